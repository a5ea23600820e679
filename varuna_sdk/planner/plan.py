"""Auto-configuration: from a ``Profile`` and G GPUs to a ranked table of configurations.

Owns ``plan()`` and the ``Plan``/``PlanRow``/``Prices`` types. The inner loop (every pipeline
depth P — not only divisors of the cut-point count —, the largest replica count D that keeps
the global batch exact, cost-balanced memory-aware stage split, micro-batch size, one
simulated mini-batch with the runtime's own schedule code) runs in C++ (``csrc/search.cpp``);
this module prepares its inputs from the profile, adds prices, and presents the result.
Paper §4.1–4.4, §7.2; varuna-original.md §5.5 (whose AutoConfig could not even be built).

Units: seconds, bytes, examples/s, US dollars. Never imports ``cluster``/``manager``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from .. import _core
from ..config import POLICIES, ConfigError, ParallelConfig
from ..profiling.profile import Profile, ProfileError


@dataclass
class Prices:
    """Price of one GPU-hour in US dollars, spot and on-demand. The defaults are an **example**
    (roughly a 1×V100 cloud VM's list price and a typical ~70 % spot discount) — pass your own
    figures for your VM type; ``example`` marks whether they are."""

    spot_per_gpu_hour: float = 0.92
    on_demand_per_gpu_hour: float = 3.06
    vm_type: str = "example 1-GPU VM"
    example: bool = True


@dataclass
class PlanRow:
    """One configuration. ``stages`` holds the segment indices of each stage; times are
    seconds per mini-batch; memory is peak bytes per GPU per stage; costs are dollars for the
    GPUs the configuration uses (P·D; idle GPUs are reported, not billed)."""

    P: int
    D: int
    micro_batch_size: int
    m: int
    idle_gpus: int
    stages: list[list[int]]
    time_s: float
    examples_per_s: float
    bubble_fraction: float
    stage_memory_bytes: list[float]
    feasible: bool
    reason: str = ""
    cost_per_1k_spot: float = math.nan
    cost_per_1k_on_demand: float = math.nan
    time_to_target_s: float = math.nan
    cost_to_target_spot: float = math.nan

    def parallel_config(self, global_batch: int, policy: str = "varuna", recompute: bool | None = None) -> ParallelConfig:
        """This row as a ``ParallelConfig`` (explicit stage boundaries, so the run uses this split)."""
        return ParallelConfig(P=self.P, D=self.D, global_batch=global_batch, micro_batch_size=self.micro_batch_size,
                              policy=policy, recompute=recompute, boundaries=self.stages)


@dataclass
class Plan:
    """Ranked configurations for ``gpus`` GPUs and ``global_batch`` examples per step: feasible
    rows fastest first, then excluded rows with their reasons. ``str(plan)`` is a table."""

    gpus: int
    global_batch: int
    policy: str
    recompute: bool
    rows: list[PlanRow]
    prices: Prices
    target_examples: int | None
    search_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> list[PlanRow]:
        return [r for r in self.rows if r.feasible]

    @property
    def excluded(self) -> list[PlanRow]:
        return [r for r in self.rows if not r.feasible]

    @property
    def best(self) -> PlanRow:
        """The fastest feasible row; raises ``ValueError`` with every exclusion reason if none."""
        if not self.feasible:
            why = "; ".join(f"P={r.P}: {r.reason}" for r in self.rows[:8])
            raise ValueError(f"no configuration fits {self.gpus} GPUs and global batch {self.global_batch}: {why}")
        return self.feasible[0]

    def parallel_config(self) -> ParallelConfig:
        return self.best.parallel_config(self.global_batch, self.policy, self.recompute)

    def table(self, top: int = 12) -> str:
        """A fixed-width table: the top feasible rows, then every excluded P with its reason."""
        hdr = (f"{'rank':>4} {'P':>3} {'D':>4} {'mbs':>4} {'m':>5} {'idle':>4} {'time/step':>10} {'ex/s':>9} "
               f"{'bubble':>6} {'max mem/GPU':>11} {'$/1k ex spot':>12} {'$/1k ex od':>10}")
        if self.target_examples:
            hdr += f" {'to target':>10} {'$ to target':>11}"
        lines = [f"plan for G={self.gpus} GPUs, global batch {self.global_batch}, policy {self.policy}"
                 f"{' + recompute' if self.recompute else ''} (searched in {self.search_s * 1e3:.1f} ms)", hdr]
        for i, r in enumerate(self.feasible[:top]):
            line = (f"{i + 1:>4} {r.P:>3} {r.D:>4} {r.micro_batch_size:>4} {r.m:>5} {r.idle_gpus:>4} "
                    f"{_dur(r.time_s):>10} {r.examples_per_s:>9.2f} {r.bubble_fraction:>6.1%} "
                    f"{_bytes(max(r.stage_memory_bytes)):>11} {r.cost_per_1k_spot:>12.4f} {r.cost_per_1k_on_demand:>10.4f}")
            if self.target_examples:
                line += f" {_dur(r.time_to_target_s):>10} {r.cost_to_target_spot:>11.2f}"
            lines.append(line)
        if len(self.feasible) > top:
            lines.append(f"     ... {len(self.feasible) - top} more feasible configurations")
        for r in self.excluded:
            lines.append(f"  excluded P={r.P} D={r.D}: {r.reason}")
        if self.prices.example:
            lines.append(f"  prices are an EXAMPLE ({self.prices.vm_type}: ${self.prices.spot_per_gpu_hour}/GPU-h spot, "
                         f"${self.prices.on_demand_per_gpu_hour}/GPU-h on-demand); pass prices=Prices(...) for yours")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.table())}</pre>"

    def to_dict(self) -> dict:
        return asdict(self)


def _dur(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.1f} TiB"


def _tables(profile: Profile, sizes: Sequence[int]) -> list:
    """Per-size segment tables, interpolated once per profile and size list (cached)."""
    cache = profile.__dict__.setdefault("_tables_cache", {})
    key = tuple(sizes)
    if key in cache:
        return cache[key]
    xs = np.array(profile.micro_batch_sizes, dtype=float)
    out = []
    for b in sizes:
        t = _core.SegmentTable()
        t.micro_batch_size = int(b)
        for name, attr in (("fwd", "fwd_s"), ("rec", "rec_s"), ("bwd", "bwd_s"), ("out_bytes", "out_bytes"),
                           ("act_bytes", "act_bytes")):
            setattr(t, name, [profile.at(attr, k, b) if len(xs) < 2 or b > xs[-1] or b < xs[0]
                              else float(np.interp(b, xs, getattr(profile.segments[k], attr)))
                              for k in range(profile.num_segments)])
        out.append(t)
    cache[key] = out
    return out


def candidate_micro_batch_sizes(profile: Profile) -> list[int]:
    """Profiled sizes plus powers of two up to twice the largest profiled size."""
    top = max(profile.micro_batch_sizes) * 2
    sizes = set(profile.micro_batch_sizes) | {2**i for i in range(0, int(math.log2(top)) + 1)}
    return sorted(s for s in sizes if s <= top)


def plan(
    profile: Profile,
    gpus: int,
    global_batch: int,
    *,
    policy: str = "varuna",
    recompute: bool | None = None,
    memory_limit_bytes: float | None = None,
    gpus_per_vm: int = 1,
    compute_slots_per_vm: int = 0,
    micro_batch_sizes: Sequence[int] | None = None,
    boundaries: list[list[int]] | None = None,
    network_bandwidth_Bps: float | None = None,
    prices: Prices | None = None,
    target_examples: int | None = None,
    max_depth: int | None = None,
) -> Plan:
    """Rank every configuration of ``gpus`` GPUs for a fixed ``global_batch`` (paper §4.4).

    Args:
        profile: from ``calibrate()`` (must hold network figures unless gpus == 1).
        gpus: G, the GPUs (or CPU workers) available.
        global_batch: examples per optimizer step; never changed (= micro-batch × m × D).
        memory_limit_bytes: per GPU; default the profile's device memory if recorded, else none.
        gpus_per_vm, compute_slots_per_vm: placement (ranks sharing a VM, and how many compute
            actions can run at once there — e.g. CPU cores on the testbed; 0 = one per GPU).
        boundaries: explicit segment lists per stage (only that P is evaluated).
        network_bandwidth_Bps: what-if: replace the calibrated cross-VM p2p and all-reduce bandwidth.
        prices, target_examples: dollars per GPU-hour and a training target for time/cost columns.

    Raises ``ConfigError`` for bad arguments and ``ProfileError`` naming what the profile lacks.
    """
    if gpus < 1:
        raise ConfigError(f"gpus={gpus} must be >= 1")
    if global_batch < 1:
        raise ConfigError(f"global_batch={global_batch} must be >= 1")
    if policy not in POLICIES:
        raise ConfigError(f"policy={policy!r}; choose one of {list(POLICIES)}")
    profile.require(network=gpus > 1)
    prices = prices or Prices()
    t0 = time.perf_counter()
    rec = _core.default_recompute(policy) if recompute is None else bool(recompute)
    sizes = sorted(set(micro_batch_sizes)) if micro_batch_sizes else candidate_micro_batch_sizes(profile)
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"micro_batch_sizes={micro_batch_sizes} must be positive integers")
    inp = _core.SearchInput()
    inp.gpus, inp.global_batch, inp.policy, inp.recompute = gpus, global_batch, policy, rec
    inp.tables = _tables(profile, sizes)
    inp.param_bytes = [float(s.param_bytes) for s in profile.segments]
    shared = profile.model.get("shared", [])
    inp.tied_segments = [list(s["segments"]) for s in shared]
    inp.tied_bytes = [float(s["bytes"]) for s in shared]
    inp.optimizer_state_factor = profile.optimizer_state_factor
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.hardware.get("memory_bytes", 0)
    inp.memory_limit = float(limit or 0)
    inp.max_depth = int(max_depth or 0)
    inp.opt_s_per_param_byte = profile.opt_s_per_param_byte
    if boundaries is not None:
        if any(not b for b in boundaries):
            raise ConfigError("every stage in boundaries needs at least one segment")
        inp.fixed_starts = [b[0] for b in boundaries]
    sim = _core.SimConfig()
    net = profile.network
    if net is not None:
        bw = network_bandwidth_Bps
        sim.p2p_alpha, sim.p2p_beta = net.p2p_alpha_s, bw or net.p2p_beta_Bps
        sim.local_alpha, sim.local_beta = net.p2p_alpha_s, net.p2p_beta_Bps
        sim.ar_alpha, sim.ar_beta = net.ar_alpha_s, bw or net.ar_beta_Bps
        sim.consensus_latency = net.consensus_s
    sim.ranks_per_host = max(1, gpus_per_vm)
    sim.compute_slots_per_host = max(0, compute_slots_per_vm)
    sim.action_overhead = profile.per_action_s
    inp.sim = sim
    cands = _core.search(inp)
    n = profile.num_segments
    rows = []
    for c in cands:
        stages = []
        if c.starts:
            ends = list(c.starts[1:]) + [n]
            stages = [list(range(a, b)) for a, b in zip(c.starts, ends)]
        eps = global_batch / c.minibatch_time if c.feasible and c.minibatch_time > 0 else 0.0
        row = PlanRow(P=c.P, D=c.D, micro_batch_size=c.micro_batch_size, m=c.m, idle_gpus=c.idle_gpus, stages=stages,
                      time_s=c.minibatch_time if c.feasible else math.nan, examples_per_s=eps,
                      bubble_fraction=c.bubble_fraction, stage_memory_bytes=list(c.stage_memory) or [0.0],
                      feasible=c.feasible, reason=c.reason)
        if c.feasible and eps > 0:
            used = c.P * c.D
            hours_per_1k = 1000.0 / eps / 3600.0
            row.cost_per_1k_spot = hours_per_1k * used * prices.spot_per_gpu_hour
            row.cost_per_1k_on_demand = hours_per_1k * used * prices.on_demand_per_gpu_hour
            if target_examples:
                row.time_to_target_s = target_examples / eps
                row.cost_to_target_spot = row.time_to_target_s / 3600.0 * used * prices.spot_per_gpu_hour
        rows.append(row)
    notes = []
    if sizes and max(sizes) > max(profile.micro_batch_sizes):
        notes.append(f"micro-batch sizes above {max(profile.micro_batch_sizes)} are extrapolated from the profile")
    return Plan(gpus=gpus, global_batch=global_batch, policy=policy, recompute=rec, rows=rows, prices=prices,
                target_examples=target_examples, search_s=time.perf_counter() - t0, notes=notes)


__all__ = ["Plan", "PlanRow", "Prices", "plan", "candidate_micro_batch_sizes", "ProfileError"]
