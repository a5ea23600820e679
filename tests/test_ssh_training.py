"""End to end over SSH: a P=2 x D=2 tiny GPT-2 job on 4 sshd test hosts ("VMs"), bootstrapped
(versions, code + config synced by hash), started with ``cluster.remote.launch`` running the
worker entry point with the venv's Python, heartbeats flowing to a ``HeartbeatServer`` in this
process — the losses match ``train_local`` of the same job; and a non-rank-0 VM removed in the
middle of training is detected within 2 heartbeat intervals, after which the job is stopped and
no worker or sshd process is left."""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
import time
from pathlib import Path

import pytest

from ssh_hosts import _is_zombie, skip_reason, worker_processes, procs_mentioning
from varuna_sdk.cluster.bootstrap import bootstrap
from varuna_sdk.cluster.hosts import Secret
from varuna_sdk.cluster.local import free_port
from varuna_sdk.cluster.remote import WorkerSpec, launch
from varuna_sdk.cluster.ssh import SSHPool
from varuna_sdk.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.data.loader import default_cache_dir, tokenize_corpus
from varuna_sdk.launch import train_local
from varuna_sdk.manager.events import EventLog, Kind
from varuna_sdk.manager.heartbeat import HeartbeatServer

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

ENTRY = "varuna_sdk.manager.heartbeat_worker"  # = varuna_sdk.worker + heartbeat client


def tiny_job(tmp_path: Path, steps: int) -> JobConfig:
    """tests/test_launch.py's tiny job at P=2 x D=2 (3-layer tiny GPT-2, bytes, seq 32, batch 8)."""
    return JobConfig(
        name="tiny-ssh",
        model=ModelConfig(preset="tiny", n_layer=3),
        data=DataConfig(tokenizer="byte", seq_len=32),
        parallel=ParallelConfig(P=2, D=2, global_batch=8, micro_batch_size=2),
        train=TrainConfig(steps=steps, lr=3e-3, warmup_steps=2, eval_batches=2,
                          run_dir=str(tmp_path / "runs")),
    )


class Lines:
    def __init__(self):
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, stream, worker, line):
        with self.lock:
            self.lines.append(line)

    def tail(self, n: int = 60) -> str:
        with self.lock:
            return "\n".join(self.lines[-n:])


class SSHJob:
    """What the manager will do, spelled out: bootstrap, heartbeat server, launch."""

    def __init__(self, ssh_hosts, hosts, tmp_path: Path, job: JobConfig, interval_s: float,
                 command=None, extra_files: dict[str, str] | None = None):
        self.hosts, self.job = hosts, job
        code = tmp_path / "code"
        code.mkdir()
        job.to_yaml(code / "config.yaml")
        for name, text in (extra_files or {}).items():
            (code / name).parent.mkdir(parents=True, exist_ok=True)
            (code / name).write_text(text)
        command = command or (lambda h, run_dir: [h.python, "-m", ENTRY, "config.yaml", run_dir])
        self.pool = SSHPool(ssh_hosts.options(kill_grace_s=1.0))
        t0 = time.monotonic()
        self.boot = bootstrap(self.pool, hosts, code_dir=code)
        self.t_boot = time.monotonic() - t0
        self.job_id = f"tiny-{secrets.token_hex(3)}"
        self.token = Secret(secrets.token_urlsafe(24))
        self.events = EventLog(tmp_path / "events.db")
        self.server = HeartbeatServer(self.job_id, self.token, self.events,
                                      interval_s=interval_s).start()
        self.sink = Lines()
        code_dir = {h.name: self.boot.sync[h.name].remote_dir for h in hosts}
        self.run_dir = {h.name: f"{h.workdir}/run" for h in hosts}
        specs = [WorkerSpec(h, r, command(h, self.run_dir[h.name]), cwd=code_dir[h.name])
                 for r, h in enumerate(hosts)]
        for r, h in enumerate(hosts):
            self.server.expect(h.name, r, within_s=60)
        master = hosts[0].address
        t0 = time.monotonic()
        self.remote = launch(specs, pool=self.pool, master_addr=master,
                             master_port=free_port(master), job_id=self.job_id, token=self.token,
                             env={**self.server.worker_env(),
                                  "VARUNA_SDK_CACHE_DIR": str(default_cache_dir())},
                             sink=self.sink)
        self.t_launch = time.monotonic() - t0

    def close(self) -> None:
        self.server.stop_expecting()
        if not self.remote.done():
            self.remote.stop()
        self.server.close()
        self.pool.close()
        self.events.close()






