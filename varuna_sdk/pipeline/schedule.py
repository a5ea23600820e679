"""Pipeline schedules as data.

This module owns the per-stage order of forward (``F``), recompute (``R``),
backward (``B``) and — with ``split_backward`` — weight-gradient (``W``) actions for one
mini-batch, for the policies ``varuna`` (paper
arXiv 2111.04007 §3.2), ``gpipe`` and ``1f1b`` (PipeDream-Flush), plus the
run-time :class:`StageScheduler` that applies Varuna's opportunistic reordering.
The pipeline runtime and the simulator both consume it.  The policies themselves
are implemented in C++ (``csrc/schedule.cpp``, exposed as ``varuna_sdk._core``);
this is the Python face. Their names, ``POLICIES``, are defined once in ``varuna_sdk.config``.

It must never import torch (schedules are plain data, usable without a GPU stack) nor anything
of ``varuna_sdk`` but ``_native`` and ``config``.

Conventions: ``P`` is the number of pipeline stages, ``m`` the number of
micro-batches per mini-batch, ``stage`` a 0-based stage index and micro-batch
indices are 0-based.  The last stage never recomputes.  ``recompute`` is one flag for every
stage or a list of ``P`` flags (one per stage: a planner recomputes only where memory needs it),
and a Varuna stage that keeps its activations may carry an in-flight cap (``max_in_flight``,
see :class:`StageScheduler`).  With ``split_backward``
(Varuna only; the zero-bubble split of arXiv 2401.10241) ``B`` computes the input gradient
only and ``W`` the weight gradients, deferred at run time into the gaps where the stage
would wait for a message (see :class:`StageScheduler`).
"""

from __future__ import annotations

import numbers
import re
from typing import NamedTuple, Sequence

from varuna_sdk._native import core as _core
from varuna_sdk.config import POLICIES

__all__ = [
    "Action",
    "default_recompute",
    "stage_schedule",
    "pipeline_schedule",
    "format_schedule",
    "parse_schedule",
    "StageScheduler",
]

_KINDS = ("F", "R", "B", "W")  # index = C++ ActionKind value
_TOKEN = re.compile(r"([FRBW])(\d+)\Z")


class Action(NamedTuple):
    """One scheduled action: ``kind`` is ``'F'`` (forward), ``'R'`` (recompute), ``'B'``
    (backward; with ``split_backward`` its input gradient only) or ``'W'`` (weight gradients);
    ``mb`` is the 0-based micro-batch index."""

    kind: str  # 'F' | 'R' | 'B' | 'W'
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


def _action(t: tuple[int, int]) -> Action:
    return Action(_KINDS[t[0]], t[1])


def _check_policy(policy: object) -> str:
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(
            f"unknown schedule policy {policy!r}; valid policies are: {', '.join(POLICIES)}"
        )
    return policy


def _check_split(policy: str, split_backward: object) -> bool:
    if not _is_flag(split_backward):
        raise TypeError(f"split_backward must be a bool, got {type(split_backward).__name__} {split_backward!r}")
    if split_backward and policy != "varuna":
        raise ValueError(
            f"split_backward applies to the varuna policy only ({policy} runs its backward whole, as "
            "published); pass split_backward=False or policy='varuna'"
        )
    return bool(split_backward)


def _is_flag(x: object) -> bool:
    """A Python bool or a NumPy bool (anything whose type is named ``bool``/``bool_`` and is not an int)."""
    return isinstance(x, bool) or type(x).__name__ in ("bool_", "bool") and not isinstance(x, numbers.Integral)


