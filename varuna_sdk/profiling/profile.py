"""The ``Profile``: everything calibration measured, as versioned JSON (never a pickle).

Owns the profile's schema, its JSON round-trip, interpolation over micro-batch sizes, and the
check that a profile holds what a plan needs — a missing entry is an error naming it, never a
silent zero. Paper §4.3 (scale-invariant calibration): every figure here is independent of the
number of GPUs G; the planner combines them for any G.

Units: seconds, bytes, bytes/second. Imports nothing from ``pipeline`` or above.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile is missing something a plan needs, or is of another version."""


@dataclass
class SegmentProfile:
    """One cut-point segment, each list indexed like ``Profile.micro_batch_sizes``.

    ``fwd_s``: forward without grad (what a recomputing stage runs first); ``rec_s``: forward
    with grad (recompute, or the forward of a non-recomputing stage); ``bwd_s``: backward;
    ``out_bytes``: bytes of the tensors crossing the cut-point after it; ``act_bytes``: bytes
    autograd saves for backward; ``param_bytes``: parameters first used here. ``bwd_in_s`` and
    ``wgt_s``: the backward split in two (``pipeline.split_backward``): the input-gradient part
    B and the weight-gradient part W, each timed on its own (their sum exceeds ``bwd_s`` by what
    the split costs); empty in a profile calibrated without them (the planner then never splits).
    """

    fwd_s: list[float]
    rec_s: list[float]
    bwd_s: list[float]
    out_bytes: list[int]
    act_bytes: list[int]
    param_bytes: int
    bwd_in_s: list[float] = field(default_factory=list)
    wgt_s: list[float] = field(default_factory=list)


