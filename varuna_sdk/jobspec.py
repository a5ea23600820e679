"""The job layer's model and data: turn a ``JobConfig`` (plus what a notebook shipped by value)
into a ``model.spec.ModelSpec`` and the job's data, and check the two together — all before any
process starts, and again, identically, in every worker.

A model is named one of three ways (``config.ModelConfig``):

- a **registered** model (``MODELS``; ``register_model`` adds one): ``gpt2`` (our GPT-2 presets,
  the default), ``hf-causal-lm`` (any Hugging Face causal LM from a config:
  ``kwargs: {model_type: llama, hidden_size: 64, ...}``, random weights, nothing downloaded) and
  ``hf-masked-lm`` (the same for a masked LM: ``model_type: bert``, ``roberta``…; train it with
  ``data.mlm_probability``);
- an **import path** ``package.module:function`` in the user's code folder, called with
  ``kwargs`` — shipped *by reference*: the bootstrap syncs the folder to the VMs and each worker
  imports it there;
- a **callable shipped by value** (a class or function defined in a notebook cell or
  ``__main__``, and the user's own modules where asked): ``Job(model=...)`` packs it with
  cloudpickle into an objects file (``shipping``) that travels only inside the job spec — to
  local worker processes through the run folder, to the user's own VMs over the SSH/SFTP
  bootstrap — never over the heartbeat or metrics channels. A worker reads the file's header
  first and refuses to unpickle on a Python (major.minor), torch or cloudpickle mismatch, naming
  its VM and the versions (``ShippingError``).

Data (``config.DataConfig``) is the user's text, token file, ``datasets`` folder or column
files (``data.sources``), or a ``Dataset`` factory (import path or by value). ``resolve_job``
returns a ``ResolvedJob``: the spec, the data, how batches become model inputs, and the checks
that refuse bad data — token ids beyond the model's vocabulary, sequences longer than its
context, too little data, missing fields — naming the file or field and the fix.

Callables in a spec are picklable (``Imported``, ``shipping.ByValue``, ``Prepared``), so spawned
worker and calibration-probe processes receive them as they are.

Owns ``resolve_job``/``resolve_model``/``resolve_data``, ``ResolvedJob``, ``JobData``,
``check_together``, ``MODELS``/``register_model``/``Registered``, ``import_object``,
``Imported``, ``Prepared``, ``hf_causal_lm``. Sits above ``model``, ``data``, ``shipping`` and
``config``; below ``trainer`` and everything that launches; never imports ``pipeline``,
``cluster`` or ``manager``.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import inspect
import multiprocessing as mp
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from .config import ConfigError, JobConfig
from .config.checks import colon_hint
from .data.loader import (LM_FIELDS, BatchLoader, ExampleLoader, collate, eval_batches, example_eval_batches,
                          lm_fields, seeded_global_rngs, split_examples, train_val_split)
from .data.mlm import HELD_OUT, SAMPLE, TRAIN, MLMMasking, masking_for
from .data.sources import DataError, ExampleData, TokenData, check_tokens, open_examples, open_tokens
from .data.tokenizer import Tokenizer, get_tokenizer
from .model.materialize import build_on_meta
from .model.spec import (ModelSpec, ModelSpecError, UserLoss, check_target_ids, check_targets, cross_entropy, infer_call,
                         model_limits, positive_settings, prepare_model, warn_if_causal_with_masking)
from .model.hybrid import WeightValueError
from .model.tracer import ModelStructure, trace_model
from .pipeline.spawn import rerun_main_script
from .shipping import GIVEN_DATA, ByValue, ShippingError, code_sha256, find_objects

# ---- picklable callables ---------------------------------------------------------------------
def import_object(ref: str) -> Any:
    """The object at ``package.module:attr.path``, imported (the current folder and the user's
    code folder are on ``sys.path`` in workers). Raises ``ConfigError`` naming what is missing."""
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise ConfigError(f"{ref!r} is not an import path; write it as 'package.module:function'")
    mod_name, attr = ref.split(":")
    if mod_name.split(".")[0] in sys.stdlib_module_names:
        # a job config names the user's code; a standard-library callable (os:system ...) is never a
        # model, loss or dataset, and running it from a config file would run arbitrary commands
        raise ConfigError(f"{ref!r} names the standard library module {mod_name!r}; an import path in a job config "
                          "must name your own code (a module in the code folder or an installed package)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and not (mod_name == missing or mod_name.startswith(missing + ".")):
            # the module was found; something it imports is not installed
            raise ConfigError(f"importing {mod_name!r} for {ref!r} failed: it imports {missing!r}, which is not "
                              f"installed here ({e}); install it (on VMs too), or remove the import") from None
        raise ConfigError(f"cannot import {mod_name!r} for {ref!r}: {e}. The module must be importable from the "
                          f"working folder ({os.getcwd()}) or an installed package; on VMs the job's code folder "
                          "is synced and is the workers' working folder") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say where, once
        where = ""
        if not isinstance(e, SyntaxError):   # a SyntaxError says its file and line itself
            tb = e.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            if tb is not None:
                where = f" ({tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})"
        raise ConfigError(f"importing {mod_name!r} for {ref!r} raised {type(e).__name__}: {e}{where}; fix the "
                          "module (python -c 'import " + mod_name + "' shows the whole traceback)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            have = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))[:20]
            raise ConfigError(f"{mod_name!r} has no {part!r} (for {ref!r}); callables there: {have}")
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Imported:
    """A callable named by import path, imported on first call (pickles as the path)."""

    ref: str

    def __call__(self, *args, **kwargs):
        """Import the object at ``ref`` (``package.module:attr``) and call it with these arguments; returns its result.
        Raises ``ConfigError`` when ``ref`` cannot be imported."""
        return import_object(self.ref)(*args, **kwargs)


@dataclass(frozen=True)
class Prepared:
    """``factory(**kwargs)`` then ``model.spec.prepare_model`` (cache off, cut-points at ``blocks``)."""

    factory: Callable[..., nn.Module]
    kwargs: tuple[tuple[str, Any], ...] = ()
    blocks: str | tuple[str, ...] | None = None

    def __call__(self) -> nn.Module:
        """Build the model: ``factory(**kwargs)``, checked to be an ``nn.Module``, then ``prepare_model`` (cache off,
        cut-points at ``blocks``; paper §5.1). Raises ``ModelSpecError`` when the factory returns anything else or
        ``blocks`` names no block container."""
        model = self.factory(**dict(self.kwargs))
        if not isinstance(model, nn.Module):
            raise ModelSpecError(f"the model factory returned a {type(model).__name__}, not an nn.Module; it must "
                                 "build and return the whole model")
        return prepare_model(model, self.blocks)


# ---- registered models -----------------------------------------------------------------------
@dataclass
class Registered:
    """What a registered model contributes: its factory, loss (``None``: automatic), per-module
    ``init_fn`` (``None``: the constructor's own), name and identity."""

    factory: Callable[..., nn.Module]
    name: str
    identity: dict
    loss: Any = None
    init_fn: Any = None


RegisteredBuilder = Callable[[JobConfig, "Tokenizer | None"], Registered]
MODELS: dict[str, RegisteredBuilder] = {}


def register_model(name: str, builder: RegisteredBuilder) -> None:
    """Add a registered model: ``builder(job, tokenizer) -> Registered``, used when
    ``model.factory`` is ``name`` (or, for ``gpt2``, when no model is named). Raises ``ValueError``
    for a name that is taken or holds a ``:``."""
    if ":" in name or not name:
        raise ValueError(f"registered model names are plain words, got {name!r}")
    if name in MODELS:
        raise ValueError(f"a model named {name!r} is registered already")
    MODELS[name] = builder


def _vocab_size(job: JobConfig, tok: Tokenizer | None, kw: Mapping[str, Any], model: str) -> int:
    """The vocabulary of a registered model: ``model.kwargs.vocab_size``, else the tokenizer's.
    Raises ``ConfigError`` when there is neither (``data.tokenizer: null``)."""
    if "vocab_size" in kw:
        return kw["vocab_size"]
    if tok is None:
        given = job.model.preset is not None or job.model.factory is not None or bool(job.model.kwargs)
        raise ConfigError(f"{model} takes its vocabulary size from data.tokenizer, which is null: give data.tokenizer "
                          "(the one your examples' token ids come from) or model.kwargs.vocab_size"
                          + ("" if given else "; no model was given, so the built-in GPT-2 preset is used: to train "
                             "your own, give it (Job(model=...), model.factory in a config)"))
    return tok.vocab_size


#: how far data.seq_len may stretch a preset's context before the job is warned (position table, attention)
CONTEXT_STRETCH_WARN = 4


def _warn_if_context_grown(name: str, base: Any, cfg: Any) -> None:
    """Warn when ``data.seq_len`` makes the GPT-2 preset ``name``'s context (``base.block_size``)
    more than ``CONTEXT_STRETCH_WARN`` times longer in ``cfg``: its position table grows with it
    and each sequence's attention with its square, which a user meaning a typo does not expect."""
    T0, T = base.block_size, cfg.block_size
    if T <= CONTEXT_STRETCH_WARN * T0:
        return
    warnings.warn(f"data.seq_len={T} is {T / T0:.0f}x the context of the GPT-2 preset {name!r} ({T0} positions): "
                  f"the model is built with {T} positions, {cfg.num_parameters():,} parameters instead of "
                  f"{base.num_parameters():,}, and each sequence's attention costs {(T / T0) ** 2:,.0f}x the preset's "
                  f"(it grows with seq_len squared), so each step is far slower; set data.seq_len to at most {T0} "
                  "for the preset as it is, or model.kwargs.block_size to say the context you mean", UserWarning,
                  stacklevel=3)


def _gpt2_builder(job: JobConfig, tok: Tokenizer | None) -> Registered:
    from .model.gpt2 import GPT2Config, gpt2, init_gpt2, lm_loss, preset

    m = job.model
    kw = dict(m.kwargs or {})
    kw["vocab_size"] = _vocab_size(job, tok, kw, "model gpt2 (the preset)")
    name = kw.pop("preset", None) or m.preset or "cpu-demo"
    overrides = {k: v for k, v in (("n_layer", m.n_layer), ("n_head", m.n_head), ("n_embd", m.n_embd)) if v is not None}
    overrides.update(kw)
    base = preset(name)
    cfg: GPT2Config = preset(name, **{"dropout": m.dropout,
                                      "block_size": max(base.block_size, job.data.seq_len), **overrides})
    if "block_size" not in overrides:   # (a context the user set is the one meant)
        _warn_if_context_grown(name, preset(name, **{**overrides, "block_size": base.block_size}), cfg)
    return Registered(functools.partial(gpt2, cfg, False), name=f"GPT-2 {name}",
                      identity={"kind": "preset", "name": "gpt2", "gpt2": cfg.to_dict()},
                      loss=lm_loss, init_fn=functools.partial(init_gpt2, n_layer=cfg.n_layer))


#: Padding tokens looked up in a tokenizer.json: a Hugging Face model built from a config takes its id
#: as ``pad_token_id`` (unless model.kwargs set it), not the config class's default
PAD_TOKENS = ("[PAD]", "<pad>")
#: ``model.factory`` name of a Hugging Face model from a config → (the transformers Auto class that
#: builds it, its model-type table in ``transformers.models.auto.modeling_auto``, the head in words,
#: the ``loss_type`` transformers uses for it by default)
HF_HEADS = {"hf-causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-LM", "ForCausalLM"),
            "hf-masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked-LM", "ForMaskedLM")}