def _is_count(x: object) -> bool:
    """An integer that is not a flag: Python ``int`` or a NumPy integer (``numbers.Integral``)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_recompute(P: int, recompute: object) -> bool | list[bool] | None:
    """``None``, one bool, or a list/tuple of exactly ``P`` bools (one per stage); NumPy bools count (a NumPy
    array does not: pass ``list(array)``)."""
    if recompute is None or _is_flag(recompute):
        return None if recompute is None else bool(recompute)
    if isinstance(recompute, (list, tuple)) and all(_is_flag(x) for x in recompute):
        if len(recompute) != P:
            raise ValueError(f"recompute lists one flag per stage: P={P} stages, got {len(recompute)} flags "
                             f"{list(recompute)!r}")
        return [bool(x) for x in recompute]
    raise TypeError(f"recompute must be None, a bool or a list of {P} bools (one per stage), got "
                    f"{type(recompute).__name__} {recompute!r}")


def _check_caps(policy: str, P: int, stage: int, max_in_flight: object) -> list[int]:
    """One cap for every stage, or a list of ``P`` caps (one per stage), as the C++ takes them: P caps."""
    caps = [0] * P
    if _is_count(max_in_flight):
        caps = [int(max_in_flight)] * P  # the same cap on every stage (as the other stages must be told)
    elif isinstance(max_in_flight, (list, tuple)) and all(_is_count(x) for x in max_in_flight):
        if len(max_in_flight) != P:
            raise ValueError(f"max_in_flight lists one cap per stage: P={P} stages, got {len(max_in_flight)}")
        caps = [int(x) for x in max_in_flight]
    else:
        raise TypeError(f"max_in_flight must be an int (every stage's cap, 0 = none) or a list of {P} ints (one per "
                        f"stage), got {type(max_in_flight).__name__} {max_in_flight!r}")
    if any(c < 0 or c >= 1 << 31 for c in caps):
        raise ValueError(f"max_in_flight must be >= 0 and < 2**31 (0 = no cap), got {max_in_flight!r}")
    if any(caps) and policy != "varuna":
        raise ValueError(f"an in-flight cap applies to the varuna policy only ({policy} holds what it publishes); "
                         "pass max_in_flight=0 or policy='varuna'")
    return caps


_INT_MAX = (1 << 31) - 1  # the C++ core's int


def _check_ints(**values: object) -> list[int]:
    """The values as Python ints (NumPy integers accepted); a bool or a non-integer is refused
    (``TypeError``), and one beyond the C++ core's int (``ValueError``)."""
    for name, value in values.items():
        if not _is_count(value):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if not -_INT_MAX <= int(value) <= _INT_MAX:  # type: ignore[call-overload]
            raise ValueError(f"{name}={value} is out of range: at most {_INT_MAX}")
    return [int(v) for v in values.values()]  # type: ignore[call-overload]


def default_recompute(policy: str) -> bool:
    """Whether ``policy`` recomputes activations by default.

    ``varuna`` -> True (it stashes only stage inputs and recomputes just in time,
    §3.2); ``gpipe`` and ``1f1b`` -> False.

    Raises:
        ValueError: ``policy`` is not one of :data:`varuna_sdk.config.POLICIES`.
    """
    return _core.default_recompute(_check_policy(policy))


