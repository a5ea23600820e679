"""The manager's and a generation's settings as typed dataclasses, with every default in one place:
``GenerationOptions`` (how one generation of workers is started and watched: heartbeats,
bootstrap, SSH, ports, output) and ``ManagerOptions`` (the morph manager's rules, timeouts and
budgets, plus the ``GenerationOptions`` every generation it launches gets).

Callers may still give plain keywords (``Manager(..., stop_timeout_s=30, generation_options={"sink":
None})``, ``Generation(..., heartbeat_interval_s=1.0)``): ``ManagerOptions.merged`` and
``GenerationOptions.merged`` turn them into these types, and an unknown name raises ``TypeError``
naming it.

Owns ``GenerationOptions``, ``ManagerOptions``. Imports ``config`` (``ConfigError``), ``cluster``
(hosts, SSH, bootstrap and launch types) and ``manager.decisions`` (the rules); never torch, never
``manager.manager`` or ``manager.generation`` (they import this).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..cluster.bootstrap import VersionPolicy
from ..cluster.hosts import Host, Secret
from ..cluster.remote import LineSink, print_sink
from ..cluster.ssh import SSHOptions, SSHPool
from ..config import ConfigError
from .decisions import DriftRule, GrowRule, StragglerRule


def _merged(cls, base, overrides: Mapping[str, Any]):
    """``base`` (an instance of ``cls``, None: the defaults) with ``overrides`` replacing fields;
    ``TypeError`` naming an unknown field."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no option(s) {unknown}; known: {sorted(names)}")
    return dataclasses.replace(base if base is not None else cls(), **overrides)



def _check_number(opts: Any, name: str, *, low: float, high: float | None = None,
                  inclusive: bool = False) -> None:
    """``ConfigError`` unless ``opts.<name>`` is a finite number above ``low`` (at least, with
    ``inclusive``) and at most ``high``."""
    v = getattr(opts, name)
    number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not number or v < low or (v == low and not inclusive) or (high is not None and v > high):
        where = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        raise ConfigError(f"{name}={v!r}: give a number {where}")