def hf_causal_lm(model_type: str, **config: Any) -> nn.Module:
    """A Hugging Face causal LM of ``model_type`` (``gpt2``, ``llama``, ``mistral``, ``qwen2``…)
    from a config with ``config`` overriding its defaults — random weights, nothing downloaded.
    Raises ``ConfigError`` for an unknown model type or config field."""
    return hf_model("hf-causal-lm", model_type, **config)


def hf_model(factory: str, model_type: str, **config: Any) -> nn.Module:
    """The Hugging Face model ``factory`` (a key of ``HF_HEADS``: causal or masked LM) of
    ``model_type`` from a config with ``config`` overriding its defaults — random weights, nothing
    downloaded. Raises ``ConfigError`` naming an unknown model type, a field the config does not
    know (with the likely one) or a model type that has no such head."""
    import transformers

    _check_hf_model_type(factory, model_type)
    try:
        cls = transformers.AutoConfig.for_model(model_type).__class__
    except ValueError as e:
        raise ConfigError(f"{factory}: {_short(str(e), 300)}") from None
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    unknown = sorted(set(config) - known)
    if unknown:
        hints = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        raise ConfigError(f"{factory}: {cls.__name__} has no field(s) {unknown}"
                          + "".join(f"; {k}: did you mean {h[0]!r}?" for k, h in hints.items() if h)
                          + " (a field it does not know would be ignored and the model built with its default)")
    defaults = cls()
    vocab = config.get("vocab_size", getattr(defaults, "vocab_size", None))
    # special-token defaults of a vocabulary it no longer has (GPT-2's 50256 with 256 byte ids): None,
    # given before the config is made (transformers warns of them as it makes one)
    dropped = {k: None for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k not in config
               and isinstance(getattr(defaults, k, None), int) and isinstance(vocab, int) and getattr(defaults, k) >= vocab}
    cfg = transformers.AutoConfig.for_model(model_type, **config, **dropped)
    try:
        model = getattr(transformers, HF_HEADS[factory][0]).from_config(cfg)
    except ValueError as e:   # e.g. a masked-LM head for a causal-only model type
        raise ConfigError(f"{factory}: {_short(str(e), 300)}") from None
    if getattr(model, "loss_type", "") is None:   # the loss transformers falls back to, named (it warns otherwise)
        model.loss_type = HF_HEADS[factory][3]
    return model


def _check_hf_model_type(factory: str, model_type: str) -> None:
    """Raise ``ConfigError`` unless transformers has a ``factory`` head (causal or masked LM) for
    ``model_type``: an unknown type with the likely one, or the other factory that has it and
    some model types that have this head."""
    from transformers.models.auto import configuration_auto, modeling_auto

    heads = {f: getattr(modeling_auto, table) for f, (_, table, *_) in HF_HEADS.items()}
    if model_type in heads[factory]:
        return
    if model_type not in configuration_auto.CONFIG_MAPPING_NAMES:
        near = difflib.get_close_matches(model_type, sorted(configuration_auto.CONFIG_MAPPING_NAMES), n=1)
        raise ConfigError(f"{factory}: transformers has no model_type {model_type!r}"
                          + (f"; did you mean {near[0]!r}?" if near else ""))
    other = [f for f, names in heads.items() if f != factory and model_type in names]
    some = ", ".join(list(heads[factory])[:12])
    head = {f: words for f, (_, _, words, _) in HF_HEADS.items()}
    raise ConfigError(f"{factory}: model_type {model_type!r} has no {head[factory]} head in transformers"
                      + (f" (it has a {head[other[0]]} head: use model.factory {other[0]})" if other else "")
                      + f"; model types that have one: {some}, …")


def _hf_builder(factory: str, job: JobConfig, tok: Tokenizer | None) -> Registered:
    import transformers

    kw = dict(job.model.kwargs or {})
    if "model_type" not in kw:
        examples = "bert, roberta, deberta-v2" if factory == "hf-masked-lm" else "gpt2, llama, mistral"
        raise ConfigError(f"model.factory {factory} needs model.kwargs.model_type (e.g. {examples}) and "
                          "the config fields to set (e.g. num_hidden_layers, hidden_size)")
    kw["vocab_size"] = _vocab_size(job, tok, kw, f"model.factory {factory}")
    pad = None if tok is None else next((i for i in (tok.token_id(t) for t in PAD_TOKENS) if i is not None), None)
    if pad is not None:   # the tokenizer's own padding id, not the config's default (RoBERTa's 1 may be a word)
        kw.setdefault("pad_token_id", pad)
    identity = {"kind": "hf", "kwargs": kw, "transformers": transformers.__version__}
    if factory != "hf-causal-lm":   # (the causal LM's identity as before: its cached calibrations stay valid)
        identity["head"] = factory
    return Registered(functools.partial(hf_model, factory, **kw), name=f"Hugging Face {kw['model_type']}",
                      identity=identity)


register_model("gpt2", _gpt2_builder)
for _factory in HF_HEADS:
    register_model(_factory, functools.partial(_hf_builder, _factory))


def _by_value_ref(value: str | None) -> str | None:
    if value is None:
        return None
    return value.split(":", 1)[1] if value.startswith("sha256:") else value


