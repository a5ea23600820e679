"""The configuration search: from a ``PlanRequest`` to one ``PlanRow`` per pipeline depth.

Owns preparing the C++ search's input from the request (per-size segment tables interpolated from
the profile as ``Profile.at`` does, the placement and the network costs), running it once per
mode (recompute on and off — both for Varuna's per-stage choice —, the backward whole and split
into B and W where asked), keeping per depth the fastest candidate, refining it per stage
(``planner.recompute``: recompute only where memory needs it, in-flight caps) and turning
candidates into rows: costs in dollars, and for an excluded candidate a
reason in bytes the user can act on (the least memory a split needs, the stage over the limit),
or why a best-only search pruned it; and the notes under the table (extrapolated sizes, idle GPUs).
The inner loop itself is C++ (``csrc/search.cpp``).

Units: seconds, bytes, examples/s, US dollars. Imports ``planner.request``, ``planner.rows``,
``planner.cuts``, numpy and the C++ core; must never import ``planner.plan``, torch, ``cluster`` or ``manager``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from .._native import core as _core
from .cuts import better_split
from .recompute import (StagePlan, evaluate_with, memory_balanced_starts, memory_bounds, refine, stage_memories,
                        with_ceiling)
from .request import SPLIT_KEYS, TABLE_KEYS, PlanRequest, largest_divisor
from .rows import EXHAUSTIVE_HINT, PlanRow, extrapolation_note, format_bytes, format_duration, rank_rows

#: how many of the fastest depths get their split refined by simulation (``cuts.better_split``),
#: within a budget of simulated actions: this share of the search's own, and at least the floor
REFINED_DEPTHS = 4
REFINE_SHARE = 0.25
REFINE_FLOOR = 5000.0


def _interp(ys: np.ndarray, xs: np.ndarray, b: int) -> np.ndarray:
    """``Profile.at`` for every segment at once (``ys`` is ``[segments, sizes]``): piecewise-linear
    in the measured sizes, extended linearly with the nearest interval, clamped at 0 (and, below
    the smallest size, at the smallest size's value)."""
    if len(xs) == 1:
        return np.maximum(0.0, ys[:, 0] * b / xs[0])
    if b <= xs[0]:
        i = 0
    elif b >= xs[-1]:
        i = len(xs) - 2
    else:
        i = int(np.searchsorted(xs, b, side="right")) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[:, i], ys[:, i + 1]
    v = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
    if b < xs[0]:
        v = np.minimum(v, y0)
    return np.maximum(0.0, v)


def _tables(req: PlanRequest) -> list:
    """Per-size segment tables (the C++ search's input), interpolated from the request's checked
    profile arrays as ``Profile.at`` does. Built afresh on every call (vectorised, well under a
    millisecond for a hundred segments), so a profile edited in place is never planned from stale
    numbers."""
    xs, arrays = req.checked
    out = []
    for b in req.sizes:
        t = _core.SegmentTable()
        t.micro_batch_size = int(b)
        for name, attr in TABLE_KEYS + SPLIT_KEYS:
            if attr in arrays:
                setattr(t, name, _interp(arrays[attr], xs, int(b)).tolist())
        out.append(t)
    return out


def search_input(req: PlanRequest, recompute: bool = False):
    """The C++ ``SearchInput`` of ``req`` (whole backward; ``recompute`` on or off everywhere): tables, parameter and tied bytes,
    optimizer and placement figures, the memory limit (0: none), fixed depth/replicas/stage starts
    and the simulator's network costs (``network_bandwidth_Bps`` replacing the calibrated cross-VM
    bandwidth)."""
    profile = req.profile
    inp = _core.SearchInput()
    inp.gpus, inp.global_batch, inp.policy, inp.recompute = req.gpus, req.global_batch, req.policy, bool(recompute)
    inp.tables = _tables(req)
    inp.param_bytes = [float(s.param_bytes) for s in profile.segments]
    shared = profile.model.get("shared", [])
    inp.tied_segments = [list(s["segments"]) for s in shared]
    inp.tied_bytes = [float(s["bytes"]) for s in shared]
    inp.optimizer_state_factor = profile.optimizer_state_factor
    inp.memory_limit = float(req.limit or 0)  # 0: no limit (C++)
    inp.max_depth = int(req.max_depth or 0)
    inp.fixed_replicas = int(req.replicas or 0)
    inp.opt_s_per_param_byte = profile.opt_s_per_param_byte
    inp.opt_parallelism = profile.opt_parallelism
    inp.compute_interference = profile.compute_interference
    inp.ar_cpu_share = profile.network.ar_cpu_share if profile.network is not None else 1.0
    inp.exhaustive = bool(req.exhaustive)
    inp.data_read_per_example = float(profile.data_read_s)
    inp.data_prefetch = req.data_prefetch
    if req.boundaries is not None:
        inp.fixed_starts = [b[0] for b in req.boundaries]
    # no stage starts after a cut-point a tensor skips (recorded by the calibration's trace)
    inp.forbidden_starts = [int(k) + 1 for k in profile.model.get("unsplittable_cuts", [])]
    sim = _core.SimConfig()
    net = profile.network
    if net is not None:
        bw = req.network_bandwidth_Bps
        sim.p2p_alpha, sim.p2p_beta = net.p2p_alpha_s, bw or net.p2p_beta_Bps
        sim.local_alpha, sim.local_beta = net.p2p_alpha_s, net.p2p_beta_Bps
        sim.ar_alpha, sim.ar_beta = net.ar_alpha_s, bw or net.ar_beta_Bps
        sim.consensus_latency = net.consensus_s
    sim.ranks_per_host = req.gpus_per_vm
    sim.shared_egress = req.shared_egress
    sim.compute_slots_per_host = req.compute_slots_per_vm
    sim.action_overhead = profile.per_action_s
    inp.sim = sim
    return inp


Mode = tuple[bool, bool]
"""A whole-pipeline search mode: (recompute everywhere, split backward)."""


@dataclass
class SearchResult:
    """What the C++ search returned for a request: per mode ``(recompute, split)`` its input (kept
    for ``Plan.simulate``) and ranked candidates, and the summed statistics (``csrc/search.h``:
    depths, candidates, simulated, pruned, ...)."""

    searches: dict[Mode, object] = field(default_factory=dict)
    results: dict[Mode, list] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)


