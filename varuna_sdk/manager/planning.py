"""Planning for the morph manager: which VMs the next plan may use (``_usable_hosts``: not under
notice, not an excluded straggler, not recently lost), the best plan for them (``_replan``: the
planner run on the job's calibration, keeping the first plan's micro-batch size so random ops
draw the same masks), the PLAN event with the ranked table and the simulated timeline
(``_record_plan``), and where the job resumes (``_resume_step``: the last complete checkpoint).

``ManagerPlanning`` is that part of ``Manager`` (a mixin: it uses the manager's ``job``,
``provider``, ``options``, ``log``, ``profile()`` and the fields ``_excluded``, ``_noticed``,
``_suspect``, ``_micro_batch_size``, ``_profile``, set by ``Manager.__init__``).

Owns ``ManagerPlanning``, ``SUSPECT_S``, ``on_this_machine``, ``resume_problem`` (whether a job may
start workers on its checkpoint store). Imports ``cluster`` (hosts, localproc),
``config``, ``planner`` and ``checkpoint`` (inside the methods: the planner loads the compiled
core) and ``manager.decisions|events``; never torch, never ``manager.manager``.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import time
from dataclasses import asdict
from typing import Any

from ..cluster.hosts import Host
from ..cluster.localproc import is_local
from ..config import ConfigError, JobConfig
from .decisions import pool_prices, pool_slots, worker_slots
from .events import Kind

_log = logging.getLogger(__name__)

SUSPECT_S = 120.0  # a VM reported lost is not planned on for this long unless the provider re-adds it


def _answers(h: Host, timeout_s: float = 1.0) -> bool:
    """Whether a VM reported lost is reachable again: a local slot always is (only its worker
    died); an SSH VM when its SSH port accepts a TCP connection within ``timeout_s``."""
    if is_local(h):
        return True
    try:
        with socket.create_connection((h.address, h.port), timeout=timeout_s):
            return True
    except OSError:
        return False



def on_this_machine(h: Host) -> bool:
    """Local slots and loopback test hosts share this machine's cores (the planner models them
    as one VM with ``os.cpu_count()`` compute slots)."""
    return is_local(h) or h.is_loopback



def resume_problem(url: str, key: bytes | None, *, resume: bool, steps_done: int, stopped: bool) -> str | None:
    """Why a job must not start workers on the checkpoint store at ``url``, in words (None: it may):

    - ``resume`` false (``train.resume``) and the store already holds a complete checkpoint (any,
      signed or not: the workers would refuse it after starting, and the run would end FAILED);
    - ``stopped`` (a STOPPED run being continued) that has done ``steps_done`` > 0 steps, but no
      checkpoint in the store verifies with ``key`` (``manifest_key`` of the job secret; None:
      checksums only): the workers would start again from step 0 and repeat those steps.

    Reads manifests only (no tensor files). Raises ``CheckpointError`` when the store cannot be
    opened or listed (a file, or a path under a file)."""
    from ..checkpoint.store import complete_checkpoints

    if not resume:
        found = complete_checkpoints(url)
        if not found:
            return None
        if stopped and steps_done > 0:
            return (f"train.resume is false, but this run stopped after {steps_done} step(s) and its checkpoint store "
                    f"{url!r} holds checkpoints (newest at step {found[0].step}): no worker was started and the run "
                    "is still STOPPED. Set train.resume to true to continue it from there, or give a new --run-dir "
                    "to train from scratch")
        return (f"train.resume is false but the checkpoint store {url!r} already holds checkpoints (newest at step "
                f"{found[0].step}) of an earlier run; set train.checkpoint_url to an empty location, delete them, or "
                "set train.resume to true to continue that run")
    if not stopped or steps_done <= 0:
        return None
    skipped: list[tuple[str, str]] = []
    if complete_checkpoints(url, key, skipped):
        return None
    why = ("; ".join(f"{name} ({reason[:160]})" for name, reason in skipped[:5]) + ("; ..." if len(skipped) > 5 else "")
           if skipped else "it holds none")
    return (f"this run stopped after {steps_done} step(s), but no usable checkpoint remains in its store {url!r} "
            f"(skipped: {why}); continuing would start again from step 0 and repeat those steps. No worker was "
            "started and the run is still STOPPED: put its checkpoints back to continue it, or give a new --run-dir "
            "to train from scratch")


class ManagerPlanning:
    """The planning part of ``Manager`` (see the module docstring)."""

    def _provider_hosts(self) -> list[Host]:
        """Every VM the provider holds, usable or under a pre-emption notice."""
        return self.provider.all_hosts()

    def _usable_hosts(self) -> list[Host]:
        """VMs the next plan may use: held by the provider, not under notice, not excluded as a
        straggler, and not reported lost in the last ``SUSPECT_S`` seconds (unless re-added, or it
        answers: a local slot whose worker was killed is reusable at once, an SSH VM whose SSH port
        accepts a connection within a second is too)."""
        now = time.time()
        return [h for h in self.provider.hosts() if h.name not in self._excluded and
                not (h.name in self._noticed and self._noticed[h.name] > now - 3600) and
                not (h.name in self._suspect and self._suspect[h.name] > now - SUSPECT_S
                     and not _answers(h))]

    def _replan(self, hosts: list[Host], *, first: bool, best_only: bool = False, profile=None
                ) -> tuple[JobConfig, Any, Any, list[Host]]:
        """Best plan for ``hosts``; returns (job for it, Plan, row, hosts used in rank order).
        ``best_only``: a what-if that needs only the best row (a best-only search, about linear in
        the GPUs); the plan a generation runs, shown on the dashboard, simulates every depth.
        ``profile``: plan from this calibration instead of the job's current one (a what-if that
        must use the same yardstick as the running plan)."""
        from ..planner.plan import Prices, plan_for_job

        G = pool_slots(hosts)
        priced = pool_prices(hosts)     # the pool's real prices (e.g. the spot price history), or the example's
        prices = Prices(**priced) if priced else None
        job = copy.deepcopy(self.job)
        p0 = job.parallel
        fixed = {k: getattr(p0, k) for k in ("P", "D") if getattr(p0, k) is not None}
        self.plan_kept = fixed if first and fixed else None   # the config's fixed P/D, kept unless they do not fit
        if first and not self.options.calibrate_first and self._profile is None and not p0.planned and p0.P * p0.D <= G:
            self._micro_batch_size = self._micro_batch_size or p0.micro_batch_size
            return job, None, None, self._hosts_for(hosts, p0.P * p0.D)  # as configured, no calibration
        if not first:
            job.parallel.P = job.parallel.D = None
            job.parallel.boundaries = None
        local = all(on_this_machine(h) for h in hosts)
        per_vm = G if local else max(worker_slots(h) for h in hosts)
        slots = (os.cpu_count() or 1) if local else 0
        # a morph keeps the micro-batch size of the first plan: random ops (dropout) draw per (step,
        # micro-batch, segment), so the same examples get the same masks only in micro-batches of the
        # same size — the loss trajectory stays the uninterrupted one's
        pinned = None if self._micro_batch_size is None else [self._micro_batch_size]
        if first and pinned is None and not p0.planned:   # a configured P x D: its configured micro-batch size
            pinned = [p0.micro_batch_size]

        def plan_on_pool(keep_fixed: bool, sizes: list[int] | None):
            # VMs: a worker's activations and gradients leave its VM by one network link (shared egress);
            # local workers talk over this machine's loopback
            return plan_for_job(job, profile or self.profile(), G, gpus_per_vm=per_vm, compute_slots_per_vm=slots,
                                keep_fixed=keep_fixed, exhaustive=not best_only, prices=prices,
                                micro_batch_sizes=sizes, shared_egress=not local)

        def pinned_or_not(keep_fixed: bool):
            # the pinned micro-batch size where a plan has it, else any; said only when the size changes
            # (a config's P x D that does not fit fails either way: not the micro-batch's doing)
            try:
                return plan_on_pool(keep_fixed, pinned)
            except ConfigError:
                if pinned is None:
                    raise
            job_any, pl_any = plan_on_pool(keep_fixed, None)
            if job_any.parallel.micro_batch_size != pinned[0]:
                msg = (f"no plan for {G} worker slot(s) keeps micro-batch size {pinned[0]}; choosing "
                       f"{job_any.parallel.micro_batch_size}, so random ops (dropout) draw other masks from here on")
                _log.warning("job %s: %s", self.job_id, msg)
                self.log.append(Kind.WARNING, job_id=self.job_id, payload={"message": msg})
            return job_any, pl_any

        try:
            job_g, pl = pinned_or_not(first)
        except ConfigError as e:
            if not first:
                raise
            msg = (f"parallel.P={p0.P} x D={p0.D} from the config cannot run on the {G} worker slot(s) the pool "
                   f"has ({e}); planning for the pool instead")
            _log.warning("job %s: %s", self.job_id, msg)
            self.log.append(Kind.WARNING, job_id=self.job_id, payload={"message": msg})
            self.plan_kept = None
            job.parallel.P = job.parallel.D = None  # the fixed P/D does not fit the pool: choose
            job.parallel.boundaries = None
            job_g, pl = pinned_or_not(False)   # ... P and D, with the configured micro-batch size when some plan has it
        row = next(r for r in pl.feasible if r.P == job_g.parallel.P and r.D == job_g.parallel.D)
        if not best_only:   # what the plan a generation runs was held to (its PLAN event says it)
            self.plan_held = {**(self.plan_kept or {}), **({"micro_batch_size": pinned[0]} if pinned and
                                                           job_g.parallel.micro_batch_size == pinned[0] else {})}
        if first and not best_only and self._micro_batch_size is None:
            self._micro_batch_size = job_g.parallel.micro_batch_size
        return job_g, pl, row, self._hosts_for(hosts, job_g.parallel.P * job_g.parallel.D)

    @staticmethod
    def _hosts_for(hosts: list[Host], need: int) -> list[Host]:
        """The first whole VMs, in the provider's order, that hold ``need`` workers."""
        used, n = [], 0
        for h in hosts:
            if n >= need:
                break
            used.append(h)
            n += worker_slots(h)
        return used

    def _record_plan(self, job: JobConfig, pl, row, hosts: list[Host]) -> list[float]:
        """PLAN event with the ranked table and the simulated timeline; returns the predicted
        per-stage compute seconds per micro-batch (for straggler detection)."""
        p = job.parallel
        timeline, per_stage = [], []
        if pl is None:  # started as configured, without a calibration (calibrate_first=False)
            rank_hosts = [h.name for h in hosts for _ in range(worker_slots(h))]
            self.log.append(Kind.PLAN, job_id=self.job_id, payload={
                "generation": self.generation, "gpus": p.P * p.D, "pool_gpus": pool_slots(hosts), "P": p.P,
                "D": p.D, "micro_batch_size": p.micro_batch_size, "num_micro_batches": p.num_micro_batches,
                "boundaries": p.boundaries, "hosts": rank_hosts[:p.P * p.D], "predicted_step_s": None,
                "examples_per_s": None, "bubble": None, "mem_per_stage_bytes": None, "rows": [], "timeline": [],
                "note": "as configured (no calibration yet)", "labels": self.labels})
            return []
        try:
            sim = pl.simulate(row, record_timeline=True)
            for s in range(p.P):
                for seg in sim.timeline[s]:
                    timeline.append({"stage": s, "action": seg.kind, "micro_batch": seg.mb,
                                     "start_s": seg.start, "end_s": seg.end})
            per_stage = [b / max(1, row.m) for b in sim.stage_busy]
        except Exception as e:  # noqa: BLE001 - a timeline is a view; never stop a job for it
            timeline = []
            per_stage = []
            self.log.append(Kind.WARNING, job_id=self.job_id, payload={"message": f"no simulated timeline: {e}"})
        rank_hosts = []
        for h in hosts:
            rank_hosts += [h.name] * worker_slots(h)
        rows = [{k: v for k, v in asdict(r).items() if k in ("P", "D", "micro_batch_size", "m", "idle_gpus", "time_s",
                                                              "examples_per_s", "bubble_fraction", "stage_memory_bytes",
                                                              "feasible", "reason", "cost_per_1k_spot")}
                for r in pl.rows]
        self.log.append(Kind.PLAN, job_id=self.job_id, payload={
            "generation": self.generation, "gpus": p.P * p.D, "pool_gpus": pl.gpus, "P": p.P, "D": p.D,
            "micro_batch_size": p.micro_batch_size, "num_micro_batches": p.num_micro_batches,
            "boundaries": p.boundaries, "hosts": rank_hosts[:p.P * p.D], "predicted_step_s": row.time_s,
            "examples_per_s": row.examples_per_s, "bubble": row.bubble_fraction, "data_wait_s": row.data_wait_s,
            "notes": list(pl.notes), "held": dict(self.plan_held),
            "mem_per_stage_bytes": row.stage_memory_bytes, "rows": rows, "timeline": timeline, "labels": self.labels,
            "prices": asdict(pl.prices)})
        return per_stage

    def _resume_step(self) -> int:
        """Steps the job's last complete checkpoint holds (0: none yet): where the next generation resumes.
        Raises ``CheckpointError`` when the store cannot be opened or listed."""
        from ..checkpoint import latest_complete

        ck = latest_complete(self._store_url(), self._manifest_key)
        return 0 if ck is None else int(ck.step)

    def _check_resumable(self) -> None:
        """Before any state change or worker: the store can be listed, and ``resume_problem`` for this
        job and its store (a STOPPED job continued, ``train.resume`` false on a store holding
        checkpoints). Raises ``ManagerError`` saying why and what to do; the run's recorded state is
        left as it was."""
        from ..checkpoint.store import CheckpointError
        from .state import JobState, ManagerError

        done = 0 if self._last_step is None else int(self._last_step) + 1
        try:
            self._resume_step()   # a store that cannot be listed (a file, a path under one): said now
            problem = resume_problem(self._store_url(), self._manifest_key, resume=self.job.train.resume,
                                     steps_done=done, stopped=self.state == JobState.STOPPED)
        except CheckpointError as e:
            problem = str(e)
        if problem:
            raise ManagerError(problem)

    def _store_url(self) -> str:
        """The job's checkpoint store (a folder or a URL)."""
        return self.job.train.checkpoint_url or str(self.run_dir / "checkpoints")

