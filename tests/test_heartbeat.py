"""Heartbeats (``varuna_sdk.manager.heartbeat_server`` / ``heartbeat_client``) over real TCP sockets between real processes:
heartbeats recorded in the event log, bad MACs / malformed / replayed messages rejected and
logged, a worker that freezes or dies declared lost within 2 intervals, clean and failed exits
not mistaken for losses, and the job secret never written anywhere."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from varuna_sdk.cluster.hosts import Secret
from varuna_sdk.manager.events import EventLog, Kind
from varuna_sdk.manager.heartbeat_client import HeartbeatClient
from varuna_sdk.manager.heartbeat_server import HeartbeatServer, RefusalBudget
from varuna_sdk.manager.wire import ENV_TOKEN, derive_key, encode

pytestmark = pytest.mark.timeout(60)

HB_S = 0.5  # heartbeat interval of these tests (s)

CLIENT = textwrap.dedent("""
    import os, sys, time
    from varuna_sdk.manager.heartbeat_client import HeartbeatClient
    c = HeartbeatClient.from_env()
    c.start()
    step = 0
    mode = sys.argv[1]
    while True:
        c.record_step(step, loss=5.0 - 0.1 * step, compute_s={"F": 0.04, "R": 0.04, "B": 0.08},
                      micro_batches=4, step_time_s=0.2)
        step += 1
        if mode in ("ok", "failed") and step == 3:
            c.close(status=mode, error="ValueError: boom" if mode == "failed" else None)
            sys.exit(0 if mode == "ok" else 1)
        print("step", step, flush=True)
        time.sleep(0.2)
