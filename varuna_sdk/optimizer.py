"""The optimizer each stage steps: ``train.optimizer`` — a ``torch.optim`` class by its name
(``AdamW``, the default; ``SGD``, ``Adam``, ``RMSprop``, ``Adagrad``, ``NAdam``, ...) or an optimizer
class of one's own by import path (``mypkg.optim:Lion``, from the job's code folder or an installed
package) — built with ``train.optimizer_kwargs`` (``{momentum: 0.9, nesterov: true}``) on one
stage's trainable parameters in two groups, ``train.weight_decay`` on matrices (``p.dim() >= 2``:
weights, embeddings, kernels) and 0 on the rest (biases, norm weights), as the built-in AdamW
always was. The learning rate is ``train.lr``, set on every group before each step by its warm-up
and cosine decay (``trainer.lr_at``). A parameter's optimizer state (momentum, moments) is
checkpointed with it by name whatever the optimizer, so it moves with the parameter when a morph
changes the stages.

Owns ``optimizer_class``, ``optimizer_kwargs``, ``make_optimizer`` (used by the workers and by
``reference.plain_pytorch_losses``, so both step the same optimizer) and ``check_optimizer`` (the
settings tried on a two-parameter model before any work). Sits above ``jobspec`` (its
``import_object``); imports torch and the user's module only.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Iterable

import torch
from torch import nn

from .config import ConfigError, JobConfig
from .config.fields import near_names

#: the default: GPT-style AdamW
DEFAULT = "AdamW"
#: settings this SDK gives a built-in optimizer unless ``optimizer_kwargs`` sets them (torch's own
#: defaults for the rest): AdamW with betas (0.9, 0.95), as GPT-2/3 and nanoGPT train
DEFAULT_KWARGS: dict[str, dict[str, Any]] = {"AdamW": {"betas": (0.9, 0.95)}}
#: optimizer arguments that other settings give, and which settings
SET_ELSEWHERE = {"lr": "train.lr (warmed up over train.warmup_steps, then decayed to train.min_lr)",
                 "weight_decay": "train.weight_decay (applied to matrices only; 0 turns it off)",
                 "params": "nothing: each stage's optimizer gets that stage's parameters"}
#: torch optimizers a pipeline cannot step, and why
UNSUPPORTED = {"LBFGS": "it steps with a closure that re-runs the whole model's forward, which a stage cannot",
               "SparseAdam": "it takes sparse gradients only (nn.Embedding(sparse=True)), which the pipeline's "
                             "gradient all-reduce does not make"}


def _torch_optimizers() -> dict[str, type]:
    """``torch.optim``'s optimizer classes by name."""
    out = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            out[name] = obj
    return out


def optimizer_class(name: str) -> type:
    """The optimizer class ``train.optimizer`` names: ``torch.optim``'s by its name (any case:
    ``sgd`` is ``SGD``), or the class at an import path ``package.module:Class``. Raises
    ``ConfigError`` for an unknown name (with the closest ones), an import path that cannot be
    imported (``jobspec.import_object``'s words), something that is no ``torch.optim.Optimizer``
    subclass, and ``LBFGS``/``SparseAdam`` (``UNSUPPORTED``)."""
    known = _torch_optimizers()
    if ":" in name:
        from .jobspec import import_object

        cls = import_object(name)
        if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"train.optimizer={name!r} is {type(cls).__name__ if not inspect.isclass(cls) else 'a class'} "
                              "that is no torch.optim.Optimizer subclass; name an optimizer class (its constructor "
                              "takes the parameters first, then its settings from train.optimizer_kwargs)")
    else:
        by_lower = {k.lower(): k for k in known}
        if name.lower() not in by_lower:
            near = near_names(name, list(known), n=2)
            raise ConfigError(f"train.optimizer={name!r} is no torch.optim optimizer"
                              + (f" (did you mean {' or '.join(near)}?)" if near else "")
                              + f"; give one of {sorted(known)}, or the import path of a class of your own "
                              "('mypkg.optim:Lion')")
        cls = known[by_lower[name.lower()]]
    why = UNSUPPORTED.get(cls.__name__) if cls.__module__.startswith("torch.optim") else None
    if why:
        raise ConfigError(f"train.optimizer={name!r}: {cls.__name__} cannot train a pipeline: {why}; use another "
                          "(AdamW, SGD, Adam, ...)")
    return cls


