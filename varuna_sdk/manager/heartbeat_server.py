"""The manager's heartbeat server: one thread with a ``selectors`` loop that accepts the workers'
TCP connections, authenticates every line (``manager.wire``), records each heartbeat in the job's
``EventLog`` and declares a host lost when its workers go quiet (the rules and the per-worker
state live in ``manager.loss_detection.LossDetector``, which ``HeartbeatServer`` extends).

**Metrics**: a message's metrics rows are appended to the event log's metrics table once per step
and the line is acknowledged (``{"type": "ack", "ack": seq}``), so the client can drop them.

**Stop command** (server → client): ``HeartbeatServer.request_stop(reason)`` sends every worker
(and every worker that connects later) a signed ``stop`` line; the client then reports
``stop_requested`` = True, which the training loop polls at each mini-batch boundary. Unlike a
signal, it reaches workers on every VM over the channel that is already authenticated.

**Refusals**: any failure — bad MAC, malformed, oversized, wrong job, replay, a (host, rank) the
generation never placed (``placed_only``), or any exception while handling it — refuses that
connection only: it is closed and recorded as an ``auth_failed`` event (peer address and reason,
never the message or the secret), at most ``REFUSAL_ROWS_PER_MIN`` rows a minute, the rest
counted in one ``auth_failed_suppressed`` row per minute (``RefusalBudget``). The server holds at
most ``connection_limit()`` connections (below half the descriptor limit; unauthenticated ones at
most half of that), and when ``accept`` fails (descriptors exhausted) it stops watching the
listening socket for a doubling pause (``ACCEPT_BACKOFF_S``: 0.05–2 s) instead of spinning. The
job secret is a ``Secret``: it is never logged, stored in the event log or put in an exception.

Owns ``HeartbeatServer``, ``RefusalBudget``, ``connection_limit``. Imports the standard library,
``cluster.hosts`` (``Secret``), ``manager.events``, ``manager.wire`` and
``manager.loss_detection`` only; must never import the client, torch or anything above the
manager. Workers never import this module.
"""

from __future__ import annotations

import collections
import logging
import resource
import secrets as _secrets
import selectors
import socket
import threading
import time
from typing import Any, Callable, Mapping

from ..cluster.hosts import Secret
from .events import Event, EventLog, Kind
from .loss_detection import LossDetector
from .wire import (CLIENT_TYPES, ENV_ADDR, ENV_INTERVAL, MAX_LINE, WireError, check_envelope,
                   check_sender, derive_key, greeting, json_safe, open_line, seal)

log = logging.getLogger(__name__)

REFUSAL_ROWS_PER_MIN = 30     # auth_failed rows per minute at most; the rest are counted
REFUSAL_WINDOW_S = 60.0
ACCEPT_BACKOFF_S = (0.05, 2.0)  # accept errors (descriptors exhausted): first and longest pause


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


class _Conn:
    """One worker connection on the server: its socket, the nonces, the sequence numbers of each
    direction and the server lines not yet written."""

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


