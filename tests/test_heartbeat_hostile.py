"""The heartbeat server against hostile and unlucky peers (real TCP sockets on loopback).

Shown: every line a peer can send — found ones (a lone surrogate in ``msg``, deep nesting, a
non-ASCII MAC, each of which used to end the server's thread) and hypothesis-generated ones,
unauthenticated or signed with the job's key — refuses that connection only: afterwards the
server thread is alive and a genuine worker still joins and is recorded. Refusals write a bounded
number of ``auth_failed`` rows per window plus one summary row; a signed hello from a (host, rank)
the generation never placed is refused; with the process's descriptors exhausted the accept loop
backs off instead of spinning, and serves again once descriptors are free.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varuna_sdk.cluster.hosts import Secret
from varuna_sdk.manager.events import EventLog, Kind
from varuna_sdk.manager.heartbeat_client import HeartbeatClient
from varuna_sdk.manager.heartbeat_server import HeartbeatServer, RefusalBudget
from varuna_sdk.manager.wire import derive_key, encode

pytestmark = pytest.mark.timeout(120)

JOB = "job-hostile"


@pytest.fixture
def server(tmp_path):
    secret = Secret(secrets.token_urlsafe(24))
    log = EventLog(tmp_path / "events.db")
    srv = HeartbeatServer(JOB, secret, log, interval_s=0.5).start()
    srv.test_secret = secret
    yield srv
    srv.close()
    log.close()


def _connect(srv: HeartbeatServer) -> tuple[socket.socket, str]:
    s = socket.create_connection(srv.address, timeout=5)
    f = s.makefile("rb")
    nonce = json.loads(f.readline())["nonce"]
    return s, nonce


def _closed(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
            # a signed line may be acked first: read on until the server closes
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _genuine_worker_joins(srv: HeartbeatServer, rank: int) -> None:
    """A real client joins and its heartbeat is recorded: the server is alive and serving."""
    assert srv._thread is not None and srv._thread.is_alive(), "the heartbeat server thread died"
    c = HeartbeatClient(srv.address, srv.test_secret, job_id=JOB, host=f"ok{rank}", rank=rank,
                        interval_s=0.2).start()
    try:
        c.record_step(1, loss=1.0)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            s = srv.senders().get((f"ok{rank}", rank))
            if s is not None and s.heartbeats:
                return
            time.sleep(0.05)
        raise AssertionError("a genuine worker's heartbeat was not recorded")
    finally:
        c.close()


def _signed(srv: HeartbeatServer, conn_nonce: str, **fields) -> bytes:
    msg = {"v": 1, "type": "hb", "job": JOB, "host": "vm1", "rank": 1, "seq": 1, "nonce": conn_nonce,
           "cnonce": "c" * 32, "time": 0, **fields}
    return encode(derive_key(srv.test_secret), msg)


def _signed_text(srv: HeartbeatServer, text: str) -> bytes:
    """A line whose MAC is right for an arbitrary authenticated ``text``."""
    import hashlib
    import hmac
    mac = hmac.new(derive_key(srv.test_secret), text.encode("utf-8", "surrogatepass"),
                   hashlib.sha256).hexdigest()
    return (json.dumps({"mac": mac, "msg": text}) + "\n").encode()


# lines that ended the server's thread before (each one alone, unauthenticated), and relatives
KILLERS = [
    b'{"mac":"x","msg":"\\ud800"}',                              # lone surrogate: encode() raised
    b"[" * 50_000,                                               # RecursionError in json.loads
    b'{"mac":"a","msg":' + b"[" * 3000 + b"]" * 3000 + b"}",     # nested inside the envelope
    b'{"mac":"\\u0100","msg":"x"}',                              # compare_digest on non-ASCII
    b'{"mac":"' + b"0" * 64 + b'","msg":"\\ud800\\udfff\\ud800"}',
    b"\x00" * 100, b"\xff\xfe\xfd", b"1e999999", b'"' + b"\\" * 1000 + b'"', b"{}" * 10000,
]


@pytest.mark.parametrize("line", KILLERS, ids=range(len(KILLERS)))
def test_a_hostile_line_refuses_only_its_connection(server, line):
    s, _ = _connect(server)
    s.sendall(line + b"\n")
    assert _closed(s), "the connection was not refused"
    _genuine_worker_joins(server, rank=0)
    assert server.events.events(kind=Kind.AUTH_FAILED)


def test_signed_messages_with_odd_fields_refuse_or_are_ignored_never_kill(server):
    """Authenticated (right key, nonce and seq) but odd: deep nesting, wrong types, huge values."""
    odd = [{"metrics": "x"}, {"metrics": [1, None, "s", {"step": "1"}, {"step": 10 ** 400}]},
           {"metrics": [{"step": 3, "loss": [[[]]]}]}, {"pid": 10 ** 30}, {"rank": -1}, {"rank": True},
           {"host": "h" * 5000}, {"type": "bye", "status": {"x": 1}, "error": ["e"]},
           {"metrics_dropped": 10 ** 30}, {"step": {"a": [1]}, "loss": "nan"}, {"cnonce": 5}]
    for i, fields in enumerate(odd):
        s, nonce = _connect(server)
        s.sendall(_signed(server, nonce, **fields))
        s.sendall(_signed_text(server, "[" * 5000 + "]" * 5000))  # authentic but absurd text
        assert _closed(s), fields
        s, nonce = _connect(server)   # authentic NaN / Infinity (json.loads accepts them)
        s.sendall(_signed_text(server, json.dumps({"v": 1, "type": "hb", "job": JOB, "host": "vm2",
                                                   "rank": 2, "seq": 1, "nonce": nonce, "cnonce": "d" * 32,
                                                   "step": float("nan"), "loss": float("inf"),
                                                   "metrics": [{"step": 1, "loss": float("nan")}]})))
        s.sendall(b"\n")
        assert _closed(s), fields
    _genuine_worker_joins(server, rank=0)


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                            lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
_fields = st.dictionaries(st.sampled_from(["type", "host", "rank", "seq", "step", "loss", "metrics",
                                           "pid", "status", "error", "cnonce", "v", "job", "nonce"]),
                          _json_values, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300), fields=_fields)
def test_any_bytes_or_signed_fields_leave_the_server_alive(server, raw, fields):
    s, nonce = _connect(server)
    try:
        s.sendall(raw.replace(b"\n", b" ") + b"\n")
        assert _closed(s)
    finally:
        s.close()
    s, nonce = _connect(server)
    try:
        s.sendall(_signed(server, nonce, **fields))
        s.sendall(b"\n")  # an empty line: malformed, so every connection ends refused
        assert _closed(s)
    finally:
        s.close()
    assert server._thread.is_alive()


def test_genuine_worker_after_the_hypothesis_run(server):
    for _ in range(20):
        s, _n = _connect(server)
        s.sendall(b"\xff\n")
        _closed(s)
    _genuine_worker_joins(server, rank=3)


def test_refusals_write_bounded_rows_and_a_summary(server):
    server.refusals = RefusalBudget(rows_per_window=5, window_s=1.5)
    n = 200
    for _ in range(n):
        s, _n = _connect(server)
        s.sendall(b"junk\n")
        _closed(s)
        s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not server.events.events(kind=Kind.AUTH_FAILED_SUPPRESSED):
        time.sleep(0.1)
    rows = server.events.events(kind=Kind.AUTH_FAILED)
    summary = server.events.events(kind=Kind.AUTH_FAILED_SUPPRESSED)
    # 5 rows per 1.5 s window: 200 refusals take well under a few windows here
    windows = 1 + int((time.monotonic() - (deadline - 10)) / 1.5) + 1
    assert len(rows) <= 5 * windows, len(rows)
    assert summary and sum(e.payload["suppressed"] for e in summary) + len(rows) == n
    assert summary[0].payload["peers"] == ["127.0.0.1"]
    assert summary[0].payload["reasons"] == {"malformed: not a JSON line": summary[0].payload["suppressed"]}


def test_a_signed_hello_from_a_rank_never_placed_is_refused(tmp_path):
    secret = Secret(secrets.token_urlsafe(24))
    log = EventLog(tmp_path / "events.db")
    srv = HeartbeatServer(JOB, secret, log, interval_s=0.5, placed_only=True).start()
    srv.test_secret = secret
    try:
        srv.expect("ok0", 0, within_s=30)
        s, nonce = _connect(srv)
        s.sendall(_signed(srv, nonce, type="hello", host="ok0", rank=7))  # the key, not the place
        assert _closed(s)
        reasons = [e.payload["reason"] for e in log.events(kind=Kind.AUTH_FAILED)]
        assert reasons == ["host 'ok0' rank 7 was not placed in this generation"]
        assert ("ok0", 7) not in srv.senders()
        _genuine_worker_joins(srv, rank=0)   # the placed one joins
    finally:
        srv.close()
        log.close()


EXHAUST = textwrap.dedent("""
    import os, resource, secrets, socket, sys, tempfile, time
    from varuna_sdk.cluster.hosts import Secret
    from varuna_sdk.manager.events import EventLog
    from varuna_sdk.manager.heartbeat_client import HeartbeatClient
    from varuna_sdk.manager.heartbeat_server import HeartbeatServer
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))   # hard too: the server cannot raise it
    secret = Secret(secrets.token_urlsafe(24))
    log = EventLog(os.path.join(tempfile.mkdtemp(), "events.db"))
    srv = HeartbeatServer("j", secret, log, interval_s=0.5).start()
    print("limit", srv.max_connections, flush=True)
    hoard = []
    try:
        while True:
            hoard.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print("port", srv.address[1], flush=True)
    sys.stdin.readline()                 # the test has connected: accept now fails (EMFILE)
    t0 = time.process_time()
    time.sleep(2.0)
    print("cpu", time.process_time() - t0, "alive", srv._thread.is_alive(), flush=True)
    for fd in hoard:
        os.close(fd)
    c = HeartbeatClient(srv.address, secret, job_id="j", host="h", rank=0, interval_s=0.2).start()
    c.record_step(1, loss=1.0)
    ok = srv.wait_heartbeats(1, 20)
    print("joined", ok, flush=True)
    c.close()
    srv.close()
""")


def test_descriptors_exhausted_the_accept_loop_backs_off_and_recovers():
    p = subprocess.Popen([sys.executable, "-c", EXHAUST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        limit = int(p.stdout.readline().split()[1])
        assert 4 <= limit <= (256 - 64) // 2    # below the descriptor limit, with room to spare
        port = int(p.stdout.readline().split()[1])
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(5)]
        p.stdin.write("go\n")
        p.stdin.flush()
        words = p.stdout.readline().split()
        cpu, alive = float(words[1]), words[3] == "True"
        assert alive
        assert cpu < 0.5, f"the server used {cpu:.2f} s of CPU in 2 s with accept failing: it spins"
        assert p.stdout.readline().split() == ["joined", "True"]
        for s in socks:
            s.close()
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)
