"""Worker functions for the checkpoint tests, run in real spawned gloo processes (importable).

Results go to files (``torch.save`` of tensors and plain containers; the tests load them with
``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from varuna_sdk.checkpoint import StageCheckpointer, default_staging_dir
from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.trainer import build_training, lr_at


def tiny_job(P: int, D: int, steps: int = 6, global_batch: int = 4, **train) -> JobConfig:
    """Tiny GPT-2 with 8 blocks (10 cut-point segments, so P = 8 is possible), byte tokens, fp32,
    dropout 0.1 (so the checkpoint and morph equivalences cover the dropout masks), micro-batch 1 (so m =
    global_batch / D)."""
    return JobConfig(
        name="ckpt-test",
        model=ModelConfig(preset="tiny", n_layer=8, dropout=0.1),
        data=DataConfig(tokenizer="byte", seq_len=16),
        parallel=ParallelConfig(P=P, D=D, global_batch=global_batch, micro_batch_size=1),
        train=TrainConfig(steps=steps, lr=3e-3, warmup_steps=1, eval_batches=1, precision="fp32", **train),
        launch=LaunchConfig(timeout_s=60.0),
    )


def stage_dump(tr, ckpt: StageCheckpointer) -> dict:
    """This rank's parameters, optimizer state (by name), step and data position."""
    e, opt = tr.engine, tr.optimizer
    return {
        "params": {n: p.detach().clone() for n, p in e.named_parameters()},
        "optim": {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(p, {}).items()}
                  for n, p in e.named_parameters()},
        "step": e.step_count,
        "position": tr.loader.position,
        "scaler": e.scaler.state_dict(),
    }


def reshard_worker(rank: int, world: int, job_dict: dict, src_url: str | None, dst_url: str, out_dir: str,
                   train_steps: int) -> None:
    """Build the job's stage; either train ``train_steps`` steps from scratch (``src_url`` None) or
    resume from the newest complete checkpoint of ``src_url``; dump the state to
    ``out_dir/rank<r>.pt``; then checkpoint it to ``dst_url`` and wait until it is published."""
    job = JobConfig.from_dict(job_dict)
    tr = build_training(job, rank)
    ckpt = StageCheckpointer(tr.engine, tr.optimizer, dst_url, default_staging_dir(out_dir, rank), keep=5,
                             timeout_s=60.0)
    if src_url is None:
        for step in range(train_steps):
            for g in tr.optimizer.param_groups:
                g["lr"] = lr_at(step, job)
            tr.engine.step(tr.batch(step), tr.optimizer)
        tr.loader.load_state_dict({**tr.loader.state_dict(), "step": train_steps})
    else:
        info, common = ckpt.resume(src_url)
        assert info is not None, f"no complete checkpoint in {src_url}"
        tr.loader.load_state_dict(common["loader"])
    torch.save(stage_dump(tr, ckpt), Path(out_dir) / f"rank{rank}.pt")
    ckpt.save(tr.engine.step_count, {"loader": tr.loader.state_dict()} if rank == 0 else None)
    ckpt.wait()
    if world > 1:
        torch.distributed.barrier()  # rank 0 returns from wait() only once the manifest is written


class DieAtStep:
    """``on_step`` that kills this process (``os._exit``, no clean-up: a VM lost without notice)
    on rank ``rank`` after step index ``step``."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def __call__(self, step: int, result, metrics: dict) -> None:
        if step == self.step and torch.distributed.get_rank() == self.rank:
            os._exit(9)


def torn_payload(step: int, rank: int) -> dict:
    """The segment file rank ``rank`` writes for checkpoint ``step`` in the torn-write tests."""
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {"segment": rank, "params": {f"w{rank}": torch.randn(64, 64, generator=g)}, "buffers": {}, "optim": {}}


def torn_write(url: str, staging: str, steps: list[int], keep: int) -> None:
    """Write checkpoints ``steps`` (in order) of a 2-rank job from this one process: two
    ``CheckpointWriter`` threads, rank 0 writing the manifest. Run with ``VARUNA_CKPT_CRASH`` set to
    kill the process at one phase of one step's write."""
    from varuna_sdk.checkpoint import CheckpointWriter
    from varuna_sdk.checkpoint.store import checkpoint_name

    writers = [CheckpointWriter(url, r, 2, Path(staging) / f"rank{r}", keep=keep, timeout_s=30.0) for r in range(2)]
    for step in steps:
        name = checkpoint_name(step, "t0")
        for r, w in enumerate(writers):
            files = {f"seg-{r:05d}.pt": torn_payload(step, r)}
            if r == 0:
                files["common.pt"] = {"step": step}
            w.save(name, step, files, {"P": 1, "D": 2} if r == 0 else None)
        for w in writers:
            w.wait()


def reshard_chain_worker(rank: int, world: int, chain: list, urls: list, out_root: str, ports: list,
                         train_steps: int) -> None:
    """Run ``reshard_worker`` for every (P, D) of ``chain`` in turn in these same processes: hop i
    re-initialises torch.distributed with world P × D on its own port (ranks >= P × D sit it out;
    a world of 1 runs without a process group), so the chain costs one set of process start-ups."""
    import datetime

    import torch.distributed as dist

    dist.barrier()  # every rank has connected its pairs before any rank closes them
    dist.destroy_process_group()  # the one spawn_workers made (world 8); each hop makes its own
    for i, (P, D) in enumerate(chain):
        if rank >= P * D:
            continue
        if P * D > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[i]}", rank=rank, world_size=P * D,
                                    timeout=datetime.timedelta(seconds=120))
        out = Path(out_root) / f"hop{i}"
        out.mkdir(parents=True, exist_ok=True)
        job = tiny_job(P, D, global_batch=6).to_dict()
        reshard_worker(rank, P * D, job, urls[i - 1] if i else None, urls[i], str(out), train_steps)
        if P * D > 1:
            dist.barrier()   # no rank tears its pairs down while a peer still uses them
            dist.destroy_process_group()
    # No group is made again for spawn_workers' tear-down (it tolerates none): with no collective
    # after it, a rank that finished connecting its pairs could exit while rank 0 still read its
    # handshake, and rank 0 failed with "Connection closed by peer" in connectFullMesh.
