"""The ``ssh_hosts`` pytest fixture on top of ``varuna_sdk.cluster.testhosts.TestHosts`` (real sshd
"VMs" on this machine: loopback addresses, or network namespaces with ``add(netns=True)``).

``test_hosts_fixture`` (registered in ``conftest.py`` as ``ssh_hosts``) creates a ``TestHosts``
and removes every host from a finalizer, so it runs even when the test fails or times out; it
skips with the reason when sshd is not installed. The helpers the SSH tests share (process
checks) are re-exported from the package module, so there is one copy of each; ``Lines`` is
the output sink the launcher tests share.
"""

from __future__ import annotations

import threading
import time

import pytest

from varuna_sdk.cluster.testhosts import (TestHosts, _cgroup2_base, _is_zombie,  # noqa: F401
                                          netns_skip_reason, procs_mentioning, reap_stale,
                                          skip_reason, sshd_path, worker_processes)


class Lines:
    """An output sink for ``remote.launch`` / ``Generation`` (``sink=``): keeps every
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
            return "\n".join(l for s, l in self.lines if stream in (None, s))

    def tail(self, n: int = 60) -> str:
        with self.lock:
            return "\n".join(l for _, l in self.lines[-n:])

    def wait_for(self, needle: str, count: int = 1, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.text().count(needle) >= count:
                return True
            time.sleep(0.05)
        return False


def test_hosts_fixture(request, tmp_path_factory):
    """Body of the ``ssh_hosts`` fixture: a ``TestHosts`` removed by a finalizer (runs even when
    the test fails or times out). Skips with the reason when sshd is not installed."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    hosts = TestHosts(tmp_path_factory.mktemp("sshhosts"))
    request.addfinalizer(hosts.close)
    return hosts
