"""The supervision loop of the morph manager: watching one running generation until it ends or
must end, and deciding what follows (paper §4.2, §4.6).

``_supervise(run)`` runs ``_watch`` — every 0.2 s, and at once on a message: the generation's
metrics, its result if it ended, one message from the manager's queue (``_on_message``: a user's
cancel, a provider's VM event, a host the heartbeats declared lost), the periodic checks
(``_periodic_checks``: grow onto free VMs, stragglers, the estimate's drift) and the stop
deadline — and then turns the outcome into the next step: ``_after_loss`` for a VM lost without
notice (stop the survivors, resume from the last complete checkpoint), ``_after_result`` for a
generation that ended (completed, stopped at a boundary for a morph or the user, lost, failed:
retried up to the failure budget unless the failure is deterministic). A ``KeyboardInterrupt`` (a
second Ctrl-C) kills the generation's workers at once and goes on up (``Manager._interrupted``
records the job STOPPED at its last complete checkpoint). It returns a terminal ``JobState``, or
None: plan and launch the next generation.

The rules themselves live in ``manager.decisions``; this module only applies them.
``ManagerSupervision`` is that part of ``Manager`` (a mixin: it uses the manager's ``options``,
``log``, ``job``, ``job_id``, ``generation``, budgets and fields set by ``Manager.__init__``,
``_set`` and the planning and telemetry parts).

Owns ``ManagerSupervision``. Imports ``config``, ``manager.events|results|state``; never torch,
never ``manager.manager``.
"""

from __future__ import annotations

import queue
import re
import time

from ..config import ConfigError
from .decisions import pool_slots
from .events import Kind
from .results import GenerationResult, GenerationStatus, explained, short_error
from .state import (CalibrationFailed, CancelRequested, HostChanged, JobState, ManagerMessage, MorphCause, MorphRecord,
                    RunningGeneration, WorkersLost, plan_summary)

POLL_S = 0.2          # the loop's period: how long it waits for a message before looking at the generation again
GROW_CHECK_S = 5.0    # how often free VMs are considered for a grow (besides on every VM added)


