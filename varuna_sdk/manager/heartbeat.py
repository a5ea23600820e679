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
  network cut, pre-empted without a notice);
- a worker's connection closed without a goodbye (its process died — killed, OOM, VM gone) and
  it did not reconnect within ``reconnect_grace_s`` (default half an interval);
- the launcher reports that a worker's process died (``report_exit``) or that the VM is gone
  (``report_lost``);
- a worker announced with ``expect(...)`` never joined within its start-up allowance (a VM lost
  during bootstrap).

Wire format — JSON lines, never pickle. On accept the server sends ``{"v":1,"nonce":HEX}``.
Each client line is ``{"mac": HEX, "msg": TEXT}`` where ``TEXT`` is a JSON object (``v``,
``type`` = ``hello``/``hb``/``bye``, ``job``, ``host``, ``rank``, ``seq``, ``nonce``, ``time``
and the type's fields) and ``mac = HMAC-SHA256(key, TEXT)`` with
``key = HMAC-SHA256(job secret, "varuna-heartbeat-v1")``. The server checks the MAC (constant
time) *before* parsing ``TEXT``; then the job id, the connection's nonce (no replay from another
connection) and a strictly increasing ``seq`` (no replay within one). Any failure — bad MAC,
malformed, oversized, wrong job, replay — is recorded as an ``auth_failed`` event (peer address
and reason, never the message or the secret) and the connection is closed. The job secret is a
``Secret``: it is never logged, stored in the event log or put in an exception.

Environment contract for workers (``HeartbeatServer.worker_env()`` makes it; the launcher adds
``VARUNA_JOB_TOKEN``, ``VARUNA_JOB_ID``, ``VARUNA_HOST``, ``RANK``):
``VARUNA_HEARTBEAT_ADDR=host:port``, ``VARUNA_HEARTBEAT_INTERVAL=seconds``.

Owns ``HeartbeatServer``, ``HeartbeatClient``, ``SenderState``, the wire format (``encode``,
``derive_key``). Imports the standard library, ``manager.events`` and ``cluster.hosts``
(``Secret``) only; never torch (the client reads GPU memory only if the worker already imported
torch).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import resource
import secrets as _secrets
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
_KDF_LABEL = b"varuna-heartbeat-v1"
_TYPES = ("hello", "hb", "bye")


