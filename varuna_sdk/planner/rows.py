"""The result of a configuration search: ``Plan``, its ``PlanRow``s and the ``Prices`` they cost at.

Owns the result types ``plan()`` returns and their presentation: the ranked text table
(``Plan.table()``), its HTML, strict JSON (``Plan.to_dict()``), a row's ``ParallelConfig`` and the
event-by-event re-simulation of a row for the dashboard's Gantt chart (``Plan.simulate``); and
the number formats the planner's messages share (``format_duration``, ``format_bytes``).

Units: seconds, bytes, examples/s, US dollars. Imports ``config``, the C++ core and
``planner.simulate``; must never import ``planner.plan``/``planner.search`` (they build these
types), torch, ``cluster`` or ``manager``.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Sequence

from .._native import core as _core
from ..config import ConfigError, ParallelConfig
from .simulate import SimOutput

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


@dataclass(frozen=True)
class TableHints:
    """How ``Plan.table``'s notes say to see more: ``show_all`` with ``{n}`` for the number of
    feasible rows, ``refine`` for refining a depth left as searched."""

    show_all: str
    refine: str


#: a notebook's or script's calls on the ``Plan`` object
PYTHON_HINTS = TableHints(show_all="table(top={n})", refine="plan.refine(P)")
#: ``varuna plan``'s flags
CLI_HINTS = TableHints(show_all="--top {n}", refine="--refine P")


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
    mini-batch) is the smallest lower bound of its candidates, at least the best row's time; a
    row left unrefined (``refined`` below) has one too, NaN on every other row. ``split_backward``: the row runs the zero-bubble split (B and W apart;
    ``pipeline.split_backward``) because the simulator found it faster there.

    Memory per stage (``planner.recompute``; empty lists on an excluded row): ``stage_recompute``
    says which stages recompute (size P, the last False), ``max_in_flight`` the most micro-batches
    each stage may hold in flight (0 = no cap; the runtime's scheduler enforces it, so a stage never
    exceeds its ``stage_memory_bytes`` however late messages arrive) and ``recompute_why`` one
    sentence per stage saying why."""

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
    stage_recompute: list[bool] = field(default_factory=list)
    max_in_flight: list[int] = field(default_factory=list)
    recompute_why: list[str] = field(default_factory=list)
    data_wait_s: float = 0.0
    """Seconds of ``time_s`` spent waiting for data: the read of the replica's examples beyond
    the compute it overlaps (``data.prefetch``), or all of it without prefetch."""
    refined: bool = True
    """False for a Varuna row left as the search simulated it (one recompute setting on every stage
    but the last, no in-flight caps, the search's split) because its ``lower_bound_s`` — what no
    refinement of its depth can beat — is no faster than the best row: ``Plan.refine(P)`` refines
    it (recompute per stage, caps; ``plan_for_job`` does so for a depth the job fixes)."""

    @property
    def recompute_label(self) -> str:
        """Which stages recompute: ``none``, ``all`` (every stage but the last), ``stage 0`` or
        ``stages 0,2`` (stage indices from 0, named as such: a bare ``0`` read as "none")."""
        which = [s for s, r in enumerate(self.stage_recompute) if r]
        if not which:
            return "none"
        if len(which) == self.P - 1:
            return "all"
        return f"stage{'s' if len(which) > 1 else ''} {','.join(map(str, which))}"

    def __repr__(self) -> str:
        """Fields as in the dataclass, floats to 4 significant digits (not 15)."""
        def show(v):
            if isinstance(v, float):
                return f"{v:.4g}"
            if isinstance(v, list):
                return "[" + ", ".join(show(x) for x in v) + "]"
            return repr(v)
        return "PlanRow(" + ", ".join(f"{f.name}={show(getattr(self, f.name))}" for f in fields(self)) + ")"

    def parallel_config(self, global_batch: int, policy: str = "varuna") -> ParallelConfig:
        """This row as a ``ParallelConfig``: explicit stage boundaries (so the run uses this split),
        the row's choice of the split backward, its recompute per stage and in-flight caps (Varuna's
        only: GPipe and 1F1B run their backward whole, uncapped)."""
        varuna = policy == "varuna"
        return ParallelConfig(P=self.P, D=self.D, global_batch=global_batch, micro_batch_size=self.micro_batch_size,
                              policy=policy, recompute=list(self.stage_recompute) or None, boundaries=self.stages,
                              split_backward=self.split_backward if varuna else None,
                              max_in_flight=list(self.max_in_flight) if varuna and any(self.max_in_flight) else None)


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
    recompute: bool | None
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
    _searches: dict = field(default_factory=dict, repr=False, compare=False)
    _sizes: list[int] = field(default_factory=list, repr=False, compare=False)
    _refiner: object = field(default=None, repr=False, compare=False)
    _profiled_max_mbs: int = field(default=0, repr=False, compare=False)   # larger sizes are extrapolated (0: unknown)

    @property
    def feasible(self) -> list[PlanRow]:
        """The rows that fit, fastest first."""
        return [r for r in self.rows if r.feasible]

    @property
    def excluded(self) -> list[PlanRow]:
        """The rows that do not fit (or were pruned), each with its ``reason``."""
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

    def refine(self, P: int) -> PlanRow:
        """The row of depth ``P`` refined per stage — recompute only where memory needs it, in-flight
        caps (``planner.recompute``) — when the search left it as searched (``PlanRow.refined``
        False: it could not be the best row); it replaces that row and the rows are re-ranked.
        A refined row is returned as it is. Raises ``ValueError`` when no row has depth ``P``."""
        if isinstance(P, bool) or not isinstance(P, numbers.Integral):
            raise ValueError(f"P={P!r} must be an integer pipeline depth, one of this plan's rows' (e.g. "
                             f"plan.refine({self.rows[0].P if self.rows else 1}))")
        P = int(P)
        i = next((k for k, r in enumerate(self.rows) if r.P == P), None)
        if i is None:
            raise ValueError(f"this plan has no row of depth P={P}; its depths are "
                             f"{_ranges(sorted(r.P for r in self.rows))}")
        row = self.rows[i]
        if row.pruned:
            raise ValueError(f"P={P} was pruned by the best-only search (never simulated, nothing to refine); "
                             f"plan(..., exhaustive=True) gives every depth's row")
        if row.refined:
            return row
        if self._refiner is None:
            raise ValueError(f"this Plan has no search kept (unpickled, or not made by plan()), so its row P={P} "
                             "cannot be refined; call plan() again")
        row = self._refiner.refine(P)
        self.rows = rank_rows(self.rows[:i] + [row] + self.rows[i + 1:])
        return row

    def parallel_config(self) -> ParallelConfig:
        """The best row as a ``ParallelConfig`` with this plan's batch and policy, and the row's
        recompute per stage and in-flight caps; raises ``ValueError`` as ``best`` does when no row fits."""
        return self.best.parallel_config(self.global_batch, self.policy)

    def _rows_and_notes(self, top: int, hints: TableHints | None = None) -> tuple[list[str], list[list[str]], list[str]]:
        """The table's header, the ``top`` fastest feasible rows as formatted cells, and the lines
        after it (rows left out, excluded and pruned depths, example prices, notes), whose hints
        name ``hints``' ways of showing more (default: this object's Python calls)."""
        hints = hints or PYTHON_HINTS
        if isinstance(top, bool) or not isinstance(top, numbers.Integral) or top < 1:
            raise ValueError(f"top={top!r} must be an integer >= 1 (how many feasible rows to show); "
                             "top=len(plan.feasible) shows them all")
        top = int(top)
        head = ["rank", "P", "D", "mbs", "m", "idle", "bwd", "recompute", "time/step", "ex/s", "bubble", "max mem/GPU",
                "$/1k ex spot", "$/1k ex od"] + (["to target", "$ to target"] if self.target_examples else [])
        rows = []
        for i, r in enumerate(self.feasible[:top]):
            cells = [str(i + 1), str(r.P), str(r.D), str(r.micro_batch_size), str(r.m), str(r.idle_gpus),
                     "B|W" if r.split_backward else "whole", r.recompute_label + ("" if r.refined else "*"),
                     format_duration(r.time_s), f"{r.examples_per_s:.2f}", f"{r.bubble_fraction:.1%}",
                     format_bytes(max(r.stage_memory_bytes)), f"{r.cost_per_1k_spot:.4f}",
                     f"{r.cost_per_1k_on_demand:.4f}"]
            if self.target_examples:
                cells += [format_duration(r.time_to_target_s), f"{r.cost_to_target_spot:.2f}"]
            rows.append(cells)
        notes = []
        if len(self.feasible) > top:
            more = len(self.feasible) - top
            notes.append(f"... {more} more feasible configuration{'s' if more > 1 else ''} "
                         f"({hints.show_all.format(n=len(self.feasible))} shows all)")
        raw = [r.P for r in self.feasible[:top] if not r.refined]
        if raw:
            notes.append(f"* P={_ranges(sorted(raw))}: as searched (one recompute setting, no in-flight caps), not "
                         "refined per stage: no refinement of these depths can beat the best row (their lower "
                         f"bounds); {hints.refine} refines one")
        best = self.feasible[0] if self.feasible else None
        if best is not None and self.policy == "varuna" and best.recompute_why:
            notes += [f"rank 1, stage {s}: {w}" for s, w in enumerate(best.recompute_why)]
        for r in self.excluded:
            if not r.pruned:
                notes.append(f"excluded P={r.P}: {r.reason}")
        pruned = [r for r in self.excluded if r.pruned]
        if pruned:  # one line: a best-only search prunes most depths
            lo = min(pruned, key=lambda r: r.lower_bound_s)
            many = "s" if len(pruned) > 1 else ""
            notes.append(f"pruned P={_ranges([r.P for r in pruned])} ({len(pruned)} depth{many}): by their lower "
                         f"bounds (>= {format_duration(lo.lower_bound_s)} per mini-batch, at P={lo.P}) none beats "
                         "the best row; "
                         f"not simulated, memory not checked {EXHAUSTIVE_HINT}")
        if self.prices.example:
            notes.append(f"prices are an EXAMPLE ({self.prices.vm_type}: ${self.prices.spot_per_gpu_hour}/GPU-h spot, "
                         f"${self.prices.on_demand_per_gpu_hour}/GPU-h on-demand); pass prices=Prices(...) "
                         "(varuna plan: --spot-price, --on-demand-price) for yours")
        shown = self.feasible[:top]
        limit = self._profiled_max_mbs
        notes += [f"note: {n}" for n in self.notes   # the extrapolation note only where a row shown is extrapolated
                  if not (limit and n == extrapolation_note(limit) and all(r.micro_batch_size <= limit for r in shown))]
        return head, rows, notes

    def _title(self) -> str:
        split = {None: _split_title([r.split_backward for r in self.feasible]), True: " + split backward (B|W)",
                 False: ""}[self.split_backward]
        return (f"plan for G={self.gpus} GPUs, global batch {self.global_batch}, policy {self.policy}"
                f"{_RECOMPUTE_TITLE[self.recompute]}{split} (searched in {self.search_s * 1e3:.1f} ms"
                f"{'' if self.exhaustive else _BEST_ONLY_NOTE})")

    def table(self, top: int = 12, hints: TableHints | None = None) -> str:
        """A fixed-width table: the ``top`` (>= 1) fastest feasible rows, a line counting the
        feasible rows left out, then every excluded P with its reason. ``hints``: how the notes
        say to show more rows or refine one (default ``PYTHON_HINTS``, ``table(top=n)``,
        ``plan.refine(P)``; ``varuna plan`` passes its flags). Raises ``ValueError`` for ``top`` < 1."""
        head, rows, notes = self._rows_and_notes(top, hints)
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

    def __getstate__(self) -> dict:
        """Pickling keeps the public fields (rows, prices, notes...) and drops the search kept for
        ``simulate`` and ``refine`` (C++ objects, not picklable): an unpickled plan says so if asked."""
        state = dict(self.__dict__)
        for f in fields(self):
            if f.name.startswith("_"):
                state[f.name] = f.default_factory() if f.default_factory is not MISSING else f.default
        return state

    def __copy__(self) -> Plan:
        """A shallow copy that still simulates and refines (the search is shared, never changed)."""
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        return out

    def __deepcopy__(self, memo: dict) -> Plan:
        """Public fields copied deeply; the search kept for ``simulate``/``refine`` shared (it is
        only ever copied before a change), so the copy still simulates and refines — its own rows."""
        out = object.__new__(type(self))
        memo[id(self)] = out
        for k, v in self.__dict__.items():
            out.__dict__[k] = v if k.startswith("_") else copy.deepcopy(v, memo)
        return out

    def to_dict(self) -> dict:
        """Plain data, JSON-able in strict JSON (``json.dumps(..., allow_nan=False)``): every public
        field, rows and prices as dicts; a number that does not apply (NaN or infinite in the
        ``PlanRow``) is ``None``."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")}

    def simulate(self, row: PlanRow | None = None, *, rank_scale: Sequence[float] | None = None,
                 record_timeline: bool = True) -> SimOutput:
        """Simulate ``row`` (default: the best) event by event for its full m with the costs the
        search used: the per-stage Gantt timeline (``SimOutput.timeline``, seconds from the
        mini-batch's start, per rank = replica*P + stage) for the dashboard, and what-ifs:
        ``rank_scale`` (length P*D) slows ranks' compute down (a straggler at 1.5x: 1.5).

        Raises ``ValueError`` for a row that is not one of this plan's ``rows`` (from another
        ``Plan``, or edited: it would be simulated with this plan's inputs), an infeasible row or a
        ``rank_scale`` of the wrong length.
        """
        row = self.best if row is None else row
        if row not in self.rows:  # identity, else equality
            raise ValueError(f"row P={getattr(row, 'P', '?')} D={getattr(row, 'D', '?')} is not one of this plan's "
                             "rows (it comes from another Plan or was edited, and would be simulated with this plan's "
                             "profile, G and batch); pass a row of this plan's .rows, or call .simulate() on the Plan "
                             "that made it")
        if not row.feasible or not row.stages:
            raise ValueError(f"P={row.P} D={row.D} is not feasible ({row.reason}); simulate a feasible row")
        if self._search is None or row.micro_batch_size not in self._sizes:
            raise ValueError("this Plan has no search input kept (unpickled, or not made by plan()); call plan() again")
        scale = [float(x) for x in rank_scale] if rank_scale is not None else []
        if scale and len(scale) != row.P * row.D:
            raise ValueError(f"rank_scale has {len(scale)} entries; P*D = {row.P * row.D} needed")
        search = copy.copy(self._search_split if row.split_backward else self._search)
        if row.stage_recompute:
            search.stage_recompute = list(row.stage_recompute)
            search.max_in_flight = list(row.max_in_flight)
        r = _core.simulate_candidate(search, row.P, row.D, self._sizes.index(row.micro_batch_size),
                                     [st[0] for st in row.stages], scale, bool(record_timeline))
        return SimOutput.from_core(r, bool(record_timeline))


def rank_rows(rows: list[PlanRow]) -> list[PlanRow]:
    """Feasible rows by time (then the shallower pipeline), then the excluded in their order."""
    feasible = sorted((r for r in rows if r.feasible), key=lambda r: (r.time_s, r.P))
    return feasible + [r for r in rows if not r.feasible]


def _split_title(splits: list[bool]) -> str:
    """The title's words for a plan that chose the backward split per row (``split_backward`` None)."""
    if any(splits):
        return " (backward split B|W on the rows where the simulator found it faster)"
    return " (backward split B|W tried per row; the whole backward is as fast or faster on every row)"


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


#: The title's words for ``Plan.recompute``.
_RECOMPUTE_TITLE = {True: " + recompute", False: "", None: " (recompute per stage: only where memory needs it)"}

#: How to get what a best-only search leaves out (simulated rows and memory checks for every depth).
EXHAUSTIVE_HINT = "(an exhaustive search does both: varuna plan without --best-only, plan(..., exhaustive=True))"
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


def extrapolation_note(profiled_max: int) -> str:
    """The plan's note that micro-batch sizes above ``profiled_max`` (the largest the profile
    measured) are extrapolated from the profile."""
    return f"micro-batch sizes above {profiled_max} are extrapolated from the profile"


def format_duration(s: float) -> str:
    """Seconds as ``12.3 ms``, ``4.56 s``, ``7.8 min`` or ``1.2 h``; ``-`` when not finite."""
    if not math.isfinite(s):
        return "-"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def format_bytes(b: float, digits: int = 1) -> str:
    """Bytes in B, KiB, MiB, GiB or TiB (binary units) with ``digits`` decimals: ``60.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.{digits}f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.{digits}f} TiB"
