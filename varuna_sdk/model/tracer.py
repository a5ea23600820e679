"""Dry-run tracer: runs the model once with its weights on the ``meta`` device (no memory, no
weight compute) and records, per segment, which parameters and buffers it touches, which tensors
cross each cut-point (dtype, requires_grad, shape), a FLOP estimate, and every weight-derived
tensor that reaches a later segment *without* passing through every cut-point in between.

The inputs stay real and ``hybrid.MetaAsDevice`` is active, so what depends on the inputs alone
(masks, positions, token-id checks in library code) is computed for real and steers the forward
exactly as in a real run; such tensors are recomputed by every stage, so they may reach any
segment — model inputs used late (labels, targets, masks) need not cross the cut-points.

Paper §5.2 (tracking cross-partition dependencies). Unlike the original (varuna-original.md
§2.1–2.2: ``sys.settrace`` argument sniffing, full forward on CPU, swallowed exceptions) this
sees every torch call through a ``TorchFunctionMode``, so parameters read inside builtins
(``F.linear(x, self.weight)``) and tied weights used through another module are both caught.

Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .cutpoint import crossing_signature, observe_cutpoints
from .state_kept import restored
from .hybrid import MetaAsDevice, WeightValueError
from .loss_items import LOSS_FUNCS, LossCall, LossItems, infer_loss_items
from .inputs import ModelInputs, as_inputs, call_model, to_device


@dataclass
class ModelStructure:
    """What the dry run learned about a model (plain data; JSON-friendly).

    Attributes:
        num_segments: cut-point crossings + 1.
        state_segments: canonical parameter/buffer name → sorted segment indices that use it.
        param_names: canonical names of parameters (the rest of ``state_segments`` are buffers).
        unused: canonical names never touched by the forward (placed on segment 0).
        crossings: for crossing ``k`` (between segment ``k`` and ``k+1``) the signature of each
            tensor: ``{"dtype", "requires_grad", "shape"}`` at the traced micro-batch size.
        input_crossings: for crossing ``k``, whether a tensor computed from the inputs alone
            crosses it (a mask, position ids): which tensors cross may then change from one
            micro-batch to the next (a mask a model builds for padded data only).
        segment_flops: forward FLOP estimate per segment at the traced micro-batch size.
        segment_param_bytes: bytes of parameters first used in each segment.
        cross_uses: ``(producer_segment, consumer_segment, op)`` for tensors that skip a cut-point
            (``op``: the operation that used it and the tensor, for messages: ``'to' on a [64, 4]
            float32 tensor made by 'linear'``, or the cut-point it crossed without being carried).
        carried_uses: ``(producer_segment, consumer_segment, op, cuts)`` for a tensor used by its
            object from before the cut-points ``cuts`` it crossed (a residual added outside the
            block, ``h = h + layer(h)``): a stage whose first cut-point is one of ``cuts`` has it,
            substituting the received tensor for it (``pipeline.stage_prefix.StageRun``).
        segment_modules: per segment, names of modules whose parameters it uses (for messages).
        embeddings: every embedding lookup whose indices were real (computed from the inputs):
            ``{"param", "rows", "max_index", "from_input"}`` — ``from_input``: the indices are a
            model input itself (token ids, so ``rows`` bounds the vocabulary), else derived from
            them (positions: ``max_index`` grows with the sequence length).
        random_ops: names of the functions that draw random numbers the forward (or the loss)
            called, dropout aside (``randn_like`` for noise): the pipeline draws them per (step,
            micro-batch, segment), so a plain PyTorch run of the model draws others.
        loss_items: where a micro-batch's loss items (valid tokens) are counted, when the loss is one
            mean cross-entropy over targets found in the data (``model.loss_items``); else None.
        nonfinite_checks: names of the functions that test for NaN/inf (``isnan``, ``nan_to_num``...)
            the forward (or the loss) called on tensors computed from the data alone: a model that
            handles missing values itself, whose data may then hold NaN (``jobspec.check_finite``).
        read_only_buffers: canonical names of the buffers the forward (and the loss) read but never
            wrote (no in-place change: their version counters did not move; none replaced): a
            causal mask, rotary frequencies. Such a buffer may be used on several stages (each holds
            an identical copy); a written one (BatchNorm's running statistics) may not. Empty in a
            structure from before this field: every buffer then counts as written.
        written_buffers: canonical names of the buffers the forward (and the loss) changed in place
            or replaced (a BatchNorm's running statistics, a user's EMA of its activations).
    """

    num_segments: int
    state_segments: dict[str, list[int]]
    param_names: list[str]
    unused: list[str]
    crossings: list[list[dict]]
    input_crossings: list[bool]
    segment_flops: list[float]
    segment_param_bytes: list[int]
    cross_uses: list[tuple[int, int, str]] = field(default_factory=list)
    carried_uses: list[tuple[int, int, str, tuple[int, ...]]] = field(default_factory=list)
    segment_modules: list[list[str]] = field(default_factory=list)
    embeddings: list[dict] = field(default_factory=list)
    random_ops: list[str] = field(default_factory=list)
    loss_items: LossItems | None = None
    nonfinite_checks: list[str] = field(default_factory=list)
    read_only_buffers: list[str] = field(default_factory=list)
    written_buffers: list[str] = field(default_factory=list)

    def segments_of(self, name: str) -> list[int]:
        """Segments that use parameter or buffer ``name`` (``[0]`` if none was recorded)."""
        return self.state_segments.get(name, [0])


def _tensors(obj: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _flops(func: Callable, args: tuple, kwargs: dict, out: Any) -> float:
    """Rough forward FLOPs of one torch call (matmul-like ops dominate; elementwise = numel)."""
    name = getattr(func, "__name__", "")
    try:
        if name == "linear":
            x, w = args[0], args[1]
            return 2.0 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]
        if name in ("matmul", "bmm", "mm", "__matmul__"):
            a = args[0]
            o = out if isinstance(out, torch.Tensor) else None
            return 2.0 * (o.numel() if o is not None else 0) * a.shape[-1]
        if name == "scaled_dot_product_attention":
            q, k = args[0], args[1]
            return 4.0 * (q.numel() // q.shape[-1]) * k.shape[-2] * q.shape[-1]
        if name == "embedding":
            return float(out.numel()) if isinstance(out, torch.Tensor) else 0.0
    except (AttributeError, IndexError, TypeError):
        return 0.0
    return float(sum(t.numel() for t in _tensors(out)))


#: functions that draw random numbers (dropout, warned about on its own, aside)
_RANDOM_FUNCS = frozenset({"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
                           "bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "multinomial", "poisson",
                           "exponential_", "geometric_", "cauchy_", "log_normal_", "random_"})


class _Trace:
    def __init__(self, model: nn.Module):
        self.segment = 0
        self.state_ids: dict[int, str] = {}
        self.param_names: list[str] = []
        self.module_of: dict[str, str] = {}
        for mname, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                self.module_of.setdefault(f"{mname}.{pname}" if mname else pname, mname)
            for bname, b in mod.named_buffers(recurse=False):
                self.module_of.setdefault(f"{mname}.{bname}" if mname else bname, mname)
        for name, p in model.named_parameters():
            self.state_ids[id(p)] = name
            self.param_names.append(name)
        for name, b in model.named_buffers():
            self.state_ids.setdefault(id(b), name)
        self.uses: dict[str, set[int]] = {}
        self.producer: dict[int, int] = {}
        self.made_by: dict[int, str] = {}  # id of a produced tensor -> the operation that made it
        self.keep: list[torch.Tensor] = []
        self.crossings: list[list[dict]] = []
        self.input_crossings: list[bool] = []
        self.flops: list[float] = [0.0]
        self.cross_uses: set[tuple[int, int, str]] = set()
        self.carried_uses: set[tuple[int, int, str, tuple[int, ...]]] = set()
        self.crossed: dict[int, set[int]] = {}  # id of a tensor -> the cut-points it crossed (that object)
        self.carried: set[int] = set()  # ids of the tensors that crossed the previous cut-point
        self.in_cut = False
        self.input_storages: set[int] = set()
        self.embeddings: dict[str, dict] = {}
        self.strict_dtypes = False
        self.in_after = False  # running ``after`` (the loss): its uses are named as the loss's
        self.random_ops: set[str] = set()
        self.nonfinite_checks: set[str] = set()
        self.loss_calls: list[LossCall | None] = []  # cross_entropy/nll_loss calls (None: unreadable)
        self.pending_loss: LossCall | None = None     # the one about to run, for its output's id
        self.loss_outs: dict[int, LossCall] = {}      # id of a loss call's output -> the call
        self.mixed: tuple[str, list[str]] | None = None   # the latest operation run on meta with real (data) tensors
        self.failed_op: str | None = None                 # the operation whose kernel raised, if any

    def data_on_meta(self) -> str:
        """When the operation that failed is the latest one run on meta with real tensors — tensors
        computed from the data alone (``MetaAsDevice`` moved them to meta beside weight-derived ones)
        — that in words, for the dry run's error; else ""."""
        if self.mixed is None or self.failed_op is None or self.mixed[0] != self.failed_op or not self.mixed[1]:
            return ""
        op, real = self.mixed
        return (f". The operation {op!r} got {', '.join(real)} computed from the data alone (a field of the "
                f"examples or something made from it) beside tensors computed from the weights, so the dry run "
                f"ran it on the meta device, data included, in segment {self.segment}; this operation needs that "
                "data's values on a real device. Compute it where no activation is involved, or use another "
                "operation (e.g. mask the padded positions instead)")

    def on_mixed(self, func, args: tuple, kwargs: dict) -> None:
        """An operation about to run on meta with its real arguments: note embedding lookups
        with real indices (how large the tables must be), and the targets of a loss call."""
        self.mixed = (getattr(func, "__name__", str(func)),
                      [f"a {list(t.shape)} {str(t.dtype).replace('torch.', '')} tensor"
                       for t in _tensors((args, kwargs)) if t.device.type != "meta" and id(t) not in self.state_ids])
        if func in LOSS_FUNCS:
            self.pending_loss = LossCall.of(func, args, kwargs)
            self.loss_calls.append(self.pending_loss)
            return
        if func is not F.embedding or len(args) < 2:
            return
        idx, weight = args[0], args[1]
        if not isinstance(idx, torch.Tensor) or idx.device.type == "meta" or idx.numel() == 0:
            return
        name = self.state_ids.get(id(weight), "?")
        e = self.embeddings.setdefault(name, {"param": name, "rows": int(weight.shape[0]), "max_index": -1,
                                              "from_input": False})
        e["max_index"] = max(e["max_index"], int(idx.max()))
        e["from_input"] = e["from_input"] or idx.untyped_storage().data_ptr() in self.input_storages

    def mark(self, tensors: Sequence[torch.Tensor], segment: int, op: str = "") -> None:
        """Record ``segment`` as the producer of the weight-derived (meta) ``tensors`` (made by
        ``op``, for messages); real ones depend on the inputs alone and every stage recomputes them."""
        for t in tensors:
            if t.device.type == "meta":
                self.producer[id(t)] = segment
                self.made_by[id(t)] = op
                self.keep.append(t)

    def describe(self, t: torch.Tensor) -> str:
        """``a [64, 4] float32 tensor made by 'linear'``: what a message says of a tensor that
        skips a cut-point, so that the user can tell which one it is."""
        by = self.made_by.get(id(t))
        return (f"a {list(t.shape)} {str(t.dtype).replace('torch.', '')} tensor"
                + (f" made by {by!r}" if by else ""))

    def at_cutpoint(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.in_cut = True
        try:
            with torch._C.DisableTorchFunction():  # true devices (MetaAsDevice answers "cpu")
                return self._crossing(tensors)
        finally:
            self.in_cut = False

    def _crossing(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        k = self.segment  # this is crossing k: from segment k to segment k + 1
        for t in tensors:
            prod = self.producer.get(id(t))
            if prod is not None and prod != k and id(t) not in self.carried:
                # made before segment k and not carried across cut-point k - 1: a stage starting
                # between them would not have it (e.g. one mask given only to later blocks)
                self.cross_uses.add((prod, k + 1, f"cut-point {k}"))
        for t in tensors:
            self.crossed.setdefault(id(t), set()).add(k)
            name = self.state_ids.get(id(t))
            if name is not None:   # a weight or buffer handed to a block (block(h, self.mask)): segment k reads it
                self.uses.setdefault(name, set()).add(k)
        self.crossings.append(crossing_signature(tensors))
        self.input_crossings.append(any(t.device.type != "meta" for t in tensors))
        self.segment += 1
        self.flops.append(0.0)
        out = tuple(t.detach().requires_grad_(bool(t.requires_grad and t.is_floating_point())) for t in tensors)
        self.mark(out, self.segment)
        self.carried = {id(t) for t in tensors} | {id(t) for t in out}
        return out


#: operations that refuse floating operands of different dtypes on a real device (the meta
#: kernels do not check): float64 data into a float32 model fails there, so the dry run says so
_SAME_DTYPE = frozenset({F.linear, F.bilinear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                         torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
                         torch.addmm, torch.baddbmm, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
                         F.conv_transpose2d, F.conv_transpose3d})


#: functions that test for (or replace) NaN/inf: called on the data, the model handles such values itself
_NONFINITE_FUNCS = frozenset({"isnan", "isinf", "isfinite", "isposinf", "isneginf", "nan_to_num", "nan_to_num_",
                              "nanmean", "nansum", "nanmedian", "nanquantile"})


def _check_same_dtype(func, args: tuple, kwargs: dict, floats_too: bool) -> None:
    """Raise the ``RuntimeError`` the real device would, when integer (or bool) and floating operands
    meet (integer features into a ``Linear``, uint8 images into a convolution: autocast casts neither),
    or, with ``floats_too``, when floating operands differ in dtype (not under autocast)."""
    tensors = list(_tensors((args, kwargs)))
    floats = [t for t in tensors if t.is_floating_point()]
    whole = sorted({str(t.dtype).replace("torch.", "") for t in tensors if not t.is_floating_point()
                    and not t.is_complex()})
    name = getattr(func, "__name__", func)
    if floats and whole:
        raise RuntimeError(f"{name} got {', '.join(whole)} operands beside {str(floats[0].dtype).replace('torch.', '')} "
                           "ones: a layer's weights take floating inputs — cast the data's field in the dataset "
                           "(features: x.float(); uint8 images: x.float() / 255), or, for ids, look them up in an "
                           "nn.Embedding first")
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in floats})
    if floats_too and len(dtypes) > 1:
        raise RuntimeError(f"{name} got floating operands of different dtypes "
                           f"({', '.join(dtypes)}): the data and the weights must have one dtype — cast the data's "
                           "floating fields in the dataset (e.g. torch.from_numpy(x).float(), x.astype('float32'))")


def _in_place(func) -> bool:
    """Whether ``func`` changes its first argument in place (``add_``, ``loss += aux``)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__"))


class _TraceMode(TorchFunctionMode):
    def __init__(self, trace: _Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.trace
        if tr.in_cut:
            return func(*args, **kwargs)
        seg = tr.segment
        if func in _SAME_DTYPE:
            _check_same_dtype(func, args, kwargs, floats_too=tr.strict_dtypes)
        if getattr(func, "__name__", "") in _RANDOM_FUNCS:
            tr.random_ops.add(func.__name__)
        if getattr(func, "__name__", "") in _NONFINITE_FUNCS and \
                any(t.device.type != "meta" for t in _tensors((args, kwargs))):
            tr.nonfinite_checks.add(func.__name__)   # on data (weights and activations are meta)
        is_get = getattr(func, "__name__", "") == "__get__"
        if is_get:
            out = func(*args, **kwargs)
            if not isinstance(out, torch.Tensor):  # x.shape, x.dtype...: no values are read
                return out
            # a property that gives a tensor (w.T, w.mT, w.H, w.data) reads its owner: a use of it
        for t in _tensors((args, kwargs)):
            name = tr.state_ids.get(id(t))
            if name is not None:
                tr.uses.setdefault(name, set()).add(seg)
                continue
            prod = tr.producer.get(id(t))
            if prod is not None and prod != seg:
                op = repr(getattr(func, "__name__", str(func)))
                op = f"{op}{' (in the loss)' if tr.in_after else ''} on {tr.describe(t)}"
                cuts = tr.crossed.get(id(t))
                if cuts:  # it crossed cut-points: a stage starting at one of them has it (received)
                    tr.carried_uses.add((prod, seg, op, tuple(sorted(cuts))))
                else:
                    tr.cross_uses.add((prod, seg, op))
        if tr.loss_outs and args and id(args[0]) in tr.loss_outs and _in_place(func):
            tr.loss_outs.pop(id(args[0])).out_id = None   # loss += aux: no longer the mean it was
        if not is_get:
            try:
                out = func(*args, **kwargs)
            except (NotImplementedError, RuntimeError):
                tr.failed_op = getattr(func, "__name__", str(func))
                raise
        if func in LOSS_FUNCS:
            if tr.pending_loss is None:
                tr.loss_calls.append(None)   # a loss call on_mixed did not read (no meta argument)
            else:
                tr.pending_loss.out_id = id(out)
                tr.loss_outs[id(out)] = tr.pending_loss
                tr.pending_loss = None
        outs = _tensors(out)
        tr.mark([t for t in outs if id(t) not in tr.state_ids], seg, getattr(func, "__name__", ""))
        tr.flops[seg] += _flops(func, args, kwargs, out)
        return out


def _buffer_versions(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{buffer name: (id of the tensor the module holds, its version counter)}`` (every name
    of a buffer held twice)."""
    return {name: (id(b), b._version) for name, b in model.named_buffers(remove_duplicate=False)}


def _unwritten(before: dict, after: dict, state_ids: dict[int, str]) -> tuple[set[str], set[str]]:
    """Canonical names of the buffers whose tensor is the same object at the same version
    (``_buffer_versions`` before and after the forward): read, never written in place or replaced;
    and of the others (written in place or replaced)."""
    changed = {name for name, v in before.items() if after.get(name) != v}
    canon = {name: state_ids.get(v[0], name) for name, v in before.items()}
    written = {canon[n] for n in changed}
    return {canon[n] for n in before} - written, written


def to_meta(obj: Any) -> Any:
    """Meta-device copies of every tensor in a (nested) tuple/list/dict, same dtype and shape."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj, device="meta")
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_meta(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_meta(v) for k, v in obj.items()}
    return obj


def loss_after(loss_fn: Callable[[Any, Any], Any] | None, targets: Any) -> Callable[[Any], Any] | None:
    """``trace_model``'s ``after`` that runs ``loss_fn(output, targets)`` (``targets``: one
    micro-batch's, as the engine gets them), so that the loss's uses of tensors made in earlier
    segments (an auxiliary output of the first block) are ``cross_uses`` of the last segment: the
    launcher's split check and every worker's stage map then see the same structure. None when the
    model computes its own loss (``loss_fn`` None). A loss that reads values (``float(x)`` to log
    it) is followed up to that read."""
    if loss_fn is None:
        return None

    def run(out: Any) -> Any:
        try:
            return loss_fn(out, targets)
        except WeightValueError:
            return None

    return run


def trace_model(meta_model: nn.Module, sample_inputs: ModelInputs,
                device: torch.device | str = "cpu", after: Callable[[Any], Any] | None = None,
                strict_dtypes: bool = False, targets: Any = None) -> ModelStructure:
    """Dry-run ``meta_model`` (its weights on the meta device) on ``sample_inputs``.

    Args:
        meta_model: the full model, every parameter on ``device="meta"``.
        sample_inputs: one micro-batch of model inputs — a tuple (positional, e.g. ``(idx,)`` with
            ``idx`` ``[micro_batch, seq_len]`` int64) or a mapping (keyword arguments). Real
            values: code that inspects them (mask helpers) sees what a real run sees.
        device: where the input-derived part runs (the workers' device; meta tensors report it).
        after: called with the model's output while the dry run's modes are still on (e.g. to run
            the loss on it: meta where it depends on weights, real where it depends on inputs);
            what it returns is taken as the loss (``loss_items``).
        targets: the micro-batch's targets that ``after`` compares with, if any (where the loss's
            items may be counted: ``model.loss_items``).
        strict_dtypes: refuse, as a real device would, a matrix product or convolution of floating
            operands of different dtypes (float64 data, float32 weights); off under autocast.

    Returns a ``ModelStructure``. Raises ``RuntimeError`` naming the segment when the forward reads
    a value that depends on the weights (``.item()`` or ``if`` on an activation) or uses an
    operation the meta device lacks.
    """
    trace = _Trace(meta_model)
    trace.strict_dtypes = strict_dtypes
    inputs = to_device(as_inputs(sample_inputs), device)
    trace.input_storages = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    was_training = meta_model.training
    meta_model.train()
    try:
        # the dry run is no training forward: real state it updates in place (a BatchNorm's
        # num_batches_tracked, made on the CPU even under the meta recorder) is put back after it.
        # MetaAsDevice on top: it answers device queries and moves mixed operations to meta; the
        # trace mode below it sees each operation as it runs (no mode active inside its handler)
        with restored(list(meta_model.buffers()) + list(meta_model.parameters()), always=True), \
                observe_cutpoints(trace), \
                _TraceMode(trace), MetaAsDevice(device, on_mixed=trace.on_mixed):
            before = _buffer_versions(meta_model)
            out = call_model(meta_model, inputs)
            loss = out
            if after is not None:
                trace.in_after = True
                loss = after(out)
            read_only, written = _unwritten(before, _buffer_versions(meta_model), trace.state_ids)
    except WeightValueError as e:
        raise RuntimeError(f"the dry run failed in segment {trace.segment}: {e}") from None
    except (NotImplementedError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "meta" not in str(e):
            raise  # an ordinary error of the user's forward (shapes, dtypes): keep it as it is
        why = trace.data_on_meta() or (". The model's forward must not depend on values computed from its weights "
                                       "(no .item() or if/for on activations)")
        raise RuntimeError(f"the dry run with the weights on the meta device failed in segment {trace.segment}: "
                           f"{e}{why}") from e
    finally:
        meta_model.train(was_training)
    n = trace.segment + 1
    used = set(trace.uses)
    all_state = list(dict.fromkeys(list(trace.state_ids.values())))
    unused = [s for s in all_state if s not in used]
    state_segments = {name: sorted(segs) for name, segs in trace.uses.items()}
    for s in unused:
        state_segments[s] = [0]
    params = dict(meta_model.named_parameters())
    pbytes = [0] * n
    seg_modules: list[list[str]] = [[] for _ in range(n)]
    for name in trace.param_names:
        segs = state_segments[name]
        p = params[name]
        pbytes[segs[0]] += p.numel() * p.element_size()
        mod = trace.module_of.get(name, "")
        for s in segs:
            if mod not in seg_modules[s]:
                seg_modules[s].append(mod)
    return ModelStructure(
        num_segments=n,
        state_segments=state_segments,
        param_names=list(trace.param_names),
        unused=unused,
        crossings=trace.crossings,
        input_crossings=trace.input_crossings,
        segment_flops=[float(f) for f in trace.flops],
        segment_param_bytes=pbytes,
        cross_uses=sorted(trace.cross_uses),
        carried_uses=sorted(trace.carried_uses),
        segment_modules=seg_modules,
        embeddings=list(trace.embeddings.values()),
        random_ops=sorted(trace.random_ops),
        nonfinite_checks=sorted(trace.nonfinite_checks),
        read_only_buffers=sorted(read_only & used), written_buffers=sorted(written),
        loss_items=infer_loss_items(trace.loss_calls, loss, inputs, targets),
    )


def describe_segment(structure: ModelStructure, k: int) -> str:
    """Short human name of segment ``k`` from the modules it uses (for error messages)."""
    mods = [m for m in structure.segment_modules[k] if m] if k < len(structure.segment_modules) else []
    if not mods:
        return f"segment {k}"
    shown = ", ".join(mods[:3]) + (", …" if len(mods) > 3 else "")
    return f"segment {k} ({shown})"


def segment_costs(structure: ModelStructure) -> list[float]:
    """Relative training cost of each segment for balancing without a profile: forward FLOPs ×3
    (forward + backward ≈ 2× forward), floored so that no segment counts as free."""
    floor = max(structure.segment_flops) * 1e-3 if structure.segment_flops else 1.0
    return [3.0 * max(f, floor) if math.isfinite(f) else floor for f in structure.segment_flops]
