"""The training engine: ``Varuna(...).step(batch, optimizer)`` on one rank of a P × D job.

Owns one rank's stage: building it (trace on meta, split, materialise only local parameters),
running the schedule policy (from csrc, the same code the simulator uses) over its
micro-batches — one method per action kind, forward (F), recompute (R), backward (B) and, with
the split backward, weight gradients (W), dispatched from a table keyed by the kind as
torch.distributed.pipelining's executor does — and the end-of-step synchronisation: tied-weight
gradient sum, data-parallel all-reduce, running statistics (BatchNorm) merged over the replicas
(``pipeline.running_stats``), one world-wide consensus of (overflow, grad-norm², loss),
global-norm clipping, loss-scale update and the optimizer step.
Paper §3.2, §5.2, §6; varuna-original.md §3, §8 — with its bugs fixed: fp32 gradients are
reduced, RNG is forked (never rewound), the loss is the mini-batch mean over all replicas,
``shared_params=None`` works, and short micro-batches cannot occur (the batch identity is
validated up front).

A stage's forward runs the user's whole ``forward`` on the real inputs, the segments before the
stage on the ``meta`` device at almost no cost: how, and why, is ``pipeline.stage_prefix``.

Imports ``config``, ``model`` and the rest of ``pipeline``; never imports
``varuna_sdk.checkpoint``/``profiling``/``planner``/``cluster``/``manager`` or anything above.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ..config import PRECISIONS, ParallelConfig, validate_parallel
from ..model.cutpoint import observe_cutpoints
from ..model.hybrid import MetaAsDevice
from ..model.inputs import ModelInputs, as_inputs, call_model, leading_dim, rows, to_device
from ..model.loss_items import LossItems
from ..model.materialize import build_on_meta, materialize
from ..model.partition import StageMap, balanced_stage_map, shared_state, stage_state_names, unsplittable_cuts
from ..model.rng import forked_rng, loss_rng, seed_segment
from ..model.spec import ModelSpecError
from ..model.state_kept import InPlaceUpdates
from ..model.tracer import ModelStructure, loss_after, segment_costs, trace_model
from .comm import Channel, Receiver
from .grad_sync import GradSync
from .groups import Topology, build_groups
from .scaler import LossScaler
from .running_stats import RunningStats
from .schedule import StageScheduler, default_recompute
from .split_backward import WeightWork, backward_input
from .stage_prefix import Carried, Recomputing, StageExit, StagePrefix, StageRun

#: torch's words for a class id beyond the logits (``nll_loss``'s check on CPU)
_ID_OUT_OF_BOUNDS = re.compile(r"Target -?\d+ is out of bounds")

LossFn = Callable[[object, object], torch.Tensor]  # (model output, targets) -> scalar mean loss


@dataclass
class StepResult:
    """What one optimizer step did. ``loss`` is the mean over the whole mini-batch (all
    micro-batches of all replicas); ``grad_norm`` the global L2 norm before clipping (tied
    weights counted once); ``skipped`` is True when any stage overflowed (fp16). ``time_s``: the
    whole step (seconds); ``compute_s``: this stage's seconds per action kind over the step
    (``{"F", "R", "B"}``, computing only); ``wait_s``: seconds blocked waiting for an input
    that had not arrived (``"F"``: an activation from the stage before, ``"B"``: a gradient from
    the stage after) — the pipeline bubble as this stage saw it, never counted as compute.
    ``model_s``: the part of ``compute_s`` spent inside the model itself — its forward and the
    loss (F, R), autograd's backward (B, W) — so that ``compute_s - model_s`` is the engine's own
    work per action kind (scheduling, RNG, receiving, sending, bookkeeping; seconds).
    ``peak_live_graphs``: the most micro-batches whose activations (autograd graph, or deferred
    weight-gradient work) this stage held at once during the step — at most its in-flight cap
    when it has one (``parallel.max_in_flight``)."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    time_s: float
    compute_s: dict[str, float] = field(default_factory=dict)
    wait_s: dict[str, float] = field(default_factory=dict)
    peak_live_graphs: int = 0
    model_s: dict[str, float] = field(default_factory=dict)


