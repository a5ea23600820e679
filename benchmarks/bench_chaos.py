"""Chaos: a job on SSH test hosts survives a seeded stream of real faults, and its per-step losses
stay the uninterrupted run's.

The job: the tests' tiny GPT-2 (4 blocks, d=128, byte vocabulary, dropout 0.1, fp32, global batch 8
in micro-batches of 2, checkpoint every 5 steps), first generation P=2 x D=1, on 3 sshd test hosts
of this machine, each in its **own network namespace** (``SSHDHosts.add(netns=True)``), checkpoints
in a **tmpfs** mounted for the run. The manager is **a separate process**: ``varuna launch``'s own
code path (``launch.launch_job`` with a watched host file, ``cluster.hostfile.HostFileProvider``),
started by this script with ``--child-manager`` so that it can be SIGKILLed and started again with
the same command, like ``varuna launch --hosts FILE`` (which builds the provider without
``SSHOptions``: the test hosts' ``known_hosts`` must be given, hence the child mode). A host file
has no way to say "this VM gets a pre-emption notice", so the child's provider is a
``HostFileProvider`` that also reads a notices file (``NAME DEADLINE`` lines: the analogue of a
cloud's metadata-service notice) and calls ``PoolProvider._notice_host`` — the product's notice
path from there on. The child runs the manager with ``grow=None`` and ``straggler=None``: every
morph is caused by an injected fault; a VM that came back joins at the next morph.

A ``random.Random(--seed)`` schedule fires ``--faults`` faults (default 32: 4 of each of 8 kinds,
shuffled), each once the newest generation is RUNNING and has done a random 6-10 steps (plus a
random fraction of a second), on a random VM of the current plan:

- ``worker_kill9``: SIGKILL of the VM's worker process (its VM and sshd stay);
- ``worker_sigstop``: SIGSTOP of the VM's worker process (it hangs, its sockets stay open; the
  manager must notice the silence and kill it); SIGCONT afterwards if it were still alive;
- ``network_cut``: the VM's link taken down (``SSHDHosts.cut``: processes run on, TCP stays open,
  no packet passes); restored once the job runs again without it;
- ``manager_kill9``: SIGKILL of the manager process, then the same command started again (the
  orphaned workers stop at a boundary with a checkpoint, the new manager waits for them);
- ``disk_full``: the checkpoint store's tmpfs filled to the last byte with a filler file; freed once
  the job has noticed (a checkpoint write failed and the generation ended) or after 60 s;
- ``malformed_traffic``: hostile peers on the job's heartbeat port (found in a worker's
  environment): garbage bytes, a half line held open, a line over the size limit, envelopes with
  bad MACs, lines that once killed the server, a burst of silent connections — the job must not
  notice (no morph, steps go on);
- ``preempt_notice``: a pre-emption notice (``--notice`` s), then at the deadline the VM's sshd and
  every process it started are killed and it leaves the host file; it comes back (a new VM, new
  host key) once the job runs again;
- ``preempt_sudden``: the same without notice.

Judged per fault: the job survived (it reached RUNNING again, or never left it, and finished all
its steps at the end: SUCCEEDED); steps lost, counted independently from ``metrics.jsonl`` (rank
0's rows of every generation: a generation that starts below the highest step done before it
re-trains the difference), next to the manager's ``MorphRecord.steps_lost`` — 0 for faults with
notice or that do not touch training (notice, manager restart, malformed traffic), at most the
checkpoint interval otherwise (a full disk may cost one more interval: the write that failed was
the newest checkpoint); downtime (the manager's morph records: cause seen -> first step of the new
plan) per kind; every step's final loss equals an uninterrupted run's (``spawn_workers`` +
``run_worker``, P=2 x D=1, the same schedule; relative 1e-5); every checkpoint a generation loaded
(the ``resumed from NAME`` line of its rank 0 log) is re-verified by this script right after the
load with the product's reader (signed manifest, every file's size and SHA-256): 0 torn
checkpoints loaded; whether the old worker of a hung (SIGSTOP) or cut-off VM still ran after its
morph, and how long after the VM resumed it ended (target: the morph ends it). Hostile peers: no
morph, and the longest gap between finished steps while they talk. Finally nothing is left: no
sshd of the test hosts, no worker of the run, no namespace, the tmpfs unmounted.

Run: ``.venv/bin/python benchmarks/bench_chaos.py [--quick] [--seed 1] [--faults 32] [--notice 6]``
(root, sshd and iproute2 needed; ~15 minutes on 2 cores; ``--quick``: 6 faults of 6 kinds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # ssh_hosts: procs_left
import common  # noqa: E402

common.setup_path()

from varuna_sdk.cluster.hostfile import HostFileProvider  # noqa: E402
from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402

EVERY = 5            # checkpoint interval (steps)
INTERVAL = 1.0       # heartbeat interval (s)
ORPHAN_AFTER = 3.0   # workers that lose the manager this long stop with a checkpoint (s)
GAP = (6, 10)        # steps the newest generation makes before the next fault
KINDS = ("worker_kill9", "worker_sigstop", "network_cut", "manager_kill9", "disk_full",
         "malformed_traffic", "preempt_notice", "preempt_sudden")
NO_LOSS_KINDS = ("preempt_notice", "manager_kill9", "malformed_traffic")  # target: 0 steps lost
STORE_MB = 192
HOSTS = 3            # test hosts (VMs); the job starts on 2 of them
DOWNTIME_TARGET_S = 30.0


def chaos_job(steps: int, store: str | None) -> JobConfig:
    """The tests' tiny job (``tests/test_manager.py::tiny_job``): ~0.1 s a step on 2 cores."""
    return JobConfig(name="chaos", model=ModelConfig(preset="tiny", n_layer=4, n_embd=128, n_head=4, dropout=0.1),
                     data=DataConfig(tokenizer="byte", seq_len=64),
                     parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                     train=TrainConfig(steps=steps, lr=1e-3, min_lr=1e-4, warmup_steps=2, eval_batches=1,
                                       precision="fp32", checkpoint_every=EVERY, checkpoint_url=store),
                     launch=LaunchConfig(gpus=4, timeout_s=60))


