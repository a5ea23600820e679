"""The training loop every worker runs for a ``JobConfig``: one flat loop, nanoGPT style.

Owns: building the GPT-2 job from a config (data, model, engine, AdamW, warm-up + cosine
learning rate), the per-step line and the JSON-lines metrics file (``metrics.jsonl`` in the run
folder, one object per step, written by rank 0; the dashboard reads it), and the held-out
perplexity at start and end (``summary.json``), and the job's cached calibration
(``calibrate_job``). Sits above ``pipeline``, ``data`` and ``profiling``; never imports
``manager`` (heartbeats are fed through the ``on_step`` callback).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from .config import JobConfig
from .data.loader import BatchLoader, eval_batches, tokenize_corpus, train_val_split
from .data.tokenizer import get_tokenizer
from .model.gpt2 import GPT2Config, gpt2, init_gpt2, lm_loss, preset
from .pipeline.engine import StepResult, Varuna


def model_config(job: JobConfig) -> GPT2Config:
    """The GPT-2 shape of a job: its preset, overridden by explicit fields, with the tokenizer's
    vocabulary and a block size of at least ``seq_len``."""
    m = job.model
    overrides = {k: v for k, v in (("n_layer", m.n_layer), ("n_head", m.n_head), ("n_embd", m.n_embd)) if v is not None}
    vocab = get_tokenizer(job.data.tokenizer).vocab_size
    base = preset(m.preset)
    return preset(m.preset, vocab_size=vocab, dropout=m.dropout,
                  block_size=max(base.block_size, job.data.seq_len), **overrides)


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


def build_engine(job: JobConfig, rank: int | None = None) -> Varuna:
    """The ``Varuna`` engine of this rank for ``job`` (torch.distributed already initialised)."""
    cfg = model_config(job)
    p = job.parallel
    sample = (torch.zeros(p.micro_batch_size, job.data.seq_len, dtype=torch.long),)
    return Varuna(partial(gpt2, cfg), lm_loss, p, sample, seed=job.train.seed,
                  init_fn=partial(init_gpt2, n_layer=cfg.n_layer), precision=job.train.precision,
                  loss_scale=job.train.loss_scale, grad_clip=job.train.grad_clip, rank=rank,
                  timeout_s=job.launch.timeout_s)


def check_partition(job: JobConfig) -> str:
    """Trace the job's model on the meta device and split it exactly as the workers will, so a
    bad P, boundary list or cross-stage use fails in the caller before any process starts.
    Returns a one-line description of the stage map. Raises ``PartitionError``."""
    from .model.materialize import build_on_meta
    from .model.partition import StageMap, balanced_stage_map, shared_state
    from .model.tracer import segment_costs, trace_model

    cfg, p = model_config(job), job.parallel
    structure = trace_model(build_on_meta(partial(gpt2, cfg)),
                            (torch.zeros(p.micro_batch_size, job.data.seq_len, dtype=torch.long),))
    if p.boundaries is not None:
        smap = StageMap.from_lists(p.boundaries, structure.num_segments)
    else:
        smap = balanced_stage_map(segment_costs(structure), p.P)
    shared = shared_state(structure, smap, p.shared_params)
    return f"stages (segments) {smap.to_lists()}, tied across stages: {shared or 'none'}"


def profile_key(job: JobConfig) -> str:
    """Cache key of a job's calibration: model shape, sequence length, precision, torch."""
    import hashlib

    cfg = model_config(job)
    text = json.dumps([cfg.to_dict(), job.data.seq_len, job.train.precision, torch.__version__,
                       job.launch.threads_per_worker], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibrate_job(job: JobConfig, cache_dir: str | Path | None = None, refresh: bool = False,
                  micro_batch_sizes: tuple[int, ...] = (1, 2, 4)):
    """Calibrate the job's GPT-2 once (paper §4.3) and cache the ``Profile`` JSON under
    ``cache_dir`` (default ``~/.cache/varuna_sdk/profiles``); a cached profile is reused."""
    from .data.loader import default_cache_dir
    from .profiling.calibrate import calibrate
    from .profiling.profile import Profile

    cache = Path(cache_dir) if cache_dir else default_cache_dir() / "profiles"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{job.name}-{profile_key(job)}.json"
    if path.exists() and not refresh:
        return Profile.load(path)
    cfg = model_config(job)
    T = job.data.seq_len

    def make_batch(b: int):
        g = torch.Generator().manual_seed(b)
        x = torch.randint(0, cfg.vocab_size, (b, T + 1), generator=g)
        return (x[:, :-1],), x[:, 1:]

    prof = calibrate(partial(gpt2, cfg), lm_loss, make_batch, micro_batch_sizes, seed=job.train.seed,
                     init_fn=partial(init_gpt2, n_layer=cfg.n_layer), precision=job.train.precision,
                     threads=job.launch.threads_per_worker, model_info={"name": job.name, "gpt2": cfg.to_dict()})
    tmp = path.with_suffix(".tmp")
    prof.to_json(tmp)
    os.replace(tmp, path)
    return prof


def _log(msg: str) -> None:
    print(msg, flush=True)


def evaluate(engine: Varuna, batches: list) -> float:
    """Mean held-out loss over ``batches`` (collective)."""
    losses = [engine.evaluate(b) for b in batches]
    return sum(losses) / len(losses)


def run_worker(rank: int, world_size: int, job_dict: dict, run_dir: str,
               on_step: Callable[[int, StepResult], None] | None = None) -> None:
    """Entry point of one worker (``spawn_workers`` target): train ``job`` and, on rank 0, write
    ``metrics.jsonl`` and ``summary.json`` into ``run_dir``. ``on_step(step, result)``, if given,
    is called on every rank after each optimizer step (``varuna_sdk.worker`` feeds the worker's
    heartbeat with it); it must be cheap and must not raise."""
    job = JobConfig.from_dict(job_dict).validate()
    d, p, t = job.data, job.parallel, job.train
    tokens = tokenize_corpus(d.corpus, d.tokenizer)
    train_tokens, val_tokens = train_val_split(tokens, d.val_fraction)
    loader = BatchLoader(train_tokens, d.seq_len, p.global_batch, seed=d.seed)
    val = eval_batches(val_tokens, d.seq_len, p.global_batch, max_batches=t.eval_batches)
    engine = build_engine(job, rank)
    decay = [q for n, q in engine.named_parameters() if q.dim() >= 2]
    no_decay = [q for n, q in engine.named_parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(0.9, 0.95))
    lead = rank == 0
    out = Path(run_dir)
    metrics_path = out / "metrics.jsonl"
    if lead:
        _log(f"[varuna] {job.name}: P={p.P} x D={p.D}, global batch {p.global_batch} = micro-batch "
             f"{p.micro_batch_size} x m={p.num_micro_batches} x D={p.D}, policy {p.policy}, "
             f"{sum(1 for _ in engine.named_parameters())} tensors on rank 0")
    _log(f"[rank {rank}] {engine.describe()}")
    ppl0 = math.exp(evaluate(engine, val))
    if lead:
        _log(f"[varuna] held-out perplexity at start: {ppl0:.2f}")
    tokens_per_step = p.global_batch * d.seq_len
    t_start = time.time()
    with open(metrics_path, "a") if lead else open(os.devnull, "w") as mf:
        for step in range(t.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, job)
            batch = loader.replica_batch(step, engine.replica, p.D)
            r = engine.step(batch, opt)
            if on_step is not None:
                on_step(step, r)
            if lead:
                m = StepMetrics(step=step, loss=r.loss, lr=lr_at(step, job), grad_norm=r.grad_norm, skipped=r.skipped,
                                loss_scale=r.loss_scale, step_time_s=r.time_s,
                                tokens_per_s=tokens_per_step / r.time_s, examples_per_s=p.global_batch / r.time_s,
                                wall_time=time.time(), P=p.P, D=p.D)
                mf.write(json.dumps(asdict(m)) + "\n")
                mf.flush()
                _log(f"step {step + 1:4d}/{t.steps} | loss {r.loss:7.4f} | {m.tokens_per_s:8.0f} tok/s | "
                     f"{m.examples_per_s:6.2f} ex/s | {r.time_s:6.3f} s" + (" | skipped (overflow)" if r.skipped else ""))
    ppl1 = math.exp(evaluate(engine, val))
    if lead:
        _log(f"[varuna] held-out perplexity: start {ppl0:.2f} -> end {ppl1:.2f} "
             f"({t.steps} steps in {time.time() - t_start:.1f} s)")
        (out / "summary.json").write_text(json.dumps({
            "name": job.name, "steps": t.steps, "P": p.P, "D": p.D, "ppl_start": ppl0, "ppl_end": ppl1,
            "final_loss": r.loss, "train_time_s": time.time() - t_start}, indent=2))
    sys.stdout.flush()
