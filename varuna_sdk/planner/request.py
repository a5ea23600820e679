"""A ``plan()`` call's arguments as one validated request: ``PlanRequest``.

Owns ``PlanRequest`` (a dataclass built from ``plan()``'s arguments and checked in
``__post_init__`` before any search runs: each bad argument a ``ConfigError`` naming it and what
to pass instead, a profile that lacks what the request needs a ``ProfileError``), the argument
checks the planner's other entry points share (``int_arg``, ``positive_or_none``,
``check_boundaries``, ``largest_divisor``) and ``candidate_micro_batch_sizes``.

Units: seconds, bytes, bytes/s, examples. Imports ``config``, ``profiling.profile``, the C++ core
and ``planner.rows``; must never import ``planner.search``/``planner.plan``, torch, ``cluster``
or ``manager``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .._native import core as _core
from ..config import POLICIES, ConfigError
from ..config.fields import plain
from ..profiling.profile import Profile, ProfileError
from .rows import Prices

#: ``(C++ SegmentTable field, profile SegmentProfile attribute)`` pairs the search reads per size.
TABLE_KEYS = (("fwd", "fwd_s"), ("rec", "rec_s"), ("bwd", "bwd_s"), ("out_bytes", "out_bytes"),
              ("act_bytes", "act_bytes"))
SPLIT_KEYS = (("bwd_in", "bwd_in_s"), ("wgt", "wgt_s"))  # only in a profile with the split backward


def _checked(profile: Profile) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The profile's sizes and per-key ``[segments, sizes]`` arrays; ``ProfileError`` naming the
    segment, key and size for a value that is not a finite number >= 0, or for sizes that are not
    increasing positive integers (a NaN or negative time would otherwise surface as a simulator
    error about a *stage*, or as a silently wrong plan)."""
    xs = list(profile.micro_batch_sizes)
    if not xs or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in xs) or xs != sorted(set(xs)):
        raise ProfileError(f"profile micro_batch_sizes={xs} must be increasing positive integers; re-run calibrate()")
    out = {}
    for _, attr in TABLE_KEYS + (SPLIT_KEYS if profile.has_split_backward else ()):
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
    dr = profile.data_read_s
    if isinstance(dr, bool) or not isinstance(dr, (int, float)) or not math.isfinite(dr) or dr < 0:
        raise ProfileError(f"profile data_read_s (seconds to read one example) is {dr!r}; it must be a number "
                           ">= 0; re-run calibrate_job()")
    for k, seg in enumerate(profile.segments):
        pb = seg.param_bytes
        if isinstance(pb, bool) or not isinstance(pb, (int, float)) or not math.isfinite(pb) or pb < 0:
            raise ProfileError(f"segment {k} param_bytes is {pb!r}; it must be a number >= 0; re-run calibrate()")
    return np.array(xs, dtype=float), out


_INT_MAX = 2**31 - 1  # the C++ search counts examples, GPUs and micro-batches in 32-bit ints


def int_arg(name: str, v, low: int, hint: str) -> int:
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


