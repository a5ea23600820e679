"""The one run façade: every way of running a job — ``varuna train``, ``varuna launch``,
``Job.launch()`` in a notebook, ``make demo`` — goes through ``prepare_run`` and the morph
manager (``manager.Manager``), so each of them plans, checkpoints and morphs the same way.

``prepare_run`` does everything that can fail before a process starts: validate the config,
pack callables shipped by value (``JobObjects``: a model, loss, init or dataset defined in a
notebook cell), resolve and check the model spec and data together (``jobspec``: vocabulary,
context, fields, too little data), trace and split the model for a fixed P, then make the run
folder (``runs/<name>-<time>/``) with ``config.yaml`` and the objects file. ``launch_job`` runs
the manager in the foreground on a provider's VMs; ``train_local`` is ``varuna train``: the
job's fixed P × D on as many local worker slots (no calibration is needed to start; a failure
ends the job at once with the failing rank's traceback), returning the run's summary.
Every worker is stopped on success, failure, timeout or Ctrl-C.

(Named ``runner``, not ``launch``: "launch" is ``varuna launch`` — ``launch_job`` here — and
``Job.launch()``; this module serves every front door.) Sits above ``manager`` and ``trainer``
(layer 7, with ``worker``); imports them, ``cluster``, ``planner`` and ``profiling`` where used;
must never import ``demo``, ``notebook``, ``cli`` or the dashboard.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .config import ConfigError, JobConfig
from .shipping import objects_file_name, pack_objects


@dataclass
class RunResult:
    """Where a finished run wrote its files, and its headline numbers. ``trained``: False when
    ``run_dir`` held a job that had already finished, so nothing ran this time (its files are
    the earlier run's)."""

    run_dir: Path
    summary: dict
    trained: bool = True

    @property
    def metrics_path(self) -> Path:
        """The run's per-step metrics file, ``run_dir/metrics.jsonl`` (one JSON object per step; ``metrics()`` reads
        it)."""
        return self.run_dir / "metrics.jsonl"

    def metrics(self) -> list[dict]:
        """Every step's metrics (``metrics.jsonl`` rows), in order. Their ``step`` is 0-based (the
        first step is 0), while the worker logs and ``varuna status`` count from 1 ("step 566/2000"
        there is the row with ``step`` 565)."""
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]


@dataclass
class JobObjects:
    """Callables a job ships by value (``varuna_sdk.shipping``): ``model`` (a factory or class
    returning the whole ``nn.Module``), ``loss`` (``(output, targets) -> scalar``), ``init``
    (``init_fn(module, name)``), ``dataset`` (a factory returning a map-style ``Dataset``), and
    ``modules``: the user's own modules to pickle by value as well (not installed on the VMs)."""

    model: Callable | None = None
    loss: Callable | None = None
    init: Callable | None = None
    dataset: Callable | None = None
    modules: Sequence[Any] = field(default_factory=tuple)

    def pack(self, job: JobConfig) -> dict[str, bytes]:
        """Pack the model-side and data-side callables (one objects file each), set
        ``job.model.by_value`` / ``job.data.by_value`` to their digests and return
        ``{file name: bytes}`` to write into the run folder. Raises ``TypeError`` naming a
        callable that cannot be pickled."""
        files = {}
        model_side = {"factory": self.model, "loss": self.loss, "init": self.init}
        if any(v is not None for v in model_side.values()):
            if self.model is None:
                raise TypeError("a loss or init shipped by value needs the model shipped by value too (model=...)")
            digest, blob = pack_objects(model_side, self.modules)
            job.model.by_value, job.model.factory = f"sha256:{digest}", None
            files[objects_file_name(digest)] = blob
        if self.dataset is not None:
            digest, blob = pack_objects({"dataset": self.dataset}, self.modules)
            job.data.by_value = f"sha256:{digest}"
            files[objects_file_name(digest)] = blob
        return files


def new_run_dir(job: JobConfig) -> Path:
    """A fresh ``<train.run_dir>/<name>-<YYYYmmdd-HHMMSS>`` folder (suffixed if it exists)."""
    base = Path(job.train.run_dir) / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():
        path, k = Path(f"{base}-{k}"), k + 1
    make_run_folder(path, "train.run_dir")
    return path


def file_in_the_way(path: str | Path) -> Path | None:
    """The file that keeps ``path`` from being (or becoming) a folder: ``path`` itself when it is a
    file, else its nearest existing parent when that is a file; ``None`` when there is none (or it
    cannot be told: no permission)."""
    for q in (Path(path), *Path(path).parents):
        try:
            if q.exists():
                return None if q.is_dir() else q
        except OSError:
            return None
    return None


