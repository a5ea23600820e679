"""How one generation of workers ended, as types: ``GenerationStatus`` (completed, stopped, lost,
failed, killed) and ``GenerationResult`` (the status with exit codes, lost hosts, the failure text
and its cause, the last step). ``manager.generation`` produces them; ``manager.manager`` decides
the next morph from them without probing attributes.

Owns ``GenerationStatus``, ``GenerationResult``. Imports only the standard library; never torch,
``cluster`` or the rest of the manager.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class GenerationStatus(enum.StrEnum):
    """How a generation ended (a ``str`` enum: the value is what ``generation_ended`` events record).

    ``COMPLETED``: every worker finished the job's steps; ``STOPPED``: stopped on request at a
    mini-batch boundary, with a checkpoint; ``LOST``: a host was lost (pre-empted, network cut,
    process killed, heartbeats stopped); ``FAILED``: a worker raised (or the generation did not
    start); ``KILLED``: ``stop()`` ended workers that had not finished."""

    COMPLETED = "completed"
    STOPPED = "stopped"
    LOST = "lost"
    FAILED = "failed"
    KILLED = "killed"


@dataclass
class GenerationResult:
    """How a generation ended. ``status``: a ``GenerationStatus``; ``exit_codes``: rank → exit code
    (None: no exit code — connection lost, or never started); ``lost_hosts``: host name → reason
    (``connection_closed``, ``heartbeat_timeout``, ``worker_process_died``, ``vm_unreachable``,
    ``lost_during_bootstrap``, ``never_joined``, ``preempted``...); ``failure``: the first failed
    worker's traceback, each line prefixed ``[vm rank r]`` (or the bootstrap error naming the VM);
    ``last_step``: the last step rank 0 reported finished (None: none); ``seconds``: from
    ``start()`` to the end; ``stop_reason``: the ``request_stop`` reason, if any; ``cause``: why
    the worker named in ``failure`` failed (``wire.FAILURE_CAUSES``; None: not said) — a
    ``"data"`` failure is deterministic, so retrying it would fail the same way."""

    status: GenerationStatus
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    lost_hosts: dict[str, str] = field(default_factory=dict)
    failure: str | None = None
    last_step: int | None = None
    seconds: float = 0.0
    stop_reason: str | None = None
    cause: str | None = None

    def __post_init__(self):
        self.status = GenerationStatus(self.status)


__all__ = ["GenerationStatus", "GenerationResult"]
