"""The notebook's ``Job`` handle: calibrate, plan, launch in the background, follow, read and
stop a training job from cells (the package docstring, ``varuna_sdk.notebook``, is the guide).

Owns ``Job``, the kernel's registry of launched jobs (one running job per name) and the stop of
every job at interpreter exit. Imports the manager, planner, profiling, cluster providers and
``runner`` where used, and the top-level ``dashboard`` package only in ``Job.dashboard()``;
nothing in ``varuna_sdk`` imports it.
"""

from __future__ import annotations

import atexit
import copy
import json
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

from ..config import JobConfig
from ..palette import plan_label
from .arguments import SHIP_HELP, apply_overrides, apply_settings, name_of, unshippable
from .views import JobStatus, PlanView, colour_finished_bar, metrics_figure

_RUNNING: dict[str, "Job"] = {}   # job name -> the Job that launched it last (one per kernel)
_LAUNCHED: "weakref.WeakSet[Job]" = weakref.WeakSet()
_LOCK = threading.Lock()


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
            folder, json/jsonl/parquet/csv), a ``DataConfig``, a map-style ``Dataset`` object (a
            ``datasets.Dataset`` too), or a function returning one (either shipped by value: a
            function that reads the data on the worker ships less), or its import path
            ``"mypkg.data:make"`` (``data.dataset``, by reference).
        init: ``init_fn(module, name)`` for a model too large to record once (shipped by value).
        ship_modules: your own modules whose code must travel by value too (not installed on
            the VMs); a module in your synced code folder needs nothing.
        steps: ``train.steps`` (a shortcut).
        **settings: any other field of the config by its name, e.g. ``seq_len=64`` (``data.seq_len``),
            ``global_batch=16``, ``micro_batch_size=2``, ``P=2``, ``D=1`` (fixing both skips the
            planner), ``lr=3e-4``, ``precision="bf16"``; ``data_seed=``/``train_seed=`` for the two
            seeds. An unknown name raises ``TypeError`` with the likely one.
        provider: where workers run (``cluster.provider``: ``LocalProvider``, ``cluster.hostfile.HostFileProvider``,
            ``cluster.spot.SpotEmulator``...); default local worker processes, closed by ``close()``:
            ``LocalProvider(P × D)`` when both are fixed (a warning when that is more than
            ``launch.gpus``), else ``LocalProvider(config.launch.gpus)``. A provider you pass stays yours to close
            (at interpreter exit it is closed too, if a job of this kernel still runs on it).
        run_dir: the job's own folder (default ``<train.run_dir>/<name>-<time>``, made at launch);
            one holding this job's run is continued. A folder of other runs is refused
            (``ConfigError``): give a new folder inside it, or ``train_run_dir=`` that folder; so are
            an empty path, a file and a path under a file (``ConfigError``, here, not at launch).
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
                 manager_options: dict[str, Any] | None = None, **settings: Any):
        if config is None:
            job = JobConfig()
            if model is not None:
                job.name = name_of(model)
        elif isinstance(config, (str, Path)):
            job = JobConfig.from_yaml(Path(config))
        elif isinstance(config, JobConfig):
            job = config
        else:
            from torch import nn

            what = getattr(config, "__qualname__", None) or type(config).__name__
            hint = f" To train {what}, pass it as Job(model={what})." if callable(config) and not isinstance(
                config, nn.Module) else ""
            raise TypeError(f"Job(config) takes a JobConfig or the path of a job YAML, not {what!r}.{hint} {SHIP_HELP}")
        job = copy.deepcopy(job)
        objects = apply_overrides(job, model=model, loss=loss, data=data, init=init, ship_modules=ship_modules)
        if steps is not None:
            job.train.steps = steps
        apply_settings(job, settings, own_model=job.model.factory is not None or (
            objects is not None and objects.model is not None))
        bad = unshippable(job.to_dict(), "config")
        if bad:
            raise TypeError(f"{bad} cannot be sent to the workers. {SHIP_HELP}")
        job.validate()
        from ..runner import check_run_dir

        check_run_dir(run_dir, job.name, notebook=True)   # a folder of runs is no job's folder: said before any work
        self._files = objects.pack(job) if objects is not None else {}
        from ..trainer import resolve

        self.resolved = resolve(job)  # the model, data and loss, checked together now
        if not job.parallel.planned:
            from ..trainer import check_partition

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

        from ..manager.runs import find_runs, read_run

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
        p2p and all-reduce α–β (kept per host for an hour and reused by the next model's
        calibration). Cached on disk per model shape (``refresh=True`` measures both again);
        returns the ``profiling.profile.Profile``."""
        from ..profiling.job import calibrate_job

        self._profile = calibrate_job(self.config, refresh=refresh, resolved=self.resolved)
        return self._profile

    def initial_weights(self) -> dict:
        """The parameters and (persistent) buffers every stage starts from, as one ``state_dict``
        of CPU tensors under the model's own names (tied weights under each of their names).

        Each is made by the model's own constructor (or ``model.init``) seeded from
        ``train.seed`` and its module's name, so every (P, D) starts from the same values. Load
        it into your own copy — ``mine = MyModel(); mine.load_state_dict(job.initial_weights())``
        — and a plain PyTorch loop over the same micro-batches (``batch(step)``; loss / m summed into
        the gradients, the same optimizer) follows the pipeline's losses to fp32 rounding
        (``plain_pytorch_losses`` runs that loop). Builds the
        whole model in host memory (its size in bytes); raises what the model's constructor raises.
        """
        from ..reference import initial_model

        model = initial_model(self.config, self.resolved)
        return {n: t.detach().clone() for n, t in model.state_dict().items()}

    def trained_weights(self) -> dict:
        """The trained model: one ``state_dict`` of CPU tensors with exactly the keys of
        ``initial_weights()`` (the whole, unpartitioned model under its own names, tied weights
        under each of their names), read from the run's newest complete checkpoint — whatever
        P × D wrote it, each file checked against its SHA-256 and the job's signature and loaded
        with ``torch.load(weights_only=True)``; a torn checkpoint is never used, the next older
        one is. A finished run always checkpoints its last step, so after SUCCEEDED these are the
        weights after ``train.steps`` steps (of a stopped or running job: its last checkpoint).
        ``mine = MyModel(); mine.load_state_dict(job.trained_weights())``; from a shell:
        ``varuna export RUN_DIR -o model.pt``. Reads the run folder only (callable from any kernel
        given ``Job(config, run_dir=...)``). Raises ``ValueError`` before a run folder is known
        (not launched, no ``run_dir``), ``checkpoint.CheckpointError`` when no usable checkpoint is
        left (naming each one skipped and why). (``runner.trained_weights``)"""
        if self.run_dir is None:
            raise ValueError("this job has no run folder yet: launch() it first, or make the Job with "
                             "run_dir= naming the folder of the run whose weights you want")
        from ..runner import trained_weights

        return trained_weights(self.run_dir, self.config, self.resolved)[0]

    def batch(self, step: int, micro_batch_size: int | None = None) -> list:
        """The micro-batches mini-batch ``step`` trains on, in order: a list of ``(inputs,
        targets)`` as the model and the loss take them (``model(*inputs)`` for a tuple,
        ``model(**inputs)`` for a dict; ``targets`` ``None`` when the model computes its own
        loss), ``global_batch`` examples in all, ``micro_batch_size`` each (default the job's,
        after ``plan()`` the planned one, else the whole mini-batch as one). The same examples at
        every P × D and after every morph. Raises ``ValueError`` for a step outside
        ``0 .. train.steps - 1`` or a size that does not divide the global batch."""
        from ..reference import micro_batches

        return micro_batches(self.config, self.resolved, step, micro_batch_size)

    @property
    def segments(self):
        """Where the model's cut-points fell, before any plan or launch: a pandas DataFrame with one
        row per segment between cut-points (what the planner's stages are made of, paper §3.2):
        ``segment``, ``modules`` (the modules whose parameters it uses, the first few named),
        ``param_bytes`` (bytes of the parameters it uses first) and ``forward_flops_share``
        (its share of the forward's FLOPs at the dry run's micro-batch, 0..1), read off the dry
        run ``Job()`` made. A stage of a plan is a run of consecutive segments."""
        import pandas as pd

        st = self.resolved.structure
        total = sum(st.segment_flops) or 1.0
        rows = []
        for i in range(st.num_segments):
            mods = [m or "(the model's own)" for m in (st.segment_modules[i] if i < len(st.segment_modules) else [])]
            shown = ", ".join(mods[:4]) + (f" (+{len(mods) - 4} more)" if len(mods) > 4 else "")
            rows.append([i, shown, int(st.segment_param_bytes[i]), st.segment_flops[i] / total])
        return pd.DataFrame(rows, columns=["segment", "modules", "param_bytes", "forward_flops_share"])

    def plain_pytorch_losses(self, steps: int = 3, micro_batch_size: int | None = None, model=None) -> list[float]:
        """The first ``steps`` losses of the unpartitioned model trained by plain PyTorch on this
        job's micro-batches (``batch``), from ``initial_weights()`` (or your ``model``, which is
        trained in place), with the job's AdamW, learning rate and clipping — what
        ``job.metrics.loss`` must equal, to fp32 rounding, at any P × D: your check that the
        pipeline trains your model as PyTorch does. Runs here, on CPU (fp32 or bf16), before or
        after ``launch()``. Dropout masks and other random draws are the pipeline's (each segment
        of each micro-batch seeded as the workers seed it) at the job's micro-batch size with the
        job's own model; with your ``model`` or another size a model with dropout is warned about
        (its masks differ). Raises
        ``ValueError`` for ``steps`` outside ``1 .. train.steps`` or fp16. (``varuna_sdk.reference``)"""
        from ..reference import plain_losses

        return plain_losses(self.config, self.resolved, steps, micro_batch_size, model)

    def _default_gpus(self) -> int:
        if self.provider is not None:
            from ..manager.decisions import pool_slots

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
        from ..planner.plan import plan_for_job

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
        bandwidth, bytes/s), ``prices`` (``planner.rows.Prices``: $ per GPU-hour) and
        ``target_examples`` (time and cost to train that many) as in ``planner.plan.plan``.
        Compute times are the calibrated device's (this machine's CPU when calibrated here).
        Returns a ``PlanView``; raises ``ConfigError`` for bad arguments."""
        from ..planner.plan import plan as plan_fn

        prof = self._profile or self.calibrate()
        p = self.config.parallel
        G = self.config.launch.gpus if gpus is None else gpus
        return PlanView(plan_fn(prof, G, p.global_batch if global_batch is None else global_batch, policy=policy or p.policy,
                                recompute=(p.recompute if isinstance(p.recompute, bool) else None)
                                if recompute is None and policy is None else recompute,
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
        ``launch.backend: nccl`` for this machine's workers where it has no CUDA GPU raises
        ``ConfigError`` (``runner.check_local_backend``). Worker or planning errors surface in
        ``status.error`` (state FAILED), not here."""
        from ..manager.manager import Manager

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
            from ..runner import check_local_backend

            check_local_backend(self.config, provider)   # NCCL asked for on a machine without it: refused
            if provider is None:   # this machine's worker processes: as many as a fixed P x D needs
                from ..cluster.provider import LocalProvider
                from ..runner import local_slots

                slots, said = local_slots(self.config)
                for text in said:
                    warnings.warn(text, stacklevel=2)
                provider = LocalProvider(slots)
                self._own_provider = True
                self.provider = provider
            from ..runner import prepare_run

            with warnings.catch_warnings():   # Job() showed what resolving this job warns about: not again
                warnings.filterwarnings("ignore", category=UserWarning, module=r"varuna_sdk\.")
                _, out, _ = prepare_run(self.config, self.run_dir, files=self._files)  # config + shipped objects
            self.run_dir = out.resolve()
            self.config.to_yaml(self.run_dir / "config.yaml")
            # a stopped or failed job continues under a new job id in the same folder: the
            # manager of the old id would only replay its terminal state
            job_id = self.run_dir.name if self.launches == 0 else f"{self.run_dir.name}.{self.launches}"
            from ..runner import job_labels

            manager = Manager(self.config, provider, run_dir=self.run_dir, job_id=job_id, profile=self._profile,
                              **{"labels": job_labels(self.resolved), **self.manager_options})
            if not provider.started and not provider.closed:
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
        return m is not None and not m.state.terminal and m.alive

    def wait(self, timeout_s: float | None = None) -> JobStatus:
        """Block until the job ends (or ``timeout_s`` seconds pass); returns its status.
        Interrupting the wait (Jupyter's interrupt, Ctrl-C) leaves the job training in the
        background: ``stop()`` stops it at a checkpoint."""
        if self.manager is not None:
            try:
                self.manager.wait(timeout_s)
            except KeyboardInterrupt:
                if self.running:
                    print(f"[varuna] {self.config.name} goes on training in the background; job.stop() stops it "
                          "at the next mini-batch with a checkpoint", file=sys.stderr)
                raise
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
        from ..manager.events import EventLog

        if self.run_dir is None or not (self.run_dir / "events.db").exists():
            return None
        return EventLog.reader(self.run_dir / "events.db")

    @property
    def status(self) -> JobStatus:
        """The job's state, last step, loss, throughput and plan (a snapshot; cheap)."""
        from ..manager.events import Kind

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
        state, error = (m.state.value, m.error) if m else self._folder_state()
        return JobStatus(
            name=self.config.name, state=state,
            step=int(last.get("step", -1)) + 1, steps=self.config.train.steps, loss=last.get("loss"),
            tokens_per_s=last.get("tokens_per_s"), examples_per_s=last.get("examples_per_s"),
            P=last.get("P") or self.config.parallel.P, D=last.get("D") or self.config.parallel.D,
            generation=max(0, plans - 1), morphs=morphs, error=error,
            run_dir=str(self.run_dir) if self.run_dir else None)

    def _folder_state(self) -> tuple[str, str | None]:
        """``(state, error)`` of this job's run folder when no manager of this kernel runs it (a
        ``Job(..., run_dir=...)`` of a finished or stopped run: what ``varuna status`` says, e.g.
        ``SUCCEEDED``); ``("NOT LAUNCHED", None)`` for a folder no job has run in."""
        if self.run_dir is None or not (Path(self.run_dir) / "events.db").exists():
            return "NOT LAUNCHED", None
        from ..manager.runs import read_run

        try:
            info = read_run(self.run_dir)
        except Exception:  # noqa: BLE001 - a folder that cannot be read: say nothing more than before
            return "NOT LAUNCHED", None
        return info.state_text, info.error

    @property
    def metrics(self):
        """Every training step's metrics as a pandas DataFrame, in the order they were recorded:
        step (0-based: the first step is 0, while the worker logs, ``varuna status`` and the
        progress bar count from 1, so their "step 566/2000" is the row with step 565), loss, lr,
        grad_norm, skipped, loss_scale, step_time_s (s, reading the
        batch included: data_s of it), tokens_per_s, examples_per_s, wall_time (Unix s), P, D,
        generation, job_id. A step redone after a sudden loss appears once per generation that
        trained it. Before the first step (or when the job failed before it): no rows, the same
        columns."""
        import pandas as pd

        cols = ["step", "loss", "lr", "grad_norm", "skipped", "loss_scale", "step_time_s", "tokens_per_s",
                "examples_per_s", "wall_time", "P", "D", "generation", "job_id"]
        log = self._log()
        if log is None:
            return pd.DataFrame(columns=cols)
        try:
            df = pd.DataFrame(log.metrics())
        finally:
            log.close()
        if df.empty:
            return pd.DataFrame(columns=cols)
        return df.drop(columns=[c for c in ("id", "time") if c in df.columns])

    @property
    def events(self):
        """Every event of the job (state changes, plans, VMs added / noticed / removed, workers
        joined and finished, morphs...) as a pandas DataFrame: time (UTC, to the millisecond), what
        (the event in a sentence), kind, host ("" when none), rank (an integer, or <NA>), payload
        (a dict)."""
        import pandas as pd

        from ..manager.runs import event_sentence

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

        from ..manager.events import Kind
        from ..manager.runs import morph_sentence

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
                         "host": p.get("host"), "what_happened": morph_sentence(p), "old_plan": plan_label(p.get("old"), hosts=True),
                         "new_plan": plan_label(p.get("new"), hosts=True), "downtime_s": p.get("downtime_s"),
                         "phases_s": p.get("phases_s") or {}, "from_step": p.get("from_step"),
                         "resume_step": p.get("resume_step"), "steps_lost": p.get("steps_lost"),
                         "candidates": p.get("candidates") or [], "old": p.get("old"), "new": p.get("new")})
        return pd.DataFrame(rows, columns=cols)

    @property
    def summary(self) -> dict | None:
        """The finished run's ``summary.json`` (held-out mean loss at start ``loss_start`` and end
        ``loss_end``, their perplexities ``ppl_start``/``ppl_end`` — for a language model on text
        only: None for a dataset with its own loss, and when the loss is above ~709 — final loss,
        training seconds), written by rank 0 into the run folder when
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
        df = self.metrics
        if df.empty:
            raise RuntimeError("no step finished yet: launch() the job and wait for its first step")
        return metrics_figure(df, self.morphs["resume_step"].dropna(), height)

    def dashboard(self, **kwargs):
        """The team dashboard for this job (``dashboard.app.build_app``: VM pool, partition map,
        throughput and loss, simulator estimates, pipeline timeline, morph history) as a Panel
        object; it displays inline in Jupyter and refreshes itself every ``refresh_s`` (1 s).
        Raises ``RuntimeError`` before ``launch()``."""
        if self.run_dir is None or not (self.run_dir / "events.db").exists():
            raise RuntimeError("launch() the job first: the dashboard reads the job's event log")
        from dashboard.app import build_app  # the dashboard: a top-level package, imported only here

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
        """Follow the job on ``bar`` until it ends; a FAILED job's reason is printed under the bar
        (a script's ``job.wait()`` returns the status, which a script need not print)."""
        state, error = None, None
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
                state, error = st.state, st.error
                if ended:
                    break
                time.sleep(0.5)
        except Exception:  # noqa: BLE001 - a progress bar must never take the kernel down
            pass
        finally:
            bar.close()
            colour_finished_bar(bar, state)
            if state == "FAILED" and error:
                print(f"[varuna] {self.config.name} FAILED: {error}", file=sys.stderr, flush=True)

    def __repr__(self) -> str:
        return f"<Job {self.config.name} {self.status.state}{' at ' + str(self.run_dir) if self.run_dir else ''}>"



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
