"""The ``ssh_hosts`` pytest fixture on top of ``varuna_sdk.cluster.sshd_hosts.SSHDHosts`` (real sshd
"VMs" on this machine: loopback addresses, or network namespaces with ``add(netns=True)``).

``test_hosts_fixture`` (registered in ``conftest.py`` as ``ssh_hosts``) creates an ``SSHDHosts``
and removes every host from a finalizer, so it runs even when the test fails or times out; it
skips with the reason when sshd is not installed. The process checks the SSH tests share
(``procs_mentioning``, ``procs_left``, ``worker_processes``) live here, test-only; the package
names the SSH tests use are imported from ``cluster.sshd_hosts`` / ``cluster.sshd_procs``, so
there is one copy of each; ``Lines`` is the output sink the launcher tests share.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from varuna_sdk.cluster.sshd_hosts import SSHDHosts, netns_skip_reason, skip_reason, sshd_path  # noqa: F401
from varuna_sdk.cluster.sshd_procs import _cgroup2_base, _is_zombie, reap_stale  # noqa: F401

def procs_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes of this machine whose command line contains ``text``."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if text.encode() in (p / "cmdline").read_bytes() and not _is_zombie(int(p.name)):
                    found.append(int(p.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
    return found


def procs_left(*texts: str, timeout_s: float = 20.0) -> list[int]:
    """Wait up to ``timeout_s`` seconds for every process mentioning any of ``texts`` to end;
    returns those still alive then (empty: nothing was left behind)."""
    deadline = time.time() + timeout_s
    while True:
        left = sorted({pid for t in texts for pid in procs_mentioning(t)})
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.25)


def worker_processes(test_hosts: SSHDHosts, hosts) -> list[tuple[int, str]]:
    """Live non-sshd processes of the given sshd hosts (what a job could leave behind)."""
    out = []
    for h in hosts:
        for p in test_hosts.pids(h):
            try:
                comm = Path(f"/proc/{p}/comm").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if comm != "sshd" and not _is_zombie(p):
                out.append((p, comm))
    return out


class Lines:
    """An output sink for ``remote.start_workers`` / ``Generation`` (``sink=``): keeps every
    ``(stream, line)`` the workers printed, prefixed by VM and rank, for assertions."""

    def __init__(self):
        self.lines: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, stream, worker, line):
        with self.lock:
            self.lines.append((stream, line))

    def text(self, stream=None) -> str:
        """Every line (of ``stream`` — "stdout"/"stderr" — if given), joined."""
        with self.lock:
            return "\n".join(ln for s, ln in self.lines if stream in (None, s))

    def tail(self, n: int = 60) -> str:
        with self.lock:
            return "\n".join(ln for _, ln in self.lines[-n:])

    def wait_for(self, needle: str, count: int = 1, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.text().count(needle) >= count:
                return True
            time.sleep(0.05)
        return False


def test_hosts_fixture(request, tmp_path_factory):
    """Body of the ``ssh_hosts`` fixture: an ``SSHDHosts`` removed by a finalizer (runs even when
    the test fails or times out). Skips with the reason when sshd is not installed."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    hosts = SSHDHosts(tmp_path_factory.mktemp("sshhosts"))
    request.addfinalizer(hosts.close)
    return hosts
