"""Run a ``JobConfig`` on local worker processes (the embedded default provider).

Owns ``train_local``: validate the whole config before anything starts, make the run folder
(``runs/<name>-<time>/`` with ``config.yaml``, ``metrics.jsonl``, ``summary.json``), prepare the
tokenized corpus once in the parent (workers then hit the cache), start P × D workers with
``cluster.local.spawn_workers`` and return the run's summary. Every worker is stopped on
success, failure, timeout or Ctrl-C.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .cluster.local import spawn_workers
from .config import JobConfig
from .data.loader import tokenize_corpus
from .trainer import check_partition, run_worker


@dataclass
class RunResult:
    """Where a finished run wrote its files, and its headline numbers."""

    run_dir: Path
    summary: dict

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def metrics(self) -> list[dict]:
        """Every step's metrics (``metrics.jsonl`` rows)."""
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]


def new_run_dir(job: JobConfig) -> Path:
    """A fresh ``<train.run_dir>/<name>-<YYYYmmdd-HHMMSS>`` folder (suffixed if it exists)."""
    base = Path(job.train.run_dir) / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():
        path, k = Path(f"{base}-{k}"), k + 1
    path.mkdir(parents=True)
    return path


def plan_job(job: JobConfig, profile=None):
    """Choose P, D, micro-batch size and stage boundaries for ``job.launch.gpus`` local workers
    from a (cached) calibration and the simulator; returns ``(job with parallel filled, Plan)``.
    A P or D the config fixes is kept (only the other is chosen); ``ConfigError`` if no plan has it.
    Local workers share this machine's cores: the plan models them as one VM with
    ``os.cpu_count()`` compute slots (see ``planner.plan.plan_for_job``)."""
    from .planner.plan import plan_for_job
    from .trainer import calibrate_job

    return plan_for_job(job, profile or calibrate_job(job))


def train_local(job: JobConfig, run_dir: str | Path | None = None) -> RunResult:
    """Train ``job`` on P × D local processes (gloo on CPU, NCCL with GPUs).

    Raises ``ConfigError`` before starting anything if the config is invalid, and
    ``WorkerFailure`` (with the failing rank's traceback) if any worker fails; in every case no
    worker process is left running.
    """
    job.validate()
    if job.parallel.planned:
        job, pl = plan_job(job)
        print(pl.table(top=5), flush=True)
        print(f"[varuna] planned: P={job.parallel.P} x D={job.parallel.D}, micro-batch "
              f"{job.parallel.micro_batch_size}, stages {job.parallel.boundaries}", flush=True)
    check_partition(job)  # unknown preset, bad shape or split -> ValueError now, not in a worker
    tokenize_corpus(job.data.corpus, job.data.tokenizer)
    out = Path(run_dir) if run_dir is not None else new_run_dir(job)
    out.mkdir(parents=True, exist_ok=True)
    job.to_yaml(out / "config.yaml")
    spawn_workers(run_worker, job.parallel.world_size, (job.to_dict(), str(out)),
                  backend=job.launch.backend, addr=job.launch.master_addr, port=job.launch.master_port,
                  timeout_s=job.launch.timeout_s + 60.0 * job.train.steps, threads_per_worker=job.launch.threads_per_worker,
                  work_dir=out)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return RunResult(out, summary)


def launch_job(job: JobConfig, *, run_dir: str | Path | None = None, provider=None, job_id: str | None = None,
               **manager_options) -> dict:
    """Run ``job`` under the morph manager in the foreground until it ends, on ``provider``'s
    VMs (default: ``job.launch.gpus`` local worker slots); returns ``Manager.summary()``.

    ``run_dir``: the job's folder; when it already holds the job's event log, the job is
    continued under the same id (a restarted manager picks it up: orphaned workers of the
    previous one stop at a boundary with a checkpoint, then the job resumes). ``manager_options``
    go to ``manager.Manager`` (``heartbeat_interval_s``, ``generation_options``...).
    Raises ``ConfigError`` before anything starts when the config is invalid. The provider is
    closed at the end (no worker left running) when this function made it.
    """
    from .cluster.provider import LocalProvider
    from .manager.manager import Manager

    job.validate()
    out = Path(run_dir) if run_dir is not None else new_run_dir(job)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.yaml").exists():
        job.to_yaml(out / "config.yaml")
    tokenize_corpus(job.data.corpus, job.data.tokenizer)  # once here; workers hit the cache
    own = provider is None
    provider = provider or LocalProvider(job.launch.gpus)
    try:
        mgr = Manager(job, provider, run_dir=out, job_id=job_id, **manager_options)
        mgr.run()
        return mgr.summary()
    finally:
        if own:
            provider.close()

