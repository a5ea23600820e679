"""Providers (``varuna_sdk.cluster.provider``): the local default's slots, the watched host file
(format, errors naming the line, live additions/removals/changes), the pool bookkeeping a cloud
provider builds on (notices take a host out of ``hosts()`` and ``acquire``), and host events in
the job's event log."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from varuna_sdk.cluster.hosts import Host
from varuna_sdk.cluster.localproc import is_local, local_processes, start_local
from varuna_sdk.cluster.hostfile import HostFileError, HostFileProvider, parse_host_file
from varuna_sdk.cluster.provider import EVENT_KINDS, HostEvent, LocalProvider, PoolProvider
from varuna_sdk.manager.events import EventLog, Kind


class Events:
    def __init__(self):
        self.items: list[HostEvent] = []
        self.cv = threading.Condition()

    def __call__(self, ev: HostEvent) -> None:
        with self.cv:
            self.items.append(ev)
            self.cv.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> list[HostEvent]:
        deadline = time.monotonic() + timeout
        with self.cv:
            while len(self.items) < n and time.monotonic() < deadline:
                self.cv.wait(0.05)
            return list(self.items)


def test_event_kinds_are_the_event_logs_kinds():
    assert EVENT_KINDS == {"added": Kind.HOST_ADDED, "notice": Kind.PREEMPTION_NOTICE,
                           "removed": Kind.HOST_REMOVED}
    h = Host(name="vm0", address="10.0.0.1")
    with pytest.raises(ValueError, match="kind 'gone'"):
        HostEvent("gone", h, 0.0)
    with pytest.raises(ValueError, match="needs its deadline"):
        HostEvent("notice", h, 0.0)
    assert HostEvent("notice", h, 100.0, deadline=130.0).lead_s == 30.0


@pytest.mark.timeout(30)
def test_local_provider_slots_acquire_release_and_close(tmp_path):
    with pytest.raises(ValueError, match="slots must be an integer >= 1"):
        LocalProvider(0)
    log = EventLog(tmp_path / "events.db")
    seen = Events()
    p = LocalProvider(3, event_log=log, job_id="j")
    p.subscribe(seen)
    with p:
        assert [h.name for h in p.hosts()] == ["local0", "local1", "local2"]
        assert all(is_local(h) and h.address == "127.0.0.1" and h.python == sys.executable
                   for h in p.hosts())
        assert [e.kind for e in seen.wait(3)] == ["added"] * 3
        a = p.acquire(2)
        assert [h.name for h in a] == ["local0", "local1"]
        assert [h.name for h in p.acquire(5)] == ["local2"] and p.acquire(1) == []
        p.release([a[0], "local2"])
        assert [h.name for h in p.acquire(5)] == ["local0", "local2"]
        with pytest.raises(ValueError, match="n must be an integer >= 0"):
            p.acquire(-1)
        proc = start_local(a[1], [sys.executable, "-c", "import time; time.sleep(60)"])
        assert local_processes("local1")
    # close() leaves no process of its slots behind
    assert proc.wait(5) is not None and not local_processes("local1")
    rows = log.events(kind=Kind.HOST_ADDED)
    assert [r.host for r in rows] == ["local0", "local1", "local2"]
    assert rows[0].payload["labels"] == {"kind": "local"} and rows[0].job_id == "j"


def test_host_file_format_and_errors_name_the_line(tmp_path):
    text = """
    # the team's VMs
    10.0.0.5
    10.0.0.6:2222                 # non-standard port
    vm-a 10.0.0.7 gpus=2 user=ubuntu python=/opt/venv/bin/python label.zone=eastus env.NCCL_SOCKET_IFNAME=eth0
    v6 [fd00::5]:2200 key=~/.ssh/id_ed25519
    """
    hosts = parse_host_file(text, defaults={"python": "/usr/bin/python3", "user": "alice"})
    by = {h.name: h for h in hosts}
    assert list(by) == ["10-0-0-5", "10-0-0-6-2222", "vm-a", "v6"]
    assert by["10-0-0-5"].port == 22 and by["10-0-0-6-2222"].port == 2222
    assert by["vm-a"].gpus == 2 and by["vm-a"].user == "ubuntu" and by["vm-a"].python == "/opt/venv/bin/python"
    assert by["vm-a"].labels == {"zone": "eastus", "env.NCCL_SOCKET_IFNAME": "eth0"}
    assert by["10-0-0-5"].python == "/usr/bin/python3" and by["10-0-0-5"].user == "alice"
    assert by["v6"].address == "fd00::5" and by["v6"].port == 2200 and by["v6"].key_path == Path("~/.ssh/id_ed25519").expanduser()
    bad = [
        ("a 10.0.0.1 colour=red", r"f:1: unknown option 'colour'"),
        ("a 10.0.0.1\nb 10.0.0.2\na 10.0.0.3", r"f:3: host name 'a' already used on line 1"),
        ("a 10.0.0.1:http", r"f:1: bad address '10.0.0.1:http'"),
        ("a 10.0.0.1 python=venv/bin/python", r"f:1: .*must be an absolute path on the VM"),
        ("a b 10.0.0.1", r"f:1: expected 'ADDRESS\[:PORT\]' or 'NAME ADDRESS\[:PORT\]', got 3 words"),
        ("gpus=1 a 10.0.0.1", r"f:1: options \(key=value\) must come after"),
        ("\n\na 10.0.0.1 gpus=two", r"f:3: gpus='two' must be a whole number"),
    ]
    for body, msg in bad:
        with pytest.raises(HostFileError, match=msg):
            parse_host_file(body, source="f")
    with pytest.raises(FileNotFoundError, match="one host per line"):
        HostFileProvider(tmp_path / "missing.txt")


@pytest.mark.timeout(60)
def test_host_file_is_watched_for_changes(tmp_path, caplog):
    path = tmp_path / "hosts.txt"
    path.write_text("vm0 10.0.0.1\nvm1 10.0.0.2\n")
    log = EventLog(tmp_path / "events.db")
    seen = Events()
    p = HostFileProvider(path, poll_s=0.1, event_log=log, job_id="j")
    p.subscribe(seen)
    with p:
        assert [e.kind for e in seen.wait(2)] == ["added", "added"]
        t0 = time.monotonic()
        path.write_text("vm0 10.0.0.1\nvm1 10.0.0.2\nvm2 10.0.0.3 gpus=1\n")  # a VM joins
        ev = seen.wait(3)[-1]
        assert (ev.kind, ev.host.name, ev.host.gpus) == ("added", "vm2", 1)
        assert time.monotonic() - t0 < 2.0  # polled every 0.1 s
        assert p.acquire(3) and p.in_use() == ["vm0", "vm1", "vm2"]
        path.write_text("vm0 10.0.0.1\nvm2 10.0.0.3 gpus=1\n")  # vm1 leaves
        ev = seen.wait(4)[-1]
        assert (ev.kind, ev.host.name, ev.reason) == ("removed", "vm1", "removed from host file")
        assert "vm1" not in p.in_use()
        path.write_text("vm0 10.0.0.9\nvm2 10.0.0.3 gpus=1\n")  # vm0 is another VM now
        evs = seen.wait(6)[-2:]
        assert [(e.kind, e.host.name, e.host.address) for e in evs] == [
            ("removed", "vm0", "10.0.0.1"), ("added", "vm0", "10.0.0.9")]
        path.write_text("vm0 10.0.0.9\nvm2 10.0.0.3 gpus=one\n")  # broken: keep the hosts
        deadline = time.monotonic() + 5
        while p.last_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "hosts.txt:2: gpus='one'" in p.last_error and len(seen.items) == 6
        assert sorted(h.name for h in p.hosts()) == ["vm0", "vm2"]
        assert "keeping the previous hosts" in caplog.text
        path.write_text("vm0 10.0.0.9\nvm2 10.0.0.3 gpus=1\nvm3 10.0.0.4\n")  # fixed
        ev = seen.wait(7)[-1]
        assert (ev.kind, ev.host.name) == ("added", "vm3") and p.last_error is None
        path.unlink()  # deleted by accident: keep the hosts
        time.sleep(0.4)
        assert sorted(h.name for h in p.hosts()) == ["vm0", "vm2", "vm3"]
    assert not p._thread.is_alive()
    kinds = [(e.kind, e.host) for e in log.events(job_id="j")]
    assert kinds[-3:] == [(Kind.HOST_REMOVED, "vm0"), (Kind.HOST_ADDED, "vm0"), (Kind.HOST_ADDED, "vm3")]


class _Cloud(PoolProvider):
    """A provider written from the module docstring alone: VMs appear when 'booted', get a
    notice, then disappear — the pool bookkeeping does the rest."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.deleted: list[str] = []

    def boot(self, name: str) -> None:
        self._add_host(Host(name=name, address=f"10.1.0.{len(self.all_hosts()) + 2}", gpus=1,
                            labels={"instance_type": "g4dn.xlarge"}), reason="spot request filled")

    def release(self, hosts):
        super().release(hosts)
        for h in hosts:
            name = h if isinstance(h, str) else h.name
            self.deleted.append(name)
            self._remove_host(name, reason="released")

    def start(self):
        self.started = True
        return self

    def close(self):
        for h in self.all_hosts():
            self.release([h])
        self.closed = True


def test_pool_bookkeeping_for_a_cloud_provider(tmp_path):
    log = EventLog(tmp_path / "events.db")
    seen = Events()
    with _Cloud(event_log=log, job_id="j") as cloud:
        unsubscribe = cloud.subscribe(seen)
        cloud.boot("spot-1")
        cloud.boot("spot-2")
        got = cloud.acquire(1)
        deadline = time.time() + 120
        cloud._notice_host("spot-1", deadline)
        assert [h.name for h in cloud.hosts()] == ["spot-2"]  # under notice: not usable
        assert cloud.under_notice() == {"spot-1": deadline}
        assert [h.name for h in cloud.acquire(5)] == ["spot-2"]
        cloud._remove_host("spot-1")
        assert [h.name for h in got] == ["spot-1"] and "spot-1" not in cloud.in_use()
        unsubscribe()
        cloud.boot("spot-3")
    assert [e.kind for e in seen.items] == ["added", "added", "notice", "removed"]
    assert cloud.deleted == ["spot-2", "spot-3"]  # close() gave back every VM
    notice = log.events(kind=Kind.PREEMPTION_NOTICE)[0]
    assert notice.host == "spot-1" and notice.payload["deadline"] == deadline
    assert 119 < notice.payload["lead_s"] <= 120
