"""The job's event log: one embedded SQLite file (stdlib ``sqlite3``, WAL mode) that the manager
appends to and the dashboard reads.

Three append-only tables, every row stamped with wall-clock ``time`` (Unix seconds) and
``job_id``:

- ``events``     — what happened: ``kind`` (see ``Kind``), ``host``, ``rank``, ``payload`` (JSON
  object). Host lost, worker joined/failed, authentication failures, pre-emption notices, ...
- ``heartbeats`` — one row per worker heartbeat: ``step``, per-micro-batch forward / recompute /
  backward compute seconds, ``loss``, memory, plus the full message as JSON.
- ``metrics``    — one row per training step (the job's ``metrics.jsonl`` line as JSON, with
  ``step`` and ``loss`` as columns for queries).

Concurrency: **one writer, any number of readers**. The writer (``EventLog(path)``) holds one
connection guarded by a lock, so several threads of the manager process may append; readers
(``EventLog.reader(path)``, e.g. the dashboard, possibly in other processes) open the file
read-only. WAL mode means readers never block the writer and always see a consistent snapshot;
``busy_timeout`` absorbs the brief checkpoint locks.

Secrets never go here: payloads are plain JSON written by the manager, and the heartbeat server
stores a worker's message only after its MAC was verified — the MAC key itself is never stored.

Owns ``EventLog``, ``Event``, ``HeartbeatRow``, ``Kind``. Imports only the standard library;
must never import torch, ``cluster`` or anything above the manager.
"""

from __future__ import annotations

import enum
import json
import math
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    time    REAL    NOT NULL,
    job_id  TEXT,
    kind    TEXT    NOT NULL,
    host    TEXT,
    rank    INTEGER,
    payload TEXT    NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_job_kind ON events (job_id, kind, id);
