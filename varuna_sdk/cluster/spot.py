"""Spot VMs on one machine: pre-emption traces (``load_trace``) and a provider that replays one
against real hosts (``SpotEmulator``) — for tests, benchmarks, tutorials and the demo.

**Traces.** Public spot-availability traces (``varuna_sdk/data/spot-traces/``: AWS p3 and g4dn,
recorded by Bamboo, NSDI'23) have one event a line, ``milliseconds_since_start,add|remove,nodeN``.
``load_trace(path, start_s=, end_s=, compress=)`` validates them (every error names the file and
line: a malformed row, a time going backwards, a node added twice or removed before it was
added), cuts a time window ``[start_s, end_s)`` in trace seconds — nodes alive at ``start_s``
become ``add`` events at time 0 — and compresses time by ``compress`` (``compress=60``: an hour
of trace replays in a minute). Count traces (``milliseconds,count`` rows: how many VMs are up)
and ``date, time, count`` rows are accepted too: nodes are added and removed to follow the count
(``scale_to=capacity``: a large pool's counts scaled to the emulator's VMs, a seeded random VM
going at each drop — without it a 64-VM trace on 4 slots would never touch them).

**Emulator.** ``SpotEmulator(trace, capacity=4, backend="ssh" | "local", notice_s=...)`` is a
``Provider`` (``cluster.provider``) that owns up to ``capacity`` hosts — real sshd test hosts
(``cluster.sshd_hosts.SSHDHosts``: loopback or, with ``netns=True``, network namespaces) or local
slots (``local0``...) — and replays the trace in real time on its own thread:

- trace nodes are mapped to host slots (``vm0``.. or ``local0``..) first come, first served; a
  node added while every slot is taken is ignored for its whole life (``overflow``: those up in
  the trace now; ``overflowed``: how many adds were ignored; the first is logged); a slot freed by a removal is reused by the next added node (a new VM: a test
  host gets a new sshd and host key);
- ``notice_s`` **wall-clock seconds** (after compression; the manager needs real time to
  checkpoint) before each removal a ``notice`` event with the deadline is emitted and the host
  leaves ``hosts()``; when the removal comes earlier than that after the replay starts, the
  notice comes at once with the shorter lead (its payload says the real ``lead_s``). With
  ``notices="metadata"`` (SSH test hosts) the notice is not a provider event but what a cloud
  does: each host gets its own instance-metadata stand-in (``cluster.metadata.MetadataServer``,
  ``cloud`` = ``"aws"``, ``"gcp"`` or ``"azure"``, or a tuple of them taken by the slots in
  turn; its URL in the host's
  ``env.VARUNA_METADATA_URL`` label), which starts reporting the notice; the VM's own watcher
  (``cluster.notice``) must see it and tell the manager, and the host stays in ``hosts()``
  until it is removed, as a cloud API would list it;
- a removal really removes the host: a test host's sshd and every process it started are
  killed (``SSHDHosts.remove``), a local slot's worker processes are killed
  (``localproc.kill_host``); then ``removed`` is emitted.

``remove_now(name, notice_s=None)`` and ``add_now(name=None)`` drive it by hand (tests,
tutorials), with or without a trace. ``labels`` go on every host it brings up (e.g. the prices
an emulated VM stands for: ``price_per_hour``, ``on_demand_per_hour``, ``prices="example"``). Host events go to the job's event log when one is given.

Owns ``TraceEvent``, ``Trace``, ``TraceError``, ``load_trace``, ``SpotEmulator``. Imports
``cluster.hostfile`` (the bounded file read), ``cluster.hosts``, ``cluster.localproc``,
``cluster.metadata``, ``cluster.provider``, ``cluster.ssh`` and ``cluster.sshd_hosts`` only;
never torch or the manager.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .hostfile import read_small_text
from .hosts import Host
from .localproc import kill_host, local_host
from .provider import PoolProvider
from .ssh import SSHOptions

log = logging.getLogger(__name__)

_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


MAX_TRACE_BYTES = 64 << 20     # the shipped traces are < 1 MB
MAX_TRACE_NODES = 100_000       # nodes up at once in a count row
MAX_TRACE_EVENTS = 1_000_000


class TraceError(ValueError):
    """A trace file is malformed or a window/compression is invalid; names the file and line."""


@dataclass(frozen=True)
class TraceEvent:
    """One trace event. ``t_s``: seconds after the replay starts (window start, compressed);
    ``kind``: ``"add"`` or ``"remove"``; ``node``: the trace's node name; ``trace_ms``: its
    original timestamp (ms since the trace began); ``line``: its line in the file (0: made up —
    a node alive at the window start)."""

    t_s: float
    kind: str
    node: str
    trace_ms: int
    line: int


@dataclass
class Trace:
    """A validated, windowed, compressed trace: ``events`` sorted by time."""

    events: list[TraceEvent]
    source: str
    start_s: float = 0.0
    end_s: float | None = None
    compress: float = 1.0
    raw_events: int = 0
    note: str = ""   # what load_trace changed (a count trace scaled to the emulator's capacity)
    format: str = "events"   # the file's rows: "events", "counts" or "dated counts"

    @property
    def duration_s(self) -> float:
        """Wall seconds the replay takes (to the last event, or to the window end)."""
        if self.end_s is not None:
            return (self.end_s - self.start_s) / self.compress
        return self.events[-1].t_s if self.events else 0.0

    def nodes_at(self, t_s: float) -> set[str]:
        """Nodes up at replay time ``t_s`` (after every event at or before it)."""
        alive: set[str] = set()
        for e in self.events:
            if e.t_s > t_s:
                break
            (alive.add if e.kind == "add" else alive.discard)(e.node)
        return alive

    def max_nodes(self) -> int:
        """The most nodes up at once."""
        n = best = 0
        for e in self.events:
            n += 1 if e.kind == "add" else -1
            best = max(best, n)
        return best

    def counts(self) -> dict[str, int]:
        """How many ``add`` and ``remove`` events the windowed trace holds: ``{"add": n, "remove": m}``."""
        return {"add": sum(e.kind == "add" for e in self.events),
                "remove": sum(e.kind == "remove" for e in self.events)}


def load_trace(path: str | os.PathLike, *, start_s: float = 0.0, end_s: float | None = None,
               compress: float = 1.0, scale_to: int | None = None, seed: int = 0) -> Trace:
    """Load a spot trace (``ms,add|remove,node``, ``ms,count`` or ``date, time, count`` rows — e.g.
    ``2023-03-01, 12:00:05, 57``; ``#`` comments and blank lines ignored), keep the window
    ``[start_s, end_s)`` in trace seconds (nodes alive at ``start_s`` become ``add`` events at
    time 0), divide times by ``compress``.

    ``scale_to``: a count trace of a pool larger than that many VMs (the emulator's capacity) is
    scaled to it — each count times ``scale_to / peak``, rounded, so availability keeps its
    fraction of the peak — and the VM that goes at a drop is a seeded (``seed``) random choice
    among those up, not the last one added (which on a small emulator would never touch its
    slots). ``Trace.note`` says what was scaled. Without it, count traces add and remove last in,
    first out. Raises ``FileNotFoundError`` or ``TraceError`` (naming the file and line, and what
    is wrong)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file {p} does not exist (the shipped traces are in varuna_sdk/data/spot-traces/)")
    _check_window(start_s, end_s, compress, scale_to)
    fmt, raw, counts = _read_rows(p)
    note = ""
    if counts:
        raw, note = _count_events(counts, p, scale_to, seed)
    lo, hi = start_s * 1000.0, None if end_s is None else end_s * 1000.0
    events: list[TraceEvent] = []
    up_at_start: dict[str, tuple[int, int]] = {}
    for ms, kind, node, no in raw:
        if ms < lo:
            if kind == "add":
                up_at_start[node] = (ms, no)
            else:
                up_at_start.pop(node, None)
            continue
        if hi is not None and ms >= hi:
            break
        events.append(TraceEvent((ms - lo) / 1000.0 / compress, kind, node, ms, no))
    initial = [TraceEvent(0.0, "add", n, ms, 0) for n, (ms, _) in up_at_start.items()]
    return Trace(initial + events, str(p), start_s, end_s, float(compress), len(raw), note, fmt)


def _check_window(start_s: float, end_s: float | None, compress: float, scale_to: int | None) -> None:
    """``TraceError`` unless ``compress`` > 0, ``0 <= start_s < end_s`` (finite seconds) and
    ``scale_to`` is None or an integer >= 1."""
    if not (isinstance(compress, (int, float)) and math.isfinite(compress) and compress > 0):
        raise TraceError(f"compress={compress!r} must be a finite number > 0 (60: an hour of trace in a minute)")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (start_s, 0.0 if end_s is None else end_s)):
        raise TraceError(f"window start_s={start_s!r}, end_s={end_s!r} must be finite numbers of seconds")
    if start_s < 0 or (end_s is not None and end_s <= start_s):
        raise TraceError(f"window start_s={start_s}, end_s={end_s}: need 0 <= start_s < end_s (seconds)")
    if scale_to is not None and (not isinstance(scale_to, int) or isinstance(scale_to, bool) or scale_to < 1):
        raise TraceError(f"scale_to={scale_to!r} must be an integer >= 1 (the emulator's capacity) or None")


def _read_rows(p: Path) -> tuple[str, list[tuple[int, str, str, int]], list[tuple[int, int, int]]]:
    """The rows of trace file ``p``: its format (``"events"``, ``"counts"`` or ``"dated
    counts"``), its events ``(ms, kind, node, line)`` and its counts ``(ms, count, line)`` (one of
    the two lists is empty). ``TraceError`` naming the line for anything malformed."""
    raw: list[tuple[int, str, str, int]] = []  # (ms, kind, node, line)
    counts: list[tuple[int, int, int]] = []    # count traces: (ms, count, line), turned into events later
    fmt = None
    last_ms = -1
    alive: set[str] = set()
    t0_dated: float | None = None
    for no, text in enumerate(read_small_text(p, MAX_TRACE_BYTES, "trace file", TraceError).splitlines(), 1):
        line = text.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{p}:{no}"
        parts = [x.strip() for x in line.split(",")]
        this = ("events" if len(parts) == 3 and parts[1] in ("add", "remove", "grow") or len(parts) == 3 and
                not _DATE.match(parts[0]) else "dated counts" if len(parts) == 3 else
                "counts" if len(parts) == 2 else None)
        if this is None:
            raise TraceError(f"{where}: expected 'ms,add|remove,node', 'ms,count' or 'date, time, count', "
                             f"got {text.strip()!r}")
        if fmt is None:
            fmt = this
        elif fmt != this:
            raise TraceError(f"{where}: a {this} row in a trace of {fmt} rows; use one format per file")
        if fmt == "dated counts":   # date, time, count: milliseconds from the first row
            try:
                at = _parse_when(parts[0], parts[1])
            except ValueError:
                raise TraceError(f"{where}: {parts[0]!r}, {parts[1]!r} is not a date (YYYY-MM-DD) and a time "
                                 "(HH:MM[:SS])") from None
            t0_dated = at if t0_dated is None else t0_dated
            parts = [str(int(round((at - t0_dated) * 1000))), parts[2]]
        last_ms = ms = _row_ms(parts[0], last_ms, where)
        if fmt == "events":
            raw.append(_event_row(ms, parts[1], parts[2], alive, no, where))
        else:
            counts.append((ms, _row_count(parts[1], where), no))
    if fmt is None:
        raise TraceError(f"{p}: no events (expected rows 'ms,add|remove,node' or 'ms,count')")
    return fmt, raw, counts


def _row_ms(text: str, last_ms: int, where: str) -> int:
    """A row's time (whole milliseconds, not before ``last_ms``); ``TraceError`` at ``where``."""
    try:
        ms = int(text)
    except ValueError:
        header = " (a header row? start it with '#': a comment)" if not any(c.isdigit() for c in text) else ""
        raise TraceError(f"{where}: time {text!r} is not a whole number of milliseconds{header}") from None
    if ms < 0:
        raise TraceError(f"{where}: time {ms} ms is negative")
    if ms < last_ms:
        raise TraceError(f"{where}: time {ms} ms goes backwards (previous row: {last_ms} ms); "
                         "sort the trace by time")
    return ms


def _event_row(ms: int, kind: str, node: str, alive: set[str], no: int,
               where: str) -> tuple[int, str, str, int]:
    """An ``add``/``remove`` row as ``(ms, kind, node, line)``, updating ``alive`` (the nodes up);
    ``TraceError`` for a bad kind or node name, a node added twice or removed while down."""
    if kind not in ("add", "remove"):
        raise TraceError(f"{where}: event {kind!r} must be 'add' or 'remove'")
    if not _NODE.match(node):
        raise TraceError(f"{where}: node name {node!r} must be letters, digits, '.', '_' or '-'")
    if kind == "add":
        if node in alive:
            raise TraceError(f"{where}: node {node} added while already up")
        alive.add(node)
    else:
        if node not in alive:
            raise TraceError(f"{where}: node {node} removed but it is not up (never added, "
                             "or removed twice)")
        alive.discard(node)
    return (ms, kind, node, no)


def _row_count(text: str, where: str) -> int:
    """A count row's count (nodes up, 0..``MAX_TRACE_NODES``); ``TraceError`` at ``where``."""
    try:
        count = int(text)
    except ValueError:
        raise TraceError(f"{where}: count {text!r} is not a whole number") from None
    if not 0 <= count <= MAX_TRACE_NODES:
        raise TraceError(f"{where}: count {count} must be in 0..{MAX_TRACE_NODES} (nodes up at once)")
    return count


_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _parse_when(date: str, clock: str) -> float:
    """Seconds since the epoch (UTC) of ``YYYY-MM-DD`` and ``HH:MM[:SS[.fff]]``; ``ValueError``."""
    import datetime

    if not _DATE.match(date):
        raise ValueError(date)
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M"):
        try:
            return datetime.datetime.strptime(f"{date} {clock}", fmt).replace(tzinfo=datetime.timezone.utc).timestamp()
        except ValueError:
            continue
    raise ValueError(clock)


def _count_events(counts: list[tuple[int, int, int]], path: Path, scale_to: int | None,
                  seed: int) -> tuple[list[tuple[int, str, str, int]], str]:
    """A count trace's rows as add/remove events (and a note on any scaling): VMs follow each
    count; with ``scale_to`` below the peak, counts are scaled to it and the VM that goes is a
    seeded random one (see ``load_trace``)."""
    import random

    peak = max(c for _, c, _ in counts)
    scale = scale_to / peak if scale_to is not None and peak > scale_to else None
    rng = random.Random(seed)
    up: list[str] = []
    made = itertools.count()
    raw: list[tuple[int, str, str, int]] = []
    for ms, count, no in counts:
        want = int(math.floor(count * scale + 0.5)) if scale is not None else count
        if len(raw) + abs(want - len(up)) > MAX_TRACE_EVENTS:
            raise TraceError(f"{path}:{no}: the trace makes more than {MAX_TRACE_EVENTS} events; cut it into windows")
        while len(up) < want:
            node = f"node{next(made)}"
            up.append(node)
            raw.append((ms, "add", node, no))
        while len(up) > want:
            gone = up.pop(rng.randrange(len(up))) if scale is not None else up.pop()   # else last in, first out
            raw.append((ms, "remove", gone, no))
    note = (f"count trace scaled from a peak of {peak} VMs to {scale_to}: each count x {scale_to}/{peak}, rounded "
            f"(availability kept as a fraction of the peak); the VM that goes at a drop is a random one (seed {seed})"
            if scale is not None else "")
    return raw, note


# ------------------------------------------------------------------------------------ emulator
class SpotEmulator(PoolProvider):
    """A ``Provider`` of up to ``capacity`` emulated spot VMs replaying ``trace`` (see the module
    docstring).

    ``backend``: ``"ssh"`` (sshd test hosts; ``test_hosts``: an ``SSHDHosts`` to use — default:
    one of its own under ``root`` or a temporary folder, closed by ``close()``; ``netns=True``:
    network-namespace hosts) or ``"local"`` (local slots, workers as subprocesses).
    ``notice_s``: wall-clock seconds of pre-emption notice before each removal (0 or None: none).
    ``initial``: without a trace, how many hosts are up after ``start()`` (default ``capacity``).
    Raises ``ValueError`` for a bad capacity/backend/notice, ``RuntimeError`` when SSH test hosts
    cannot run here (with the reason).
    """

    def __init__(self, trace: Trace | None = None, *, capacity: int, backend: str = "local",
                 notice_s: float | None = 30.0, initial: int | None = None,
                 test_hosts: Any = None, root: str | os.PathLike | None = None, netns: bool = False,
                 gpus_per_host: int = 0, event_log: Any = None, job_id: str | None = None,
                 labels: dict[str, str] | None = None, notices: str = "provider",
                 cloud: str | tuple[str, ...] = "aws"):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be an integer >= 1 (the most VMs held at once)")
        if backend not in ("ssh", "local"):
            raise ValueError(f"backend={backend!r}: use 'ssh' (sshd test hosts) or 'local' (local slots)")
        if notice_s is not None and notice_s < 0:
            raise ValueError(f"notice_s={notice_s} must be >= 0 seconds (or None: no notices)")
        if initial is not None and not 0 <= initial <= capacity:
            raise ValueError(f"initial={initial} must be between 0 and capacity={capacity}")
        if netns and backend != "ssh":
            raise ValueError("netns=True needs backend='ssh'")
        if notices not in ("provider", "metadata"):
            raise ValueError(f"notices={notices!r}: use 'provider' (a provider event) or 'metadata' "
                             "(each VM's metadata service announces it, as on a cloud)")
        if notices == "metadata" and (backend != "ssh" or netns):
            raise ValueError("notices='metadata' needs backend='ssh' on loopback test hosts (a local slot has "
                             "no VM to watch; a namespace host cannot reach a loopback metadata server)")
        clouds = (cloud,) if isinstance(cloud, str) else tuple(cloud)
        if not clouds or any(c not in ("aws", "gcp", "azure") for c in clouds):
            raise ValueError(f"cloud={cloud!r}: use 'aws', 'gcp' or 'azure' (or a tuple of them, one per slot in turn)")
        self.notices, self.clouds = notices, clouds
        self.metadata: dict[str, Any] = {}   # slot -> its MetadataServer (notices="metadata")
        super().__init__(event_log=event_log, job_id=job_id)
        if trace is not None and trace.format != "events" and not trace.note and trace.max_nodes() > capacity:
            log.warning("count trace %s peaks at %d VMs but the emulator holds %d: nodes past the first %d are "
                        "ignored, and removals may never reach them; load it with load_trace(..., scale_to=%d)",
                        trace.source, trace.max_nodes(), capacity, capacity, capacity)
        self.trace, self.capacity, self.backend = trace, capacity, backend
        self.notice_s = float(notice_s or 0.0)
        self.initial = capacity if initial is None else initial
        self.netns, self.gpus_per_host = netns, gpus_per_host
        self.labels = {str(k): str(v) for k, v in (labels or {}).items()}   # on every host (e.g. its prices)
        self._own_root: Path | None = None
        self.test_hosts = test_hosts
        if backend == "ssh" and test_hosts is None:
            from .sshd_hosts import SSHDHosts, skip_reason

            reason = skip_reason()
            if reason:
                raise RuntimeError(reason)
            if root is None:
                self._own_root = Path(tempfile.mkdtemp(prefix="varuna-spot-"))
                root = self._own_root
            self.test_hosts = SSHDHosts(root)
            self._own_hosts = True
        else:
            self._own_hosts = False
        prefix = "vm" if backend == "ssh" else "local"
        self.slots = [f"{prefix}{i}" for i in range(capacity)]
        self._node_of: dict[str, str] = {}   # slot -> trace node
        self._slot_of: dict[str, str] = {}   # trace node -> slot
        self.overflow: set[str] = set()      # trace nodes that found no free slot (and are up in the trace)
        self.overflowed = 0                   # adds of the trace that found no free slot, in all
        self.removed_count = self.added_count = 0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._t0_mono: float | None = None
        self._op_lock = threading.RLock()   # one add/remove at a time

    # ---------------------------------------------------------------------------- provider
    def ssh_options(self) -> SSHOptions | None:
        """How to reach the emulated VMs: the sshd test hosts' options (their known_hosts file) when there are test
        hosts, else None (local slots: ``SSHOptions()`` defaults)."""
        return self.test_hosts.options() if self.test_hosts is not None else None

    def start(self) -> "SpotEmulator":
        """Bring up the initial hosts (trace events at time 0, else ``initial`` slots), then
        replay the rest of the trace on a thread."""
        if self._started:
            return self
        self.started = True
        self._t0_mono = time.monotonic()
        if self.trace is None:
            for slot in self.slots[: self.initial]:
                self.add_now(slot)
        else:
            for e in self.trace.events:
                if e.t_s <= 0:
                    self._trace_event(e)
                else:
                    self._schedule(e.t_s, lambda e=e: self._trace_event(e))
                    if e.kind == "remove" and self.notice_s > 0:
                        self._schedule(max(0.0, e.t_s - self.notice_s),
                                       lambda e=e: self._trace_notice(e))
        self._thread = threading.Thread(target=self._run, name="spot-emulator", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the replay and remove every host (a test host's sshd and processes, a local
        slot's processes); no events are emitted for this."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(10.0)
        with self._op_lock:
            errors = []
            for h in self.all_hosts():
                try:
                    self._kill(h.name)
                except Exception as e:  # noqa: BLE001 - keep cleaning the others
                    errors.append(f"{h.name}: {e}")
            if self._own_hosts and self.test_hosts is not None:
                self.test_hosts.close()
            if self._own_root is not None:
                shutil.rmtree(self._own_root, ignore_errors=True)
        if errors:
            raise RuntimeError("spot emulator cleanup failed: " + "; ".join(errors))

    # ------------------------------------------------------------------------------ by hand
    def add_now(self, name: str | None = None) -> Host:
        """Bring up host ``name`` (a free slot; default: the first free one) now; returns it.
        Raises ``ValueError`` if it is up already, or ``RuntimeError`` if no slot is free."""
        with self._op_lock:
            held = {h.name for h in self.all_hosts()}
            if name is None:
                free = [s for s in self.slots if s not in held]
                if not free:
                    raise RuntimeError(f"all {self.capacity} slots are up; remove one first")
                name = free[0]
            if name not in self.slots:
                raise ValueError(f"{name!r} is not a slot of this emulator: {self.slots}")
            if name in held:
                raise ValueError(f"host {name} is up already")
            if self.backend == "ssh":
                host = self.test_hosts.add(name, gpus=self.gpus_per_host, netns=self.netns)
            else:
                host = local_host(name, gpus=self.gpus_per_host)
            extra = dict(self.labels)
            if self.notices == "metadata":
                from .metadata import MetadataServer
                from .notice import ENV_URL

                cloud = self.clouds[self.slots.index(name) % len(self.clouds)]
                md = self.metadata[name] = MetadataServer(name, clouds=(cloud,)).start()
                extra[f"env.{ENV_URL}"] = md.url
            if extra:
                host = dataclasses.replace(host, labels={**extra, **host.labels})
            self.added_count += 1
            node = self._node_of.get(name)
            self._add_host(host, reason=f"trace {node} added" if node else "added")
            return host

    def remove_now(self, name: str, notice_s: float | None = None) -> float:
        """Pre-empt host ``name``: with ``notice_s`` (wall seconds) a notice now and the removal
        ``notice_s`` later (on the replay thread); without, removed before returning. Returns the
        removal time (Unix seconds). Raises ``KeyError`` if ``name`` is not up, ``ValueError`` for a
        negative or non-finite ``notice_s``."""
        if notice_s is not None and not 0 <= notice_s < math.inf:
            raise ValueError(f"notice_s={notice_s} must be >= 0 seconds (or None: removed now, no notice)")
        if name not in {h.name for h in self.all_hosts()}:
            raise KeyError(f"host {name} is not up; up: {sorted(h.name for h in self.all_hosts())}")
        if not notice_s:
            self._take(name, "preempted")
            return time.time()
        deadline = time.time() + notice_s
        self._warn(name, deadline, reason="preempted")
        self._schedule(self._now() + notice_s, lambda: self._take(name, "preempted"))
        return deadline

    def node_of(self, name: str) -> str | None:
        """The trace node host ``name`` stands for now (None: added by hand or not up)."""
        return self._node_of.get(name)

    # ----------------------------------------------------------------------------- internals
    _recheck_s = math.inf   # a subclass whose clock can stand still looks again this often

    def _now(self) -> float:
        return time.monotonic() - (self._t0_mono or time.monotonic())

    def _schedule(self, at_s: float, action: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (at_s, next(self._seq), action))
            self._cv.notify_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                if not self._heap:
                    self._cv.wait(1.0)
                    continue
                at, _, action = self._heap[0]
                wait = at - self._now()
                if wait > 0:
                    self._cv.wait(min(wait, self._recheck_s))
                    continue
                heapq.heappop(self._heap)
            if self._stop.is_set():
                return
            try:
                action()
            except Exception:  # noqa: BLE001 - keep replaying
                log.exception("spot emulator action failed")

    def _trace_event(self, e: TraceEvent) -> None:
        with self._op_lock:
            if self.closed:
                return
            if e.kind == "add":
                held = {h.name for h in self.all_hosts()}
                free = [s for s in self.slots if s not in held]
                if not free:
                    self.overflow.add(e.node)
                    self.overflowed += 1
                    if self.overflowed == 1:   # said once: a trace of a larger pool overflows at every add
                        log.info("spot emulator: trace node %s added while all %d slots are held: ignored, as every "
                                 "later node that finds no free slot (count: .overflowed; up now: .overflow)",
                                 e.node, len(self.slots))
                    return
                self._slot_of[e.node], self._node_of[free[0]] = free[0], e.node
                try:
                    self.add_now(free[0])
                except Exception:
                    self._slot_of.pop(e.node, None)
                    self._node_of.pop(free[0], None)
                    raise
            else:
                self.overflow.discard(e.node)
                slot = self._slot_of.get(e.node)
                if slot is not None:
                    self._take(slot, f"preempted (trace {e.node})")

    def _trace_notice(self, e: TraceEvent) -> None:
        slot = self._slot_of.get(e.node)
        if slot is None:
            return
        remove_at = self.trace_time_to_unix(e.t_s)
        self._warn(slot, remove_at, reason=f"preempted (trace {e.node})")

    def _warn(self, name: str, deadline: float, reason: str) -> None:
        """The pre-emption notice for host ``name``: a provider event, or (``notices="metadata"``)
        the host's metadata service starts reporting it."""
        md = self.metadata.get(name)
        if md is None:
            self._notice_host(name, deadline, reason=reason)
        else:
            md.announce(lead_s=max(0.0, deadline - time.time()))

    def trace_time_to_unix(self, t_s: float) -> float:
        """Unix time of replay time ``t_s``."""
        return time.time() + (t_s - self._now())

    def _take(self, name: str, reason: str) -> None:
        with self._op_lock:
            if name not in {h.name for h in self.all_hosts()}:
                return  # removed already (by hand, or closed)
            self._kill(name)
            node = self._node_of.pop(name, None)
            if node is not None:
                self._slot_of.pop(node, None)
            self.removed_count += 1
            self._remove_host(name, reason=reason)

    def _kill(self, name: str) -> list[int]:
        md = self.metadata.pop(name, None)
        if md is not None:
            md.close()
        if self.backend == "ssh":
            return self.test_hosts.remove(name) if name in self.test_hosts else []
        return kill_host(name)
