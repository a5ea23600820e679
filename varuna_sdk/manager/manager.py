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

Where the parts are: the state machine's types (``JobState``, ``MorphRecord``, the queue
messages) in ``manager.state``; the settings (``ManagerOptions``, ``GenerationOptions``) in
``manager.options``; the supervision loop of one generation in ``manager.supervision``; planning
in ``manager.planning``; metrics, heartbeats, stragglers and drift in ``manager.telemetry``; the
morph rules as pure functions in ``manager.decisions``. This module holds the job's lifecycle:
construction and restart, the public face, and the loop that plans and launches generation
after generation.

Owns ``Manager``. Imports ``cluster`` (hosts, provider), ``config``, ``profiling`` (the job's
calibration), ``checkpoint`` and ``manager.events|generation|options|orphans|runs|state|
supervision|telemetry|planning|decisions``; never imported by them.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..cluster.hosts import Host, Secret
from ..cluster.localproc import close_zygotes
from ..cluster.provider import HostEvent, Provider
from ..config import ConfigError, JobConfig
from .decisions import pool_slots, steps_lost
from .events import Event, EventLog, Kind
from .options import ManagerOptions
from .planning import ManagerPlanning
from .runs import RunBusy, acquire_run_lock, clear_stop, watch_stop_requests
from .state import (CalibrationFailed, CancelRequested, HostChanged, JobInterrupted, JobState, ManagerError,
                    MorphRecord, RunningGeneration, WorkersLost, interrupted_reason, plan_candidates, plan_summary)
from .supervision import ManagerSupervision
from .telemetry import ManagerTelemetry

_log = logging.getLogger(__name__)


JOB_SECRET_FILE = ".job-secret"   # in the run folder, mode 0600


def _manifest_key(token: Secret) -> bytes:
    from ..checkpoint.store import manifest_key

    return manifest_key(token.reveal())



