"""Heartbeats: every worker reports to the manager every few seconds; the manager notices a
VM that went quiet.

**Client** (``HeartbeatClient``, a daemon thread inside each worker): connects to the manager's
``HeartbeatServer`` over TCP and, every ``interval_s``, sends the worker's latest step, loss,
per-micro-batch forward / recompute / backward compute seconds, step time and memory. The
training loop feeds it with ``record_step(...)`` (cheap: it only stores numbers); the thread does
all network work, reconnects with back-off, and never raises into training. On exit the worker
says goodbye (``close(status="ok" | "failed", error=...)``), so a clean end or a Python
exception is never mistaken for a lost VM.

**Server** (``HeartbeatServer``, one thread with a ``selectors`` loop): records every
authenticated heartbeat in the job's ``EventLog`` and declares a host lost — one ``host_lost``
event, with ``detection_latency_s`` and ``since_last_heartbeat_s`` in its payload — when

- no heartbeat of one of its workers arrived for ``miss_limit`` (2) intervals (VM frozen,
  network cut, pre-empted without a notice) — or, before the worker reported its first
  training step, for ``startup_grace_s`` (default 15 s) if that is longer: importing torch and
  initialising the process group can hold the interpreter for seconds on a busy VM, and that
  silence is not a loss (a start-up that *dies* is still caught at once, below);
- a worker's connection closed without a goodbye (its process died — killed, OOM, VM gone) and
  it did not reconnect within ``reconnect_grace_s`` (default half an interval);
- the launcher reports that a worker's process died (``report_exit``) or that the VM is gone
  (``report_lost``);
- a worker announced with ``expect(...)`` never joined within its start-up allowance (a VM lost
  during bootstrap).

**Metrics** (``HeartbeatClient.record_metrics``, rank 0): every training step's metrics row (the
``metrics.jsonl`` line) rides on the next heartbeat (``"metrics": [row, ...]``; a backlog too big
for one line follows at once in ``"metrics"`` messages). The server appends each row to the event
log's metrics table — the dashboard's source — once per step, and acknowledges the message; the
client keeps every row until acknowledged and sends unacknowledged rows again after a reconnect
(and flushes them before its goodbye), so no step is dropped while the manager is reachable. The
client's queue is bounded (``max_pending_metrics``); rows dropped because it overflowed (a manager
unreachable for that many steps) are counted and reported (``metrics_dropped`` event).

**Pre-emption notices from the VM** (``HeartbeatClient.report_notice``, fed by the notice
watcher of ``cluster.notice`` on the first worker of each VM): a heartbeat carries
``"notice": {"cloud", "kind", "deadline", "reason"}``; the server emits one
``preemption_notice`` event per host and deadline (``source: "vm"``), which the manager turns into
its notice morph. A malformed notice is ignored.

**Stop command** (server → client): ``HeartbeatServer.request_stop(reason)`` sends every worker
(and every worker that connects later) a signed ``stop`` message; the client then reports
``stop_requested`` = True, which the training loop polls at each mini-batch boundary
(``run_worker(should_stop=...)``: the workers agree, checkpoint and end with ``bye`` status
``"stopped"``). Unlike a signal, it reaches workers on every VM over the channel that is already
authenticated.

Wire format — JSON lines, never pickle. On accept the server sends ``{"v":1,"nonce":HEX}``.
Each line either way is ``{"mac": HEX, "msg": TEXT}`` where ``TEXT`` is a JSON object and
``mac = HMAC-SHA256(key, TEXT)``. Client lines (``type`` = ``hello``/``hb``/``metrics``/``bye``;
``v``, ``job``, ``host``, ``rank``, ``seq``, ``nonce``, ``cnonce`` (the client's random nonce of
this connection), ``time`` and the type's fields) use ``key = HMAC-SHA256(job secret,
"varuna-heartbeat-v1")``; server lines (``type`` = ``ack``/``stop``; ``v``, ``job``, ``seq``,
``nonce``, ``cnonce``, ``time``) use the other direction's key
``HMAC-SHA256(job secret, "varuna-heartbeat-v1/server")``, so a client line can never pass for a
server line. The server checks the MAC (constant time) *before* parsing ``TEXT``; then the job
id, the connection's nonce (no replay from another connection) and a strictly increasing ``seq``
(no replay within one); the client checks the same of server lines with both nonces (its own
fresh ``cnonce`` stops a replayed ``stop`` of an earlier connection). Any failure on the server —
bad MAC, malformed, oversized, wrong job, replay, a (host, rank) the generation never placed
(``placed_only``), or any exception while handling it — refuses that connection only: it is
closed and recorded as an ``auth_failed`` event (peer address and reason, never the message or
the secret), at most ``REFUSAL_ROWS_PER_MIN`` rows a minute, the rest counted in one
``auth_failed_suppressed`` row per minute. The server holds at most ``connection_limit()``
connections (below half the descriptor limit; unauthenticated ones at most half of that), and
when ``accept`` fails (descriptors exhausted) it stops watching the listening socket for a
doubling pause (0.05–2 s) instead of spinning. The client drops a connection that sends a bad
line. The job secret is a ``Secret``: it is never logged,
stored in the event log or put in an exception.

Environment contract for workers (``HeartbeatServer.worker_env()`` makes it; the launcher adds
``VARUNA_JOB_TOKEN``, ``VARUNA_JOB_ID``, ``VARUNA_HOST``, ``RANK``):
``VARUNA_HEARTBEAT_ADDR=host:port``, ``VARUNA_HEARTBEAT_INTERVAL=seconds``, optionally
``VARUNA_ORPHAN_AFTER=seconds`` (a worker cut off from its manager that long stops on its own).

Owns ``HeartbeatServer``, ``HeartbeatClient``, ``SenderState``, the wire format (``encode``,
``derive_key``). Imports the standard library, ``manager.events`` and ``cluster.hosts``
(``Secret``) only; never torch (the client reads GPU memory only if the worker already imported
torch).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import math
import os
import resource
import secrets as _secrets
import select
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..cluster.hosts import Secret
from .events import Event, EventLog, Kind

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_LINE = 64 * 1024
ENV_ADDR = "VARUNA_HEARTBEAT_ADDR"
ENV_INTERVAL = "VARUNA_HEARTBEAT_INTERVAL"
ENV_TOKEN = "VARUNA_JOB_TOKEN"
ENV_ORPHAN = "VARUNA_ORPHAN_AFTER"
_KDF_LABEL = b"varuna-heartbeat-v1"
_KDF_LABEL_SERVER = b"varuna-heartbeat-v1/server"
_TYPES = ("hello", "hb", "metrics", "bye")
_SERVER_TYPES = ("ack", "stop")
METRICS_BUDGET = 32 * 1024  # bytes of metrics rows per line (well under MAX_LINE)
STOPPED = "stopped"  # bye status of a worker that stopped on request (not a failure)
#: why a worker failed (its goodbye's ``cause``): its data ("data": deterministic, never retried), a
#: peer that died first ("peer": a consequence, not the cause), anything else ("error")
FAILURE_CAUSES = ("data", "code", "peer", "error")


# ------------------------------------------------------------------------------------ wire format
def derive_key(secret: Secret | str, direction: str = "client") -> bytes:
    """The MAC key of a job secret for one direction (``"client"``: worker → manager lines,
    ``"server"``: manager → worker lines); domain-separated, so the raw token is never the key."""
    raw = secret.reveal() if isinstance(secret, Secret) else secret
    if not raw:
        raise ValueError("the job secret is empty")
    if direction not in ("client", "server"):
        raise ValueError(f"direction={direction!r}: use 'client' or 'server'")
    label = _KDF_LABEL if direction == "client" else _KDF_LABEL_SERVER
    return hmac.new(raw.encode(), label, hashlib.sha256).digest()


def encode(key: bytes, msg: Mapping[str, Any]) -> bytes:
    """One wire line: ``{"mac": HMAC(key, TEXT), "msg": TEXT}\\n`` with ``TEXT = json(msg)``."""
    text = json.dumps(msg, separators=(",", ":"), allow_nan=False, default=_finite)
    mac = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
    return (json.dumps({"mac": mac, "msg": text}, separators=(",", ":")) + "\n").encode()


def _finite(v):
    raise TypeError(f"not JSON: {type(v).__name__}")


def _clean(v: Any) -> Any:
    """Replace non-finite floats with None (strict JSON) recursively."""
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class _Reject(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_HEX = frozenset("0123456789abcdef")
MAX_HOST_NAME = 253           # a DNS name's limit; longer host fields are malformed
MAX_RANK = 1 << 20
REFUSAL_ROWS_PER_MIN = 30     # auth_failed rows per minute at most; the rest are counted
REFUSAL_WINDOW_S = 60.0
ACCEPT_BACKOFF_S = (0.05, 2.0)  # accept errors (descriptors exhausted): first and longest pause


def _json(text: str | bytes) -> Any:
    """``json.loads`` that turns every failure on hostile input (bad UTF-8, deep nesting, huge
    numbers) into ``_Reject``."""
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError, MemoryError):
        raise _Reject("malformed: not a JSON line") from None


class RefusalBudget:
    """Bounds what refused connections write: at most ``rows_per_window`` ``auth_failed`` rows (and
    log lines) per ``window_s``; the rest are counted and summarised in one
    ``auth_failed_suppressed`` row when the window ends (``summary(now)``). Not thread-safe: the
    server thread owns it."""

    def __init__(self, rows_per_window: int = REFUSAL_ROWS_PER_MIN, window_s: float = REFUSAL_WINDOW_S):
        self.rows_per_window, self.window_s = rows_per_window, window_s
        self.window_start: float | None = None
        self.rows = 0
        self.suppressed = 0
        self.total = 0
        self._peers: set[str] = set()
        self._reasons: collections.Counter = collections.Counter()

    def admit(self, now: float, peer: str, reason: str) -> bool:
        """Count one refusal; True when it may write its own row."""
        if self.window_start is None or now - self.window_start >= self.window_s:
            self.window_start, self.rows = now, 0
        self.total += 1
        if self.rows < self.rows_per_window:
            self.rows += 1
            return True
        self.suppressed += 1
        if len(self._peers) < 1000:
            self._peers.add(peer.rsplit(":", 1)[0])
        self._reasons[reason[:80]] += 1
        return False

    def summary(self, now: float) -> dict[str, Any] | None:
        """The summary payload of the window that ended by ``now`` (None: nothing suppressed or the
        window is still open); resets the counters."""
        if not self.suppressed or self.window_start is None or now - self.window_start < self.window_s:
            return None
        out = {"suppressed": self.suppressed, "window_s": self.window_s,
               "peers": sorted(self._peers)[:20], "peer_count": len(self._peers),
               "reasons": dict(self._reasons.most_common(5))}
        self.suppressed = 0
        self._peers.clear()
        self._reasons.clear()
        self.window_start, self.rows = now, 0
        return out

    def next_due(self) -> float | None:
        """When the open window's summary falls due (monotonic s), if anything was suppressed."""
        return None if not self.suppressed or self.window_start is None else self.window_start + self.window_s


