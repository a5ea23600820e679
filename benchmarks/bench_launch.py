"""Launch and loss detection: time from ``Generation.start()`` to the first training step on 4 SSH
test hosts vs 4 local processes, and how fast a lost VM is noticed (killed, and network cut).

1. **Launch → first step.** The tiny GPT-2 of the tests (3 blocks, byte vocabulary, P=2 x D=2,
   global batch 8) is launched by ``manager.generation.Generation`` on 4 local slots (workers as
   local subprocesses: the embedded default) and on 4 sshd test hosts on this machine
   (``cluster.sshd_hosts``: bootstrap = version probe + config upload over SFTP, workers started
   over SSH with the venv's Python). The time is from ``start()`` to rank 0's first metrics row
   arriving in the event log through the heartbeat channel (interpreter + torch import, process
   group, model build, the held-out evaluation, one optimizer step). Rounds alternate local/SSH;
   medians. Ratio SSH / local; target <= 1.5 (SSH may add connection, bootstrap and remote
   start-up, not multiply the start-up). After the first step of the last SSH round, the
   non-rank-0 VM is removed mid-training: the real end-to-end detection latency is reported.
2. **Loss detection latency** (heartbeat interval 1 s; target: within 2 intervals, ratio =
   latency / 2 intervals <= 1.0), median of N runs each, with one heartbeat worker per fresh
   test host (started over SSH, a real ``HeartbeatClient`` in its own process; no torch, so runs
   are cheap), wired as ``Generation`` wires it (the SSH channel's end reported to the server):
   *killed* — the host's sshd and every process it started are SIGKILLed
   (``SSHDHosts.remove``), measured from the removal call; *network cut* — a host in its own
   network namespace has its link taken down (``SSHDHosts.cut``): its processes keep running and
   only the silence tells. Cut times are spread over the heartbeat phase (random delay).

Run: ``.venv/bin/python benchmarks/bench_launch.py [--quick] [--rounds 2] [--runs 5]``.
Needs sshd (and root + iproute2 for the network-cut runs, skipped otherwise).
"""

from __future__ import annotations

import random
import secrets
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.setup_path()

from varuna_sdk.cluster.hosts import Secret  # noqa: E402
from varuna_sdk.cluster.localproc import local_host  # noqa: E402
from varuna_sdk.cluster.remote import WorkerSpec, start_workers  # noqa: E402
from varuna_sdk.cluster.ssh import SSHPool  # noqa: E402
from varuna_sdk.cluster.sshd_hosts import SSHDHosts, netns_skip_reason, skip_reason  # noqa: E402
from varuna_sdk.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from varuna_sdk.data.loader import tokenize_corpus  # noqa: E402
from varuna_sdk.manager.events import EventLog, Kind  # noqa: E402
from varuna_sdk.manager.generation import Generation  # noqa: E402
from varuna_sdk.manager.startup import route_source  # noqa: E402
from varuna_sdk.manager.heartbeat_server import HeartbeatServer  # noqa: E402

INTERVAL = 1.0

HB_WORKER = textwrap.dedent("""
    import time
    from varuna_sdk.manager.heartbeat_client import HeartbeatClient
    c = HeartbeatClient.from_env()
    c.start()
    step = 0
    while True:
        c.record_step(step, loss=1.0)
        step += 1
        time.sleep(0.05)
""")


def tiny_job(root: Path, steps: int) -> JobConfig:
    return JobConfig(name="bench-launch", model=ModelConfig(preset="tiny", n_layer=3),
                     data=DataConfig(tokenizer="byte", seq_len=32),
                     parallel=ParallelConfig(P=2, D=2, global_batch=8, micro_batch_size=2),
                     train=TrainConfig(steps=steps, lr=3e-3, warmup_steps=2, eval_batches=2,
                                       run_dir=str(root / "runs")))