# ---- resolution ------------------------------------------------------------------------------
def _factory_keyword_problem(factory: Any, kwargs: dict, what: str, field: str = "model.kwargs") -> str | None:
    """A factory's ``TypeError`` said as a key of ``field`` (``model.kwargs``, ``data.dataset_kwargs``)
    it does not take (with the likely one and the parameters it takes:
    ``config.checks.keyword_problem``); ``None`` when the keywords fit its signature (the error is
    the factory's own). ``factory``: ``Imported``, or shipped by value (``ByValue``, loaded by the
    failed call); ``what`` names it."""
    from .config.checks import keyword_problem

    fn = import_object(factory.ref) if isinstance(factory, Imported) else getattr(factory, "_obj", None)
    return keyword_problem(fn, kwargs, what, field) if fn is not None else None


def _short(text: str, limit: int = 600) -> str:
    """``text`` cut to ``limit`` characters (a library's message can list hundreds of names)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + f" … ({len(text) - limit} more characters)"


def _source_digest(obj: Any) -> str:
    try:
        src = inspect.getsourcefile(obj) or inspect.getfile(obj)
        return hashlib.sha256(Path(src).read_bytes()).hexdigest()[:16]
    except (TypeError, OSError):
        return "unknown"


def resolve_model(job: JobConfig, tokenizer: Tokenizer | None, fields: Sequence[str],
                  search: Sequence[str | Path | None] = (), from_text: bool = True) -> ModelSpec:
    """The ``ModelSpec`` of ``job`` for data with ``fields`` (see the module docstring);
    ``from_text``: the fields are language-model fields made from text, not a dataset's own.

    Builds the model once on the meta device (no memory) to read its forward's signature and
    limits. Raises ``ConfigError`` (unknown registered name, import failure), ``ModelSpecError``
    (no cut-points possible, a call the data cannot feed) or ``ShippingError``.
    """
    m = job.model
    loss: Any = m.loss
    init_fn: Any = None
    digest = _by_value_ref(m.by_value)
    if digest is not None:
        shipped = find_objects(digest, search)
        payloads = shipped.payloads
        if "factory" not in payloads:
            raise ShippingError("the objects shipped with the job hold no model factory")
        factory: Callable = ByValue(shipped, "factory")
        kwargs = dict(m.kwargs or {})
        if "loss" in payloads:
            loss = ByValue(shipped, "loss")
        if "init" in payloads:
            init_fn = ByValue(shipped, "init")
        name = shipped.names.get("factory", "model defined in the notebook")
        identity = {"kind": "by_value", "sha256": code_sha256(payloads["factory"])[:24],
                    "kwargs": kwargs}
    elif m.factory is not None and ":" in m.factory:
        obj = import_object(m.factory)
        if not callable(obj):
            hint = ""
            if inspect.ismodule(obj):   # 'pkg:mod' where 'pkg.mod:build' was meant
                names = sorted(n for n, v in vars(obj).items() if callable(v) and not n.startswith("_")
                               and getattr(v, "__module__", None) == obj.__name__)
                hint = (f": name a callable in it, {obj.__name__ + ':' + (names[0] if names else '<name>')!r}"
                        + (f" (its callables: {names[:8]})" if names else ""))
            raise ConfigError(f"model.factory {m.factory!r} is a {type(obj).__name__}, not a callable{hint}")
        factory, kwargs, name = Imported(m.factory), dict(m.kwargs or {}), m.factory
        identity = {"kind": "import", "ref": m.factory, "kwargs": kwargs, "code": _source_digest(obj)}
    else:
        reg_name = m.factory or "gpt2"
        if reg_name not in MODELS:
            near = difflib.get_close_matches(reg_name, list(MODELS), n=1)
            raise ConfigError(f"model.factory={reg_name!r} is neither an import path 'package.module:function' nor a "
                              f"registered model ({sorted(MODELS)})" + (colon_hint(reg_name) or (
                                  f"; did you mean {near[0]!r}?" if near else "")))
        reg = MODELS[reg_name](job, tokenizer)
        factory, kwargs, name, identity = reg.factory, {}, reg.name, reg.identity
        if loss is None and reg.loss is not None:
            loss = reg.loss
        init_fn = reg.init_fn
    if isinstance(loss, str) and ":" in loss:
        loss = Imported(loss)
    if m.init is not None:
        if not callable(import_object(m.init)):
            raise ConfigError(f"model.init {m.init!r} is not a function init_fn(module, name)")
        init_fn = Imported(m.init)
    prepared = Prepared(factory, tuple(sorted(kwargs.items())),
                        tuple(m.blocks) if isinstance(m.blocks, list) else m.blocks)
    try:
        meta = build_on_meta(prepared)
    except (ModelSpecError, ConfigError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's constructor failed: say where, keep its words
        wrong = _factory_keyword_problem(factory, kwargs, f"the model factory {name}") if isinstance(e, TypeError) and kwargs else None
        if wrong is not None:
            raise ConfigError(wrong) from None
        raise ModelSpecError(f"building the model ({name}{'(**' + repr(kwargs) + ')' if kwargs else '()'}) failed: "
                             f"{type(e).__name__}: {_short(str(e))}") from e
    call, loss_fn = infer_call(meta, fields, loss, m.inputs, m.targets, masked=job.data.mlm_probability is not None,
                               from_text=from_text)
    if loss is not None and not isinstance(loss, str):   # the user's own function: may return (loss, ...) / {"loss"}
        loss_fn = UserLoss(loss_fn)
    if job.data.mlm_probability is not None:
        warn_if_causal_with_masking(meta)
    vocab, ctx = model_limits(meta)
    del meta
    return ModelSpec(factory=prepared, loss_fn=loss_fn, call=call, name=name, identity=identity,
                     init_fn=init_fn, shared_params=job.parallel.shared_params, vocab_size=vocab, context=ctx)


@dataclass
class JobData:
    """The job's data, opened and checked: a token stream (``tokens``, with its ``tokenizer``)
    or a dataset of examples (``examples``; ``tokenizer`` ``None`` when ``data.tokenizer`` is null). ``fields``: the names a batch has. ``mlm``: masked-LM
    masking of token data (``data.mlm_probability``): ``input_ids`` masked, ``labels`` and
    ``targets`` the ids to predict (-100 elsewhere), the same examples whatever P, D or morphs."""

    tokenizer: Tokenizer | None
    tokens: TokenData | None = None
    examples: ExampleData | None = None
    source: str = ""
    mlm: MLMMasking | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """Names of an example's fields (``LM_FIELDS`` for token data)."""
        if self.tokens is not None:
            return LM_FIELDS
        return tuple(collate([self.examples.dataset[0]]))

    def sample(self, n: int, seq_len: int) -> dict[str, Any]:
        """The fields of ``n`` real examples (the data's first), for tracing and calibration."""
        if self.tokens is not None:
            toks = self.tokens.tokens
            if len(toks) < seq_len + 1:
                raise DataError(f"{self.source} gives {len(toks)} tokens, fewer than one sequence of seq_len + 1 = "
                                f"{seq_len + 1}; use data.seq_len <= {max(1, len(toks) - 1)} or more data")
            span = len(toks) - seq_len
            rows_ = [toks[(i * (seq_len + 1)) % span:(i * (seq_len + 1)) % span + seq_len + 1] for i in range(n)]
            x = torch.from_numpy(np.stack(rows_).astype("int64"))
            return _lm(x[:, :-1].contiguous(), x[:, 1:].contiguous(), self.mlm, [(SAMPLE, i) for i in range(n)])
        ids = [i % len(self.examples) for i in range(n)]
        return collate([self.examples.dataset[i] for i in ids], ids)

    def split_examples(self, global_batch: int, seed: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """``(train, held-out)`` indices of a dataset's examples (``loaders``: the held-out batches
        are the held-out indices in order). Raises ``DataError`` when nothing is left to train on."""
        n = len(self.examples)
        try:
            return split_examples(n, val_fraction, seed, min_held=global_batch if n - global_batch >= global_batch else 1)
        except ValueError as e:
            raise DataError(f"{self.source}: {e}") from None

    def loaders(self, seq_len: int, global_batch: int, seed: int, val_fraction: float, eval_batches_max: int):
        """``(train loader, held-out batches)``: the loader's ``replica_batch(step, replica, D)``
        gives a replica's fields of a step; held-out batches are lists of fields (the text's last
        ``val_fraction``, a dataset's seeded random ``val_fraction``, at least one mini-batch of
        ``global_batch`` where the rest still holds one to train on; none when it is 0: the job then
        trains on all the data and measures no held-out loss). Raises ``DataError`` when either part
        is too small."""
        held_out = float(val_fraction) > 0
        if self.tokens is not None:
            # at least one held-out batch where the rest still holds one for training
            one = global_batch * seq_len + 1
            total = len(self.tokens.tokens)
            if held_out and total < 2 * one:   # no val_fraction holds out a mini-batch and trains on another
                raise DataError(f"{self.source} has {total} tokens: too few to hold out a mini-batch of {global_batch} "
                                f"sequences of seq_len={seq_len} ({one} tokens) for the held-out loss and train on "
                                f"another; set data.val_fraction: 0 (train on all {total}, no held-out loss), or a "
                                "smaller parallel.global_batch or data.seq_len, or give more text")
            train, val = train_val_split(self.tokens.tokens, val_fraction, min_val=one)
            try:
                loader = BatchLoader(train, seq_len, global_batch, seed=seed)
                val_b = [_lm(x, y, self.mlm, [(HELD_OUT, b, k) for k in range(len(x))])
                         for b, (x, y) in enumerate(eval_batches(val, seq_len, global_batch,
                                                                 max_batches=eval_batches_max))] if held_out else []
            except ValueError as e:
                share = (f" (of its {total} tokens, {len(train)} are trained on and {len(val)} held out by "
                         f"data.val_fraction {float(val_fraction):g})") if held_out else ""
                raise DataError(f"{self.source}{share}: {e}") from None
            return _LMLoader(loader, self.mlm), val_b
        n = len(self.examples)
        train, held = self.split_examples(global_batch, seed, val_fraction)
        if held_out and n < 2 * global_batch:   # no val_fraction gives both a held-out and a training mini-batch
            raise DataError(f"{self.source} has {n} examples: too few to hold out a mini-batch of {global_batch} for "
                            f"the held-out loss and train on another; set data.val_fraction: 0 (train on all {n}, no "
                            f"held-out loss) or a global batch of at most {n // 2} (parallel.global_batch)")
        if len(train) < global_batch:
            raise DataError(f"{self.source} leaves {len(train)} examples to train on (of {len(self.examples)}; "
                            f"{len(held)} held out by data.val_fraction {val_fraction:g}), fewer than one mini-batch of "
                            f"{global_batch}: each mini-batch "
                            "would repeat examples; use more data, "
                            + ("a smaller data.val_fraction " if len(held) else "")
                            + "or a smaller parallel.global_batch")
        loader = ExampleLoader(self.examples.dataset, global_batch, seed=seed, indices=train)
        if not held_out:
            return loader, []
        try:
            val_b = example_eval_batches(self.examples.dataset, held, global_batch, eval_batches_max, seed=seed)
        except ValueError as e:
            raise DataError(f"{self.source}: {e}") from None
        return loader, val_b


def _lm(inputs: torch.Tensor, targets: torch.Tensor, mlm: MLMMasking | None, keys: list) -> dict[str, torch.Tensor]:
    """Language-model fields of ``inputs``/``targets`` (``[n, T]``); with ``mlm``, the inputs
    masked and ``labels``/``targets`` the masked positions' ids (example ``i`` drawn by ``keys[i]``)."""
    if mlm is None:
        return lm_fields(inputs, targets)
    masked, labels = mlm.apply(inputs, keys)
    return {"input_ids": masked, "targets": labels, "labels": labels}


class _LMLoader:
    """``BatchLoader`` giving named fields (``LM_FIELDS``) instead of ``(inputs, targets)``;
    with ``mlm``, masked by example (its step and row of the global batch)."""

    def __init__(self, loader: BatchLoader, mlm: MLMMasking | None = None):
        self.inner, self.mlm = loader, mlm

    def replica_batch(self, step: int, replica: int, num_replicas: int) -> dict[str, torch.Tensor]:
        x, y = self.inner.replica_batch(step, replica, num_replicas)
        first = replica * (self.inner.global_batch // num_replicas)
        return _lm(x, y, self.mlm, [(TRAIN, step, first + k) for k in range(len(x))])

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        x, y = self.inner.batch(step)
        return _lm(x, y, self.mlm, [(TRAIN, step, k) for k in range(len(x))])

    @property
    def position(self) -> int:
        return self.inner.position

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)


def _tokenizer(name: str | None, examples: bool, path: str | None = None) -> Tokenizer | None:
    """The tokenizer ``data.tokenizer`` names; ``None`` (no tokenizer) only for a dataset of
    examples (``examples``). Raises ``ConfigError`` for an unknown one, or ``None`` with text or
    token data (``path``: the data's file or folder, for the message)."""
    if name is None:
        if not examples:
            raise ConfigError(_no_tokenizer_for(path))
        return None
    try:
        return get_tokenizer(name)
    except ValueError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None


def _no_tokenizer_for(path: str | None) -> str:
    """Why ``data.tokenizer: null`` cannot read ``path`` (text or token ids cut into sequences), and
    what to give instead: the tokenizer, or the examples as a dataset."""
    from .data.sources import TOKEN_SUFFIXES

    p = Path(path) if path else None
    if p is not None and p.suffix.lower() in TOKEN_SUFFIXES:
        return (f"data.tokenizer is null, but {str(p)!r} holds token ids, read as one stream cut into sequences with "
                "the tokenizer that made them (its vocabulary, end-of-text id): give it as data.tokenizer ('gpt2', "
                "'byte' or a tokenizer.json; leaving it out means 'gpt2'); for examples of your own (features and "
                "labels), give them as a dataset instead (Job(data=...), data.dataset in a config)")
    if p is not None and p.is_dir():
        return (f"data.tokenizer is null, but {str(p)!r} is a folder, read as text or token files cut into sequences "
                "with a tokenizer: give data.tokenizer for text; for examples of your own (a folder saved with "
                "datasets' save_to_disk, or .npy files, one per example), give them as a dataset: "
                "Job(data=datasets.load_from_disk(path)) or a function that reads them (data.dataset in a config)")
    return ("data.tokenizer is null, but the data is text or tokens to cut into sequences, which "
            "needs one: give data.tokenizer ('gpt2', 'byte' or a tokenizer.json), or a data.dataset "
            "whose examples are tensors already (a CSV of numbers: read it into a TensorDataset)")


def resolve_data(job: JobConfig, search: Sequence[str | Path | None] = ()) -> JobData:
    """Open and check the job's data (see ``config.DataConfig``). Raises ``DataError`` naming the
    file, column or factory and the fix, ``ConfigError`` for an unknown tokenizer."""
    d = job.data
    digest = _by_value_ref(d.by_value)
    tok = _tokenizer(d.tokenizer, examples=digest is not None or d.dataset is not None, path=d.path)
    if digest is not None or d.dataset is not None:
        if digest is not None:
            shipped = find_objects(digest, search)
            if "dataset" not in shipped.payloads:
                raise ShippingError("the objects shipped with the job hold no dataset factory")
            make = ByValue(shipped, "dataset")
            name = shipped.names.get("dataset", "")
            where = (f"the {name[len(GIVEN_DATA):]} given as data= (shipped with the job)" if name.startswith(GIVEN_DATA)
                     else f"dataset factory {name} (shipped with the job)")
        else:
            make, where = Imported(d.dataset), f"data.dataset {d.dataset!r}"
        kwargs = dict(d.dataset_kwargs or {})
        try:
            with seeded_global_rngs() as reseed:   # a factory that draws at random builds one dataset everywhere
                reseed(d.seed)
                ds = make(**kwargs)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's factory failed: say which, keep its message
            wrong = _factory_keyword_problem(make, kwargs, where, "data.dataset_kwargs") \
                if isinstance(e, TypeError) and kwargs else None
            if wrong is not None:
                raise ConfigError(wrong) from None
            raise DataError(f"{where} raised {type(e).__name__}: {e}") from e
        if d.mlm_probability is not None:
            raise DataError(f"data.mlm_probability masks token data (text or token files), and {where} gives "
                            "examples: mask them in the dataset (e.g. with transformers' "
                            "DataCollatorForLanguageModeling) and remove data.mlm_probability")
        return JobData(tok, examples=open_examples(ds, where), source=where)
    try:
        mlm = masking_for(d.mlm_probability, tok, d.mask_token, d.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tokens = open_tokens(d.path, tokenizer=tok, fmt=d.format, text_column=d.text_column,
                         token_dtype=d.token_dtype, corpus=d.corpus)
    return JobData(tok, tokens=tokens, source=tokens.source, mlm=mlm)


@dataclass
class ResolvedJob:
    """A job's model spec and data, checked together (``resolve_job``)."""

    spec: ModelSpec
    data: JobData
    #: what the dry run learned of the model (its segments between cut-points); None unchecked
    structure: ModelStructure | None = None

    def split(self, fields: Mapping[str, Any]) -> tuple:
        """``(inputs, targets)`` for the engine from a batch's fields."""
        return self.spec.call.split(fields)

    def sample_inputs(self, n: int, seq_len: int) -> tuple:
        """``(inputs, targets)`` of ``n`` real examples (tracing, calibration)."""
        return self.split(self.data.sample(n, seq_len))


class _ForwardFailed(Exception):
    """The user's forward failed in the dry run (``error``: the ``ModelSpecError`` to raise)."""

    def __init__(self, error: ModelSpecError):
        super().__init__(str(error))
        self.error = error


def _warn_first_of_several(out: Any, name: str) -> None:
    """Warn when the automatic cross-entropy takes the first tensor of an output tuple that holds
    several (``model.spec.output_logits``): a ``(hidden, logits)`` output would train on the
    hidden state as if it were logits, with no error."""
    if not isinstance(out, (tuple, list)) or getattr(out, "logits", None) is not None:
        return
    # shapes with the batch as B: the dry runs of other micro-batch sizes then warn once, in the same words
    shapes = ["[" + ", ".join(["B", *map(str, t.shape[1:])]) + "]" if t.dim() else "[]" for t in out
              if isinstance(t, torch.Tensor)]
    if len(shapes) > 1:
        warnings.warn(f"{name} returns a {type(out).__name__} of {len(shapes)} tensors (shapes {', '.join(shapes)}); the automatic "
                      f"cross-entropy takes the first, {shapes[0]}, as the logits. If the logits are another element, "
                      "give the job a loss, e.g. model.loss: 'mypkg.losses:ce' with def ce(output, targets): return "
                      "F.cross_entropy(output[1], targets) (Job(..., loss=ce) in a notebook)", stacklevel=2)


def _dry_run(spec: ModelSpec, data: JobData, meta: nn.Module, b: int, T: int, precision: str,
             seen: dict | None = None) -> ModelStructure:
    """One dry run (weights on meta, ``b`` real examples): the forward, the loss on its output, and
    every embedding lookup (token tables bound the ids, position tables the length); the automatic
    cross-entropy's class ids checked against the output's classes (``check_targets``, as the
    workers' last stage does). ``seen``: filled with the micro-batch's ``"fields"``, ``"ids"``
    (dataset indices; ``None`` for token data), the output's ``"classes"`` (the automatic
    cross-entropy's; else ``None``) and ``"class_error"``, the ``DataError`` to raise for ids beyond
    them (``None``: none). Raises ``_ForwardFailed`` when the forward itself fails, the
    checks' errors otherwise."""
    fields = data.sample(b, T)
    ids = [i % len(data.examples) for i in range(b)] if data.examples is not None else None
    if seen is not None:
        seen.update(fields=fields, ids=ids, classes=None, class_error=None)
    try:
        inputs, targets = spec.call.split(fields)
    except ModelSpecError as e:
        raise DataError(f"{data.source}: {e}") from None

    def loss_on(out: Any) -> Any:
        if spec.loss_fn is cross_entropy:
            _warn_first_of_several(out, spec.name)
        said: list = []
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                loss = spec.loss_fn(out, targets)
        except WeightValueError:
            reads_values.append(out)  # e.g. to log them, or float(...): checked below, on real zeros
            return None
        except ConfigError as e:  # an import-path loss that does not resolve: the config's error
            raise ConfigError(f"model.loss: {e}") from None
        except ModelSpecError as e:   # the automatic loss's own explanation (with its fix): said whole, as it is
            raise ModelSpecError(f"{e} (called on {spec.name}'s output, a {type(out).__name__}, as "
                                 f"{spec.call.describe()})" + _default_model_hint(spec, data)) from e
        except Exception as e:  # noqa: BLE001 - the user's loss failed on the model's output
            raise ModelSpecError(f"the loss raised {type(e).__name__}: {_short(str(e))} (called on {spec.name}'s "
                                 f"output, a {type(out).__name__}, as {spec.call.describe()})"
                                 + _loss_error_hint(str(e), out, targets) + _default_model_hint(spec, data)) from e
        finally:
            _refuse_broadcast_loss(said, out, targets, spec)
        _check_loss(loss, spec)
        if spec.loss_fn is cross_entropy and seen is not None:   # ids beyond the classes: the meta loss cannot tell
            try:
                seen["classes"] = check_targets(out, targets)
            except ModelSpecError as e:   # raised after the lookups' checks (a token id beyond the vocabulary)
                seen["class_error"] = DataError(f"{data.source}, {_examples(ids)} (read before any worker starts): {e}")
        return loss

    reads_values: list = []
    try:
        # fp32 runs the data's dtypes as they are (bf16/fp16 autocast casts the operands)
        structure = trace_model(meta, inputs, after=loss_on, strict_dtypes=precision == "fp32", targets=targets)
    except (ModelSpecError, DataError, ConfigError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's forward failed on real data: say which data
        shapes = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in fields.items()
                           if isinstance(v, torch.Tensor))
        err = ModelSpecError(f"{spec.name}'s forward failed on a micro-batch of {data.source} ({shapes}), called "
                             f"as {spec.call.describe()}: {type(e).__name__}: {_short(str(e))}" + _on_meta(e)
                             + _unnamed_fields(meta, inputs) + _default_model_hint(spec, data)
                             + _labels_went_to_the_loss(spec, meta))
        err.__cause__ = e
        raise _ForwardFailed(err) from None
    if reads_values:  # what such a loss returns, on a real stand-in of the output (outside the dry run)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. float() of a tensor that requires grad
                loss = spec.loss_fn(_real_stand_in(reads_values[0]), targets)
        except Exception:  # noqa: BLE001 - a loss that cannot take zeros is not checked here; a real run says
            loss = None
        if loss is not None:
            _check_loss(loss, spec)
    if spec.loss_fn is cross_entropy or spec.identity.get("kind") == "preset":   # (the preset's loss does not shift)
        _warn_unshifted(inputs, targets, spec.name)
    return structure


def _refuse_broadcast_loss(said: list, out: Any, targets: Any, spec: ModelSpec) -> None:
    """Raise ``ModelSpecError`` when the loss broadcast the targets against an output of another
    shape (torch's "Using a target size ... different to the input size" warning: an ``[B, 1]``
    output against ``[B]`` targets trains on ``B x B`` pairs, silently wrong); else say the
    loss's other warnings again."""
    for w in said:
        text = str(w.message)
        if "target size" in text and "different to the input size" in text:
            o = tuple(out.shape) if isinstance(out, torch.Tensor) else "?"
            t = tuple(targets.shape) if isinstance(targets, torch.Tensor) else "?"
            raise ModelSpecError(
                f"the loss broadcast the targets {t} against {spec.name}'s output {o} (torch: {_short(text)}): "
                f"it would compare every output with every target of the micro-batch. Give the targets the output's "
                f"shape (e.g. y.view(-1, 1) in the dataset, or y of shape {o[1:] if o != '?' else 'the output'} per "
                "example), or squeeze the output in the loss (output.squeeze(-1))")
    for w in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _loss_error_hint(message: str, out: Any, targets: Any) -> str:
    """What to change when a loss of the user's own failed on a common mismatch of the targets
    with the output (``message``: the error's text): class ids stored as floats, integer targets
    for a regression loss, or shapes that differ. ``""`` when none applies."""
    if not isinstance(targets, torch.Tensor) or not isinstance(out, torch.Tensor):
        return ""
    low = message.lower()
    o, t = tuple(out.shape), tuple(targets.shape)
    if targets.is_floating_point() and ("for index" in low or "scalar type long" in low or "dtype to be long" in low):
        return (f". The targets are {targets.dtype} {t}: class ids must be integers; give them as y.long() in the "
                "dataset (or, for class probabilities, floats of the output's shape)")
    if not targets.is_floating_point() and out.is_floating_point() and "dtype" in low and "float" in low:
        return (f". The targets are {targets.dtype} and the output {out.dtype}: a regression loss needs float targets "
                "(y.float() in the dataset)")
    if o != t and ("size of tensor" in low or "must match" in low or "shape" in low):
        return (f". The output is {o} and the targets {t}: a loss comparing them element by element needs one shape "
                f"(e.g. targets of shape {o}, or the output squeezed to {t} in the loss)")
    return ""


def _warn_unshifted(inputs: Any, targets: Any, name: str) -> None:
    """Warn when the automatic cross-entropy's targets are a sequence input itself (Hugging Face's
    ``labels`` format: the ids, -100 where nothing is predicted, shifted by the model's own loss):
    the automatic loss compares position t with t, so the model would learn to copy its input."""
    if not isinstance(targets, torch.Tensor) or targets.dim() < 2 or targets.is_floating_point():
        return
    kept = targets != -100
    if not bool(kept.any()):
        return
    items = inputs.items() if isinstance(inputs, dict) else enumerate(inputs if isinstance(inputs, tuple) else ())
    for key, x in items:
        if isinstance(x, torch.Tensor) and x.shape == targets.shape and not x.is_floating_point() \
                and bool((x[kept] == targets[kept]).all()):
            where = f"input {key!r}" if isinstance(key, str) else f"positional input {key}"
            warnings.warn(f"the targets equal {name}'s {where} wherever they are not -100: labels in Hugging "
                          "Face's format, which a model's own loss shifts by one position; the automatic "
                          "cross-entropy compares position t with t, so the model would learn to copy its input. "
                          "Give targets shifted by one (y[t] = x[t + 1]), a forward that takes labels and computes "
                          "its own loss, or a loss that shifts them", UserWarning, stacklevel=4)
            return


#: Words of torch's errors for what the meta device cannot run: no meta kernel, an output whose shape
#: depends on values (``nonzero``, boolean-mask indexing: MoE routing), a meta kernel stricter than the
#: real one (``grouped_mm`` asks for bf16)
_META_LIMITS = ("meta", "fake impl", "data-dependent", "dynamicoutputshape", "nonzero", "grouped_mm",
                "cannot be converted to a python scalar")
#: a shape check's message (torch's meta kernels make the checks its real kernels make)
_SHAPE_MISMATCH = re.compile(r"same reduction dim|shapes cannot be multiplied|size mismatch|must match the size|"
                             r"size of tensor a \(\d+\) must match|expected input.*to have \d+ channels|"
                             r"invalid channel dimensions|but got \[[\d, ]+\] x \[[\d, ]+\]")
#: a dtype check's message (an embedding given float ids, a linear layer given integer features)
_DTYPE_MISMATCH = re.compile(r"to have one of the following scalar types|expected scalar type \w+ but found|"
                             r"mat1 and mat2 must have the same dtype|input type \(.*\) and (weight|bias) type .* "
                             r"should be the same|\"\w+\" not implemented for '(long|int|short|char|byte|bool)'")


def _unnamed_fields(model: nn.Module, inputs: Any) -> str:
    """What to add to a failed forward called with keyword fields its signature does not name (they
    went to its ``**kwargs``, e.g. ``ids`` where it takes ``input_ids``): those fields and the likely
    parameter each stands for; ``""`` when every field is a named parameter."""
    import difflib
    import inspect

    if not isinstance(inputs, dict):
        return ""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return ""
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return ""
    named = [n for n, p in params.items() if p.kind not in (inspect.Parameter.VAR_KEYWORD,
                                                             inspect.Parameter.VAR_POSITIONAL)]
    odd = [k for k in inputs if k not in named]
    if not odd:
        return ""
    hints = []
    for k in odd:
        near = difflib.get_close_matches(k, named, n=1, cutoff=0.4)
        hints.append(f"{k!r}" + (f" (its parameter {near[0]!r}?)" if near else ""))
    return (f". The data's field(s) {', '.join(hints)} are no parameter of the forward (they went to its **kwargs): "
            "name the fields as the forward's parameters, or map them with model.inputs")


def _labels_went_to_the_loss(spec: ModelSpec, model: nn.Module) -> str:
    """What to add when a loss of the user's own takes a field the forward also has a parameter for
    (``labels``): the forward ran without it, which a model that makes its decoder's inputs from its
    labels (Hugging Face's encoder-decoders) cannot; ``""`` otherwise."""
    import inspect

    if spec.call.targets is None or spec.loss_fn in (cross_entropy,):
        return ""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return ""
    taken = [f for f in spec.call.target_fields() if f in params]
    if not taken:
        return ""
    return (f". With a loss of your own, the field(s) {taken} go to the loss, not to the forward, although it takes "
            f"them: a model that builds its decoder's inputs from labels (an encoder-decoder) then has none — give "
            "decoder_input_ids in the data, or use the model's own loss (no loss=)")


def _default_model_hint(spec: ModelSpec, data: JobData) -> str:
    """What to add when the model that failed is the built-in GPT-2 preset, chosen because no model
    was given, on examples (not text): the job needs the user's model; ``""`` otherwise."""
    if spec.identity.get("kind") != "preset" or data.examples is None:
        return ""
    return (". No model was given, so the built-in GPT-2 preset (token ids in, next-token loss) was tried on "
            "these examples: give the model that takes them (Job(model=...), model.factory in a config)")


def _on_meta(e: BaseException) -> str:
    """What to add to a dry-run failure that comes from the meta device itself, not from the model:
    an explanation and the way out; ``""`` for other failures."""
    text = f"{type(e).__name__} {e}".lower()
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    in_torch_meta = any(("_meta_registrations" in f or "fake_impl" in f or "_subclasses/fake" in f) for f in frames)
    if _DTYPE_MISMATCH.search(text):
        return (". The data's dtype does not fit the model's layer (the same error as a plain PyTorch run of this model "
                "gives): an nn.Embedding takes integer ids (torch.long), nn.Linear and convolutions float features; "
                "check the dtypes of the data's fields against what the model's forward expects")
    if _SHAPE_MISMATCH.search(text) and not any(w in text for w in _META_LIMITS[2:]):
        # torch's meta kernels check shapes as its real ones do: the model's own error
        return (". The shapes of the data and the model's layers do not match (the same error as a plain PyTorch "
                "run of this model gives): check the data's field shapes against what the model's forward expects")
    if not in_torch_meta and not any(w in text for w in _META_LIMITS):
        return ""
    return (". This is a limit of the meta device the SDK traces the model on (weights without memory): an "
            "operation torch has no meta kernel for (e.g. CTC loss), or one whose output shape depends on values "
            "(torch.nonzero, boolean-mask indexing, mixture-of-experts routing), cannot run there, so such a model "
            "cannot be split into pipeline stages yet")


def _runs_on(spec: ModelSpec, data: JobData, meta: nn.Module, b: int, T: int, precision: str) -> bool:
    """Whether the forward runs on ``b`` examples (the other checks are not asked)."""
    try:
        _dry_run(spec, data, meta, b, T, precision)
    except _ForwardFailed:
        return False
    except (ModelSpecError, DataError, ConfigError):
        return True
    return True


def check_together(spec: ModelSpec, data: JobData, job: JobConfig) -> ModelStructure:
    """Refuse data the model cannot take, before workers start: token ids beyond its vocabulary,
    ``seq_len`` beyond its context, batches without the fields its call reads. Raises
    ``DataError`` naming the source and the fix. What the dry runs warn about (once per micro-batch
    size tried) is said once per message, after them. Returns the dry run's ``ModelStructure``."""
    said: list = []
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            return _check_together(spec, data, job)
    finally:
        shown: set = set()
        for w in said:
            if (str(w.message), w.category) not in shown:
                shown.add((str(w.message), w.category))
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _check_together(spec: ModelSpec, data: JobData, job: JobConfig) -> ModelStructure:
    T = job.data.seq_len
    if data.tokens is not None:
        check_tokens(data.tokens, spec.vocab_size)
        if spec.context is not None and T > spec.context:
            raise DataError(f"data.seq_len={T} is longer than {spec.name}'s context of {spec.context} "
                            f"positions; use data.seq_len <= {spec.context}, or build the model with a longer context")
    meta = build_on_meta(spec.factory)
    _check_no_lazy_modules(meta, spec.name)
    _check_no_layerdrop(meta, spec.name)
    if spec.init_fn is not None:
        _check_init(meta, spec.init_fn)
    b, precision = job.parallel.micro_batch_size, job.train.precision
    seen: dict = {}
    try:
        structure = _dry_run(spec, data, meta, b, T, precision, seen)
    except _ForwardFailed as e:
        if b > 1 or not _runs_on(spec, data, meta, 2, T, precision):
            raise e.error from e.error.__cause__
        if not job.parallel.planned:
            raise ModelSpecError(f"{spec.name}'s forward fails on a micro-batch of one example ({e.error.__cause__}) "
                                 "but runs on two (a layer such as BatchNorm needs more than one example per "
                                 "micro-batch in training): set parallel.micro_batch_size to 2 or more") from None
        spec.min_micro_batch = 2   # the planner and the calibration then try 2 and up
        structure = _dry_run(spec, data, meta, 2, T, precision, seen)
    else:
        if b > 1 and not _runs_on(spec, data, meta, 1, T, precision):
            spec.min_micro_batch = 2   # BatchNorm: the calibration must not measure micro-batches of one
    _check_lookups(structure, data, spec.name, T)
    _check_every_block_ran(meta, structure, spec.name)
    _warn_unmerged_buffers(meta, structure, spec.name, job.parallel.D)
    if seen["class_error"] is not None:
        raise seen["class_error"]
    if data.examples is not None:
        check_finite(seen["fields"], seen["ids"], spec, data.source, structure.nonfinite_checks)
    if data.examples is not None and structure.loss_items is None:
        _warn_unweighted(data, spec.name)
    d, p = job.data, job.parallel
    _, val = data.loaders(d.seq_len, p.global_batch, d.seed, d.val_fraction, 1)  # enough to train and to hold out
    if data.examples is not None and val:   # the first held-out batch, read just now: checked too
        ids = [int(i) for i in data.split_examples(p.global_batch, d.seed, d.val_fraction)[1][:p.global_batch]]
        if seen["classes"] is not None:
            try:
                check_target_ids(spec.call.split(val[0])[1], seen["classes"])
            except ModelSpecError as e:
                raise DataError(f"{data.source}, {_examples(ids, 'held-out ')} (read before any worker starts): {e}") \
                    from None
        check_finite(val[0], ids, spec, data.source, structure.nonfinite_checks, "held-out ")
    return structure


def _warn_unmerged_buffers(meta: nn.Module, structure: ModelStructure, name: str, D: int | None) -> None:
    """Warn when the forward writes buffers of its own (an EMA of its activations; not a
    normalisation layer's running statistics, which the replicas merge: ``pipeline.running_stats``)
    and the job may run D > 1 replicas (``D``: fixed, or ``None``: planned): each replica updates
    them from its own micro-batches only, where plain PyTorch updates them over every micro-batch
    of the mini-batch in order, and a checkpoint keeps replica 0's. At D = 1 they train as in plain
    PyTorch (a recompute sees them as its forward did: ``model.state_kept``)."""
    if D == 1:
        return
    norm = {f"{m_name}.{b}" if m_name else b for m_name, mod in meta.named_modules()
            if isinstance(mod, torch.nn.modules.batchnorm._NormBase) for b in mod._buffers}
    written = sorted(n for n in structure.written_buffers if n not in norm)
    if not written:
        return
    shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
    when = f"at D={D}" if D else "if the plan picks D > 1 replicas"
    warnings.warn(f"{name}'s forward updates buffers of its own in place ({shown}): {when} each replica updates "
                  "them from its own micro-batches only (plain PyTorch updates them over every micro-batch of "
                  "the mini-batch, in order; only normalisation layers' running statistics are merged across "
                  "replicas), and checkpoints keep replica 0's. Set parallel.D: 1 for plain PyTorch's values "
                  "(any P), or ignore this if they only feed monitoring", stacklevel=2)


def _examples(ids: Sequence[int] | None, kind: str = "") -> str:
    """``examples 0..3`` (``ids``: dataset indices of a batch), what a message says it read."""
    if ids is None:
        return "its first sequences"
    if list(ids) == list(range(ids[0], ids[0] + len(ids))):
        shown = f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else f"{ids[0]}"
    else:
        shown = ", ".join(str(i) for i in ids[:8]) + (", …" if len(ids) > 8 else "")
    return f"{kind}example{'s' if len(ids) > 1 else ''} {shown}"


def _additive_mask(name: str, values: torch.Tensor) -> bool:
    """Whether a floating input field may hold -inf: an additive attention mask or bias (its name
    says mask/bias, or none of its values is positive: 0 where attended, -inf where not)."""
    low = name.lower()
    return "mask" in low or "bias" in low or not bool((values > 0).any())


def check_finite(fields: Mapping[str, Any], ids: Sequence[int], spec: ModelSpec, source: str,
                 handled: Sequence[str] = (), kind: str = "") -> None:
    """Refuse a batch of examples (``ids``: their dataset indices) holding NaN or inf where it would
    make the loss NaN, before any worker starts (the job would otherwise skip steps and stop).

    The rule: only floating tensor fields the model or the loss reads (``spec.call``) are looked
    at (integer and bool fields cannot hold NaN; fields nothing reads are left alone). NaN and
    +inf are refused in each; -inf in the targets, and in an input except an additive attention
    mask or bias (a field whose name says mask/bias, or with no positive value: 0 and -inf). Nothing
    is refused when the forward or the loss itself tested the data for NaN/inf in the dry run
    (``handled``: ``torch.isnan``, ``nan_to_num``... called on the data: a model that handles
    missing values). ``kind``: what the examples are (``"held-out "``), for the message. Raises
    ``DataError`` naming the example, the field, the value and the fix."""
    if handled:
        return
    targets = spec.call.target_fields()
    for name in spec.call.fields():
        v = fields.get(name)
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() == 0 or not v.numel():
            continue
        flat = v.detach().reshape(len(v), -1)
        bad = torch.isnan(flat) | (flat == float("inf"))
        if name in targets or not _additive_mask(name, flat):
            bad |= flat == float("-inf")
        rows = bad.any(dim=1).nonzero().flatten().tolist()
        if not rows:
            continue
        row = flat[rows[0]]
        what = "NaN" if bool(torch.isnan(row).any()) else "inf" if bool((row == float("inf")).any()) else "-inf"
        field = f"field {name!r}" + (f" (example[{name}])" if name.isdigit() else "")
        role = "the loss's targets" if name in targets else "the model's inputs"
        raise DataError(
            f"{source}: {kind}example {ids[rows[0]]}'s {field} holds {what} ({int(bad[rows[0]].sum())} of its "
            f"{row.numel()} values; {len(rows)} of {_examples(ids, kind)}, read before any worker starts, hold NaN "
            f"or inf there). NaN or inf in {role} makes the loss and the gradients NaN: every step would be "
            "skipped and the job would stop. Clean the data (replace or impute the missing values in the dataset, e.g. "
            "torch.nan_to_num(x) or a column mean) or filter those examples out (keep the examples whose tensors "
            "are all finite: torch.isfinite(x).all()); a forward that handles NaN itself (torch.isnan or "
            "nan_to_num on its inputs) is not refused")


def _warn_unweighted(data: JobData, name: str) -> None:
    """Warn when a dataset's integer fields hold -100 (ignored labels: padding, prompts) but the loss
    is not one mean cross-entropy whose items the SDK can count (``model.loss_items``): each
    micro-batch's mean then weighs the same, so the loss depends on the micro-batch size."""
    fields = data.sample(min(len(data.examples), 8), None)   # a few: a slow dataset reads them again
    ignored = [k for k, v in fields.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()
               and bool((v == -100).any())]
    if ignored:
        warnings.warn(f"{data.source}: field(s) {ignored} hold -100 (ignored labels), but {name}'s loss is not one "
                      "mean cross_entropy/nll_loss over them (a second term added, class weights it cannot read, or its own "
                      "normalisation), so the SDK cannot weigh micro-batches by their tokens: each micro-batch's mean "
                      "loss counts the same, and the loss changes with the micro-batch size the plan picks (fix "
                      "parallel.micro_batch_size to keep it), unlike one plain PyTorch call on the mini-batch",
                      UserWarning, stacklevel=3)


def _check_lookups(structure: ModelStructure, data: JobData, name: str, T: int) -> None:
    """Every embedding lookup of the dry run within its table: token ids (from the inputs) below
    the vocabulary — over the whole token data, or the sampled example of a dataset — and
    positions below the context. Raises ``DataError`` naming the table and the fix."""
    for e in structure.embeddings:
        if e["from_input"] and data.mlm is not None and data.tokens.max_id < e["rows"] \
                and max(data.mlm.mask_id, data.mlm.vocab_size - 1) >= e["rows"]:
            raise DataError(f"data.mlm_probability: the tokenizer has {data.mlm.vocab_size} ids (its mask token is id "
                            f"{data.mlm.mask_id}), beyond the model's vocabulary of {e['rows']} ids ({e['param']}); "
                            "masking puts the mask token and random tokens of the whole tokenizer into the inputs: "
                            "use the tokenizer the model was made for, or a model with at least "
                            f"{max(data.mlm.mask_id, data.mlm.vocab_size - 1) + 1} token embeddings")
        if e["from_input"] and data.tokens is not None and data.tokens.max_id >= e["rows"]:
            raise DataError(f"{data.source} holds token id {data.tokens.max_id}, beyond the model's vocabulary of "
                            f"{e['rows']} ids ({e['param']}); use the tokenizer the model was made for, or a model "
                            f"with at least {data.tokens.max_id + 1} token embeddings")
        if e["from_input"] and data.tokens is None and e["max_index"] >= e["rows"]:
            raise DataError(f"{data.source}: an example holds token id {e['max_index']}, beyond the model's vocabulary "
                            f"of {e['rows']} ids ({e['param']}); make the dataset's ids smaller than {e['rows']} "
                            f"(its tokenizer), or build the model with at least {e['max_index'] + 1} token embeddings")
        if not e["from_input"] and e["max_index"] >= e["rows"] and data.tokens is None:
            raise DataError(f"{data.source}: its examples make {name} look up row {e['max_index']} of "
                            f"{e['param']}, which has {e['rows']} rows (its context); make each example at most "
                            f"{e['rows']} long (crop it in the dataset), or build the model with a longer context")
        if not e["from_input"] and e["max_index"] >= e["rows"]:
            raise DataError(f"data.seq_len={T} makes {name} look up row {e['max_index']} of {e['param']}, which "
                            f"has {e['rows']} rows (its context); lower data.seq_len, or build the model with a "
                            "longer context")


def _real_stand_in(out: Any) -> Any:
    """``out`` with every meta tensor replaced by real zeros of its shape and dtype (floating ones
    requiring grad), so that a loss that reads values can run on it."""
    from torch.utils._pytree import tree_map

    def real(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            z = torch.zeros(t.shape, dtype=t.dtype)
            return z.requires_grad_() if z.is_floating_point() else z
        return t
    return tree_map(real, out)


def _check_loss(loss: Any, spec: ModelSpec) -> None:
    """The loss of a dry-run micro-batch must be a 0-dim floating tensor that depends on the
    weights (so ``backward`` reaches them)."""
    if not isinstance(loss, torch.Tensor):
        raise ModelSpecError(f"the loss returned a {type(loss).__name__}; it must return a scalar tensor (the "
                             "micro-batch's mean loss), a dict holding it as 'loss', or a tuple whose first element "
                             "it is")
    if loss.dim() != 0 or not loss.is_floating_point():
        raise ModelSpecError(f"the loss returned a {tuple(loss.shape)} {loss.dtype} tensor; it must return a scalar "
                             "floating-point tensor (the micro-batch's mean, e.g. reduction='mean')")
    if not loss.requires_grad:
        raise ModelSpecError("the loss does not depend on the model's parameters (no gradient would reach them); "
                             "compute it from the model's output")


def _check_every_block_ran(meta: nn.Module, structure: ModelStructure, name: str) -> None:
    """Refuse a model whose dry run (in training mode) skipped some of its blocks: fewer segments
    than its automatic cut-points make (``model._varuna_auto_segments``). A forward that skips
    blocks at random (a hand-written LayerDrop, stochastic depth by block) would run other blocks
    on another micro-batch, and the stages' cut-points would not line up. Raises ``ModelSpecError``."""
    want = getattr(meta, "_varuna_auto_segments", None)
    if want is None or structure.num_segments >= want:
        return
    raise ModelSpecError(
        f"{name}'s forward skipped some of its {getattr(meta, '_varuna_auto_blocks', want - 2)} blocks in the dry run (training mode: "
        f"{structure.num_segments} segments where every block called makes {want}): a pipeline runs every block on "
        "every micro-batch. If it skips blocks at random in training "
        "(LayerDrop, stochastic depth by whole blocks), turn that off (skip nothing, or scale the block's output "
        "instead); if it uses fewer blocks than it lists, set model.blocks to the list it calls, or put CutPoint() "
        "modules in its forward")


#: attributes through which models (Hugging Face's OPT, BART, Wav2Vec2, M2M100...) ask for LayerDrop
_LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def _check_no_lazy_modules(meta: nn.Module, name: str) -> None:
    """Refuse lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``...): their weights get a shape only
    at the first forward, and every stage materialises its weights from what the constructor made.
    Raises ``ModelSpecError`` naming the modules and the fix."""
    from torch.nn.modules.lazy import LazyModuleMixin

    lazy = [f"{mod_name or '<root>'} ({type(m).__name__})" for mod_name, m in meta.named_modules()
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]
    if lazy:
        raise ModelSpecError(f"{name} has lazy modules whose weights get their shape only at the first forward: "
                             f"{', '.join(lazy[:5])}{' …' if len(lazy) > 5 else ''}; give their input sizes "
                             "(e.g. nn.Linear(in_features, out) instead of nn.LazyLinear(out)), since each "
                             "pipeline stage makes its weights from what the constructor made")


def _check_no_layerdrop(meta: nn.Module, name: str) -> None:
    """Refuse LayerDrop (a block skipped at random in training, Fan et al. 2019): a pipeline's
    stages, its calibration and its cut-point traffic assume every block runs in every micro-batch.
    Looks at each module's own ``layerdrop`` attributes and its ``config``'s. Raises
    ``ModelSpecError`` naming the module, the attribute and the fix."""
    found: dict[str, tuple[str, float]] = {}
    for where, attr, p in positive_settings(meta, _LAYERDROP):
        found.setdefault(attr, (where, p))   # each attribute where it is first set
    if found:
        attrs = list(found)
        said = ", ".join(f"{w}.{a}={v}" for a, (w, v) in found.items())
        raise ModelSpecError(
            f"{name} uses LayerDrop ({said}): it skips blocks at random in training, so the pipeline's stages "
            f"would not run the same blocks from one micro-batch to the next. Build the model with "
            f"{' and '.join(f'{a}=0' for a in attrs)} (for a Hugging Face config: model.kwargs: "
            f"{{{', '.join(f'{a}: 0.0' for a in attrs)}}}); a pipeline runs every block on every step")


def _check_init(meta: nn.Module, init_fn) -> None:
    """Run ``init_fn(module, name)`` on every module of the meta model (no memory): an init that
    raises does so now, not in a worker."""
    with torch.no_grad():
        for name, mod in meta.named_modules():
            try:
                init_fn(mod, name)
            except Exception as e:  # noqa: BLE001 - the user's init failed: say on which module
                raise ModelSpecError(f"model.init raised on module {name or '<root>'} ({type(mod).__name__}): "
                                     f"{type(e).__name__}: {_short(str(e))}") from e


def resolve_job(job: JobConfig, search: Sequence[str | Path | None] = (), check: bool = True) -> ResolvedJob:
    """``resolve_data`` + ``resolve_model`` + ``check_together`` (``search``: folders that may hold
    the job's objects file — its run folder; ``check=False``: a worker, whose launcher checked
    the same job already). Raises ``ConfigError``/``DataError``/``ModelSpecError`` (all
    ``ValueError``) or ``ShippingError`` before anything starts; ``ConfigError`` too in a worker
    process re-importing a main script that builds a job at its top level (the script has no
    ``if __name__ == "__main__":``): each worker would build, check and launch the job again while
    the calibration measures, so the worker stops there and the script's run fails saying why."""
    script = rerun_main_script()
    if script is not None:
        raise ConfigError(f"{script} builds a job at its top level, and this worker process "
                          f"({mp.current_process().name}) is importing that script again, as every worker a "
                          "calibration or a local job starts does, so the script's code would run again in each "
                          "worker: put the code that builds, plans and launches jobs under "
                          "`if __name__ == \"__main__\":` (a notebook needs nothing)")
    data = resolve_data(job, search)
    spec = resolve_model(job, data.tokenizer, data.fields, search, from_text=data.tokens is not None)
    return ResolvedJob(spec, data, check_together(spec, data, job) if check else None)


def model_identity(job: JobConfig, resolved: ResolvedJob | None = None) -> dict:
    """Plain data naming exactly the job's model (factory, arguments, code hash) — a calibration
    cache key part."""
    return (resolved or resolve_job(job)).spec.identity
