"""Build a model on the meta device and materialise only the parameters one stage needs.

Initialisation is keyed by *name*: the module owning a parameter is initialised under a seed
derived from (seed, module name), so any stage map — P=1 or P=16 — gives bit-identical initial
weights. Tied parameters (one ``nn.Parameter`` reachable under several names) are materialised
once and re-tied, so every module that shares it sees the same tensor. The original built the
whole model on CPU in every process (varuna-original.md §9.2); here memory is spent on the
local stage only.

Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from .rng import derive_seed, forked_rng

InitFn = Callable[[nn.Module, str], None]


def build_on_meta(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """Call ``model_fn()`` with ``meta`` as the default device: no memory, no initialisation.

    Raises ``TypeError`` if ``model_fn`` does not return an ``nn.Module``.
    """
    with torch.device("meta"):
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
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

    ``init_fn(module, module_name)`` runs once per materialised module under a seed derived from
    ``(seed, module_name)``; it defaults to ``module.reset_parameters()``. Everything not named
    stays on the meta device. Raises ``KeyError`` for a name the model does not have.
    """
    init_fn = init_fn or default_init
    device = torch.device(device)
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


def local_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) of every materialised (non-meta) parameter, tied ones once."""
    return [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
