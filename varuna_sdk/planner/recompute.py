"""Recompute only where memory needs it, and the in-flight cap of every stage that keeps its
activations.

Owns the per-stage memory decision of one searched candidate (a depth's row): which stages
recompute, the cap on the micro-batches each other stage holds in flight, and a sentence per
stage saying why. The search (``planner.search``) runs whole-pipeline modes (recompute on
everywhere, or off everywhere); this module then refines the candidate it keeps for a depth:

* a stage that does not recompute holds one live graph (its input plus every activation its
  segments save for the backward) per micro-batch in flight. Its cap is the most micro-batches
  that fit the memory limit, or, with no limit, the simulated peak — so that however late
  messages arrive at run time, no stage holds more than the plan's memory figure says
  (``pipeline.schedule.StageScheduler``: the runtime's scheduler enforces it);
* a stage recomputes only when keeping the activations of the micro-batches 1F1B would hold
  there (``P - stage``; fewer would starve the pipeline) does not fit the limit. The mixed
  configuration is simulated; it is kept when it fits and is no slower than recompute
  everywhere.

Varuna only (GPipe and 1F1B run as published: their recompute is one flag and they take no
cap). The last stage never recomputes. Memory per stage is ``SearchInput``'s model
(``_core.stage_memory``: weights, gradients and optimizer state plus stashed inputs and live
graphs). Paper §3.2 (recompute), §4.4 (memory-aware configuration).

Units: bytes, micro-batches, seconds. Imports ``planner.rows`` (formatting) and the C++ core only.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from .._native import core as _core
from .rows import format_bytes


@dataclass(frozen=True)
class StageMemory:
    """One stage's memory model (bytes per GPU): ``fixed`` (weights, gradients, optimizer state),
    ``per_stashed`` (one stashed input, awaiting its recompute) and ``per_live`` (one live graph:
    the input plus the activations its segments save)."""

    fixed: float
    per_stashed: float
    per_live: float

    def bytes(self, stashed: int, live: int) -> float:
        """Bytes while holding ``stashed`` inputs and ``live`` graphs."""
        return self.fixed + stashed * self.per_stashed + live * self.per_live

    def live_fit(self, limit: float | None) -> int | None:
        """The most live graphs that fit ``limit`` bytes (None: no limit, or nothing to hold)."""
        if not limit or self.per_live <= 0:
            return None
        return max(0, math.floor((limit - self.fixed) / self.per_live))


@dataclass
class StagePlan:
    """The refined candidate of one depth: the C++ ``Candidate`` it simulates as, recompute per
    stage (size P, the last False), the in-flight cap per stage (size P, 0 = none) and why."""

    candidate: object
    recompute: list[bool]
    max_in_flight: list[int]
    why: list[str]


def stage_memories(inp, c, ti: int) -> list[StageMemory]:
    """The memory model of each stage of candidate ``c`` (its ``starts``) at micro-batch table ``ti``."""
    n = len(inp.tables[ti].fwd)
    ends = list(c.starts[1:]) + [n]
    out = []
    for a, b in zip(c.starts, ends):
        fixed = _core.stage_memory(inp, ti, a, b, 0, 0)
        out.append(StageMemory(fixed, _core.stage_memory(inp, ti, a, b, 1, 0) - fixed,
                               _core.stage_memory(inp, ti, a, b, 0, 1) - fixed))
    return out


def _evaluate(inp, c, ti: int, rec: list[bool], caps: list[int]):
    """``c`` (its split fixed) simulated with recompute per stage and caps."""
    x = copy.copy(inp)
    x.fixed_starts = list(c.starts)
    x.stage_recompute = rec
    x.max_in_flight = caps
    return _core.evaluate(x, c.P, c.D, ti)


def _cap(fit: int | None, peak: int, m: int) -> int:
    """The cap of a stage that keeps its activations: what fits (None: the simulated peak); 0 when
    it would not bind (>= m)."""
    k = peak if fit is None else fit
    return 0 if k >= m else max(1, k)


def _keep_why(cap: int, mem: StageMemory, limit: float | None, m: int) -> str:
    held = cap or m
    size = format_bytes(mem.bytes(0, held))
    if not limit:
        return (f"keeps activations: at most {held} micro-batches in flight ({size}; no memory limit, capped at "
                "the simulated peak)" if cap else f"keeps activations of up to all {m} micro-batches ({size}; no "
                "memory limit)")
    return (f"keeps activations: at most {held} micro-batches in flight, {size} of the {format_bytes(limit)} limit"
            + ("" if cap else " (all of them fit)"))


def refine(inp, c, ti: int, *, limit: float | None, recompute: bool, auto: bool) -> StagePlan:
    """Per-stage recompute and in-flight caps for the feasible Varuna candidate ``c`` that the
    search found in mode ``recompute`` (on or off everywhere) with input ``inp``.

    ``auto`` (the planner's ``recompute=None``): a recompute candidate gets recompute only on the
    stages where the activations of ``P - stage`` micro-batches do not fit ``limit`` (bytes per
    GPU, None = no limit), kept when the simulation finds it feasible and no slower. A stage that
    keeps its activations is capped (``_cap``). With ``auto`` False the mode is the user's (every
    stage but the last as asked) and only the caps are set.
    """
    P, m = c.P, c.m
    mems = stage_memories(inp, c, ti)
    fits = [mem.live_fit(limit) for mem in mems]
    last = [s == P - 1 for s in range(P)]
    if not recompute:
        caps = [0 if last[s] else _cap(fits[s], c.peak_live[s], m) for s in range(P)]
        why = [_keep_why(caps[s], mems[s], limit, m) for s in range(P)]
        if last[-1]:
            why[-1] = "last stage: runs each backward right after its forward (never recomputes)"
        cand = _evaluate(inp, c, ti, [False] * P, caps) if any(caps) else c
        return StagePlan(cand, [False] * P, caps, why)
    need = [min(m, P - s) for s in range(P)]
    keep = [not last[s] and auto and (fits[s] is None or fits[s] >= need[s]) for s in range(P)]
    rec = [not last[s] and not keep[s] for s in range(P)]
    caps = [_cap(fits[s], m, m) if keep[s] else 0 for s in range(P)]
    why = []
    for s in range(P):
        if last[s]:
            why.append("last stage: runs each backward right after its forward (never recomputes)")
        elif keep[s]:
            why.append(_keep_why(caps[s], mems[s], limit, m))
        elif not auto:
            why.append("recomputes: recompute=True was asked")
        else:
            why.append(f"recomputes: keeping the activations of {need[s]} micro-batches (as many as 1F1B holds here) "
                       f"needs {format_bytes(mems[s].bytes(0, need[s]))}, over the {format_bytes(limit)} limit")
    if any(keep):
        mixed = _evaluate(inp, c, ti, rec, caps)
        if mixed.feasible and mixed.minibatch_time <= c.minibatch_time:
            return StagePlan(mixed, rec, caps, why)
        slower = (f"recomputes: keeping activations (capped at what fits) simulates slower, "
                  f"{mixed.minibatch_time:.4g} s against {c.minibatch_time:.4g} s per mini-batch"
                  if mixed.feasible else "recomputes: keeping activations does not fit as simulated")
        why = [slower if keep[s] else why[s] for s in range(P)]
    return StagePlan(c, [not last[s] for s in range(P)], [0] * P, why)
