"""Running statistics (BatchNorm, InstanceNorm with ``track_running_stats``) merged across the D
replicas of a stage, so that the model after a step is the one plain PyTorch trains on the whole
mini-batch.

With D replicas each replica's normalisation layers update their running mean and variance
from their own micro-batches only; the gradients are all-reduced, but the buffers are not, and a
checkpoint keeps one replica's. Plain PyTorch updates them over every micro-batch of the
mini-batch, in order: replica 0's micro-batches, then replica 1's, ... The update is linear in
the running value, so each replica's share can be computed from where it started and where it
ended, and one all-reduce over the stage's replica group gives exactly the sequential result
(to float rounding):

- momentum ``a`` (exponential average; ``n`` updates per replica in the step, counted by
  ``num_batches_tracked``): ``x = (1-a)^(D n) x0 + sum_r (1-a)^(n (D-1-r)) (x_r - (1-a)^n x0)``;
- momentum ``None`` (cumulative average over ``n0`` earlier updates):
  ``x = (n0 x0 + sum_r ((n0 + n) x_r - n0 x0)) / (n0 + D n)``;
- ``num_batches_tracked = n0 + D n``.

Owns ``RunningStats``. Imports only torch; never imports anything above ``pipeline``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


class RunningStats:
    """The stage's normalisation layers that keep running statistics (on its device), merged
    across its ``D`` replicas after each training step (``replica``: this rank's index in the
    stage's replica ``group``). ``begin()`` before the step's forwards, ``merge()`` after them;
    a no-op at D = 1 or without such layers."""

    def __init__(self, model: nn.Module, replica: int, D: int, group: Any = None):
        self.layers = [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats
                       and m.running_mean is not None and m.running_mean.device.type != "meta"]
        self.replica, self.D, self.group = replica, D, group
        self._start: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    @property
    def active(self) -> bool:
        """Whether there is anything to merge (D > 1 and such layers on this stage)."""
        return self.D > 1 and bool(self.layers)

    def begin(self) -> None:
        """Note each layer's running mean, variance and update count before the step."""
        if self.active:
            self._start = [(m.running_mean.detach().clone(), m.running_var.detach().clone(),
                            int(m.num_batches_tracked)) for m in self.layers]

    @torch.no_grad()
    def merge(self) -> None:
        """Replace each layer's statistics by those of every replica's micro-batches in order
        (one all-reduce of this rank's shares, float32 or the buffers' dtype)."""
        if not self.active or not self._start:
            return
        shares, counts = [], []
        for m, (mean0, var0, n0) in zip(self.layers, self._start):
            n = int(m.num_batches_tracked) - n0
            counts.append(n)
            for x, x0 in ((m.running_mean, mean0), (m.running_var, var0)):
                shares.append(self._share(m.momentum, x, x0, n0, n).reshape(-1))
        flat = torch.cat([s.to(torch.float64) for s in shares])
        dist.all_reduce(flat, group=self.group)
        off = 0
        for m, (mean0, var0, n0), n in zip(self.layers, self._start, counts):
            for x, x0 in ((m.running_mean, mean0), (m.running_var, var0)):
                k = x.numel()
                x.copy_(self._total(m.momentum, flat[off:off + k].view_as(x), x0, n0, n).to(x.dtype))
                off += k
            m.num_batches_tracked.fill_(n0 + self.D * n)
        self._start = []

    def _share(self, momentum: float | None, x: torch.Tensor, x0: torch.Tensor, n0: int, n: int) -> torch.Tensor:
        """This replica's term of the merged value (see the module docstring)."""
        x, x0 = x.to(torch.float64), x0.to(torch.float64)
        if momentum is None:
            return (n0 + n) * x - n0 * x0
        keep = (1.0 - momentum) ** n
        return (1.0 - momentum) ** (n * (self.D - 1 - self.replica)) * (x - keep * x0)

    def _total(self, momentum: float | None, summed: torch.Tensor, x0: torch.Tensor, n0: int, n: int) -> torch.Tensor:
        x0 = x0.to(torch.float64)
        if momentum is None:
            return (n0 * x0 + summed) / max(1, n0 + self.D * n)
        return (1.0 - momentum) ** (self.D * n) * x0 + summed
