"""``Job(model=, loss=, data=, init=)`` turned into a job config and the callables shipped by
value: which argument takes what, the job's default name, and the check that a config holds
plain (YAML) values only.

Owns ``apply_overrides``, ``unshippable``, ``name_of`` and ``SHIP_HELP``. Imports ``config``,
``runner`` (``JobObjects``) and torch (only to refuse a built ``nn.Module``); must never import
the manager, the cluster or the dashboard.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ..config import JobConfig

_PLAIN = (type(None), bool, int, float, str)


def unshippable(value: Any, where: str) -> str | None:
    """Path of the first value in ``value`` (plain data expected) that is not YAML-plain."""
    if isinstance(value, _PLAIN):
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = unshippable(v, f"{where}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where} (key {k!r})"
            bad = unshippable(v, f"{where}.{k}")
            if bad:
                return bad
        return None
    return f"{where} = {value!r} ({type(value).__name__})"


SHIP_HELP = (
    "A job's config holds plain values only (it is YAML). Pass your own model, loss or dataset as "
    "Job(model=..., loss=..., data=...): a callable defined here is shipped by value, an import path "
    "'pkg.mod:fn' by reference.")


def name_of(obj: Any) -> str:
    """A job name from a model: its qualified name, or the last part of an import path."""
    if isinstance(obj, str):
        base = obj.split(":")[-1]
    else:
        base = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    clean = "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "-" for c in base).strip("-_") or "job"
    return clean[:48]


def apply_overrides(job: JobConfig, *, model: Any, loss: Any, data: Any, init: Any, ship_modules: tuple):
    """Put ``Job(model=, loss=, data=, init=)`` into ``job``; returns the ``JobObjects`` to ship
    by value (None when everything is named by import path or config). Raises ``TypeError``
    for a value of the wrong kind, saying what each argument takes."""
    from torch import nn

    from ..config import DataConfig, ModelConfig
    from ..runner import JobObjects

    objs = JobObjects(modules=tuple(ship_modules))
    if isinstance(model, nn.Module):
        raise TypeError(f"Job(model=...) got a built {type(model).__name__}; pass its class or a function that "
                        f"builds it (e.g. model=lambda: {type(model).__name__}(...)): each worker builds only its "
                        "own stage")
    if isinstance(model, ModelConfig):
        job.model = copy.deepcopy(model)
    elif isinstance(model, str) or callable(model):  # the config's call and loss settings still apply
        m = job.model
        job.model = ModelConfig(factory=model if isinstance(model, str) else None, loss=m.loss, inputs=m.inputs,
                                targets=m.targets, blocks=m.blocks, kwargs=dict(m.kwargs or {}))
        if not isinstance(model, str):
            objs.model = model
    elif model is not None:
        raise TypeError(f"Job(model=...) takes a class or function building the model, an import path "
                        f"'pkg.mod:fn', or a ModelConfig; got {type(model).__name__}")
    if isinstance(loss, str):
        job.model.loss = loss
    elif callable(loss):
        if objs.model is None:
            raise TypeError("Job(loss=<function>) ships the loss by value, which needs the model shipped by value "
                            "too (model=<class or function>); or name the loss by import path 'pkg.mod:fn'")
        objs.loss = loss
    elif loss is not None:
        raise TypeError(f"Job(loss=...) takes 'model', 'cross_entropy', an import path or a function; got "
                        f"{type(loss).__name__}")
    if isinstance(init, str):
        job.model.init = init
    elif callable(init):
        objs.init = init
    if isinstance(data, DataConfig):
        job.data = copy.deepcopy(data)
    elif isinstance(data, (str, Path)):
        job.data.path, job.data.corpus = str(data), None
    elif callable(data):
        objs.dataset = data
    elif data is not None:
        raise TypeError(f"Job(data=...) takes a path, a DataConfig or a function returning a Dataset; got "
                        f"{type(data).__name__}")
    return objs if (objs.model or objs.loss or objs.init or objs.dataset) else None

