"""Views of the dashboard that are plain HTML of the store: the job header (state, progress,
ETA, cost), the VM pool and the estimate-drift warning. Pure functions of a ``TelemetryStore``
(no Panel objects, no session): ``app.Dashboard`` puts what they return on the page.

Imports numpy, ``dashboard.store``/``format``/``theme`` and ``varuna_sdk.manager``'s read-only
helpers (billing, decisions, runs: words for costs and drift); must never import torch or any
part of ``varuna_sdk`` that drives a job.
"""

from __future__ import annotations

import math
import time

import numpy as np

from varuna_sdk.manager.billing import cost_text
from varuna_sdk.manager.decisions import DriftRule, step_time_drift
from varuna_sdk.manager.runs import drift_sentence

from .format import clock, duration, esc, finite, num, progress_text
from .store import VM_STATES, TelemetryStore
from .theme import STATE_COLORS, STATUS_COLORS

DRIFT_RULE = DriftRule()   # the manager's default: 15 % off the prediction for 5 steps


def header_html(st: TelemetryStore, title: str, steps_total: int | None) -> str:
    """The job's header: name and job id, state badge (since when, why), and the tiles: step of
    ``steps_total``, elapsed, ETA, loss, examples/s, tokens/s, model, plan, VMs up, cost, last
    step (UTC). HTML; never raises on a malformed log."""
    js = st.job_state.payload if st.job_state else {}
    state = str(js.get("state") or ("RUNNING" if len(st.metrics) else "WAITING"))
    color = STATE_COLORS.get(state.upper(), "#455A64")
    n = len(st.metrics)
    last = lambda c: st.metrics[c][-1] if n else math.nan  # noqa: E731
    counts = st.vm_counts()
    plan = st.plan
    job_id = next((e.job_id for e in (st.plans or list(st.recent)) if e.job_id), None)
    since = f" since {clock(st.job_state.time)} UTC" if st.job_state else ""
    reason = str(js.get("reason") or "")
    done = int(last("step")) + 1 if n and finite(last("step")) else 0
    ended = state.upper() in ("SUCCEEDED", "FAILED", "STOPPED")
    tiles = [("step", progress_text(done, steps_total)), ("elapsed", duration(elapsed_s(st, ended))),
             ("ETA", "–" if ended else duration(eta_s(st, steps_total, done))), ("loss", num(last("loss"), "{:.4f}")),
             ("examples/s", num(last("examples_per_s"), "{:,.1f}")),
             ("tokens/s", num(last("tokens_per_s"), "{:,.0f}")),
             ("model", str((plan or {}).get("labels", {}).get("model") or "–")),
             ("plan", (f"P={plan.get('P')} × D={plan.get('D')} · gen {plan.get('generation', '?')}"
                       if plan else "–")),
             ("VMs up", f"{counts['up'] + counts['notice']} / {len(st.vms)}"),
             ("cost", cost_text(st.cost())),
             ("last step", clock(last("time") if n else None) + (" UTC" if n else ""))]
    return (f'<div class="hdr"><div class="title">varuna · {esc(title)}'
            + (f'<span class="job">job {esc(job_id)}</span>' if job_id else "") + "</div>"
            f'<span class="badge" data-state="{esc(state)}" style="background:{color}">{esc(state)}</span>'
            f'<span class="muted">{esc(since)}{" — " + esc(reason) if reason else ""}</span>'
            '<div class="tiles">' + "".join(
                f'<div class="tile"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div></div>'
                for k, v in tiles) + "</div></div>")

def elapsed_s(st: TelemetryStore, ended: bool) -> float | None:
    """Seconds from the job's first event to now, or to its end (``ended``); None before any."""
    if st.first_event_time is None:
        return None
    end = st.job_state.time if ended and st.job_state is not None else time.time()
    return max(0.0, end - st.first_event_time)

def eta_s(st: TelemetryStore, steps_total: int | None, done: int) -> float | None:
    """Seconds to go: steps left (``steps_total`` - ``done``) × the median time of the latest 20
    steps (None: total or step times unknown)."""
    if steps_total is None:
        return None
    times = st.metrics["step_time_s"][-20:]
    times = times[np.isfinite(times)]
    return max(0, steps_total - done) * float(np.median(times)) if len(times) else None