# ============================================================================ the manager process
class NoticeHostFileProvider(HostFileProvider):
    """A watched host file plus a notices file (``NAME DEADLINE_UNIX_S`` a line): a listed VM gets
    the provider's pre-emption notice (``_notice_host``) once, while the deadline is ahead."""

    def __init__(self, path, notices, **kw):
        self.notices_path = Path(notices)
        super().__init__(path, **kw)

    def check(self) -> bool:
        changed = super().check()
        try:
            text = self.notices_path.read_text()
        except FileNotFoundError:
            return changed
        held = {h.name for h in self.all_hosts()}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in held:
                deadline = float(parts[1])
                if deadline > time.time():
                    self._notice_host(parts[0], deadline, reason="preempted (notice)")
        return changed


def child_main(argv: list[str]) -> int:
    from varuna_sdk.cluster.ssh import SSHOptions
    from varuna_sdk.runner import launch_job

    ap = argparse.ArgumentParser()
    for a in ("--config", "--run-dir", "--hosts", "--notices", "--known-hosts", "--job-id", "--summary"):
        ap.add_argument(a, required=True)
    ap.add_argument("--max-failures", type=int, default=2)
    a = ap.parse_args(argv)
    job = JobConfig.from_yaml(Path(a.config)).validate()
    opts = SSHOptions(known_hosts=a.known_hosts, connect_timeout_s=5.0, command_timeout_s=30.0, kill_grace_s=1.0)
    provider = NoticeHostFileProvider(a.hosts, a.notices, poll_s=0.25, ssh_options=opts)
    try:
        summary = launch_job(job, run_dir=a.run_dir, provider=provider, job_id=a.job_id,
                             heartbeat_interval_s=INTERVAL, grow=None, straggler=None, stop_timeout_s=60.0,
                             max_failures=a.max_failures,
                             generation_options={"orphan_after_s": ORPHAN_AFTER, "remote_run_dir": a.run_dir,
                                                 "sink": None})
    finally:
        provider.close()
    Path(a.summary).write_text(json.dumps(summary, indent=1, default=str))
    print(f"[chaos-manager] job {summary['job_id']}: {summary['state']} {summary['error'] or ''}", flush=True)
    return 0 if summary["state"] == "SUCCEEDED" else 1


# ==================================================================================== the harness
class JobGone(RuntimeError):
    """The job ended (or its manager died) while the harness expected it to run."""


