"""Opening a big event log on the dashboard: peak memory and time to read a 10^6-row log.

Setup: a real ``EventLog`` file with ``--rows`` rows (default 1,000,000): 60 % per-step metrics
rows, 35 % events of the kinds a long, attacked job writes (``auth_failed``, ``checkpoint``,
``plan``, ``worker_joined``) and 5 % heartbeats, inserted in bulk with the log's own schema.
Each measurement runs in a fresh process that opens the log with the dashboard's
``TelemetryStore`` and reads all of it (``refresh(force=True)``: the open, in batches, metrics as
numbers picked out by SQLite, only the state-changing events folded one by one), as ``varuna
dashboard`` does before it listens; the process reports its peak resident memory growth and the
wall time of the read (peak: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus
``VmRSS`` before the read). Before each measurement the benchmark waits (``--wait-idle``, default
30 s) for idle CPUs.

Baseline, measured in the same run: the old read — one query per table, every row decoded into
Python objects at once (``EventLog.events()``, ``EventLog.metrics()`` dicts), every event folded
by the store one by one and the 11 metric columns the dashboard kept then converted value by
value. Targets (from the hardening issue): peak memory growth < 300 MB and time < 10 s
(absolute), memory ratio vs the baseline <= 0.5, time ratio vs the baseline <= 0.5.

Run: ``.venv/bin/python benchmarks/bench_dashboard_big_log.py [--quick] [--rows N]``; writes
``benchmarks/results/dashboard_big_log.json``.
"""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402

common.setup_path()

TARGET_MB, TARGET_S = 300.0, 10.0

OPEN = """
import sys, time
sys.path.insert(0, {root!r})
import numpy as np
import dashboard.store as S
from varuna_sdk.manager.events import EventLog

OLD_COLUMNS = ("step", "time", "loss", "lr", "grad_norm", "tokens_per_s", "examples_per_s",
               "step_time_s", "generation", "P", "D")

def read_old(path):  # the old read: every row of a table in one list of Python objects (all held at once)
    store, log = S.TelemetryStore(path), EventLog.reader(path)
    events = log.events()
    for e in events:
        store._apply(e)
    rows = log.metrics()
    cols = {{c: np.array([S._f(r.get(c)) for r in rows]) for c in OLD_COLUMNS}}
    log.latest_heartbeats()
    return len(cols["step"]), len(store.checkpoints)

def read_ours(path):
    store = S.TelemetryStore(path)
    store.refresh(force=True)
    return len(store.metrics), len(store.checkpoints)

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")   # reset the peak (VmHWM) to the current size
before = kib("VmRSS")
t0 = time.perf_counter()
n_metrics, n_ckpt = (read_old if {old} else read_ours)({path!r})
dt = time.perf_counter() - t0
grown = kib("VmHWM") - before
print(dt, grown * 1024, n_metrics, n_ckpt, flush=True)
"""


def make_log(path: Path, rows: int) -> dict:
    from varuna_sdk.manager.events import EventLog

    EventLog(path).close()   # the schema
    rnd = random.Random(0)
    n_metrics, n_events = int(rows * 0.60), int(rows * 0.35)
    n_hb = rows - n_metrics - n_events
    db = sqlite3.connect(path)
    t = 1.7e9
    db.executemany("INSERT INTO metrics (time, job_id, step, loss, payload) VALUES (?, ?, ?, ?, ?)",
                   ((t + i, "big", i, 5.0 / (1 + i * 1e-4), json.dumps(
                       {"step": i, "loss": 5.0 / (1 + i * 1e-4), "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 5000.0,
                        "examples_per_s": 40.0, "step_time_s": 0.1, "generation": i // 100_000}))
                    for i in range(n_metrics)))
    kinds = ["auth_failed"] * 6 + ["checkpoint", "plan", "worker_joined"]
    db.executemany("INSERT INTO events (time, job_id, kind, host, rank, payload) VALUES (?, ?, ?, ?, ?, ?)",
                   ((t + i, "big", k, f"vm{i % 8}", i % 4, json.dumps(
                       {"peer": "10.0.0.9:5555", "reason": "bad MAC (wrong job secret or altered message)"}
                       if k == "auth_failed" else {"step": i, "P": 2, "D": 2, "hosts": ["vm0", "vm1"]}))
                    for i, k in ((i, rnd.choice(kinds)) for i in range(n_events))))
    db.executemany("INSERT INTO heartbeats (time, job_id, host, rank, step, loss, payload) VALUES (?, ?, ?, ?, ?, ?, ?)",
                   ((t + i, "big", f"vm{i % 8}", i % 4, i, 1.0, "{}") for i in range(n_hb)))
    db.commit()
    db.close()
    return {"metrics": n_metrics, "events": n_events, "heartbeats": n_hb, "bytes": path.stat().st_size}


def measure(path: Path, old: bool, wait_idle_s: float) -> dict:
    """Open ``path`` in a fresh process (``old``: the baseline read) after waiting up to
    ``wait_idle_s`` for idle CPUs: read seconds, peak memory growth (bytes), rows read."""
    idle = common.wait_for_idle(wait_idle_s)
    load = common.load_average()
    out = subprocess.run([sys.executable, "-c", OPEN.format(root=str(ROOT), path=str(path), old=old)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    dt, grown, n_metrics, n_ckpt = out.stdout.split()
    return {"s": float(dt), "bytes": float(grown), "metrics": int(n_metrics), "checkpoints_kept": int(n_ckpt),
            "idle_before": idle, "load_average": [load, common.load_average()]}


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda ap: ap.add_argument("--rows", type=int, default=None))
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "events.db"
        t0 = time.perf_counter()
        shape = make_log(path, rows)
        print(f"wrote {rows} rows ({shape['bytes'] / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")
        ours = measure(path, old=False, wait_idle_s=args.wait_idle)
        base = measure(path, old=True, wait_idle_s=args.wait_idle)
    assert ours["metrics"] == base["metrics"] == shape["metrics"]
    figures = [
        common.Figure("peak memory growth (batched read)", ours["bytes"], "B", baseline=base["bytes"], target="<= 0.5",
                      detail={"unbatched_bytes": base["bytes"]}),
        common.Figure("peak memory growth vs 300 MB", ours["bytes"] / 2**20, "MB", ratio=ours["bytes"] / 2**20 / TARGET_MB,
                      target="< 1.0"),
        common.Figure("time to read the whole log vs 10 s", ours["s"], "s", ratio=ours["s"] / TARGET_S, target="< 1.0",
                      detail={"unbatched_s": base["s"]}),
        common.Figure("time to read the whole log vs the old read", ours["s"], "s", baseline=base["s"], target="<= 0.5"),
    ]
    common.print_table(f"dashboard: opening a {rows:,}-row event log", figures)
    common.write_results("dashboard_big_log", figures, notes=(
        f"{rows} rows ({shape}); fresh process per read, after waiting for idle CPUs; baseline = the old read "
        "(one query per table, every row decoded and folded in Python). Memory = peak RSS (VmHWM) growth of the "
        "reading process during the read."), out=args.out,
        machine=common.machine_info(load_average=ours["load_average"], idle_before=ours["idle_before"]),
        extra={"rows": rows, "shape": shape, "batched": ours, "unbatched": base, "quick": args.quick})


if __name__ == "__main__":
    main()
