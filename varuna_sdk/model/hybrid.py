"""Meta tensors that behave as if they were on the real device, next to real input tensors.

The dry run (``tracer``) and every stage after the first (``pipeline.engine``) run parts of the
user's forward on the ``meta`` device: the weights they do not hold have no values. Library code
in those parts often looks at *values* that depend only on the model's inputs — Hugging Face's
mask helpers check whether an attention mask is all ones or the position ids are packed, models
check token ids or build positions with ``torch.arange(..., device=x.device)``. A pure meta run
cannot answer those (``.item()`` on meta fails) and a fake-tensor run answers them differently
from the real run (libraries take their "tracing" branches), so the structure seen would not be
the structure that runs.

``MetaAsDevice(device)`` is the middle way: inputs stay real; an operation with any meta
argument runs on meta (real arguments and device arguments are moved to meta, except the CPU
sizes tensor of a packed-sequence operation, ``_CPU_SIZES_OPS``); an operation with only real
arguments runs for real; and a meta tensor *reports* ``device`` (``x.device``,
``x.is_cuda``, ``x.is_meta``…), so ``torch.arange(n, device=hidden.device)`` makes real
positions. Values derived from the inputs alone are therefore real and equal to those of the
real run, control flow on them takes the same branch, and values derived from weights stay meta
(reading one — ``.item()``, ``bool()`` — raises ``WeightValueError``).

Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_META = torch.device("meta")
_DEVICE_GET = torch.Tensor.device.__get__
_IS_META = torch.Tensor.is_meta.__get__
_IS_CUDA = torch.Tensor.is_cuda.__get__
_IS_CPU = torch.Tensor.is_cpu.__get__
_GET_DEVICE = torch.Tensor.get_device
_VALUE_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
                torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.__len__}


def _grouped_mm_on_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm`` (mixture-of-experts layers: Hugging Face's default experts kernel) for
    meta operands: a differentiable product of the same output shape, dtype and FLOPs. torch's meta
    kernel checks what its CUDA kernel needs (bf16 operands, 16-byte strides), while the real CPU
    kernel runs fp32 at any shape. Shapes follow ``torch.nn.functional.grouped_mm``: 2-D × 3-D
    (``offs`` groups the rows: tokens by expert) -> ``(M, N)``; 3-D × 2-D -> ``(M, N)``; 2-D × 2-D
    (``offs`` groups K) -> ``(G, M, N)``; 3-D × 3-D -> ``(G, M, N)``."""
    a, b = mat_a.to(_META), mat_b.to(_META)
    if a.dim() == 2 and b.dim() == 3:
        out = a @ b.sum(0)
    elif a.dim() == 3 and b.dim() == 2:
        out = a.sum(0) @ b
    elif a.dim() == 2:
        out = (a @ b).unsqueeze(0).expand(offs.size(0), -1, -1)
    else:
        out = torch.bmm(a, b)
    if bias is not None:
        out = out + bias.to(_META)
    return out.to(out_dtype or mat_a.dtype)


#: Operations whose meta kernel refuses what the real CPU kernel runs -> a meta stand-in
_META_STAND_INS = {torch._grouped_mm: _grouped_mm_on_meta}

#: Operations that take a CPU int64 tensor of *sizes* beside their data (packed sequences: the
#: ``lengths`` of ``pack_padded_sequence``, the ``batch_sizes`` a packed LSTM/GRU and
#: ``pad_packed_sequence`` read): their kernels, meta ones included, require it on the CPU and read
#: its values to shape the output. Computed from the data (``lengths`` is a field of the examples),
#: it is real, so it stays real beside meta data; the output's shape then follows the values, as in
#: the real run (never cached: a shape cache keys on shapes, not values).
_CPU_SIZES_OPS = frozenset(getattr(torch._C._VariableFunctions, n) for n in (
    "_pack_padded_sequence", "_pad_packed_sequence", "lstm", "gru", "rnn_tanh", "rnn_relu")
    if hasattr(torch._C._VariableFunctions, n))


def _to_meta_but_cpu_sizes(x: Any) -> Any:
    """``_to_meta``, except for a real CPU integer tensor (``_CPU_SIZES_OPS``' sizes): kept."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not x.is_floating_point() \
            and not x.is_complex() and x.dtype != torch.bool:
        return x
    return _to_meta(x)


class WeightValueError(RuntimeError):
    """The forward read the value of a tensor that depends on weights this process does not hold."""


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return x.to(_META)
    if isinstance(x, torch.device) and x.type != "meta":
        return _META
    return x


_SCALARS = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
            torch.memory_format)
_INPLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__ilshift__", "__irshift__", "__iand__", "__ixor__", "__ior__",
                              "__setitem__", "__delitem__", "__set__", "__delete__"})


def _leaf_key(x: Any) -> tuple | None:
    """What decides an operation's meta output about one argument: a tensor's dtype, shape and strides
    (on meta its values never matter: real arguments are moved to meta first), a scalar's type and value,
    a slice's parts; ``None`` for anything else (the operation is then not cached)."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape), tuple(x.stride()))
    t = type(x)
    if t in _SCALARS:
        return (t, x)
    if t is slice:
        parts = (_leaf_key(x.start), _leaf_key(x.stop), _leaf_key(x.step))
        return None if None in parts else (slice, parts)
    if t is torch.Size:
        return (t, tuple(x))
    return None


