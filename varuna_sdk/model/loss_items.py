"""How many items a micro-batch's mean loss averages over, so that a mini-batch's loss is the
mean over *all* its items, whatever the micro-batch size.

A token cross-entropy with ignored positions (padding or prompt tokens labelled -100) is a mean
over the valid tokens of the micro-batch it sees. Averaging those micro-batch means weighs each
token by ``1 / valid tokens of its micro-batch``, so the loss and the gradient change with the
micro-batch size — and with every plan or morph that changes it — and differ from the same
mini-batch trained in one call (the gradient-accumulation normalisation problem; Hugging Face's
``num_items_in_batch`` answers it the same way). Weighting each micro-batch's mean by its count
of valid items, and dividing by the mini-batch's count, gives the mean over every item.

The count is read from the data, by a rule found once in the dry run (``infer_loss_items``): the
loss's one ``cross_entropy``/``nll_loss`` call (mean reduction) whose output is the loss, compared
with the micro-batch's targets and integer inputs, as they are or shifted by one position (a causal
LM's labels). With class weights (``weight=``, a tensor the loss holds) the call's mean is over the
weights of its targets, Σ w[y]·l / Σ w[y], so a micro-batch's items are that weight sum (at a
micro-batch of one example the weights would otherwise cancel out). No rule (another loss, several
terms, weights the dry run cannot read): the micro-batch means are averaged, as before.

Owns ``LossCall``, ``LossItems`` and ``infer_loss_items``. Must never import
``varuna_sdk.pipeline``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

#: the loss functions whose mean is over the targets not equal to ``ignore_index``
LOSS_FUNCS = (F.cross_entropy, F.nll_loss)
_SIGNATURES = {f: inspect.signature(f) for f in LOSS_FUNCS}


@dataclass
class LossCall:
    """One ``cross_entropy``/``nll_loss`` call seen in the dry run: its real ``target`` (computed
    from the inputs alone), ``ignore_index``, ``reduction``, whether it had class ``weight``s and
    their values (``weight``, ``[C]``; ``None`` where they were on meta: a model's buffer), and the
    id of its output (set once it ran)."""

    target: torch.Tensor
    ignore_index: int
    reduction: str
    weighted: bool
    weight: tuple[float, ...] | None = None
    out_id: int | None = None

    @classmethod
    def of(cls, func: Any, args: tuple, kwargs: dict) -> "LossCall | None":
        """The call's record, or None when its target is not a real integer tensor."""
        try:
            bound = _SIGNATURES[func].bind(*args, **kwargs)
        except TypeError:
            return None
        a = bound.arguments
        target = a.get("target")
        if not isinstance(target, torch.Tensor) or target.device.type == "meta" or target.is_floating_point():
            return None
        legacy = a.get("size_average") is not None or a.get("reduce") is not None
        w = a.get("weight")
        readable = isinstance(w, torch.Tensor) and w.device.type != "meta" and w.dim() == 1
        return cls(target=target.detach().clone(), ignore_index=int(a.get("ignore_index", -100)),
                   reduction="legacy" if legacy else str(a.get("reduction", "mean")),
                   weighted=w is not None,
                   weight=tuple(float(x) for x in w.detach().double().cpu()) if readable else None)


@dataclass(frozen=True)
class LossItems:
    """Where a micro-batch's loss items are: ``source`` is ``None`` for the targets (the loss
    function's second argument), else the name (a mapping's key) or position (a tuple's index,
    as a string) of a model input; ``shift``: the loss compares positions ``1..`` of it (a causal
    LM shifting its labels); ``ignore_index``: the id that does not count; ``guessed``: the traced
    sample could not tell whether the loss shifts (every label ignored, or constant along the
    sequence), so ``shift`` follows the convention (``infer_loss_items``) and a wider sample should
    decide (``trainer.loss_items_of``); ``weight``: the loss's class weights (``[C]``), where a
    micro-batch's items are the weight sum of its counted targets."""

    source: str | None
    shift: bool
    ignore_index: int
    guessed: bool = field(default=False, compare=False)   # the sample could not tell the shift
    weight: tuple[float, ...] | None = None

    def _tensor(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        if self.source is None:
            t = targets
        elif isinstance(inputs, Mapping):
            t = inputs.get(self.source)
        else:
            i = int(self.source)
            t = inputs[i] if i < len(inputs) else None
        return t if isinstance(t, torch.Tensor) else None

    def count(self, inputs: Any, targets: Any) -> tuple[float, int]:
        """``(items, positions)`` of a micro-batch (host tensors: no device sync): the positions the
        loss compares and how many of them count (not ``ignore_index``) — with class weights, the
        sum of their weights. Raises ``ValueError`` when the micro-batch lacks the source tensor."""
        t = self._tensor(inputs, targets)
        if t is None:
            raise ValueError(f"the micro-batch has no {self.source or 'targets'!r} tensor to count the loss's items in")
        if self.shift:
            t = t[..., 1:]
        valid = t != self.ignore_index
        if self.weight is None:
            return int(valid.sum()), int(t.numel())
        return float(torch.tensor(self.weight, dtype=torch.float64)[t[valid].long().cpu()].sum()), int(t.numel())


def _candidates(inputs: Any, targets: Any) -> list[tuple[str | None, torch.Tensor]]:
    found: list[tuple[str | None, torch.Tensor]] = [(None, targets)] if isinstance(targets, torch.Tensor) else []
    items = inputs.items() if isinstance(inputs, Mapping) else enumerate(inputs if isinstance(inputs, tuple) else ())
    found += [(str(k), v) for k, v in items if isinstance(v, torch.Tensor) and not v.is_floating_point()
              and v.device.type != "meta"]
    return found


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == b.numel() and bool(torch.equal(a.reshape(-1).cpu().long(), b.reshape(-1).cpu().long()))


def _matches(target: torch.Tensor, cand: torch.Tensor, shift: bool, ignore: int) -> bool:
    """Whether the loss's ``target`` is ``cand`` (as it is, or its positions ``1..`` — with or without a
    trailing ignored column, as Hugging Face pads before shifting)."""
    if not shift:
        return _same(target, cand)
    if cand.dim() < 2 or cand.shape[-1] < 2:   # a shift runs along a sequence, not the batch
        return False
    tail = cand[..., 1:]
    if _same(target, tail):
        return True
    padded = torch.cat([tail, torch.full_like(cand[..., :1], ignore)], dim=-1)
    return _same(target, padded)


def infer_loss_items(calls: list[LossCall], loss: Any, inputs: Any, targets: Any) -> LossItems | None:
    """The rule for counting a micro-batch's loss items, from the dry run: ``calls`` its loss
    calls, ``loss`` the tensor the loss returned (or the model's output holding it as ``.loss`` /
    ``["loss"]``), ``inputs``/``targets`` the micro-batch. A rule
    needs exactly one call, with mean reduction and class weights (if any) it can read, whose output is the loss
    itself, and one source: the loss's own targets where they are the call's target as given,
    else the target or integer input equal to it as it is or shifted by one position (a source
    matching both ways is read by convention, ``guessed``). None otherwise (the micro-batch means
    are averaged)."""
    if isinstance(loss, Mapping):   # the model's own output, where no loss function ran after it
        loss = loss.get("loss")
    elif not isinstance(loss, torch.Tensor):
        loss = getattr(loss, "loss", None)
    if len(calls) != 1 or not isinstance(loss, torch.Tensor):
        return None
    c = calls[0]
    if c is None or c.reduction != "mean" or (c.weighted and c.weight is None) or c.out_id != id(loss):
        return None   # None: a loss call whose target was not a real integer tensor
    found = {LossItems(name, shift, c.ignore_index, weight=c.weight) for name, cand in _candidates(inputs, targets)
             for shift in (False, True) if _matches(c.target, cand, shift, c.ignore_index)}
    direct = LossItems(None, False, c.ignore_index, weight=c.weight)   # the loss's own targets, as it was given them
    if direct in found and LossItems(None, True, c.ignore_index, weight=c.weight) not in found:
        return direct
    if len({r.shift for r in found}) > 1:
        # the sample cannot tell (every label ignored, or constant along the sequence): a model
        # input is a model's own loss's labels, which a causal LM shifts; external targets are aligned
        found = {replace(r, guessed=True) for r in found if r.shift == (r.source is not None)} or found
    if len(found) > 1:   # labels equal to input_ids in this sample: read the labels (padding differs)
        if len({r.shift for r in found}) == 1:
            return min(found, key=lambda r: (r.source is not None,
                                             not any(w in (r.source or "").lower() for w in ("label", "target")),
                                             r.source or ""))
        return None
    return found.pop() if found else None
