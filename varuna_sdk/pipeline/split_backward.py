"""The backward split into input-gradient (B) and weight-gradient (W) work — the zero-bubble idea.

A stage's backward does two jobs: the gradient of its *inputs*, which the stage before waits for,
and the gradients of its *weights*, which nobody needs until the optimizer step. Splitting them lets
a stage send the input gradient upstream as soon as it is known and run the weight gradients later,
in a gap where it would otherwise wait for a message (Qi et al., "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241; the same split torch.distributed.pipelining's zero-bubble
schedules make). :func:`backward_input` is the B: one ``torch.autograd.grad`` to the stage's input
leaves that also returns, as extra ``GradientEdge`` inputs of the same call, the gradient flowing
into every autograd node where a weight's subgraph joins the input path (the engine captures them
in C++: no Python hook runs during the backward; hooks cost a quarter of B on CPU). :class:`WeightWork` is the W: for each group of weights
sharing such nodes, one ``torch.autograd.grad`` from those nodes (with the recorded gradients) to
the weights, so no input-path work is done twice. The sum B + W equals the full backward to the
float rounding of the order of accumulation (tests compare with 1e-5).

Only public autograd API is used (``Node.register_prehook``, ``GradientEdge``,
``torch.autograd.grad``). Must never import anything above ``pipeline``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightWork", "backward_input"]


def _node(t: torch.Tensor) -> Node | None:
    """The autograd node a gradient for ``t`` enters: its ``grad_fn``, or for a leaf that requires
    grad its accumulator (made on demand through a throw-away view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def _parents(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the autograd graph below ``roots``: node -> the nodes that feed it a
    gradient. Every reachable node is a key (roots with an empty list)."""
    parents: dict[Node, list[Node]] = {}
    todo = deque()
    for r in roots:
        if r not in parents:
            parents[r] = []
            todo.append(r)
    while todo:
        n = todo.popleft()
        for child, _ in n.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(n)
    return parents


def _upward(starts: Iterable[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node reachable from them towards the outputs: the input path."""
    seen: set[Node] = set()
    todo = deque()
    for s in starts:
        if s not in seen:
            seen.add(s)
            todo.append(s)
    while todo:
        for p in parents.get(todo.popleft(), ()):
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


class _Group:
    """Weights whose gradients all flow out of the same input-path nodes (``joins``)."""

    def __init__(self, params: set[Node], joins: set[Node]):
        self.params, self.joins = params, joins


def _groups(param_nodes: Sequence[Node], joinable: set[Node],
            parents: dict[Node, list[Node]]) -> list[_Group]:
    """Group weights by the nodes where their subgraphs join the input path or reach an output
    directly (``joinable``): one union-find pass over the edges leaving nodes off the input path
    (O(graph), not O(weights x graph)); weights whose subgraphs touch, or meet at a join node,
    share a group."""
    up: dict[Node, Node] = {}

    def find(n: Node) -> Node:
        root = n
        while up.get(root, root) is not root:
            root = up[root]
        while n is not root:  # path compression
            n, up[n] = up[n], root
        return root

    for n, ps in parents.items():
        if n in joinable:
            continue  # a join's own parents lie on the input path: never followed
        for p in ps:
            a, b = find(n), find(p)
            if a is not b:
                up[a] = b
    by_root: dict[Node, _Group] = {}
    for pn in param_nodes:
        by_root.setdefault(find(pn), _Group(set(), set())).params.add(pn)
    for j in joinable:
        g = by_root.get(find(j))
        if g is not None:
            g.joins.add(j)
    return [g for g in by_root.values() if g.joins]


class WeightWork:
    """The deferred weight-gradient (W) work of one micro-batch on one stage.

    Holds the retained autograd graph and the gradients recorded at the join nodes during
    :func:`backward_input`; :meth:`run` accumulates every weight's gradient into ``.grad`` (as
    ``backward()`` would) and releases them. Memory held until then: the stage's saved activations
    of this micro-batch plus one gradient per join node (about one activation each).
    """

    def __init__(self, params: dict[Node, torch.Tensor], groups: list[_Group],
                 captured: dict[Node, list]):
        self._params, self._groups, self._captured = params, groups, captured
        self.done = False

    def run(self, on_group: Callable[[list[torch.Tensor], float], None] | None = None,
            sync: Callable[[], None] | None = None) -> None:
        """Compute and accumulate the weight gradients (once; a second call does nothing).

        ``on_group(weights, seconds)``, when given, is told each group's time (calibration
        attributes W to segments with it); ``sync`` (e.g. a CUDA synchronize) runs around each
        group then. Raises ``RuntimeError`` from autograd if the graph was freed (a caller bug)."""
        if self.done:
            return
        self.done = True
        for n, g in enumerate(self._groups):
            if on_group is not None:
                if sync is not None:
                    sync()
                t0 = time.perf_counter()
            edges, gouts = [], []
            for j in g.joins:
                for k, gr in enumerate(self._captured.get(j, ())):
                    if gr is not None:
                        edges.append(GradientEdge(j, k))
                        gouts.append(gr)
            if not edges:
                continue  # no gradient reached this group (its output was unused)
            hooks = []
            if len(g.joins) > 1:
                # one join may feed another (a weight used twice): its recorded gradient is already
                # complete, so whatever flows into it again here is replaced, not added
                # (slots past the last captured one received nothing in B: None)
                hooks = [j.register_prehook(
                    lambda gin, saved=tuple(self._captured[j]): saved + (None,) * (len(gin) - len(saved)))
                    for j in g.joins if j in self._captured]
            params = list(g.params)
            try:
                dws = torch.autograd.grad(edges, [GradientEdge(p, 0) for p in params], gouts,
                                          retain_graph=n < len(self._groups) - 1, allow_unused=True)
            finally:
                for h in hooks:
                    h.remove()
            for p, dw in zip(params, dws):
                if dw is None:
                    continue
                w = self._params[p]
                if w.grad is None:
                    # a copy, as autograd's accumulation makes of a gradient it does not own: one tensor
                    # may reach two weights (p1 + p2) or be the input gradient sent upstream (x + b)
                    w.grad = dw.clone()
                else:
                    w.grad += dw
            if on_group is not None:
                if sync is not None:
                    sync()
                on_group([self._params[p] for p in params], time.perf_counter() - t0)
        self._captured.clear()
        self._groups = []


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Iterable[torch.Tensor],
                   timing: dict[str, float] | None = None) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of ``inputs`` only, and the W work left for ``params``.

    Args:
        outputs: the stage's outputs (or its scalar loss); those without a graph are skipped.
        grads: one gradient per output, same shape (``None``: ones, for a scalar loss).
        inputs: the stage's input leaves (those with ``requires_grad`` get a gradient, the others
            ``None``).
        params: the stage's weights; those outside the graph are left untouched.

    ``timing``, when given, receives ``"analysis_s"``: the seconds spent reading the autograd
    graph (grouping the weights, placing the hooks) before the input gradients are computed.

    Returns ``(input gradients aligned with inputs, WeightWork)``. When no input requires a
    gradient (the first stage) the input path is empty: the whole backward then happens in
    :meth:`WeightWork.run`. Weights whose subgraph reaches an output without touching the input
    path (an output computed from weights only) take that output's gradient: the one given, plus
    what flows into it through the other outputs when their graphs use it too (computed in this
    call).
    """
    t0 = time.perf_counter()
    outs, gouts = [], []
    for o, g in zip(outputs, grads):
        if o.requires_grad:
            outs.append(o)
            gouts.append(torch.ones_like(o) if g is None else g)
    out_nodes = [_node(o) for o in outs]
    parents = _parents(out_nodes)
    want = [i for i, t in enumerate(inputs) if t.requires_grad]
    input_nodes = [n for n in (_node(inputs[i]) for i in want) if n in parents]
    on_input_path = _upward(input_nodes, parents)
    captured: dict[Node, list] = {}
    for o, n, g in zip(outs, out_nodes, gouts):
        if n not in on_input_path:  # never run by the input backward: its gradient is the given one
            slot = 0 if o.grad_fn is None else o.output_nr
            got = captured.setdefault(n, [])
            got.extend([None] * (slot + 1 - len(got)))
            got[slot] = g if got[slot] is None else got[slot] + g
    params_by_node: dict[Node, torch.Tensor] = {}
    for p in params:
        if p.requires_grad:
            n = _node(p)
            if n in parents:
                params_by_node[n] = p
    groups = _groups(list(params_by_node), on_input_path | set(captured), parents)
    all_joins = {j for g in groups for j in g.joins}
    # an output off the input path that the graph of another output also feeds (T5's position bias,
    # used by the hidden state that crosses with it; y and 2*y) gets more than its given gradient:
    # asked of the same call, its full gradient replaces the given one
    joins = (all_joins - set(captured)) | {j for j in all_joins & set(captured) if parents.get(j)}
    edges = _join_edges(joins, parents, outs, out_nodes)
    result: list[torch.Tensor | None] = [None] * len(inputs)
    if timing is not None:
        timing["analysis_s"] = time.perf_counter() - t0
    if (want or edges) and outs:
        got = torch.autograd.grad(outs, [inputs[i] for i in want] + edges, gouts,
                                  retain_graph=True, allow_unused=True)
        for i, g in zip(want, got):
            result[i] = g
        for e, g in zip(edges, got[len(want):]):
            if g is not None:
                slots = captured.setdefault(e.node, [])
                slots.extend([None] * (e.output_nr + 1 - len(slots)))
                slots[e.output_nr] = g
    return result, WeightWork(params_by_node, groups, captured)


def _join_edges(joins: set[Node], parents: dict[Node, list[Node]], outs: Sequence[torch.Tensor],
                out_nodes: Sequence[Node]) -> list[GradientEdge]:
    """One ``GradientEdge`` per gradient slot of each join node that can receive a gradient: the
    slots its parents' edges (and the outputs themselves, for a join that is an output's node)
    point at. Asked of ``torch.autograd.grad`` as inputs, each returns the gradient flowing into
    that slot — summed over every edge into it, as a pre-hook on the node would see it."""
    slots: dict[Node, set[int]] = {}
    for j in joins:
        for p in parents.get(j, ()):
            for child, k in p.next_functions:
                if child is j:
                    slots.setdefault(j, set()).add(k)
    for o, n in zip(outs, out_nodes):
        if n in joins:
            slots.setdefault(n, set()).add(0 if o.grad_fn is None else o.output_nr)
    return [GradientEdge(j, k) for j, ks in slots.items() for k in sorted(ks)]
