"""Gradient synchronisation of one stage, overlapped with its last backward (as DDP does).

Owns ``GradSync``: the stage's data-parallel gradients in buckets of about ``bucket_bytes``
(parameters of the last segments first: their gradients are final first), each all-reduced
asynchronously over the stage's replica group as soon as every gradient in it is final, in bucket
order (every replica issues the same collectives in the same order, whatever order its gradients
finish in); a tied weight's sum over its stages' group starts as soon as its gradients are final
too. A gradient is final during the stage's last gradient-producing action of the step — the
last B, or with the split backward the last W — which ``arm()`` announces; ``ready(p)`` is then
called per parameter (an autograd post-accumulate hook, or the split backward's W). ``finish()``
launches whatever is left, waits, and writes the mean over replicas back into ``.grad``
(unscaled for fp16). A parameter no micro-batch of any replica reached keeps ``.grad = None``,
as in plain PyTorch (AdamW skips it); one reached on some replicas only gets zeros on the others
(as DDP does), so the mean is the whole mini-batch's gradient. Paper §6; the
original all-reduced after the whole backward, in one fp16 bucket (varuna-original.md §8).

Must never import anything above ``pipeline``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 4 << 20


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: Any                      # process group, or None (nothing to reduce: D = 1)
    pending: set[int] = field(default_factory=set)
    flat: torch.Tensor | None = None
    work: Any = None


class GradSync:
    """Bucketed all-reduce of one stage's gradients, overlapped with its last backward.

    Args:
        buckets_of: ``[(group, [parameters])]`` — the stage's data-parallel parameters (group:
            the replica group, or ``None`` when D = 1) and each tied-weight set (its group over
            the stages sharing it), in launch order. Every parameter ``ready`` is told about
            must be in one of them.
        split: per entry of ``buckets_of``, whether it is cut into buckets of ``bucket_bytes``
            (the data-parallel parameters) or reduced in one collective (a tied set).
        bucket_bytes: data-parallel bucket size (bytes).

    ``launched`` counts collectives started before ``finish`` (the overlap; tests read it).
    """

    def __init__(self, buckets_of: Sequence[tuple[Any, list[nn.Parameter]]], split: Sequence[bool],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.buckets: list[_Bucket] = []
        for k, (group, params) in enumerate(buckets_of):
            chunk: list[nn.Parameter] = []
            size = 0
            splittable = split[k]
            for p in params:
                chunk.append(p)
                size += p.numel() * p.element_size()
                if splittable and size >= bucket_bytes:
                    self.buckets.append(_Bucket(chunk, group))
                    chunk, size = [], 0
            if chunk:
                self.buckets.append(_Bucket(chunk, group))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._armed = False
        self._next = 0  # first bucket not launched (buckets launch in order)
        self.launched = 0

    def arm(self) -> None:
        """The stage's last gradient-producing action starts: gradients turn final from now
        (called once per step, before ``finish``)."""
        self._armed = True
        for b in self.buckets:
            b.pending = {id(p) for p in b.params}

    def ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final (ignored before ``arm()``); ``p`` is one of the parameters
        given to the constructor."""
        if not self._armed:
            return
        self.buckets[self._bucket_of[id(p)]].pending.discard(id(p))
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])
            self._next += 1
            self.launched += 1

    @staticmethod
    def _launch(b: _Bucket) -> None:
        if b.group is None:
            return
        # one "has a gradient" flag per parameter rides along: a parameter no replica's forward
        # used keeps a None gradient after the reduction, as in plain PyTorch (AdamW then skips
        # it: no weight decay, no moment update); one used by some replica gets zeros elsewhere
        dtype = next((p.grad.dtype for p in b.params if p.grad is not None), b.params[0].dtype)
        used = torch.tensor([float(p.grad is not None) for p in b.params], dtype=dtype, device=b.params[0].device)
        b.flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p, dtype=dtype)).reshape(-1)
                            for p in b.params] + [used])
        b.work = dist.all_reduce(b.flat, group=b.group, async_op=True)

    def finish(self, scale: float) -> None:
        """Launch what is left, wait for every collective, write the reduced gradients times
        ``scale`` (e.g. 1 / (loss scale × D)) back into ``.grad``; ready for the next step."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for b in self.buckets:
            if b.work is None:  # nothing to reduce: scale in place
                grads = [p.grad for p in b.params if p.grad is not None]
                if scale != 1.0 and grads:
                    torch._foreach_mul_(grads, scale)
                continue
            b.work.wait()
            used = (b.flat[-len(b.params):] > 0).tolist()
            b.flat.mul_(scale)
            off = 0
            for p, u in zip(b.params, used):
                if not u:
                    p.grad = None
                elif p.grad is None:
                    p.grad = b.flat[off:off + p.numel()].view_as(p).clone()
                else:
                    p.grad.copy_(b.flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            b.flat, b.work = None, None
        self._armed = False
        self._next = 0
