"""Typed job configuration with YAML round-trip and eager validation.

Owns the long-lived configuration types (``ModelConfig``, ``DataConfig``, ``ParallelConfig``,
``TrainConfig``, ``LaunchConfig``, ``JobConfig``) and ``ClusterConfig`` (``varuna launch``'s
options: where the workers run, heartbeats). Every check runs before any process starts
and every message says what is wrong and which values would work. The batch identity (paper
§4.1–4.2, DESIGN.md) is::

    global batch (mini-batch) = micro_batch_size × num_micro_batches (m) × D      (never × P)

Imports nothing from the rest of ``varuna_sdk`` (it is the bottom of the dependency graph).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

POLICIES = ("varuna", "gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what would work."""


# ------------------------------------------------------------------------------ field rules
# Every field of every section has a rule (a test checks that none is missing); ``check_fields``
# applies them before any relationship between fields is checked, so no comparison below ever
# meets a string, NaN or a list where a number belongs.
MAX_TEXT = 4096            # characters of any string field (paths, import paths, names)
MAX_ITEMS = 4096           # items of any list, and entries of a mapping tree (kwargs)
MAX_DEPTH = 8              # nesting of kwargs mappings
MAX_CONFIG_BYTES = 1 << 20  # a job YAML file or text
MAX_GPUS = 4096            # workers a job (and the planner's search) may have
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@dataclass(frozen=True)
class Int:
    """An integer (not a bool) in [lo, hi]."""

    lo: int
    hi: int
    optional: bool = False

    def check(self, where: str, v: Any) -> None:
        if v is None and self.optional:
            return
        null = ", or null" if self.optional else ""
        if not _is_int(v):
            raise ConfigError(f"{where}={_show(v)} must be an integer >= {self.lo}{null}")
        if v < self.lo:
            raise ConfigError(f"{where}={v} must be an integer >= {self.lo}{null}")
        if v > self.hi:
            raise ConfigError(f"{where}={v} must be an integer <= {self.hi}")