def launch_once(root: Path, hosts, tag: str, th: SSHDHosts | None, kill_after_first: bool = False) -> dict:
    """One generation; seconds from start() to the first metrics row (and, optionally, the
    detection latency of removing the rank-3 VM mid-training)."""
    run = root / f"run-{tag}"
    events = EventLog(run / "events.db")
    gen = Generation(tiny_job(root, steps=5000 if kill_after_first else 3), hosts, run, events=events,
                     job_id=f"bench-{tag}", heartbeat_interval_s=INTERVAL, sink=None, kill_grace_s=1.0,
                     ssh_options=th.options() if th is not None else None)
    out: dict = {}
    try:
        t0 = time.monotonic()
        gen.start()
        out["start_call_s"] = time.monotonic() - t0
        if not gen.server.wait_metrics(None, timeout_s=300):
            raise RuntimeError(f"{tag}: no first step within 300 s: {gen.wait(timeout_s=0)}")
        out["first_step_s"] = time.monotonic() - t0
        boot = events.events(kind=Kind.BOOTSTRAP)
        if boot:
            out["bootstrap_s"] = boot[0].payload["seconds"]
        if kill_after_first:
            assert gen.server.wait_heartbeats(4, timeout_s=60, min_step=1)
            victim = hosts[3]
            t1 = time.monotonic()
            th.remove(victim)
            ev = gen.server.wait_for(Kind.HOST_LOST, timeout_s=10 * INTERVAL)
            out["kill_mid_training_s"] = time.monotonic() - t1 if ev is not None else None
            out["kill_reason"] = ev.payload["reason"] if ev is not None else None
            res = gen.wait(timeout_s=30)
        else:
            res = gen.wait(timeout_s=300)
        out["status"] = res.status if res is not None else "timeout"
    finally:
        gen.close()
        events.close()
    return out


def detection_runs(th: SSHDHosts, mode: str, runs: int) -> list[dict]:
    """``runs`` loss-detection measurements with one heartbeat worker per fresh host."""
    out = []
    with tempfile.TemporaryDirectory(prefix="varuna-bench-hb-") as tmp:
        events = EventLog(Path(tmp) / "events.db")
        token = Secret(secrets.token_urlsafe(24))
        server = HeartbeatServer("bench-hb", token, events, interval_s=INTERVAL, bind="0.0.0.0",
                                 advertise="127.0.0.1").start()
        pool = SSHPool(th.options(kill_grace_s=0.5))
        try:
            for i in range(runs):
                h = th.add(f"{mode}{i}", netns=(mode == "cut"))
                addr = route_source(h.address, h.port)
                job = start_workers([WorkerSpec(h, 0, [h.python, "-c", HB_WORKER])], pool=pool,
                             master_addr=h.address, master_port=1, job_id="bench-hb", token=token,
                             env={"VARUNA_HEARTBEAT_ADDR": f"{addr}:{server.address[1]}",
                                  "VARUNA_HEARTBEAT_INTERVAL": repr(INTERVAL)}, sink=None,
                             on_exit=lambda w: server.report_exit(  # what Generation wires
                                 w.host.name, w.rank, None if w.process.connection_lost else w.process.exit_code,
                                 at=w.process.ended_at))
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    s = server.senders().get((h.name, 0))
                    if s is not None and s.heartbeats >= 3:
                        break
                    time.sleep(0.05)
                else:
                    raise RuntimeError(f"{h.name}: no heartbeats")
                time.sleep(random.uniform(0, INTERVAL))  # spread over the heartbeat phase
                t0 = time.monotonic()
                if mode == "kill":
                    th.remove(h)
                else:
                    th.cut(h)
                ev = server.wait_for(Kind.HOST_LOST, timeout_s=10 * INTERVAL, host=h.name)
                latency = time.monotonic() - t0 if ev is not None else float("nan")
                out.append({"host": h.name, "latency_s": latency,
                            "reason": ev.payload["reason"] if ev is not None else None,
                            "since_last_heartbeat_s": ev.payload.get("since_last_heartbeat_s") if ev else None})
                server.stop_expecting(h.name)
                job.stop(grace_s=0.5, gone=[h.name])
                if mode == "cut":
                    th.remove(h)
                print(f"  {mode} run {i + 1}/{runs}: host_lost after {latency:.3f}s "
                      f"({out[-1]['reason']})", flush=True)
        finally:
            pool.close()
            server.close()
            events.close()
    return out


