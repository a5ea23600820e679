"""How one generation of workers ended, as types: ``GenerationStatus`` (completed, stopped, lost,
failed, killed) and ``GenerationResult`` (the status with exit codes, lost hosts, the failure text
and its cause, the last step). ``manager.generation`` produces them; ``manager.manager`` decides
the next morph from them without probing attributes.

Also how a failed worker's own error is told: ``LOG_ONLY`` (the mark a worker started by a manager
puts before each line of its failure's traceback: written to ``gen<g>/workers.log``, not streamed
live), ``EXPLAINED_ERRORS`` / ``explained`` (the SDK's own errors, whose message says everything:
told in one line, without a traceback), ``short_error`` and ``failure_excerpt`` (from a worker's
stderr tail, its own traceback ending with its exception line — never a line a dying process wrote
after it, such as ``terminate called without an active exception``).

Owns ``GenerationStatus``, ``GenerationResult``, ``failure_excerpt``. Imports only the standard
library; never torch, ``cluster`` or the rest of the manager.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Sequence

#: put by a worker (started by a manager) before each line of output meant for the log file only
LOG_ONLY = "\x1e"

#: the lines around what a worker whose manager died had last sent it (``worker._OutputThatSurvives``),
#: replayed in its own log: the manager may not have saved them (a pipe's unread bytes die with its
#: reader); ``varuna logs`` shows those of them that ``workers.log`` lacks (``runs.OwnLogFilter``)
SENT_BEFORE = "[varuna] the last lines sent to the manager before it was found gone:"
SENT_END = "[varuna] (end of the lines sent to the manager)"

#: the SDK's own errors: raised on purpose with a message that says what to change, so a failure
#: with one of them is told in one line (its traceback stays in the workers' log)
EXPLAINED_ERRORS = frozenset({"DataError", "ModelSpecError", "NonFiniteLossError", "ConfigError", "ShippingError",
                              "PartitionError", "CheckpointError", "WeightValueError", "UninitializedError",
                              "ProfileError"})

_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("The above exception was the direct cause of the following exception:",
            "During handling of the above exception, another exception occurred:")
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]:\s?")   # torch.distributed's excepthook prefixes each line
_NOISE = ("terminate called", "Aborted (core dumped)")   # what a process killed while it dies may still write
_QUALIFIED = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))")


def error_name(error: str | None) -> str:
    """The exception's class name in an error as ``traceback.format_exception_only`` writes it
    (``"varuna_sdk.trainer.NonFiniteLossError: steps..."`` → ``"NonFiniteLossError"``); "" for none."""
    first = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    head = first.split(":", 1)[0].strip()
    return head.rsplit(".", 1)[-1] if re.fullmatch(r"[A-Za-z_][\w.]*", head) else ""


def explained(error: str | None) -> bool:
    """True when ``error`` is one of the SDK's own explained errors (``EXPLAINED_ERRORS``)."""
    return error_name(error) in EXPLAINED_ERRORS


def short_error(error: str) -> str:
    """``error`` with its class's module path dropped (``varuna_sdk.trainer.NonFiniteLossError: x`` →
    ``NonFiniteLossError: x``)."""
    return _QUALIFIED.sub("", error.strip(), count=1)


def _clean(line: str) -> str:
    return _TORCH_PREFIX.sub("", line.replace(LOG_ONLY, "")).rstrip()


def failure_excerpt(lines: Sequence[str], error: str | None = None) -> list[str]:
    """What a failed worker's stderr tail ``lines`` says of its own error: its last traceback (with
    the tracebacks of the exceptions chained before it), ending with the exception line — nothing
    written after it (a C++ ``terminate called...`` of the dying process, a peer's output). ``error``:
    the exception as the worker reported it (its goodbye), if it did: the excerpt ends with it, and
    is just it when the tail does not hold it. Lines the worker marked ``LOG_ONLY`` are preferred
    (its failure report); torch's ``[rankN]:`` prefixes are dropped, and blank lines."""
    marked = [x for x in lines if x.startswith(LOG_ONLY)]
    clean = [c for c in (_clean(x) for x in (marked or lines)) if c.strip()]
    said = [x.rstrip() for x in (error or "").strip().splitlines() if x.strip()]
    end = None
    if said:
        hits = [i for i, x in enumerate(clean) if x.strip() == said[0].strip()]
        end = hits[-1] + 1 if hits else None
        if end is not None:   # a message of several lines: as many as it has
            while end < len(clean) and end - hits[-1] < len(said) and clean[end].strip() == said[end - hits[-1]].strip():
                end += 1
    else:
        heads = [i for i, x in enumerate(clean) if x.strip() == _TRACEBACK]
        if heads:
            k = heads[-1] + 1
            while k < len(clean) and (clean[k][:1].isspace() or clean[k].strip() == _TRACEBACK):
                k += 1
            end = k + 1 if k < len(clean) else None
    if end is None:
        if said:
            return said
        rest = [x for x in clean if not x.strip().startswith(_NOISE)]
        return rest or clean
    heads = [i for i in range(end) if clean[i].strip() == _TRACEBACK]
    if not heads:
        return clean[end - (len(said) or 1):end] if said else clean[max(0, end - 1):end]
    start = heads[-1]
    while True:   # chained exceptions: back to the first traceback of the chain
        j = start - 1
        if j < 0 or clean[j].strip() not in _CHAINED:
            break
        before = [i for i in heads if i < j]
        if not before:
            break
        start = before[-1]
    return clean[start:end]


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
    worker's traceback ending with its exception line (``failure_excerpt``), each line prefixed
    ``[vm rank r]`` (or the bootstrap error naming the VM); ``error``: that worker's own error
    (``"TypeError: ..."``: the one it reported, else its traceback's exception line), with ``rank``
    and ``host``: which worker (None: no worker's error, e.g. a bootstrap failure);
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
    error: str | None = None
    rank: int | None = None
    host: str | None = None

    def __post_init__(self):
        self.status = GenerationStatus(self.status)


__all__ = ["GenerationStatus", "GenerationResult", "LOG_ONLY", "EXPLAINED_ERRORS", "error_name", "explained",
           "short_error", "failure_excerpt"]
