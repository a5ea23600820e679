"""The model spec (DESIGN.md): what a job trains, as one long-lived, resolved type.

``ModelSpec`` holds a factory returning the *whole* model (called with every tensor on the meta
device, ``model.deferred``), how a batch's named fields become the model's inputs and the loss's
targets (``CallSpec``), the loss, an optional per-module ``init_fn`` (for models too large to
record once), shared-weight declarations and an identity (for calibration caches). How a spec is
*named* — a registered preset, an import path, a callable shipped by value — is the job layer's
business (``varuna_sdk.jobspec``); the engine, trainer, profiler and planner only see this type.

Models are taken as people write them: ``prepare_model`` turns off a Hugging Face model's cache
and marks cut-points at its decoder layers (``auto_cutpoints``) unless the model has its own;
``infer_call`` reads the forward's signature to pass what it asks for — ``labels=`` to a Hugging
Face model, ``targets`` to a single-file GPT whose forward is ``(idx, targets)``, just the tokens
to a model that returns logits; ``model_loss`` takes a loss the model computed itself (``.loss``,
``["loss"]``, the scalar in ``(logits, loss)``) and ``cross_entropy`` computes one from the
logits (a tensor, ``.logits`` or the first element of a tuple).

Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .cutpoint import CutPoint, auto_cutpoints, find_block_list
from .inputs import ModelInputs

InitFn = Callable[[nn.Module, str], None]
LossFn = Callable[[Any, Any], torch.Tensor]


class ModelSpecError(ValueError):
    """A model, its call or its loss cannot be used as given; the message says what to change."""


# ---- losses ----------------------------------------------------------------------------------
def output_logits(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, ``.logits``, ``["logits"]`` or the first
    element of a tuple/list. Raises ``ModelSpecError`` naming the output's type otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ModelSpecError(f"cannot find logits in the model's output ({type(output).__name__}); give the job a loss "
                         "function (output, targets) -> scalar")


def model_loss(output: Any, targets: Any = None) -> torch.Tensor:
    """The loss the model computed itself: the output when it is a 0-dim floating tensor,
    ``output.loss`` (Hugging Face), ``output["loss"]``, or the one 0-dim floating tensor of a
    tuple such as ``(logits, loss)``. ``targets`` is ignored.
    Raises ``ModelSpecError`` when the output holds no loss (e.g. labels were not passed)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
        return output   # the forward returned its loss itself
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)):
        scalars = [t for t in output if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
        loss = scalars[0] if len(scalars) == 1 else None
    if not isinstance(loss, torch.Tensor):
        raise ModelSpecError(
            f"the model's output ({type(output).__name__}) holds no loss. With loss='model' the forward must compute "
            "it (pass labels/targets: see model.inputs), or give a loss function (output, targets) -> scalar")
    return loss


@dataclass(frozen=True)
class UserLoss:
    """A loss of the user's own, ``fn(output, targets)``, whose result may also be a dict (or
    an object with ``.loss``, a Hugging Face output) holding ``"loss"``, or a tuple/list whose
    first element is the loss — ``(loss, aux)`` or ``{"loss": loss, "acc": acc}`` as Lightning
    and Hugging Face code returns — so such a function works unedited: the loss trains, the other
    entries are not recorded. Anything else is returned as it is (the dry run then says what a
    loss must return)."""

    fn: LossFn

    def __call__(self, output: Any, targets: Any = None) -> Any:
        """``fn(output, targets)``'s loss: a tensor as it is, else its ``loss`` / ``["loss"]`` / ``[0]``;
        a one-element tensor (``[1]``, ``[1, 1]``: ``loss.view(1)``, a ``sum(..., keepdim=True)``) as
        the 0-dim tensor it holds, as plain PyTorch's ``backward`` takes it."""
        out = self.fn(output, targets)
        if isinstance(out, Mapping) and "loss" in out:
            out = out["loss"]
        elif not isinstance(out, (Mapping, torch.Tensor)) and isinstance(getattr(out, "loss", None), torch.Tensor):
            out = out.loss
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            out = out[0]
        if isinstance(out, torch.Tensor) and out.dim() > 0 and out.numel() == 1:
            return out.reshape(())
        return out


#: how far a class-probability target's row may be from summing to 1 (or its values from [0, 1]),
#: by dtype: one-hot rows are exact; softmax rows stored in 16 bits are not
_PROB_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}

#: how to give a loss of one's own, the end of every targets error of the automatic cross-entropy
_OWN_LOSS = ("give a loss of your own (model.loss: 'mypkg.losses:my_loss' with def my_loss(output, targets), or "
             "Job(..., loss=my_loss) in a notebook)")


