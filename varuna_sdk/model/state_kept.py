"""State a forward updates in place — BatchNorm's running statistics and ``num_batches_tracked``,
a user's EMA buffer — kept from being updated twice when a forward is run again.

A forward run only to measure or rebuild something (the dry run on meta that traces the model,
the recompute (R) of a stage that dropped its activations, paper §3.3) must not count as a
second forward: plain PyTorch runs each micro-batch's forward once, so its running statistics
see each micro-batch once. ``restored`` puts back, after a block, the values of the given
tensors that the block changed in place (the dry run); ``InPlaceUpdates`` learns which of a
stage's buffers its forward updates, and runs a recompute on copies of those.

Imports only torch; must never import anything above ``model``.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn


@contextlib.contextmanager
def restored(tensors: Iterable[torch.Tensor], always: bool = False) -> Iterator[None]:
    """Within the block the tensors may change in place; afterwards each one changed is copied
    back to its value before the block (meta tensors, which hold no values, are skipped). A tensor
    is copied back when its version counter moved — or always, with ``always=True``, for kernels
    that write without moving it (BatchNorm's running statistics)."""
    saved = [(t, t._version, t.detach().clone()) for t in tensors if t.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, version, value in saved:
                if always or t._version != version:
                    t.copy_(value)


class InPlaceUpdates:
    """Which of a stage's own buffers (those of ``model`` on a real device) its forward updates in
    place, and a recompute that sees them as its forward did and leaves them as they are.

    ``with updates.watch() as before: forward()`` adds the buffers it changed to ``updated``: the
    first watched forward compares every buffer's values (a BatchNorm kernel writes its running
    mean and variance without moving their version counters), later ones the version counters
    only; ``before`` then holds the updated buffers' values as the forward found them (``{id:
    tensor}``). ``with updates.kept(before): forward_again()`` runs the block on copies of those
    values (of the current ones without ``before``), put in their modules for the block and taken
    out after it: the originals are never written, so the graph the block builds (which may have
    saved a copy, as BatchNorm's backward does) stays valid, and a forward that reads what it
    updates (a user's running mean subtracted from its input) recomputes what it computed, not what
    later micro-batches' updates left.
    """

    def __init__(self, model: nn.Module):
        self.slots = [(mod, name, b) for mod in model.modules() for name, b in mod._buffers.items()
                      if b is not None and b.device.type != "meta"]
        self.updated: set[int] = set()   # ids of updated buffers
        self._compared = False

    @contextlib.contextmanager
    def watch(self) -> Iterator[dict[int, torch.Tensor]]:
        """Within the block, note which buffers change in place (added to ``updated``); yields a
        dict filled after the block with those buffers' values from before it."""
        buffers = list({id(b): b for _, _, b in self.slots}.values())
        before = [b._version for b in buffers]
        values = [b.detach().clone() if not self._compared or id(b) in self.updated else None for b in buffers]
        found: dict[int, torch.Tensor] = {}
        try:
            yield found
        finally:
            for k, b in enumerate(buffers):
                if b._version != before[k] or (not self._compared and not torch.equal(b, values[k])):
                    self.updated.add(id(b))
                if id(b) in self.updated and values[k] is not None:
                    found[id(b)] = values[k]
            self._compared = True

    @contextlib.contextmanager
    def kept(self, before: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
        """Within the block the updated buffers are copies (one per tensor, shared where the
        tensor is) of their values in ``before`` (``watch``'s), else of their current values;
        afterwards the modules hold their original buffers again."""
        copies: dict[int, torch.Tensor] = {}
        swapped = []
        before = before or {}
        for mod, name, b in self.slots:
            if id(b) in self.updated:
                mod._buffers[name] = copies.setdefault(id(b), (before.get(id(b), b)).detach().clone())
                swapped.append((mod, name, b))
        try:
            yield
        finally:
            for mod, name, b in swapped:
                mod._buffers[name] = b