class Chaos:
    def __init__(self, root: Path, steps: int, notice_s: float, max_failures: int):
        from varuna_sdk.cluster.sshd_hosts import SSHDHosts

        self.root, self.steps, self.notice_s, self.max_failures = root, steps, notice_s, max_failures
        self.run = root / "run"
        self.store = root / "store"
        self.hosts_file, self.notices = root / "hosts.txt", root / "notices.txt"
        self.summary_file = root / "summary.json"
        self.mounted = False
        self.store.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STORE_MB}m", "varuna-chaos-store", str(self.store)],
                       check=True, capture_output=True, text=True)
        self.mounted = True
        self.filler = self.store / "filler.bin"
        self.th = SSHDHosts(root / "vms")
        self.up: dict[str, object] = {}
        self.cfg = root / "job.yaml"
        chaos_job(steps, str(self.store)).to_yaml(self.cfg)
        self.manager: subprocess.Popen | None = None
        self.manager_starts = 0
        self.verified: dict[str, dict] = {}   # checkpoint name -> verification result
        self.loads: list[dict] = []           # every resume a generation made
        self.watchers: list[threading.Thread] = []
        self.verify_errors: list[str] = []
        self._stop_verifier = threading.Event()
        self._verifier_thread = threading.Thread(target=self._verifier, name="chaos-verifier", daemon=True)

    # ----------------------------------------------------------------- hosts, host file, manager
    def add_host(self, name: str) -> None:
        self.up[name] = self.th.add(name, netns=True)
        self.write_hosts()

    def write_hosts(self) -> None:
        lines = []
        for name in sorted(self.up):
            h = self.up[name]
            opts = [f"user={h.user}", f"python={h.python}", f"workdir={h.workdir}", f"key={h.key_path}"]
            opts += [f"label.{k}={v}" if not k.startswith("env.") else f"{k}={v}" for k, v in sorted(h.labels.items())]
            lines.append(f"{name} {h.address}:{h.port} " + " ".join(opts))
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.hosts_file)

    def start_manager(self) -> None:
        self.manager_starts += 1
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child-manager", "--config", str(self.cfg),
               "--run-dir", str(self.run), "--hosts", str(self.hosts_file), "--notices", str(self.notices),
               "--known-hosts", str(self.th.known_hosts), "--job-id", "chaos", "--summary", str(self.summary_file),
               "--max-failures", str(self.max_failures)]
        log = open(self.root / "manager.log", "a")
        log.write(f"\n===== manager start {self.manager_starts} at {time.time():.3f}\n")
        log.flush()
        self.manager = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, cwd=str(Path(__file__).resolve().parent.parent))
        log.close()

    def manager_alive(self) -> bool:
        return self.manager is not None and self.manager.poll() is None

    # ---------------------------------------------------------------------------- the event log
    def log(self):
        from varuna_sdk.manager.events import EventLog

        return EventLog.reader(self.run / "events.db")

    def snapshot(self) -> dict:
        """State, newest generation and its step count, morph records, from the event log."""
        from varuna_sdk.manager.events import Kind

        if not (self.run / "events.db").exists():
            return {"state": None, "generation": None, "gen_steps": 0, "last_step": None, "morphs": [],
                    "plans": []}
        log = self.log()
        try:
            states = log.events(kind=Kind.JOB_STATE)
            started = log.events(kind="generation_started")
            morphs = log.events(kind=Kind.MORPH)
            plans = log.events(kind=Kind.PLAN)
            metrics = log.metrics()
        finally:
            log.close()
        g = started[-1].payload["generation"] if started else None
        mine = [m for m in metrics if m.get("generation") == g]
        return {"state": states[-1].payload["state"] if states else None, "generation": g,
                "gen_started": started[-1].time if started else None, "gen_steps": len(mine),
                "last_step": max((m["step"] for m in metrics), default=None),
                "morphs": [{**e.payload, "logged_at": e.time} for e in morphs], "plans": [p.payload for p in plans]}

    def wait_running(self, steps: int, timeout_s: float, min_morphs: int = 0) -> dict:
        """Until the job is RUNNING, has recorded ``min_morphs`` morphs and its newest generation
        has done ``steps`` steps. Raises ``JobGone`` when the manager exits, ``TimeoutError``."""
        deadline = time.time() + timeout_s
        while True:
            s = self.snapshot()
            if s["state"] == "RUNNING" and len(s["morphs"]) >= min_morphs and s["gen_steps"] >= steps:
                self.check_loads()
                return s
            if not self.manager_alive():
                raise JobGone(f"manager exited with {self.manager.returncode if self.manager else None} "
                              f"(state {s['state']})")
            if time.time() > deadline:
                raise TimeoutError(f"not RUNNING with {steps} steps and {min_morphs} morphs after {timeout_s} s: "
                                   f"state {s['state']}, generation {s['generation']} ({s['gen_steps']} steps), "
                                   f"{len(s['morphs'])} morphs")
            time.sleep(0.2)

    def plan_hosts(self) -> list[str]:
        plans = self.snapshot()["plans"]
        return list(dict.fromkeys(plans[-1]["hosts"])) if plans else []

    # ------------------------------------------------------------------- checkpoints loaded
    def check_loads(self) -> None:
        """Every generation's ``resumed from NAME`` (rank 0's log): verify that checkpoint now,
        with the product's reader and the job's key (signed manifest, every file's SHA-256)."""
        for gdir in sorted(self.run.glob("gen*"), key=lambda p: int(p.name[3:]) if p.name[3:].isdigit() else -1):
            g = int(gdir.name[3:])
            if any(x["generation"] == g for x in self.loads):
                continue
            try:
                text = (gdir / "workers.log").read_text(errors="replace")
            except FileNotFoundError:
                continue
            m = re.search(r"\[varuna\] resumed from (\S+) \(saved at P=(\d+) x D=(\d+)\): step (\d+)", text)
            skipped = re.findall(r"\[varuna\] skipped checkpoint (\S+) \((.*?)\); falling back", text)
            if m is None:
                if re.search(r"held-out perplexity at start", text) or re.search(r"step\s+\d+/", text):
                    self.loads.append({"generation": g, "checkpoint": None, "step": 0, "skipped": skipped})
                continue
            name, step = m.group(1), int(m.group(4))
            self.loads.append({"generation": g, "checkpoint": name, "step": step, "skipped": skipped,
                               "verified": self.verify(name) or {"ok": None, "error": "pruned before it was seen"}})

    def verify(self, name: str) -> dict | None:
        """Verify checkpoint ``name`` as it is in the store now, with the product's reader and the
        job's key (signed manifest, every file's size and SHA-256). A result is kept once it is
        definite: verified, or failed while its manifest was there before and after (torn). None:
        not complete now (being written, or being pruned: the manifest goes first)."""
        from varuna_sdk.checkpoint.store import MANIFEST, CheckpointError, Store, manifest_key
        from varuna_sdk.cluster.hosts import Secret

        if name in self.verified:
            return self.verified[name]
        secret = self.run / ".job-secret"
        manifest = self.store / name / MANIFEST
        if not secret.exists() or not manifest.exists():
            return None
        store = Store(str(self.store), manifest_key(Secret.load_or_create(secret).reveal()))
        try:
            body = store.read_manifest(name)
            for fname in sorted(body["files"]):
                store.read_verified(name, fname, body)
            out = {"ok": True, "files": len(body["files"]), "step": int(body["step"]), "at": time.time()}
        except (CheckpointError, OSError) as e:
            if not manifest.exists():
                return None   # pruned while being read
            out = {"ok": False, "error": str(e)[:300], "at": time.time()}
        self.verified[name] = out
        return out

    def verify_store(self) -> None:
        """Verify every complete checkpoint in the store not verified yet (a background thread
        calls this every 0.3 s, so each is seen before it is pruned)."""
        try:
            names = [p.name for p in self.store.iterdir() if p.is_dir()]
        except OSError:
            return
        for name in names:
            if name not in self.verified:
                try:
                    self.verify(name)
                except Exception as e:  # noqa: BLE001 - keep watching; said in the results
                    self.verify_errors.append(f"{name}: {type(e).__name__}: {e}"[:300])

    def _verifier(self) -> None:
        while not self._stop_verifier.wait(0.3):
            self.verify_store()

    # --------------------------------------------------------------------------- processes
    def worker_pids(self, host: str) -> list[int]:
        from varuna_sdk.cluster.sshd_procs import _is_zombie

        out = []   # the Python process itself, not the session's ``setsid sh -c`` wrapper
        for p in self.th.pids(host):
            try:
                argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
                if b"varuna_sdk.worker" in argv and b"-m" in argv and not _is_zombie(p):
                    out.append(p)
            except (FileNotFoundError, ProcessLookupError):
                pass
        return out

    def heartbeat_addr(self) -> tuple[str, int] | None:
        for name in self.plan_hosts():
            if name not in self.th:
                continue
            for p in self.worker_pids(name):
                try:
                    env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
                except (FileNotFoundError, ProcessLookupError):
                    continue
                for kv in env:
                    if kv.startswith(b"VARUNA_HEARTBEAT_ADDR="):
                        host, _, port = kv.split(b"=", 1)[1].decode().rpartition(":")
                        return host, int(port)
        return None

    # ------------------------------------------------------------------------------ faults
    def inject(self, kind: str, victim: str, rng: random.Random) -> dict:
        """Fire one fault; returns what was done (and, for the harness, what to undo later)."""
        rec: dict = {"kind": kind, "host": victim, "t": time.time()}
        if kind in ("worker_kill9", "worker_sigstop"):
            pids = self.worker_pids(victim)
            if not pids:
                raise RuntimeError(f"no worker process on {victim}")
            pid = pids[0]
            os.kill(pid, signal.SIGKILL if kind == "worker_kill9" else signal.SIGSTOP)
            rec["pid"], rec["pids"] = pid, [pid]
        elif kind == "network_cut":
            rec["pids"] = self.worker_pids(victim)
            self.th.cut(victim)
        elif kind == "manager_kill9":
            rec["host"] = None
            os.killpg(self.manager.pid, signal.SIGKILL)
            self.manager.wait(10)
            rec["restart_after_s"] = round(rng.uniform(0.0, 2.0), 2)
            time.sleep(rec["restart_after_s"])
            self.start_manager()
        elif kind == "disk_full":
            rec["host"] = None
            rec["filled_bytes"] = self.fill_store()
        elif kind == "malformed_traffic":
            rec["host"] = None
            rec.update(self.hostile_peers())
        elif kind == "preempt_notice":
            deadline = time.time() + self.notice_s
            self.notices.write_text(f"{victim} {deadline:.3f}\n")
            rec["deadline"] = deadline
            while time.time() < deadline:
                time.sleep(0.05)
            self.take(victim)
        elif kind == "preempt_sudden":
            self.take(victim)
        else:
            raise ValueError(kind)
        return rec

    def take(self, name: str) -> None:
        """The VM is gone: its sshd and everything it started killed, then off the host file."""
        self.th.remove(name)
        del self.up[name]
        self.write_hosts()

    def fill_store(self) -> int:
        """Fill the store's tmpfs to the last byte (unbuffered writes until ENOSPC)."""
        n = 0
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                chunk = b"\0" * size
                while True:
                    try:
                        n += os.write(fd, chunk)
                    except OSError:
                        break
        finally:
            os.close(fd)
        return n

    def free_store(self) -> None:
        try:
            self.filler.unlink()
        except FileNotFoundError:
            pass

    def hostile_peers(self) -> dict:
        """Hostile traffic to the job's heartbeat port; returns what was sent."""
        addr = self.heartbeat_addr()
        if addr is None:
            raise RuntimeError("no heartbeat address found in a worker's environment")
        sent = {"addr": f"{addr[0]}:{addr[1]}", "connections": 0, "errors": 0}

        def conn() -> tuple[socket.socket, str | None]:
            s = socket.create_connection(addr, timeout=3)
            sent["connections"] += 1
            try:
                nonce = json.loads(s.makefile("rb").readline()).get("nonce")
            except (ValueError, OSError, AttributeError):
                nonce = None
            return s, nonce

        hb = lambda nonce, **kw: json.dumps({"v": 1, "type": "hb", "job": "chaos", "host": "vm0", "rank": 0,  # noqa: E731
                                             "seq": 1, "nonce": nonce, "cnonce": "c" * 32, "time": time.time(),
                                             **kw})
        lines = [b"\x00\xff\xfe garbage \x01\x02",
                 b'{"mac":"x","msg":"\\ud800"}',
                 b"[" * 50_000,
                 b'{"mac":"\\u0100","msg":"x"}',
                 b"{}" * 10_000, b"1e999999"]
        held = []
        for raw in lines:
            try:
                s, _ = conn()
                s.sendall(raw + b"\n")
                held.append(s)
            except OSError:
                sent["errors"] += 1
        try:   # envelopes with bad MACs around plausible messages
            for k in range(3):
                s, nonce = conn()
                body = hb(nonce, step=10_000 + k)
                s.sendall((json.dumps({"mac": "0" * 64, "msg": body}) + "\n").encode())
                s.sendall((json.dumps({"mac": "f" * 63, "msg": hb(nonce, type="bye", status="stopped")}) + "\n")
                          .encode())
                held.append(s)
        except OSError:
            sent["errors"] += 1
        try:   # a line over the size limit, never finished
            s, _ = conn()
            s.sendall(b"A" * (200 * 1024))
            held.append(s)
        except OSError:
            sent["errors"] += 1
        try:   # a half line, held open
            s, nonce = conn()
            s.sendall(b'{"mac": "' + b"1" * 32)
            held.append(s)
        except OSError:
            sent["errors"] += 1
        for _ in range(30):   # a burst of silent connections
            try:
                s, _ = conn()
                held.append(s)
            except OSError:
                sent["errors"] += 1
        time.sleep(2.0 + 2 * INTERVAL)
        for s in held:
            try:
                s.close()
            except OSError:
                pass
        return {"traffic": sent}

    def undo(self, rec: dict) -> None:
        """After the job runs again: bring back what the fault took (a VM, a link, the disk)."""
        kind = rec["kind"]
        if kind in ("worker_sigstop", "network_cut"):
            from varuna_sdk.cluster.sshd_procs import _is_zombie, _pid_alive

            alive = lambda p: _pid_alive(p) and not _is_zombie(p)  # noqa: E731
            # the hung (or cut off) worker of the old generation: did the morph end it?
            rec["left_running_after_morph"] = [p for p in rec["pids"] if alive(p)]
            if kind == "worker_sigstop":
                try:
                    os.kill(rec["pid"], signal.SIGCONT)
                except ProcessLookupError:
                    pass
            elif rec["host"] in self.th:
                self.th.cut(rec["host"], False)
            def watch(t0: float = time.time()) -> None:   # in the background: the job trains on
                while any(alive(p) for p in rec["left_running_after_morph"]) and time.time() - t0 < 30.0:
                    time.sleep(0.1)
                left = [p for p in rec["left_running_after_morph"] if alive(p)]
                rec["exited_after_resume_s"] = None if left else round(time.time() - t0, 2)
                rec["still_running_30s_after_resume"] = left

            th = threading.Thread(target=watch, daemon=True)
            th.start()
            self.watchers.append(th)
        elif kind in ("preempt_notice", "preempt_sudden"):
            self.notices.write_text("")
            self.add_host(rec["host"])
        elif kind == "disk_full":
            self.free_store()

    # --------------------------------------------------------------------------- the run
    def run_schedule(self, schedule: list[str], rng: random.Random) -> tuple[list[dict], str | None]:
        for i in range(HOSTS):
            self.add_host(f"vm{i}")
        self.start_manager()
        self._verifier_thread.start()
        faults: list[dict] = []
        stopped_early = None
        self.wait_running(3, 300)
        for i, kind in enumerate(schedule):
            k = rng.randint(*GAP)
            s = self.wait_running(k, 300)
            jitter = rng.uniform(0.0, 0.5)
            time.sleep(jitter)
            s = self.snapshot()
            if s["last_step"] is not None and s["last_step"] > self.steps - 60:
                stopped_early = f"job near its end (step {s['last_step']} of {self.steps}) before fault {i + 1}"
                break
            hosts = self.plan_hosts()
            victim = rng.choice(sorted(h for h in hosts if h in self.th))
            n_morphs = len(s["morphs"])
            where = victim if kind not in ("manager_kill9", "disk_full", "malformed_traffic") else "-"
            print(f"fault {i + 1}/{len(schedule)}: {kind:<17} on {where:<4} "
                  f"(generation {s['generation']}, step {s['last_step']}, plan on {hosts})", flush=True)
            rec = self.inject(kind, victim, rng)
            rec.update({"index": i, "after_gen_steps": k, "jitter_s": round(jitter, 3), "step_before": s["last_step"],
                        "generation_before": s["generation"], "morphs_before": n_morphs})
            expect_morph = kind not in ("malformed_traffic", "disk_full")
            try:
                if kind == "disk_full":
                    rec["noticed"] = self.await_disk_full_noticed(rec["t"], 60.0)
                    self.undo(rec)
                    rec["undone"] = True
                    expect_morph = rec["noticed"] is not None
                s2 = self.wait_running(GAP[0], 240, min_morphs=n_morphs + (1 if expect_morph else 0))
                rec["survived"] = True
            except (JobGone, TimeoutError) as e:
                rec["survived"] = False
                rec["error"] = str(e)
                faults.append(rec)
                print(f"  NOT SURVIVED: {e}", flush=True)
                stopped_early = f"fault {i + 1} ({kind}) not survived: {e}"
                break
            new = s2["morphs"][n_morphs:]
            rec["morphs"] = new
            if not rec.get("undone"):
                self.undo(rec)
            rec["t_done"] = time.time()
            faults.append(rec)
            desc = ", ".join(f"{m['cause']} downtime {None if m['downtime_s'] is None else round(m['downtime_s'], 1)} s "
                             f"lost {m['steps_lost']}" for m in new) or "no morph"
            print(f"  survived: {desc}", flush=True)
        return faults, stopped_early

    def await_disk_full_noticed(self, t0: float, timeout_s: float) -> dict | None:
        """Until the job noticed the full store (a worker failed / the generation ended), or
        ``timeout_s``; returns the event that showed it (None: not noticed)."""
        from varuna_sdk.manager.events import Kind

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            log = self.log()
            try:
                evs = [e for e in log.events(kind=(Kind.WORKER_FAILED, "generation_failed", "generation_ended",
                                                   Kind.HOST_LOST)) if e.time >= t0]
            finally:
                log.close()
            if evs:
                e = evs[0]
                return {"kind": e.kind, "after_s": round(e.time - t0, 2), "host": e.host,
                        "error": str(e.payload.get("error", e.payload.get("reason", "")))[:300]}
            if not self.manager_alive():
                return {"kind": "manager_exited"}
            time.sleep(0.2)
        return None

    def finish(self, timeout_s: float) -> int | None:
        """Wait for the manager to end the job; its exit code (None: killed after the timeout)."""
        try:
            return self.manager.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.manager.pid, signal.SIGKILL)
            self.manager.wait(10)
            return None

    def close(self) -> dict:
        """Stop everything; report what was left before and after."""
        from ssh_hosts import procs_left

        out: dict = {}
        self._stop_verifier.set()
        if self._verifier_thread.is_alive():
            self._verifier_thread.join(30.0)
        if self.manager_alive():
            os.killpg(self.manager.pid, signal.SIGKILL)
            self.manager.wait(10)
        out["worker_processes_before_close"] = sorted(
            {p for name in list(self.up) if name in self.th for p in self.worker_pids(name)})
        try:
            self.th.close()
        except RuntimeError as e:
            out["test_host_close_error"] = str(e)
        out["procs_left"] = procs_left(str(self.root), timeout_s=15.0)
        self.free_store()
        if self.mounted:
            r = subprocess.run(["umount", str(self.store)], capture_output=True, text=True)
            if r.returncode != 0:
                time.sleep(1.0)
                r = subprocess.run(["umount", "-l", str(self.store)], capture_output=True, text=True)
            self.mounted = r.returncode != 0
        mounts = Path("/proc/mounts").read_text()
        out["tmpfs_mounted"] = str(self.store) in mounts
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        out["namespaces_left"] = [line.split()[0] for line in ns.splitlines()
                                  if line.startswith(f"varuna-th-{os.getpid()}-")]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        mine = ("vvb", "vvh")
        from varuna_sdk.cluster.sshd_procs import _b36

        out["links_left"] = [ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines()
                             if len(ln.split(":")) > 1 and ln.split(":")[1].strip().startswith(
                                 tuple(p + _b36(os.getpid()) + "-" for p in mine))]
        return out