def connection_limit(requested: int, reserve: int = 64) -> int:
    """Connections the server may hold: ``requested`` but at most half of this process's
    descriptor limit (``RLIMIT_NOFILE``, whose soft value is first raised towards the hard one when
    it is lower than ``2 x requested + reserve``) after ``reserve``, so a flood of connections can
    never take the descriptors that the event log, SSH sessions and worker pipes need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * requested + reserve
    if soft != resource.RLIM_INFINITY and 0 < soft < want:   # raise the soft limit as far as allowed
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return requested
    return max(4, min(requested, (soft - reserve) // 2))


# ------------------------------------------------------------------------------------ server state
@dataclass
class SenderState:
    """What the server knows about one worker (host, rank). Times are ``time.monotonic()``."""

    host: str
    rank: int
    status: str = "expected"   # expected | running | disconnected | finished | failed | stopping | lost
    joined_at: float | None = None
    last_seen: float | None = None
    deadline: float | None = None
    heartbeats: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    loss_time: float | None = None  # when the loss became known (EOF, report), for the latency
    pid: int | None = None


class _Conn:
    def __init__(self, sock: socket.socket, peer: str, nonce: str, now: float):
        self.sock, self.peer, self.nonce = sock, peer, nonce
        self.buf = b""
        self.seq = -1
        self.sender: tuple[str, int] | None = None
        self.cnonce: str | None = None
        self.opened = now
        self.said_bye = False
        self.out = b""          # server lines not yet written (non-blocking socket)
        self.out_seq = 0
        self.stop_sent = False


class HeartbeatServer:
    """Receives the workers' heartbeats of job ``job_id`` and declares lost hosts.

    ``HeartbeatServer(job_id, secret, event_log, interval_s=2.0).start()``; give the workers
    ``worker_env()`` (plus the secret as ``VARUNA_JOB_TOKEN``); ``close()`` when the job ends.
    Thread-safe: ``expect``, ``report_exit``, ``report_lost``, ``stop_expecting``, ``senders``
    and ``wait_for`` may be called from any thread. ``on_event(event)`` callbacks run on the
    server thread (keep them short).
    """

    def __init__(self, job_id: str, secret: Secret, events: EventLog, *, interval_s: float = 2.0,
                 miss_limit: float = 2.0, reconnect_grace_s: float | None = None,
                 bind: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 auth_timeout_s: float = 10.0, max_connections: int = 4096,
                 startup_grace_s: float = 15.0, placed_only: bool = False,
                 refusal_rows_per_min: int = REFUSAL_ROWS_PER_MIN,
                 on_event: Callable[[Event], None] | None = None):
        if not isinstance(secret, Secret):
            raise TypeError("secret must be a Secret (so that it can never be printed)")
        if interval_s <= 0 or miss_limit < 1:
            raise ValueError("interval_s must be > 0 and miss_limit >= 1")
        self.job_id = job_id
        self._key = derive_key(secret)
        self._out_key = derive_key(secret, "server")
        self.events = events
        self.interval_s = float(interval_s)
        self.lost_after_s = float(miss_limit) * self.interval_s
        self.reconnect_grace_s = (0.5 * self.interval_s if reconnect_grace_s is None
                                  else float(reconnect_grace_s))
        self.auth_timeout_s = auth_timeout_s
        self.startup_grace_s = float(startup_grace_s)
        # below the descriptor limit; unauthenticated connections get at most half of it, so a
        # flood of them can never keep a placed worker out
        self.max_connections = connection_limit(max_connections)
        self.max_pending = max(2, self.max_connections // 2)
        self.placed_only = bool(placed_only)
        self.refusals = RefusalBudget(refusal_rows_per_min)
        self._accept_pause = 0.0            # current accept back-off (s); 0: accepting
        self._accept_resume_at: float | None = None
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind((bind, port))
        self._listen.listen(256)
        self._listen.setblocking(False)
        self.address: tuple[str, int] = self._listen.getsockname()[:2]
        if advertise is None and bind in ("0.0.0.0", ""):
            raise ValueError("bind=0.0.0.0 needs advertise=ADDRESS (what the workers connect to)")
        self.advertise = advertise or bind
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._senders: dict[tuple[str, int], SenderState] = {}
        self._conns: dict[socket.socket, _Conn] = {}
        self._lost_hosts: dict[str, Event] = {}
        self.emitted: list[Event] = []
        self._callbacks = [on_event] if on_event else []
        self._stop_request: dict[str, Any] | None = None
        self._metric_steps: set[int] = set()
        self.last_metric_step: int | None = None
        self.metrics_recorded = 0
        self._dropped_reported: dict[tuple[str, int], int] = {}
        self._notices: dict[str, float] = {}   # host -> deadline of the VM notice last emitted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> "HeartbeatServer":
        self._sel.register(self._listen, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{self.job_id}",
                                        daemon=True)
        self._thread.start()
        self._emit(Kind.HEARTBEAT_SERVER_STARTED, payload={
            "address": f"{self.advertise}:{self.address[1]}", "interval_s": self.interval_s,
            "lost_after_s": self.lost_after_s, "reconnect_grace_s": self.reconnect_grace_s})
        log.info("heartbeat server for job %s on %s:%d (interval %.2fs, lost after %.2fs)",
                 self.job_id, self.advertise, self.address[1], self.interval_s, self.lost_after_s)
        return self

    def worker_env(self) -> dict[str, str]:
        """Environment variables a worker needs to find this server (not the secret)."""
        return {ENV_ADDR: f"{self.advertise}:{self.address[1]}", ENV_INTERVAL: repr(self.interval_s)}

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(5.0)
        for c in list(self._conns.values()):
            self._drop(c, quiet=True)
        for s in (self._listen, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self._sel.close()
        self._emit(Kind.HEARTBEAT_SERVER_STOPPED)

    def __enter__(self) -> "HeartbeatServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # --------------------------------------------------------------------------- public API
    def expect(self, host: str, rank: int, within_s: float) -> None:
        """Announce a worker before it starts: if it has not joined within ``within_s`` seconds
        (start-up: bootstrap, interpreter and torch import), its host is declared lost."""
        with self._lock:
            s = self._senders.setdefault((host, rank), SenderState(host, rank))
            if s.status == "expected":
                s.deadline = time.monotonic() + within_s
        self._wake()

    def report_exit(self, host: str, rank: int, exit_code: int | None, *,
                    at: float | None = None) -> None:
        """The launcher saw worker ``rank`` on ``host`` end (``at``: ``time.monotonic()`` when it
        did). A worker that said goodbye, one we are stopping, or one that exited 0 after training
        (its goodbye was lost on the way) just gets ``worker_exited``; one that exited 0 before its
        first step, without a goodbye, is a ``worker_failed`` naming the rank (it ended itself; the
        others would wait for it); any other is a process death (a signal, a non-zero exit without
        goodbye, ``exit_code=None``: its VM is unreachable): its host is declared lost now."""
        now = time.monotonic()
        with self._lock:
            s = self._senders.setdefault((host, rank), SenderState(host, rank))
            self._emit(Kind.WORKER_EXITED, host=host, rank=rank,
                       payload={"exit_code": exit_code, "status_before": s.status})
            if s.status in ("running", "disconnected", "expected") and exit_code != 0:
                s.loss_time = now if at is None else at
                reason = "worker_process_died" if exit_code is not None else "vm_unreachable"
                self._declare_lost(s, reason, now, extra={"exit_code": exit_code})
            elif s.status in ("running", "disconnected", "expected") and s.last.get("step") is None:
                # exit 0 without a goodbye and without one training step: the process ended itself
                # (sys.exit / os._exit in user code, a broken start-up) — the other ranks would wait
                # for it until the collective timeout; name it now
                s.status, s.deadline = "failed", None
                where = "before it joined" if s.joined_at is None else "before its first training step"
                self._emit(Kind.WORKER_FAILED, host=host, rank=rank, payload={
                    "status": "exited", "last_step": None, "error": f"rank {rank} on {host} exited with code 0 "
                    f"{where} (its engine was never built, or the code it runs ended the process: look for "
                    "sys.exit/os._exit in the model, data or loss code, and at its worker log)"})
            elif s.status not in ("lost",):
                s.status = "exited" if s.status != "failed" else s.status

    def report_lost(self, host: str, reason: str, *, at: float | None = None,
                    payload: Mapping[str, Any] | None = None) -> None:
        """The provider or launcher knows ``host`` is gone (pre-empted, SSH connection lost):
        declare it lost now (once)."""
        now = time.monotonic()
        with self._lock:
            ranks = [s for s in self._senders.values() if s.host == host]
            if not ranks:
                ranks = [SenderState(host, -1)]
            for s in ranks:
                s.loss_time = now if at is None else at
            self._declare_lost(ranks[0], reason, now, extra=dict(payload or {}))

    def stop_expecting(self, host: str | None = None) -> None:
        """The job (or ``host``'s workers) is being stopped on purpose: from now on their
        silence or disconnection is not a loss."""
        with self._lock:
            for s in self._senders.values():
                if host is None or s.host == host:
                    if s.status in ("running", "disconnected", "expected"):
                        s.status, s.deadline = "stopping", None

    def request_stop(self, reason: str, **payload: Any) -> None:
        """Ask every worker — connected now or later — to stop at its next mini-batch boundary
        (a signed ``stop`` line on its heartbeat connection; the client's ``stop_requested``
        becomes True). Recorded as a ``stop_requested`` event; repeated calls are no-ops."""
        with self._lock:
            if self._stop_request is not None:
                return
            self._stop_request = {"reason": str(reason), **_clean(dict(payload))}
        self._emit("stop_requested", payload=self._stop_request)
        self._wake()

    @property
    def stop_requested(self) -> bool:
        return self._stop_request is not None

    def senders(self) -> dict[tuple[str, int], SenderState]:
        """A snapshot of every worker's state: (host, rank) → ``SenderState`` copy."""
        with self._lock:
            return {k: SenderState(**{**vars(v), "last": dict(v.last)}) for k, v in self._senders.items()}

    def lost_hosts(self) -> dict[str, Event]:
        with self._lock:
            return dict(self._lost_hosts)

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def wait_for(self, predicate: Callable[[Event], bool] | str, timeout_s: float,
                 *, host: str | None = None) -> Event | None:
        """The first emitted event matching ``predicate`` (or of that kind, on ``host``), waiting
        up to ``timeout_s``; None on timeout."""
        if isinstance(predicate, str):
            kind = predicate
            predicate = lambda e: e.kind == kind and (host is None or e.host == host)  # noqa: E731
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for e in self.emitted:
                    if predicate(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def wait_heartbeats(self, count: int, timeout_s: float, *, min_step: int | None = None) -> bool:
        """Wait until ``count`` workers are running (and, with ``min_step``, have reported at
        least that step). True when reached."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                ok = [s for s in self._senders.values() if s.status == "running" and s.heartbeats
                      and (min_step is None or (s.last.get("step") is not None
                                                and s.last["step"] >= min_step))]
                if len(ok) >= count:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))

    # ----------------------------------------------------------------------------- internals
    def _emit(self, kind: str, *, host: str | None = None, rank: int | None = None,
              payload: Mapping[str, Any] | None = None) -> Event:
        payload = _clean(dict(payload or {}))
        t = time.time()
        try:
            eid = self.events.append(kind, job_id=self.job_id, host=host, rank=rank,
                                     payload=payload, time_s=t)
        except Exception as e:  # noqa: BLE001 - a full disk must not kill loss detection
            log.error("event log write failed (%s): %s %s", type(e).__name__, kind, host)
            eid = -1
        ev = Event(eid, t, self.job_id, kind, host, rank, payload)
        with self._cond:
            self.emitted.append(ev)
            callbacks = list(self._callbacks)
            self._cond.notify_all()
        for cb in callbacks:
            try:
                cb(ev)
            except Exception:  # noqa: BLE001
                log.exception("heartbeat event callback failed")
        return ev

    def _declare_lost(self, s: SenderState, reason: str, now: float,
                      extra: Mapping[str, Any] | None = None) -> None:
        """Mark every still-expected worker of ``s.host`` lost; emit ``host_lost`` once."""
        host = s.host
        since = None if s.last_seen is None else now - s.last_seen
        latency = now - s.loss_time if s.loss_time is not None else since
        ranks = []
        for o in self._senders.values():
            if o.host == host and o.status in ("running", "disconnected", "expected"):
                o.status, o.deadline = "lost", None
                ranks.append(o.rank)
        s.status, s.deadline = "lost", None
        if s.rank >= 0 and s.rank not in ranks:
            ranks.append(s.rank)
        if host in self._lost_hosts:
            return
        payload = {"reason": reason, "ranks": sorted(ranks),
                   "detection_latency_s": None if latency is None else round(latency, 4),
                   "since_last_heartbeat_s": None if since is None else round(since, 4),
                   "last_step": s.last.get("step"), "interval_s": self.interval_s,
                   "lost_after_s": self.lost_after_s, **dict(extra or {})}
        log.warning("job %s: host %s lost (%s), detected %.2fs after the loss", self.job_id,
                    host, reason, latency if latency is not None else float("nan"))
        self._lost_hosts[host] = self._emit(Kind.HOST_LOST, host=host,
                                            rank=s.rank if s.rank >= 0 else None, payload=payload)

    def _loop(self) -> None:
        """The server thread. Nothing a peer sends may end it: each connection's handling is
        guarded (a failure drops that connection only), and so is each turn of the loop."""
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as e:  # noqa: BLE001 - keep detecting losses whatever happened
                if self._stop.is_set():
                    return
                log.error("heartbeat server: %s in its loop (continuing)", type(e).__name__)
                time.sleep(0.05)

    def _turn(self) -> None:
        timeout = self._check_deadlines()
        self._resume_accepting()
        if self._accept_resume_at is not None:
            timeout = min(timeout, max(0.0, self._accept_resume_at - time.monotonic()))
        self._send_stops()
        try:
            ready = self._sel.select(timeout)
        except (OSError, ValueError):
            if self._stop.is_set():
                return
            raise
        for key, mask in ready:
            if key.data == "listen":
                self._accept()
            elif key.data == "wake":
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            else:
                c = key.data
                try:
                    if mask & selectors.EVENT_WRITE:
                        self._flush_out(c)
                    if mask & selectors.EVENT_READ and c.sock.fileno() >= 0:
                        self._read(c)
                except Exception as e:  # noqa: BLE001 - this connection only
                    self._reject(c, f"internal error handling the connection ({type(e).__name__})")

    # ------------------------------------------------------------------- server -> client lines
    def _send_line(self, c: _Conn, body: Mapping[str, Any]) -> None:
        """Queue one signed server line on ``c`` (server thread only) and try to write it."""
        if c.sock.fileno() < 0 or c.cnonce is None:
            return
        c.out_seq += 1
        msg = {"v": PROTOCOL_VERSION, "job": self.job_id, "seq": c.out_seq, "nonce": c.nonce,
               "cnonce": c.cnonce, "time": time.time(), **_clean(dict(body))}
        c.out += encode(self._out_key, msg)
        self._flush_out(c)

    def _flush_out(self, c: _Conn) -> None:
        while c.out:
            try:
                n = c.sock.send(c.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                c.out = b""
                return
            c.out = c.out[n:]
        try:
            self._sel.modify(c.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if c.out else 0), c)
        except (KeyError, ValueError, OSError):
            pass

    def _send_stops(self) -> None:
        with self._lock:
            req = self._stop_request
            if req is None:
                return
            conns = [c for c in self._conns.values() if c.sender is not None and not c.stop_sent]
        for c in conns:
            c.stop_sent = True
            self._send_line(c, {"type": "stop", **req})

    def _check_deadlines(self) -> float:
        """Declare overdue workers lost; returns how long the loop may sleep."""
        now = time.monotonic()
        nearest = now + 1.0
        summary = self.refusals.summary(now)
        if summary is not None:
            log.warning("heartbeat: %d more refused connections in the last %.0f s (from %d peers)",
                        summary["suppressed"], summary["window_s"], summary["peer_count"])
            self._emit(Kind.AUTH_FAILED_SUPPRESSED, payload=summary)
        due = self.refusals.next_due()
        if due is not None:
            nearest = min(nearest, due)
        with self._lock:
            for s in list(self._senders.values()):
                if s.deadline is None or s.status not in ("running", "disconnected", "expected"):
                    continue
                if now >= s.deadline:
                    reason = {"running": "heartbeat_timeout", "disconnected": "connection_closed",
                              "expected": "never_joined"}[s.status]
                    if s.status == "running":
                        s.loss_time = None  # unknown: the latency is the silence
                    self._declare_lost(s, reason, now)
                else:
                    nearest = min(nearest, s.deadline)
            for c in list(self._conns.values()):
                if c.sender is None:
                    if now - c.opened > self.auth_timeout_s:
                        self._reject(c, "no authenticated message in time")
                    else:
                        nearest = min(nearest, c.opened + self.auth_timeout_s)
        return max(0.0, nearest - time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # descriptors or buffers exhausted: the listening socket stays readable, so stop
                # watching it for a while (doubling up to ACCEPT_BACKOFF_S[1]) instead of spinning
                self._pause_accepting(e)
                return
            self._accept_pause = 0.0
            peer_s = f"{peer[0]}:{peer[1]}"
            pending = sum(1 for c in self._conns.values() if c.sender is None)
            if len(self._conns) >= self.max_connections or pending >= self.max_pending:
                sock.close()
                self._refused(peer_s, f"too many connections ({len(self._conns)} open, "
                                      f"{pending} not authenticated)")
                continue
            nonce = _secrets.token_hex(16)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(1.0)
                sock.sendall((json.dumps({"v": PROTOCOL_VERSION, "nonce": nonce}) + "\n").encode())
                sock.setblocking(False)
            except OSError:
                sock.close()
                continue
            c = _Conn(sock, peer_s, nonce, time.monotonic())
            with self._lock:
                self._conns[sock] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _pause_accepting(self, err: OSError) -> None:
        first, longest = ACCEPT_BACKOFF_S
        self._accept_pause = min(longest, max(first, 2 * self._accept_pause))
        self._accept_resume_at = time.monotonic() + self._accept_pause
        try:
            self._sel.unregister(self._listen)
        except (KeyError, ValueError, OSError):
            pass
        if self.refusals.admit(time.monotonic(), "accept", "accept failed"):
            log.warning("heartbeat accept failed (%s); not accepting for %.2f s",
                        err.strerror or type(err).__name__, self._accept_pause)

    def _resume_accepting(self) -> None:
        if self._accept_resume_at is None or time.monotonic() < self._accept_resume_at:
            return
        self._accept_resume_at = None
        try:
            self._sel.register(self._listen, selectors.EVENT_READ, "listen")
        except (KeyError, ValueError, OSError):
            pass

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._closed_by_peer(c)
            return
        c.buf += data
        while b"\n" in c.buf:
            line, c.buf = c.buf.split(b"\n", 1)
            if c.sock.fileno() < 0:
                return
            if not self._handle(c, line):
                return
        if len(c.buf) > MAX_LINE:
            self._reject(c, f"message longer than {MAX_LINE} bytes")

    def _handle(self, c: _Conn, line: bytes) -> bool:
        try:
            if len(line) > MAX_LINE:
                raise _Reject(f"message longer than {MAX_LINE} bytes")
            msg = self._verify(c, line)
        except _Reject as e:
            self._reject(c, e.reason)
            return False
        self._accept_message(c, msg)
        return True

    def _verify(self, c: _Conn, line: bytes) -> dict:
        outer = _json(line)
        if not (isinstance(outer, dict) and isinstance(outer.get("mac"), str)
                and isinstance(outer.get("msg"), str)):
            raise _Reject("malformed: expected {\"mac\", \"msg\"}")
        mac = outer["mac"]
        if len(mac) != 64 or not _HEX.issuperset(mac):
            raise _Reject("malformed: mac is not 64 hex digits")
        try:
            text = outer["msg"].encode()
        except UnicodeEncodeError:
            raise _Reject("malformed: msg is not valid UTF-8 text") from None
        want = hmac.new(self._key, text, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, mac):
            raise _Reject("bad MAC (wrong job secret or altered message)")
        try:
            msg = _json(outer["msg"])
        except _Reject:
            raise _Reject("malformed: authenticated text is not JSON") from None
        if not isinstance(msg, dict):
            raise _Reject("malformed: message is not an object")
        if msg.get("v") != PROTOCOL_VERSION:
            raise _Reject(f"protocol version {repr(msg.get('v'))[:40]} (want {PROTOCOL_VERSION})")
        if msg.get("job") != self.job_id:
            raise _Reject("message of another job")
        if msg.get("nonce") != c.nonce:
            raise _Reject("replayed message (nonce of another connection)")
        seq = msg.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq <= c.seq:
            raise _Reject("replayed or reordered message (seq did not increase)")
        host, rank = msg.get("host"), msg.get("rank")
        if not (isinstance(host, str) and 0 < len(host) <= MAX_HOST_NAME and isinstance(rank, int)
                and not isinstance(rank, bool) and 0 <= rank < MAX_RANK):
            raise _Reject("malformed: host and rank required")
        if c.sender is not None and c.sender != (host, rank):
            raise _Reject("a connection speaks for one worker only")
        if c.sender is None and self.placed_only:
            with self._lock:
                placed = (host, rank) in self._senders
            if not placed:
                raise _Reject(f"host {host[:64]!r} rank {rank} was not placed in this generation")
        cnonce = msg.get("cnonce")
        if not (isinstance(cnonce, str) and 16 <= len(cnonce) <= 128) or (
                c.cnonce is not None and cnonce != c.cnonce):
            raise _Reject("malformed: missing or changed client nonce")
        if msg.get("type") not in _TYPES:
            raise _Reject(f"unknown message type {repr(msg.get('type'))[:40]}")
        c.seq = seq
        return msg

    def _accept_message(self, c: _Conn, msg: dict) -> None:
        now = time.monotonic()
        host, rank, kind = msg["host"], msg["rank"], msg["type"]
        with self._lock:
            s = self._senders.get((host, rank))
            if s is None:
                s = self._senders[(host, rank)] = SenderState(host, rank)
            first_on_conn = c.sender is None
            c.sender = (host, rank)
            if first_on_conn:
                c.cnonce = msg["cnonce"]
                if self._stop_request is not None:
                    self._wake()  # the loop sends it the stop command
            if s.status == "lost" or host in self._lost_hosts:
                # a worker of a host already declared lost (it came back): record, don't revive
                if first_on_conn:
                    self._emit("worker_after_loss", host=host, rank=rank, payload={"peer": c.peer})
                s.last_seen = now
                if msg.get("metrics") is not None:  # steps it did train are still facts
                    self._record_metrics(c, host, rank, msg["metrics"], msg["seq"])
                return
            if first_on_conn:
                joined = s.joined_at is None
                s.joined_at = s.joined_at or now
                if s.status in ("expected", "disconnected", "running") or (
                        kind == "hello" and s.status in ("finished", "failed", "exited")):
                    s.status = "running"  # (a finished worker saying hello again: restarted)
                s.pid = msg.get("pid") if isinstance(msg.get("pid"), int) else s.pid
                self._emit(Kind.WORKER_JOINED if joined else Kind.WORKER_REJOINED, host=host,
                           rank=rank, payload={"peer": c.peer, "pid": s.pid})
            s.last_seen = now
            rows = msg.get("metrics")
            if rows is not None:
                self._record_metrics(c, host, rank, rows, msg["seq"])
            dropped = msg.get("metrics_dropped")
            if isinstance(dropped, int) and dropped > self._dropped_reported.get((host, rank), 0):
                self._dropped_reported[(host, rank)] = dropped
                self._emit("metrics_dropped", host=host, rank=rank, payload={"rows": dropped})
            if kind == "hb" and msg.get("notice") is not None:
                self._note_notice(host, rank, msg["notice"])
            if kind == "hb":
                body = {k: v for k, v in msg.items() if k not in ("nonce", "cnonce", "mac", "metrics", "notice")}
                s.last = body
                s.heartbeats += 1
                try:
                    self.events.append_heartbeat(body, job_id=self.job_id, host=host, rank=rank)
                except Exception as e:  # noqa: BLE001
                    log.error("event log write failed (%s)", type(e).__name__)
                self._cond.notify_all()
            elif kind == "bye":
                c.said_bye = True
                status = msg.get("status")
                failed = status not in ("ok", STOPPED)
                s.status, s.deadline = ("failed" if failed else "finished"), None
                payload = {"status": status, "last_step": msg.get("step")}
                if failed:
                    err = msg.get("error")
                    payload["error"] = err[-2000:] if isinstance(err, str) else None
                    cause = msg.get("cause")
                    payload["cause"] = cause if cause in FAILURE_CAUSES else "error"
                self._emit(Kind.WORKER_FAILED if failed else Kind.WORKER_FINISHED, host=host,
                           rank=rank, payload=payload)
            if s.status == "running":
                trained = s.last.get("step") is not None
                s.deadline = now + (self.lost_after_s if trained
                                    else max(self.lost_after_s, self.startup_grace_s))

    def _note_notice(self, host: str, rank: int, notice: Any) -> None:
        """A VM's own pre-emption notice (``HeartbeatClient.report_notice``): one
        ``preemption_notice`` event per host and deadline (payload ``deadline``, ``lead_s``,
        ``reason``, ``cloud``, ``kind``, ``source`` = ``"vm"``). Malformed notices are ignored
        (the message is authenticated; its worker keeps its connection)."""
        if not isinstance(notice, dict):
            return
        deadline, now = notice.get("deadline"), time.time()
        if not (isinstance(deadline, (int, float)) and not isinstance(deadline, bool)
                and math.isfinite(deadline) and now - 3600 < deadline < now + 86400):
            return
        kind = notice.get("kind") if notice.get("kind") in ("preempt", "rebalance") else "preempt"
        cloud = notice.get("cloud") if notice.get("cloud") in ("aws", "gcp", "azure") else "unknown"
        reason = notice.get("reason")
        reason = reason[:200] if isinstance(reason, str) else f"{cloud} pre-emption notice"
        last = self._notices.get(host)
        if last is not None and abs(last - deadline) <= 1.0:
            return
        self._notices[host] = float(deadline)
        self._emit(Kind.PREEMPTION_NOTICE, host=host, rank=rank, payload={
            "deadline": float(deadline), "lead_s": round(max(0.0, deadline - now), 1), "reason": reason,
            "cloud": cloud, "kind": kind, "source": "vm"})

    def _record_metrics(self, c: _Conn, host: str, rank: int, rows: Any, seq: int) -> None:
        """Append each new step's metrics row to the event log (once per step), then ack."""
        if not isinstance(rows, list):
            log.warning("metrics from %s rank %s ignored: not a list", host, rank)
            return
        for row in rows:
            step = row.get("step") if isinstance(row, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                log.warning("metrics row from %s rank %s ignored: no integer step", host, rank)
                continue
            if step in self._metric_steps:
                continue  # re-sent after a reconnect
            try:
                self.events.append_metric(step, row, job_id=self.job_id)
            except Exception as e:  # noqa: BLE001 - not acked: the client sends it again
                log.error("event log write failed (%s)", type(e).__name__)
                return
            self._metric_steps.add(step)
            self.metrics_recorded += 1
            self.last_metric_step = step if self.last_metric_step is None else max(self.last_metric_step, step)
        self._send_line(c, {"type": "ack", "ack": seq})
        self._cond.notify_all()

    def wait_metrics(self, step: int | None, timeout_s: float) -> bool:
        """Wait until the metrics row of ``step`` (None: of any step) is recorded; True when
        it is."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (not self._metric_steps) if step is None else (step not in self._metric_steps):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def _reject(self, c: _Conn, reason: str) -> None:
        """Refuse connection ``c`` (only it): a logged, rate-limited ``auth_failed`` row, then close."""
        self._refused(c.peer, reason, c.sender)   # recorded before the peer sees the close
        self._drop(c, quiet=True)

    def _refused(self, peer: str, reason: str, who: tuple[str, int] | None = None) -> None:
        if not self.refusals.admit(time.monotonic(), peer, reason):
            return
        log.warning("heartbeat from %s rejected: %s", peer, reason)
        who = who or (None, None)
        self._emit(Kind.AUTH_FAILED, host=who[0], rank=who[1], payload={"peer": peer, "reason": reason})

    def _closed_by_peer(self, c: _Conn) -> None:
        now = time.monotonic()
        self._drop(c, quiet=True)
        if c.sender is None or c.said_bye:
            return
        with self._lock:
            s = self._senders.get(c.sender)
            if s is None or s.status != "running":
                return
            # the worker's process (or its VM) closed the socket without a goodbye: it died,
            # unless it reconnects at once (a client-side network error)
            s.status, s.loss_time = "disconnected", now
            s.deadline = min(s.deadline or now + self.reconnect_grace_s, now + self.reconnect_grace_s)
            self._emit(Kind.WORKER_DISCONNECTED, host=s.host, rank=s.rank,
                       payload={"peer": c.peer, "since_last_heartbeat_s":
                                None if s.last_seen is None else round(now - s.last_seen, 4)})

    def _drop(self, c: _Conn, quiet: bool = False) -> None:
        with self._lock:
            self._conns.pop(c.sock, None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            c.sock.close()
        except OSError:
            pass


# ----------------------------------------------------------------------------------------- client
def _memory_bytes() -> tuple[int | None, int | None, int | None]:
    """(resident set size now, peak RSS, GPU bytes allocated if torch.cuda is in use)."""
    rss = None
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024
    gpu = None
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                gpu = int(torch.cuda.memory_allocated())
        except Exception:  # noqa: BLE001
            gpu = None
    return rss, peak, gpu


class _Wake:
    """A settable flag whose waiters can also watch a socket (``select`` on its read end)."""

    def __init__(self):
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)

    def set(self) -> None:
        try:
            self._w.send(b"x")
        except OSError:
            pass

    def clear(self) -> None:
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def fileno(self) -> int:
        return self._r.fileno()

    def close(self) -> None:
        for s in (self._r, self._w):
            try:
                s.close()
            except OSError:
                pass


class HeartbeatClient:
    """Sends this worker's heartbeats (and rank 0's per-step metrics) to the manager from a daemon
    thread, and receives the manager's ``stop`` command.

    ``HeartbeatClient(("10.0.0.4", 7000), secret, job_id=..., host="vm3", rank=5)``, or
    ``HeartbeatClient.from_env()`` (None when ``VARUNA_HEARTBEAT_ADDR`` is not set). ``start()``;
    call ``record_step(...)`` (and, on rank 0, ``record_metrics(row)``) after every training step;
    poll ``stop_requested`` at each mini-batch boundary; ``close(status=...)`` at the end. Never
    raises into the caller once started: network errors are retried with back-off.
    ``max_pending_metrics``: bound of the unacknowledged metrics queue (rows beyond it are
    dropped, counted in ``metrics_dropped`` and reported to the manager). ``orphan_after_s``
    (env ``VARUNA_ORPHAN_AFTER``): after this many seconds without a connection to the manager,
    ``stop_requested`` turns True by itself (reason ``"manager unreachable"``).
    """

    def __init__(self, address: tuple[str, int] | str, secret: Secret | str, *, job_id: str,
                 host: str, rank: int, interval_s: float = 2.0, connect_timeout_s: float = 5.0,
                 max_pending_metrics: int = 100_000, orphan_after_s: float | None = None):
        if isinstance(address, str):
            h, _, p = address.rpartition(":")
            address = (h.strip("[]"), int(p))
        self.address = (address[0], int(address[1]))
        secret = secret if isinstance(secret, Secret) else Secret(secret)
        self._key = derive_key(secret)
        self._in_key = derive_key(secret, "server")
        self.job_id, self.host, self.rank = job_id, host, int(rank)
        self.interval_s = float(interval_s)
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._nonce: str | None = None
        self._cnonce: str | None = None
        self._seq = 0
        self._in_seq = 0
        self._rbuf = b""
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._kick = _Wake()
        self._thread: threading.Thread | None = None
        self._state: dict[str, Any] = {"step": None}
        self._mlock = threading.Lock()
        self._pending: "collections.deque[dict]" = collections.deque()
        self._inflight: list[tuple[int, list[dict]]] = []
        self.max_pending_metrics = int(max_pending_metrics)
        self.metrics_dropped = 0
        self.metrics_acked = 0
        self._stop_command: dict[str, Any] | None = None
        self.sent = 0
        self.connects = 0
        self.closed = False
        self.orphan_after_s = orphan_after_s
        self._disconnected_since: float | None = time.monotonic()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, rank: int | None = None,
                 host: str | None = None) -> "HeartbeatClient | None":
        env = os.environ if env is None else env
        addr = env.get(ENV_ADDR)
        if not addr:
            return None
        token = env.get(ENV_TOKEN)
        if not token:
            raise RuntimeError(f"{ENV_ADDR} is set but {ENV_TOKEN} is not: the worker cannot "
                               "authenticate its heartbeats")
        return cls(addr, Secret(token), job_id=env.get("VARUNA_JOB_ID", ""),
                   host=host or env.get("VARUNA_HOST") or socket.gethostname(),
                   rank=int(env.get("RANK", "0")) if rank is None else rank,
                   interval_s=float(env.get(ENV_INTERVAL, "2.0")),
                   orphan_after_s=float(env[ENV_ORPHAN]) if env.get(ENV_ORPHAN) else None)

    # ------------------------------------------------------------------------------ feeding
    def record_step(self, step: int, *, loss: float | None = None,
                    compute_s: Mapping[str, float] | None = None, micro_batches: int = 1,
                    step_time_s: float | None = None, mem_bytes: int | None = None,
                    wait_s: Mapping[str, float] | None = None) -> None:
        """Store the latest step's numbers (sent with the next heartbeat). ``compute_s``: this
        stage's total seconds per action kind over the step (``{"F", "R", "B", "W"}``, as in
        ``StepResult.compute_s``; a split backward's B and W are sent as one backward); divided by ``micro_batches`` for per-micro-batch times.
        ``wait_s``: seconds the stage was blocked on an input over the step (``StepResult.wait_s``),
        sent as one total per step (``wait_s``), never counted as compute."""
        m = max(1, int(micro_batches))
        c = dict(compute_s or {})
        state = {"step": int(step), "loss": None if loss is None else float(loss),
                 "fwd_s": c["F"] / m if "F" in c else None,
                 "recompute_s": c["R"] / m if "R" in c else None,
                 "bwd_s": (c["B"] + c.get("W", 0.0)) / m if "B" in c else None,  # split: B + W
                 "micro_batches": m, "step_time_s": step_time_s}
        if wait_s is not None:
            state["wait_s"] = float(sum(float(v) for v in wait_s.values()))
        if mem_bytes is not None:
            state["mem_bytes"] = int(mem_bytes)
        first = self._state.get("step") is None
        self._state = state  # one atomic rebinding: the sender thread reads a consistent dict
        if first:
            self._kick.set()  # the first step goes out at once: the manager sees training start

    def report_notice(self, *, cloud: str, kind: str, deadline: float, reason: str) -> None:
        """A pre-emption notice seen on this VM (``cluster.notice.NoticeWatcher``): it rides on
        this and every later heartbeat (the next one goes out at once), so the manager learns it
        within a round trip and again after any reconnect. ``deadline``: Unix seconds."""
        self._state["notice"] = {"cloud": str(cloud)[:16], "kind": str(kind)[:16],
                                 "deadline": float(deadline), "reason": str(reason)[:200]}
        self._kick.set()

    def record_metrics(self, row: Mapping[str, Any]) -> None:
        """Queue one step's metrics row (a ``metrics.jsonl`` line: a JSON-able dict with an
        integer ``step``) for the manager's metrics table; sent with the next heartbeat and kept
        until the manager acknowledges it. Cheap; never blocks on the network."""
        if not isinstance(row.get("step"), int):
            raise ValueError(f"a metrics row needs an integer 'step', got {row.get('step')!r}")
        first = False
        with self._mlock:
            if len(self._pending) >= self.max_pending_metrics:
                self.metrics_dropped += 1
                return
            first = not self._pending and not self._inflight and self.metrics_acked == 0
            self._pending.append(_clean(dict(row)))
        if first:
            self._kick.set()

    @property
    def stop_requested(self) -> bool:
        """True once the manager sent the ``stop`` command — or, with ``orphan_after_s``, once
        the manager has been unreachable that long (the manager died: stop at a boundary with a
        checkpoint rather than train on as an orphan). Sticky."""
        if self._stop_command is None and self.orphan_after_s is not None:
            since = self._disconnected_since
            if since is not None and time.monotonic() - since > self.orphan_after_s:
                self._stop_command = {"type": "stop", "reason": "manager unreachable",
                                      "after_s": self.orphan_after_s}
                log.warning("the manager has been unreachable for %.0fs: stopping at the next "
                            "mini-batch boundary", self.orphan_after_s)
        return self._stop_command is not None

    @property
    def stop_reason(self) -> str | None:
        c = self._stop_command
        return None if c is None else c.get("reason")

    @property
    def pending_metrics(self) -> int:
        """Rows not yet acknowledged by the manager (queued or in flight)."""
        with self._mlock:
            return len(self._pending) + sum(len(r) for _, r in self._inflight)

    # ------------------------------------------------------------------------------ running
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> "HeartbeatClient":
        self._thread = threading.Thread(target=self._run, name="varuna-heartbeat", daemon=True)
        self._thread.start()
        return self

    def close(self, status: str = "ok", error: str | None = None, timeout_s: float = 5.0,
              cause: str | None = None) -> None:
        """Stop the thread, deliver the metrics not yet acknowledged (within ``timeout_s``) and
        say goodbye (``status`` "ok", "stopped", or "failed" with ``error``, e.g. the traceback's
        last line, and ``cause``, one of ``FAILURE_CAUSES``), so the manager does not take the
        exit for a lost VM."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._sock is None:
                        self._connect(deadline=deadline)
                    self._flush_metrics(deadline)
                    bye = {"type": "bye", "status": status, "step": self._state.get("step")}
                    if error:
                        bye["error"] = str(error)[-2000:]
                    if cause in FAILURE_CAUSES:
                        bye["cause"] = cause
                    self._send(bye)
                    break
                except Exception as e:  # noqa: BLE001
                    log.debug("heartbeat goodbye not delivered: %s", type(e).__name__)
                    self._disconnect()
                    if time.monotonic() >= deadline:
                        break
            self._disconnect()
        self._kick.close()

    def _run(self) -> None:
        backoff = 0.0  # the first retry is immediate (a dropped connection, not a dead manager)
        next_beat = time.monotonic()
        while not self._stop.is_set():
            try:
                with self._lock:
                    if self._sock is None:
                        self._connect(deadline=time.monotonic() + self.connect_timeout_s)
                        self._send({"type": "hello", "pid": os.getpid()})
                        next_beat = time.monotonic()
                    if time.monotonic() >= next_beat:
                        self._send_heartbeat()
                        next_beat = time.monotonic() + self.interval_s
                backoff = 0.0
                if self._wait(max(0.0, next_beat - time.monotonic())):
                    next_beat = time.monotonic()  # kicked: beat now
            except Exception as e:  # noqa: BLE001 - never let the heartbeat thread die
                log.debug("heartbeat to %s:%d failed (%s); retrying", *self.address, type(e).__name__)
                with self._lock:
                    self._disconnect()
                self._stop.wait(backoff)
                backoff = min(max(0.05, backoff * 2), self.interval_s)

    def _wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` s, handling server lines as they come; True when kicked."""
        deadline = time.monotonic() + timeout
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sock = self._sock
            fds = [self._kick] + ([sock] if sock is not None else [])
            ready, _, _ = select.select(fds, [], [], left)
            if self._kick in ready:
                self._kick.clear()
                return True
            if sock is not None and sock in ready:
                with self._lock:
                    self._read_server()
        return True

    def _read_server(self, block_s: float = 0.0) -> None:
        """Read what the server sent (waiting up to ``block_s``) and handle every whole line."""
        sock = self._sock
        if sock is None:
            raise ConnectionError("not connected")
        sock.settimeout(block_s if block_s > 0 else 0.0)
        try:
            data = sock.recv(65536)
        except (BlockingIOError, socket.timeout):
            return
        finally:
            try:
                sock.settimeout(max(1.0, self.interval_s))
            except OSError:
                pass
        if not data:
            raise ConnectionError("the manager closed the heartbeat connection")
        self._rbuf += data
        if len(self._rbuf) > MAX_LINE:
            raise ValueError("server line too long")
        while b"\n" in self._rbuf:
            line, self._rbuf = self._rbuf.split(b"\n", 1)
            self._handle_server_line(line)

    def _handle_server_line(self, line: bytes) -> None:
        outer = json.loads(line)
        if not (isinstance(outer, dict) and isinstance(outer.get("mac"), str)
                and isinstance(outer.get("msg"), str)):
            raise ValueError("malformed server line")
        want = hmac.new(self._in_key, outer["msg"].encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, outer["mac"]):
            raise ValueError("server line with a bad MAC")
        msg = json.loads(outer["msg"])
        if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION or msg.get("job") != self.job_id:
            raise ValueError("server line of another protocol or job")
        if msg.get("nonce") != self._nonce or msg.get("cnonce") != self._cnonce:
            raise ValueError("replayed server line (nonce of another connection)")
        seq = msg.get("seq")
        if not isinstance(seq, int) or seq <= self._in_seq:
            raise ValueError("replayed server line (seq did not increase)")
        self._in_seq = seq
        kind = msg.get("type")
        if kind == "ack":
            ack = msg.get("ack")
            if isinstance(ack, int):
                with self._mlock:
                    done = [rows for s, rows in self._inflight if s <= ack]
                    self._inflight = [(s, rows) for s, rows in self._inflight if s > ack]
                    self.metrics_acked += sum(len(r) for r in done)
        elif kind == "stop":
            if self._stop_command is None:
                self._stop_command = {k: v for k, v in msg.items()
                                      if k not in ("v", "job", "seq", "nonce", "cnonce")}
                log.info("the manager asks this worker to stop: %s", msg.get("reason"))

    def _connect(self, deadline: float) -> None:
        sock = socket.create_connection(self.address, timeout=max(0.1, deadline - time.monotonic()))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = b""
            while b"\n" not in buf:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                chunk = sock.recv(4096)
                if not chunk:
                    raise ConnectionError("server closed the connection before its greeting")
                buf += chunk
                if len(buf) > 4096:
                    raise ValueError("greeting too long")
            first, _, rest = buf.partition(b"\n")
            hello = json.loads(first)
            if not isinstance(hello, dict) or not isinstance(hello.get("nonce"), str):
                raise ValueError("not a varuna heartbeat server")
            sock.settimeout(max(1.0, self.interval_s))
        except BaseException:
            sock.close()
            raise
        self._sock, self._nonce, self._seq = sock, hello["nonce"], 0
        self._cnonce, self._in_seq, self._rbuf = _secrets.token_hex(16), 0, rest
        self.connects += 1
        self._disconnected_since = None

    def _send(self, body: Mapping[str, Any]) -> int:
        self._seq += 1
        msg = {"v": PROTOCOL_VERSION, "job": self.job_id, "host": self.host, "rank": self.rank,
               "seq": self._seq, "nonce": self._nonce, "cnonce": self._cnonce, "time": time.time(),
               **_clean(dict(body))}
        self._sock.sendall(encode(self._key, msg))
        self.sent += 1
        return self._seq

    def _take_metrics(self) -> list[dict]:
        """Rows for one line: as many queued rows as fit in ``METRICS_BUDGET`` bytes (at least
        one)."""
        rows, size = [], 0
        with self._mlock:
            while self._pending:
                n = len(json.dumps(self._pending[0], default=str)) + 1
                if rows and size + n > METRICS_BUDGET:
                    break
                rows.append(self._pending.popleft())
                size += n
        return rows

    def _send_with_metrics(self, body: dict[str, Any]) -> None:
        rows = self._take_metrics()
        if rows:
            body["metrics"] = rows
        if self.metrics_dropped:
            body["metrics_dropped"] = self.metrics_dropped
        try:
            seq = self._send(body)
        except BaseException:
            if rows:
                with self._mlock:
                    self._pending.extendleft(reversed(rows))
            raise
        if rows:
            with self._mlock:
                self._inflight.append((seq, rows))

    def _send_heartbeat(self) -> None:
        state = dict(self._state)
        rss, peak, gpu = _memory_bytes()
        state.setdefault("mem_bytes", gpu if gpu is not None else rss)
        state.update({"type": "hb", "rss_bytes": rss, "peak_rss_bytes": peak,
                      "gpu_bytes": gpu})
        self._send_with_metrics(state)
        for _ in range(64):  # a backlog (after a reconnect) follows at once
            with self._mlock:
                if not self._pending:
                    break
            self._send_with_metrics({"type": "metrics"})

    def _flush_metrics(self, deadline: float) -> None:
        """Send every queued row and wait for the acknowledgements (until ``deadline``)."""
        while True:
            with self._mlock:
                more = bool(self._pending)
            if not more:
                break
            self._send_with_metrics({"type": "metrics"})
        while time.monotonic() < deadline:
            with self._mlock:
                if not self._inflight:
                    return
            self._read_server(block_s=min(0.2, max(0.01, deadline - time.monotonic())))

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            if self._disconnected_since is None:
                self._disconnected_since = time.monotonic()
        self._sock = None
        with self._mlock:  # unacknowledged rows go out again on the next connection
            for _, rows in reversed(self._inflight):
                self._pending.extendleft(reversed(rows))
            self._inflight = []
