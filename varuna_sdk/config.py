"""Typed job configuration with YAML round-trip and eager validation.

Owns the long-lived configuration types (``ModelConfig``, ``DataConfig``, ``ParallelConfig``,
``TrainConfig``, ``LaunchConfig``, ``JobConfig``). Every check runs before any process starts
and every message says what is wrong and which values would work. The batch identity (paper
§4.1–4.2, DESIGN.md) is::

    global batch (mini-batch) = micro_batch_size × num_micro_batches (m) × D      (never × P)

Imports nothing from the rest of ``varuna_sdk`` (it is the bottom of the dependency graph).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

POLICIES = ("varuna", "gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what would work."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ModelConfig:
    """Which model to train (the *model spec*, DESIGN.md), named one of three ways:

    - ``factory``: an import path ``package.module:function`` (or ``:Class``) in the user's code
      folder, called as ``function(**kwargs)`` and returning the whole ``nn.Module`` (its tensors
      are made on the meta device; each worker computes only its stage's) — or the name of a
      registered model (``gpt2``, ``hf-causal-lm``; see ``varuna_sdk.jobspec.MODELS``);
    - ``by_value``: set by ``Job(model=...)`` for a callable defined in a notebook cell or
      ``__main__``, shipped by value (cloudpickle) with the job — not written by hand;
    - neither: the GPT-2 ``preset`` (``tiny``, ``cpu-demo``, ``gpt2`` … ``gpt2-xl``, default
      ``cpu-demo``) with ``n_layer``/``n_head``/``n_embd``/``dropout`` overriding it.

    ``loss``: ``null`` (automatic: the model's own loss when its forward takes ``labels`` or
    ``targets``, else cross-entropy of its logits), ``model``, ``cross_entropy`` or an import path
    of ``(output, targets) -> scalar``. ``inputs``: which batch fields feed the forward — a list
    (positional) or a mapping argument → field; ``targets``: the field the loss compares with
    (``null``: automatic; see ``model.spec.infer_call``). ``blocks``: the dotted name of the
    model's list of layers where cut-points go (``null``: its largest ``ModuleList``). ``init``:
    ``null`` (the model's own constructor, replayed per stage) or an import path of
    ``init_fn(module, name)`` for a model too large to record once."""

    preset: str | None = None
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    dropout: float = 0.0
    factory: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss: str | None = None
    inputs: list[str] | dict[str, str] | None = None
    targets: str | None = None
    blocks: str | None = None
    init: str | None = None
    by_value: str | None = None


@dataclass
class DataConfig:
    """Training data, tokenizer and sequence length.

    Where the data comes from (the first that is set): ``by_value`` (a dataset factory shipped
    by ``Job(data=...)``), ``dataset`` (an import path ``pkg.mod:fn`` returning a map-style
    ``torch.utils.data.Dataset``, called with ``dataset_kwargs``), ``path`` (a text file, a folder
    of text files, a pre-tokenized ``.bin`` (``token_dtype`` ``uint16``/``uint32``) or ``.npy``
    file, a ``datasets`` dataset saved with ``save_to_disk``, or local ``json``/``jsonl``/
    ``parquet``/``csv`` files whose ``text_column`` holds the text; ``format`` ``auto`` tells them
    apart), else the shipped ``corpus`` (``shakespeare``, the default; ignored when one of the
    others is set). ``tokenizer``: ``gpt2`` (real BPE),
    ``byte``, or the path of a ``tokenizer.json``. ``seq_len`` tokens per example, the held-out
    fraction (the end of the data) and the data seed (the order of examples)."""

    corpus: str | None = "shakespeare"
    path: str | None = None
    format: str = "auto"
    text_column: str = "text"
    token_dtype: str | None = None
    dataset: str | None = None
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    by_value: str | None = None
    tokenizer: str = "gpt2"
    seq_len: int = 128
    val_fraction: float = 0.05
    seed: int = 0


@dataclass
class ParallelConfig:
    """How the job is split. ``P`` stages × ``D`` replicas; ``global_batch`` examples per
    optimizer step (fixed, never changed by morphing) = ``micro_batch_size`` × m × ``D``.
    ``boundaries`` optionally gives the segment indices of each stage (``[[0, 1], [2, 3]]``);
    ``None`` balances stages on estimated cost. ``recompute`` ``None`` = the policy's default
    (Varuna: on; GPipe, 1F1B: off). ``P``/``D`` ``None`` = let the planner choose for
    ``launch.gpus`` workers from a calibration (paper §4.4)."""

    P: int | None = 1
    D: int | None = 1
    global_batch: int = 8
    micro_batch_size: int = 1
    policy: str = "varuna"
    recompute: bool | None = None
    boundaries: list[list[int]] | None = None
    shared_params: list[str] | None = None

    @property
    def num_micro_batches(self) -> int:
        """m = global_batch / (micro_batch_size × D)."""
        return self.global_batch // (self.micro_batch_size * self.D)

    @property
    def replica_batch(self) -> int:
        """Examples each replica processes per step (= global_batch / D)."""
        return self.global_batch // self.D

    @property
    def world_size(self) -> int:
        if self.P is None or self.D is None:
            raise ConfigError("P and D are not chosen yet (null = planned); run the planner first")
        return self.P * self.D

    @property
    def planned(self) -> bool:
        """True when P or D is left to the planner."""
        return self.P is None or self.D is None


@dataclass
class TrainConfig:
    """Optimisation: steps, AdamW learning rate and weight decay, warm-up steps (linear) then
    cosine decay to ``min_lr``, global grad-norm clipping (``None`` = off), numeric precision,
    initial dynamic loss scale for fp16, model seed, evaluation size, where runs are written.

    Checkpoints (paper §4.5, ``varuna_sdk.checkpoint``): ``checkpoint_every`` optimizer steps
    (0 = only when the job is asked to stop), published to ``checkpoint_url`` (a path or any fsspec
    URL such as ``s3://bucket/job``; ``None`` = ``<run folder>/checkpoints``), the newest
    ``keep_checkpoints`` complete ones kept; ``resume`` starts from the newest complete checkpoint
    in that store (under the job's current P, D and stage boundaries) when there is one."""

    steps: int = 50
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    warmup_steps: int = 5
    grad_clip: float | None = 1.0
    precision: str = "fp32"
    loss_scale: float = 2.0**16
    seed: int = 1234
    eval_batches: int = 8
    run_dir: str = "runs"
    checkpoint_every: int = 0
    checkpoint_url: str | None = None
    keep_checkpoints: int = 3
    resume: bool = True


@dataclass
class LaunchConfig:
    """Local launch: torch.distributed backend (``auto`` = NCCL when every worker has a GPU,
    else gloo), ``gpus`` = workers the planner may use when P/D are null, rendezvous address
    and port (0 = pick a free one), timeouts in seconds."""

    backend: str = "auto"
    gpus: int = 4
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 120.0
    threads_per_worker: int = 1


@dataclass
class JobConfig:
    """A whole training job. ``JobConfig.from_yaml(path)`` / ``to_yaml(path)`` round-trip;
    ``validate()`` raises ``ConfigError`` for the first problem, before any work starts."""

    name: str = "gpt2-shakespeare"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    # ---- YAML -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobConfig":
        """Build from plain data; unknown keys raise ``ConfigError`` naming the valid keys."""
        if not isinstance(data, dict):
            raise ConfigError(f"a job config must be a mapping, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        sections = {f.name: f for f in fields(cls)}
        for key, value in data.items():
            if key not in sections:
                raise ConfigError(f"unknown config section {key!r}; valid sections: {sorted(sections)}")
            sub_type = {"model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig,
                        "train": TrainConfig, "launch": LaunchConfig}.get(key)
            kwargs[key] = value if sub_type is None else _build(sub_type, value, key)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "JobConfig":
        """Load a YAML file (``yaml.safe_load``: no arbitrary objects). Raises ``ConfigError`` if the
        file does not exist or holds unknown keys."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        return cls.from_yaml_text(p.read_text())

    @classmethod
    def from_yaml_text(cls, text: str) -> "JobConfig":
        """Parse YAML text into a ``JobConfig``."""
        return cls.from_dict(yaml.safe_load(text) or {})

    # ---- validation --------------------------------------------------------------------
    def validate(self) -> "JobConfig":
        validate_parallel(self.parallel)
        t = self.train
        if t.steps < 1:
            raise ConfigError(f"train.steps={t.steps} must be >= 1")
        if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
            raise ConfigError(f"train.lr={t.lr} must be > 0 and 0 <= train.min_lr={t.min_lr} <= lr")
        if t.precision not in PRECISIONS:
            raise ConfigError(f"train.precision={t.precision!r}; choose one of {list(PRECISIONS)}")
        if t.grad_clip is not None and t.grad_clip <= 0:
            raise ConfigError(f"train.grad_clip={t.grad_clip} must be > 0, or null to disable clipping")
        if t.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be >= 0")
        validate_checkpointing(t)
        validate_model(self.model)
        validate_data(self.data)
        if self.launch.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"launch.backend={self.launch.backend!r}; choose auto, gloo or nccl")
        if self.launch.gpus < 1:
            raise ConfigError(f"launch.gpus={self.launch.gpus} must be >= 1")
        if not 0 <= self.launch.master_port < 65536:
            raise ConfigError(f"launch.master_port={self.launch.master_port} must be in 0..65535 (0 = pick a free port)")
        return self


def _is_import_path(v: Any) -> bool:
    if not isinstance(v, str) or v.count(":") != 1:
        return False
    mod, obj = v.split(":")
    return all(p.isidentifier() for p in mod.split(".")) and all(p.isidentifier() for p in obj.split("."))


def validate_model(m: ModelConfig) -> None:
    """Check the model section's shape (not the model itself: ``jobspec`` resolves and checks
    that); raise ``ConfigError`` saying what would work."""
    if not isinstance(m.dropout, (int, float)) or isinstance(m.dropout, bool) or not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout!r} must be in [0, 1) (a probability)")
    named = [k for k in ("factory", "by_value") if getattr(m, k) is not None]
    if len(named) > 1:
        raise ConfigError("model.factory and model.by_value both name a model; keep one")
    if named and (m.preset is not None or any(getattr(m, k) is not None for k in ("n_layer", "n_head", "n_embd"))):
        raise ConfigError(f"model.{named[0]} names the model, so model.preset/n_layer/n_head/n_embd (GPT-2 preset "
                          "fields) do not apply; remove them, or pass such settings in model.kwargs")
    if m.factory is not None and not (isinstance(m.factory, str) and m.factory.strip()):
        raise ConfigError(f"model.factory={m.factory!r} must be an import path 'package.module:function' or a "
                          "registered model name")
    if not isinstance(m.kwargs, dict) or not all(isinstance(k, str) for k in m.kwargs):
        raise ConfigError(f"model.kwargs must be a mapping of argument names to values, got {m.kwargs!r}")
    if m.loss is not None and m.loss not in ("model", "cross_entropy") and not _is_import_path(m.loss):
        raise ConfigError(f"model.loss={m.loss!r}; use null (automatic), model, cross_entropy, or an import path "
                          "'package.module:function' of (output, targets) -> scalar")
    if m.init is not None and not _is_import_path(m.init):
        raise ConfigError(f"model.init={m.init!r} must be null (the model's own constructor) or an import path "
                          "'package.module:function' of init_fn(module, name)")
    if m.inputs is not None:
        ok = (isinstance(m.inputs, list) and m.inputs and all(isinstance(x, str) for x in m.inputs)) or (
            isinstance(m.inputs, dict) and m.inputs and all(isinstance(k, str) and isinstance(v, str)
                                                             for k, v in m.inputs.items()))
        if not ok:
            raise ConfigError(f"model.inputs={m.inputs!r} must be a list of batch field names (positional) or a "
                              "mapping argument -> field name, e.g. {input_ids: input_ids, labels: labels}")
    for k in ("targets", "blocks", "preset"):
        v = getattr(m, k)
        if v is not None and not (isinstance(v, str) and v.strip()):
            raise ConfigError(f"model.{k}={v!r} must be a name or null")


def validate_data(d: DataConfig) -> None:
    """Check the data section's values; raise ``ConfigError`` saying what would work. (Whether
    the files exist and hold usable data is checked by ``jobspec`` before workers start.)"""
    if not _is_int(d.seq_len) or d.seq_len < 1:
        raise ConfigError(f"data.seq_len={d.seq_len!r} must be >= 1 (an integer number of tokens)")
    if not isinstance(d.val_fraction, (int, float)) or isinstance(d.val_fraction, bool) or not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction!r} must be between 0 and 1")
    if not _is_int(d.seed) or d.seed < 0:
        raise ConfigError(f"data.seed={d.seed!r} must be an integer >= 0")
    formats = ("auto", "text", "tokens", "hf", "json", "jsonl", "parquet", "csv")
    if d.format not in formats:
        raise ConfigError(f"data.format={d.format!r}; choose one of {list(formats)}")
    if d.token_dtype is not None and d.token_dtype not in ("uint16", "uint32"):
        raise ConfigError(f"data.token_dtype={d.token_dtype!r}; choose uint16 or uint32 (the width of each id)")
    if d.dataset is not None and not _is_import_path(d.dataset):
        raise ConfigError(f"data.dataset={d.dataset!r} must be an import path 'package.module:function' returning a "
                          "torch.utils.data.Dataset")
    if not isinstance(d.dataset_kwargs, dict):
        raise ConfigError(f"data.dataset_kwargs must be a mapping, got {d.dataset_kwargs!r}")
    for k in ("path", "corpus", "tokenizer", "text_column"):
        v = getattr(d, k)
        if v is not None and not (isinstance(v, str) and v.strip()):
            raise ConfigError(f"data.{k}={v!r} must be a non-empty string" + (" or null" if k != "tokenizer" else ""))


def _build(cls: type, value: Any, section: str):
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise ConfigError(f"config section {section!r} must be a mapping, got {type(value).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(value) - names
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in {section!r}; valid keys: {sorted(names)}")
    return cls(**value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_checkpointing(t: TrainConfig) -> None:
    """Check the checkpoint fields of ``train``; raise ``ConfigError`` saying what would work.

    ``checkpoint_every`` an integer >= 0 (0 = off), ``keep_checkpoints`` >= 1, ``resume`` a bool,
    ``checkpoint_url`` ``None``, a path, or a URL whose scheme fsspec knows (and whose driver is
    installed, e.g. ``s3fs`` for ``s3://``).
    """
    if not _is_int(t.checkpoint_every) or t.checkpoint_every < 0:
        raise ConfigError(f"train.checkpoint_every={t.checkpoint_every!r} must be an integer >= 0 "
                          "(optimizer steps between checkpoints; 0 = only when the job is stopped)")
    if not _is_int(t.keep_checkpoints) or t.keep_checkpoints < 1:
        raise ConfigError(f"train.keep_checkpoints={t.keep_checkpoints!r} must be an integer >= 1 "
                          "(how many complete checkpoints to keep)")
    if not isinstance(t.resume, bool):
        raise ConfigError(f"train.resume={t.resume!r} must be true or false")
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
    for name in ("P", "D", "global_batch", "micro_batch_size"):
        v = getattr(p, name)
        if v is None and name in ("P", "D"):
            continue  # chosen by the planner
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"parallel.{name}={v!r} must be an integer >= 1")
    if p.policy not in POLICIES:
        raise ConfigError(f"parallel.policy={p.policy!r}; choose one of {list(POLICIES)}")
    if p.planned:
        return
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


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` re-exported for convenience."""
    return dataclasses.replace(cfg, **changes)
