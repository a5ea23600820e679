"""Providers: where a job's VMs come from, and how the job learns that one is coming or going.

The interface (``Provider``) is small, so that a cloud provider — Azure/AWS/GCP spot VMs — can be
written from this docstring alone:

``hosts() -> list[Host]``
    The hosts usable *now*: running, reachable as far as the provider knows, and **not under a
    pre-emption notice**. Cheap, never blocks on the network (answer from the provider's own
    state, refreshed by its thread).
``acquire(n) -> list[Host]``
    Hand the caller up to ``n`` usable hosts that nobody acquired yet and mark them in use.
    Returns at once with what is ready (possibly fewer than ``n``, possibly none); a cloud
    provider that has to start new VMs starts them here and announces each later with an
    ``added`` event, when it is ready for SSH. ``ValueError`` for ``n < 0``.
``release(hosts)``
    The caller no longer needs these hosts (a cloud provider deletes the VMs; local slots and
    host files just mark them free). Unknown or already released hosts are ignored.
``subscribe(callback) -> unsubscribe``
    ``callback(HostEvent)`` for every later event, called from the provider's thread (keep it
    short; exceptions are logged, never propagated). Returns a function that unsubscribes.
``start()``
    Begin watching (threads, cloud API polling, metadata-service listeners) and announce every
    host the provider begins with as an ``added`` event. Returns the provider.
``close()``
    Stop watching and leave nothing behind that the provider started: its threads, its VMs (a
    cloud provider deletes the VMs it created), its local processes. Idempotent. Providers are
    context managers (``with LocalProvider(4) as p: ...`` starts and closes).
``ssh_options() -> SSHOptions | None``
    How to reach its hosts over SSH (known_hosts file, trust-on-first-use for fresh cloud VMs
    whose host keys the provider cannot learn otherwise); None: ``SSHOptions()`` defaults.

**Events** (``HostEvent``): ``added`` (a VM joined the pool), ``notice`` (a VM will be taken away
at ``deadline``, Unix seconds — the cloud's pre-emption notice: AWS gives 2 minutes, Azure's
Scheduled Events ~30 s, GCP 30 s; from this moment the host is no longer in ``hosts()``),
``removed`` (the VM is gone, with or without notice; its processes are dead). ``time`` is when
the provider learned it (Unix seconds). A host may come back later under the same name (a new
VM): ``added`` again. Every event is also written to the job's event log when the provider is
given one (``event_log=EventLog(...)``, ``job_id=...``) as ``host_added``, ``preemption_notice``
(payload ``{"deadline", "lead_s", "reason"}``) or ``host_removed`` — the same names as
``manager.events.Kind`` (the event log is passed in, duck-typed: the cluster layer never imports
the manager).

**Hosts** are ``cluster.hosts.Host`` values. ``labels`` carry provider facts (``zone``,
``instance_type``, ``price_per_hour``) and two conventions the launcher
(``manager.generation``) reads: ``kind`` (``"local"``: a slot of this machine, workers run as
local subprocesses; ``"test-host"``: an sshd test host; anything else: a VM reached over SSH) and
``env.NAME`` (environment variables the workers on that host need, e.g.
``env.GLOO_SOCKET_IFNAME=eth0`` or ``env.NCCL_SOCKET_IFNAME``).

A cloud provider, in outline: subclass ``PoolProvider``; in ``acquire`` ask the cloud for spot
VMs (tag them with the job id so ``close`` can find and delete them even after a crash); a thread
polls the cloud (instance states) and each VM's pre-emption signal (AWS: the instance metadata's
``spot/instance-action``; Azure: Scheduled Events ``Preempt``; GCP: ``preempted``) and calls
``_add_host`` when a VM answers SSH, ``_notice_host(name, deadline)`` on a notice and
``_remove_host(name, reason)`` when it is gone; ``release`` and ``close`` delete VMs.

Implementations here: ``LocalProvider`` (the embedded default), ``HostFileProvider`` (a watched
file of hosts); ``cluster.spot.SpotEmulator`` (test hosts or local slots replaying a pre-emption
trace). Owns ``Provider``, ``PoolProvider``, ``HostEvent``, ``LocalProvider``,
``HostFileProvider``, ``HostFileError``, ``parse_host_file``. Imports ``cluster.hosts``,
``cluster.localproc`` and ``cluster.ssh`` only; must never import torch or the manager.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .hosts import Host, HostError
from .localproc import is_local, kill_host, local_host
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
    """Where a job's hosts come from (see the module docstring for the contract)."""

    def __init__(self, *, event_log: Any = None, job_id: str | None = None):
        self.event_log, self.job_id = event_log, job_id
        self._callbacks: list[Callable[[HostEvent], None]] = []
        self._cb_lock = threading.Lock()

    @abstractmethod
    def hosts(self) -> list[Host]:
        """Hosts usable now (not under a pre-emption notice)."""

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
        if self.event_log is not None:
            try:
                self.event_log.append(EVENT_KINDS[event.kind], job_id=self.job_id,
                                      host=event.host.name, payload=event.payload(),
                                      time_s=event.time)
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the provider
                log.error("event log write failed (%s): %s %s", type(e).__name__, event.kind,
                          event.host.name)
        with self._cb_lock:
            callbacks = list(self._callbacks)
        for cb in callbacks:
            try:
                cb(event)
            except Exception:  # noqa: BLE001
                log.exception("host event callback failed")
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
        self.started = self.closed = False

    def ssh_options(self) -> SSHOptions | None:
        return self._ssh_options

    def hosts(self) -> list[Host]:
        with self._lock:
            return [h for n, h in self._pool.items() if n not in self._notices]

    def all_hosts(self) -> list[Host]:
        """Every host held, usable or under notice."""
        with self._lock:
            return list(self._pool.values())

    def under_notice(self) -> dict[str, float]:
        """Hosts under a pre-emption notice: name → deadline (Unix seconds)."""
        with self._lock:
            return dict(self._notices)

    def in_use(self) -> list[str]:
        with self._lock:
            return sorted(self._in_use)

    def acquire(self, n: int) -> list[Host]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"acquire(n={n!r}): n must be an integer >= 0")
        with self._lock:
            free = [h for h in self.hosts() if h.name not in self._in_use][:n]
            self._in_use.update(h.name for h in free)
            return free

    def release(self, hosts: Iterable[Host | str]) -> None:
        with self._lock:
            for h in hosts:
                self._in_use.discard(h if isinstance(h, str) else h.name)

    # ------------------------------------------------------------------ for implementations
    def _add_host(self, host: Host, reason: str = "") -> HostEvent:
        with self._lock:
            self._pool[host.name] = host
            self._notices.pop(host.name, None)
        return self._emit(HostEvent("added", host, time.time(), reason=reason))

    def _notice_host(self, name: str, deadline: float, reason: str = "preempted") -> HostEvent | None:
        with self._lock:
            host = self._pool.get(name)
            if host is None or name in self._notices:
                return None
            self._notices[name] = deadline
        return self._emit(HostEvent("notice", host, time.time(), deadline=deadline, reason=reason))

    def _remove_host(self, name: str, reason: str = "preempted") -> HostEvent | None:
        with self._lock:
            host = self._pool.pop(name, None)
            self._notices.pop(name, None)
            self._in_use.discard(name)
        if host is None:
            return None
        return self._emit(HostEvent("removed", host, time.time(), reason=reason))

    def _announce_all(self) -> None:
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
        if not self.started:
            self.started = True
            self._announce_all()
        return self

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for h in self.all_hosts():
            kill_host(h.name)


