"""Typed job configuration with YAML round-trip and eager validation.

Owns the whole job (``JobConfig``: its YAML round-trip and ``validate``) and ``ClusterConfig``
(``varuna launch``'s options: where the workers run, heartbeats); the package's face re-exports
the rest, so ``from varuna_sdk.config import X`` is the one way in:

- ``config.sections``: the five sections (``ModelConfig``, ``DataConfig``, ``ParallelConfig``,
  ``TrainConfig``, ``LaunchConfig``), every field's rule (``RULES``, ``check_fields``),
  ``POLICIES`` and ``PRECISIONS``;
- ``config.fields``: the rule descriptors (``Int``, ``Num``, ``Text``, ``Flag``, ``Plain``), the
  input limits (``MAX_*``), the job name's pattern and ``ConfigError``;
- ``config.checks``: how fields fit together (``validate_model``, ``validate_data``,
  ``validate_checkpointing``, ``validate_parallel``);
- ``config.yamlio``: reading untrusted YAML (``load_yaml``, ``field_lines``).

Every check runs before any process starts and every message says what is wrong and which values
would work. The batch identity (paper §4.1–4.2, DESIGN.md) is::

    global batch (mini-batch) = micro_batch_size × num_micro_batches (m) × D      (never × P)

Imports nothing from the rest of ``varuna_sdk`` (it is the bottom of the dependency graph), and
its sub-modules nothing from outside ``varuna_sdk.config``.
"""

from __future__ import annotations

import math
import dataclasses  # dataclasses.fields, always qualified: `fields` here is the sub-module config.fields
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .checks import validate_checkpointing, validate_data, validate_model, validate_parallel
from .fields import (MAX_CONFIG_BYTES, MAX_DEPTH, MAX_GPUS, MAX_ITEMS, MAX_TEXT, NAME_RE, ConfigError, Flag, Int,
                     Num, Plain, Text, check_name, plain)
from .sections import (POLICIES, PRECISIONS, RULES, DataConfig, LaunchConfig, ModelConfig, ParallelConfig,
                       TrainConfig, check_fields)
from .yamlio import field_lines, load_yaml, unknown_key_line

__all__ = [
    "MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_GPUS", "MAX_ITEMS", "MAX_TEXT", "NAME_RE", "POLICIES", "PRECISIONS",
    "RULES", "ClusterConfig", "ConfigError", "DataConfig", "Flag", "Int", "JobConfig", "LaunchConfig", "ModelConfig",
    "Num", "ParallelConfig", "Plain", "Text", "TrainConfig", "check_fields", "check_name", "field_lines", "load_yaml",
    "replace", "validate_checkpointing", "validate_data", "validate_model", "validate_parallel",
]


AWS_FLAGS = {"region": "--region", "instance_types": "--instance-type", "ami": "--ami", "subnets": "--subnet",
             "security_group": "--security-group", "key_name": "--key-name", "key_path": "--key-path",
             "max_price": "--max-price", "user": "--vm-user", "python": "--vm-python"}
