"""How the fields of a job config fit together, checked after each field's own rule
(``check_fields``): the model section's shape, the data source, the checkpoint store, and the
batch identity of the parallel section (``global_batch`` = ``micro_batch_size`` × m × D, never × P).
Each ``validate_*`` raises ``ConfigError`` naming the field and the values that would work.

Imports only ``config.fields`` and ``config.sections`` from ``varuna_sdk`` (``config`` is the
bottom of the dependency graph); ``fsspec`` only inside ``validate_checkpointing``.
"""

from __future__ import annotations

from typing import Any

from .fields import ConfigError
from .sections import DataConfig, ModelConfig, ParallelConfig, TrainConfig, check_fields


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_import_path(v: Any) -> bool:
    if not isinstance(v, str) or v.count(":") != 1:
        return False
    mod, obj = v.split(":")
    return all(p.isidentifier() for p in mod.split(".")) and all(p.isidentifier() for p in obj.split("."))


def colon_hint(v: Any) -> str:
    """For a dotted name written without the colon of an import path (``mypkg.models.MLP``): the
    spelling meant, ``"; an import path puts ':' before the object: 'mypkg.models:MLP'"``; else ""."""
    if not isinstance(v, str) or ":" in v or v.count(".") < 1 or not all(p.isidentifier() for p in v.split(".")):
        return ""
    mod, obj = v.rsplit(".", 1)
    if _is_module(v):   # 'pkg.models' is a module itself: the object in it is missing, not the colon
        return f"; {v!r} is a module: an import path names an object in it after ':', e.g. {v + ':build'!r}"
    return f"; an import path puts ':' between the module and the object: {mod + ':' + obj!r}"


