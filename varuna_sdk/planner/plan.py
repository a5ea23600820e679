"""Auto-configuration: from a ``Profile`` and G GPUs to a ranked table of configurations.

Owns ``plan()`` and ``plan_for_job()``, the planner's entry points. ``plan()`` is three steps,
each in its own module: the arguments become a validated ``PlanRequest``
(:mod:`varuna_sdk.planner.request`, every check before any work); the search
(:mod:`varuna_sdk.planner.search`) runs the inner loop in C++ (``csrc/search.cpp``: every
pipeline depth P — not only divisors of the cut-point count —, every replica count D <= G/P that
keeps the global batch exact, every micro-batch size, a cost-balanced memory-aware stage split
and a simulated mini-batch with the runtime's own schedule code; per P the fastest
(D, micro-batch), candidates that a lower bound shows cannot win skipped unsimulated) and turns
its candidates into rows; the result is a ``Plan`` of ``PlanRow``s priced with ``Prices``
(:mod:`varuna_sdk.planner.rows`).
Paper §4.1–4.4, §7.2; varuna-original.md §5.5 (whose AutoConfig could not even be built).

Units: seconds, bytes, examples/s, US dollars. Imports ``config``, ``profiling.profile`` and the
planner's own modules; never imports torch, ``cluster``, ``manager`` or ``trainer``.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Sequence

from ..config import ConfigError, JobConfig, ParallelConfig
from ..profiling.profile import Profile
from .request import PlanRequest, check_boundaries, int_arg, largest_divisor
from .rows import Plan, Prices
from .search import plan_notes, plan_rows, run_search


def plan(
    profile: Profile,
    gpus: int,
    global_batch: int,
    *,
    policy: str = "varuna",
    recompute: bool | None = None,
    memory_limit_bytes: float | None = None,
    gpus_per_vm: int = 1,
    compute_slots_per_vm: int = 0,
    micro_batch_sizes: Sequence[int] | None = None,
    boundaries: list[list[int]] | None = None,
    network_bandwidth_Bps: float | None = None,
    prices: Prices | None = None,
    target_examples: int | None = None,
    max_depth: int | None = None,
    replicas: int | None = None,
    exhaustive: bool = True,
    split_backward: bool | None = None,
    shared_egress: bool = False,
    max_in_flight: int | None = None,
    data_prefetch: bool = True,
    refine_cuts: bool = True,
) -> Plan:
    """Rank every configuration of ``gpus`` GPUs for a fixed ``global_batch`` (paper §4.4).

    One row per pipeline depth P = 1 .. min(gpus, segments): the fastest simulated (D,
    micro-batch size) for that P over every replica count D <= gpus / P dividing the global
    batch (fewer replicas leave GPUs idle — ``idle_gpus`` — and win when the all-reduce or
    shared cores cost more than the extra replicas give) and every micro-batch size that
    divides the replica batch. Ties go to fewer GPUs, then the larger micro-batch.

    Args:
        profile: from ``calibrate()`` (must hold network figures unless gpus == 1).
        gpus: G >= 1, the GPUs (or CPU workers) available (an int).
        global_batch: examples per optimizer step, an int >= 1; never changed (= micro-batch × m × D).
        policy: ``"varuna"``, ``"gpipe"`` or ``"1f1b"``.
        recompute: True, False or None. None (default): for Varuna, per stage — a stage
            recomputes only where keeping its activations does not fit the memory limit (both
            settings are searched, the faster kept per depth, then refined per stage; each row's
            ``stage_recompute``, ``max_in_flight`` and ``recompute_why`` say what and why);
            GPipe and 1F1B: off. Varuna stages that keep activations get an in-flight cap
            (``planner.recompute``).
        memory_limit_bytes: bytes per GPU, a finite number > 0; None (default): the profile's
            device memory if recorded, else no limit. 0 does not mean "no limit" (refused).
        gpus_per_vm, compute_slots_per_vm: placement (ranks sharing a VM, an int >= 1, and how many
            compute actions can run at once there, an int >= 0 — e.g. CPU cores on the testbed;
            0 = one per GPU).
        micro_batch_sizes: a non-empty list of ints >= 1 to try; default every size from 1 to
            twice the largest profiled size that divides ``global_batch``.
        boundaries: explicit segment lists per stage (only that P is evaluated; P x ``replicas``
            must fit ``gpus``, and ``max_depth``, if given, must be >= P).
        network_bandwidth_Bps: what-if, bytes/s > 0: replace the calibrated cross-VM p2p and
            all-reduce bandwidth. None: the calibrated figures.
        prices, target_examples: dollars per GPU-hour (a ``Prices``) and a training target in
            examples (> 0) for time/cost columns.
        max_depth: largest P tried, an int >= 1 (default min(gpus, segments)).
        replicas: a data-parallel width D fixed by the user (must divide ``global_batch`` and be
            <= ``gpus``); only depths P <= gpus / D are offered. Default: chosen per P.
        exhaustive: True (default): every depth's row is its fastest candidate, simulated; the
            cost grows about quadratically in G below the segment count (each depth P simulates a
            pipeline of P stages). A Varuna row is refined per stage (recompute, caps) only where
            it could be the best: a depth whose lower bound for any refinement is no faster than
            the best row keeps the search's candidate (``PlanRow.refined`` False; ``Plan.refine(P)``
            refines it; ``plan_for_job`` does so for a depth the job fixes). False (best only, for re-planning under a morph): candidates of
            all depths are taken best first by lower bound and the search stops when none can
            beat the fastest found, so it costs about linearly in G; the best row is the same,
            other rows are the fastest candidate simulated for their depth (not necessarily its
            fastest), and depths never simulated are excluded as pruned (``PlanRow.pruned``).
            Varuna with ``recompute=None`` under a memory limit always searches exhaustively
            (recompute is chosen per stage after the search; ``Plan.exhaustive`` says so).
        split_backward: the zero-bubble split of the backward (Varuna only; B = input gradient,
            W = weight gradients deferred into waits). None (default): searched both ways where
            the profile holds the split's B and W times, each row taking the faster (its
            ``split_backward`` says which); True: always (the profile must hold them); False:
            never.
        shared_egress: True where each rank's activations and gradients leave it by one network
            link, one message at a time (one rank per VM behind one NIC, as on the namespace
            testbed): the simulator queues a rank's sends to both neighbours on that link
            (``SimConfig.shared_egress``). False (default): each pair of ranks has a link of its own.
        max_in_flight: the user's ceiling (Varuna only, an int >= 1, micro-batches): no stage —
            the last included — holds more micro-batches in flight than this, whatever the
            planner's own caps; each row is simulated with the resulting caps and its
            ``recompute_why`` says where the ceiling binds. None (default): the planner's caps.
        data_prefetch: True (default) where each rank reads the next mini-batch while one trains
            (``data.prefetch``): a row's time is max(its compute, its read); False: their sum.
            The read is the profile's ``data_read_s`` (seconds per example, measured by
            ``profiling.job.calibrate_job`` on the job's own data; 0: not modelled) times the
            replica's ``global_batch / D`` examples, which every rank of a replica reads.
        refine_cuts: True (default): the split of the fastest depths' candidates is then moved a
            cut-point at a time while the simulator predicts a faster mini-batch
            (``planner.cuts.better_split``: the search balances compute; what crosses a cut-point
            and the bubble can favour another split). False: the search's split as it is.

    Raises ``ConfigError`` for bad arguments (each checked before any work, the message saying
    what to pass instead) and ``ProfileError`` naming what the profile lacks.
    """

    req = PlanRequest(profile, gpus, global_batch, policy=policy, recompute=recompute,
                      memory_limit_bytes=memory_limit_bytes, gpus_per_vm=gpus_per_vm,
                      compute_slots_per_vm=compute_slots_per_vm, micro_batch_sizes=micro_batch_sizes,
                      boundaries=boundaries, network_bandwidth_Bps=network_bandwidth_Bps, prices=prices,
                      target_examples=target_examples, max_depth=max_depth, replicas=replicas, exhaustive=exhaustive,
                      split_backward=split_backward, shared_egress=shared_egress, max_in_flight=max_in_flight,
                      data_prefetch=data_prefetch, refine_cuts=refine_cuts)
    t0 = time.perf_counter()
    found = run_search(req)
    rows, refiner = plan_rows(req, found)
    modes = req.split_modes
    base = req.rec_modes[0]  # Plan.simulate overrides recompute per row
    return Plan(gpus=req.gpus, global_batch=req.global_batch, policy=req.policy,
                recompute=None if req.auto_recompute else base, rows=rows,
                prices=req.prices, target_examples=req.target_examples, search_s=time.perf_counter() - t0,
                notes=plan_notes(req, rows), search_stats=found.stats, exhaustive=bool(req.exhaustive),
                split_backward=None if len(modes) == 2 else modes[0],
                _search=found.searches.get((base, False)) or found.searches[(base, True)],
                _search_split=found.searches.get((base, True)), _searches=dict(found.searches),
                _sizes=list(req.sizes), _refiner=refiner, _profiled_max_mbs=max(req.profile.micro_batch_sizes, default=0))


def plan_for_job(job: JobConfig, profile: Profile, gpus: int | None = None, *, gpus_per_vm: int | None = None,
                 compute_slots_per_vm: int | None = None, keep_fixed: bool = True,
                 micro_batch_sizes: Sequence[int] | None = None,
                 exhaustive: bool = True, prices: Prices | None = None,
                 memory_limit_bytes: float | None = None, shared_egress: bool = False) -> tuple[JobConfig, Plan]:
    """Plan ``job`` for ``gpus`` workers (default ``job.launch.gpus``) and return a copy of it
    with ``parallel`` filled in from the best row (P, D, micro-batch size, stage boundaries),
    and the ``Plan``. The global batch and policy are the job's; recompute is the job's when it is
    True or False, else the best row's per-stage choice; the split backward (Varuna) is the job's
    when it is True or False, else the best row's; the row's in-flight caps are set. A job's own
    ``max_in_flight`` given as one int is the user's ceiling: every stage's cap is at most that
    (``plan(max_in_flight=...)``, the rows simulated with it); a per-stage list was a plan's choice
    for its own P and is chosen afresh (as a per-stage recompute list is).

    Placement defaults model local workers: all ``gpus`` on one VM whose compute is shared by
    ``os.cpu_count()`` cores (fewer workers than ``gpus`` may then be fastest: the plan's rows
    weigh every replica count, and the best row's ``idle_gpus`` says how many stay unused); pass
    ``gpus_per_vm``/``compute_slots_per_vm`` for real VMs.
    ``keep_fixed``: a P, D or stage ``boundaries`` the config fixes are kept (only the rest is
    chosen; boundaries fix P and are checked as ``plan(boundaries=...)`` checks them); the manager
    passes False when the GPUs changed under a morph (P, D and boundaries are then all chosen
    afresh). ``exhaustive=False``: a best-only search (``plan``), for what-ifs that need only the
    best row; a fixed P is still searched exhaustively (its row must be exact). ``prices``: the
    pool's $ per GPU-hour for the rows' costs (default ``Prices()``'s example figures).
    ``memory_limit_bytes``: bytes per GPU to plan for (a what-if: "would this job fit a 16 GiB
    card?"), as ``plan`` takes it; None: the profile's device memory. ``shared_egress``: as ``plan``
    takes it (one network link per rank). The memory model counts the job's optimizer's state
    (``optimizer.state_factor``: SGD without momentum keeps none, Adam with amsgrad three copies
    of the parameters). Raises
    ``ConfigError`` for boundaries that do not list the profile's segments once each in order, a
    P that contradicts them, a P x D over the workers, or when no feasible plan has the fixed P/D
    (listing the feasible ones) or none fits at all.
    """
    p = job.parallel
    G = int_arg("gpus" if gpus is not None else "launch.gpus", gpus if gpus is not None else job.launch.gpus, 1,
                 "pass the number of workers to plan for")
    fixed_P = p.P if keep_fixed else None
    fixed_D = p.D if keep_fixed else None
    bnd = p.boundaries if keep_fixed else None
    per_vm = G if gpus_per_vm is None else gpus_per_vm   # 0 is refused by plan(), as there
    slots = compute_slots_per_vm if compute_slots_per_vm is not None else (os.cpu_count() or 1)

    if fixed_D is not None and (fixed_D > G or p.global_batch % fixed_D):
        raise ConfigError(f"parallel.D={fixed_D} does not fit {G} workers and global batch {p.global_batch} (D must "
                          f"divide the global batch and be <= {G}); set D to null or change it")
    if bnd is not None:
        try:
            check_boundaries(bnd, profile.num_segments, G)
        except ConfigError as e:
            raise ConfigError(f"parallel.{e}") from None
        if fixed_P is not None and fixed_P != len(bnd):
            raise ConfigError(f"parallel.P={fixed_P} but parallel.boundaries has {len(bnd)} stages; set P to "
                              f"{len(bnd)} (or null), or boundaries to null to let the planner split the model")
        if fixed_D is not None and len(bnd) * fixed_D > G:
            raise ConfigError(f"parallel.boundaries give P={len(bnd)} stages and parallel.D={fixed_D}: P x D = "
                              f"{len(bnd) * fixed_D} workers but only {G}; set D to at most "
                              f"{largest_divisor(p.global_batch, G // len(bnd))} (or null), or change boundaries")
        fixed_P = len(bnd)
    # the memory model counts the job's optimizer's state (the profile's factor is AdamW's two moments)
    from ..optimizer import state_factor

    profile = copy.copy(profile)
    profile.optimizer_state_factor = state_factor(job)
    # boundaries fix P and the split; a fixed P caps the depths tried; a fixed D is the only replica count tried
    settings = config_settings(p)
    rec = settings["recompute"]
    pl = plan(profile, G, p.global_batch, gpus_per_vm=min(per_vm, G),
              compute_slots_per_vm=slots, max_depth=None if bnd is not None else fixed_P, replicas=fixed_D,
              boundaries=bnd, exhaustive=exhaustive or fixed_P is not None, micro_batch_sizes=micro_batch_sizes,
              prices=prices, memory_limit_bytes=memory_limit_bytes, shared_egress=shared_egress,
              data_prefetch=data_prefetch_for(job, profile), **settings)
    if fixed_P is not None and any(r.P == fixed_P for r in pl.rows):
        pl.refine(fixed_P)  # the job runs this depth: its row refined per stage even when it is not the best
    fits = [r for r in pl.feasible if (fixed_P is None or r.P == fixed_P) and (fixed_D is None or r.D == fixed_D)]
    if not fits:
        free = pl
        if fixed_P is not None or fixed_D is not None or bnd is not None:
            # what these workers can run with nothing fixed (the search above tried the fixed D only,
            # and depths up to the fixed P: its rows alone left out P=2 D=1 for P=2 x D=2 on 2 workers)
            free = plan(profile, G, p.global_batch, gpus_per_vm=min(per_vm, G), compute_slots_per_vm=slots,
                        exhaustive=True, micro_batch_sizes=micro_batch_sizes, prices=prices,
                        memory_limit_bytes=memory_limit_bytes, shared_egress=shared_egress,
                        data_prefetch=data_prefetch_for(job, profile), **settings)
        offered = ", ".join(f"P={r.P} D={r.D}" for r in free.feasible[:8]) or "none"
        if len(free.feasible) > 8:
            offered += f", ... ({len(free.feasible)} in all)"
        fixed = " and ".join(f"{k}={v}" for k, v in (("P", fixed_P), ("D", fixed_D)) if v is not None)
        if bnd is not None:
            fixed += " (from parallel.boundaries)" if p.P is None else " and these boundaries"
        if not fixed:
            raise ConfigError(f"no configuration fits {G} workers and global batch {p.global_batch}: "
                              + "; ".join(f"P={r.P}: {r.reason}" for r in pl.rows[:6]))
        why = [r for r in pl.rows if not r.feasible and (fixed_P is None or r.P == fixed_P)
               and (fixed_D is None or r.D == fixed_D)]
        reasons = "; ".join(dict.fromkeys(f"P={r.P} D={r.D}: {r.reason}" for r in why[:3]))
        raise ConfigError(f"no plan for {G} workers and global batch {p.global_batch} has parallel.{fixed}"
                          f"{' (' + reasons + ')' if reasons else ''}; "
                          f"feasible on {G} workers, each depth's best, fastest first: {offered}. Set P, D and boundaries to null, or "
                          "change them")
    best = fits[0]
    job = copy.deepcopy(job)
    job.parallel.P, job.parallel.D = best.P, best.D
    job.parallel.micro_batch_size = best.micro_batch_size
    job.parallel.boundaries = best.stages
    job.parallel.recompute = list(best.stage_recompute) if rec is None else rec
    job.parallel.max_in_flight = list(best.max_in_flight) if any(best.max_in_flight) else None
    if p.policy == "varuna":   # the schedule the row was simulated (and its caps chosen) with
        job.parallel.split_backward = bool(best.split_backward)
    job.launch.gpus = G
    return job.validate(), pl


def config_settings(p: ParallelConfig, policy: str | None = None) -> dict:
    """``plan()``'s keyword arguments that a job's ``parallel`` section fixes, for ``policy``
    (default the section's): ``policy``; ``recompute`` True/False as set (a per-stage list was an
    earlier plan's choice for its own P: None, chosen per stage again); ``split_backward`` as set
    (Varuna only; None: the planner's choice per row); ``max_in_flight`` one int >= 1 as the user's
    ceiling on every stage (0, None or a per-stage list: the planner's caps). Raises
    ``ConfigError`` for a cap that is not an integer >= 0 (checked, so that a bad value is refused,
    not read as "no ceiling")."""
    policy = policy or p.policy
    caps = p.max_in_flight
    p.stage_caps(len(caps) if isinstance(caps, list) and caps else 1)
    return dict(policy=policy, recompute=p.recompute if isinstance(p.recompute, bool) else None,
                split_backward=p.split_backward if policy == "varuna" else None,
                max_in_flight=caps if isinstance(caps, int) and not isinstance(caps, bool) and caps > 0 else None)


def data_prefetch_for(job: JobConfig, profile: Profile) -> bool:
    """Whether the job's ranks will read each batch ahead (``plan(data_prefetch=...)``):
    ``data.prefetch``, unless the calibration saw the data's reads draw from a global random
    generator (``Profile.data_draws_random``), for which the runtime turns prefetching off."""
    return bool(job.data.prefetch) and not profile.data_draws_random


__all__ = ["plan_for_job", "plan", "data_prefetch_for"]