def run_search(req: PlanRequest) -> SearchResult:
    """Run the C++ search of ``req`` once per mode: ``req.rec_modes`` x ``req.split_modes``."""
    found = SearchResult()
    for rec in req.rec_modes:
        inp = search_input(req, rec)
        for split in req.split_modes:
            si = inp if split is False else _with_split(inp)
            found.searches[(rec, split)] = si
            found.results[(rec, split)], st = _core.search_with_stats(si)
            for k, v in dict(st).items():
                found.stats[k] = found.stats.get(k, 0) + v
    return found


def _with_split(inp):
    """A copy of a search input that splits the backward (the tables hold B and W)."""
    out = copy.copy(inp)
    out.split_backward = True
    return out


def _per_depth(results: dict[Mode, list]) -> list[tuple[object, Mode]]:
    """One candidate per depth from the searches of every mode: the fastest feasible one (a tie
    keeps the mode sorted first: no recompute, then the whole backward), else an excluded row (the
    recompute search's when there is one: its reason names the least memory); ranked as the C++ search ranks (feasible by time, then the shallower pipeline;
    excluded rows after)."""
    by_p: dict[int, tuple[object, Mode]] = {}
    for mode in sorted(results):
        for c in results[mode]:
            had = by_p.get(c.P)
            # an excluded depth keeps the recompute search's reason (recompute needs the least memory)
            if had is None or (c.feasible and (not had[0].feasible or c.minibatch_time < had[0].minibatch_time)) or \
                    (not c.feasible and not had[0].feasible and mode[0] and not had[1][0]):
                by_p[c.P] = (c, mode)
    feasible = sorted((x for x in by_p.values() if x[0].feasible), key=lambda x: (x[0].minibatch_time, x[0].P))
    order = {c.P: i for i, c in enumerate(next(iter(results.values())))}
    excluded = sorted((x for x in by_p.values() if not x[0].feasible), key=lambda x: order.get(x[0].P, 0))
    return feasible + excluded


