"""The job's event log (``varuna_sdk.manager.events``): SQLite in WAL mode, append + query, one
writer with readers in other processes polling at the same time."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from varuna_sdk.manager.events import EventLog, Kind


def test_append_and_query(tmp_path):
    path = tmp_path / "job" / "events.db"
    with EventLog(path) as log:
        a = log.append(Kind.JOB_STARTED, job_id="j1", payload={"P": 2, "D": 2})
        b = log.append(Kind.HOST_LOST, job_id="j1", host="vm3", rank=3,
                       payload={"detection_latency_s": 0.5, "loss": float("nan")})
        log.append(Kind.HOST_LOST, job_id="j2", host="vm1")
        assert b > a
        assert [e.kind for e in log.events(job_id="j1")] == ["job_started", "host_lost"]
        lost = log.events(kind=Kind.HOST_LOST, job_id="j1")
        assert len(lost) == 1 and lost[0].host == "vm3" and lost[0].rank == 3
        assert lost[0].payload == {"detection_latency_s": 0.5, "loss": None}  # strict JSON
        assert [e.id for e in log.events(since_id=a)] == [b, b + 1]
        assert log.events(kind=[Kind.JOB_STARTED, Kind.HOST_LOST], host="vm1")[0].job_id == "j2"
        log.append_heartbeat({"step": 4, "loss": 3.5, "fwd_s": 0.01, "bwd_s": 0.02,
                              "recompute_s": 0.005, "mem_bytes": 123, "extra": [1, 2]},
                             job_id="j1", host="vm0", rank=0)
        log.append_heartbeat({"step": 5, "loss": 3.4}, job_id="j1", host="vm0", rank=0)
        log.append_heartbeat({"step": 5, "loss": 3.4}, job_id="j1", host="vm1", rank=1)
        latest = log.latest_heartbeats("j1")
        assert set(latest) == {0, 1} and latest[0].step == 5
        first = log.heartbeats(rank=0)[0]
        assert (first.fwd_s, first.bwd_s, first.recompute_s, first.mem_bytes) == (0.01, 0.02, 0.005, 123)
        assert first.payload["extra"] == [1, 2]
        log.append_metric(0, {"loss": 4.0, "tokens_per_s": 100.0}, job_id="j1")
        assert log.metrics(job_id="j1")[0]["tokens_per_s"] == 100.0
        assert log.count("heartbeats") == 3
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_reader_is_read_only_and_needs_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EventLog.reader(tmp_path / "missing.db")
    EventLog(tmp_path / "e.db").close()
    with EventLog.reader(tmp_path / "e.db") as r:
        with pytest.raises(PermissionError, match="read-only"):
            r.append("x")


READER = textwrap.dedent("""
    import json, sys, time
    from varuna_sdk.manager.events import EventLog
    path, want = sys.argv[1], int(sys.argv[2])
    r = EventLog.reader(path)
    print("ready", flush=True)
    cursor, seen, polls = 0, [], 0
    deadline = time.monotonic() + 60
    while len(seen) < want and time.monotonic() < deadline:
        new = r.events(since_id=cursor)
        polls += 1
        if new:
            cursor = new[-1].id
            seen += [e.payload["i"] for e in new]
        time.sleep(0.005)
    print(json.dumps({"seen": seen, "polls": polls}))
""")


@pytest.mark.timeout(90)
def test_one_writer_several_reader_processes(tmp_path):
    path = tmp_path / "events.db"
    n = 400
    log = EventLog(path)
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(path), str(n)],
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for p in readers:  # both are polling before the first write
        assert p.stdout.readline().strip() == "ready"
    errors: list[BaseException] = []

    def write(start: int, step: int):
        try:
            for i in range(start, n, step):
                log.append("tick", job_id="j", payload={"i": i})
                if i % 50 == 0:
                    time.sleep(0.01)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(k, 2)) for k in range(2)]  # 2 writer threads
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    outs = [json.loads(p.communicate(timeout=70)[0].strip().splitlines()[-1]) for p in readers]
    log.close()
    assert not errors
    for out in outs:
        assert sorted(out["seen"]) == list(range(n)) and len(out["seen"]) == n
        assert out["polls"] > 1  # they read while the writer wrote
    assert all(p.returncode == 0 for p in readers)


def test_a_closed_log_is_whole_in_its_one_file(tmp_path):
    """A finished job's ``events.db`` copied alone held 68 of its 72 events (the rest in
    ``events.db-wal``: helper-66): closing the writer folds the write-ahead log into the file."""
    import shutil

    log = EventLog(tmp_path / "events.db")
    for i in range(50):
        log.append(Kind.WARNING, job_id="j", payload={"message": f"m{i}"})
        log.append_metric(i, {"loss": float(i)}, job_id="j")
    log.close()
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "events.db", tmp_path / "copy" / "events.db")   # the file alone, no -wal
    with EventLog(tmp_path / "copy" / "events.db", readonly=True) as copy:
        assert len(copy.events(kind=Kind.WARNING)) == 50 and len(copy.metrics(job_id="j")) == 50
