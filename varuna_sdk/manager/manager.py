"""The morph manager: one state machine per job that keeps it training while spot VMs come and
go (paper §4.2 correctness-preserving morphing, §4.5 checkpoints, §4.6 manager).

States (``JobState``): PENDING → PROVISIONING → RUNNING ⇄ MORPHING / RECOVERING → SUCCEEDED,
FAILED or STOPPED (by the user). Each launch of workers under one plan is a *generation*
(``manager.generation.Generation``); the manager decides, from provider events, heartbeats and
the planner, when to end one and start the next:

- **pre-emption notice** for a VM in use — from the provider, or from the VM itself (its
  notice watcher reads the cloud's metadata and tells the manager over the heartbeat channel:
  ``cluster.notice``) → ask the workers to stop at the next mini-batch
  boundary (they agree on the step, checkpoint and exit), re-plan for the VMs that remain,
  relaunch, resume — no step lost;
- **sudden loss** (VM removed, heartbeats stopped, process died) → stop the survivors, re-plan,
  resume from the last complete checkpoint (at most the checkpoint interval lost);
- **VMs returned or added** → grow when the planner predicts at least ``GrowRule.min_gain``
  more examples/s and the cooldown since the last morph has passed (hysteresis);
- **straggler** (a worker's compute persistently ``StragglerRule.factor`` x its peers', from
  heartbeats) → exclude its VM when the simulator says the job is faster without it;
- a worker that does not stop within ``stop_timeout_s`` → killed; the job falls back to the
  last complete checkpoint;
- a worker that crashes (a real failure, not a lost VM) → relaunch from the last checkpoint,
  up to ``max_failures`` times; pre-emptions are counted separately (``max_preemptions``).

The global batch never changes; the resumed run's loss trajectory is the uninterrupted one's
(the data position, learning rate and dropout seeds follow the step). Everything the manager
decides is an event in the job's SQLite event log (``events.db`` in the run folder): state
changes, plans (with the simulated timeline), morphs (time, cause, old → new plan, downtime,
steps lost), stragglers. A manager restarted on the same run folder and job id reads its
state back from there and continues the job.

Owns ``Manager``, ``JobState``, ``MorphRecord``, ``ManagerError``. Imports ``cluster`` (hosts,
provider), ``planner``, ``checkpoint``, ``manager.events|generation|decisions``; never imported
by them.
"""

from __future__ import annotations

import copy
import enum
import json
import logging
import math
import os
import queue
import re
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..cluster.hosts import Host, Secret
from ..cluster.localproc import is_local
from ..config import ConfigError, JobConfig
from .decisions import (DriftRule, GrowRule, StragglerRule, compute_ratios, find_stragglers, pool_prices, pool_slots,
                        segment_factors, step_time_drift, steps_lost, worker_slots)
from .events import Event, EventLog, Kind
from .runs import RunBusy, acquire_run_lock, clear_stop, watch_stop_requests

_log = logging.getLogger(__name__)


SUSPECT_S = 120.0  # a VM reported lost is not planned on for this long unless the provider re-adds it



JOB_SECRET_FILE = ".job-secret"   # in the run folder, mode 0600


def _manifest_key(token: Secret) -> bytes:
    from ..checkpoint.store import manifest_key

    return manifest_key(token.reveal())


def _answers(h: Host, timeout_s: float = 1.0) -> bool:
    """Whether a VM reported lost is reachable again: a local slot always is (only its worker
    died); an SSH VM when its SSH port accepts a TCP connection within ``timeout_s``."""
    if is_local(h):
        return True
    import socket

    try:
        with socket.create_connection((h.address, h.port), timeout=timeout_s):
            return True
    except OSError:
        return False

class JobState(str, enum.Enum):
    """Where a job is. Terminal: SUCCEEDED, FAILED, STOPPED."""

    PENDING = "PENDING"
    PROVISIONING = "PROVISIONING"
    RUNNING = "RUNNING"
    MORPHING = "MORPHING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


class CalibrationFailed(RuntimeError):
    """Measuring the model for the planner failed (its code raised): not retried."""


class ManagerError(RuntimeError):
    """The job could not go on (no VMs left, failure budget spent, bad configuration)."""


@dataclass
class MorphRecord:
    """One morph: ``time`` (Unix s, when its cause was seen), ``cause`` ("notice", "loss",
    "grow", "straggler", "failure", "stop_timeout", "manager_restart"), ``old``/``new`` plans
    (``{"P", "D", "gpus", "micro_batch_size", "hosts"}``), ``downtime_s`` (cause seen → first
    step of the new generation finished; None until then), ``steps_lost`` (trained steps the
    resumed checkpoint does not hold), ``from_step`` (last step finished before), and
    ``resume_step`` (steps the checkpoint holds). ``phases_s``: the downtime split into its
    phases (``MORPH_PHASES``, seconds each; they sum to ``downtime_s``); ``candidates``: the
    planner's best predictions for the new pool (``{"P", "D", "micro_batch_size",
    "examples_per_s", "time_s"}``, fastest first, the chosen one marked ``"chosen": True``) and
    ``feasible_plans`` how many it compared (paper §4.2: the planner simulates each)."""

    time: float
    cause: str
    old: dict[str, Any]
    new: dict[str, Any] | None = None
    downtime_s: float | None = None
    steps_lost: int = 0
    from_step: int | None = None
    resume_step: int = 0
    host: str | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    feasible_plans: int | None = None
    marks: dict[str, float] = field(default_factory=dict, repr=False)

    def mark(self, phase_end: str, at: float | None = None, *, first_only: bool = False) -> None:
        """Note when the phase ``phase_end`` (one of ``MORPH_PHASES``) ended (Unix s)."""
        if first_only and phase_end in self.marks:
            return
        self.marks[phase_end] = time.time() if at is None else at

    def close(self, first_step_time: float) -> None:
        """The new generation finished its first step at ``first_step_time``: set the downtime and
        its phases (each from the previous phase's end; a phase not seen counts 0 s)."""
        self.downtime_s = max(0.0, first_step_time - self.time)
        self.mark("first_step", first_step_time)
        self.phases_s = morph_phases(self.time, self.marks)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("marks")
        return d


HISTORY = 5   # heartbeats per rank kept for the drift estimate (one per step)

MORPH_PHASES = ("stop", "wait_for_vms", "replan", "start_workers", "first_step")
"""A morph's downtime in order: the old generation stopping (checkpoint at the boundary, or
killed after a loss), waiting for usable VMs, planning, starting the workers (spawn or SSH, until
every worker's first heartbeat), and the first step (process group, model build, checkpoint
load, one step)."""


def morph_phases(start: float, marks: dict[str, float]) -> dict[str, float]:
    """Seconds per phase of ``MORPH_PHASES`` from the times each one ended (``marks``, Unix s);
    a phase whose end was not marked lasts 0 s. The values sum to the last mark minus ``start``."""
    out, t = {}, start
    for ph in MORPH_PHASES:
        end = marks.get(ph)
        if end is None:
            out[ph] = 0.0
            continue
        out[ph] = round(max(0.0, end - t), 3)
        t = max(t, end)
    return out


