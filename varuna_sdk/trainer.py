"""The training loop every worker runs for a ``JobConfig``: one flat loop, nanoGPT style.

Owns: building a rank's training from a config (the job's model spec and data resolved by
``jobspec`` — any model, data and loss; this module never knows which — the engine, AdamW,
warm-up + cosine learning rate), the per-step line and the JSON-lines metrics file
(``metrics.jsonl`` in the run folder, one object per step, written by rank 0; the dashboard reads
it), the held-out perplexity at start and end (``summary.json``), and the job's cached
calibration (``calibrate_job``, keyed by the model's identity). Also the worker's side of
morphing (paper §4.2): resume from the newest complete per-layer checkpoint under the current
stage map, periodic background checkpoints, and stopping all ranks after the same mini-batch
when any one is asked (``should_stop``, agreed by one all-reduce), with a published checkpoint
(``WorkerOutcome``). Sits above ``jobspec``, ``pipeline``, ``checkpoint``, ``data`` and
``profiling``; never imports ``manager`` (heartbeats are fed through the ``on_step`` callback,
stop requests through ``should_stop``).
"""

from __future__ import annotations

import json
import math
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
from .jobspec import ResolvedJob, resolve_job
from .pipeline.engine import StepResult, Varuna


def resolve(job: JobConfig, run_dir: str | Path | None = None, check: bool = True) -> ResolvedJob:
    """The job's model spec and data, resolved and (``check``) checked together
    (``jobspec.resolve_job``); objects the job shipped by value are looked up in ``run_dir`` too."""
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
    """One line of ``metrics.jsonl``: units are seconds, tokens/s and examples/s."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    step_time_s: float
    tokens_per_s: float
    examples_per_s: float
    wall_time: float
    P: int
    D: int
    generation: int = 0


def build_engine(job: JobConfig, rank: int | None = None, resolved: ResolvedJob | None = None) -> Varuna:
    """The ``Varuna`` engine of this rank for ``job`` (torch.distributed already initialised)."""
    r = resolved or resolve(job)
    p = job.parallel
    sample, _ = r.sample_inputs(p.micro_batch_size, job.data.seq_len)
    return Varuna(r.spec.factory, r.spec.loss_fn, p, sample, seed=job.train.seed, init_fn=r.spec.init_fn,
                  precision=job.train.precision, loss_scale=job.train.loss_scale, grad_clip=job.train.grad_clip,
                  rank=rank, timeout_s=job.launch.timeout_s)


def check_partition(job: JobConfig, resolved: ResolvedJob | None = None) -> str:
    """Trace the job's model (weights on the meta device) and split it exactly as the workers will,
    so a bad P, boundary list or cross-stage use fails in the caller before any process starts.
    Returns a one-line description of the stage map. Raises ``PartitionError``."""
    from .model.partition import StageMap, balanced_stage_map, shared_state
    from .model.tracer import segment_costs

    p = job.parallel
    structure = model_structure(job, resolved)
    if p.boundaries is not None:
        smap = StageMap.from_lists(p.boundaries, structure.num_segments)
    else:
        smap = balanced_stage_map(segment_costs(structure), p.P)
    shared = shared_state(structure, smap, p.shared_params)
    return f"stages (segments) {smap.to_lists()}, tied across stages: {shared or 'none'}"


def model_structure(job: JobConfig, resolved: ResolvedJob | None = None):
    """The job's model traced with its weights on the meta device (no memory, no weight compute),
    on a real micro-batch of its data: its cut-point segments as the workers will see them
    (``model.tracer.ModelStructure``)."""
    from .model.materialize import build_on_meta
    from .model.tracer import trace_model

    r = resolved or resolve(job)
    sample, _ = r.sample_inputs(job.parallel.micro_batch_size or 1, job.data.seq_len)
    return trace_model(build_on_meta(r.spec.factory), sample)


def profile_key(job: JobConfig, resolved: ResolvedJob | None = None) -> str:
    """Cache key of a job's calibration: what the measurements depend on — the model's identity
    (factory, arguments, code hash), the shape and type of each input field of an example, the
    sequence length, precision, torch and threads per worker. Not the job's name: two jobs of the
    same model and data shapes share one calibration."""
    import hashlib

    r = resolved or resolve(job)
    example = {k: [list(v.shape[1:]), str(v.dtype)] if isinstance(v, torch.Tensor) else type(v).__name__
               for k, v in r.data.sample(1, job.data.seq_len).items()}
    text = json.dumps([r.spec.identity, example, job.data.seq_len, job.train.precision, torch.__version__,
                       job.launch.threads_per_worker], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibrate_job(job: JobConfig, cache_dir: str | Path | None = None, refresh: bool = False,
                  micro_batch_sizes: tuple[int, ...] = (1, 2, 4), resolved: ResolvedJob | None = None,
                  run_dir: str | Path | None = None):
    """Calibrate the job's model once (paper §4.3) on real micro-batches of its data and cache the
    ``Profile`` JSON under ``cache_dir`` (default ``~/.cache/varuna_sdk/profiles``), keyed by
    ``profile_key``; a cached profile is reused."""
    from .data.loader import default_cache_dir
    from .profiling.calibrate import calibrate
    from .profiling.profile import Profile

    r = resolved or resolve(job, run_dir)
    cache = Path(cache_dir) if cache_dir else default_cache_dir() / "profiles"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{profile_key(job, r)}.json"
    if path.exists() and not refresh:
        prof = Profile.load(path)
        if not prof.calibrated_at:   # a cache file from before the time was recorded: its own time
            prof.calibrated_at = path.stat().st_mtime
        return prof
    T = job.data.seq_len
    prof = calibrate(r.spec.factory, r.spec.loss_fn, lambda b: r.sample_inputs(b, T), micro_batch_sizes,
                     seed=job.train.seed, init_fn=r.spec.init_fn, precision=job.train.precision,
                     threads=job.launch.threads_per_worker,
                     model_info={"name": job.name, "model": r.spec.name, "identity": r.spec.identity})
    tmp = path.with_suffix(".tmp")
    prof.to_json(tmp)
    os.replace(tmp, path)
    return prof


def _log(msg: str) -> None:
    print(msg, flush=True)


def evaluate(engine: Varuna, batches: list) -> float:
    """Mean held-out loss over ``batches`` (``(inputs, targets)`` each; collective)."""
    losses = [engine.evaluate(b) for b in batches]
    return sum(losses) / len(losses)


@dataclass
class Training:
    """What one rank trains with: its engine, AdamW (decay on matrices only), the deterministic
    batch loader (``replica_batch(step, replica, D)`` → the fields of a replica's share), the
    held-out batches (``(inputs, targets)``) and the resolved job (``split`` turns fields into
    the engine's ``(inputs, targets)``)."""

    engine: Varuna
    optimizer: torch.optim.Optimizer
    loader: Any
    val: list
    job: ResolvedJob

    def batch(self, step: int) -> tuple:
        """This rank's ``(inputs, targets)`` of ``step``."""
        e = self.engine
        return self.job.split(self.loader.replica_batch(step, e.replica, e.D))


def build_training(job: JobConfig, rank: int | None = None, run_dir: str | Path | None = None) -> Training:
    """Build this rank's engine, optimizer and data for ``job`` (torch.distributed initialised
    when P × D > 1; collective: the engine creates its process groups)."""
    d, p, t = job.data, job.parallel, job.train
    r = resolve(job, run_dir, check=False)  # the launcher checked this job before any worker started
    loader, val = r.data.loaders(d.seq_len, p.global_batch, d.seed, d.val_fraction, t.eval_batches)
    engine = build_engine(job, rank, r)
    decay = [q for n, q in engine.named_parameters() if q.dim() >= 2]
    no_decay = [q for n, q in engine.named_parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(0.9, 0.95))
    return Training(engine, opt, loader, [r.split(v) for v in val], r)


def tokens_per_example(job: JobConfig, resolved: ResolvedJob) -> int:
    """Tokens in one example: ``seq_len`` for token data; for a dataset, the elements of its
    first integer field (token ids), else 1."""
    if resolved.data.tokens is not None:
        return job.data.seq_len
    for v in resolved.data.sample(1, job.data.seq_len).values():
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            return max(1, v[0].numel())
    return 1


#: Steps in a row whose loss or gradients are not finite after which a job without loss scaling
#: (fp32, bf16) fails, instead of going on without applying any step. (fp16's loss scaler skips
#: such steps while it lowers the scale; the engine skips one in fp32 too, everywhere at once.)
MAX_NONFINITE_STEPS = 3

# ---- stopping at a mini-batch boundary ----------------------------------------------------------
_progress = {"steps_done": 0, "rank": 0}


def steps_done() -> int:
    """Optimizer steps this process's job has completed so far (the running ``run_worker``'s
    counter, including steps restored from a checkpoint); for ``should_stop`` callables."""
    return _progress["steps_done"]


@dataclass(frozen=True)
class StopAtStep:
    """``should_stop`` that asks to stop once ``step`` optimizer steps are done; with ``ranks``,
    only those ranks ask (the others learn it from the agreement all-reduce). Picklable, for
    ``spawn_workers``, tests and benchmarks."""

    step: int
    ranks: tuple[int, ...] | None = None

    def __call__(self) -> bool:
        if self.ranks is not None and _progress["rank"] not in self.ranks:
            return False
        return steps_done() >= self.step


@dataclass(frozen=True)
class StopFile:
    """``should_stop`` that asks to stop when the file ``path`` exists (one ``stat`` a step): a
    flag a local manager, a signal handler or a person can set. Picklable."""

    path: str

    def __call__(self) -> bool:
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


def _agree_stop(should_stop: Callable[[], bool], device: torch.device) -> bool:
    """True on every rank when ``should_stop()`` is True on any rank (one MAX all-reduce of one
    integer; the original relied on a signal reaching every worker)."""
    flag = torch.tensor([1 if should_stop() else 0], dtype=torch.int32, device=device)
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
               should_stop: Callable[[], bool] | None = None, generation: int = 0,
               secret: str | None = None) -> WorkerOutcome:
    """Entry point of one worker (``spawn_workers`` target): train ``job`` from its newest complete
    checkpoint (``train.resume``) or from scratch, under the job's current P, D and stage map.

    Rank 0 appends one line per step to ``<run_dir>/metrics.jsonl`` (with ``generation``),
    writes ``summary.json`` when all steps are done, and ``outcome.json`` (the ``WorkerOutcome``)
    on return. Checkpoints go to ``train.checkpoint_url`` (default ``<run_dir>/checkpoints``)
    every ``train.checkpoint_every`` steps, written in the background.

    Args:
        on_step: ``on_step(step, result, metrics)`` called on every rank after each optimizer
            step; ``step`` is the 0-based index of the step just done, ``metrics`` the dict of its
            ``metrics.jsonl`` line (computed on every rank). Must be cheap and must not raise.
        should_stop: ``should_stop() -> bool`` polled on every rank after every step; the ranks
            agree through one MAX all-reduce, so a request seen by any one rank stops all of them
            after the same step. Then a checkpoint is written at that boundary (even with
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
    job = JobConfig.from_dict(job_dict).validate()
    p, t = job.parallel, job.train
    _progress.update(steps_done=0, rank=rank)
    tr = build_training(job, rank, run_dir)
    engine, opt, loader, val = tr.engine, tr.optimizer, tr.loader, tr.val
    lead = rank == 0
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    url = t.checkpoint_url or default_store_url(out)
    # rank 0 waits this long for every rank's files before giving a checkpoint up (large models, remote stores)
    ckpt = StageCheckpointer(engine, opt, url, default_staging_dir(out, rank), keep=t.keep_checkpoints,
                             timeout_s=max(600.0, job.launch.timeout_s), generation=generation,
                             key=manifest_key(secret) if secret else None)
    ckpt.check_store()
    if lead:
        _log(f"[varuna] {job.name}: P={p.P} x D={p.D}, global batch {p.global_batch} = micro-batch "
             f"{p.micro_batch_size} x m={p.num_micro_batches} x D={p.D}, policy {p.policy}, "
             f"{sum(1 for _ in engine.named_parameters())} tensors on rank 0, generation {generation}")
    _log(f"[rank {rank}] {engine.describe()}")
    start, resumed_from, ppl0 = 0, None, None
    if not t.resume:
        _refuse_stale_store(url, lead, engine.device)
    if t.resume:
        info, common = ckpt.resume()
        if info is not None:
            try:
                loader.load_state_dict(common["loader"])
            except ValueError as e:
                raise CheckpointError(f"checkpoint {info.name!r} in {url!r} does not fit this job's data: {e}") from None
            start = resumed_from = loader.position
            ppl0 = common.get("ppl_start")
            if lead:
                _log(f"[varuna] resumed from {info.name} (saved at P={info.P} x D={info.D}): step {start}")
    _progress["steps_done"] = start
    if ppl0 is None:
        ppl0 = math.exp(evaluate(engine, val))
        if lead:
            _log(f"[varuna] held-out perplexity at start: {ppl0:.2f}")
    tokens_per_step = p.global_batch * tokens_per_example(job, tr.job)
    t_start = time.time()
    r = None
    outcome = WorkerOutcome(status="completed", step=start, generation=generation, resumed_from=resumed_from)
    every = t.checkpoint_every
    skipped_in_a_row = 0
    with open(metrics_path, "a") if lead else open(os.devnull, "w") as mf:
        for step in range(start, t.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, job)
            r = engine.step(tr.batch(step), opt)
            skipped_in_a_row = skipped_in_a_row + 1 if r.skipped else 0
            if skipped_in_a_row >= MAX_NONFINITE_STEPS and t.precision != "fp16":
                raise FloatingPointError(
                    f"steps {step - skipped_in_a_row + 2}..{step + 1}: the loss or the gradients were not finite "
                    f"(loss {r.loss}, grad norm {r.grad_norm}) {skipped_in_a_row} steps in a row in {t.precision}, so "
                    "no step was applied; check the loss function and the data, lower train.lr, or enable "
                    "train.grad_clip")
            done = step + 1
            _progress["steps_done"] = done
            outcome.step, outcome.steps_run = done, outcome.steps_run + 1
            m = StepMetrics(step=step, loss=r.loss, lr=lr_at(step, job), grad_norm=r.grad_norm, skipped=r.skipped,
                            loss_scale=r.loss_scale, step_time_s=r.time_s,
                            tokens_per_s=tokens_per_step / r.time_s, examples_per_s=p.global_batch / r.time_s,
                            wall_time=time.time(), P=p.P, D=p.D, generation=generation)
            md = asdict(m)
            if on_step is not None:
                on_step(step, r, md)
            if lead:
                mf.write(json.dumps(md) + "\n")
                mf.flush()
                _log(f"step {step + 1:4d}/{t.steps} | loss {r.loss:7.4f} | {m.tokens_per_s:8.0f} tok/s | "
                     f"{m.examples_per_s:6.2f} ex/s | {r.time_s:6.3f} s" + (" | skipped (overflow)" if r.skipped else ""))
            stop = False
            if should_stop is not None:
                t0 = time.perf_counter()
                stop = _agree_stop(should_stop, engine.device)
                outcome.stop_poll_s += time.perf_counter() - t0
            if stop or (every and done % every == 0):
                loader_state = {**loader.state_dict(), "step": done}
                outcome.checkpoint_block_s += ckpt.save(done, {"loader": loader_state, "ppl_start": ppl0,
                                                              "job": job.name} if lead else None)
            if stop:
                t0 = time.perf_counter()
                _wait_published(ckpt, engine.device)
                outcome.checkpoint_block_s += time.perf_counter() - t0
                outcome.status, outcome.checkpoint = "stopped", checkpoint_name(done, ckpt.tag)
                if lead:
                    _log(f"[varuna] stopped after step {done}; checkpoint {outcome.checkpoint} published to {url}")
                    _write_outcome(out, outcome)
                sys.stdout.flush()
                return outcome
    t0 = time.perf_counter()
    ckpt.wait()  # a periodic checkpoint still in flight is published before the job ends
    outcome.checkpoint_block_s += time.perf_counter() - t0
    ppl1 = math.exp(evaluate(engine, val))
    if lead:
        _log(f"[varuna] held-out perplexity: start {ppl0:.2f} -> end {ppl1:.2f} "
             f"({outcome.steps_run} steps in {time.time() - t_start:.1f} s)")
        (out / "summary.json").write_text(_strict_json({
            "name": job.name, "steps": t.steps, "P": p.P, "D": p.D, "ppl_start": ppl0, "ppl_end": ppl1,
            "final_loss": r.loss if r is not None else None, "train_time_s": time.time() - t_start,
            "generation": generation, "resumed_from": resumed_from}))
        _write_outcome(out, outcome)
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
