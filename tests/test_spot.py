"""Spot traces and the spot emulator (``varuna_sdk.cluster.spot``): the real AWS traces load with
the counts their README gives, windows and compression are exact, malformed traces fail naming
the line; the emulator replays a trace on local slots (notices ``notice_s`` wall seconds ahead,
real process death at removal, events in the job's event log) and pre-empts real sshd test hosts
by hand (sshd and every process killed, a returning VM reachable again with a new host key)."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

import pytest

from ssh_hosts import _is_zombie, skip_reason
from varuna_sdk.cluster.localproc import local_processes, start_local
from varuna_sdk.cluster.provider import HostEvent
from varuna_sdk.cluster.spot import SpotEmulator, TraceError, load_trace
from varuna_sdk.cluster.ssh import SSHConnection
from varuna_sdk.cluster.ssh_errors import HostUnreachableError
from varuna_sdk.demo import TRACES_DIR
from varuna_sdk.manager.events import EventLog, Kind

TRACES = TRACES_DIR  # the traces shipped inside the package (varuna_sdk/data/spot-traces)


class Events:
    def __init__(self):
        self.items: list[tuple[float, HostEvent]] = []
        self.cv = threading.Condition()

    def __call__(self, ev):
        with self.cv:
            self.items.append((time.monotonic(), ev))
            self.cv.notify_all()

    def wait(self, pred, timeout=10.0):
        deadline = time.monotonic() + timeout
        with self.cv:
            while time.monotonic() < deadline:
                for t, e in self.items:
                    if pred(e):
                        return t, e
                self.cv.wait(0.05)
        raise AssertionError(f"no such event; seen {[(e.kind, e.host.name) for _, e in self.items]}")


def _raw(path: Path) -> list[tuple[int, str, str]]:
    return [(int(a), b, c) for a, b, c in (line.split(",") for line in path.read_text().split())]


@pytest.mark.parametrize("name, adds, removes, peak", [("aws-p3-trace.csv", 177, 167, 32),
                                                       ("aws-g4dn-trace.csv", 79, 74, 24)])
def test_real_traces_load(name, adds, removes, peak):
    t = load_trace(TRACES / name)
    assert t.counts() == {"add": adds, "remove": removes} and t.max_nodes() == peak
    raw = _raw(TRACES / name)
    assert t.duration_s == raw[-1][0] / 1000.0 and t.raw_events == len(raw)


def test_window_and_compression_are_exact():
    path = TRACES / "aws-p3-trace.csv"
    t = load_trace(path, start_s=3600, end_s=7200, compress=120)
    raw = _raw(path)
    alive = set()
    for ms, kind, node in raw:  # the nodes up at 3600 s, computed independently
        if ms >= 3_600_000:
            break
        (alive.add if kind == "add" else alive.discard)(node)
    initial = [e for e in t.events if e.line == 0]
    assert {e.node for e in initial} == alive and all(e.t_s == 0 and e.kind == "add" for e in initial)
    inside = [(ms, k, n) for ms, k, n in raw if 3_600_000 <= ms < 7_200_000]
    rest = [e for e in t.events if e.line > 0]
    assert [(e.trace_ms, e.kind, e.node) for e in rest] == inside
    assert all(e.t_s == pytest.approx((e.trace_ms - 3_600_000) / 1000 / 120) for e in rest)
    assert t.duration_s == 30.0 and max(e.t_s for e in t.events) < 30.0
    assert t.nodes_at(0.0) == alive | {n for ms, k, n in inside if ms == 3_600_000 and k == "add"}


@pytest.mark.parametrize("body, message", [
    ("0,add,node1\n10,grow,node1\n", r"t.csv:2: event 'grow' must be 'add' or 'remove'"),
    ("5000,add,node1\n100,add,node2\n", r"t.csv:2: time 100 ms goes backwards \(previous row: 5000 ms\)"),
    ("0,add,node1\n10,remove,node2\n", r"t.csv:2: node node2 removed but it is not up"),
    ("0,add,node1\n10,add,node1\n", r"t.csv:2: node node1 added while already up"),
    ("0,add\n", r"t.csv:1: a counts row in a trace of"),
    ("# only a comment\n0,add,node 1\n", r"t.csv:2: node name 'node 1'"),
    ("abc,add,node1\n", r"t.csv:1: time 'abc' is not a whole number of milliseconds \(a header row\? start it "
                        r"with '#'"),
    ("1.5,add,node1\n", r"t.csv:1: time '1.5' is not a whole number of milliseconds$"),
    ("0,3\n10,-1\n", r"t.csv:2: count -1 must be in 0..100000"),
    ("0,add,node1,extra\n", r"t.csv:1: expected 'ms,add\|remove,node', 'ms,count' or 'date, time, count'"),
    ("2023-03-01, 12:00, 5\n2023-03-01, noon, 4\n", r"t.csv:2: '2023-03-01', 'noon' is not a date \(YYYY-MM-DD\)"),
    ("\n# nothing\n", r"no events"),
])
def test_malformed_traces_name_the_line(tmp_path, body, message):
    (tmp_path / "t.csv").write_text(body if not body.startswith("0,add\n") else "0,add,node1\n5,add\n")
    if body.startswith("0,add\n"):
        message = r"t.csv:2: a counts row in a trace of events rows"
    with pytest.raises(TraceError, match=message):
        load_trace(tmp_path / "t.csv")


def test_trace_arguments_and_count_traces(tmp_path):
    p = tmp_path / "c.csv"
    p.write_text("0,2\n1000,3\n2000,1\n")
    t = load_trace(p)
    assert [(e.t_s, e.kind, e.node) for e in t.events] == [
        (0.0, "add", "node0"), (0.0, "add", "node1"), (1.0, "add", "node2"),
        (2.0, "remove", "node2"), (2.0, "remove", "node1")]  # last in, first out
    with pytest.raises(TraceError, match="compress=0 must be a finite number > 0"):
        load_trace(p, compress=0)
    with pytest.raises(TraceError, match="need 0 <= start_s < end_s"):
        load_trace(p, start_s=5, end_s=5)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="capacity=0"):
        SpotEmulator(t, capacity=0)
    with pytest.raises(ValueError, match="backend='aws'"):
        SpotEmulator(t, capacity=1, backend="aws")


@pytest.mark.timeout(60)
def test_a_large_pools_count_trace_is_scaled_to_the_emulator_and_preempts_in_proportion(tmp_path, caplog):
    """A count trace of a 64-VM pool (made here, as ``date, time, count`` rows) replayed on 4 local
    slots: scaled to 4 VMs (each count x 4/64), its drops to 75 %, 50 % and 25 % of the peak
    become 1, 2 and 3 pre-emptions of the emulator's VMs — the same removals counted from the
    emulator's own events — where the unscaled trace, removing last in first out, never touches
    the first 4 nodes (and the emulator says so)."""
    import logging

    pool = [64, 48, 64, 32, 64, 16, 16, 64]          # VMs up, one row a minute
    p = tmp_path / "pool.csv"
    p.write_text("# date, time, count\n" + "".join(f"2023-03-01, 12:{i:02d}:00, {c}\n" for i, c in enumerate(pool)))
    t = load_trace(p, compress=240.0, scale_to=4, seed=7)       # a minute of trace in 0.25 s
    assert t.format == "dated counts" and "peak of 64 VMs to 4" in t.note and t.max_nodes() == 4
    drops = [max(0, round(a * 4 / 64) - round(b * 4 / 64)) for a, b in zip(pool, pool[1:])]
    assert drops == [1, 0, 2, 0, 3, 0, 0] and t.counts()["remove"] == sum(drops) == 6
    assert [e.t_s for e in t.events if e.kind == "remove"] == [0.25, 0.75, 0.75, 1.25, 1.25, 1.25]
    again = load_trace(p, compress=240.0, scale_to=4, seed=7)  # seeded: the same VMs go
    assert [e.node for e in again.events] == [e.node for e in t.events]
    seen: list = []
    emu = SpotEmulator(t, capacity=4, backend="local", notice_s=None)
    emu.subscribe(seen.append)
    try:
        emu.start()
        deadline = time.monotonic() + 30
        while emu.removed_count < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        emu.close()
    assert emu.removed_count == 6 and sum(ev.kind == "removed" for ev in seen) == 6, seen
    # unscaled, last in first out: 60 of the 64 nodes never get a slot, the emulator warns
    caplog.set_level(logging.WARNING, logger="varuna_sdk.cluster.spot")
    SpotEmulator(load_trace(p), capacity=4, backend="local").close()
    assert "load it with load_trace(..., scale_to=4)" in caplog.text


@pytest.mark.timeout(60)
def test_emulator_replays_a_trace_on_local_slots(tmp_path):
    """node1 and node2 up at 0; node3 overflows (capacity 2); node1 pre-empted at 1.0 s of
    replay (trace 2 s, compress 2) with a 0.4 s notice; node4 takes the freed slot at 1.5 s."""
    p = tmp_path / "t.csv"
    p.write_text("0,add,node1\n0,add,node2\n1000,add,node3\n2000,remove,node1\n"
                 "3000,add,node4\n4000,remove,node3\n")
    log = EventLog(tmp_path / "events.db")
    seen = Events()
    em = SpotEmulator(load_trace(p, compress=2), capacity=2, backend="local", notice_s=0.4,
                      event_log=log, job_id="j")
    em.subscribe(seen)
    t0 = time.monotonic()
    with em:
        assert [h.name for h in em.hosts()] == ["local0", "local1"]
        assert em.node_of("local0") == "node1"
        with pytest.raises(ValueError, match=r"notice_s=-1 must be >= 0 seconds"):   # was taken (helper-63)
            em.remove_now("local1", notice_s=-1)
        proc = start_local(em.hosts()[0], [sys.executable, "-c", "import time; time.sleep(60)"])
        child = proc.pids()
        t_n, notice = seen.wait(lambda e: e.kind == "notice")
        # never early; late by at most a loaded machine's scheduling slack (order is checked by the events)
        assert notice.host.name == "local0" and 0.5 < t_n - t0 < 1.9
        assert 0 < notice.lead_s <= 0.4 + 1e-6
        assert [h.name for h in em.hosts()] == ["local1"] and em.acquire(2) == [em.hosts()[0]]
        assert proc.poll() is None  # a notice is only a warning
        t_r, removed = seen.wait(lambda e: e.kind == "removed")
        assert removed.host.name == "local0" and 0.9 < t_r - t0 < 2.4
        assert time.time() >= notice.deadline - 0.05   # removed at (not before) the notice's deadline
        assert proc.wait(2) == -9 and not local_processes("local0")  # really killed
        assert child and all(_is_zombie(c) for c in child)
        t_a, added = seen.wait(lambda e: e.kind == "added" and e.reason == "trace node4 added")
        assert added.host.name == "local0" and 1.4 < t_a - t0 < 2.9
        time.sleep(0.8)  # node3 (overflow) leaves at 2.0 s: nothing happens
        assert em.overflow == set() and sorted(h.name for h in em.hosts()) == ["local0", "local1"]
        assert em.overflowed == 1   # node3's add, ignored (gone from .overflow once removed: helper-63)
    rows = [(e.kind, e.host) for e in log.events(job_id="j")]
    assert rows == [(Kind.HOST_ADDED, "local0"), (Kind.HOST_ADDED, "local1"),
                    (Kind.PREEMPTION_NOTICE, "local0"), (Kind.HOST_REMOVED, "local0"),
                    (Kind.HOST_ADDED, "local0")]
    n = log.events(kind=Kind.PREEMPTION_NOTICE)[0].payload
    assert n["deadline"] == notice.deadline and 0 < n["lead_s"] <= 0.4 + 1e-6


@pytest.mark.timeout(90)
@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_emulator_preempts_and_returns_real_ssh_hosts(tmp_path):
    seen = Events()
    with SpotEmulator(capacity=2, backend="ssh", root=tmp_path / "hosts", notice_s=None) as em:
        em.subscribe(seen)
        opts = em.ssh_options()
        vm0, vm1 = em.hosts()
        assert (vm0.name, vm1.name) == ("vm0", "vm1") and vm1.labels["kind"] == "test-host"
        c = SSHConnection(vm1, opts)
        assert c.run("echo up", timeout_s=10).stdout == "up\n"
        sleeper = c.start("sleep 300")
        assert sleeper.wait_started() is not None
        pids = em.test_hosts.pids(vm1)
        t0 = time.monotonic()
        before = time.time()
        deadline = em.remove_now("vm1", notice_s=0.5)
        assert [h.name for h in em.hosts()] == ["vm0"] and before + 0.5 <= deadline <= time.time() + 0.5
        assert c.run("echo still", timeout_s=10).ok  # until the deadline the VM works
        t_r, removed = seen.wait(lambda e: e.kind == "removed")
        assert 0.4 < t_r - t0 < 2.5
        assert sleeper.wait(5) is None and sleeper.connection_lost
        assert not [p for p in pids if not _is_zombie(p)]
        with pytest.raises(HostUnreachableError):
            SSHConnection(vm1, dataclasses.replace(opts, connect_timeout_s=1.0)).connect()
        with pytest.raises(KeyError, match="vm1 is not up"):
            em.remove_now("vm1")
        back = em.add_now()  # the VM returns (a new sshd, a new host key)
        assert back.name == "vm1"
        assert SSHConnection(back, em.ssh_options()).run("echo back", timeout_s=10).stdout == "back\n"
        em.remove_now("vm0")  # without notice: gone before it returns
        assert [e.kind for _, e in seen.items] == ["notice", "removed", "added", "removed"]
        root_pids = em.test_hosts.pids(back)
    assert root_pids and not [p for p in root_pids if not _is_zombie(p)]  # close() removed every VM
