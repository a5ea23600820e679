"""The stage prefix: how a stage runs the part of the user's forward that lies *before* it.

Owns ``StageExit`` (the exception that stops the forward at the stage's last cut-point),
``StageRun`` (the cut-point observer of one forward of one micro-batch: it swaps the received
tensors in at the stage's first cut-point and stops at its last) and ``StagePrefix`` (the meta
stubs of the modules that run only before the stage, and the meta stand-ins of the local tied
weights those modules also use).

Why this exists: a stage runs the user's *whole*, unedited ``forward`` on the real inputs, not a
re-written sub-module, because a model's forward is arbitrary Python — inputs a later segment
uses (labels, attention masks, position ids, rotary tables) are computed or passed along before
the stage's first cut-point, and only running that code produces them, on every stage, for
every micro-batch. Running it for real would cost the earlier stages' compute and memory, so
those segments run with their weights on the ``meta`` device (``model.hybrid.MetaAsDevice``):
what depends on the inputs alone is still computed for real and steers the forward exactly as
on the first stage. Modules whose outputs depend on weights are replaced by stubs returning
their recorded meta outputs (recorded once per input shape), so skipping them costs nothing;
a local parameter they share (a tied embedding) is swapped for a meta stand-in while they run.
At the stage's first cut-point the received tensors replace the crossing ones — and wherever
the same tensor objects are handed to a later block of the stage (a mask or rotary
``(cos, sin)`` given to every layer), the received ones are substituted again; the forward stops
by exception at the stage's last cut-point, so the rest of the model never runs here.

Imports only ``varuna_sdk.model``; must never import anything above ``pipeline``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..model.cutpoint import observe_cutpoints
from ..model.hybrid import MetaAsDevice, MetaShapeCache
from ..model.inputs import ModelInputs, call_model, shapes_key, tensors_of
from ..model.rng import seed_segment
from ..model.tracer import ModelStructure

Swap = tuple[nn.Module, str, nn.Parameter]  # (owning module, attribute name, the real parameter)
Stub = tuple[nn.Module, list]  # (module, its recorded meta outputs, one per call in a forward)


def _fresh(x):
    """A stub's recorded meta output as a new meta tensor of the same shape, strides and dtype: the
    recorded one was made under ``no_grad``, often as a view (a ``Linear`` on 3-d input), and a
    forward that writes into it in place (SpecAugment's ``h[mask] = emb`` before the first block)
    failed on the stage with "a view was created in no_grad mode" (helper-67); writing into it
    would also change what the next micro-batch's stub returns. Anything else as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C.DisableTorchFunction():   # MetaAsDevice has meta tensors say they are on the stage's device
        if not x.is_meta:
            return x
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
Carried = dict[int, tuple[torch.Tensor, torch.Tensor]]  # id(crossing tensor) -> (it, the tensor received for it)


class StageExit(BaseException):
    """Raised at the stage's last cut-point to stop the user's forward; ``tensors`` are the
    crossing tensors there (the stage's outputs). A ``BaseException``, not an ``Exception``, so
    that user ``try/except Exception`` blocks cannot swallow it."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        super().__init__()
        self.tensors = tensors


class StageRun:
    """Cut-point observer for one forward of one micro-batch on this stage.

    Args:
        start_cut: index of the cut-point where the stage starts (-1: the first stage).
        end_cut: index of the cut-point where it stops (-1: the last stage runs to the end).
        received: the tensors received from the stage before (one per crossing tensor at
            ``start_cut``), or ``None`` on the first stage.
        seed, step, mb: the model seed, optimizer step and global micro-batch index; each
            segment of the stage is seeded from them (``model.rng.seed_segment``).
        on_enter: called once on reaching ``start_cut`` (``StagePrefix.running``'s restore).
        mode: the ``MetaAsDevice`` mode the prefix runs under, popped on reaching ``start_cut``
            (the stage's own segments run on the real device), or ``None`` on the first stage.
        everywhere: the stage's operations use crossing tensors of ``start_cut`` by their objects
            from before it (``ModelStructure.carried_uses``: a residual added outside the block,
            ``h = h + layer(h)``): from ``start_cut`` on, every torch operation gets the received
            tensor in their place, not only the blocks. Call ``close()`` after the forward.

    ``entered`` tells, after the forward, whether ``start_cut`` was reached.
    """

    def __init__(self, start_cut: int, end_cut: int, received: tuple[torch.Tensor, ...] | None,
                 seed: int, step: int, mb: int, on_enter: Callable[[], None] | None,
                 mode: MetaAsDevice | None = None, everywhere: bool = False):
        self.k = 0
        self.start_cut, self.end_cut = start_cut, end_cut
        self.received = received
        self.seed, self.step, self.mb = seed, step, mb
        self.on_enter = on_enter
        self.mode = mode
        self.everywhere = everywhere
        self.entered = start_cut < 0
        self.carried: Carried = {}
        self._received_mode: _Received | None = None

    def close(self) -> None:
        """Leave the substitution of the received tensors (``everywhere``), if it was entered."""
        if self._received_mode is not None:
            self._received_mode.__exit__(None, None, None)
            self._received_mode = None

    def _substitute(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return substitute(self.carried, tensors)

    def at_cutpoint(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The tensors the forward continues with after the next cut-point; raises ``StageExit``
        at ``end_cut``."""
        k = self.k
        self.k += 1
        if k == self.end_cut:
            raise StageExit(self._substitute(tensors))
        # every segment, the prefix's too: what it computes for real (from the inputs, or NumPy's draws
        # that a later segment uses) is then what the stages before computed
        seed_segment(self.seed, self.step, self.mb, k + 1)
        if k == self.start_cut:
            self.entered = True
            if self.on_enter is not None:
                self.on_enter()
            if self.mode is not None:
                self.mode.pop()  # this stage's own segments run on the real device, unobserved
            self.carried = {id(t): (t, r) for t, r in zip(tensors, self.received)}
            if self.everywhere:
                self._received_mode = _Received(self.carried)
                self._received_mode.__enter__()
            return self.received
        if k > self.start_cut:
            return self._substitute(tensors)
        return tensors


def substitute(carried: Carried, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The received tensor for every crossing tensor that is one received at the stage's first
    cut-point (same object: a mask or rotary table handed to every block)."""
    if not carried:
        return tensors
    out = []
    for t in tensors:
        hit = carried.get(id(t))
        out.append(hit[1] if hit is not None and hit[0] is t else t)
    return tuple(out)


class Recomputing:
    """Cut-point observer for a micro-batch's backward on a stage after the first (pass
    ``StageRun.carried`` of its forward). A block the user's forward ran under
    ``torch.utils.checkpoint`` is recomputed in the backward with the arguments the checkpoint
    saved, which for the stage's first block are the meta tensors the prefix made: at its
    cut-point each is replaced by the tensor received for it, as in the forward. Other crossings
    pass unchanged."""

    def __init__(self, carried: Carried):
        self.carried = carried

    def at_cutpoint(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``tensors`` with the received ones in place of the forward's crossing tensors."""
        return substitute(self.carried, tensors)


class _Received(TorchFunctionMode):
    """Torch-function mode: every tensor argument that is one of the crossing tensors of the
    stage's first cut-point (the same object, made on meta by the prefix) is replaced by the
    tensor received for it, so that an operation outside the blocks (``h + layer(h)``) computes
    with, and sends its gradient to, what the stage before sent."""

    def __init__(self, carried: Carried):
        super().__init__()
        self.carried = carried

    def _swap(self, x):
        hit = self.carried.get(id(x)) if isinstance(x, torch.Tensor) else None
        return hit[1] if hit is not None and hit[0] is x else x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(self._swap, (args, kwargs or {}))
        return func(*args, **kwargs)


class _StopAt:
    """Cut-point observer of the recording forward: marks the modules running at each crossing
    and stops at the stage's first cut-point."""

    def __init__(self, stop: int, running: list[nn.Module], crossing: set[nn.Module]):
        self.k, self.stop = 0, stop
        self.running, self.crossing = running, crossing

    def at_cutpoint(self, tensors):
        """Mark the running modules as crossing; stop at the stage's first cut-point."""
        self.crossing.update(self.running)
        if self.k == self.stop:
            raise StageExit(tensors)
        self.k += 1
        return tensors


class StagePrefix:
    """The segments before one stage, run on the meta device at almost no cost.

    Args:
        model: the whole model, built on meta with only this stage's state materialised.
        structure: its traced structure (which segments use which parameters).
        first_segment: index of the stage's first segment (0: the first stage, no prefix).
        device: the stage's real device (what ``MetaAsDevice`` pretends the meta device is).
    """

    def __init__(self, model: nn.Module, structure: ModelStructure, first_segment: int, device: torch.device):
        self.model, self.device = model, device
        self.start_cut = first_segment - 1
        self.swaps = self._pre_stage_params(structure, first_segment)
        self._stub_cache: dict[tuple, list[Stub]] = {}
        #: the meta operations' output metadata, replayed on every forward after the first (``MetaAsDevice``)
        self.meta_cache = MetaShapeCache()

    def _pre_stage_params(self, structure: ModelStructure, first_segment: int) -> list[Swap]:
        """Local parameters also used by segments *before* this stage (tied weights): they are
        swapped for meta stand-ins while those segments run on the meta device."""
        canonical = dict(self.model.named_parameters())
        wanted = {id(canonical[nm]) for nm, segs in structure.state_segments.items()
                  if nm in canonical and canonical[nm].device.type != "meta" and min(segs) < first_segment}
        return [(mod, attr, p) for mod in self.model.modules()
                for attr, p in mod._parameters.items() if p is not None and id(p) in wanted]

    def _swap_in_meta(self) -> None:
        for mod, attr, p in self.swaps:
            mod._parameters[attr] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)

    def _swap_back(self) -> None:
        for mod, attr, p in self.swaps:
            mod._parameters[attr] = p

    @contextlib.contextmanager
    def running(self, inputs: ModelInputs) -> Iterator[Callable[[], None]]:
        """While segments before this stage run: modules used only there are replaced by stubs
        that return their recorded meta outputs, and local parameters they share (tied weights)
        are swapped for meta stand-ins. Yields the ``restore`` callback the stage calls on reaching
        its first cut-point (called again on exit if it was not)."""
        if self.start_cut < 0:
            yield lambda: None
            return
        stubs = self.stubs(inputs)
        restored = [False]

        def restore() -> None:
            if not restored[0]:
                self._swap_back()
                for mod, _ in stubs:
                    mod.__dict__.pop("forward", None)
                restored[0] = True

        def stub(mod: nn.Module, outs: list) -> Callable:
            it = iter(outs)
            real = type(mod).forward

            def forward(*a, **k):
                # a module called again at the stage's first cut-point (one block object used at
                # every depth): torch looked its forward up before the cut-point's pre-hook
                # restored it, so this call runs the real one
                return real(mod, *a, **k) if restored[0] else tree_map(_fresh, next(it))
            return forward

        self._swap_in_meta()
        for mod, outs in stubs:
            mod.forward = stub(mod, outs)
        try:
            yield restore
        finally:
            restore()

    def stubs(self, inputs: ModelInputs) -> list[Stub]:
        """Record, once per input shape, the meta outputs of every module that runs only before
        this stage's first cut-point; return the outermost such modules with their outputs."""
        key = shapes_key(inputs)
        if key not in self._stub_cache:
            calls, crossing = self._record(inputs)
            self._stub_cache[key] = self._outermost(calls, crossing)
        return self._stub_cache[key]

    def _record(self, inputs: ModelInputs) -> tuple[dict[nn.Module, list], set[nn.Module]]:
        """One meta forward up to the first cut-point: every module's outputs (per call), and the
        modules whose own call crosses a cut-point (``CutPoint`` modules, wrappers around them):
        those must not be stubbed, the stage has to observe every crossing to count cut-points."""
        calls: dict[nn.Module, list] = {}
        running: list[nn.Module] = []
        crossing: set[nn.Module] = set()

        def pre_hook(mod, _args):
            running.append(mod)

        def hook(mod, _args, out):
            running.pop()
            calls.setdefault(mod, []).append(out)

        mods = [m for m in self.model.modules() if m is not self.model]
        # pre-hooks run after, forward hooks before, any cut-point hooks (auto_cutpoints): a block
        # whose crossing happens in a hook is still stubbed — its hooks run on the stub's output.
        handles = ([m.register_forward_pre_hook(pre_hook) for m in mods]
                   + [m.register_forward_hook(hook, prepend=True) for m in mods])
        try:
            self._swap_in_meta()
            stop = _StopAt(self.start_cut, running, crossing)
            with torch.no_grad(), observe_cutpoints(stop), MetaAsDevice(self.device):
                try:
                    call_model(self.model, inputs)
                except StageExit:
                    pass
        finally:
            for h in handles:
                h.remove()
            self._swap_back()
        return calls, crossing

    def _outermost(self, calls: dict[nn.Module, list], crossing: set[nn.Module]) -> list[Stub]:
        """The modules to stub: recorded, not crossing a cut-point, with meta outputs only (a module
        whose output holds a real tensor computed it from the inputs alone — positions, masks — and
        runs every time, cheaply, so that its values follow each micro-batch), and not inside
        another module that is stubbed."""
        parents: dict[nn.Module, nn.Module] = {}
        for mod in self.model.modules():
            for child in mod.children():
                parents.setdefault(child, mod)
        real_out = {m for m, outs in calls.items() if any(t.device.type != "meta" for t in tensors_of(outs))}

        def covered(m: nn.Module) -> bool:
            a = parents.get(m)
            while a is not None:
                if a in calls and a not in crossing and a not in real_out:
                    return True
                a = parents.get(a)
            return False

        return [(m, outs) for m, outs in calls.items()
                if m not in crossing and m not in real_out and not covered(m)]
