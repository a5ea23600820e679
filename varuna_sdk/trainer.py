"""The training loop every worker runs for a ``JobConfig``: one flat loop, nanoGPT style.

Owns: building a rank's training from a config (the job's model spec and data resolved by
``jobspec`` — any model, data and loss; this module never knows which — the engine, the
optimizer (``optimizer.make_optimizer``), warm-up + cosine learning rate), the per-step line and the JSON-lines metrics file
(``metrics.jsonl`` in the run folder, one object per step, written by rank 0; the dashboard reads
it) and the held-out loss and perplexity at start and end (``summary.json``). Also the worker's side of
morphing (paper §4.2): resume from the newest complete per-layer checkpoint under the current
stage map, periodic background checkpoints, and stopping all ranks after the same mini-batch
when any one is asked (``should_stop(progress)``, agreed by one all-reduce; the ``Progress`` it
is given is the running worker's own, never a module global), with a published checkpoint
(``WorkerOutcome``). The job's cached calibration is ``profiling.job.calibrate_job`` (the manager
plans from it and never imports this module).

Sits above ``jobspec``, ``pipeline``, ``checkpoint``, ``data`` and ``model``; never imports
``manager``, ``cluster`` or ``planner`` (heartbeats are fed through the ``on_step`` callback, stop
requests through ``should_stop``).
"""

from __future__ import annotations

import json
import math
import warnings
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from .checkpoint import CheckpointError, StageCheckpointer, default_staging_dir, default_store_url, latest_complete
from .checkpoint.store import manifest_key
from .checkpoint.store import checkpoint_name
from .config import JobConfig
from .data.loader import DataError
from .data.prefetch import BatchPrefetcher
from .jobspec import ResolvedJob, resolve_job
from .optimizer import check_optimizer, make_optimizer, optimizer_kwargs
from .pipeline.engine import StepResult, Varuna


def resolve(job: JobConfig, run_dir: str | Path | None = None, check: bool = True) -> ResolvedJob:
    """The job's model spec and data, resolved and (``check``) checked together
    (``jobspec.resolve_job``, and ``check``: the optimizer's settings, ``optimizer.check_optimizer``);
    objects the job shipped by value are looked up in ``run_dir`` too."""
    if check:
        check_optimizer(job)
    return resolve_job(job, search=[run_dir] if run_dir is not None else [], check=check)


def lr_at(step: int, job: JobConfig) -> float:
    """Learning rate at ``step``: linear warm-up, then cosine decay from ``lr`` to ``min_lr``."""
    t = job.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class StepMetrics:
    """One line of ``metrics.jsonl``: units are seconds, tokens/s and examples/s.
    ``step_time_s``: the whole step on rank 0, waiting for its batch included (``data_s`` of it:
    the part of reading it that the previous step's compute did not hide, ``data.prefetch``), so
    that throughput and the time left are what the job really runs at — a dataset whose
    ``__getitem__`` is slower than a step shows there, not only in the wall clock.
    ``peak_live_graphs``: the most micro-batches whose activations rank 0 (the first stage, which
    holds the most) kept at once in the step (``StepResult.peak_live_graphs``).
    ``tokens_per_s``: ``None`` for examples that hold no token ids (``tokens_per_example``)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    step_time_s: float
    tokens_per_s: float | None
    examples_per_s: float
    wall_time: float
    P: int
    D: int
    generation: int = 0
    peak_live_graphs: int = 0
    data_s: float = 0.0


def build_engine(job: JobConfig, rank: int | None = None, resolved: ResolvedJob | None = None) -> Varuna:
    """The ``Varuna`` engine of this rank for ``job`` (torch.distributed already initialised)."""
    r = resolved or resolve(job)
    p = job.parallel
    sample, targets = r.sample_inputs(p.micro_batch_size, job.data.seq_len)
    engine = Varuna(r.spec.factory, r.spec.loss_fn, p, sample, seed=job.train.seed, init_fn=r.spec.init_fn,
                    precision=job.train.precision, loss_scale=job.train.loss_scale, grad_clip=job.train.grad_clip,
                    rank=rank, timeout_s=job.launch.timeout_s, sample_targets=targets)
    engine.loss_items = loss_items_of(job, r, engine.structure)   # from its own trace (a wider one if needed)
    return engine


def check_partition(job: JobConfig, resolved: ResolvedJob | None = None) -> str:
    """Trace the job's model (weights on the meta device) and split it exactly as the workers will,
    so a bad P, boundary list or cross-stage use fails in the caller before any process starts.
    Returns a one-line description of the stage map. Raises ``PartitionError``; warns when the
    automatic split is much less balanced than the model's costs allow (``imbalance_note``)."""
    from .model.partition import StageMap, balanced_stage_map, imbalance_note, shared_state, unsplittable_cuts
    from .model.tracer import segment_costs

    p = job.parallel
    resolved = resolved or resolve(job)
    structure = model_structure(job, resolved)
    if p.boundaries is not None:
        smap = StageMap.from_lists(p.boundaries, structure.num_segments)
    else:
        costs = segment_costs(structure)
        smap = balanced_stage_map(costs, p.P, unsplittable_cuts(structure))
        note = imbalance_note(structure, costs, p.P)
        if note:
            warnings.warn(f"{resolved.spec.name}: {note}", stacklevel=2)
    shared = shared_state(structure, smap, p.shared_params)
    return f"stages (segments) {smap.to_lists()}, tied across stages: {shared or 'none'}"


