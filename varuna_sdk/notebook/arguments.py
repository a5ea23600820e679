"""``Job(model=, loss=, data=, init=)`` turned into a job config and the callables shipped by
value: which argument takes what, the job's default name, and the check that a config holds
plain (YAML) values only.

Owns ``apply_overrides``, ``unshippable``, ``name_of`` and ``SHIP_HELP``. Imports ``config``,
``runner`` (``JobObjects``) and torch (only to refuse a built ``nn.Module``); must never import
the manager, the cluster or the dashboard.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from ..config import JobConfig
from ..shipping import GIVEN_DATA

_PLAIN = (type(None), bool, int, float, str)
#: ``package.module:function``: a dataset factory named by import path (``data.dataset``), not a file
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


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


class GivenDataset:
    """``Job(data=ds)`` with a dataset object: the dataset factory that returns it (shipped by value
    with it, so keep such a dataset small — or pass a function that reads it on the worker)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.__qualname__ = f"{GIVEN_DATA}{type(dataset).__qualname__}"   # (for messages: "the tuple given as data=")

    def __call__(self) -> Any:
        """The dataset, as it was given."""
        return self.dataset


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
    elif isinstance(data, str) and _IMPORT_PATH.fullmatch(data) and not Path(data).exists():
        job.data.dataset, job.data.path, job.data.corpus = data, None, None   # "mypkg.data:make": a factory
    elif isinstance(data, (str, Path)):
        job.data.path, job.data.corpus = str(data), None
    elif callable(data):
        objs.dataset = data
    elif hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, (bytes, dict)):
        objs.dataset = GivenDataset(data)   # the dataset object itself travels with the job
    elif data is not None:
        raise TypeError(f"Job(data=...) takes a path, a DataConfig, a map-style Dataset (len and [i]) or a function "
                        f"returning one; got {type(data).__name__}" + _data_hint(data))
    return objs if (objs.model or objs.loss or objs.init or objs.dataset) else None


def _data_hint(data: Any) -> str:
    """How to give ``data`` (a container that is no map-style dataset) as one: ``""`` if unknown."""
    import collections.abc as abc

    name = type(data).__name__
    if hasattr(data, "dataset") and hasattr(data, "batch_size"):   # a torch DataLoader
        return (": give its dataset, Job(data=loader.dataset) — the job makes its own batches (global_batch, "
                "micro_batch_size) and stacks equal-shaped examples, so a collate_fn of your own is not taken: pad "
                "or crop the examples in the dataset's __getitem__")
    if isinstance(data, dict) and data and all(hasattr(v, "__len__") and hasattr(v, "__getitem__") and not
                                               isinstance(v, (str, bytes)) for v in data.values()):
        if name == "DatasetDict" or all(hasattr(v, "column_names") for v in data.values()):
            return f": give one split, e.g. Job(data=ds[{next(iter(data))!r}])"
        return (": a dict of columns is not a dataset of rows; give "
                "torch.utils.data.TensorDataset(*columns) (tensors), or datasets.Dataset.from_dict(columns), whose "
                "examples are dicts of the fields")
    iterable_dataset = any(c.__name__ == "IterableDataset" for c in type(data).__mro__)   # (torch's, datasets')
    if iterable_dataset or isinstance(data, abc.Iterator) or \
            isinstance(data, abc.Iterable) and not hasattr(data, "__getitem__"):
        return (": an iterable (a generator, an IterableDataset) has no index, and the job reads examples by index "
                "(so that every P x D, morph and resume trains the same ones): make it a list, "
                "list(itertools.islice(it, N)), or a map-style Dataset")
    return ""



#: Fields ``Job(**settings)`` does not take by name -> the Job argument that sets them
_NOT_SETTINGS = {("model", "factory"): "model=", ("model", "loss"): "loss=", ("model", "init"): "init=",
                 ("model", "by_value"): "model=", ("data", "by_value"): "data=", ("data", "dataset"): "data=",
                 ("train", "steps"): "steps="}
#: the built-in GPT-2 preset's shape: no setting of a model the user brings
_PRESET_ONLY = {"preset", "n_layer", "n_head", "n_embd", "dropout"}


def _settable(job: JobConfig) -> tuple[dict[str, list[tuple[str, str]]], dict[str, str]]:
    """Each settable field name (bare, and ``<section>_<name>``) -> the ``(section, field)`` pairs it
    names (two for ``seed``); and each name the Job takes as an argument instead -> that argument."""
    import dataclasses

    names: dict[str, list[tuple[str, str]]] = {}
    elsewhere: dict[str, str] = {}
    for section in dataclasses.fields(job):
        sub = getattr(job, section.name)
        if not dataclasses.is_dataclass(sub):
            names.setdefault(section.name, []).append(("", section.name))
            continue
        for f in dataclasses.fields(sub):
            arg = _NOT_SETTINGS.get((section.name, f.name))
            if arg is not None:
                elsewhere[f.name] = elsewhere[f"{section.name}_{f.name}"] = arg
                continue
            names.setdefault(f.name, []).append((section.name, f.name))
            names.setdefault(f"{section.name}_{f.name}", []).append((section.name, f.name))
    return names, elsewhere


