"""Python face of the C++ mini-batch simulator (``csrc/simulator.{h,cpp}``).

Owns: :class:`SimInput` (what to simulate), :class:`SimOutput` (what came out),
:func:`simulate`, and reference formulas (:func:`bubble_fraction_gpipe`,
:func:`allreduce_time`).  The simulation itself is C++ (``varuna_sdk._core``): a
discrete-event model of one mini-batch in which every stage is driven by the same
``StageScheduler`` decisions the runtime (``varuna_sdk.pipeline.engine``) uses, so
what is simulated is what runs.  Paper arXiv 2111.04007 §4.1, reference notes
``varuna-original.md`` §5 (what the original simulator did, and what we do better).

Must never import torch, ``cluster`` or ``manager``: it is plain arithmetic.

Units everywhere: seconds (times, latencies), bytes (sizes), bytes/s (bandwidths).

Model in one paragraph (details in ``csrc/simulator.h``): rank = replica * P + stage,
host = rank // ranks_per_host.  A free rank asks its stage's scheduler for the next
action given the activations / gradients that have arrived by now; the action starts
when its input has arrived (F(i) on stage > 0 needs activation i, B(i) on a non-last
stage gradient i) and, with ``compute_slots_per_host`` > 0, a compute slot on its host
is free.  F on a non-last stage sends the activation downstream and B on stage > 0 the
gradient upstream, each link one transfer at a time (``alpha + bytes / beta``, local
figures between ranks of one host).  After its last action and sends, every stage
all-reduces its gradients across its D replicas (ring alpha-beta), tied groups sum
theirs, one world-wide consensus all-reduce follows, then each stage's optimizer step.

Example::

    from varuna_sdk.planner.simulate import simulate
    out = simulate(P=4, m=16, fwd=0.010, bwd=0.020, act_bytes=4e6, p2p_alpha=50e-6, p2p_beta=1.25e9)
    out.minibatch_time, out.bubble_fraction, out.peak_stashed
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import NamedTuple, Sequence

import numpy as np

from varuna_sdk._native import core as _core
from varuna_sdk.config import POLICIES

__all__ = [
    "SimInput",
    "SimOutput",
    "TiedGroup",
    "Segment",
    "Transfer",
    "SEGMENT_KINDS",
    "simulate",
    "bubble_fraction_gpipe",
    "allreduce_time",
]

#: Timeline segment kinds, index = C++ ``SegmentKind``.  F/R/B: compute actions;
#: WAIT: input ready but no free compute slot; AR: data-parallel all-reduce of the
#: stage; TIED: tied-weight all-reduce (``mb`` = group index); SYNC: world-wide
#: consensus all-reduce; OPT: optimizer step.
SEGMENT_KINDS: tuple[str, ...] = ("F", "R", "B", "WAIT", "AR", "TIED", "SYNC", "OPT", "W")

Floats = float | Sequence[float]


class TiedGroup(NamedTuple):
    """Parameters shared by several stages (e.g. GPT-2's tied embeddings on the first
    and last stage): their gradients (``bytes`` bytes) are summed across ``stages`` and
    all replicas in one all-reduce of ``len(stages) * D`` ranks."""

    stages: tuple[int, ...]
    bytes: float


class Segment(NamedTuple):
    """One bar of a rank's Gantt chart: ``kind`` in :data:`SEGMENT_KINDS`, ``mb`` the
    micro-batch (tied-group index for TIED, -1 for AR/SYNC/OPT), ``start``/``end`` in
    seconds from the start of the mini-batch."""

    kind: str
    mb: int
    start: float
    end: float


class Transfer(NamedTuple):
    """One p2p message: ``kind`` ``"act"`` (stage s -> s+1) or ``"grad"`` (s -> s-1),
    micro-batch ``mb``, ranks ``src``/``dst``, seconds ``start`` (link start) and
    ``end`` (arrival)."""

    kind: str
    mb: int
    src: int
    dst: int
    start: float
    end: float


@dataclass
class SimInput:
    """What to simulate: one mini-batch of a P-stage, D-replica pipeline.

    Per-stage fields accept one number (the same on every stage) or a sequence of
    length P.  Boundary fields (``act_bytes``, ``grad_bytes``) accept one number or a
    sequence of length P-1 (boundary s is between stages s and s+1; length P is
    accepted too, the last entry ignored).  ``None`` means the documented default.
    Validation happens in C++ and raises ``ValueError`` naming the field.
    """

    P: int
    """Pipeline stages, >= 1."""
    m: int
    """Micro-batches per mini-batch and replica, >= 1."""
    fwd: Floats
    """Forward seconds per micro-batch, per stage."""
    bwd: Floats
    """Backward seconds per micro-batch, per stage (excluding recompute); with
    ``split_backward`` the input-gradient part (B) alone."""
    D: int = 1
    """Data-parallel replicas, >= 1."""
    policy: str = "varuna"
    """``"varuna"``, ``"gpipe"`` or ``"1f1b"`` (see ``varuna_sdk.pipeline.schedule``)."""
    recompute: bool | Sequence[bool] | None = None
    """Recompute activations before each backward (non-last stages): one flag for every stage
    or a sequence of P flags (one per stage); ``None`` = the policy's default (varuna: True,
    gpipe/1f1b: False)."""
    max_in_flight: int | Sequence[int] | None = None
    """Varuna only: the most micro-batches a stage holds in flight (forward run, backward not:
    its live activations), one cap for every stage or P caps; 0 or ``None`` = no cap (see
    ``pipeline.schedule.StageScheduler``)."""
    rec: Floats | None = None
    """Recompute seconds per micro-batch, per stage; ``None`` = ``fwd``."""
    split_backward: bool = False
    """Varuna only: the backward split into B (input gradient, ``bwd``) and W (weight
    gradients, ``wgt``), W deferred into the stage's waits (zero-bubble split)."""
    wgt: Floats | None = None
    """Weight-gradient (W) seconds per micro-batch, per stage; required with ``split_backward``."""
    opt: Floats | None = None
    """Optimizer step seconds, per stage; ``None`` = 0."""
    act_bytes: Floats | None = None
    """Activation bytes per micro-batch sent across each boundary; ``None`` = 0."""
    grad_bytes: Floats | None = None
    """Gradient bytes per micro-batch sent back across each boundary; ``None`` = ``act_bytes``."""
    dp_bytes: Floats | None = None
    """Gradient bytes all-reduced across the D replicas of each stage; ``None`` = 0."""
    tied: Sequence[TiedGroup | tuple[Sequence[int], float]] = ()
    """Tied-weight groups ``(stages, bytes)``, synced after the DP all-reduce, in order."""
    p2p_alpha: float = 0.0
    """p2p latency between ranks on different hosts, seconds."""
    p2p_beta: float = math.inf
    """p2p bandwidth between hosts, bytes/s (``inf`` = free)."""
    local_alpha: float = 0.0
    """p2p latency between ranks of one host, seconds."""
    local_beta: float = math.inf
    """p2p bandwidth within a host, bytes/s."""
    ar_alpha: float = 0.0
    """All-reduce per-step latency, seconds: time(bytes, n) = ar_alpha*2(n-1) + 2(n-1)/n*bytes/ar_beta."""
    ar_beta: float = math.inf
    """All-reduce bandwidth, bytes/s."""
    consensus_latency: float = 0.0
    """World-wide consensus all-reduce at the end of each step, seconds (0 when P*D == 1)."""
    data_read: float = 0.0
    """Seconds each rank spends reading the mini-batch's data (a replica's examples, read by each
    of its stages); 0 = not modelled.  See ``data_prefetch``."""
    data_prefetch: bool = True
    """The next mini-batch is read while this one computes (``data.prefetch``): the mini-batch
    lasts max(compute, ``data_read``); False: compute + ``data_read``."""
    shared_egress: bool = False
    """Each rank's outgoing messages share one link (one NIC, as a VM or a network-namespace host
    has): activations downstream and gradients upstream go one at a time, FIFO; False: one link
    per direction."""
    bucket_bytes: float = 4 * 2**20
    """Gradient all-reduce bucket, bytes (the engine's ``pipeline.grad_sync.DEFAULT_BUCKET_BYTES``):
    a stage's buckets start during its last backward, so only the last one must follow it;
    0 = one all-reduce after the pipeline phase."""
    ranks_per_host: int = 1
    """Ranks per host (VM); rank = replica*P + stage, host = rank // ranks_per_host."""
    compute_slots_per_host: int = 0
    """Compute actions that can run at once on a host (shared cores / GPU); 0 = unlimited."""
    action_overhead: float = 0.0
    """Fixed framework cost added to every F/R/B, seconds."""
    send_overhead: float = 0.0
    """Sender-side cost added to an action that sends a message, seconds."""
    p2p_jitter_sigma: float = 0.0
    """Half-normal extra delay on each p2p transfer's delivery: |N(0, sigma)| seconds (the link is
    not held meanwhile; a channel's messages still land in order)."""
    compute_jitter_rel: float = 0.0
    """Relative noise on each action's compute time: x max(0, 1 + N(0, sigma))."""
    seed: int = 0
    """Seed of the jitter (same seed, same result)."""
    rank_compute_scale: Sequence[float] | None = None
    """Per-rank compute slowdown (stragglers), length P*D; ``None`` = 1."""
    record_timeline: bool = False
    """Return per-rank Gantt segments and the transfers (costs memory; disables extrapolation)."""
    extrapolate: bool = False
    """For large m, simulate shorter runs and extrapolate through the detected periodic
    steady state (exact when it is periodic; otherwise simulates m exactly).  See
    ``csrc/simulator.h``."""
    extrapolate_cap: int = 0
    """Length of the first extrapolation run; 0 = 5P + 32 (Varuna) or 2P + 32."""
    replica_shortcut: bool = True
    """Simulate one replica when all are provably identical (bit-identical results)."""
    engine: str = "auto"
    """``"auto"``, ``"event"`` (priority-queue event loop) or ``"fast"`` (heap-free,
    no jitter / slot contention); all give identical results where they apply."""

    def to_core(self) -> "_core.SimConfig":
        """The ``_core.SimConfig`` for this input (scalars broadcast, defaults filled)."""
        for name in ("P", "m", "D", "ranks_per_host", "compute_slots_per_host", "seed", "extrapolate_cap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown schedule policy {self.policy!r}; valid policies are: {', '.join(POLICIES)}"
            )
        P = int(self.P)
        c = _core.SimConfig()
        c.P, c.m, c.D = P, int(self.m), int(self.D)
        c.policy = self.policy
        rec = self.recompute
        flags = list(rec) if isinstance(rec, (list, tuple)) else [rec]
        if rec is None:
            c.recompute = _core.default_recompute(self.policy)
        elif not all(isinstance(x, (bool, np.bool_)) for x in flags) or (isinstance(rec, (list, tuple)) and not flags):
            raise TypeError(f"recompute must be None, a bool or a sequence of P bools (one per stage), got {rec!r}")
        elif isinstance(rec, (list, tuple)):
            c.stage_recompute = [bool(x) for x in flags]
        else:
            c.recompute = bool(rec)
        if not isinstance(self.shared_egress, (bool, np.bool_)):
            raise TypeError(f"shared_egress must be a bool, got {self.shared_egress!r}")
        if self.max_in_flight is not None:
            caps = self.max_in_flight
            caps = [caps] * P if isinstance(caps, numbers.Integral) else list(caps)
            if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < 1 << 31 for x in caps):
                raise TypeError(f"max_in_flight must be an int or a sequence of ints in [0, 2**31), got "
                                f"{self.max_in_flight!r}")
            c.max_in_flight = [int(x) for x in caps]
        c.fwd = _per(self.fwd, P, "fwd")
        c.bwd = _per(self.bwd, P, "bwd")
        if self.rec is not None:
            c.rec = _per(self.rec, P, "rec")
        c.split_backward = bool(self.split_backward)
        if self.wgt is not None:
            c.wgt = _per(self.wgt, P, "wgt")
        if self.opt is not None:
            c.opt = _per(self.opt, P, "opt")
        if self.act_bytes is not None:
            c.act_bytes = _per(self.act_bytes, max(P - 1, 0), "act_bytes")
        if self.grad_bytes is not None:
            c.grad_bytes = _per(self.grad_bytes, max(P - 1, 0), "grad_bytes")
        if self.dp_bytes is not None:
            c.dp_bytes = _per(self.dp_bytes, P, "dp_bytes")
        c.tied = [(list(g[0]), float(g[1])) for g in self.tied]
        for name in (
            "p2p_alpha", "p2p_beta", "local_alpha", "local_beta", "ar_alpha", "ar_beta",
            "consensus_latency", "bucket_bytes", "action_overhead", "send_overhead", "p2p_jitter_sigma",
            "compute_jitter_rel",
        ):
            setattr(c, name, float(getattr(self, name)))
        c.ranks_per_host = int(self.ranks_per_host)
        c.compute_slots_per_host = int(self.compute_slots_per_host)
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        c.seed = int(self.seed)
        if self.rank_compute_scale is not None:
            c.rank_compute_scale = [float(x) for x in self.rank_compute_scale]
        c.shared_egress = bool(self.shared_egress)
        if not isinstance(self.data_prefetch, (bool, np.bool_)):
            raise TypeError(f"data_prefetch must be a bool, got {self.data_prefetch!r}")
        c.data_read = float(self.data_read)
        c.data_prefetch = bool(self.data_prefetch)
        c.record_timeline = bool(self.record_timeline)
        c.extrapolate = bool(self.extrapolate)
        c.extrapolate_cap = int(self.extrapolate_cap)
        c.replica_shortcut = bool(self.replica_shortcut)
        c.engine = self.engine
        return c


