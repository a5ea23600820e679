"""Orphans: workers of a manager that died. A worker that cannot reach its manager for
``orphan_after_s`` stops at a mini-batch boundary with a checkpoint by itself
(``HeartbeatClient``); ``wait_for_orphans`` lets a manager restarted on the same run folder wait
for that before it launches the next generation, so two generations never train at once.

Owns ``wait_for_orphans``. Imports ``manager.events`` and the standard library; never torch,
never ``cluster``.
"""

from __future__ import annotations

import time
from pathlib import Path

from .events import EventLog, Kind


def wait_for_orphans(events: EventLog, job_id: str, *, timeout_s: float = 120.0) -> dict:
    """After a manager restart on the same event log: if the job's last generation never ended
    (no ``generation_ended``), its workers may still run — orphans. They stop by themselves at a
    mini-batch boundary, with a checkpoint, ``orphan_after_s`` after they lost the manager
    (``HeartbeatClient``); wait for that: until every local worker process of that generation
    (pids from its ``worker_joined`` events) has exited and, when it had remote workers, until
    ``orphan_after_s`` + 2 intervals + 10 s after its last recorded heartbeat — at most
    ``timeout_s``. Records an ``orphans`` event; returns what it found (``generation``,
    ``local_pids``, ``left``: pids still alive, ``waited_s``)."""
    t0 = time.monotonic()
    marks = events.events(job_id=job_id, kind=(Kind.GENERATION_STARTED, Kind.GENERATION_ENDED))
    if not marks or marks[-1].kind != Kind.GENERATION_STARTED:
        return {"generation": None, "local_pids": [], "left": [], "waited_s": 0.0}
    started = marks[-1]
    g = started.payload.get("generation")
    local = set(started.payload.get("local_hosts") or [])
    joined = events.events(job_id=job_id, kind=(Kind.WORKER_JOINED, Kind.WORKER_REJOINED),
                           since_id=started.id)
    pids = sorted({int(e.payload["pid"]) for e in joined
                   if e.host in local and isinstance(e.payload.get("pid"), int)})
    remote = set(started.payload.get("hosts") or []) - local
    orphan_after = started.payload.get("orphan_after_s")
    interval = float(started.payload.get("interval_s") or 2.0)
    beats = events.heartbeats(job_id=job_id, since_id=0)
    last_beat = beats[-1].time if beats else started.time
    remote_until = (last_beat + float(orphan_after) + 2 * interval + 10.0) if (remote and orphan_after) else 0.0

    def alive(pid: int) -> bool:
        try:
            return b"varuna_sdk.worker" in Path(f"/proc/{pid}/cmdline").read_bytes() and \
                Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    while True:
        left = [p for p in pids if alive(p)]
        if (not left and time.time() >= remote_until) or time.monotonic() - t0 >= timeout_s:
            break
        time.sleep(0.2)
    out = {"generation": g, "local_pids": pids, "left": left, "waited_s": round(time.monotonic() - t0, 3),
           "remote_hosts": sorted(remote)}
    events.append(Kind.ORPHANS, job_id=job_id, payload=out)
    return out