""")


@pytest.fixture
def job(tmp_path):
    secret = Secret(secrets.token_urlsafe(24))
    log = EventLog(tmp_path / "events.db")
    server = HeartbeatServer("job-hb", secret, log, interval_s=HB_S).start()
    procs: list[subprocess.Popen] = []

    def spawn(host: str, rank: int, mode: str = "run", token: str | None = None) -> subprocess.Popen:
        env = {**os.environ, **server.worker_env(), ENV_TOKEN: token or secret.reveal(),
               "VARUNA_JOB_ID": "job-hb", "VARUNA_HOST": host, "RANK": str(rank)}
        p = subprocess.Popen([sys.executable, "-c", CLIENT, mode], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p

    yield server, log, secret, spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        p.stdout.close()
        p.stderr.close()
    server.close()
    log.close()


def _wait_line(p: subprocess.Popen, text: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if text in line:
            return
        if not line and p.poll() is not None:
            raise AssertionError(f"client exited: {p.stderr.read()}")
    raise AssertionError(f"no {text!r} from the client")


def test_heartbeats_are_recorded(job):
    server, log, secret, spawn = job
    spawn("vm0", 0)
    spawn("vm1", 1)
    assert server.wait_heartbeats(2, timeout_s=20, min_step=2)
    time.sleep(3.2 * HB_S)
    rows = log.heartbeats(job_id="job-hb", rank=1)
    assert len(rows) >= 2 and rows[-1].host == "vm1" and rows[-1].step >= 2
    r = rows[-1]
    assert r.fwd_s == pytest.approx(0.01) and r.recompute_s == pytest.approx(0.01)
    assert r.bwd_s == pytest.approx(0.02) and r.loss == pytest.approx(5.0 - 0.1 * r.step)
    assert r.mem_bytes > 10_000_000 and r.payload["peak_rss_bytes"] >= r.payload["rss_bytes"] > 0
    steady = rows[2:]  # after the hello and the at-once report of the first step
    gaps = [b.time - a.time for a, b in zip(steady, steady[1:])]
    assert all(0.5 * HB_S < g < 1.6 * HB_S for g in gaps), gaps
    joined = log.events(kind=Kind.WORKER_JOINED)
    assert {(e.host, e.rank) for e in joined} == {("vm0", 0), ("vm1", 1)}
    assert not server.lost_hosts()


def test_bad_mac_malformed_and_replayed_messages_are_rejected_and_logged(job, caplog):
    caplog.set_level(logging.DEBUG)
    server, log, secret, spawn = job
    server.refusals = RefusalBudget(rows_per_window=10_000)  # every reason recorded (budget: hostile tests)
    wrong = spawn("vm-evil", 7, token="not-the-job-secret")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not log.events(kind=Kind.AUTH_FAILED):
        time.sleep(0.05)
    ev = log.events(kind=Kind.AUTH_FAILED)
    assert ev and "bad MAC" in ev[0].payload["reason"] and ev[0].payload["peer"].startswith("127.")
    assert not log.heartbeats(rank=7) and ("vm-evil", 7) not in server.senders()
    wrong.kill()  # (it would retry, and be rejected, about once per interval)
    wrong.wait(10)
    time.sleep(0.1)
    before = sum("bad MAC" in e.payload["reason"] for e in log.events(kind=Kind.AUTH_FAILED))

    addr = server.address
    key = derive_key(secret)

    def conn() -> tuple[socket.socket, str]:
        s = socket.create_connection(addr, timeout=5)
        greeting = json.loads(s.makefile().readline())
        return s, greeting["nonce"]

    def closed(s: socket.socket) -> bool:
        s.settimeout(5)
        try:
            return s.recv(1) == b""
        except ConnectionResetError:
            return True

    base = {"v": 1, "type": "hb", "job": "job-hb", "host": "vm9", "rank": 9, "step": 1,
            "cnonce": secrets.token_hex(16)}
    # 1. a pickle (never unpickled): not JSON
    import pickle
    s, _ = conn()
    s.sendall(pickle.dumps({"step": 1}) + b"\n")
    assert closed(s)
    # 2. an altered message keeps its old MAC
    s, nonce = conn()
    line = json.loads(encode(key, {**base, "seq": 1, "nonce": nonce, "time": 0}))
    line["msg"] = line["msg"].replace('"step":1', '"step":999')
    s.sendall((json.dumps(line) + "\n").encode())
    assert closed(s)
    # 3. a valid line replayed on another connection (other nonce)
    s, nonce = conn()
    good = encode(key, {**base, "seq": 1, "nonce": nonce, "time": 0})
    s.sendall(good)
    s2, _ = conn()
    s2.sendall(good)
    assert closed(s2)
    # 4. the same line replayed on its own connection (seq does not increase)
    s.sendall(good)
    assert closed(s)
    # 5. oversized
    s, _ = conn()
    s.sendall(b"x" * 70_000)
    assert closed(s)
    time.sleep(0.2)
    reasons = [e.payload["reason"] for e in log.events(kind=Kind.AUTH_FAILED)]
    assert any("not a JSON line" in r for r in reasons), reasons
    assert sum("bad MAC" in r for r in reasons) == before + 1
    assert any("nonce of another connection" in r for r in reasons)
    assert any("seq did not increase" in r for r in reasons)
    assert any("longer than" in r for r in reasons)
    assert [r.step for r in log.heartbeats(rank=9)] == [1]  # only the one authentic message
    assert "rejected: bad MAC" in caplog.text


def test_frozen_worker_is_lost_within_two_intervals(job):
    server, log, secret, spawn = job
    spawn("vm0", 0)
    p = spawn("vm1", 1)
    assert server.wait_heartbeats(2, timeout_s=20, min_step=1)
    p.send_signal(signal.SIGSTOP)  # the VM freezes: socket open, nothing sent
    t_stop = time.monotonic()
    ev = server.wait_for(Kind.HOST_LOST, timeout_s=5 * HB_S, host="vm1")
    latency = time.monotonic() - t_stop
    p.kill()
    assert ev is not None, log.events()
    assert ev.payload["reason"] == "heartbeat_timeout" and ev.payload["ranks"] == [1]
    # never before 2 intervals; the slack above them only absorbs a loaded machine's scheduling
    assert latency <= 2 * HB_S + 1.0, latency
    assert 2 * HB_S - 0.05 <= ev.payload["since_last_heartbeat_s"] <= 2 * HB_S + 1.0
    assert ev.payload["detection_latency_s"] == ev.payload["since_last_heartbeat_s"]
    assert log.events(kind=Kind.HOST_LOST)[0].payload == ev.payload
    assert set(server.lost_hosts()) == {"vm1"}  # vm0 keeps beating
    time.sleep(2.5 * HB_S)
    assert set(server.lost_hosts()) == {"vm1"}
    print(f"frozen worker: lost {latency:.3f}s after SIGSTOP (interval {HB_S}s)")


def test_killed_worker_is_lost_at_once_and_only_once(job):
    server, log, secret, spawn = job
    p = spawn("vm1", 1)
    assert server.wait_heartbeats(1, timeout_s=20, min_step=1)
    t_kill = time.monotonic()
    p.kill()  # the process dies: its socket closes without a goodbye
    ev = server.wait_for(Kind.HOST_LOST, timeout_s=5 * HB_S, host="vm1")
    latency = time.monotonic() - t_kill
    assert ev is not None and ev.payload["reason"] == "connection_closed"
    assert latency < 2 * HB_S, latency
    assert [e.kind for e in log.events(host="vm1")][-2:] == [Kind.WORKER_DISCONNECTED, Kind.HOST_LOST]
    server.report_exit("vm1", 1, -9)  # the launcher notices too: no second host_lost
    time.sleep(2.5 * HB_S)
    assert len(log.events(kind=Kind.HOST_LOST)) == 1
    print(f"killed worker: lost {latency:.3f}s after SIGKILL (interval {HB_S}s)")


def test_goodbyes_are_not_losses_reports_and_no_shows_are(job):
    server, log, secret, spawn = job
    ok, failed = spawn("vm0", 0, "ok"), spawn("vm1", 1, "failed")
    assert ok.wait(20) == 0 and failed.wait(20) == 1
    time.sleep(3 * HB_S)
    assert not server.lost_hosts(), log.events()
    fin = log.events(kind=Kind.WORKER_FINISHED)
    bad = log.events(kind=Kind.WORKER_FAILED)
    assert [e.host for e in fin] == ["vm0"] and [e.host for e in bad] == ["vm1"]
    assert bad[0].payload["error"] == "ValueError: boom" and bad[0].payload["last_step"] == 2
    # the launcher reports a process death before any heartbeat timeout
    server.expect("vm2", 2, within_s=30)
    p = spawn("vm2", 2)
    assert server.wait_heartbeats(1, timeout_s=20)
    p.kill()
    server.report_exit("vm2", 2, -9, at=time.monotonic())
    ev = server.wait_for(Kind.HOST_LOST, timeout_s=1, host="vm2")
    assert ev.payload["reason"] == "worker_process_died" and ev.payload["exit_code"] == -9
    assert ev.payload["detection_latency_s"] < 1.0   # at once: no heartbeat timeout waited for
    # a worker that never joins (its VM died during bootstrap) is lost after its allowance
    server.expect("vm3", 3, within_s=2 * HB_S)
    ev = server.wait_for(Kind.HOST_LOST, timeout_s=4 * HB_S, host="vm3")
    assert ev is not None and ev.payload["reason"] == "never_joined"
    # a job stopped on purpose: silence is not a loss
    q = spawn("vm4", 4)
    assert server.wait_heartbeats(1, timeout_s=20, min_step=1)
    server.stop_expecting()
    q.kill()
    time.sleep(3 * HB_S)
    assert set(server.lost_hosts()) == {"vm2", "vm3"}


def test_secret_never_written_anywhere(job, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    server, log, secret, spawn = job
    p = spawn("vm0", 0)
    spawn("vm-evil", 5, token="wrong-" + secret.reveal()[:6])
    assert server.wait_heartbeats(1, timeout_s=20, min_step=2)
    p.kill()
    assert server.wait_for(Kind.HOST_LOST, timeout_s=5 * HB_S)
    log.append("checkpoint", payload={"ok": True})  # flush some more through the WAL
    raw = b"".join(f.read_bytes() for f in tmp_path.glob("events.db*"))
    key = derive_key(secret)
    for needle in (secret.reveal().encode(), key, key.hex().encode()):
        assert needle not in raw
    assert secret.reveal() not in caplog.text and key.hex() not in caplog.text
    assert secret.reveal() not in repr(server.__dict__) and "***" in repr(secret)
    with pytest.raises(RuntimeError, match="VARUNA_JOB_TOKEN is not"):
        HeartbeatClient.from_env({"VARUNA_HEARTBEAT_ADDR": "127.0.0.1:1"})


# --------------------------------------------------------------------- stop command and metrics
STOPPER = textwrap.dedent("""
    import sys, time
    from varuna_sdk.manager.heartbeat_client import HeartbeatClient
    c = HeartbeatClient.from_env()
    c.start()
    step = 0
    while not c.stop_requested:          # the training loop polls at each mini-batch boundary
        c.record_step(step, loss=1.0)
        step += 1
        time.sleep(0.02)
    print(f"stopping after step {step - 1}: {c.stop_reason}", flush=True)
    c.close(status="stopped")
