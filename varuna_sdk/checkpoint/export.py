"""The trained model out of a run's per-layer checkpoints: every parameter and buffer of the
newest complete checkpoint that reads whole (``read_model_state``: canonical names, the stage
shards of whatever P x D wrote it put back together), and that as the whole model's
``state_dict`` under every name the model gives it (``full_state_dict``: tied weights under each
of their names, non-persistent buffers left out) — the keys ``Job.initial_weights()`` has.

Files are read with ``load_verified`` (SHA-256 against the manifest, ``torch.load(weights_only=
True)``): a torn, incomplete, unsigned or altered checkpoint is never used — the next older one
is, and the one chosen is said. Optimizer state is not read.

Sits on ``checkpoint.store``/``checkpoint.stage`` and torch; never imports ``trainer``,
``manager``, ``runner`` or ``notebook``.
"""

from __future__ import annotations

import torch
from torch import nn

from .stage import load_verified
from .store import CheckpointError, CheckpointInfo, Store, complete_checkpoints


def read_model_state(url: str, key: bytes | None = None, skipped: list[tuple[str, str]] | None = None
                     ) -> tuple[CheckpointInfo, dict[str, torch.Tensor]]:
    """The model weights of the newest complete checkpoint in the store at ``url`` whose files all
    verify and load: ``(its CheckpointInfo, {canonical parameter/buffer name: CPU tensor})`` — one
    tensor per name, of the shape and dtype the model holds it in (the names are the model's
    ``named_parameters()``/``named_buffers()`` ones, a tied weight under its first name only;
    ``full_state_dict`` adds the others). ``info.step`` is the optimizer steps it holds.

    ``key``: ``manifest_key(job secret)`` to accept only manifests the job signed (None: checksums
    only). ``skipped`` (a list) receives ``(name, reason)`` of every newer checkpoint passed over.
    Raises ``CheckpointError`` when the store cannot be opened or holds no usable checkpoint
    (the message names each one skipped and why)."""
    passed: list[tuple[str, str]] = []
    for info in complete_checkpoints(url, key, passed):
        try:
            tensors = _tensors_of(info, key)
        except CheckpointError as e:
            passed.append((info.name, str(e)))
            continue
        if skipped is not None:   # the ones passed over before this one, as the docstring says
            skipped += passed
        return info, tensors
    if skipped is not None:
        skipped += passed
    why = "; ".join(f"{n} ({r[:200]})" for n, r in passed) if passed else "it holds none"
    raise CheckpointError(f"no usable checkpoint in {url!r}: {why}")


def _tensors_of(info: CheckpointInfo, key: bytes | None) -> dict[str, torch.Tensor]:
    store = Store(info.url, key)
    items = info.manifest.get("items")
    if not isinstance(items, dict) or not items:
        raise CheckpointError(f"checkpoint {info.name!r}: its manifest lists no parameters")
    loaded: dict[str, dict] = {}
    out: dict[str, torch.Tensor] = {}
    for name, entry in sorted(items.items()):
        fname = entry.get("tensor") if isinstance(entry, dict) else None
        if not isinstance(fname, str):
            raise CheckpointError(f"checkpoint {info.name!r}: its manifest lists no file for {name!r}")
        if fname not in loaded:
            loaded[fname] = load_verified(store, info, fname)
        payload = loaded[fname]
        t = None
        if isinstance(payload, dict):
            for part in ("params", "buffers"):
                held = payload.get(part)
                if isinstance(held, dict) and isinstance(held.get(name), torch.Tensor):
                    t = held[name]
                    break
        if t is None:
            raise CheckpointError(f"checkpoint {info.name!r}: file {fname!r} does not hold {name!r} (its manifest "
                                  "says it does)")
        out[name] = t
    return out


def full_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.state_dict()``'s keys, each with its value from ``tensors`` (``read_model_state``):
    a tied weight (one tensor under several names) gets the checkpoint's tensor under every name
    (separate copies); non-persistent buffers are left out, as ``state_dict`` leaves them. The
    model may be on the ``meta`` device (only its names, shapes and dtypes are read). Raises
    ``CheckpointError`` when the checkpoint lacks one of the model's tensors, holds names the model
    does not have, or a shape or dtype differs."""
    canon: dict[int, str] = {}
    for n, p in model.named_parameters():
        canon.setdefault(id(p), n)
    for n, b in model.named_buffers():
        canon.setdefault(id(b), n)
    wanted = model.state_dict(keep_vars=True)
    needed = {canon.get(id(t), k) for k, t in wanted.items()}
    extra = sorted(set(tensors) - set(canon.values()))
    missing = sorted(needed - set(tensors))
    if missing or extra:
        raise CheckpointError(f"the checkpoint does not fit this model: model-only names {missing[:5]}, "
                              f"checkpoint-only names {extra[:5]}")
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for k, t in wanted.items():
        name = canon.get(id(t), k)
        src = tensors[name]
        if src.shape != t.shape or src.dtype != t.dtype:
            raise CheckpointError(f"{k!r} is {src.dtype} {tuple(src.shape)} in the checkpoint but {t.dtype} "
                                  f"{tuple(t.shape)} in the model")
        out[k] = src.clone() if name in used else src
        used.add(name)
    return out
