"""A stand-in job for the dashboard tests and benchmark: writes a realistic event log over time
from its own process, through the real ``EventLog`` writer API.

Run: ``python tests/dashboard_writer.py RUN_DIR [--hosts 4] [--interval 0.25] [--prefill N]``.
It writes ``RUN_DIR/config.yaml`` (the job's name) and ``RUN_DIR/events.db``: the job state
(PROVISIONING -> RUNNING), one ``host_added`` per VM (GPUs, $ per hour), a ``plan`` made by the
real planner (``varuna_sdk.planner.plan.plan`` on a synthetic 6-segment GPT-2-like profile, its
ranked rows, boundaries, hosts, memory per stage) with the timeline of one simulated mini-batch
(``varuna_sdk.planner.simulate``), then one metrics row per step and one heartbeat per rank per
step (per-micro-batch F/R/B seconds near the profile's), until stdin closes or says ``quit``.
``--prefill N`` first writes N steps of back-dated history (the 100k-point benchmark).

Commands on stdin, one per line (each answered on stdout with a line starting ``ok``):
- ``preempt HOST``: notice, MORPHING, checkpoint, ``host_removed``, a new plan for the GPUs
  left (generation + 1), ``morph`` (cause "notice"), RUNNING — the manager's sequence;
- ``straggler HOST``: a ``straggler`` event for HOST's first rank;
- ``quit``.
At start it prints ``ok started gen=0 P=.. D=..`` once the first plan is written.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import threading
import time
from pathlib import Path

from varuna_sdk.manager.events import EventLog, Kind
from varuna_sdk.planner.plan import plan
from varuna_sdk.planner.rows import Prices
from varuna_sdk.planner.simulate import simulate
from varuna_sdk.profiling.profile import NetworkProfile, Profile, SegmentProfile

COSTS = [1.0, 2.0, 2.0, 2.0, 2.0, 3.0]  # embeddings, 4 blocks, LM head (relative compute)
UNIT_S = 0.004
SIZES = (1, 2, 4)
GLOBAL_BATCH = 16
TOKENS = 128  # per example
JOB_ID = "gpt2-demo-0001"
PRICE = 0.92  # $ per VM-hour of a 1-GPU VM (example spot price)


def profile(costs: list[float] = COSTS) -> Profile:
    """A GPT-2-like profile of ``len(costs)`` segments: per segment, forward
    ``cost * UNIT_S * (0.5 + 0.5 b)`` seconds at micro-batch b, recompute 1.1x, backward 2x;
    1 MB per example across cut-points; 60 MB of parameters per segment; 1.2 GB per GPU, which
    the whole model with its optimizer state does not fit (4 GPUs plan P=2 x D=2, 3 GPUs
    P=3 x D=1)."""
    segs = []
    for c in costs:
        f = [c * UNIT_S * (0.5 + 0.5 * b) for b in SIZES]
        segs.append(SegmentProfile(fwd_s=f, rec_s=[1.1 * x for x in f], bwd_s=[2.0 * x for x in f],
                                   out_bytes=[int(1e6 * b) for b in SIZES],
                                   act_bytes=[int(4e6 * b) for b in SIZES], param_bytes=60_000_000))
    net = NetworkProfile(p2p_alpha_s=50e-6, p2p_beta_Bps=1.25e9, ar_alpha_s=50e-6, ar_beta_Bps=1.25e9,
                         consensus_s=1e-4)
    return Profile(model={"num_segments": len(costs), "shared": []},
                   hardware={"device": "synthetic", "memory_bytes": 1.2e9},
                   software={}, micro_batch_sizes=list(SIZES), segments=segs, network=net,
                   per_action_s=1e-4, per_step_s=0.0, opt_s_per_param_byte=0.0)


def make_plan(prof: Profile, hosts: list[str], generation: int) -> dict:
    """The ``plan`` payload for ``hosts`` (one GPU each), best row first."""
    pl = plan(prof, len(hosts), GLOBAL_BATCH, prices=Prices())
    best = pl.best
    seg = prof.segments
    k = prof.micro_batch_sizes.index(best.micro_batch_size) if best.micro_batch_size in prof.micro_batch_sizes else 0
    fwd = [sum(seg[i].fwd_s[k] for i in st) for st in best.stages]
    bwd = [sum(seg[i].bwd_s[k] for i in st) for st in best.stages]
    sim = simulate(P=best.P, m=best.m, D=best.D, fwd=fwd, bwd=bwd, rec=[1.1 * f for f in fwd],
                   act_bytes=1e6 * best.micro_batch_size, p2p_alpha=50e-6, p2p_beta=1.25e9,
                   record_timeline=True)
    timeline = [{"stage": s, "action": g.kind, "micro_batch": g.mb, "start_s": g.start, "end_s": g.end}
                for s, rank in enumerate(sim.timeline[: best.P]) for g in rank]
    rows = [{k2: v for k2, v in r.__dict__.items()} for r in pl.rows]
    return {"generation": generation, "gpus": len(hosts), "P": best.P, "D": best.D,
            "micro_batch_size": best.micro_batch_size, "num_micro_batches": best.m,
            "boundaries": best.stages, "hosts": hosts[: best.P * best.D],
            "predicted_step_s": best.time_s, "examples_per_s": best.examples_per_s,
            "bubble": best.bubble_fraction, "mem_per_stage_bytes": best.stage_memory_bytes,
            "rows": rows, "timeline": timeline, "fwd_s": fwd, "bwd_s": bwd}


class Job:
    """The fake job: state, plan, step counter; ``tick`` writes one step."""

    def __init__(self, log: EventLog, hosts: list[str], seed: int = 0):
        self.log, self.hosts, self.rng = log, list(hosts), random.Random(seed)
        self.prof = profile()
        self.step = 0
        self.lock = threading.Lock()
        self.plan: dict = {}

    def state(self, state: str, previous: str | None, reason: str) -> None:
        self.log.append(Kind.JOB_STATE, job_id=JOB_ID, payload={"state": state, "previous": previous,
                                                                 "reason": reason})

    def start(self, prefill: int) -> None:
        self.state("PROVISIONING", None, "job submitted")
        for h in self.hosts:
            self.log.append(Kind.HOST_ADDED, job_id=JOB_ID, host=h,
                            payload={"address": f"10.0.0.{len(h)}", "gpus": 1, "reason": "initial",
                                     "labels": {"price_per_hour": PRICE, "instance_type": "spot-1gpu",
                                                "zone": "test-a"}})
        self.log.append(Kind.JOB_STARTED, job_id=JOB_ID, payload={"hosts": len(self.hosts)})
        self.plan = make_plan(self.prof, self.hosts, 0)
        self.log.append(Kind.PLAN, job_id=JOB_ID, payload=self.plan)
        if prefill:
            now = time.time()
            dt = self.plan["predicted_step_s"]
            for i in range(prefill):
                self.write_step(time_s=now - (prefill - i) * dt, heartbeats=False)
        self.state("RUNNING", "PROVISIONING", f"plan P={self.plan['P']} x D={self.plan['D']}")

    def metric_values(self) -> dict:
        p, s = self.plan, self.step
        step_t = p["predicted_step_s"] * (1.04 + 0.03 * self.rng.random())
        if self.rng.random() < 0.003:
            step_t *= 1.3  # an occasional slow step (GC, a network hiccup)
        eps = GLOBAL_BATCH / step_t
        loss = 3.2 + 7.6 * math.exp(-s / 400.0) + 0.08 * self.rng.gauss(0, 1)
        lr = 2e-3 * min(1.0, (s + 1) / 10) * (0.55 + 0.45 * math.cos(math.pi * min(s, 20000) / 20000))
        return {"step": s, "loss": loss, "lr": lr, "grad_norm": 0.6 + 2.0 * math.exp(-s / 300.0)
                + 0.05 * self.rng.random(), "tokens_per_s": eps * TOKENS, "examples_per_s": eps,
                "step_time_s": step_t, "wall_time": time.time(), "P": p["P"], "D": p["D"],
                "generation": p["generation"]}

    def write_step(self, time_s: float | None = None, heartbeats: bool = True) -> None:
        with self.lock:
            vals = self.metric_values()
            self.log.append_metric(self.step, vals, job_id=JOB_ID, time_s=time_s)
            if heartbeats:
                p = self.plan
                for rank, host in enumerate(p["hosts"]):
                    stage = rank % p["P"]
                    j = 1.0 + 0.04 * self.rng.random()
                    f = p["fwd_s"][stage] * j
                    self.log.append_heartbeat(
                        {"step": self.step, "loss": vals["loss"], "fwd_s": f,
                         "recompute_s": 1.1 * f if stage < p["P"] - 1 else None,
                         "bwd_s": p["bwd_s"][stage] * j, "micro_batches": p["num_micro_batches"],
                         "step_time_s": vals["step_time_s"], "mem_bytes": int(p["mem_per_stage_bytes"][stage])},
                        job_id=JOB_ID, host=host, rank=rank)
            self.step += 1

    def preempt(self, host: str) -> str:
        with self.lock:
            old = self.plan
            if host not in self.hosts:
                return f"err unknown host {host}"
            self.log.append(Kind.PREEMPTION_NOTICE, job_id=JOB_ID, host=host,
                            payload={"deadline": time.time() + 30.0, "lead_s": 30.0, "reason": "preempted"})
            self.state("MORPHING", "RUNNING", f"pre-emption notice for {host}")
            self.log.append(Kind.CHECKPOINT, job_id=JOB_ID, payload={
                "step": self.step, "path": f"checkpoints/step{self.step}", "bytes": 48_000_000, "seconds": 0.4,
                "remote": None})
            self.log.append(Kind.HOST_REMOVED, job_id=JOB_ID, host=host, payload={"reason": "preempted"})
            self.hosts.remove(host)
            self.plan = make_plan(self.prof, self.hosts, old["generation"] + 1)
            self.log.append(Kind.PLAN, job_id=JOB_ID, payload=self.plan)
            keys = ("P", "D", "micro_batch_size", "num_micro_batches")
            self.log.append(Kind.MORPH, job_id=JOB_ID, payload={
                "cause": "notice", "old": {k: old[k] for k in keys}, "new": {k: self.plan[k] for k in keys},
                "downtime_s": 6.3, "steps_lost": 0, "from_step": self.step, "resume_step": self.step})
            self.state("RUNNING", "MORPHING", f"resumed on P={self.plan['P']} x D={self.plan['D']}")
            return f"ok preempt {host} gen={self.plan['generation']} P={self.plan['P']} D={self.plan['D']}"

    def straggler(self, host: str) -> str:
        with self.lock:
            ranks = [r for r, h in enumerate(self.plan["hosts"]) if h == host]
            if not ranks:
                return f"err {host} runs no rank"
            self.log.append(Kind.STRAGGLER, job_id=JOB_ID, host=host, rank=ranks[0],
                            payload={"rank": ranks[0], "slowdown": 1.7, "action": "kept"})
            return f"ok straggler {host}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between steps")
    ap.add_argument("--prefill", type=int, default=0, help="back-dated steps written first")
    ap.add_argument("--max-s", type=float, default=600.0, help="stop after this many seconds")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("name: gpt2-shakespeare-demo\n")
    log = EventLog(run / "events.db")
    job = Job(log, [f"spot-vm-{i}" for i in range(args.hosts)])
    job.start(args.prefill)
    print(f"ok started gen=0 P={job.plan['P']} D={job.plan['D']} steps={job.step}", flush=True)
    stop = threading.Event()

    def commands():
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "quit":
                break
            if cmd[0] == "preempt" and len(cmd) == 2:
                print(job.preempt(cmd[1]), flush=True)
            elif cmd[0] == "straggler" and len(cmd) == 2:
                print(job.straggler(cmd[1]), flush=True)
            else:
                print(f"err unknown command {line.strip()!r}", flush=True)
        stop.set()

    threading.Thread(target=commands, daemon=True).start()
    deadline = time.monotonic() + args.max_s
    while not stop.is_set() and time.monotonic() < deadline:
        job.write_step()
        stop.wait(args.interval)
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def write_run(root: Path, name: str, state: str, steps: int, total: int, morph: bool = False) -> Path:
    """A run folder as the manager leaves it: config.yaml (the step total) and an event log with the
    job's states, a plan, ``steps`` metrics rows and optionally a notice morph."""
    from varuna_sdk.config import JobConfig, TrainConfig

    run = root / name
    run.mkdir(parents=True)
    JobConfig(name=name, train=TrainConfig(steps=total)).to_yaml(run / "config.yaml")
    t0 = time.time() - 120
    with EventLog(run / "events.db") as log:
        log.append(Kind.JOB_STATE, job_id=name, payload={"state": "RUNNING", "reason": "generation 0"}, time_s=t0)
        log.append(Kind.PLAN, job_id=name, payload={"generation": 0, "P": 2, "D": 2, "hosts": ["vm0", "vm1"],
                                                    "micro_batch_size": 2, "num_micro_batches": 4,
                                                    "predicted_step_s": 0.4}, time_s=t0)
        for s in range(steps):
            log.append_metric(s, {"step": s, "loss": 5.0 - s / max(steps, 1), "step_time_s": 0.5, "generation": 0},
                              job_id=name, time_s=t0 + s)
        if morph:   # 0.5 s measured against 0.4 s predicted: the manager re-calibrated
            log.append(Kind.ESTIMATE_DRIFT, job_id=name, payload={
                "generation": 0, "drift": 0.25, "steps": 5, "predicted_step_s": 0.4, "measured_step_s": 0.5,
                "recalibrated_step_s": 0.49, "recalibrated_examples_per_s": 16.3, "calibrated_at": t0 - 3600,
                "load_1min": 3.2, "cpu_count": 2, "workers_here": 4}, time_s=t0 + 9)
        if morph:
            log.append(Kind.MORPH, job_id=name, payload={"time": t0 + 10, "cause": "notice", "host": "vm1",
                       "old": {"P": 2, "D": 2, "hosts": ["vm0", "vm1"]}, "new": {"P": 2, "D": 1, "hosts": ["vm0"]},
                       "downtime_s": 6.5, "steps_lost": 0, "resume_step": 11,
                       "phases_s": {"stop": 1.5, "wait_for_vms": 0.0, "replan": 0.5, "start_workers": 2.0,
                                    "first_step": 2.5},
                       "candidates": [{"P": 2, "D": 1, "examples_per_s": 12.25, "chosen": True},
                                      {"P": 1, "D": 2, "examples_per_s": 9.5, "chosen": False}],
                       "feasible_plans": 4}, time_s=t0 + 17)
        if state != "RUNNING":
            log.append(Kind.JOB_STATE, job_id=name, payload={"state": state, "reason": f"the job {state.lower()}"},
                       time_s=t0 + steps)
    for g in range(2 if morph else 1):   # what the workers printed, per generation
        (run / f"gen{g}").mkdir()
        (run / f"gen{g}" / "workers.log").write_text(
            "".join(f"[vm0 rank 0] generation {g} step {s} <ok>\n" for s in range(steps)))
    return run