# ================================================================================== the analysis
def read_metrics_file(path: Path) -> tuple[list[dict], int]:
    rows, bad = [], 0
    if not path.exists():
        return rows, bad
    for line in path.read_text(errors="replace").splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(m, dict) and isinstance(m.get("step"), int):
            rows.append(m)
    return rows, bad


def retrained_by_generation(rows: list[dict]) -> dict[int, dict]:
    """Per generation (in the order rank 0 wrote them): its first step and the steps it re-trained
    (done before by an earlier generation)."""
    out: dict[int, dict] = {}
    best = -1
    order: list[int] = []
    for m in rows:
        g = int(m.get("generation", -1))
        if g not in out:
            order.append(g)
            out[g] = {"first_step": m["step"], "first_wall_time": m.get("wall_time"),
                      "retrained": max(0, best + 1 - m["step"]), "rows": 0, "max_step_before": best}
        out[g]["rows"] += 1
        best = max(best, m["step"])
    return out


def reference_losses(steps: int, out: Path) -> dict[int, float]:
    """The uninterrupted run: P=2 x D=1 in 2 spawned gloo processes, the same job and schedule,
    stopped at ``steps`` (``spawn_workers`` + ``run_worker`` + ``StopAtStep``, as
    ``tests/test_trace_replay.py`` trains its reference)."""
    from varuna_sdk.pipeline.spawn import spawn_workers
    from varuna_sdk.trainer import StopAtStep, run_worker

    out.mkdir(parents=True, exist_ok=True)
    job = chaos_job(steps, None)
    sys.stdout.flush()
    saved = os.dup(1)
    with open(out / "reference.log", "w") as f:   # the workers' step lines go there, not to the console
        os.dup2(f.fileno(), 1)
        try:
            spawn_workers(run_worker, job.parallel.P * job.parallel.D,
                          args=(job.to_dict(), str(out), None, StopAtStep(steps)),
                          timeout_s=900, work_dir=out, backend="gloo")
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    rows, _ = read_metrics_file(out / "metrics.jsonl")
    return {r["step"]: r["loss"] for r in rows}


