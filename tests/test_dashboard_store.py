"""The dashboard store's open of a long event log (``TelemetryStore``'s first refresh: metrics
picked out by SQLite, only the state-changing events folded, the newest of the rest by query)
gives the same state as a plain reading of the SQLite file and as folding every row one by one
(the live path). Correctness only: the speed is ``benchmarks/bench_dashboard_big_log.py``'s."""

from __future__ import annotations

import json
import math
import random
import sqlite3

import numpy as np
import pytest

import dashboard.store as S
from dashboard.store import TelemetryStore
from varuna_sdk.manager.events import EventLog, Kind

JOB = "job-a"


def write_log(log: EventLog, n_metrics: int, t0: float, first_step: int = 0) -> None:
    """A job's log as a long run writes it, plus another job's rows and awkward values."""
    rnd = random.Random(first_step)
    odd = [True, "fast", None, {"x": 1}, [1], 1e308 * 10, 7]   # 1e308 * 10: inf, stored as null
    hosts = [f"vm{i}" for i in range(4)]
    if first_step == 0:
        log.append(Kind.WORKER_JOINED, job_id=JOB, host="early", rank=0, time_s=t0)  # before any pool event
        log.append(Kind.PLAN, job_id=JOB, time_s=t0, payload={"generation": 0, "P": 2, "D": 2, "hosts": hosts})
        log.append(Kind.STRAGGLER, job_id=JOB, time_s=t0, payload={"rank": 3, "slowdown": 1.7, "action": "kept"})
        for h in hosts:
            log.append(Kind.HOST_ADDED, job_id=JOB, host=h, time_s=t0,
                       payload={"gpus": 1, "labels": {"price_per_hour": "$0.9/h", "instance_type": "g4"}})
        log.append(Kind.JOB_STATE, job_id=JOB, time_s=t0, payload={"state": "RUNNING", "previous": "PROVISIONING"})
    for i in range(n_metrics):
        s, t = first_step + i, t0 + i
        vals = {"step": s, "loss": 5.0 / (1 + s), "tokens_per_s": 900.0 + s, "examples_per_s": rnd.choice([40, 40.5]),
                "step_time_s": 0.1 + (s % 7) * 0.01, "generation": s // 400, "lr": 1e-3}
        if i % 97 == 5:
            vals[rnd.choice(["tokens_per_s", "examples_per_s", "step_time_s", "generation"])] = rnd.choice(odd)
        if i % 131 == 7:
            del vals["examples_per_s"]
        log.append_metric(s, vals, job_id=JOB, time_s=t)
        if i % 10 == 0:
            log.append_metric(s, {"step": s, "loss": 99.0}, job_id="other", time_s=t)
        for _ in range(rnd.choice([0, 0, 1, 2])):
            log.append(Kind.AUTH_FAILED, job_id=JOB, host=rnd.choice(hosts), time_s=t, payload={"peer": "10.0.0.9"})
        if i % 3 == 0:
            log.append("worker_after_loss", job_id=JOB, rank=i % 4, time_s=t)   # quiet: not in the table
        if i % 40 == 0:
            log.append(Kind.CHECKPOINT, job_id=JOB, time_s=t, payload={"step": s, "path": f"ck/{s}", "bytes": 10})
            log.append_heartbeat({"step": s, "fwd_s": 0.01, "bwd_s": 0.02, "step_time_s": 0.1}, job_id=JOB,
                                 host=hosts[i % 4], rank=i % 4, time_s=t)
        if i % 400 == 399:
            h = hosts[(i // 400) % 4]
            log.append(Kind.PREEMPTION_NOTICE, job_id=JOB, host=h, time_s=t, payload={"deadline": t + 30})
            log.append(Kind.HOST_REMOVED, job_id=JOB, host=h, time_s=t, payload={"reason": "preempted"})
            log.append(Kind.MORPH, job_id=JOB, time_s=t, payload={"cause": "notice", "from_step": s, "resume_step": s,
                                                                  "old": {"P": 2, "D": 2}, "new": {"P": 3, "D": 1}})
            log.append(Kind.PLAN, job_id=JOB, time_s=t, payload={"generation": s // 400 + 1, "P": 3, "D": 1,
                                                                 "hosts": [x for x in hosts if x != h][:3]})
            log.append(Kind.HOST_ADDED, job_id=JOB, host=h, time_s=t)
            log.append(Kind.HOST_LOST, job_id="other", host=hosts[0], time_s=t)   # another job's: ignored
        if i % 500 == 250:
            log.append(Kind.STRAGGLER, job_id=JOB, time_s=t, payload={"rank": 1, "slowdown": 2.0 + i / 1e3})
    log.append("worker_after_loss", job_id=JOB, time_s=t0 + n_metrics)  # the newest events are quiet
    log.append("worker_after_loss", job_id=JOB, time_s=t0 + n_metrics)


def plain_reading(path, job_id: str) -> dict:
    """The log read with sqlite3 and json alone: metric columns, event ids per kind, recent ids."""
    db = sqlite3.connect(path)

    def num(v):
        return float(v) if type(v) in (int, float) and math.isfinite(v) else math.nan

    rows = db.execute("SELECT time, step, loss, payload FROM metrics WHERE job_id = ? ORDER BY id", (job_id,)).fetchall()
    cols = {"time": [r[0] for r in rows], "step": [r[1] for r in rows], "loss": [num(r[2]) for r in rows]}
    for f in S.METRIC_FIELDS:
        cols[f] = [num(json.loads(r[3]).get(f)) for r in rows]
    events = db.execute("SELECT id, kind, payload FROM events WHERE job_id = ? ORDER BY id", (job_id,)).fetchall()
    db.close()
    ids = {}
    for i, kind, _ in events:
        ids.setdefault(kind, []).append(i)
    return {"metrics": {c: np.asarray(v, dtype=float) for c, v in cols.items()}, "ids": ids,
            "payload": {i: json.loads(p) for i, _, p in events},
            "recent": [i for i, kind, _ in events if kind not in S.QUIET_KINDS][-200:]}


def assert_same_state(a: TelemetryStore, b: TelemetryStore) -> None:
    """Every part of the state the views draw is equal in the two stores."""
    assert list(a.vms.items()) == list(b.vms.items())
    for attr in ("plans", "morphs", "checkpoints", "recent"):
        assert list(getattr(a, attr)) == list(getattr(b, attr)), attr
    assert a.job_state == b.job_state and a.first_event_time == b.first_event_time
    assert a.heartbeats == b.heartbeats
    assert len(a.metrics) == len(b.metrics) and a.metrics.last_id == b.metrics.last_id
    for c in S.METRIC_COLUMNS:
        np.testing.assert_array_equal(a.metrics[c], b.metrics[c], err_msg=c)


def test_open_reads_what_the_file_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "READ_BATCH", 97)   # many batches in every read
    path = tmp_path / "events.db"
    log = EventLog(path)
    live = TelemetryStore(path, job_id=JOB)   # opened on the empty log: it folds every row as it comes
    assert not live.refresh(force=True)
    write_log(log, 2500, t0=1.7e9)
    assert live.refresh(force=True)

    opened = TelemetryStore(path, job_id=JOB)
    assert opened.refresh(force=True)
    plain = plain_reading(path, JOB)
    # the metrics, column by column (NaN where the payload has no number), as the file holds them
    m = plain["metrics"]
    assert len(opened.metrics) == len(m["step"]) == 2500
    for c in S.METRIC_COLUMNS:
        np.testing.assert_array_equal(opened.metrics[c], m[c], err_msg=c)
    assert opened.metrics["step"][-1] == 2499 and opened.metrics["loss"][-1] == pytest.approx(5.0 / 2500)
    assert np.isnan(opened.metrics["examples_per_s"]).sum() > 10   # awkward values did occur
    # the events: morph rows, checkpoints, plans, job state, the recent table (quiet kinds left out)
    ids = plain["ids"]
    assert [e.id for e in opened.morphs] == ids[Kind.MORPH] and len(ids[Kind.MORPH]) == 6
    assert [e.payload for e in opened.morphs] == [plain["payload"][i] for i in ids[Kind.MORPH]]
    assert [e.id for e in opened.checkpoints] == ids[Kind.CHECKPOINT]
    assert [e.id for e in opened.plans] == ids[Kind.PLAN] and opened.plan == plain["payload"][ids[Kind.PLAN][-1]]
    assert opened.job_state.id == ids[Kind.JOB_STATE][-1]
    assert [e.id for e in opened.recent] == plain["recent"]
    assert opened.vm_counts()["up"] == 5 and opened.vm_counts()["stragglers"] >= 1  # 4 VMs + "early"
    assert_same_state(opened, live)

    # after the open, new rows are folded one by one, as in the store that read everything live
    write_log(log, 300, t0=1.7e9 + 2500, first_step=2500)
    assert opened.refresh(force=True) and live.refresh(force=True)
    assert_same_state(opened, live)
    assert opened.metrics["step"][-1] == 2799
    log.close()
    opened.close()
    live.close()


def test_open_keeps_only_the_newest_events(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "MAX_KEPT_EVENTS", 20)
    path = tmp_path / "events.db"
    with EventLog(path) as log:
        write_log(log, 1000, t0=1.7e9)
    store = TelemetryStore(path, job_id=JOB)
    store.refresh(force=True)
    ids = plain_reading(path, JOB)["ids"]
    assert [e.id for e in store.checkpoints] == ids[Kind.CHECKPOINT][-20:]
    assert len(store.morphs) == 2   # fewer than kept: all
    store.close()
