"""Build a model on the meta device and materialise only the parameters and buffers one stage
needs.

By default a stage's tensors get exactly what the model's own constructor computes
(``model.deferred``: the constructor's tensor operations are recorded on meta and the ones the
stage's tensors depend on are replayed on the real device, random initialisers seeded per
recorded operation), so any stage map — P=1 or P=16 — gives bit-identical initial weights *and*
buffers (rotary tables, masks), and a tensor nothing filled is an error naming it. With an
``init_fn`` (for a model too large to record once, or our own GPT-2 preset's scheme) the module
owning a parameter is initialised under a seed derived from (seed, module name) instead. Tied
parameters (one ``nn.Parameter`` reachable under several names) are materialised once and
re-tied, so every module that shares it sees the same tensor. The original built the whole
model on CPU in every process (varuna-original.md §9.2); here memory is spent on the local
stage only.

Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from .deferred import build_recorded, construction_log
from .rng import derive_seed, forked_rng

InitFn = Callable[[nn.Module, str], None]


def build_on_meta(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """Call ``model_fn()`` with every tensor made on the ``meta`` device (no memory, no compute),
    recording its constructor's tensor operations for ``materialize`` (``deferred.build_recorded``).

    ``nn.TransformerEncoder``'s nested-tensor fast path is turned off (``use_nested_tensor``): in
    eval mode with a padding mask it hands its layers a nested tensor, which cannot cross a
    cut-point; without it padded positions' outputs are computed instead of zeroed, which a loss or
    pooling that masks them does not see.

    Raises ``TypeError`` if ``model_fn`` does not return an ``nn.Module``.
    """
    model = build_recorded(model_fn)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False
    return model


def default_init(module: nn.Module, name: str) -> None:
    """Initialise a module's own parameters with its ``reset_parameters()``.

    Raises ``ValueError`` naming the module when it has parameters but no ``reset_parameters``.
    """
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        return
    own = [n for n, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"module {name or '<root>'} ({type(module).__name__}) has parameters {own} but no "
            "reset_parameters(); pass init_fn=(module, name) -> None that initialises them"
        )


def _owner_map(model: nn.Module) -> dict[int, tuple[str, str]]:
    """id(tensor) → (module name, attribute) of its canonical (first) owner."""
    owners: dict[int, tuple[str, str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()) + list(mod._buffers.items()):
            if p is not None:
                owners.setdefault(id(p), (mname, attr))
    return owners


def materialize(
    model: nn.Module,
    names: Iterable[str],
    *,
    seed: int,
    device: torch.device | str = "cpu",
    init_fn: InitFn | None = None,
) -> None:
    """Materialise, in place, the parameters and buffers whose canonical names are in ``names``
    (every module that owns one of them gets all its direct tensors) and initialise them.

    Without ``init_fn`` the values are the model's own constructor's (replayed from the log
    ``build_on_meta`` recorded; a model built otherwise falls back to each module's
    ``reset_parameters()``). ``init_fn(module, module_name)`` instead runs once per materialised
    module under a seed derived from ``(seed, module_name)``. Everything not named stays on the
    meta device. Raises ``KeyError`` for a name the model does not have, ``UninitializedError``
    naming the tensors the constructor never filled.
    """
    device = torch.device(device)
    log = construction_log(model) if init_fn is None else None
    if log is not None:
        _materialize_replayed(model, set(names), log, seed=seed, device=device)
        return
    init_fn = init_fn or default_init
    wanted = set(names)
    canonical: dict[str, torch.Tensor] = dict(model.named_parameters())
    canonical.update({n: b for n, b in model.named_buffers() if n not in canonical})
    missing = wanted - set(canonical)
    if missing:
        raise KeyError(f"model has no parameters or buffers named {sorted(missing)}")
    owners = _owner_map(model)
    wanted_ids = {id(canonical[n]) for n in wanted}
    modules = dict(model.named_modules(remove_duplicate=False))
    # every module holding a wanted tensor, under any of its names (tied copies included)
    todo: list[str] = []
    for mname, mod in modules.items():
        tensors = list(mod._parameters.values()) + list(mod._buffers.values())
        if any(t is not None and id(t) in wanted_ids for t in tensors) and mname not in todo:
            todo.append(mname)
    fresh: dict[tuple[str, str], torch.Tensor] = {}
    for mname in todo:
        mod = modules[mname]
        for attr, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                fresh[(mname, attr)] = p
                mod._parameters[attr] = new
        for attr, b in list(mod._buffers.items()):
            if b is not None and b.device.type == "meta":
                fresh[(mname, attr)] = b
                mod._buffers[attr] = torch.empty(b.shape, dtype=b.dtype, device=device)
    for mname in todo:
        with forked_rng():
            torch.manual_seed(derive_seed("init", seed, mname))
            with torch.no_grad():
                init_fn(modules[mname], mname)
    # re-tie: every holder of a shared tensor points at the canonical owner's new tensor
    for (mname, attr), old in fresh.items():
        owner = owners.get(id(old))
        if owner is None or owner == (mname, attr):
            continue
        omod = modules[owner[0]]
        src = omod._parameters.get(owner[1]) if owner[1] in omod._parameters else omod._buffers.get(owner[1])
        mod = modules[mname]
        if attr in mod._parameters:
            mod._parameters[attr] = src
        else:
            mod._buffers[attr] = src


def _materialize_replayed(model: nn.Module, wanted: set[str], log, *, seed: int, device: torch.device) -> None:
    """``materialize`` from the constructor's recorded operations: every holder of a wanted tensor
    (tied copies included) gets the one replayed tensor."""
    canonical: dict[str, torch.Tensor] = dict(model.named_parameters())
    canonical.update({n: b for n, b in model.named_buffers() if n not in canonical})
    missing = wanted - set(canonical)
    if missing:
        raise KeyError(f"model has no parameters or buffers named {sorted(missing)}")
    values = log.replay({n: canonical[n] for n in sorted(wanted)}, device, seed=seed)
    by_id = {id(canonical[n]): values[n] for n in wanted}
    made: dict[int, torch.Tensor] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()):
            if p is not None and id(p) in by_id:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(by_id[id(p)], requires_grad=p.requires_grad)
                mod._parameters[attr] = made[id(p)]
        for attr, b in list(mod._buffers.items()):
            if b is not None and id(b) in by_id:
                made.setdefault(id(b), by_id[id(b)])
                mod._buffers[attr] = made[id(b)]