def plan_candidates(pl, row, top: int = 3) -> tuple[list[dict[str, Any]], int]:
    """The planner's fastest predictions for a pool (one row per P x D, the best micro-batch
    each), at most ``top`` plus the chosen ``row`` when it is not among them; and how many
    feasible rows were compared. ``pl``: a ``planner.Plan`` (None: started as configured)."""
    if pl is None:
        return [], 0
    best: dict[tuple[int, int], Any] = {}
    for r in pl.feasible:
        k = (r.P, r.D)
        if k not in best or r.examples_per_s > best[k].examples_per_s:
            best[k] = r
    if row is not None:
        best[(row.P, row.D)] = row
    ranked = sorted(best.values(), key=lambda r: -r.examples_per_s)
    keep = ranked[:top] + [r for r in ranked[top:] if row is not None and r is row]
    return [{"P": r.P, "D": r.D, "micro_batch_size": r.micro_batch_size, "examples_per_s": round(r.examples_per_s, 3),
             "time_s": round(r.time_s, 4), "chosen": row is not None and (r.P, r.D) == (row.P, row.D)}
            for r in keep], len(pl.feasible)


@dataclass
class _Running:
    """The generation being supervised and what the manager knows of it."""

    gen: Any
    job: JobConfig
    plan: Any
    row: Any
    hosts: list[Host]
    started: float
    predicted_stage_s: list[float]
    wall_started: float = field(default_factory=time.time)
    first_step_time: float | None = None
    stopping: tuple[str, str | None, float] | None = None  # (cause, host, when asked)
    stop_deadline: float = math.inf
    profile: Any = None                      # the calibration this generation was planned from
    estimate_s: float | None = None          # the latest re-calibrated step time (None: the plan's)
    recalibrated_examples_per_s: float | None = None   # the running plan re-simulated from heartbeats


def _plan_summary(job: JobConfig, hosts: list[Host]) -> dict[str, Any]:
    p = job.parallel
    return {"P": p.P, "D": p.D, "gpus": p.P * p.D, "micro_batch_size": p.micro_batch_size,
            "num_micro_batches": p.num_micro_batches, "hosts": [h.name for h in hosts]}