@pytest.mark.timeout(420)
def test_p2_d2_over_ssh_matches_local_losses(ssh_hosts, tmp_path):
    hosts = [ssh_hosts.add() for _ in range(4)]
    job = tiny_job(tmp_path, steps=5)
    tokenize_corpus(job.data.corpus, job.data.tokenizer)  # cache shared by the "VMs"
    t0, wall0 = time.monotonic(), time.time()
    run = SSHJob(ssh_hosts, hosts, tmp_path, job, interval_s=1.0)
    try:
        assert run.boot.sync["vm3"].files_sent == 1  # config.yaml
        joined = run.server.wait_heartbeats(4, timeout_s=120)
        assert joined, run.sink.tail()
        codes = run.remote.wait(timeout_s=240)
        t_total = time.monotonic() - t0
        assert codes == {0: 0, 1: 0, 2: 0, 3: 0}, run.sink.tail()
        time.sleep(0.3)
        finished = run.events.events(kind=Kind.WORKER_FINISHED)
        assert sorted(e.rank for e in finished) == [0, 1, 2, 3], run.events.events()
        assert not run.events.events(kind=Kind.HOST_LOST)
        assert not run.events.events(kind=Kind.AUTH_FAILED)
        beats = run.events.heartbeats(job_id=run.job_id)
        assert {b.rank for b in beats} == {0, 1, 2, 3}
        stepped = [b for b in beats if b.step is not None]
        assert {b.rank for b in stepped} == {0, 1, 2, 3}  # the first step is reported at once
        assert all(b.fwd_s > 0 and b.bwd_s > 0 and b.mem_bytes > 0 for b in stepped)
        # rank 0 writes metrics.jsonl on its VM: fetch it like a remote user would
        local_metrics = tmp_path / "ssh-metrics.jsonl"
        run.pool.get(hosts[0]).get(f"{run.run_dir['vm0']}/metrics.jsonl", local_metrics)
    finally:
        run.close()
    ssh_rows = [json.loads(x) for x in local_metrics.read_text().splitlines() if x.strip()]
    assert [r["step"] for r in ssh_rows] == list(range(5))
    t_first = ssh_rows[0]["wall_time"] - wall0
    for b in stepped:  # heartbeat losses are the training losses
        assert b.loss == pytest.approx(ssh_rows[b.step]["loss"], rel=1e-6)
    assert "[vm0 rank 0] step    5/5" in "\n".join(run.sink.lines)
    assert run.token.reveal() not in "\n".join(run.sink.lines)
    db = b"".join(f.read_bytes() for f in tmp_path.glob("events.db*"))
    assert run.token.reveal().encode() not in db and b"VARUNA_JOB_TOKEN" not in db

    t1 = time.monotonic()
    ref = train_local(tiny_job(tmp_path, steps=5), run_dir=tmp_path / "local")
    t_local = time.monotonic() - t1
    ref_losses = [r["loss"] for r in ref.metrics()]
    ssh_losses = [r["loss"] for r in ssh_rows]
    for a, b in zip(ssh_losses, ref_losses):
        assert math.isclose(a, b, rel_tol=1e-5), (ssh_losses, ref_losses)
    assert not worker_processes(ssh_hosts, hosts)
    print(f"\nP=2 x D=2 over SSH on 4 VMs: bootstrap {run.t_boot:.2f}s, launch {run.t_launch:.2f}s, "
          f"first step done {t_first:.1f}s, 5 steps done {t_total:.1f}s "
          f"(train_local: {t_local:.1f}s); losses {['%.5f' % x for x in ssh_losses]} "
          f"max rel diff {max(abs(a - b) / abs(b) for a, b in zip(ssh_losses, ref_losses)):.1e}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["removed", "frozen"])
def test_vm_lost_mid_training_is_detected_and_job_stopped(ssh_hosts, tmp_path, how):
    """``removed``: the VM is pre-empted (its sshd and every process on it killed: sockets close).
    ``frozen``: the VM hangs (everything on it stops, sockets stay open, nothing is sent — what a
    network cut looks like to the manager), so only the heartbeat timeout can tell."""
    interval = 1.0
    hosts = [ssh_hosts.add() for _ in range(4)]
    job = tiny_job(tmp_path, steps=5000)
    tokenize_corpus(job.data.corpus, job.data.tokenizer)
    run = SSHJob(ssh_hosts, hosts, tmp_path, job, interval_s=interval)
    victim = hosts[3]  # rank 3: stage 1 of replica 1, not rank 0
    sshd_pids = {h.name: ssh_hosts.pids(h) for h in hosts}
    try:
        assert run.server.wait_heartbeats(4, timeout_s=150, min_step=2), run.sink.tail()
        assert not run.remote.done(), run.sink.tail()
        t0 = time.monotonic()
        if how == "removed":
            killed = len(ssh_hosts.remove(victim))  # its sshd and every process it started
        else:
            ssh_hosts.freeze(victim)
            killed = 0
        t_act = time.monotonic() - t0
        ev = run.server.wait_for(Kind.HOST_LOST, timeout_s=10 * interval)
        latency = time.monotonic() - t0
        assert ev is not None, run.events.events()
        assert ev.host == victim.name and ev.payload["ranks"] == [3], ev
        if how == "removed":
            assert ev.payload["reason"] == "connection_closed"
            assert latency < 2 * interval, latency
        else:
            assert ev.payload["reason"] == "heartbeat_timeout"
            assert latency <= 2 * interval + 0.1, latency
        # the job reacts: stop every worker on the VMs still there (the lost one is skipped)
        run.server.stop_expecting()
        t1 = time.monotonic()
        assert run.remote.stop(grace_s=1.0, gone={ev.host}) is True
        t_stop = time.monotonic() - t1
        if how == "frozen":
            ssh_hosts.remove(victim)  # the provider gives the hung VM back
        lost = EventLog.reader(run.events.path).events(kind=Kind.HOST_LOST)
        assert [e.host for e in lost] == ["vm3"]  # reported in the event log, once
    finally:
        run.close()
    survivors = [h for h in hosts if h.name != victim.name]
    assert not worker_processes(ssh_hosts, survivors)
    assert not procs_mentioning(ENTRY)
    ssh_hosts.close()
    left = [p for pids in sshd_pids.values() for p in pids
            if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
    assert not left
    print(f"\nVM {how} at step {ev.payload['last_step']}: host_lost after {latency:.3f}s "
          f"(reason {ev.payload['reason']}, interval {interval}s; {how} in {t_act:.3f}s, "
          f"{killed} processes killed); job stopped in {t_stop:.2f}s")
