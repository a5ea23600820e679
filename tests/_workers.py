"""Worker functions run in real spawned processes by the multi-process tests (importable)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from varuna_sdk.config import ParallelConfig
from varuna_sdk.model import gpt2, init_gpt2, lm_loss, preset
from varuna_sdk.pipeline.engine import Varuna


def tiny_cfg(n_layer=3, dropout=0.1, **kw):
    return preset("tiny", n_layer=n_layer, dropout=dropout, bias=False, **kw)


def make_batch(step: int, B: int, T: int, vocab: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train_worker(rank: int, world: int, out_dir: str, par: dict, model: dict, steps: int, opts: dict) -> None:
    """Train ``steps`` steps of a tiny GPT-2 and save losses and local parameters."""
    cfg = tiny_cfg(**model)
    p = ParallelConfig(**par)
    T = opts.get("T", 16)
    eng = Varuna(lambda: gpt2(cfg), lm_loss, p, (torch.zeros(p.micro_batch_size, T, dtype=torch.long),),
                 seed=opts.get("seed", 3), init_fn=partial(init_gpt2, n_layer=cfg.n_layer),
                 grad_clip=opts.get("clip"), precision=opts.get("precision", "fp32"), timeout_s=60)
    opt = torch.optim.AdamW(eng.parameters(), lr=opts.get("lr", 1e-3))
    inject = opts.get("inject_inf")  # (step, stage)
    losses, norms, skipped = [], [], []
    for step in range(steps):
        if inject and inject[0] == step and inject[1] == eng.stage:
            name, prm = eng.named_parameters()[0]
            prm.register_hook(lambda g: g * float("inf"))
        r = eng.step(make_batch(step, p.global_batch, T), opt)
        losses.append(r.loss)
        norms.append(r.grad_norm)
        skipped.append(r.skipped)
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64), "norms": torch.tensor(norms, dtype=torch.float64),
                "skipped": torch.tensor(skipped), "stage": eng.stage, "replica": eng.replica,
                "params": {n: q.detach().clone() for n, q in eng.named_parameters()}},
               Path(out_dir) / f"rank{rank}.pt")