""")


def test_stop_command_reaches_running_and_late_workers(job):
    server, log, secret, spawn = job
    env_run = {**os.environ, **server.worker_env(), ENV_TOKEN: secret.reveal(), "VARUNA_JOB_ID": "job-hb"}

    def start(host, rank):
        return subprocess.Popen([sys.executable, "-c", STOPPER], env={**env_run, "VARUNA_HOST": host,
                                "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    early = start("vm0", 0)
    try:
        assert server.wait_heartbeats(1, timeout_s=20, min_step=3)
        t0 = time.monotonic()
        server.request_stop("notice", generation=3)
        assert early.wait(10) == 0, early.stderr.read()
        took = time.monotonic() - t0
        out = early.stdout.read()
        assert "stopping after step" in out and out.strip().endswith(": notice"), out
        assert took < 2 * HB_S + 1.0, took  # sent at once, read at once (plus the interpreter's exit)
        late = start("vm1", 1)  # connects after the request: told on its first message
        assert late.wait(20) == 0, late.stderr.read()
        assert "stopping after step" in late.stdout.read()
    finally:
        for p in (early, locals().get("late")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)
    time.sleep(0.2)
    assert [e.payload for e in log.events(kind="stop_requested")] == [{"reason": "notice", "generation": 3}]
    fin = log.events(kind=Kind.WORKER_FINISHED)
    assert sorted(e.host for e in fin) == ["vm0", "vm1"] and all(e.payload["status"] == "stopped" for e in fin)
    assert not log.events(kind=Kind.WORKER_FAILED) and not server.lost_hosts()
    print(f"stop command: worker stopped and exited {took:.3f}s after request_stop")


def test_forged_or_replayed_stop_commands_are_ignored(tmp_path):
    """A fake manager sends the client stop lines that are signed with the client-direction key
    (a reflected worker line), replayed from an earlier connection, or correct: only the last
    one is obeyed; a bad line makes the client drop the connection."""
    secret = Secret(secrets.token_urlsafe(24))
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(10)
    client = HeartbeatClient(srv.getsockname(), secret, job_id="j", host="vm0", rank=0, interval_s=0.2)
    client.start()

    def accept():
        s, _ = srv.accept()
        nonce = secrets.token_hex(16)
        s.sendall((json.dumps({"v": 1, "nonce": nonce}) + "\n").encode())
        f = s.makefile("rb")
        hello = json.loads(json.loads(f.readline())["msg"])
        assert hello["type"] == "hello" and hello["nonce"] == nonce
        return s, f, nonce, hello["cnonce"]

    def stop_line(key, nonce, cnonce, seq=1):
        return encode(key, {"v": 1, "job": "j", "seq": seq, "nonce": nonce, "cnonce": cnonce,
                            "time": 0, "type": "stop", "reason": "forged"})

    def dropped(f) -> bool:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if f.readline() == b"":
                return True
        return False

    try:
        s1, f1, n1, c1 = accept()
        s1.sendall(stop_line(derive_key(secret, "client"), n1, c1))  # reflected key
        assert dropped(f1) and not client.stop_requested
        s2, f2, n2, c2 = accept()
        s2.sendall(stop_line(derive_key(secret, "server"), n2, c1))  # cnonce of connection 1
        assert dropped(f2) and not client.stop_requested
        s3, f3, n3, c3 = accept()
        assert c3 not in (c1, c2)
        s3.sendall(stop_line(derive_key(secret, "server"), n3, c3))
        deadline = time.monotonic() + 5
        while not client.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.stop_requested and client.stop_reason == "forged"
    finally:
        client.close(timeout_s=0.5)
        srv.close()


class _Proxy:
    """A TCP relay between the clients and the server whose connections can be cut."""

    def __init__(self, target):
        self.target = target
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.address = self.srv.getsockname()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        self.cuts = 0

    def start(self):
        self.srv.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self):
        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            with self.lock:
                self.pairs.append((a, b))
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    @staticmethod
    def _pump(x, y):
        try:
            while True:
                data = x.recv(65536)
                if not data:
                    break
                y.sendall(data)
        except OSError:
            pass
        for s in (x, y):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        with self.lock:
            pairs, self.pairs = self.pairs, []
            self.cuts += 1
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass

    def close(self):
        self.cut()
        self.srv.close()


METRICS = textwrap.dedent("""
    import sys, time
    from varuna_sdk.manager.heartbeat_client import HeartbeatClient
    c = HeartbeatClient.from_env()
    c.start()
    n = int(sys.argv[1])
    for step in range(n):
        c.record_step(step, loss=10.0 - step / n)
        c.record_metrics({"step": step, "loss": 10.0 - step / n, "lr": 1e-3, "note": "x" * 200})
        time.sleep(0.004)
    print("recorded", flush=True)
    c.close(status="ok", timeout_s=10)
    print(f"dropped={c.metrics_dropped} pending={c.pending_metrics} connects={c.connects}", flush=True)