def model_structure(job: JobConfig, resolved: ResolvedJob | None = None):
    """The job's model traced with its weights on the meta device (no memory, no weight compute),
    on a real micro-batch of its data, with the loss run on its output: its cut-point segments and
    cross-stage uses as the workers will see them (``model.tracer.ModelStructure``)."""
    from .model.materialize import build_on_meta
    from .model.tracer import loss_after, trace_model

    r = resolved or resolve(job)
    sample, targets = r.sample_inputs(job.parallel.micro_batch_size or 1, job.data.seq_len)
    return trace_model(build_on_meta(r.spec.factory), sample, after=loss_after(r.spec.loss_fn, targets),
                       targets=targets)


#: Wider samples the loss-items rule is read from when a micro-batch's could not tell the shift
#: (``loss_items_of``): the first examples may all predict nothing (a dataset sorted that way)
LOSS_ITEMS_SAMPLES = (8, 64)


def loss_items_of(job: JobConfig, resolved: ResolvedJob, structure) -> Any:
    """Where a dataset job's loss items are counted (``model.loss_items.LossItems``): the rule the
    model's trace ``structure`` found on its micro-batch, unless that sample could not tell whether
    the loss shifts its labels (``LossItems.guessed``); then read again off dry runs on the first
    ``LOSS_ITEMS_SAMPLES`` examples, until one tells. The same for every worker and for
    ``plain_pytorch_losses``. None for token data (every example holds as many tokens) or a loss
    that is not one mean cross-entropy."""
    from .model.materialize import build_on_meta
    from .model.tracer import loss_after, trace_model

    rule = structure.loss_items
    if resolved.data.examples is None or rule is None:
        return None
    for n in LOSS_ITEMS_SAMPLES:
        if not rule.guessed or n > len(resolved.data.examples):
            break
        sample, targets = resolved.sample_inputs(n, job.data.seq_len)
        rule = trace_model(build_on_meta(resolved.spec.factory), sample,
                           after=loss_after(resolved.spec.loss_fn, targets), targets=targets).loss_items or rule
    return rule


#: Seconds a step may wait for its batch before the worker's log says so (and again every as many).
DATA_STALL_S = 60.0


def _log(msg: str) -> None:
    print(msg, flush=True)


def evaluate(engine: Varuna, batches: list) -> float | None:
    """Mean held-out loss over ``batches`` (``(inputs, targets)`` each; collective): over their
    items where the engine counts them (``Varuna.loss_items``), else the mean of the batches'; ``None``
    without batches (``data.val_fraction: 0``: every rank has none, so none calls the collective)."""
    losses, items = [], []
    for b in batches:
        losses.append(engine.evaluate(b))
        items.append(engine.eval_items)
    if not losses:
        return None
    if engine.loss_items is not None and sum(items) > 0:   # the mean over every held-out item
        return sum(x * n for x, n in zip(losses, items) if n) / sum(items)
    return sum(losses) / len(losses)


@dataclass
class Training:
    """What one rank trains with: its engine, its optimizer (decay on matrices only), the deterministic
    batch loader (``replica_batch(step, replica, D)`` → the fields of a replica's share), the
    held-out batches (``(inputs, targets)``) and the resolved job (``split`` turns fields into
    the engine's ``(inputs, targets)``)."""

    engine: Varuna
    optimizer: torch.optim.Optimizer
    loader: Any
    val: list
    job: ResolvedJob
    kinds: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None

    def batch(self, step: int) -> tuple:
        """This rank's ``(inputs, targets)`` of ``step``. Raises ``DataError`` (not retried: the
        same step reads the same examples) when a field's dtype or shape per example differs from
        the examples the job was set up with (``kinds``)."""
        e = self.engine
        fields = self.loader.replica_batch(step, e.replica, e.D)
        if self.kinds is not None:
            check_batch_kinds(fields, self.kinds, step, ids=getattr(self.loader, "example_indices", None))
        return self.job.split(fields)


