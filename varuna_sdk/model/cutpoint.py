"""Cut-points: the marked places where a model may be split into pipeline stages.

Owns the ``CutPoint`` marker module, ``auto_cutpoints`` (marks the blocks of an
``nn.ModuleList``/``nn.Sequential`` body without editing the model's code) and the small
context protocol through which the tracer, the stage runtime and the segment RNG observe
cut-point crossings. Paper §5.1 (cut-points), varuna-original.md §1.1.

A model with ``n`` cut-point *crossings* per forward has ``n + 1`` **segments**: segment ``k``
is the code that runs between crossing ``k - 1`` and crossing ``k``. Segments are numbered by
the order in which cut-points are crossed during one forward, so a ``CutPoint`` module that is
called twice counts twice. A stage is a contiguous run of segments.

Must never import ``varuna_sdk.pipeline`` or anything above it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


class CutPointObserver(Protocol):
    """What the tracer, the stage runtime or the segment RNG does at each crossing."""

    def at_cutpoint(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Called with the tensors crossing the boundary; returns the tensors to continue with."""


_state = threading.local()


def _observer() -> CutPointObserver | None:
    return getattr(_state, "observer", None)


class observe_cutpoints:
    """Context manager that routes every cut-point crossing in this thread to ``observer``.

    Nested use replaces the observer for the inner block and restores it afterwards.
    """

    def __init__(self, observer: CutPointObserver | None):
        self.observer = observer
        self._prev: CutPointObserver | None = None

    def __enter__(self) -> CutPointObserver | None:
        self._prev = _observer()
        _state.observer = self.observer
        return self.observer

    def __exit__(self, *exc: Any) -> None:
        _state.observer = self._prev


def _cross(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    obs = _observer()
    if obs is None:
        return tensors
    out = tuple(obs.at_cutpoint(tuple(tensors)))
    if len(out) != len(tensors):
        raise RuntimeError(
            f"cut-point observer returned {len(out)} tensors for {len(tensors)} crossing; "
            "the tensors that cross a cut-point must be the same on every stage"
        )
    return out


class CutPoint(nn.Module):
    """Identity marker at a place where the model may be split between pipeline stages.

    ``forward(*tensors)`` returns its arguments unchanged (one tensor → that tensor, several →
    a tuple), so a model with cut-points computes exactly what it computed without them. Every
    tensor that later code needs must pass through the cut-point (hidden states, masks of any
    dtype, float tensors with or without grad); a tensor that skips a cut-point and is used on
    another stage is reported by the tracer with the names of both segments.

    Has no parameters. Paper §5.1.
    """

    def forward(self, *tensors: torch.Tensor):
        """Return ``tensors`` unchanged (one → that tensor, several → a tuple, shapes kept), or what this thread's
        observer (``observe_cutpoints``) returns in their place. Raises ``ValueError`` for no tensor, ``TypeError`` for
        a non-tensor, ``RuntimeError`` when the observer returns a different count. Paper §5.1."""
        if not tensors:
            raise ValueError("CutPoint() needs at least one tensor: call it as x = cut(x) or x, m = cut(x, m)")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"CutPoint received a {type(t).__name__}; only tensors can cross a stage boundary. "
                    "Pass Python values as module attributes instead"
                )
        out = _cross(tuple(tensors))
        return out[0] if len(out) == 1 else out