def plan_rows(req: PlanRequest, found: SearchResult) -> tuple[list[PlanRow], "DepthRefiner"]:
    """One row per depth (``_per_depth``): times, memory and dollar costs of a feasible
    candidate — its split moved a cut-point at a time while simulated faster (``cuts.better_split``)
    for the ``REFINED_DEPTHS`` fastest depths, within ``REFINE_SHARE`` of the search's simulated
    actions (at least ``REFINE_FLOOR``), for Varuna with recompute per stage and in-flight
    caps (``planner.recompute``), re-ranked by the refined time —, the reason of an excluded one. Under a memory limit a Varuna
    candidate without recompute that the search excluded for memory is tried with in-flight caps
    first (``_rescue``).

    Branch and bound: depths are refined in the search's order, and a Varuna depth whose lower
    bound (``DepthRefiner.bound``: for any per-stage recompute and caps, on its split or on any
    where its cut-points may move: what no refinement can beat) is no faster than the fastest
    refined row is left as searched (``PlanRow.refined`` False; its
    ``lower_bound_s`` is that bound): refining it costs simulations (deep pipelines, thousands of
    micro-batches) and cannot change the best row. ``DepthRefiner.refine`` refines one later
    (``Plan.refine``). Returns the rows (feasible fastest first, then excluded) and the refiner."""
    refiner = DepthRefiner(req, found)
    rows: list[PlanRow] = []
    best = math.inf
    # a user's max_in_flight is a ceiling every row is simulated with: no row stays as searched
    prune = req.policy == "varuna" and not req.max_in_flight
    for i, (c, mode) in enumerate(_per_depth(found.results)):   # the feasible first, fastest first
        cuts = req.refine_cuts and i < REFINED_DEPTHS
        refiner.cuts[c.P] = cuts
        bound = refiner.bound(c.P, split_fixed=not cuts)
        if prune and c.simulated and bound >= best:
            rows.append(refiner.as_searched(c, mode, bound, best))
            continue
        row = refiner.refine(c.P)
        rows.append(row)
        if row.feasible:
            best = min(best, row.time_s)
    return rank_rows(rows), refiner


