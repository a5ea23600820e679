"""Morph latency: how long the demo job stops training when a VM is pre-empted with a notice or lost
without one, and how many steps it loses (paper §4.2, §4.5, §4.6; DESIGN.md target: from
pre-emption to training resumed < 30 s on the testbed; no progress lost with a notice, at most the
checkpoint interval without).

The demo job (``varuna demo``: GPT-2 ``cpu-demo``, 4 blocks, d=128, 50,257-token BPE, global batch
16, checkpoint every 5 steps) runs under the morph manager (``manager.Manager``) on 4 local slots of
a ``SpotEmulator`` driven by hand: the first generation is P=2 x D=2 on the 4 slots; then, for
``--rounds`` rounds, a VM in use gets a pre-emption notice (``--notice`` s) and is taken; once the
new plan has done a few steps the VM comes back; then a VM in use vanishes without notice, and comes
back once the job has resumed. Growing onto returned VMs is off (``grow=None``): a grow decided
as a VM is lost folds the loss into its own record, and the rounds would no longer be comparable.

Downtime (the manager's ``MorphRecord.downtime_s``): from the notice (resp. the loss) to the end of
the first mini-batch under the new plan. Broken down from the job's event log:
``stop`` (notice: workers finish the mini-batch, checkpoint, publish and exit; loss: from the VM's
processes killed — or the removal announced, if earlier — until the survivors are stopped), ``plan`` (re-plan for the VMs left), ``launch`` (processes
started until every worker said hello), ``init + load`` (torch import, model build, rendezvous,
checkpoint read under the new stage map) and ``first step``. Steps lost: trained steps the resumed
checkpoint does not hold. Targets: median downtime < 30 s (ratio = value / 30 s); steps lost with
notice 0; without notice <= the checkpoint interval (ratio = value / interval).

The same rounds run twice in one run: first with every worker a fresh process
(``VARUNA_SDK_START_METHOD=spawn``: each imports torch and ``torch._dynamo`` itself), then as by
default, forked from the run's zygote (``cluster.zygote``, torch imported once); the ratio of their
median downtimes has a target of <= 0.7.

Run: ``.venv/bin/python benchmarks/bench_morph.py [--quick] [--rounds N] [--notice S]``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.setup_path()

from varuna_sdk.cluster.spot import SpotEmulator  # noqa: E402
from varuna_sdk.demo import demo_config, morph_table  # noqa: E402
from varuna_sdk.manager.events import EventLog, Kind  # noqa: E402
from varuna_sdk.manager.manager import Manager  # noqa: E402
from varuna_sdk.profiling.job import calibrate_job  # noqa: E402

TARGET_S = 30.0
EVERY = 5          # checkpoint interval (steps)
STEPS_BETWEEN = 4  # steps the new plan makes before the next event


def _events(run: Path):
    log = EventLog.reader(run / "events.db")
    try:
        return log.events(), log.metrics()
    finally:
        log.close()


def current_hosts(run: Path) -> list[str]:
    """VMs (rank order) of the newest plan."""
    events, _ = _events(run)
    plans = [e for e in events if e.kind == Kind.PLAN]
    return list(plans[-1].payload["hosts"]) if plans else []


def wait_steps(run: Path, mgr: Manager, n: int, timeout_s: float) -> int:
    """Wait until the newest generation has finished ``n`` steps; returns its last step."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if mgr.state.terminal:
            raise RuntimeError(f"job ended: {mgr.summary()['state']} {mgr.error}")
        events, metrics = _events(run)
        started = [e for e in events if e.kind == "generation_started"]
        if started:
            g = started[-1].payload["generation"]
            mine = [m for m in metrics if m.get("generation") == g]
            if len(mine) >= n:
                return max(m["step"] for m in mine)
        time.sleep(0.2)
    raise TimeoutError(f"the newest generation did not make {n} steps in {timeout_s} s")