PHASES = ("cause -> new plan (detect, stop, orphans, plan)", "launch (until every worker said hello)",
          "init + load (import, build, rendezvous, checkpoint read)", "first step")


def downtime_breakdown(run: Path, morphs: list[dict]) -> list[dict]:
    """Phases of each morph's downtime from the event log (seconds): from its cause to the plan of
    the generation that made its first step, the launch until every worker of that generation
    said hello, their start-up and checkpoint load, and the first step."""
    from varuna_sdk.manager.events import EventLog, Kind

    log = EventLog.reader(run / "events.db")
    try:
        plans = log.events(kind=Kind.PLAN)
        joined = log.events(kind=Kind.WORKER_JOINED)
        metrics = log.metrics()
    finally:
        log.close()
    out = []
    for m in morphs:
        plan = max((p for p in plans if p.time <= m["logged_at"]), key=lambda p: p.time, default=None)
        if plan is None or m.get("downtime_s") is None:
            out.append({})
            continue
        g = plan.payload["generation"]
        first = min((x for x in metrics if x.get("generation") == g), key=lambda x: x["step"], default=None)
        hello = [e.time for e in joined if plan.time <= e.time <= m["logged_at"]]
        if first is None or not hello:
            out.append({"generation": g})
            continue
        end = float(first.get("wall_time") or first["time"])
        vals = (plan.time - m["time"], max(hello) - plan.time, end - first["step_time_s"] - max(hello),
                first["step_time_s"])
        out.append({"generation": g, **{k: round(v, 3) for k, v in zip(PHASES, vals)}})
    return out


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    if len(v) == 1:
        return v[0]
    i = q * (len(v) - 1)
    lo = int(i)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (i - lo)


