"""Reading the next step's batch while a step trains (``data.prefetch``, ``data.prefetch``
module) against reading it first, in the same run: the same job (P=2 x D=1, a user's classifier
on a user's ``Dataset``, trained with ``runner.train_local``), only ``data.prefetch`` differs;
rounds alternate on / off; the figure is the median ``step_time_s`` of the steps after the
first two (``metrics.jsonl``), and its ratio on / off (so <= 0.77 is >= 1.3x the throughput).

1. **A dataset whose examples wait on storage** (``__getitem__`` sleeps 1.5 ms per example: a
   network file system, object storage): the wait is hidden behind the step; target <= 0.77.
2. **A dataset that decodes on the CPU** (``__getitem__`` runs NumPy work that holds both cores
   while the pipeline's two stages compute on them): nothing to hide it behind on 2 cores;
   target <= 1.05 (no slower).
3. **Token data** (the shipped corpus, GPT-2 preset): reading is a slice of an array; target
   <= 1.05 (no slower).
4. **The simulator's step prediction for the storage-bound job** (``plan_for_job`` from the
   job's calibration, which times its data read: ``Profile.data_read_s``) against the step times
   measured in 1, prefetch on and off: the larger relative error of the two with the read modelled,
   against the same without it (``data_read_s`` = 0, as before the read was modelled); target
   <= 0.5 (the read explains at least half of the error).

Run: ``.venv/bin/python benchmarks/bench_prefetch.py [--rounds 2]``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from varuna_sdk.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from varuna_sdk.runner import train_local  # noqa: E402

STEPS = 14


class _Examples(torch.utils.data.Dataset):
    """Classification examples (x: 256 floats, y: one of 8 classes) that cost ``kind`` to read."""

    def __init__(self, kind: str, n: int = 4096):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 256, generator=g)
        self.y = self.x[:, :8].argmax(dim=1)
        self.kind = kind

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.kind == "storage":
            time.sleep(0.0015)
        else:   # decode: ~1 ms of NumPy work per example
            a = np.random.default_rng(i).standard_normal((96, 96))
            for _ in range(3):
                a = np.tanh(a @ a.T / 96.0)
        return self.x[i], self.y[i]


def storage_examples() -> _Examples:
    return _Examples("storage")


def decoded_examples() -> _Examples:
    return _Examples("decode")


class Classifier(torch.nn.Module):
    """Eight residual MLP blocks, 256 wide: cut-points at the blocks (``auto_cutpoints``)."""

    def __init__(self, width: int = 512, depth: int = 8, classes: int = 8):
        super().__init__()
        self.inp = torch.nn.Linear(256, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width),
                                                              torch.nn.GELU()) for _ in range(depth))
        self.out = torch.nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def _job(name: str, data: DataConfig, model: ModelConfig, run_dir: str) -> JobConfig:
    return JobConfig(name=name, model=model, data=data,
                     parallel=ParallelConfig(P=2, D=1, global_batch=64, micro_batch_size=16),
                     train=TrainConfig(steps=STEPS, lr=1e-3, warmup_steps=1, eval_batches=1, run_dir=run_dir,
                                       checkpoint_every=0))


def _step_times(job: JobConfig, prefetch: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        job = replace(job, data=replace(job.data, prefetch=prefetch), train=replace(job.train, run_dir=d))
        train_local(job, run_dir=Path(d) / "run")
        lines = [json.loads(x) for x in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
    return [m["step_time_s"] for m in lines[2:]]


def _measure(job: JobConfig, rounds: int) -> tuple[list[float], list[float]]:
    on, off = [], []
    for _ in range(rounds):
        on += _step_times(job, True)
        off += _step_times(job, False)
    return on, off


def _compare(label: str, job: JobConfig, rounds: int, target: str,
             measured: tuple[list[float], list[float]] | None = None) -> common.Figure:
    on, off = measured or _measure(job, rounds)
    return common.Figure(f"{label}: median step time, data.prefetch on vs off", statistics.median(on), "s",
                         baseline=statistics.median(off), target=target,
                         detail={"on_s": common.stats(on), "off_s": common.stats(off), "steps_per_round": STEPS - 2,
                                 "rounds": rounds})


def _prediction(job: JobConfig, on: list[float], off: list[float]) -> common.Figure:
    """Figure 4: the planned row's time (the job's fixed P, D and micro-batch) with the read
    modelled and without, against the measured medians, prefetch on and off."""
    from varuna_sdk.planner.plan import plan_for_job
    from varuna_sdk.profiling.job import calibrate_job

    prof = calibrate_job(job)
    blind = replace(prof, data_read_s=0.0)
    measured = {True: statistics.median(on), False: statistics.median(off)}
    pred, err = {}, {"modelled": 0.0, "not modelled": 0.0}
    for prefetch in (True, False):
        j = replace(job, data=replace(job.data, prefetch=prefetch))
        for name, p in (("modelled", prof), ("not modelled", blind)):
            t = plan_for_job(j, p, micro_batch_sizes=[job.parallel.micro_batch_size])[1].best.time_s
            pred[f"{name}, prefetch {'on' if prefetch else 'off'}"] = t
            err[name] = max(err[name], abs(t / measured[prefetch] - 1.0))
    return common.Figure("storage dataset: simulator's step prediction, worse relative error of prefetch on/off, "
                         "read modelled vs not", err["modelled"], "x", baseline=err["not modelled"], target="<= 0.5",
                         detail={"predicted_s": pred, "measured_s": {"prefetch on": measured[True],
                                                                     "prefetch off": measured[False]},
                                 "data_read_s_per_example": prof.data_read_s})


def main() -> None:
    args = common.parse_args(__doc__, lambda ap: ap.add_argument("--rounds", type=int, default=2))
    machine = common.machine_info(idle_before=common.wait_for_idle(args.wait_idle))
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    mine = ModelConfig(factory="bench_prefetch:Classifier")
    storage = _job("storage", DataConfig(dataset="bench_prefetch:storage_examples", tokenizer=None), mine, "/tmp")
    on, off = _measure(storage, args.rounds)
    figures = [
        _compare("dataset waiting on storage (1.5 ms/example)", storage, args.rounds, "<= 0.77", (on, off)),
        _compare("dataset decoding on the CPU (~1 ms/example)",
                 _job("decode", DataConfig(dataset="bench_prefetch:decoded_examples", tokenizer=None), mine, "/tmp"),
                 args.rounds, "<= 1.05"),
        _compare("token data (shipped corpus, GPT-2 preset)",
                 _job("tokens", DataConfig(tokenizer="byte", seq_len=64),
                      ModelConfig(preset="tiny"), "/tmp"), args.rounds, "<= 1.05"),
        _prediction(storage, on, off),
    ]
    common.print_table("data prefetch", figures)
    common.write_results("prefetch", figures, notes=__doc__.split("\n\n")[0], machine=machine)


if __name__ == "__main__":
    main()