def pool_html(st: TelemetryStore) -> str:
    """The VM pool: one card per VM (status and since when, GPUs, kind, price per hour, its ranks
    as stage·replica, notice deadline, why it left, straggler flag) under a one-line summary. HTML."""
    cards = []
    for vm in st.vms.values():
        color = STATUS_COLORS.get(vm.status, "#999")
        ranks = st.ranks_of(vm.name) if vm.status in ("up", "notice") else []
        lines = [f'<div class="name">{esc(vm.name)}</div>',
                 f'<span class="badge" style="background:{color}">{esc(vm.status)}</span>'
                 f'<div class="muted">since {clock(vm.since)} UTC</div>',
                 "<div>" + ("CPU worker" if vm.gpus == 0 else
                            (f"{vm.gpus} GPU{'' if vm.gpus == 1 else 's'}" if vm.gpus is not None
                             else "GPUs not reported"))
                 + (f" · {esc(vm.kind)}" if vm.kind else "")
                 + (f" · ${vm.price_per_hour:.2f}/h" if vm.price_per_hour is not None else "") + "</div>"]
        if ranks:
            lines.append("<div>" + ", ".join(f"rank {r} (S{s}·R{d})" for r, s, d in ranks) + "</div>")
        elif vm.status in ("up", "notice"):
            lines.append('<div class="muted">no rank in the plan</div>')
        if vm.status == "notice" and vm.notice_deadline:
            lines.append(f"<div>leaves by {clock(vm.notice_deadline)} UTC</div>")
        if vm.reason and vm.status not in ("up", "notice"):
            lines.append(f'<div class="muted">{esc(vm.reason)}</div>')
        if vm.straggler:
            s = vm.straggler
            lines.append(f'<span class="flag">straggler ×{num(s.get("slowdown"), "{:.2f}", "?")}'
                         f'{" · " + esc(s["action"]) if s.get("action") else ""}</span>')
        gone = "" if vm.status in ("up", "notice") else " gone"
        cards.append(f'<div class="vm{gone}" data-vm="{esc(vm.name)}" data-status="{esc(vm.status)}" '
                     f'data-straggler="{"1" if vm.straggler else "0"}" style="border-left-color:{color}">'
                     + "".join(lines) + "</div>")
    c = st.vm_counts()
    summary = " · ".join(f"{c[s]} {s}" for s in VM_STATES if c[s]) or "no VMs yet"
    if c["stragglers"]:
        summary += f" · {c['stragglers']} straggler{'s' if c['stragglers'] > 1 else ''}"
    known = [vm.gpus for vm in st.vms.values() if vm.status in ("up", "notice") and vm.gpus is not None]
    # a CPU-only VM (gpus 0) runs one worker: "0 GPUs up" beside emulated VMs' labels said none ran
    cpu = sum(1 for g in known if g == 0)
    gpus = (f" · {sum(known)} GPUs up" if sum(known) else "") + (
        f" · {cpu} CPU-only VM{'s' if cpu != 1 else ''} (one worker each)" if cpu else "")
    return (f'<div class="muted" data-vms="{len(st.vms)}" style="margin-bottom:6px">{len(st.vms)} VMs: '
            f'{esc(summary)}{gpus}</div><div class="pool">' + "".join(cards) + "</div>")


def drift_banner(st: TelemetryStore, plan: dict | None) -> str:
    """A warning above the estimates when the running plan's step time has left its prediction:
    the manager's ``estimate_drift`` event (why, and the estimate re-calibrated from heartbeats),
    or, for a log without one, the same rule applied to the metrics here."""
    gen = (plan or {}).get("generation")
    ev = next((e for e in reversed(st.drifts) if isinstance(e.payload, dict)
               and e.payload.get("generation") == gen), None)
    if ev is not None:
        text = drift_sentence(ev.payload, time.time())
    else:
        sel = st.generation_rows(gen if isinstance(gen, int) else None)
        times = [] if sel is None else [float(x) for x in st.metrics["step_time_s"][sel[-50:]]]
        drift = step_time_drift(times, (plan or {}).get("predicted_step_s"), DRIFT_RULE)
        if drift is None:
            return ""
        text = drift_sentence({"drift": drift, "steps": DRIFT_RULE.steps,
                               "predicted_step_s": plan.get("predicted_step_s"),
                               "measured_step_s": float(np.median(times[-DRIFT_RULE.steps:]))})
        text += " (no re-calibration recorded for this plan)"
    return f'<div class="drift" data-drift="1">⚠ {esc(text)}</div>'