def stage_schedule(
    policy: str, P: int, m: int, stage: int, recompute: bool | Sequence[bool] | None = None,
    split_backward: bool = False,
) -> list[Action]:
    """Static action list of one pipeline stage for one mini-batch.

    Args:
        policy: ``"varuna"`` (paper §3.2: quantum simulation, F/R = 1 quantum,
            backward = 2, priority backward > recompute > forward), ``"gpipe"``
            (all forwards then all backwards) or ``"1f1b"`` (PipeDream-Flush:
            ``min(P-stage-1, m)`` warm-up forwards, then one F / one B).
        P: number of pipeline stages, >= 1.
        m: number of micro-batches per mini-batch, >= 1.
        stage: 0-based stage index, ``0 <= stage < P``.
        recompute: emit ``R(i)`` before ``B(i)`` on non-last stages: one bool for every
            stage, or a list of ``P`` bools (one per stage; Varuna's static order of a stage
            depends on which stages recompute).  ``None`` uses :func:`default_recompute`.
            The last stage never recomputes (its entry is ignored).
        split_backward: ``varuna`` only: ``W(i)`` follows every ``B(i)`` in the static
            list (the run-time scheduler defers it; zero-bubble split).

    Returns:
        The actions in execution order, e.g. ``[F0, F1, R0, B0, ...]``.

    Raises:
        ValueError: unknown policy, ``P < 1``, ``m < 1``, ``P``/``m`` above ``2**31 - 1``, ``stage`` out of range, a
            ``recompute`` list without exactly ``P`` flags, or ``split_backward`` with a policy
            other than ``varuna``; the message names the valid values.
        TypeError: ``P``, ``m`` or ``stage`` is not an int, ``split_backward`` not a bool,
            ``recompute`` not None, a bool or a list of bools.
    """
    P, m, stage = _check_ints(P=P, m=m, stage=stage)
    policy = _check_policy(policy)
    split = _check_split(policy, split_backward)
    rec = _check_recompute(P, recompute)
    return [_action(t) for t in _core.stage_schedule(policy, P, m, stage, rec, split)]


def pipeline_schedule(
    policy: str, P: int, m: int, recompute: bool | Sequence[bool] | None = None, split_backward: bool = False
) -> list[list[Action]]:
    """Static action lists of all ``P`` stages (index = stage).

    Same arguments, units and errors as :func:`stage_schedule` (paper §3.2).
    """
    P, m = _check_ints(P=P, m=m)
    policy = _check_policy(policy)
    split = _check_split(policy, split_backward)
    rec = _check_recompute(P, recompute)
    return [
        [_action(t) for t in stage]
        for stage in _core.pipeline_schedule(policy, P, m, rec, split)
    ]


def format_schedule(actions: Sequence[Action]) -> str:
    """Render actions as space-separated tokens, e.g. ``"F0 F1 R0 B0"``."""
    return " ".join(str(a) for a in actions)


def parse_schedule(text: str) -> list[Action]:
    """Parse space-separated tokens (``"F0 F1 R0 B0"``) back into actions.

    Commas are accepted as separators too.  An empty string gives ``[]``.

    Raises:
        ValueError: a token is not ``F``, ``R``, ``B`` or ``W`` followed by a
            non-negative integer; the message quotes the token and its position.
    """
    actions: list[Action] = []
    for pos, tok in enumerate(text.replace(",", " ").split()):
        match = _TOKEN.match(tok)
        if match is None:
            raise ValueError(
                f"bad schedule token {tok!r} at position {pos}; expected F<i>, R<i>, B<i> or W<i> "
                "with a non-negative micro-batch index, e.g. 'F0 F1 R0 B0'"
            )
        actions.append(Action(match.group(1), int(match.group(2))))
    return actions


