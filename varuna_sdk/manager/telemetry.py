"""What the morph manager learns from a running generation: its metrics (``_poll_metrics``: the
last step, step times, the first step of a new generation — which closes the morph record),
its heartbeats (``_collect_heartbeats``: per rank, compute seconds per micro-batch), and the two
judgements made from them — stragglers (``_check_stragglers``, ``decisions.find_stragglers`` and
``decisions.judge_straggler``) and an estimate that no longer holds (``_check_drift``,
``decisions.step_time_drift``: an ``estimate_drift`` event and later plans from the calibration
scaled by what the job measured). After a manager restart, ``_backfill_metrics`` copies the steps
orphaned workers finished into the event log.

``ManagerTelemetry`` is that part of ``Manager`` (a mixin: it uses the manager's ``log``,
``job_id``, ``generation``, ``options``, ``run_dir`` and the fields ``_metric_cursor``,
``_hb_cursor``, ``_history``, ``_hb_last_step``, ``_step_times``, ``_data_times``, ``_last_step``, ``_lineage``, ``_pending``,
``_excluded``, ``_profile``, ``morphs``, set by ``Manager.__init__``).

Owns ``ManagerTelemetry``, ``HISTORY``. Imports ``config``, ``manager.decisions|events|planning|state``;
never torch, never ``manager.manager``.
"""

from __future__ import annotations

import json
import os
import statistics

from ..config import ConfigError
from .decisions import advance_lineage, compute_ratios, find_stragglers, judge_straggler, segment_factors, step_time_drift, worker_slots
from .events import Kind
from .planning import on_this_machine
from .state import RunningGeneration

HISTORY = 5   # heartbeats per rank kept for the drift estimate (one per step)


