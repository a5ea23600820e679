"""Remote workers (``varuna_sdk.cluster.remote``) on real sshd test hosts: a gloo all-reduce
between two "VMs", output streamed back prefixed by VM and rank, a crash's traceback reaching the
caller, and ``stop()`` leaving no process on any host."""

from __future__ import annotations

import logging
import textwrap
import time

import pytest

from ssh_hosts import Lines, skip_reason, worker_processes
from varuna_sdk.cluster.hosts import Secret
from varuna_sdk.pipeline.spawn import free_port
from varuna_sdk.cluster.remote import RemoteWorkerFailure, WorkerSpec, start_workers
from varuna_sdk.cluster.ssh import SSHPool

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")



ALL_REDUCE = textwrap.dedent("""
    import datetime, os, socket
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    dist.all_reduce(t)
    print(f"rank={rank} world={dist.get_world_size()} sum={t.tolist()} "
          f"host={os.environ['VARUNA_HOST']} job={os.environ['VARUNA_JOB_ID']} "
          f"master={os.environ['MASTER_ADDR']} token_len={len(os.environ['VARUNA_JOB_TOKEN'])}",
          flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(150)
def test_two_workers_all_reduce_over_ssh(ssh_hosts, caplog):
    caplog.set_level(logging.DEBUG)
    hosts = [ssh_hosts.add(), ssh_hosts.add()]
    master = hosts[0].address
    token = Secret("tok-" + "x7" * 12)
    sink = Lines()
    t0 = time.monotonic()
    with SSHPool(ssh_hosts.options()) as pool:
        specs = [WorkerSpec(h, r, [h.python, "-c", ALL_REDUCE]) for r, h in enumerate(hosts)]
        job = start_workers(specs, pool=pool, master_addr=master, master_port=free_port(master),
                            job_id="job-ar", token=token, sink=sink)
        started = time.monotonic() - t0
        codes = job.wait(timeout_s=120)
    took = time.monotonic() - t0
    assert codes == {0: 0, 1: 0}, sink.text()
    out = sink.text("stdout")
    for r, h in enumerate(hosts):
        assert (f"[{h.name} rank {r}] rank={r} world=2 sum=[3.0, 30.0] host={h.name} job=job-ar "
                f"master={master} token_len={len(token.reveal())}") in out, sink.text()
    assert token.reveal() not in caplog.text and token.reveal() not in sink.text()
    assert not worker_processes(ssh_hosts, hosts)
    print(f"2-host gloo all_reduce over SSH: started in {started:.2f}s, done in {took:.1f}s")


CHILDREN = textwrap.dedent("""
    import os, subprocess, sys, time
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(f"ready {os.environ['RANK']} child={kid.pid}", flush=True)
    time.sleep(120)
""")


@pytest.mark.timeout(60)
def test_stop_leaves_no_process_behind(ssh_hosts):
    hosts = [ssh_hosts.add(), ssh_hosts.add()]
    sink = Lines()
    with SSHPool(ssh_hosts.options(kill_grace_s=0.5)) as pool:
        specs = [WorkerSpec(h, r, [h.python, "-c", CHILDREN]) for r, h in enumerate(hosts)]
        job = start_workers(specs, pool=pool, master_addr=hosts[0].address, master_port=1, sink=sink)
        assert sink.wait_for("ready", 2), sink.text()
        before = worker_processes(ssh_hosts, hosts)
        assert sum(c == "python" for _, c in before) == 4, before  # worker + child, per host
        t0 = time.monotonic()
        assert job.stop() is True
        took = time.monotonic() - t0
        assert job.done() and all(w.process.killed for w in job.workers)
    assert not worker_processes(ssh_hosts, hosts)
    assert "[vm0 rank 0] ready 0" in sink.text() and "[vm1 rank 1] ready 1" in sink.text()
    print(f"stop(): 2 workers and their children gone in {took * 1e3:.0f} ms")


CRASH = textwrap.dedent("""
    import os, time
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        def inner():
            raise ValueError("boom at rank 1")
        inner()
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_worker_crash_reaches_the_user_and_stops_the_rest(ssh_hosts):
    hosts = [ssh_hosts.add(), ssh_hosts.add()]
    sink = Lines()
    with SSHPool(ssh_hosts.options(kill_grace_s=0.5)) as pool:
        specs = [WorkerSpec(h, r, [h.python, "-c", CRASH]) for r, h in enumerate(hosts)]
        job = start_workers(specs, pool=pool, master_addr=hosts[0].address, master_port=1, sink=sink)
        t0 = time.monotonic()
        with pytest.raises(RemoteWorkerFailure,
                           match=r"worker \[vm1 rank 1\] exited with 1: ValueError: boom at rank 1") as e:
            job.wait(timeout_s=30)
        assert time.monotonic() - t0 < 10
    err = sink.text("stderr")
    assert "[vm1 rank 1] Traceback (most recent call last):" in err
    assert "[vm1 rank 1] ValueError: boom at rank 1" in err
    assert e.value.failures[1][0] == "vm1" and "in inner" in e.value.failures[1][2]
    assert not worker_processes(ssh_hosts, hosts)  # rank 0 was stopped


@pytest.mark.timeout(30)
def test_launch_checks_ranks_and_a_missing_workdir_fails_clearly(ssh_hosts):
    h = ssh_hosts.add()
    with SSHPool(ssh_hosts.options()) as pool:
        with pytest.raises(ValueError, match="ranks must be 0..1"):
            start_workers([WorkerSpec(h, 0, ["true"]), WorkerSpec(h, 0, ["true"])], pool=pool,
                          master_addr=h.address, master_port=1, sink=None)
        job = start_workers([WorkerSpec(h, 0, ["true"], cwd="/nonexistent/dir")], pool=pool,
                            master_addr=h.address, master_port=1, sink=None)
        with pytest.raises(RemoteWorkerFailure, match=r"\[vm0 rank 0\] exited with 97: .*nonexistent"):
            job.wait(timeout_s=10)
