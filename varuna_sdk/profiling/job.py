"""A job's calibration, cached: ``calibrate`` run on the job's own model and data, once per model.

Owns ``profile_key`` (the cache key: what the measurements depend on), ``calibrate_job`` (the
``Profile`` of a ``JobConfig``, measured on real micro-batches of its data and cached as JSON under
``~/.cache/varuna_sdk/profiles``) and the per-host network cache (``host_key``,
``cached_host_network``, ``store_host_network``): the machine's p2p and all-reduce figures do not
depend on the model, so a calibration within ``HOST_NETWORK_MAX_AGE_S`` of the last one on this
host skips those probes (~8 s of a ~20 s calibration on a 2-core machine). The manager plans every
morph from the profile, so it lives here, below the manager, and not in ``trainer`` (the training
loop the workers run).

Imports ``config``, ``data``, ``jobspec`` and ``profiling``; must never import ``trainer``,
``planner``, ``cluster`` or ``manager``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from ..config import JobConfig
from ..data.loader import default_cache_dir
from ..data.prefetch import draws_random
from ..jobspec import ResolvedJob, resolve_job
from ..model.cutpoint import AUTO_CUTPOINTS_VERSION
from .calibrate import calibrate
from .network import MODEL_SAMPLES
from .profile import NetworkProfile, Profile

# How long a host's measured network figures are reused by later calibrations on the host (s): long
# enough for a session's models to share one measurement, short enough that a measurement taken on
# a loaded machine does not plan every later job (``refresh=True`` measures afresh at once).
HOST_NETWORK_MAX_AGE_S = 3600.0

# A cached calibration measured while other work kept at least BUSY_STALE of the CPUs busy is
# measured again once at most BUSY_QUIET are, if at least BUSY_RECHECK_AGE_S old
# (``measured_under_load``); the load is sampled over BUSY_WINDOW_S seconds before each
# calibration or cache read.
BUSY_STALE = 0.5
BUSY_QUIET = 0.2
BUSY_WINDOW_S = 0.2
BUSY_RECHECK_AGE_S = 600.0

# Wall-clock seconds ``measure_data_read`` may spend timing the job's data reads (a fast dataset
# reads its 252 examples well within it; a slow one stops after a batch or two).
DATA_READ_BUDGET_S = 0.5


def profile_key(job: JobConfig, resolved: ResolvedJob | None = None) -> str:
    """Cache key of a job's calibration (16 hex digits): what the measurements depend on — the
    model's identity (factory, arguments, code hash), the shape and type of each input field of an
    example, the sequence length, precision, torch, threads per worker and the version of the
    cut-point rules (``model.cutpoint.AUTO_CUTPOINTS_VERSION``) and ``model.blocks``. Not the job's name: two
    jobs of the same model and data shapes share one calibration. ``resolved``: the job's model
    spec and data if already resolved (``jobspec.resolve_job``); raises what resolving raises."""
    r = resolved or resolve_job(job)
    return _key(job, r, input_shapes(r, job.data.seq_len))


def _key(job: JobConfig, r: ResolvedJob, example: dict) -> str:
    # model.blocks moves the cut-points, so the segments measured (in the key only when set: older keys hold)
    where = [{"blocks": job.model.blocks}] if job.model.blocks is not None else []
    text = json.dumps([r.spec.identity, example, job.data.seq_len, job.train.precision, torch.__version__,
                       job.launch.threads_per_worker, AUTO_CUTPOINTS_VERSION, *where], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def input_shapes(r: ResolvedJob, seq_len: int) -> dict:
    """The shape of one example of each batch field (the batch dimension left out) and its dtype,
    ``{field: [shape, dtype]}`` (a field that is no tensor: its type's name): what a calibration's
    times depend on besides the model and precision. Reads one example of the job's data."""
    return {k: [list(v.shape[1:]), str(v.dtype)] if isinstance(v, torch.Tensor) else type(v).__name__
            for k, v in r.data.sample(1, seq_len).items()}


def profile_inputs(job: JobConfig, r: ResolvedJob) -> dict:
    """What a profile records of the job's inputs (``Profile.model``'s ``inputs`` and
    ``precision``): the per-example shapes and dtypes of its batch fields (``input_shapes``) and
    the numeric precision — what ``profile_misfit`` compares with another job's."""
    return {"inputs": json.loads(json.dumps(input_shapes(r, job.data.seq_len))), "precision": job.train.precision}


def profile_misfit(prof: Profile, job: JobConfig, r: ResolvedJob) -> list[str]:
    """How the inputs ``prof`` was measured on differ from ``job``'s (``profile_inputs``): each
    batch field whose per-example shape or dtype differs (another sequence length, image size or
    dtype), a field only one of them has, another precision — ``[]`` when they are the same (the
    micro-batch size may differ: the planner interpolates over it) or the profile records none of
    them (one calibrated before they were recorded, or synthetic)."""
    measured, mine = prof.model or {}, profile_inputs(job, r)
    out = []
    had, have = measured.get("inputs"), mine["inputs"]
    if isinstance(had, dict) and had != have:
        def said(x):
            return "absent" if x is None else (f"{x[1]} of shape {x[0]} per example"
                                               if isinstance(x, list) and len(x) == 2 else repr(x))
        out += [f"input {k!r}: {said(had.get(k))} in the profile, {said(have.get(k))} in the job"
                for k in sorted(set(had) | set(have)) if had.get(k) != have.get(k)]
    if measured.get("precision") not in (None, mine["precision"]):
        out.append(f"precision {measured['precision']} in the profile, {mine['precision']} in the job")
    return out


def calibrate_job(job: JobConfig, cache_dir: str | Path | None = None, refresh: bool = False,
                  micro_batch_sizes: tuple[int, ...] | None = None, resolved: ResolvedJob | None = None,
                  run_dir: str | Path | None = None, warn_under_load: bool = True) -> Profile:
    """Calibrate the job's model once (paper §4.3) on real micro-batches of its data and cache the
    ``Profile`` JSON under ``cache_dir`` (default ``~/.cache/varuna_sdk/profiles``), keyed by
    ``profile_key``; a cached profile is reused unless ``refresh``. ``run_dir``: where objects the
    job shipped by value are looked up too. ``micro_batch_sizes``: default 1, 2, 4 examples — or
    2, 4, 8 for a model that cannot train on one (``ModelSpec.min_micro_batch``). The profile's
    ``data_read_s`` is timed on this job's data every time (``measure_data_read``), and its
    ``busy_at_calibration`` says how busy other work kept the CPUs (a calibration made while at
    least ``BUSY_STALE`` were busy warns that its figures are inflated); a cached profile measured
    under load is measured again, with a warning, once the machine is quiet
    (``measured_under_load``). ``warn_under_load=False``: no ``UserWarning`` for a calibration made
    now under load (``under_load_warning``), for a caller that reports it its own way (the
    manager: a log line and a WARNING event). Raises what resolving the job or ``calibrate`` raises."""
    r = resolved or resolve_job(job, search=[run_dir] if run_dir is not None else [])
    if micro_batch_sizes is None:
        micro_batch_sizes = tuple(r.spec.min_micro_batch * k for k in (1, 2, 4))
    cache = Path(cache_dir) if cache_dir else default_cache_dir() / "profiles"
    cache.mkdir(parents=True, exist_ok=True)
    inputs = profile_inputs(job, r)
    path = cache / f"{_key(job, r, inputs['inputs'])}.json"
    busy = busy_fraction()
    stale = False
    if path.exists() and not refresh:
        prof = Profile.load(path)
        if not prof.calibrated_at:   # a cache file from before the time was recorded: its own time
            prof.calibrated_at = path.stat().st_mtime
        for k, v in inputs.items():   # a cache file from before they were recorded: the key holds them
            prof.model.setdefault(k, v)
        if not measured_under_load(prof.busy_at_calibration, busy, time.time() - prof.calibrated_at):
            # measured afresh: the key holds the data's shapes, not the dataset (another with the
            # same shapes may read slower)
            prof.data_read_s, prof.data_draws_random = measure_data_read(r, job.data.seq_len)
            return prof
        warnings.warn(f"the cached calibration of this model ({path.name}) was measured while other work kept "
                      f"{prof.busy_at_calibration:.0%} of this machine's CPUs busy, which inflates its compute "
                      f"times; the CPUs are {busy:.0%} busy now, so it is measured again", stacklevel=2)
        stale = True
    T = job.data.seq_len
    threads = job.launch.threads_per_worker
    hosts = cache / "hosts"
    known = None if refresh or stale else cached_host_network(hosts, threads)
    prof = calibrate(r.spec.factory, r.spec.loss_fn, lambda b: r.sample_inputs(b, T), micro_batch_sizes,
                     seed=job.train.seed, init_fn=r.spec.init_fn, precision=job.train.precision,
                     threads=threads, network=known or True,
                     model_info={"name": job.name, "model": r.spec.name, "identity": r.spec.identity, **inputs})
    if known is None and prof.network is not None:
        store_host_network(hosts, threads, prof.network)
    prof.data_read_s, prof.data_draws_random = measure_data_read(r, T)
    prof.busy_at_calibration = busy
    try:
        _write_atomic(path, prof.to_json())
    except OSError as e:   # the cache (a folder another process removed, a full disk): the profile still serves
        warnings.warn(f"the calibration could not be cached at {path} ({e}); this plan uses it, and the next job "
                      "of this model calibrates again", stacklevel=2)
    said = under_load_warning(busy)
    if said and warn_under_load:
        warnings.warn(said, stacklevel=2)
    return prof


def under_load_warning(busy: float | None) -> str | None:
    """What to tell a user of a calibration made while other work kept ``busy`` (a fraction) of
    the CPUs busy, when that is at least ``BUSY_STALE``; None otherwise."""
    if busy is None or busy < BUSY_STALE:
        return None
    return (f"the model was calibrated while other work kept {busy:.0%} of this machine's CPUs busy: its compute "
            "times are inflated, and the plans made from them (P, D, whether a returning VM is worth growing onto) "
            f"may be off. It is measured again once it is {BUSY_RECHECK_AGE_S / 60:.0f} min old and the machine at "
            f"most {BUSY_QUIET:.0%} busy; or calibrate on a quiet machine with `varuna calibrate CONFIG --refresh`")


def cpu_times() -> tuple[int, int] | None:
    """This machine's CPU time so far, ``(idle, total)`` in clock ticks over every CPU (idle
    includes waiting for I/O), from ``/proc/stat``; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(vals) < 4:
        return None
    return vals[3] + (vals[4] if len(vals) > 4 else 0), sum(vals)


def busy_fraction(window_s: float = BUSY_WINDOW_S) -> float | None:
    """The share of this machine's CPU time (0..1) that was not idle over the next ``window_s``
    seconds (this process sleeps meanwhile: the work is other processes'); None where
    ``cpu_times`` is None."""
    a = cpu_times()
    time.sleep(window_s)
    b = cpu_times()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return round(1.0 - (b[0] - a[0]) / (b[1] - a[1]), 3)


def measured_under_load(busy_then: float | None, busy_now: float | None, age_s: float) -> bool:
    """True when a cached calibration ``age_s`` seconds old should be measured again: other work
    kept at least ``BUSY_STALE`` of the CPUs busy while it was measured (its compute times are
    inflated, and every later plan of the model would use them), at most ``BUSY_QUIET`` are busy
    now, and it is at least ``BUSY_RECHECK_AGE_S`` old (calls moments apart share one calibration,
    whatever a fraction of a second's load said). A machine that stays busy keeps its calibration
    (measuring again would measure the same load); None (not known) never triggers it."""
    return (busy_then is not None and busy_now is not None and busy_then >= BUSY_STALE and busy_now <= BUSY_QUIET
            and age_s >= BUSY_RECHECK_AGE_S)


def measure_data_read(r: ResolvedJob, seq_len: int, budget_s: float = DATA_READ_BUDGET_S,
                      max_examples: int = 256) -> tuple[float, list[str]]:
    """Seconds to read one example of the job's data as a training step reads it: the dataset's
    ``__getitem__`` (or the token slice), collation and the split into inputs and targets
    (``ResolvedJob.sample_inputs``), timed over batches of 4, 8, 16, ... examples after one warm-up
    read (which opens files and fills caches), stopping before the next batch would take the total
    past ``budget_s`` seconds or ``max_examples`` examples; and the global random generators the
    warm-up read drew from (``data.prefetch.draws_random``: a dataset whose reads draw from them is
    read on the main thread, not ahead). The simulator charges each rank ``global_batch / D`` times
    the seconds per mini-batch (``SimConfig.data_read``). Raises what reading the data raises (the
    job's dry run has read these examples already)."""
    _, moved = draws_random(lambda: r.sample_inputs(4, seq_len))
    spent, n_read, n = 0.0, 0, 4
    while True:
        t0 = time.perf_counter()
        r.sample_inputs(n, seq_len)
        spent += time.perf_counter() - t0
        n_read += n
        n *= 2
        if n_read + n > max_examples or spent + n * spent / n_read > budget_s:
            return spent / n_read, moved


def host_key(threads: int) -> str:
    """Cache key of this host's network figures (16 hex digits): host name, CPUs this process may
    use, threads per worker, torch and varuna_sdk versions — what ``measure_host``'s p2p and
    all-reduce probes depend on besides load."""
    from .. import __version__

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    text = json.dumps([platform.node(), os.cpu_count(), cpus, threads, torch.__version__, __version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_host_network(folder: str | Path, threads: int, max_age_s: float = HOST_NETWORK_MAX_AGE_S,
                        now: float | None = None) -> NetworkProfile | None:
    """This host's network figures stored by ``store_host_network`` under ``folder`` less than
    ``max_age_s`` seconds ago (``now``: Unix seconds, default the clock), or None: none stored,
    too old, or unreadable (a torn or foreign file is never used: it is measured afresh)."""
    path = Path(folder) / f"{host_key(threads)}.json"
    try:
        d = json.loads(path.read_text())
        age = (time.time() if now is None else now) - float(d["measured_at"])
        net = NetworkProfile(**d["network"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return net if 0.0 <= age < max_age_s else None


def store_host_network(folder: str | Path, threads: int, network: NetworkProfile, now: float | None = None) -> Path:
    """Keep ``network`` (its model-free part: p2p, all-reduce, consensus) as this host's figures
    under ``folder`` for ``cached_host_network``, measured at ``now`` (Unix s, default the clock);
    written whole or not at all. Returns the file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    samples = {k: v for k, v in network.samples.items() if k not in MODEL_SAMPLES}
    d = {"measured_at": time.time() if now is None else now, "network": {**asdict(network), "samples": samples}}
    path = folder / f"{host_key(threads)}.json"
    _write_atomic(path, json.dumps(d))
    return path


def _write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all (a temporary file renamed over it), its folder made
    if it is gone (a cache folder removed while a calibration ran). Raises ``OSError``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
