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
argument runs on meta (real arguments and device arguments are moved to meta); an operation with
only real arguments runs for real; and a meta tensor *reports* ``device`` (``x.device``,
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


class MetaAsDevice(TorchFunctionMode):
    """Torch-function mode: meta tensors pose as tensors on ``device``; operations mixing meta and
    real tensors run on meta (see the module docstring); ``on_mixed(func, args, kwargs)``, if
    given, sees each such operation with its real arguments first. Use as a context manager; ``pop()``
    leaves it in the middle of a forward (a stage reaching its own layers), ``pop`` again and
    ``__exit__`` are then no-ops."""

    def __init__(self, device: torch.device | str, on_mixed=None):
        super().__init__()
        self.device = torch.device(device)
        self.on_mixed = on_mixed  # (func, args, kwargs) of each operation run on meta, before moving
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
        leaves, _ = tree_flatten((args, kwargs))
        if not any(_is_meta(t) for t in leaves):
            return func(*args, **kwargs)
        if func in _VALUE_READS:
            t = next(x for x in leaves if _is_meta(x))
            raise WeightValueError(
                f"the forward reads the value of a {tuple(t.shape)} {t.dtype} tensor ({getattr(func, '__name__', func)}) "
                "computed from the model's weights. A pipeline stage runs the layers before its own without their "
                "weights, so only values computed from the inputs alone (masks, positions, token ids) may decide "
                "what the forward does; move such a check out of forward() or make it depend on the inputs")
        if self.on_mixed is not None:
            self.on_mixed(func, args, kwargs)
        return func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
