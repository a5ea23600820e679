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

The optimizer must update each parameter from its own gradient and state, as torch's do: one
that reads sums over all its parameters (a global norm of its own) or keeps state per parameter
group (Prodigy's ``d``) sees only its stage's parameters at P > 1 (warned about where detectable).

Owns ``optimizer_class``, ``optimizer_kwargs``, ``make_optimizer`` (used by the workers and by
``reference.plain_pytorch_losses``, so both step the same optimizer), ``check_optimizer`` (the
settings tried on a two-parameter model before any work), ``check_state_carries_over`` (a
continued run's changed settings tried on the state the old ones keep) and ``state_factor`` (the
state's bytes per parameter byte, for the planner's memory model). Sits above ``jobspec`` (its
``import_object``); imports torch and the user's module only.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Iterable

import warnings

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
                             "gradient all-reduce does not make",
               "Muon": "it takes matrices only, and every stage's optimizer holds its biases and norm weights too"}


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
            near = near_names(name, list(known), n=2) or [by_lower[x] for x in difflib.get_close_matches(
                name.lower(), list(by_lower), n=2, cutoff=0.5)]
            raise ConfigError(f"train.optimizer={name!r} is no torch.optim optimizer"
                              + (f" (did you mean {' or '.join(near)}?)" if near else "")
                              + f"; give one of {sorted(k for k in known if k not in UNSUPPORTED)}, or the import "
                              "path of a class of your own "
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


def _check_types(cls: type, name: str, kwargs: dict[str, Any]) -> None:
    """Refuse a setting whose value is not of the kind the constructor's default is: a flag
    (``amsgrad: "no"``, a non-empty string, would turn it on), a number (``eps: "1e-6"``), or a
    pair of numbers (``betas: 0.9``, ``betas: [0.9]``). Settings without a default, or with
    ``None``, are left to the class. Raises ``ConfigError`` naming the setting."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return
    for key, v in kwargs.items():
        d = params[key].default if key in params else inspect.Parameter.empty
        where = f"train.optimizer_kwargs.{key}={v!r}"
        if isinstance(d, bool) and not isinstance(v, bool):
            raise ConfigError(f"{where} must be true or false ({name}'s {key} is a flag)")
        if isinstance(d, (int, float)) and not isinstance(d, bool) and (
                isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"{where} must be a number (e.g. {d!r}, {name}'s default)")
        if isinstance(d, tuple) and d and all(isinstance(x, (int, float)) for x in d) and (
                not isinstance(v, (tuple, list)) or len(v) != len(d)
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            raise ConfigError(f"{where} must be {len(d)} numbers, e.g. {list(d)} ({name}'s default)")


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
    _check_types(cls, t.optimizer, kwargs)
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
    except Exception as e:  # noqa: BLE001 - the class's own check of its settings (torch's or the user's)
        raise ConfigError(f"train.optimizer={t.optimizer!r} refused its settings (lr={t.lr:g}, "
                          f"train.optimizer_kwargs={dict(t.optimizer_kwargs or {})!r}): {type(e).__name__}: {e}") \
            from None


def _test_step(job: JobConfig, state: dict | None = None) -> tuple[torch.optim.Optimizer, list[str]]:
    """``train.optimizer`` built on a two-parameter model (a 2 × 2 matrix and a bias), given
    ``state`` (another optimizer's ``state_dict()["state"]``, as a checkpoint holds it) and stepped
    once on finite gradients; with the parameter-group entries the step added or changed (``lr``
    aside). Raises ``ConfigError`` saying what failed."""
    t = job.train
    w, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.zeros(2))
    opt = make_optimizer([w, b], job)
    w.grad, b.grad = torch.full_like(w, 0.5), torch.full_like(b, 0.5)
    settings = f"train.optimizer={t.optimizer!r} with train.optimizer_kwargs={dict(t.optimizer_kwargs or {})!r}"
    if state is not None:
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)
    before = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
              for g in opt.param_groups]
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - the user's optimizer class: say what it did, in one line
        if state is not None:
            raise ConfigError(f"{settings} cannot step from the optimizer state the run saved ({type(e).__name__}: "
                              f"{e}): the changed settings need state the run's optimizer did not keep") from None
        closure = "closure" in str(e) or (isinstance(e, TypeError) and "step()" in str(e))
        raise ConfigError(f"{settings} failed its first step on a test parameter ({type(e).__name__}: {e})"
                          + ("; an optimizer must step with opt.step() and no closure" if closure else "")) from None
    if not all(math.isfinite(float(x)) for p in (w, b) for x in p.detach().flatten()):
        raise ConfigError(f"{settings} made a test parameter non-finite in one step")
    moved = sorted({k for g, was in zip(opt.param_groups, before) for k, v in g.items()
                    if k not in ("params", "lr") and (k not in was or not _same(v, was[k]))})
    return opt, moved


def check_optimizer(job: JobConfig) -> None:
    """Build ``train.optimizer`` with its settings on a two-parameter model and step it once on
    finite gradients, before any work, so a misspelt name, a setting the class does not take or a
    value it refuses is said now, naming the setting. An optimizer that keeps state per parameter
    group (Prodigy's ``d``, a step count of its own) is warned about where the job may run P > 1
    stages: each stage's optimizer has its own groups, so that state differs from plain PyTorch's.
    Raises ``ConfigError``."""
    _, moved = _test_step(job)
    if moved and job.parallel.P != 1:
        warnings.warn(f"train.optimizer={job.train.optimizer!r} keeps state in its parameter groups ({', '.join(moved)}"
                      "): at P > 1 each stage's optimizer holds its own groups and updates that state from its own "
                      "parameters only, so the job's losses differ from plain PyTorch's, and a continued run starts "
                      "that state from stage 0's; set parallel.P: 1 (any D) for plain PyTorch's", stacklevel=3)


def _same(a: Any, b: Any) -> bool:
    """Whether two parameter-group values are equal (tensors by value)."""
    try:
        return bool(a == b) if not isinstance(a, torch.Tensor) else bool(torch.equal(a, b))
    except Exception:  # noqa: BLE001 - values that cannot be compared: count as changed
        return False


def state_factor(job: JobConfig) -> float:
    """Bytes of optimizer state per byte of parameters that ``train.optimizer`` keeps (AdamW: 2.0,
    its two moments; with ``amsgrad`` 3.0; SGD with momentum 1.0, without 0.0; Adafactor's factored
    moments less than 1), read off the state of one test step on a 16 × 16 matrix and a bias (its
    per-parameter scalars, a step count, left out): the planner's memory model (paper §4.4).
    Raises ``ConfigError`` as ``check_optimizer`` does."""
    w, b = nn.Parameter(torch.ones(16, 16)), nn.Parameter(torch.zeros(16))
    opt = make_optimizer([w, b], job)
    w.grad, b.grad = torch.full_like(w, 0.5), torch.full_like(b, 0.5)
    opt.step()
    state = sum(v.numel() * v.element_size() for p in (w, b) for v in opt.state.get(p, {}).values()
                if isinstance(v, torch.Tensor) and v.numel() > 1)
    return state / sum(p.numel() * p.element_size() for p in (w, b))


def check_state_carries_over(old: JobConfig, new: JobConfig) -> None:
    """Refuse, before any work, to continue a run whose optimizer settings changed so that the state
    it saved cannot be stepped (Adam's ``amsgrad`` turned on needs ``max_exp_avg_sq``, RMSprop's
    ``momentum`` a ``momentum_buffer``): the old settings' state after one test step, loaded into
    the new settings' optimizer, must step. Raises ``ConfigError`` naming both settings."""
    state = _test_step(old)[0].state_dict()["state"]
    try:
        _test_step(new, state)
    except ConfigError as e:
        raise ConfigError(f"continuing the run with train.optimizer_kwargs={dict(new.train.optimizer_kwargs or {})!r} "
                          f"(the run trained with {dict(old.train.optimizer_kwargs or {})!r}) would fail at its "
                          f"first step: {e}. Continue with the run's settings, or start another run folder") from None