@dataclass
class SimOutput:
    """Result of one simulated mini-batch.  Times in seconds from its start.

    ``pipeline_time`` is when the last rank finished its last action and its last
    message arrived (start of the synchronisation phase); ``minibatch_time`` adds the
    all-reduces, the consensus and the optimizer step, and ``data_wait``: what of the mini-batch
    is spent waiting for its data (``SimInput.data_read``).  Per stage, ``stage_busy`` is the
    F+R+B compute time (with overheads and jitter, without slot waits; mean over
    replicas) and ``stage_bubble = 1 - stage_busy / pipeline_time``;
    ``bubble_fraction`` is their mean over stages (GPipe with uniform costs, free
    communication and no overheads: exactly (P-1)/(m+P-1)).

    Memory (per stage, maxima over time and replicas): ``peak_stashed`` micro-batches
    holding only their stashed input (forward done without autograd, awaiting
    recompute), ``peak_live`` holding a live graph (input + activations: after F
    without recompute or on the last stage, or after R) until their B ends, and
    ``peak_inflight`` both together.  Memory of stage s is about
    ``peak_stashed * input_bytes + peak_live * (input_bytes + activation_bytes)``.
    """

    minibatch_time: float
    pipeline_time: float
    bubble_fraction: float
    stage_busy: list[float]
    stage_bubble: list[float]
    stage_done: list[float]
    """Per stage: when its last replica finished the pipeline phase (seconds)."""
    peak_stashed: list[int]
    peak_live: list[int]
    peak_inflight: list[int]
    replicas_simulated: int
    """1 when the one-replica shortcut applied, else D."""
    extrapolated: bool
    m_simulated: tuple[int, int]
    """``(m, 0)`` when exact; the extrapolation runs ``(m1, m2)`` (``m2 = 0``: one run)."""
    period: int
    """Steady-state period (micro-batches) used by the extrapolation, 0 if none."""
    actions: int
    """Compute actions simulated (all runs): a cost measure."""
    engine: str
    """Engine of the last run: ``"fast"`` or ``"event"``."""
    data_wait: float = 0.0
    """Seconds of ``minibatch_time`` spent waiting for data: ``data_read`` beyond the compute
    with prefetch, all of it without (0 when ``data_read`` is 0)."""
    timeline: list[list[Segment]] | None = None
    """With ``record_timeline``: per simulated rank (replica*P + stage), its segments."""
    transfers: list[Transfer] | None = None
    """With ``record_timeline``: every p2p message, ordered by start."""

    @property
    def sync_time(self) -> float:
        """Seconds after the pipeline phase: all-reduces, consensus, optimizer (not the data wait)."""
        return self.minibatch_time - self.data_wait - self.pipeline_time

    @classmethod
    def from_core(cls, r: "_core.SimResult", with_timeline: bool) -> "SimOutput":
        """The C++ simulator's result as a ``SimOutput`` (the timeline and transfers only when
        ``with_timeline``: the simulation recorded them)."""
        timeline = transfers = None
        if with_timeline:
            timeline = [[Segment(SEGMENT_KINDS[k], mb, a, b) for k, mb, a, b in rank] for rank in r.timeline]
            transfers = [Transfer("act" if k == 0 else "grad", mb, s, d, a, b) for k, mb, s, d, a, b in r.transfers]
        return cls(
            minibatch_time=r.minibatch_time,
            pipeline_time=r.pipeline_time,
            bubble_fraction=r.bubble_fraction,
            stage_busy=list(r.stage_busy),
            stage_bubble=list(r.stage_bubble),
            stage_done=list(r.stage_done),
            peak_stashed=list(r.peak_stashed),
            peak_live=list(r.peak_live),
            peak_inflight=list(r.peak_inflight),
            replicas_simulated=r.replicas_simulated,
            extrapolated=r.extrapolated,
            m_simulated=tuple(r.m_simulated),
            period=r.period,
            actions=r.actions,
            engine=r.engine_used,
            data_wait=r.data_wait,
            timeline=timeline,
            transfers=transfers,
        )


