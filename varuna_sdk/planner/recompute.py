"""Recompute only where memory needs it, and the in-flight cap of every stage that keeps its
activations.

Owns the per-stage memory decision of one searched candidate (a depth's row): which stages
recompute, the cap on the micro-batches each other stage holds in flight, and a sentence per
stage saying why. The search (``planner.search``) runs whole-pipeline modes (recompute on
everywhere, or off everywhere); this module then refines the candidate it keeps for a depth:

* under a memory limit every stage but the last gets an in-flight cap: the most micro-batches
  that fit the limit, or — when it simulates faster — no more than a capped stage above lets
  through (``cascade_caps``) — so that however late messages arrive at run time no stage holds
  more than the plan's memory figure, which is that bound. With no limit no stage is capped: a
  cap at the simulated peak (what this module did before) binds only when messages arrive later
  than simulated, and then takes a forward from a stage that would otherwise wait — under
  injected jitter the capped rows of ``bench_schedules`` ran 2–8 % slower than the uncapped ones at
  4 of 4 capped points on 12-03 17:26 (−4 … +2 % at 12:48; run-to-run noise is of that order) —
  and the memory figure is then all m micro-batches (a stage that keeps its
  activations holds one live graph — its input plus every activation its segments save — per
  micro-batch in flight; a recomputing stage holds stashed inputs plus the graphs being
  recomputed). The runtime's scheduler enforces the caps (``pipeline.schedule.StageScheduler``);
* a stage recomputes only when keeping the activations of the micro-batches 1F1B would hold
  there (``P - stage``) does not fit the limit — and, where at least one micro-batch's do, keeping
  fewer under a smaller cap (which throttles the pipeline) simulates slower. The mixed
  configurations are simulated; the fastest that fits is kept (recompute everywhere included),
  one recomputing on more stages only when it simulates ``RECOMPUTE_GAIN`` faster;
* a no-recompute candidate the search excluded for memory (its uncapped peaks) is re-simulated
  with the caps that fit (``planner.search._rescue``).

Varuna only (GPipe and 1F1B run as published and take no cap; the planner gives them one
recompute flag for every stage, though a config may list one per stage). The last stage never recomputes. Memory per stage is ``SearchInput``'s model
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
    stage (size P, the last False), the in-flight cap per stage (size P, 0 = none), the memory
    bound per stage (bytes: what the stage may hold at most, its cap — or all m micro-batches when
    uncapped — whatever the timing) and why."""

    candidate: object
    recompute: list[bool]
    max_in_flight: list[int]
    memory: list[float]
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


