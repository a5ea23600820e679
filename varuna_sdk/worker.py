"""Entry point started on every worker VM: ``python -m varuna_sdk.worker CONFIG.yaml RUN_DIR``.

Reads its rank, world size and rendezvous from the environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), initialises torch.distributed (NCCL with a GPU, else gloo)
and runs the training loop. Local jobs use ``cluster.local.spawn_workers`` instead, which calls
the same ``trainer.run_worker``.

Heartbeats: when the launcher set ``VARUNA_HEARTBEAT_ADDR`` (and ``VARUNA_JOB_TOKEN``), a
``manager.heartbeat.HeartbeatClient`` reports this worker's step, loss, per-micro-batch compute
times and memory to the manager every interval, and says goodbye at the end ("ok", or "failed"
with the exception's last line) so that a crash is never taken for a lost VM.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .cluster.local import retain_freed_memory
from .config import JobConfig
from .manager.heartbeat import HeartbeatClient
from .trainer import run_worker

HEARTBEATS = True  # main() runs a heartbeat client (varuna_sdk.manager.heartbeat_worker checks)


def main(argv: list[str] | None = None, heartbeat: HeartbeatClient | None = None) -> int:
    """Run one worker. ``heartbeat``: an already started client (else one from the environment,
    or none); main feeds it after every step and closes it."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m varuna_sdk.worker CONFIG.yaml RUN_DIR", file=sys.stderr)
        return 2
    hb = heartbeat or HeartbeatClient.from_env()
    if hb is not None and not hb.started:
        hb.start()
    try:
        _train(argv, hb)
    except BaseException as e:
        if hb is not None:
            hb.close(status="failed", error="".join(traceback.format_exception_only(e)).strip())
        raise
    if hb is not None:
        hb.close(status="ok")
    return 0


def _train(argv: list[str], hb: HeartbeatClient | None) -> None:
    job = JobConfig.from_yaml(argv[0]).validate()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if torch.cuda.is_available() and job.launch.backend != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    torch.set_num_threads(job.launch.threads_per_worker)
    retain_freed_memory()
    m = job.parallel.num_micro_batches
    on_step = None if hb is None else (lambda step, r: hb.record_step(
        step, loss=r.loss, compute_s=r.compute_s, micro_batches=m, step_time_s=r.time_s))
    Path(argv[1]).mkdir(parents=True, exist_ok=True)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=job.launch.timeout_s))
    try:
        run_worker(rank, world, job.to_dict(), argv[1], on_step=on_step)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
