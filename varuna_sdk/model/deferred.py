"""Deferred initialisation: build the whole model on the ``meta`` device while recording every
tensor operation its constructor runs, then replay — for one stage — only the operations that
produce that stage's parameters and buffers, on the real device.

So a worker's initial weights and buffers are what the model's *own* constructor computes
(``nn.Linear``'s Kaiming-uniform, a custom LayerNorm's ``torch.ones``, a rotary ``inv_freq``
table, a Hugging Face model's ``_init_weights``), while memory and time are spent on the local
stage only. The idea is torchdistx's ``deferred_init``; this is a small, self-contained
version at the ATen level (a ``TorchDispatchMode``), keyed by storage so that views, in-place
initialisers (``normal_``, ``fill_``, ``copy_``) and tied parameters are followed exactly.

Random initialisers are re-seeded per recorded operation from ``(seed, operation index)``:
the operation index is the same in every process (each builds the whole model on meta in the
same order), so every (P, D) starts from bit-identical weights. ``exact=True`` replays every
operation in order under the caller's RNG instead: the result then equals a plain
``torch.manual_seed(s); model_fn()`` on that device bit for bit (the tests check it).

A parameter or buffer that the constructor created with ``torch.empty`` and never filled is an
error naming it (``UninitializedError``) — never silently garbage (third-party-models.md).

Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .rng import derive_seed, forked_rng

# ops that allocate without defining values
_EMPTY = frozenset({"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
                    "aten::empty_like", "aten::empty_permuted"})


class UninitializedError(ValueError):
    """A parameter or buffer has no value: nothing in the model's constructor filled it."""


