"""The run's zygote (``cluster.zygote``): local workers forked from one process that imported torch
once. Real processes, a real socket pair: a forked process sees exactly the environment, working
folder and ``sys.path`` a fresh ``python -m`` would, leads its own session, reads ``/dev/null``,
writes to the pipes it was given and ends with its own exit code (or the signal's); a zygote that
dies leaves its workers' codes unknown (-1) and the next worker starts as a plain subprocess; a
real worker command is forked by the run's zygote and named on its command line (what ``ps``, the
orphan check and these tests look for)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ssh_hosts import procs_mentioning
from varuna_sdk.cluster.zygote import ZygoteClient, ZygoteError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote forks: Linux only")

PROBE = str(Path(__file__).with_name("_zygote_probe.py"))


def _fork(z: ZygoteClient, args, env, cwd):
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    try:
        child = z.fork(args, env, cwd, w_out, w_err)
    finally:
        os.close(w_out)
        os.close(w_err)
    return child, open(r_out, "rb"), open(r_err, "rb")


@pytest.mark.timeout(120)
def test_a_forked_process_is_what_a_fresh_one_would_be_and_ends_with_its_own_code(tmp_path):
    z = ZygoteClient(sys.executable, str(tmp_path), env={**os.environ, "ZYGOTE_ONLY": "1"},
                     serve_args=(PROBE,))
    try:
        work = tmp_path / "work"
        work.mkdir()
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"/nonexistent/a{os.pathsep}/nonexistent/b",
               "SECRET_TOKEN": "s3cr3t"}
        child, out, err = _fork(z, ["3", "0"], env, str(work))
        assert child.wait(30) == 3
        seen = json.loads(out.readline())
        assert "to stderr" in err.read().decode()
        assert seen["env"] == env                     # exactly what was sent: not the zygote's ZYGOTE_ONLY
        assert seen["cwd"] == str(work) and seen["path"] == [str(work), "/nonexistent/a", "/nonexistent/b"]
        assert seen["sid"] == seen["pid"] == child.pid and seen["ppid"] == z._proc.pid   # its own session
        assert seen["stdin"] == "/dev/null" and seen["argv"] == ["3", "0"]
        assert "s3cr3t" not in Path(f"/proc/{z._proc.pid}/cmdline").read_text()      # never on a command line
        # killed as a session, as the launcher kills a worker: the signal's code
        child, out, err = _fork(z, ["0", "60"], env, str(work))
        json.loads(out.readline())
        os.killpg(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        z.close()
    assert z._proc.poll() is not None


@pytest.mark.timeout(120)
def test_a_zygote_that_dies_leaves_its_workers_codes_unknown_and_refuses_forks(tmp_path):
    z = ZygoteClient(sys.executable, str(tmp_path), serve_args=(PROBE,))
    child, out, _ = _fork(z, ["0", "60"], dict(os.environ), str(tmp_path))
    json.loads(out.readline())
    os.kill(z._proc.pid, signal.SIGKILL)
    z._proc.wait(10)
    assert child.wait(1) is None                      # the worker runs on without its zygote
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(30) == -1                       # gone; its code not known
    with pytest.raises(ZygoteError, match="zygote of .* (was not ready|could not be asked|did not answer)"):
        _fork(z, ["0", "0"], dict(os.environ), str(tmp_path))
    z.close()


@pytest.mark.timeout(180)
def test_a_local_worker_is_forked_by_its_runs_zygote_and_named_on_its_command_line(tmp_path):
    """``start_local`` of a worker command: a training worker is forked by the run's zygote (its
    parent), its command line names ``varuna_sdk.worker`` and the run folder, and it is killed as a
    session; a worker that fails (a config that is not there) says so on its stderr and exits 1;
    ``close_zygotes`` ends the zygote; with ``VARUNA_SDK_START_METHOD=spawn`` the worker is a plain
    subprocess of this process."""
    from varuna_sdk.cluster.localproc import START_METHOD_ENV, _zygotes, close_zygotes, local_host, start_local
    from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig, TrainConfig
    from varuna_sdk.pipeline.spawn import free_port

    run = tmp_path / "run"
    run.mkdir()
    cfg = run / "config.yaml"
    JobConfig(name="zyg", model=ModelConfig(preset="tiny", n_layer=2), data=DataConfig(tokenizer="byte", seq_len=16),
              parallel=ParallelConfig(P=1, D=1, global_batch=4, micro_batch_size=2),
              train=TrainConfig(steps=100000, lr=1e-3, eval_batches=1, checkpoint_every=0),
              launch=LaunchConfig(gpus=1)).to_yaml(cfg)

    def env() -> dict:
        return {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    def training(argv) -> tuple:
        out: list[str] = []
        p = start_local(local_host(0), argv, env=env(), on_stdout=out.append)
        deadline = time.time() + 120
        while not any("step" in line for line in out):   # alive and training: its process is there to see
            assert p.poll() is None and time.time() < deadline, out
            time.sleep(0.1)
        return p, parent(p.pid)

    argv = [sys.executable, "-m", "varuna_sdk.worker", str(cfg), str(run)]
    try:
        p, ppid = training(argv)
        zygote = _zygotes[(sys.executable, str(run.resolve()))]
        assert ppid == zygote._proc.pid
        assert p.pid in procs_mentioning(str(run)) and p.pid in procs_mentioning("varuna_sdk.worker")
        assert p.kill(grace_s=0.5) and p.wait(30) is not None and p.exit_code < 0
        lines: list[str] = []
        bad = start_local(local_host(0), [*argv[:3], str(tmp_path / "missing.yaml"), str(run)], env=env(),
                          on_stderr=lines.append)
        assert bad.wait(60) == 1 and any("missing.yaml" in line for line in lines), lines
    finally:
        close_zygotes(run)
    assert zygote._proc.poll() is not None and not procs_mentioning(str(run))
    os.environ[START_METHOD_ENV] = "spawn"
    try:
        p, ppid = training(argv)
        assert ppid == os.getpid() and (sys.executable, str(run.resolve())) not in _zygotes
        assert p.kill(grace_s=0.5)
    finally:
        os.environ.pop(START_METHOD_ENV)
    deadline = time.time() + 10
    while procs_mentioning(str(run)) and time.time() < deadline:
        time.sleep(0.1)
    assert not procs_mentioning(str(run))
