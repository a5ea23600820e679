"""Worker functions run in real spawned processes by the multi-process tests (importable), and
the single-process reference trainer they are compared against.

Rank layout: ``rank = replica * P + stage``. Results go to files (``torch.save`` of plain tensors,
strings and containers; load with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from varuna_sdk.config import ParallelConfig
from varuna_sdk.model import CutPoint, build_on_meta, gpt2, init_gpt2, lm_loss, materialize, preset, segment_rng
from varuna_sdk.pipeline.engine import Varuna


class StopAtStepInFile:
    """A trainer's ``should_stop`` (picklable): stop at a boundary once the steps done reach the
    number written in the file ``path`` (read every step; no file yet: go on)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, progress) -> bool:
        try:
            return progress.steps_done >= int(Path(self.path).read_text())
        except (OSError, ValueError):
            return False


def tiny_cfg(n_layer=3, dropout=0.1, **kw):
    return preset("tiny", n_layer=n_layer, dropout=dropout, bias=False, **kw)


def make_batch(step: int, B: int, T: int, vocab: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


# ---------------------------------------------------------------------------------------------
# small custom models


class MixedBlock(nn.Module):
    """Uses all three boundary tensors: hidden ``x`` (grad), int64 ``mask``, no-grad float ``scale``."""

    def __init__(self, d: int, dropout: float):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask, scale):
        gate = mask.unsqueeze(-1).to(x.dtype)
        return x + self.drop(F.gelu(self.fc(self.ln(x)))) * gate * scale


class MixedModel(nn.Module):
    """Stages exchange (float with grad, int64 mask, float without grad). ``order`` puts the
    tensors in the cut-point call in this order (``"xms"``: x, mask, scale; ``"mxs"``: mask, x,
    scale), so the grad-carrying tensor is not always the first one."""

    def __init__(self, vocab: int = 64, d: int = 16, n_blocks: int = 3, dropout: float = 0.1, order: str = "xms"):
        super().__init__()
        self.order = order
        self.emb = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([MixedBlock(d, dropout) for _ in range(n_blocks)])
        self.cuts = nn.ModuleList([CutPoint() for _ in range(n_blocks + 1)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def _cut(self, i, x, mask, scale):
        if self.order == "xms":
            return self.cuts[i](x, mask, scale)
        mask, x, scale = self.cuts[i](mask, x, scale)
        return x, mask, scale

    def forward(self, idx):
        x = self.drop(self.emb(idx))
        mask = (idx % 3 != 0).long()                                      # int64, no grad
        scale = (0.5 + (idx % 5).to(torch.float32) / 4.0).unsqueeze(-1)   # float, no grad
        for i, blk in enumerate(self.blocks):
            x, mask, scale = self._cut(i, x, mask, scale)
            x = blk(x, mask, scale)
            scale = scale * 0.9
        x, mask, scale = self._cut(len(self.blocks), x, mask, scale)
        return self.head(self.ln_f(x) * (1.0 + mask.unsqueeze(-1).to(x.dtype)))


class LeakyModel(nn.Module):
    """A tensor made in segment 0 (``skip``) is used in segment 2 without crossing the cut-points."""

    def __init__(self, vocab: int = 64, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)
        self.cut1, self.cut2 = CutPoint(), CutPoint()

    def forward(self, idx):
        x = self.emb(idx)
        skip = x * 2.0
        x = self.cut1(x)
        x = self.fc1(x)
        x = self.cut2(x)
        x = self.fc2(x) + skip
        return self.head(x)


class _Group(nn.Module):
    """Owns its cut-points: a cut-point before each of its blocks."""

    def __init__(self, d: int, n: int, dropout: float):
        super().__init__()
        self.cuts = nn.ModuleList([CutPoint() for _ in range(n)])
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Dropout(dropout))
                                     for _ in range(n)])

    def forward(self, x):
        for cut, blk in zip(self.cuts, self.blocks):
            x = cut(x)
            x = x + blk(x)
        return x


