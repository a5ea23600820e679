"""Run folders as a team sees them: which jobs there are, how far each got, and what happened, in
sentences — for ``varuna status``, ``varuna logs``, ``varuna stop`` and the notebook's
``Job.list()``.

A **run folder** is where one job keeps its state: ``config.yaml`` (the job as it runs),
``events.db`` (the event log, ``manager.events``), ``gen<g>/workers.log`` (every worker's output
of generation g) and, once done, ``summary.json``. ``find_runs(path)`` is the run folder itself, or
the run folders directly inside ``path`` (a ``runs/`` parent), newest first (both, when a run folder
holds runs of its own). ``read_run`` turns one
into a ``RunInfo``: state and its reason, plan, steps done of the total, elapsed time, an ETA from
the recent step times, morphs, the last event. ``event_sentence`` says an event in words
(``morph_sentence`` a morph: which VM, what happened, the plan before and after and why, downtime
in its phases, steps lost and why; ``drift_sentence`` an estimate that no longer holds).

**Stopping from outside.** ``request_stop(run_dir)`` writes ``RUN_DIR/stop-request.json``
(atomically; who asked and when); the manager of that run polls ``stop_requested`` (every
``STOP_POLL_S``), removes it (``clear_stop``) and relays it to the workers at once (a signed
``stop`` on their heartbeat channel); they stop at the first mini-batch boundary after it reaches
them — the end of the step under way — with a checkpoint, as ``Job.stop()`` does.
``stopped_by`` says who asked for the stop that ended a run. Anyone who can write the run folder can stop the job — the same people who could
edit its checkpoints.

Imports ``config``, ``manager.events``, ``manager.billing``, ``manager.results`` and the standard library
(never torch).
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import TrainConfig
from .billing import BILLED_KINDS, Billing, cost_text
from .events import Event, EventLog, Kind
from .results import SENT_BEFORE, SENT_END

__all__ = ["LOCK_FILE", "OwnLogFilter", "RunBusy", "RunInfo", "STOP_FILE", "TERMINAL", "acquire_run_lock", "check_run_free", "clear_stop", "clip", "jobs_alive_beside",
           "drift_sentence", "event_sentence", "find_runs", "format_runs", "log_label", "log_tail", "morph_sentence",
           "orphans_ended", "read_run", "request_stop", "run_lock_holder", "stop_requested", "stopped_by", "watch_stop_requests", "worker_logs"]

STOP_FILE = "stop-request.json"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
RECENT_STEPS = 20   # the ETA uses the median step time of this many latest steps


@dataclass
class RunInfo:
    """One run folder, read at ``read_at`` (Unix s). ``state``: the manager's last state (PENDING
    before any); ``steps_done`` of ``steps_total`` (None: not known); ``elapsed_s`` from the first
    event to the last (ended) or to ``read_at``; ``eta_s``: steps left × the median time of the
    latest steps (None when ended or unknown); ``plan``: e.g. "P=2 x D=2 on vm0, vm1"; ``started``:
    the first event's time (Unix s); ``cost``: what its VMs cost so far (``billing.Billing.cost``:
    $ spent, $ on demand, $/h now; None when no price was given); ``drift``: the running plan's
    latest ``estimate_drift`` payload (its step time left the prediction), else None."""

    path: Path
    job_id: str | None
    name: str
    state: str
    reason: str
    steps_done: int
    steps_total: int | None
    elapsed_s: float
    eta_s: float | None
    plan: str
    morphs: list[dict] = field(default_factory=list)
    last_event: str = ""
    error: str | None = None
    started: float = 0.0
    read_at: float = 0.0
    cost: dict | None = None
    drift: dict | None = None
    manager: dict | None = None   # who runs it now (``run_lock_holder``); None: no live manager
    orphans: dict | None = None   # how its orphaned workers ended by themselves (see ``orphans_ended``)

    @property
    def orphaned(self) -> bool:
        """Its last state is an active one but no manager holds the run folder: the manager was
        killed or crashed (its workers stop by themselves; ``varuna launch`` continues the job)."""
        return self.active and self.manager is None

    @property
    def state_text(self) -> str:
        """``state``, marked when no manager is running the job although its state says so, or
        when the workers of a killed manager ended the job by themselves ("STOPPED (no manager)")."""
        return f"{self.state} (no manager)" if self.orphaned or self.orphans else self.state

    @property
    def cost_text(self) -> str:
        """``cost`` in words ("$1.20 spent · $0.92/h · saves 70% vs on-demand", "free (local)")."""
        return cost_text(self.cost)

    @property
    def percent(self) -> float | None:
        """Steps done as a percentage of the total (None: total unknown)."""
        return None if not self.steps_total else 100.0 * self.steps_done / self.steps_total

    @property
    def active(self) -> bool:
        """The job is not in a terminal state (it runs, or its manager died without saying so)."""
        return self.state not in TERMINAL


def find_runs(path: str | Path) -> list[Path]:
    """``path`` when it is a run folder (holds ``events.db``), followed by any run folders directly
    inside it (a folder of runs once given as a job's own run folder: its runs stay listed), else
    the run folders directly inside it; those inside newest first. Raises ``FileNotFoundError``
    naming ``path`` when it does not exist, ``NotADirectoryError`` when it is a file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{str(p)!r} does not exist; give a run folder (the --run-dir a job was launched "
                                "with, holding events.db) or the folder of runs (by default runs/ where you launched)")
    if not p.is_dir():
        raise NotADirectoryError(f"{str(p)!r} is a file, not a run folder nor a folder of runs; give the --run-dir a "
                                 "job was launched with, or the folder of runs")

    def mtime(d: Path) -> float:
        try:
            return (d / "events.db").stat().st_mtime
        except OSError:   # removed meanwhile
            return 0.0
    runs = sorted((d for d in p.iterdir() if d.is_dir() and (d / "events.db").is_file()), key=mtime, reverse=True)
    return [p, *runs] if (p / "events.db").is_file() else runs


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _plan_text(p: dict | None) -> str:
    if not p or p.get("P") is None:
        return "-"
    hosts = p.get("hosts") or []
    return f"P={p['P']} x D={p['D']}" + (f" on {', '.join(dict.fromkeys(hosts))}" if hosts else "")


_PHASE_WORDS = {"stop": "stop", "wait_for_vms": "wait for VMs", "replan": "re-plan", "start_workers": "start workers",
                "first_step": "resume + first step"}


def _choice_text(m: dict) -> str:
    """Why the new plan: what the planner predicted for the best candidates it compared."""
    cands = [c for c in (m.get("candidates") or []) if isinstance(c, dict)]
    if not cands:
        return ""
    try:
        listed = "; ".join(f"P={c['P']} x D={c['D']} {float(c['examples_per_s']):.1f} ex/s"
                           + (" (chosen)" if c.get("chosen") else "") for c in cands)
    except (KeyError, TypeError, ValueError):
        return ""
    n = m.get("feasible_plans") or len(cands)
    kept = m.get("kept") if isinstance(m.get("kept"), dict) else None
    if kept:   # the config fixed P and/or D: the plans compared are those that keep them
        fixed = " and ".join(f"parallel.{k}={v}" for k, v in kept.items())
        why = f"the config's {fixed} kept (null lets the planner choose), of {n} feasible plan(s) compared"
    elif cands[0].get("chosen"):
        why = f"the fastest predicted of {n} feasible plan(s)"
    else:
        why = f"kept as configured, of {n} feasible"
    return f" ({why}: {listed})"


def _plan_choice_text(p: dict) -> str:
    """How a PLAN event's plan compares with the others its table ranked (``rows``: feasible ones
    fastest first) and the pool's worker slots it leaves idle; "" where the payload has no table."""
    rows = [r for r in (p.get("rows") or []) if isinstance(r, dict) and r.get("feasible")]
    held = p.get("held") if isinstance(p.get("held"), dict) else {}
    # the table ranks one row per depth (its best D and micro-batch), under what the plan was held to
    within = (" (keeping " + ", ".join(f"{'micro-batch' if k == 'micro_batch_size' else k}={v}"
                                       for k, v in held.items()) + ")") if held else ""
    try:
        out = []
        if rows:
            mine = next((i for i, r in enumerate(rows) if (r["P"], r["D"], r["micro_batch_size"]) ==
                         (p.get("P"), p.get("D"), p.get("micro_batch_size"))), None)
            depths = f"{len(rows)} depth{'s' if len(rows) != 1 else ''} that fit{within}"
            if mine == 0:
                nxt = rows[1] if len(rows) > 1 else None
                out.append(f"the fastest predicted of the {depths}"
                           + (f"; the next, P={nxt['P']} x D={nxt['D']}, {float(nxt['examples_per_s']):.1f} ex/s against "
                              f"{float(rows[0]['examples_per_s']):.1f}" if nxt else ""))
            elif mine is not None:
                out.append(f"as the config fixes it; the fastest predicted of the {depths} is "
                           f"P={rows[0]['P']} x D={rows[0]['D']} at {float(rows[0]['examples_per_s']):.1f} ex/s "
                           f"against {float(rows[mine]['examples_per_s']):.1f}")
        pool, used = p.get("pool_gpus"), p.get("gpus")
        if isinstance(pool, int) and isinstance(used, int) and pool > used:
            out.append(f"{pool - used} of the pool's {pool} worker slots left idle")
    except (KeyError, TypeError, ValueError):
        return ""
    return f" ({'; '.join(out)})" if out else ""


def _downtime_text(m: dict) -> str:
    if m.get("downtime_s") is None:
        return ""
    phases = m.get("phases_s") or {}
    parts = [f"{_PHASE_WORDS.get(k, k)} {float(v):.1f} s" for k, v in phases.items()
             if isinstance(v, (int, float)) and v >= 0.05]
    return f", {m['downtime_s']:.1f} s down" + (f" ({', '.join(parts)})" if parts else "")


def morph_sentence(m: dict, t0: float | None = None) -> str:
    """One morph in words: when, which VM and what happened, the plan before and after with what
    the planner predicted for the best candidates and why this one, the downtime split into its
    phases (``manager.MORPH_PHASES``), steps lost and why (the checkpoint it resumed from).
    ``m``: a ``MorphRecord.to_dict()`` (the MORPH event's payload); ``t0``: the job's start (Unix
    s) to say when, relative. Missing or malformed fields are left out, never raised."""
    what = _CAUSE_WORDS.get(m.get("cause", ""), m.get("cause", "changed"))
    who = f"VM {m['host']}" if m.get("host") else "the job"
    if m.get("cause") == "grow" and not m.get("host"):
        who, what = "VMs", "were free again"
    if m.get("cause") == "manager_restart":
        who = "the job"
    when = f"at {m['time'] - t0:.0f} s: " if t0 is not None and m.get("time") else ""
    new = m.get("new")
    moved = (f"re-planned {_plan_text(m.get('old'))} -> {_plan_text(new)}{_choice_text(m)}" if new
             else "re-planning")
    lost = m.get("steps_lost") or 0
    resume = m.get("resume_step")
    if lost:
        why = f"{lost} step(s) redone: resumed from the checkpoint of step {resume}"
    elif resume is not None and new:
        why = f"nothing lost: resumed at step {resume}"
    else:
        why = ""
    return f"{when}{who} {what}; {moved}{_downtime_text(m)}" + (f"; {why}" if why else "") + _also_text(m)


_CAUSE_WORDS = {"notice": "got a pre-emption notice", "loss": "was lost without notice", "grow": "came back",
                "straggler": "was a straggler", "failure": "had a worker fail",
                "stop_timeout": "did not stop when asked", "manager_restart": "had its manager restarted"}


def _also_text(m: dict) -> str:
    """The causes folded into the morph while it was under way (``MorphRecord.also``), in words."""
    parts = [f"{'VM ' + a['host'] if a.get('host') else 'the job'} "
             f"{_CAUSE_WORDS.get(a.get('cause', ''), a.get('cause', 'changed'))}"
             for a in m.get("also") or [] if isinstance(a, dict)]
    return f"; meanwhile {', '.join(parts)} (folded into this morph)" if parts else ""


def _ago(s: float) -> str:
    return _fmt_s(s).replace(" s", " seconds") + " ago" if s < 90 else f"{_fmt_s(s)} ago"


def drift_sentence(p: dict, now: float | None = None) -> str:
    """An ``estimate_drift`` payload in words: how far the step time left the prediction, why it
    may have (when the calibration was made, the machine's load then against its cores), and the
    estimate re-simulated from the job's heartbeats. Malformed fields are left out."""
    now = time.time() if now is None else now

    def num(k):
        v = p.get(k)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    drift, pred, meas = num("drift"), num("predicted_step_s"), num("measured_step_s")
    if drift is None:
        return "the step time left the prediction"
    side = "slower" if drift > 0 else "faster"
    head = (f"measured step {meas:.3f} s is {abs(drift):.0%} {side} than predicted {pred:.3f} s"
            if meas is not None and pred is not None else f"steps run {abs(drift):.0%} {side} than predicted")
    head += f" for {int(p['steps'])} steps" if isinstance(p.get("steps"), int) else ""
    why = []
    at = num("calibrated_at")
    if at:
        why.append(f"calibrated {_ago(now - at)}" + (f" on {p['calibrated_on']}" if p.get("calibrated_on") else ""))
    load, cores, here = num("load_1min"), num("cpu_count"), num("workers_here")
    if load is not None and cores:
        busy = "busier than its cores" if load > cores else "within its cores"
        why.append(f"this machine's load was {load:.1f} on {cores:.0f} cores with {here:.0f} workers ({busy}: "
                   "other processes contend for them)" if here else f"load was {load:.1f} on {cores:.0f} cores ({busy})")
    elif drift > 0:
        why.append("contention on the VMs, a slower network or other hardware than calibrated")
    recal, eps = num("recalibrated_step_s"), num("recalibrated_examples_per_s")
    tail = (f"; re-calibrated from the job's heartbeats: {recal:.3f} s per step"
            + (f" ({eps:.1f} examples/s)" if eps else "") + ", which later morphs plan from") if recal else ""
    return head + (f" — {'; '.join(why)}" if why else "") + tail


def _first_line(reason) -> str:
    """A state's reason as one line: a failure's traceback (the lines after its first) is left to
    ``varuna status`` and the workers' log."""
    lines = str(reason or "").strip().splitlines()
    return lines[0] + (f" (+ a traceback of {len(lines) - 1} lines: `varuna status`)" if len(lines) > 1 else "") \
        if lines else ""


def event_sentence(e: Event, t0: float | None = None) -> str:
    """An event of the log in words (the kinds a user cares about; others as ``kind: payload``)."""
    p, k = e.payload, e.kind
    at = f"{e.time - t0:7.1f} s  " if t0 is not None else ""
    vm = e.host or "?"
    text = {
        Kind.JOB_STATE: lambda: f"job {p.get('state')}: {_first_line(p.get('reason'))}".rstrip(": "),
        Kind.PLAN: lambda: (f"plan for generation {p.get('generation')}: {_plan_text(p)}, micro-batch "
                            f"{p.get('micro_batch_size')} x {p.get('num_micro_batches')}"
                            + (f", predicted {p['predicted_step_s']:.3f} s per step" if isinstance(
                                p.get("predicted_step_s"), (int, float)) else "")
                            + (f" ({p['data_wait_s']:.3f} s of it waiting for data)" if isinstance(
                                p.get("data_wait_s"), (int, float)) and p["data_wait_s"] > 0 else "")
                            + _plan_choice_text(p)),
        Kind.MORPH: lambda: "morph: " + morph_sentence(p),
        Kind.ESTIMATE_DRIFT: lambda: "estimate: " + drift_sentence(p, e.time),
        Kind.HOST_ADDED: lambda: f"VM {vm} joined the pool",
        Kind.HOST_REMOVED: lambda: f"VM {vm} left the pool",
        Kind.PREEMPTION_NOTICE: lambda: f"VM {vm} will be pre-empted in {p.get('lead_s', '?')} s",
        Kind.HOST_LOST: lambda: f"VM {vm} lost ({p.get('reason', '?')})",
        Kind.WORKER_FAILED: lambda: (f"rank {e.rank} on {vm} failed: {str(p.get('error') or '?').splitlines()[-1][:300]}"
                                     if p.get("cause") != "peer" else
                                     f"rank {e.rank} on {vm} stopped: a peer failed first (its collective failed)"),
        Kind.CHECKPOINT: lambda: f"checkpoint after step {p.get('step')} published",
        Kind.WORKER_JOINED: lambda: f"rank {e.rank} on {vm} joined (pid {p.get('pid', '?')})",
        Kind.WORKER_FINISHED: lambda: f"rank {e.rank} on {vm} finished ({p.get('status')}, {_steps_done(p)})",
        Kind.WORKER_EXITED: lambda: f"rank {e.rank} on {vm} exited with code {p.get('exit_code')}",
        Kind.HEARTBEAT_SERVER_STARTED: lambda: f"heartbeat server listening on {p.get('address')}",
        Kind.GENERATION_STARTED: lambda: (f"generation {p.get('generation')} started: P={p.get('P')} x D={p.get('D')} on "
                                          f"{', '.join(p.get('hosts') or [])}"),
        Kind.GENERATION_ENDED: lambda: (f"generation {p.get('generation')} ended: {p.get('status')} after "
                                        f"{p.get('seconds', 0):.0f} s, {_steps_done(p)}"),
        Kind.CALIBRATION_STARTED: lambda: str(p.get("message") or "calibrating the model"),
        Kind.GROW_DECISION: lambda: (f"VMs free: a plan on them would run {_num(p.get('new_examples_per_s'))} examples/s "
                                     f"against {_num(p.get('current_examples_per_s'))} now: "
                                     + ("grow" if p.get("decision") == "grow" else
                                        f"stay ({p['why']})" if p.get("why") else   # (older logs: no why)
                                        f"stay (gain below {_num(p.get('min_gain'))}x or in the cooldown)")),
        Kind.WARNING: lambda: f"warning: {p.get('message')}",
        Kind.HEARTBEAT_SERVER_STOPPED: lambda: "heartbeat server stopped",
        Kind.STOP_REQUESTED: lambda: f"workers asked to stop at the next mini-batch boundary ({p.get('reason')})",
        Kind.STOP_REQUEST_RECEIVED: lambda: f"asked to stop from outside ({p.get('by')})",
        Kind.STRAGGLER: lambda: (f"rank {p.get('rank')} runs {p.get('slowdown', 0):.1f}x slower than its peers: "
                                 f"{p.get('action')}"),
    }.get(k)
    if text is None:
        return f"{at}{k}" + (f" ({vm})" if e.host else "") + (f": {_brief(p)}" if p else "")
    try:
        return at + text()
    except (KeyError, TypeError, ValueError, IndexError):
        return f"{at}{k}: {_brief(p)}"


def _steps_done(p: dict) -> str:
    """A worker's or generation's ``last_step`` (0-based) as the console counts: steps done."""
    last = p.get("last_step")
    return f"{last + 1} step(s) done" if isinstance(last, int) else "no step done"


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _brief(p: dict, n: int = 200) -> str:
    """A payload as ``key=value`` pairs, numbers to 4 significant digits, cut to ``n`` characters."""
    def show(v):
        if isinstance(v, float):
            return _num(v)
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {show(x)}" for k, x in list(v.items())[:4]) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(show(x) for x in v[:4]) + (", ..." if len(v) > 4 else "") + "]"
        return str(v)
    return clip(", ".join(f"{k}={show(v)}" for k, v in p.items()), n)