def _is_module(name: str) -> bool:
    """Whether ``name`` is an importable module (found without importing it; its parent packages
    are imported, as an import of it would)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def validate_model(m: ModelConfig) -> None:
    """Check the model section's shape (not the model itself: ``jobspec`` resolves and checks
    that); raise ``ConfigError`` saying what would work."""
    check_fields("model", m)
    named = [k for k in ("factory", "by_value") if getattr(m, k) is not None]
    if len(named) > 1:
        raise ConfigError("model.factory and model.by_value both name a model; keep one")
    if named and (m.preset is not None or any(getattr(m, k) is not None for k in ("n_layer", "n_head", "n_embd"))):
        raise ConfigError(f"model.{named[0]} names the model, so model.preset/n_layer/n_head/n_embd (GPT-2 preset "
                          "fields) do not apply; remove them, or pass such settings in model.kwargs")
    if m.factory is not None and not (isinstance(m.factory, str) and m.factory.strip()):
        raise ConfigError(f"model.factory={m.factory!r} must be an import path 'package.module:function' or a "
                          "registered model name")
    if m.loss is not None and m.loss not in ("model", "cross_entropy") and not _is_import_path(m.loss):
        raise ConfigError(f"model.loss={m.loss!r}; use null (automatic), model, cross_entropy, or an import path "
                          "'package.module:function' of (output, targets) -> scalar" + colon_hint(m.loss))
    if m.init is not None and not _is_import_path(m.init):
        raise ConfigError(f"model.init={m.init!r} must be null (the model's own constructor) or an import path "
                          "'package.module:function' of init_fn(module, name)" + colon_hint(m.init))


def keyword_problem(fn: Any, kwargs: dict, what: str, field: str) -> str | None:
    """Why calling ``fn(**kwargs)`` cannot work, from ``fn``'s signature, or ``None`` when the
    keywords fit (or the signature cannot be read, or takes ``**kwargs``): each keyword it does not
    take, with the likely one, and the parameters it takes with their defaults. ``what`` names the
    callable (``mypkg.models:build``), ``field`` the config field holding ``kwargs``
    (``model.kwargs``). Imports nothing (``inspect`` and ``difflib`` only)."""
    import difflib
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = [q for q in sig.parameters.values() if q.name != "self"]
    if any(q.kind is q.VAR_KEYWORD for q in params):
        return None
    named = [q for q in params if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)]
    names = [q.name for q in named]
    unknown = [k for k in kwargs if k not in names]
    if not unknown:
        return None
    parts = []
    for k in unknown:
        near = difflib.get_close_matches(str(k), [n for n in names if n not in kwargs] or names, n=1, cutoff=0.6)
        parts.append(f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    takes = ", ".join(q.name if q.default is q.empty else f"{q.name}={q.default!r}" for q in named)
    return (f"{field} gives {what} the keyword(s) {', '.join(parts)}, which it does not take; it takes "
            + (f"({takes})" if takes else "no keywords") + f": fix or remove the key in {field}")


def validate_data(d: DataConfig) -> None:
    """Check the data section's values; raise ``ConfigError`` saying what would work. (Whether
    the files exist and hold usable data is checked by ``jobspec`` before workers start.)"""
    check_fields("data", d)
    if d.dataset is not None and not _is_import_path(d.dataset):
        raise ConfigError(f"data.dataset={d.dataset!r} must be an import path 'package.module:function' returning a "
                          "torch.utils.data.Dataset" + colon_hint(d.dataset))


def validate_checkpointing(t: TrainConfig) -> None:
    """Check the checkpoint fields of ``train``; raise ``ConfigError`` saying what would work.

    ``checkpoint_every`` an integer >= 0 (0 = automatic, see ``TrainConfig``), ``keep_checkpoints`` >= 1, ``resume`` a bool,
    ``checkpoint_url`` ``None``, a path, or a URL whose scheme fsspec knows (and whose driver is
    installed, e.g. ``s3fs`` for ``s3://``).
    """
    check_fields("train", t)
    url = t.checkpoint_url
    if url is None:
        return
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"train.checkpoint_url={url!r} must be a path or an fsspec URL (e.g. "
                          "'/shared/ckpt', 'file:///shared/ckpt', 's3://bucket/job'), or null for "
                          "<run folder>/checkpoints")
    if "://" in url:
        import fsspec

        scheme = url.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(scheme)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"train.checkpoint_url={url!r}: fsspec cannot open {scheme}:// URLs ({e}); "
                              "install its driver or use a path or file:// URL") from None


def validate_parallel(p: ParallelConfig) -> None:
    """Check the batch identity and the parallel shape; raise ``ConfigError`` with valid choices.

    Rules: P >= 1, D >= 1, micro_batch_size >= 1, policy known, and ``global_batch`` divisible
    by ``micro_batch_size × D`` (so m is a whole number; P plays no part).
    """
    if p.micro_batch_size is None:   # said with what null would have meant, before the field's own rule
        raise ConfigError("parallel.micro_batch_size=None must be an integer >= 1" + (
            ": with P or D null the first plan chooses the micro-batch size itself and this one only sizes "
            "the dry run, so any size the global batch allows will do (e.g. 1)" if p.planned else
            " (the examples of each micro-batch); null would let the planner choose only with P or D null"))
    check_fields("parallel", p)   # P and D may be null: chosen by the planner
    if p.split_backward and p.policy != "varuna":
        raise ConfigError(
            f"parallel.split_backward=true applies to the varuna policy only (policy={p.policy!r} runs its "
            "backward whole, as published); set split_backward to false or null, or policy to 'varuna'"
        )
    caps = p.max_in_flight
    if caps is not None and any(caps if isinstance(caps, list) else [caps]) and p.policy != "varuna":
        raise ConfigError(f"parallel.max_in_flight applies to the varuna policy only (policy={p.policy!r} holds "
                          "what it publishes); set it to null, or policy to 'varuna'")
    if p.planned:
        return
    for name, per in (("recompute", p.recompute), ("max_in_flight", p.max_in_flight)):
        if isinstance(per, list) and len(per) != p.P:
            raise ConfigError(f"parallel.{name} lists {len(per)} stages but P={p.P}; give one entry per stage, or "
                              f"null{' (or true/false for every stage)' if name == 'recompute' else ' (or one integer for every stage)'}")
    if p.boundaries is not None and len(p.boundaries) != p.P:
        raise ConfigError(
            f"parallel.boundaries has {len(p.boundaries)} stages but P={p.P}; give one list of segment "
            "indices per stage, or null to balance automatically"
        )
    B, b, D = p.global_batch, p.micro_batch_size, p.D
    if B % D:
        valid_d = [d for d in _divisors(B) if d <= max(64, D)]
        near = sorted({(B // D) * D, (B // D + 1) * D} - {0})
        raise ConfigError(
            f"global batch {B} is not divisible by D={D} replicas, so replicas would get unequal shares. "
            f"Valid D for global batch {B}: {valid_d}; or keep D={D} with global batch {' or '.join(map(str, near))}"
        )
    if (B // D) % b:
        valid_b = _divisors(B // D)
        raise ConfigError(
            f"each replica gets {B // D} examples (global batch {B} / D={D}), which micro_batch_size={b} "
            f"does not divide. Valid micro-batch sizes: {valid_b}"
        )
