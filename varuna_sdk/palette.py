"""How a plan and its pipeline actions look to people, the same everywhere: the notebook's
partition maps and Gantt charts and the team dashboard share these colours and these words.

Owns ``ACTION_COLORS`` (the pipeline actions F / R / B and the rest of a step),
``TIMELINE_COLORS`` (the other kinds of a simulated mini-batch: W, AR, WAIT, TIED, SYNC, OPT)
and ``plan_label`` (one spelling of a plan: ``P=2×D=2 (mbs 4, m 2)``). Plain data and string
formatting only: imports nothing from ``varuna_sdk`` or ``dashboard`` (a leaf, layer 0), so the
notebook never needs the dashboard to draw a chart.
"""

from __future__ import annotations

from typing import Any

#: Colours (colour-blind safe Tableau 10) of the pipeline actions: forward, recompute, backward,
#: and everything else in a step (communication, all-reduce, optimizer, idle).
ACTION_COLORS = {"F": "#4C78A8", "R": "#F58518", "B": "#54A24B", "other": "#BAB0AC"}

#: Colours of the simulator's other timeline kinds (``planner`` ``Segment.kind``): weight
#: gradients of a split backward, all-reduce, waiting for a core, tied-weight all-reduce,
#: consensus and the optimizer step.
TIMELINE_COLORS = {"W": "#88D27A", "AR": "#B279A2", "WAIT": "#EEEEEE", "TIED": "#9D755D", "SYNC": "#72B7B2",
                   "OPT": "#BAB0AC"}


def plan_label(plan: Any, *, hosts: bool = False) -> str | None:
    """One plan in words: ``P=2×D=2 (mbs 4, m 2)`` — pipeline depth P, data-parallel width D,
    micro-batch size and micro-batches per mini-batch (m) when the plan has them — and, with
    ``hosts``, `` on vm0,vm1`` (the plan's hosts in rank order, when it lists any).

    ``plan`` is a plan payload of the event log (``Kind.PLAN``, or a morph's ``old``/``new``): a
    dict with ``P``, ``D`` and optionally ``micro_batch_size``, ``num_micro_batches`` (or ``m``)
    and ``hosts``. Returns None for anything that is not such a dict (no plan yet, a malformed
    payload); a missing P or D reads ``?``. Never raises.
    """
    if not isinstance(plan, dict):
        return None
    s = f"P={plan.get('P', '?')}×D={plan.get('D', '?')}"
    extra = [f"mbs {plan['micro_batch_size']}"] if plan.get("micro_batch_size") is not None else []
    m = plan.get("num_micro_batches", plan.get("m"))
    if m is not None:
        extra.append(f"m {m}")
    s += f" ({', '.join(extra)})" if extra else ""
    where = plan.get("hosts") if hosts else None
    if isinstance(where, list) and where:
        s += f" on {','.join(map(str, where))}"
    return s


__all__ = ["ACTION_COLORS", "TIMELINE_COLORS", "plan_label"]