def make_schedule(n: int, rng: random.Random, quick: bool) -> list[str]:
    if quick:
        kinds = list(KINDS)
        rng.shuffle(kinds)
        return kinds[:n]
    sched = [KINDS[i % len(KINDS)] for i in range(n)]
    rng.shuffle(sched)
    return sched


def main() -> None:
    def extra(ap):
        ap.add_argument("--seed", type=int, default=1, help="seed of the fault schedule (default 1)")
        ap.add_argument("--faults", type=int, default=None, help="faults to inject (default 32; quick 6)")
        ap.add_argument("--notice", type=float, default=6.0, help="pre-emption notice, seconds (default 6)")
        ap.add_argument("--keep", action="store_true", help="keep the work folder (printed) for inspection")

    args = common.parse_args(__doc__.splitlines()[0], extra)
    from varuna_sdk.cluster.sshd_hosts import netns_skip_reason
    from varuna_sdk.cluster.sshd_procs import reap_stale

    reason = netns_skip_reason()
    if reason:
        sys.exit(f"bench_chaos needs namespace test hosts: {reason}")
    reap_stale()
    n = args.faults or (6 if args.quick else 32)
    rng = random.Random(args.seed)
    schedule = make_schedule(n, rng, args.quick)
    steps = 20 * n + 120
    idle = common.wait_for_idle(args.wait_idle)
    load0 = common.load_average()
    from varuna_sdk.data.loader import tokenize_corpus
    from varuna_sdk.profiling.job import calibrate_job

    job = chaos_job(steps, None)
    tokenize_corpus(job.data.corpus, job.data.tokenizer)
    calibrate_job(job)   # cached: the manager's first plan does not pay for it
    tmp = Path(tempfile.mkdtemp(prefix="varuna-bench-chaos-"))
    print(f"work folder {tmp}; {n} faults, seed {args.seed}: {schedule}", flush=True)
    chaos = Chaos(tmp, steps, args.notice, max_failures=2 + schedule.count("disk_full"))
    t0 = time.monotonic()
    faults, stopped_early, rc, cleanup = [], None, None, {}
    try:
        faults, stopped_early = chaos.run_schedule(schedule, rng)
        print("faults done; the job trains to its end", flush=True)
        rc = chaos.finish(900)
        for w in chaos.watchers:
            w.join(40.0)
        chaos.check_loads()
    finally:
        wall_chaos = time.monotonic() - t0
        cleanup = chaos.close()
    summary = json.loads(chaos.summary_file.read_text()) if chaos.summary_file.exists() else {}
    # ---- what the job kept
    from varuna_sdk.manager.events import EventLog, Kind

    log = EventLog.reader(chaos.run / "events.db")
    try:
        final = {m["step"]: m["loss"] for m in log.metrics()}
        morphs = [{**e.payload, "logged_at": e.time} for e in log.events(kind=Kind.MORPH)]
        auth_failed = [e for e in log.events(kind=(Kind.AUTH_FAILED, Kind.AUTH_FAILED_SUPPRESSED))]
        states = [e.payload for e in log.events(kind=Kind.JOB_STATE)]
    finally:
        log.close()
    for m, b in zip(morphs, downtime_breakdown(chaos.run, morphs)):
        m["breakdown_s"] = b
    rows, torn_rows = read_metrics_file(chaos.run / "metrics.jsonl")
    per_gen = retrained_by_generation(rows)
    # ---- the uninterrupted run
    t1 = time.monotonic()
    done_steps = max(final) + 1 if final else 0
    ref = reference_losses(done_steps, tmp / "reference") if done_steps else {}
    wall_ref = time.monotonic() - t1
    missing = sorted(set(ref) - set(final))
    extra_steps = sorted(set(final) - set(ref))
    rel = [abs(final[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in ref if s in final]
    max_rel = max(rel) if rel else float("nan")
    bad_steps = [s for s in ref if s in final and abs(final[s] - ref[s]) > 1e-5 * abs(ref[s])]
    # ---- per fault: morphs, steps lost (manager / independent), downtime
    windows = [(f["t"], faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")) for i, f in enumerate(faults)]
    gens_by_fault: dict[int, list[int]] = {}
    for g, info in per_gen.items():
        if g == 0 or info.get("first_wall_time") is None:
            continue
        for i, (a, b) in enumerate(windows):
            if a <= info["first_wall_time"] < b:
                gens_by_fault.setdefault(i, []).append(g)
    mismatches = []
    for i, f in enumerate(faults):
        a, b = windows[i]
        f["morphs"] = ms = [m for m in morphs if a <= m["logged_at"] < b]
        f["steps_lost_manager"] = sum(int(m.get("steps_lost") or 0) for m in ms)
        f["generations"] = gens_by_fault.get(i, [])
        f["steps_lost_counted"] = sum(per_gen[g]["retrained"] for g in f["generations"])
        f["downtime_s"] = [m.get("downtime_s") for m in ms]
        if f["steps_lost_manager"] != f["steps_lost_counted"]:
            mismatches.append(i)
    walls = sorted(float(r["wall_time"]) for r in rows if r.get("wall_time"))
    for i, f in enumerate(faults):   # the longest time without a finished step around the fault (metrics.jsonl)
        a, b = windows[i]
        gaps = [walls[j + 1] - walls[j] for j in range(len(walls) - 1) if a <= walls[j + 1] < b]
        f["training_gap_s"] = round(max(gaps), 3) if gaps else None
    kinds_seen = sorted({f["kind"] for f in faults})
    survived = [f for f in faults if f.get("survived")]
    job_ok = summary.get("state") == "SUCCEEDED" and rc == 0
    # a fault counts as survived when the job ran again after it (and, for the last, finished the run)
    n_survived = len([f for f in survived if job_ok or f is not faults[-1]])
    counts = {k: sum(1 for f in faults if f["kind"] == k) for k in KINDS}
    by_kind = {}
    for k in KINDS:
        fs = [f for f in faults if f["kind"] == k]
        if not fs:
            continue
        down = [d for f in fs for d in f["downtime_s"] if d is not None]
        gaps = [f["training_gap_s"] for f in fs if f.get("training_gap_s") is not None]
        by_kind[k] = {"faults": len(fs), "survived": sum(1 for f in fs if f.get("survived")),
                      "training_gap_s": {"median": pct(gaps, 0.5), "p90": pct(gaps, 0.9),
                                         "max": max(gaps) if gaps else None, "values": gaps},
                      "morphs": [m["cause"] for f in fs for m in f.get("morphs", [])],
                      "steps_lost_manager": [f["steps_lost_manager"] for f in fs],
                      "steps_lost_counted": [f["steps_lost_counted"] for f in fs],
                      "downtime_s": {"median": pct(down, 0.5), "p90": pct(down, 0.9), "max": max(down) if down else None,
                                     "n": len(down), "values": [round(d, 2) for d in down]}}
        parts = [m["breakdown_s"] for f in fs for m in f.get("morphs", []) if m.get("breakdown_s", {}).get(PHASES[0])
                 is not None]
        if parts:
            by_kind[k]["downtime_s"]["breakdown_median_s"] = {ph: round(statistics.median(b[ph] for b in parts), 2)
                                                              for ph in PHASES}
    lost_no = [f["steps_lost_counted"] for f in faults if f["kind"] in NO_LOSS_KINDS]
    lost_no += [f["steps_lost_manager"] for f in faults if f["kind"] in NO_LOSS_KINDS]
    lost_yes = [max(f["steps_lost_counted"], f["steps_lost_manager"]) for f in faults
                if f["kind"] not in NO_LOSS_KINDS and f["kind"] != "disk_full"]
    lost_disk = [max(f["steps_lost_counted"], f["steps_lost_manager"]) for f in faults if f["kind"] == "disk_full"]
    all_down = [d for f in faults for d in f["downtime_s"] if d is not None]
    loaded = [x for x in chaos.loads if x["checkpoint"]]
    torn_loaded = [x for x in loaded if x["verified"]["ok"] is False]
    unverified = [x for x in loaded if x["verified"]["ok"] is None]
    resume_mismatch = []
    for x in loaded:
        if x["verified"].get("ok") and x["verified"]["step"] != x["step"]:
            resume_mismatch.append(x)
    rejected = sorted({name for x in chaos.loads for name, _ in x.get("skipped", [])})
    left = (len(cleanup.get("procs_left", [])) + len(cleanup.get("worker_processes_before_close", []))
            + int(bool(cleanup.get("tmpfs_mounted"))) + len(cleanup.get("namespaces_left", []))
            + len(cleanup.get("links_left", [])))
    F = common.Figure
    figures = [
        F(f"faults survived of {len(faults)} injected (job {summary.get('state', '?')} at the end)", n_survived,
          "faults", baseline=len(faults), target=">= 1.0",
          detail={"by_kind": counts, "job_state": summary.get("state"), "manager_exit_code": rc,
                  "stopped_early": stopped_early, "error": summary.get("error")}),
        F(f"faults injected (target >= 30) of {len(kinds_seen)} kinds (target >= 5)",
          len(faults), "faults", ratio=min(len(faults) / 30, len(kinds_seen) / 5), target=">= 1.0",
          detail={"kinds": kinds_seen, "ratio_is": "min(faults / 30, kinds / 5)", "seed": args.seed,
                  "schedule": schedule}),
        F("steps lost, faults with notice or off the training path (notice, manager restart, hostile peers; max)",
          max(lost_no) if lost_no else 0, "steps", ratio=float(max(lost_no) if lost_no else 0), target="<= 0",
          detail={"kinds": NO_LOSS_KINDS}),
        F(f"steps lost without notice (worker kill/stop, network cut, sudden pre-emption; max) vs the checkpoint "
          f"interval ({EVERY})", max(lost_yes) if lost_yes else 0, "steps", baseline=EVERY, target="<= 1.0",
          detail={"values": lost_yes}),
    ]
    if lost_disk:
        figures.append(F(f"steps lost, full checkpoint store (max) vs 2 checkpoint intervals ({2 * EVERY})",
                         max(lost_disk), "steps", baseline=2 * EVERY, target="<= 1.0",
                         detail={"values": lost_disk, "why_2": "the write that failed was to be the newest "
                                 "checkpoint: the job resumes from the one before it"}))
    figures += [
        F("faults whose re-trained steps (metrics.jsonl, counted here) differ from the manager's steps_lost",
          len(mismatches), "faults", ratio=float(len(mismatches)), target="<= 0",
          detail={"faults": [{"index": faults[i]["index"], "kind": faults[i]["kind"],
                              "manager": faults[i]["steps_lost_manager"], "counted": faults[i]["steps_lost_counted"]}
                             for i in mismatches], "torn_metrics_lines": torn_rows}),
        F(f"downtime, median of {len(all_down)} morphs (p90 {pct(all_down, 0.9):.1f} s, max "
          f"{max(all_down) if all_down else float('nan'):.1f} s) vs {DOWNTIME_TARGET_S:.0f} s",
          pct(all_down, 0.5), "s", ratio=pct(all_down, 0.5) / DOWNTIME_TARGET_S, target="< 1",
          detail={"by_kind": {k: v["downtime_s"] for k, v in by_kind.items()}, "stats": common.stats(all_down)}),
    ]
    for k, v in by_kind.items():
        d = v["downtime_s"]
        if d["n"]:
            figures.append(F(f"  downtime {k} (median of {d['n']}; p90 {d['p90']:.1f} s, max {d['max']:.1f} s)",
                             d["median"], "s", detail=d))
    hung = [f for f in faults if f["kind"] in ("worker_sigstop", "network_cut")]
    if hung:
        n_left = sum(1 for f in hung if f.get("left_running_after_morph"))
        figures.append(F(f"hung / cut-off workers still running after their morph ({len(hung)} SIGSTOP and network-cut "
                         "faults; they end once resumed)", n_left, "faults", ratio=float(n_left), target="<= 0",
                         detail={"per_fault": [{"index": f["index"], "kind": f["kind"], "host": f["host"],
                                                "left_running_after_morph": f.get("left_running_after_morph"),
                                                "exited_after_resume_s": f.get("exited_after_resume_s"),
                                                "still_running_30s_after_resume": f.get("still_running_30s_after_resume")}
                                               for f in hung],
                                 "why": "Generation.stop skips every host the heartbeat server declared lost, so a "
                                        "worker that hangs on a VM that still answers SSH is not killed by the morph"}))
    hostile = [f for f in faults if f["kind"] == "malformed_traffic"]
    if hostile:
        n_m = sum(len(f["morphs"]) for f in hostile)
        figures.append(F(f"morphs during {len(hostile)} bursts of hostile heartbeat traffic (the job must not notice)",
                         n_m, "morphs", ratio=float(n_m), target="<= 0",
                         detail={"longest_step_gap_s": [f.get("training_gap_s") for f in hostile],
                                 "auth_failed_rows": len(auth_failed), "traffic": [f.get("traffic") for f in hostile]}))
    figures += [
        F(f"max relative loss difference vs the uninterrupted run over {len(rel)} steps (dropout 0.1) vs 1e-5",
          max_rel, "", baseline=1e-5, target="<= 1.0",
          detail={"steps_compared": len(rel), "steps_missing": missing[:50], "steps_extra": extra_steps[:50],
                  "steps_off": bad_steps[:50], "reference_steps": len(ref)}),
        F(f"torn checkpoints loaded ({len(loaded)} loads, {len(loaded) - len(torn_loaded) - len(unverified)} "
          f"re-verified, {len(rejected)} candidates rejected by the workers)",
          len(torn_loaded) + len(resume_mismatch), "", ratio=float(len(torn_loaded) + len(resume_mismatch)),
          target="<= 0",
          detail={"loads": chaos.loads, "unverified_gone": [x["checkpoint"] for x in unverified],
                  "resume_step_mismatch": resume_mismatch, "rejected": rejected,
                  "checkpoints_verified_in_store": sum(1 for v in chaos.verified.values() if v["ok"]),
                  "checkpoints_failing_verification": {k: v for k, v in chaos.verified.items() if v["ok"] is False},
                  "verifier_errors": chaos.verify_errors[:20],
                  "how": "a thread re-verifies every complete checkpoint in the store every 0.3 s (signed manifest, "
                         "each file's size and SHA-256, with the product's Store); each 'resumed from NAME' line of "
                         "a generation's rank-0 log is looked up there"}),
        F("left after the run: processes, worker processes, tmpfs, namespaces, links", left, "", ratio=float(left),
          target="<= 0", detail=cleanup),
    ]
    common.print_table("Chaos: seeded faults on SSH test hosts (tiny GPT-2, 2-core testbed)", figures)
    wall = wall_chaos + wall_ref
    notes = (f"{len(faults)} faults (seed {args.seed}) of {len(kinds_seen)} kinds on a tiny GPT-2 job (first "
             "generation P=2 x D=1, then as planned) "
             f"(dropout 0.1, {steps} steps, checkpoint every {EVERY}) on {HOSTS} network-namespace sshd test hosts; the "
             "manager is its own process (launch_job on a watched host file plus a notices file; grow and "
             "straggler rules off), SIGKILLed and restarted by the manager_kill9 faults; checkpoints on a "
             f"{STORE_MB} MiB tmpfs filled by the disk_full faults. Chaos run {wall_chaos:.0f} s, reference "
             f"{wall_ref:.0f} s. Steps lost per fault: re-trained steps in metrics.jsonl (independent) next to the "
             "manager's MorphRecord.steps_lost. Torn checkpoints: a thread re-verified every complete checkpoint in "
             "the store every 0.3 s (signed manifest, sizes, SHA-256) and each 'resumed from' checkpoint was looked up there. "
             "Machine shared with other work: see "
             "load_average.")
    common.write_results("chaos", figures, notes,
                         machine=common.machine_info(load_average=[load0, common.load_average()], idle_before=idle),
                         extra={"quick": bool(args.quick), "seed": args.seed, "wall_s": round(wall, 1),
                                "faults": faults, "morphs": morphs, "by_kind": by_kind,
                                "generations": {str(k): v for k, v in per_gen.items()},
                                "auth_failed_rows": len(auth_failed), "job_states": [s["state"] for s in states],
                                "manager_starts": chaos.manager_starts, "summary": summary}, out=args.out)
    if args.keep:
        print(f"kept {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-manager":
        sys.exit(child_main(sys.argv[2:]))
    main()