def simulate(inp: SimInput | None = None, /, **kwargs) -> SimOutput:
    """Simulate one mini-batch.

    Call with a :class:`SimInput`, or with its fields as keywords
    (``simulate(P=4, m=8, fwd=1.0, bwd=2.0)``), or a ``SimInput`` plus keyword
    overrides.  Releases the GIL while the C++ runs.

    Raises:
        ValueError: an invalid value (P < 1, m < 1, negative time, a per-stage list of
            the wrong length, unknown policy ...); the message names the field.
        TypeError: a field of the wrong type (e.g. a float where an int is needed).
    """
    if inp is None:
        inp = SimInput(**kwargs)
    elif kwargs:
        known = {f.name for f in fields(SimInput)}
        bad = sorted(set(kwargs) - known)
        if bad:
            raise TypeError(f"unknown SimInput field(s): {', '.join(bad)}")
        inp = SimInput(**{**{f.name: getattr(inp, f.name) for f in fields(SimInput)}, **kwargs})
    r = _core.simulate(inp.to_core())
    return SimOutput.from_core(r, inp.record_timeline)


def bubble_fraction_gpipe(P: int, m: int) -> float:
    """GPipe's idle fraction with uniform stages and free communication:
    ``(P - 1) / (m + P - 1)`` (paper §2; GPipe, Huang et al. 2019)."""
    if P < 1 or m < 1:
        raise ValueError(f"P and m must be >= 1, got P={P}, m={m}")
    return (P - 1) / (m + P - 1)


def allreduce_time(nbytes: float, n: int, ar_alpha: float, ar_beta: float) -> float:
    """Ring all-reduce time in seconds: ``ar_alpha*2(n-1) + 2(n-1)/n * nbytes/ar_beta``,
    0 when ``n <= 1`` or ``nbytes <= 0`` (the simulator's model)."""
    return _core.allreduce_time(float(nbytes), int(n), float(ar_alpha), float(ar_beta))


def _per(value: Floats, n: int, name: str) -> list[float]:
    """Broadcast a number to ``n`` entries, or convert a sequence (length checked in C++)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return [float(value)] * n
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a number or a sequence of numbers, got {type(value).__name__}")
    try:
        return [float(x) for x in value]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must contain numbers: {exc}") from None