class StageScheduler:
    """Run-time action source for one stage (paper §3.2, opportunistic scheduling).

    Holds the remaining static list of :func:`stage_schedule`.  For policy
    ``varuna`` only: when the next static action is ``R(i)`` on a non-last stage,
    the gradient of micro-batch ``i`` has not arrived yet, and the earliest
    remaining forward ``F(j)`` has its input available (stage 0, or activation
    ``j`` has arrived), ``F(j)`` is returned first, so the downstream stage keeps
    being fed instead of the stage waiting on a gradient.  Otherwise the next
    static action is returned (the caller then blocks on its input if needed).

    With ``split_backward``, ``W(i)`` becomes pending when ``B(i)`` is handed out and is
    returned only when the action chosen above would wait for a message that has not
    arrived, when only ``W`` work is left, or when more than :attr:`max_deferred`
    (``P - stage``) are pending — each pending ``W`` keeps its micro-batch's activations.

    In-flight cap (``max_in_flight`` > 0, ``varuna`` only): the stage never holds more than
    ``max_in_flight`` micro-batches whose forward has run and whose backward (with the split:
    ``W``) has not — the live activations of a stage that does not recompute. When the action
    chosen above is a forward and the stage is full, a pending ``W`` runs, else the oldest
    micro-batch's ``R``/``B`` (which then waits for its gradient). A cap >= 1 never deadlocks:
    the oldest micro-batch in flight always completes downstream. A planner sets it so that no
    stage exceeds its memory figure however messages are delayed (:attr:`in_flight`). Caps
    upstream bound what can arrive: a stage never waits for an activation that the capped stages
    before it can send only after they get one of its gradients (it runs its oldest backward-side
    action first), so every stage of a pipeline must be given the same list of caps.

    Args:
        policy, P, m, stage, recompute, split_backward: as in :func:`stage_schedule`.
        max_in_flight: micro-batches, >= 0: one cap for every stage (an int; 0, the default, =
            none) or one per stage (a list of ``P``).

    Raises:
        ValueError, TypeError: as in :func:`stage_schedule`; ``max_in_flight`` negative, not an
            int, or > 0 with a policy other than ``varuna``.
    """

    def __init__(
        self, policy: str, P: int, m: int, stage: int, recompute: bool | Sequence[bool] | None = None,
        split_backward: bool = False, max_in_flight: int | Sequence[int] = 0,
    ) -> None:
        P, m, stage = _check_ints(P=P, m=m, stage=stage)
        policy = _check_policy(policy)
        split = _check_split(policy, split_backward)
        rec = _check_recompute(P, recompute)
        caps = _check_caps(policy, P, stage, max_in_flight)
        self._impl = _core.StageScheduler(policy, P, m, stage, rec, split, caps)

    def next(self, acts_arrived: int, grads_arrived: int) -> Action | None:
        """Pop and return the next action to execute, or ``None`` when done.

        Args:
            acts_arrived: activations received from upstream so far (counted in
                micro-batches; they arrive in order 0, 1, 2, ...).
            grads_arrived: gradients received from downstream so far (same order).

        Raises:
            ValueError: a count is negative.
            TypeError: a count is not an int.
        """
        acts, grads = _check_ints(acts_arrived=acts_arrived, grads_arrived=grads_arrived)
        t = self._impl.next(acts, grads)
        return None if t is None else _action(t)

    def remaining(self) -> list[Action]:
        """The actions not yet handed out, in their current order."""
        return [_action(t) for t in self._impl.remaining()]

    @property
    def done(self) -> bool:
        """True once every action has been handed out."""
        return self._impl.done

    @property
    def policy(self) -> str:
        """The policy name."""
        return self._impl.policy

    @property
    def P(self) -> int:
        """Number of pipeline stages."""
        return self._impl.P

    @property
    def m(self) -> int:
        """Micro-batches per mini-batch."""
        return self._impl.m

    @property
    def stage(self) -> int:
        """This stage's 0-based index."""
        return self._impl.stage

    @property
    def recompute(self) -> bool:
        """Whether this stage recomputes activations (never the last stage, whatever it was given)."""
        return self._impl.recompute

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into B and W."""
        return self._impl.split_backward

    @property
    def max_deferred(self) -> int:
        """Most ``W`` actions kept pending (``P - stage``)."""
        return self._impl.max_deferred

    @property
    def max_in_flight(self) -> int:
        """The in-flight cap in micro-batches (0 = none)."""
        return self._impl.max_in_flight

    @property
    def in_flight(self) -> int:
        """Micro-batches this stage holds now (forward handed out, backward / ``W`` not yet)."""
        return self._impl.in_flight

    def __repr__(self) -> str:
        return (
            f"StageScheduler(policy={self.policy!r}, P={self.P}, m={self.m}, "
            f"stage={self.stage}, recompute={self.recompute}, split_backward={self.split_backward}, "
            f"max_in_flight={self.max_in_flight}, remaining={self._impl.remaining_count()})"
        )