def _steps_total(run: Path) -> int | None:
    """``train.steps`` of the run's ``config.yaml`` (the default when it names none); None without a
    readable one. Read with a plain YAML load, cached per file version: the jobs page reads every
    run folder each refresh, and a full ``JobConfig`` validation costs ~50 ms."""
    cfg = run / "config.yaml"
    try:
        st = cfg.stat()
    except OSError:
        return None
    return _steps_of(str(cfg), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1024)
def _steps_of(path: str, _mtime_ns: int, _size: int) -> int | None:
    import yaml

    try:
        with open(path) as f:
            d = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    train = d.get("train") if isinstance(d, dict) else None
    steps = train.get("steps") if isinstance(train, dict) else None
    if steps is None and isinstance(d, dict):
        return int(TrainConfig().steps)
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0 else None


def read_run(path: str | Path, now: float | None = None) -> RunInfo:
    """The ``RunInfo`` of the run folder ``path`` (see the class). Raises ``FileNotFoundError``
    when it holds no ``events.db``."""
    run = Path(path)
    db = run / "events.db"
    if not db.is_file():
        raise FileNotFoundError(f"{str(run)!r} holds no events.db: not a run folder (see `varuna status` on its parent)")
    now = time.time() if now is None else now
    with EventLog.reader(db) as log:
        states = log.events(kind=Kind.JOB_STATE, last=1)
        plans = log.events(kind=Kind.PLAN, last=1)   # (a plan's payload holds its ranked table and timeline)
        morphs = [e.payload for e in log.events(kind=Kind.MORPH)]
        first = log.events(limit=1)
        last = log.events(not_kind=(Kind.AUTH_FAILED, Kind.AUTH_FAILED_SUPPRESSED, Kind.HEARTBEAT_SERVER_STARTED), last=1)
        metrics = _latest_metrics(log)
        billing = Billing.of(log.events(kind=BILLED_KINDS))
        drifts = log.events(kind=Kind.ESTIMATE_DRIFT, last=1)
        gens = log.events(kind=(Kind.GENERATION_STARTED, Kind.GENERATION_ENDED), last=1)
    state = states[-1].payload.get("state", "PENDING") if states else "PENDING"
    reason = states[-1].payload.get("reason", "") if states else ""
    job_id = next((e.job_id for e in states + first if e.job_id), None)
    start = first[0].time if first else (db.stat().st_mtime)
    end = states[-1].time if states and state in TERMINAL else now
    total = _steps_total(run)
    done = max((m["step"] for m in metrics), default=-1) + 1
    manager = run_lock_holder(run)
    orphans = None
    if state not in TERMINAL and manager is None:   # orphaned workers train on, unheard: their own rows
        done = max(done, _last_step_written(run) + 1)
        orphans = orphans_ended(run, gens[-1] if gens else None)
    if orphans is not None:   # ... and have ended by themselves: the job is no longer running
        done = max(done, orphans["step"])
        state, reason, end = _orphans_state(run, orphans)
        last = []
    times = [m["step_time_s"] for m in metrics if isinstance(m.get("step_time_s"), (int, float))]
    eta = None
    if state not in TERMINAL and total is not None and times:
        eta = max(0, total - done) * statistics.median(times)
    return RunInfo(path=run, job_id=job_id, name=run.name, state=state, reason=reason, steps_done=done,
                   steps_total=total, elapsed_s=max(0.0, end - start), eta_s=eta,
                   plan=_plan_text(plans[-1].payload) if plans else "-", morphs=morphs,
                   last_event=event_sentence(last[0]) if last else (reason.split(";")[0] if orphans else ""),
                   error=reason if state == "FAILED" else None, started=start, read_at=now,
                   cost=billing.cost(end), manager=manager, orphans=orphans,
                   drift=drifts[-1].payload if drifts and plans and drifts[-1].payload.get("generation") ==
                   plans[-1].payload.get("generation") else None)