def apply_settings(job: JobConfig, settings: dict[str, Any], own_model: bool = False) -> None:
    """Put ``Job(..., seq_len=64, global_batch=16, P=2, lr=3e-4)`` into ``job``: each keyword is a
    field of the config by its name (``seq_len`` is ``data.seq_len``), or ``<section>_<field>``
    where a name is in two sections (``data_seed``, ``train_seed``). The values are checked with
    the whole config afterwards (``JobConfig.validate``). ``own_model``: the job trains a model the
    user brings (the GPT-2 preset's ``n_layer``, ``n_embd``... do not apply to it). Raises
    ``TypeError`` for a keyword that names no field (with the likely one), two fields, a field
    another keyword also sets, or a field a Job argument sets (naming that argument), before
    anything starts."""
    from ..config.fields import fixed_hint, near_names

    names, elsewhere = _settable(job)
    seen: dict[tuple[str, str], str] = {}
    for key, value in settings.items():
        if key in elsewhere:
            raise TypeError(f"Job() got {key}={value!r}: pass it as Job({elsewhere[key]}...)")
        where = names.get(key)
        if where is None:
            bare = [n for n, w in names.items() if len(w) == 1 and n == w[0][1]]
            near = near_names(key, bare + list(elsewhere), n=2)
            near = [elsewhere.get(n, n) for n in near]
            fixed = fixed_hint(key)
            raise TypeError(f"Job() got the setting {key}={value!r}, which is no field of the job's config"
                            + (f" ({fixed})" if fixed else
                               f" (did you mean {' or '.join(dict.fromkeys(near))}?)" if near else "")
                            + "; a setting is a field's name (seq_len, global_batch, micro_batch_size, P, D, lr, "
                              "precision, checkpoint_every...) or <section>_<field> (data_seed), see "
                              "varuna_sdk.config.JobConfig")
        if len(where) > 1:
            both = " and ".join(f"{s}.{f}" for s, f in where)
            alts = " or ".join(f"{s}_{f}=" for s, f in where)
            raise TypeError(f"Job() got {key}={value!r}, which names both {both}; pass {alts}")
        section, field = where[0]
        if own_model and section == "model" and field in _PRESET_ONLY:
            raise TypeError(f"Job() got {key}={value!r}: model.{field} shapes the built-in GPT-2 preset, not a model "
                            "you bring; build yours with its own arguments, e.g. Job(model=lambda: MyModel(n_layer=3))")
        if (section, field) in seen:
            raise TypeError(f"Job() got both {seen[(section, field)]}= and {key}=, which set the same field "
                            f"{section}.{field}; pass one")
        seen[(section, field)] = key
        if (section, field) == ("train", "optimizer"):
            value = _optimizer_name(value)
        setattr(getattr(job, section) if section else job, field, copy.deepcopy(value))


def _optimizer_name(value: Any) -> Any:
    """``Job(optimizer=torch.optim.SGD)``: an optimizer class as ``train.optimizer`` names it —
    ``torch.optim``'s by its name, another by its import path (``mypkg.optim:Lion``); a string as
    it is. Raises ``TypeError`` for a class defined in the notebook or ``__main__`` (each worker
    imports the optimizer by name) and for a function or an optimizer already built."""
    import inspect

    import torch

    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"Job(optimizer=...) got a built {type(value).__name__}; pass its class or name "
                        f"(optimizer={type(value).__name__!r}) and its settings as optimizer_kwargs={{...}}: each "
                        "stage builds its own on its parameters")
    if inspect.isclass(value) and issubclass(value, torch.optim.Optimizer):
        if getattr(torch.optim, value.__name__, None) is value:
            return value.__name__
        if value.__module__ in ("__main__", "builtins") or "<locals>" in value.__qualname__:
            raise TypeError(f"Job(optimizer={value.__name__}) is defined in the notebook or the main script; every "
                            "worker imports the optimizer class by name: put it in a module of your code folder and pass "
                            f"optimizer='mymodule:{value.__name__}'")
        return f"{value.__module__}:{value.__qualname__}"
    raise TypeError(f"Job(optimizer=...) takes a torch.optim optimizer's name or class (optimizer='SGD', "
                    f"optimizer=torch.optim.SGD) or an import path 'mypkg.optim:Lion', with its settings as "
                    f"optimizer_kwargs={{'momentum': 0.9}}; got {type(value).__name__}")