class HeartbeatServer(LossDetector):
    """Receives the workers' heartbeats of job ``job_id`` and declares lost hosts.

    ``HeartbeatServer(job_id, secret, event_log, interval_s=2.0).start()``; give the workers
    ``worker_env()`` (plus the secret as ``VARUNA_JOB_TOKEN``); ``close()`` when the job ends.
    Thread-safe: ``expect``, ``report_exit``, ``report_lost``, ``stop_expecting``, ``senders``
    and ``wait_for`` may be called from any thread. ``on_event(event)`` callbacks run on the
    server thread (keep them short). Raises ``TypeError`` when ``secret`` is not a ``Secret``,
    ``ValueError`` for a bad interval or ``bind=0.0.0.0`` without ``advertise``, ``OSError``
    when the port cannot be bound.
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
        super().__init__(job_id, events, interval_s=interval_s, miss_limit=miss_limit,
                         reconnect_grace_s=reconnect_grace_s, startup_grace_s=startup_grace_s,
                         on_event=on_event)
        self._key = derive_key(secret)
        self._out_key = derive_key(secret, "server")
        self.auth_timeout_s = auth_timeout_s
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
        self._conns: dict[socket.socket, _Conn] = {}
        self._stop_request: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> "HeartbeatServer":
        """Start the server thread (and emit ``heartbeat_server_started``); returns ``self``."""
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
        """Stop the thread, close every connection and the port (``heartbeat_server_stopped``);
        idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(5.0)
        for c in list(self._conns.values()):
            self._drop(c)
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

    def request_stop(self, reason: str, **payload: Any) -> None:
        """Ask every worker — connected now or later — to stop at its next mini-batch boundary
        (a signed ``stop`` line on its heartbeat connection; the client's ``stop_requested``
        becomes True). Recorded as a ``stop_requested`` event; repeated calls are no-ops."""
        with self._lock:
            if self._stop_request is not None:
                return
            self._stop_request = {"reason": str(reason), **json_safe(dict(payload))}
        self._emit(Kind.STOP_REQUESTED, payload=self._stop_request)
        self._wake()

    @property
    def stop_requested(self) -> bool:
        """True once ``request_stop`` was called."""
        return self._stop_request is not None

    # ------------------------------------------------------------------------------- the loop
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

    def _check_deadlines(self) -> float:
        """Declare overdue workers lost, refuse connections silent past ``auth_timeout_s``, write
        the refusal summary that fell due; returns how long the loop may sleep (s)."""
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
            nearest = self._check_senders(now, nearest)
            for c in list(self._conns.values()):
                if c.sender is None:
                    if now - c.opened > self.auth_timeout_s:
                        self._reject(c, "no authenticated message in time")
                    else:
                        nearest = min(nearest, c.opened + self.auth_timeout_s)
        return max(0.0, nearest - time.monotonic())

    # ------------------------------------------------------------------- server -> client lines
    def _send_line(self, c: _Conn, body: Mapping[str, Any]) -> None:
        """Queue one signed server line on ``c`` (server thread only) and try to write it."""
        if c.sock.fileno() < 0 or c.cnonce is None:
            return
        c.out_seq += 1
        c.out += seal(self._out_key, body, job=self.job_id, seq=c.out_seq, nonce=c.nonce,
                      cnonce=c.cnonce)
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

    # ------------------------------------------------------------------------------ accepting
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
                sock.sendall(greeting(nonce))
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

    # -------------------------------------------------------------------------------- reading
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
                raise WireError(f"message longer than {MAX_LINE} bytes")
            msg = self._verify(c, line)
        except WireError as e:
            self._reject(c, e.reason)
            return False
        self._accept_message(c, msg)
        return True

    def _verify(self, c: _Conn, line: bytes) -> dict:
        """The message of one client line on ``c``: signed with the job's client key, of this job
        and connection, in order, from the one worker the connection speaks for (and, with
        ``placed_only``, one the generation placed). Raises ``WireError``."""
        msg = open_line(self._key, line)
        seq = check_envelope(msg, job_id=self.job_id, nonce=c.nonce, last_seq=c.seq)
        host, rank = check_sender(msg)
        if c.sender is not None and c.sender != (host, rank):
            raise WireError("a connection speaks for one worker only")
        if c.sender is None and self.placed_only:
            with self._lock:
                placed = (host, rank) in self._senders
            if not placed:
                raise WireError(f"host {host[:64]!r} rank {rank} was not placed in this generation")
        cnonce = msg.get("cnonce")
        if not (isinstance(cnonce, str) and 16 <= len(cnonce) <= 128) or (
                c.cnonce is not None and cnonce != c.cnonce):
            raise WireError("malformed: missing or changed client nonce")
        if msg.get("type") not in CLIENT_TYPES:
            raise WireError(f"unknown message type {repr(msg.get('type'))[:40]}")
        c.seq = seq
        return msg

    def _accept_message(self, c: _Conn, msg: dict) -> None:
        """Bind ``c`` to its worker on its first message, apply the message to the worker's
        state (``LossDetector``) and acknowledge recorded metrics."""
        with self._lock:
            first_on_conn = c.sender is None
            c.sender = (msg["host"], msg["rank"])
            if first_on_conn:
                c.cnonce = msg["cnonce"]
                if self._stop_request is not None:
                    self._wake()  # the loop sends it the stop command
            if msg["type"] == "bye":
                c.said_bye = True
            if self._worker_message(msg, first_on_conn=first_on_conn, peer=c.peer):
                self._send_line(c, {"type": "ack", "ack": msg["seq"]})

    # ------------------------------------------------------------------------------- closing
    def _reject(self, c: _Conn, reason: str) -> None:
        """Refuse connection ``c`` (only it): a logged, rate-limited ``auth_failed`` row, then close."""
        self._refused(c.peer, reason, c.sender)   # recorded before the peer sees the close
        self._drop(c)

    def _refused(self, peer: str, reason: str, who: tuple[str, int] | None = None) -> None:
        if not self.refusals.admit(time.monotonic(), peer, reason):
            return
        log.warning("heartbeat from %s rejected: %s", peer, reason)
        who = who or (None, None)
        self._emit(Kind.AUTH_FAILED, host=who[0], rank=who[1], payload={"peer": peer, "reason": reason})

    def _closed_by_peer(self, c: _Conn) -> None:
        now = time.monotonic()
        self._drop(c)
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

    def _drop(self, c: _Conn) -> None:
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