# ------------------------------------------------------------------------------------ wire format
def derive_key(secret: Secret | str) -> bytes:
    """The MAC key of a job secret (domain-separated, so the raw token is never the key)."""
    raw = secret.reveal() if isinstance(secret, Secret) else secret
    if not raw:
        raise ValueError("the job secret is empty")
    return hmac.new(raw.encode(), _KDF_LABEL, hashlib.sha256).digest()


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
        self.opened = now
        self.said_bye = False


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
                 on_event: Callable[[Event], None] | None = None):
        if not isinstance(secret, Secret):
            raise TypeError("secret must be a Secret (so that it can never be printed)")
        if interval_s <= 0 or miss_limit < 1:
            raise ValueError("interval_s must be > 0 and miss_limit >= 1")
        self.job_id = job_id
        self._key = derive_key(secret)
        self.events = events
        self.interval_s = float(interval_s)
        self.lost_after_s = float(miss_limit) * self.interval_s
        self.reconnect_grace_s = (0.5 * self.interval_s if reconnect_grace_s is None
                                  else float(reconnect_grace_s))
        self.auth_timeout_s = auth_timeout_s
        self.max_connections = max_connections
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
        did). A worker that said goodbye, or one we are stopping, just gets ``worker_exited``;
        any other is a process death: its host is declared lost now."""
        now = time.monotonic()
        with self._lock:
            s = self._senders.setdefault((host, rank), SenderState(host, rank))
            self._emit(Kind.WORKER_EXITED, host=host, rank=rank,
                       payload={"exit_code": exit_code, "status_before": s.status})
            if s.status in ("running", "disconnected", "expected"):
                s.loss_time = now if at is None else at
                reason = "worker_process_died" if exit_code is not None else "vm_unreachable"
                self._declare_lost(s, reason, now, extra={"exit_code": exit_code})
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
        while not self._stop.is_set():
            timeout = self._check_deadlines()
            try:
                ready = self._sel.select(timeout)
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                raise
            for key, _ in ready:
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                else:
                    self._read(key.data)

    def _check_deadlines(self) -> float:
        """Declare overdue workers lost; returns how long the loop may sleep."""
        now = time.monotonic()
        nearest = now + 1.0
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
                log.warning("heartbeat accept failed: %s", e)
                return
            peer_s = f"{peer[0]}:{peer[1]}"
            if len(self._conns) >= self.max_connections:
                sock.close()
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
        try:
            outer = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise _Reject("malformed: not a JSON line") from None
        if not (isinstance(outer, dict) and isinstance(outer.get("mac"), str)
                and isinstance(outer.get("msg"), str)):
            raise _Reject("malformed: expected {\"mac\", \"msg\"}")
        want = hmac.new(self._key, outer["msg"].encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, outer["mac"]):
            raise _Reject("bad MAC (wrong job secret or altered message)")
        try:
            msg = json.loads(outer["msg"])
        except ValueError:
            raise _Reject("malformed: authenticated text is not JSON") from None
        if not isinstance(msg, dict):
            raise _Reject("malformed: message is not an object")
        if msg.get("v") != PROTOCOL_VERSION:
            raise _Reject(f"protocol version {msg.get('v')!r} (want {PROTOCOL_VERSION})")
        if msg.get("job") != self.job_id:
            raise _Reject("message of another job")
        if msg.get("nonce") != c.nonce:
            raise _Reject("replayed message (nonce of another connection)")
        seq = msg.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq <= c.seq:
            raise _Reject("replayed or reordered message (seq did not increase)")
        host, rank = msg.get("host"), msg.get("rank")
        if not (isinstance(host, str) and host and isinstance(rank, int) and not isinstance(rank, bool)):
            raise _Reject("malformed: host and rank required")
        if c.sender is not None and c.sender != (host, rank):
            raise _Reject("a connection speaks for one worker only")
        if msg.get("type") not in _TYPES:
            raise _Reject(f"unknown message type {msg.get('type')!r}")
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
            if s.status == "lost" or host in self._lost_hosts:
                # a worker of a host already declared lost (it came back): record, don't revive
                if first_on_conn:
                    self._emit("worker_after_loss", host=host, rank=rank, payload={"peer": c.peer})
                s.last_seen = now
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
            if s.status in ("running",):
                s.deadline = now + self.lost_after_s
            if kind == "hb":
                body = {k: v for k, v in msg.items() if k not in ("nonce", "mac")}
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
                failed = status != "ok"
                s.status, s.deadline = ("failed" if failed else "finished"), None
                payload = {"status": status, "last_step": msg.get("step")}
                if failed:
                    err = msg.get("error")
                    payload["error"] = err[-2000:] if isinstance(err, str) else None
                self._emit(Kind.WORKER_FAILED if failed else Kind.WORKER_FINISHED, host=host,
                           rank=rank, payload=payload)

    def _reject(self, c: _Conn, reason: str) -> None:
        log.warning("heartbeat from %s rejected: %s", c.peer, reason)
        who = c.sender or (None, None)
        self._emit(Kind.AUTH_FAILED, host=who[0], rank=who[1],
                   payload={"peer": c.peer, "reason": reason})
        self._drop(c, quiet=True)

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


class HeartbeatClient:
    """Sends this worker's heartbeats to the manager from a daemon thread.

    ``HeartbeatClient(("10.0.0.4", 7000), secret, job_id=..., host="vm3", rank=5)``, or
    ``HeartbeatClient.from_env()`` (None when ``VARUNA_HEARTBEAT_ADDR`` is not set). ``start()``;
    call ``record_step(...)`` after every training step; ``close(status=...)`` at the end.
    Never raises into the caller once started: network errors are retried with back-off.
    """

    def __init__(self, address: tuple[str, int] | str, secret: Secret | str, *, job_id: str,
                 host: str, rank: int, interval_s: float = 2.0, connect_timeout_s: float = 5.0):
        if isinstance(address, str):
            h, _, p = address.rpartition(":")
            address = (h.strip("[]"), int(p))
        self.address = (address[0], int(address[1]))
        self._key = derive_key(secret if isinstance(secret, Secret) else Secret(secret))
        self.job_id, self.host, self.rank = job_id, host, int(rank)
        self.interval_s = float(interval_s)
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._nonce: str | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: dict[str, Any] = {"step": None}
        self.sent = 0
        self.connects = 0
        self.closed = False

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
                   interval_s=float(env.get(ENV_INTERVAL, "2.0")))

    # ------------------------------------------------------------------------------ feeding
    def record_step(self, step: int, *, loss: float | None = None,
                    compute_s: Mapping[str, float] | None = None, micro_batches: int = 1,
                    step_time_s: float | None = None, mem_bytes: int | None = None) -> None:
        """Store the latest step's numbers (sent with the next heartbeat). ``compute_s``: this
        stage's total seconds per action kind over the step (``{"F", "R", "B"}``, as in
        ``StepResult.compute_s``); divided by ``micro_batches`` for per-micro-batch times."""
        m = max(1, int(micro_batches))
        c = dict(compute_s or {})
        state = {"step": int(step), "loss": None if loss is None else float(loss),
                 "fwd_s": c["F"] / m if "F" in c else None,
                 "recompute_s": c["R"] / m if "R" in c else None,
                 "bwd_s": c["B"] / m if "B" in c else None,
                 "micro_batches": m, "step_time_s": step_time_s}
        if mem_bytes is not None:
            state["mem_bytes"] = int(mem_bytes)
        first = self._state.get("step") is None
        self._state = state  # one atomic rebinding: the sender thread reads a consistent dict
        if first:
            self._kick.set()  # the first step goes out at once: the manager sees training start

    # ------------------------------------------------------------------------------ running
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> "HeartbeatClient":
        self._thread = threading.Thread(target=self._run, name="varuna-heartbeat", daemon=True)
        self._thread.start()
        return self

    def close(self, status: str = "ok", error: str | None = None, timeout_s: float = 2.0) -> None:
        """Stop the thread and say goodbye (``status`` "ok", or "failed" with ``error``, e.g.
        the traceback's last line), so the manager does not take the exit for a lost VM."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            try:
                if self._sock is None:
                    self._connect(deadline=time.monotonic() + timeout_s)
                bye = {"type": "bye", "status": status, "step": self._state.get("step")}
                if error:
                    bye["error"] = str(error)[-2000:]
                self._send(bye)
            except Exception as e:  # noqa: BLE001
                log.debug("heartbeat goodbye not delivered: %s", type(e).__name__)
            finally:
                self._disconnect()

    def _run(self) -> None:
        backoff = min(0.2, self.interval_s)
        while not self._stop.is_set():
            try:
                with self._lock:
                    if self._sock is None:
                        self._connect(deadline=time.monotonic() + self.connect_timeout_s)
                        self._send({"type": "hello", "pid": os.getpid()})
                    self._send_heartbeat()
                backoff = min(0.2, self.interval_s)
                wait = self.interval_s
            except Exception as e:  # noqa: BLE001 - never let the heartbeat thread die
                log.debug("heartbeat to %s:%d failed (%s); retrying", *self.address, type(e).__name__)
                with self._lock:
                    self._disconnect()
                wait, backoff = backoff, min(backoff * 2, self.interval_s)
            self._kick.wait(wait)
            self._kick.clear()

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
            hello = json.loads(buf.split(b"\n", 1)[0])
            if not isinstance(hello, dict) or not isinstance(hello.get("nonce"), str):
                raise ValueError("not a varuna heartbeat server")
            sock.settimeout(max(1.0, self.interval_s))
        except BaseException:
            sock.close()
            raise
        self._sock, self._nonce, self._seq = sock, hello["nonce"], 0
        self.connects += 1

    def _send(self, body: Mapping[str, Any]) -> None:
        self._seq += 1
        msg = {"v": PROTOCOL_VERSION, "job": self.job_id, "host": self.host, "rank": self.rank,
               "seq": self._seq, "nonce": self._nonce, "time": time.time(), **_clean(dict(body))}
        self._sock.sendall(encode(self._key, msg))
        self.sent += 1

    def _send_heartbeat(self) -> None:
        state = dict(self._state)
        rss, peak, gpu = _memory_bytes()
        state.setdefault("mem_bytes", gpu if gpu is not None else rss)
        state.update({"type": "hb", "rss_bytes": rss, "peak_rss_bytes": peak,
                      "gpu_bytes": gpu})
        self._send(state)

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