def main() -> None:
    def extra(ap):
        ap.add_argument("--rounds", type=int, default=None, help="launch rounds per side (default 2; quick 1)")
        ap.add_argument("--runs", type=int, default=None, help="detection runs per mode (default 5; quick 3)")

    args = common.parse_args(__doc__.splitlines()[0], extra)
    rounds = args.rounds or (1 if args.quick else 2)
    runs = args.runs or (3 if args.quick else 5)
    reason = skip_reason()
    if reason:
        sys.exit(f"bench_launch needs SSH test hosts: {reason}")
    idle = common.wait_for_idle(args.wait_idle)
    figures: list[common.Figure] = []
    with tempfile.TemporaryDirectory(prefix="varuna-bench-launch-") as tmp:
        root = Path(tmp)
        tokenize_corpus("shakespeare", "byte")
        th = SSHDHosts(root / "hosts")
        try:
            local_rounds, ssh_rounds = [], []
            for r in range(rounds):
                local = launch_once(root, [local_host(i) for i in range(4)], f"local{r}", None)
                hosts = [th.add(f"l{r}vm{i}") for i in range(4)]
                last = r == rounds - 1
                ssh = launch_once(root, hosts, f"ssh{r}", th, kill_after_first=last)
                for h in hosts:
                    if h.name in th:
                        th.remove(h)
                local_rounds.append(local)
                ssh_rounds.append(ssh)
                print(f"round {r + 1}/{rounds}: first step local {local['first_step_s']:.2f}s "
                      f"({local['status']}), SSH {ssh['first_step_s']:.2f}s ({ssh['status']}, "
                      f"bootstrap {ssh.get('bootstrap_s', 0):.2f}s)", flush=True)
            loc = statistics.median(x["first_step_s"] for x in local_rounds)
            sshv = statistics.median(x["first_step_s"] for x in ssh_rounds)
            figures.append(common.Figure(
                "launch -> first step, 4 SSH test hosts vs 4 local processes (P=2 x D=2)", sshv, "s",
                baseline=loc, target="<= 1.5",
                detail={"local": local_rounds, "ssh": ssh_rounds,
                        "bootstrap_s_median": statistics.median(x.get("bootstrap_s", 0.0) for x in ssh_rounds)}))
            mid = ssh_rounds[-1].get("kill_mid_training_s")
            if mid is not None:
                figures.append(common.Figure(
                    "VM killed mid-training (P=2 x D=2 over SSH): detection vs 2 heartbeat intervals",
                    mid, "s", baseline=2 * INTERVAL, target="<= 1.0",
                    detail={"reason": ssh_rounds[-1].get("kill_reason"), "interval_s": INTERVAL, "runs": 1}))
            print(f"\nloss detection, {runs} runs per mode (interval {INTERVAL:g}s):", flush=True)
            kills = detection_runs(th, "kill", runs)
            lat = [x["latency_s"] for x in kills]
            figures.append(common.Figure(
                f"lost VM detected, killed (median of {runs}) vs 2 heartbeat intervals",
                statistics.median(lat), "s", baseline=2 * INTERVAL, target="<= 1.0",
                detail={"runs": kills, "stats": common.stats(lat), "interval_s": INTERVAL}))
            nreason = netns_skip_reason()
            if nreason is None:
                cuts = detection_runs(th, "cut", runs)
                lat = [x["latency_s"] for x in cuts]
                figures.append(common.Figure(
                    f"lost VM detected, network cut (median of {runs}) vs 2 heartbeat intervals",
                    statistics.median(lat), "s", baseline=2 * INTERVAL, target="<= 1.0",
                    detail={"runs": cuts, "stats": common.stats(lat), "worst_s": max(lat),
                            "interval_s": INTERVAL}))
            else:
                print(f"network-cut runs skipped: {nreason}")
        finally:
            th.close()
    common.print_table("Launch and loss detection", figures)
    notes = ("Launch: Generation.start() -> rank 0's first metrics row in the event log; tiny GPT-2 "
             "P=2 x D=2 on 4 local slots vs 4 sshd test hosts on the same 2-core machine (so the "
             "SSH side pays connection, bootstrap and remote start-up, not network distance); "
             f"median of {rounds} alternating rounds. Detection: heartbeat interval {INTERVAL:g}s, "
             "latency from the kill/cut call to the host_lost event; killed = sshd and every "
             "process of the host SIGKILLed (the SSH channel ends at once and the launcher reports "
             "it; else the heartbeat connection's close after a reconnect grace of half an "
             "interval); cut = link down in a network namespace, only "
             "the 2-interval silence tells (latency = 2 intervals minus the time since the last "
             "heartbeat, plus the server's tick).")
    common.write_results("launch", figures, notes, machine=common.machine_info(
        load_average=[common.load_average()], idle_before=idle), out=args.out)


if __name__ == "__main__":
    main()
