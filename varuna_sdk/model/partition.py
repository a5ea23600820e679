"""Partitioning: which contiguous run of segments each pipeline stage holds, and which
parameters more than one stage needs.

Owns ``StageMap`` (the stage → segment ranges of one plan), the cost-balanced contiguous split
(minimise the slowest stage; any P up to the number of segments, not only divisors — the
original only split uniformly, varuna-original.md §2.3), and the check that a split is
executable: tensors that skip a cut-point must not cross a stage boundary, and parameters used
on several stages are either tied automatically or must be declared.

Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .tracer import ModelStructure, describe_segment


class PartitionError(ValueError):
    """A model cannot be split as asked; the message says what to change."""


@dataclass(frozen=True)
class StageMap:
    """Stage ``s`` holds segments ``ranges[s][0] <= k < ranges[s][1]``; P = ``len(ranges)``."""

    ranges: tuple[tuple[int, int], ...]

    @property
    def P(self) -> int:
        """Number of stages."""
        return len(self.ranges)

    @property
    def num_segments(self) -> int:
        """Number of cut-point segments the map covers."""
        return self.ranges[-1][1]

    def segments(self, stage: int) -> range:
        """Segment indices of ``stage``."""
        a, b = self.ranges[stage]
        return range(a, b)

    def stage_of_segment(self, k: int) -> int:
        """The stage holding segment ``k``; raises ``IndexError`` outside the map."""
        for s, (a, b) in enumerate(self.ranges):
            if a <= k < b:
                return s
        raise IndexError(f"segment {k} is outside 0..{self.num_segments - 1}")

    def to_lists(self) -> list[list[int]]:
        """Segment indices per stage, e.g. ``[[0, 1, 2], [3, 4]]`` (the YAML form)."""
        return [list(range(a, b)) for a, b in self.ranges]

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]], num_segments: int) -> "StageMap":
        """Build from explicit per-stage segment lists; they must be contiguous, in order, non-empty
        and cover ``0..num_segments-1`` exactly. Raises ``PartitionError`` saying which rule broke."""
        if not lists:
            raise PartitionError("stage boundaries are empty: give one list of segment indices per stage")
        ranges = []
        expect = 0
        for s, segs in enumerate(lists):
            segs = list(segs)
            if not segs:
                raise PartitionError(f"stage {s} has no segments; every stage needs at least one")
            if segs != list(range(segs[0], segs[0] + len(segs))) or segs[0] != expect:
                raise PartitionError(
                    f"stage {s} holds segments {segs}; stages must hold contiguous segments in order, "
                    f"so stage {s} must start at segment {expect}"
                )
            ranges.append((segs[0], segs[-1] + 1))
            expect = segs[-1] + 1
        if expect != num_segments:
            raise PartitionError(
                f"the stages cover segments 0..{expect - 1} but the model has {num_segments} "
                f"(0..{num_segments - 1}); the last stage must end at segment {num_segments - 1}"
            )
        return cls(tuple(ranges))

    @classmethod
    def uniform(cls, num_segments: int, P: int) -> "StageMap":
        """Split as evenly as possible by segment count (the first stages get the extra ones)."""
        check_depth(num_segments, P)
        base, extra = divmod(num_segments, P)
        ranges, a = [], 0
        for s in range(P):
            b = a + base + (1 if s < extra else 0)
            ranges.append((a, b))
            a = b
        return cls(tuple(ranges))


def check_depth(num_segments: int, P: int) -> None:
    """Raise ``PartitionError`` unless ``1 <= P <= num_segments``."""
    if P < 1:
        raise PartitionError(f"pipeline depth P={P} must be at least 1")
    if P > num_segments:
        hint = (" (it has no cut-points: set model.blocks to the dotted name of its list of layers, or to its "
                "blocks' names in call order, e.g. ['b1', 'b2', 'b3'], or put CutPoint() modules in its forward: "
                "from varuna_sdk import CutPoint; self.cut1 = CutPoint() in __init__, x = self.cut1(x) in forward, one per cut)") if num_segments == 1 else ""
        raise PartitionError(
            f"pipeline depth P={P} is larger than the model's {num_segments} segments (the pieces its "
            f"{num_segments - 1} cut-points split it into: typically what comes before the first block, each "
            f"block, and what comes after the last); choose P <= {num_segments} or add cut-points{hint}"
        )


def unsplittable_cuts(structure: ModelStructure) -> set[int]:
    """Cut-points where no stage may start: those a tensor skips on its way from the segment that
    makes it to one that uses it (``cross_uses``), and for a tensor used by its object from before
    the cut-points it crossed (``carried_uses``), the ones in between that it did not cross (after
    the last block, ``x + layer(x)`` needs an ``x`` that the output cut-point does not carry).
    Cut-point ``k`` lies between segments ``k`` and ``k + 1``."""
    out: set[int] = set()
    for prod, cons, _ in structure.cross_uses:
        out.update(range(prod, cons))
    for prod, cons, _, cuts in structure.carried_uses:
        out.update(k for k in range(prod, cons) if k not in cuts)
    return out


def imbalance_note(structure: ModelStructure, costs: Sequence[float], P: int, factor: float = 1.5) -> str | None:
    """Why ``balanced_stage_map`` splits the model into ``P`` stages much worse than its costs allow:
    when its largest stage costs ``factor`` or more times the largest of a split free to use every
    cut-point, a sentence naming the shares and the tensors that keep stages from starting there
    (``cross_uses``: made in one segment, used several later, crossing no cut-point), with what to
    change; else ``None``. Units: shares of the summed ``costs``."""
    blocked = unsplittable_cuts(structure)
    if P < 2 or not blocked or len(costs) < P:
        return None
    total = float(sum(costs)) or 1.0

    def largest(smap: StageMap) -> float:
        return max(sum(costs[a:b]) for a, b in smap.ranges) / total

    got, free = largest(balanced_stage_map(costs, P, blocked)), largest(balanced_stage_map(costs, P))
    if got < factor * free:
        return None
    why = sorted({(prod, cons, op) for prod, cons, op in structure.cross_uses}, key=lambda u: u[0] - u[1])[:2]
    def tensor(op: str) -> str:
        what = op.split(" on ", 1)[-1] if " on " in op else op
        return what + (" in" if " made by " in what else " made in")

    named = "; ".join(f"{tensor(op)} {describe_segment(structure, a)} is used in {describe_segment(structure, b)}"
                      for a, b, op in why)
    return (f"the {P} stages are unbalanced: the largest holds {got:.0%} of the model's compute, where a split "
            f"free to cut anywhere would hold {free:.0%}, because no stage may start between segments that a "
            f"tensor skips on its way ({named or 'a tensor used by its object from before the cut-points'}). "
            "Pass it through every block (an auxiliary loss as a running total: x, aux = layer(x, aux)), "
            "use it where it is made, or choose parallel.boundaries")


def balanced_stage_map(costs: Sequence[float], P: int, unsplittable: Iterable[int] = ()) -> StageMap:
    """Contiguous split of segments with per-segment ``costs`` into ``P`` non-empty stages that
    minimises the largest stage cost (ties: the earliest boundaries), starting no stage right
    after a cut-point in ``unsplittable`` (``unsplittable_cuts``) where another split exists.
    Exact dynamic programme, O(P·n²) for n segments.

    Raises ``PartitionError`` if ``P`` is not in ``1..len(costs)``.
    """
    n = len(costs)
    check_depth(n, P)
    avoid = {k + 1 for k in unsplittable}  # a stage starting at segment k + 1 starts after cut-point k
    if sum(1 for j in range(1, n) if j not in avoid) < P - 1:
        avoid = set()  # too few places to split: the caller's check names the tensor in the way
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[p][i]: minimal max-cost splitting the first i segments into p stages
    best = [[inf] * (n + 1) for _ in range(P + 1)]
    cut = [[0] * (n + 1) for _ in range(P + 1)]
    best[0][0] = 0.0
    for p in range(1, P + 1):
        for i in range(p, n - (P - p) + 1):
            for j in range(p - 1, i):
                if j in avoid or best[p - 1][j] == inf:
                    continue
                v = max(best[p - 1][j], prefix[i] - prefix[j])
                if v < best[p][i] - 1e-12 * max(1.0, abs(v)):
                    best[p][i] = v
                    cut[p][i] = j
    ranges = []
    i = n
    for p in range(P, 0, -1):
        j = cut[p][i]
        ranges.append((j, i))
        i = j
    return StageMap(tuple(reversed(ranges)))


def shared_state(
    structure: ModelStructure,
    stage_map: StageMap,
    declared_shared: Iterable[str] | None = None,
) -> dict[str, list[int]]:
    """Return ``{canonical name: [stages]}`` for every parameter needed by more than one stage.

    With ``declared_shared=None`` every such parameter is tied automatically (its copies start
    identical and their gradients are summed, paper §5.2). With a list, only the named ones may
    be shared, and each must be a parameter of the model (a misspelt name is refused with the
    closest one). A buffer the forward only reads (``ModelStructure.read_only_buffers``: a causal
    mask) may be used on several stages: each holds an identical copy (not in the result). Raises
    ``PartitionError`` naming the parameter, the stages and the fix when an
    undeclared parameter, or a buffer the forward writes (state that cannot be kept identical), is
    used on several stages, or when a tensor skips a cut-point across a stage boundary.
    """
    check_tensor_flow(structure, stage_map)
    declared = None if declared_shared is None else set(declared_shared)
    params = set(structure.param_names)
    for name in sorted(declared or ()):
        if name not in params:
            import difflib

            close = difflib.get_close_matches(name, sorted(params), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PartitionError(
                f"shared_params names {name!r}, which is not a parameter of the model; {hint}"
                f"names are the model's own (named_parameters), e.g. {sorted(params)[:3]}")
    out: dict[str, list[int]] = {}
    for name, segs in structure.state_segments.items():
        stages = sorted({stage_map.stage_of_segment(k) for k in segs})
        if len(stages) < 2:
            continue
        where = ", ".join(describe_segment(structure, k) for k in segs)
        if name not in params and name in structure.read_only_buffers:
            continue   # a constant (a causal mask): each stage holds an identical copy, nothing to sum
        if name not in params:
            raise PartitionError(
                f"buffer {name!r} is used on stages {stages} ({where}) and the forward changes it (in place, "
                "or replaces it): copies on several stages would drift apart. Move its uses into one stage "
                "(choose other boundaries), or keep state the forward updates in the one block that uses it"
            )
        if declared is not None and name not in declared:
            raise PartitionError(
                f"parameter {name!r} is used on stages {stages} ({where}) but is not declared shared. "
                f"Add it to shared_params (e.g. shared_params=[{name!r}]) or use automatic tying "
                "(shared_params=None)"
            )
        out[name] = stages
    return out


def check_tensor_flow(structure: ModelStructure, stage_map: StageMap) -> None:
    """Raise ``PartitionError`` if a tensor produced in one stage is used in another without
    passing through a cut-point (it would not be sent)."""
    uses = [(prod, cons, op) for prod, cons, op in structure.cross_uses]
    for prod, cons, op, cuts in structure.carried_uses:  # fine where the consumer's stage receives it
        if stage_map.ranges[stage_map.stage_of_segment(cons)][0] - 1 not in cuts:
            uses.append((prod, cons, op))
    for prod, cons, op in uses:
        sp, sc = stage_map.stage_of_segment(prod), stage_map.stage_of_segment(cons)
        if sp != sc:
            name, what = op.split(" on ", 1) if " on " in op else (op, "a tensor")
            early = (" It is an element of a tensor taken before a block's call (x + self.gamma[i] * layer(x) "
                     "takes self.gamma[i] before layer(x) runs): take it after the call instead, "
                     "layer(x) * self.gamma[i].") if "made by '__getitem__'" in what else (
                " A scalar a block makes and a later segment adds up (an auxiliary loss) can travel with the "
                "activations: carry the running total through every block, x, aux_total = layer(x, aux_total)."
                if what.startswith("a [] ") else "")
            raise PartitionError(
                f"{what}{' in' if ' made by ' in what else ' made in'} {describe_segment(structure, prod)} on "
                f"stage {sp} is used in "
                f"{describe_segment(structure, cons)} on stage {sc} (by {name}) without passing through the "
                f"cut-points in between, so that stage would not have it.{early} Keep those segments on one stage (other "
                "parallel.boundaries, or a smaller P), pass the tensor through every cut-point in between (as "
                "an argument of each block with automatic cut-points; x, skip = cut(x, skip) with CutPoint "
                "modules), or recompute it in the later segment. If the cut-points are not where you expect "
                "(automatic ones sit before every block of the model's largest ModuleList/Sequential that "
                "no other holds: the segments above name their modules), set model.blocks to the dotted "
                "name of the model's list of layers (e.g. 'transformer.h') or put CutPoint() modules in "
                "its forward"
            )


def stage_state_names(structure: ModelStructure, stage_map: StageMap, stage: int) -> set[str]:
    """Canonical parameter and buffer names that ``stage`` must materialise."""
    segs = set(stage_map.segments(stage))
    return {name for name, used in structure.state_segments.items() if segs.intersection(used)}