def positive_or_none(name: str, v, hint: str) -> float | None:
    """``None``, or ``v`` as a finite float > 0; ``ConfigError`` naming ``name`` and ``hint`` otherwise."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{name}={v!r} must be a finite number > 0, or None; {hint}")
    return float(v)


def largest_divisor(B: int, k: int) -> int:
    """The largest divisor of ``B`` that is <= ``k`` (>= 1): the most replicas a batch of B allows."""
    best, i = 1, 1
    while i * i <= B:
        if B % i == 0:
            best = max([best] + [d for d in (i, B // i) if d <= k])
        i += 1
    return best


def check_boundaries(boundaries: list[list[int]], n: int, gpus: int) -> None:
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


#: the largest micro-batch size tried, as a multiple of the largest calibrated one (extrapolated)
FAR_SIZES = 8


def candidate_micro_batch_sizes(profile: Profile, global_batch: int | None = None) -> list[int]:
    """Every micro-batch size from the smallest profiled one (1, or 2 for a model that cannot train
    on one example) to twice the largest (sizes between and above the profiled ones are
    interpolated / extrapolated); with ``global_batch``, only the sizes that divide it (no other
    can keep global batch = micro-batch × m × D exact), and its divisors up to ``FAR_SIZES`` times
    the largest profiled size too (a job of global batch 256 calibrated at 1, 2, 4 ran faster at
    micro-batch 16 or 32 than at the 8 the search stopped at: helper-68)."""
    top = max(profile.micro_batch_sizes) * 2
    low = min(profile.micro_batch_sizes)
    if global_batch is None:
        return list(range(low, top + 1))
    far = max(profile.micro_batch_sizes) * FAR_SIZES
    return [b for b in range(low, min(far, global_batch) + 1) if global_batch % b == 0]



@dataclass
class PlanRequest:
    """The arguments of one ``plan()`` call (see ``plan`` for each), checked in ``__post_init__``
    in a fixed order before any search runs, and what the search derives from them:

    * ``limit``: the per-GPU memory limit in bytes (``memory_limit_bytes``, else the profile's
      ``hardware.memory_bytes``, else None: no limit);
    * ``sizes``: the micro-batch sizes to try (the user's, sorted and deduplicated, else
      ``candidate_micro_batch_sizes``);
    * ``rec_modes``: the recompute settings searched (both for Varuna's None: per stage, from memory);
    * ``checked``: the profile's sizes and per-key ``[segments, sizes]`` arrays, checked finite.

    After construction ``gpus``, ``global_batch``, ``gpus_per_vm`` and ``compute_slots_per_vm``
    are ints, ``replicas``/``max_depth`` ints or None, ``memory_limit_bytes`` and
    ``network_bandwidth_Bps`` floats or None, ``micro_batch_sizes`` a list of ints or None and
    ``prices`` a ``Prices``. Raises ``ConfigError`` for a bad argument (the message names it and
    says what to pass instead) and ``ProfileError`` naming what the profile lacks."""

    profile: Profile
    gpus: int
    global_batch: int
    policy: str = "varuna"
    recompute: bool | None = None
    memory_limit_bytes: float | None = None
    gpus_per_vm: int = 1
    compute_slots_per_vm: int = 0
    micro_batch_sizes: Sequence[int] | None = None
    boundaries: list[list[int]] | None = None
    network_bandwidth_Bps: float | None = None
    prices: Prices | None = None
    target_examples: int | None = None
    max_depth: int | None = None
    replicas: int | None = None
    exhaustive: bool = True
    split_backward: bool | None = None
    shared_egress: bool = False
    max_in_flight: int | None = None
    data_prefetch: bool = True
    refine_cuts: bool = True
    limit: float | None = field(init=False, default=None)
    sizes: list[int] = field(init=False, default_factory=list)
    checked: tuple = field(init=False, default=(), repr=False)

    def __post_init__(self) -> None:
        self.boundaries = plain(self.boundaries)   # NumPy ints in a notebook's boundaries
        self._check_counts()
        self._check_micro_batch_sizes()
        self._check_options()
        self._check_against_profile()
        self.prices = self.prices or Prices()
        self.sizes = (sorted(set(self.micro_batch_sizes)) if self.micro_batch_sizes
                      else candidate_micro_batch_sizes(self.profile, self.global_batch))
        if self.limit and self.policy == "varuna" and self.recompute is not True:
            # a best-only search prunes per whole-pipeline mode by a lower bound of the uncapped
            # pipeline, before recompute and in-flight caps are chosen per stage (planner.recompute)
            # and before a no-recompute candidate over the limit is rescued with caps: it could miss
            # the depth that wins once refined (a P=3 rescued at 563 ms was pruned at a "bound" of
            # 765 ms): search them all
            self.exhaustive = True

    @property
    def auto_recompute(self) -> bool:
        """True when recompute is decided per stage from the memory limit (Varuna, ``recompute=None``)."""
        return self.recompute is None and self.policy == "varuna"

    @property
    def rec_modes(self) -> list[bool]:
        """The whole-pipeline recompute settings to search: the user's, GPipe's and 1F1B's default
        (off), or for Varuna with ``recompute=None`` both (off first: a tie keeps the activations);
        ``planner.recompute`` then refines per stage."""
        if self.recompute is not None:
            return [bool(self.recompute)]
        return [False, True] if self.auto_recompute else [bool(_core.default_recompute(self.policy))]

    @property
    def split_modes(self) -> list[bool]:
        """The backward modes to search: ``[False]`` (whole), ``[True]`` (split) or both."""
        if self.split_backward or (self.split_backward is None and self.policy == "varuna"
                                   and self.profile.has_split_backward):
            return [True] if self.split_backward else [False, True]
        return [False]

    def _check_counts(self) -> None:
        """``gpus``, ``global_batch``, ``policy``, ``recompute`` and ``replicas``."""
        self.gpus = int_arg("gpus", self.gpus, 1, "pass the number of GPUs (workers) available, e.g. gpus=8")
        self.global_batch = int_arg("global_batch", self.global_batch, 1,
                                    "pass the examples per optimizer step as an int, e.g. global_batch=64")
        gpus, global_batch, replicas = self.gpus, self.global_batch, self.replicas
        if self.policy not in POLICIES:
            raise ConfigError(f"policy={self.policy!r}; choose one of {list(POLICIES)}")
        if self.recompute is not None and not isinstance(self.recompute, (bool, np.bool_)):
            raise ConfigError(f"recompute={self.recompute!r} must be True, False or None (Varuna: per stage, only where "
                              "the memory limit needs it; GPipe, 1F1B: off)")
        if self.recompute is not None:
            self.recompute = bool(self.recompute)
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, numbers.Integral)
                                     or replicas < 1 or replicas > gpus or global_batch % replicas):
            raise ConfigError(f"replicas={replicas!r} must be an integer D >= 1 that divides "
                              f"global_batch={global_batch} and is at most gpus={gpus}; pass replicas=None to let "
                              "the planner choose D")
        self.replicas = None if replicas is None else int(replicas)

    def _check_micro_batch_sizes(self) -> None:
        """``micro_batch_sizes``: None, or a non-empty iterable of ints in ``[1, 2**31 - 1]``."""
        if self.micro_batch_sizes is None:
            return
        mbs_hint = ("pass a non-empty list of ints >= 1 such as [1, 2, 4], or None to try every size from 1 to twice "
                    "the largest profiled")
        if isinstance(self.micro_batch_sizes, (str, bytes)) or not hasattr(self.micro_batch_sizes, "__iter__"):
            raise ConfigError(f"micro_batch_sizes={self.micro_batch_sizes!r} is not a list; {mbs_hint}")
        given = list(self.micro_batch_sizes)
        if not given:
            raise ConfigError(f"micro_batch_sizes={given} is empty; {mbs_hint}")
        for b in given:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or not 1 <= b <= _INT_MAX:
                raise ConfigError(f"micro_batch_sizes={given!r} holds {b!r}, which is not an integer >= 1; {mbs_hint}")
        self.micro_batch_sizes = [int(b) for b in given]

    def _check_options(self) -> None:
        """The memory limit, bandwidth, depth, placement, prices, search mode, split backward, egress and the
        user's in-flight ceiling."""
        self.memory_limit_bytes = positive_or_none(
            "memory_limit_bytes", self.memory_limit_bytes, "pass bytes per GPU such as 16 * 2**30, or None for the "
            "profile's device memory (no limit when none is recorded)")
        self.network_bandwidth_Bps = positive_or_none(
            "network_bandwidth_Bps", self.network_bandwidth_Bps, "pass bytes per second such as 1.25e9 (10 Gbit/s), "
            "or None for the calibrated bandwidth")
        if self.max_depth is not None:
            self.max_depth = int_arg("max_depth", self.max_depth, 1,
                                     "pass None to try every depth up to min(gpus, segments)")
        self.gpus_per_vm = int_arg("gpus_per_vm", self.gpus_per_vm, 1,
                                   "pass how many GPUs (ranks) share one VM, e.g. 1")
        self.compute_slots_per_vm = int_arg("compute_slots_per_vm", self.compute_slots_per_vm, 0,
                                            "pass how many compute actions a VM runs at once (e.g. its CPU cores), "
                                            "or 0 for one per GPU")
        if self.prices is not None and not isinstance(self.prices, Prices):
            raise ConfigError(f"prices={self.prices!r} must be a Prices(spot_per_gpu_hour=..., "
                              "on_demand_per_gpu_hour=...) or None for the example prices")
        if not isinstance(self.exhaustive, (bool, np.bool_)):
            raise ConfigError(f"exhaustive={self.exhaustive!r} must be True (simulate every depth's row) or False "
                              "(best only)")
        split = self.split_backward
        if split is not None and not isinstance(split, (bool, np.bool_)):
            raise ConfigError(f"split_backward={split!r} must be True, False or None (try both per row)")
        if split and self.policy != "varuna":
            raise ConfigError(f"split_backward=True applies to the varuna policy only (policy={self.policy!r} runs "
                              "its backward whole); pass split_backward=None or False, or policy='varuna'")
        if split and not self.profile.has_split_backward:
            raise ProfileError("split_backward=True needs the split backward's B and W times per segment (bwd_in_s, "
                               "wgt_s), which this profile lacks; re-run calibrate(), or pass split_backward=None")
        if not isinstance(self.shared_egress, (bool, np.bool_)):
            raise ConfigError(f"shared_egress={self.shared_egress!r} must be True (a rank's sends share one link) or "
                              "False (a link per pair of ranks)")
        self.shared_egress = bool(self.shared_egress)
        if not isinstance(self.data_prefetch, (bool, np.bool_)):
            raise ConfigError(f"data_prefetch={self.data_prefetch!r} must be True (the next mini-batch is read while "
                              "one trains: data.prefetch) or False (read, then train)")
        self.data_prefetch = bool(self.data_prefetch)
        if not isinstance(self.refine_cuts, (bool, np.bool_)):
            raise ConfigError(f"refine_cuts={self.refine_cuts!r} must be True (the fastest depths' splits moved while "
                              "simulated faster) or False (the search's balanced split)")
        self.refine_cuts = bool(self.refine_cuts)
        if self.max_in_flight is not None:
            self.max_in_flight = int_arg("max_in_flight", self.max_in_flight, 1,
                                         "pass the most micro-batches any stage may hold in flight, e.g. 2, or None "
                                         "for the planner's own caps")
            if self.policy != "varuna":
                raise ConfigError(f"max_in_flight={self.max_in_flight} applies to the varuna policy only "
                                  f"(policy={self.policy!r} holds what it publishes); pass max_in_flight=None")
        if self.target_examples is not None:
            positive_or_none("target_examples", self.target_examples,
                             "pass the examples to train on, e.g. 10**7, or None for no time/cost-to-target columns")

    def _check_against_profile(self) -> None:
        """What the profile must hold, explicit ``boundaries`` against it, and the memory limit."""
        profile, gpus = self.profile, self.gpus
        profile.require(network=gpus > 1)
        self.checked = _checked(profile)
        if self.boundaries is not None:
            check_boundaries(self.boundaries, profile.num_segments, gpus)
            P = len(self.boundaries)
            if self.max_depth is not None and self.max_depth < P:
                raise ConfigError(f"max_depth={self.max_depth} but boundaries give P={P} stages; pass max_depth=None "
                                  f"(boundaries fix P) or give at most {self.max_depth} stages")
            if self.replicas is not None and P * self.replicas > gpus:
                raise ConfigError(f"boundaries give P={P} stages and replicas={self.replicas}: P x replicas = "
                                  f"{P * self.replicas} GPUs but gpus={gpus}; the largest valid replicas is "
                                  f"{largest_divisor(self.global_batch, gpus // P)} (at most gpus // P = {gpus // P} "
                                  f"and dividing global_batch={self.global_batch}), or pass replicas=None")
        if self.memory_limit_bytes is not None:
            self.limit = self.memory_limit_bytes
            return
        limit = profile.hardware.get("memory_bytes")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Real)
                                  or not math.isfinite(limit) or limit <= 0):
            raise ProfileError(f"profile hardware.memory_bytes={limit!r} is not a number of bytes > 0; re-run "
                               "calibrate(), or pass memory_limit_bytes")
        self.limit = limit