def make_run_folder(path: Path, what: str) -> None:
    """``mkdir -p path``; an ``OSError`` (a file in the way, no permission, a read-only or virtual
    file system) becomes a ``ConfigError`` naming ``what`` to change."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = file_in_the_way(path)
        why = f"{blocker} is a file, not a folder" if blocker is not None else (e.strerror or str(e))
        raise ConfigError(f"cannot create the run folder {path}: {why}; set {what} to a folder you can "
                          "write") from None


def run_folders_inside(path: str | Path) -> list[Path]:
    """The run folders (each holding ``events.db``) directly inside ``path``, by name; [] when
    ``path`` is not a folder or cannot be listed."""
    try:
        return sorted((d for d in Path(path).iterdir() if d.is_dir() and (d / "events.db").is_file()),
                      key=lambda d: d.name)
    except OSError:
        return []


def _check_can_make(p: Path, given: str) -> None:
    """Make the folder ``p`` (and its missing parents) and remove them again: a run folder that
    cannot be made (no permission, a read-only or virtual file system such as /proc) is refused
    now, not after a calibration. Raises ``ConfigError`` naming the reason."""
    made: list[Path] = []
    q = p.absolute()
    while not q.exists() and q != q.parent:
        made.append(q)
        q = q.parent
    try:
        p.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(f"{given}: the run folder cannot be made ({e.strerror or e}); give a folder this user can "
                          "create and write (e.g. runs/my-job)") from None
    for d in made:   # innermost first: only what this check made
        try:
            d.rmdir()
        except OSError:
            break


def check_run_dir(run_dir: str | Path | None, name: str | None = None, *, notebook: bool = False) -> None:
    """Refuse, before any work, a ``run_dir`` that cannot be a job's run folder: an empty or blank
    path (it would make the current directory the run folder), a file, or a path under a file
    (no folder can be made there); and a folder *of* runs rather than one job's run
    folder: a folder that is no run itself (no ``events.db``, no ``config.yaml``) but holds run
    folders. Made the job's folder, it would hide those runs from ``varuna status`` and refuse the
    next job there. Raises ``ConfigError`` naming the runs inside and what to pass instead: a new
    folder inside it, or no run folder and ``train.run_dir`` set to it (each run then gets a new
    ``NAME-TIME`` folder inside it, ``new_run_dir``). ``notebook``: the messages name
    ``Job(run_dir=...)`` rather than ``--run-dir``."""
    if run_dir is None:
        return
    given = f"Job(run_dir={str(run_dir)!r})" if notebook else f"--run-dir {str(run_dir)!r}"
    if isinstance(run_dir, str) and not run_dir.strip():
        raise ConfigError(f"{given}: the run folder is empty, which would make the current directory the job's run "
                          "folder; name a folder (e.g. " + ("Job(..., run_dir='runs/my-job')" if notebook else
                                                            "--run-dir runs/my-job") + "), or leave it out for a new "
                          "NAME-TIME folder inside train.run_dir")
    p = Path(run_dir)
    blocker = file_in_the_way(p)
    if blocker is not None:
        where = "is a file" if blocker == p else f"is under {str(blocker)!r}, a file"
        raise ConfigError(f"{given} {where}, not a folder: a run folder cannot be made there; give a folder (a new "
                          "one, or a job's run folder to continue it)")
    if not p.exists():
        _check_can_make(p, given)
    if not p.is_dir() or (p / "events.db").is_file() or (p / "config.yaml").is_file():
        return
    inner = run_folders_inside(p)
    if not inner:
        return
    shown = ", ".join(d.name for d in inner[:3]) + (f" and {len(inner) - 3} more" if len(inner) > 3 else "")
    new = p / (name or "NAME")
    raise ConfigError(
        f"run folder {str(p)!r} is a folder of runs, not a job's own run folder: it holds {len(inner)} run "
        f"folder(s) ({shown}), and a run folder holds one job. Give a new folder inside it (--run-dir {new}; in "
        f"a notebook Job(..., run_dir={str(new)!r})), or leave the run folder out and set train.run_dir: {p} "
        f"(--run-dir left out; in a notebook Job(..., train_run_dir={str(p)!r})): each run then gets a new "
        f"NAME-TIME folder inside it. `varuna status {p}` lists the runs there")


def _note_runs_inside(e: ConfigError, run_dir: Path) -> ConfigError:
    """``e`` (a run folder this config cannot continue) with a note when that run folder holds other
    run folders too: it was given as the run folder of a job while it held other runs."""
    inner = run_folders_inside(run_dir)
    if not inner:
        return e
    return ConfigError(f"{e}. Note: {run_dir} also holds {len(inner)} run folder(s) of other jobs inside it "
                       f"({', '.join(d.name for d in inner[:3])}{' ...' if len(inner) > 3 else ''}): to start a "
                       f"new job beside them, give a new folder inside it (--run-dir {run_dir}/NAME) or set "
                       f"train.run_dir: {run_dir} and leave the run folder out")


def check_store_url(job: JobConfig) -> None:
    """``train.checkpoint_url`` must be usable from the launcher before anything starts: a local
    path (or ``file://`` URL) must be a folder or a path that can become one — not a file, nor a
    path under a file; a remote one (``s3://``, ``gs://``, ``ftp://`` ...) must open. Raises
    ``ConfigError`` saying which and what to change."""
    url = job.train.checkpoint_url
    if not url:
        return
    if "://" not in url or url.startswith("file://"):
        _check_local_store(url)
        return
    from .checkpoint import Store

    try:
        Store(url).fs.exists(Store(url).root)
    except Exception as e:  # noqa: BLE001 - any driver's error: DNS, credentials, permissions
        raise ConfigError(f"train.checkpoint_url={url!r} cannot be opened from here ({type(e).__name__}: "
                          f"{str(e)[:200]}); every worker must reach the store: fix the URL or its "
                          "credentials") from None


def check_local_backend(job: JobConfig, provider=None) -> None:
    """``launch.backend: nccl`` for workers on this machine (``provider`` None or a
    ``cluster.provider.LocalProvider``) that has no CUDA GPU (or a torch without NCCL) is refused
    before anything starts: NCCL cannot run there, and falling back to gloo without a word would
    not be what the config asks. Raises ``ConfigError`` saying what to set instead. Workers on
    other VMs (SSH hosts, a cloud) are not checked here: each refuses on its own VM (``worker``)."""
    if job.launch.backend != "nccl":
        return
    from .cluster.provider import LocalProvider

    if provider is not None and not isinstance(provider, LocalProvider):
        return
    import torch

    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return
    why = "no CUDA GPU" if not torch.cuda.is_available() else "a torch built without NCCL"
    raise ConfigError(f"launch.backend: nccl, but this machine, where the workers run, has {why}; set "
                      "launch.backend: auto (NCCL where every worker has a GPU, else gloo) or gloo")


def _check_local_store(url: str) -> None:
    """A local ``train.checkpoint_url``: the path, or its nearest existing parent, is a folder."""
    path = Path(url[len("file://"):] if url.startswith("file://") else url).expanduser()
    here = file_in_the_way(path)
    if here is None:
        return
    where = "is a file" if here == path else f"is under {str(here)!r}, which is a file"
    raise ConfigError(f"train.checkpoint_url={url!r} {where}, not a folder: checkpoints are folders of files; give "
                      "train.checkpoint_url a folder (or leave it out: <run folder>/checkpoints)")


def check_resume(job: JobConfig, run_dir: str | Path | None) -> None:
    """Before any worker starts, whether the job may start on its checkpoint store
    (``manager.planning.resume_problem``): ``train.resume`` false on a store that already holds
    checkpoints is refused (the workers would refuse it, and the run would end FAILED), and so is
    continuing a STOPPED run (``run_dir`` holding its event log) that has done steps but has no
    usable checkpoint left (it would start again from step 0, its first steps recorded twice) — in
    both cases the run is left as it was, STOPPED and continuable. The store is
    ``train.checkpoint_url``, else ``<run_dir>/checkpoints``; its manifests are verified with the
    run's job secret when the folder holds one. Reads manifests only. Raises ``ConfigError`` saying
    why and what to do, or naming a store that cannot be opened or listed."""
    from .checkpoint.store import CheckpointError, manifest_key
    from .manager.planning import resume_problem

    url = job.train.checkpoint_url
    if url is None and run_dir is None:
        return   # a new run folder: its store is new and empty
    url = url or os.path.abspath(os.path.join(str(run_dir), "checkpoints"))
    state, done, key = None, 0, None
    if run_dir is not None and (Path(run_dir) / "events.db").is_file():
        state, done = _run_progress(Path(run_dir))
        if state in ("SUCCEEDED", "FAILED"):
            return   # an ended run is not run again (check_continuation, the manager say so)
        secret = Path(run_dir) / ".job-secret"
        if secret.is_file():
            from .cluster.hosts import Secret

            try:
                key = manifest_key(Secret.load_or_create(secret).reveal())
            except (OSError, ValueError):
                key = None   # an unreadable secret: the manager's own checks decide
    try:
        problem = resume_problem(url, key, resume=job.train.resume, steps_done=done, stopped=state == "STOPPED")
    except CheckpointError as e:
        raise ConfigError(f"train.checkpoint_url: {e}") from None
    if problem:
        where = f"{run_dir}: " if run_dir is not None and state is not None else ""
        raise ConfigError(where + problem)


def _run_key(run_dir: Path) -> bytes | None:
    """``manifest_key`` of the run folder's job secret (None when it holds none: checksums only)."""
    secret = Path(run_dir) / ".job-secret"
    if not secret.is_file():
        return None
    from .checkpoint.store import manifest_key
    from .cluster.hosts import Secret

    return manifest_key(Secret.load_or_create(secret).reveal())


def trained_weights(run_dir: str | Path, job: JobConfig | None = None, resolved=None) -> tuple[dict, Any]:
    """The trained model of the run in ``run_dir``: ``(state_dict, info)`` — ``state_dict`` the whole,
    unpartitioned model's ``{name: CPU tensor}`` with exactly the keys of ``Job.initial_weights()``
    (the model's own ``state_dict()`` names, tied weights under each of their names; dtypes as
    trained), read from the newest complete checkpoint whose files all verify (SHA-256, the job's
    signature when the folder holds its secret; ``torch.load(weights_only=True)``), whatever
    P x D wrote it; ``info`` its ``checkpoint.CheckpointInfo`` (``info.step``: the optimizer steps
    it holds — ``train.steps`` for a finished run, which always checkpoints its last step). A torn
    checkpoint is never used: the next older one is.

    ``job``/``resolved``: the run's config and ``jobspec.ResolvedJob`` (default: ``run_dir``'s
    ``config.yaml``, resolved with the objects shipped into the folder); the model is built on the
    meta device only, for its names. Raises ``FileNotFoundError`` when ``run_dir`` holds no
    ``config.yaml``, ``checkpoint.CheckpointError`` when no usable checkpoint is left (naming each
    skipped and why) or the checkpoint does not fit the model, and what resolving the job raises."""
    from .checkpoint import full_state_dict, read_model_state
    from .model.materialize import build_on_meta

    run_dir = Path(run_dir)
    if job is None:
        path = run_dir / "config.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"{run_dir} is no run folder: it holds no config.yaml")
        job = JobConfig.from_yaml(path)
    if resolved is None:
        from .trainer import resolve

        resolved = resolve(job, run_dir, check=False)
    url = job.train.checkpoint_url or os.path.abspath(os.path.join(str(run_dir), "checkpoints"))
    info, tensors = read_model_state(url, _run_key(run_dir))
    return full_state_dict(build_on_meta(resolved.spec.factory), tensors), info


def job_labels(resolved) -> dict[str, str]:
    """What the dashboard shows of a job's model and data (plain strings)."""
    return {"model": resolved.spec.name, "call": resolved.spec.call.describe(), "data": resolved.data.source}


def prepare_run(job: JobConfig, run_dir: str | Path | None = None, objects: JobObjects | None = None,
                files: dict[str, bytes] | None = None, command: str = "varuna launch") -> tuple[JobConfig, Path, Any]:
    """Check everything about ``job`` that can fail before a process starts, then make its run
    folder (``run_dir``, or a fresh ``new_run_dir``) holding ``config.yaml`` and the objects
    files (``objects`` packed here, or ``files`` packed already by ``JobObjects.pack``). Returns
    ``(the job as it will run, run folder, its jobspec.ResolvedJob)``. Raises ``ConfigError``, ``DataError``,
    ``ModelSpecError``, ``PartitionError`` (all ``ValueError``), ``ShippingError`` or
    ``TypeError`` — leaving no folder behind. ``command``: the command that runs the job (``varuna
    train``, ``varuna launch``), named in the way to continue a run folder this config cannot."""
    from .trainer import check_partition, resolve

    job = copy.deepcopy(job).validate()
    # a folder of runs, or a run folder this config cannot continue, is refused first: no model is
    # built, no data read
    check_run_dir(run_dir, job.name)
    try:
        changed = check_continuation(job, Path(run_dir), command) if run_dir is not None else []
    except ConfigError as e:
        raise _note_runs_inside(e, Path(run_dir)) from None
    check_store_url(job)          # a store that is a file, or under one: said now, before any work
    check_resume(job, run_dir)    # resume off on a store holding checkpoints; a stopped run with none left
    files = dict(files or {})
    if objects is not None:
        files.update(objects.pack(job))
    resolved = resolve(job, run_dir)  # the model spec and the data, checked together
    if run_dir is not None:
        check_same_data(resolved, Path(run_dir))
        check_same_model(job, resolved, Path(run_dir))
    if not job.parallel.planned:
        check_partition(job, resolved)  # a bad P, split or cross-stage use: now, not in a worker
    out = Path(run_dir) if run_dir is not None else new_run_dir(job)
    if changed:
        continue_with_changes(job, out, changed)
    make_run_folder(out, "the run folder (--run-dir)")
    for name, blob in files.items():  # the user's code, readable by the user only
        if not (out / name).exists():
            tmp = out / f"{name}.tmp"
            tmp.touch(mode=0o600)
            tmp.write_bytes(blob)
            tmp.replace(out / name)
    if not (out / "config.yaml").exists():
        job.to_yaml(out / "config.yaml")
        ident = data_identity(resolved)
        if ident is not None:
            (out / DATA_IDENTITY).write_text(json.dumps(ident))
    return job, out, resolved


#: The run folder's record of the data it began with (``data_identity``).
DATA_IDENTITY = "data-identity.json"


def data_identity(resolved) -> dict | None:
    """What identifies a job's data: its source, a content digest and its size — for token data
    (text or token files) ``data.sources.TokenData.digest`` (the files' bytes and the tokenizer)
    and the token count; for a ``data.dataset`` ``ExampleData.digest`` (its length and sampled
    examples; None for a dataset that draws from a random generator of its own, whose length
    alone is then compared) and the example count."""
    t, e = resolved.data.tokens, resolved.data.examples
    if t is not None:
        return {"source": t.source, "digest": t.digest, "tokens": len(t)}
    if e is None:
        return None
    return {"source": e.source, "digest": e.digest(), "examples": len(e)}   # (digest None: its length alone)


def check_same_data(resolved, run_dir: Path) -> None:
    """A started run folder (``events.db``) whose recorded data (``DATA_IDENTITY``: tokens or a
    dataset's examples) differs from what the job reads now — a data file edited in place — is refused before anything starts:
    its checkpoints hold positions in the old token stream, and loading them failed in the workers
    and marked the run FAILED (or, with the same length, trained on on other text without a word).
    Raises ``ConfigError`` naming the source, both token counts and what to do."""
    path = run_dir / DATA_IDENTITY
    if not (run_dir / "events.db").is_file() or not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
        unit = "tokens" if "tokens" in old else "examples"
        old_digest, old_count = old.get("digest"), int(old[unit])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return   # an unreadable record: the checkpoint's own checks decide
    new = data_identity(resolved)
    if new is None or unit not in new:
        return
    if new[unit] == old_count and (old_digest is None or new["digest"] is None or new["digest"] == old_digest):
        return
    same = f"as many {unit}" if new[unit] == old_count else f"{new[unit]} {unit} where it had {old_count}"
    content = (f", of other content (digest {new['digest']}, was {old_digest})"
               if old_digest is not None and new["digest"] is not None and new["digest"] != old_digest else "")
    hint = ("; if no file changed, the dataset is not the same in every process (one that draws at random in "
            "__init__ without a seed gives each process other examples: seed it)") if unit == "examples" else ""
    raise ConfigError(f"the data of the run in {run_dir} changed since the run began: {new['source']} now gives "
                      f"{same}{content}; its checkpoints hold positions in the data it began with. Put that data "
                      "back to continue this run, or train on the changed data in another --run-dir (in a notebook: "
                      f"Job(..., run_dir=...) naming another folder){hint}")


def check_same_model(job: JobConfig, resolved, run_dir: Path) -> None:
    """A started run folder whose newest complete checkpoint holds tensors the model built now does
    not have, or has in another shape — the model's code edited in place (a layer widened or
    renamed; the config unchanged, so ``check_continuation`` cannot tell) — is refused before
    anything starts: the workers failed loading the checkpoint and the run was marked FAILED for
    good (helper-61). Reads the manifest only (names and shapes, recorded since checkpoints carry
    them) and builds the model on meta. Raises ``ConfigError`` naming the tensors and what to do."""
    from .checkpoint.store import CheckpointError, latest_complete
    from .model.materialize import build_on_meta

    if not (run_dir / "events.db").is_file():
        return
    url = job.train.checkpoint_url or os.path.abspath(run_dir / "checkpoints")
    try:
        info = latest_complete(url, _run_key(run_dir))
    except (CheckpointError, OSError, ValueError):
        return   # (check_resume has said what is wrong with the store)
    items = (info.manifest.get("items") or {}) if info is not None else {}
    if not items:
        return
    model = build_on_meta(resolved.spec.factory)
    have: dict[str, Any] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        have.setdefault(n, t)
    gone = sorted(n for n in items if n not in have)
    reshaped = [f"{n!r} {tuple(it['shape'])} in the checkpoint, {tuple(have[n].shape)} now" for n, it in items.items()
                if n in have and isinstance(it.get("shape"), list) and list(have[n].shape) != it["shape"]]
    if not gone and not reshaped:
        return
    new = sorted(n for n, _ in model.named_parameters() if n not in items)   # (a renamed layer's new names)

    def some(names: list[str]) -> str:
        return f"{names[:3]}" + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")

    said = ([f"{'; '.join(reshaped[:3])}" + (f" (and {len(reshaped) - 3} more)" if len(reshaped) > 3 else "")]
            if reshaped else [])
    said += [f"{some(gone)} not in the model now"] if gone else []
    said += [f"{some(new)} not in the checkpoint"] if gone and new else []
    raise ConfigError(f"the model of the run in {run_dir} changed since its checkpoint of step {info.step}: "
                      f"{'; '.join(said)} — its code was edited, "
                      "its config is the same. The checkpoint holds the model the run trained: put the code back to "
                      "continue this run (it stays as it was), or train the changed model in another --run-dir (in a "
                      "notebook: Job(..., run_dir=...) naming another folder)")


#: what a continued run must keep: its checkpoints hold this model, trained on these examples
CONTINUED_FIELDS = ("model", "data.tokenizer", "data.seq_len", "data.corpus", "data.path", "data.format",
                    "data.text_column", "data.token_dtype", "data.dataset", "data.dataset_kwargs", "data.seed",
                    "data.val_fraction", "data.mlm_probability", "data.mask_token", "parallel.global_batch",
                    "train.seed", "train.precision", "train.optimizer")


def check_continuation(job: JobConfig, run_dir: Path, command: str = "varuna launch") -> list[tuple[str, Any, Any]]:
    """A run folder that holds a started job (``events.db`` and ``config.yaml``) is continued: the
    config given must train the same model on the same examples (``CONTINUED_FIELDS``), or its
    checkpoint cannot be loaded — found now, not after a calibration and a failed generation that
    would mark the run FAILED. The arguments of a factory named by import path
    (``data.dataset_kwargs``, ``model.kwargs``) are compared as the call sees them
    (``same_call_arguments``): a default spelled out (``seed: 0`` where the function's default
    seed is 0) is the same call. Other fields (steps, lr, checkpointing, launch) may change: they are
    returned as ``(dotted field, old, new)`` for ``continue_with_changes`` ([] when nothing changes
    or the folder holds no started job). A job that already ended (SUCCEEDED, FAILED) is not run
    again, so a changed config for it is refused, as is ``train.steps`` below the steps it has
    done. Reads the folder only (no torch; the factory's module is imported only when its
    arguments differ as written and nothing else does; changed ``train.optimizer_kwargs`` are
    tried on the state the run's settings keep: ``optimizer.check_state_carries_over``). Raises ``ConfigError`` naming each
    differing field with both values and ``command`` (``varuna train``, ``varuna launch``) as the
    way to continue the run as it was."""
    old_path = Path(run_dir) / "config.yaml"
    if not (Path(run_dir) / "events.db").is_file() or not old_path.is_file():
        return []
    try:
        old = JobConfig.from_yaml(old_path).to_dict()
    except (ConfigError, OSError, ValueError):
        return []   # a folder's unreadable config: the job's own checks decide
    new = job.to_dict()

    def get(d, dotted):
        for k in dotted.split("."):
            d = d.get(k) if isinstance(d, dict) else None
        return d

    diffs, calls = [], []
    for f in CONTINUED_FIELDS:
        a, b = get(old, f), get(new, f)
        if a == b or (f == "train.optimizer" and _same_optimizer(a, b)):   # 'rmsprop' is 'RMSprop'
            continue
        if f in _CALL_ARGUMENTS and isinstance(a, dict) and isinstance(b, dict):
            calls.append((f, a, b))   # compared as the call sees them: below
        elif isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if not _differs(a, b, k):
                    continue
                if f"{f}.{k}" in _CALL_ARGUMENTS and isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
                    calls.append((f"{f}.{k}", a[k], b[k]))
                else:   # (a field left null takes its default: the preset's own n_layer, say)
                    diffs.append(f"{f}.{k}: {_given(a, k, 'null (its default)')} in the run, "
                                 f"{_given(b, k, 'null (its default)')} here")
        else:
            diffs.append(f"{f}: {a!r} in the run, {b!r} here")
    same_calls = set()
    for f, a, b in calls:
        factory = get(new, _CALL_ARGUMENTS[f])
        # the factory's module is imported only when the arguments alone differ (a refusal for another
        # field is said without importing the user's code); the same factory in both, by import path
        if not diffs and factory is not None and factory == get(old, _CALL_ARGUMENTS[f]) \
                and same_call_arguments(factory, a, b):
            same_calls.add(f)
            continue
        diffs += [f"{f}.{k}: {_given(a, k)} in the run, {_given(b, k)} here" for k in sorted(set(a) | set(b))
                  if _differs(a, b, k)]
    if diffs:
        raise ConfigError(f"{run_dir} holds a job that trains another model, other examples or another optimizer than this config "
                          f"({'; '.join(diffs[:6])}{'; ...' if len(diffs) > 6 else ''}); its checkpoints cannot "
                          f"continue this one. Continue it as it was: `{command} {old_path} --run-dir {run_dir}`; "
                          "or run this config in another --run-dir (in a notebook: Job(..., run_dir=...) naming "
                          "another folder, or the model and data the run was made with)")
    # arguments that differ as written only (a default spelled out): the same job, not a change
    changed = [c for c in _changed_fields(old, new) if not any(c[0] == f or c[0].startswith(f + ".")
                                                                for f in same_calls)]
    if any(f.startswith("train.optimizer_kwargs") for f, _, _ in changed):   # the saved state must still step
        from .optimizer import check_state_carries_over

        check_state_carries_over(JobConfig.from_dict(old), job)
    state, done = _run_progress(run_dir)
    what = _changes_text(changed)
    if state in ("SUCCEEDED", "FAILED"):
        # (fewer steps than it did: nothing to train either way; the manager says it had ended)
        if any(not (f == "train.steps" and isinstance(b, int) and b <= done) for f, _, b in changed):
            raise ConfigError(f"{run_dir} holds a job that already ended {state} after {done} step(s); a finished "
                              f"job is not run again, so this config's changes ({what}) would not take effect. Run it "
                              "in another --run-dir (in a notebook: Job(..., run_dir=...) naming another folder); it "
                              "trains from the start there")
        return []
    steps = new.get("train", {}).get("steps")
    if isinstance(steps, int) and done > steps:
        raise ConfigError(f"{run_dir} holds a job that has done {done} step(s) already; train.steps={steps} is fewer, "
                          f"so continuing it would train nothing. Give train.steps > {done} (or --steps) to train on, "
                          "or another --run-dir to start again")
    return changed


def _same_optimizer(a: Any, b: Any) -> bool:
    """Whether two ``train.optimizer`` values name one class (``rmsprop`` and ``RMSprop``;
    ``torch.optim:AdamW`` and ``AdamW``); ``False`` where either names none."""
    from .optimizer import optimizer_class

    try:
        return isinstance(a, str) and isinstance(b, str) and optimizer_class(a) is optimizer_class(b)
    except ConfigError:
        return False


def _differs(a: dict, b: dict, k: str) -> bool:
    """Key ``k`` is in one of ``a``, ``b`` only (``seed: null`` spelled out is not left out), or differs."""
    return (k in a) != (k in b) or a.get(k) != b.get(k)


def _given(d: dict, k: str, null: str = "None") -> str:
    return "not given" if k not in d else null if d[k] is None else repr(d[k])


#: the factory arguments a continued run compares as the call sees them -> the field naming the factory
_CALL_ARGUMENTS = {"data.dataset_kwargs": "data.dataset", "model.kwargs": "model.factory"}


def same_call_arguments(ref: str, a: dict, b: dict) -> bool:
    """Whether ``f(**a)`` and ``f(**b)`` are the same call for the function or class ``f`` at import
    path ``ref`` (``package.module:function``): each bound to its signature with the defaults
    applied (``seed: 0`` spelled out where the default seed is 0 = left out), then compared. False
    whenever that cannot be told: ``ref`` is no import path (a registered model's name) or cannot be
    imported, the signature cannot be read, either set of arguments does not fit it, or comparing
    raises. Imports ``ref``'s module."""
    import inspect

    if not isinstance(ref, str) or ref.count(":") != 1:
        return False
    from .jobspec import import_object

    try:
        sig = inspect.signature(import_object(ref))

        def bound(kw: dict) -> dict:
            args = sig.bind(**kw)
            args.apply_defaults()
            out = dict(args.arguments)
            for name, p in sig.parameters.items():
                if p.kind is inspect.Parameter.VAR_KEYWORD:
                    out.update(out.pop(name, {}))   # **kwargs: as given, no defaults to apply
                elif p.kind is inspect.Parameter.VAR_POSITIONAL:
                    out.pop(name, None)
            return out

        x, y = bound(a), bound(b)
        return set(x) == set(y) and all(type(x[k]) is type(y[k]) and bool(x[k] == y[k]) for k in x)
    except Exception:  # noqa: BLE001 - not importable, no signature, arguments that do not fit: not shown the same
        return False


def continue_with_changes(job: JobConfig, run_dir: Path, changed: list[tuple[str, Any, Any]]) -> None:
    """Say which fields a continued run changes (``check_continuation``'s list) and write ``job``
    as the folder's ``config.yaml`` (atomically): what runs from the checkpoint it resumes from."""
    print(f"[varuna] continuing {run_dir} with changes: {_changes_text(changed)} (they apply from the checkpoint "
          "it resumes from; config.yaml updated)", flush=True)
    path = Path(run_dir) / "config.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    job.to_yaml(tmp)
    tmp.replace(path)


def _changes_text(changed: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{f} {a!r} -> {b!r}" for f, a, b in changed[:6]) + ("; ..." if len(changed) > 6 else "")


class _NotGiven:
    """A key one of two config dicts leaves out (an optimizer setting given only at the continue):
    said as "not given", not as None (a value the user could have given)."""

    def __repr__(self) -> str:
        return "not given"


NOT_GIVEN = _NotGiven()


def _changed_fields(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted field, old value, new value)`` for every leaf that differs between two config
    dicts; a key only one of them has: ``NOT_GIVEN`` on the other side."""
    out: list[tuple[str, Any, Any]] = []
    for k in sorted(set(old) | set(new)):
        a, b, name = old.get(k, NOT_GIVEN), new.get(k, NOT_GIVEN), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict) and name != "model.kwargs":
            out += _changed_fields(a, b, name + ".")
        elif a != b:
            out.append((name, a, b))
    return out


def _run_progress(run_dir: Path) -> tuple[str | None, int]:
    """The run folder's last manager state (None: not known) and the steps its metrics show done."""
    from .manager.runs import read_run

    try:
        info = read_run(run_dir)
    except Exception:  # noqa: BLE001 - an unreadable or empty event log: the manager's own checks decide
        return None, 0
    return info.state, info.steps_done


def plan_job(job: JobConfig, profile=None):
    """Choose P, D, micro-batch size and stage boundaries for ``job.launch.gpus`` local workers
    from a (cached) calibration and the simulator; returns ``(job with parallel filled, Plan)``.
    A P or D the config fixes is kept (only the other is chosen); ``ConfigError`` if no plan has it.
    Local workers share this machine's cores: the plan models them as one VM with
    ``os.cpu_count()`` compute slots (see ``planner.plan.plan_for_job``)."""
    from .planner.plan import plan_for_job
    from .profiling.job import calibrate_job

    return plan_for_job(job, profile or calibrate_job(job))


#: Seconds after a first SIGINT/SIGTERM within which another is the same interrupt (``stop_on_signals``).
REPEAT_SIGNAL_S = 1.0


@contextlib.contextmanager
def stop_on_signals(mgr) -> Iterator[None]:
    """While in this block (in the main thread), the first SIGINT (Ctrl-C) or SIGTERM stops the
    job at the next mini-batch boundary with a checkpoint (``mgr.cancel()``, as ``varuna stop``);
    a second one at least ``REPEAT_SIGNAL_S`` later raises ``KeyboardInterrupt`` (the workers are
    killed, nothing is checkpointed) — sooner, it is the same interrupt delivered twice (``timeout``,
    ``uv run`` and other wrappers pass on the SIGINT its process group got as well) and is ignored.
    Elsewhere than the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from .manager.events import Kind
    seen: list[float] = []

    def handler(signum, frame) -> None:
        now = time.monotonic()
        if seen and now - seen[0] < REPEAT_SIGNAL_S:
            return
        seen.append(now)
        if len(seen) > 1:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        print(f"[varuna] {name}: stopping at the next mini-batch boundary with a checkpoint (again to kill "
              "the workers at once)", file=sys.stderr, flush=True)
        mgr.log.append(Kind.STOP_REQUEST_RECEIVED, job_id=mgr.job_id, payload={"by": name})
        mgr.cancel()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def launch_job(job: JobConfig, *, run_dir: str | Path | None = None, provider=None, job_id: str | None = None,
               objects: JobObjects | None = None, signals: bool = False, command: str = "varuna launch",
               warnings_if_accepted: Sequence[str] = (), narrate=None, **manager_options) -> dict:
    """Run ``job`` under the morph manager in the foreground until it ends, on ``provider``'s
    VMs (default: ``job.launch.gpus`` local worker slots); returns ``Manager.summary()``.

    ``run_dir``: the job's folder; when it already holds the job's event log, the job is
    continued under the same id (a restarted manager picks it up: orphaned workers of the
    previous one stop at a boundary with a checkpoint, then the job resumes). ``objects``:
    callables shipped by value. ``manager_options`` go to ``manager.Manager``
    (``heartbeat_interval_s``, ``generation_options``, ``calibrate_first``...). Raises
    (``prepare_run``; ``ConfigError`` from ``check_local_backend`` for NCCL on local workers of a
    machine without it) before anything starts when the job cannot run. The provider is closed at
    the end (no worker left running) when this function made it. ``signals``: SIGINT/SIGTERM stop
    the job at a boundary with a checkpoint (``stop_on_signals``; the CLI's way). Raises
    ``manager.ManagerError`` at once when another manager runs ``run_dir`` now. ``command``: the
    command that runs it, named when ``run_dir`` holds a job this config cannot continue.
    ``warnings_if_accepted``: warnings (``UserWarning``) to give once ``prepare_run`` has accepted
    the job, so that a job refused says its real error alone. ``narrate``: a ``say(line)``
    callable (the CLI's ``print``) told the run's calibration, plans, notices, lost VMs, morphs and
    drifting estimates as they happen (``manager.runs.Narrator``).
    """
    from .cluster.provider import LocalProvider
    from .manager.manager import Manager
    from .manager.state import ManagerError
    from .manager.runs import RunBusy, check_run_free

    if run_dir is not None:
        check_run_dir(run_dir, job.name)   # a folder of runs is no job's run folder
        try:
            check_run_free(run_dir)   # before any work: a live run is never taken over
        except RunBusy as e:
            raise ManagerError(str(e)) from None
    check_local_backend(job, provider)   # NCCL asked for where there is none: before any work
    job, out, resolved = prepare_run(job, run_dir, objects, command=command)
    for text in warnings_if_accepted:
        warnings.warn(text, stacklevel=3)
    own = provider is None
    provider = provider or LocalProvider(job.launch.gpus)
    try:
        manager_options.setdefault("labels", job_labels(resolved))
        mgr = Manager(job, provider, run_dir=out, job_id=job_id, **manager_options)
        from .manager.runs import Narrator

        with stop_on_signals(mgr) if signals else contextlib.nullcontext(), \
                Narrator(out, narrate) if narrate is not None else contextlib.nullcontext():
            mgr.run()
        return mgr.summary()
    finally:
        if own:
            provider.close()


def stopped_sentence(run_dir: str | Path, last_step: int | None, kept: int | None) -> str:
    """How a stopped job ended, in words: ``stopped after N step(s) with a checkpoint in RUN`` — or,
    when its last complete checkpoint holds fewer steps (``kept``; None: all of them; a step that
    stalled past the stop's deadline got the workers killed), how many it holds and how many will
    be trained again. ``last_step``: the last step done (0-based; None: none)."""
    done = 0 if last_step is None else last_step + 1
    if done == 0 and not kept:
        return f"stopped before its first step (nothing to checkpoint yet) in {run_dir}"
    if kept is None or kept >= done:
        return f"stopped after {done} step(s) with a checkpoint in {run_dir}"
    return (f"stopped after {done} step(s) without reaching a mini-batch boundary (the workers were killed); its last "
            f"checkpoint in {run_dir} holds {kept} step(s), and {done - kept} step(s) will be trained again")


class JobStopped(Exception):
    """The job was stopped on request (Ctrl-C, SIGTERM, ``varuna stop``), at a mini-batch boundary
    with a checkpoint in ``run_dir`` — or, when a step stalled past the stop's deadline, killed, its
    last complete checkpoint kept: ``varuna launch RUN_DIR/config.yaml --run-dir RUN_DIR``
    continues it. ``last_step``: the last step done (0-based; None: none); ``kept``: the steps the
    checkpoint it continues from holds (None: as many as were done); ``sentence``:
    ``stopped_sentence``."""

    def __init__(self, run_dir: Path, last_step: int | None, kept: int | None = None):
        self.run_dir, self.last_step, self.kept = Path(run_dir), last_step, kept
        self.sentence = stopped_sentence(run_dir, last_step, kept)
        super().__init__(f"{self.sentence}; continue with `varuna launch {Path(run_dir) / 'config.yaml'} "
                         f"--run-dir {run_dir}`")


def _devices_here() -> str:
    """This machine's devices in words: its CUDA GPUs, else its CPU cores."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"{n} GPU(s)" if n else f"{os.cpu_count()} CPU core(s)"


def local_slots(job: JobConfig) -> tuple[int, list[str]]:
    """``(worker slots, warnings)`` of a job run on this machine's own worker processes: P × D when
    both are fixed (the configured shape runs as given, as many workers as it needs), else
    ``launch.gpus`` (the planner chooses for them); a warning when that is more workers than
    ``launch.gpus`` (they share this machine's devices)."""
    slots = job.parallel.world_size if not job.parallel.planned else job.launch.gpus
    if slots <= job.launch.gpus:
        return slots, []
    return slots, [f"P={job.parallel.P} x D={job.parallel.D} starts {slots} local workers, more than "
                   f"launch.gpus={job.launch.gpus}; they share this machine's devices ({_devices_here()}), so "
                   "each step is slower than the plan for that many GPUs. Set launch.gpus to the workers "
                   "this machine should run, or P and D null to plan for launch.gpus"]


def train_local(job: JobConfig, run_dir: str | Path | None = None, objects: JobObjects | None = None,
                **manager_options) -> RunResult:
    """``varuna train``: the job on P × D local worker processes (gloo on CPU, NCCL with GPUs),
    under the manager like every other launch. With P and D fixed it starts at once (no
    calibration); with P or D null the planner chooses for ``launch.gpus`` workers first.

    Raises ``ConfigError`` (and the other ``prepare_run`` errors) before starting anything,
    ``JobStopped`` when it was stopped on request (``manager_options`` may hold ``signals=True``:
    see ``launch_job``) and ``WorkerFailure`` (with the failing rank's traceback) if the job fails; in every case no
    worker process is left running.
    """
    from .pipeline.spawn import WorkerFailure
    from .cluster.provider import LocalProvider

    job = copy.deepcopy(job).validate()
    check_run_dir(run_dir, job.name)
    slots, shared = local_slots(job)   # ``shared``: said once the job is accepted (``launch_job``)
    opts = {"warnings_if_accepted": shared, "calibrate_first": False, "max_failures": 0, "grow": None, "straggler": None,
            "generation_options": {"start_timeout_s": max(180.0, job.launch.timeout_s)}, "command": "varuna train",
            **manager_options}
    provider = LocalProvider(slots)
    try:
        summary = launch_job(job, run_dir=run_dir, provider=provider, objects=objects, **opts)
    finally:
        provider.close()
    out = Path(summary["run_dir"])
    if summary["state"] == "STOPPED":
        raise JobStopped(out, summary.get("last_step"), summary.get("checkpoint_steps"))
    if summary["state"] != "SUCCEEDED":
        raise WorkerFailure(f"job {summary['job_id']} {summary['state']}: {summary['error']}",
                            {0: (1, summary["error"] or "")})
    summary_path = out / "summary.json"
    return RunResult(out, json.loads(summary_path.read_text()) if summary_path.exists() else {},
                     trained=not summary.get("ended_before", False))


__all__ = ["JobObjects", "JobStopped", "local_slots", "file_in_the_way", "stopped_sentence", "RunResult", "launch_job", "new_run_dir", "check_run_dir", "check_local_backend", "plan_job", "prepare_run", "stop_on_signals",
           "train_local", "trained_weights", "check_resume", "check_store_url",
           "ConfigError"]