def wait_morph(mgr: Manager, cause: str, since: int, timeout_s: float) -> tuple[int, dict]:
    """Wait for the first morph of ``cause`` recorded after the first ``since`` ones (a morph is
    recorded at the first step of the new plan); returns (its index, the record)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        morphs = mgr.summary()["morphs"]
        for i, m in enumerate(morphs[since:], since):
            if m["cause"] == cause:
                return i, m
        if mgr.state.terminal:
            break
        time.sleep(0.2)
    raise TimeoutError(f"no {cause} morph after morph {since} in {timeout_s} s: {mgr.summary()}")


def breakdown(run: Path, morph: dict) -> dict:
    """Phases of one morph from the event log (seconds; see the module docstring)."""
    events, metrics = _events(run)
    t = morph["time"]
    if morph["cause"] == "loss":  # a slot's processes die before the emulator announces the removal
        seen = [e.time for e in events if e.kind == Kind.HOST_LOST and e.host == morph.get("host")
                and t - 5.0 <= e.time <= t]
        t = min([t, *seen])
    after = [e for e in events if e.time >= t - 1e-3]
    ended = next(e for e in after if e.kind == "generation_ended")
    plan = next(e for e in after if e.kind == Kind.PLAN and e.time >= ended.time)
    started = next(e for e in after if e.kind == "generation_started" and e.time >= plan.time)
    g = started.payload["generation"]
    joined = [e for e in after if e.kind == Kind.WORKER_JOINED and e.time >= started.time]
    joined = joined[: started.payload["world_size"]]
    first = min((m for m in metrics if m.get("generation") == g), key=lambda m: m["step"], default=None)
    # (a generation whose rows the reader has not seen yet: the morph's own end, its first step done)
    step_end = (float(first.get("wall_time") or first["time"]) if first is not None
                else morph["time"] + float(morph["downtime_s"] or 0.0))
    out = {"generation": g}
    if morph["cause"] == "notice":
        finished = [e for e in after if e.kind == Kind.WORKER_FINISHED and e.time <= ended.time]
        t_ck = max(e.time for e in finished) if finished else ended.time
        out["stop: mini-batch + checkpoint + publish"] = t_ck - t
        out["stop: workers exit"] = ended.time - t_ck
    else:
        out["stop: loss seen (VM killed), survivors stopped"] = ended.time - t
    out["plan"] = plan.time - ended.time
    out["launch (until every worker said hello)"] = max(e.time for e in joined) - plan.time
    out["init + load (import, build, rendezvous, checkpoint read)"] = step_end - first["step_time_s"] - max(
        e.time for e in joined)
    out["first step"] = first["step_time_s"]
    out["total"] = step_end - t
    return out


def run_rounds(rounds: int, notice_s: float, work: Path) -> tuple[list[dict], list[dict], Path]:
    job = demo_config(steps=5000)
    job.train.checkpoint_every = EVERY
    profile = calibrate_job(job)
    run = work / "run"
    emu = SpotEmulator(capacity=4, backend="local", notice_s=None).start()
    mgr = Manager(job, emu, run_dir=run, profile=profile, heartbeat_interval_s=1.0, stop_timeout_s=60.0,
                  grow=None, straggler=None, generation_options={"sink": None})
    n = 0
    try:
        mgr.start()
        wait_steps(run, mgr, STEPS_BETWEEN, 300)
        for r in range(rounds):
            for kind in ("notice", "loss"):
                victim = current_hosts(run)[-1]
                print(f"round {r + 1}/{rounds}: {kind} of {victim} (in use: {current_hosts(run)})", flush=True)
                emu.remove_now(victim, notice_s=notice_s if kind == "notice" else None)
                i, m = wait_morph(mgr, kind, n, 180)
                n = i + 1
                print(f"  morph {n}: {m['cause']}, downtime {m['downtime_s']:.1f} s, steps lost {m['steps_lost']}",
                      flush=True)
                wait_steps(run, mgr, STEPS_BETWEEN + (r + (kind == "loss")) % 3, 180)  # vary the loss's offset
                while victim in {h.name for h in emu.all_hosts()}:  # a notice's removal comes at its deadline
                    time.sleep(0.1)
                emu.add_now(victim)
                time.sleep(1.0)  # let the manager judge the returned VM (no gain: no morph)
                n = len(mgr.summary()["morphs"])
        mgr.cancel()
        mgr.wait(180)
    finally:
        mgr.cancel()
        mgr.wait(60)
        emu.close()
    morphs = mgr.summary()["morphs"]
    return morphs, [breakdown(run, m) for m in morphs], run


def main() -> None:
    args = common.parse_args("Morph latency and steps lost on local slots (demo job)",
                             lambda ap: (ap.add_argument("--rounds", type=int, default=None,
                                                         help="notice + loss rounds (default 3; quick 1)"),
                                         ap.add_argument("--notice", type=float, default=10.0,
                                                         help="pre-emption notice, seconds (default 10)")))
    rounds = args.rounds or (1 if args.quick else 3)
    idle = common.wait_for_idle(args.wait_idle)
    load0 = common.load_average()
    # the baseline first: every worker a fresh process (torch imported in each, every generation)
    import os

    from varuna_sdk.pipeline.spawn import START_METHOD_ENV

    os.environ[START_METHOD_ENV] = "spawn"
    with tempfile.TemporaryDirectory(prefix="varuna-bench-morph-") as tmp:
        base_morphs, _, _ = run_rounds(rounds, args.notice, Path(tmp))
    os.environ.pop(START_METHOD_ENV)
    with tempfile.TemporaryDirectory(prefix="varuna-bench-morph-") as tmp:
        t0 = time.monotonic()
        morphs, phases, run = run_rounds(rounds, args.notice, Path(tmp))
        wall = time.monotonic() - t0
        print("\n" + morph_table(morphs, morphs[0]["time"] if morphs else None))
    by = {c: [(m, p) for m, p in zip(morphs, phases) if m["cause"] == c] for c in ("notice", "loss", "grow")}
    figures = []
    for cause, what in (("notice", "pre-emption notice"), ("loss", "sudden loss")):
        mine = [m["downtime_s"] for m, _ in by[cause]]
        fresh = [m["downtime_s"] for m in base_morphs if m["cause"] == cause]
        if mine and fresh:
            figures.append(common.Figure(
                f"downtime after a {what}: workers forked from the run's zygote vs fresh processes (medians)",
                statistics.median(mine), "s", baseline=statistics.median(fresh), target="<= 0.7",
                detail={"zygote_s": mine, "fresh_processes_s": fresh}))
    for cause, what in (("notice", "pre-emption notice"), ("loss", "sudden loss")):
        rows = by[cause]
        if not rows:
            continue
        down = [m["downtime_s"] for m, _ in rows]
        keys = [k for k in rows[0][1] if k not in ("generation",)]
        med = {k: statistics.median(p[k] for _, p in rows) for k in keys}
        figures.append(common.Figure(
            f"downtime: {what} -> first step of the new plan (median of {len(rows)}, target < {TARGET_S:.0f} s)",
            statistics.median(down), "s", ratio=statistics.median(down) / TARGET_S, target="< 1",
            detail={"ratio_is": f"value / {TARGET_S:.0f} s target", "stats": common.stats(down),
                    "breakdown_median_s": med, "per_morph": [{**p, "downtime_s": m["downtime_s"]} for m, p in rows]}))
        for k in keys:
            if k != "total":
                figures.append(common.Figure(f"  {k}", med[k], "s"))
    if by["notice"]:
        lost = [m["steps_lost"] for m, _ in by["notice"]]
        figures.append(common.Figure(f"steps lost with a notice (max of {len(lost)}, target 0)", max(lost), "steps",
                                     ratio=float(max(lost)), target="<= 0", detail={"per_morph": lost}))
    if by["loss"]:
        lost = [m["steps_lost"] for m, _ in by["loss"]]
        figures.append(common.Figure(
            f"steps lost without notice (max of {len(lost)}) vs the checkpoint interval ({EVERY} steps)", max(lost),
            "steps", baseline=EVERY, target="<= 1.0", detail={"per_morph": lost, "checkpoint_every": EVERY}))
    common.print_table("Morph latency on local slots (demo job, 2-core testbed)", figures)
    notes = (f"{rounds} round(s) of (notice {args.notice:g} s, then a sudden loss) on 4 local slots of a SpotEmulator; "
             f"the demo job (GPT-2 cpu-demo, global batch 16, checkpoint every {EVERY} steps) starts at P=2 x D=2 and "
             "is re-planned after each morph (2 workers of the 3 slots left on this 2-core machine). Downtime = cause "
             f"seen -> first mini-batch of the new plan done; the whole run took {wall:.0f} s. Machine shared with "
             "other work: see load_average. The baseline (the same rounds first, VARUNA_SDK_START_METHOD=spawn) starts "
             "every worker as a fresh process, which imports torch and torch._dynamo itself; by default the run's "
             "zygote (cluster.zygote) forks them with those imported.")
    common.write_results("morph", figures, notes,
                         machine=common.machine_info(load_average=[load0, common.load_average()], idle_before=idle),
                         extra={"morphs": morphs}, out=args.out)


if __name__ == "__main__":
    main()
