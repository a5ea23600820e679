"""Auto-configuration: from a ``Profile`` and G GPUs to a ranked table of configurations.

Owns ``plan()`` and the ``Plan``/``PlanRow``/``Prices`` types. The inner loop (every pipeline
depth P — not only divisors of the cut-point count —, every replica count D <= G/P that keeps
the global batch exact, every micro-batch size, a cost-balanced memory-aware stage split and a
simulated mini-batch with the runtime's own schedule code; per P the fastest (D, micro-batch),
candidates that a lower bound shows cannot win skipped unsimulated) runs in C++
(``csrc/search.cpp``); this module prepares its inputs from the profile, adds prices, and
presents the result.
Paper §4.1–4.4, §7.2; varuna-original.md §5.5 (whose AutoConfig could not even be built).

Units: seconds, bytes, examples/s, US dollars. Never imports ``cluster``/``manager``.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

import numpy as np

from .._native import core as _core
from ..config import POLICIES, ConfigError, JobConfig, ParallelConfig
from ..profiling.profile import Profile, ProfileError


@dataclass
class Prices:
    """Price of one GPU-hour in US dollars, spot and on-demand. The defaults are an **example**
    (roughly a 1×V100 cloud VM's list price and a typical ~70 % spot discount) — pass your own
    figures for your VM type; ``example`` marks whether they are.

    Raises ``ConfigError`` when a price is not a finite number >= 0 (a string, a bool, NaN, a
    negative number)."""

    spot_per_gpu_hour: float = 0.92
    on_demand_per_gpu_hour: float = 3.06
    vm_type: str = "example 1-GPU VM"
    example: bool = True

    def __post_init__(self) -> None:
        for name in ("spot_per_gpu_hour", "on_demand_per_gpu_hour"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"Prices.{name}={v!r} must be a finite number >= 0 (US dollars per GPU-hour), "
                                  f"e.g. Prices(spot_per_gpu_hour=0.9, on_demand_per_gpu_hour=3.0)")
            setattr(self, name, float(v))


@dataclass
class PlanRow:
    """One configuration. ``stages`` holds the segment indices of each stage; times are
    seconds per mini-batch; memory is peak bytes per GPU per stage; costs are dollars for the
    GPUs the configuration uses (P·D; idle GPUs are reported, not billed); a number that does not
    apply (the time of an excluded row, time and cost to target without ``target_examples``) is
    NaN here and ``None`` in ``Plan.to_dict()``. For an excluded row, ``D`` and
    ``micro_batch_size`` are those of the candidate its ``reason`` describes. ``pruned`` is True
    only for the excluded row of a depth that a best-only search (``plan(exhaustive=False)``)
    ruled out without simulating or checking memory; its ``lower_bound_s`` (seconds per
    mini-batch, NaN on every other row) is the smallest lower bound of its candidates, at least
    the best row's time. ``split_backward``: the row runs the zero-bubble split (B and W apart;
    ``pipeline.split_backward``) because the simulator found it faster there."""

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
    pruned: bool = False
    lower_bound_s: float = math.nan
    split_backward: bool = False

    def __repr__(self) -> str:
        """Fields as in the dataclass, floats to 4 significant digits (not 15)."""
        def show(v):
            if isinstance(v, float):
                return f"{v:.4g}"
            if isinstance(v, list):
                return "[" + ", ".join(show(x) for x in v) + "]"
            return repr(v)
        return "PlanRow(" + ", ".join(f"{f.name}={show(getattr(self, f.name))}" for f in fields(self)) + ")"

    def parallel_config(self, global_batch: int, policy: str = "varuna", recompute: bool | None = None) -> ParallelConfig:
        """This row as a ``ParallelConfig`` (explicit stage boundaries, so the run uses this split,
        and the row's choice of the split backward)."""
        return ParallelConfig(P=self.P, D=self.D, global_batch=global_batch, micro_batch_size=self.micro_batch_size,
                              policy=policy, recompute=recompute, boundaries=self.stages,
                              split_backward=self.split_backward)


@dataclass
class Plan:
    """Ranked configurations for ``gpus`` GPUs and ``global_batch`` examples per step: one row per
    pipeline depth P (its fastest replica count D and micro-batch size), feasible rows fastest
    first, then excluded rows with their reasons. ``str(plan)`` is a table. ``search_stats``: what
    the C++ search did (depths, candidates, bounded, splits, split_failed, simulated, pruned,
    actions, pruned_rows; see ``csrc/search.h``). ``exhaustive``: False for a best-only search
    (``plan(exhaustive=False)``), whose rows other than the best are the fastest candidate it
    happened to simulate for their depth, or excluded as pruned."""

    gpus: int
    global_batch: int
    policy: str
    recompute: bool
    rows: list[PlanRow]
    prices: Prices
    target_examples: int | None
    search_s: float
    notes: list[str] = field(default_factory=list)
    search_stats: dict = field(default_factory=dict)
    exhaustive: bool = True
    split_backward: bool | None = False
    _search: object = field(default=None, repr=False, compare=False)
    _search_split: object = field(default=None, repr=False, compare=False)
    _sizes: list[int] = field(default_factory=list, repr=False, compare=False)

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
            if len(self.rows) > 8:
                why += f"; ... and {len(self.rows) - 8} more (see Plan.table())"
            raise ValueError(f"no configuration fits {self.gpus} GPUs and global batch {self.global_batch}: {why}")
        return self.feasible[0]

    def parallel_config(self) -> ParallelConfig:
        return self.best.parallel_config(self.global_batch, self.policy, self.recompute)

    def _rows_and_notes(self, top: int) -> tuple[list[str], list[list[str]], list[str]]:
        """The table's header, the ``top`` fastest feasible rows as formatted cells, and the lines
        after it (rows left out, excluded and pruned depths, example prices, notes)."""
        if isinstance(top, bool) or not isinstance(top, numbers.Integral) or top < 1:
            raise ValueError(f"top={top!r} must be an integer >= 1 (how many feasible rows to show); "
                             "top=len(plan.feasible) shows them all")
        top = int(top)
        head = ["rank", "P", "D", "mbs", "m", "idle", "bwd", "time/step", "ex/s", "bubble", "max mem/GPU",
                "$/1k ex spot", "$/1k ex od"] + (["to target", "$ to target"] if self.target_examples else [])
        rows = []
        for i, r in enumerate(self.feasible[:top]):
            cells = [str(i + 1), str(r.P), str(r.D), str(r.micro_batch_size), str(r.m), str(r.idle_gpus),
                     "B|W" if r.split_backward else "whole",
                     _dur(r.time_s), f"{r.examples_per_s:.2f}", f"{r.bubble_fraction:.1%}",
                     _bytes(max(r.stage_memory_bytes)), f"{r.cost_per_1k_spot:.4f}", f"{r.cost_per_1k_on_demand:.4f}"]
            if self.target_examples:
                cells += [_dur(r.time_to_target_s), f"{r.cost_to_target_spot:.2f}"]
            rows.append(cells)
        notes = []
        if len(self.feasible) > top:
            more = len(self.feasible) - top
            notes.append(f"... {more} more feasible configuration{'s' if more > 1 else ''} "
                         f"(table(top={len(self.feasible)}) shows all)")
        for r in self.excluded:
            if not r.pruned:
                notes.append(f"excluded P={r.P}: {r.reason}")
        pruned = [r for r in self.excluded if r.pruned]
        if pruned:  # one line: a best-only search prunes most depths
            lo = min(pruned, key=lambda r: r.lower_bound_s)
            many = "s" if len(pruned) > 1 else ""
            notes.append(f"pruned P={_ranges([r.P for r in pruned])} ({len(pruned)} depth{many}): by their lower "
                         f"bounds (>= {_dur(lo.lower_bound_s)} per mini-batch, at P={lo.P}) none beats the best row; "
                         f"not simulated, memory not checked {_EXHAUSTIVE_HINT}")
        if self.prices.example:
            notes.append(f"prices are an EXAMPLE ({self.prices.vm_type}: ${self.prices.spot_per_gpu_hour}/GPU-h spot, "
                         f"${self.prices.on_demand_per_gpu_hour}/GPU-h on-demand); pass prices=Prices(...) "
                         "(varuna plan: --spot-price, --on-demand-price) for yours")
        notes += [f"note: {n}" for n in self.notes]
        return head, rows, notes

    def _title(self) -> str:
        split = {None: " (backward split per row: B|W)", True: " + split backward (B|W)", False: ""}[self.split_backward]
        return (f"plan for G={self.gpus} GPUs, global batch {self.global_batch}, policy {self.policy}"
                f"{' + recompute' if self.recompute else ''}{split} (searched in {self.search_s * 1e3:.1f} ms"
                f"{'' if self.exhaustive else _BEST_ONLY_NOTE})")

    def table(self, top: int = 12) -> str:
        """A fixed-width table: the ``top`` (>= 1) fastest feasible rows, a line counting the
        feasible rows left out, then every excluded P with its reason. Raises ``ValueError`` for
        ``top`` < 1."""
        head, rows, notes = self._rows_and_notes(top)
        widths = [max(len(c) for c in col) for col in zip(head, *rows)]
        lines = [self._title()] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows]]
        return "\n".join(lines + [f"  {n}" for n in notes])

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        """The table as HTML (a notebook wraps long ``<pre>`` lines, which breaks a text table's
        columns): numbers right-aligned in cells, the notes as lines below."""
        import html

        head, rows, notes = self._rows_and_notes(12)
        td = "padding:1px 8px;text-align:right;font-variant-numeric:tabular-nums"
        cells = "".join("<tr>" + "".join(f"<td style='{td}'>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return (f"<div><b>{html.escape(self._title())}</b><table style='border-collapse:collapse'><tr>"
                + "".join(f"<th style='{td}'>{html.escape(h)}</th>" for h in head) + f"</tr>{cells}</table>"
                + "".join(f"<div style='font-size:90%;color:#555'>{html.escape(n)}</div>" for n in notes) + "</div>")

    def to_dict(self) -> dict:
        """Plain data, JSON-able in strict JSON (``json.dumps(..., allow_nan=False)``): every public
        field, rows and prices as dicts; a number that does not apply (NaN or infinite in the
        ``PlanRow``) is ``None``."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")}

    def simulate(self, row: PlanRow | None = None, *, rank_scale: Sequence[float] | None = None,
                 record_timeline: bool = True) -> "SimOutput":
        """Simulate ``row`` (default: the best) event by event for its full m with the costs the
        search used: the per-stage Gantt timeline (``SimOutput.timeline``, seconds from the
        mini-batch's start, per rank = replica*P + stage) for the dashboard, and what-ifs:
        ``rank_scale`` (length P*D) slows ranks' compute down (a straggler at 1.5x: 1.5).

        Raises ``ValueError`` for a row that is not one of this plan's ``rows`` (from another
        ``Plan``, or edited: it would be simulated with this plan's inputs), an infeasible row or a
        ``rank_scale`` of the wrong length.
        """
        from .simulate import SimOutput

        row = self.best if row is None else row
        if row not in self.rows:  # identity, else equality
            raise ValueError(f"row P={getattr(row, 'P', '?')} D={getattr(row, 'D', '?')} is not one of this plan's "
                             "rows (it comes from another Plan or was edited, and would be simulated with this plan's "
                             "profile, G and batch); pass a row of this plan's .rows, or call .simulate() on the Plan "
                             "that made it")
        if not row.feasible or not row.stages:
            raise ValueError(f"P={row.P} D={row.D} is not feasible ({row.reason}); simulate a feasible row")
        if self._search is None or row.micro_batch_size not in self._sizes:
            raise ValueError("this Plan was not made by plan() (no search input kept); call plan() again")
        scale = [float(x) for x in rank_scale] if rank_scale is not None else []
        if scale and len(scale) != row.P * row.D:
            raise ValueError(f"rank_scale has {len(scale)} entries; P*D = {row.P * row.D} needed")
        search = self._search_split if row.split_backward else self._search
        r = _core.simulate_candidate(search, row.P, row.D, self._sizes.index(row.micro_batch_size),
                                     [st[0] for st in row.stages], scale, bool(record_timeline))
        return SimOutput.from_core(r, bool(record_timeline))


def _plain(v):
    """``v`` as JSON-able data: dataclasses as dicts, non-finite floats as ``None``."""
    if hasattr(v, "__dataclass_fields__"):
        v = asdict(v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


_EXHAUSTIVE_HINT = "(an exhaustive search does both: varuna plan without --best-only, plan(..., exhaustive=True))"
_BEST_ONLY_NOTE = ("; best-only search: the first row is the fastest; each other row is the fastest candidate it "
                   "simulated for that depth, not necessarily the depth's fastest")


def _ranges(xs: Sequence[int]) -> str:
    """Sorted ints as runs: [1, 2, 3, 5, 7, 8] -> "1-3, 5, 7-8"."""
    runs: list[list[int]] = []
    for x in sorted(xs):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


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


def _bytes(b: float, digits: int = 1) -> str:
    """Bytes in B, KiB, MiB, GiB or TiB (binary units) with ``digits`` decimals: ``60.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.{digits}f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.{digits}f} TiB"


_TABLE_KEYS = (("fwd", "fwd_s"), ("rec", "rec_s"), ("bwd", "bwd_s"), ("out_bytes", "out_bytes"),
               ("act_bytes", "act_bytes"))
_SPLIT_KEYS = (("bwd_in", "bwd_in_s"), ("wgt", "wgt_s"))  # only in a profile with the split backward


def _checked(profile: Profile) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The profile's sizes and per-key ``[segments, sizes]`` arrays; ``ProfileError`` naming the
    segment, key and size for a value that is not a finite number >= 0, or for sizes that are not
    increasing positive integers (a NaN or negative time would otherwise surface as a simulator
    error about a *stage*, or as a silently wrong plan)."""
    xs = list(profile.micro_batch_sizes)
    if not xs or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in xs) or xs != sorted(set(xs)):
        raise ProfileError(f"profile micro_batch_sizes={xs} must be increasing positive integers; re-run calibrate()")
    out = {}
    for _, attr in _TABLE_KEYS + (_SPLIT_KEYS if profile.has_split_backward else ()):
        try:
            a = np.array([getattr(seg, attr) for seg in profile.segments], dtype=float)
        except (TypeError, ValueError) as e:
            raise ProfileError(f"profile {attr} holds a value that is not a number ({e}); re-run calibrate()") from None
        bad = ~np.isfinite(a) | (a < 0)
        if bad.any():
            k, j = (int(v) for v in np.argwhere(bad)[0])
            raise ProfileError(f"segment {k} {attr} at micro-batch size {xs[j]} is "
                               f"{getattr(profile.segments[k], attr)[j]!r}; it must be a finite "
                               "number >= 0; re-run calibrate()")
        out[attr] = a
    for k, seg in enumerate(profile.segments):
        pb = seg.param_bytes
        if isinstance(pb, bool) or not isinstance(pb, (int, float)) or not math.isfinite(pb) or pb < 0:
            raise ProfileError(f"segment {k} param_bytes is {pb!r}; it must be a number >= 0; re-run calibrate()")
    return np.array(xs, dtype=float), out


def _interp(ys: np.ndarray, xs: np.ndarray, b: int) -> np.ndarray:
    """``Profile.at`` for every segment at once (``ys`` is ``[segments, sizes]``): piecewise-linear
    in the measured sizes, extended linearly with the nearest interval, clamped at 0 (and, below
    the smallest size, at the smallest size's value)."""
    if len(xs) == 1:
        return np.maximum(0.0, ys[:, 0] * b / xs[0])
    if b <= xs[0]:
        i = 0
    elif b >= xs[-1]:
        i = len(xs) - 2
    else:
        i = int(np.searchsorted(xs, b, side="right")) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[:, i], ys[:, i + 1]
    v = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
    if b < xs[0]:
        v = np.minimum(v, y0)
    return np.maximum(0.0, v)


def _tables(profile: Profile, sizes: Sequence[int], checked: tuple | None = None) -> list:
    """Per-size segment tables (the C++ search's input), interpolated from the profile as
    ``Profile.at`` does. Built afresh on every call (vectorised, well under a millisecond for a
    hundred segments), so a profile edited in place is never planned from stale numbers."""
    xs, arrays = checked or _checked(profile)
    out = []
    for b in sizes:
        t = _core.SegmentTable()
        t.micro_batch_size = int(b)
        for name, attr in _TABLE_KEYS + _SPLIT_KEYS:
            if attr in arrays:
                setattr(t, name, _interp(arrays[attr], xs, int(b)).tolist())
        out.append(t)
    return out


_INT_MAX = 2**31 - 1  # the C++ search counts examples, GPUs and micro-batches in 32-bit ints


def _int_arg(name: str, v, low: int, hint: str) -> int:
    """``v`` as an int in ``[low, 2**31 - 1]``; ``ConfigError`` naming ``name``, what is wrong and
    ``hint`` otherwise (a bool, float or string is refused, never rounded)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ConfigError(f"{name}={v!r} must be an integer >= {low}, not a {type(v).__name__}; {hint}")
    if v < low:
        raise ConfigError(f"{name}={v!r} must be an integer >= {low}; {hint}")
    if v > _INT_MAX:
        raise ConfigError(f"{name}={v!r} is too large: the search counts in 32-bit integers (at most {_INT_MAX}); "
                          f"{hint}")
    return int(v)


def _positive(name: str, v, hint: str) -> float | None:
    """``None``, or ``v`` as a finite float > 0; ``ConfigError`` naming ``name`` and ``hint`` otherwise."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{name}={v!r} must be a finite number > 0, or None; {hint}")
    return float(v)


def _largest_divisor(B: int, k: int) -> int:
    """The largest divisor of ``B`` that is <= ``k`` (>= 1): the most replicas a batch of B allows."""
    best, i = 1, 1
    while i * i <= B:
        if B % i == 0:
            best = max([best] + [d for d in (i, B // i) if d <= k])
        i += 1
    return best


def _check_boundaries(boundaries: list[list[int]], n: int, gpus: int) -> None:
    """Explicit stages must list every segment 0..n-1 once, in order, each stage non-empty, and
    need no more GPUs than there are (``ConfigError`` saying what would work)."""
    if not isinstance(boundaries, (list, tuple)) or any(not isinstance(b, (list, tuple)) for b in boundaries):
        raise ConfigError(f"boundaries={boundaries!r} must be a list of stages, each a list of segment indices, "
                          f"e.g. [[0, 1], [2, 3]]; or None to balance the stages")
    P = len(boundaries)
    if P < 1 or any(not b for b in boundaries):
        raise ConfigError(f"boundaries={boundaries}: every stage needs at least one segment")
    flat = [k for b in boundaries for k in b]
    if any(isinstance(k, bool) or not isinstance(k, int) for k in flat) or flat != list(range(n)):
        even = [list(range(s * n // P, (s + 1) * n // P)) for s in range(P)] if P <= n else None
        hint = f", e.g. {even}" if even and n <= 32 else ""
        raise ConfigError(f"boundaries={boundaries} must list the profile's {n} segments 0..{n - 1} once each, in "
                          f"order, as {P} contiguous {'stage' if P == 1 else 'stages'}{hint}")
    if P > gpus:
        raise ConfigError(f"boundaries give P={P} stages but only gpus={gpus}; use at most {gpus} stages")


def candidate_micro_batch_sizes(profile: Profile, global_batch: int | None = None) -> list[int]:
    """Every micro-batch size from 1 to twice the largest profiled size (sizes between and above
    the profiled ones are interpolated / extrapolated); with ``global_batch``, only the sizes that
    divide it (no other can keep global batch = micro-batch × m × D exact)."""
    top = max(profile.micro_batch_sizes) * 2
    return [b for b in range(1, top + 1) if global_batch is None or global_batch % b == 0]


def _stages(P: int) -> str:
    return f"{P} stage" if P == 1 else f"{P} stages"


def _two_sizes(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` bytes as ``_bytes`` prints them, with more digits when they would print alike."""
    x, y = _bytes(a), _bytes(b)
    return (x, y) if x != y else (_bytes(a, 3), _bytes(b, 3))


def _least_split_memory(inp, P: int, D: int, ti: int) -> float:
    """The smallest per-GPU memory limit (bytes, to 0.01 %) under which the search finds a split
    into P stages for replica count D and micro-batch table ``ti``: a bisection on
    ``inp.memory_limit`` with the search's own memory-aware split (``candidate_lower_bound`` is
    inf exactly when no split fits). ``inp`` is left as it was; NaN if even 2**200 x fails."""
    limit = inp.memory_limit

    def fits(x: float) -> bool:
        inp.memory_limit = x
        return math.isfinite(_core.candidate_lower_bound(inp, P, D, ti))

    try:
        lo, hi = limit, 2.0 * limit
        for _ in range(200):
            if fits(hi):
                break
            lo, hi = hi, 2.0 * hi
        else:
            return math.nan
        while hi - lo > 1e-4 * hi:
            mid = 0.5 * (lo + hi)
            if fits(mid):
                hi = mid
            else:
                lo = mid
        return hi
    finally:
        inp.memory_limit = limit


def _reason(c, inp, sizes: list[int]) -> str:
    """Why the infeasible candidate ``c`` cannot run, in bytes the user can act on: the memory
    limit and the least a split into c.P stages needs (or the stage over the limit), else the
    search's own reason (no micro-batch size divides the replica batch)."""
    if not c.simulated:
        return (f"pruned by the best-only search: its candidates need at least {_dur(c.minibatch_time)} per "
                f"mini-batch (a lower bound), at least the best row's time; neither simulated nor checked against "
                f"memory {_EXHAUSTIVE_HINT}")
    limit = inp.memory_limit
    if limit > 0 and c.micro_batch_size and not c.starts:
        need = _least_split_memory(inp, c.P, c.D, sizes.index(c.micro_batch_size))
        a, b = _two_sizes(need, limit)
        return (f"no split into {_stages(c.P)} fits the memory limit of {b} per GPU: the best needs at least {a} "
                f"(micro-batch {c.micro_batch_size}, m={c.m})")
    over = [s for s, mem in enumerate(c.stage_memory) if mem > limit] if limit > 0 else []
    if over:
        s = over[0]
        a, b = _two_sizes(c.stage_memory[s], limit)
        return (f"stage {s} of the split into {_stages(c.P)} needs {a} per GPU, over the memory limit of {b} "
                f"(micro-batch {c.micro_batch_size}, m={c.m})")
    if not c.micro_batch_size:  # no size divides the replica batch (only with the user's sizes: 1 always does)
        return f"{c.reason} (micro-batch sizes tried: {sizes})"
    return c.reason


def _idle_note(best: PlanRow, G: int, B: int, replicas: int | None, limits: list[str]) -> str:
    """Why the best row leaves GPUs idle: a fixed D, fewer replicas simulating faster, or a G/P that
    does not divide the batch (or a P that does not divide G). ``limits``: the user's other
    restrictions of the search (boundaries, max_depth), named in the note."""
    P, D = best.P, best.D
    head = f"the best configuration uses P x D = {P * D} of the {G} GPUs ({best.idle_gpus} idle) because "
    among = f" ({' and '.join(limits)})" if limits else ""
    if replicas is not None:
        return head + f"replicas={replicas} is fixed{among}; pass replicas=None to let the planner choose D"
    top = G // P
    dmax = _largest_divisor(B, top)
    if D < dmax:
        return head + (f"fewer replicas are faster as simulated: P={P} with D={dmax} replicas ({P * dmax} GPUs) is "
                       f"no faster than with D={D} (the extra replicas' all-reduce and shared compute cost more than "
                       "they give)")
    why = []
    if dmax < top:
        why.append(f"D = G/P = {top} does not divide the global batch {B} (the largest D <= {top} that does is {dmax})")
    if G % P:
        why.append(f"P={P} does not divide G={G}")
    return head + " and ".join(why) + f"; no configuration {'tried ' if limits else ''}that uses all {G} GPUs is " \
        f"faster{among}"


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
    replicas: int | None = None,
    exhaustive: bool = True,
    split_backward: bool | None = None,
) -> Plan:
    """Rank every configuration of ``gpus`` GPUs for a fixed ``global_batch`` (paper §4.4).

    One row per pipeline depth P = 1 .. min(gpus, segments): the fastest simulated (D,
    micro-batch size) for that P over every replica count D <= gpus / P dividing the global
    batch (fewer replicas leave GPUs idle — ``idle_gpus`` — and win when the all-reduce or
    shared cores cost more than the extra replicas give) and every micro-batch size that
    divides the replica batch. Ties go to fewer GPUs, then the larger micro-batch.

    Args:
        profile: from ``calibrate()`` (must hold network figures unless gpus == 1).
        gpus: G >= 1, the GPUs (or CPU workers) available (an int).
        global_batch: examples per optimizer step, an int >= 1; never changed (= micro-batch × m × D).
        policy: ``"varuna"``, ``"gpipe"`` or ``"1f1b"``.
        recompute: True, False or None (the policy's default: on for Varuna).
        memory_limit_bytes: bytes per GPU, a finite number > 0; None (default): the profile's
            device memory if recorded, else no limit. 0 does not mean "no limit" (refused).
        gpus_per_vm, compute_slots_per_vm: placement (ranks sharing a VM, an int >= 1, and how many
            compute actions can run at once there, an int >= 0 — e.g. CPU cores on the testbed;
            0 = one per GPU).
        micro_batch_sizes: a non-empty list of ints >= 1 to try; default every size from 1 to
            twice the largest profiled size that divides ``global_batch``.
        boundaries: explicit segment lists per stage (only that P is evaluated; P x ``replicas``
            must fit ``gpus``, and ``max_depth``, if given, must be >= P).
        network_bandwidth_Bps: what-if, bytes/s > 0: replace the calibrated cross-VM p2p and
            all-reduce bandwidth. None: the calibrated figures.
        prices, target_examples: dollars per GPU-hour (a ``Prices``) and a training target in
            examples (> 0) for time/cost columns.
        max_depth: largest P tried, an int >= 1 (default min(gpus, segments)).
        replicas: a data-parallel width D fixed by the user (must divide ``global_batch`` and be
            <= ``gpus``); only depths P <= gpus / D are offered. Default: chosen per P.
        exhaustive: True (default): every depth's row is its fastest candidate, simulated; the
            cost grows about quadratically in G below the segment count (each depth P simulates a
            pipeline of P stages). False (best only, for re-planning under a morph): candidates of
            all depths are taken best first by lower bound and the search stops when none can
            beat the fastest found, so it costs about linearly in G; the best row is the same,
            other rows are the fastest candidate simulated for their depth (not necessarily its
            fastest), and depths never simulated are excluded as pruned (``PlanRow.pruned``).
        split_backward: the zero-bubble split of the backward (Varuna only; B = input gradient,
            W = weight gradients deferred into waits). None (default): searched both ways where
            the profile holds the split's B and W times, each row taking the faster (its
            ``split_backward`` says which); True: always (the profile must hold them); False:
            never.

    Raises ``ConfigError`` for bad arguments (each checked before any work, the message saying
    what to pass instead) and ``ProfileError`` naming what the profile lacks.
    """
    gpus = _int_arg("gpus", gpus, 1, "pass the number of GPUs (workers) available, e.g. gpus=8")
    global_batch = _int_arg("global_batch", global_batch, 1,
                            "pass the examples per optimizer step as an int, e.g. global_batch=64")
    if policy not in POLICIES:
        raise ConfigError(f"policy={policy!r}; choose one of {list(POLICIES)}")
    if recompute is not None and not isinstance(recompute, (bool, np.bool_)):
        raise ConfigError(f"recompute={recompute!r} must be True, False or None (the policy's default)")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, numbers.Integral)
                                 or replicas < 1 or replicas > gpus or global_batch % replicas):
        raise ConfigError(f"replicas={replicas!r} must be an integer D >= 1 that divides global_batch={global_batch} "
                          f"and is at most gpus={gpus}; pass replicas=None to let the planner choose D")
    replicas = None if replicas is None else int(replicas)
    if micro_batch_sizes is not None:
        mbs_hint = ("pass a non-empty list of ints >= 1 such as [1, 2, 4], or None to try every size from 1 to twice "
                    "the largest profiled")
        if isinstance(micro_batch_sizes, (str, bytes)) or not hasattr(micro_batch_sizes, "__iter__"):
            raise ConfigError(f"micro_batch_sizes={micro_batch_sizes!r} is not a list; {mbs_hint}")
        given = list(micro_batch_sizes)
        if not given:
            raise ConfigError(f"micro_batch_sizes={given} is empty; {mbs_hint}")
        for b in given:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or not 1 <= b <= _INT_MAX:
                raise ConfigError(f"micro_batch_sizes={given!r} holds {b!r}, which is not an integer >= 1; {mbs_hint}")
        micro_batch_sizes = [int(b) for b in given]
    memory_limit_bytes = _positive("memory_limit_bytes", memory_limit_bytes,
                                   "pass bytes per GPU such as 16 * 2**30, or None for the profile's device memory "
                                   "(no limit when none is recorded)")
    network_bandwidth_Bps = _positive("network_bandwidth_Bps", network_bandwidth_Bps,
                                      "pass bytes per second such as 1.25e9 (10 Gbit/s), or None for the calibrated "
                                      "bandwidth")
    if max_depth is not None:
        max_depth = _int_arg("max_depth", max_depth, 1, "pass None to try every depth up to min(gpus, segments)")
    gpus_per_vm = _int_arg("gpus_per_vm", gpus_per_vm, 1, "pass how many GPUs (ranks) share one VM, e.g. 1")
    compute_slots_per_vm = _int_arg("compute_slots_per_vm", compute_slots_per_vm, 0,
                                    "pass how many compute actions a VM runs at once (e.g. its CPU cores), or 0 for "
                                    "one per GPU")
    if prices is not None and not isinstance(prices, Prices):
        raise ConfigError(f"prices={prices!r} must be a Prices(spot_per_gpu_hour=..., on_demand_per_gpu_hour=...) "
                          "or None for the example prices")
    if not isinstance(exhaustive, (bool, np.bool_)):
        raise ConfigError(f"exhaustive={exhaustive!r} must be True (simulate every depth's row) or False (best only)")
    if split_backward is not None and not isinstance(split_backward, (bool, np.bool_)):
        raise ConfigError(f"split_backward={split_backward!r} must be True, False or None (try both per row)")
    if split_backward and policy != "varuna":
        raise ConfigError(f"split_backward=True applies to the varuna policy only (policy={policy!r} runs its backward "
                          "whole); pass split_backward=None or False, or policy='varuna'")
    if split_backward and not profile.has_split_backward:
        raise ProfileError("split_backward=True needs the split backward's B and W times per segment (bwd_in_s, "
                           "wgt_s), which this profile lacks; re-run calibrate(), or pass split_backward=None")
    if target_examples is not None:
        _positive("target_examples", target_examples,
                  "pass the examples to train on, e.g. 10**7, or None for no time/cost-to-target columns")
    profile.require(network=gpus > 1)
    checked = _checked(profile)
    n = profile.num_segments
    if boundaries is not None:
        _check_boundaries(boundaries, n, gpus)
        P = len(boundaries)
        if max_depth is not None and max_depth < P:
            raise ConfigError(f"max_depth={max_depth} but boundaries give P={P} stages; pass max_depth=None "
                              f"(boundaries fix P) or give at most {max_depth} stages")
        if replicas is not None and P * replicas > gpus:
            raise ConfigError(f"boundaries give P={P} stages and replicas={replicas}: P x replicas = {P * replicas} "
                              f"GPUs but gpus={gpus}; the largest valid replicas is "
                              f"{_largest_divisor(global_batch, gpus // P)} (at most gpus // P = {gpus // P} and "
                              f"dividing global_batch={global_batch}), or pass replicas=None")
    if memory_limit_bytes is not None:
        limit = memory_limit_bytes
    else:
        limit = profile.hardware.get("memory_bytes")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Real)
                                  or not math.isfinite(limit) or limit <= 0):
            raise ProfileError(f"profile hardware.memory_bytes={limit!r} is not a number of bytes > 0; re-run "
                               "calibrate(), or pass memory_limit_bytes")
    prices = prices or Prices()
    t0 = time.perf_counter()
    rec = _core.default_recompute(policy) if recompute is None else bool(recompute)
    sizes = sorted(set(micro_batch_sizes)) if micro_batch_sizes else candidate_micro_batch_sizes(profile, global_batch)
    inp = _core.SearchInput()
    inp.gpus, inp.global_batch, inp.policy, inp.recompute = gpus, global_batch, policy, rec
    inp.tables = _tables(profile, sizes, checked)
    inp.param_bytes = [float(s.param_bytes) for s in profile.segments]
    shared = profile.model.get("shared", [])
    inp.tied_segments = [list(s["segments"]) for s in shared]
    inp.tied_bytes = [float(s["bytes"]) for s in shared]
    inp.optimizer_state_factor = profile.optimizer_state_factor
    inp.memory_limit = float(limit or 0)  # 0: no limit (C++)
    inp.max_depth = int(max_depth or 0)
    inp.fixed_replicas = int(replicas or 0)
    inp.opt_s_per_param_byte = profile.opt_s_per_param_byte
    inp.opt_parallelism = profile.opt_parallelism
    inp.compute_interference = profile.compute_interference
    inp.ar_cpu_share = profile.network.ar_cpu_share if profile.network is not None else 1.0
    inp.exhaustive = bool(exhaustive)
    if boundaries is not None:
        inp.fixed_starts = [b[0] for b in boundaries]
    sim = _core.SimConfig()
    net = profile.network
    if net is not None:
        bw = network_bandwidth_Bps
        sim.p2p_alpha, sim.p2p_beta = net.p2p_alpha_s, bw or net.p2p_beta_Bps
        sim.local_alpha, sim.local_beta = net.p2p_alpha_s, net.p2p_beta_Bps
        sim.ar_alpha, sim.ar_beta = net.ar_alpha_s, bw or net.ar_beta_Bps
        sim.consensus_latency = net.consensus_s
    sim.ranks_per_host = gpus_per_vm
    sim.compute_slots_per_host = compute_slots_per_vm
    sim.action_overhead = profile.per_action_s
    inp.sim = sim
    modes = [False]
    if split_backward or (split_backward is None and policy == "varuna" and profile.has_split_backward):
        modes = [True] if split_backward else [False, True]
    searches: dict[bool, object] = {}
    results: dict[bool, list] = {}
    stats: dict[str, int] = {}
    for split in modes:
        si = inp if split is False else _with_split(inp)
        searches[split] = si
        results[split], st = _core.search_with_stats(si)
        for k, v in dict(st).items():
            stats[k] = stats.get(k, 0) + v
    rows = []
    for c, split in _per_depth(results):
        stages = []
        if c.starts:
            ends = list(c.starts[1:]) + [n]
            stages = [list(range(a, b)) for a, b in zip(c.starts, ends)]
        eps = global_batch / c.minibatch_time if c.feasible and c.minibatch_time > 0 else 0.0
        row = PlanRow(P=c.P, D=c.D, micro_batch_size=c.micro_batch_size, m=c.m, idle_gpus=c.idle_gpus, stages=stages,
                      time_s=c.minibatch_time if c.feasible else math.nan, examples_per_s=eps,
                      bubble_fraction=c.bubble_fraction, stage_memory_bytes=list(c.stage_memory) or [0.0],
                      feasible=c.feasible, reason="" if c.feasible else _reason(c, searches[split], sizes),
                      pruned=not c.simulated, lower_bound_s=math.nan if c.simulated else c.minibatch_time,
                      split_backward=split and c.feasible)
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
    best = next((r for r in rows if r.feasible), None)
    if best is not None and best.idle_gpus > 0:
        limits = ([f"boundaries fix P={len(boundaries)}"] if boundaries is not None else []) + \
            ([f"max_depth={max_depth}"] if boundaries is None and (max_depth or n) < min(gpus, n) else [])
        notes.append(_idle_note(best, gpus, global_batch, replicas, limits))
    return Plan(gpus=gpus, global_batch=global_batch, policy=policy, recompute=rec, rows=rows, prices=prices,
                target_examples=target_examples, search_s=time.perf_counter() - t0, notes=notes,
                search_stats=stats, exhaustive=bool(exhaustive), split_backward=None if len(modes) == 2 else modes[0],
                _search=searches.get(False) or searches[True], _search_split=searches.get(True), _sizes=list(sizes))


def _with_split(inp):
    """A copy of a search input that splits the backward (the tables hold B and W)."""
    import copy

    out = copy.copy(inp)
    out.split_backward = True
    return out


def _per_depth(results: dict[bool, list]) -> list[tuple[object, bool]]:
    """One candidate per depth from the whole-backward and split searches: the faster feasible one
    (a tie keeps the whole backward), else the whole backward's excluded row; ranked as the C++
    search ranks (feasible by time, then the shallower pipeline; excluded rows after)."""
    by_p: dict[int, tuple[object, bool]] = {}
    for split in sorted(results):  # False first: ties keep the whole backward
        for c in results[split]:
            had = by_p.get(c.P)
            if had is None or (c.feasible and (not had[0].feasible or c.minibatch_time < had[0].minibatch_time)):
                by_p[c.P] = (c, split)
    feasible = sorted((x for x in by_p.values() if x[0].feasible), key=lambda x: (x[0].minibatch_time, x[0].P))
    order = {c.P: i for i, c in enumerate(next(iter(results.values())))}
    excluded = sorted((x for x in by_p.values() if not x[0].feasible), key=lambda x: order.get(x[0].P, 0))
    return feasible + excluded


def plan_for_job(job: JobConfig, profile: Profile, gpus: int | None = None, *, gpus_per_vm: int | None = None,
                 compute_slots_per_vm: int | None = None, keep_fixed: bool = True,
                 micro_batch_sizes: Sequence[int] | None = None,
                 exhaustive: bool = True, prices: Prices | None = None) -> tuple[JobConfig, Plan]:
    """Plan ``job`` for ``gpus`` workers (default ``job.launch.gpus``) and return a copy of it
    with ``parallel`` filled in from the best row (P, D, micro-batch size, stage boundaries),
    and the ``Plan``. The global batch, policy and recompute setting are the job's.

    Placement defaults model local workers: all ``gpus`` on one VM whose compute is shared by
    ``os.cpu_count()`` cores (fewer workers than ``gpus`` may then be fastest: the plan's rows
    weigh every replica count, and the best row's ``idle_gpus`` says how many stay unused); pass
    ``gpus_per_vm``/``compute_slots_per_vm`` for real VMs.
    ``keep_fixed``: a P, D or stage ``boundaries`` the config fixes are kept (only the rest is
    chosen; boundaries fix P and are checked as ``plan(boundaries=...)`` checks them); the manager
    passes False when the GPUs changed under a morph (P, D and boundaries are then all chosen
    afresh). ``exhaustive=False``: a best-only search (``plan``), for what-ifs that need only the
    best row; a fixed P is still searched exhaustively (its row must be exact). ``prices``: the
    pool's $ per GPU-hour for the rows' costs (default ``Prices()``'s example figures). Raises
    ``ConfigError`` for boundaries that do not list the profile's segments once each in order, a
    P that contradicts them, a P x D over the workers, or when no feasible plan has the fixed P/D
    (listing the feasible ones) or none fits at all.
    """
    import copy
    import os

    p = job.parallel
    G = _int_arg("gpus" if gpus is not None else "launch.gpus", gpus if gpus is not None else job.launch.gpus, 1,
                 "pass the number of workers to plan for")
    fixed_P = p.P if keep_fixed else None
    fixed_D = p.D if keep_fixed else None
    bnd = p.boundaries if keep_fixed else None
    per_vm = gpus_per_vm or G
    slots = compute_slots_per_vm if compute_slots_per_vm is not None else (os.cpu_count() or 1)

    if fixed_D is not None and (fixed_D > G or p.global_batch % fixed_D):
        raise ConfigError(f"parallel.D={fixed_D} does not fit {G} workers and global batch {p.global_batch} (D must "
                          f"divide the global batch and be <= {G}); set D to null or change it")
    if bnd is not None:
        try:
            _check_boundaries(bnd, profile.num_segments, G)
        except ConfigError as e:
            raise ConfigError(f"parallel.{e}") from None
        if fixed_P is not None and fixed_P != len(bnd):
            raise ConfigError(f"parallel.P={fixed_P} but parallel.boundaries has {len(bnd)} stages; set P to "
                              f"{len(bnd)} (or null), or boundaries to null to let the planner split the model")
        if fixed_D is not None and len(bnd) * fixed_D > G:
            raise ConfigError(f"parallel.boundaries give P={len(bnd)} stages and parallel.D={fixed_D}: P x D = "
                              f"{len(bnd) * fixed_D} workers but only {G}; set D to at most "
                              f"{_largest_divisor(p.global_batch, G // len(bnd))} (or null), or change boundaries")
        fixed_P = len(bnd)
    # boundaries fix P and the split; a fixed P caps the depths tried; a fixed D is the only replica count tried
    pl = plan(profile, G, p.global_batch, policy=p.policy, recompute=p.recompute, gpus_per_vm=min(per_vm, G),
              compute_slots_per_vm=slots, max_depth=None if bnd is not None else fixed_P, replicas=fixed_D,
              boundaries=bnd, exhaustive=exhaustive or fixed_P is not None, micro_batch_sizes=micro_batch_sizes,
              prices=prices)
    fits = [r for r in pl.feasible if (fixed_P is None or r.P == fixed_P) and (fixed_D is None or r.D == fixed_D)]
    if not fits:
        offered = ", ".join(f"P={r.P} D={r.D}" for r in pl.feasible) or "none"
        fixed = " and ".join(f"{k}={v}" for k, v in (("P", fixed_P), ("D", fixed_D)) if v is not None)
        if bnd is not None:
            fixed += " (from parallel.boundaries)" if p.P is None else " and these boundaries"
        if not fixed:
            raise ConfigError(f"no configuration fits {G} workers and global batch {p.global_batch}: "
                              + "; ".join(f"P={r.P}: {r.reason}" for r in pl.rows[:6]))
        raise ConfigError(f"no plan for {G} workers and global batch {p.global_batch} has parallel.{fixed}"
                          f"{': ' + pl.rows[0].reason if bnd is not None and pl.rows else ''}; "
                          f"feasible plans: {offered}. Set P, D and boundaries to null, or change them")
    best = fits[0]
    job = copy.deepcopy(job)
    job.parallel.P, job.parallel.D = best.P, best.D
    job.parallel.micro_batch_size = best.micro_batch_size
    job.parallel.boundaries = best.stages
    job.launch.gpus = G
    return job.validate(), pl


__all__ = ["plan_for_job", "Plan", "PlanRow", "Prices", "plan", "candidate_micro_batch_sizes", "ProfileError"]