class ManagerSupervision:
    """The supervision part of ``Manager`` (see the module docstring)."""

    # ------------------------------------------------------------------------------- watching
    def _supervise(self, run: RunningGeneration) -> JobState | None:
        """Watch one generation; returns a terminal state, or None to start the next one."""
        try:
            res, lost = self._watch(run)
        except KeyboardInterrupt:   # a second Ctrl-C: kill the workers at once (then ``Manager._interrupted``)
            run.gen.stop(grace_s=1.0)
            raise
        if lost is not None:
            return self._after_loss(run, *lost)
        self._poll_metrics(run)
        return self._after_result(run, res)

    def _watch(self, run: RunningGeneration) -> tuple[GenerationResult | None, tuple[str, float] | None]:
        """Until the generation ends, or a VM it uses is lost without notice: ``(result, None)``, or
        ``(None, (host, when it was lost, Unix s))``. A generation killed after missing its stop
        deadline may leave no result (None)."""
        run.next_health_check = time.time() + 5 * self.options.heartbeat_interval_s
        run.next_grow_check = time.time() + GROW_CHECK_S
        while True:
            self._poll_metrics(run)
            res = run.gen.wait(timeout_s=0)
            if res is not None:
                return res, None
            try:   # waits here, so a message (a user's stop) is acted on at once, not after a wait
                msg = self._q.get(timeout=POLL_S)
            except queue.Empty:
                msg = None
            lost = self._on_message(run, msg) if msg is not None else None
            if lost is not None:
                return None, lost
            self._periodic_checks(run)
            if run.stopping is not None and time.time() > run.stop_deadline:
                return self._stop_timed_out(run), None

    def _on_message(self, run: RunningGeneration, msg: ManagerMessage) -> tuple[str, float] | None:
        """Act on one queue message; returns ``(host, when lost)`` when a VM the generation uses
        was lost without notice (a loss of the previous generation may still be queued when it
        ended on its own: only one seen since this generation was launched counts)."""
        used = {h.name for h in run.hosts}
        if isinstance(msg, CancelRequested):
            self._request_stop(run, "user", None)
        elif isinstance(msg, HostChanged):
            self._note_host_event(msg)
            ev = msg.event
            name = ev.host.name
            if ev.kind == "notice" and name in used:
                self._request_stop(run, "notice", name)
            elif ev.kind == "removed" and name in used and ev.time >= run.wall_started and \
                    not self._stopping_for_notice(run, name):
                return name, ev.time
            elif ev.kind == "added" and run.stopping is None:
                self._consider_grow(run)
        elif isinstance(msg, WorkersLost):
            ev = msg.event
            if ev.host in used and ev.time >= run.wall_started and not self._stopping_for_notice(run, ev.host):
                return ev.host, ev.time - float(ev.payload.get("detection_latency_s") or 0.0)
        return None

    def _periodic_checks(self, run: RunningGeneration) -> None:
        """While no stop is under way: a grow onto VMs that came back during a cooldown (every
        ``GROW_CHECK_S``), and every 2 heartbeat intervals the stragglers and the drift of the
        step time from the plan's estimate (from the heartbeats collected since)."""
        if run.stopping is not None:
            return
        now = time.time()
        if self.options.grow is not None and now >= run.next_grow_check:
            run.next_grow_check = now + GROW_CHECK_S
            self._consider_grow(run, quiet=True)
        if run.stopping is None and now >= run.next_health_check:
            run.next_health_check = now + 2 * self.options.heartbeat_interval_s
            self._collect_heartbeats(run)
            if self.options.straggler is not None:
                self._check_stragglers(run)
            if self.options.drift is not None:
                self._check_drift(run)

    def _stop_timed_out(self, run: RunningGeneration) -> GenerationResult | None:
        """The workers missed their stop deadline: kill them (the last complete checkpoint is
        used); the morph's cause becomes ``stop_timeout``. Returns the generation's result."""
        self.log.append(Kind.STOP_TIMEOUT, job_id=self.job_id,
                        payload={"generation": self.generation, "timeout_s": self.options.stop_timeout_s})
        run.stop_timed_out = True
        run.gen.stop(grace_s=2.0)
        res = run.gen.wait(timeout_s=10.0)
        if self._pending is not None:
            self._pending.cause = "stop_timeout"
        return res

    # ------------------------------------------------------------------------------- outcomes
    def _after_loss(self, run: RunningGeneration, host: str, at: float) -> JobState | None:
        """A VM of the generation was lost without notice at ``at`` (Unix s): stop the survivors
        (only a VM the provider no longer holds is skipped; a live one's workers are killed), keep
        the VM out of plans for a while, and resume from the last complete checkpoint."""
        held = {h.name for h in self._provider_hosts()}
        run.gen.stop(grace_s=2.0, gone=[host] if host not in held else [])
        self._suspect[host] = time.time()
        run.gen.wait(timeout_s=15.0)
        self._begin_morph("loss", host, run, at=at)
        self.preemptions += 1
        self._poll_metrics(run)
        if self.preemptions > self.options.max_preemptions:
            return self._fail(f"pre-emption budget spent ({self.options.max_preemptions})")
        self._set(JobState.RECOVERING, f"VM {host} lost without notice; resuming from the last complete checkpoint")
        return None

    def _after_result(self, run: RunningGeneration, res: GenerationResult | None) -> JobState | None:
        """The generation ended with ``res`` (None: killed without a result, counted as failed):
        SUCCEEDED, STOPPED by the user, or None to morph (a stop at a boundary, a loss, a failure
        within the budget); FAILED when a budget is spent or a failure is deterministic."""
        res = res if res is not None else GenerationResult(GenerationStatus.FAILED)
        status = res.status
        if status == GenerationStatus.COMPLETED:
            if self._pending is not None and self._pending.new is not None:
                self._finish_morph()  # e.g. orphans finished the job; downtime unknown (None)
            self._pending = None
            self._set(JobState.SUCCEEDED, f"finished {self.job.train.steps} steps")
            return self.state
        if status == GenerationStatus.STOPPED or (run.stopping is not None and status != GenerationStatus.FAILED):
            cause = run.stopping[0] if run.stopping else "notice"
            if cause == "user":
                self._pending = None
                if run.stop_timed_out:   # killed mid-step: what is kept is the last complete checkpoint
                    self._set(JobState.STOPPED, f"stopped by the user: the workers did not reach a mini-batch boundary "
                                                f"within {self.options.stop_timeout_s:.0f} s (a step stalled?) and were "
                                                f"killed; the last complete checkpoint holds {self._resume_step()} "
                                                "step(s), where the job continues")
                else:
                    self._set(JobState.STOPPED, "stopped by the user at a mini-batch boundary (checkpointed)")
                return self.state
            if cause == "notice":
                self.preemptions += 1
            return None
        gone = sorted(set(res.lost_hosts) & {h.name for h in run.hosts})
        if status == GenerationStatus.LOST or gone:
            for h in gone:
                self._suspect[h] = time.time()
            self.preemptions += 1
            self._begin_morph("loss", gone[0] if gone else None, run)
            if self.preemptions > self.options.max_preemptions:
                return self._fail(f"pre-emption budget spent ({self.options.max_preemptions})")
            self._set(JobState.RECOVERING, f"VM(s) {', '.join(gone) or '?'} lost; resuming from the last checkpoint")
            return None
        return self._after_failure(run, res)

    def _after_failure(self, run: RunningGeneration, res: GenerationResult) -> JobState | None:
        """A worker failed: FAILED when the failure is deterministic (the data, a programming
        error, a loss that stayed non-finite, the same error twice in a row) or the failure budget is spent; else retry from the
        last checkpoint (None)."""
        self.failures += 1
        detail, what = self._failure_detail(res)
        same, self._last_failure = what == self._last_failure, what
        if res.cause == "data":
            self._pending = None
            return self._fail(f"the data failed (not retried: the same step reads the same examples): {detail}")
        if res.cause == "code":
            self._pending = None
            return self._fail(f"the job's code raised a programming error (not retried: the same code fails the "
                              f"same way; fix it and launch again): {detail}")
        if res.cause == "diverged":
            self._pending = None
            return self._fail(f"training diverged (not retried: resuming replays the same steps from the same "
                              f"weights): {detail}")
        if same:
            self._pending = None
            return self._fail(f"the same worker error twice in a row (not retried again: it looks deterministic): "
                              f"{detail}")
        if self.failures > self.options.max_failures:
            self._pending = None
            return self._fail(f"worker failure (budget of {self.options.max_failures} retries spent): {detail}")
        self._begin_morph("failure", None, run)
        self._set(JobState.RECOVERING, f"worker failure, retry {self.failures}/{self.options.max_failures}: {what}")
        return None

    def _failure_detail(self, res: GenerationResult) -> tuple[str, str]:
        """``(detail, error)`` of a failed generation: ``error`` is the failed rank's own exception
        (``res.error``, as its worker reported it; else the last line of ``res.failure``) without its
        class's module path; ``detail`` says it first, then which rank and where every worker's output
        is (``varuna logs RUN``) — for one of the SDK's explained errors (``results.explained``)
        nothing more; for any other, that rank's traceback after it, ending with the exception line."""
        failure = (res.failure or "").strip()
        if res.error:
            what = short_error(res.error)
        else:
            said = failure.splitlines()[-1] if failure else f"generation ended with status {res.status}"
            what = re.sub(r"^(\[[^\]]*\]\s*)+:?\s*", "", said)   # the error, not which VM and rank said it
        if res.rank is None:
            lines = failure.splitlines()
            return ("\n".join([what] + lines[:-1]) if what and len(lines) > 1 else (failure or what)), what
        where = f"rank {res.rank} on {res.host}; every worker's output: `varuna logs {self.run_dir}`"
        if explained(res.error) or len(failure.splitlines()) <= 1:
            return f"{what} [{where}]", what
        return f"{what} [{where}]\n{failure}", what

    # ------------------------------------------------------------------------------- actions
    def _note_host_event(self, msg: HostChanged) -> None:
        """Keep a VM under notice out of plans; a VM added (again) is usable at once."""
        ev = msg.event
        if ev.kind == "notice":
            self._noticed[ev.host.name] = ev.deadline or time.time()
        elif ev.kind == "added":
            self._noticed.pop(ev.host.name, None)
            self._suspect.pop(ev.host.name, None)

    def _begin_morph(self, cause: MorphCause, host: str | None, run: RunningGeneration | None,
                     at: float | None = None) -> None:
        """Open a morph record (``_pending``) for ``cause`` seen at ``at`` (Unix s; None: now);
        an earlier morph that never reached a first step keeps its cause and time, and notes this
        one in its ``also``."""
        if self._pending is not None:
            seen = {"cause": cause, "host": host, "time": at or time.time()}
            if (cause, host) != (self._pending.cause, self._pending.host) and \
                    not any((a["cause"], a["host"]) == (cause, host) for a in self._pending.also):
                self._pending.also.append(seen)
            return
        old = plan_summary(run.job, run.hosts) if run is not None else {}
        self._pending = MorphRecord(time=at or time.time(), cause=cause, old=old, host=host, from_step=self._lineage[1])

    def _fail(self, why: str) -> JobState:
        """Record FAILED with ``why`` (also ``error``); returns the state."""
        self.error = why
        self._set(JobState.FAILED, why)
        return self.state

    def _request_stop(self, run: RunningGeneration, cause: MorphCause, host: str | None) -> None:
        """Ask the generation's workers to stop at the next mini-batch boundary (with a
        checkpoint), for ``cause`` (on ``host``); a second request while one is under way is
        ignored. Any cause but ``user`` begins a morph (state MORPHING)."""
        if run.stopping is not None:
            return
        run.stopping = (cause, host, time.time())
        run.stop_deadline = time.time() + self.options.stop_timeout_s
        self._begin_morph(cause, host, run)
        run.gen.request_stop(cause)
        if cause != "user":
            self._set(JobState.MORPHING, f"{cause}{' on ' + host if host else ''}: stopping at the next mini-batch boundary")

    def _stopping_for_notice(self, run: RunningGeneration, host: str) -> bool:
        """A VM under notice that leaves (or goes quiet) while its workers stop at a boundary
        is not a sudden loss: the generation's own result says whether the stop checkpoint was
        made (if not, it ends "lost" and the last complete checkpoint is used)."""
        return run.stopping is not None and host in self._noticed

    def _consider_grow(self, run: RunningGeneration, *, quiet: bool = False) -> None:
        """Grow onto free VMs when ``options.grow`` says the plan for the larger pool is worth a
        morph (a GROW_DECISION event; ``quiet``: only when it says grow)."""
        # not before the last morph's first step: a grow begun then would be folded into that
        # morph's record and go missing from the history (the periodic check grows a few s later)
        if self.options.grow is None or self._pending is not None:
            return
        hosts = self._usable_hosts()
        if pool_slots(hosts) <= run.job.parallel.P * run.job.parallel.D:
            return
        try:
            _, _, row, _ = self._replan(hosts, first=False, best_only=True)
        except (ConfigError, ValueError, CalibrationFailed):
            return
        since = time.time() - max(self._last_morph_time, run.started)
        if run.row is None:  # started without a calibration: plan the running configuration now
            try:
                self.profile()  # calibrate now (cached by the model's identity)
                _, run.plan, run.row, _ = self._replan(run.hosts, first=True, best_only=True)
            except (ConfigError, ValueError, CalibrationFailed):
                return
        # the running plan as the profile the new one was planned from predicts it (re-simulated
        # from heartbeats once the estimate drifted): the same yardstick for both
        current = run.recalibrated_examples_per_s or run.row.examples_per_s
        why = self.options.grow.why_not(current, row.examples_per_s, since,
                                        run.job.parallel.P * run.job.parallel.D, row.P * row.D)
        grow = why is None
        if quiet and not grow:
            return
        self.log.append(Kind.GROW_DECISION, job_id=self.job_id, payload={
            "current_examples_per_s": current, "new_examples_per_s": row.examples_per_s,
            "new": {"P": row.P, "D": row.D}, "min_gain": self.options.grow.min_gain, "seconds_since_last_morph": since,
            "decision": "grow" if grow else "stay", **({"why": why} if why else {})})
        if grow:
            self._request_stop(run, "grow", None)