@dataclass(frozen=True)
class Num:
    """A finite real number in [lo, hi] (``lo_open``/``hi_open``: the bound itself excluded)."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False
    unit: str = ""

    def describe(self) -> str:
        return (f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
                + (f" ({self.unit})" if self.unit else ""))

    def check(self, where: str, v: Any) -> None:
        if v is None and self.optional:
            return
        null = ", or null" if self.optional else ""
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"{where}={_show(v)} must be a finite number in {self.describe()}{null}")
        low = v <= self.lo if self.lo_open else v < self.lo
        high = v >= self.hi if self.hi_open else v > self.hi
        if low or high:
            raise ConfigError(f"{where}={v!r} must be in {self.describe()}{null}")


@dataclass(frozen=True)
class Text:
    """A non-empty string of at most ``MAX_TEXT`` characters (one of ``choices`` when given)."""

    choices: tuple[str, ...] | None = None
    optional: bool = False
    hint: str = ""   # what the value is, for the message ("a path or an fsspec URL ...")

    def check(self, where: str, v: Any) -> None:
        if v is None and self.optional:
            return
        if self.choices is not None:
            if v not in self.choices:
                raise ConfigError(f"{where}={_show(v)}; choose one of {list(self.choices)}")
            return
        null = " or null" if self.optional else ""
        if not isinstance(v, str) or not v.strip():
            raise ConfigError(f"{where}={_show(v)} must be {self.hint or 'a non-empty string'}{null}")
        if len(v) > MAX_TEXT or "\x00" in v:
            raise ConfigError(f"{where} is {len(v)} characters{' with a NUL' if chr(0) in v else ''}; "
                              f"at most {MAX_TEXT}, no NUL")


@dataclass(frozen=True)
class Flag:
    """``true`` or ``false`` (or null when optional)."""

    optional: bool = False

    def check(self, where: str, v: Any) -> None:
        if not (isinstance(v, bool) or (v is None and self.optional)):
            raise ConfigError(f"{where}={_show(v)} must be true or false" + (", or null" if self.optional else ""))


@dataclass(frozen=True)
class Plain:
    """Plain data: a mapping (``kind="map"``), a list of names (``"names"``), a list of lists of
    integers (``"index_lists"``) or names-or-mapping (``"inputs"``); bounded in size and depth, floats
    finite, keys strings."""

    kind: str
    optional: bool = True

    def check(self, where: str, v: Any) -> None:
        if v is None and self.optional:
            return
        if self.kind == "map":
            if not isinstance(v, dict):
                raise ConfigError(f"{where} must be a mapping of names to values, got {_show(v)}")
            _check_tree(where, v, [0], 0)
        elif self.kind == "names":
            if not (isinstance(v, list) and len(v) <= MAX_ITEMS
                    and all(isinstance(x, str) and 0 < len(x) <= MAX_TEXT for x in v)):
                raise ConfigError(f"{where}={_show(v)} must be a list of names (at most {MAX_ITEMS}), or null")
        elif self.kind == "index_lists":
            if not (isinstance(v, list) and len(v) <= MAX_ITEMS and all(
                    isinstance(x, list) and len(x) <= MAX_ITEMS and all(_is_int(i) and 0 <= i < 1 << 20 for i in x)
                    for x in v)):
                raise ConfigError(f"{where}={_show(v)} must be one list of segment indices (integers >= 0) per "
                                  "stage, e.g. [[0, 1], [2, 3]], or null")
        elif self.kind == "inputs":
            ok = (isinstance(v, list) and 0 < len(v) <= MAX_ITEMS and all(isinstance(x, str) for x in v)) or (
                isinstance(v, dict) and 0 < len(v) <= MAX_ITEMS
                and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()))
            if not ok:
                raise ConfigError(f"{where}={_show(v)} must be a list of batch field names (positional) or a "
                                  "mapping argument -> field name, e.g. {input_ids: input_ids, labels: labels}")


def _check_tree(where: str, v: Any, count: list[int], depth: int) -> None:
    count[0] += 1
    if count[0] > MAX_ITEMS:
        raise ConfigError(f"{where} holds more than {MAX_ITEMS} values; pass large data as a file")
    if depth > MAX_DEPTH:
        raise ConfigError(f"{where} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where}={v!r}: values must be finite numbers")
    if isinstance(v, str) and len(v) > MAX_TEXT:
        raise ConfigError(f"{where} holds a string of {len(v)} characters (at most {MAX_TEXT})")
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where} has key {_show(k)}; keys must be names (strings)")
            _check_tree(f"{where}.{k}", x, count, depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_tree(f"{where}[{i}]", x, count, depth + 1)
    elif not (v is None or isinstance(v, (bool, int, float, str))):
        raise ConfigError(f"{where}={_show(v)} must be plain data (numbers, strings, lists, mappings)")


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
    (Varuna: on; GPipe, 1F1B: off). ``split_backward`` (Varuna only) splits each backward into
    the input gradient (B, sent upstream at once) and the weight gradients (W, deferred into the
    stage's waits; the zero-bubble split); ``None`` = the policy's default. ``P``/``D`` ``None`` =
    let the planner choose for ``launch.gpus`` workers from a calibration (paper §4.4)."""

    P: int | None = 1
    D: int | None = 1
    global_batch: int = 8
    micro_batch_size: int = 1
    policy: str = "varuna"
    recompute: bool | None = None
    boundaries: list[list[int]] | None = None
    shared_params: list[str] | None = None
    split_backward: bool | None = None

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
class ClusterConfig:
    """Where ``varuna launch`` runs a job's workers and how its manager watches them (the
    command's options, typed; not part of the job's YAML). At most one of ``local``, ``hosts``
    and ``provider`` is set; none means ``launch.gpus`` local worker slots.

    Fields:
        local: N local worker slots (``--local N``), each a worker process on this machine.
        hosts: path of an SSH host file, watched: a VM added or removed there joins or leaves
            the pool (``--hosts FILE``; ``cluster.hostfile``).
        provider: a cloud of spot VMs: ``"aws"`` (EC2 through boto3; ``cluster.aws``).
        aws_file: a YAML mapping of ``cluster.aws.AWSSpotConfig`` fields (``--aws FILE``).
        aws: AWSSpotConfig fields given as flags (region, instance_types, ami, subnets, ...);
            they override ``aws_file``'s.
        instances: spot instances to keep (>= 1; default ``launch.gpus``).
        endpoint_url: another EC2 endpoint (an API emulator).
        run_dir: the job's own folder; an existing one is continued. Needed with a provider:
            its name is the job id every instance is tagged with.
        job_id: the job's id in the event log (default: made from the run folder's name).
        heartbeat_interval_s: seconds between a worker's heartbeats (> 0).
        orphan_after_s: seconds after which workers that lost the manager stop at a mini-batch
            boundary with a checkpoint (> 0).
    """

    local: int | None = None
    hosts: str | None = None
    provider: str | None = None
    aws_file: str | None = None
    aws: dict[str, Any] = field(default_factory=dict)
    instances: int | None = None
    endpoint_url: str | None = None
    run_dir: str | None = None
    job_id: str | None = None
    heartbeat_interval_s: float = 2.0
    orphan_after_s: float = 60.0

    def validate(self) -> "ClusterConfig":
        """Check the options before any VM is asked for; returns ``self``. Raises ``ConfigError``
        naming the option (as a ``varuna launch`` flag) and what would work."""
        if self.heartbeat_interval_s <= 0 or self.orphan_after_s <= 0:
            raise ConfigError("--heartbeat and --orphan-after must be > 0 seconds")
        given = [f for f, v in (("--local", self.local), ("--hosts", self.hosts), ("--provider", self.provider))
                 if v is not None]
        if len(given) > 1:
            raise ConfigError(f"{', '.join(given)}: each says where the workers run; give one of them")
        if self.provider not in (None, "aws"):
            raise ConfigError(f"--provider {self.provider!r} is not known; the providers are: aws")
        if self.provider == "aws":
            if not self.run_dir:
                raise ConfigError("--provider aws needs --run-dir: its name is the job id every instance is tagged with")
            if self.instances is not None and self.instances < 1:
                raise ConfigError(f"--instances {self.instances}: give the number of spot instances to keep (>= 1)")
        return self


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
        """Load a YAML file (``load_yaml``: safe, no aliases, at most ``MAX_CONFIG_BYTES``). Raises
        ``ConfigError`` naming the file if it does not exist, is not YAML (with the line) or holds
        unknown keys."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {str(path)!r} is {p.stat().st_size} bytes; a job config is at most "
                              f"{MAX_CONFIG_BYTES} bytes")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text") from None
        if not text.strip():
            raise ConfigError(f"config file {str(path)!r} is empty; start from `varuna config > job.yaml` and edit it")
        try:
            job = cls.from_yaml_text(text, source=str(path))
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if str(path) in msg else f"{path}: {_unknown_key_line(msg, text)}{msg}") from None
        job._origin = (str(path), field_lines(text))
        return job

    @classmethod
    def from_yaml_text(cls, text: str, *, source: str = "<config text>") -> "JobConfig":
        """Parse YAML text into a ``JobConfig`` (see ``load_yaml``)."""
        return cls.from_dict(load_yaml(text, source=source) or {})

    # ---- validation --------------------------------------------------------------------
    def validate(self) -> "JobConfig":
        """Check every field's type and range (``RULES``), then how fields fit together; raise
        ``ConfigError`` for the first problem, naming the field and what would work — and, for a
        config read by ``from_yaml`` whose field still holds the file's value, the file and line."""
        try:
            return self._validate()
        except ConfigError as e:
            raise ConfigError(self._located(str(e))) from None

    def _located(self, msg: str) -> str:
        """``msg`` prefixed by ``FILE: line N:`` when it starts with a ``section.field`` that still
        holds the value read from that line (a value overridden since, e.g. by a CLI flag, is not
        the file's fault)."""
        path, lines = getattr(self, "_origin", (None, {}))
        m = re.match(r"(\w+)\.(\w+)", msg)
        if path is None or m is None or m.group(0) not in lines or msg.startswith(path):
            return msg
        line, value = lines[m.group(0)]
        section = getattr(self, m.group(1), None)
        return f"{path}: line {line}: {msg}" if getattr(section, m.group(2), object()) == value else msg

    def _validate(self) -> "JobConfig":
        check_name(self.name)
        for name in ("model", "data", "parallel", "train", "launch"):
            section = getattr(self, name)
            if type(section) is not type(getattr(JobConfig(), name)):
                raise ConfigError(f"config section {name!r} must be a mapping, got {type(section).__name__}")
        validate_parallel(self.parallel)
        t = self.train
        check_fields("train", t)
        if t.min_lr > t.lr:
            raise ConfigError(f"train.min_lr={t.min_lr} must be <= train.lr={t.lr} (the cosine decays from lr to "
                              "min_lr)")
        validate_checkpointing(t)
        validate_model(self.model)
        validate_data(self.data)
        check_fields("launch", self.launch)
        return self