def _cross_tree(tree: Any) -> Any:
    """``tree`` (any nesting of tuples, lists and dicts) with every tensor leaf replaced by what
    crossing returns; the tensors cross in ``tree_flatten`` order (the same on every stage)."""
    leaves, spec = tree_flatten(tree)
    idx = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if not idx:
        return tree
    crossed = _cross(tuple(leaves[i] for i in idx))
    for i, t in zip(idx, crossed):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _cut_call_args(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Cross every tensor a block is called with — positional or keyword, plain or inside
    tuples/lists/dicts (Hugging Face's ``position_embeddings=(cos, sin)``). None (the call as it
    is) when no observer is set; plain tensor arguments skip the tree walk (per block, per
    micro-batch: it is most of a cut-point's cost), crossing in the same order."""
    if _observer() is None:
        return None
    if not kwargs and args and all(isinstance(a, torch.Tensor) for a in args):
        return _cross(tuple(args)), kwargs
    return _cross_tree((tuple(args), dict(kwargs)))


def _cut_output(output: Any) -> Any:
    if isinstance(output, torch.Tensor):   # the common block output: no tree to walk
        return _cross((output,))[0]
    leaves, _ = tree_flatten(output)
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        raise TypeError(
            f"auto_cutpoints: the last block returned {type(output).__name__} without tensors; it must return a "
            "tensor, or tuples/lists/dicts holding them. Mark cut-points by hand with CutPoint() for this model")
    return _cross_tree(output)


def find_block_list(model: nn.Module) -> tuple[str, nn.Module]:
    """Return ``(name, container)`` of the model's body: its largest ``nn.ModuleList`` or
    ``nn.Sequential`` of at least two children that no other such container holds (a block's
    own ``nn.Sequential`` MLP is never the body, however many modules it has; ties: the first
    found) — or, when there is none, its outermost ``nn.ModuleList`` of one block (ALBERT calls
    its one layer group at every depth).

    Raises ``ValueError`` when the model has no such container.
    """
    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2]
    if not found:
        # a ModuleList of one block called at every depth (Hugging Face ALBERT's layer groups):
        # the outermost such list, a cut-point before each call of its block
        found = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod) == 1]
    inner = {id(sub) for _, mod in found for sub in mod.modules() if sub is not mod}
    best: tuple[str, nn.Module] | None = None
    for name, mod in found:
        if id(mod) not in inner and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None:
        raise ValueError(
            f"auto_cutpoints: {type(model).__name__} has no nn.ModuleList or nn.Sequential of 2 or more "
            "blocks; insert CutPoint() modules in its forward by hand instead"
        )
    return best


#: Version of the rules ``auto_cutpoints`` places cut-points by: part of a calibration's cache key
#: (``profiling.job.profile_key``), so a profile measured on other segments is never reused. 2: an
#: encoder-decoder is cut in both stacks.
AUTO_CUTPOINTS_VERSION = 2