class DepthRefiner:
    """Refines the search's candidate of one depth into its row (``_rescue`` under a memory limit,
    the choice between modes, ``cuts.better_split`` within the budget, ``_row``), or leaves it as
    searched. Holds the request and the search's results (``found.results`` is updated where a
    rescue replaces a candidate)."""

    def __init__(self, req: PlanRequest, found: SearchResult):
        self.req, self.found = req, found
        self.budget = max(REFINE_FLOOR, REFINE_SHARE * found.stats.get("actions", 0))
        self.cuts: dict[int, bool] = {}  # per depth: whether its split is moved (one of the fastest)
        self.done: dict[int, PlanRow] = {}  # per depth: its refined row (rescues change found.results)
        self.by_depth: dict[int, list[tuple[Mode, int]]] = {}
        for mode, cands in found.results.items():
            for i, c in enumerate(cands):
                self.by_depth.setdefault(c.P, []).append((mode, i))
        # per depth, the fastest feasible recompute candidate (a capped no-recompute one that is no
        # faster needs no rescue: a capped one is never faster than its uncapped simulation)
        self.recompute_best: dict[int, float] = {}
        for mode, cands in found.results.items():
            for c in cands if mode[0] else ():
                if c.feasible:
                    self.recompute_best[c.P] = min(self.recompute_best.get(c.P, math.inf), c.minibatch_time)

    def bound(self, P: int, split_fixed: bool = True) -> float:
        """Seconds per mini-batch that no row of depth ``P`` can beat, however refined: the least,
        over its simulated candidates, of the search's lower bound for any per-stage recompute and
        caps (``_core.candidate_lower_bound(any_recompute=True)``: each stage's cheaper forward, no
        recompute action; a recomputing stage's forward runs without autograd, so recompute can
        shorten the pipeline's fill) — on
        the candidate's own split where refinement keeps it (``split_fixed``: a feasible candidate
        whose cut-points will not be moved), else over every split (``split_free``). -inf where a
        candidate has no micro-batch table (nothing to bound it with)."""
        out = math.inf
        for mode, i in self.by_depth.get(P, ()):
            c = self.found.results[mode][i]
            if not c.simulated:
                continue
            if c.micro_batch_size not in self.req.sizes:
                return -math.inf
            inp = self.found.searches[mode]
            ti = self.req.sizes.index(c.micro_batch_size)
            if split_fixed and c.feasible and c.starts:
                inp = copy.copy(inp)
                inp.fixed_starts = list(c.starts)
                out = min(out, _core.candidate_lower_bound(inp, c.P, c.D, ti, any_recompute=True))
            else:
                out = min(out, _core.candidate_lower_bound(inp, c.P, c.D, ti, split_free=True, any_recompute=True))
        return out

    def as_searched(self, c, mode: Mode, bound: float, best: float) -> PlanRow:
        """Candidate ``c`` (depth ``c.P``) as the search simulated it — one recompute setting on every
        stage but the last, no caps — marked unrefined, with ``bound`` as its lower bound and why."""
        inp = self.found.searches[mode]
        if not c.feasible:
            row = _row(self.req, c, mode, inp)
            if self.req.limit and self.req.policy == "varuna":
                row.reason += (f"; in-flight caps not tried: no configuration of this depth can beat the best row "
                               f"(lower bound {format_duration(bound)} >= {format_duration(best)} per mini-batch; "
                               f"refining P={c.P} tries them: Plan.refine({c.P}), `varuna plan --refine {c.P}`)")
            row.refined, row.lower_bound_s = False, bound
            return row
        P = c.P
        flags = [mode[0] and s < P - 1 for s in range(P)]
        # without a limit its memory whatever the timing (uncapped: up to all m in flight), as a
        # refined row says it; under one the simulated peak the search fitted (a refinement caps it)
        memory = list(c.stage_memory)
        if not self.req.limit:
            memory = memory_bounds(stage_memories(inp, c, self.req.sizes.index(c.micro_batch_size)), flags, [0] * P,
                                   [max(1, x) for x in c.peak_live], c.m, c.stage_memory[P - 1])
        tail = (f" (as searched, uncapped{'; memory as simulated' if self.req.limit else ''}): not refined per "
                f"stage, since no refinement of this depth can beat the "
                f"best row (lower bound {format_duration(bound)} >= {format_duration(best)} per mini-batch); "
                f"Plan.refine({P}) (`varuna plan --refine {P}`) refines it")
        said = {f: ("recomputes" if f else "keeps activations") + tail for f in (False, True)}
        why = [said[f] for f in flags]
        row = _row(self.req, c, mode, inp, StagePlan(c, flags, [0] * P, memory, why))
        row.refined, row.lower_bound_s = False, bound
        return row

    def refine(self, P: int) -> PlanRow:
        """The row of depth ``P``: rescued with caps where that helps, the fastest mode's candidate,
        its split moved while simulated faster where it is one of the ``REFINED_DEPTHS`` fastest
        as searched (``req.refine_cuts``, within the budget), refined per stage."""
        if P in self.done:   # refined once (a copy of the plan asking again): the same figures
            return copy.deepcopy(self.done[P])
        cuts = self.cuts.get(P, False)
        req, found = self.req, self.found
        plans = self._rescue(P)
        mine = {mode: [found.results[mode][i] for m2, i in self.by_depth[P] if m2 == mode] for mode in found.results}
        c, mode = _per_depth({k: v for k, v in mine.items() if v})[0]
        sp = plans.get(mode)
        if req.refine_cuts and cuts and sp is None and self.budget > 0 and c.feasible and \
                c.micro_batch_size in req.sizes:
            c, spent = better_split(found.searches[mode], c, req.sizes.index(c.micro_batch_size),
                                    req.profile.num_segments, self.budget)
            self.budget -= spent
        row = _row(req, c, mode, found.searches[mode], sp)
        self.done[P] = copy.deepcopy(row)
        return row

    def _rescue(self, P: int) -> dict[Mode, StagePlan]:
        """Varuna without recompute under a memory limit: each simulated candidate of depth ``P``
        the search excluded for memory (its uncapped peaks) re-simulated with the in-flight caps that
        fit; one that then fits replaces it in ``found.results``. Returns the ``StagePlan`` per mode."""
        req, found = self.req, self.found
        plans: dict[Mode, StagePlan] = {}
        if req.policy != "varuna" or not req.limit:
            return plans
        for mode, i in self.by_depth.get(P, ()):
            c = found.results[mode][i]
            if mode[0] or c.feasible or not c.simulated or not c.micro_batch_size or \
                    c.micro_batch_size not in req.sizes:
                continue
            inp = found.searches[mode]
            ti = req.sizes.index(c.micro_batch_size)
            if not c.starts:  # no split fit the search's uncapped in-flight bounds: split without the limit
                free = copy.copy(inp)
                free.memory_limit = 0.0
                c = _core.evaluate(free, c.P, c.D, ti)
                if not c.starts or not c.peak_live:
                    continue
            if c.minibatch_time >= self.recompute_best.get(P, math.inf):
                continue
            sp = refine(inp, c, ti, limit=req.limit, recompute=False, auto=req.auto_recompute,
                        ceiling=req.max_in_flight or 0)
            if sp is None and not req.boundaries:
                sp = _memory_balanced(req, inp, c, ti)
            if sp is not None:
                found.results[mode][i] = sp.candidate
                plans[mode] = sp
        return plans