_OPT = Text(optional=True)
BIG = 10 ** 9
RULES: dict[type, dict[str, Any]] = {
    ModelConfig: {"preset": _OPT, "n_layer": Int(1, 4096, True), "n_head": Int(1, 4096, True),
                  "n_embd": Int(1, 1 << 17, True), "dropout": Num(0.0, 1.0, hi_open=True, unit="a probability"),
                  "factory": _OPT, "kwargs": Plain("map", optional=False), "loss": _OPT,
                  "inputs": Plain("inputs"), "targets": _OPT, "blocks": _OPT, "init": _OPT, "by_value": _OPT},
    DataConfig: {"corpus": _OPT, "path": _OPT,
                 "format": Text(("auto", "text", "tokens", "hf", "json", "jsonl", "parquet", "csv")),
                 "text_column": Text(), "token_dtype": Text(("uint16", "uint32"), optional=True), "dataset": _OPT,
                 "dataset_kwargs": Plain("map", optional=False), "by_value": _OPT, "tokenizer": Text(),
                 "seq_len": Int(1, 1 << 20), "val_fraction": Num(0.0, 1.0, True, True),
                 "seed": Int(0, 2 ** 63 - 1)},
    ParallelConfig: {"P": Int(1, 4096, True), "D": Int(1, 1 << 20, True), "global_batch": Int(1, 1 << 30),
                     "micro_batch_size": Int(1, 1 << 20), "policy": Text(POLICIES), "recompute": Flag(True),
                     "split_backward": Flag(True), "boundaries": Plain("index_lists"), "shared_params": Plain("names")},
    TrainConfig: {"steps": Int(1, BIG), "lr": Num(0.0, 10.0, lo_open=True), "min_lr": Num(0.0, 10.0),
                  "weight_decay": Num(0.0, 10.0), "warmup_steps": Int(0, BIG),
                  "grad_clip": Num(0.0, 1e9, lo_open=True, optional=True), "precision": Text(PRECISIONS),
                  "loss_scale": Num(1.0, 2.0 ** 64), "seed": Int(0, 2 ** 63 - 1), "eval_batches": Int(0, 1 << 20),
                  "run_dir": Text(), "checkpoint_every": Int(0, BIG), "checkpoint_url": Text(optional=True, hint=(
                      "a path or an fsspec URL (e.g. '/shared/ckpt', 'file:///shared/ckpt', 's3://bucket/job'); "
                      "null: <run folder>/checkpoints")),
                  "keep_checkpoints": Int(1, 10_000), "resume": Flag()},
    LaunchConfig: {"backend": Text(("auto", "gloo", "nccl")), "gpus": Int(1, MAX_GPUS), "master_addr": Text(),
                   "master_port": Int(0, 65535), "timeout_s": Num(0.0, 7 * 86400.0, lo_open=True, unit="seconds"),
                   "threads_per_worker": Int(1, 1024)},
}