def field_kinds(fields: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor field's shape per example (without the batch dimension) and dtype."""
    return {k: (tuple(v.shape[1:]), v.dtype) for k, v in fields.items() if isinstance(v, torch.Tensor)}


def check_batch_kinds(fields: dict, kinds: dict, step: int, *, ids=None) -> None:
    """Refuse a batch whose tensor fields differ in dtype or shape per example from ``kinds``
    (``field_kinds`` of the examples the job was traced and calibrated on): stages exchange
    tensors of the traced shapes, the plan was made for them, and a raw torch error deep in a
    stage (then a retry that reads the same examples) said neither which step nor why. Raises
    ``DataError`` naming the step, the field, both kinds and the examples (``ids(step)``)."""
    for k, (shape, dtype) in field_kinds(fields).items():
        want = kinds.get(k)
        if want is None or want == (shape, dtype):
            continue
        which = ""
        if ids is not None:
            idx = [int(i) for i in ids(step)]
            which = f" (examples {idx[:8]}{'...' if len(idx) > 8 else ''})"
        raise DataError(
            f"step {step + 1}: field {k!r} has shape {list(shape)} {str(dtype).replace('torch.', '')} per example"
            f"{which} where the job was set up with {list(want[0])} {str(want[1]).replace('torch.', '')} (its "
            "trace, its calibration and the tensors its stages exchange): every example must give the same "
            "shapes and dtypes; pad or crop them to one shape, and cast them to one dtype, in the dataset")


def build_training(job: JobConfig, rank: int | None = None, run_dir: str | Path | None = None) -> Training:
    """Build this rank's engine, optimizer and data for ``job`` (torch.distributed initialised
    when P × D > 1; collective: the engine creates its process groups)."""
    d, p, t = job.data, job.parallel, job.train
    with warnings.catch_warnings():  # the launcher checked this job and showed the SDK's warnings about it
        warnings.filterwarnings("ignore", category=UserWarning, module=r"varuna_sdk\.")
        r = resolve(job, run_dir, check=False)
    loader, val = r.data.loaders(d.seq_len, p.global_batch, d.seed, d.val_fraction, t.eval_batches)
    engine = build_engine(job, rank, r)
    opt = make_optimizer(engine.parameters(), job)
    return Training(engine, opt, loader, [r.split(v) for v in val], r, field_kinds(r.data.sample(1, d.seq_len)))


#: integer dtypes that hold no token ids (masks; pixels)
_NOT_TOKENS = (torch.bool, torch.uint8, torch.int8)


def tokens_per_example(job: JobConfig, resolved: ResolvedJob) -> int | None:
    """Tokens in one example: ``seq_len`` for token data; for a dataset, the elements of its
    ``input_ids`` field, else its first integer field of more than one element (token ids; not a
    bool mask, not a class label, not uint8/int8 pixels or an integer array of 3 or more dimensions:
    an image), else ``None``: the examples hold no tokens (images, table rows), and throughput is
    examples/s only."""
    if resolved.data.tokens is not None:
        return job.data.seq_len
    fields = resolved.data.sample(1, job.data.seq_len)
    ids = [fields["input_ids"]] if "input_ids" in fields else list(fields.values())
    for v in ids:
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype not in _NOT_TOKENS \
                and (v.dim() <= 3 or v is fields.get("input_ids")):
            n = v[0].numel() if v.dim() else 1
            if n > 1 or v is fields.get("input_ids"):
                return max(1, n)
    return None


#: Steps in a row whose loss or gradients are not finite after which a job fails, instead of going
#: on without applying any step: in fp32 and bf16 at once; in fp16 once the loss scaler is at its
#: minimum (it skips overflowing steps while it lowers the scale). The engine skips such a step
#: everywhere at once. The count survives a retry or a morph (it travels in the checkpoint).
MAX_NONFINITE_STEPS = 3


class NonFiniteLossError(FloatingPointError):
    """``MAX_NONFINITE_STEPS`` steps in a row had a loss or gradients that were not finite, so no
    update was applied. Deterministic (resuming replays the same steps from the same weights): the
    manager does not retry it (``worker.failure_cause`` says ``"diverged"``)."""

# ---- stopping at a mini-batch boundary ----------------------------------------------------------
@dataclass
class Progress:
    """Where the running ``run_worker`` stands, as its stop callback sees it: this process's
    ``rank`` and the optimizer steps its job has completed so far (``steps_done``, including
    steps restored from a checkpoint). Owned by one ``run_worker`` call and given to its
    ``should_stop`` after every step."""

    rank: int
    steps_done: int = 0


@dataclass(frozen=True)
class StopAtStep:
    """``should_stop`` that asks to stop once ``step`` optimizer steps are done; with ``ranks``,
    only those ranks ask (the others learn it from the agreement all-reduce). Picklable, for
    ``spawn_workers``, tests and benchmarks."""

    step: int
    ranks: tuple[int, ...] | None = None

    def __call__(self, progress: Progress) -> bool:
        """True (stop at this mini-batch boundary, paper §4.5) once ``progress.steps_done >= step``; always False on a
        rank not in ``ranks`` when ``ranks`` is given."""
        if self.ranks is not None and progress.rank not in self.ranks:
            return False
        return progress.steps_done >= self.step


@dataclass(frozen=True)
class StopFile:
    """``should_stop`` that asks to stop when the file ``path`` exists (one ``stat`` a step): a
    flag a local manager, a signal handler or a person can set. Picklable."""

    path: str

    def __call__(self, progress: Progress) -> bool:
        """True (stop at this mini-batch boundary) when the file ``path`` exists; ``progress`` is unused."""
        return os.path.exists(self.path)


@dataclass
class WorkerOutcome:
    """How ``run_worker`` ended on this rank.

    ``status``: ``"completed"`` (all ``train.steps`` done) or ``"stopped"`` (asked to stop:
    a checkpoint of the state after ``step`` steps was published before returning, named
    ``checkpoint``). ``step``: optimizer steps completed = where a resumed run starts.
    ``resumed_from``: the step this generation started from (``None``: from scratch).
    ``stop_poll_s``: total seconds in ``should_stop`` + the agreement all-reduce;
    ``checkpoint_block_s``: total seconds training was blocked by checkpoints (CPU snapshot,
    waiting for the previous write, and at a stop waiting for publication)."""

    status: str
    step: int
    generation: int = 0
    resumed_from: int | None = None
    checkpoint: str | None = None
    steps_run: int = 0
    stop_poll_s: float = 0.0
    checkpoint_block_s: float = 0.0


def _agree_stop(should_stop: Callable[[Progress], bool], progress: Progress, device: torch.device) -> bool:
    """True on every rank when ``should_stop(progress)`` is True on any rank (one MAX all-reduce of
    one integer; the original relied on a signal reaching every worker)."""
    flag = torch.tensor([1 if should_stop(progress) else 0], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _wait_published(ckpt: StageCheckpointer, device: torch.device) -> None:
    """Wait until this rank's files are written and (rank 0) the manifest is published; agree
    with one MIN all-reduce that every rank succeeded; raise ``CheckpointError`` otherwise."""
    error = None
    try:
        ckpt.wait()
    except CheckpointError as e:
        error = e
    ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not int(ok.item()):
        raise CheckpointError("the stop checkpoint was not published: another rank failed to write it (see its log)")


def _refuse_stale_store(url: str, lead: bool, device: torch.device) -> None:
    """With ``resume`` off, a store that already holds complete checkpoints would mix two runs
    (``latest_complete`` would find the old one, pruning would delete the new ones): every rank
    raises ``CheckpointError`` (rank 0 looks, one MAX all-reduce tells the others)."""
    info = latest_complete(url) if lead else None
    found = torch.tensor([info.step + 1 if info else 0], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if int(found.item()):
        raise CheckpointError(
            f"train.resume is false but the checkpoint store {url!r} already holds checkpoints (newest at step "
            f"{int(found.item()) - 1}) of an earlier run; set train.checkpoint_url to an empty location, delete "
            "them, or set train.resume to true to continue that run")


def run_worker(rank: int, world_size: int, job_dict: dict, run_dir: str,
               on_step: Callable[[int, StepResult, dict], None] | None = None,
               should_stop: Callable[[Progress], bool] | None = None, generation: int = 0,
               secret: str | None = None) -> WorkerOutcome:
    """Entry point of one worker (``spawn_workers`` target): train ``job`` from its newest complete
    checkpoint (``train.resume``) or from scratch, under the job's current P, D and stage map.

    Rank 0 appends one line per step to ``<run_dir>/metrics.jsonl`` (with ``generation``),
    writes ``summary.json`` when all steps are done, and ``outcome.json`` (the ``WorkerOutcome``)
    on return. Checkpoints go to ``train.checkpoint_url`` (default ``<run_dir>/checkpoints``)
    every ``train.checkpoint_every`` steps and after the last one (when that is not 0), written in the background.

    Args:
        on_step: ``on_step(step, result, metrics)`` called on every rank after each optimizer
            step; ``step`` is the 0-based index of the step just done, ``metrics`` the dict of its
            ``metrics.jsonl`` line (computed on every rank). Must be cheap and must not raise.
        should_stop: ``should_stop(progress) -> bool`` polled on every rank after every step,
            given this worker's ``Progress`` (rank, steps done); the ranks agree through one MAX
            all-reduce, so a request seen by any one rank stops all of them after the same step. Then a checkpoint is written at that boundary (even with
            ``checkpoint_every`` 0) and published before returning ``status="stopped"``. Must be
            picklable to pass through ``spawn_workers`` (``StopAtStep``, ``StopFile``).
        generation: the manager's relaunch counter, written into each metrics line and manifest.
        secret: the job secret (the manager's, ``VARUNA_JOB_TOKEN``): checkpoint manifests are
            signed with a key derived from it and only manifests so signed are resumed from.
            ``None``: unsigned manifests (checksums only), for runs without a manager.

    Before the first step every rank checks that the checkpoint store takes a write and has room
    for its share of a checkpoint (``StageCheckpointer.check_store``).

    Returns ``WorkerOutcome``. Raises ``CheckpointError`` if a checkpoint cannot be written or a
    resumed one does not fit the job, ``PeerLost`` if another rank dies.
    """
    run = _start_run(rank, JobConfig.from_dict(job_dict).validate(), run_dir, generation, secret)
    _resume(run)
    p = run.job.parallel
    per_example = tokens_per_example(run.job, run.tr.job)
    tokens_per_step = None if per_example is None else p.global_batch * per_example
    t_start = run.t_start = time.time()
    r = None
    try:
        with open(run.out / "metrics.jsonl", "a") if run.lead else open(os.devnull, "w") as mf:
            for step in range(run.outcome.step, run.job.train.steps):
                r = _train_step(run, step, tokens_per_step, on_step, mf)
                if _stop_or_checkpoint(run, should_stop):
                    return run.outcome
    finally:
        run.reader.close()
    return _finish(run, r, t_start)


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)``: the perplexity of a mean cross-entropy in nats; None when the loss is not
    finite or too large for a float's exponent (a regression loss above ~709)."""
    if loss is None or not math.isfinite(loss) or loss > 700.0:
        return None
    return math.exp(loss)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _text_job(job: JobConfig) -> bool:
    """A language model on text (its loss a token cross-entropy, so a perplexity means something),
    not a dataset with the user's own loss."""
    return job.data.by_value is None and job.data.dataset is None


def _held_out(job: JobConfig, *losses: float | None) -> tuple[str, list[str]]:
    """How held-out losses read in the log: ``("perplexity", values)`` for a language model on
    text (the loss is its token cross-entropy), else ``("loss", values)`` (a dataset with the
    user's loss: a regression's perplexity means nothing, and overflows above ~709)."""
    ppls = [perplexity(x) for x in losses]
    if _text_job(job) and None not in ppls:
        return "perplexity", [f"{x:.2f}" for x in ppls]
    return "loss", [f"{x:.6g}" if x is not None else "n/a" for x in losses]


def _start_loss(common: dict) -> float | None:
    """The held-out loss at the run's start, from a checkpoint's common state (older checkpoints
    kept its perplexity instead)."""
    if common.get("loss_start") is not None:
        return float(common["loss_start"])
    ppl = common.get("ppl_start")
    return math.log(ppl) if isinstance(ppl, (int, float)) and ppl > 0 else None


@dataclass
class _WorkerRun:
    """One ``run_worker`` call: the validated job, this rank's ``Training``, its checkpointer and
    store ``url``, the run folder ``out``, the ``WorkerOutcome`` so far, the ``Progress`` its stop
    callback sees, the held-out loss at start, the non-finite steps in a row and the skipped steps
    of the whole run (both kept in checkpoints)."""

    job: JobConfig
    tr: Training
    ckpt: StageCheckpointer
    url: str
    out: Path
    generation: int
    outcome: WorkerOutcome
    progress: Progress
    loss0: float | None = None
    skipped_in_a_row: int = 0
    skipped_total: int = 0
    time_before: float = 0.0   # training seconds of the generations before this one (from the checkpoint)
    t_start: float = 0.0       # when this generation's first step began (Unix s)
    reader: BatchPrefetcher | None = None   # the steps' batches, the next read while a step trains

    def __post_init__(self) -> None:
        if self.reader is None:
            self.reader = BatchPrefetcher(self.tr.batch, self.job.train.steps, enabled=self.job.data.prefetch,
                                          on_stall=self._data_stalled, stall_s=DATA_STALL_S,
                                          draws=lambda: getattr(self.tr.loader, "draws_random", None) or [])

    def _data_stalled(self, step: int, waited_s: float) -> None:
        """Say in the worker's log that ``step``'s batch has been awaited ``waited_s`` seconds."""
        ids = getattr(self.tr.loader, "example_indices", None)
        which = ""
        if ids is not None:
            idx = [int(i) for i in ids(step)]
            which = f" (examples {idx[:8]}{'...' if len(idx) > 8 else ''})"
        _log(f"[varuna] rank {self.progress.rank}: step {step + 1}'s batch{which} is not read after {waited_s:.0f} s: "
             "the dataset's __getitem__ (or the storage it reads) may hang; the job waits for it")

    @property
    def lead(self) -> bool:
        """Rank 0: writes the metrics, summary and outcome files and the run's log lines."""
        return self.progress.rank == 0


def _start_run(rank: int, job: JobConfig, run_dir: str, generation: int, secret: str | None) -> _WorkerRun:
    """Build this rank's training and checkpointer (checking the store takes a write) and log
    the configuration."""
    p, t = job.parallel, job.train
    tr = build_training(job, rank, run_dir)
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    url = t.checkpoint_url or default_store_url(out)
    # rank 0 waits this long for every rank's files before giving a checkpoint up (large models, remote stores)
    ckpt = StageCheckpointer(tr.engine, tr.optimizer, url, default_staging_dir(out, rank), keep=t.keep_checkpoints,
                             timeout_s=max(600.0, job.launch.timeout_s), generation=generation,
                             key=manifest_key(secret) if secret else None)
    ckpt.check_store()
    if rank == 0:
        _log(f"[varuna] {job.name}: P={p.P} x D={p.D}, global batch {p.global_batch} = micro-batch "
             f"{p.micro_batch_size} x m={p.num_micro_batches} x D={p.D}, policy {p.policy}, "
             f"{sum(1 for _ in tr.engine.named_parameters())} tensors on rank 0, generation {generation}, optimizer "
             f"{type(tr.optimizer).__name__}({', '.join(f'{k}={v}' for k, v in optimizer_kwargs(job).items())})")
        if t.warmup_steps > t.steps:
            _log(f"[varuna] note: train.warmup_steps={t.warmup_steps} is longer than the run's {t.steps} steps, so the "
                 f"learning rate peaks at {lr_at(t.steps - 1, job):.3g}, not train.lr={t.lr:g}")
    _log(f"[rank {rank}] {tr.engine.describe()}")
    return _WorkerRun(job, tr, ckpt, url, out, generation,
                      WorkerOutcome(status="completed", step=0, generation=generation), Progress(rank))


def _resume(run: _WorkerRun) -> None:
    """Resume from the store's newest complete checkpoint (``train.resume``; else refuse a store
    holding an earlier run's), and measure the held-out loss at start unless resumed."""
    engine, loader, lead = run.tr.engine, run.tr.loader, run.lead
    if not run.job.train.resume:
        _refuse_stale_store(run.url, lead, engine.device)
    else:
        info, common = run.ckpt.resume()
        if info is not None:
            try:
                loader.load_state_dict(common["loader"])
            except ValueError as e:
                raise CheckpointError(f"checkpoint {info.name!r} in {run.url!r} does not fit this job's data: "
                                      f"{e}") from None
            run.outcome.step = run.outcome.resumed_from = loader.position
            run.loss0 = _start_loss(common)
            run.skipped_in_a_row = int(common.get("skipped_in_a_row") or 0)
            run.skipped_total = int(common.get("skipped_steps") or 0)
            run.time_before = float(common.get("train_time_s") or 0.0)
            if lead:
                _log(f"[varuna] resumed from {info.name} (saved at P={info.P} x D={info.D}): step {run.outcome.step}")
    run.progress.steps_done = run.outcome.step
    if run.loss0 is None and not run.tr.val:
        if lead:
            _log("[varuna] no held-out evaluation: data.val_fraction is 0, so every example trains")
    elif run.loss0 is None:
        run.loss0 = evaluate(engine, run.tr.val)
        if lead:
            what, (v0,) = _held_out(run.job, run.loss0)
            _log(f"[varuna] held-out {what} at start: {v0}")
            if not math.isfinite(run.loss0):
                _log(f"[varuna] warning: the held-out loss is {run.loss0} before any step: the held-out examples "
                     "(data.val_fraction of the data: a dataset's examples drawn at random from data.seed, a text's "
                     "last tokens) or the loss give values that are not finite, so the "
                     "held-out figures of this run mean nothing; check those examples for NaN or inf")


def _train_step(run: _WorkerRun, step: int, tokens_per_step: int | None, on_step, mf) -> StepResult:
    """One optimizer step (0-based ``step``) at its learning rate; then the progress, the metrics
    line (``on_step``, and written to ``mf`` and logged on rank 0). Raises ``NonFiniteLossError``
    after ``MAX_NONFINITE_STEPS`` skipped steps in a row (``_count_skipped``)."""
    job, p, t = run.job, run.job.parallel, run.job.train
    for g in run.tr.optimizer.param_groups:
        g["lr"] = lr_at(step, job)
    batch = run.reader.get(step)
    data_s = run.reader.waited_s
    if run.lead and run.reader.off_reason and not run.outcome.steps_run:
        _log(f"[varuna] data.prefetch is off for this run: {run.reader.off_reason}")
    r = run.tr.engine.step(batch, run.tr.optimizer)
    wall_s = data_s + r.time_s
    done = step + 1
    run.progress.steps_done = done
    run.outcome.step, run.outcome.steps_run = done, run.outcome.steps_run + 1
    m = StepMetrics(step=step, loss=r.loss, lr=lr_at(step, job), grad_norm=r.grad_norm, skipped=r.skipped,
                    loss_scale=r.loss_scale, step_time_s=wall_s,
                    tokens_per_s=None if tokens_per_step is None else tokens_per_step / wall_s,
                    examples_per_s=p.global_batch / wall_s,
                    wall_time=time.time(), P=p.P, D=p.D, generation=run.generation,
                    peak_live_graphs=r.peak_live_graphs, data_s=data_s)
    md = asdict(m)
    if on_step is not None:
        on_step(step, r, md)
    if run.lead:
        mf.write(json.dumps(md) + "\n")
        mf.flush()
        tok = "" if m.tokens_per_s is None else f"{m.tokens_per_s:8.0f} tok/s | "
        _log(f"step {step + 1:4d}/{t.steps} | loss {r.loss:7.4f} | {tok}"
             f"{m.examples_per_s:6.2f} ex/s | {wall_s:6.3f} s" + (_skip_note(t.precision, r) if r.skipped else ""))
    _count_skipped(run, r, step)   # after its line: the error names steps the log shows
    return r


def _skip_note(precision: str, r: StepResult) -> str:
    """What a skipped step's log line says: in fp16 an overflow the loss scaler answers by lowering
    the scale; else a loss or gradients that were not finite (no update applied)."""
    if precision == "fp16":
        return f" | skipped (overflow; loss scale now {r.loss_scale:g})"
    return " | SKIPPED: loss or gradients not finite; no update applied"


def _count_skipped(run: _WorkerRun, r: StepResult, step: int) -> None:
    """Count a skipped step (in a row and in all); raise ``NonFiniteLossError`` at the
    ``MAX_NONFINITE_STEPS``-th in a row, in fp16 only once the loss scaler is at its minimum (below
    it, skipping is how the scaler finds a scale that does not overflow)."""
    t = run.job.train
    if not r.skipped:
        run.skipped_in_a_row = 0
        return
    run.skipped_total += 1
    scaler = run.tr.engine.scaler
    if t.precision == "fp16" and scaler.scale > scaler.min_scale:
        return
    run.skipped_in_a_row += 1
    if run.skipped_in_a_row < MAX_NONFINITE_STEPS:
        return
    hint = ("enable train.grad_clip" if not t.grad_clip else
            f"lower train.grad_clip (now {t.grad_clip:g}) only if the gradients grow large first")
    n = run.skipped_in_a_row
    raise NonFiniteLossError(
        f"steps {step - n + 2}..{step + 1} of {t.steps} (metrics.jsonl's \"step\" {step - n + 1}..{step}): the loss or "
        f"the gradients were not finite (last loss {r.loss}) {n} steps in a row in {t.precision}"
        + (" at the loss scaler's minimum scale" if t.precision == "fp16" else "")
        + f", so no step was applied; check the loss function and the data for NaN or inf, lower train.lr "
        f"(now {t.lr:g}), or {hint}. Not retried: resuming replays the same steps from the same weights")


def _stop_or_checkpoint(run: _WorkerRun, should_stop: Callable[[Progress], bool] | None) -> bool:
    """After a step: agree whether to stop; checkpoint when stopping, every
    ``train.checkpoint_every`` steps, and after the last step (``train.steps``: the trained model
    is kept, whatever the interval; every run a manager makes checkpoints, while a bare worker run
    with ``checkpoint_every`` 0 checkpoints only when asked to stop); when stopping, wait for the checkpoint's publication
    and record the outcome. True when the worker stops here."""
    engine, ckpt, outcome, done = run.tr.engine, run.ckpt, run.outcome, run.outcome.step
    stop = False
    if should_stop is not None:
        t0 = time.perf_counter()
        stop = _agree_stop(should_stop, run.progress, engine.device)
        outcome.stop_poll_s += time.perf_counter() - t0
    every = run.job.train.checkpoint_every
    if stop or (every and (done % every == 0 or done == run.job.train.steps)):
        loader_state = {**run.tr.loader.state_dict(), "step": done}
        outcome.checkpoint_block_s += ckpt.save(done, {"loader": loader_state, "loss_start": run.loss0,
                                                       "job": run.job.name, "skipped_in_a_row": run.skipped_in_a_row,
                                                       "skipped_steps": run.skipped_total,
                                                       "train_time_s": run.time_before + time.time() - run.t_start}
                                                if run.lead else None)
    if stop:
        t0 = time.perf_counter()
        _wait_published(ckpt, engine.device)
        outcome.checkpoint_block_s += time.perf_counter() - t0
        outcome.status, outcome.checkpoint = "stopped", checkpoint_name(done, ckpt.tag)
        if run.lead:
            _log(f"[varuna] stopped after step {done}; checkpoint {outcome.checkpoint} published to {run.url}")
            _write_outcome(run.out, outcome)
        sys.stdout.flush()
    return stop


def _finish(run: _WorkerRun, r: StepResult | None, t_start: float) -> WorkerOutcome:
    """All steps done: publish the last step's checkpoint (still in flight), measure the held-out
    perplexity at the end and (rank 0) write ``summary.json`` and ``outcome.json``."""
    outcome, t = run.outcome, run.job.train
    t0 = time.perf_counter()
    run.ckpt.wait()  # the last step's checkpoint is published before the job ends
    outcome.checkpoint_block_s += time.perf_counter() - t0
    loss1 = evaluate(run.tr.engine, run.tr.val)
    if run.lead:
        what, (v0, v1) = _held_out(run.job, run.loss0, loss1)
        _log(f"[varuna] held-out {what}: start {v0} -> end {v1} "
             f"({outcome.steps_run} steps in {time.time() - t_start:.1f} s)" if run.tr.val else
             f"[varuna] done: {outcome.steps_run} steps in {time.time() - t_start:.1f} s (no held-out evaluation)")
        (run.out / "summary.json").write_text(_strict_json({
            "name": run.job.name, "steps": t.steps, "P": run.job.parallel.P, "D": run.job.parallel.D,
            "loss_start": _finite(run.loss0), "loss_end": _finite(loss1),
            "ppl_start": perplexity(run.loss0) if _text_job(run.job) else None,
            "ppl_end": perplexity(loss1) if _text_job(run.job) else None,
            "final_loss": r.loss if r is not None else None, "skipped_steps": run.skipped_total,
            "train_time_s": run.time_before + time.time() - t_start, "generation": run.generation,
            "resumed_from": outcome.resumed_from}))
        _write_outcome(run.out, outcome)
    sys.stdout.flush()
    return outcome


def _strict_json(doc: dict) -> str:
    """``doc`` as JSON any reader accepts: non-finite numbers (a diverged perplexity) become null."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in doc.items()}
    return json.dumps(clean, indent=2, allow_nan=False)


def _write_outcome(out: Path, outcome: WorkerOutcome) -> None:
    tmp = out / "outcome.json.tmp"
    tmp.write_text(json.dumps(asdict(outcome), indent=2))
    os.replace(tmp, out / "outcome.json")
