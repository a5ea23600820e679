"""The morph manager's decisions as small pure functions (paper §4.2, §4.6): how many worker
slots a pool offers, whether growing onto returned VMs is worth a morph, which workers are
stragglers, how many steps a morph lost. No processes, sockets or clocks here — the state
machine in ``manager.manager`` feeds these with what it observed, so every rule is testable
with plain numbers.

Owns ``worker_slots``, ``GrowRule``, ``StragglerRule``, ``find_stragglers``, ``steps_lost``.
Imports ``cluster.hosts`` only; never torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ..cluster.hosts import Host


def worker_slots(host: Host) -> int:
    """Workers one VM runs: one per GPU, or one on a CPU-only VM (``gpus == 0``)."""
    return max(1, int(host.gpus))


def pool_slots(hosts: Iterable[Host]) -> int:
    """Total worker slots of a pool of VMs (``worker_slots`` summed)."""
    return sum(worker_slots(h) for h in hosts)


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
                 seconds_since_last_morph: float) -> bool:
        """True when the new plan is ``min_gain`` x faster and the cooldown has passed."""
        if seconds_since_last_morph < self.cooldown_s:
            return False
        if not current_examples_per_s > 0.0:
            return new_examples_per_s > 0.0
        return new_examples_per_s >= self.min_gain * current_examples_per_s


@dataclass(frozen=True)
class StragglerRule:
    """A worker is a straggler (fail-stutter, paper §4.6) when its compute per micro-batch,
    relative to what the plan predicted for its stage, is ``factor`` x the median of all
    other workers' ratios in each of its last ``beats`` heartbeats. Comparing against the prediction
    (not only same-stage peers) makes the rule work with D = 1 too."""

    factor: float = 1.5
    beats: int = 3

    def __post_init__(self):
        if not self.factor > 1.0:
            raise ValueError(f"StragglerRule.factor={self.factor} must be > 1 (1.5 = 50% slower than peers)")
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


def steps_lost(last_step_done: int | None, resume_step: int) -> int:
    """Optimizer steps trained but not in the checkpoint the job resumes from: with a notice 0
    (the checkpoint is taken at the boundary), after a sudden loss at most the checkpoint
    interval. ``last_step_done``: index of the last finished step (None: none yet);
    ``resume_step``: the number of steps the checkpoint holds (the next step's index)."""
    if last_step_done is None:
        return 0
    return max(0, int(last_step_done) + 1 - int(resume_step))


__all__ = ["worker_slots", "pool_slots", "GrowRule", "StragglerRule", "find_stragglers", "steps_lost"]