def _mutates(func: Any, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS or "out" in kwargs


class MetaShapeCache:
    """Output metadata (shape, strides, dtype) of the meta operations a stage's prefix runs, keyed by
    the operation and its arguments' metadata, so that running the segments before a stage costs a
    dictionary lookup per operation instead of a meta kernel (torch's meta kernels for elementwise
    operations are Python decompositions: ~0.2 ms an ``add`` on this CPU, against ~5 µs a lookup).

    A meta output depends only on its arguments' metadata (every argument is on meta when it runs), so
    a hit is exact. Not cached: operations that mutate an argument (``add_``, ``x[i] = …``, ``out=``),
    outputs that are not a tensor or a plain tuple/list of tensors, arguments of other types. A replayed
    output is a fresh meta tensor without ``requires_grad``, as the prefix's stubbed modules return
    (nothing runs backward through the prefix). At most ``max_entries`` entries (then it starts over)."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self.entries: dict[tuple, tuple] = {}
        self.hits = 0

    def key(self, func: Any, leaves: list, spec: Any, kwargs: dict) -> tuple | None:
        """The cache key of ``func`` on these flattened ``(args, kwargs)``; ``None`` when not cacheable."""
        if _mutates(func, kwargs):
            return None
        parts = []
        for x in leaves:
            k = _leaf_key(x)
            if k is None:
                return None
            parts.append(k)
        return (func, spec, torch.is_grad_enabled(), tuple(parts))

    def replay(self, key: tuple) -> Any:
        """Fresh meta tensors shaped as the recorded output of ``key``, or ``None`` on a miss."""
        rec = self.entries.get(key)
        if rec is None:
            return None
        self.hits += 1
        kind, metas = rec
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=_META) for shape, stride, dtype in metas]
        return outs[0] if kind is None else kind(outs)

    def record(self, key: tuple, out: Any, leaves: list) -> bool:
        """Remember ``out``'s metadata under ``key`` when it is a meta tensor or a tuple/list of them,
        none of them one of the arguments (``x.to(dtype)`` may return ``x`` itself); True if it did."""
        if isinstance(out, torch.Tensor):
            kind, ts = None, [out]
        elif type(out) in (tuple, list) and out and all(isinstance(t, torch.Tensor) for t in out):
            kind, ts = type(out), list(out)
        else:
            return False
        if not all(t.device.type == "meta" for t in ts) or any(t is x for t in ts for x in leaves):
            return False
        if len(self.entries) >= self.max_entries:
            self.entries.clear()
        self.entries[key] = (kind, [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in ts])
        return True


class MetaAsDevice(TorchFunctionMode):
    """Torch-function mode: meta tensors pose as tensors on ``device``; operations mixing meta and
    real tensors run on meta (see the module docstring); ``on_mixed(func, args, kwargs)``, if
    given, sees each such operation with its real arguments first. ``cache`` (a ``MetaShapeCache``
    kept across forwards, not with ``on_mixed``) replays the metadata of meta operations seen before
    instead of running their meta kernels. Use as a context manager; ``pop()``
    leaves it in the middle of a forward (a stage reaching its own layers), ``pop`` again and
    ``__exit__`` are then no-ops."""

    def __init__(self, device: torch.device | str, on_mixed=None, cache: MetaShapeCache | None = None):
        super().__init__()
        if cache is not None and on_mixed is not None:
            raise ValueError("MetaAsDevice: a cache skips the operations on_mixed must see; give one or the other")
        self.device = torch.device(device)
        self.on_mixed = on_mixed  # (func, args, kwargs) of each operation run on meta, before moving
        self.cache = cache
        self._on = False

    def __enter__(self):
        self._on = True
        return super().__enter__()

    def __exit__(self, *exc):
        if self._on:
            self._on = False
            return super().__exit__(*exc)
        return None

    def pop(self) -> None:
        """Leave the mode now (it must be the innermost torch-function mode)."""
        if self._on:
            self._on = False
            super().__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GET:
            return self.device if _is_meta(args[0]) else func(*args)
        if func == _IS_META:
            return False
        if func == _IS_CUDA:
            return self.device.type == "cuda" if _is_meta(args[0]) else func(*args)
        if func == _IS_CPU:
            return self.device.type == "cpu" if _is_meta(args[0]) else func(*args)
        if func is _GET_DEVICE and args and _is_meta(args[0]):
            return -1 if self.device.type == "cpu" else (self.device.index or 0)
        leaves, spec = tree_flatten((args, kwargs))
        if not any(_is_meta(t) for t in leaves):
            return func(*args, **kwargs)
        sizes_op = func in _CPU_SIZES_OPS
        key = self.cache.key(func, leaves, spec, kwargs) if self.cache is not None and func not in _VALUE_READS \
            and not sizes_op else None
        if key is not None:
            out = self.cache.replay(key)
            if out is not None:
                return out
        if func in _VALUE_READS:
            t = next(x for x in leaves if _is_meta(x))
            raise WeightValueError(
                f"the forward reads the value of a {tuple(t.shape)} {t.dtype} tensor ({getattr(func, '__name__', func)}) "
                "computed from the model's weights. A pipeline stage runs the layers before its own without their "
                "weights, so only values computed from the inputs alone (masks, positions, token ids) may decide "
                "what the forward does; move such a check out of forward() or make it depend on the inputs")
        if self.on_mixed is not None:
            self.on_mixed(func, args, kwargs)
        func = _META_STAND_INS.get(func, func)
        move = _to_meta_but_cpu_sizes if sizes_op else _to_meta
        out = func(*tree_map(move, args), **tree_map(move, kwargs))
        if key is not None and self.cache.record(key, out, leaves):
            return self.cache.replay(key)  # the first call returns what every later one will
        return out
