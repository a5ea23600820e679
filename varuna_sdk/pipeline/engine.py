"""The training engine: ``Varuna(...).step(batch, optimizer)`` on one rank of a P × D job.

Owns one rank's stage: building it (trace on meta, split, materialise only local parameters),
running the schedule policy (from csrc, the same code the simulator uses) over its
micro-batches with forward (F), recompute (R) and backward (B) actions, and the end-of-step
synchronisation: tied-weight gradient sum, data-parallel all-reduce, one world-wide consensus
of (overflow, grad-norm², loss), global-norm clipping, loss-scale update and the optimizer step.
Paper §3.2, §5.2, §6; varuna-original.md §3, §8 — with its bugs fixed: fp32 gradients are
reduced, RNG is forked (never rewound), the loss is the mini-batch mean over all replicas,
``shared_params=None`` works, and short micro-batches cannot occur (the batch identity is
validated up front).

A stage's forward runs the user's whole ``forward`` on the real inputs (so inputs a later
segment uses — labels, masks — are there on every stage): segments before the stage run with
their weights on the ``meta`` device (no memory, no weight compute; modules whose outputs depend
on weights are replaced by stubs returning their recorded meta outputs, tied weights held here by
meta stand-ins) under ``model.hybrid.MetaAsDevice``, so what depends on the inputs alone is
computed for real and steers the forward as on the first stage. At the stage's first cut-point
the received tensors replace the crossing ones — and wherever the same tensor objects are handed
to a later block of the stage (a mask or rotary ``(cos, sin)`` given to every layer), the
received ones are substituted again; the forward stops by exception at its last cut-point.

Never imports ``varuna_sdk.cluster``/``manager``/``planner``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import ParallelConfig, validate_parallel
from ..model.cutpoint import observe_cutpoints
from ..model.hybrid import MetaAsDevice
from ..model.inputs import ModelInputs, as_inputs, call_model, leading_dim, rows, shapes_key, tensors_of, to_device
from ..model.materialize import build_on_meta, materialize
from ..model.partition import StageMap, balanced_stage_map, shared_state, stage_state_names
from ..model.rng import forked_rng, seed_segment
from ..model.tracer import ModelStructure, segment_costs, trace_model
from .comm import Channel, Receiver
from .grad_sync import GradSync
from .groups import Topology, build_groups
from .scaler import LossScaler
from .schedule import StageScheduler, default_recompute
from .split_backward import WeightWork, backward_input

LossFn = Callable[[object, object], torch.Tensor]  # (model output, targets) -> scalar mean loss


@dataclass
class StepResult:
    """What one optimizer step did. ``loss`` is the mean over the whole mini-batch (all
    micro-batches of all replicas); ``grad_norm`` the global L2 norm before clipping (tied
    weights counted once); ``skipped`` is True when any stage overflowed (fp16). ``time_s``: the
    whole step (seconds); ``compute_s``: this stage's seconds per action kind over the step
    (``{"F", "R", "B"}``, computing only); ``wait_s``: seconds blocked waiting for an input
    that had not arrived (``"F"``: an activation from the stage before, ``"B"``: a gradient from
    the stage after) — the pipeline bubble as this stage saw it, never counted as compute."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    time_s: float
    compute_s: dict[str, float] = field(default_factory=dict)
    wait_s: dict[str, float] = field(default_factory=dict)