def ring_allreduce_s(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-reduce of ``nbytes`` among ``n`` ranks (seconds): ``2(n-1)·alpha + 2(n-1)/n ·
    nbytes / beta`` (alpha in seconds, beta in bytes/s); 0 for ``n <= 1``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


@dataclass
class NetworkProfile:
    """α–β models: p2p one-way time = ``p2p_alpha_s + bytes / p2p_beta_Bps``; ring all-reduce
    among n = ``2(n-1)·ar_alpha_s + 2(n-1)/n · bytes / ar_beta_Bps`` (one process per core: the
    flatten / scale / copy-back around the collective included); ``consensus_s`` is the small
    world-wide all-reduce each step. ``ar_cpu_share``: the fraction u of a core each participant
    keeps busy during an all-reduce — where a host has fewer cores than u × participants, the
    planner stretches the collective by that sharing (measured from all-reduces with more
    processes than cores where the calibrating machine has them, else CPU time / wall time).
    ``samples`` keeps the raw measurements."""

    p2p_alpha_s: float
    p2p_beta_Bps: float
    ar_alpha_s: float
    ar_beta_Bps: float
    consensus_s: float
    samples: dict[str, list] = field(default_factory=dict)
    ar_cpu_share: float = 1.0

    def p2p_time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` point to point: α + bytes / β."""
        return self.p2p_alpha_s + nbytes / self.p2p_beta_Bps

    def allreduce_time(self, nbytes: float, n: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` among ``n`` participants (``ring_allreduce_s``)."""
        return ring_allreduce_s(nbytes, n, self.ar_alpha_s, self.ar_beta_Bps)


@dataclass
class Profile:
    """Calibration of one model on one kind of device (JSON, versioned)."""

    model: dict[str, Any]
    hardware: dict[str, Any]
    software: dict[str, Any]
    micro_batch_sizes: list[int]
    segments: list[SegmentProfile]
    network: NetworkProfile | None
    per_action_s: float  # framework cost of each F/R/B action (scheduler, RNG fork, send)
    per_step_s: float  # fixed cost of a step (split, receivers, schedule set-up)
    opt_s_per_param_byte: float  # end of step per parameter byte: gradient norm, clipping, optimizer step
    optimizer_state_factor: float = 2.0  # Adam: exp_avg + exp_avg_sq = 2 × params
    calibration_s: float = 0.0
    version: int = PROFILE_VERSION
    # How many processes' end-of-step work (memory-bound passes over the parameters) the machine
    # runs at full speed at once: cores × (time alone) / (time with every core doing it). Below
    # the core count when memory bandwidth, not cores, is the limit; 0 = not measured (= cores).
    opt_parallelism: float = 0.0
    # How much slower compute runs per other busy core of the machine (shared memory bandwidth
    # and caches): t(every core runs the model; mean over those processes) / t(alone) - 1, per
    # extra core; 0 = not measured.
    compute_interference: float = 0.0
    calibrated_at: float = 0.0   # Unix s when calibrate() measured it (0: not recorded)
    # per-segment factors applied to the measured compute by ``scaled`` (a live re-calibration
    # from a job's heartbeats); empty: the calibration as measured
    live_scale: list[float] = field(default_factory=list)
    # Seconds to read one example of the job's data as a training step reads it (the dataset's
    # __getitem__, collation, the split into inputs and targets; ``profiling.job.measure_data_read``):
    # each rank reads its replica's examples every mini-batch, which the simulator overlaps with
    # compute under data.prefetch (``SimConfig.data_read``). 0 = not measured (not modelled).
    data_read_s: float = 0.0
    # The global random generators reading the data draws from ("torch", "NumPy", "Python random";
    # a random transform in __getitem__): such data is read on the main thread, not ahead
    # (data.prefetch turns itself off), so the plan models no overlap.
    data_draws_random: list[str] = field(default_factory=list)
    # The share of the machine's CPU time (0..1) other work kept busy just before the calibration
    # (``profiling.job.busy_fraction``); None: not known. A calibration measured under load is
    # measured again once the machine is quiet (``profiling.job.measured_under_load``).
    busy_at_calibration: float | None = None

    def scaled(self, segment_factors: Sequence[float]) -> "Profile":
        """A copy whose per-segment compute (``fwd_s``, ``rec_s``, ``bwd_s``, ``bwd_in_s``, ``wgt_s``,
        at every micro-batch size) is multiplied by ``segment_factors[i]`` (one positive factor per segment; 1.25 = 25 %
        slower than calibrated). Memory, network and per-action costs are kept. Used to plan from
        what a running job measured (``manager``, issue "honest estimates"). Raises ``ValueError``
        for a wrong length or a factor that is not a positive finite number."""
        f = [float(x) for x in segment_factors]
        if len(f) != len(self.segments):
            raise ValueError(f"{len(f)} factors for {len(self.segments)} segments; give one per segment")
        if not all(math.isfinite(x) and x > 0.0 for x in f):
            raise ValueError(f"segment factors must be positive finite numbers, got {f}")
        segs = [replace(sg, fwd_s=[x * k for x in sg.fwd_s], rec_s=[x * k for x in sg.rec_s],
                        bwd_s=[x * k for x in sg.bwd_s], bwd_in_s=[x * k for x in sg.bwd_in_s],
                        wgt_s=[x * k for x in sg.wgt_s]) for sg, k in zip(self.segments, f)]
        base = self.live_scale or [1.0] * len(f)
        return replace(self, segments=segs, live_scale=[round(a * b, 6) for a, b in zip(base, f)])

    # ---- JSON -----------------------------------------------------------------------------
    @property
    def has_split_backward(self) -> bool:
        """True when every segment holds the split backward's B and W times (``bwd_in_s``,
        ``wgt_s``) at every micro-batch size: the planner may then split the backward."""
        n = len(self.micro_batch_sizes)
        return bool(self.segments) and all(len(sg.bwd_in_s) == n and len(sg.wgt_s) == n for sg in self.segments)

    def to_json(self, path: str | Path | None = None) -> str:
        """The profile as JSON text, also written to ``path`` when given."""
        text = json.dumps(asdict(self), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        """Build from parsed JSON; raises ``ProfileError`` naming the missing key or bad version."""
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile version {d.get('version')!r} is not {PROFILE_VERSION}; re-run calibrate()")
        try:
            segs = [SegmentProfile(**s) for s in d["segments"]]
            net = NetworkProfile(**d["network"]) if d.get("network") is not None else None
            rest = {k: d[k] for k in ("model", "hardware", "software", "micro_batch_sizes", "per_action_s",
                                      "per_step_s", "opt_s_per_param_byte")}
        except KeyError as e:
            raise ProfileError(f"profile is missing {e.args[0]!r}; re-run calibrate()") from e
        except TypeError as e:
            raise ProfileError(f"profile has a malformed entry: {e}") from e
        opt = {k: d[k] for k in ("optimizer_state_factor", "calibration_s", "opt_parallelism",
                                            "compute_interference", "calibrated_at", "live_scale", "data_read_s",
                                 "data_draws_random", "busy_at_calibration") if k in d}
        return cls(segments=segs, network=net, **rest, **opt)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile JSON file; raises ``ProfileError`` for a missing file or entry."""
        p = Path(path)
        if not p.is_file():
            raise ProfileError(f"profile file {str(p)!r} does not exist; run calibrate() first")
        return cls.from_dict(json.loads(p.read_text()))

    # ---- lookups ----------------------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        """Cut-point segments the profile measured."""
        return len(self.segments)

    def require(self, *, network: bool, micro_batch_size: int | None = None) -> None:
        """Raise ``ProfileError`` naming what is missing for a plan (network figures for D > 1 or
        P > 1; the segment lists; a usable micro-batch size)."""
        if not self.segments:
            raise ProfileError("profile has no segments; re-run calibrate()")
        n = len(self.micro_batch_sizes)
        for i, s in enumerate(self.segments):
            for key in ("fwd_s", "rec_s", "bwd_s", "out_bytes", "act_bytes"):
                vals = getattr(s, key)
                if len(vals) != n:
                    raise ProfileError(
                        f"segment {i} has {len(vals)} {key} values for {n} micro-batch sizes; re-run calibrate()")
        if network and self.network is None:
            raise ProfileError("profile has no network measurements (p2p, all-reduce), needed for P > 1 or D > 1; "
                               "run calibrate(network=True)")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ProfileError(f"micro-batch size {micro_batch_size} must be >= 1")

    def at(self, key: str, segment: int, micro_batch_size: int) -> float:
        """``key`` of ``segment`` at any micro-batch size: piecewise-linear in the measured sizes,
        extended linearly beyond them (per-example cost of the nearest interval)."""
        xs = self.micro_batch_sizes
        ys = getattr(self.segments[segment], key)
        b = float(micro_batch_size)
        if len(xs) == 1:
            return ys[0] * b / xs[0]
        if b <= xs[0]:
            i = 0
        elif b >= xs[-1]:
            i = len(xs) - 2
        else:
            i = max(j for j in range(len(xs) - 1) if xs[j] <= b)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        v = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
        if b < xs[0]:  # below the smallest size: scale down, never below zero
            v = max(0.0, min(v, y0))
        return max(0.0, v)