@dataclass
class _StepState:
    """One step's bookkeeping on this stage, shared by the action methods.

    ``mb_in``/``mb_tg``: the replica's micro-batches (inputs, targets); ``base``: the global index
    of its first micro-batch; ``scale``: the loss scale of the step; ``recv_flags``/``sent_flags``:
    micro-batch -> which received tensors get a gradient sent back / which sent ones get one; ``stash``: micro-batch -> received inputs awaiting R; ``live``:
    micro-batch -> (leaves, outputs) with a graph awaiting B; ``deferred``: micro-batch -> its
    weight-gradient work awaiting W; ``carried``: micro-batch -> the crossing tensors its forward
    replaced by received ones (``StageRun.carried``), until its backward is done (a block run under
    ``torch.utils.checkpoint`` is recomputed then, with them); ``compute_s``/``model_s``: seconds per action kind in the
    action / inside the model (``StepResult``); ``grad_actions``: gradient-accumulating actions run so far;
    ``peak_live``: the most entries of ``live`` + ``deferred`` at once so far."""

    mb_in: list
    mb_tg: list
    base: int
    scale: float
    loss_sum: torch.Tensor
    recv_flags: dict[int, list[bool]] = field(default_factory=dict)
    sent_flags: dict[int, list[bool]] = field(default_factory=dict)   # micro-batch -> which sent outputs get a gradient
    stash: dict[int, tuple | None] = field(default_factory=dict)
    buffers_before: dict[int, dict] = field(default_factory=dict)   # micro-batch -> updated buffers as its F found them
    live: dict[int, tuple] = field(default_factory=dict)
    deferred: dict[int, WeightWork] = field(default_factory=dict)
    carried: dict[int, Carried] = field(default_factory=dict)
    compute_s: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "R": 0.0, "B": 0.0, "W": 0.0})
    model_s: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "R": 0.0, "B": 0.0, "W": 0.0})
    wait_s: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0})
    grad_actions: int = 0
    peak_live: int = 0
    mb_host: list = field(default_factory=list)   # targets on the host, per micro-batch (Varuna._micro_batches)
    items: list[float] | None = None   # last stage, counting loss items: valid items (or their class-weight sum) per micro-batch
    positions: int = 0               # ... and the positions the loss compares, over the replica's micro-batches


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
        sample_targets: that micro-batch's targets (the loss's second argument): the trace runs
            the loss too, so that its use of a tensor from an earlier segment is seen (refused, or
            kept on one stage), as ``trainer.check_partition`` sees it. None: the forward only.
        seed: model seed; weights depend only on (seed, what the constructor did), never on P or D.
        init_fn: ``(module, name) -> None`` initialising a module's own parameters, for a model too
            large to record once; default: the model's own constructor, replayed.
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + shared loss scaler).
        grad_clip: max global gradient L2 norm, or ``None``.
        rank: this process's global rank (default ``dist.get_rank()`` or 0).
        device: default CUDA device ``rank % n_gpus`` with NCCL, else CPU.
        timeout_s: how long a stage waits for a neighbour before raising ``PeerLost``.
        loss_items: where the loss's items (valid tokens) are counted in a micro-batch
            (``model.loss_items``, ``trainer.loss_items_of``): each micro-batch's mean loss is then
            weighted by its items, and the step's loss and gradients are the mean over the
            mini-batch's items at any micro-batch size; None (default): the mean of the micro-batch
            means.

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
        sample_targets: Any = None,
        loss_items: LossItems | None = None,
    ):
        validate_parallel(parallel)
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}; choose fp32, bf16 or fp16")
        self.parallel = parallel
        self.topo = Topology(parallel.P, parallel.D)
        distributed = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if self.topo.world_size > 1 and not distributed:
            raise RuntimeError(
                f"P={parallel.P} × D={parallel.D} needs torch.distributed initialised with "
                f"{self.topo.world_size} ranks; start the job with `varuna train job.yaml` (or "
                "varuna_sdk.runner.train_local, or Job(...).launch() in a notebook), which starts one "
                "process per rank, or call torch.distributed.init_process_group in each process first"
            )
        self.rank = rank
        self.stage, self.replica = self.topo.coords(rank)
        self.P, self.D, self.m = parallel.P, parallel.D, parallel.num_micro_batches
        self.is_first, self.is_last = self.stage == 0, self.stage == self.P - 1
        self.loss_fn, self.seed, self.precision, self.grad_clip = loss_fn, seed, precision, grad_clip
        self.timeout_s = timeout_s
        self.policy = parallel.policy
        rec = default_recompute(self.policy) if parallel.recompute is None else parallel.recompute
        # every stage's scheduler needs all stages' flags (Varuna's static order depends on them)
        self.stage_recompute = [bool(x) for x in rec] if isinstance(rec, (list, tuple)) else [bool(rec)] * self.P
        if len(self.stage_recompute) != self.P:
            raise ValueError(f"parallel.recompute lists {len(self.stage_recompute)} stages but P={self.P}; give one "
                             "flag per stage, or one bool for every stage")
        self.recompute = self.stage_recompute[self.stage] and not self.is_last
        self.stage_caps = parallel.stage_caps(self.P)
        self.max_in_flight = self.stage_caps[self.stage]
        self.split_backward = bool(parallel.split_backward)
        #: Most micro-batches whose activation graph this stage held at once (awaiting B or W), over
        #: every step so far: with an in-flight cap, at most ``max_in_flight``.
        self.peak_live_graphs = 0
        if device is None:
            backend = dist.get_backend() if distributed else "gloo"
            device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self._build_stage(model_fn, sample_inputs, structure, init_fn, sample_targets)
        #: where the last stage counts a micro-batch's loss items (valid tokens), so that the loss is
        #: the mean over the mini-batch's items at any micro-batch size (``model.loss_items``); None:
        #: the mean of the micro-batch means (every micro-batch holds as many items)
        self.loss_items = loss_items
        #: the items (valid tokens) of the last ``evaluate``'s mini-batch, counting them (else None)
        self.eval_items: float | None = None
        self._open_channels(rank)
        # BatchNorm-like running statistics, merged over the stage's replicas after each step
        self.running_stats = RunningStats(self.model, self.replica, self.D, self.groups.dp)
        self.scaler = LossScaler(scale=loss_scale, enabled=precision == "fp16")
        self.step_count = 0
        self.grad_sync = self._build_grad_sync()

    # ------------------------------------------------------------------------------------------
    def _build_stage(self, model_fn: Callable[[], nn.Module], sample_inputs: Sequence[torch.Tensor],
                     structure: ModelStructure | None, init_fn: Callable[[nn.Module, str], None] | None,
                     sample_targets: Any = None) -> None:
        """The model: trace on meta (with the loss on ``sample_targets`` when given, so that the
        loss's uses of earlier segments' tensors shape the split, as the launcher's check saw them),
        split into stages, materialise this stage only."""
        parallel = self.parallel
        self.model = build_on_meta(model_fn)
        if structure is None:
            targets = tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, sample_targets)
            after = loss_after(self.loss_fn, targets) if sample_targets is not None else None
            structure = trace_model(self.model, as_inputs(sample_inputs), self.device, after=after, targets=targets)
        self.structure = structure
        n = self.structure.num_segments
        if parallel.boundaries is not None:
            self.stage_map = StageMap.from_lists(parallel.boundaries, n)
        else:
            self.stage_map = balanced_stage_map(segment_costs(self.structure), self.P,
                                                unsplittable_cuts(self.structure))
        self.shared = shared_state(self.structure, self.stage_map, parallel.shared_params)
        names = stage_state_names(self.structure, self.stage_map, self.stage)
        materialize(self.model, names, seed=self.seed, device=self.device, init_fn=init_fn)
        self.model.train()
        a, b = self.stage_map.ranges[self.stage]
        self.start_cut, self.end_cut = a - 1, (b - 1 if b < n else -1)
        # the stage's operations use a received tensor by its object from before the cut (h + layer(h))
        self._carried_uses = a > 0 and any(a <= cons < b and a - 1 in cuts
                                           for _, cons, _, cuts in self.structure.carried_uses)
        self.send_flags = [c["requires_grad"] for c in self.structure.crossings[self.end_cut]] if not self.is_last else []
        # (floating?, rank) of each traced output: outputs of those kinds take send_flags (autocast may change a dtype)
        self._end_kinds = [(getattr(torch, c["dtype"]).is_floating_point, len(c["shape"]))
                           for c in self.structure.crossings[self.end_cut]] if not self.is_last else []
        canonical = dict(self.model.named_parameters())
        self.params: list[tuple[str, nn.Parameter]] = [(nm, canonical[nm]) for nm in sorted(names) if nm in canonical]
        self.prefix = StagePrefix(self.model, self.structure, a, self.device)
        # buffers this stage's forward updates in place (BatchNorm statistics): kept through a recompute
        self.in_place = InPlaceUpdates(self.model)

    def _open_channels(self, rank: int) -> None:
        """Process groups, the four p2p channels to the neighbouring stages of this replica (``None``
        at the pipeline's ends) and one long-lived receiving thread per incoming channel."""
        self.groups = build_groups(self.topo, rank, [tuple(s) for s in self.shared.values()])
        g, s, r = self.groups, self.stage, self.replica
        # a link crossed by tensors made from the inputs (masks) may carry other tensors per micro-batch
        out_varies = not self.is_last and self.structure.input_crossings[self.end_cut]
        in_varies = not self.is_first and self.structure.input_crossings[self.start_cut]
        self.ch_act_out = Channel(self.topo.rank(s + 1, r), g.act_send, self.device,
                                  header_per_message=out_varies) if not self.is_last else None
        self.ch_act_in = Channel(self.topo.rank(s - 1, r), g.act_recv, self.device,
                                 header_per_message=in_varies) if not self.is_first else None
        self.ch_grad_out = Channel(self.topo.rank(s - 1, r), g.grad_send, self.device,
                                   header_per_message=in_varies) if not self.is_first else None
        self.ch_grad_in = Channel(self.topo.rank(s + 1, r), g.grad_recv, self.device,
                                  header_per_message=out_varies) if not self.is_last else None
        self.rx_acts = Receiver(self.ch_act_in, self.timeout_s) if self.ch_act_in else None
        self.rx_grads = Receiver(self.ch_grad_in, self.timeout_s) if self.ch_grad_in else None

    # ------------------------------------------------------------------------------------------
    def _build_grad_sync(self) -> GradSync:
        """The stage's gradient all-reduce, bucketed and started during the last backward: its
        data-parallel parameters (those of the last segments first, whose gradients are final
        first) over the replica group, each tied set over its stages' group."""
        last_use = {nm: max(segs) for nm, segs in self.structure.state_segments.items()}
        trained = [(nm, p) for nm, p in self.params if p.requires_grad]  # frozen weights get no gradient
        dp = [p for nm, p in sorted(trained, key=lambda x: (-last_use.get(x[0], 0), x[0]))
              if nm not in self.shared]
        tied: dict[tuple, list[nn.Parameter]] = {}
        for nm, p in trained:
            if nm in self.shared:
                tied.setdefault(tuple(self.shared[nm]), []).append(p)
        sets = [(self.groups.dp, dp)] + [(self.groups.tied.get(k), ps) for k, ps in sorted(tied.items())]
        sync = GradSync(sets, split=[True] + [False] * len(tied))
        for _, p in trained:  # the whole backward accumulates through autograd: its hook
            p.register_post_accumulate_grad_hook(sync.ready)
        return sync

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

    def _forward(self, inputs: ModelInputs, received: tuple | None, mb: int, grad: bool,
                 model_s: dict[str, float] | None = None, kind: str = "F", carried: dict | None = None):
        """Run this stage's part of the user forward for global micro-batch ``mb`` (the prefix on
        meta, see ``stage_prefix``): the stage's output tensors, or on the last stage the model's
        output. ``model_s[kind]``, when given, gets the seconds inside the model's own forward;
        ``carried[mb]``, when given, the crossing tensors the received ones replaced (for the
        backward: ``Recomputing``). Raises ``RuntimeError`` if the forward skips the stage's cut-points."""
        with forked_rng(), self.prefix.running(inputs) as restore, torch.set_grad_enabled(grad), self._autocast():
            mode = None if self.is_first else MetaAsDevice(self.device, cache=self.prefix.meta_cache)
            run = StageRun(self.start_cut, self.end_cut, received, self.seed, self.step_count, mb, restore, mode,
                           everywhere=self._carried_uses)
            seed_segment(self.seed, self.step_count, mb, 0)
            with observe_cutpoints(run), (mode if mode is not None else contextlib.nullcontext()):
                t0 = time.perf_counter()
                try:
                    out = call_model(self.model, inputs)
                except StageExit as e:
                    return e.tensors
                except IndexError as e:   # a model computing its own loss (labels=) on class ids beyond its outputs
                    if not _ID_OUT_OF_BOUNDS.search(str(e)):
                        raise
                    raise ModelSpecError(
                        f"the model's forward failed: {str(e).rstrip('.')}: a class id in the labels of step "
                        f"{self.step_count} is not below the number of classes the model outputs (its own loss "
                        "computes a cross-entropy on them); class ids must be 0 .. C-1 — check the model's number "
                        "of classes (a Hugging Face config's num_labels) against the data's labels") from e
                finally:
                    run.close()
                    if model_s is not None:
                        model_s[kind] += time.perf_counter() - t0
                    if carried is not None and run.carried:
                        carried[mb] = run.carried
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
        st = self._begin_train_step(batch)
        self.running_stats.begin()
        self._run_schedule(st)
        self._end_transfers()
        self.running_stats.merge()
        loss_local = st.loss_sum / self.m if self.is_last and st.items is None else st.loss_sum
        counts = (float(sum(st.items)), float(st.positions)) if st.items is not None else (0.0, 0.0)
        result = self._sync_and_step(optimizer, loss_local, counts)
        result.time_s = time.perf_counter() - t0
        result.compute_s = st.compute_s
        result.wait_s = st.wait_s
        result.model_s = st.model_s
        result.peak_live_graphs = st.peak_live
        self.step_count += 1
        return result

    def _micro_batches(self, batch: Sequence, non_blocking: bool = False) -> tuple[list, list, list]:
        """This replica's ``(inputs, targets)`` cut into ``m`` micro-batches on the stage's device,
        and the targets' micro-batches as read (on the host) where the last stage computes on
        another device and its loss checks targets (``check_targets``; else ``None`` each)."""
        inputs, targets = split_batch(batch, self.parallel.global_batch, self.parallel.replica_batch, self.replica)
        b = self.parallel.micro_batch_size
        host = [None] * self.m
        if self.is_last and self.device.type != "cpu" and getattr(self.loss_fn, "check_targets", None) is not None:
            host = [rows(targets, i * b, (i + 1) * b) for i in range(self.m)]
        inputs = to_device(inputs, self.device, non_blocking=non_blocking)
        targets = to_device(targets, self.device, non_blocking=non_blocking)
        return ([rows(inputs, i * b, (i + 1) * b) for i in range(self.m)],
                [rows(targets, i * b, (i + 1) * b) for i in range(self.m)], host)

    def _loss(self, out: Any, targets: Any, host: Any, mb: int) -> torch.Tensor:
        """The last stage's loss of ``out``. A loss with a ``check_targets(output, targets)`` hook
        first checks ``host``, the targets' copy on the host (None on a CPU stage, where the loss
        itself raises the clear error): on CUDA a class id beyond the logits would otherwise be a
        device-side assert that poisons the process, not an error naming the id
        (``model.spec.cross_entropy``). Runs under the forward's autocast (bf16/fp16), as PyTorch's
        AMP recipe and the plain reference (``varuna_sdk.reference``) compute the loss: autocast
        takes a cross-entropy of bf16 logits in fp32."""
        if host is not None:
            self.loss_fn.check_targets(out, host)
        try:
            with self._autocast(), loss_rng(self.seed, self.step_count, mb):
                return self.loss_fn(out, targets)
        except IndexError as e:   # a loss of the user's own on class ids beyond the logits (on CPU)
            if not _ID_OUT_OF_BOUNDS.search(str(e)):
                raise
            shape = f" (the output is {tuple(out.shape)})" if isinstance(out, torch.Tensor) else ""
            raise ModelSpecError(f"the loss failed: {str(e).rstrip('.')}: a class id in the targets of step {self.step_count} is "
                                 f"not below the number of classes the model outputs{shape}; class ids must be "
                                 "0 .. C-1 — check the model's number of classes against the data's labels") from e

    def _begin_train_step(self, batch: Sequence) -> _StepState:
        """Cut the batch, open the channels' step and start both receivers for ``m`` messages."""
        mb_in, mb_tg, mb_host = self._micro_batches(batch, non_blocking=True)
        items, positions = self._item_counts(batch)
        self._begin_step()
        for rx in (self.rx_acts, self.rx_grads):
            if rx is not None:
                rx.start(self.m)
        return _StepState(mb_in, mb_tg, base=self.replica * self.m, scale=self.scaler.scale,
                          loss_sum=torch.zeros((), device=self.device), mb_host=mb_host, items=items,
                          positions=positions)

    def _item_counts(self, batch: Sequence) -> tuple[list[float] | None, int]:
        """On the last stage of a job counting loss items: each micro-batch's valid items and the
        positions of all (``LossItems.count``, on the batch as read: no device sync); ``(None, 0)``
        elsewhere."""
        if not (self.is_last and self.loss_items is not None):
            return None, 0
        inputs, targets = split_batch(batch, self.parallel.global_batch, self.parallel.replica_batch, self.replica)
        b = self.parallel.micro_batch_size
        counts = [self.loss_items.count(rows(inputs, i * b, (i + 1) * b), rows(targets, i * b, (i + 1) * b))
                  for i in range(self.m)]
        return [n for n, _ in counts], sum(k for _, k in counts)

    def _run_schedule(self, st: _StepState) -> None:
        """Ask the policy for the next action given what has arrived, run it, until the step's
        schedule is done; each action kind has its own method (the table below)."""
        actions: dict[str, Callable[[_StepState, int], float]] = {
            "F": self._run_forward, "R": self._run_recompute, "B": self._run_backward, "W": self._run_weights}
        sched = StageScheduler(self.policy, self.P, self.m, self.stage, self.stage_recompute, self.split_backward,
                               self.stage_caps)
        acts, grads = self.rx_acts, self.rx_grads
        while True:
            action = sched.next(acts.arrived if acts else 0, grads.arrived if grads else 0)
            if action is None:
                return
            self._count_grad_action(st, action.kind)
            ta = time.perf_counter()
            waited = actions[action.kind](st, action.mb)
            st.peak_live = max(st.peak_live, len(st.live) + len(st.deferred))
            self.peak_live_graphs = max(self.peak_live_graphs, st.peak_live)
            st.compute_s[action.kind] += time.perf_counter() - ta - waited
            if waited:
                st.wait_s[action.kind] += waited

    def _count_grad_action(self, st: _StepState, kind: str) -> None:
        """Count the actions that accumulate weight gradients (B, or W with the split backward); the
        ``m``-th makes them final, so the gradient all-reduce is armed to start during it."""
        if kind == ("W" if self.split_backward else "B"):
            st.grad_actions += 1
            if st.grad_actions == self.m:
                self.grad_sync.arm()

    @staticmethod
    def _receive(rx: Receiver | None, mb: int) -> tuple[tuple | None, list[bool], float]:
        """Micro-batch ``mb``'s tensors from ``rx`` (``None`` without a receiver), which of them
        need a gradient sent back (the sender's flags), and the seconds spent blocked waiting."""
        if rx is None:
            return None, [], 0.0
        t = time.perf_counter()
        tensors, flags = rx.get(mb)
        waited = time.perf_counter() - t
        rx.release(mb)
        return tuple(tensors), list(flags), waited

    def _send_flags(self, out: tuple, grad: bool) -> list[bool]:
        """Which of this stage's outputs the next stage sends a gradient back for: the traced
        crossing's flags when the outputs are of its kinds (floating or not) and ranks; for other
        crossing tensors (a micro-batch whose mask the model made, or left out, unlike the traced
        one) the floating outputs that require a gradient — every floating one after a forward
        without a graph (the sender drops the gradients of those that turn out to need none)."""
        traced = self._end_kinds
        if len(out) == len(traced) and all((t.is_floating_point(), t.dim()) == k for t, k in zip(out, traced)):
            return self.send_flags
        return [t.is_floating_point() and (t.requires_grad or not grad) for t in out]

    def _run_forward(self, st: _StepState, i: int) -> float:
        """F of micro-batch ``i``: receive, run the stage forward, send the outputs on (or take the
        loss on the last stage); without a graph when it will be recomputed, stashing the input.
        Returns the seconds spent waiting for the activation."""
        received, flags, waited = self._receive(self.rx_acts, i)
        st.recv_flags[i] = flags
        with_grad = self.is_last or not self.recompute
        leaves = self._leaves(received, flags, with_grad)
        with self.in_place.watch() if not with_grad else contextlib.nullcontext() as before:
            out = self._forward(st.mb_in[i], leaves, st.base + i, grad=with_grad, model_s=st.model_s,
                                carried=st.carried if with_grad else None)
        if before:   # the buffers this forward updated, as it found them: what its recompute must see
            st.buffers_before[i] = before
        if self.is_last:
            t0 = time.perf_counter()
            loss = self._loss(out, st.mb_tg[i], st.mb_host[i], st.base + i)
            st.model_s["F"] += time.perf_counter() - t0
            st.live[i] = (leaves, (loss,))
            if st.items is None:
                st.loss_sum = st.loss_sum + loss.detach()
            elif st.items[i]:   # a micro-batch with no item has a NaN mean and no share of the loss
                st.loss_sum = st.loss_sum + loss.detach() * st.items[i]
        else:
            st.sent_flags[i] = self._send_flags(out, with_grad)
            self.ch_act_out.send(out, st.sent_flags[i])
            if with_grad:
                st.live[i] = (leaves, _as_tuple(out))
            else:
                st.stash[i] = received
        return waited

    def _run_recompute(self, st: _StepState, i: int) -> float:
        """R of micro-batch ``i``: the forward again from its stashed input, with a graph; buffers the
        forward updates in place (a BatchNorm's running statistics) keep F's update only, as in
        plain PyTorch, where each micro-batch's forward runs once."""
        received = st.stash.pop(i)
        leaves = self._leaves(received, st.recv_flags[i], True)
        # the forward's in-place updates (running statistics) happened in F: R runs on copies of the
        # values F found (a forward that reads what it updates recomputes what F computed)
        with self.in_place.kept(st.buffers_before.pop(i, None)):
            out = self._forward(st.mb_in[i], leaves, st.base + i, grad=True, model_s=st.model_s, kind="R",
                                carried=st.carried)
        st.live[i] = (leaves, _as_tuple(out))
        return 0.0

    def _run_backward(self, st: _StepState, i: int) -> float:
        """B of micro-batch ``i``: backward from the loss (last stage) or from the received output
        gradients, the input gradients sent upstream; with the split backward only the input
        gradients, the weight-gradient work kept for a W. Returns the seconds spent waiting."""
        leaves, outs = st.live.pop(i)
        waited = 0.0
        if self.is_last:   # a micro-batch's share of the mini-batch loss: 1/m, or its items / the replica's positions
            share = 1.0 / self.m if st.items is None else st.items[i] / max(st.positions, 1)
            # no item (every label ignored): share 0, and a mean cross-entropy over no item
            # backpropagates zeros (its NaN value times 0 seeds none), as in plain PyTorch
            roots, gouts = [outs[0] * (st.scale * share)], [None]
        else:
            g_tensors, _, waited = self._receive(self.rx_grads, i)
            # g_tensors holds one gradient per *flagged* output, in order (see _input_grads),
            # so pair them with the flagged outputs, not positionally with all outputs.
            flagged = [o for o, f in zip(outs, st.sent_flags.pop(i)) if f]
            pairs = [(o, g) for o, g in zip(flagged, g_tensors) if o.requires_grad]
            roots, gouts = [o for o, _ in pairs], [g for _, g in pairs]
        t0 = time.perf_counter()
        with self._recomputing(st, i, done=not self.split_backward):
            if self.split_backward:
                st.deferred[i] = self._backward_input(roots, gouts, leaves)
            elif roots:
                torch.autograd.backward(roots, gouts if not self.is_last else None)
        st.model_s["B"] += time.perf_counter() - t0
        if not self.is_first:
            self.ch_grad_out.send(self._input_grads(leaves, st.recv_flags.pop(i)))
        return waited

    def _run_weights(self, st: _StepState, i: int) -> float:
        """W of micro-batch ``i`` (split backward): its deferred weight gradients; during the last W
        each parameter group's gradients are handed to the all-reduce as they turn final."""
        t0 = time.perf_counter()
        with self._recomputing(st, i, done=True):
            st.deferred.pop(i).run(on_group=self._weights_final if st.grad_actions == self.m else None)
        st.model_s["W"] += time.perf_counter() - t0
        return 0.0

    @staticmethod
    def _recomputing(st: _StepState, i: int, done: bool):
        """The cut-point observer of micro-batch ``i``'s backward (``Recomputing``: a block the
        user's forward checkpointed is recomputed with the received tensors), dropped when ``done``."""
        carried = st.carried.pop(st.base + i, None) if done else st.carried.get(st.base + i)
        return observe_cutpoints(Recomputing(carried)) if carried else contextlib.nullcontext()

    def _end_transfers(self) -> None:
        """Wait for both receivers to finish the step and for every send to complete."""
        for rx in (self.rx_acts, self.rx_grads):
            if rx is not None:
                rx.join()
        for ch in (self.ch_act_out, self.ch_grad_out):
            if ch is not None:
                ch.wait_sends()

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
    def _sync_and_step(self, optimizer: torch.optim.Optimizer, loss_local: torch.Tensor,
                       counts: tuple[float, float] = (0.0, 0.0)) -> StepResult:
        """Tied-weight sum and DP all-reduce (mean over replicas; started during the last backward,
        finished here), consensus, clipping, step. Counting loss items (``loss_items``), the
        gradients leave the backward as the replicas' item sums over their positions; the consensus
        also sums ``counts`` (the last stages' items and positions), and one pass scales the
        gradients to the mean over the mini-batch's items (with the clipping factor)."""
        counting = self.loss_items is not None
        self.grad_sync.finish(1.0 / (self.scaler.scale * (1 if counting else self.D)))
        norm_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        finite = torch.ones((), dtype=torch.float32, device=self.device)
        counted = [p.grad for name, p in self.params if p.grad is not None
                   and not (name in self.shared and self.shared[name][0] != self.stage)]  # tied: counted once
        if counted:
            norm_sq = torch.stack([n.float() for n in torch._foreach_norm(counted)]).pow(2).sum()
        finite = torch.isfinite(norm_sq).float()
        parts = [1.0 - finite, torch.nan_to_num(norm_sq, nan=0.0, posinf=0.0) / self.D,
                 loss_local.float() / (1 if counting else self.D)]
        if counting:   # float64: a mini-batch's token count may pass float32's exact integers
            parts = [t.double() for t in parts] + [torch.tensor(c, dtype=torch.float64, device=self.device)
                                                   for c in counts]
        stats = torch.stack(parts)
        if self.topo.world_size > 1:
            dist.all_reduce(stats)
        overflow = bool(stats[0].item() > 0)
        factor = 1.0
        if counting:
            items, positions = float(stats[3].item()), float(stats[4].item()) / self.D
            # no item in the whole mini-batch: zero gradients and a NaN loss, as plain PyTorch gives
            # (AdamW still steps: momentum and weight decay)
            factor = positions / items if items > 0 else 0.0
            loss = float(stats[2].item()) / items if items > 0 else float("nan")
        else:
            loss = float(stats[2].item())
        total_norm = float(stats[1].sqrt().item()) * factor if not overflow else float("inf")
        if not overflow:
            coef = factor
            if self.grad_clip is not None and self.grad_clip / (total_norm + 1e-6) < 1.0:
                coef *= self.grad_clip / (total_norm + 1e-6)
            if coef != 1.0:
                for _, p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.scaler.update(overflow)
        return StepResult(step=self.step_count, loss=loss, grad_norm=total_norm, skipped=overflow,
                          loss_scale=self.scaler.scale, time_s=0.0)

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batch: Sequence[torch.Tensor]) -> float:
        """Mean loss over a held-out mini-batch (forward only, no RNG effect on training;
        collective): over its items where the job counts them (``loss_items``), else the mean of
        the micro-batch means. Dropout is off during evaluation."""
        mb_in, mb_tg, mb_host = self._micro_batches(batch)
        items, _ = self._item_counts(batch)
        self._begin_step()
        acts = self.rx_acts
        if acts is not None:
            acts.start(self.m)
        total = torch.zeros((), device=self.device)
        self.model.eval()
        try:
            for i in range(self.m):
                received, flags, _ = self._receive(acts, i)
                out = self._forward(mb_in[i], self._leaves(received, flags, False),
                                    self.replica * self.m + i, grad=False)
                if self.is_last:
                    if items is None or items[i]:
                        total += self._loss(out, mb_tg[i], mb_host[i], self.replica * self.m + i).float() * (1 if items is None else items[i])
                else:
                    self.ch_act_out.send(out, [False] * len(out))
        finally:
            self.model.train()
        if acts:
            acts.join()
        if self.ch_act_out:
            self.ch_act_out.wait_sends()
        if self.loss_items is not None:   # (item sum, items) over the replicas
            stat = torch.stack([total.double(), torch.tensor(float(sum(items or [])), dtype=torch.float64,
                                                             device=self.device)])
            if self.topo.world_size > 1:
                dist.all_reduce(stat)
            self.eval_items = float(stat[1].item())
            return float(stat[0].item() / stat[1].item()) if stat[1].item() > 0 else float("nan")
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
                f"{f' max in flight {self.max_in_flight}' if self.max_in_flight else ''}"
                f"{' split backward' if self.split_backward else ''}")
