"""Cut-point refinement: the search's split of a depth, moved one cut-point at a time while the
simulator predicts a shorter mini-batch.

The search splits the model by balancing the stages' compute (``balance`` in ``csrc/search.cpp``):
right when many micro-batches keep every stage busy, not when few do or the network is slow —
then what crosses a cut-point (a CNN's early activations are large, its late ones small) and the
first and last stages' bubble decide. Here each cut-point of a feasible candidate is moved one
segment earlier or later, the split simulated whole (``evaluate`` with the split fixed: compute,
communication, memory), and a move kept when it is predicted at least ``MIN_GAIN`` faster, until
no move is (paper §4: the simulator as the judge of configurations). The moves cost a share of
what the search itself simulated (``planner.search.REFINE_SHARE``), so planning stays about as fast.

Owns ``better_split``. Imports ``_native`` only; never imports the profiler, the cluster or the
manager.
"""

from __future__ import annotations

import copy

from .._native import core as _core

#: the smallest predicted gain (fraction of the mini-batch time) for which a cut-point moves
MIN_GAIN = 1e-3
#: the most rounds of moves (each tries every cut-point one segment either way)
MAX_ROUNDS = 8


def better_split(inp, c, ti: int, num_segments: int, budget: float = float("inf")) -> tuple:
    """The fastest split found from candidate ``c`` (its ``starts``: the first segment of each
    stage) of search input ``inp`` at micro-batch table ``ti``, and the simulated actions spent:
    ``c`` itself when no move of one cut-point by one segment is predicted ``MIN_GAIN`` faster and
    feasible (memory included), else the candidate of the best split reached. Splits ``inp`` fixes,
    forbidden starts (cut-points that cannot be split) and a depth of 1 are left alone. Stops
    within ``budget`` simulated actions (each simulation of P stages × m micro-batches counts
    3·P·m: forward, backward and a recompute or weight-gradient action), after at most
    ``MAX_ROUNDS`` rounds of 2(P-1) moves."""
    if inp.fixed_starts or not c.feasible or c.P < 2 or not c.starts:
        return c, 0.0
    forbidden = set(inp.forbidden_starts)
    cost = 3.0 * c.P * c.m
    trial = copy.copy(inp)
    best, spent = c, 0.0
    for _ in range(MAX_ROUNDS):
        moved = None
        for s in range(1, c.P):
            for step in (-1, 1):
                starts = list(best.starts)
                starts[s] += step
                upper = starts[s + 1] if s + 1 < c.P else num_segments
                if not starts[s - 1] < starts[s] < upper or starts[s] in forbidden:
                    continue
                if spent + cost > budget:
                    return (moved or best), spent
                trial.fixed_starts = starts
                cand = _core.evaluate(trial, c.P, c.D, ti)
                spent += cost
                if cand.feasible and cand.minibatch_time < best.minibatch_time * (1 - MIN_GAIN) and \
                        cand.minibatch_time < (moved or best).minibatch_time:
                    moved = cand
        if moved is None:
            return best, spent
        best = moved
    return best, spent
