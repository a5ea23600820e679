"""Workers for the third-party model tests (importable by spawned processes) and the plain
PyTorch reference they are compared with.

A case is a job config (plain data) whose model is named by import path — the whole product path:
``jobspec`` resolves the model spec and the data (a real text file, byte tokenizer), the engine
trains it. The reference builds the *raw* model from the same factory on CPU (no cut-point
hooks, nothing of ours), loads the initial weights and buffers every stage started from
(``materialize`` of every name with the job's seed: the model's own constructor, replayed), and
trains it with a plain PyTorch loop: gradient accumulation over the same micro-batches, AdamW.
"""

from __future__ import annotations

from pathlib import Path

import torch

from varuna_sdk.config import JobConfig
from varuna_sdk.jobspec import import_object
from varuna_sdk.model.materialize import build_on_meta, materialize
from varuna_sdk.pipeline.engine import Varuna
from varuna_sdk.trainer import resolve

STEPS = 3


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps a copy of every gradient it steps with (the last step's)."""

    def step(self, closure=None):
        self.grads = [None if p.grad is None else p.grad.detach().clone()  # None: a frozen parameter
                      for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def _batches(job: JobConfig, r):
    loader, _ = r.data.loaders(job.data.seq_len, job.parallel.global_batch, job.data.seed, job.data.val_fraction, 1)
    return loader


def run_case(rank: int, case: dict) -> dict:
    job = JobConfig.from_dict(case["job"]).validate()
    r = resolve(job)
    p = job.parallel
    loader = _batches(job, r)
    sample, _ = r.sample_inputs(p.micro_batch_size, job.data.seq_len)
    eng = Varuna(r.spec.factory, r.spec.loss_fn, p, sample, seed=job.train.seed, init_fn=r.spec.init_fn, rank=rank,
                 timeout_s=60)
    opt = RecordingAdamW(eng.parameters(), lr=job.train.lr)
    losses = []
    for step in range(STEPS):
        res = eng.step(r.split(loader.replica_batch(step, eng.replica, p.D)), opt)
        losses.append(res.loss)
    names = [n for n, _ in eng.named_parameters()]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "grads": dict(zip(names, opt.grads)),
            "params": {n: q.detach().clone() for n, q in eng.named_parameters()}, "call": r.spec.call.describe()}


def cases_worker(rank: int, world: int, out_dir: str, cases: list) -> None:
    """Run each case (P × D == world) in turn; save ``<name>.rank<r>.pt``."""
    for case in cases:
        torch.save(run_case(rank, case), Path(out_dir) / f"{case['name']}.rank{rank}.pt")


def reference(case: dict) -> dict:
    """Plain PyTorch: the raw model, the engine's initial weights, the same micro-batches."""
    job = JobConfig.from_dict(case["job"]).validate()
    r = resolve(job)
    p = job.parallel
    meta = build_on_meta(r.spec.factory)
    names = [n for n, _ in meta.named_parameters()] + [n for n, _ in meta.named_buffers()]
    materialize(meta, names, seed=job.train.seed, device="cpu", init_fn=r.spec.init_fn)
    start = {n: t.detach().clone() for n, t in list(meta.named_parameters()) + list(meta.named_buffers())}
    model = import_object(job.model.factory)(**job.model.kwargs)   # the user's factory, nothing of ours
    if hasattr(model, "config") and hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    with torch.no_grad():
        for n, t in own.items():
            t.copy_(start[n])
    model.train()
    opt = RecordingAdamW(model.parameters(), lr=job.train.lr)
    loader = _batches(job, r)
    b, n_mb = p.micro_batch_size, p.global_batch // p.micro_batch_size
    losses = []
    for step in range(STEPS):
        batch = loader.batch(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(n_mb):
            x = batch["input_ids"][j * b:(j + 1) * b]
            y = (batch["labels"] if case["kind"] == "hf_mlm" else batch["targets"])[j * b:(j + 1) * b]
            loss = _plain_loss(case, model, x, y)
            (loss / n_mb).backward()
            total += loss.item() / n_mb
        opt.step()
        losses.append(total)
    names = [n for n, _ in model.named_parameters()]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "grads": dict(zip(names, opt.grads)),
            "params": {n: q.detach().clone() for n, q in model.named_parameters()}}


def _plain_loss(case: dict, model, x, y):
    """How a user computes the loss of each kind of model, by hand."""
    kind = case["kind"]
    if kind == "hf":        # Hugging Face: labels=input_ids, the model shifts them itself
        return model(input_ids=x, labels=x).loss
    if kind == "hf_mlm":    # masked LM: the masked inputs and their labels (-100: not predicted)
        return model(input_ids=x, labels=y).loss
    if kind == "targets":   # single-file GPT: (idx, targets) -> (logits, loss)
        return model(x, y)[1]
    logits = model(x)       # plain: logits, cross-entropy against the next tokens
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