def check_fields(section: str, obj: Any) -> None:
    """Apply ``RULES`` to every field of the section ``obj`` (a config dataclass): each value has
    its type and range (finite floats, integers that are integers, bounded strings, lists and
    mappings). Raises ``ConfigError`` naming ``section.field``, the value and what would work."""
    rules = RULES[type(obj)]
    for f in fields(obj):
        rules[f.name].check(f"{section}.{f.name}", getattr(obj, f.name))


def check_name(name: Any) -> None:
    """A job name: 1-100 letters, digits, ``.``, ``_`` or ``-``, not starting with ``.``/``-`` — it names
    the run folder inside ``train.run_dir``, so it can never point elsewhere."""
    if not (isinstance(name, str) and NAME_RE.match(name)) or name in (".", ".."):
        raise ConfigError(f"name={_show(name)} must be 1-100 letters, digits, '.', '_' or '-' starting with a letter "
                          "or digit (it names the run folder inside train.run_dir), e.g. 'my-model-run'")


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases (``*name``): a few lines of anchors and aliases can
    expand to gigabytes ("billion laughs"), and a job config never needs them."""

    def construct_mapping(self, node, deep=False):  # noqa: D102 - PyYAML's hook
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} appears twice (first on line "
                                  f"{seen[key]}); the second would silently replace the first: keep one")
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)

    def compose_node(self, parent, index):  # noqa: D102 - PyYAML's hook
        if self.check_event(yaml.events.AliasEvent):
            ev = self.peek_event()
            raise ConfigError(f"line {ev.start_mark.line + 1}: YAML alias *{ev.anchor} is not allowed in a job config "
                              "(aliases can expand a small file enormously); write the value out")
        return super().compose_node(parent, index)


def _unknown_key_line(msg: str, text: str) -> str:
    """``"line N: "`` for a message about an unknown section or key (``from_dict``'s), else ``""``."""
    m = re.search(r"unknown key\(s\) \['([^']+)'.*? in '(\w+)'", msg) or re.search(r"unknown config section '([^']+)'", msg)
    if m is None:
        return ""
    key = f"{m.group(2)}.{m.group(1)}" if m.lastindex == 2 else m.group(1)
    hit = field_lines(text).get(key)
    return f"line {hit[0]}: " if hit else ""


def field_lines(text: str) -> dict[str, tuple[int, Any]]:
    """``"section.field"`` → (its line in ``text``, 1-based; the value there) for every field of a
    job config's sections, for messages that name the line. Empty when ``text`` does not parse
    (``load_yaml`` has said why by then)."""
    try:
        root = yaml.compose(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, ConfigError, RecursionError, ValueError):
        return {}
    out: dict[str, tuple[int, Any]] = {}
    if not isinstance(root, yaml.MappingNode):
        return out
    for sec_key, sec in root.value:
        out[str(sec_key.value)] = (sec_key.start_mark.line + 1, None)
        if not isinstance(sec, yaml.MappingNode):
            continue
        for key, val in sec.value:
            try:
                value = yaml.load(yaml.serialize(val), Loader=_NoAliasLoader)  # noqa: S506
            except (yaml.YAMLError, ConfigError, RecursionError, ValueError):
                continue
            out[f"{sec_key.value}.{key.value}"] = (key.start_mark.line + 1, value)
    return out


def load_yaml(text: str, *, source: str = "<config text>") -> Any:
    """Parse untrusted YAML: safe types only, no aliases, at most ``MAX_CONFIG_BYTES``; every
    failure is a ``ConfigError`` naming ``source`` and the line (never a PyYAML traceback)."""
    if not isinstance(text, str):
        raise ConfigError(f"{source}: expected YAML text, got {type(text).__name__}")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source} is more than {MAX_CONFIG_BYTES} bytes; a config is at most that")
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{source}:{where}: not valid YAML: {e.problem or e.context}") from None
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        raise ConfigError(f"{source}: not valid YAML ({type(e).__name__}: {str(e)[:200]})") from None