"""``ClusterConfig.aws`` keys (``cluster.aws.AWSSpotConfig`` fields) -> the ``varuna launch`` flag that sets each."""


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
        job_id: the job's id in the event log: the run folder's name (given, it must be that name,
            and ``run_dir`` must be given; ``ConfigError`` otherwise).
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

    def _check_timing(self) -> None:
        """``--heartbeat`` and ``--orphan-after``: finite numbers of seconds, the second longer than
        the manager's loss timeout (2 missed heartbeats), else orphans would stop live workers."""
        for flag, v in (("--heartbeat", self.heartbeat_interval_s), ("--orphan-after", self.orphan_after_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{flag} {v!r}: give a number of seconds > 0")
        if self.orphan_after_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError(f"--orphan-after {self.orphan_after_s:g} must exceed the manager's loss timeout, two "
                              f"heartbeats ({2 * self.heartbeat_interval_s:g} s with --heartbeat "
                              f"{self.heartbeat_interval_s:g}); raise --orphan-after or lower --heartbeat")

    def _check_job_id(self) -> None:
        """``--job-id`` must be the run folder's name: a later start on the folder (without
        ``--job-id``) finds the job by that name, and would otherwise start a new job there —
        a finished job run again."""
        from pathlib import Path

        if not self.run_dir:
            raise ConfigError(f"--job-id {self.job_id}: the job id is the run folder's name, and without --run-dir "
                              f"the folder is a new NAME-TIME one; pass --run-dir DIR/{self.job_id} (and drop "
                              "--job-id), or leave --job-id out")
        folder = Path(self.run_dir).resolve().name
        if self.job_id != folder:
            raise ConfigError(f"--job-id {self.job_id} is not the run folder's name ({folder!r}): the job id is the "
                              f"run folder's name, so a later `varuna launch ... --run-dir {self.run_dir}` finds the "
                              f"job by it. Leave --job-id out (or pass --job-id {folder}), or name the run folder "
                              f"{self.job_id}")

    def validate(self) -> "ClusterConfig":
        """Check the options before any VM is asked for; returns ``self``. Raises ``ConfigError``
        naming the option (as a ``varuna launch`` flag) and what would work: an empty ``--run-dir``, a
        ``--job-id`` other than the run folder's name (or without ``--run-dir``) too."""
        self._check_timing()
        given = [f for f, v in (("--local", self.local), ("--hosts", self.hosts), ("--provider", self.provider))
                 if v is not None]
        if len(given) > 1:
            raise ConfigError(f"{', '.join(given)}: each says where the workers run; give one of them")
        if self.provider not in (None, "aws"):
            raise ConfigError(f"--provider {self.provider!r} is not known; the providers are: aws")
        if self.local is not None and (isinstance(self.local, bool) or not isinstance(self.local, int)
                                       or self.local < 1):
            raise ConfigError(f"--local {self.local!r}: give the number of local worker slots (an integer >= 1)")
        aws_only = [f for f, v in (("--aws", self.aws_file), ("--instances", self.instances),
                                   ("--endpoint-url", self.endpoint_url)) if v is not None]
        aws_only += [AWS_FLAGS.get(k, k) for k in self.aws]
        if aws_only and self.provider != "aws":
            raise ConfigError(f"{', '.join(aws_only)}: options of AWS spot VMs; add --provider aws, or drop them")
        if self.run_dir is not None and not str(self.run_dir).strip():
            raise ConfigError(f"--run-dir {self.run_dir!r}: the run folder is empty, which would make the current "
                              "directory the job's run folder; name a folder (e.g. --run-dir runs/my-job), or leave "
                              "it out for a new NAME-TIME folder inside train.run_dir")
        if self.job_id is not None:
            self._check_job_id()
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
        """The job as plain data (nested dicts), as ``from_dict`` takes it (NumPy scalars as Python
        values, tuples as lists: ``fields.plain``)."""
        return plain(asdict(self))

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The job as YAML text, also written to ``path`` when given."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_yaml_beside_defaults(self, whose: str = "this job's") -> str:
        """``to_yaml()`` with every field whose value is not the default marked on its line,
        ``# <whose>; left out: <default>`` (``varuna config`` prints the demo's job so: its lr is the
        demo's, and a config that leaves lr out gets the default), under one header line saying so."""
        defaults = JobConfig().to_dict()
        mine = self.to_dict()

        def shown(v: Any) -> str:
            return yaml.safe_dump(v, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()

        out = [f"# values marked `{whose}` are {whose} own; a config that leaves such a field out gets the default "
               "named after `left out:`"]
        section = None
        for line in self.to_yaml().splitlines():
            key = line.split(":", 1)[0].strip()
            if not line.startswith(" "):
                section = key if isinstance(mine.get(key), dict) else None
            elif section is not None and line.startswith("  ") and not line.startswith("   ") \
                    and not line.lstrip().startswith("- ") and key in mine[section]:
                new, default = mine[section][key], defaults.get(section, {}).get(key)
                if new != default:
                    line = f"{line}   # {whose}; left out: {shown(default)}"
            out.append(line)
        return "\n".join(out) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobConfig":
        """Build from plain data; unknown keys raise ``ConfigError`` naming the valid keys."""
        if not isinstance(data, dict):
            raise ConfigError(f"a job config must be a mapping, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        sections = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key not in sections:
                import difflib

                near = difflib.get_close_matches(str(key), sections, n=1)
                raise ConfigError(f"unknown config section {key!r}; valid sections: {sorted(sections)}"
                                  + (f" (did you mean {near[0]!r}?)" if near else ""))
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
        if p.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a folder; give the job's YAML file inside it (e.g. "
                              f"{str(p / 'job.yaml')!r})")
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
            raise ConfigError(msg if str(path) in msg else f"{path}: {unknown_key_line(msg, text)}{msg}") from None
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


def _build(cls: type, value: Any, section: str):
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise ConfigError(f"config section {section!r} must be a mapping, got {type(value).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(value) - names
    if unknown:
        from .fields import fixed_hint, near_names

        near = {k: near_names(k, names) for k in sorted(unknown, key=str)}
        hint = "; ".join([f"{k!r}: {fixed_hint(k)}" for k in sorted(unknown, key=str) if fixed_hint(k)]
                         + [f"did you mean {m[0]!r} for {k!r}?" for k, m in near.items() if m and not fixed_hint(k)])
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in {section!r}; valid keys: {sorted(names)}"
                          + (f" ({hint})" if hint else ""))
    return cls(**value)


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` re-exported for convenience."""
    return dataclasses.replace(cfg, **changes)