class NestedModel(nn.Module):
    """Cut-points live inside sub-modules (two groups of blocks), so a whole group - with its
    cut-points - runs before a later stage's first cut-point."""

    def __init__(self, vocab: int = 64, d: int = 16, groups: int = 2, per_group: int = 2, dropout: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(dropout)
        self.groups = nn.ModuleList([_Group(d, per_group, dropout) for _ in range(groups)])
        self.cut = CutPoint()
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.drop(self.emb(idx))
        for g in self.groups:
            x = g(x)
        return self.head(self.cut(x))


def model_spec(kind: str, model: dict):
    """(model_fn, init_fn, vocab) for a job's model description."""
    if kind == "gpt2":
        cfg = tiny_cfg(**model)
        return (lambda: gpt2(cfg)), partial(init_gpt2, n_layer=cfg.n_layer), cfg.vocab_size
    if kind == "mixed":
        return (lambda: MixedModel(**model)), None, model.get("vocab", 64)
    if kind == "nested":
        return (lambda: NestedModel(**model)), None, model.get("vocab", 64)
    if kind == "leaky":
        return (lambda: LeakyModel(**model)), None, model.get("vocab", 64)
    raise ValueError(f"unknown model kind {kind!r}")


def lm_ce(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _loss_fn(kind: str):
    return lm_loss if kind == "gpt2" else lm_ce


def job_batch(job: dict, step: int):
    p = ParallelConfig(**job["par"])
    opts = job.get("opts", {})
    _, _, vocab = model_spec(job.get("kind", "gpt2"), job.get("model", {}))
    s = 0 if opts.get("repeat_batch") else step
    return make_batch(s, p.global_batch, opts.get("T", 16), vocab=vocab, seed=opts.get("data_seed", 0))


def eval_batch(job: dict):
    """A held-out global batch (a step index no training step uses)."""
    p = ParallelConfig(**job["par"])
    opts = job.get("opts", {})
    _, _, vocab = model_spec(job.get("kind", "gpt2"), job.get("model", {}))
    return make_batch(10_000, p.global_batch, opts.get("T", 16), vocab=vocab, seed=opts.get("data_seed", 0))


# ---------------------------------------------------------------------------------------------
# one job on one rank


def run_job(rank: int, job: dict) -> dict:
    """Run one training job on this rank; return a dict of plain data (tensors, str, containers).

    job = {"name", "kind" (gpt2|mixed|nested|leaky), "par" (ParallelConfig kwargs), "model" (model kwargs),
    "steps", "opts": {seed, lr, clip, precision, loss_scale, T, inject_inf: (step, stage),
    repeat_batch, history}, "expect_error": bool}.
    With ``expect_error`` the engine's construction error is returned instead of raised.
    """
    kind = job.get("kind", "gpt2")
    opts = job.get("opts", {})
    p = ParallelConfig(**job["par"])
    T = opts.get("T", 16)
    model_fn, init_fn, _ = model_spec(kind, job.get("model", {}))
    try:
        eng = Varuna(model_fn, _loss_fn(kind), p, (torch.zeros(p.micro_batch_size, T, dtype=torch.long),),
                     seed=opts.get("seed", 3), init_fn=init_fn, grad_clip=opts.get("clip"),
                     precision=opts.get("precision", "fp32"), loss_scale=opts.get("loss_scale", 2.0**16),
                     rank=rank, timeout_s=opts.get("timeout_s", 60))
    except Exception as e:  # noqa: BLE001 - reported to the test
        if job.get("expect_error"):
            return {"error_type": type(e).__name__, "error": str(e)}
        raise
    if job.get("expect_error"):
        raise AssertionError(f"job {job.get('name')}: expected the engine to refuse this configuration")
    opt = torch.optim.AdamW(eng.parameters(), lr=opts.get("lr", 1e-3))
    inject = opts.get("inject_inf")  # (step, stage)
    keep_history = opts.get("history", False)

    def snapshot():
        return {n: q.detach().clone() for n, q in eng.named_parameters()}

    history = [snapshot()] if keep_history else []
    losses, norms, skipped, scales, step_peaks = [], [], [], [], []
    spent = {"time_s": 0.0, "compute_s": 0.0, "wait_F": 0.0, "wait_B": 0.0, "W": 0.0}   # summed over the steps
    for step in range(job["steps"]):
        handle = None
        if inject and inject[0] == step and inject[1] == eng.stage:
            _, prm = eng.named_parameters()[0]
            handle = prm.register_hook(lambda g: g * float("inf"))
        r = eng.step(job_batch(job, step), opt)
        if handle is not None:
            handle.remove()
        spent["time_s"] += r.time_s
        spent["compute_s"] += sum(r.compute_s.values())
        spent["wait_F"] += r.wait_s.get("F", 0.0)
        spent["wait_B"] += r.wait_s.get("B", 0.0)
        spent["W"] += r.compute_s.get("W", 0.0)
        losses.append(r.loss)
        norms.append(r.grad_norm)
        skipped.append(r.skipped)
        scales.append(r.loss_scale)
        step_peaks.append(r.peak_live_graphs)
        if keep_history:
            history.append(snapshot())
    out = {"losses": torch.tensor(losses, dtype=torch.float64), "norms": torch.tensor(norms, dtype=torch.float64),
           "skipped": torch.tensor(skipped), "scales": torch.tensor(scales, dtype=torch.float64),
           "stage": eng.stage, "replica": eng.replica, "params": snapshot(), "spent": spent,
           "overlapped": eng.grad_sync.launched, "buckets": len(eng.grad_sync.buckets),
           "peak_live_graphs": eng.peak_live_graphs, "step_peaks": step_peaks}
    if keep_history:
        out["history"] = history
    if opts.get("eval"):
        out["eval"] = eng.evaluate(eval_batch(job))
    return out


def suite_worker(rank: int, world: int, out_dir: str, jobs: list) -> None:
    """Run several jobs one after another in the same process group (every job must have
    P × D == world); save ``<name>.rank<r>.pt`` per job."""
    for job in jobs:
        res = run_job(rank, job)
        torch.save(res, Path(out_dir) / f"{job['name']}.rank{rank}.pt")


def train_worker(rank: int, world: int, out_dir: str, par: dict, model: dict, steps: int, opts: dict) -> None:
    """Train ``steps`` steps of a tiny GPT-2 and save losses and local parameters."""
    res = run_job(rank, {"name": "train", "kind": "gpt2", "par": par, "model": model, "steps": steps, "opts": opts})
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def failing_worker(rank: int, world: int, out_dir: str, bad_rank: int) -> None:
    """Record this process's pid; ``bad_rank`` raises, the others block in a collective."""
    import torch.distributed as dist

    Path(out_dir, f"pid{rank}").write_text(str(os.getpid()))
    if rank == bad_rank:
        time.sleep(0.5)
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # never completes: the bad rank does not join
    time.sleep(600)


# ---------------------------------------------------------------------------------------------
# single-process reference


def reference_train(job: dict) -> dict:
    """Plain PyTorch training of the whole model: the same weights (materialise every name with
    the same seed and init), gradient accumulation over the same m·D micro-batches (global index
    j, each forward under ``segment_rng(seed, step, j)``), loss scaled by 1/(m·D),
    ``clip_grad_norm_`` and AdamW. Returns losses, total grad norms and the final parameters."""
    kind = job.get("kind", "gpt2")
    opts = job.get("opts", {})
    p = ParallelConfig(**job["par"])
    seed = opts.get("seed", 3)
    model_fn, init_fn, _ = model_spec(kind, job.get("model", {}))
    model = build_on_meta(model_fn)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    materialize(model, names, seed=seed, device="cpu", init_fn=init_fn)
    model.train()
    loss_fn = _loss_fn(kind)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=opts.get("lr", 1e-3))
    b, n_mb = p.micro_batch_size, p.num_micro_batches * p.D
    clip = opts.get("clip")
    losses, norms = [], []
    for step in range(job["steps"]):
        inputs, targets = job_batch(job, step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(n_mb):
            with segment_rng(seed, step, j):
                out = model(inputs[j * b:(j + 1) * b])
            loss = loss_fn(out, targets[j * b:(j + 1) * b])
            (loss / n_mb).backward()
            total += loss.item() / n_mb
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in params if q.grad is not None]))
        opt.step()
        losses.append(total)
        norms.append(float(norm))
    out = {"losses": torch.tensor(losses, dtype=torch.float64), "norms": torch.tensor(norms, dtype=torch.float64),
           "params": {n: q.detach().clone() for n, q in model.named_parameters()}}
    if opts.get("eval"):
        inputs, targets = eval_batch(job)
        model.eval()
        with torch.no_grad():
            out["eval"] = sum(loss_fn(model(inputs[j * b:(j + 1) * b]), targets[j * b:(j + 1) * b]).item()
                              for j in range(n_mb)) / n_mb
    return out


