"""Jupyter face of the SDK: a ``Job`` handle that calibrates, plans, launches a job in the
background, shows its progress, and opens the dashboard — all from notebook cells.

    job = Job(config)                          # a JobConfig, or the path of its YAML
    job.calibrate()                            # once per model shape; cached on disk
    job.plan(gpus=4)                           # ranked table + partition map, inline
    job.what_if(gpus=16, network_bandwidth_Bps=1.25e9)   # a hypothetical cluster; job unchanged
    job.launch()                               # returns at once; progress bar below the cell
    job.status                                 # state, step, loss, tokens/s, plan (a JobStatus)
    job.metrics, job.events, job.morphs        # pandas DataFrames from the job's event log
    job.plot()                                 # loss and throughput by step, morphs marked (Bokeh)
    job.dashboard()                            # the team dashboard (Panel), inline
    job.stop()                                 # checkpoint at the next mini-batch boundary, stop
    job.launch()                               # ... and continue from that checkpoint later

Re-running a cell never starts a second job by accident: ``launch()`` on a job that is already
running says so and returns it, and a new ``Job`` with the name of a running one refuses to
launch (``RuntimeError``) until that one is stopped — or made with ``replace=True``. A handle
lost by re-running ``job = Job(...)`` is found again with ``Job.get(name)``.

Your own model, loss and data, from a cell:

    job = Job(model=MyGPT, data="my_text.txt", steps=200)     # a class or function defined here
    job = Job(model=lambda: GPT2LMHeadModel(GPT2Config(n_layer=4)), data="tokens.bin",
              config=JobConfig(data=DataConfig(token_dtype="uint16")))
    job = Job(model="mypkg.models:build", data=make_dataset, loss=my_loss)

A callable defined in the notebook (model factory or class, loss, init, dataset factory) is
shipped by value with cloudpickle inside the job spec — to local workers through the run folder,
to your VMs over the SSH bootstrap — and every worker checks the Python/torch/cloudpickle
versions before unpickling (``varuna_sdk.shipping``); an import path is shipped by reference
(your code folder is synced to the VMs). The model, data and loss are resolved and checked
together when the ``Job`` is made — a model that cannot be cut, token ids beyond its vocabulary,
a missing column fail in that cell, before anything starts.

At interpreter exit (kernel shutdown or restart) every job this kernel launched is asked to
stop and the providers it ran on are closed, so no worker or test host outlives the kernel.

Owns ``Job``, ``JobStatus``, ``PlanView``. Sits at the top (with ``cli``): imports the manager,
planner, cluster providers and (for ``dashboard()``) the top-level ``dashboard`` package;
nothing in ``varuna_sdk`` imports it.
"""

from __future__ import annotations

import atexit
import copy
import json
import math
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, JobConfig

_RUNNING: dict[str, "Job"] = {}   # job name -> the Job that launched it last (one per kernel)
_LAUNCHED: "weakref.WeakSet[Job]" = weakref.WeakSet()
_LOCK = threading.Lock()

_PLAIN = (type(None), bool, int, float, str)