def _memory_balanced(req: PlanRequest, inp, c, ti: int) -> StagePlan | None:
    """Candidate ``c``'s depth on the split that balances memory at one live graph per stage
    (``memory_balanced_starts``), simulated without the limit for its peaks and refined with the caps
    that fit; None when that does not fit either (or is the split already tried)."""
    starts = memory_balanced_starts(inp, ti, c.P)
    if starts is None or list(starts) == list(c.starts):
        return None
    free = copy.copy(inp)
    free.memory_limit = 0.0
    free.fixed_starts = starts
    m = _core.evaluate(free, c.P, c.D, ti)
    if not m.starts or not m.peak_live:
        return None
    return refine(inp, m, ti, limit=req.limit, recompute=False, auto=req.auto_recompute,
                  ceiling=req.max_in_flight or 0)


def _stage_plan(req: PlanRequest, c, mode: Mode, inp) -> StagePlan:
    """Recompute per stage, in-flight caps and memory bounds of a feasible candidate (Varuna:
    ``refine``, else as searched; GPipe and 1F1B: the searched setting on every stage but the
    last, no caps)."""
    rec, P = mode[0], c.P
    flags = [rec and s < P - 1 for s in range(P)]
    if req.policy == "varuna":
        sp = refine(inp, c, req.sizes.index(c.micro_batch_size), limit=req.limit, recompute=rec,
                    auto=req.auto_recompute, ceiling=req.max_in_flight or 0)
        if sp is not None:
            return sp
        if req.max_in_flight:  # the user's ceiling still holds, simulated as asked
            caps = with_ceiling([0] * P, req.max_in_flight, c.m)
            capped = evaluate_with(inp, c, req.sizes.index(c.micro_batch_size), flags, caps)
            return StagePlan(capped, flags, caps, list(capped.stage_memory),
                             [f"no in-flight cap fits the memory limit: max_in_flight={req.max_in_flight} asked"] * P)
        why = ["no in-flight cap fits the memory limit: as searched, uncapped"] * P
    else:
        why = [("recomputes" if f else "keeps activations") + f" ({req.policy}: one setting for every stage)"
               for f in flags]
    return StagePlan(c, flags, [0] * P, list(c.stage_memory), why)


