"""What a micro-batch looks like to the model, and the few pure helpers every part uses on it.

A model's **inputs** are either a tuple (positional arguments, ``model(*inputs)``) or a mapping
(keyword arguments, ``model(**inputs)``: ``{"input_ids": ..., "labels": ...}`` for a Hugging Face
model); their tensors have the batch as the leading dimension. **Targets** are what an external
loss compares the output with: a tensor, any nesting of tuples/lists/dicts of tensors, or
``None`` when the model computes its own loss. Non-tensor leaves (``None``, flags) pass through
unchanged.

Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

ModelInputs = Union[tuple, Mapping[str, Any]]


def as_inputs(x: Any) -> ModelInputs:
    """``x`` as model inputs: a mapping stays a mapping (a plain ``dict``), a list or tuple becomes a
    tuple, anything else (one tensor) a 1-tuple."""
    if isinstance(x, Mapping):
        return dict(x)
    if isinstance(x, (tuple, list)):
        return tuple(x)
    return (x,)


def call_model(model: nn.Module, inputs: ModelInputs) -> Any:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a tuple."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor leaf of ``obj``, in ``tree_flatten`` order."""
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def leading_dim(obj: Any) -> int | None:
    """The batch size (leading dimension) of the first tensor in ``obj`` (None: no tensor)."""
    for t in tensors_of(obj):
        return int(t.shape[0]) if t.dim() else None
    return None


def rows(obj: Any, a: int, b: int) -> Any:
    """Rows ``a:b`` of every tensor leaf (a view)."""
    return tree_map(lambda t: t[a:b] if isinstance(t, torch.Tensor) else t, obj)


def to_device(obj: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Every tensor leaf moved to ``device``."""
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, obj)


def shapes_key(obj: Any) -> tuple:
    """A hashable description of the tensor leaves' shapes and dtypes (and the structure)."""
    leaves, spec = tree_flatten(obj)
    return (str(spec),) + tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                                for t in leaves)
