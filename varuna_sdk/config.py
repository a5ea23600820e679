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
from typing import Any, Literal

import yaml

POLICIES = ("varuna", "gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what would work."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ModelConfig:
    """Which model to train. ``preset`` names a GPT-2 shape (``tiny``, ``cpu-demo``, ``gpt2``,
    ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``); the other fields override it when set."""

    preset: str = "cpu-demo"
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    dropout: float = 0.0


@dataclass
class DataConfig:
    """Training text: ``corpus`` (``shakespeare``), ``tokenizer`` (``gpt2`` real BPE or ``byte``),
    sequence length in tokens, held-out fraction (the end of the corpus) and the data seed."""

    corpus: str = "shakespeare"
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
        t, d = self.train, self.data
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
        if d.seq_len < 1:
            raise ConfigError(f"data.seq_len={d.seq_len} must be >= 1")
        if not 0.0 < d.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={d.val_fraction} must be between 0 and 1")
        if not 0.0 <= self.model.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.model.dropout} must be in [0, 1)")
        if self.launch.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"launch.backend={self.launch.backend!r}; choose auto, gloo or nccl")
        if self.launch.gpus < 1:
            raise ConfigError(f"launch.gpus={self.launch.gpus} must be >= 1")
        if not 0 <= self.launch.master_port < 65536:
            raise ConfigError(f"launch.master_port={self.launch.master_port} must be in 0..65535 (0 = pick a free port)")
        return self


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