def orphans_ended(run: str | Path, generation_mark: Event | None) -> dict | None:
    """How the workers of a run whose manager died ended by themselves, read from the run's
    ``outcome.json`` (rank 0 writes it when it returns: stopped at a boundary with a checkpoint
    once it lost the manager for ``orphan_after_s``, or all steps done): ``{"status": "stopped" |
    "completed", "step": steps done, "checkpoint": its name or None, "generation", "time": when it
    was written (Unix s)}``. None while they may still run: no outcome of the generation the
    manager last started (``generation_mark``, its latest ``generation_started`` or
    ``generation_ended`` event: None or an ended one is no running generation), or an older one."""
    if generation_mark is None or generation_mark.kind != Kind.GENERATION_STARTED:
        return None
    path = Path(run) / "outcome.json"
    try:
        written = path.stat().st_mtime
        d = json.loads(path.read_text()[:65536])
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("status") not in ("stopped", "completed"):
        return None
    g, step = d.get("generation"), d.get("step")
    if g != generation_mark.payload.get("generation") or written < generation_mark.time - 1.0 \
            or not isinstance(step, int) or isinstance(step, bool):
        return None   # an earlier generation's outcome (one that ended before the manager last started one)
    ckpt = d.get("checkpoint")
    return {"status": d["status"], "step": step, "checkpoint": ckpt if isinstance(ckpt, str) else None,
            "generation": g, "time": written}


