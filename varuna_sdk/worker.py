"""Entry point started on every worker VM: ``python -m varuna_sdk.worker CONFIG.yaml RUN_DIR``.

Reads its rank, world size and rendezvous from the environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), initialises torch.distributed (NCCL with a GPU, else gloo)
and runs the training loop. Local jobs use ``cluster.local.spawn_workers`` instead, which calls
the same ``trainer.run_worker``.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from .config import JobConfig
from .trainer import run_worker


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m varuna_sdk.worker CONFIG.yaml RUN_DIR", file=sys.stderr)
        return 2
    job = JobConfig.from_yaml(argv[0]).validate()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if torch.cuda.is_available() and job.launch.backend != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    torch.set_num_threads(job.launch.threads_per_worker)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=job.launch.timeout_s))
    try:
        run_worker(rank, world, job.to_dict(), argv[1])
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