def optimizer_kwargs(job: JobConfig) -> dict[str, Any]:
    """The keyword arguments the optimizer class is built with besides the parameters and
    ``lr``: ``DEFAULT_KWARGS`` of a built-in one, overridden by ``train.optimizer_kwargs``.
    Raises ``ConfigError`` for a key another setting gives (``lr``, ``weight_decay``: ``SET_ELSEWHERE``)."""
    t = job.train
    given = dict(t.optimizer_kwargs or {})
    for key, where in SET_ELSEWHERE.items():
        if key in given:
            raise ConfigError(f"train.optimizer_kwargs sets {key}={given[key]!r}; {key} is set by {where}")
    cls = optimizer_class(t.optimizer)
    base = DEFAULT_KWARGS.get(cls.__name__, {}) if cls.__module__.startswith("torch.optim") else {}
    out = {**base, **given}
    for k, v in out.items():   # YAML has no tuples: betas: [0.9, 0.95] is torch's (0.9, 0.95)
        if isinstance(v, list):
            out[k] = tuple(v)
    return out


def _takes(cls: type, name: str) -> bool:
    """Whether ``cls``'s constructor takes keyword ``name`` (or any keyword)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def make_optimizer(params: Iterable[nn.Parameter], job: JobConfig) -> torch.optim.Optimizer:
    """``train.optimizer`` on ``params`` (one stage's, or the whole model's in plain PyTorch;
    frozen ones, ``requires_grad=False``, left out), in two groups: ``train.weight_decay`` on
    those with ``dim() >= 2``, 0.0 on the rest (an optimizer that takes no ``weight_decay`` gets
    none when ``train.weight_decay`` is 0), ``lr=train.lr``. Raises ``ConfigError`` as
    ``optimizer_class``/``optimizer_kwargs`` do, and naming the settings when the class refuses them."""
    t = job.train
    cls = optimizer_class(t.optimizer)
    kwargs = optimizer_kwargs(job)
    trainable = [p for p in params if p.requires_grad]
    decay, rest = [p for p in trainable if p.dim() >= 2], [p for p in trainable if p.dim() < 2]
    if _takes(cls, "weight_decay"):
        groups: list[dict] = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    elif t.weight_decay:
        raise ConfigError(f"train.optimizer={t.optimizer!r} takes no weight_decay, but train.weight_decay="
                          f"{t.weight_decay:g}; set train.weight_decay: 0 (or use an optimizer with weight decay)")
    else:
        groups = [{"params": decay}, {"params": rest}]
    try:
        return cls(groups, lr=t.lr, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"train.optimizer={t.optimizer!r} refused its settings (lr={t.lr:g}, "
                          f"train.optimizer_kwargs={dict(t.optimizer_kwargs or {})!r}): {e}") from None


def check_optimizer(job: JobConfig) -> None:
    """Build ``train.optimizer`` with its settings on a two-parameter model (a 2 × 2 matrix and a
    bias) and step it once on finite gradients, before any work, so a misspelt name, a setting the
    class does not take or a value it refuses is said now, naming the setting. Raises ``ConfigError``."""
    w, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.zeros(2))
    opt = make_optimizer([w, b], job)
    w.grad, b.grad = torch.full_like(w, 0.5), torch.full_like(b, 0.5)
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - the user's optimizer class: say what it did, in one line
        raise ConfigError(f"train.optimizer={job.train.optimizer!r} failed its first step on a test parameter "
                          f"({type(e).__name__}: {e}); an optimizer must step with opt.step() and no closure") from None
    if not all(math.isfinite(float(x)) for p in (w, b) for x in p.detach().flatten()):
        raise ConfigError(f"train.optimizer={job.train.optimizer!r} with train.optimizer_kwargs="
                          f"{dict(job.train.optimizer_kwargs or {})!r} made a test parameter non-finite in one step")