# --------------------------------------------------------------------------------- host file
MAX_HOST_FILE_BYTES = 1 << 20   # a host file (some thousand hosts) is far smaller
MAX_GPUS_PER_HOST = 1024


def read_small_text(path: Path, limit: int, what: str, error: type[Exception]) -> str:
    """The UTF-8 text of ``path`` if it is at most ``limit`` bytes; else ``error`` saying which
    file and what is wrong (too big, not UTF-8) — never a decode traceback or an unbounded read."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} {path} is larger than {limit} bytes; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte {e.start}); save it as plain text") from None


class HostFileError(ValueError):
    """A host file is malformed; the message names the file, the line and the fix."""


HOST_FILE_FORMAT = """\
One host per line; blank lines and text after '#' are ignored. Either just an address
    10.0.0.5            (name derived from it: 10-0-0-5)
    10.0.0.6:2222       (SSH port 2222)
or a name, an address and options (key=value, no spaces):
    vm0 10.0.0.4 gpus=1 user=ubuntu python=/opt/venv/bin/python workdir=/home/ubuntu/run
        key=~/.ssh/id_ed25519 key_passphrase_env=VM_KEY_PASS label.zone=eastus env.NCCL_SOCKET_IFNAME=eth0
IPv6 addresses go in brackets: [fd00::5]:22. Options: user, gpus, python, workdir, key,
key_passphrase_env, label.NAME=VALUE, env.NAME=VALUE (an environment variable for the workers).
"""

_OPTS = {"user": "user", "gpus": "gpus", "python": "python", "workdir": "workdir",
         "key": "key_path", "key_passphrase_env": "key_passphrase_env"}


def _split_address(token: str) -> tuple[str, int | None]:
    if token.startswith("["):
        addr, _, rest = token[1:].partition("]")
        if not rest:
            return addr, None
        if not rest.startswith(":"):
            raise ValueError(f"{token!r}: write [IPv6]:PORT")
        return addr, int(rest[1:])
    if token.count(":") == 1:
        addr, port = token.split(":")
        return addr, int(port)
    return token, None


def parse_host_file(text: str, *, source: str = "<host file>",
                    defaults: Mapping[str, Any] | None = None) -> list[Host]:
    """Hosts of a host file (format: ``HOST_FILE_FORMAT``). ``defaults``: ``Host`` fields applied
    to every host unless its line says otherwise (e.g. ``{"python": "/opt/venv/bin/python",
    "key_path": "~/.ssh/id_ed25519"}``). Raises ``HostFileError`` naming the line."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{no}"
        tokens = line.split()
        pos = [t for t in tokens if "=" not in t]
        opts = [t for t in tokens if "=" in t]
        if tokens[: len(pos)] != pos:
            raise HostFileError(f"{where}: options (key=value) must come after the name and "
                                f"address: {raw.strip()!r}\n{HOST_FILE_FORMAT}")
        if len(pos) not in (1, 2):
            raise HostFileError(f"{where}: expected 'ADDRESS[:PORT]' or 'NAME ADDRESS[:PORT]', got "
                                f"{len(pos)} words: {raw.strip()!r}\n{HOST_FILE_FORMAT}")
        try:
            addr, port = _split_address(pos[-1])
        except ValueError as e:
            raise HostFileError(f"{where}: bad address {pos[-1]!r} ({e}); write ADDRESS or "
                                "ADDRESS:PORT") from None
        name = pos[0] if len(pos) == 2 else re.sub(r"[^A-Za-z0-9]+", "-", addr).strip("-") + (
            f"-{port}" if port not in (None, 22) else "")
        kw: dict[str, Any] = dict(defaults or {})
        labels: dict[str, str] = dict(kw.pop("labels", {}) or {})
        kw.update(name=name, address=addr)
        if port is not None:
            kw["port"] = port
        for opt in opts:
            k, _, v = opt.partition("=")
            if k.startswith(("label.", "env.")):
                labels[k[6:] if k.startswith("label.") else k] = v
            elif k in _OPTS:
                if k == "gpus":
                    if not (v.isascii() and v.isdigit() and len(v) <= 5 and int(v) <= MAX_GPUS_PER_HOST):
                        raise HostFileError(f"{where}: gpus={v[:20]!r} must be a whole number in "
                                            f"0..{MAX_GPUS_PER_HOST}")
                    kw["gpus"] = int(v)
                else:
                    kw[_OPTS[k]] = v
            else:
                raise HostFileError(f"{where}: unknown option {k!r}; known: {sorted(_OPTS)}, "
                                    "label.NAME, env.NAME")
        kw["labels"] = labels
        try:
            host = Host(**kw)
        except (HostError, TypeError) as e:
            raise HostFileError(f"{where}: {e}") from None
        if host.name in seen:
            raise HostFileError(f"{where}: host name {host.name!r} already used on line "
                                f"{seen[host.name]}; names must be unique")
        seen[host.name] = no
        hosts.append(host)
    return hosts