def _shown(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def _probability_error(targets: torch.Tensor, dim: int) -> str | None:
    """Why ``targets`` (floating, read on the host) are not class probabilities along ``dim``
    (values in [0, 1], each row summing to 1), or None when they are."""
    tol = _PROB_TOL.get(targets.dtype, 1e-3)
    t = targets.detach().float()
    lo, hi = float(t.min()), float(t.max())
    if lo < -tol or hi > 1 + tol:
        return f"they hold values from {lo:.4g} to {hi:.4g}, outside [0, 1]"
    sums = t.sum(dim)
    off = (sums - 1).abs()
    if float(off.max()) <= tol:
        return None
    worst = float(sums.flatten()[int(off.argmax())])
    if bool(((t == 0) | (t == 1)).all()):
        return (f"their rows along dimension {dim} sum to {worst:g} (multi-hot: several classes per example?): "
                "several true classes are a multi-label task, whose loss is "
                "F.binary_cross_entropy_with_logits(output, targets); ")
    return f"a row along dimension {dim} sums to {worst:.4g}, not 1 (normalise: y / y.sum({dim}, keepdim=True)); "


def _squeezed_hint(targets: torch.Tensor, accepted: list[torch.Size]) -> str | None:
    """``y.squeeze(d)`` where dropping a size-1 dimension ``d`` of ``targets`` gives an accepted shape."""
    for d in range(targets.dim() - 1, -1, -1):
        if targets.shape[d] == 1 and targets.squeeze(d).shape in accepted:
            return f"y.squeeze({d - targets.dim() if d == targets.dim() - 1 else d})"
    return None


def _class_dim(logits: torch.Tensor, targets: torch.Tensor, values: bool) -> int:
    """The dimension of ``logits`` that holds the classes for these ``targets`` (-1, or 1 for
    PyTorch's ``[B, C, d1, ...]`` layout), or a ``ModelSpecError`` saying what is wrong with the
    targets and what to change. Class ids (integers) have the logits' shape without their class
    dimension: ``[B, ..., C]`` logits take ``[B, ...]`` ids; ``[B, C, d1, ...]`` logits also take
    ``[B, d1, ...]`` (read as PyTorch's layout where the shapes say so: the classes last wins a
    tie). Class probabilities (floating) have the logits' shape, values in [0, 1] and rows summing
    to 1 along the class dimension — the last, or dimension 1 where only that one sums to 1. Only
    the shapes are read unless ``values`` (targets on the host): then the probabilities and the
    whole numbers of float targets are read too; floating targets of ``[B, C, d1, ...]`` logits are
    read whatever ``values`` says (a device sync), since only their values tell the layout."""
    shape = logits.shape
    if logits.dim() < 2:
        raise ModelSpecError(
            f"cross-entropy (the automatic loss) needs logits with a class dimension, [B, C] or [B, ..., C], but the "
            f"model's output is {_shown(logits)} and the targets {_shown(targets)} (a regression's?): {_OWN_LOSS}, e.g. "
            "def mse(output, targets): return F.mse_loss(output, targets)")
    C = shape[-1]
    ids_last = shape[:-1]
    ids_first = torch.Size(shape[:1] + shape[2:]) if logits.dim() >= 3 else None
    accepted = [ids_last] + ([ids_first] if ids_first is not None and ids_first != ids_last else [])
    said = f"the targets are {_shown(targets)} and the logits {list(shape)}"
    layouts = f"class ids of shape {list(ids_last)} (the logits' shape without their last, class dimension)"
    if len(accepted) > 1:
        layouts += f" or {list(ids_first)} (PyTorch's [B, C, d1, ...] layout, classes in dimension 1)"
    if targets.is_floating_point():
        if targets.shape == shape and C >= 2:
            dims = [-1] + ([1] if logits.dim() >= 3 and shape[1] >= 2 else [])
            if values or len(dims) > 1:
                why = [_probability_error(targets, d) for d in dims]
                for d, w in zip(dims, why):
                    if w is None:
                        return d
                raise ModelSpecError(
                    f"cross-entropy (the automatic loss) reads float targets of the logits' shape as class "
                    f"probabilities, but {said}, and {why[0].rstrip('; ')}. Give class probabilities (values in [0, 1], "
                    f"each row summing to 1 along the class dimension), {layouts}, or {_OWN_LOSS}")
            return -1
        hint = ""
        if values and targets.shape in accepted + [s + (1,) for s in accepted]:
            t = targets.detach()
            kept = t[t != -100]
            if kept.numel() and bool((kept == kept.round()).all()) and float(kept.min()) >= 0:
                squeeze = _squeezed_hint(targets, accepted)
                hint = (f" They hold whole numbers from {int(kept.min())} to {int(kept.max())}: class ids stored as "
                        f"floats? Give them as integers (y.long(){squeeze[1:] if squeeze else ''}).")
        single = (" (over the logits' 1 class cross-entropy is 0 whatever the model outputs)" if C == 1 else "")
        raise ModelSpecError(
            f"cross-entropy (the automatic loss) compares the logits with class ids, but the targets are "
            f"{_shown(targets)} with the logits {list(shape)}{single} (a regression's targets?): it takes {layouts}, or float "
            f"class probabilities of the logits' shape.{hint} For other targets give the loss, e.g. "
            "model.loss: 'mypkg.losses:mse' with def mse(output, targets): return F.mse_loss(output.squeeze(-1), "
            "targets), or Job(..., loss=my_loss) in a notebook")
    if targets.shape == ids_last:
        return -1
    if len(accepted) > 1 and targets.shape == ids_first:
        return 1
    squeeze = _squeezed_hint(targets, accepted)
    if squeeze is not None:
        fix = f"drop the targets' dimension of size 1: {squeeze} (in the dataset, e.g. TensorDataset(x, {squeeze}))"
    elif targets.shape == shape:
        fix = ("integer targets of the logits' shape look one-hot: give the class ids, y.argmax(-1), or class "
               "probabilities, y.float()")
    else:
        fix = "give targets of that shape"
    raise ModelSpecError(
        f"{said}: cross-entropy (the automatic loss) takes {layouts}, as PyTorch's F.cross_entropy "
        f"does (it refuses these shapes too). To train, {fix}, or {_OWN_LOSS}")


def cross_entropy(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the output's logits (a tensor, ``.logits`` or a tuple's first; fp32
    whatever the autocast dtype) against ``targets``, as ``F.cross_entropy`` computes it:

    - class ids of any integer dtype (int32 ids from NumPy are taken as int64) of the logits'
      shape without the class dimension: ``[B, T]`` for ``[B, T, V]`` logits, ``[B]`` for
      ``[B, C]``; for ``[B, C, d1, ...]`` logits also ``[B, d1, ...]`` (PyTorch's layout, e.g. a
      segmentation's); -100 ignored;
    - float class probabilities (one-hot or soft labels) of the logits' shape, each row summing to
      1 along the class dimension (the last; dimension 1 where only that one sums to 1).

    Raises ``ModelSpecError`` saying what to change for targets of another shape (``[B, 1]`` ids
    for ``[B, C]`` logits, which PyTorch refuses too: squeeze them), for float targets that are no
    probabilities (a regression's: give a loss), and for class ids outside ``[0, C)`` (other than
    -100), naming the id and ``C`` (checked when torch refuses them; on CUDA the pipeline's last
    stage checks the targets' host copy first, ``check_targets``, since torch's device-side assert
    would come first there, and the probabilities' values are read there too)."""
    logits = output_logits(output)
    if not isinstance(targets, torch.Tensor):
        raise ModelSpecError(f"cross-entropy (the automatic loss) compares the logits with class ids, but the targets "
                             f"are a {type(targets).__name__}, not a tensor: {_OWN_LOSS}")
    dim = _class_dim(logits, targets, values=targets.device.type == "cpu")
    C = logits.shape[dim]
    flat = logits.float().movedim(dim, -1).reshape(-1, C)
    if targets.is_floating_point():
        return F.cross_entropy(flat, targets.float().movedim(dim, -1).reshape(-1, C))
    ids = targets.reshape(-1).long()
    try:
        return F.cross_entropy(flat, ids)
    except (IndexError, RuntimeError):
        wrong = _class_id_error(ids, C)
        if wrong is None:
            raise
    raise wrong from None


def _class_id_error(ids: torch.Tensor, classes: int) -> ModelSpecError | None:
    """The error to raise when a class id of ``ids`` is outside ``[0, classes)`` and is not
    cross-entropy's ignored -100, else None."""
    bad = ids[((ids < 0) | (ids >= classes)) & (ids != -100)]
    if bad.numel():
        lo, hi = int(ids[ids != -100].min()), int(ids[ids != -100].max())
        said = (f"the targets hold class id {int(bad[0])} (ids from {lo} to {hi} in this micro-batch) but the model's "
                f"output has {classes} classes (logits [..., {classes}]): cross-entropy takes ids in [0, {classes}) "
                f"(-100: ignored). ")
        if lo < 0:   # no width helps a negative id: the labels are the thing to change
            return ModelSpecError(said + f"Map the dataset's labels to 0..{classes - 1}, and padding or unlabelled "
                                  f"examples to -100 (a loss of your own can ignore another id: "
                                  f"cross_entropy(..., ignore_index={lo}))")
        return ModelSpecError(said + f"Make the model's output as wide as the number of classes: its last "
                              f"nn.Linear's out_features the dataset's largest class id + 1, at least {hi + 1} "
                              f"(this micro-batch's largest id is {hi}; others may hold larger ones), or map the "
                              f"dataset's labels to 0..{classes - 1}")
    return None


def check_targets(output: Any, targets: Any) -> int | None:
    """``cross_entropy``'s checks of the targets' host copy against the output (only its shape is
    read: no device sync), run by the pipeline's last stage before a loss on another device
    (``pipeline.engine.Varuna._loss``) and by the dry run on the examples it reads (the output on
    the meta device). Raises the ``ModelSpecError`` of ``cross_entropy`` for
    targets of a shape it does not take, float targets that are no class probabilities, and a class
    id outside ``[0, C)`` (other than -100); non-tensor targets are left to the loss. Returns the
    output's number of classes ``C`` (``None`` for non-tensor targets), to check other examples'
    ids with (``check_target_ids``)."""
    if not isinstance(targets, torch.Tensor):
        return None
    logits = output_logits(output)
    dim = _class_dim(logits, targets, values=True)
    check_target_ids(targets, logits.shape[dim])
    return int(logits.shape[dim])


def check_target_ids(targets: Any, classes: int) -> None:
    """Raise ``cross_entropy``'s ``ModelSpecError`` when integer ``targets`` hold a class id outside
    ``[0, classes)`` other than -100 (float or non-tensor targets: nothing is checked)."""
    if isinstance(targets, torch.Tensor) and not targets.is_floating_point() and targets.numel():
        wrong = _class_id_error(targets.reshape(-1).long(), classes)
        if wrong is not None:
            raise wrong


#: the former name of ``check_targets`` (it checked class ids only)
check_class_ids = check_targets
cross_entropy.check_targets = check_targets   # type: ignore[attr-defined]

LOSSES: dict[str, LossFn] = {"model": model_loss, "cross_entropy": cross_entropy}


# ---- how a batch becomes the model's inputs ---------------------------------------------------
def _class_ids(arg: str, value: Any, own_loss: bool) -> Any:
    """``labels``/``targets`` handed to a forward that computes its own loss, as int64 when they
    are integers of another type (NumPy's int32 ids: torch's losses take int64 class ids only)."""
    return _int64(value) if own_loss and arg in ("labels", "targets") else value


def _int64(value: Any) -> Any:
    """An integer tensor of another type than int64 (NumPy's int32, uint8 masks) as int64, the
    one integer type torch's losses take as class ids; anything else as it is."""
    if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
            and value.dtype not in (torch.int64, torch.bool):
        return value.long()
    return value


@dataclass(frozen=True)
class CallSpec:
    """How the named fields of a batch feed the model and the loss.

    ``args``: field names passed positionally, in order; ``kwargs``: (argument name, field name)
    pairs passed by keyword; ``targets``: the field handed to the loss function, or a tuple of
    fields handed to it as one dict field → tensor (a loss of several targets); ``None``: the model
    computes its own loss. Tensor shapes are the data's (batch first)."""

    args: tuple[str, ...] = ()
    kwargs: tuple[tuple[str, str], ...] = ()
    targets: str | tuple[str, ...] | None = None

    def target_fields(self) -> list[str]:
        """The fields the loss's targets are made of (none, one, or several)."""
        if self.targets is None:
            return []
        return [self.targets] if isinstance(self.targets, str) else list(self.targets)

    def fields(self) -> list[str]:
        """Every field the call reads."""
        names = list(self.args) + [f for _, f in self.kwargs]
        return names + [t for t in self.target_fields() if t not in names]

    def split(self, batch: Mapping[str, Any]) -> tuple[ModelInputs, Any]:
        """``(inputs, targets)`` of a batch of named fields (integer ``labels``/``targets`` handed to
        a forward computing its own loss, and integer targets of a loss, as int64). Raises ``ModelSpecError`` naming a missing field
        and the fields there are."""
        missing = [f for f in self.fields() if f not in batch]
        if missing:
            raise ModelSpecError(f"the batch has no field(s) {missing}; it has {sorted(batch)}. Set model.inputs "
                                 "(and the targets field) to names the data gives")
        inputs: ModelInputs = ({a: _class_ids(a, batch[f], self.targets is None) for a, f in self.kwargs}
                               if self.kwargs and not self.args else tuple(batch[f] for f in self.args))
        if self.kwargs and self.args:
            raise ModelSpecError("a model call takes positional or keyword fields, not both")
        # the loss's targets: integer ones as int64 (a loss of one's own on NumPy's int32 ids failed in
        # the workers with "expected target dtype to be Long"; Job.batch gave them as int32 too)
        if isinstance(self.targets, tuple):
            return inputs, {t: _int64(batch[t]) for t in self.targets}
        return inputs, (_int64(batch[self.targets]) if self.targets else None)

    def describe(self) -> str:
        """``model(input_ids, targets)`` / ``model(input_ids=input_ids, labels=labels)`` and the loss's targets."""
        def show(field: str) -> str:  # a tuple example's position: example[0]
            return f"example[{field}]" if field.isdigit() else field

        parts = [show(f) for f in self.args] + [f"{a}={show(f)}" for a, f in self.kwargs]
        if isinstance(self.targets, tuple):
            return f"model({', '.join(parts)}), loss(output, {{{', '.join(f'{t!r}: {show(t)}' for t in self.targets)}}})"
        return f"model({', '.join(parts)})" + (f", loss(output, {show(self.targets)})" if self.targets
                                               else ", its own loss")


def _named_causal(model: nn.Module) -> bool:
    """The model's class, or a class it derives from (a user's ``class MyLlama(LlamaForCausalLM)``),
    is a Hugging Face causal LM by name (``…ForCausalLM``, ``…LMHeadModel``)."""
    return any("CausalLM" in c.__name__ or "LMHead" in c.__name__ for c in type(model).__mro__)


def _warn_if_not_causal(model: nn.Module) -> None:
    """Warn when a Hugging Face model given ``labels=input_ids`` from text is not a causal (or
    encoder-decoder) language model: a masked-LM head sees, unmasked, every token it is asked to
    predict, so its loss falls towards 0 without it learning anything."""
    cfg = getattr(model, "config", None)
    name = type(model).__name__
    if cfg is None or getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "is_decoder", False):
        return
    if _named_causal(model):
        return
    warnings.warn(f"{name} is not a causal language model: trained on text, its labels are its unmasked inputs, "
                  "which it sees, so its loss falls towards 0 without learning. Set data.mlm_probability: 0.15 "
                  "(BERT's masking, with a tokenizer.json that has a mask token), give it masked inputs and labels "
                  "from a dataset (data.dataset), or train a causal LM (…ForCausalLM)", UserWarning, stacklevel=3)


def warn_if_causal_with_masking(model: nn.Module) -> None:
    """Warn when masked-LM examples (``data.mlm_probability``) go to a causal language model (a
    Hugging Face ``…ForCausalLM``/``…LMHeadModel`` or decoder, or our GPT-2): it predicts each next
    token from the left only, so masked inputs and labels at the masked positions train an
    objective it was not made for."""
    cfg = getattr(model, "config", None)
    name = type(model).__name__
    causal = (_named_causal(model) or type(model).__module__.endswith("varuna_sdk.model.gpt2")
              or (cfg is not None and getattr(cfg, "is_decoder", False)
                  and not getattr(cfg, "is_encoder_decoder", False)))
    if causal:
        warnings.warn(f"data.mlm_probability masks text for a masked language model (BERT-like), but {name} is a "
                      "causal LM: it sees only the tokens to its left, so it trains on [MASK] tokens and labels "
                      "at masked positions only. Remove data.mlm_probability to train it on next tokens",
                      UserWarning, stacklevel=3)


def _forward_params(model: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def _extra_fields(model: nn.Module, fields: Sequence[str], params: Sequence[inspect.Parameter],
                  names: Sequence[str], exclude: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``(argument, field)`` pairs for the data's fields besides ``exclude`` that the forward takes
    by name (an ``attention_mask``, ``token_type_ids``...; every one when it takes ``**kwargs``).
    A field it cannot take is warned about, never dropped silently."""
    rest = [f for f in fields if f not in exclude and not f.isdigit()]
    any_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    taken = [f for f in rest if f in names or any_kw]
    left = [f for f in rest if f not in taken]
    if left:
        warnings.warn(f"the data's field(s) {left} are not parameters of {type(model).__name__}.forward"
                      f"{tuple(names)}: they are not passed to the model (name the fields to pass in model.inputs "
                      "to silence this)", UserWarning, stacklevel=3)
    return tuple((f, f) for f in taken)


def _several_targets(model: nn.Module, fields: Sequence[str], loss: str | LossFn | None,
                     inputs: Sequence[str] | Mapping[str, str] | None, targets: Sequence[str]) -> tuple[CallSpec, LossFn]:
    """``infer_call`` for a loss of several targets (``targets``: their fields, two or more): the
    loss gets ``{field: tensor}`` of them; the forward gets ``inputs`` when given, else the other
    fields (positionally for a tuple example; by name for a dict one: those its parameters name, every
    one when it names none, as ``infer_call`` passes them)."""
    targets = tuple(str(t) for t in targets)
    if loss is None or loss in ("cross_entropy", "model"):
        said = "the automatic loss" if loss is None else f"model.loss={loss!r}"
        raise ModelSpecError(f"model.targets={list(targets)} names {len(targets)} fields, and {said} compares the output "
                             "with one: give a loss function (output, targets) -> scalar, which gets targets as a dict "
                             f"{{{', '.join(repr(t) + ': tensor' for t in targets)}}} (Job(..., loss=fn) in a notebook; "
                             "model.loss: 'package.module:fn' in a config), or name one field")
    missing = [t for t in targets if t not in fields]
    if missing:
        raise ModelSpecError(f"model.targets names field(s) {missing} that the data does not give; its fields are "
                             f"{list(fields)}")
    fn = LOSSES[loss] if isinstance(loss, str) else loss
    if not callable(fn):
        raise ModelSpecError(f"model.loss={loss!r} is not callable")
    if inputs is not None:
        call = (CallSpec(kwargs=tuple(dict(inputs).items())) if isinstance(inputs, Mapping)
                else CallSpec(args=tuple(inputs)))
        return CallSpec(call.args, call.kwargs, targets), fn
    rest = [f for f in fields if f not in targets]
    if all(f.isdigit() for f in fields):
        return CallSpec(args=tuple(rest), targets=targets), fn
    params = _forward_params(model)
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    keep = (_extra_fields(model, fields, params, names, exclude=targets) if any(f in names for f in rest)
            else tuple((f, f) for f in rest))
    return CallSpec(kwargs=keep, targets=targets), fn


def infer_call(model: nn.Module, fields: Sequence[str], loss: str | LossFn | None,
               inputs: Sequence[str] | Mapping[str, str] | None = None,
               targets: str | Sequence[str] | None = None,
               masked: bool = False, from_text: bool = True) -> tuple[CallSpec, LossFn]:
    """Choose how to call ``model`` and which loss to use from the forward's signature and the
    fields the data gives (``fields``), unless ``inputs``/``targets``/``loss`` say it.

    ``loss``: ``None`` (automatic), ``"model"`` (the model computes it), ``"cross_entropy"``, or a
    callable ``(output, targets) -> scalar``. Automatic, for language-model fields
    (``input_ids``, ``targets``, ``labels``): a forward with a ``labels`` parameter gets
    ``input_ids=, labels=`` and its own loss (Hugging Face); one with a ``targets`` parameter gets
    ``(input_ids, targets)`` and its own loss (single-file GPTs); otherwise ``(input_ids)`` and the
    cross-entropy against ``targets``; any other field the forward takes by name (a dataset's
    ``attention_mask``, ``token_type_ids``) is passed by keyword too, and one it cannot take is
    warned about. For a dataset's fields: tuple examples ``(x, y)`` give
    ``model(x)`` and ``loss(output, y)`` — or, when the forward takes ``targets`` or ``labels`` by
    name and no loss is given, ``model(x=x, targets=y)`` and its own loss; dict examples are passed by keyword (the fields the forward
    takes by name; the others are warned about, not passed), and when the
    forward takes their targets field (``labels``) by name it gets it and its own loss is used
    (a Hugging Face classifier's: cross-entropy, or MSE for one label). ``targets`` naming several
    fields (a multi-task loss): the loss gets them as one dict field → tensor (``_several_targets``).

    ``masked``: the language-model fields are masked-LM ones (``data.mlm_probability``), so a
    model that is not causal is not warned about. ``from_text``: the fields were made from text
    (``labels`` are the inputs themselves); a dataset's own ``labels`` (a class, masked tokens)
    are not warned about either.

    Returns ``(CallSpec, loss function)``. Raises ``ModelSpecError`` for a call that cannot be
    made (a loss that needs targets the data lacks, an unknown loss name).
    """
    fields = list(fields)
    if isinstance(loss, str) and loss not in LOSSES:
        raise ModelSpecError(f"model.loss={loss!r}; use 'model' (the model computes it), 'cross_entropy', an import "
                             "path 'pkg.mod:fn', or pass a function (output, targets) -> scalar")
    if targets is not None and not isinstance(targets, str):
        if len(targets) > 1:
            return _several_targets(model, fields, loss, inputs, targets)
        targets = str(targets[0])   # a list of one: that field
    params = _forward_params(model)
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    own = loss == "model"
    if inputs is not None:
        call = (CallSpec(kwargs=tuple(dict(inputs).items())) if isinstance(inputs, Mapping)
                else CallSpec(args=tuple(inputs)))
    elif "input_ids" in fields:  # language-model data (and a dataset's dicts with input_ids)
        # the named targets field is the loss's, not the forward's (a **kwargs forward takes any field)
        extra = _extra_fields(model, fields, params, names,
                              exclude=("input_ids", "labels", "targets", "label") + ((targets,) if targets else ()))
        first = names[0] if names else "input_ids"
        if "labels" in names and (loss is None or own):
            call, own = CallSpec(kwargs=(("input_ids", "input_ids"), *extra, ("labels", "labels"))), True
            if from_text and not masked:
                _warn_if_not_causal(model)
        elif "targets" in names[1:] and (loss is None or own):
            call = (CallSpec(kwargs=((first, "input_ids"), *extra, ("targets", "targets"))) if extra
                    else CallSpec(args=("input_ids", "targets")))
            own = True
        elif own:
            raise ModelSpecError(f"loss='model' but {type(model).__name__}.forward{tuple(names)} takes neither labels "
                                 "nor targets; say which fields to pass with model.inputs")
        else:
            call = CallSpec(kwargs=((first, "input_ids"), *extra)) if extra else CallSpec(args=("input_ids",))
    elif all(f.isdigit() for f in fields):  # tuple examples (x, y, ...)
        n = len(fields)
        call = CallSpec(args=tuple(fields if own or n == 1 else fields[:-1]))
        takes = next((t for t in ("labels", "targets") if t in names[1:]), None)
        front = [nm for nm in names if nm != takes][:n - 1]
        if loss is None and n >= 2 and takes is not None and len(front) == n - 1:
            # the forward takes the targets by name (a single-file GPT's targets=, a classifier's labels=):
            # they go to it, and its own loss is used, as for language-model and dict data
            call, own = CallSpec(kwargs=(*zip(front, fields[:-1]), (takes, fields[-1]))), True
    else:  # dict examples: by keyword
        tgt = targets or next((f for f in ("targets", "labels", "label") if f in fields), None)
        if loss is None and tgt is not None and tgt in names:
            own = True  # the forward takes the targets by name (Hugging Face's labels=): its own loss
        # the fields the forward takes by name (every one with **kwargs); the others are warned about
        passed = [f for f in fields if own or f != tgt]
        keep = (_extra_fields(model, fields, params, names, exclude=() if own else (tgt,))
                if any(f in names for f in passed) else  # a forward naming none: passed as they are
                tuple((f, f) for f in passed))
        call = CallSpec(kwargs=keep)
    if own:
        return CallSpec(call.args, call.kwargs, None), model_loss
    fn = LOSSES["cross_entropy"] if loss is None else (LOSSES[loss] if isinstance(loss, str) else loss)
    if not callable(fn):
        raise ModelSpecError(f"model.loss={loss!r} is not callable")
    tgt = targets
    if tgt is None:
        used = set(call.fields())
        tgt = next((f for f in ("targets", "labels", "label") if f in fields and f not in used), None)
        if tgt is None and all(f.isdigit() for f in fields) and len(fields) > len(call.args):
            tgt = fields[len(call.args)]
    if tgt is None:
        # a field the forward takes only through its **kwargs is likely the targets (Hugging Face's)
        loose = [f for f in fields if f not in names and not f.isdigit() and f != "input_ids"]
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        how = "reach the forward only through its **kwargs" if var_kw else "are not parameters of the forward"
        guess = (f"model.targets: {loose[0]!r} (the field(s) {loose} {how})"
                 if loose else f"model.targets: {fields[0]!r} to compare the output with an input, as an "
                 "autoencoder does")
        why = (f"no field of the data ({fields}) is named as targets are ('targets', 'labels', 'label')" if loose
               else f"the data's fields {fields} hold none the model does not already take")
        raise ModelSpecError(f"the loss needs targets, but {why}; name the targets field ({guess}; "
                             "Job(..., targets=...) in a notebook), or use loss='model'")
    return CallSpec(call.args, call.kwargs, tgt), fn


def positive_settings(model: nn.Module, names: Sequence[str]) -> list[tuple[str, str, float]]:
    """``(where, name, value)`` for every numeric attribute in ``names`` above 0 that a module of
    ``model`` or its ``config`` holds (``where``: the module's dotted name, ``<root>`` for the
    model, with ``.config`` for its config), in module order: how models ask for LayerDrop,
    functional dropout or drop paths without a module that shows it."""
    out = []
    for mod_name, mod in model.named_modules():
        base = mod_name or "<root>"
        for owner, where in ((mod, base), (getattr(mod, "config", None), f"{base}.config")):
            for a in names:
                v = getattr(owner, a, None) if owner is not None else None
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                    out.append((where, a, float(v)))
    return out


# ---- preparing a model built from the user's factory ----------------------------------------
def is_hf_model(model: nn.Module) -> bool:
    """True for a Hugging Face ``transformers`` ``PreTrainedModel`` (checked without importing it)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def prepare_model(model: nn.Module, blocks: str | Sequence[str] | None = None) -> nn.Module:
    """Ready a freshly built model for the pipeline, without editing its code: a Hugging Face
    model's key/value cache is turned off (training needs none, and a ``Cache`` object cannot
    cross a stage boundary); cut-points are marked at the blocks of ``blocks`` (a dotted module
    name, or a list of the blocks' names in call order) or of its largest ``ModuleList`` unless it
    has ``CutPoint`` modules already.

    A model without any ``ModuleList``/``Sequential`` of blocks (and ``blocks`` not given) is left
    without cut-points: it trains at P = 1 only, and a deeper pipeline is refused by the partition
    check with what to do. Raises ``ModelSpecError`` when ``blocks`` names no such container.
    """
    if is_hf_model(model):
        cfg = getattr(model, "config", None)
        if cfg is not None and getattr(cfg, "use_cache", None):
            cfg.use_cache = False
    if any(isinstance(m, CutPoint) for m in model.modules()) or getattr(model, "_varuna_auto_cutpoints", False):
        return model
    if blocks is None:
        try:
            find_block_list(model)
        except ValueError:
            return model  # one segment: P = 1 (check_depth says what to do for more)
    try:
        return auto_cutpoints(model, blocks)
    except ValueError as e:
        raise ModelSpecError(f"{e}; set model.blocks to the dotted name of the model's list of layers (e.g. "
                             "'transformer.h') or to its blocks' names in call order (e.g. ['b1', 'b2', 'b3'])"
                             ) from None


def model_limits(model: nn.Module) -> tuple[int | None, int | None]:
    """``(vocab size, longest sequence)`` the model accepts, when it says (its ``config``'s
    ``vocab_size`` and ``max_position_embeddings``/``n_positions``/``block_size``/``n_ctx``, or
    the same attributes on the model or its ``cfg``); ``None`` where unknown."""
    vocab = ctx = None
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None), model):
        if holder is None:
            continue
        if vocab is None and isinstance(getattr(holder, "vocab_size", None), int):
            vocab = int(holder.vocab_size)
        for attr in ("max_position_embeddings", "n_positions", "block_size", "n_ctx", "max_seq_len"):
            v = getattr(holder, attr, None)
            if ctx is None and isinstance(v, int) and not isinstance(v, bool):
                ctx = int(v)
    return vocab, ctx


@dataclass
class ModelSpec:
    """A resolved model spec (see the module docstring).

    ``factory``: ``() -> nn.Module`` — the whole model, cut-points marked (``prepare_model``
    applied); ``loss_fn``: ``(output, targets) -> scalar`` mean loss of a micro-batch;
    ``call``: how a batch's fields feed model and loss; ``init_fn``: ``(module, name) -> None``
    or ``None`` (the constructor's own initialisation, replayed); ``shared_params``: parameter
    names that may be used on several stages (``None``: tie automatically); ``name``: for
    messages; ``identity``: plain data naming exactly this model (factory, arguments, code hash),
    part of calibration cache keys; ``vocab_size``/``context``: what the model accepts (``None``:
    it does not say), checked against the data before workers start; ``min_micro_batch``: the
    fewest examples per micro-batch its forward runs on in training (2 for a BatchNorm model:
    the planner and the calibration try no smaller micro-batch)."""

    factory: Callable[[], nn.Module]
    loss_fn: LossFn
    call: CallSpec
    name: str
    identity: dict = field(default_factory=dict)
    init_fn: InitFn | None = None
    shared_params: list[str] | None = None
    vocab_size: int | None = None
    context: int | None = None
    min_micro_batch: int = 1

    def describe(self) -> str:
        """One line: the model and how it is called."""
        return f"{self.name}: {self.call.describe()}"
