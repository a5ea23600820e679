"""Loss detection: what the manager's heartbeat server knows about each worker, and the rules that
declare a host lost. No sockets here: ``manager.heartbeat_server.HeartbeatServer`` subclasses
``LossDetector`` and feeds it the authenticated messages it receives.

A host is declared lost — one ``host_lost`` event, with ``detection_latency_s`` and
``since_last_heartbeat_s`` in its payload — when

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

A worker's goodbye (``bye``: ``"ok"``, ``"stopped"`` or ``"failed"`` with its error and cause) is
never mistaken for a loss. Metrics rows that ride on the heartbeats are appended to the event
log's metrics table once per step; a VM's own pre-emption notice becomes one
``preemption_notice`` event per host and deadline (``source: "vm"``).

Owns ``SenderState`` and ``LossDetector``. Imports the standard library, ``cluster.hosts``
(``notify``), ``manager.events`` and ``manager.wire`` only; must never import the server, the client, ``socket``, torch or
anything above the manager.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..cluster.hosts import notify
from .events import Event, EventLog, Kind
from .wire import FAILURE_CAUSES, STOPPED, json_safe

log = logging.getLogger(__name__)

_LIVE = ("running", "disconnected", "expected")   # statuses whose silence may be a loss


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


class LossDetector:
    """Every worker's ``SenderState`` of job ``job_id``, the deadlines that declare a host lost,
    and the events that record it all in ``events`` (also kept in ``emitted``).

    ``interval_s``: the heartbeat interval (s); a running worker silent for ``miss_limit``
    intervals is lost. Thread-safe: ``expect``, ``report_exit``, ``report_lost``,
    ``stop_expecting``, ``senders`` and the ``wait_*`` methods may be called from any thread.
    ``on_event(event)`` callbacks run on the thread that emitted (keep them short). Raises
    ``ValueError`` for ``interval_s <= 0`` or ``miss_limit < 1``.
    """

    def __init__(self, job_id: str, events: EventLog, *, interval_s: float = 2.0,
                 miss_limit: float = 2.0, reconnect_grace_s: float | None = None,
                 startup_grace_s: float = 15.0, on_event: Callable[[Event], None] | None = None):
        if interval_s <= 0 or miss_limit < 1:
            raise ValueError("interval_s must be > 0 and miss_limit >= 1")
        self.job_id = job_id
        self.events = events
        self.interval_s = float(interval_s)
        self.lost_after_s = float(miss_limit) * self.interval_s
        self.reconnect_grace_s = (0.5 * self.interval_s if reconnect_grace_s is None
                                  else float(reconnect_grace_s))
        self.startup_grace_s = float(startup_grace_s)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._senders: dict[tuple[str, int], SenderState] = {}
        self._lost_hosts: dict[str, Event] = {}
        self.emitted: list[Event] = []
        self._callbacks = [on_event] if on_event else []
        self._metric_steps: set[int] = set()
        self.last_metric_step: int | None = None
        self.metrics_recorded = 0
        self._dropped_reported: dict[tuple[str, int], int] = {}
        self._notices: dict[str, float] = {}   # host -> deadline of the VM notice last emitted

    def _wake(self) -> None:
        """Hook: a deadline changed (the server wakes its loop). Nothing to do here."""

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
            if s.status in _LIVE and exit_code != 0:
                s.loss_time = now if at is None else at
                reason = "worker_process_died" if exit_code is not None else "vm_unreachable"
                self._declare_lost(s, reason, now, extra={"exit_code": exit_code})
            elif s.status in _LIVE and s.last.get("step") is None:
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
                    if s.status in _LIVE:
                        s.status, s.deadline = "stopping", None

    def senders(self) -> dict[tuple[str, int], SenderState]:
        """A snapshot of every worker's state: (host, rank) → ``SenderState`` copy."""
        with self._lock:
            return {k: SenderState(**{**vars(v), "last": dict(v.last)}) for k, v in self._senders.items()}

    def lost_hosts(self) -> dict[str, Event]:
        """Every host declared lost so far → its ``host_lost`` event."""
        with self._lock:
            return dict(self._lost_hosts)

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        """Call ``callback(event)`` for every event emitted from now on."""
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

    # ----------------------------------------------------------------------------- internals
    def _emit(self, kind: str, *, host: str | None = None, rank: int | None = None,
              payload: Mapping[str, Any] | None = None) -> Event:
        """Append one event to the log (a failed write is logged, never raised: a full disk must
        not stop loss detection), remember it in ``emitted`` and run the callbacks."""
        payload = json_safe(dict(payload or {}))
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
        notify(callbacks, ev, logger=log, what="heartbeat event callback")
        return ev

    def _declare_lost(self, s: SenderState, reason: str, now: float,
                      extra: Mapping[str, Any] | None = None) -> None:
        """Mark every still-expected worker of ``s.host`` lost; emit ``host_lost`` once."""
        host = s.host
        since = None if s.last_seen is None else now - s.last_seen
        latency = now - s.loss_time if s.loss_time is not None else since
        ranks = []
        for o in self._senders.values():
            if o.host == host and o.status in _LIVE:
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

    def _check_senders(self, now: float, nearest: float) -> float:
        """Declare every worker past its deadline lost (call with the lock held); returns the
        nearest deadline still ahead (or ``nearest``), in ``time.monotonic()`` seconds."""
        for s in list(self._senders.values()):
            if s.deadline is None or s.status not in _LIVE:
                continue
            if now >= s.deadline:
                reason = {"running": "heartbeat_timeout", "disconnected": "connection_closed",
                          "expected": "never_joined"}[s.status]
                if s.status == "running":
                    s.loss_time = None  # unknown: the latency is the silence
                self._declare_lost(s, reason, now)
            else:
                nearest = min(nearest, s.deadline)
        return nearest

    def _worker_message(self, msg: Mapping[str, Any], *, first_on_conn: bool, peer: str) -> bool:
        """Apply one authenticated client message (``type`` hello/hb/metrics/bye, already checked
        by ``manager.wire``) to its worker's state; call with the lock held. ``first_on_conn``:
        the first message of its connection; ``peer``: its address, for the events. True when it
        carried metrics rows that were recorded (the server then acknowledges the line)."""
        now = time.monotonic()
        host, rank, kind = msg["host"], msg["rank"], msg["type"]
        s = self._senders.get((host, rank))
        if s is None:
            s = self._senders[(host, rank)] = SenderState(host, rank)
        if s.status == "lost" or host in self._lost_hosts:
            # a worker of a host already declared lost (it came back): record, don't revive
            if first_on_conn:
                self._emit(Kind.WORKER_AFTER_LOSS, host=host, rank=rank, payload={"peer": peer})
            s.last_seen = now
            # steps it did train are still facts
            return msg.get("metrics") is not None and self._record_metrics(host, rank, msg["metrics"])
        if first_on_conn:
            self._worker_connected(s, msg, peer, now)
        s.last_seen = now
        acked = msg.get("metrics") is not None and self._record_metrics(host, rank, msg["metrics"])
        dropped = msg.get("metrics_dropped")
        if isinstance(dropped, int) and dropped > self._dropped_reported.get((host, rank), 0):
            self._dropped_reported[(host, rank)] = dropped
            self._emit(Kind.METRICS_DROPPED, host=host, rank=rank, payload={"rows": dropped})
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
            self._worker_said_bye(s, msg)
        if s.status == "running":
            trained = s.last.get("step") is not None
            s.deadline = now + (self.lost_after_s if trained
                                else max(self.lost_after_s, self.startup_grace_s))
        return acked

    def _worker_connected(self, s: SenderState, msg: Mapping[str, Any], peer: str, now: float) -> None:
        """The first message of a worker's connection: ``worker_joined`` (or ``worker_rejoined``)."""
        joined = s.joined_at is None
        s.joined_at = s.joined_at or now
        if s.status in _LIVE or (msg["type"] == "hello" and s.status in ("finished", "failed", "exited")):
            s.status = "running"  # (a finished worker saying hello again: restarted)
        s.pid = msg.get("pid") if isinstance(msg.get("pid"), int) else s.pid
        self._emit(Kind.WORKER_JOINED if joined else Kind.WORKER_REJOINED, host=s.host,
                   rank=s.rank, payload={"peer": peer, "pid": s.pid})

    def _worker_said_bye(self, s: SenderState, msg: Mapping[str, Any]) -> None:
        """A goodbye: ``worker_finished`` (status ``"ok"``/``"stopped"``) or ``worker_failed``
        (with its error, at most 2000 characters, and its cause from ``FAILURE_CAUSES``)."""
        status = msg.get("status")
        failed = status not in ("ok", STOPPED)
        s.status, s.deadline = ("failed" if failed else "finished"), None
        payload = {"status": status, "last_step": msg.get("step")}
        if failed:
            err = msg.get("error")
            payload["error"] = err[-2000:] if isinstance(err, str) else None
            cause = msg.get("cause")
            payload["cause"] = cause if cause in FAILURE_CAUSES else "error"
        self._emit(Kind.WORKER_FAILED if failed else Kind.WORKER_FINISHED, host=s.host,
                   rank=s.rank, payload=payload)

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

    def _record_metrics(self, host: str, rank: int, rows: Any) -> bool:
        """Append each new step's metrics row to the event log (once per step). True when the
        message may be acknowledged: False for a malformed batch or a failed write (the client
        then sends the rows again)."""
        if not isinstance(rows, list):
            log.warning("metrics from %s rank %s ignored: not a list", host, rank)
            return False
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
                return False
            self._metric_steps.add(step)
            self.metrics_recorded += 1
            self.last_metric_step = step if self.last_metric_step is None else max(self.last_metric_step, step)
        self._cond.notify_all()
        return True