class HostFileProvider(PoolProvider):
    """Hosts listed in a file (format: ``HOST_FILE_FORMAT``), like the original's machine list,
    watched for changes: every ``poll_s`` seconds its modification time and size are checked; on
    a change the file is re-read (twice, ``settle_s`` apart, until it stops changing — an editor
    mid-write) and the differences announced: a new line → ``added``, a deleted line →
    ``removed`` (reason ``"removed from host file"``), a changed line → ``removed`` then
    ``added``. A file that stops parsing (or disappears) keeps the previous hosts and logs a
    warning naming the line; the next valid version is applied.

    ``defaults``: ``Host`` fields for every line (see ``parse_host_file``); ``ssh_options``: how
    to reach the hosts. Raises ``FileNotFoundError`` / ``HostFileError`` at construction.
    """

    def __init__(self, path: str | os.PathLike, *, poll_s: float = 1.0, settle_s: float = 0.05,
                 defaults: Mapping[str, Any] | None = None, ssh_options: SSHOptions | None = None,
                 event_log: Any = None, job_id: str | None = None):
        super().__init__(event_log=event_log, job_id=job_id, ssh_options=ssh_options)
        if poll_s <= 0:
            raise ValueError(f"poll_s={poll_s} must be > 0 seconds")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"host file {self.path} does not exist; create it with one "
                                    f"host per line:\n{HOST_FILE_FORMAT}")
        self.poll_s, self.settle_s = poll_s, settle_s
        self.defaults = dict(defaults or {})
        self._sig = self._signature()
        self._text = self._read()
        for h in parse_host_file(self._text, source=str(self.path), defaults=self.defaults):
            self._pool[h.name] = h
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _signature(self) -> tuple | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def start(self) -> "HostFileProvider":
        if self.started:
            return self
        self.started = True
        self._announce_all()
        self._thread = threading.Thread(target=self._watch, name=f"hostfile-{self.path.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def _read(self) -> str:
        return read_small_text(self.path, MAX_HOST_FILE_BYTES, "host file", HostFileError)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("host file watcher")

    def check(self) -> bool:
        """Look at the file now (the watcher does this every ``poll_s``); apply a change.
        True when the host set changed."""
        sig = self._signature()
        if sig == self._sig:
            return False
        if sig is None:
            self._sig = None
            self._warn(f"host file {self.path} disappeared; keeping the previous "
                       f"{len(self.all_hosts())} host(s)")
            return False
        try:
            text = self._read()
            while True:  # wait until the content stops changing
                time.sleep(self.settle_s)
                again = self._read() if self.path.exists() else text
                if again == text:
                    break
                text = again
        except (HostFileError, OSError) as e:
            self._sig = self._signature()
            self._warn(f"{e} — keeping the previous hosts until the file is fixed")
            return False
        self._sig = self._signature()
        if text == self._text:
            return False
        try:
            new = parse_host_file(text, source=str(self.path), defaults=self.defaults)
        except HostFileError as e:
            self._warn(f"{e} — keeping the previous hosts until the file is fixed")
            return False
        self._text, self.last_error = text, None
        old = {h.name: h for h in self.all_hosts()}
        fresh = {h.name: h for h in new}
        changed = False
        for name, h in old.items():
            if name not in fresh or fresh[name].to_dict() != h.to_dict():
                self._remove_host(name, reason="removed from host file" if name not in fresh
                                  else "changed in host file")
                changed = True
        for name, h in fresh.items():
            if name not in old or old[name].to_dict() != h.to_dict():
                self._add_host(h, reason="listed in host file")
                changed = True
        return changed

    def _warn(self, msg: str) -> None:
        if msg != self.last_error:
            log.warning("%s", msg)
        self.last_error = msg

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)


__all__ = ["EVENT_KINDS", "HOST_FILE_FORMAT", "HostEvent", "HostFileError", "HostFileProvider",
           "LocalProvider", "PoolProvider", "Provider", "is_local", "local_host", "parse_host_file"]