def _row(req: PlanRequest, c, mode: Mode, inp, sp: StagePlan | None = None) -> PlanRow:
    """The candidate ``c`` of search input ``inp`` (mode ``(recompute, split)``; ``sp``: its stage
    plan when already refined) as a ``PlanRow``, priced with ``req.prices``."""
    split = mode[1]
    if c.feasible and sp is None:
        sp = _stage_plan(req, c, mode, inp)
    if sp is not None:
        c = sp.candidate
        # the bound (cap, or all m, in flight) whatever the timing, never below what was simulated
        memory = [max(x, b) for x, b in zip(c.stage_memory, sp.memory)]
    else:
        memory = list(c.stage_memory)
    n, prices, target = req.profile.num_segments, req.prices, req.target_examples
    stages = []
    if c.starts:
        ends = list(c.starts[1:]) + [n]
        stages = [list(range(a, b)) for a, b in zip(c.starts, ends)]
    eps = req.global_batch / c.minibatch_time if c.feasible and c.minibatch_time > 0 else 0.0
    row = PlanRow(P=c.P, D=c.D, micro_batch_size=c.micro_batch_size, m=c.m, idle_gpus=c.idle_gpus, stages=stages,
                  time_s=c.minibatch_time if c.feasible else math.nan, examples_per_s=eps,
                  bubble_fraction=c.bubble_fraction, stage_memory_bytes=memory or [0.0],
                  feasible=c.feasible, reason="" if c.feasible else _reason(c, inp, req.sizes),
                  pruned=not c.simulated, lower_bound_s=math.nan if c.simulated else c.minibatch_time,
                  split_backward=split and c.feasible,
                  stage_recompute=sp.recompute if sp else [], max_in_flight=sp.max_in_flight if sp else [],
                  recompute_why=sp.why if sp else [], data_wait_s=c.data_wait if c.feasible else 0.0)
    if c.feasible and eps > 0:
        used = c.P * c.D
        hours_per_1k = 1000.0 / eps / 3600.0
        row.cost_per_1k_spot = hours_per_1k * used * prices.spot_per_gpu_hour
        row.cost_per_1k_on_demand = hours_per_1k * used * prices.on_demand_per_gpu_hour
        if target:
            row.time_to_target_s = target / eps
            row.cost_to_target_spot = row.time_to_target_s / 3600.0 * used * prices.spot_per_gpu_hour
    return row


def plan_notes(req: PlanRequest, rows: list[PlanRow]) -> list[str]:
    """The notes under the table: micro-batch sizes extrapolated beyond the profile (when a feasible
    row uses one; ``Plan.table`` shows it only when a row it prints does), and why the best row
    leaves GPUs idle."""
    profile, n = req.profile, req.profile.num_segments
    notes = []
    limit = max(profile.micro_batch_sizes, default=0)
    if limit and any(r.feasible and r.micro_batch_size > limit for r in rows):   # (the table shows feasible rows only)
        notes.append(extrapolation_note(limit))
    best = next((r for r in rows if r.feasible), None)
    if best is not None and best.idle_gpus > 0:
        bnd, max_depth = req.boundaries, req.max_depth
        limits = ([f"boundaries fix P={len(bnd)}"] if bnd is not None else []) + \
            ([f"max_depth={max_depth}"] if bnd is None and (max_depth or n) < min(req.gpus, n) else [])
        notes.append(_idle_note(best, req.gpus, req.global_batch, req.replicas, limits))
    if best is not None and best.data_wait_s > DATA_NOTE_SHARE * best.time_s:
        notes.append(_data_note(best, req))
    return notes


#: Share of the best row's time spent waiting for data above which the plan says so.
DATA_NOTE_SHARE = 0.05


def _data_note(best: PlanRow, req: PlanRequest) -> str:
    """Why the best row waits for its data, and what would shorten the wait."""
    per = req.profile.data_read_s
    n = req.global_batch // best.D
    read = per * n
    head = (f"reading the data bounds the best row: each rank reads its replica's {n} examples per mini-batch "
            f"({format_duration(per)} each, {format_duration(read)})")
    if req.data_prefetch:
        how = (f", longer than the {format_duration(best.time_s - best.data_wait_s)} of compute it overlaps, so "
               f"{format_duration(best.data_wait_s)} of each {format_duration(best.time_s)} mini-batch waits for it")
    elif req.profile.data_draws_random:
        how = (f" before it computes: reading draws from the global {' and '.join(req.profile.data_draws_random)} "
               "random generator (a random transform in __getitem__?), so the batches are read on the main thread, "
               f"not ahead; {format_duration(best.data_wait_s)} of each {format_duration(best.time_s)} mini-batch. "
               "A torch.Generator of the dataset's own (seeded from the index) lets data.prefetch read ahead")
    else:
        how = (f" before it computes (data.prefetch is off), {format_duration(best.data_wait_s)} of each "
               f"{format_duration(best.time_s)} mini-batch; data.prefetch: true overlaps it with the previous one")
    more = " or more replicas (each reads fewer examples)" if req.gpus // best.P > best.D else ""
    return head + how + f"; a faster dataset __getitem__ (decode once and cache, or keep the examples in memory){more} " \
        "shortens it"


def _stages(P: int) -> str:
    return f"{P} stage" if P == 1 else f"{P} stages"


