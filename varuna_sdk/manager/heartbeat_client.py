"""What a worker runs to report to the manager: ``HeartbeatClient``, a daemon thread inside each
worker that connects to the manager's ``HeartbeatServer`` (``manager.heartbeat_server``) over TCP
and speaks the wire format of ``manager.wire``.

Every ``interval_s`` it sends the worker's latest step, loss, per-micro-batch forward /
recompute / backward compute seconds, step time and memory. The training loop feeds it with
``record_step(...)`` (cheap: it only stores numbers); the thread does all network work,
reconnects with back-off, and never raises into training. On exit the worker says goodbye
(``close(status="ok" | "stopped" | "failed", error=...)``), so a clean end or a Python exception
is never mistaken for a lost VM.

**Metrics** (``record_metrics``, rank 0): every training step's metrics row (the
``metrics.jsonl`` line) rides on the next heartbeat (``"metrics": [row, ...]``; a backlog too big
for one line follows at once in ``"metrics"`` messages). The client keeps every row until the
server acknowledges it and sends unacknowledged rows again after a reconnect (and flushes them
before its goodbye), so no step is dropped while the manager is reachable. The queue is bounded
(``max_pending_metrics``); rows dropped because it overflowed (a manager unreachable for that
many steps) are counted and reported (``metrics_dropped`` event).

**Pre-emption notices from the VM** (``report_notice``, fed by the notice watcher of
``cluster.notice`` on the first worker of each VM): a heartbeat carries
``"notice": {"cloud", "kind", "deadline", "reason"}``; the server turns it into one
``preemption_notice`` event per host and deadline.

**Stop command**: a signed ``stop`` line from the server makes ``stop_requested`` True, which the
training loop polls at each mini-batch boundary (``run_worker(should_stop=...)``: the workers
agree, checkpoint and end with ``bye`` status ``"stopped"``). The client checks every server line
(MAC under the server direction's key, job, both nonces — its own fresh ``cnonce`` stops a
replayed ``stop`` of an earlier connection — and an increasing ``seq``) and drops a connection
that sends a bad line.

Owns ``HeartbeatClient``. Imports the standard library, ``cluster.hosts`` (``Secret``) and
``manager.wire`` only; must never import the server, ``manager.loss_detection``,
``manager.events``, ``manager.manager`` or torch (workers load it before torch; the client reads
GPU memory only if the worker already imported torch).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import resource
import secrets as _secrets
import select
import socket
import sys
import threading
import time
from typing import Any, Mapping

from ..cluster.hosts import Secret
from .wire import (ENV_ADDR, ENV_INTERVAL, ENV_ORPHAN, ENV_TOKEN, FAILURE_CAUSES, MAX_LINE,
                   METRICS_BUDGET, WireError, check_envelope, derive_key, json_safe,
                   open_line, read_greeting, seal)

log = logging.getLogger(__name__)


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
        """Raise the flag (wakes a ``select`` on ``fileno()``)."""
        try:
            self._w.send(b"x")
        except OSError:
            pass

    def clear(self) -> None:
        """Lower the flag."""
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def fileno(self) -> int:
        """The read end's descriptor, for ``select``."""
        return self._r.fileno()

    def close(self) -> None:
        """Close both ends."""
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
        """A client configured from the worker's environment (``manager.wire``'s ``ENV_*``;
        ``VARUNA_JOB_ID``, ``VARUNA_HOST``, ``RANK``), not started; None when
        ``VARUNA_HEARTBEAT_ADDR`` is not set. Raises ``RuntimeError`` when the address is set but
        ``VARUNA_JOB_TOKEN`` is not."""
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
            self._pending.append(json_safe(dict(row)))
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
        """Why the worker is asked to stop (the ``stop`` command's ``reason``); None before."""
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
        """True once ``start()`` was called."""
        return self._thread is not None

    def start(self) -> "HeartbeatClient":
        """Start the sender thread (it connects, says hello and beats); returns ``self``."""
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
        """Check one server line (``manager.wire``: MAC under the server key, job, both nonces of
        this connection, increasing ``seq``) and apply it: ``ack`` releases acknowledged metrics
        rows, ``stop`` sets the stop command. Raises ``WireError`` (the caller drops the
        connection)."""
        msg = open_line(self._in_key, line)
        seq = check_envelope(msg, job_id=self.job_id, nonce=self._nonce, last_seq=self._in_seq)
        if msg.get("cnonce") != self._cnonce:
            raise WireError("replayed server line (client nonce of another connection)")
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
            nonce = read_greeting(first)
            sock.settimeout(max(1.0, self.interval_s))
        except BaseException:
            sock.close()
            raise
        self._sock, self._nonce, self._seq = sock, nonce, 0
        self._cnonce, self._in_seq, self._rbuf = _secrets.token_hex(16), 0, rest
        self.connects += 1
        self._disconnected_since = None

    def _send(self, body: Mapping[str, Any]) -> int:
        self._seq += 1
        self._sock.sendall(seal(self._key, body, job=self.job_id, host=self.host, rank=self.rank,
                                seq=self._seq, nonce=self._nonce, cnonce=self._cnonce))
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
