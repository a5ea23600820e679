"""What the morph manager knows and says, as types: the job's state (``JobState``), a morph's record
(``MorphRecord``, its cause a ``MorphCause``, its downtime split into ``MORPH_PHASES``), the
generation being supervised (``RunningGeneration``) and the messages put on the manager's queue
(``CancelRequested``, ``HostChanged``, ``WorkersLost``: small frozen dataclasses, one per kind).

Owns ``JobState``, ``ManagerError``, ``CalibrationFailed``, ``MorphCause``, ``MorphRecord``,
``MORPH_PHASES``, ``morph_phases``, ``plan_candidates``, ``plan_summary``, ``RunningGeneration``,
``CancelRequested``, ``HostChanged``, ``WorkersLost``, ``ManagerMessage``. Imports ``config``,
``cluster`` (hosts, provider events) and ``manager.events``; never torch, never
``manager.manager`` (which imports this).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union

from ..cluster.hosts import Host
from ..cluster.provider import HostEvent
from ..config import JobConfig
from .events import Event

if TYPE_CHECKING:
    from .generation import Generation

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
        """True for SUCCEEDED, FAILED and STOPPED: nothing runs and nothing will."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


class CalibrationFailed(RuntimeError):
    """Measuring the model for the planner failed (its code raised): not retried."""


class ManagerError(RuntimeError):
    """The job could not go on (no VMs left, failure budget spent, bad configuration)."""


class JobInterrupted(KeyboardInterrupt):
    """A second Ctrl-C (``KeyboardInterrupt``) ended the manager while the job ran: its workers
    were killed before a mini-batch boundary and the job was recorded STOPPED, to continue from
    its last complete checkpoint. ``run_dir``: the job's folder; ``kept``: the steps that
    checkpoint holds (where launching again resumes; None: not known)."""

    def __init__(self, run_dir, kept: int | None):
        self.run_dir, self.kept = run_dir, kept
        super().__init__(interrupted_reason(kept))


def interrupted_reason(kept: int | None) -> str:
    """Why a job whose manager a second Ctrl-C ended is STOPPED, and where it continues (``kept``:
    the steps its last complete checkpoint holds; None: not known)."""
    where = ("its last complete checkpoint could not be read" if kept is None else
             "no checkpoint was complete yet: the job continues from step 0" if kept == 0 else
             f"the last complete checkpoint holds {kept} step(s): the job continues at step {kept}")
    return f"interrupted (a second Ctrl-C or SIGTERM): the workers were killed before a mini-batch boundary; {where}"


MorphCause = Literal["notice", "loss", "grow", "straggler", "failure", "stop_timeout", "manager_restart", "user"]
"""Why a morph (or a stop) began: a pre-emption ``notice``; a sudden ``loss`` of a VM; ``grow`` onto
returned VMs; a ``straggler`` excluded; a worker ``failure``; workers that missed the
``stop_timeout``; a ``manager_restart``; ``user``: the user stopped the job (no morph follows)."""


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
    ``feasible_plans`` how many it compared (paper §4.2: the planner simulates each); ``kept``:
    the config's fixed ``parallel.P``/``D`` the plan kept (``{"D": 1}``; a restarted or continued
    job's first plan keeps them), None when the planner chose freely. ``also``: the causes met
    while this morph was under way, before its new generation's first step (``{"cause", "host",
    "time"}`` each, in order): they are folded into this morph, not recorded as morphs of their
    own (e.g. VMs lost while a grow was restarting the job)."""

    time: float
    cause: MorphCause
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
    kept: dict[str, int] | None = None
    also: list[dict[str, Any]] = field(default_factory=list)
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
        """The record as the MORPH event's payload (plain data, without the phase marks)."""
        d = asdict(self)
        d.pop("marks")
        return d


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
class RunningGeneration:
    """The generation being supervised and what the manager knows of it (times in Unix s, all from
    ``time.time()``; ``predicted_stage_s``: per stage, the plan's compute seconds
    per micro-batch; ``plan``/``row``: the ``planner`` plan and its chosen row, None when started
    as configured without a calibration)."""

    gen: Generation
    job: JobConfig
    plan: Any
    row: Any
    hosts: list[Host]
    started: float
    predicted_stage_s: list[float]
    wall_started: float = field(default_factory=time.time)
    first_step_time: float | None = None
    stopping: tuple[MorphCause, str | None, float] | None = None  # (cause, host, when asked)
    stop_deadline: float = math.inf
    stop_timed_out: bool = False             # the workers missed the stop's deadline and were killed
    profile: Any = None                      # the calibration this generation was planned from
    estimate_s: float | None = None          # the step time measured at the last drift event (None: the plan's)
    recalibrated_examples_per_s: float | None = None   # the running plan re-simulated from heartbeats
    next_grow_check: float = 0.0             # when the supervision loop next looks for a grow
    next_health_check: float = 0.0           # ... next judges stragglers and the estimate's drift


def plan_summary(job: JobConfig, hosts: list[Host]) -> dict[str, Any]:
    """A plan as a morph records it: ``{"P", "D", "gpus", "micro_batch_size", "num_micro_batches",
    "hosts"}`` (``hosts``: the VMs' names in rank order)."""
    p = job.parallel
    return {"P": p.P, "D": p.D, "gpus": p.P * p.D, "micro_batch_size": p.micro_batch_size,
            "num_micro_batches": p.num_micro_batches, "hosts": [h.name for h in hosts]}


@dataclass(frozen=True)
class CancelRequested:
    """The user asked the job to stop (``Manager.cancel``, ``varuna stop``)."""


@dataclass(frozen=True)
class HostChanged:
    """A VM event from the provider (``added``, ``notice``, ``removed``), or a VM's own pre-emption
    notice relayed by its notice watcher over the heartbeat channel."""

    event: HostEvent


@dataclass(frozen=True)
class WorkersLost:
    """The running generation's heartbeat server declared a host lost (its ``host_lost`` event;
    ``payload["detection_latency_s"]``: how long after the loss it was detected)."""

    event: Event


ManagerMessage = Union[CancelRequested, HostChanged, WorkersLost]
"""What the manager's queue carries (provider and heartbeat threads put, the manager's loop takes)."""


__all__ = ["JobState", "ManagerError", "JobInterrupted", "interrupted_reason", "CalibrationFailed", "MorphCause", "MorphRecord", "MORPH_PHASES",
           "morph_phases", "plan_candidates", "plan_summary", "RunningGeneration", "CancelRequested",
           "HostChanged", "WorkersLost", "ManagerMessage"]
