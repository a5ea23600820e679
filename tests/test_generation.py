"""``manager.generation.Generation`` on local hosts (workers as local subprocesses, the embedded
default): a P=2 x D=2 tiny GPT-2 job completes with every step's metrics in the event log; the
heartbeat channel's stop command stops it at a mini-batch boundary; a worker that raises ends the
generation "failed" with its traceback prefixed by VM and rank; a local slot pre-empted by the
spot emulator ends it "lost" within 2 heartbeat intervals. Every test checks that no worker
process is left. Placement and argument checks need no process."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from varuna_sdk.cluster.hosts import Host
from varuna_sdk.cluster.localproc import local_host, local_processes
from varuna_sdk.cluster.provider import LocalProvider
from varuna_sdk.cluster.spot import SpotEmulator
from ssh_hosts import Lines, _is_zombie
from varuna_sdk.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.data.loader import tokenize_corpus
from varuna_sdk.manager.events import EventLog, Kind
from varuna_sdk.manager.generation import Generation, place

HB_S = 1.0  # heartbeat interval (s)


def tiny_job(tmp_path: Path, steps: int, P: int = 2, D: int = 2) -> JobConfig:
    return JobConfig(name="tiny-gen", model=ModelConfig(preset="tiny", n_layer=3),
                     data=DataConfig(tokenizer="byte", seq_len=32),
                     parallel=ParallelConfig(P=P, D=D, global_batch=8, micro_batch_size=2),
                     train=TrainConfig(steps=steps, lr=3e-3, warmup_steps=2, eval_batches=2,
                                       run_dir=str(tmp_path / "runs")))



def _gen(tmp_path, job, hosts, **kw):
    tokenize_corpus(job.data.corpus, job.data.tokenizer)
    events = EventLog(tmp_path / "events.db")
    sink = Lines()
    g = Generation(job, hosts, tmp_path / "run", events=events, job_id="gen-test",
                   heartbeat_interval_s=HB_S, sink=sink, kill_grace_s=1.0, **kw)
    return g, events, sink


def _no_workers_left(hosts) -> bool:
    return not any(local_processes(h.name) for h in hosts)


# ----------------------------------------------------------------------------------- no processes
def test_placement_fills_gpu_hosts_with_consecutive_ranks():
    a = Host(name="a", address="10.0.0.1", gpus=2)
    b = Host(name="b", address="10.0.0.2")
    c = Host(name="c", address="10.0.0.3", gpus=4)
    got = [(h.name, k) for h, k in place([a, b, c], 5)]
    assert got == [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1)]
    assert [(h.name, k) for h, k in place([b, a], 3, cpu_slots=2)] == [("b", 0), ("b", 1), ("a", 0)]
    with pytest.raises(ValueError, match=r"need 8 slots but the hosts offer 7 \(a: 2, b: 1, c: 4\)"):
        place([a, b, c], 8)
    with pytest.raises(ValueError, match="unique"):
        place([a, a], 1)


def test_generation_checks_its_arguments_before_starting(tmp_path):
    job = tiny_job(tmp_path, 5)
    job.parallel.P = None
    with pytest.raises(ValueError, match="P and D must be chosen"):
        Generation(job, [local_host(0)], tmp_path, events=EventLog(tmp_path / "e.db"), job_id="x")
    with pytest.raises(ValueError, match="need 4 slots but the hosts offer 2"):
        Generation(tiny_job(tmp_path, 5), [local_host(0), local_host(1)], tmp_path,
                   events=EventLog(tmp_path / "e.db"), job_id="x")
    g = Generation(tiny_job(tmp_path, 5, P=1, D=1), [local_host(0), local_host(1)], tmp_path,
                   events=EventLog(tmp_path / "e.db"), job_id="x")
    assert g.rank_hosts == ["local0"] and [h.name for h in g.unused_hosts] == ["local1"]


# ------------------------------------------------------------------------------------ processes
@pytest.mark.timeout(240)
def test_local_generation_completes_and_every_step_reaches_the_metrics_table(tmp_path):
    with LocalProvider(4) as provider:
        hosts = provider.acquire(4)
        g, events, sink = _gen(tmp_path, tiny_job(tmp_path, steps=6), hosts)
        t0 = time.monotonic()
        g.start()
        assert g.wait(timeout_s=0) is None  # running
        res = g.wait(timeout_s=200)
        took = time.monotonic() - t0
        assert res.status == "completed", (res, sink.text()[-3000:])
        assert res.exit_codes == {0: 0, 1: 0, 2: 0, 3: 0} and res.last_step == 5 and not res.lost_hosts
        deadline = time.monotonic() + 5.0   # each exit reaches the server from its launcher thread
        while True:
            beats = g.heartbeats()
            if all(s.status == "exited" for s in beats.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert sorted(beats) == [("local0", 0), ("local1", 1), ("local2", 2), ("local3", 3)]
        assert all(s.status == "exited" and s.heartbeats >= 1 for s in beats.values()), \
            {k: (s.status, s.heartbeats) for k, s in beats.items()}  # bye, then exit 0
        assert g.wait(timeout_s=0) is res  # the result stays
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    table = events.metrics(job_id="gen-test")
    assert [m["step"] for m in table] == [r["step"] for r in rows] == list(range(6))
    for m, r in zip(table, rows):  # the table holds rank 0's metrics.jsonl lines, exactly
        assert {k: m[k] for k in r} == r
    kinds = [e.kind for e in events.events(job_id="gen-test")]
    assert kinds[:2] == [Kind.HEARTBEAT_SERVER_STARTED, "generation_started"]
    assert kinds.count(Kind.WORKER_FINISHED) == 4 and kinds[-1] == "generation_ended"
    started = events.events(kind="generation_started")[0].payload
    assert started["hosts"] == ["local0", "local1", "local2", "local3"] and started["P"] == 2
    log = (tmp_path / "run" / "gen0" / "workers.log").read_text()
    assert "[local0 rank 0] step    6/6" in log and "[local3 rank 3] [rank 3] rank 3: stage 1/2 replica 1/2" in log
    assert "[local0 rank 0] step    6/6" in sink.text()
    assert g.token.reveal() not in log
    assert _no_workers_left(hosts)
    print(f"\nlocal P=2 x D=2 generation: 6 steps in {took:.1f}s, {len(table)} metrics rows recorded")


@pytest.mark.timeout(240)
def test_request_stop_ends_the_generation_at_a_mini_batch_boundary(tmp_path):
    hosts = [local_host(i) for i in range(4)]
    g, events, sink = _gen(tmp_path, tiny_job(tmp_path, steps=5000), hosts)
    try:
        g.start()
        assert g.server.wait_metrics(None, timeout_s=150), sink.text()[-3000:]
        time.sleep(0.5)
        asked_at = g.server.last_metric_step
        t0 = time.monotonic()
        g.request_stop("notice")
        res = g.wait(timeout_s=60)
        took = time.monotonic() - t0
    finally:
        g.close()
    assert res.status == "stopped" and res.stop_reason == "notice", (res, sink.text()[-3000:])
    assert res.exit_codes == {0: 0, 1: 0, 2: 0, 3: 0}
    assert asked_at <= res.last_step < 5000 - 1
    fin = events.events(kind=Kind.WORKER_FINISHED)
    assert sorted(e.rank for e in fin) == [0, 1, 2, 3] and {e.payload["status"] for e in fin} == {"stopped"}
    outcome = json.loads((tmp_path / "run" / "outcome.json").read_text())
    assert outcome["status"] == "stopped" and outcome["step"] == res.last_step + 1
    steps = [m["step"] for m in events.metrics(job_id="gen-test")]
    assert steps == list(range(res.last_step + 1))  # every step up to the boundary, none after
    assert _no_workers_left(hosts)
    print(f"\nstop command: generation stopped after step {res.last_step} (asked after step "
          f"{asked_at}), {took:.2f}s from request_stop to all workers gone")


CRASH = textwrap.dedent("""
    import os
    if os.environ.get("RANK") == "1":
        import varuna_sdk.trainer as trainer
        _run = trainer.run_worker

        def run_worker(*args, on_step=None, **kwargs):
            def step(s, r, metrics):
                if s == 2:
                    def inner():
                        raise ValueError("boom at rank 1")
                    inner()
                if on_step is not None:
                    on_step(s, r, metrics)
            return _run(*args, on_step=step, **kwargs)

        trainer.run_worker = run_worker
