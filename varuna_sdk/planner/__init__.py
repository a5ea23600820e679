"""Planner: the Python face of the C++ simulator and the configuration search.

``simulate`` — one mini-batch, event-driven, with the runtime's own schedule code
(:mod:`varuna_sdk.planner.simulate`); ``plan`` — the configuration search built on it
(:mod:`varuna_sdk.planner.plan`: ``plan``/``plan_for_job``), in three parts: the validated
``PlanRequest`` (``planner.request``), the search (``planner.search``) and the result types
``Plan``/``PlanRow``/``Prices`` (``planner.rows``). Never imports torch, ``trainer``,
``cluster`` or ``manager``.
"""

from .simulate import (
    SEGMENT_KINDS,
    Segment,
    SimInput,
    SimOutput,
    TiedGroup,
    Transfer,
    allreduce_time,
    bubble_fraction_gpipe,
    simulate,
)

__all__ = [
    "SEGMENT_KINDS",
    "Segment",
    "SimInput",
    "SimOutput",
    "TiedGroup",
    "Transfer",
    "allreduce_time",
    "bubble_fraction_gpipe",
    "simulate",
]