""")


@pytest.mark.timeout(90)
def test_every_metrics_row_arrives_once_across_dropped_connections(job):
    """Rank 0's per-step rows reach the metrics table exactly once each, in order of steps,
    although the connection is cut three times while they stream (rows in flight are sent
    again on the next connection and de-duplicated by step)."""
    _, log, secret, spawn = job
    # a reconnect through the proxy takes a moment: not a loss here (this test is about rows)
    server = HeartbeatServer("job-hb", secret, log, interval_s=HB_S, reconnect_grace_s=5.0).start()
    proxy = _Proxy(server.address).start()
    n = 600
    env = {**os.environ, ENV_TOKEN: secret.reveal(), "VARUNA_JOB_ID": "job-hb", "VARUNA_HOST": "vm0",
           "RANK": "0", "VARUNA_HEARTBEAT_ADDR": f"{proxy.address[0]}:{proxy.address[1]}",
           "VARUNA_HEARTBEAT_INTERVAL": repr(HB_S)}
    p = subprocess.Popen([sys.executable, "-c", METRICS, str(n)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            deadline = time.monotonic() + 20
            before = server.metrics_recorded
            while server.metrics_recorded < before + 50 and time.monotonic() < deadline:
                time.sleep(0.02)
            proxy.cut()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        proxy.close()
        server.close()
    assert p.returncode == 0, err
    assert "dropped=0 pending=0" in out, out
    connects = int(out.split("connects=")[1])
    assert connects >= 4, out  # it really reconnected after each cut
    rows = log.metrics(job_id="job-hb")
    assert [r["step"] for r in sorted(rows, key=lambda r: r["step"])] == list(range(n))
    assert len(rows) == n  # once each
    assert all(r["loss"] == pytest.approx(10.0 - r["step"] / n) and r["note"] == "x" * 200 for r in rows)
    assert server.last_metric_step == n - 1
    assert log.events(kind=Kind.WORKER_FINISHED) and not server.lost_hosts()
    print(f"{n} metrics rows over {connects} connections ({proxy.cuts} cuts): all recorded once")


def test_metrics_queue_is_bounded_and_overflow_is_reported(job):
    server, log, secret, spawn = job
    proxy = _Proxy(server.address)  # not listening yet: the manager is unreachable
    client = HeartbeatClient(proxy.address, secret, job_id="job-hb", host="vm0", rank=0,
                             interval_s=HB_S, max_pending_metrics=5)
    client.start()
    try:
        for step in range(8):
            client.record_metrics({"step": step, "loss": float(step)})
        with pytest.raises(ValueError, match="integer 'step'"):
            client.record_metrics({"loss": 1.0})
        assert client.metrics_dropped == 3 and client.pending_metrics == 5
        proxy.start()  # the manager comes back
        deadline = time.monotonic() + 20
        while client.pending_metrics and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.pending_metrics == 0
    finally:
        client.close()
        proxy.close()
    time.sleep(0.2)
    assert [r["step"] for r in log.metrics()] == [0, 1, 2, 3, 4]
    ev = log.events(kind="metrics_dropped")
    assert ev and ev[0].payload == {"rows": 3} and ev[0].host == "vm0"


def test_a_worker_cut_off_from_its_manager_stops_by_itself(tmp_path):
    secret = Secret(secrets.token_urlsafe(24))
    log = EventLog(tmp_path / "events.db")
    server = HeartbeatServer("job-o", secret, log, interval_s=HB_S).start()
    client = HeartbeatClient(server.address, secret, job_id="job-o", host="vm0", rank=0,
                             interval_s=HB_S, orphan_after_s=1.5)
    client.start()
    try:
        assert server.wait_heartbeats(1, timeout_s=20)
        time.sleep(2.0)
        assert not client.stop_requested  # connected: no matter how long
        server.close()  # the manager dies
        t0 = time.monotonic()
        while not client.stop_requested and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert client.stop_requested and client.stop_reason == "manager unreachable"
        assert 1.5 <= took < 6.0, took   # never before orphan_after_s
    finally:
        client.close(timeout_s=0.5)
        log.close()


# ------------------------------------------------------------------------------- what workers load
WORKER_IMPORTS = textwrap.dedent("""
    import sys
    import {module}
    print(" ".join(sorted(m for m in sys.modules if m.startswith("varuna_sdk") or m == "torch")))
""")


@pytest.mark.parametrize("module", ["varuna_sdk.worker", "varuna_sdk.manager.heartbeat_client"])
def test_workers_load_neither_the_heartbeat_server_nor_the_event_log(module):
    """A worker imports the heartbeat client and the wire format before torch; the server side
    (``heartbeat_server``, ``loss_detection``), the event log and the manager stay out of it."""
    out = subprocess.run([sys.executable, "-c", WORKER_IMPORTS.format(module=module)],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert "varuna_sdk.manager.heartbeat_client" in out and "varuna_sdk.manager.wire" in out, out
    for absent in ("varuna_sdk.manager.heartbeat_server", "varuna_sdk.manager.loss_detection",
                   "varuna_sdk.manager.events", "varuna_sdk.manager.manager",
                   "varuna_sdk.manager.generation", "torch"):
        assert absent not in out, (absent, out)