""")


@pytest.mark.timeout(240)
def test_crashing_worker_fails_the_generation_with_its_traceback(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(CRASH)  # rank 1 raises at its third step
    hosts = [local_host(i) for i in range(4)]
    g, events, sink = _gen(tmp_path, tiny_job(tmp_path, steps=5000), hosts,
                           env={"PYTHONPATH": str(hooks)})
    try:
        g.start()
        res = g.wait(timeout_s=200)
    finally:
        g.close()
    assert res.status == "failed", (res, sink.text()[-3000:])
    assert not res.lost_hosts
    lines = res.failure.splitlines()  # (torch.distributed adds its own "[rank1]: " after ours)
    assert all(x.startswith("[local1 rank 1] ") for x in lines), res.failure
    assert "Traceback (most recent call last):" in lines[0], res.failure
    assert any(x.endswith('raise ValueError("boom at rank 1")') for x in lines)
    assert lines[-1].endswith("ValueError: boom at rank 1")
    assert res.exit_codes[1] in (1, -15)  # it may still be exiting when the rest are stopped
    bad = events.events(kind=Kind.WORKER_FAILED)   # (a peer's failure may be told first: its collective broke)
    first = next(e for e in bad if e.payload.get("cause") != "peer")
    assert first.rank == 1 and first.payload["error"] == "ValueError: boom at rank 1", [e.payload for e in bad]
    assert events.events(kind="generation_ended")[-1].payload["status"] == "failed"
    assert _no_workers_left(hosts)


@pytest.mark.timeout(240)
def test_preempted_local_slot_is_lost_within_two_intervals(tmp_path):
    """The spot emulator (local slots) pre-empts local2 without notice: every worker process of
    that slot is killed; the generation reports it lost within 2 intervals and stops the rest."""
    with SpotEmulator(capacity=4, backend="local", notice_s=None,
                      event_log=EventLog(tmp_path / "pool.db"), job_id="gen-test") as spot:
        hosts = spot.acquire(4)
        g, events, sink = _gen(tmp_path, tiny_job(tmp_path, steps=5000), hosts)
        lost = []
        g.subscribe(lambda e: lost.append((time.monotonic(), e)) if e.kind == Kind.HOST_LOST else None)
        try:
            g.start()
            assert g.server.wait_heartbeats(4, timeout_s=150, min_step=1), sink.text()[-3000:]
            victim = local_processes("local2")
            pids = [p for proc in victim for p in proc.pids()]
            t0 = time.monotonic()
            spot.remove_now("local2")
            res = g.wait(timeout_s=10 * HB_S)
        finally:
            g.close()
        (t_ev, ev), = lost
        latency = t_ev - t0
        assert res.status == "lost" and list(res.lost_hosts) == ["local2"], res
        assert ev.payload["ranks"] == [2] and latency < 2 * HB_S, (ev, latency)
        assert pids and all(_is_zombie(p) for p in pids)  # every process of the slot is dead
        assert "local2" not in [h.name for h in spot.hosts()]
        removed = EventLog.reader(tmp_path / "pool.db").events(kind=Kind.HOST_REMOVED)
        assert [e.host for e in removed] == ["local2"]
        assert _no_workers_left(hosts)
    print(f"\nlocal slot pre-empted: host_lost after {latency:.3f}s ({ev.payload['reason']})")


@pytest.mark.timeout(240)
def test_orphaned_workers_stop_by_themselves_when_the_manager_dies(tmp_path):
    """The manager's heartbeat server disappears mid-training (its process died): after
    ``orphan_after_s`` every worker agrees to stop at a mini-batch boundary, checkpoints and
    exits 0; a restarted manager's ``wait_for_orphans`` sees them gone."""
    from varuna_sdk.manager.orphans import wait_for_orphans

    hosts = [local_host(i) for i in range(4)]
    g, events, sink = _gen(tmp_path, tiny_job(tmp_path, steps=5000), hosts, orphan_after_s=3.0)
    try:
        g.start()
        assert g.server.wait_heartbeats(4, timeout_s=150, min_step=1), sink.text()[-3000:]
        g.server.close()  # the manager is gone; nobody stops the workers
        t0 = time.monotonic()
        found = wait_for_orphans(events, "gen-test", timeout_s=60)
        took = time.monotonic() - t0
        assert found["generation"] == 0 and len(found["local_pids"]) == 4 and found["left"] == []
        assert 3.0 <= took < 30, took
        assert all(w.process.wait(10) == 0 for w in g.remote.workers)  # stopped cleanly, not killed
    finally:
        g.close()
    outcome = json.loads((tmp_path / "run" / "outcome.json").read_text())
    assert outcome["status"] == "stopped" and outcome["checkpoint"]
    assert events.events(kind="orphans")[-1].payload["left"] == []
    # (its goodbyes never arrived: this Generation, standing in for the dead manager, cannot
    # tell "stopped" from "completed"; the workers' outcome.json can)
    assert events.events(kind="generation_ended")[-1].payload["status"] in ("stopped", "completed")
    assert not events.events(kind=Kind.HOST_LOST)  # exit code 0 is never a lost VM
    assert wait_for_orphans(events, "gen-test", timeout_s=1)["generation"] is None  # it ended
    print(f"\norphans stopped by themselves {took:.1f}s after the manager vanished (after {outcome['step']} steps)")
