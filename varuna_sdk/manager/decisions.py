"""The morph manager's decisions as small pure functions (paper §4.2, §4.6): how many worker
slots a pool offers, whether growing onto returned VMs is worth a morph, which workers are
stragglers and whether the job is faster without one, whether the plan's estimate still holds,
how many steps a morph lost. No processes, sockets or clocks here — the state machine in
``manager.manager`` feeds these with what it observed, so every rule is testable with plain
numbers.

**Adding a morph rule? This module is where it lives.** The contract:

1. A rule's thresholds are a frozen dataclass here (``GrowRule``, ``StragglerRule``,
   ``DriftRule``): one docstring line per field with its unit, checked in ``__post_init__``
   (``ValueError`` naming the field).
2. Its judgement is a pure function (or method) here of plain observations — numbers, ``Host``
   lists, per-rank histories, a ``planner`` plan and row to simulate — returning the decision
   (a bool, the ranks concerned, a number or None); it never reads a clock, a socket or the
   event log, and never starts or stops anything.
3. Wiring (outside this module, a few lines): a field for the rule in
   ``manager.options.ManagerOptions`` (``None``: the rule is off); a ``MorphCause`` for it in
   ``manager.state``; a call in the supervision loop (``manager.supervision``: on a queue message
   in ``_on_message``, or periodically in ``_periodic_checks``) that records the decision as an
   event (a ``Kind`` in ``manager.events``) and, when it says morph, calls
   ``self._request_stop(run, cause, host)`` — the workers stop at the next mini-batch boundary,
   checkpoint, and the manager re-plans for the VMs it may use. The existing rules' calls are
   the models: ``_check_stragglers`` and ``_check_drift`` in ``manager.telemetry`` (run from
   ``_periodic_checks``), the grow check in ``manager.supervision``.
4. Words for the new cause where morphs are shown: ``manager.runs`` (the sentences of ``varuna
   status``/``logs``) and ``dashboard/theme.py`` (``CAUSE_LABELS``, the morph table); a cause missing
   there is shown by its bare name.

Owns ``worker_slots``, ``pool_slots``, ``pool_prices``, ``GrowRule``, ``StragglerRule``,
``find_stragglers``, ``judge_straggler``, ``advance_lineage``, ``steps_lost``, ``DriftRule``, ``step_time_drift``,
``compute_ratios``, ``segment_factors``. Imports ``cluster.hosts`` and ``manager.billing.price`` (a
label's US $ per hour); never torch, never the rest of the manager.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..cluster.hosts import Host
from .billing import price


def worker_slots(host: Host) -> int:
    """Workers one VM runs: one per GPU, or one on a CPU-only VM (``gpus == 0``)."""
    return max(1, int(host.gpus))


def pool_slots(hosts: Iterable[Host]) -> int:
    """Total worker slots of a pool of VMs (``worker_slots`` summed)."""
    return sum(worker_slots(h) for h in hosts)


def pool_prices(hosts: Iterable[Host]) -> dict | None:
    """The planner's ``Prices`` fields for a pool, from the ``price_per_hour`` (spot) and
    ``on_demand_per_hour`` labels (US $ per VM-hour) its provider put on the VMs (the AWS provider:
    the spot price history of each instance's type and zone): ``{"spot_per_gpu_hour",
    "on_demand_per_gpu_hour", "vm_type", "example"}``, each VM's price spread over its worker
    slots and averaged over the pool's slots. None when no VM has a price (the planner then uses
    its example figures). A VM without an on-demand price counts at its spot price."""
    spot = on_demand = 0.0
    slots, types, example = 0, [], False
    for h in hosts:
        vm_spot = price(h.labels.get("price_per_hour"))
        if vm_spot is None:
            continue
        spot += vm_spot
        od = price(h.labels.get("on_demand_per_hour"))
        on_demand += vm_spot if od is None else od
        slots += worker_slots(h)
        kind = h.labels.get("instance_type") or h.labels.get("kind") or "VM"
        if kind not in types:
            types.append(str(kind))
        example = example or str(h.labels.get("prices", "")) == "example"
    if slots == 0:
        return None
    return {"spot_per_gpu_hour": spot / slots, "on_demand_per_gpu_hour": on_demand / slots,
            "vm_type": ", ".join(types), "example": example}


@dataclass(frozen=True)
class GrowRule:
    """When returned or new VMs are worth a morph (hysteresis, so the job does not flap).

    ``min_gain``: the new plan's predicted examples/s must be at least this multiple of the
    running plan's (1.10 = 10 % faster); ``cooldown_s``: seconds since the last morph (or
    start) before growing again; a morph costs a checkpoint and a restart, so small gains
    right after one are not taken.
    """

    min_gain: float = 1.10
    cooldown_s: float = 30.0

    def __post_init__(self):
        if not self.min_gain >= 1.0:
            raise ValueError(f"GrowRule.min_gain={self.min_gain} must be >= 1.0 (1.10 = grow for a 10% gain)")
        if not self.cooldown_s >= 0.0:
            raise ValueError(f"GrowRule.cooldown_s={self.cooldown_s} must be >= 0 seconds")

    def worth_it(self, current_examples_per_s: float, new_examples_per_s: float,
                 seconds_since_last_morph: float, current_workers: int | None = None,
                 new_workers: int | None = None) -> bool:
        """True when the new plan is ``min_gain`` x faster, the cooldown has passed and, when the
        worker counts (P x D) are given, the new plan uses more workers: a plan on no more
        workers than the running one is no grow, however its prediction compares (the two
        predictions may come from different yardsticks)."""
        return self.why_not(current_examples_per_s, new_examples_per_s, seconds_since_last_morph,
                            current_workers, new_workers) is None

    def why_not(self, current_examples_per_s: float, new_examples_per_s: float,
                seconds_since_last_morph: float, current_workers: int | None = None,
                new_workers: int | None = None) -> str | None:
        """Why ``worth_it`` says no, in words (``None``: it says grow): the cooldown (with the
        seconds left), no more workers, or a gain below ``min_gain``."""
        if seconds_since_last_morph < self.cooldown_s:
            return (f"in the cooldown: {seconds_since_last_morph:.0f} s since the last morph or the start, "
                    f"{self.cooldown_s - seconds_since_last_morph:.0f} s of {self.cooldown_s:.0f} s left")
        if current_workers is not None and new_workers is not None and new_workers <= current_workers:
            return f"that plan uses {new_workers} workers, no more than the {current_workers} running"
        if not current_examples_per_s > 0.0:
            return None if new_examples_per_s > 0.0 else "no plan predicts any examples/s"
        gain = new_examples_per_s / current_examples_per_s
        if gain >= self.min_gain:
            return None
        return f"gain {gain:.2f}x, below {self.min_gain:.2f}x"


@dataclass(frozen=True)
class StragglerRule:
    """A worker is a straggler (fail-stutter, paper §4.6) when its compute per micro-batch,
    relative to what the plan predicted for its stage, is ``factor`` x the median of all
    other workers' ratios in each of its last ``beats`` heartbeats. Comparing against the prediction
    (not only same-stage peers) makes the rule work with D = 1 too. It is excluded when the job is
    then predicted ``min_gain`` faster without it (``judge_straggler``)."""

    factor: float = 1.5
    beats: int = 3
    #: exclude only when the job is predicted this much faster without the worker (reading data included)
    min_gain: float = 0.1

    def __post_init__(self):
        if not self.factor > 1.0:
            raise ValueError(f"StragglerRule.factor={self.factor} must be > 1 (1.5 = 50% slower than peers)")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"StragglerRule.min_gain={self.min_gain} must be in [0, 1) (0.1 = 10% faster without it)")
        if self.beats < 1:
            raise ValueError(f"StragglerRule.beats={self.beats} must be >= 1")


def find_stragglers(history: Mapping[int, Sequence[float]], predicted: Mapping[int, float],
                    rule: StragglerRule) -> dict[int, float]:
    """Ranks that are stragglers under ``rule``, with their slowdown (median ratio of their
    last ``rule.beats`` samples to the median of the other ranks' samples).

    ``history``: rank -> per-micro-batch compute seconds (F + R + B) from its heartbeats,
    oldest first; ``predicted``: rank -> the plan's seconds for its stage. Ranks with fewer
    than ``rule.beats`` samples, or no prediction, are not judged. Units cancel (ratios).
    """
    ratios: dict[int, list[float]] = {}
    for rank, xs in history.items():
        p = predicted.get(rank)
        if not p or p <= 0.0 or len(xs) < rule.beats:
            continue
        ratios[rank] = [x / p for x in xs[-rule.beats:] if x is not None and x > 0.0]
    ratios = {r: v for r, v in ratios.items() if len(v) == rule.beats}
    if len(ratios) < 2:
        return {}
    out = {}
    for k in range(rule.beats):  # a straggler must stand out in every one of the last beats
        for r, v in ratios.items():
            med = statistics.median(w[k] for q, w in ratios.items() if q != r)  # its peers
            if med > 0.0 and v[k] >= rule.factor * med:
                out.setdefault(r, []).append(v[k] / med)
    return {r: statistics.median(v) for r, v in out.items() if len(v) == rule.beats}


@dataclass(frozen=True)
class DriftRule:
    """The plan's estimate no longer holds (issue "honest estimates"): the measured step time
    differs from the predicted one by more than ``threshold`` (0.15 = 15 %), in the same
    direction, in each of the last ``steps`` steps, after the generation's first ``warmup``
    steps (a restart's first steps load a checkpoint and warm caches)."""

    threshold: float = 0.15
    steps: int = 5
    warmup: int = 2

    def __post_init__(self):
        if not self.threshold > 0.0:
            raise ValueError(f"DriftRule.threshold={self.threshold} must be > 0 (0.15 = 15 %)")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"DriftRule.steps={self.steps} must be >= 1 and warmup={self.warmup} >= 0")


def step_time_drift(step_times_s: Sequence[float], predicted_step_s: float | None,
                    rule: DriftRule) -> float | None:
    """Relative drift of the measured step time from the prediction (+0.38 = 38 % slower), the
    median over the last ``rule.steps`` steps, when every one of them is beyond the rule's
    threshold on the same side; None otherwise (too few steps, no prediction, or within it).
    ``step_times_s``: one generation's step times in seconds, oldest first."""
    if not predicted_step_s or predicted_step_s <= 0.0:
        return None
    xs = [float(x) for x in step_times_s[rule.warmup:] if x is not None and x > 0.0]
    if len(xs) < rule.steps:
        return None
    rel = [x / predicted_step_s - 1.0 for x in xs[-rule.steps:]]
    if all(r > rule.threshold for r in rel) or all(r < -rule.threshold for r in rel):
        return statistics.median(rel)
    return None


def compute_ratios(history: Mapping[int, Sequence[float]], predicted: Mapping[int, float],
                   last: int = 5) -> dict[int, float]:
    """Per rank, measured / predicted compute per micro-batch (median of its last ``last``
    heartbeats); ranks without samples or a prediction are left out. ``history`` and
    ``predicted`` as in ``find_stragglers``."""
    out = {}
    for rank, xs in history.items():
        p = predicted.get(rank)
        vals = [x for x in xs[-last:] if x is not None and x > 0.0]
        if p and p > 0.0 and vals:
            out[rank] = statistics.median(vals) / p
    return out


def segment_factors(ratios: Mapping[int, float], stages: Sequence[Sequence[int]], P: int,
                    n_segments: int) -> list[float]:
    """Per cut-point segment, the factor by which the live job's compute differs from the
    calibration: the smallest ratio over the replicas of the stage that ran it — what a healthy
    worker does now (contention slows them all; a straggler, one: it must not make every later
    plan look slow, nor hide that the job is faster without it); 1.0 for a stage with no sample.
    ``ratios``: rank -> ratio (``compute_ratios``), rank = replica * P + stage; ``stages``:
    segment indices per stage."""
    f = [1.0] * n_segments
    for s, segs in enumerate(stages):
        xs = [r for rank, r in ratios.items() if rank % P == s]
        k = min(xs) if xs else 1.0
        for i in segs:
            if 0 <= i < n_segments:
                f[i] = k
    return f


def judge_straggler(plan, row, rank: int, slowdown: float, without, data_s: float = 0.0,
                    min_gain: float = 0.0, measured_s: float | None = None) -> tuple[bool, float, float]:
    """Is the job faster without a slow worker? (paper §4.6, fail-stutter.) ``plan``/``row``:
    the running configuration; ``rank`` runs ``slowdown`` x slower than predicted; ``without``:
    the best ``PlanRow`` for the pool minus its VM (None: no VM would be left). Simulates the
    running configuration with that rank slowed (``Plan.simulate(rank_scale=...)``) and
    compares mini-batch times, each with the time a step waits for its batch that the plan's
    simulation leaves out (``data_s``, seconds measured for a replica's share now; 0 where the
    profile's ``data_read_s`` lets the simulator model the read; a replica of ``without`` reads
    ``row.D / without.D`` times as much). Excludes only when the step is
    ``min_gain`` (0.1 = 10 %) faster without: a job bound by reading its data gains nothing by
    losing a worker. ``measured_s``: the step time measured with the worker (data included),
    when known, replaces the simulated one — a calibration that splits the model between stages
    wrongly makes one stage look ``slowdown`` x slow next to the others, and the simulation of
    that slowdown then overstates what the worker costs. Returns ``(exclude, seconds_with,
    seconds_without)``."""
    scale = [1.0] * (row.P * row.D)
    scale[rank] = float(slowdown)
    data_s = max(0.0, float(data_s))
    with_it = (float(measured_s) if measured_s is not None and measured_s > 0.0 else
               plan.simulate(row, rank_scale=scale, record_timeline=False).minibatch_time + data_s)
    t_without = math.inf if without is None else float(without.time_s) + data_s * row.D / max(1, without.D)
    return t_without < with_it * (1.0 - min_gain), with_it, t_without



def advance_lineage(lineage: tuple[int, int | None], generation: Any, step: int) -> tuple[tuple[int, int | None], bool]:
    """The job's lineage after one metrics row: ``lineage`` is (the newest generation that
    trained, the last step it finished; None: none yet), the row is ``step`` of ``generation``
    (not an int: an old row without one, counted in the current lineage). A newer generation
    starts a new lineage at its row, whatever the older one reached — steps an older generation
    finished past a sudden loss are re-done, and were lost once, by that morph; a late row of an
    older generation changes nothing. Returns (the lineage after the row, True when the row is new
    to it: a later step, or a newer generation's)."""
    gen, last = lineage
    if not isinstance(generation, int) or isinstance(generation, bool) or generation == gen:
        return (gen, step if last is None else max(last, step)), last is None or step > last
    if generation > gen:
        return (generation, step), True
    return lineage, False


def steps_lost(last_step_done: int | None, resume_step: int) -> int:
    """Optimizer steps trained but not in the checkpoint the job resumes from: with a notice 0
    (the checkpoint is taken at the boundary), after a sudden loss at most the checkpoint
    interval. ``last_step_done``: index of the last finished step (None: none yet);
    ``resume_step``: the number of steps the checkpoint holds (the next step's index)."""
    if last_step_done is None:
        return 0
    return max(0, int(last_step_done) + 1 - int(resume_step))


__all__ = ["worker_slots", "pool_slots", "pool_prices", "GrowRule", "StragglerRule", "find_stragglers",
           "judge_straggler", "advance_lineage", "steps_lost", "DriftRule",
           "step_time_drift", "compute_ratios", "segment_factors"]
