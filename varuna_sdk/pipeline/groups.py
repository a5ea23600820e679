"""Rank layout and process groups of a P × D job.

Owns ``Topology`` (rank ↔ (stage, replica): ``rank = replica · P + stage``, so one replica's
stages are neighbours) and ``build_groups``: every rank creates the same groups in the same
order (a torch.distributed requirement): one two-rank group per direction per adjacent stage
pair, one data-parallel group per stage (its D replicas), one group per set of stages that hold
a tied parameter (all of their replicas), and the world for the per-step consensus.
Paper §6 (one group for replica all-reduce, one for shared state). Never imports ``cluster``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """P stages × D replicas; ``rank = replica * P + stage``."""

    P: int
    D: int

    @property
    def world_size(self) -> int:
        """P × D: the number of ranks."""
        return self.P * self.D

    def rank(self, stage: int, replica: int) -> int:
        """The global rank of ``stage`` in ``replica``."""
        return replica * self.P + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``; raises ``ValueError`` outside the world."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} (P={self.P} × D={self.D})")
        return rank % self.P, rank // self.P


@dataclass
class Groups:
    """The process groups one rank uses (``None`` where a group is not needed)."""

    act_send: Any = None  # to stage+1
    act_recv: Any = None  # from stage-1
    grad_send: Any = None  # to stage-1
    grad_recv: Any = None  # from stage+1
    dp: Any = None
    tied: dict[tuple[int, ...], Any] = field(default_factory=dict)  # stages -> group


def build_groups(topo: Topology, rank: int, tied_stage_sets: Iterable[tuple[int, ...]]) -> Groups:
    """Create every group of the job (collectively, on every rank) and return this rank's.

    Requires ``torch.distributed`` to be initialised with ``world_size == P × D`` when the
    world has more than one rank; for a single rank returns empty ``Groups``.
    """
    g = Groups()
    if topo.world_size == 1:
        return g
    if dist.get_world_size() != topo.world_size:
        raise RuntimeError(
            f"torch.distributed world has {dist.get_world_size()} ranks but P={topo.P} × D={topo.D} "
            f"needs {topo.world_size}"
        )
    stage, replica = topo.coords(rank)
    for d in range(topo.D):
        for s in range(topo.P - 1):
            a, b = topo.rank(s, d), topo.rank(s + 1, d)
            fwd = dist.new_group([a, b])
            bwd = dist.new_group([a, b])
            if d == replica and s == stage:
                g.act_send, g.grad_recv = fwd, bwd
            if d == replica and s + 1 == stage:
                g.act_recv, g.grad_send = fwd, bwd
    if topo.D > 1:
        for s in range(topo.P):
            grp = dist.new_group([topo.rank(s, d) for d in range(topo.D)])
            if s == stage:
                g.dp = grp
    for stages in sorted(set(tuple(sorted(s)) for s in tied_stage_sets)):
        ranks = sorted(topo.rank(s, d) for s in stages for d in range(topo.D))
        grp = dist.new_group(ranks)
        if stage in stages:
            g.tied[stages] = grp
    return g