def _unshippable(value: Any, where: str) -> str | None:
    """Path of the first value in ``value`` (plain data expected) that is not YAML-plain."""
    if isinstance(value, _PLAIN):
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = _unshippable(v, f"{where}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where} (key {k!r})"
            bad = _unshippable(v, f"{where}.{k}")
            if bad:
                return bad
        return None
    return f"{where} = {value!r} ({type(value).__name__})"


_SHIP_HELP = (
    "A job's config holds plain values only (it is YAML). Pass your own model, loss or dataset as "
    "Job(model=..., loss=..., data=...): a callable defined here is shipped by value, an import path "
    "'pkg.mod:fn' by reference.")


def _name_of(obj: Any) -> str:
    """A job name from a model: its qualified name, or the last part of an import path."""
    if isinstance(obj, str):
        base = obj.split(":")[-1]
    else:
        base = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    clean = "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "-" for c in base).strip("-_") or "job"
    return clean[:48]


def _apply_overrides(job: JobConfig, *, model: Any, loss: Any, data: Any, init: Any, ship_modules: tuple):
    """Put ``Job(model=, loss=, data=, init=)`` into ``job``; returns the ``JobObjects`` to ship
    by value (None when everything is named by import path or config). Raises ``TypeError``
    for a value of the wrong kind, saying what each argument takes."""
    from torch import nn

    from .config import DataConfig, ModelConfig
    from .launch import JobObjects

    objs = JobObjects(modules=tuple(ship_modules))
    if isinstance(model, nn.Module):
        raise TypeError(f"Job(model=...) got a built {type(model).__name__}; pass its class or a function that "
                        f"builds it (e.g. model=lambda: {type(model).__name__}(...)): each worker builds only its "
                        "own stage")
    if isinstance(model, ModelConfig):
        job.model = copy.deepcopy(model)
    elif isinstance(model, str) or callable(model):  # the config's call and loss settings still apply
        m = job.model
        job.model = ModelConfig(factory=model if isinstance(model, str) else None, loss=m.loss, inputs=m.inputs,
                                targets=m.targets, blocks=m.blocks, kwargs=dict(m.kwargs or {}))
        if not isinstance(model, str):
            objs.model = model
    elif model is not None:
        raise TypeError(f"Job(model=...) takes a class or function building the model, an import path "
                        f"'pkg.mod:fn', or a ModelConfig; got {type(model).__name__}")
    if isinstance(loss, str):
        job.model.loss = loss
    elif callable(loss):
        if objs.model is None:
            raise TypeError("Job(loss=<function>) ships the loss by value, which needs the model shipped by value "
                            "too (model=<class or function>); or name the loss by import path 'pkg.mod:fn'")
        objs.loss = loss
    elif loss is not None:
        raise TypeError(f"Job(loss=...) takes 'model', 'cross_entropy', an import path or a function; got "
                        f"{type(loss).__name__}")
    if isinstance(init, str):
        job.model.init = init
    elif callable(init):
        objs.init = init
    if isinstance(data, DataConfig):
        job.data = copy.deepcopy(data)
    elif isinstance(data, (str, Path)):
        job.data.path, job.data.corpus = str(data), None
    elif callable(data):
        objs.dataset = data
    elif data is not None:
        raise TypeError(f"Job(data=...) takes a path, a DataConfig or a function returning a Dataset; got "
                        f"{type(data).__name__}")
    return objs if (objs.model or objs.loss or objs.init or objs.dataset) else None


@dataclass
class JobStatus:
    """A snapshot of a job.

    ``state``: ``NOT LAUNCHED``, then the manager's ``JobState`` (PENDING, PROVISIONING, RUNNING,
    MORPHING, RECOVERING; terminal SUCCEEDED, FAILED, STOPPED). ``step``: optimizer steps
    finished (the last metrics row's step + 1; it can step back after a sudden loss, when the
    job resumes from an earlier checkpoint); ``steps``: the total. ``loss``: last training loss;
    ``tokens_per_s``, ``examples_per_s``: last step's throughput. ``P``/``D``: the plan of the
    last step trained (or of the configuration before the first step). ``generation``: worker
    launches so far - 1; ``morphs``: morphs recorded (both counted over every ``launch()``).
    ``error``: why the job failed. ``run_dir``: its folder."""

    name: str
    state: str
    step: int
    steps: int
    loss: float | None
    tokens_per_s: float | None
    examples_per_s: float | None
    P: int | None
    D: int | None
    generation: int
    morphs: int
    error: str | None
    run_dir: str | None

    @property
    def done(self) -> bool:
        """True in a terminal state (SUCCEEDED, FAILED, STOPPED)."""
        return self.state in ("SUCCEEDED", "FAILED", "STOPPED")

    def __str__(self) -> str:
        plan = f"P={self.P} x D={self.D}" if self.P else "not planned yet"
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        tps = f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s else "-"
        s = (f"{self.name}: {self.state} | step {self.step}/{self.steps} | loss {loss} | {tps} | {plan} | "
             f"generation {self.generation}, {self.morphs} morph(s)")
        return s + (f"\n  error: {self.error}" if self.error else "")

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(str(self))}</pre>"