def memory_balanced_starts(inp, ti: int, P: int, per_live: int = 1) -> list[int] | None:
    """The split into ``P`` contiguous stages (first segment of each) whose largest stage needs the
    least memory holding ``per_live`` live graphs (bytes: ``_core.stage_memory`` of the segment
    range), to 0.01 %: a bisection on that maximum, each step a greedy packing (a stage's memory only
    grows with its range), O(n log) stage-memory calls for n segments. The search's memory-aware
    split assumes uncapped in-flight; under caps a stage holds one graph or a few, so a split that
    balances weights and optimizer state can fit a limit the search calls too small. None when
    there are fewer segments than stages."""
    n = len(inp.tables[ti].fwd)
    if P < 1 or n < P:
        return None
    memo: dict[tuple[int, int], float] = {}

    def cost(a: int, b: int) -> float:
        if (a, b) not in memo:
            memo[(a, b)] = _core.stage_memory(inp, ti, a, b, 0, per_live)
        return memo[(a, b)]

    def pack(x: float) -> list[int] | None:
        starts, a = [0], 0
        for b in range(1, n):
            if cost(a, b + 1) > x:
                starts.append(b)
                a = b
                if len(starts) > P:
                    return None
        return starts

    lo = max(cost(k, k + 1) for k in range(n))
    hi = max(lo, cost(0, n))
    best, at_lo = pack(hi), pack(lo)
    if at_lo is not None:
        best, hi = at_lo, lo
    while hi - lo > 1e-4 * hi:
        mid = 0.5 * (lo + hi)
        got = pack(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    starts = list(best or [0])
    while len(starts) < P:  # fewer stages than P: split the largest stage that has two segments
        ends = starts[1:] + [n]
        k = max((k for k in range(len(starts)) if ends[k] - starts[k] > 1), key=lambda k: cost(starts[k], ends[k]))
        starts.insert(k + 1, ends[k] - 1)
    return starts


def evaluate_with(inp, c, ti: int, rec: list[bool], caps: list[int]):
    """``c`` (its split fixed) simulated with recompute per stage and caps."""
    x = copy.copy(inp)
    x.fixed_starts = list(c.starts)
    x.stage_recompute = rec
    x.max_in_flight = caps
    return _core.evaluate(x, c.P, c.D, ti)


def _keep_cap(mem: StageMemory, limit: float | None, m: int) -> int:
    """The cap of a stage that keeps its activations: the most live graphs that fit ``limit``; 0
    (none) with no limit or when it would not bind (>= m)."""
    fit = mem.live_fit(limit)
    return 0 if fit is None or fit >= m else fit


def _rec_cap(mem: StageMemory, limit: float | None, live: int, m: int) -> int:
    """The cap of a recomputing stage (stashed inputs plus ``live`` graphs at once): the most
    micro-batches that fit ``limit``; 0 (none) with no limit or when >= m."""
    if not limit:
        return 0
    if mem.per_stashed <= 0:
        k = m
    else:
        k = live + math.floor((limit - mem.bytes(0, live)) / mem.per_stashed)
    return 0 if k >= m else max(1, k)


def cascade_caps(caps: list[int], m: int) -> list[int]:
    """Caps no looser than what a capped stage upstream lets through, as 1F1B holds them: a stage
    ``k`` stages below a stage capped at ``c`` gets at most ``max(1, c - k)`` (the last stage keeps
    0). The runtime lets a loosely capped stage run forwards while the capped stage above it
    waits for a gradient, so on the synthetic 4-stage profile of the tests caps [4, 0, 0, 0]
    simulate 2.75 s per mini-batch and [4, 3, 2, 0] 1.66 s; the tighter caps also hold less."""
    out = list(caps)
    bind: int | None = None  # the tightest cap the stages above impose on this one
    for s in range(len(caps) - 1):
        if bind is not None:
            k = min(out[s] or m, max(1, bind))
            out[s] = 0 if k >= m else k
        nxt = [x - 1 for x in (bind, out[s] or None) if x is not None]
        bind = min(nxt) if nxt else None
    return out


def cap_variants(caps: list[int], m: int) -> list[list[list[int]]]:
    """The in-flight caps ``refine`` simulates for one recompute setting, in groups, loosest
    first: ``caps`` (what fits the limit per stage) and those caps cascaded (``cascade_caps``);
    then, where the stages' caps differ, one group per tighter cap level found among them, every
    stage but the last held to it (and that cascaded). A stage allowed more micro-batches than
    those below it runs forwards that then wait, so a uniform cap can simulate faster while
    holding less (helper-41's 9-stage case: caps [4, 3, 3, 3, 3, 1, 1, 1, 0] 9.63 s, every stage
    at 3 9.29 s). ``refine`` stops at the first level whose uniform caps are no faster. Each variant is no
    looser than ``caps`` anywhere, so the memory bounds of ``caps`` hold for it too; no variant
    repeats."""
    seen: list[list[int]] = []

    def group(cs: list[int]) -> list[list[int]]:
        out = [v for v in (cs, cascade_caps(cs, m)) if v not in seen]
        out = [v for k, v in enumerate(out) if v not in out[:k]]
        seen.extend(out)
        return out

    groups = [group(list(caps))]
    for k in sorted({x for x in caps[:-1] if x}, reverse=True)[1:]:
        g = group([min(x or m, k) if s < len(caps) - 1 else x for s, x in enumerate(caps)])
        if g:
            groups.append(g)
    return groups


def _bound(mem: StageMemory, rec: bool, cap: int, live: int, m: int) -> float:
    """Bytes a stage may hold at most: its cap (or all m micro-batches) in flight."""
    held = cap or m
    return mem.bytes(max(0, held - live), min(held, live)) if rec else mem.bytes(0, held)


def _mbs(n: int) -> str:
    return f"{n} micro-batch{'' if n == 1 else 'es'}"


def _keep_why(cap: int, bound: float, limit: float | None, m: int) -> str:
    size = format_bytes(bound)
    if not limit:
        return (f"keeps activations: at most {_mbs(cap)} in flight ({size}; no memory limit)" if cap
                else f"keeps activations of up to all {m} micro-batches ({size}; no memory limit: uncapped, so "
                "that late messages find the schedule's slack)")
    return (f"keeps activations: at most {_mbs(cap or m)} in flight, {size} of the {format_bytes(limit)} "
            f"limit" + ("" if cap else " (all of them fit)"))


#: A configuration that recomputes on more stages is chosen only when it simulates this much faster
#: (a fraction of the mini-batch time): recompute spends a second forward, which the simulator
#: charges only as compute time — not the cores it takes from other ranks on a shared host, nor its
#: memory traffic — and the simulator is a few per cent off on real links (bench_slow_network);
#: below this, keeping the activations is the plan (recompute only where memory needs it).
RECOMPUTE_GAIN = 0.02


def _rec_why(cap: int, bound: float, limit: float | None, reason: str) -> str:
    held = f"at most {_mbs(cap)} in flight" if cap else "every micro-batch may be in flight"
    lim = f" of the {format_bytes(limit)} limit" if limit else ""
    return f"recomputes ({reason}): {held}, {format_bytes(bound)}{lim}"


def with_ceiling(caps: list[int], ceiling: int, m: int) -> list[int]:
    """``caps`` (0 = none) with no stage above the user's ``ceiling`` (0 = no ceiling; the last stage
    included); 0 where the result would not bind (>= m)."""
    if ceiling <= 0:
        return list(caps)
    out = [min(c or m, ceiling) for c in caps]
    return [0 if k >= m else k for k in out]


def _ceiling_why(why: str, cap: int, ceiling: int) -> str:
    """``why`` with a note where the user's ceiling is the stage's cap."""
    return f"{why}; max_in_flight={ceiling} asked" if ceiling and cap == ceiling else why


def memory_bounds(mems: list[StageMemory], rec: list[bool], caps: list[int], live: list[int], m: int,
                  last_memory: float) -> list[float]:
    """Bytes each stage may hold at most, whatever the timing: its cap (0: none, so all ``m``)
    micro-batches in flight — ``live`` of them as graphs on a recomputing stage, the rest stashed
    inputs — and never more than the tightest cap above it (a micro-batch in flight on a stage is
    in flight on every stage above it: their backward waits for its gradient). The last stage,
    which runs each backward right after its forward, holds ``last_memory`` (simulated)."""
    held, tight = [], 0
    for x in caps:   # the tightest non-zero cap so far (0: none), in one pass
        tight = x if x and (not tight or x < tight) else tight
        held.append(tight)
    last = len(mems) - 1
    return [_bound(mems[s], rec[s], held[s], live[s], m) if s != last else last_memory for s in range(len(mems))]


def refine(inp, c, ti: int, *, limit: float | None, recompute: bool, auto: bool,
           ceiling: int = 0) -> StagePlan | None:
    """Per-stage recompute, in-flight caps and memory bounds for the Varuna candidate ``c`` that
    the search found in mode ``recompute`` (on or off everywhere) with input ``inp``.

    Under a limit every stage but the last gets a cap (``_keep_cap``, ``_rec_cap``: what fits
    ``limit``, bytes per GPU), so that its memory figure holds whatever the timing; with no limit
    (None) no stage is capped. ``auto`` (the planner's ``recompute=None``): a recompute candidate gets recompute only
    on the stages where the activations of ``P - stage`` micro-batches do not fit, kept when the
    simulation finds it feasible and no slower (more recompute only when ``RECOMPUTE_GAIN`` faster). A no-recompute candidate that the search excluded
    for memory is tried with its caps (None when that cannot fit either). With ``auto`` False the
    recompute setting is the user's. ``ceiling`` (the user's ``max_in_flight``, 0 = none): no
    stage's cap — the last stage's included — exceeds it (``with_ceiling``), in every simulation.
    """
    P, m = c.P, c.m
    mems = stage_memories(inp, c, ti)
    last = P - 1
    searched = [recompute and s != last for s in range(P)]

    def live_at_peak(rec: list[bool]) -> list[int]:
        """Per stage, the live graphs (at least 1) at the simulated peak of ``rec`` uncapped: the
        candidate's own for its searched mode, else simulated here (a recompute candidate's peaks
        say nothing of what its stages hold keeping activations)."""
        src = c
        if rec != searched:
            free = copy.copy(inp)
            free.memory_limit = 0.0
            src = evaluate_with(free, c, ti, rec, [0] * P)
        return [max(1, x) for x in src.peak_live]

    def bounds(rec: list[bool], caps: list[int], live: list[int]) -> list[float]:
        return memory_bounds(mems, rec, caps, live, m, c.stage_memory[last])

    def run(rec: list[bool]):
        """The faster of the caps that fit (none without a limit) and those caps cascaded."""
        live = live_at_peak(rec)
        caps = [0 if s == last else (_rec_cap(mems[s], limit, live[s], m) if rec[s]
                                     else _keep_cap(mems[s], limit, m)) for s in range(P)]
        caps = with_ceiling(caps, ceiling, m)
        bound = bounds(rec, caps, live)
        if limit and any(b > limit for b in bound[:last]):
            return None, caps, bound
        best = None
        for n, group in enumerate(cap_variants(caps, m)):
            gained = False
            for cs in group:
                cand = evaluate_with(inp, c, ti, rec, cs)
                if cand.feasible and (best is None or cand.minibatch_time < best[0].minibatch_time):
                    best, gained = (cand, cs, bounds(rec, cs, live)), True
                if n and not gained:   # a tighter level that gains nothing: neither its cascade nor
                    break              # the tighter levels are tried
            if n and not gained:
                break
        return best if best is not None else (None, caps, bound)

    last_why = "last stage: runs each backward right after its forward (never recomputes)"
    if not recompute:
        rec = [False] * P
        cand, caps, bound = run(rec)
        if cand is None:
            return None
        why = [_keep_why(caps[s], bound[s], limit, m) for s in range(last)] + [last_why]
        return StagePlan(cand, rec, caps, bound, [_ceiling_why(w, k, ceiling) for w, k in zip(why, caps)])
    need = [min(m, P - s) for s in range(P)]
    fits = [mem.live_fit(limit) for mem in mems]
    keep = [s != last and auto and (fits[s] is None or fits[s] >= need[s]) for s in range(P)]
    # a stage where fewer graphs than 1F1B holds fit (but at least one) may still keep its
    # activations under that smaller cap: it throttles the pipeline instead of paying a second forward
    throttle = [s != last and auto and not keep[s] and fits[s] is not None and fits[s] >= 1 for s in range(P)]
    every = [s != last for s in range(P)]
    options = [(every, "recompute=True was asked" if not auto else "")]
    if any(keep):
        options.insert(0, ([s != last and not keep[s] for s in range(P)], ""))
    if any(throttle):
        options.insert(0, ([s != last and not (keep[s] or throttle[s]) for s in range(P)], ""))
    best = None
    for rec, asked in options:  # fewest recomputing stages first: a later option must win by RECOMPUTE_GAIN
        cand, caps, bound = run(rec)
        if cand is not None and (best is None or cand.minibatch_time < best[0].minibatch_time * (1 - RECOMPUTE_GAIN)):
            best = (cand, rec, caps, bound, asked)
    if best is None:
        return None
    cand, rec, caps, bound, asked = best
    why = []
    for s in range(P):
        if s == last:
            why.append(last_why)
        elif not rec[s]:
            why.append(_keep_why(caps[s], bound[s], limit, m) + (
                f"; fewer than the {need[s]} 1F1B holds here, which throttles the pipeline but simulates faster than "
                "recomputing" if throttle[s] else ""))
        elif asked:
            why.append(_rec_why(caps[s], bound[s], limit, asked))
        elif keep[s]:  # the mixed configuration simulated slower
            why.append(_rec_why(caps[s], bound[s], limit, f"keeping activations here simulates more than "
                                f"{RECOMPUTE_GAIN:.0%} slower"))
        elif throttle[s]:  # keeping fewer than need[s] under a smaller cap simulated slower
            why.append(_rec_why(caps[s], bound[s], limit, f"keeping the activations of {need[s]} micro-batches, as "
                                f"many as 1F1B holds here, needs {format_bytes(mems[s].bytes(0, need[s]))}, over the "
                                f"limit, and keeping {fits[s]} under a cap simulates slower"))
        else:
            why.append(_rec_why(caps[s], bound[s], limit, f"keeping the activations of {need[s]} micro-batches, as "
                                f"many as 1F1B holds here, needs {format_bytes(mems[s].bytes(0, need[s]))}, over the "
                                f"limit"))
    return StagePlan(cand, rec, caps, bound, [_ceiling_why(w, k, ceiling) for w, k in zip(why, caps)])
