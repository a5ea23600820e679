"""Local process start: ``pipeline.spawn.spawn_workers`` forking from its fork server (torch and
``torch._dynamo`` imported once) against spawning every process (``VARUNA_SDK_START_METHOD=spawn``,
the way it started them before), in the same run.

1. **Start → every rank ready**: ``spawn_workers`` of a target that builds a small model and its
   AdamW optimizer (what a worker does first; the optimizer's first call imports
   ``torch._dynamo``) and meets its peers in a barrier, at world 2 and 4; the wall time of the
   whole call. Rounds alternate fork server / spawn after one untimed warm-up each (the fork
   server's own start, timed separately below); medians. Ratio fork server / spawn; target
   <= 0.5.
2. **A calibration's host probes**: ``profiling.network.measure_host`` (what ``calibrate`` runs
   on a host whose network is not cached: p2p, all-reduce, optimizer and compute-contention
   probes in 4 processes), fork server vs spawn; target <= 0.8.

The fork server's one-time start (the first ``spawn_workers`` of a process) is reported as a
figure of its own, without a target.

Run: ``.venv/bin/python benchmarks/bench_spawn.py [--rounds 5]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from varuna_sdk.pipeline.spawn import START_METHOD_ENV, spawn_workers  # noqa: E402


def ready_worker(rank: int, world: int, out: str) -> None:
    """A worker's first moves: a model, its AdamW optimizer, a barrier with its peers."""
    import torch
    import torch.distributed as dist

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    dist.barrier()
    Path(out, f"rank{rank}").write_text("ready")


def _timed_start(method: str, world: int) -> float:
    import bench_spawn   # the target by its module's name: one of the main script is always spawned

    os.environ[START_METHOD_ENV] = method
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        spawn_workers(bench_spawn.ready_worker, world, args=(d,), backend="gloo", timeout_s=120, work_dir=d)
        took = time.perf_counter() - t0
        assert all(Path(d, f"rank{r}").exists() for r in range(world))
    return took


def _timed_probes(method: str) -> float:
    from varuna_sdk.profiling.network import measure_host

    os.environ[START_METHOD_ENV] = method
    t0 = time.perf_counter()
    measure_host(world=4, reps=5, opt_bytes=4 << 20)
    return time.perf_counter() - t0


def main() -> None:
    args = common.parse_args(__doc__, lambda ap: ap.add_argument("--rounds", type=int, default=5))
    machine = common.machine_info(idle_before=common.wait_for_idle(args.wait_idle))
    first = _timed_start("forkserver", 2)          # this process's first: the fork server starts
    _timed_start("spawn", 2)                        # warm-up of the file cache for the baseline
    figures = [common.Figure("fork server start (once per process), included in its first spawn_workers at world 2",
                             first, "s", detail={"note": "no target: paid once per process"})]
    for world in (2, 4):
        forked, spawned = [], []
        for _ in range(args.rounds):
            forked.append(_timed_start("forkserver", world))
            spawned.append(_timed_start("spawn", world))
        figures.append(common.Figure(f"spawn_workers start -> every rank ready, world {world}: fork server vs spawn",
                                     statistics.median(forked), "s", baseline=statistics.median(spawned),
                                     target="<= 0.5", detail={"forkserver_s": forked, "spawn_s": spawned}))
    forked, spawned = [], []
    for _ in range(max(2, args.rounds // 2)):
        forked.append(_timed_probes("forkserver"))
        spawned.append(_timed_probes("spawn"))
    figures.append(common.Figure("calibration host probes (measure_host, 4 processes): fork server vs spawn",
                                 statistics.median(forked), "s", baseline=statistics.median(spawned),
                                 target="<= 0.8", detail={"forkserver_s": forked, "spawn_s": spawned}))
    os.environ.pop(START_METHOD_ENV, None)
    common.print_table("local process start", figures)
    common.write_results("spawn", figures, notes=__doc__.split("\n\n")[0], machine=machine)


if __name__ == "__main__":
    main()
