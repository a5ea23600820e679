"""What the dashboard knows about a job, read from the job's event log and nothing else.

``TelemetryStore`` polls a job's SQLite event log (``varuna_sdk.manager.events.EventLog``, opened
read-only) with one cursor per table (``since_id``), so each refresh reads only the rows appended
since the last one, and folds them into plain state the views draw:

- the VM pool (``VM`` per host: up / notice / pre-empted / lost, GPUs, $ per hour, straggler),
  from ``host_added``, ``preemption_notice``, ``host_removed``, ``host_lost``, ``straggler``
  events (and, for providers that write no pool events, from the hosts named by plans and workers);
- plans (``plan`` payloads, one per generation), morphs (``morph``), the job state
  (``job_state``), checkpoints and a ring of recent events;
- the per-step metrics as growing numpy columns (``MetricColumns``; 100k rows are ~6 MB);
- the latest heartbeat of every rank.

Opening a long log (the first refresh) does not fold every row: metrics come as numbers picked
out of their JSON by SQLite (``EventLog.metric_values``), only the events that change state
(``STATE_KINDS``) are folded in order, and the newest morphs, checkpoints and recent events are
read by query. Later refreshes fold each new row as it comes. Either way the state is the same
(``tests/test_dashboard_store.py``), except that the open keeps exactly the newest
``MAX_KEPT_EVENTS`` morphs and checkpoints.

Payload shapes are the contract written next to ``Kind`` in ``varuna_sdk/manager/events.py``;
missing keys are tolerated (shown as unknown), extra keys are ignored.

Also owns ``minmax_indices`` (display downsampling that keeps spikes) and ``resolve_event_log``.
Imports only numpy and ``varuna_sdk.manager.events`` (standard library underneath); must never
import torch, panel/bokeh, or anything that writes to the job: the dashboard is read-only.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from varuna_sdk.manager.billing import Billing
from varuna_sdk.manager.events import Event, EventLog, HeartbeatRow, Kind

#: Payload fields of a ``metrics`` row the views use (missing or non-numeric values become NaN).
METRIC_FIELDS = ("tokens_per_s", "examples_per_s", "step_time_s", "generation")

#: Metric columns kept for the charts: as ``EventLog.metric_values`` returns them, less ``id``.
METRIC_COLUMNS = ("time", "step", "loss") + METRIC_FIELDS

#: VM states, in the order the header counts them.
VM_STATES = ("up", "notice", "pre-empted", "lost", "released")

#: Event kinds that are not worth a row in the "recent events" table (noise at scale).
QUIET_KINDS = frozenset({"worker_after_loss"})

#: Event kinds whose order matters to the state (the VM pool, plans, the job state): the only
#: ones the open folds one by one (``TelemetryStore._fold`` acts on no other kind but these and
#: ``KEPT_KINDS``).
STATE_KINDS = (Kind.HOST_ADDED, Kind.PREEMPTION_NOTICE, Kind.HOST_REMOVED, Kind.HOST_LOST, Kind.STRAGGLER,
               Kind.PLAN, Kind.JOB_STATE, Kind.WORKER_JOINED, Kind.WORKER_REJOINED)

#: Event kinds kept as lists of their newest ``MAX_KEPT_EVENTS`` (the store's attribute of each).
KEPT_KINDS = {Kind.MORPH: "morphs", Kind.CHECKPOINT: "checkpoints", Kind.ESTIMATE_DRIFT: "drifts"}


READ_BATCH = 5000          # rows read per query when catching up with a log
MAX_KEPT_EVENTS = 5000     # plans, morphs, checkpoints kept for the views (the newest)


def _append_bounded(items: list, item: Any, cap: int = MAX_KEPT_EVENTS) -> None:
    items.append(item)
    if len(items) > cap + cap // 4:   # trim in chunks, not on every append
        del items[: len(items) - cap]


def resolve_event_log(source: str | Path) -> Path:
    """The event log of ``source``: a run folder holding ``events.db``, or the ``.db`` file itself.

    Raises ``FileNotFoundError`` saying which path was tried and what to pass instead.
    """
    p = Path(source).expanduser()
    if p.is_dir():
        db = p / "events.db"
        if not db.is_file():
            raise FileNotFoundError(
                f"run folder {p} has no events.db (the job's event log): pass the folder of a job that "
                "has started, or the path of its events.db")
        return db
    if p.is_file():
        return p
    raise FileNotFoundError(f"{p} does not exist: pass a run folder (holding events.db) or an event-log file")


def _f(v: Any) -> float:
    """A finite float or NaN (bools, strings and None are not numbers here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v) if math.isfinite(v) else math.nan


