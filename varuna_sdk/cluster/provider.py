"""Providers: where a job's VMs come from, and how the job learns that one is coming or going.

**Adding a cloud provider? This page is the contract.** Subclass ``PoolProvider`` (below), which
does the bookkeeping (usable / under notice / in use, subscribers, the event log); the worked
example is ``cluster/aws.py`` (``AWSSpotProvider``: EC2 spot instances, ~600 lines with its
checks); ``tests/test_provider.py::_Cloud`` is the smallest one that passes. The manager
(``manager.manager``) uses ``start``, ``hosts``, ``all_hosts``, ``subscribe``, ``attach``,
``ssh_options``, ``started``, ``closed`` and ``close`` — no attribute probing, nothing set on a
provider from outside — and reaches the hosts' workers over SSH itself. It plans on every host
``hosts()`` offers; it never calls ``acquire``/``release``, so a cloud provider keeps its pool
full on its own (``aws.py`` requests the shortfall from ``start`` and its watcher thread).

Methods (``Provider``; ``PoolProvider`` implements the ones marked *):

``hosts() -> list[Host]`` *
    The hosts usable *now*: running, reachable as far as the provider knows, and **not under a
    pre-emption notice**. Cheap, never blocks on the network (answer from the provider's own
    state, refreshed by its thread).
``all_hosts() -> list[Host]`` *
    Every host the provider holds, including those under a pre-emption notice (the manager
    records them in the event log for the dashboard's VM pool). Default: ``hosts()``.
``acquire(n) -> list[Host]`` *
    For a caller that hands hosts out itself (not the manager): up to ``n`` usable hosts that
    nobody acquired yet, marked in use. Returns at once with what is ready (possibly fewer than
    ``n``, possibly none). ``ValueError`` for ``n < 0``.
``release(hosts)`` *
    The caller no longer needs these hosts (``Host`` values or names; a cloud provider deletes
    the VMs; local slots and host files just mark them free). Unknown or already released hosts
    are ignored.
``start() -> Provider`` (implement)
    Begin watching (threads, cloud API polling, metadata-service listeners) and announce every
    host the provider begins with as an ``added`` event. Set ``self.started = True`` first;
    idempotent (return at once when ``self._started``); a failed start cleans up and raises.
``close()`` (implement)
    Stop watching and leave nothing behind that the provider started: its threads, its VMs (a
    cloud provider deletes the VMs it created — found through the cloud API by the job's tag,
    not from memory), its local processes. Set ``self.closed = True``; idempotent. Providers are
    context managers (``with LocalProvider(4) as p: ...`` starts and closes).
``started: bool``, ``closed: bool``
    ``started``: True between ``start()`` and ``close()``; ``closed``: ``close()`` was called
    (a closed provider is not started, and does not start again).
``attach(event_log, job_id)``
    The manager's call: record every later event in ``event_log`` under ``job_id``. A provider
    that was given an event log at construction keeps it (one provider writes to one log).
``subscribe(callback) -> unsubscribe``
    ``callback(HostEvent)`` for every later event; returns a function that unsubscribes.
``ssh_options() -> SSHOptions | None``
    How to reach its hosts over SSH (known_hosts file, trust-on-first-use for fresh cloud VMs
    whose host keys the provider cannot learn otherwise); None: ``SSHOptions()`` defaults.

**Events to emit** (``HostEvent``; a ``PoolProvider`` emits them through ``_add_host(host)``,
``_notice_host(name, deadline)`` and ``_remove_host(name, reason)``): ``added`` (a VM joined the
pool and answers SSH), ``notice`` (a VM will be taken away at ``deadline``, Unix seconds — the
cloud's pre-emption notice: AWS gives 2 minutes, Azure's Scheduled Events ~30 s, GCP 30 s; from
this moment the host is no longer in ``hosts()``), ``removed`` (the VM is gone, with or without
notice; its processes are dead). ``time`` is when the provider learned it (Unix seconds). A host
may come back later under the same name (a new VM): ``added`` again. Every event is also written
to the job's event log (given at construction, ``event_log=EventLog(...), job_id=...``, or by
``attach``) as ``host_added``, ``preemption_notice`` (payload ``{"deadline", "lead_s",
"reason"}``) or ``host_removed`` — the same names as ``manager.events.Kind`` (the event log is
passed in, duck-typed: the cluster layer never imports the manager). A notice read *inside* the
VM (``cluster.notice``: AWS ``spot/instance-action``, Azure Scheduled Events ``Preempt``, GCP
``preempted``) reaches the manager without the provider; a provider that can see it from the
cloud API may emit it too.

**Threading rules.** The manager calls the methods from its own thread; the provider watches on
its own daemon thread(s). ``hosts``/``all_hosts``/``acquire``/``release`` must be safe from any
thread and must not block on the network (``PoolProvider`` guards its pool with ``self._lock``,
an ``RLock``). Subscriber callbacks run on the thread that emits (the provider's): they must be
short, and an exception in one is logged, never propagated. Never call a subscriber or the event
log while holding ``self._lock`` — ``_add_host`` and friends release it before emitting. ``close``
stops and joins the threads (bounded waits) before deleting VMs.

**Hosts** are ``cluster.hosts.Host`` values. ``labels`` carry provider facts (``zone``,
``instance_type``, ``price_per_hour``) and two conventions the generation
(``manager.generation``) reads: ``kind`` (``"local"``: a slot of this machine, workers run as
local subprocesses; ``"test-host"``: an sshd namespace host; anything else: a VM reached over
SSH) and ``env.NAME`` (environment variables the workers on that host need, e.g.
``env.GLOO_SOCKET_IFNAME=eth0`` or ``env.NCCL_SOCKET_IFNAME``).

A cloud provider, in outline (what ``aws.py`` does): in ``start`` check the settings and
credentials, adopt the job's VMs still alive (tagged with the job id), request the shortfall and
start a thread; in ``acquire`` raise the target; the thread polls the cloud (instance states) and
calls ``_add_host`` when a VM answers SSH, ``_notice_host`` on a notice and ``_remove_host`` when
it is gone; ``release`` and ``close`` delete VMs.

Implementations: ``LocalProvider`` (here; the embedded default), ``cluster.hostfile.HostFileProvider``
(a watched file of hosts), ``cluster.spot.SpotEmulator`` (namespace SSH hosts or local slots
replaying a pre-emption trace), ``cluster.aws.AWSSpotProvider``. Owns ``Provider``,
``PoolProvider``, ``HostEvent``, ``EVENT_KINDS``, ``LocalProvider``. Imports ``cluster.hosts``,
``cluster.localproc`` and ``cluster.ssh`` only; must never import torch or the manager.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .hosts import Host, notify
from .localproc import kill_host, local_host
from .ssh import SSHOptions

log = logging.getLogger(__name__)

EVENT_KINDS = {"added": "host_added", "notice": "preemption_notice", "removed": "host_removed"}
"""HostEvent kind → the event-log kind it is recorded as (``manager.events.Kind`` values)."""


@dataclass(frozen=True)
class HostEvent:
    """Something happened to one host. ``kind``: ``"added"``, ``"notice"`` or ``"removed"``;
    ``time``: when (Unix seconds); ``deadline``: for a notice, when the VM will be taken (Unix
    seconds), else None; ``reason``: free text (``"preempted"``, ``"removed from host file"``)."""

    kind: str
    host: Host
    time: float
    deadline: float | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"HostEvent kind {self.kind!r}: use one of {sorted(EVENT_KINDS)}")
        if self.kind == "notice" and self.deadline is None:
            raise ValueError("a notice HostEvent needs its deadline (Unix seconds)")

    @property
    def lead_s(self) -> float | None:
        """Seconds from the notice to the deadline (None unless a notice)."""
        return None if self.deadline is None else max(0.0, self.deadline - self.time)

    def payload(self) -> dict[str, Any]:
        """The event-log payload of this event."""
        if self.kind == "added":
            return {"address": self.host.address, "gpus": self.host.gpus,
                    "labels": dict(self.host.labels), "reason": self.reason}
        if self.kind == "notice":
            return {"deadline": self.deadline, "lead_s": round(self.lead_s, 3), "reason": self.reason}
        return {"reason": self.reason}


class Provider(ABC):
    """Where a job's hosts come from (the module docstring is the contract). ``event_log``: where
    to record host events (an ``EventLog``, duck-typed: ``append(kind, job_id=, host=, payload=,
    time_s=)``), or None until the manager ``attach``es one; ``job_id``: the job they are
    recorded under."""

    def __init__(self, *, event_log: Any = None, job_id: str | None = None):
        self.event_log, self.job_id = event_log, job_id
        self._callbacks: list[Callable[[HostEvent], None]] = []
        self._cb_lock = threading.Lock()
        self._started = False
        self.closed = False

    @abstractmethod
    def hosts(self) -> list[Host]:
        """Hosts usable now (not under a pre-emption notice)."""

    def all_hosts(self) -> list[Host]:
        """Every host held, usable or under a pre-emption notice (default: ``hosts()``)."""
        return self.hosts()

    @abstractmethod
    def acquire(self, n: int) -> list[Host]:
        """Up to ``n`` usable hosts nobody holds, marked in use (at once; maybe fewer)."""

    @abstractmethod
    def release(self, hosts: Iterable[Host | str]) -> None:
        """Give hosts back (a cloud provider deletes the VMs)."""

    @abstractmethod
    def start(self) -> "Provider":
        """Begin watching; announce the initial hosts as ``added``."""

    @abstractmethod
    def close(self) -> None:
        """Stop watching; leave no thread, VM or process the provider started."""

    @property
    def started(self) -> bool:
        """True between ``start()`` and ``close()``."""
        return self._started and not self.closed

    @started.setter
    def started(self, value: bool) -> None:
        """Implementations set ``self.started = True`` at the top of ``start()``."""
        self._started = bool(value)

    def attach(self, event_log: Any, job_id: str | None) -> None:
        """Record every later host event in ``event_log`` under ``job_id`` — the manager's call
        when it takes the provider. A provider that already records into a log (given at
        construction, or attached before) keeps that log and job id."""
        with self._cb_lock:
            if self.event_log is None:
                self.event_log, self.job_id = event_log, job_id

    def ssh_options(self) -> SSHOptions | None:
        """How to reach the hosts over SSH (None: ``SSHOptions()`` defaults)."""
        return None

    def subscribe(self, callback: Callable[[HostEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every later event; returns the unsubscribe function."""
        with self._cb_lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self._cb_lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)
        return unsubscribe

    def _emit(self, event: HostEvent) -> HostEvent:
        """Record ``event`` in the event log (if any) and deliver it to every subscriber."""
        with self._cb_lock:
            event_log, job_id = self.event_log, self.job_id
        if event_log is not None:
            try:
                event_log.append(EVENT_KINDS[event.kind], job_id=job_id,
                                      host=event.host.name, payload=event.payload(),
                                      time_s=event.time)
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the provider
                log.error("event log write failed (%s): %s %s", type(e).__name__, event.kind,
                          event.host.name)
        with self._cb_lock:
            callbacks = list(self._callbacks)
        notify(callbacks, event, logger=log, what="host event callback")
        return event

    def __enter__(self) -> "Provider":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class PoolProvider(Provider):
    """A provider that holds its hosts in a pool: the bookkeeping every implementation shares
    (usable / under notice / in use). Subclasses call ``_add_host``, ``_notice_host`` and
    ``_remove_host`` (which emit the events) and implement ``start`` / ``close``."""

    def __init__(self, *, event_log: Any = None, job_id: str | None = None,
                 ssh_options: SSHOptions | None = None):
        super().__init__(event_log=event_log, job_id=job_id)
        self._lock = threading.RLock()
        self._pool: dict[str, Host] = {}
        self._notices: dict[str, float] = {}
        self._in_use: set[str] = set()
        self._ssh_options = ssh_options

    def ssh_options(self) -> SSHOptions | None:
        """The ``ssh_options`` given at construction."""
        return self._ssh_options

    def hosts(self) -> list[Host]:
        """Hosts in the pool and not under a pre-emption notice."""
        with self._lock:
            return [h for n, h in self._pool.items() if n not in self._notices]

    def all_hosts(self) -> list[Host]:
        """Every host held, usable or under a pre-emption notice."""
        with self._lock:
            return list(self._pool.values())

    def under_notice(self) -> dict[str, float]:
        """Hosts under a pre-emption notice: name → deadline (Unix seconds)."""
        with self._lock:
            return dict(self._notices)

    def in_use(self) -> list[str]:
        """Names of the hosts acquired and not released, sorted."""
        with self._lock:
            return sorted(self._in_use)

    def acquire(self, n: int) -> list[Host]:
        """Up to ``n`` usable hosts nobody holds, marked in use; ``ValueError`` for ``n < 0``."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"acquire(n={n!r}): n must be an integer >= 0")
        with self._lock:
            free = [h for h in self.hosts() if h.name not in self._in_use][:n]
            self._in_use.update(h.name for h in free)
            return free

    def release(self, hosts: Iterable[Host | str]) -> None:
        """Mark these hosts (``Host`` values or names) free; unknown ones are ignored."""
        with self._lock:
            for h in hosts:
                self._in_use.discard(h if isinstance(h, str) else h.name)

    # ------------------------------------------------------------------ for implementations
    def _add_host(self, host: Host, reason: str = "") -> HostEvent:
        """Put ``host`` in the pool (clearing any notice) and emit ``added``."""
        with self._lock:
            self._pool[host.name] = host
            self._notices.pop(host.name, None)
        return self._emit(HostEvent("added", host, time.time(), reason=reason))

    def _notice_host(self, name: str, deadline: float, reason: str = "preempted") -> HostEvent | None:
        """Take ``name`` out of ``hosts()`` until ``deadline`` (Unix seconds) and emit ``notice``;
        None (no event) for a host not held or already under notice."""
        with self._lock:
            host = self._pool.get(name)
            if host is None or name in self._notices:
                return None
            self._notices[name] = deadline
        return self._emit(HostEvent("notice", host, time.time(), deadline=deadline, reason=reason))

    def _remove_host(self, name: str, reason: str = "preempted") -> HostEvent | None:
        """Drop ``name`` from the pool and emit ``removed``; None for a host not held."""
        with self._lock:
            host = self._pool.pop(name, None)
            self._notices.pop(name, None)
            self._in_use.discard(name)
        if host is None:
            return None
        return self._emit(HostEvent("removed", host, time.time(), reason=reason))

    def _announce_all(self) -> None:
        """Emit ``added`` (reason ``"initial"``) for every host held — for ``start()``."""
        for h in self.all_hosts():
            self._emit(HostEvent("added", h, time.time(), reason="initial"))


# ------------------------------------------------------------------------------------- local
class LocalProvider(PoolProvider):
    """The embedded default: ``slots`` "hosts" ``local0``..``local{slots-1}`` on this machine,
    labelled ``kind=local`` — their workers run as local subprocesses, not over SSH. ``gpus_per
    _slot``: GPUs each slot offers (0: CPU, one worker per slot). ``close()`` kills every worker
    process started for its slots. Raises ``ValueError`` for ``slots < 1``."""

    def __init__(self, slots: int, *, gpus_per_slot: int = 0, event_log: Any = None,
                 job_id: str | None = None):
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"LocalProvider(slots={slots!r}): slots must be an integer >= 1 "
                             "(one per local worker; e.g. os.cpu_count())")
        super().__init__(event_log=event_log, job_id=job_id)
        for i in range(slots):
            h = local_host(i, gpus=gpus_per_slot)
            self._pool[h.name] = h

    def start(self) -> "LocalProvider":
        """Announce every slot as ``added`` (once)."""
        if not self._started:
            self.started = True
            self._announce_all()
        return self

    def close(self) -> None:
        """Kill every worker process started for these slots (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for h in self.all_hosts():
            kill_host(h.name)


__all__ = ["EVENT_KINDS", "HostEvent", "LocalProvider", "PoolProvider", "Provider"]