class _StageExit(BaseException):
    """Raised at the stage's last cut-point to stop the user's forward (not an Exception, so
    user ``try/except Exception`` blocks cannot swallow it)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        super().__init__()
        self.tensors = tensors


class _StageRun:
    """Cut-point observer for one forward of one micro-batch on this stage."""

    def __init__(self, start_cut: int, end_cut: int, received: tuple[torch.Tensor, ...] | None,
                 seed: int, step: int, mb: int, on_enter: Callable[[], None] | None,
                 mode: MetaAsDevice | None = None):
        self.k = 0
        self.start_cut, self.end_cut = start_cut, end_cut
        self.received = received
        self.seed, self.step, self.mb = seed, step, mb
        self.on_enter = on_enter
        self.mode = mode
        self.entered = start_cut < 0
        self.carried: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _substitute(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The received tensor for every crossing tensor that is one received at the stage's first
        cut-point (same object: a mask or rotary table handed to every block)."""
        if not self.carried:
            return tensors
        out = []
        for t in tensors:
            hit = self.carried.get(id(t))
            out.append(hit[1] if hit is not None and hit[0] is t else t)
        return tuple(out)

    def at_cutpoint(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        k = self.k
        self.k += 1
        if k == self.end_cut:
            raise _StageExit(self._substitute(tensors))
        if k >= self.start_cut:
            seed_segment(self.seed, self.step, self.mb, k + 1)
        if k == self.start_cut:
            self.entered = True
            if self.on_enter is not None:
                self.on_enter()
            if self.mode is not None:
                self.mode.pop()  # this stage's own segments run on the real device, unobserved
            self.carried = {id(t): (t, r) for t, r in zip(tensors, self.received)}
            return self.received
        if k > self.start_cut:
            return self._substitute(tensors)
        return tensors


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def split_batch(batch: Sequence, global_batch: int, replica_batch: int, replica: int) -> tuple:
    """This replica's ``(inputs, targets)`` of a batch ``(inputs, targets)``: inputs a tensor, a
    tuple of tensors (positional) or a mapping (keyword arguments); targets a tensor, any nesting
    of tensors, or ``None`` (the model computes its loss). Accepts the global batch (leading dim
    ``global_batch``) or already the replica's share (leading dim ``replica_batch``).

    Raises ``ValueError`` naming the sizes when the leading dimension is neither.
    """
    inputs, targets = batch
    inputs = as_inputs(inputs)
    n = leading_dim(targets)
    if n is None:
        n = leading_dim(inputs)
    if n == replica_batch:
        return inputs, targets
    if n == global_batch:
        a, b = replica * replica_batch, (replica + 1) * replica_batch
        return rows(inputs, a, b), rows(targets, a, b)
    raise ValueError(
        f"batch has {n} examples; step() takes the global batch ({global_batch}) or this replica's "
        f"share ({replica_batch} = {global_batch} / D)"
    )


class Varuna:
    """One rank of a pipeline × data-parallel job (paper §3, §6).

    Args:
        model_fn: ``() -> nn.Module`` building the *whole* model (its tensors are made on the meta
            device and its constructor's operations recorded; only this stage's parameters and
            buffers are then computed, ``model.deferred``). The model has cut-points
            (``CutPoint`` modules or ``auto_cutpoints``); it is called ``model(*inputs)`` or
            ``model(**inputs)`` (see ``model.inputs``).
        loss_fn: ``(output, targets) -> scalar`` mean loss of one micro-batch; ``output`` is
            whatever the model returns (tensor, tuple, Hugging Face ``ModelOutput``), ``targets``
            the micro-batch's targets (``None`` when the model computes its own loss).
        parallel: P, D, global batch, micro-batch size, policy, recompute, boundaries.
        sample_inputs: model inputs of one micro-batch (a tuple or a mapping of tensors with
            real values), e.g. ``(torch.zeros(b, T, dtype=torch.long),)``.
        seed: model seed; weights depend only on (seed, what the constructor did), never on P or D.
        init_fn: ``(module, name) -> None`` initialising a module's own parameters, for a model too
            large to record once; default: the model's own constructor, replayed.
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + shared loss scaler).
        grad_clip: max global gradient L2 norm, or ``None``.
        rank: this process's global rank (default ``dist.get_rank()`` or 0).
        device: default CUDA device ``rank % n_gpus`` with NCCL, else CPU.
        timeout_s: how long a stage waits for a neighbour before raising ``PeerLost``.

    Raises ``ConfigError``/``PartitionError`` (both ``ValueError``) for an invalid split before
    any tensor is allocated.
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        loss_fn: LossFn,
        parallel: ParallelConfig,
        sample_inputs: Sequence[torch.Tensor],
        *,
        seed: int = 0,
        init_fn: Callable[[nn.Module, str], None] | None = None,
        precision: str = "fp32",
        loss_scale: float = 2.0**16,
        grad_clip: float | None = None,
        rank: int | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 300.0,
        structure: ModelStructure | None = None,
    ):
        validate_parallel(parallel)
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision={precision!r}; choose fp32, bf16 or fp16")
        self.parallel = parallel
        self.topo = Topology(parallel.P, parallel.D)
        distributed = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if self.topo.world_size > 1 and not distributed:
            raise RuntimeError(
                f"P={parallel.P} × D={parallel.D} needs torch.distributed initialised with "
                f"{self.topo.world_size} ranks; use varuna_sdk.launch_local() or init_process_group first"
            )
        self.rank = rank
        self.stage, self.replica = self.topo.coords(rank)
        self.P, self.D, self.m = parallel.P, parallel.D, parallel.num_micro_batches
        self.is_first, self.is_last = self.stage == 0, self.stage == self.P - 1
        self.loss_fn, self.seed, self.precision, self.grad_clip = loss_fn, seed, precision, grad_clip
        self.timeout_s = timeout_s
        self.policy = parallel.policy
        self.recompute = default_recompute(self.policy) if parallel.recompute is None else parallel.recompute
        self.split_backward = bool(parallel.split_backward)
        if device is None:
            backend = dist.get_backend() if distributed else "gloo"
            device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        self.device = torch.device(device)

        # ---- model: trace, split, materialise this stage only --------------------------------
        self.model = build_on_meta(model_fn)
        self.structure = structure or trace_model(self.model, as_inputs(sample_inputs), self.device)
        n = self.structure.num_segments
        if parallel.boundaries is not None:
            self.stage_map = StageMap.from_lists(parallel.boundaries, n)
        else:
            self.stage_map = balanced_stage_map(segment_costs(self.structure), self.P)
        self.shared = shared_state(self.structure, self.stage_map, parallel.shared_params)
        names = stage_state_names(self.structure, self.stage_map, self.stage)
        materialize(self.model, names, seed=seed, device=self.device, init_fn=init_fn)
        self.model.train()
        a, b = self.stage_map.ranges[self.stage]
        self.start_cut, self.end_cut = a - 1, (b - 1 if b < n else -1)
        self.send_flags = [c["requires_grad"] for c in self.structure.crossings[self.end_cut]] if not self.is_last else []
        canonical = dict(self.model.named_parameters())
        self.params: list[tuple[str, nn.Parameter]] = [(nm, canonical[nm]) for nm in sorted(names) if nm in canonical]
        self._pre_stage_swaps = self._find_pre_stage_params(canonical)
        self._stub_cache: dict[tuple, list] = {}

        # ---- process groups and channels -------------------------------------------------------
        self.groups = build_groups(self.topo, rank, [tuple(s) for s in self.shared.values()])
        g = self.groups
        self.ch_act_out = Channel(self.topo.rank(self.stage + 1, self.replica), g.act_send, self.device) if not self.is_last else None
        self.ch_act_in = Channel(self.topo.rank(self.stage - 1, self.replica), g.act_recv, self.device) if not self.is_first else None
        self.ch_grad_out = Channel(self.topo.rank(self.stage - 1, self.replica), g.grad_send, self.device) if not self.is_first else None
        self.ch_grad_in = Channel(self.topo.rank(self.stage + 1, self.replica), g.grad_recv, self.device) if not self.is_last else None
        # one long-lived receiving thread per incoming channel (not one per step)
        self.rx_acts = Receiver(self.ch_act_in, timeout_s) if self.ch_act_in else None
        self.rx_grads = Receiver(self.ch_grad_in, timeout_s) if self.ch_grad_in else None

        self.scaler = LossScaler(scale=loss_scale, enabled=precision == "fp16")
        self.step_count = 0
        self.grad_sync = self._build_grad_sync()

    # ------------------------------------------------------------------------------------------
    def _build_grad_sync(self) -> GradSync:
        """The stage's gradient all-reduce, bucketed and started during the last backward: its
        data-parallel parameters (those of the last segments first, whose gradients are final
        first) over the replica group, each tied set over its stages' group."""
        last_use = {nm: max(segs) for nm, segs in self.structure.state_segments.items()}
        dp = [p for nm, p in sorted(self.params, key=lambda x: (-last_use.get(x[0], 0), x[0]))
              if nm not in self.shared]
        tied: dict[tuple, list[nn.Parameter]] = {}
        for nm, p in self.params:
            if nm in self.shared:
                tied.setdefault(tuple(self.shared[nm]), []).append(p)
        sets = [(self.groups.dp, dp)] + [(self.groups.tied.get(k), ps) for k, ps in sorted(tied.items())]
        sync = GradSync(sets, split=[True] + [False] * len(tied))
        for _, p in self.params:  # the whole backward accumulates through autograd: its hook
            p.register_post_accumulate_grad_hook(sync.ready)
        return sync

    def _find_pre_stage_params(self, canonical: dict[str, nn.Parameter]) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """Local parameters also used by segments *before* this stage (tied weights): they are
        swapped for meta stand-ins while those segments run on the meta device."""
        a = self.stage_map.ranges[self.stage][0]
        wanted = {id(canonical[nm]) for nm, segs in self.structure.state_segments.items()
                  if nm in canonical and canonical[nm].device.type != "meta" and min(segs) < a}
        swaps = []
        for mod in self.model.modules():
            for attr, p in mod._parameters.items():
                if p is not None and id(p) in wanted:
                    swaps.append((mod, attr, p))
        return swaps

    @contextlib.contextmanager
    def _meta_prefix(self, inputs: tuple):
        """While segments before this stage run: modules used only there are replaced by stubs
        that return their recorded meta outputs (so skipping them costs nothing), and local
        parameters they share (tied weights) are swapped for meta stand-ins. Yields the
        ``restore`` callback the stage calls on reaching its first cut-point."""
        if self.is_first:
            yield lambda: None
            return
        stubs = self._prefix_stubs(inputs)
        metas = [nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                 for _, _, p in self._pre_stage_swaps]
        restored = [False]

        def restore() -> None:
            if not restored[0]:
                for mod, attr, p in self._pre_stage_swaps:
                    mod._parameters[attr] = p
                for mod, _ in stubs:
                    mod.__dict__.pop("forward", None)
                restored[0] = True

        for (mod, attr, _), mp in zip(self._pre_stage_swaps, metas):
            mod._parameters[attr] = mp
        for mod, outs in stubs:
            calls = iter(outs)
            mod.forward = (lambda it: (lambda *a, **k: next(it)))(calls)
        try:
            yield restore
        finally:
            restore()

    def _prefix_stubs(self, inputs: tuple) -> list[tuple[nn.Module, list]]:
        """Record, once per input shape, the meta outputs of every module that runs only before
        this stage's first cut-point; return the outermost such modules with their outputs."""
        key = shapes_key(inputs)
        cached = self._stub_cache.get(key)
        if cached is not None:
            return cached
        calls: dict[nn.Module, list] = {}
        parents: dict[nn.Module, nn.Module] = {}
        for mod in self.model.modules():
            for child in mod.children():
                parents.setdefault(child, mod)
        stop = self.start_cut
        # Modules whose own call crosses a cut-point (``CutPoint`` modules, wrappers around them)
        # must not be stubbed: the stage has to observe every crossing to count cut-points.
        running: list[nn.Module] = []
        crossing: set[nn.Module] = set()

        class _Stop:
            k = 0

            def at_cutpoint(self, tensors):
                crossing.update(running)
                if self.k == stop:
                    raise _StageExit(tensors)
                self.k += 1
                return tensors

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
        swaps = [(mod, attr, p) for mod, attr, p in self._pre_stage_swaps]
        try:
            for mod, attr, p in swaps:
                mod._parameters[attr] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            with torch.no_grad(), observe_cutpoints(_Stop()), MetaAsDevice(self.device):
                try:
                    call_model(self.model, inputs)
                except _StageExit:
                    pass
        finally:
            for h in handles:
                h.remove()
            for mod, attr, p in swaps:
                mod._parameters[attr] = p

        def covered(m: nn.Module) -> bool:
            a = parents.get(m)
            while a is not None:
                if a in calls and a not in crossing and a not in real_out:
                    return True
                a = parents.get(a)
            return False

        # a module whose output holds a real tensor computed it from the inputs alone (positions,
        # masks): it runs every time (it is cheap), so that its values follow each micro-batch
        real_out = {m for m, outs in calls.items() if any(t.device.type != "meta" for t in tensors_of(outs))}
        stubs = [(m, outs) for m, outs in calls.items()
                 if m not in crossing and m not in real_out and not covered(m)]
        self._stub_cache[key] = stubs
        return stubs

    def parameters(self) -> list[nn.Parameter]:
        """This stage's parameters (tied ones once) — pass them to a torch optimizer."""
        return [p for _, p in self.params]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(canonical name, parameter) of this stage, sorted by name."""
        return list(self.params)

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _forward(self, inputs: ModelInputs, received: tuple | None, mb: int, grad: bool):
        """Run this stage's part of the user forward for global micro-batch ``mb``."""
        with forked_rng(), self._meta_prefix(inputs) as restore, torch.set_grad_enabled(grad), self._autocast():
            mode = None if self.is_first else MetaAsDevice(self.device)
            run = _StageRun(self.start_cut, self.end_cut, received, self.seed, self.step_count, mb, restore, mode)
            seed_segment(self.seed, self.step_count, mb, 0)
            with observe_cutpoints(run), (mode if mode is not None else contextlib.nullcontext()):
                try:
                    out = call_model(self.model, inputs)
                except _StageExit as e:
                    return e.tensors
            if not run.entered:
                raise RuntimeError(
                    f"stage {self.stage}: the forward never reached cut-point {self.start_cut}; the model "
                    "must cross the same cut-points on every forward"
                )
            if not self.is_last:
                raise RuntimeError(
                    f"stage {self.stage}: the forward finished before cut-point {self.end_cut}; the model "
                    "must cross the same cut-points on every forward"
                )
            return out

    # ------------------------------------------------------------------------------------------
    def step(self, batch: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> StepResult:
        """One optimizer step on one mini-batch (collective: every rank calls it).

        Args:
            batch: ``(inputs, targets)`` — inputs a tensor, a tuple of tensors or a mapping of
                keyword arguments, targets a tensor (any nesting) or ``None``, all with the batch as
                leading dimension; the global batch or this replica's share (``global/D``).
            optimizer: built on ``self.parameters()``; stepped here unless the step overflows.

        Returns a ``StepResult`` (loss = mini-batch mean over all replicas). Raises ``PeerLost``
        if a neighbouring stage dies, ``ValueError`` for a wrongly sized batch.
        """
        t0 = time.perf_counter()
        inputs, targets = split_batch(batch, self.parallel.global_batch, self.parallel.replica_batch, self.replica)
        inputs = to_device(inputs, self.device, non_blocking=True)
        targets = to_device(targets, self.device, non_blocking=True)
        b = self.parallel.micro_batch_size
        mb_in = [rows(inputs, i * b, (i + 1) * b) for i in range(self.m)]
        mb_tg = [rows(targets, i * b, (i + 1) * b) for i in range(self.m)]
        base = self.replica * self.m
        scale = self.scaler.scale
        self._begin_step()
        acts, grads = self.rx_acts, self.rx_grads
        for rx in (acts, grads):
            if rx is not None:
                rx.start(self.m)
        sched = StageScheduler(self.policy, self.P, self.m, self.stage, self.recompute, self.split_backward)
        stash: dict[int, tuple] = {}  # mb -> received inputs (recompute) or (leaves, outputs)
        live: dict[int, tuple] = {}  # mb -> (leaves, outputs) with a graph
        deferred: dict[int, WeightWork] = {}  # mb -> its weight-gradient work (split backward)
        loss_sum = torch.zeros((), device=self.device)
        timing = {"F": 0.0, "R": 0.0, "B": 0.0, "W": 0.0}
        waited = {"F": 0.0, "B": 0.0}   # blocked on an input, taken out of the action's time
        recv_flags = [c["requires_grad"] for c in self.structure.crossings[self.start_cut]] if not self.is_first else []
        grad_kind = "W" if self.split_backward else "B"  # the actions that accumulate weight gradients
        grad_actions = 0
        while True:
            action = sched.next(acts.arrived if acts else 0, grads.arrived if grads else 0)
            if action is None:
                break
            i, kind = action.mb, action.kind
            if kind == grad_kind:
                grad_actions += 1
                if grad_actions == self.m:  # gradients turn final in this action: start their all-reduce
                    self.grad_sync.arm()
            ta = time.perf_counter()
            w = 0.0
            if kind == "F":
                received = None
                if acts is not None:
                    tensors, _ = acts.get(i)
                    w = time.perf_counter() - ta
                    acts.release(i)
                    received = tuple(tensors)
                with_grad = self.is_last or not self.recompute
                leaves = self._leaves(received, recv_flags, with_grad)
                out = self._forward(mb_in[i], leaves, base + i, grad=with_grad)
                if self.is_last:
                    loss = self.loss_fn(out, mb_tg[i])
                    live[i] = (leaves, (loss,))
                    loss_sum = loss_sum + loss.detach()
                else:
                    self.ch_act_out.send(out, self.send_flags)
                    if with_grad:
                        live[i] = (leaves, _as_tuple(out))
                    else:
                        stash[i] = received
            elif kind == "R":
                received = stash.pop(i)
                leaves = self._leaves(received, recv_flags, True)
                out = self._forward(mb_in[i], leaves, base + i, grad=True)
                live[i] = (leaves, _as_tuple(out))
            elif kind == "W":
                deferred.pop(i).run(on_group=self._weights_final if grad_actions == self.m else None)
            else:  # "B"
                leaves, outs = live.pop(i)
                if self.is_last:
                    roots, gouts = [outs[0] * (scale / self.m)], [None]
                else:
                    tw = time.perf_counter()
                    g_tensors, _ = grads.get(i)
                    w = time.perf_counter() - tw
                    grads.release(i)
                    # g_tensors holds one gradient per *flagged* output, in order (see _input_grads),
                    # so pair them with the flagged outputs, not positionally with all outputs.
                    flagged = [o for o, f in zip(outs, self.send_flags) if f]
                    pairs = [(o, g) for o, g in zip(flagged, g_tensors) if o.requires_grad]
                    roots, gouts = [o for o, _ in pairs], [g for _, g in pairs]
                if self.split_backward:
                    deferred[i] = self._backward_input(roots, gouts, leaves)
                elif roots:
                    torch.autograd.backward(roots, gouts if not self.is_last else None)
                if not self.is_first:
                    self.ch_grad_out.send(self._input_grads(leaves, recv_flags))
            timing[kind] += time.perf_counter() - ta - w
            if w:
                waited[kind] += w
        for r in (acts, grads):
            if r is not None:
                r.join()
        for ch in (self.ch_act_out, self.ch_grad_out):
            if ch is not None:
                ch.wait_sends()
        loss_local = loss_sum / self.m if self.is_last else loss_sum
        result = self._sync_and_step(optimizer, loss_local)
        result.time_s = time.perf_counter() - t0
        result.compute_s = timing
        result.wait_s = waited
        self.step_count += 1
        return result

    def _begin_step(self) -> None:
        for ch in (self.ch_act_out, self.ch_act_in, self.ch_grad_out, self.ch_grad_in):
            if ch is not None:
                ch.begin_step()

    def _weights_final(self, weights: list, _seconds: float) -> None:
        for w in weights:
            self.grad_sync.ready(w)

    def _backward_input(self, roots: list, gouts: list, leaves: tuple | None) -> WeightWork:
        """B of the split backward: the input gradients into the leaves' ``.grad`` (what
        ``_input_grads`` sends), the weight-gradient work returned for a later W."""
        inputs = list(leaves) if leaves is not None else []
        got, work = backward_input(roots, gouts, inputs, self.parameters())
        for t, g in zip(inputs, got):
            if g is not None:
                t.grad = g
        return work

    def _leaves(self, received: tuple | None, flags: Sequence[bool], with_grad: bool) -> tuple | None:
        if received is None:
            return None
        return tuple(
            t.detach().requires_grad_(bool(with_grad and f and t.is_floating_point())) for t, f in zip(received, flags)
        )

    def _input_grads(self, leaves: tuple, flags: Sequence[bool]) -> list[torch.Tensor]:
        out = []
        for t, f in zip(leaves, flags):
            if f and t.is_floating_point():
                out.append(t.grad if t.grad is not None else torch.zeros_like(t))
        return out

    # ------------------------------------------------------------------------------------------
    def _sync_and_step(self, optimizer: torch.optim.Optimizer, loss_local: torch.Tensor) -> StepResult:
        """Tied-weight sum and DP all-reduce (mean over replicas; started during the last backward,
        finished here), consensus, clipping, step."""
        self.grad_sync.finish(1.0 / (self.scaler.scale * self.D))
        norm_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        finite = torch.ones((), dtype=torch.float32, device=self.device)
        counted = [p.grad for name, p in self.params
                   if not (name in self.shared and self.shared[name][0] != self.stage)]  # tied: counted once
        if counted:
            norm_sq = torch.stack([n.float() for n in torch._foreach_norm(counted)]).pow(2).sum()
        finite = torch.isfinite(norm_sq).float()
        stats = torch.stack([1.0 - finite, torch.nan_to_num(norm_sq, nan=0.0, posinf=0.0) / self.D,
                             loss_local.float() / self.D])
        if self.topo.world_size > 1:
            dist.all_reduce(stats)
        overflow = bool(stats[0].item() > 0)
        total_norm = float(stats[1].sqrt().item()) if not overflow else float("inf")
        loss = float(stats[2].item())
        if not overflow and self.grad_clip is not None:
            coef = self.grad_clip / (total_norm + 1e-6)
            if coef < 1.0:
                for _, p in self.params:
                    p.grad.mul_(coef)
        if not overflow:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.scaler.update(overflow)
        return StepResult(step=self.step_count, loss=loss, grad_norm=total_norm, skipped=overflow,
                          loss_scale=self.scaler.scale, time_s=0.0)

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batch: Sequence[torch.Tensor]) -> float:
        """Mean loss over a held-out mini-batch (forward only, no RNG effect on training;
        collective). Dropout is off during evaluation."""
        inputs, targets = split_batch(batch, self.parallel.global_batch, self.parallel.replica_batch, self.replica)
        inputs = to_device(inputs, self.device)
        targets = to_device(targets, self.device)
        b = self.parallel.micro_batch_size
        self._begin_step()
        acts = self.rx_acts
        if acts is not None:
            acts.start(self.m)
        recv_flags = [False] * (len(self.structure.crossings[self.start_cut]) if not self.is_first else 0)
        total = torch.zeros((), device=self.device)
        self.model.eval()
        try:
            for i in range(self.m):
                received = tuple(acts.get(i)[0]) if acts else None
                if acts:
                    acts.release(i)
                out = self._forward(rows(inputs, i * b, (i + 1) * b), self._leaves(received, recv_flags, False),
                                    self.replica * self.m + i, grad=False)
                if self.is_last:
                    total += self.loss_fn(out, rows(targets, i * b, (i + 1) * b)).float()
                else:
                    self.ch_act_out.send(out, [False] * len(out))
        finally:
            self.model.train()
        if acts:
            acts.join()
        if self.ch_act_out:
            self.ch_act_out.wait_sends()
        stat = (total / self.m / self.D).reshape(1)
        if self.topo.world_size > 1:
            dist.all_reduce(stat)
        return float(stat.item())

    def describe(self) -> str:
        """One line: rank, stage, replica, segments and parameter count of this stage."""
        a, b = self.stage_map.ranges[self.stage]
        nparam = sum(p.numel() for _, p in self.params)
        return (f"rank {self.rank}: stage {self.stage}/{self.P} replica {self.replica}/{self.D} "
                f"segments {a}..{b - 1} params {nparam:,} policy {self.policy} recompute {self.recompute}"
                f"{' split backward' if self.split_backward else ''}")