def find_block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's bodies, in forward order: ``find_block_list``'s, and for an encoder-decoder (the
    body's name holds ``encoder`` or ``decoder``, and the same name with the other word names a
    container of 2 or more blocks, e.g. T5's ``encoder.block``/``decoder.block``, BART's and
    ``nn.Transformer``'s ``encoder.layers``/``decoder.layers``) both stacks, the encoder's first.

    Raises ``ValueError`` as ``find_block_list``."""
    name, body = find_block_list(model)
    for a, b in (("encoder", "decoder"), ("decoder", "encoder")):
        if a in name:
            try:
                other = model.get_submodule(name.replace(a, b))
            except AttributeError:
                continue
            if isinstance(other, (nn.ModuleList, nn.Sequential)) and len(other) >= 2:
                pair = [(name, body), (name.replace(a, b), other)]
                return pair if a == "encoder" else pair[::-1]
    return [(name, body)]


def auto_cutpoints(model: nn.Module, blocks: str | None = None) -> nn.Module:
    """Mark a cut-point before every block of the model's body and one after the last block.

    The body is ``blocks`` (a dotted module name of a ``ModuleList``, ``Sequential`` or
    ``ModuleDict``, whose blocks the forward calls in the dict's order; or a list of the blocks'
    dotted names, in the order the forward calls them, for blocks kept as attributes
    ``self.b1``, ``self.b2``...) or, when omitted, the largest
    ``nn.ModuleList``/``nn.Sequential`` in the model (e.g. GPT-2's ``h``) — for an encoder-decoder
    both stacks (``find_block_lists``), each marked as a body is: ``n + m`` blocks give
    ``n + m + 3`` segments, [embeddings], [encoder blocks], [between: the encoder's last norm, the
    decoder's embeddings], [decoder blocks], [head]. Implemented with
    forward hooks, so neither the model's code nor its parameter names change (checkpoints of
    the plain model still load). With ``n`` blocks the model gets ``n + 1`` cut-points and
    ``n + 2`` segments: [embeddings], [block 0], …, [block n-1], [head] (one block object listed
    ``n`` times, its weights shared across depth as in ALBERT: a cut-point before each of its
    calls, ``n + 1`` segments, the head with the last call; a list of one block, which may be
    called at every depth as Hugging Face ALBERT's layer group is: a cut-point before each call; a
    block that is a ``ModuleList`` of sub-blocks, ``for attn, ff in self.layers``: before its first
    sub-block's call, and after the last block's last). Every tensor argument of
    a block crosses the cut-point — positional or keyword, alone or inside tuples, lists and dicts —
    so attention masks, position ids and rotary ``(cos, sin)`` travel between stages
    automatically, and every block of a stage receives them.

    Returns the same model (marked in place). Calling it twice is a no-op.
    Raises ``ValueError`` if no body is found or ``blocks`` names no container.
    """
    if getattr(model, "_varuna_auto_cutpoints", False):
        return model
    if blocks is None:
        bodies = [body for _, body in find_block_lists(model)]
    elif not isinstance(blocks, str):   # the blocks by name, in the order the forward calls them
        names = list(blocks)
        if len(names) < 2 or len(set(names)) != len(names):
            raise ValueError(f"auto_cutpoints: blocks={names!r} must name 2 or more distinct modules, in the order "
                             "the forward calls them")
        bodies = [[_submodule(model, n) for n in names]]
    else:
        body = _submodule(model, blocks)
        if not isinstance(body, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or len(body) < 1:
            raise ValueError(f"auto_cutpoints: {blocks!r} is a {type(body).__name__}, not a non-empty "
                             "ModuleList/Sequential/ModuleDict; name its blocks as a list instead, in the order "
                             "the forward calls them (e.g. ['b1', 'b2', 'b3'])")
        bodies = [body]
    segments = [_mark_body(body) for body in bodies]
    if all(n is not None for n in segments):
        # distinct blocks, each called once per forward: this many segments at least (checked on the
        # dry run: a forward that skips blocks, as LayerDrop does, has fewer)
        model._varuna_auto_segments = sum(segments) + 1
        model._varuna_auto_blocks = sum(n - 1 for n in segments)
    model._varuna_auto_cutpoints = True
    return model


def _submodule(model: nn.Module, name: str) -> nn.Module:
    """``model.get_submodule(name)``; raises ``ValueError`` naming the closest module names when
    there is none by that name."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        import difflib

        names = [n for n, _ in model.named_modules() if n]
        near = difflib.get_close_matches(name, names, n=3)
        top = [n for n, _ in model.named_children()]
        raise ValueError(f"auto_cutpoints: model has no submodule {name!r}"
                         + (f"; did you mean {' or '.join(map(repr, near))}?" if near else
                            f"; its modules are {top[:12]}")) from None


def _mark_body(body: nn.Module | list[nn.Module]) -> int | None:
    """Hook a cut-point before each block of ``body`` and one after its last; the segments it adds
    (one per block and the one after it), or ``None`` when the blocks are not distinct."""

    def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict):
        return _cut_call_args(args, kwargs)

    def post_hook(_mod: nn.Module, _args: tuple, output: Any):
        return _cut_output(output)

    # a block that is itself a ModuleList (``for attn, ff in self.layers``) is never called: the
    # cut-point goes before its first module's call, and after the last block's last module
    blocks = list(body.values()) if isinstance(body, nn.ModuleDict) else list(body)   # a ModuleDict: in its order
    children = [_called(c, last=False) for c in blocks]
    distinct = list({id(c): c for c in children}.values())
    for child in distinct:  # one block object listed n times (weights shared across depth): one hook
        child.register_forward_pre_hook(pre_hook, with_kwargs=True)
    if len(distinct) == len(children) > 1:
        _called(blocks[-1], last=True).register_forward_hook(post_hook)
        return len(children) + 1
    # else: the last block is also an earlier one (or the list's only block, which may be called at
    # every depth), whose every call would end a segment; the head stays in the last call's segment
    return None


def _called(block: nn.Module, last: bool) -> nn.Module:
    """The module a block's call enters (``last``: the one it leaves by): the block itself, or for a
    ``ModuleList`` of sub-blocks, which the forward iterates instead of calling, its first (last)."""
    while isinstance(block, nn.ModuleList) and len(block):
        block = block[-1] if last else block[0]
    return block


def crossing_signature(tensors: Sequence[torch.Tensor]) -> list[dict]:
    """Describe tensors crossing a boundary: dtype, requires_grad and shape per tensor (plain data)."""
    return [
        {"dtype": str(t.dtype).replace("torch.", ""), "requires_grad": bool(t.requires_grad), "shape": list(t.shape)}
        for t in tensors
    ]