class Job:
    """A training job driven from a notebook.

    Args:
        config: a ``JobConfig`` or the path of its YAML (copied: later changes to the object
            you passed do not change this job); default ``JobConfig()`` (named after the model).
        model: the model, overriding ``config.model``: a class or function returning the whole
            ``nn.Module`` (shipped by value), an import path ``"pkg.mod:fn"`` or registered name
            (shipped by reference), or a ``ModelConfig``.
        loss: ``"model"``, ``"cross_entropy"``, an import path, or ``(output, targets) -> scalar``
            (shipped by value); default automatic (``model.spec.infer_call``).
        data: overriding ``config.data``: a path (text file or folder, token file, ``datasets``
            folder, json/jsonl/parquet/csv), a ``DataConfig``, or a function returning a map-style
            ``Dataset`` (shipped by value).
        init: ``init_fn(module, name)`` for a model too large to record once (shipped by value).
        ship_modules: your own modules whose code must travel by value too (not installed on
            the VMs); a module in your synced code folder needs nothing.
        steps: ``train.steps`` (a shortcut).
        provider: where workers run (``cluster.provider``: ``LocalProvider``, ``HostFileProvider``,
            ``cluster.spot.SpotEmulator``...); default ``LocalProvider(config.launch.gpus)``,
            local worker processes, closed by ``close()``. A provider you pass stays yours to close
            (at interpreter exit it is closed too, if a job of this kernel still runs on it).
        run_dir: the job's folder (default ``<train.run_dir>/<name>-<time>``, made at launch).
        replace: allow launching while another ``Job`` of the same name runs in this kernel.
        manager_options: keyword arguments for ``manager.Manager`` (``heartbeat_interval_s``,
            ``grow``, ``straggler``, ``stop_timeout_s``, ``generation_options``...). Worker output
            goes to ``<run_dir>/gen<g>/workers.log`` (``job.logs()``), not into the notebook,
            unless ``generation_options={"sink": ...}`` says otherwise.

    Raises ``ConfigError``/``DataError``/``ModelSpecError`` (all ``ValueError``) for a config,
    model or data that cannot run, and ``TypeError`` for a config holding Python objects where
    plain values belong, or a callable cloudpickle cannot ship — before anything starts.
    """

    def __init__(self, config: JobConfig | str | Path | None = None, *, model: Any = None, loss: Any = None,
                 data: Any = None, init: Any = None, ship_modules: tuple = (), steps: int | None = None,
                 provider=None, run_dir: str | Path | None = None, replace: bool = False,
                 manager_options: dict[str, Any] | None = None):
        if config is None:
            job = JobConfig()
            if model is not None:
                job.name = _name_of(model)
        elif isinstance(config, (str, Path)):
            job = JobConfig.from_yaml(Path(config))
        elif isinstance(config, JobConfig):
            job = config
        else:
            from torch import nn

            what = getattr(config, "__qualname__", None) or type(config).__name__
            hint = f" To train {what}, pass it as Job(model={what})." if callable(config) and not isinstance(
                config, nn.Module) else ""
            raise TypeError(f"Job(config) takes a JobConfig or the path of a job YAML, not {what!r}.{hint} {_SHIP_HELP}")
        job = copy.deepcopy(job)
        objects = _apply_overrides(job, model=model, loss=loss, data=data, init=init, ship_modules=ship_modules)
        if steps is not None:
            job.train.steps = steps
        bad = _unshippable(job.to_dict(), "config")
        if bad:
            raise TypeError(f"{bad} cannot be sent to the workers. {_SHIP_HELP}")
        job.validate()
        self._files = objects.pack(job) if objects is not None else {}
        from .trainer import resolve

        self.resolved = resolve(job)  # the model, data and loss, checked together now
        if not job.parallel.planned:
            from .trainer import check_partition

            check_partition(job, self.resolved)  # and the configured split, before launch()
        self.config = job
        self.provider = provider
        self.run_dir = Path(run_dir).resolve() if run_dir is not None else None
        self.replace = replace
        opts = dict(manager_options or {})
        gen_opts = {"sink": None, **dict(opts.pop("generation_options", None) or {})}
        self.manager_options = {**opts, "generation_options": gen_opts}
        self.manager = None
        self.launches = 0
        self._profile = None
        self._plan = None
        self._monitor: threading.Thread | None = None
        self._bar = None
        self._own_provider = False
        self._count_lock = threading.Lock()
        self._event_cursor = 0
        self._counts: dict[str, int] = {}

    # ------------------------------------------------------------------------------ finding
    @staticmethod
    def get(name: str) -> "Job":
        """The ``Job`` of this kernel that last launched a job named ``name`` (to get a handle
        back after re-running ``job = Job(...)``). Raises ``KeyError`` listing the names known."""
        with _LOCK:
            if name not in _RUNNING:
                raise KeyError(f"no job named {name!r} was launched in this kernel; known: {sorted(_RUNNING)}")
            return _RUNNING[name]

    @staticmethod
    def list(root: str | Path = "runs"):
        """Every job in the folder of runs ``root`` (or the one run folder ``root``), newest first, as
        a pandas DataFrame: job, state, plan, steps_done, steps_total, percent, elapsed_s, eta_s
        (seconds), cost (what its VMs cost so far, in words), morphs, last_event, path — what ``varuna status`` prints, from any kernel or
        machine that sees the folder. Raises ``FileNotFoundError`` for a folder that does not exist."""
        import pandas as pd

        from .manager.runs import find_runs, read_run

        rows = []
        for info in (read_run(p) for p in find_runs(root)):
            rows.append({"job": info.name, "state": info.state, "plan": info.plan, "steps_done": info.steps_done,
                         "steps_total": info.steps_total, "percent": info.percent, "elapsed_s": info.elapsed_s,
                         "eta_s": info.eta_s, "cost": info.cost_text, "morphs": len(info.morphs),
                         "last_event": info.last_event, "path": str(info.path)})
        return pd.DataFrame(rows, columns=["job", "state", "plan", "steps_done", "steps_total", "percent", "elapsed_s",
                                           "eta_s", "cost", "morphs", "last_event", "path"])

    @staticmethod
    def running_jobs() -> dict[str, "Job"]:
        """Name → ``Job`` for every job of this kernel that is running now."""
        with _LOCK:
            return {n: j for n, j in _RUNNING.items() if j.running}

    # ------------------------------------------------------------------------ before launch
    def calibrate(self, refresh: bool = False):
        """Measure the model once (paper §4.3): each cut-point segment's forward, recompute and
        backward seconds and activation bytes at a few micro-batch sizes, and this machine's
        p2p and all-reduce α–β. Cached on disk per model shape (``refresh=True`` measures
        again); returns the ``profiling.profile.Profile``."""
        from .trainer import calibrate_job

        self._profile = calibrate_job(self.config, refresh=refresh, resolved=self.resolved)
        return self._profile

    def _default_gpus(self) -> int:
        if self.provider is not None:
            from .manager.decisions import pool_slots

            hosts = self.provider.hosts()
            if hosts:
                return pool_slots(hosts)
        return int(self.config.launch.gpus)

    def plan(self, gpus: int | None = None, **what_if) -> "PlanView":
        """Plan the job for where it will run (paper §4.4): rank every configuration (P, D,
        micro-batch size, stage split) of ``gpus`` workers — default: the provider's worker
        slots, else ``launch.gpus`` — and set the job's P, D, micro-batch size and stage
        boundaries to the best (``launch()`` then runs it). Local workers and loopback test
        hosts share this machine's cores, and the plan models that (it may use fewer workers).

        With keyword arguments (``network_bandwidth_Bps``, ``global_batch``, ``policy``,
        ``prices``...) it is ``what_if(gpus, ...)`` instead and leaves the job unchanged.
        Returns a ``PlanView`` (renders the ranked table and the partition map inline). Raises
        ``ConfigError`` when no configuration fits."""
        if what_if:
            return self.what_if(gpus, **what_if)
        from .planner.plan import plan_for_job

        prof = self._profile or self.calibrate()
        G = self._default_gpus() if gpus is None else gpus  # plan() checks it (no silent int())
        planned = JobConfig.from_dict(self.config.to_dict())
        planned.parallel.P = planned.parallel.D = None
        planned.parallel.boundaries = None
        self.config, pl = plan_for_job(planned, prof, G)
        self._plan = pl
        return PlanView(pl, self.config)

    def what_if(self, gpus: int | None = None, *, global_batch: int | None = None, policy: str | None = None,
                recompute: bool | None = None, network_bandwidth_Bps: float | None = None, prices=None,
                target_examples: int | None = None, gpus_per_vm: int = 1, compute_slots_per_vm: int = 0,
                memory_limit_bytes: float | None = None, micro_batch_sizes=None) -> "PlanView":
        """Plan a hypothetical cluster from the job's calibration without changing the job:
        ``gpus`` GPUs (default ``launch.gpus``), ``gpus_per_vm`` per VM (1: every pipeline
        hop and all-reduce crosses the network), ``compute_slots_per_vm`` (0: one per GPU).
        ``global_batch`` (examples per step; default the job's), ``policy`` ("varuna", "gpipe",
        "1f1b"), ``recompute``, ``network_bandwidth_Bps`` (replaces the calibrated cross-VM
        bandwidth, bytes/s), ``prices`` (``planner.plan.Prices``: $ per GPU-hour) and
        ``target_examples`` (time and cost to train that many) as in ``planner.plan.plan``.
        Compute times are the calibrated device's (this machine's CPU when calibrated here).
        Returns a ``PlanView``; raises ``ConfigError`` for bad arguments."""
        from .planner.plan import plan as plan_fn

        prof = self._profile or self.calibrate()
        p = self.config.parallel
        G = self.config.launch.gpus if gpus is None else gpus
        return PlanView(plan_fn(prof, G, p.global_batch if global_batch is None else global_batch, policy=policy or p.policy,
                                recompute=p.recompute if recompute is None and policy is None else recompute,
                                gpus_per_vm=gpus_per_vm, compute_slots_per_vm=compute_slots_per_vm,
                                network_bandwidth_Bps=network_bandwidth_Bps, prices=prices,
                                target_examples=target_examples, memory_limit_bytes=memory_limit_bytes,
                                micro_batch_sizes=micro_batch_sizes), self.config)

    # ------------------------------------------------------------------------------ running
    def launch(self, progress: bool = True) -> "Job":
        """Start the job in the background and return at once; with ``progress`` a bar (step,
        loss, tokens/s, plan; ipywidgets in Jupyter, text elsewhere) follows it below the cell.

        Calling it again while the job runs returns the same job (no second one starts); after
        ``stop()`` (or a failure) it continues from the job's newest complete checkpoint in the
        same run folder; after SUCCEEDED it does nothing. A different ``Job`` of the same name
        refuses while this one runs (``RuntimeError``) unless it was made with ``replace=True``.
        Worker or planning errors surface in ``status.error`` (state FAILED), not here."""
        from .manager.manager import Manager

        with _LOCK:
            other = _RUNNING.get(self.config.name)
            if other is self and self.running:
                print(f"[varuna] {self.config.name} is already running (state {self.manager.state.value}); "
                      "not starting a second one")
                return self
            if other is not None and other is not self and other.running and not self.replace:
                raise RuntimeError(
                    f"a job named {self.config.name!r} is already running in this kernel ({other.run_dir}); "
                    f"get its handle with Job.get({self.config.name!r}) and stop it with .stop() first, "
                    "or make this Job with replace=True")
            if self.manager is not None and self.manager.state.value == "SUCCEEDED":
                print(f"[varuna] {self.config.name} already finished its {self.config.train.steps} steps "
                      f"({self.run_dir}); make a new Job to train again")
                return self
            provider = self.provider
            if provider is None:
                from .cluster.provider import LocalProvider

                provider = LocalProvider(self.config.launch.gpus)
                self._own_provider = True
                self.provider = provider
            from .launch import prepare_run

            _, out, _ = prepare_run(self.config, self.run_dir, files=self._files)  # config + shipped objects
            self.run_dir = out.resolve()
            self.config.to_yaml(self.run_dir / "config.yaml")
            # a stopped or failed job continues under a new job id in the same folder: the
            # manager of the old id would only replay its terminal state
            job_id = self.run_dir.name if self.launches == 0 else f"{self.run_dir.name}.{self.launches}"
            from .launch import job_labels

            manager = Manager(self.config, provider, run_dir=self.run_dir, job_id=job_id, profile=self._profile,
                              **{"labels": job_labels(self.resolved), **self.manager_options})
            if getattr(provider, "started", True) is False:
                provider.start()
            self.manager = manager
            self.launches += 1
            manager.start()
            _RUNNING[self.config.name] = self
            _LAUNCHED.add(self)
        if progress:
            self._start_progress()
        return self

    @property
    def running(self) -> bool:
        """True while the manager runs the job (not yet SUCCEEDED, FAILED or STOPPED)."""
        m = self.manager
        return m is not None and not m.state.terminal and m._thread is not None and m._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> JobStatus:
        """Block until the job ends (or ``timeout_s`` seconds pass); returns its status."""
        if self.manager is not None:
            self.manager.wait(timeout_s)
        if self._monitor is not None:
            self._monitor.join(5.0)
        return self.status

    def stop(self, timeout_s: float = 120.0) -> JobStatus:
        """Stop the job: the workers finish the current mini-batch, checkpoint it and exit (state
        STOPPED; ``launch()`` later continues from that checkpoint). Waits up to ``timeout_s``
        seconds; returns the status."""
        if self.running:
            self.manager.cancel()
            self.manager.wait(timeout_s)
        if self._monitor is not None:
            self._monitor.join(5.0)
        return self.status

    def close(self) -> None:
        """Stop the job if it runs and release what this ``Job`` started (its default local
        provider and any worker process left on it)."""
        self.stop()
        if self._own_provider and self.provider is not None:
            self.provider.close()
        with _LOCK:
            if _RUNNING.get(self.config.name) is self:
                del _RUNNING[self.config.name]

    # ------------------------------------------------------------------------------ reading
    def _log(self):
        from .manager.events import EventLog

        if self.run_dir is None or not (self.run_dir / "events.db").exists():
            return None
        return EventLog.reader(self.run_dir / "events.db")

    @property
    def status(self) -> JobStatus:
        """The job's state, last step, loss, throughput and plan (a snapshot; cheap)."""
        from .manager.events import Kind

        m = self.manager
        last: dict[str, Any] = {}
        log = self._log()
        if log is not None:
            try:
                n = log.count("metrics")
                rows = log.metrics(since_id=max(0, n - 1)) if n else []
                last = rows[-1] if rows else {}
                with self._count_lock:  # only new plan / morph events are read (plans are large)
                    for e in log.events(kind=(Kind.PLAN, Kind.MORPH), since_id=self._event_cursor):
                        self._event_cursor = max(self._event_cursor, e.id)
                        self._counts[e.kind] = self._counts.get(e.kind, 0) + 1
            finally:
                log.close()
        plans, morphs = self._counts.get(Kind.PLAN, 0), self._counts.get(Kind.MORPH, 0)
        return JobStatus(
            name=self.config.name, state=m.state.value if m else "NOT LAUNCHED",
            step=int(last.get("step", -1)) + 1, steps=self.config.train.steps, loss=last.get("loss"),
            tokens_per_s=last.get("tokens_per_s"), examples_per_s=last.get("examples_per_s"),
            P=last.get("P") or self.config.parallel.P, D=last.get("D") or self.config.parallel.D,
            generation=max(0, plans - 1), morphs=morphs, error=m.error if m else None,
            run_dir=str(self.run_dir) if self.run_dir else None)

    @property
    def metrics(self):
        """Every training step's metrics as a pandas DataFrame, in the order they were recorded:
        step (0-based), loss, lr, grad_norm, skipped, loss_scale, step_time_s (s),
        tokens_per_s, examples_per_s, wall_time (Unix s), P, D, generation, job_id. A step
        redone after a sudden loss appears once per generation that trained it. Empty before
        the first step."""
        import pandas as pd

        log = self._log()
        if log is None:
            return pd.DataFrame()
        try:
            df = pd.DataFrame(log.metrics())
        finally:
            log.close()
        return df.drop(columns=[c for c in ("id", "time") if c in df.columns])

    @property
    def events(self):
        """Every event of the job (state changes, plans, VMs added / noticed / removed, workers
        joined and finished, morphs...) as a pandas DataFrame: time (UTC, to the millisecond), what
        (the event in a sentence), kind, host ("" when none), rank (an integer, or <NA>), payload
        (a dict)."""
        import pandas as pd

        from .manager.runs import event_sentence

        cols = ["time", "what", "kind", "host", "rank", "payload"]
        log = self._log()
        if log is None:
            return pd.DataFrame(columns=cols)
        try:
            rows = [{"time": pd.Timestamp(round(e.time, 3), unit="s", tz="UTC").floor("ms"),
                     "what": event_sentence(e), "kind": e.kind, "host": e.host or "", "rank": e.rank,
                     "payload": e.payload} for e in log.events()]
        finally:
            log.close()
        df = pd.DataFrame(rows, columns=cols)
        df["rank"] = df["rank"].astype("Int64")   # not floats with NaN
        return df

    @property
    def morphs(self):
        """Morph history as a pandas DataFrame, one row per morph (paper §4.2): time (UTC, when
        its cause was seen), cause (notice, loss, grow, straggler, failure, stop_timeout), host,
        what_happened (the morph in one sentence: which VM, what, the plans, downtime, steps lost and
        why), old_plan → new_plan (``P=2 x D=1 on vm0,vm1``), downtime_s (cause seen → first step of the
        new plan done), phases_s (the downtime per phase: stop, wait_for_vms, replan, start_workers,
        first_step, seconds), from_step (last step trained before), resume_step (steps the resumed
        checkpoint holds), steps_lost, candidates (the planner's best predictions for the new pool,
        the chosen one marked), and the plans as dicts (old, new). A morph is recorded
        once the new plan finished its first step."""
        import pandas as pd

        from .manager.events import Kind
        from .manager.runs import morph_sentence

        cols = ["time", "cause", "host", "what_happened", "old_plan", "new_plan", "downtime_s", "phases_s", "from_step",
                "resume_step", "steps_lost", "candidates", "old", "new"]
        log = self._log()
        if log is None:
            return pd.DataFrame(columns=cols)
        try:
            evs = log.events(kind=Kind.MORPH)
        finally:
            log.close()
        rows = []
        for e in evs:
            p = e.payload
            rows.append({"time": pd.Timestamp(p.get("time") or e.time, unit="s", tz="UTC"), "cause": p.get("cause"),
                         "host": p.get("host"), "what_happened": morph_sentence(p), "old_plan": _plan_label(p.get("old")),
                         "new_plan": _plan_label(p.get("new")), "downtime_s": p.get("downtime_s"),
                         "phases_s": p.get("phases_s") or {}, "from_step": p.get("from_step"),
                         "resume_step": p.get("resume_step"), "steps_lost": p.get("steps_lost"),
                         "candidates": p.get("candidates") or [], "old": p.get("old"), "new": p.get("new")})
        return pd.DataFrame(rows, columns=cols)

    @property
    def summary(self) -> dict | None:
        """The finished run's ``summary.json`` (held-out perplexity at start ``ppl_start`` and end
        ``ppl_end``, final loss, training seconds), written by rank 0 into the run folder when
        the last step is done; None before that or when rank 0 ran on a remote VM."""
        path = self.run_dir / "summary.json" if self.run_dir else None
        if path is None or not path.is_file():
            return None
        return json.loads(path.read_text())

    def logs(self, tail: int = 40, generation: int | None = None) -> str:
        """The last ``tail`` lines the workers printed (``[host rank r] ...``) in ``generation``
        (default the latest), from ``<run_dir>/gen<g>/workers.log``; "" before any."""
        if self.run_dir is None:
            return ""
        gens = sorted((int(p.name[3:]), p) for p in self.run_dir.glob("gen*")
                      if p.name[3:].isdigit() and (p / "workers.log").is_file())
        if not gens:
            return ""
        path = dict(gens).get(generation) if generation is not None else gens[-1][1]
        if path is None:
            raise KeyError(f"no worker log for generation {generation}; have {[g for g, _ in gens]}")
        lines = (path / "workers.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    def plot(self, height: int = 260):
        """Training loss (per step, and smoothed: an EMA over 20 steps) and tokens/s by step (Bokeh),
        one colour per generation (and launch, when the job was launched more than once), morphs
        marked by dotted lines — a morph that loses nothing continues the curve where it stopped.
        Show it with ``bokeh.io.show`` (after ``output_notebook()``) or ``panel``. Raises
        ``RuntimeError`` before the first step."""
        from bokeh.layouts import column
        from bokeh.models import Span
        from bokeh.palettes import Category10_10
        from bokeh.plotting import figure

        df = self.metrics
        if df.empty:
            raise RuntimeError("no step finished yet: launch() the job and wait for its first step")
        key = df["job_id"].astype(str) + "/" + df["generation"].astype(str) if "job_id" in df else df["generation"]
        launches = {j: k for k, j in enumerate(dict.fromkeys(df["job_id"].astype(str)))} if "job_id" in df else {}
        figs = []
        for col, label, unit in (("loss", "training loss", "loss"), ("tokens_per_s", "throughput", "tokens / s")):
            f = figure(height=height, sizing_mode="stretch_width", title=label, x_axis_label="step",
                       y_axis_label=unit, tools="pan,box_zoom,wheel_zoom,reset,hover,save")
            for i, (_, g) in enumerate(df.groupby(key, sort=False)):
                gen = int(g["generation"].iloc[0])
                plan = f"P={int(g['P'].iloc[0])}×D={int(g['D'].iloc[0])}"
                where = f"generation {gen}" if len(launches) < 2 else \
                    f"launch {launches[str(g['job_id'].iloc[0])] + 1}, generation {gen}"
                color = Category10_10[i % 10]
                f.line(g["step"], g[col], color=color, line_width=2 if col != "loss" else 1,
                       alpha=1.0 if col != "loss" else 0.45, legend_label=f"{where}: {plan}" if len(set(key)) > 1 else plan)
                if col == "loss":   # the trend under the step-to-step noise
                    f.line(g["step"], g[col].ewm(span=20, adjust=False, ignore_na=True).mean(), color=color,
                           line_width=2.5, legend_label="smoothed (EMA, 20 steps)")
            for step in self.morphs["resume_step"].dropna():
                f.add_layout(Span(location=float(step) - 0.5, dimension="height", line_dash="dotted",
                                  line_color="#E08E00", line_width=2))
            f.legend.label_text_font_size = "10px"
            f.legend.click_policy = "hide"
            f.add_layout(f.legend[0], "right")
            figs.append(f)
        figs[1].x_range = figs[0].x_range
        return column(*figs, sizing_mode="stretch_width")

    def dashboard(self, **kwargs):
        """The team dashboard for this job (``dashboard.app.build_app``: VM pool, partition map,
        throughput and loss, simulator estimates, pipeline timeline, morph history) as a Panel
        object; it displays inline in Jupyter and refreshes itself every ``refresh_s`` (1 s).
        Raises ``RuntimeError`` before ``launch()``."""
        if self.run_dir is None or not (self.run_dir / "events.db").exists():
            raise RuntimeError("launch() the job first: the dashboard reads the job's event log")
        from dashboard.app import build_app  # noqa: PLC0415 (top-level package, optional at import)

        return build_app(self.run_dir, **kwargs)

    # ------------------------------------------------------------------------------ progress
    def _start_progress(self) -> None:
        """Make the bar here (the launching cell owns the widget), update it on a thread."""
        from tqdm.auto import tqdm

        if self._monitor is not None and self._monitor.is_alive():
            return
        st = self.status
        self._bar = tqdm(total=self.config.train.steps, initial=st.step, desc=self.config.name, unit="step",
                         leave=True)
        self._monitor = threading.Thread(target=self._progress, args=(self._bar, st.step),
                                         name=f"varuna-progress-{self.config.name}", daemon=True)
        self._monitor.start()

    def _progress(self, bar, done: int) -> None:
        state = None
        try:
            while True:
                ended = self.manager is None or not self.running
                st = self.status
                if st.step != done:
                    bar.update(st.step - done)  # negative after a sudden loss: steps are redone
                    done = st.step
                post = {"state": st.state}
                if st.loss is not None:
                    post["loss"] = f"{st.loss:.3f}"
                if st.tokens_per_s:
                    post["tok/s"] = f"{st.tokens_per_s:,.0f}"
                if st.P:
                    post["plan"] = f"{st.P}x{st.D}"
                if st.morphs:
                    post["morphs"] = st.morphs
                bar.set_postfix(post, refresh=True)
                state = st.state
                if ended:
                    break
                time.sleep(0.5)
        except Exception:  # noqa: BLE001 - a progress bar must never take the kernel down
            pass
        finally:
            bar.close()
            _colour_finished_bar(bar, state)

    def __repr__(self) -> str:
        return f"<Job {self.config.name} {self.status.state}{' at ' + str(self.run_dir) if self.run_dir else ''}>"


def _colour_finished_bar(bar, state: str | None) -> None:
    """A notebook bar closed short of its total turns red (tqdm reads it as an error): a job
    stopped on request (checkpointed, continuable) is shown amber, a finished one green; only a
    FAILED job stays red. Text bars have no colour: nothing to do."""
    style = {"STOPPED": "warning", "SUCCEEDED": "success"}.get(state or "")
    if style is None or not hasattr(bar, "container"):
        return
    try:   # (tqdm's own disp() never turns a red bar green: set the widget's style)
        bar.container.children[1].bar_style = style
    except Exception:  # noqa: BLE001 - cosmetic
        pass


def _plan_label(p: dict | None) -> str | None:
    if not isinstance(p, dict) or p.get("P") is None:
        return None
    hosts = p.get("hosts") or []
    return f"P={p['P']} x D={p.get('D')}" + (f" on {','.join(map(str, hosts))}" if hosts else "")


def _stop_all_at_exit() -> None:
    """At interpreter exit: ask every running job of this kernel to stop, give them a moment to
    checkpoint, then close the providers they ran on (kills what is left: local workers, test
    hosts' sshd and processes). Quick, so the kernel's shutdown is not cut short."""
    jobs = list(_LAUNCHED)
    live = [j for j in jobs if j.running]
    for j in live:
        try:
            j.manager.cancel()
        except Exception:  # noqa: BLE001
            pass
    deadline = time.time() + 3.0
    for j in live:
        if j.manager is not None:
            j.manager.wait(max(0.0, deadline - time.time()))
    for j in jobs:
        if j.provider is not None and (j in live or j._own_provider):
            try:
                j.provider.close()
            except Exception:  # noqa: BLE001
                pass


atexit.register(_stop_all_at_exit)


class PlanView:
    """A ``planner.plan.Plan`` with the job it was made for: renders the ranked table and the
    partition map (which cut-point segments each stage holds, memory per stage, the rank of
    every stage × replica cell) as HTML in Jupyter and as text elsewhere. ``.plan`` is the
    ``Plan``, ``.best`` its best row."""

    def __init__(self, plan, job: JobConfig):
        self.plan = plan
        self.job = job

    @property
    def best(self):
        """The fastest feasible ``PlanRow`` (``ValueError`` with every reason when none fits)."""
        return self.plan.best

    def to_frame(self, feasible_only: bool = False):
        """The ranked configurations as a pandas DataFrame, fastest first: P, D, micro-batch size,
        m, idle GPUs, seconds per step, examples/s, bubble fraction, max memory per GPU (MiB),
        $ per 1,000 examples (spot, on demand), time and $ to ``target_examples`` when given,
        feasible and the reason when not."""
        import pandas as pd

        rows = []
        for r in self.plan.rows:
            if feasible_only and not r.feasible:
                continue
            rows.append({"P": r.P, "D": r.D, "micro_batch": r.micro_batch_size, "m": r.m, "idle_gpus": r.idle_gpus,
                         "step_s": r.time_s, "examples_per_s": r.examples_per_s, "bubble": r.bubble_fraction,
                         "max_mem_MiB": max(r.stage_memory_bytes) / 2**20 if r.stage_memory_bytes else math.nan,
                         "usd_per_1k_spot": r.cost_per_1k_spot, "usd_per_1k_on_demand": r.cost_per_1k_on_demand,
                         "time_to_target_s": r.time_to_target_s, "usd_to_target_spot": r.cost_to_target_spot,
                         "feasible": r.feasible, "reason": r.reason})
        df = pd.DataFrame(rows)
        if not self.plan.target_examples and not df.empty:
            df = df.drop(columns=["time_to_target_s", "usd_to_target_spot"])
        return df

    def timeline(self, row=None):
        """The simulated mini-batch of ``row`` (default the best) as a pandas DataFrame, one row
        per action: rank (= replica·P + stage), stage, replica, kind (F, R, B, WAIT, AR, TIED,
        SYNC, OPT), micro_batch, start_s, end_s (seconds from the mini-batch start) — the
        simulator's own event-by-event run (``Plan.simulate(row).timeline``)."""
        import pandas as pd

        row = row or self.plan.best
        sim = self.plan.simulate(row, record_timeline=True)
        out = []
        for rank, segs in enumerate(sim.timeline or []):
            for s in segs:
                out.append({"rank": rank, "stage": rank % row.P, "replica": rank // row.P, "kind": s.kind,
                            "micro_batch": s.mb, "start_s": s.start, "end_s": s.end})
        return pd.DataFrame(out, columns=["rank", "stage", "replica", "kind", "micro_batch", "start_s", "end_s"])

    def gantt(self, row=None, replica: int = 0, height: int | None = None):
        """A Bokeh Gantt chart of the simulated mini-batch of ``row`` (default the best) for one
        ``replica``: one lane per stage, forward / recompute / backward bars numbered by
        micro-batch, then the all-reduce, consensus and optimizer step (same colours as the
        dashboard). Show it with ``bokeh.io.show``."""
        from bokeh.models import ColumnDataSource, FactorRange, HoverTool
        from bokeh.plotting import figure

        from dashboard.app import ACTION_COLORS  # noqa: PLC0415 (the dashboard's palette)

        row = row or self.plan.best
        tl = self.timeline(row)
        tl = tl[tl["replica"] == replica]
        lanes = [f"stage {s}" for s in range(row.P)]
        f = figure(height=height or 110 + 45 * row.P, sizing_mode="stretch_width",
                   y_range=FactorRange(*reversed(lanes)), x_axis_label="seconds into the mini-batch",
                   title=f"simulated mini-batch: P={row.P} x D={row.D}, micro-batch {row.micro_batch_size}, "
                         f"m={row.m}, {row.time_s:.3f} s, bubble {row.bubble_fraction:.0%}",
                   tools="pan,wheel_zoom,box_zoom,reset,save")
        names = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight gradients (split backward)",
                 "AR": "all-reduce", "WAIT": "waiting for a core",
                 "TIED": "tied-weight all-reduce", "SYNC": "consensus", "OPT": "optimizer step"}
        extra = {"W": "#88D27A", "AR": "#B279A2", "WAIT": "#EEEEEE", "TIED": "#9D755D", "SYNC": "#72B7B2", "OPT": "#BAB0AC"}
        for kind, g in tl.groupby("kind", sort=False):
            src = ColumnDataSource(dict(y=[lanes[s] for s in g["stage"]], left=g["start_s"], right=g["end_s"],
                                        mb=[str(m) if m >= 0 and kind in ("F", "R", "B", "W") else "" for m in g["micro_batch"]],
                                        mid=(g["start_s"] + g["end_s"]) / 2, kind=[names.get(kind, kind)] * len(g)))
            color = ACTION_COLORS.get(kind) if kind in ("F", "R", "B") else extra.get(kind, ACTION_COLORS["other"])
            f.hbar(y="y", left="left", right="right", height=0.7, source=src, color=color, line_color="white",
                   legend_label=names.get(kind, kind))
            if kind in ("F", "R", "B", "W"):
                f.text(x="mid", y="y", text="mb", source=src, text_align="center", text_baseline="middle",
                       text_font_size="9px", text_color="white")
        f.add_tools(HoverTool(tooltips=[("", "@kind @mb"), ("stage", "@y"), ("start", "@left{0.0000} s"),
                                        ("end", "@right{0.0000} s")]))
        f.legend.orientation = "horizontal"
        f.legend.label_text_font_size = "10px"
        f.add_layout(f.legend[0], "below")
        f.x_range.start = 0
        return f

    def partition_map(self) -> str:
        """The best row's stages as text: segments, memory per GPU, one cell per replica."""
        r = self.plan.best
        lines = [f"best: P={r.P} stages x D={r.D} replicas, micro-batch {r.micro_batch_size}, m={r.m}, "
                 f"{r.time_s:.3f} s/step predicted, bubble {r.bubble_fraction:.1%}"]
        for s, segs in enumerate(r.stages):
            mem = r.stage_memory_bytes[s] if s < len(r.stage_memory_bytes) else 0.0
            lines.append(f"  stage {s}: segments {segs[0]}..{segs[-1]} ({len(segs)}) | {mem / 2**20:8.1f} MiB | "
                         + " ".join(f"[r{d}]" for d in range(r.D)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.plan.table() + "\n\n" + self.partition_map()

    def _repr_html_(self) -> str:
        import html

        r = self.plan.best
        cells = "".join(
            "<tr><th style='text-align:left'>stage {s}<br><small>segments {a}..{b}<br>{mem:.1f} MiB</small></th>{row}</tr>".format(
                s=s, a=segs[0], b=segs[-1], mem=(r.stage_memory_bytes[s] if s < len(r.stage_memory_bytes) else 0) / 2**20,
                row="".join(f"<td style='border:1px solid #888;padding:4px 10px;background:hsl({(s * 67) % 360},60%,85%)'>"
                            f"replica {d}<br><small>rank {d * r.P + s}</small></td>" for d in range(r.D)))
            for s, segs in enumerate(r.stages))
        return (f"{self.plan._repr_html_()}<b>Partition map</b> (P={r.P} x D={r.D}, "
                f"{r.time_s:.3f} s/step predicted)<table style='border-collapse:collapse'>{cells}</table>")

    def __repr__(self) -> str:
        return str(self)


__all__ = ["Job", "JobStatus", "PlanView", "ConfigError"]