class Manager:
    """Run ``job`` on the VMs ``provider`` offers, morphing as they come and go.

    Args:
        job: the job (P/D may be null: planned; a P/D the config fixes is kept only for the first
            generation — after a morph the planner chooses for the GPUs then available).
        provider: where VMs come from (``cluster.provider``: local slots, an SSH host list, the
            spot emulator, a cloud).
        run_dir: the job's folder (event log ``events.db``, ``metrics.jsonl``, checkpoints).
        job_id: stable id; default the run folder's name. A manager started again on the same
            folder and id continues the job.
        profile: calibration for the planner (default: the job's cached ``calibrate_job``).
        heartbeat_interval_s: workers' heartbeat period (loss declared after 2 missed).
        grow, straggler: rules (``None`` straggler: never exclude a slow worker).
        drift: when the measured step time has left the prediction (``DriftRule``: 15 % for 5
            steps), record an ``estimate_drift`` event with the estimate re-simulated from the
            job's own heartbeats (per-stage F+R+B measured vs calibrated) and plan every later
            morph from the calibration scaled by them (``Profile.scaled``); ``None``: never.
        stop_timeout_s: how long workers may take to stop at a boundary and checkpoint before
            they are killed (then the last complete checkpoint is used).
        max_preemptions, max_failures: budgets, counted separately.
        wait_for_hosts_s: how long to wait when the pool has no VM before failing.
        generation_options: extra keyword arguments for ``Generation`` (bootstrap settings...).
        calibrate_first: plan the first generation from a calibration (default). ``False``: a
            job whose config fixes P and D starts at once with them (the stage split balanced on
            the traced model's costs, no simulation) and is calibrated only when a morph needs a
            plan — for a fixed pool of workers (``varuna train``) that never happens.
        labels: plain strings describing the job for people (``{"model": ..., "data": ...}`` from the
            launcher's model spec), recorded with every plan for the dashboard; the manager does
            not read them.

    Raises ``ConfigError`` for an invalid job before anything starts.
    """

    def __init__(self, job: JobConfig, provider, *, run_dir: str | Path, job_id: str | None = None,
                 profile=None, heartbeat_interval_s: float = 1.0, grow: GrowRule | None = GrowRule(),
                 straggler: StragglerRule | None = StragglerRule(), drift: DriftRule | None = DriftRule(),
                 stop_timeout_s: float = 60.0,
                 max_preemptions: int = 1000, max_failures: int = 2, wait_for_hosts_s: float = 300.0,
                 generation_options: dict[str, Any] | None = None,
                 on_state: Callable[[JobState, str], None] | None = None, calibrate_first: bool = True,
                 labels: dict[str, str] | None = None):
        job = copy.deepcopy(job).validate()
        if job.train.checkpoint_every <= 0:
            # a sudden loss must not lose the whole run: checkpoint about every 10% of the run
            job.train.checkpoint_every = max(1, min(25, job.train.steps // 10))
        if not heartbeat_interval_s > 0:
            raise ConfigError(f"heartbeat_interval_s={heartbeat_interval_s} must be > 0 seconds")
        if not stop_timeout_s > 0:
            raise ConfigError(f"stop_timeout_s={stop_timeout_s} must be > 0 seconds")
        self.provider = provider
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if job.train.checkpoint_url is None:  # one store every generation and every VM sees
            job.train.checkpoint_url = str(self.run_dir / "checkpoints")
        if not (self.run_dir / "config.yaml").exists():   # the run folder says what it runs (status, dashboard)
            job.to_yaml(self.run_dir / "config.yaml")
        self.job = job
        self.job_id = job_id or self.run_dir.name
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.grow = grow
        self.straggler = straggler
        self.drift = drift
        self.stop_timeout_s = float(stop_timeout_s)
        self.max_preemptions = int(max_preemptions)
        self.max_failures = int(max_failures)
        self.wait_for_hosts_s = float(wait_for_hosts_s)
        self.generation_options = dict(generation_options or {})
        # one secret for the whole job, kept in the run folder (0600): every generation's heartbeats
        # and every checkpoint manifest are signed with it, and a restarted manager reuses it
        self.generation_options.setdefault("token", Secret.load_or_create(self.run_dir / JOB_SECRET_FILE))
        self._manifest_key = _manifest_key(self.generation_options["token"])
        ssh = provider.ssh_options() if hasattr(provider, "ssh_options") else None
        if ssh is not None:
            self.generation_options.setdefault("ssh_options", ssh)
        self._on_state = on_state
        self._profile = profile
        self.calibrate_first = bool(calibrate_first)
        self.labels = {str(k): str(v) for k, v in (labels or {}).items()}
        self.log = EventLog(self.run_dir / "events.db")
        self.state = JobState.PENDING
        self.morphs: list[MorphRecord] = []
        self.generation = 0
        self.preemptions = 0
        self.failures = 0
        self.error: str | None = None
        self._q: queue.Queue = queue.Queue()
        self._noticed: dict[str, float] = {}     # host -> deadline
        self._excluded: set[str] = set()          # stragglers taken out
        self._suspect: dict[str, float] = {}      # host -> when reported lost (until re-added)
        self._micro_batch_size: int | None = None  # the first plan's; morphs keep it (see _replan)
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_morph_time = time.time()
        self._metric_cursor = 0
        self._hb_cursor = 0
        self._history: dict[int, list[float]] = {}   # rank -> recent compute s per micro-batch
        self._step_times: list[float] = []           # the running generation's measured step times (s)
        self._last_failure: str | None = None         # the last line of the last worker failure
        self._last_plan: tuple | None = None          # (pool's VM names, what _replan returned) of the last launch
        self._joined: set[int] = set()                # ranks of this generation that said hello
        self._world = 0                               # how many it has
        self._hb_last_step: dict[int, int] = {}
        self._last_step: int | None = None
        self._pending: MorphRecord | None = None
        self._lock_fd: int | None = None              # the run folder's manager lock while running
        self._restored = self._restore()

    # ------------------------------------------------------------------ persistence (restart)
    def _restore(self) -> bool:
        """Read a previous manager's state of this job from the event log."""
        states = self.log.events(job_id=self.job_id, kind=Kind.JOB_STATE)
        if not states:
            return False
        last = JobState(states[-1].payload.get("state", "PENDING"))
        plans = self.log.events(job_id=self.job_id, kind=Kind.PLAN)
        self.generation = 1 + max((int(e.payload.get("generation", 0)) for e in plans), default=-1)
        for e in self.log.events(job_id=self.job_id, kind=Kind.MORPH):
            self.morphs.append(MorphRecord(**{k: v for k, v in e.payload.items() if k in MorphRecord.__dataclass_fields__}))
            if e.payload.get("cause") in ("failure",):
                self.failures += 1
            elif e.payload.get("cause") in ("notice", "loss", "stop_timeout"):
                self.preemptions += 1
        newest = self.log.metrics(job_id=self.job_id, last=1)   # (not every row: a long job has millions)
        if newest:
            self._metric_cursor = newest[-1]["id"]
            self._last_step = self.log.max_step(job_id=self.job_id)
        self.state = last
        if last == JobState.FAILED:   # a relaunched failed run says why it failed, not "None"
            self.error = (f"this run failed before and is not run again (start a new run folder): "
                          f"{states[-1].payload.get('reason') or 'no reason was recorded'}")
        if plans and isinstance(plans[0].payload.get("micro_batch_size"), int):
            self._micro_batch_size = plans[0].payload["micro_batch_size"]   # the job's, kept by every morph
        if last.terminal:   # (a STOPPED job continued keeps it too: the same dropout masks per example)
            return True
        if plans:
            self._pending = MorphRecord(time=time.time(), cause="manager_restart",
                                        old={k: plans[-1].payload.get(k) for k in ("P", "D", "gpus", "micro_batch_size", "hosts")},
                                        from_step=self._last_step)
        return True

    # -------------------------------------------------------------------------------- public
    def start(self) -> "Manager":
        """Run the job in a background thread (for notebooks); returns at once. Raises
        ``ManagerError`` when another manager runs this run folder now (``runs.acquire_run_lock``)."""
        if self._thread is not None and self._thread.is_alive():
            raise ManagerError(f"job {self.job_id} is already running in this manager")
        self._take_lock()
        self._thread = threading.Thread(target=self._run_safe, name=f"varuna-manager-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    @property
    def settled(self) -> bool:
        """RUNNING with no morph under way (the last one's new plan has done its first step)."""
        return self.state == JobState.RUNNING and self._pending is None

    def wait(self, timeout_s: float | None = None) -> JobState:
        """Block until the background run ends (or ``timeout_s``); returns the state."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.state

    def cancel(self) -> None:
        """Ask the job to stop: the workers checkpoint at the next boundary and exit; state
        becomes STOPPED. A later manager on the same folder can resume it."""
        self._cancel.set()
        self._q.put(("cancel", None))

    def run(self) -> JobState:
        """Run the job to the end in this thread; returns SUCCEEDED, FAILED or STOPPED.
        Raises ``ManagerError`` (after recording FAILED) when it cannot go on."""
        if self.state in (JobState.SUCCEEDED, JobState.FAILED) and self._restored:
            if self._lock_fd is not None:   # taken by start(): nothing to run
                os.close(self._lock_fd)
                self._lock_fd = None
            return self.state
        return self._run()

    def _run_safe(self) -> None:
        try:
            self.run()
        except Exception as e:  # recorded as FAILED with the message; the thread must not die loudly
            self.error = self.error or f"{type(e).__name__}: {e}"
            if not self.state.terminal:   # never left RECOVERING (or RUNNING) with no one driving the job
                _log.exception("job %s: the manager stopped on an error", self.job_id)
                self._set(JobState.FAILED, f"the manager stopped on an error: {self.error}")

    # ------------------------------------------------------------------------------- helpers
    def _set(self, state: JobState, reason: str = "") -> None:
        prev = self.state
        self.state = state
        self.log.append(Kind.JOB_STATE, job_id=self.job_id,
                        payload={"state": state.value, "previous": prev.value, "reason": reason,
                                 "generation": self.generation})
        if self._on_state is not None:
            try:
                self._on_state(state, reason)
            except Exception:
                pass

    def _on_host_event(self, ev) -> None:
        self._q.put(("host", ev))

    def _on_gen_event(self, ev: Event, generation: int, hosts: dict[str, Host] | None = None) -> None:
        if ev.kind in (Kind.HOST_LOST,) and generation == self.generation:  # never a past generation's
            self._q.put(("lost", ev))
        elif ev.kind == Kind.PREEMPTION_NOTICE and hosts and ev.host in hosts:
            # the VM's own notice (its watcher, over the heartbeat channel): the same notice morph as
            # a provider's notice; it also keeps the VM out of later plans until it comes back
            from ..cluster.provider import HostEvent

            self._q.put(("host", HostEvent("notice", hosts[ev.host], ev.time,
                                           deadline=float(ev.payload["deadline"]),
                                           reason=str(ev.payload.get("reason", "")))))
        elif ev.kind == Kind.WORKER_JOINED and generation == self.generation and ev.rank is not None:
            self._joined.add(ev.rank)   # (the heartbeat server's thread: one set add, one mark)
            pending = self._pending
            if pending is not None and len(self._joined) >= self._world:
                pending.mark("start_workers", ev.time, first_only=True)   # every worker said hello

    def profile(self):
        """The calibration plans are made from (the job's cached ``calibrate_job``, measured now
        when there is none). Raises ``CalibrationFailed`` when measuring the model fails — its code
        fails the same way on every try, so the job fails with that error, not "no plan fits"."""
        if self._profile is None:
            from ..trainer import calibrate_job

            self._log_state_note("calibrating the model (once per model and input shape; cached)")
            try:
                self._profile = calibrate_job(self.job, run_dir=self.run_dir)
            except Exception as e:  # noqa: BLE001 - reported as the job's failure
                raise CalibrationFailed(f"{type(e).__name__}: {e}") from e
        return self._profile

    def _log_state_note(self, message: str) -> None:
        _log.info("job %s: %s", self.job_id, message)
        self.log.append("calibration_started", job_id=self.job_id, payload={"message": message})

    def _provider_hosts(self) -> list[Host]:
        return self.provider.all_hosts() if hasattr(self.provider, "all_hosts") else self.provider.hosts()

    def _usable_hosts(self) -> list[Host]:
        """VMs the next plan may use: held by the provider, not under notice, not excluded as a
        straggler, and not reported lost in the last ``SUSPECT_S`` seconds (unless re-added, or it
        answers: a local slot whose worker was killed is reusable at once, an SSH VM whose SSH port
        accepts a connection within a second is too)."""
        now = time.time()
        return [h for h in self.provider.hosts() if h.name not in self._excluded and
                not (h.name in self._noticed and self._noticed[h.name] > now - 3600) and
                not (h.name in self._suspect and self._suspect[h.name] > now - SUSPECT_S
                     and not _answers(h))]

    def _replan(self, hosts: list[Host], *, first: bool, best_only: bool = False, profile=None
                ) -> tuple[JobConfig, Any, Any, list[Host]]:
        """Best plan for ``hosts``; returns (job for it, Plan, row, hosts used in rank order).
        ``best_only``: a what-if that needs only the best row (a best-only search, about linear in
        the GPUs); the plan a generation runs, shown on the dashboard, simulates every depth.
        ``profile``: plan from this calibration instead of the job's current one (a what-if that
        must use the same yardstick as the running plan)."""
        from ..planner.plan import Prices, plan_for_job

        G = pool_slots(hosts)
        priced = pool_prices(hosts)     # the pool's real prices (e.g. the spot price history), or the example's
        prices = Prices(**priced) if priced else None
        job = copy.deepcopy(self.job)
        p0 = job.parallel
        if first and not self.calibrate_first and self._profile is None and not p0.planned and p0.P * p0.D <= G:
            self._micro_batch_size = self._micro_batch_size or p0.micro_batch_size
            return job, None, None, self._hosts_for(hosts, p0.P * p0.D)  # as configured, no calibration
        if not first:
            job.parallel.P = job.parallel.D = None
            job.parallel.boundaries = None
        local = all(_on_this_machine(h) for h in hosts)
        per_vm = G if local else max(worker_slots(h) for h in hosts)
        slots = (os.cpu_count() or 1) if local else 0
        # a morph keeps the micro-batch size of the first plan: random ops (dropout) draw per (step,
        # micro-batch, segment), so the same examples get the same masks only in micro-batches of the
        # same size — the loss trajectory stays the uninterrupted one's
        pinned = None if self._micro_batch_size is None else [self._micro_batch_size]
        if first and pinned is None and not p0.planned:   # a configured P x D: its configured micro-batch size
            pinned = [p0.micro_batch_size]
        try:
            try:
                job_g, pl = plan_for_job(job, profile or self.profile(), G, gpus_per_vm=per_vm, compute_slots_per_vm=slots,
                                         keep_fixed=first, exhaustive=not best_only, prices=prices, micro_batch_sizes=pinned)
            except ConfigError:
                if pinned is None:
                    raise
                msg = (f"no plan for {G} worker slot(s) keeps micro-batch size {pinned[0]}; choosing another, so random "
                       "ops (dropout) draw other masks from here on")
                _log.warning("job %s: %s", self.job_id, msg)
                self.log.append("warning", job_id=self.job_id, payload={"message": msg})
                job_g, pl = plan_for_job(job, profile or self.profile(), G, gpus_per_vm=per_vm, compute_slots_per_vm=slots,
                                         keep_fixed=first, exhaustive=not best_only, prices=prices)
        except ConfigError as e:
            if not first:
                raise
            msg = (f"parallel.P={p0.P} x D={p0.D} from the config cannot run on the {G} worker slot(s) the pool "
                   f"has ({e}); planning for the pool instead")
            _log.warning("job %s: %s", self.job_id, msg)
            self.log.append("warning", job_id=self.job_id, payload={"message": msg})
            job.parallel.P = job.parallel.D = None  # the fixed P/D does not fit the pool: choose
            job.parallel.boundaries = None
            try:   # ... P and D, with the configured micro-batch size when some plan has it
                job_g, pl = plan_for_job(job, profile or self.profile(), G, gpus_per_vm=per_vm, compute_slots_per_vm=slots,
                                         keep_fixed=False, exhaustive=not best_only, prices=prices, micro_batch_sizes=pinned)
            except ConfigError:
                job_g, pl = plan_for_job(job, profile or self.profile(), G, gpus_per_vm=per_vm, compute_slots_per_vm=slots,
                                         keep_fixed=False, exhaustive=not best_only, prices=prices)
        row = next(r for r in pl.feasible if r.P == job_g.parallel.P and r.D == job_g.parallel.D)
        if first and not best_only and self._micro_batch_size is None:
            self._micro_batch_size = job_g.parallel.micro_batch_size
        return job_g, pl, row, self._hosts_for(hosts, job_g.parallel.P * job_g.parallel.D)

    @staticmethod
    def _hosts_for(hosts: list[Host], need: int) -> list[Host]:
        """The first whole VMs, in the provider's order, that hold ``need`` workers."""
        used, n = [], 0
        for h in hosts:
            if n >= need:
                break
            used.append(h)
            n += worker_slots(h)
        return used

    def _record_plan(self, job: JobConfig, pl, row, hosts: list[Host]) -> list[float]:
        """PLAN event with the ranked table and the simulated timeline; returns the predicted
        per-stage compute seconds per micro-batch (for straggler detection)."""
        p = job.parallel
        timeline, per_stage = [], []
        if pl is None:  # started as configured, without a calibration (calibrate_first=False)
            rank_hosts = [h.name for h in hosts for _ in range(worker_slots(h))]
            self.log.append(Kind.PLAN, job_id=self.job_id, payload={
                "generation": self.generation, "gpus": p.P * p.D, "pool_gpus": pool_slots(hosts), "P": p.P,
                "D": p.D, "micro_batch_size": p.micro_batch_size, "num_micro_batches": p.num_micro_batches,
                "boundaries": p.boundaries, "hosts": rank_hosts[:p.P * p.D], "predicted_step_s": None,
                "examples_per_s": None, "bubble": None, "mem_per_stage_bytes": None, "rows": [], "timeline": [],
                "note": "as configured (no calibration yet)", "labels": self.labels})
            return []
        try:
            sim = pl.simulate(row, record_timeline=True)
            for s in range(p.P):
                for seg in sim.timeline[s]:
                    timeline.append({"stage": s, "action": seg.kind, "micro_batch": seg.mb,
                                     "start_s": seg.start, "end_s": seg.end})
            per_stage = [b / max(1, row.m) for b in sim.stage_busy]
        except Exception as e:  # a timeline is a view; never stop a job for it
            timeline = []
            per_stage = []
            self.log.append("warning", job_id=self.job_id, payload={"message": f"no simulated timeline: {e}"})
        rank_hosts = []
        for h in hosts:
            rank_hosts += [h.name] * worker_slots(h)
        rows = [{k: v for k, v in asdict(r).items() if k in ("P", "D", "micro_batch_size", "m", "idle_gpus", "time_s",
                                                              "examples_per_s", "bubble_fraction", "stage_memory_bytes",
                                                              "feasible", "reason", "cost_per_1k_spot")}
                for r in pl.rows]
        self.log.append(Kind.PLAN, job_id=self.job_id, payload={
            "generation": self.generation, "gpus": p.P * p.D, "pool_gpus": pl.gpus, "P": p.P, "D": p.D,
            "micro_batch_size": p.micro_batch_size, "num_micro_batches": p.num_micro_batches,
            "boundaries": p.boundaries, "hosts": rank_hosts[:p.P * p.D], "predicted_step_s": row.time_s,
            "examples_per_s": row.examples_per_s, "bubble": row.bubble_fraction,
            "mem_per_stage_bytes": row.stage_memory_bytes, "rows": rows, "timeline": timeline, "labels": self.labels,
            "prices": asdict(pl.prices)})
        return per_stage

    def _resume_step(self) -> int:
        from ..checkpoint import latest_complete

        ck = latest_complete(self._store_url(), self._manifest_key)
        return 0 if ck is None else int(ck.step)

    def _store_url(self) -> str:
        return self.job.train.checkpoint_url or str(self.run_dir / "checkpoints")

    def _poll_metrics(self, run: _Running | None) -> None:
        rows = self.log.metrics(job_id=self.job_id, since_id=self._metric_cursor)
        for m in rows:
            self._metric_cursor = m["id"]
            step = m.get("step")
            if step is not None:
                self._last_step = int(step) if self._last_step is None else max(self._last_step, int(step))
            if run is not None and int(m.get("generation", -1)) == self.generation and \
                    isinstance(m.get("step_time_s"), (int, float)):
                self._step_times.append(float(m["step_time_s"]))
                del self._step_times[:-50]
            if run is not None and run.first_step_time is None and int(m.get("generation", -1)) == self.generation:
                run.first_step_time = float(m.get("wall_time") or m["time"])
                if self._pending is not None and self._pending.new is not None:
                    self._pending.close(run.first_step_time)
                    self._finish_morph()

    def _finish_morph(self) -> None:
        rec = self._pending
        self._pending = None
        if rec is None:
            return
        self.morphs.append(rec)
        self.log.append(Kind.MORPH, job_id=self.job_id, host=rec.host, payload=rec.to_dict())

    # ---------------------------------------------------------------------------- main loop
    def _take_lock(self) -> None:
        """One manager per run folder: a second launch on a live run is refused, not a takeover."""
        if self._lock_fd is None:
            try:
                self._lock_fd = acquire_run_lock(self.run_dir)
            except RunBusy as e:
                raise ManagerError(str(e)) from None

    def _run(self) -> JobState:
        self._take_lock()
        clear_stop(self.run_dir)   # a request left from before this launch: the launch answers it
        done = threading.Event()
        watch_stop_requests(self.run_dir, self._stop_requested, done)
        try:
            return self._run_generations()
        finally:
            done.set()
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                os.close(fd)   # releases the run folder

    def _stop_requested(self, req: dict) -> None:
        """``varuna stop`` (a stop request file in the run folder, ``manager.runs``): as ``cancel``."""
        self.log.append("stop_request_received", job_id=self.job_id,
                        payload={"by": str(req.get("by", "?"))[:100], "time": req.get("time")})
        self.cancel()

    def _run_generations(self) -> JobState:
        # a job's first launch, and a stopped job launched again, start with the configured P x D
        # (when the pool holds it); a morph or a restarted manager plans for the pool
        first = self.generation == 0 or self.state == JobState.STOPPED
        if self.state == JobState.PENDING:
            self._set(JobState.PROVISIONING, "starting")
        elif self.state == JobState.STOPPED:
            self._cancel.clear()
            self._set(JobState.RECOVERING, "continuing a stopped job from its checkpoint")
        else:
            self._set(JobState.RECOVERING, "manager restarted; continuing the job")
            self._wait_for_orphans()
        self._attach_provider()
        while True:
            if self._cancel.is_set():
                self._set(JobState.STOPPED, "stopped by the user")
                return self.state
            if self._pending is not None:
                self._pending.mark("stop", first_only=True)   # the old generation has ended
            hosts = self._await_hosts()
            if hosts is None:
                return self._fail(f"no VM available for {self.wait_for_hosts_s:.0f} s")
            if self._pending is not None:
                self._pending.mark("wait_for_vms")
            pool = sorted(h.name for h in hosts)
            try:
                if self._pending is not None and self._pending.cause == "failure" and self._last_plan is not None \
                        and self._last_plan[0] == pool:
                    job_g, pl, row, used = self._last_plan[1]   # a retry on the same VMs: the same plan
                else:
                    job_g, pl, row, used = self._replan(hosts, first=first)
            except CalibrationFailed as e:
                return self._fail(f"calibrating the model failed (not retried: the same code fails the same way; "
                                  f"fix it and launch again): {e}")
            except (ConfigError, ValueError) as e:
                return self._fail(f"no plan fits the {pool_slots(hosts)} worker slots available: {e}")
            self._last_plan = (pool, (job_g, pl, row, used))
            resume = self._resume_step()
            if self._pending is not None:
                self._pending.mark("replan")
                self._pending.candidates, self._pending.feasible_plans = plan_candidates(pl, row)
                self._poll_metrics(None)
                self._backfill_metrics()   # steps whose heartbeat never left a lost VM
                self._poll_metrics(None)
                self._pending.from_step = self._last_step
                self._pending.new = _plan_summary(job_g, used)
                self._pending.resume_step = resume
                self._pending.steps_lost = steps_lost(self._pending.from_step, resume)
            per_stage = self._record_plan(job_g, pl, row, used)
            run = self._launch(job_g, pl, row, used, per_stage)
            if run is None:
                first = False
                continue
            first = False
            self._set(JobState.RUNNING, f"generation {self.generation}: P={job_g.parallel.P} x D={job_g.parallel.D} "
                                        f"on {len(used)} VM(s), resuming at step {resume}")
            outcome = self._supervise(run)
            if outcome is not None:
                return outcome
            self.generation += 1

    def _attach_provider(self) -> None:
        """Receive the provider's VM events, and have them recorded in this job's event log
        (VMs it already held are recorded once as added, for the dashboard's VM pool)."""
        self.provider.subscribe(self._on_host_event)
        if getattr(self.provider, "event_log", None) is None:
            self.provider.event_log, self.provider.job_id = self.log, self.job_id
        if getattr(self.provider, "started", True):  # else start() announces every VM itself
            held = self.provider.all_hosts() if hasattr(self.provider, "all_hosts") else self.provider.hosts()
            known = {e.host for e in self.log.events(job_id=self.job_id, kind=Kind.HOST_ADDED)}
            for h in held:
                if h.name not in known:
                    self.log.append(Kind.HOST_ADDED, job_id=self.job_id, host=h.name,
                                    payload={"address": h.address, "gpus": h.gpus, "labels": dict(h.labels),
                                             "reason": "held at start"})
        if not getattr(self.provider, "started", True):
            self.provider.start()

    def _await_hosts(self) -> list[Host] | None:
        deadline = time.time() + self.wait_for_hosts_s
        while True:
            hosts = self._usable_hosts()
            if pool_slots(hosts) >= 1 and hosts:
                return hosts
            if time.time() > deadline or self._cancel.is_set():
                return None
            try:
                kind, ev = self._q.get(timeout=0.5)
                self._note_host_event(kind, ev)
            except queue.Empty:
                pass

    def _note_host_event(self, kind: str, ev) -> None:
        if kind != "host":
            return
        if ev.kind == "notice":
            self._noticed[ev.host.name] = ev.deadline or time.time()
        elif ev.kind == "added":
            self._noticed.pop(ev.host.name, None)
            self._suspect.pop(ev.host.name, None)

    def _launch(self, job_g: JobConfig, pl, row, used: list[Host], per_stage: list[float]) -> _Running | None:
        from .generation import Generation

        gen = Generation(job_g, used, self.run_dir, events=self.log, job_id=self.job_id, generation=self.generation,
                         heartbeat_interval_s=self.heartbeat_interval_s, **self.generation_options)
        self._joined, self._world = set(), job_g.parallel.P * job_g.parallel.D
        by_name = {h.name: h for h in used}
        gen.subscribe(lambda ev, g=self.generation: self._on_gen_event(ev, g, by_name))
        self._history.clear()
        self._hb_last_step.clear()
        self._step_times.clear()
        run = _Running(gen=gen, job=job_g, plan=pl, row=row, hosts=used, started=time.time(),
                       predicted_stage_s=per_stage, profile=self._profile if pl is not None else None)
        try:
            gen.start()   # (returns once the workers are spawned; they are started when each says hello)
        except Exception as e:  # a VM lost during bootstrap, an unreachable VM...
            gen.stop(grace_s=2.0)
            self.log.append("generation_failed", job_id=self.job_id,
                            payload={"generation": self.generation, "error": f"{type(e).__name__}: {e}"})
            gone = [h.name for h in used if h.name not in {x.name for x in self.provider.hosts()}]
            if not gone:
                self.failures += 1
                if self.failures > self.max_failures:
                    self._fail(f"could not start generation {self.generation}: {e}")
                    raise ManagerError(self.error)
            self._begin_morph("loss" if gone else "failure", gone[0] if gone else None, run)
            self._set(JobState.RECOVERING, f"start failed: {e}")
            self.generation += 1
            return None
        return run

    def _begin_morph(self, cause: str, host: str | None, run: _Running | None, at: float | None = None) -> None:
        if self._pending is not None:  # an earlier morph never reached a first step: keep its cause/time
            return
        old = _plan_summary(run.job, run.hosts) if run is not None else {}
        self._pending = MorphRecord(time=at or time.time(), cause=cause, old=old, host=host, from_step=self._last_step)

    def _fail(self, why: str) -> JobState:
        self.error = why
        self._set(JobState.FAILED, why)
        return self.state

    def _request_stop(self, run: _Running, cause: str, host: str | None) -> None:
        if run.stopping is not None:
            return
        run.stopping = (cause, host, time.time())
        run.stop_deadline = time.time() + self.stop_timeout_s
        self._begin_morph(cause, host, run)
        run.gen.request_stop(cause)
        if cause != "user":
            self._set(JobState.MORPHING, f"{cause}{' on ' + host if host else ''}: stopping at the next mini-batch boundary")

    def _supervise(self, run: _Running) -> JobState | None:
        """Watch one generation; returns a terminal state, or None to start the next one."""
        used = {h.name for h in run.hosts}
        next_straggler_check = time.time() + 5 * self.heartbeat_interval_s
        next_grow_check = time.time() + 5.0
        lost: tuple[str, float] | None = None
        while True:
            self._poll_metrics(run)
            res = run.gen.wait(timeout_s=0.2)
            if res is not None:
                break
            try:
                kind, ev = self._q.get(timeout=0.2)
            except queue.Empty:
                kind, ev = None, None
            if kind == "cancel":
                self._request_stop(run, "user", None)
            elif kind == "host":
                self._note_host_event(kind, ev)
                name = ev.host.name
                if ev.kind == "notice" and name in used:
                    self._request_stop(run, "notice", name)
                elif ev.kind == "removed" and name in used and ev.time >= run.wall_started and \
                        not self._stopping_for_notice(run, name):
                    lost = (name, ev.time)
                    break
                elif ev.kind == "added" and run.stopping is None:
                    self._consider_grow(run)
            # (a loss of the previous generation may still be queued when it ended on its own:
            # only one seen since this generation was launched counts)
            elif kind == "lost" and ev.host in used and ev.time >= run.wall_started and \
                    not self._stopping_for_notice(run, ev.host):
                lost = (ev.host, ev.time - float(ev.payload.get("detection_latency_s") or 0.0))
                break
            if run.stopping is None and self.grow is not None and time.time() >= next_grow_check:
                next_grow_check = time.time() + 5.0  # VMs that came back during a cooldown
                self._consider_grow(run, quiet=True)
            if run.stopping is None and time.time() >= next_straggler_check:
                next_straggler_check = time.time() + 2 * self.heartbeat_interval_s
                self._collect_heartbeats(run)
                if self.straggler is not None:
                    self._check_stragglers(run)
                if self.drift is not None:
                    self._check_drift(run)
            if run.stopping is not None and time.time() > run.stop_deadline:
                self.log.append("stop_timeout", job_id=self.job_id,
                                payload={"generation": self.generation, "timeout_s": self.stop_timeout_s})
                run.gen.stop(grace_s=2.0)
                res = run.gen.wait(timeout_s=10.0)
                if self._pending is not None:
                    self._pending.cause = "stop_timeout"
                break
        if lost is not None:
            host, at = lost
            # only a VM the provider no longer holds is skipped; a live one's workers are killed
            held = {h.name for h in self._provider_hosts()}
            run.gen.stop(grace_s=2.0, gone=[host] if host not in held else [])
            self._suspect[host] = time.time()
            res = run.gen.wait(timeout_s=15.0)
            self._begin_morph("loss", host, run, at=at)
            self.preemptions += 1
            self._poll_metrics(run)
            if self.preemptions > self.max_preemptions:
                return self._fail(f"pre-emption budget spent ({self.max_preemptions})")
            self._set(JobState.RECOVERING, f"VM {host} lost without notice; resuming from the last complete checkpoint")
            return None
        self._poll_metrics(run)
        status = getattr(res, "status", "failed")
        if status == "completed":
            if self._pending is not None and self._pending.new is not None:
                self._finish_morph()  # e.g. orphans finished the job; downtime unknown (None)
            self._pending = None
            self._set(JobState.SUCCEEDED, f"finished {self.job.train.steps} steps")
            return self.state
        if status == "stopped" or (run.stopping is not None and status != "failed"):
            cause = run.stopping[0] if run.stopping else "notice"
            if cause == "user":
                self._pending = None
                self._set(JobState.STOPPED, "stopped by the user at a mini-batch boundary (checkpointed)")
                return self.state
            if cause == "notice":
                self.preemptions += 1
            return None
        # lost or failed
        gone = sorted(set(getattr(res, "lost_hosts", {}) or {}) & used)
        if status == "lost" or gone:
            for h in gone:
                self._suspect[h] = time.time()
            self.preemptions += 1
            self._begin_morph("loss", gone[0] if gone else None, run)
            if self.preemptions > self.max_preemptions:
                return self._fail(f"pre-emption budget spent ({self.max_preemptions})")
            self._set(JobState.RECOVERING, f"VM(s) {', '.join(gone) or '?'} lost; resuming from the last checkpoint")
            return None
        self.failures += 1
        failure = getattr(res, "failure", None) or f"generation ended with status {status}"
        cause = getattr(res, "cause", None)
        said = failure.strip().splitlines()[-1] if failure.strip() else failure
        what = re.sub(r"^(\[[^\]]*\]\s*)+", "", said)   # the error, not which VM and rank said it
        same, self._last_failure = what == self._last_failure, what
        if cause == "data":
            self._pending = None
            return self._fail(f"the data failed (not retried: the same step reads the same examples):\n{failure}")
        if cause == "code":
            self._pending = None
            return self._fail(f"the job's code raised a programming error (not retried: the same code fails the "
                              f"same way; fix it and launch again):\n{failure}")
        if same:
            self._pending = None
            return self._fail(f"the same worker error twice in a row (not retried again: it looks deterministic):"
                              f"\n{failure}")
        if self.failures > self.max_failures:
            self._pending = None
            return self._fail(f"worker failure (budget of {self.max_failures} retries spent):\n{failure}")
        self._begin_morph("failure", None, run)
        self._set(JobState.RECOVERING, f"worker failure, retry {self.failures}/{self.max_failures}: "
                                       f"{failure.strip().splitlines()[-1] if failure.strip() else failure}")
        return None

    def _stopping_for_notice(self, run: _Running, host: str) -> bool:
        """A VM under notice that leaves (or goes quiet) while its workers stop at a boundary
        is not a sudden loss: the generation's own result says whether the stop checkpoint was
        made (if not, it ends "lost" and the last complete checkpoint is used)."""
        return run.stopping is not None and host in self._noticed

    def _consider_grow(self, run: _Running, *, quiet: bool = False) -> None:
        # not before the last morph's first step: a grow begun then would be folded into that
        # morph's record and go missing from the history (the periodic check grows a few s later)
        if self.grow is None or self._pending is not None:
            return
        hosts = self._usable_hosts()
        if pool_slots(hosts) <= run.job.parallel.P * run.job.parallel.D:
            return
        try:
            _, _, row, _ = self._replan(hosts, first=False, best_only=True)
        except (ConfigError, ValueError, CalibrationFailed):
            return
        since = time.time() - max(self._last_morph_time, run.started)
        if run.row is None:  # started without a calibration: plan the running configuration now
            try:
                self.profile()  # calibrate now (cached by the model's identity)
                _, run.plan, run.row, _ = self._replan(run.hosts, first=True, best_only=True)
            except (ConfigError, ValueError, CalibrationFailed):
                return
        # the running plan as the profile the new one was planned from predicts it (re-simulated
        # from heartbeats once the estimate drifted): the same yardstick for both
        current = run.recalibrated_examples_per_s or run.row.examples_per_s
        grow = self.grow.worth_it(current, row.examples_per_s, since,
                                  run.job.parallel.P * run.job.parallel.D, row.P * row.D)
        if quiet and not grow:
            return
        self.log.append("grow_decision", job_id=self.job_id, payload={
            "current_examples_per_s": current, "new_examples_per_s": row.examples_per_s,
            "new": {"P": row.P, "D": row.D}, "min_gain": self.grow.min_gain, "seconds_since_last_morph": since,
            "decision": "grow" if grow else "stay"})
        if grow:
            self._request_stop(run, "grow", None)

    def _collect_heartbeats(self, run: _Running) -> None:
        """New heartbeats of this generation into ``_history``: per rank, its compute (F+R+B)
        per micro-batch, one sample per step, the last ``HISTORY`` kept."""
        keep = max(HISTORY, self.straggler.beats if self.straggler else 0)
        for hb in self.log.heartbeats(job_id=self.job_id, since_id=self._hb_cursor):
            self._hb_cursor = hb.id
            if hb.time < run.started or hb.rank is None:
                continue
            if int((hb.payload or {}).get("generation", self.generation)) != self.generation:
                continue
            c = sum(x for x in (hb.fwd_s, hb.recompute_s, hb.bwd_s) if x is not None)
            if c > 0 and hb.step is not None and self._hb_last_step.get(hb.rank) != hb.step:
                self._hb_last_step[hb.rank] = hb.step  # one sample per step, not per beat
                self._history.setdefault(hb.rank, []).append(c)
                del self._history[hb.rank][:-keep]

    def _check_drift(self, run: _Running) -> None:
        """Honest estimates: when the step time has drifted from the prediction (``self.drift``),
        re-simulate the running plan with each rank's measured/calibrated compute ratio, say so
        in an ``estimate_drift`` event (again only when the step time leaves that new estimate by
        the rule's threshold too), and plan later morphs from the calibration scaled by the
        measured stages. ``drift`` in the event is measured against the plan's prediction."""
        if run.row is None or run.plan is None or not run.predicted_stage_s:
            return
        # judged against the latest estimate (the plan's, then each re-calibrated one): one event
        # per change of conditions, not one per wobble of an estimate already corrected
        if step_time_drift(self._step_times, run.estimate_s or run.row.time_s, self.drift) is None:
            return
        measured = statistics.median(self._step_times[-self.drift.steps:])
        drift = measured / run.row.time_s - 1.0
        P, D = run.job.parallel.P, run.job.parallel.D
        predicted = {r: run.predicted_stage_s[r % P] for r in range(P * D)}
        ratios = compute_ratios(self._history, predicted, last=HISTORY)
        recal_s = recal_eps = None
        factors: list[float] = []
        if ratios:
            typical = statistics.median(ratios.values())
            try:
                sim = run.plan.simulate(run.row, rank_scale=[ratios.get(r, typical) for r in range(P * D)],
                                        record_timeline=False)
                recal_s = float(sim.minibatch_time)
                recal_eps = run.job.parallel.global_batch / recal_s if recal_s > 0 else None
            except (ValueError, RuntimeError) as e:
                self.log.append("warning", job_id=self.job_id, payload={"message": f"no re-simulation: {e}"})
            base = run.profile
            if base is not None:
                factors = segment_factors(ratios, run.row.stages, P, len(base.segments))
                self._profile = base.scaled(factors)   # later morphs plan from what this job measured
        run.estimate_s = recal_s or measured
        run.recalibrated_examples_per_s = recal_eps
        local = all(_on_this_machine(h) for h in run.hosts)
        prof = run.profile
        self.log.append(Kind.ESTIMATE_DRIFT, job_id=self.job_id, payload={
            "generation": self.generation, "drift": round(drift, 4), "steps": self.drift.steps,
            "threshold": self.drift.threshold, "predicted_step_s": run.row.time_s,
            "measured_step_s": measured,
            "recalibrated_step_s": recal_s, "recalibrated_examples_per_s": recal_eps,
            "compute_ratio_by_stage": [round(statistics.median([v for r, v in ratios.items() if r % P == s]), 3)
                                       if any(r % P == s for r in ratios) else None for s in range(P)],
            "segment_factors": [round(f, 3) for f in factors],
            "calibrated_at": getattr(prof, "calibrated_at", None) or None,
            "calibrated_on": (getattr(prof, "hardware", None) or {}).get("device"),
            "load_1min": round(os.getloadavg()[0], 2) if local and hasattr(os, "getloadavg") else None,
            "cpu_count": os.cpu_count() if local else None, "workers_here": P * D if local else None})

    def _check_stragglers(self, run: _Running) -> None:
        if not run.predicted_stage_s:
            return
        P = run.job.parallel.P
        history = {r: xs[-self.straggler.beats:] for r, xs in self._history.items()}
        predicted = {r: run.predicted_stage_s[r % P] for r in range(P * run.job.parallel.D)}
        found = find_stragglers(history, predicted, self.straggler)
        rank_host = []
        for h in run.hosts:
            rank_host += [h.name] * worker_slots(h)
        for rank, slowdown in sorted(found.items(), key=lambda kv: -kv[1]):
            host = rank_host[rank] if rank < len(rank_host) else None
            if host is None or host in self._excluded:
                continue
            others = [h for h in self._usable_hosts() if h.name != host]
            try:
                alt = (self._replan(others, first=False, best_only=True, profile=run.profile)[2]
                       if others else None)   # (the running plan's calibration: the same yardstick)
                exclude, with_it, without = judge_straggler(run.plan, run.row, rank, slowdown, alt)
            except (ConfigError, ValueError):
                continue
            self.log.append(Kind.STRAGGLER, job_id=self.job_id, host=host, rank=rank, payload={
                "rank": rank, "slowdown": slowdown, "action": "excluded" if exclude else "kept",
                "predicted_step_s_with": with_it, "predicted_step_s_without": without})
            if exclude:
                self._excluded.add(host)
                self._request_stop(run, "straggler", host)
                return
            self._history.pop(rank, None)  # judged and kept: judge again on fresh samples only

    def _wait_for_orphans(self) -> None:
        """After a manager restart: workers of the previous manager stop on their own (they
        checkpoint at a boundary once the manager is unreachable); give them time to."""
        from .generation import wait_for_orphans

        orphan_after = float(self.generation_options.get("orphan_after_s", 60.0))
        wait_for_orphans(self.log, self.job_id, timeout_s=orphan_after + self.stop_timeout_s + 30.0)
        self._backfill_metrics()

    def _backfill_metrics(self) -> None:
        """Steps the orphaned workers finished while no manager listened reached only rank 0's
        ``metrics.jsonl`` (when it is in this run folder): copy them into the event log, so
        the job's metrics have no hole."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        last = -1 if self._last_step is None else self._last_step
        added = 0
        with open(path) as f:
            for line in f:
                try:
                    m = json.loads(line)
                except ValueError:
                    continue  # a line torn by the kill
                step = m.get("step")
                if isinstance(step, int) and step > last:
                    self.log.append_metric(step, m, job_id=self.job_id)
                    last = step
                    added += 1
        if added:
            self.log.append("metrics_backfilled", job_id=self.job_id,
                            payload={"steps": added, "source": str(path), "last_step": last})

    def summary(self) -> dict[str, Any]:
        """State, generation, budgets used, morphs and the error, as plain data."""
        return {"job_id": self.job_id, "state": self.state.value, "generation": self.generation,
                "last_step": self._last_step, "preemptions": self.preemptions, "failures": self.failures,
                "morphs": [m.to_dict() for m in self.morphs], "error": self.error, "run_dir": str(self.run_dir)}


def judge_straggler(plan, row, rank: int, slowdown: float, without) -> tuple[bool, float, float]:
    """Is the job faster without a slow worker? (paper §4.6, fail-stutter.) ``plan``/``row``:
    the running configuration; ``rank`` runs ``slowdown`` x slower than predicted; ``without``:
    the best ``PlanRow`` for the pool minus its VM (None: no VM would be left). Simulates the
    running configuration with that rank slowed (``Plan.simulate(rank_scale=...)``) and
    compares mini-batch times. Returns ``(exclude, seconds_with, seconds_without)``."""
    scale = [1.0] * (row.P * row.D)
    scale[rank] = float(slowdown)
    with_it = plan.simulate(row, rank_scale=scale, record_timeline=False).minibatch_time
    t_without = math.inf if without is None else float(without.time_s)
    return t_without < with_it, with_it, t_without


def _on_this_machine(h: Host) -> bool:
    """Local slots and loopback test hosts share this machine's cores (the planner models them
    as one VM with ``os.cpu_count()`` compute slots)."""
    return is_local(h) or h.is_loopback


__all__ = ["Manager", "JobState", "MorphRecord", "CalibrationFailed", "MORPH_PHASES", "morph_phases", "plan_candidates", "ManagerError",
           "judge_straggler"]