def _orphans_state(run: Path, orphans: dict) -> tuple[str, str, float]:
    """(state, reason, end time) of a run whose orphaned workers ended by themselves
    (``orphans_ended``): STOPPED with the step, the checkpoint and the command that continues the
    job, or SUCCEEDED when they did every step."""
    if orphans["status"] == "completed":
        return ("SUCCEEDED", f"its workers did all {orphans['step']} steps by themselves after the manager was "
                "gone (killed or crashed)", orphans["time"])
    ckpt = f" ({orphans['checkpoint']})" if orphans.get("checkpoint") else ""
    return ("STOPPED", f"its workers stopped by themselves after step {orphans['step']} with a checkpoint{ckpt}, "
            f"the manager gone (killed or crashed); `varuna launch {run / 'config.yaml'} --run-dir {run}` "
            "(or `varuna train` with the same arguments) continues the job from it", orphans["time"])


def _last_step_written(run: Path, tail_bytes: int = 8192) -> int:
    """The step of the last whole row of the run's newest ``metrics.jsonl`` (rank 0 writes it
    itself, heard by a manager or not); -1 when there is none. Reads the file's tail only."""
    path = run / "metrics.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - tail_bytes))
            lines = fh.read().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return -1


def _latest_metrics(log: EventLog) -> list[dict]:
    """The latest ``RECENT_STEPS`` metrics rows (by id) that name their step, oldest first."""
    return [m for m in log.metrics(last=RECENT_STEPS) if isinstance(m.get("step"), int)]