def minmax_indices(y: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of at most ``max_points`` samples of ``y`` that keep its shape for a line chart.

    ``y`` is split into ``max_points // 2`` equal buckets; each contributes the index of its
    minimum and of its maximum (in order), so spikes and dips (a pre-emption, a loss spike) stay
    visible where a plain stride would drop them. NaNs are skipped (an all-NaN bucket gives its
    first index). The first and last samples are always kept. ``len(y) <= max_points``: all.
    """
    n = len(y)
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4, got {max_points}")
    if n <= max_points:
        return np.arange(n)
    buckets = max(1, (max_points - 2) // 2)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    width = int(np.max(np.diff(edges)))
    # pad every bucket to the same width, then take argmin/argmax along rows
    idx = edges[:-1, None] + np.arange(width)[None, :]
    valid = idx < edges[1:, None]
    idx = np.minimum(idx, n - 1)
    vals = y[idx]
    bad = ~valid | np.isnan(vals)
    lo = np.where(bad, np.inf, vals).argmin(axis=1)
    hi = np.where(bad, -np.inf, vals).argmax(axis=1)
    rows = np.arange(buckets)
    pick = np.concatenate([idx[rows, lo], idx[rows, hi], [0, n - 1]])
    return np.unique(pick)


class MetricColumns:
    """Per-step metrics as numpy float64 columns (``METRIC_COLUMNS``) that grow by doubling.

    ``len(cols)`` rows; ``cols["loss"]`` is a view of the filled part; ``last_id`` the event-log
    id of the last row read (the reader's cursor).
    """

    def __init__(self, capacity: int = 1024):
        self._cap = capacity
        self._n = 0
        self._data = {c: np.full(capacity, np.nan) for c in METRIC_COLUMNS}
        self.last_id = 0

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, col: str) -> np.ndarray:
        return self._data[col][: self._n]

    def extend(self, rows: list[tuple]) -> None:
        """Append rows as ``EventLog.metric_values(METRIC_FIELDS)`` returns them (``None`` and
        non-finite values become NaN)."""
        if not rows:
            return
        a = np.array(rows, dtype=np.float64)
        a[~np.isfinite(a)] = np.nan
        need = self._n + len(rows)
        if need > self._cap:
            cap = max(need, 2 * self._cap)
            for c in METRIC_COLUMNS:
                grown = np.full(cap, np.nan)
                grown[: self._n] = self._data[c][: self._n]
                self._data[c] = grown
            self._cap = cap
        for j, c in enumerate(METRIC_COLUMNS, start=1):   # column 0 is the row id
            self._data[c][self._n: need] = a[:, j]
        self._n = need
        self.last_id = int(rows[-1][0])


def _in_batches(fetch: Callable[[int], list], since_id: int, id_of: Callable[[Any], int]) -> Iterator[list]:
    """Yield ``fetch(since_id)`` batches (of ``READ_BATCH`` rows, ``id_of`` a row's id), each
    from the last id of the one before, until a short one: a long log in bounded memory."""
    while True:
        batch = fetch(since_id)
        if batch:
            yield batch
        if len(batch) < READ_BATCH:
            return
        since_id = id_of(batch[-1])


@dataclass
class VM:
    """One VM of the pool as the event log describes it. ``status`` is one of ``VM_STATES``;
    ``since`` the Unix time of the event that set it; ``gpus`` / ``price_per_hour`` (US $) are
    ``None`` when no event said; ``straggler`` holds the last ``straggler`` payload for it;
    ``kind`` the provider's ``instance_type`` (or ``kind``, e.g. "local") label."""

    name: str
    status: str = "up"
    since: float | None = None
    gpus: int | None = None
    price_per_hour: float | None = None
    reason: str | None = None
    notice_deadline: float | None = None
    straggler: dict | None = None
    kind: str | None = None


@dataclass
class Snapshot:
    """Counters that change whenever the store's state does (views redraw only on change)."""

    events: int = 0
    heartbeats: int = 0
    metrics: int = 0


class TelemetryStore:
    """Read-only state of one job's event log, refreshed incrementally.

    ``path``: the event log (``resolve_event_log`` turns a run folder into it). ``job_id``: only
    rows of this job (default: every row). ``recent``: events kept for the recent-events table.
    Thread-safe: one store may serve every browser session of a server (``TelemetryStore.shared``);
    ``refresh`` reads at most once per ``min_interval_s``.

    Raises ``FileNotFoundError`` when the log does not exist yet.
    """

    _shared: dict[tuple[str, str | None], "TelemetryStore"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, path: str | Path, *, job_id: str | None = None, recent: int = 200,
                 min_interval_s: float = 0.2):
        self.path = resolve_event_log(path)
        self.job_id = job_id
        self.min_interval_s = min_interval_s
        self._log = EventLog.reader(self.path)
        self._lock = threading.RLock()
        self._last_refresh = -math.inf
        self._ev_cursor = 0
        self._hb_cursor = 0
        self.vms: dict[str, VM] = {}
        self.billing = Billing()
        self.plans: list[Event] = []
        self.morphs: list[Event] = []
        self.drifts: list[Event] = []   # estimate_drift events: the step time left the prediction
        self.checkpoints: list[Event] = []
        self.job_state: Event | None = None
        self.first_event_time: float | None = None
        self.recent: deque[Event] = deque(maxlen=recent)
        self.metrics = MetricColumns()
        self.heartbeats: dict[int, HeartbeatRow] = {}
        self.version = Snapshot()
        self.last_change = time.time()
        self.read_s = 0.0  # seconds spent in the last refresh that read something

    @classmethod
    def shared(cls, path: str | Path, job_id: str | None = None) -> "TelemetryStore":
        """One store per (event log, job) in this process, shared by every session of a server."""
        key = (str(resolve_event_log(path).resolve()), job_id)
        with cls._shared_lock:
            store = cls._shared.get(key)
            if store is None:
                store = cls._shared[key] = cls(key[0], job_id=job_id)
            return store

    # ------------------------------------------------------------------------------ reading
    def refresh(self, force: bool = False) -> bool:
        """Read what was appended since the last call; returns whether anything changed."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_refresh < self.min_interval_s:
                return False
            self._last_refresh = now
            t0 = time.perf_counter()
            changed = self._read_events() | self._read_metrics() | self._read_heartbeats()
            if changed:
                self.last_change = time.time()
                self.read_s = time.perf_counter() - t0
            return changed

    def _events(self, **query: Any) -> list[Event]:
        return self._log.events(job_id=self.job_id, **query)

    def _read_events(self) -> bool:
        """Fold the events appended since the cursor, one by one (the first read: ``_open_events``)."""
        if self._ev_cursor == 0:
            return self._open_events()
        changed = False
        for events in _in_batches(lambda since: self._events(since_id=since, limit=READ_BATCH),
                                  self._ev_cursor, lambda e: e.id):
            for e in events:
                self._apply(e)
            self._ev_cursor = events[-1].id
            self.version.events += 1
            changed = True
        return changed

    def _open_events(self) -> bool:
        """First read: fold only ``STATE_KINDS`` events in order, and read the newest
        ``KEPT_KINDS`` events and the newest non-quiet ones (the recent table) by query; every
        query stops at the newest event seen at the start, where the cursor then stands."""
        newest = self._events(last=1)
        if not newest:
            self._ev_cursor = -1  # nothing yet: poll incrementally from now on (ids start at 1)
            return False
        upto = newest[0].id
        self.first_event_time = self._events(limit=1)[0].time
        for events in _in_batches(lambda since: self._events(kind=STATE_KINDS, since_id=since, until_id=upto,
                                                             limit=READ_BATCH), 0, lambda e: e.id):
            for e in events:
                self._fold(e)
        for kind, attr in KEPT_KINDS.items():
            setattr(self, attr, self._events(kind=kind, until_id=upto, last=MAX_KEPT_EVENTS))
        self.recent.extend(self._events(not_kind=QUIET_KINDS, until_id=upto, last=self.recent.maxlen))
        self._ev_cursor = upto
        self.version.events += 1
        return True

    def _read_metrics(self) -> bool:
        """Append the metrics rows written since the cursor (as numbers, ``EventLog.metric_values``)."""
        changed = False
        for rows in _in_batches(lambda since: self._log.metric_values(
                METRIC_FIELDS, job_id=self.job_id, since_id=since, limit=READ_BATCH),
                self.metrics.last_id, lambda r: r[0]):
            self.metrics.extend(rows)
            self.version.metrics = len(self.metrics)
            changed = True
        return changed

    def _read_heartbeats(self) -> bool:
        """Keep the latest heartbeat per rank (the first read asks for just those, not the table)."""
        if self._hb_cursor == 0:
            hbs = sorted(self._log.latest_heartbeats(self.job_id).values(), key=lambda h: h.id)
        else:
            hbs = self._log.heartbeats(job_id=self.job_id, since_id=self._hb_cursor)
        if not hbs:
            if self._hb_cursor == 0:
                self._hb_cursor = -1  # nothing yet: poll incrementally from now on (ids start at 1)
            return False
        for h in hbs:
            if h.rank is not None:
                self.heartbeats[h.rank] = h
            if h.host and h.host not in self.vms and not self._pool_events_seen():
                self.vms[h.host] = VM(h.host, since=h.time)
        self._hb_cursor = hbs[-1].id
        self.version.heartbeats += 1
        return True

    def _pool_events_seen(self) -> bool:
        """Whether the provider writes pool events (then only they add VMs)."""
        return self._has_pool_events

    _has_pool_events = False

    def _vm(self, name: str, t: float) -> VM:
        vm = self.vms.get(name)
        if vm is None:
            vm = self.vms[name] = VM(name, since=t)
        return vm

    def _apply(self, e: Event) -> None:
        """Fold one new event into the state: the recent table, then ``_fold``."""
        if self.first_event_time is None:
            self.first_event_time = e.time
        if e.kind not in QUIET_KINDS:
            self.recent.append(e)
        self._fold(e)

    def _fold(self, e: Event) -> None:
        """Fold one event of ``STATE_KINDS`` or ``KEPT_KINDS`` into the state (the payload shapes
        of ``Kind``); other kinds change nothing here."""
        p = e.payload if isinstance(e.payload, dict) else {}
        k = e.kind
        if k == Kind.HOST_ADDED and e.host:
            self._has_pool_events = True
            vm = self._vm(e.host, e.time)
            vm.status, vm.since, vm.reason, vm.notice_deadline = "up", e.time, None, None
            vm.straggler = None
            if isinstance(p.get("gpus"), int) and not isinstance(p.get("gpus"), bool):
                vm.gpus = p["gpus"]
            self.billing.feed(e)
            meter = self.billing.meters[e.host]
            vm.price_per_hour, vm.kind = meter.price_per_hour, meter.kind
        elif k == Kind.PREEMPTION_NOTICE and e.host:
            vm = self._vm(e.host, e.time)
            if vm.status == "up":
                vm.status, vm.since = "notice", e.time
            d = _f(p.get("deadline"))
            vm.notice_deadline = None if math.isnan(d) else d
        elif k == Kind.HOST_REMOVED and e.host:
            self._has_pool_events = True
            vm = self._vm(e.host, e.time)
            reason = p.get("reason") if isinstance(p.get("reason"), str) else None
            why = (reason or "").lower()
            released = "preempt" not in why and any(w in why for w in ("releas", "host file", "closed", "scale",
                                                                         "stopped", "excluded"))
            vm.status, vm.since, vm.reason = ("released" if released else "pre-empted"), e.time, reason
            self.billing.feed(e)
        elif k == Kind.HOST_LOST and e.host:
            vm = self._vm(e.host, e.time)
            if vm.status in ("up", "notice"):
                vm.status, vm.since = "lost", e.time
                vm.reason = p.get("reason") if isinstance(p.get("reason"), str) else None
        elif k == Kind.STRAGGLER:
            host = e.host or self._host_of_rank(p.get("rank", e.rank))
            if host:
                self._vm(host, e.time).straggler = dict(p)
        elif k == Kind.PLAN:
            _append_bounded(self.plans, e)
            for h in p.get("hosts") or []:
                if isinstance(h, str) and h not in self.vms and not self._has_pool_events:
                    self.vms[h] = VM(h, since=e.time)
        elif k in KEPT_KINDS:
            _append_bounded(getattr(self, KEPT_KINDS[k]), e)
        elif k == Kind.JOB_STATE:
            self.job_state = e
        elif k in (Kind.WORKER_JOINED, Kind.WORKER_REJOINED) and e.host and not self._has_pool_events:
            self._vm(e.host, e.time)

    def _host_of_rank(self, rank: Any) -> str | None:
        plan = self.plan
        hosts = plan.get("hosts") if plan else None
        if isinstance(rank, int) and isinstance(hosts, list) and 0 <= rank < len(hosts):
            return hosts[rank]
        return None

    # ------------------------------------------------------------------------------ derived
    @property
    def plan(self) -> dict | None:
        """The latest ``plan`` payload (the running configuration), or ``None``."""
        return self.plans[-1].payload if self.plans else None

    @property
    def plan_time(self) -> float | None:
        """Unix time (seconds) of the latest ``plan`` event (when the running configuration began), or ``None`` before
        the first plan."""
        return self.plans[-1].time if self.plans else None

    def cost(self, now: float | None = None) -> dict | None:
        """What the VMs cost so far (``manager.billing.Billing.cost``) up to ``now`` (default: now)."""
        return self.billing.cost(time.time() if now is None else now)

    def vm_counts(self) -> dict[str, int]:
        """VMs per status (every key of ``VM_STATES``) and ``stragglers``."""
        counts = {s: 0 for s in VM_STATES}
        for vm in self.vms.values():
            counts[vm.status] = counts.get(vm.status, 0) + 1
        counts["stragglers"] = sum(1 for vm in self.vms.values() if vm.straggler)
        return counts

    def ranks_of(self, host: str) -> list[tuple[int, int, int]]:
        """(rank, stage, replica) of every rank the running plan puts on ``host``
        (``rank = replica * P + stage``, ``varuna_sdk.pipeline.groups.Topology``)."""
        plan = self.plan or {}
        P = plan.get("P")
        hosts = plan.get("hosts") or []
        if not isinstance(P, int) or P < 1:
            return []
        return [(r, r % P, r // P) for r, h in enumerate(hosts) if h == host]

    def generation_spans(self) -> dict[int, tuple[float, float]]:
        """First and last step of every generation seen in the metrics (``generation`` column)."""
        g = self.metrics["generation"]
        s = self.metrics["step"]
        ok = ~np.isnan(g)
        if not ok.any():
            return {}
        g, s = g[ok], s[ok]
        change = np.flatnonzero(np.diff(g)) + 1
        starts = np.concatenate([[0], change])
        ends = np.concatenate([change - 1, [len(g) - 1]])
        out: dict[int, tuple[float, float]] = {}
        for a, b in zip(starts, ends):
            gen = int(g[a])
            lo, hi = out.get(gen, (s[a], s[b]))
            out[gen] = (min(lo, s[a]), max(hi, s[b]))
        return out

    def generation_rows(self, generation: int | None) -> np.ndarray | None:
        """Indices of the metric rows of ``generation`` (default: the running plan's; the rows
        after the latest plan event when metrics carry no generation), or ``None``."""
        if len(self.metrics) == 0:
            return None
        gen = self.metrics["generation"]
        if generation is None:
            plan = self.plan
            generation = plan.get("generation") if plan else None
        if isinstance(generation, int) and (gen == generation).any():
            return np.flatnonzero(gen == generation)
        if np.isnan(gen).all():  # metrics carry no generation: the steps since the plan event
            t = self.plan_time if self.plan_time is not None else -math.inf
            return np.flatnonzero(self.metrics["time"] >= t)
        return None

    def metric_median(self, column: str, generation: int | None = None, last: int = 20,
                      skip: int = 2) -> float | None:
        """Median of metric ``column`` over the last ``last`` steps of ``generation`` (see
        ``generation_rows``), skipping its first ``skip`` steps (warm-up after a (re)start);
        ``None`` without such steps."""
        sel = self.generation_rows(generation)
        if sel is None or len(sel) == 0:
            return None
        sel = sel[skip:] if len(sel) > skip else sel
        vals = self.metrics[column][sel[-last:]]
        vals = vals[~np.isnan(vals)]
        return float(np.median(vals)) if len(vals) else None

    def measured_step_s(self, generation: int | None = None, last: int = 20, skip: int = 2) -> float | None:
        """Median measured step time (seconds) of ``generation``: ``metric_median("step_time_s")``."""
        return self.metric_median("step_time_s", generation, last, skip)

    def stage_compute(self) -> dict[int, dict[str, float]]:
        """Measured per-stage compute of the running plan from the latest heartbeats (sent after
        the plan event): stage -> {"F", "R", "B": seconds per step (per-micro-batch time x
        micro-batches, median over the stage's replicas), "wait": seconds per step blocked on an
        input from a neighbour stage (NaN from workers that do not report it), "step": step
        seconds, "ranks": n}."""
        plan = self.plan or {}
        P = plan.get("P")
        if not isinstance(P, int) or P < 1:
            return {}
        t0 = self.plan_time or -math.inf
        m_plan = plan.get("num_micro_batches")
        per: dict[int, list[dict[str, float]]] = {}
        for rank, h in self.heartbeats.items():
            if h.time < t0 or rank >= P * max(1, int(plan.get("D") or 1)):
                continue
            stage = h.payload.get("stage") if isinstance(h.payload.get("stage"), int) else rank % P
            m = h.payload.get("micro_batches")
            m = m if isinstance(m, int) and m > 0 else (m_plan if isinstance(m_plan, int) else 1)
            per.setdefault(stage, []).append({
                "F": _f(h.fwd_s) * m, "R": _f(h.recompute_s) * m, "B": _f(h.bwd_s) * m,
                "wait": _f(h.payload.get("wait_s")), "step": _f(h.step_time_s)})
        out = {}
        for stage, rows in per.items():
            out[stage] = {k: float(np.nanmedian([r[k] for r in rows])) if any(
                not math.isnan(r[k]) for r in rows) else math.nan for k in ("F", "R", "B", "wait", "step")}
            out[stage]["ranks"] = len(rows)
        return out

    def close(self) -> None:
        """Close this store's read handle on the event log (the log file itself is left untouched)."""
        with self._lock:
            self._log.close()