def _two_sizes(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` bytes as ``_bytes`` prints them, with more digits when they would print alike."""
    x, y = format_bytes(a), format_bytes(b)
    return (x, y) if x != y else (format_bytes(a, 3), format_bytes(b, 3))


def _least_split_memory(inp, P: int, D: int, ti: int) -> float:
    """The smallest per-GPU memory limit (bytes, to 0.01 %) under which the search finds a split
    into P stages for replica count D and micro-batch table ``ti``: a bisection on
    ``inp.memory_limit`` with the search's own memory-aware split (``candidate_lower_bound`` is
    inf exactly when no split fits). ``inp`` is left as it was; NaN if even 2**200 x fails."""
    limit = inp.memory_limit

    def fits(x: float) -> bool:
        inp.memory_limit = x
        return math.isfinite(_core.candidate_lower_bound(inp, P, D, ti))

    try:
        lo, hi = limit, 2.0 * limit
        for _ in range(200):
            if fits(hi):
                break
            lo, hi = hi, 2.0 * hi
        else:
            return math.nan
        while hi - lo > 1e-4 * hi:
            mid = 0.5 * (lo + hi)
            if fits(mid):
                hi = mid
            else:
                lo = mid
        return hi
    finally:
        inp.memory_limit = limit


def _reason(c, inp, sizes: list[int]) -> str:
    """Why the infeasible candidate ``c`` cannot run, in bytes the user can act on: the memory
    limit and the least a split into c.P stages needs (or the stage over the limit), else the
    search's own reason (no micro-batch size divides the replica batch)."""
    if not c.simulated:
        return (f"pruned by the best-only search: its candidates need at least {format_duration(c.minibatch_time)} per "
                f"mini-batch (a lower bound), at least the best row's time; neither simulated nor checked against "
                f"memory {EXHAUSTIVE_HINT}")
    limit = inp.memory_limit
    if limit > 0 and c.micro_batch_size and not c.starts:
        need = _least_split_memory(inp, c.P, c.D, sizes.index(c.micro_batch_size))
        a, b = _two_sizes(need, limit)
        return (f"no split into {_stages(c.P)} fits the memory limit of {b} per GPU: the best needs at least {a} "
                f"(micro-batch {c.micro_batch_size}, m={c.m})")
    over = [s for s, mem in enumerate(c.stage_memory) if mem > limit] if limit > 0 else []
    if over:
        s = over[0]
        a, b = _two_sizes(c.stage_memory[s], limit)
        return (f"stage {s} of the split into {_stages(c.P)} needs {a} per GPU, over the memory limit of {b} "
                f"(micro-batch {c.micro_batch_size}, m={c.m})")
    if not c.micro_batch_size:  # no size divides the replica batch (only with the user's sizes: 1 always does)
        return f"{c.reason} (micro-batch sizes tried: {sizes})"
    return c.reason


def _idle_note(best: PlanRow, G: int, B: int, replicas: int | None, limits: list[str]) -> str:
    """Why the best row leaves GPUs idle: a fixed D, fewer replicas simulating faster, or a G/P that
    does not divide the batch (or a P that does not divide G). ``limits``: the user's other
    restrictions of the search (boundaries, max_depth), named in the note."""
    P, D = best.P, best.D
    head = f"the best configuration uses P x D = {P * D} of the {G} GPUs ({best.idle_gpus} idle) because "
    among = f" ({' and '.join(limits)})" if limits else ""
    if replicas is not None:
        return head + f"replicas={replicas} is fixed{among}; pass replicas=None to let the planner choose D"
    top = G // P
    dmax = largest_divisor(B, top)
    if D < dmax:
        return head + (f"fewer replicas are faster as simulated: P={P} with D={dmax} replicas ({P * dmax} GPUs) is "
                       f"no faster than with D={D} (the extra replicas' all-reduce and shared compute cost more than "
                       "they give)")
    why = []
    if dmax < top:
        why.append(f"D = G/P = {top} does not divide the global batch {B} (the largest D <= {top} that does is {dmax})")
    if G % P:
        why.append(f"P={P} does not divide G={G}")
    return head + " and ".join(why) + f"; no configuration {'tried ' if limits else ''}that uses all {G} GPUs is " \
        f"faster{among}"