def clip(text: str, n: int) -> str:
    """``text`` cut at a word boundary to at most ``n`` characters, with an ellipsis when cut."""
    return text if len(text) <= n else text[: n - 1].rsplit(" ", 1)[0] + " …"


def format_runs(runs: list[RunInfo]) -> str:
    """The jobs table: name, state, plan, step/total (%), elapsed, ETA, cost so far (and the saving
    against on demand; * = example prices), morphs, last event."""
    head = ("job", "state", "plan", "step", "elapsed", "ETA", "cost", "morphs", "last event")
    rows = [head]
    for r in runs:
        step = f"{r.steps_done}/{r.steps_total if r.steps_total is not None else '?'}"
        if r.percent is not None:
            step += f" ({r.percent:.0f} %)"
        rows.append((r.name, r.state_text, r.plan, step, _fmt_s(r.elapsed_s), _fmt_s(r.eta_s), cost_text(r.cost, short=True),
                     str(len(r.morphs)),
                     clip(r.last_event, 70)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    return "\n".join(lines)


def worker_logs(run: str | Path) -> list[Path]:
    """The workers' output files of every generation, in generation order: ``gen<g>/workers.log``
    (as their manager received it), followed by what each worker of that generation wrote itself
    once no manager read its output (``gen<g>/worker-<rank>.log``, by rank: after the manager was
    killed, until the workers stopped by themselves); then the ``worker-<rank>.log`` files that
    workers of earlier versions wrote in the run folder itself."""
    def rank(f: Path) -> tuple:
        r = f.stem[len("worker-"):]
        return (0, int(r), "") if r.isdigit() else (1, 0, r)

    gens = sorted((d for d in Path(run).glob("gen*") if d.is_dir() and d.name[3:].isdigit()), key=lambda d: int(d.name[3:]))
    out = []
    for d in gens:
        if (d / "workers.log").is_file():
            out.append(d / "workers.log")
        out += sorted((f for f in d.glob("worker-*.log") if f.is_file()), key=rank)
    return out + sorted((f for f in Path(run).glob("worker-*.log") if f.is_file()), key=rank)


class OwnLogFilter:
    """Which lines of a worker's own log (``gen<g>/worker-<rank>.log``) ``varuna logs`` shows: all,
    except, in the block of lines the worker replays from what it last sent its dying manager
    (between ``results.SENT_BEFORE`` and ``SENT_END``, themselves hidden), those the generation's
    ``workers.log`` already holds for that rank (the manager saved them before it died). Feed it the
    file's lines in order (``keep``)."""

    def __init__(self, path: str | Path, tail_bytes: int = 1 << 18):
        self.path, self.tail_bytes = Path(path), tail_bytes
        self.in_replay = False
        self._saved: set[str] | None = None

    def keep(self, line: str) -> bool:
        """Whether to show ``line`` (without its newline)."""
        if line == SENT_BEFORE:
            self.in_replay = True
            return False
        if line == SENT_END:
            self.in_replay = False
            return False
        return not (self.in_replay and line in self.saved())

    def saved(self) -> set[str]:
        """This rank's lines in the last ``tail_bytes`` of the generation's ``workers.log``, without
        the manager's ``[host rank r] `` prefix (read once)."""
        if self._saved is None:
            rank = self.path.stem[len("worker-"):]
            mark = f" rank {rank}] "
            text = log_tail(self.path.parent / "workers.log", self.tail_bytes)
            self._saved = {ln.split(mark, 1)[1] for ln in text.splitlines() if ln.startswith("[") and mark in ln}
        return self._saved


def log_label(path: Path) -> str:
    """How a file of ``worker_logs`` is named to people: ``gen3``; ``gen3 rank 1, after the manager
    was gone`` (a worker's own file); ``worker-1.log`` (one in the run folder itself)."""
    if path.name == "workers.log":
        return path.parent.name
    gen = path.parent.name
    if gen.startswith("gen") and gen[3:].isdigit():
        return f"{gen} rank {path.stem[len('worker-'):]}, after the manager was gone"
    return path.name


def log_tail(path: str | Path, max_bytes: int = 64 * 1024) -> str:
    """The last whole lines of a log file within ``max_bytes`` (bytes that are not UTF-8 shown as
    U+FFFD); "" for a missing file. For the dashboard's log view: a long run's log is never read whole."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            chunk = f.read()
    except OSError:
        return ""
    if size > max_bytes:   # the first line is cut: drop it
        chunk = chunk[chunk.find(b"\n") + 1:]
    return chunk.decode("utf-8", "replace")


# ------------------------------------------------------------------------------ the run lock
LOCK_FILE = "manager.lock"


class RunBusy(RuntimeError):
    """Another manager runs this run folder now (its lock is held)."""


def acquire_run_lock(run_dir: str | Path) -> int:
    """Take the run folder's manager lock (``RUN_DIR/manager.lock``, an exclusive ``flock``) and
    write who holds it (pid, host, since); returns the open descriptor — close it to release. The
    kernel releases it when the process ends however it ends (kill -9 included), so a crashed
    manager never blocks the next launch; workers do not inherit it. Raises ``RunBusy`` naming the
    holder when another manager (another process, or another job object here) runs the folder."""
    import fcntl
    import socket

    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunBusy(_busy(run_dir, run_lock_holder(run_dir) or {})) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
    return fd


def _busy(run_dir: str | Path, who: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(who["since"])) if isinstance(
        who.get("since"), (int, float)) else "?"
    return (f"run folder {str(run_dir)!r} is being run by another manager (pid {who.get('pid', '?')} on "
            f"{who.get('host', '?')}, since {since}): `varuna status {run_dir}` shows it, `varuna stop {run_dir}` "
            "stops it; to run this config as another job, give another --run-dir")


def check_run_free(run_dir: str | Path) -> None:
    """Raise ``RunBusy`` (as ``acquire_run_lock`` would) when a live manager runs ``run_dir`` —
    a cheap check before a launch does any work."""
    who = run_lock_holder(run_dir)
    if who is not None:
        raise RunBusy(_busy(run_dir, who))


def jobs_alive_beside(run_dir: str | Path):
    """``job_alive(job_id) -> bool`` for a cloud provider's reaping (``cluster.aws``): a job of
    this owner is alive while a live manager holds its run folder, ``run_dir``'s sibling named
    after the job id (the CLI names jobs after their run folders). A finished, failed, killed or
    unknown job is not alive: its instances may be terminated."""
    parent = Path(run_dir).parent

    def job_alive(job_id: str) -> bool:
        return run_lock_holder(parent / job_id) is not None
    return job_alive


def run_lock_holder(run_dir: str | Path) -> dict | None:
    """Who holds the run folder's manager lock now (``{"pid", "host", "since"}``), or None when no
    live manager does (never started, finished, or killed). Never takes the lock for long."""
    import fcntl

    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                d = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                d = {}
            return d if isinstance(d, dict) else {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ stop requests
def request_stop(run_dir: str | Path, by: str = "varuna stop") -> Path:
    """Ask the manager of ``run_dir`` to stop the job at the next mini-batch boundary with a
    checkpoint; returns the request file. Raises ``FileNotFoundError`` for a folder that is not a
    run folder."""
    run = Path(run_dir)
    if not (run / "events.db").is_file():
        raise FileNotFoundError(f"{str(run)!r} holds no events.db: not a run folder")
    fd, tmp = tempfile.mkstemp(prefix=".stop-", dir=run)
    with os.fdopen(fd, "w") as f:
        json.dump({"by": by, "time": time.time(), "pid": os.getpid()}, f)
    os.replace(tmp, run / STOP_FILE)
    return run / STOP_FILE


def stopped_by(run_dir: str | Path) -> str | None:
    """Who asked for the stop that ended the run's latest launch (the last STOPPED state): the
    ``by`` of the first stop request received since the previous one — ``"SIGINT"``, ``"SIGTERM"``
    (``runner.stop_on_signals``), ``"varuna stop"`` (``request_stop``) — or None (not recorded)."""
    with EventLog.reader(Path(run_dir) / "events.db") as log:
        evs = log.events(kind=(Kind.JOB_STATE, Kind.STOP_REQUEST_RECEIVED))
    first = found = None
    for e in evs:
        if e.kind == Kind.STOP_REQUEST_RECEIVED and first is None:
            first = str(e.payload.get("by") or "?")
        elif e.kind == Kind.JOB_STATE and e.payload.get("state") == "STOPPED":
            found, first = first, None
    return found


def stop_requested(run_dir: str | Path) -> dict | None:
    """The pending stop request of ``run_dir`` (who and when), or None."""
    p = Path(run_dir) / STOP_FILE
    try:
        data = json.loads(p.read_text()[:4096])
    except (OSError, ValueError):
        return {"by": "?", "time": p.stat().st_mtime} if p.exists() else None
    return data if isinstance(data, dict) else {"by": "?"}


def clear_stop(run_dir: str | Path) -> None:
    """Remove the stop request (the manager, once it acted on it, or a new launch)."""
    try:
        (Path(run_dir) / STOP_FILE).unlink()
    except FileNotFoundError:
        pass


STOP_POLL_S = 0.1   # how often a manager looks for a stop request: a small part of a step (one failed open)


def watch_stop_requests(run_dir: str | Path, on_request, done, interval_s: float = STOP_POLL_S):
    """Start a daemon thread that calls ``on_request(request)`` once for each stop request of
    ``run_dir`` (removing it first) until the ``threading.Event`` ``done`` is set; returns it.
    ``interval_s``: how often it looks (``STOP_POLL_S``: a request reaches the workers well within
    a step, so they stop at the boundary that ends the step under way when it was made)."""
    import threading

    def loop() -> None:
        while not done.wait(interval_s):
            req = stop_requested(run_dir)
            if req is not None:
                clear_stop(run_dir)
                on_request(req)

    t = threading.Thread(target=loop, name="varuna-stop-requests", daemon=True)
    t.start()
    return t


#: the events ``Narrator`` says as they happen: what the console of ``varuna launch``/``train`` shows
NARRATED = (Kind.CALIBRATION_STARTED, Kind.PLAN, Kind.PREEMPTION_NOTICE, Kind.HOST_LOST, Kind.MORPH,
            Kind.ESTIMATE_DRIFT)


class Narrator:
    """Says a run's events of ``kinds`` (default ``NARRATED``) in words (``event_sentence``) as the
    manager appends them: a daemon thread reading ``RUN_DIR/events.db`` every ``poll_s`` seconds
    and calling ``say(sentence)`` for each new one (events already in the log when it started are
    not said: a continued run says what this run does). A read that fails (the log not written yet)
    is tried again at the next poll. Use as a context manager; leaving it says what is left, then
    stops the thread."""

    def __init__(self, run_dir: str | Path, say, kinds=NARRATED, poll_s: float = 0.5):
        import threading

        self.path, self.say, self.kinds, self.poll_s = Path(run_dir) / "events.db", say, tuple(kinds), poll_s
        self._cursor: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="varuna-narrator", daemon=True)

    def __enter__(self) -> "Narrator":
        self._read()   # the cursor: the log's newest event now
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._read()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._read()

    def _read(self) -> None:
        if not self.path.is_file():
            if self._cursor is None:
                self._cursor = 0   # a new run: everything it writes is new
            return
        try:
            with EventLog.reader(self.path) as log:
                if self._cursor is None:
                    last = log.events(last=1)
                    self._cursor = last[-1].id if last else 0
                    return
                evs = log.events(kind=self.kinds, since_id=self._cursor)
        except Exception:  # noqa: BLE001 - a log being created or locked: the next poll reads it
            return
        for e in evs:
            self._cursor = e.id
            try:
                self.say(f"[varuna] {event_sentence(e)}")
            except Exception:  # noqa: BLE001 - a closed console must not stop the job
                pass