class ManagerTelemetry:
    """The telemetry part of ``Manager`` (see the module docstring)."""

    def _poll_metrics(self, run: RunningGeneration | None) -> None:
        """New metrics rows into ``_last_step`` and, for ``run`` (None: only the last step), its step
        times and first step time; a morph waiting for that first step is closed and recorded."""
        rows = self.log.metrics(job_id=self.job_id, since_id=self._metric_cursor)
        for m in rows:
            self._metric_cursor = m["id"]
            step = m.get("step")
            if step is not None:
                self._last_step = int(step) if self._last_step is None else max(self._last_step, int(step))
                self._lineage = advance_lineage(self._lineage, m.get("generation"), int(step))[0]
            if run is not None and int(m.get("generation", -1)) == self.generation and \
                    isinstance(m.get("step_time_s"), (int, float)):
                self._step_times.append(float(m["step_time_s"]))
                del self._step_times[:-50]
                if isinstance(m.get("data_s"), (int, float)):
                    self._data_times.append(float(m["data_s"]))
                    del self._data_times[:-50]
            if run is not None and run.first_step_time is None and int(m.get("generation", -1)) == self.generation:
                run.first_step_time = float(m.get("wall_time") or m["time"])
                if self._pending is not None and self._pending.new is not None:
                    self._pending.close(run.first_step_time)
                    self._finish_morph()

    def _finish_morph(self) -> None:
        """Record the morph under way (if any) as a MORPH event and in ``morphs``."""
        rec = self._pending
        self._pending = None
        if rec is None:
            return
        self.morphs.append(rec)
        self.log.append(Kind.MORPH, job_id=self.job_id, host=rec.host, payload=rec.to_dict())


    def _collect_heartbeats(self, run: RunningGeneration) -> None:
        """New heartbeats of this generation into ``_history``: per rank, its compute (F+R+B)
        per micro-batch, one sample per step, the last ``HISTORY`` kept."""
        keep = max(HISTORY, self.options.straggler.beats if self.options.straggler else 0)
        for hb in self.log.heartbeats(job_id=self.job_id, since_id=self._hb_cursor):
            self._hb_cursor = hb.id
            if hb.time < run.started or hb.rank is None:
                continue
            if int((hb.payload or {}).get("generation", self.generation)) != self.generation:
                continue
            c = sum(x for x in (hb.fwd_s, hb.recompute_s, hb.bwd_s) if x is not None)
            if c > 0 and hb.step is not None and self._hb_last_step.get(hb.rank) != hb.step:
                self._hb_last_step[hb.rank] = hb.step  # one sample per step, not per beat
                self._history.setdefault(hb.rank, []).append(c)
                del self._history[hb.rank][:-keep]

    def _check_drift(self, run: RunningGeneration) -> None:
        """Honest estimates: when the step time has drifted from the prediction (``self.options.drift``),
        re-simulate the running plan with each rank's measured/calibrated compute ratio, say so
        in an ``estimate_drift`` event (again only when the step time then leaves the one measured
        at that event by the rule's threshold too), and plan later morphs from the calibration scaled by the
        measured stages. ``drift`` in the event is measured against the plan's prediction."""
        if run.row is None or run.plan is None or not run.predicted_stage_s:
            return
        # judged against the plan's prediction, then against the step time measured at the last
        # event: one event per change of conditions — not one per check when the re-simulated
        # estimate cannot explain the step (time outside the model: a slow dataset, overheads)
        if step_time_drift(self._step_times, run.estimate_s or run.row.time_s, self.options.drift) is None:
            return
        measured = statistics.median(self._step_times[-self.options.drift.steps:])
        drift = measured / run.row.time_s - 1.0
        P, D = run.job.parallel.P, run.job.parallel.D
        predicted = {r: run.predicted_stage_s[r % P] for r in range(P * D)}
        ratios = compute_ratios(self._history, predicted, last=HISTORY)
        recal_s = recal_eps = None
        factors: list[float] = []
        if ratios:
            typical = statistics.median(ratios.values())
            try:
                sim = run.plan.simulate(run.row, rank_scale=[ratios.get(r, typical) for r in range(P * D)],
                                        record_timeline=False)
                recal_s = float(sim.minibatch_time)
                recal_eps = run.job.parallel.global_batch / recal_s if recal_s > 0 else None
            except (ValueError, RuntimeError) as e:
                self.log.append(Kind.WARNING, job_id=self.job_id, payload={"message": f"no re-simulation: {e}"})
            base = run.profile
            if base is not None:
                factors = segment_factors(ratios, run.row.stages, P, len(base.segments))
                self._profile = base.scaled(factors)   # later morphs plan from what this job measured
        run.estimate_s = measured
        run.recalibrated_examples_per_s = recal_eps
        local = all(on_this_machine(h) for h in run.hosts)
        prof = run.profile
        self.log.append(Kind.ESTIMATE_DRIFT, job_id=self.job_id, payload={
            "generation": self.generation, "drift": round(drift, 4), "steps": self.options.drift.steps,
            "threshold": self.options.drift.threshold, "predicted_step_s": run.row.time_s,
            "measured_step_s": measured,
            "recalibrated_step_s": recal_s, "recalibrated_examples_per_s": recal_eps,
            "compute_ratio_by_stage": [round(statistics.median([v for r, v in ratios.items() if r % P == s]), 3)
                                       if any(r % P == s for r in ratios) else None for s in range(P)],
            "segment_factors": [round(f, 3) for f in factors],
            "calibrated_at": getattr(prof, "calibrated_at", None) or None,
            "calibrated_on": (getattr(prof, "hardware", None) or {}).get("device"),
            "load_1min": round(os.getloadavg()[0], 2) if local and hasattr(os, "getloadavg") else None,
            "cpu_count": os.cpu_count() if local else None, "workers_here": P * D if local else None})

    def _check_stragglers(self, run: RunningGeneration) -> None:
        """Judge the ranks whose compute stands out (``options.straggler``): exclude the slowest one's
        VM (a straggler morph) when the simulator says the job is faster without it; a STRAGGLER
        event either way."""
        if not run.predicted_stage_s:
            return
        P = run.job.parallel.P
        history = {r: xs[-self.options.straggler.beats:] for r, xs in self._history.items()}
        predicted = {r: run.predicted_stage_s[r % P] for r in range(P * run.job.parallel.D)}
        found = find_stragglers(history, predicted, self.options.straggler)
        rank_host = []
        for h in run.hosts:
            rank_host += [h.name] * worker_slots(h)
        for rank, slowdown in sorted(found.items(), key=lambda kv: -kv[1]):
            host = rank_host[rank] if rank < len(rank_host) else None
            if host is None or host in self._excluded:
                continue
            others = [h for h in self._usable_hosts() if h.name != host]
            try:
                alt = (self._replan(others, first=False, best_only=True, profile=run.profile)[2]
                       if others else None)   # (the running plan's calibration: the same yardstick)
                beats = self.options.straggler.beats
                # the wait for data the plan's times leave out: none where the calibration measured
                # the read (the simulator then models it, Profile.data_read_s), else what steps measure
                modelled = getattr(run.profile, "data_read_s", 0.0) > 0.0
                data_s = statistics.median(self._data_times[-beats:]) if self._data_times and not modelled else 0.0
                measured = statistics.median(self._step_times[-beats:]) if len(self._step_times) >= beats else None
                exclude, with_it, without = judge_straggler(run.plan, run.row, rank, slowdown, alt, data_s,
                                                            self.options.straggler.min_gain, measured)
            except (ConfigError, ValueError):
                continue
            self.log.append(Kind.STRAGGLER, job_id=self.job_id, host=host, rank=rank, payload={
                "rank": rank, "slowdown": slowdown, "action": "excluded" if exclude else "kept",
                "predicted_step_s_with": with_it, "predicted_step_s_without": without, "data_s": data_s,
                "measured_step_s": measured})
            if exclude:
                self._excluded.add(host)
                self._request_stop(run, "straggler", host)
                return
            self._history.pop(rank, None)  # judged and kept: judge again on fresh samples only


    def _backfill_metrics(self) -> None:
        """Steps the orphaned workers finished while no manager listened reached only rank 0's
        ``metrics.jsonl`` (when it is in this run folder): copy them into the event log, so
        the job's metrics have no hole."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        lineage = self._lineage
        added = 0
        with open(path) as f:
            for line in f:
                try:
                    m = json.loads(line)
                except ValueError:
                    continue  # a line torn by the kill
                step = m.get("step") if isinstance(m, dict) else None
                if not isinstance(step, int) or isinstance(step, bool):
                    continue
                lineage, new = advance_lineage(lineage, m.get("generation"), step)
                if new:
                    self.log.append_metric(step, m, job_id=self.job_id)
                    added += 1
        if added:
            self.log.append(Kind.METRICS_BACKFILLED, job_id=self.job_id,
                            payload={"steps": added, "source": str(path), "last_step": lineage[1]})