CREATE TABLE IF NOT EXISTS heartbeats (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    time         REAL    NOT NULL,
    job_id       TEXT,
    host         TEXT,
    rank         INTEGER,
    step         INTEGER,
    loss         REAL,
    fwd_s        REAL,
    recompute_s  REAL,
    bwd_s        REAL,
    step_time_s  REAL,
    mem_bytes    INTEGER,
    payload      TEXT    NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS heartbeats_job_rank ON heartbeats (job_id, rank, id);
CREATE TABLE IF NOT EXISTS metrics (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    time    REAL    NOT NULL,
    job_id  TEXT,
    step    INTEGER,
    loss    REAL,
    payload TEXT    NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS metrics_job_step ON metrics (job_id, step);
"""


class Kind(enum.StrEnum):
    """Every event kind the SDK writes: one name per kind, the value the exact string stored in the
    ``events`` table (the dashboard and ``varuna logs`` read those strings). A ``str`` enum, so a
    member equals, hashes and formats as its value: ``Kind.HOST_LOST == "host_lost"``, and a kind
    read back from the log (a plain string) finds the member's entry in a dict. ``EventLog.append``
    also stores other non-empty strings (tools and tests may), but the SDK writes only these."""

    JOB_STARTED = "job_started"
    JOB_STOPPED = "job_stopped"
    # Heartbeat channel (``manager.heartbeat_server``)
    HEARTBEAT_SERVER_STARTED = "heartbeat_server_started"
    HEARTBEAT_SERVER_STOPPED = "heartbeat_server_stopped"
    WORKER_JOINED = "worker_joined"          # first authenticated message of a worker
    WORKER_REJOINED = "worker_rejoined"      # it reconnected after a dropped connection
    WORKER_DISCONNECTED = "worker_disconnected"  # connection closed without a goodbye
    WORKER_FINISHED = "worker_finished"      # clean goodbye (training done)
    WORKER_FAILED = "worker_failed"          # goodbye with an error (its traceback summary)
    WORKER_EXITED = "worker_exited"          # the launcher saw the process end
    WORKER_AFTER_LOSS = "worker_after_loss"  # a message from a worker whose host was declared lost
    HOST_LOST = "host_lost"                  # heartbeats stopped / process died / VM gone
    AUTH_FAILED = "auth_failed"              # a message with a bad MAC, malformed, replayed
    AUTH_FAILED_SUPPRESSED = "auth_failed_suppressed"  # refusals over the per-minute row budget
    PREEMPTION_NOTICE = "preemption_notice"  # payload: {"deadline": unix s, "lead_s": s}
    STOP_REQUESTED = "stop_requested"        # the signed stop command went out: {"reason", ...}
    METRICS_DROPPED = "metrics_dropped"      # a worker's metrics buffer overflowed: {"rows": n}
    # One generation of workers (``manager.generation``)
    BOOTSTRAP = "bootstrap"
    GENERATION_STARTED = "generation_started"  # {"generation", "P", "D", "world_size", "hosts", ...}
    GENERATION_ENDED = "generation_ended"      # {"generation", "status", "lost_hosts", "last_step", ...}
    STALE_WORKER_REAPED = "stale_worker_reaped"  # a worker on a VM lost by heartbeats killed: {"stopped"}
    ORPHANS = "orphans"                      # a restarted manager waited for its predecessor's workers
    # Provider / VM pool (``host`` column names the VM; payload may carry {"gpus": n, "price_per_hour": $})
    HOST_ADDED = "host_added"                # a VM joined the pool (acquired, returned by the cloud)
    HOST_REMOVED = "host_removed"            # the provider took a VM away (pre-empted, released)
    # Manager (payload shapes are the dashboard's contract; extra keys are allowed)
    JOB_STATE = "job_state"                  # {"state": "RUNNING", "previous": "PROVISIONING", "reason": str}
    PLAN = "plan"                            # {"generation", "gpus", "P", "D", "micro_batch_size",
                                             #  "num_micro_batches", "boundaries": [[seg,...] per stage],
                                             #  "hosts": [name per rank], "predicted_step_s", "examples_per_s",
                                             #  "bubble", "mem_per_stage_bytes": [...], "rows": [ranked table
                                             #  rows as dicts], "timeline": [{"stage", "action", "micro_batch",
                                             #  "start_s", "end_s"}] (simulated one mini-batch)}
    MORPH = "morph"                          # {"cause": "notice"|"loss"|"grow"|"straggler"|"failure",
                                             #  "old": {"P","D",...}, "new": {"P","D",...}, "downtime_s",
                                             #  "steps_lost", "from_step", "resume_step", "phases_s": {phase: s},
                                             #  "candidates": [{"P","D","examples_per_s","chosen"}], "feasible_plans"}
    ESTIMATE_DRIFT = "estimate_drift"        # {"generation", "drift": +0.38 = 38 % slower, "predicted_step_s",
                                             #  "measured_step_s", "recalibrated_step_s", "compute_ratio_by_stage",
                                             #  "calibrated_at", "load_1min", "cpu_count", "workers_here"}
    CHECKPOINT = "checkpoint"                # {"step", "path", "bytes", "seconds", "remote": url|None}
    STRAGGLER = "straggler"                  # {"rank", "slowdown": x vs peers' median, "action": "excluded"|"kept"}
    GROW_DECISION = "grow_decision"          # {"current_examples_per_s", "new_examples_per_s", "decision", ...}
    GENERATION_FAILED = "generation_failed"  # a generation did not start: {"generation", "error"}
    STOP_TIMEOUT = "stop_timeout"            # workers did not stop at a boundary in time: {"generation", "timeout_s"}
    CALIBRATION_STARTED = "calibration_started"  # {"message"}
    METRICS_BACKFILLED = "metrics_backfilled"    # steps copied from metrics.jsonl after a restart: {"steps", ...}
    STOP_REQUEST_RECEIVED = "stop_request_received"  # ``varuna stop`` / a stop file: {"by", "time"}
    WARNING = "warning"                      # something the user should know; the job goes on: {"message"}


@dataclass(frozen=True)
class Event:
    """One row of the ``events`` table: ``id`` (grows), ``time`` (Unix s), ``kind`` (a ``Kind``
    value, as a plain string when read back), the VM (``host``) and ``rank`` it is about, if any,
    and its JSON ``payload``."""

    id: int
    time: float
    job_id: str | None
    kind: str
    host: str | None
    rank: int | None
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HeartbeatRow:
    """One row of the ``heartbeats`` table: a worker's step, loss, per-micro-batch forward /
    recompute / backward compute and step time (seconds), memory (bytes), and the message."""

    id: int
    time: float
    job_id: str | None
    host: str | None
    rank: int | None
    step: int | None
    loss: float | None
    fwd_s: float | None
    recompute_s: float | None
    bwd_s: float | None
    step_time_s: float | None
    mem_bytes: int | None
    payload: dict[str, Any] = field(default_factory=dict)


def _json(payload: Mapping[str, Any] | None) -> str:
    """Strict JSON of a payload (NaN/inf become null: the dashboard's JSON parser rejects them)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, Mapping):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(dict(payload or {})), allow_nan=False, default=str, separators=(",", ":"))


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _job_term(by_index: bool) -> str:
    """The SQL filter on ``job_id`` of a query ordered by id; off the index (``+job_id``, SQLite's
    way to say so) unless ``by_index``. A reader's batch (``id > cursor ... LIMIT n``) through an
    index that does not give id order makes SQLite look up every later row of the job and sort
    them all, for every batch; a scan in id order stops after the batch."""
    return "job_id = ?" if by_index else "+job_id = ?"


class EventLog:
    """The job's event log at ``path`` (created with its folder if missing).

    ``EventLog(path)`` is the writer; ``EventLog.reader(path)`` a read-only handle. Both are
    context managers. Queries return plain dataclasses, oldest first.
    """

    def __init__(self, path: str | Path, *, readonly: bool = False, timeout_s: float = 10.0):
        self.path = Path(path)
        self.readonly = readonly
        self._lock = threading.RLock()
        if readonly:
            if not self.path.exists():
                raise FileNotFoundError(f"event log {self.path} does not exist (has the job started?)")
            uri = f"file:{self.path.resolve()}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False,
                                       isolation_level=None)
            self._wait_for_schema(timeout_s)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), timeout=timeout_s, check_same_thread=False,
                                       isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            with self._tx():
                for stmt in _SCHEMA.strip().split(";"):
                    if stmt.strip():
                        self._db.execute(stmt)
                self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                                 (str(SCHEMA_VERSION),))
        self._db.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
        self._closed = False

    def _wait_for_schema(self, timeout_s: float) -> None:
        """A reader may open the file while the writer is still creating it: wait (at most
        ``timeout_s``) until its schema is committed, so no query meets a missing table."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() and \
                        self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone():
                    return
            except sqlite3.DatabaseError:
                pass
            if time.monotonic() > deadline:
                self._db.close()
                raise FileNotFoundError(f"{self.path} is not an event log (no schema after {timeout_s:.0f} s)")
            time.sleep(0.05)

    @classmethod
    def reader(cls, path: str | Path, timeout_s: float = 10.0) -> "EventLog":
        """A read-only handle (the dashboard's); never blocks the writer (WAL)."""
        return cls(path, readonly=True, timeout_s=timeout_s)

    # ------------------------------------------------------------------------------- plumbing
    class _Tx:
        def __init__(self, log: "EventLog"):
            self.log = log

        def __enter__(self):
            self.log._lock.acquire()
            self.log._db.execute("BEGIN IMMEDIATE")

        def __exit__(self, exc_type, *exc):
            try:
                self.log._db.execute("ROLLBACK" if exc_type else "COMMIT")
            finally:
                self.log._lock.release()

    def _tx(self) -> "_Tx":
        if self.readonly:
            raise PermissionError(f"event log {self.path} was opened read-only")
        return EventLog._Tx(self)

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # -------------------------------------------------------------------------------- writing
    def append(self, kind: Kind | str, *, job_id: str | None = None, host: str | None = None,
               rank: int | None = None, payload: Mapping[str, Any] | None = None,
               time_s: float | None = None) -> int:
        """Record one event of ``kind`` (a ``Kind``; any other non-empty string is stored too);
        returns its id (ids grow: readers poll with ``since_id``). Raises ``ValueError`` for an
        empty or non-string kind."""
        if not isinstance(kind, str) or not kind:
            raise ValueError("event kind must be a non-empty string")
        with self._tx():
            cur = self._db.execute(
                "INSERT INTO events (time, job_id, kind, host, rank, payload) VALUES (?,?,?,?,?,?)",
                (time.time() if time_s is None else time_s, job_id, str(kind), host, rank, _json(payload)))
            return cur.lastrowid

    def append_heartbeat(self, message: Mapping[str, Any], *, job_id: str | None = None,
                         host: str | None = None, rank: int | None = None,
                         time_s: float | None = None) -> int:
        """Record one heartbeat (``message`` as the worker sent it: ``step``, ``loss``, ``fwd_s``,
        ``recompute_s``, ``bwd_s``, ``step_time_s``, ``mem_bytes`` ...)."""
        m = message
        with self._tx():
            cur = self._db.execute(
                "INSERT INTO heartbeats (time, job_id, host, rank, step, loss, fwd_s, recompute_s, "
                "bwd_s, step_time_s, mem_bytes, payload) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (time.time() if time_s is None else time_s, job_id, host, rank, _int(m.get("step")),
                 _num(m.get("loss")), _num(m.get("fwd_s")), _num(m.get("recompute_s")),
                 _num(m.get("bwd_s")), _num(m.get("step_time_s")), _int(m.get("mem_bytes")),
                 _json(m)))
            return cur.lastrowid

    def append_metric(self, step: int, values: Mapping[str, Any], *, job_id: str | None = None,
                      time_s: float | None = None) -> int:
        """Record one training step's metrics (a ``metrics.jsonl`` row)."""
        with self._tx():
            cur = self._db.execute(
                "INSERT INTO metrics (time, job_id, step, loss, payload) VALUES (?,?,?,?,?)",
                (time.time() if time_s is None else time_s, job_id, int(step),
                 _num(values.get("loss")), _json(values)))
            return cur.lastrowid

    # ------------------------------------------------------------------------------- querying
    def events(self, *, job_id: str | None = None, kind: str | Iterable[str] | None = None,
               host: str | None = None, since_id: int = 0, since_time: float | None = None,
               limit: int | None = None, until_id: int | None = None,
               not_kind: Iterable[str] | None = None, last: int | None = None) -> list[Event]:
        """Events matching every given filter, oldest first. ``since_id``: only ids above it
        (a reader's cursor); ``until_id``: only ids up to it; ``not_kind``: none of these kinds;
        ``limit``: the oldest that many, ``last``: the newest that many (still oldest first)."""
        where, args = ["id > ?"], [since_id]
        kinds = None if kind is None else [kind] if isinstance(kind, str) else list(kind)
        if job_id is not None:  # the (job_id, kind, id) index: in id order for one kind; else sorted once
            by_index = kinds is not None and (len(kinds) == 1 or not (limit or last))
            where.append(_job_term(by_index))
            args.append(job_id)
        for op, vals in (("IN", kinds), ("NOT IN", None if not_kind is None else list(not_kind))):
            if vals is not None:
                where.append(f"kind {op} ({','.join('?' * len(vals))})")
                args += vals
        if host is not None:
            where.append("host = ?")
            args.append(host)
        if since_time is not None:
            where.append("time >= ?")
            args.append(since_time)
        if until_id is not None:
            where.append("id <= ?")
            args.append(until_id)
        sql = "SELECT id, time, job_id, kind, host, rank, payload FROM events WHERE " + " AND ".join(where)
        if last is not None:
            sql = f"SELECT * FROM ({sql} ORDER BY id DESC LIMIT {int(last)})"
        sql += " ORDER BY id" + (f" LIMIT {int(limit)}" if limit else "")
        return [Event(*row[:6], json.loads(row[6])) for row in self._query(sql, args)]

    def heartbeats(self, *, job_id: str | None = None, host: str | None = None,
                   rank: int | None = None, since_id: int = 0,
                   limit: int | None = None) -> list[HeartbeatRow]:
        """Heartbeat rows matching every given filter, oldest first (``since_id``: a reader's cursor)."""
        where, args = ["id > ?"], [since_id]
        if job_id is not None:
            where.append(_job_term(by_index=rank is not None))
            args.append(job_id)
        for col, v in (("host", host), ("rank", rank)):
            if v is not None:
                where.append(f"{col} = ?")
                args.append(v)
        sql = ("SELECT id, time, job_id, host, rank, step, loss, fwd_s, recompute_s, bwd_s, "
               "step_time_s, mem_bytes, payload FROM heartbeats WHERE " + " AND ".join(where)
               + " ORDER BY id" + (f" LIMIT {int(limit)}" if limit else ""))
        return [HeartbeatRow(*row[:12], json.loads(row[12])) for row in self._query(sql, args)]

    def latest_heartbeats(self, job_id: str | None = None) -> dict[int, HeartbeatRow]:
        """The last heartbeat of every rank (of ``job_id``): rank → row."""
        where, args = "", []
        if job_id is not None:
            where, args = "WHERE job_id = ?", [job_id]
        sql = ("SELECT id, time, job_id, host, rank, step, loss, fwd_s, recompute_s, bwd_s, "
               "step_time_s, mem_bytes, payload FROM heartbeats WHERE id IN "
               f"(SELECT MAX(id) FROM heartbeats {where} GROUP BY rank) ORDER BY rank")
        return {row[4]: HeartbeatRow(*row[:12], json.loads(row[12])) for row in self._query(sql, args)}

    def metrics(self, *, job_id: str | None = None, since_id: int = 0,
                limit: int | None = None, last: int | None = None) -> list[dict[str, Any]]:
        """Per-step metrics rows as dicts (the stored JSON plus ``id``, ``time``, ``job_id``), oldest
        first; ``limit``: the oldest that many (a reader reading a long log in batches), ``last``:
        the newest that many (still oldest first)."""
        where, args = ["id > ?"], [since_id]
        if job_id is not None:
            where.append(_job_term(by_index=False))
            args.append(job_id)
        sql = "SELECT id, time, job_id, payload FROM metrics WHERE " + " AND ".join(where)
        if last is not None:
            sql = f"SELECT * FROM ({sql} ORDER BY id DESC LIMIT {int(last)})"
        rows = self._query(sql + " ORDER BY id" + (f" LIMIT {int(limit)}" if limit else ""), args)
        return [{**json.loads(p), "id": i, "time": t, "job_id": j} for i, t, j, p in rows]

    def max_step(self, *, job_id: str | None = None) -> int | None:
        """The highest step of the metrics table (of ``job_id``), None when it has none."""
        where, args = ("WHERE job_id = ?", [job_id]) if job_id is not None else ("", [])
        return self._query(f"SELECT MAX(step) FROM metrics {where}", args)[0][0]

    def metric_values(self, fields: Sequence[str], *, job_id: str | None = None, since_id: int = 0,
                      limit: int | None = None) -> list[tuple]:
        """Per-step metrics rows as plain numbers, oldest first, without decoding a row in Python:
        one tuple ``(id, time, step, loss, *fields)`` per row (``time`` in Unix seconds; ``step``
        and ``loss`` the table's columns), each of ``fields`` picked out of the stored JSON by
        SQLite: its number (int or float), or ``None`` when missing or not a number (a bool, a
        string, null, an object). ``since_id`` / ``limit`` as in ``metrics``."""
        bad = [f for f in fields if not isinstance(f, str) or '"' in f or "\\" in f]
        if bad:
            raise ValueError(f"metric field names must be strings without quotes or backslashes: {bad}")
        pick = ("CASE WHEN json_type(payload, ?) IN ('integer', 'real') "
                "THEN json_extract(payload, ?) END")
        paths = [p for f in fields for p in (f'$."{f}"',) * 2]
        where, args = ["id > ?"], [since_id]
        if job_id is not None:
            where.append(_job_term(by_index=False))
            args.append(job_id)
        sql = ("SELECT id, time, step, loss" + "".join(", " + pick for _ in fields) + " FROM metrics WHERE "
               + " AND ".join(where) + " ORDER BY id" + (f" LIMIT {int(limit)}" if limit else ""))
        return self._query(sql, paths + args)

    def count(self, table: str = "events") -> int:
        """Rows in ``table`` (events, heartbeats or metrics); ``ValueError`` for another name."""
        if table not in ("events", "heartbeats", "metrics"):
            raise ValueError(f"unknown table {table!r}")
        return self._query(f"SELECT COUNT(*) FROM {table}")[0][0]

    # -------------------------------------------------------------------------------- closing
    def close(self) -> None:
        """Close the connection (idempotent); a writer first folds the write-ahead log into
        ``events.db`` itself (``wal_checkpoint``), so the file alone holds every event (a copy of
        it made after the job had 68 of its 72 events: the rest sat in ``events.db-wal``)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if not self.readonly:
                    try:
                        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    except sqlite3.Error:   # a reader holds the log: SQLite folds it in later
                        pass
                self._db.close()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<EventLog {self.path}{' (read-only)' if self.readonly else ''}>"
