"""A job's calibration, cached: ``calibrate`` run on the job's own model and data, once per model.

Owns ``profile_key`` (the cache key: what the measurements depend on) and ``calibrate_job`` (the
``Profile`` of a ``JobConfig``, measured on real micro-batches of its data and cached as JSON under
``~/.cache/varuna_sdk/profiles``). The manager plans every morph from it, so it lives here, below
the manager, and not in ``trainer`` (the training loop the workers run).

Imports ``config``, ``data``, ``jobspec`` and ``profiling``; must never import ``trainer``,
``planner``, ``cluster`` or ``manager``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..config import JobConfig
from ..data.loader import default_cache_dir
from ..jobspec import ResolvedJob, resolve_job
from .calibrate import calibrate
from .profile import Profile


def profile_key(job: JobConfig, resolved: ResolvedJob | None = None) -> str:
    """Cache key of a job's calibration (16 hex digits): what the measurements depend on — the
    model's identity (factory, arguments, code hash), the shape and type of each input field of an
    example, the sequence length, precision, torch and threads per worker. Not the job's name: two
    jobs of the same model and data shapes share one calibration. ``resolved``: the job's model
    spec and data if already resolved (``jobspec.resolve_job``); raises what resolving raises."""
    r = resolved or resolve_job(job)
    example = {k: [list(v.shape[1:]), str(v.dtype)] if isinstance(v, torch.Tensor) else type(v).__name__
               for k, v in r.data.sample(1, job.data.seq_len).items()}
    text = json.dumps([r.spec.identity, example, job.data.seq_len, job.train.precision, torch.__version__,
                       job.launch.threads_per_worker], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibrate_job(job: JobConfig, cache_dir: str | Path | None = None, refresh: bool = False,
                  micro_batch_sizes: tuple[int, ...] | None = None, resolved: ResolvedJob | None = None,
                  run_dir: str | Path | None = None) -> Profile:
    """Calibrate the job's model once (paper §4.3) on real micro-batches of its data and cache the
    ``Profile`` JSON under ``cache_dir`` (default ``~/.cache/varuna_sdk/profiles``), keyed by
    ``profile_key``; a cached profile is reused unless ``refresh``. ``run_dir``: where objects the
    job shipped by value are looked up too. ``micro_batch_sizes``: default 1, 2, 4 examples — or
    2, 4, 8 for a model that cannot train on one (``ModelSpec.min_micro_batch``). Raises what
    resolving the job or ``calibrate`` raises."""
    r = resolved or resolve_job(job, search=[run_dir] if run_dir is not None else [])
    if micro_batch_sizes is None:
        micro_batch_sizes = tuple(r.spec.min_micro_batch * k for k in (1, 2, 4))
    cache = Path(cache_dir) if cache_dir else default_cache_dir() / "profiles"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{profile_key(job, r)}.json"
    if path.exists() and not refresh:
        prof = Profile.load(path)
        if not prof.calibrated_at:   # a cache file from before the time was recorded: its own time
            prof.calibrated_at = path.stat().st_mtime
        return prof
    T = job.data.seq_len
    prof = calibrate(r.spec.factory, r.spec.loss_fn, lambda b: r.sample_inputs(b, T), micro_batch_sizes,
                     seed=job.train.seed, init_fn=r.spec.init_fn, precision=job.train.precision,
                     threads=job.launch.threads_per_worker,
                     model_info={"name": job.name, "model": r.spec.name, "identity": r.spec.identity})
    tmp = path.with_suffix(".tmp")
    prof.to_json(tmp)
    os.replace(tmp, path)
    return prof