def _check_int(opts: Any, name: str, *, low: int, high: int | None = None) -> None:
    """``ConfigError`` unless ``opts.<name>`` is an integer in ``[low, high]``."""
    v = getattr(opts, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        where = f">= {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(f"{name}={v!r}: give an integer {where}")

@dataclass(frozen=True)
class GenerationOptions:
    """How one generation of workers is started and watched (``manager.generation.Generation``)."""

    heartbeat_interval_s: float = 2.0
    """Seconds between a worker's heartbeats (also its metrics flush period)."""
    miss_limit: float = 2.0
    """A host is lost after this many silent heartbeat intervals (>= 1)."""
    start_timeout_s: float = 180.0
    """Seconds a worker may take after launch to say hello (torch import, model build)."""
    ssh_options: SSHOptions | None = None
    """How to reach SSH hosts (None: ``SSHOptions()`` defaults); unused when ``pool`` is given."""
    pool: SSHPool | None = None
    """An SSH connection pool to reuse (None: the generation opens and closes its own)."""
    code_dir: str | Path | None = None
    """The user's code folder: synced to ``<workdir>/code`` on SSH hosts (their working folder);
    a local worker's working folder (None: the current folder)."""
    setup: str | Sequence[str] | None = None
    """A command run once on each SSH host before its workers start (e.g. ``pip install -r ...``)."""
    setup_timeout_s: float = 600.0
    """Seconds ``setup`` may take per host."""
    version_policy: VersionPolicy | None = None
    """What a host's Python/torch/varuna_sdk versions must match (None: the bootstrap default)."""
    bootstrap: bool = True
    """Check versions and sync the code on SSH hosts before launch (False: skip, hosts are ready)."""
    remote_run_dir: str | Callable[[Host], str] | None = None
    """The run folder on SSH hosts: a path, or ``host -> path`` (None: ``<workdir>/varuna/<job_id>/run``);
    give a shared filesystem path when ranks must see each other's checkpoints."""
    cpu_slots: int = 1
    """Workers a CPU-only host runs (a GPU host runs one per GPU)."""
    manager_address: str | None = None
    """The address workers connect to for heartbeats (None: this machine's address on the route
    to each host)."""
    master_port: int = 0
    """The rendezvous port on rank 0's host (0: a free one, chosen below the ephemeral range)."""
    env: Mapping[str, str] | None = None
    """Extra environment variables for every worker."""
    sink: LineSink | None = print_sink
    """Where each worker output line goes, prefixed ``[vm rank r]`` (None: only ``gen<g>/workers.log``)."""
    token: Secret | None = None
    """The job secret that signs heartbeats (None: a fresh one per generation; the manager gives
    the job's own, kept in the run folder)."""
    kill_grace_s: float = 2.0
    """Seconds between SIGTERM and SIGKILL when workers are stopped."""
    startup_grace_s: float = 15.0
    """Silence allowed before a worker's first step (torch import on a busy VM), in seconds."""
    orphan_after_s: float | None = 60.0
    """A worker that cannot reach its manager this long (the manager died) stops at a boundary
    with a checkpoint by itself; None: never. Must exceed the loss timeout."""
    notice_poll_s: float = 5.0
    """Seconds between polls of a VM's cloud metadata for a pre-emption notice, in (0, 3600]."""

    @classmethod
    def merged(cls, base: "GenerationOptions | Mapping[str, Any] | None" = None,
               **overrides: Any) -> "GenerationOptions":
        """Options from ``base`` (options, a mapping of field names, or None: the defaults) with
        ``overrides`` on top. Raises ``TypeError`` naming an unknown option."""
        if isinstance(base, Mapping):
            overrides, base = {**base, **overrides}, None
        return _merged(cls, base, overrides)

    def validate(self) -> "GenerationOptions":
        """Check the values together; returns self. Raises ``ConfigError`` (a ``ValueError``) naming
        the option that is wrong and the range that would work."""
        for name in ("heartbeat_interval_s", "start_timeout_s", "setup_timeout_s"):
            _check_number(self, name, low=0.0)
        for name in ("kill_grace_s", "startup_grace_s"):
            _check_number(self, name, low=0.0, inclusive=True)
        _check_number(self, "miss_limit", low=1.0, inclusive=True)
        _check_number(self, "notice_poll_s", low=0.0, high=3600.0)
        _check_int(self, "cpu_slots", low=1)
        _check_int(self, "master_port", low=0, high=65535)
        lost_after = self.miss_limit * self.heartbeat_interval_s
        if self.orphan_after_s is not None:
            _check_number(self, "orphan_after_s", low=0.0)
            if self.orphan_after_s <= lost_after:
                raise ConfigError(f"orphan_after_s={self.orphan_after_s} must exceed the loss timeout "
                                  f"({lost_after:g} s), or be None")
        return self


@dataclass(frozen=True)
class ManagerOptions:
    """The morph manager's rules, timeouts and budgets (``manager.manager.Manager``)."""

    heartbeat_interval_s: float = 1.0
    """Workers' heartbeat period in seconds (a VM is lost after 2 missed); overrides the
    generation options' own."""
    grow: GrowRule | None = GrowRule()
    """When returned or new VMs are worth a morph (None: never grow)."""
    straggler: StragglerRule | None = StragglerRule()
    """When a slow worker's VM is excluded (None: never exclude one)."""
    drift: DriftRule | None = DriftRule()
    """When the measured step time has left the prediction: record ``estimate_drift`` and plan
    later morphs from the calibration scaled by the job's own heartbeats (None: never)."""
    stop_timeout_s: float = 60.0
    """Seconds workers may take to stop at a boundary and checkpoint before they are killed."""
    max_preemptions: int = 1000
    """Pre-emptions (notices and sudden losses) the job survives before it fails."""
    max_failures: int = 2
    """Worker crashes retried from the last checkpoint before the job fails."""
    wait_for_hosts_s: float = 300.0
    """Seconds to wait for a VM when the pool has none before the job fails."""
    generation_options: GenerationOptions = field(default_factory=GenerationOptions)
    """What every generation the manager launches gets (bootstrap, SSH, output...)."""
    calibrate_first: bool = True
    """Plan the first generation from a calibration; False: a config that fixes P and D starts at
    once with them, calibrated only when a morph needs a plan."""

    @classmethod
    def merged(cls, base: "ManagerOptions | Mapping[str, Any] | None" = None,
               **overrides: Any) -> "ManagerOptions":
        """``base`` (options, a mapping of field names, or None: the defaults) with ``overrides`` on
        top; a ``generation_options`` given as a mapping becomes ``GenerationOptions``. Raises
        ``TypeError`` naming an unknown option."""
        if isinstance(base, Mapping):
            overrides, base = {**base, **overrides}, None
        gen = overrides.get("generation_options")
        if gen is None and "generation_options" in overrides:
            overrides["generation_options"] = GenerationOptions()
        elif gen is not None and not isinstance(gen, GenerationOptions):
            overrides["generation_options"] = GenerationOptions.merged(gen)
        return _merged(cls, base, overrides)

    def validate(self) -> "ManagerOptions":
        """Check the values; returns self. Raises ``ConfigError`` (a ``ValueError``) naming the option
        that is wrong; the generation options are checked with this manager's heartbeat period,
        which every generation gets."""
        for name in ("heartbeat_interval_s", "stop_timeout_s", "wait_for_hosts_s"):
            _check_number(self, name, low=0.0)
        for name in ("max_preemptions", "max_failures"):
            _check_int(self, name, low=0)
        for name, rule in (("grow", GrowRule), ("straggler", StragglerRule), ("drift", DriftRule)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, rule):
                raise ConfigError(f"{name}={value!r}: give a {rule.__name__}(...) (manager.decisions) or None "
                                  "to turn the rule off")
        if not isinstance(self.generation_options, GenerationOptions):
            raise ConfigError(f"generation_options={self.generation_options!r}: give a GenerationOptions "
                              "(or a mapping of its fields to ManagerOptions.merged)")
        dataclasses.replace(self.generation_options, heartbeat_interval_s=self.heartbeat_interval_s).validate()
        return self


__all__ = ["GenerationOptions", "ManagerOptions"]