def _skey(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _alias(x: Any) -> Any:
    """A meta tensor's alias (same storage, offset, sizes, strides; not recorded: called inside the
    recording mode's handler), other values unchanged."""
    return x.detach() if _is_meta(x) else x


@dataclass
class _Op:
    func: Any                     # torch._ops.OpOverload
    args: tuple
    kwargs: dict
    outs: list[torch.Tensor]      # tensor outputs (meta)
    writes: frozenset[int]        # storages whose values it defines or changes
    reads: frozenset[int]         # storages of its meta tensor inputs
    defines: bool                 # False for allocations without values (empty...)
    random: bool


class ConstructionLog:
    """Every ATen operation on meta tensors run while a model was built (see the module
    docstring). ``replay`` computes any subset of the model's tensors on a real device."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self._known: set[int] = set()

    def record(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """Log one ATen operation ``func(*args, **kwargs) -> out`` (called by the recording dispatch mode) if it
        touches meta tensors: the storages it reads, those it defines or writes in place, whether it only allocates
        (``empty``) and whether it draws random numbers. Other operations are ignored."""
        flat_in, _ = tree_flatten((args, kwargs))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        metas_in = [t for t in flat_in if _is_meta(t)]
        metas_out = [t for t in outs if t.device.type == "meta"]
        if not metas_in and not metas_out:
            return
        schema = func._schema
        mutated: set[int] = set()
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in tree_flatten(v)[0]:
                    if _is_meta(t):
                        mutated.add(_skey(t))
        fresh = {_skey(t) for t in metas_out} - self._known
        self._known |= fresh | {_skey(t) for t in metas_in}
        # keep aliases of the meta tensors as they are now: a later ``p.data = new`` (Hugging Face pads
        # a tied bias that way) moves the tensor object to another storage, not what this op used
        args, kwargs = tree_map(_alias, args), tree_map(_alias, dict(kwargs))
        metas_out = [t.detach() for t in metas_out]
        self.ops.append(_Op(func=func, args=args, kwargs=kwargs, outs=metas_out,
                            writes=frozenset(fresh | mutated), reads=frozenset(_skey(t) for t in metas_in),
                            defines=schema.name not in _EMPTY,
                            random=torch.Tag.nondeterministic_seeded in func.tags))

    def _closure(self, need: set[int]) -> list[int]:
        """Indices of the operations that ``need``'s storages depend on, in recorded order."""
        chosen = []
        for i in range(len(self.ops) - 1, -1, -1):
            op = self.ops[i]
            if op.writes & need:
                chosen.append(i)
                need |= op.reads
        chosen.reverse()
        return chosen

    def replay(self, tensors: Mapping[str, torch.Tensor], device: torch.device | str, *, seed: int = 0,
               exact: bool = False) -> dict[str, torch.Tensor]:
        """Real values of ``tensors`` (name → the model's meta tensor) on ``device``.

        Replays only the recorded operations those tensors depend on (all of them, in order,
        under the caller's RNG, with ``exact``); random ones are seeded from ``(seed, index)``.
        Returns name → real tensor (same shape, strides, dtype). Raises ``UninitializedError``
        naming every tensor that no recorded operation gave a value, or that was not made while
        recording.
        """
        device = torch.device(device)
        need = {_skey(t) for t in tensors.values() if _is_meta(t)}
        chosen = list(range(len(self.ops))) if exact else self._closure(set(need))
        bases: dict[int, torch.Tensor] = {}
        defined: set[int] = set()

        def real(a: Any) -> Any:
            if _is_meta(a):
                base = bases.get(_skey(a))
                if base is None:
                    raise UninitializedError(
                        f"a {tuple(a.shape)} {a.dtype} tensor used by the model's constructor was not made while "
                        "it was recorded (made before the factory was called, e.g. a module-level tensor, or by a "
                        "call that hides its values from torch's dispatcher); make it inside the model factory, "
                        "or give the job an init function (Job(init=fn), model.init) that fills the weights")
                view = torch.empty(0, dtype=a.dtype, device=device)
                return view.set_(base.untyped_storage(), a.storage_offset(), a.size(), a.stride())
            if isinstance(a, torch.device) and a.type == "meta":
                return device
            return a

        cuda = device.type == "cuda"
        with torch.no_grad(), forked_rng():
            for i in chosen:
                op = self.ops[i]
                args, kwargs = tree_map(real, op.args), tree_map(real, op.kwargs)
                if "device" in kwargs and kwargs["device"] is not None and torch.device(kwargs["device"]).type == "meta":
                    kwargs["device"] = device
                if op.random and not exact:
                    s = derive_seed("init", seed, i)
                    torch.default_generator.manual_seed(s)
                    if cuda:
                        torch.cuda.default_generators[device.index or 0].manual_seed(s)
                    kwargs.pop("generator", None)
                out = op.func(*args, **kwargs)
                routs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                for m, r in zip(op.outs, routs):
                    bases.setdefault(_skey(m), r)
                if op.defines:
                    defined |= op.writes
        result, missing = {}, []
        for name, t in tensors.items():
            if not _is_meta(t):
                result[name] = t.to(device)
                continue
            k = _skey(t)
            if k not in bases or k not in defined:
                missing.append(name)
                continue
            result[name] = real(t)
        if missing:
            raise UninitializedError(
                f"{len(missing)} parameter(s)/buffer(s) have no initial value: {missing[:8]}"
                f"{' …' if len(missing) > 8 else ''}. The model's constructor made them with torch.empty and "
                "never filled them (a Hugging Face model leaves that to post_init/_init_weights). Fill them in "
                "__init__, or give the model spec an init_fn")
        return result


    def value_of(self, t: torch.Tensor) -> torch.Tensor:
        """The real value, on the CPU, of meta tensor ``t`` made while recording: the recorded
        operations it depends on replayed (random ones seeded from ``(0, index)``, the same in
        every process). For a constructor that reads a value it computed. Raises
        ``UninitializedError`` when nothing gave ``t`` a value."""
        try:
            return self.replay({"value": t}, "cpu")["value"]
        except UninitializedError:
            raise UninitializedError(
                f"the model's constructor reads the values of a {tuple(t.shape)} {t.dtype} tensor (tolist, item, "
                "float, int, bool or numpy) that it made with torch.empty and never filled") from None


_META = torch.device("meta")
#: Tensor methods that read values (a constructor's ``torch.linspace(0, rate, n).tolist()``)
_READS = frozenset({"tolist", "numpy", "item", "__float__", "__int__", "__bool__", "__index__", "__complex__"})


class _ReadsValues(TorchFunctionMode):
    """While recording, a read of a meta tensor's values (``_READS``) gets its real value
    (``ConstructionLog.value_of``), so a constructor that computes a schedule from tensors
    (Hugging Face's ConvNext, Swin, PVT... drop-path rates) builds as it does on a real device."""

    def __init__(self, log: ConstructionLog):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS and args and _is_meta(args[0]):
            with _disable_current_modes():
                return func(self.log.value_of(args[0]), *args[1:], **kwargs)
        if name in _FROM_DATA:
            made = _from_data(func, name, args, kwargs)
            if made is not None:
                return made
        return func(*args, **kwargs)


#: Functions that make a tensor from Python data (``torch.tensor([...], device=p.device)``, as
#: Hugging Face's RWKV initialiser does): on meta the values are dropped below any mode, so while
#: recording they are made on the CPU and moved to meta by a recorded copy (``_from_data``).
_FROM_DATA = frozenset({"tensor", "as_tensor", "new_tensor"})


def _from_data(func, name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A meta tensor made from Python data whose values a replay can give back: the tensor made on
    the CPU, then copied to meta by an operation the recorder logs (``aten::_to_copy``, its input a
    CPU constant). None when the call makes no meta tensor from data (the caller runs it as is)."""
    if name == "new_tensor":
        if len(args) < 2 or not _is_meta(args[0]) or isinstance(args[1], torch.Tensor):
            return None
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "meta":
            return None
        rest = {k: v for k, v in kwargs.items() if k != "device"}
        rest.setdefault("dtype", args[0].dtype)
        data, extra = args[1], args[2:]
    else:
        device = kwargs.get("device")
        if not args or isinstance(args[0], torch.Tensor) or device is None or torch.device(device).type != "meta":
            return None
        rest = {k: v for k, v in kwargs.items() if k != "device"}
        data, extra = args[0], args[1:]
    grad = bool(rest.pop("requires_grad", False))
    with _disable_current_modes():
        cpu = torch.tensor(data, *extra, **rest)
    out = cpu.to(_META)  # through the recording dispatch mode: logged with its CPU input
    return out.requires_grad_(grad) if grad else out


class _Recorder(TorchDispatchMode):
    """Runs every ATen operation on the meta device (a ``device`` argument, given or defaulted,
    becomes ``meta``) and records it. The process's default device is left alone, so libraries
    that skip their weight initialisation under ``torch.device("meta")`` (Hugging Face's
    ``init_weights``) run it, in their own order, and it is recorded too."""

    def __init__(self, log: ConstructionLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs or any(a.name == "device" and a.kwarg_only for a in func._schema.arguments):
            kwargs["device"] = _META
        out = func(*args, **kwargs)
        self.log.record(func, args, kwargs, out)
        return out


# ---- initialisers torch skips on meta tensors --------------------------------------------------
#: ``torch.nn.init`` functions that return at once for a meta tensor (no ATen operation to record:
#: ``trunc_normal_``'s rejection sampling, ``orthogonal_``'s QR, ``dirac_``, ``sparse_``) -> the
#: names of their arguments after the tensor, in order. While recording, a call of one on a meta
#: tensor becomes one ``varuna::nn_init`` operation, recorded and replayed like any other: on a real
#: device it runs torch's own function (random ones re-seeded per operation like the rest; a
#: ``generator`` argument is not kept).
_SKIPPED_ON_META = {"trunc_normal_": ("mean", "std", "a", "b"), "orthogonal_": ("gain",), "dirac_": ("groups",),
                    "sparse_": ("sparsity", "std")}
_INIT_DEFAULTS = {"trunc_normal_": (0.0, 1.0, -2.0, 2.0), "orthogonal_": (1.0,), "dirac_": (1.0,),
                  "sparse_": (0.0, 0.01)}
_TORCH_INIT = {name: getattr(torch.nn.init, name) for name in _SKIPPED_ON_META}
_TORCH_TRUNC = torch.nn.init._no_grad_trunc_normal_


@torch.library.custom_op("varuna::nn_init", mutates_args=("t",), tags=(torch.Tag.nondeterministic_seeded,))
def _nn_init(t: torch.Tensor, fn: str, args: list[float]) -> None:
    """``torch.nn.init.<fn>(t, *args)`` on a real tensor (the recorded form of a ``_SKIPPED_ON_META`` call)."""
    vals = [int(v) if name == "groups" else v for name, v in zip(_SKIPPED_ON_META[fn], args)]
    with torch.no_grad():
        _TORCH_INIT[fn](t, *vals)


@_nn_init.register_fake
def _(t: torch.Tensor, fn: str, args: list[float]) -> None:
    return None


def _recorded_init(fn: str) -> Callable:
    """``torch.nn.init.<fn>`` that, for a meta tensor, records one ``varuna::nn_init`` operation."""
    names = _SKIPPED_ON_META[fn]

    def init(tensor, *args, **kwargs):
        if not _is_meta(tensor):
            return _TORCH_INIT[fn](tensor, *args, **kwargs)
        kwargs.pop("generator", None)
        vals = list(_INIT_DEFAULTS[fn])
        for i, v in enumerate(args[:len(names)]):
            vals[i] = v
        for i, name in enumerate(names):
            if name in kwargs:
                vals[i] = kwargs[name]
        torch.ops.varuna.nn_init(tensor, fn, [float(v) for v in vals])
        return tensor
    return init


def _recorded_trunc(tensor, mean, std, a, b, generator=None):
    """``torch.nn.init._no_grad_trunc_normal_`` (what every ``trunc_normal_`` calls, also through a
    reference a library kept to ``torch.nn.init.trunc_normal_``) recording a meta tensor's call."""
    if not _is_meta(tensor):
        return _TORCH_TRUNC(tensor, mean, std, a, b, generator=generator)
    torch.ops.varuna.nn_init(tensor, "trunc_normal_", [float(mean), float(std), float(a), float(b)])
    return tensor


class _RecordedInits:
    """While entered, the ``_SKIPPED_ON_META`` initialisers record their meta calls: ``torch.nn.init``'s
    names, and the references Hugging Face's ``transformers.initialization`` keeps to them."""

    def __enter__(self) -> None:
        import sys

        self._saved: list[tuple[Any, str, Any]] = []
        hf = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
        targets = [(torch.nn.init, "_no_grad_trunc_normal_", _recorded_trunc)]
        for fn in ("orthogonal_", "dirac_", "sparse_"):
            targets.append((torch.nn.init, fn, _recorded_init(fn)))
        for holder, name, new in targets:
            self._saved.append((holder, name, getattr(holder, name)))
            setattr(holder, name, new)
        if isinstance(hf, dict):
            for fn in ("orthogonal_", "dirac_", "sparse_"):
                if fn in hf:
                    self._saved.append((hf, fn, hf[fn]))
                    hf[fn] = _recorded_init(fn)

    def __exit__(self, *exc: Any) -> None:
        for holder, name, old in reversed(self._saved):
            if isinstance(holder, dict):
                holder[name] = old
            else:
                setattr(holder, name, old)


_LOGS: "weakref.WeakKeyDictionary[nn.Module, ConstructionLog]" = weakref.WeakKeyDictionary()


class recording:
    """Context manager that records meta-tensor operations into ``log`` (see ``build_recorded``)."""

    def __init__(self, log: ConstructionLog):
        self.log = log
        self._mode = _Recorder(log)
        self._reads = _ReadsValues(log)
        self._inits = _RecordedInits()

    def __enter__(self) -> ConstructionLog:
        self._inits.__enter__()
        self._mode.__enter__()
        self._reads.__enter__()
        return self.log

    def __exit__(self, *exc: Any) -> None:
        self._reads.__exit__(*exc)
        self._mode.__exit__(*exc)
        self._inits.__exit__(*exc)


def build_recorded(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """``model_fn()`` with every tensor made on the ``meta`` device (no memory, no compute) and its
    constructor's tensor operations recorded (``construction_log(model)`` returns them). Raises
    ``TypeError`` if ``model_fn`` does not return an ``nn.Module``."""
    log = ConstructionLog()
    with recording(log):
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory must return an nn.Module, got {type(model).__name__}")
    model = _uncompiled(model)
    _LOGS[model] = log
    return model


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, with a warning: a stage
    runs part of the user's forward, which the whole model's compiled graph cannot; other models
    unchanged."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        warnings.warn(f"the model factory returned torch.compile({type(inner).__name__}); the pipeline trains the "
                      "module itself, uncompiled (each stage runs only part of its forward): return the module "
                      "without torch.compile", UserWarning, stacklevel=3)
        return inner
    return model


def construction_log(model: nn.Module) -> ConstructionLog | None:
    """The log recorded when ``model`` was built by ``build_recorded`` (None otherwise)."""
    return _LOGS.get(model)