class Manager(ManagerSupervision, ManagerTelemetry, ManagerPlanning):
    """Run ``job`` on the VMs ``provider`` offers, morphing as they come and go.

    Args:
        job: the job (P/D may be null: planned; a P/D the config fixes is kept only for the first
            generation — after a morph the planner chooses for the GPUs then available).
        provider: where VMs come from (``cluster.provider.Provider``: local slots, an SSH host
            list, the spot emulator, a cloud).
        run_dir: the job's folder (event log ``events.db``, ``metrics.jsonl``, checkpoints).
        job_id: stable id; default the run folder's name. A manager started again on the same
            folder and id continues the job.
        profile: calibration for the planner (default: the job's cached ``calibrate_job``).
        options: a ``ManagerOptions`` (rules, timeouts, budgets, the ``GenerationOptions`` of every
            generation; None: the defaults). Any of its fields may be given as keywords on top
            (``stop_timeout_s=30``, ``grow=None``, ``generation_options={"sink": None}``).
        on_state: ``callback(state, reason)`` on every state change (errors in it are ignored).
        labels: plain strings describing the job for people (``{"model": ..., "data": ...}`` from the
            launcher's model spec), recorded with every plan for the dashboard; the manager does
            not read them.

    Raises ``ConfigError`` for an invalid job or options before anything starts, ``TypeError``
    for an unknown option.
    """

    def __init__(self, job: JobConfig, provider: Provider, *, run_dir: str | Path, job_id: str | None = None,
                 profile=None, options: ManagerOptions | None = None,
                 on_state: Callable[[JobState, str], None] | None = None,
                 labels: dict[str, str] | None = None, **option_overrides: Any):
        job = copy.deepcopy(job).validate()
        if job.train.checkpoint_every <= 0:
            # a sudden loss must not lose the whole run: checkpoint about every 10% of the run
            job.train.checkpoint_every = max(1, min(25, job.train.steps // 10))
        opts = ManagerOptions.merged(options, **option_overrides).validate()
        self.provider = provider
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if job.train.checkpoint_url is None:  # one store every generation and every VM sees
            job.train.checkpoint_url = str(self.run_dir / "checkpoints")
        if not (self.run_dir / "config.yaml").exists():   # the run folder says what it runs (status, dashboard)
            job.to_yaml(self.run_dir / "config.yaml")
        self.job = job
        self.job_id = job_id or self.run_dir.name
        # one secret for the whole job, kept in the run folder (0600): every generation's heartbeats
        # and every checkpoint manifest are signed with it, and a restarted manager reuses it
        gen = opts.generation_options
        gen = dataclasses.replace(
            gen, heartbeat_interval_s=opts.heartbeat_interval_s,
            token=gen.token or Secret.load_or_create(self.run_dir / JOB_SECRET_FILE),
            ssh_options=gen.ssh_options if gen.ssh_options is not None else provider.ssh_options())
        self.options = dataclasses.replace(opts, generation_options=gen)
        self._manifest_key = _manifest_key(gen.token)
        self._on_state = on_state
        self._profile = profile
        self.labels = {str(k): str(v) for k, v in (labels or {}).items()}
        self.log = EventLog(self.run_dir / "events.db")
        self._init_state()
        self._restored = self._restore()
        self._ended_before = False   # run() found the job already ended in its folder: nothing ran

    def _init_state(self) -> None:
        """The fields of a job not yet run (``_restore`` then reads a previous manager's back)."""
        self.state = JobState.PENDING
        self.morphs: list[MorphRecord] = []
        self.generation = 0
        self.preemptions = 0
        self.failures = 0
        self.error: str | None = None
        self._q: queue.Queue = queue.Queue()     # ``state.ManagerMessage``s
        self._noticed: dict[str, float] = {}     # host -> deadline
        self._excluded: set[str] = set()          # stragglers taken out
        self._suspect: dict[str, float] = {}      # host -> when reported lost (until re-added)
        self._micro_batch_size: int | None = None  # the first plan's; morphs keep it (see _replan)
        self.plan_kept: dict[str, int] | None = None  # the config's fixed P/D the last plan kept (see _replan)
        self.plan_held: dict[str, int] = {}   # ... and the micro-batch size it kept: the PLAN event says them
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        # set when the background run ends: waited on instead of Thread.join, which a Ctrl-C (a
        # notebook's interrupt) can leave marking a live thread as ended (Python 3.11, bpo-45274)
        self._done = threading.Event()
        self._last_morph_time = time.time()
        self._metric_cursor = 0
        self._hb_cursor = 0
        self._history: dict[int, list[float]] = {}   # rank -> recent compute s per micro-batch
        self._step_times: list[float] = []           # the running generation's measured step times (s)
        self._data_times: list[float] = []           # ... and the part of each reading its batch (s)
        self._last_failure: str | None = None         # the last line of the last worker failure
        self._last_plan: tuple | None = None          # (pool's VM names, what _replan returned) of the last launch
        self._joined: set[int] = set()                # ranks of this generation that said hello
        self._world = 0                               # how many it has
        self._hb_last_step: dict[int, int] = {}
        self._last_step: int | None = None            # the highest step any generation finished
        # (the newest generation that trained, the last step it finished): a morph's ``from_step``
        # (``decisions.advance_lineage``; not ``_last_step``: steps a lost generation trained past
        # its checkpoint are lost once, by its morph, not again by the next one)
        self._lineage: tuple[int, int | None] = (0, None)
        self._pending: MorphRecord | None = None
        self._lock_fd: int | None = None              # the run folder's manager lock while running

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
            gen = newest[-1].get("generation")
            self._lineage = (gen if isinstance(gen, int) else 0, self._last_step)
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
                                        from_step=self._lineage[1])
        return True

    # -------------------------------------------------------------------------------- public
    def start(self) -> "Manager":
        """Run the job in a background thread (for notebooks); returns at once. Raises
        ``ManagerError`` when another manager runs this run folder now (``runs.acquire_run_lock``)."""
        if self.alive:
            raise ManagerError(f"job {self.job_id} is already running in this manager")
        if not self._ended():
            self._check_resumable()   # refused here, in the caller's thread: the run's state is left as it was
        self._take_lock()
        self._done.clear()
        self._thread = threading.Thread(target=self._run_safe, name=f"varuna-manager-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """True while the background run started by ``start()`` goes on."""
        return self._thread is not None and not self._done.is_set()

    @property
    def settled(self) -> bool:
        """RUNNING with no morph under way (the last one's new plan has done its first step)."""
        return self.state == JobState.RUNNING and self._pending is None

    def wait(self, timeout_s: float | None = None) -> JobState:
        """Block until the background run ends (or ``timeout_s``); returns the state. A
        ``KeyboardInterrupt`` while waiting leaves the run going (``cancel()`` stops it)."""
        if self._thread is not None:
            self._done.wait(timeout_s)
        return self.state

    def cancel(self) -> None:
        """Ask the job to stop: the workers checkpoint at the next boundary and exit; state
        becomes STOPPED. A later manager on the same folder can resume it."""
        self._cancel.set()
        self._q.put(CancelRequested())

    def run(self) -> JobState:
        """Run the job to the end in this thread; returns SUCCEEDED, FAILED or STOPPED.
        Raises ``ManagerError`` (after recording FAILED) when it cannot go on — and, before any
        state change or worker, when the job must not start on its checkpoint store (a STOPPED
        run whose checkpoints are all gone or unusable; ``train.resume`` false on a store holding
        checkpoints: ``planning.resume_problem``), the run's state left as it was."""
        if self._ended():
            return self.state
        self._check_resumable()
        return self._run()

    def _ended(self) -> bool:
        """The job had already ended (SUCCEEDED, FAILED) in its folder: nothing to run (a lock taken by
        ``start()`` is released)."""
        if not (self.state in (JobState.SUCCEEDED, JobState.FAILED) and self._restored):
            return False
        self._ended_before = True
        if self._lock_fd is not None:   # taken by start(): nothing to run
            os.close(self._lock_fd)
            self._lock_fd = None
        return True

    def _run_safe(self) -> None:
        try:
            if not self._ended():   # (start() checked the store already)
                self._run()
        except Exception as e:  # noqa: BLE001 - recorded as FAILED with the message; the thread must not die loudly
            self.error = self.error or f"{type(e).__name__}: {e}"
            if not self.state.terminal:   # never left RECOVERING (or RUNNING) with no one driving the job
                _log.exception("job %s: the manager stopped on an error", self.job_id)
                self._set(JobState.FAILED, f"the manager stopped on an error: {self.error}")
        finally:
            self._done.set()

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
            except Exception:  # noqa: BLE001 - a callback of the caller's must not stop the job
                pass

    def _on_host_event(self, ev: HostEvent) -> None:
        """The provider's callback (its thread): queue the VM event for the manager's loop."""
        self._q.put(HostChanged(ev))

    def _on_gen_event(self, ev: Event, generation: int, hosts: dict[str, Host] | None = None) -> None:
        """A generation's event callback (the heartbeat server's thread): a host lost by the
        running generation, a VM's own pre-emption notice, a worker's hello."""
        if ev.kind == Kind.HOST_LOST and generation == self.generation:  # never a past generation's
            self._q.put(WorkersLost(ev))
        elif ev.kind == Kind.PREEMPTION_NOTICE and hosts and ev.host in hosts:
            # the VM's own notice (its watcher, over the heartbeat channel): the same notice morph as
            # a provider's notice; it also keeps the VM out of later plans until it comes back
            self._q.put(HostChanged(HostEvent("notice", hosts[ev.host], ev.time,
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
            from ..profiling.job import calibrate_job, under_load_warning

            self._log_state_note("calibrating the model (once per model and input shape; cached)")
            try:
                # said once, below (a log line and a WARNING event), not also as a UserWarning
                self._profile = calibrate_job(self.job, run_dir=self.run_dir, warn_under_load=False)
            except Exception as e:  # noqa: BLE001 - reported as the job's failure
                raise CalibrationFailed(f"{type(e).__name__}: {e}") from e
            said = under_load_warning(self._profile.busy_at_calibration)
            if said:   # its plans may be off: in the job's event log too (varuna logs --events, the dashboard)
                _log.warning("job %s: %s", self.job_id, said)
                self.log.append(Kind.WARNING, job_id=self.job_id, payload={"message": said})
        return self._profile

    def _log_state_note(self, message: str) -> None:
        """Say what the manager is doing before a long silence (a CALIBRATION_STARTED event)."""
        _log.info("job %s: %s", self.job_id, message)
        self.log.append(Kind.CALIBRATION_STARTED, job_id=self.job_id, payload={"message": message})

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
        except KeyboardInterrupt as e:   # a second Ctrl-C (``runner.stop_on_signals``): the workers are killed
            if isinstance(e, JobInterrupted) or self.state.terminal:
                raise
            raise self._interrupted() from None
        except Exception as e:   # never left PROVISIONING/RUNNING with no manager: recorded, then raised
            if not self.state.terminal:
                self.error = self.error or f"{type(e).__name__}: {e}"
                _log.exception("job %s: the manager stopped on an error", self.job_id)
                self._set(JobState.FAILED, f"the manager stopped on an error: {self.error}")
            raise
        finally:
            done.set()
            close_zygotes(self.run_dir)   # the run's local workers' zygote (its workers are gone)
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                os.close(fd)   # releases the run folder

    def _interrupted(self) -> JobInterrupted:
        """The manager is ending on a ``KeyboardInterrupt`` (a second Ctrl-C; ``_supervise`` killed
        the generation's workers): record STOPPED — not left RUNNING with no manager — with the
        steps the last complete checkpoint holds, where launching the job again continues it."""
        try:
            kept = self._resume_step()
        except Exception:  # noqa: BLE001 - an unreadable store: said so, the state is recorded anyway
            kept = None
        self._pending = None
        self._set(JobState.STOPPED, interrupted_reason(kept))
        return JobInterrupted(self.run_dir, kept)

    def _stop_requested(self, req: dict) -> None:
        """``varuna stop`` (a stop request file in the run folder, ``manager.runs``): as ``cancel``."""
        self.log.append(Kind.STOP_REQUEST_RECEIVED, job_id=self.job_id,
                        payload={"by": str(req.get("by", "?"))[:100], "time": req.get("time")})
        self.cancel()


    def _run_generations(self) -> JobState:
        """Plan and launch generation after generation until the job reaches a terminal state."""
        # this manager's first plan keeps the configured P x D when the pool holds it: a job's first
        # launch, a stopped job launched again, and a restarted manager (varuna train with P=2 fixed,
        # killed and run again, had re-planned to the pool's best and calibrated); morphs plan for the pool
        first = True
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
                return self._fail(f"no VM available for {self.options.wait_for_hosts_s:.0f} s")
            if self._pending is not None:
                self._pending.mark("wait_for_vms")
            planned = self._plan_generation(hosts, first)
            if isinstance(planned, JobState):
                return planned
            if self._cancel.is_set():   # asked to stop while it calibrated or planned: no worker starts
                self._set(JobState.STOPPED, "stopped by the user before any worker of this launch started")
                return self.state
            job_g, pl, row, used = planned
            resume = self._resume_step()
            if self._pending is not None:
                self._note_replanned(job_g, pl, row, used, resume, first)
            per_stage = self._record_plan(job_g, pl, row, used)
            run = self._launch(job_g, pl, row, used, per_stage)
            first = False
            if run is None:
                continue
            self._set(JobState.RUNNING, f"generation {self.generation}: P={job_g.parallel.P} x D={job_g.parallel.D} "
                                        f"on {len(used)} VM(s), resuming at step {resume}")
            try:
                outcome = self._supervise(run)
            finally:
                run.gen.close_log()
            if outcome is not None:
                return outcome
            self.generation += 1

    def _plan_generation(self, hosts: list[Host], first: bool) -> tuple[JobConfig, Any, Any, list[Host]] | JobState:
        """The next generation's plan for ``hosts`` (``_replan``'s tuple; a retry after a failure on
        the same VMs reuses the last plan), or FAILED when no plan can be made."""
        pool = sorted(h.name for h in hosts)
        try:
            if self._pending is not None and self._pending.cause == "failure" and self._last_plan is not None \
                    and self._last_plan[0] == pool:
                planned = self._last_plan[1]   # a retry on the same VMs: the same plan
            else:
                planned = self._replan(hosts, first=first)
        except CalibrationFailed as e:
            if self._cancel.is_set():   # a Ctrl-C reaches the calibration's processes too (EOFError): a stop
                self._set(JobState.STOPPED, f"stopped by the user while the model was calibrated ({e})")
                return self.state
            return self._fail(f"calibrating the model failed (not retried: the same code fails the same way; "
                              f"fix it and launch again): {e}")
        except (ConfigError, ValueError) as e:
            return self._fail(f"no plan fits the {pool_slots(hosts)} worker slots available: {e}")
        self._last_plan = (pool, planned)
        return planned

    def _note_replanned(self, job_g: JobConfig, pl, row, used: list[Host], resume: int, first: bool) -> None:
        """The morph under way has its new plan: record the candidates compared (and the config's
        fixed P/D the plan kept, ``plan_kept``: a ``first`` plan keeps them when they fit), the last step finished
        before it (metrics that reached only ``metrics.jsonl`` included), the new plan, where it
        resumes and the steps lost."""
        rec = self._pending
        rec.mark("replan")
        rec.candidates, rec.feasible_plans = plan_candidates(pl, row)
        rec.kept = self.plan_kept if first else None
        self._poll_metrics(None)
        self._backfill_metrics()   # steps whose heartbeat never left a lost VM
        self._poll_metrics(None)
        rec.from_step = self._lineage[1]
        rec.new = plan_summary(job_g, used)
        rec.resume_step = resume
        rec.steps_lost = steps_lost(rec.from_step, resume)

    def _attach_provider(self) -> None:
        """Receive the provider's VM events, and have them recorded in this job's event log
        (VMs it already held are recorded once as added, for the dashboard's VM pool)."""
        self.provider.subscribe(self._on_host_event)
        self.provider.attach(self.log, self.job_id)
        if not self.provider.started and not self.provider.closed:
            self.provider.start()   # start() announces every VM itself
            return
        known = {e.host for e in self.log.events(job_id=self.job_id, kind=Kind.HOST_ADDED)}
        for h in self.provider.all_hosts():
            if h.name not in known:
                self.log.append(Kind.HOST_ADDED, job_id=self.job_id, host=h.name,
                                payload={"address": h.address, "gpus": h.gpus, "labels": dict(h.labels),
                                         "reason": "held at start"})

    def _await_hosts(self) -> list[Host] | None:
        """The VMs the next plan may use, waiting (at most ``options.wait_for_hosts_s``) while
        there are none; None when none came, or the job was cancelled meanwhile."""
        deadline = time.time() + self.options.wait_for_hosts_s
        while True:
            hosts = self._usable_hosts()
            if pool_slots(hosts) >= 1 and hosts:
                return hosts
            if time.time() > deadline or self._cancel.is_set():
                return None
            try:
                msg = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(msg, HostChanged):
                self._note_host_event(msg)

    def _launch(self, job_g: JobConfig, pl, row, used: list[Host], per_stage: list[float]) -> RunningGeneration | None:
        """Start generation ``self.generation`` of ``job_g`` on ``used``; None when it did not start
        (a VM lost during bootstrap, an unreachable VM...: a morph is begun, the state is
        RECOVERING). Raises ``ManagerError`` when the failure budget is spent."""
        from .generation import Generation

        gen = Generation(job_g, used, self.run_dir, events=self.log, job_id=self.job_id, generation=self.generation,
                         options=self.options.generation_options)
        self._joined, self._world = set(), job_g.parallel.P * job_g.parallel.D
        by_name = {h.name: h for h in used}
        gen.subscribe(lambda ev, g=self.generation: self._on_gen_event(ev, g, by_name))
        self._history.clear()
        self._hb_last_step.clear()
        self._step_times.clear()
        self._data_times.clear()
        run = RunningGeneration(gen=gen, job=job_g, plan=pl, row=row, hosts=used, started=time.time(),
                                predicted_stage_s=per_stage, profile=self._profile if pl is not None else None)
        try:
            gen.start()   # (returns once the workers are spawned; they are started when each says hello)
        except Exception as e:  # noqa: BLE001 - a VM lost during bootstrap, an unreachable VM...
            gen.stop(grace_s=2.0)
            gen.close_log()
            self.log.append(Kind.GENERATION_FAILED, job_id=self.job_id,
                            payload={"generation": self.generation, "error": f"{type(e).__name__}: {e}"})
            gone = [h.name for h in used if h.name not in {x.name for x in self.provider.hosts()}]
            if not gone:
                self.failures += 1
                if self.failures > self.options.max_failures:
                    self._fail(f"could not start generation {self.generation}: {e}")
                    raise ManagerError(self.error)
            self._begin_morph("loss" if gone else "failure", gone[0] if gone else None, run)
            self._set(JobState.RECOVERING, f"start failed: {e}")
            self.generation += 1
            return None
        return run

    def _wait_for_orphans(self) -> None:
        """After a manager restart: workers of the previous manager stop on their own (they
        checkpoint at a boundary once the manager is unreachable); give them time to."""
        from .orphans import wait_for_orphans

        orphan_after = self.options.generation_options.orphan_after_s
        orphan_after = 60.0 if orphan_after is None else float(orphan_after)
        wait_for_orphans(self.log, self.job_id, timeout_s=orphan_after + self.options.stop_timeout_s + 30.0)
        self._backfill_metrics()

    def summary(self) -> dict[str, Any]:
        """State, generation, budgets used, morphs and the error, as plain data. ``ended_before``:
        the job had already ended (SUCCEEDED or FAILED) in this run folder, so ``run()`` ran nothing.
        ``checkpoint_steps``: of a STOPPED job, the steps its last complete checkpoint holds (where
        it continues), else None."""
        return {"job_id": self.job_id, "state": self.state.value, "generation": self.generation,
                "ended_before": self._ended_before,
                "last_step": self._last_step, "preemptions": self.preemptions, "failures": self.failures,
                "morphs": [m.to_dict() for m in self.morphs], "error": self.error, "run_dir": str(self.run_dir),
                "checkpoint_steps": self._resume_step() if self.state == JobState.STOPPED else None}


__all__ = ["Manager"]