def _is_import_path(v: Any) -> bool:
    if not isinstance(v, str) or v.count(":") != 1:
        return False
    mod, obj = v.split(":")
    return all(p.isidentifier() for p in mod.split(".")) and all(p.isidentifier() for p in obj.split("."))


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
                          "'package.module:function' of (output, targets) -> scalar")
    if m.init is not None and not _is_import_path(m.init):
        raise ConfigError(f"model.init={m.init!r} must be null (the model's own constructor) or an import path "
                          "'package.module:function' of init_fn(module, name)")


def validate_data(d: DataConfig) -> None:
    """Check the data section's values; raise ``ConfigError`` saying what would work. (Whether
    the files exist and hold usable data is checked by ``jobspec`` before workers start.)"""
    check_fields("data", d)
    if d.dataset is not None and not _is_import_path(d.dataset):
        raise ConfigError(f"data.dataset={d.dataset!r} must be an import path 'package.module:function' returning a "
                          "torch.utils.data.Dataset")


def _build(cls: type, value: Any, section: str):
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise ConfigError(f"config section {section!r} must be a mapping, got {type(value).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(value) - names
    if unknown:
        import difflib

        near = {k: difflib.get_close_matches(str(k), names, n=1) for k in sorted(unknown, key=str)}
        hint = "; ".join(f"did you mean {m[0]!r} for {k!r}?" for k, m in near.items() if m)
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in {section!r}; valid keys: {sorted(names)}"
                          + (f" ({hint})" if hint else ""))
    return cls(**value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_checkpointing(t: TrainConfig) -> None:
    """Check the checkpoint fields of ``train``; raise ``ConfigError`` saying what would work.

    ``checkpoint_every`` an integer >= 0 (0 = off), ``keep_checkpoints`` >= 1, ``resume`` a bool,
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
    check_fields("parallel", p)   # P and D may be null: chosen by the planner
    if p.split_backward and p.policy != "varuna":
        raise ConfigError(
            f"parallel.split_backward=true applies to the varuna policy only (policy={p.policy!r} runs its "
            "backward whole, as published); set split_backward to false or null, or policy to 'varuna'"
        )
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