def hanging_worker(rank: int, world: int, out_dir: str) -> None:
    """Record this process's pid, then never finish (for the spawn timeout path)."""
    Path(out_dir, f"pid{rank}").write_text(str(os.getpid()))
    time.sleep(600)


def hanging_worker_with_a_child(rank: int, world: int, out_dir: str) -> None:
    """Start a child process (its pid recorded), then never finish."""
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    Path(out_dir, f"child{rank}").write_text(str(child.pid))
    time.sleep(600)


def caller_state_worker(rank: int, world: int, out_dir: str) -> None:
    """What this process was given: a variable of the caller's environment, its working directory,
    whether a folder the caller put on ``sys.path`` is there, its parent's command line (the fork
    server's or the caller's); one line on stdout."""
    import json
    import sys

    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(bytes(1), b" ").decode()
    Path(out_dir, f"state{rank}.json").write_text(json.dumps({
        "env": os.environ.get("VARUNA_TEST_CALLER"), "cwd": os.getcwd(),
        "path": os.environ.get("VARUNA_TEST_PATH") in sys.path, "parent": parent}))
    print(f"rank {rank} writes to the caller's stdout", flush=True)


def grad_sync_worker(rank: int, world: int, out_dir: str) -> None:
    """Three parameters reduced by ``GradSync`` over all ranks: ``a`` used on every rank (grad =
    rank + 1), ``b`` on rank 0 only (grad 2), ``c`` on none; saves the reduced gradients."""
    import torch.distributed as dist

    from varuna_sdk.pipeline.grad_sync import GradSync

    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    sync = GradSync([(dist.group.WORLD, [a, b, c])], split=[True])
    sync.arm()
    a.grad = torch.full((3,), float(rank + 1))
    sync.ready(a)
    if rank == 0:
        b.grad = torch.full((3,), 2.0)
        sync.ready(b)
    sync.finish(1.0 / world)
    torch.save({"a": a.grad, "b": b.grad, "c": c.grad}, Path(out_dir) / f"sync{rank}.pt")
