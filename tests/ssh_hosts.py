"""The ``ssh_hosts`` pytest fixture on top of ``varuna_sdk.cluster.testhosts.TestHosts`` (real sshd
"VMs" on this machine: loopback addresses, or network namespaces with ``add(netns=True)``).

``test_hosts_fixture`` (registered in ``conftest.py`` as ``ssh_hosts``) creates a ``TestHosts``
and removes every host from a finalizer, so it runs even when the test fails or times out; it
skips with the reason when sshd is not installed. The helpers the SSH tests share (process
checks) are re-exported from the package module, so there is one copy of each.
"""

from __future__ import annotations

import pytest

from varuna_sdk.cluster.testhosts import (TestHosts, _cgroup2_base, _is_zombie,  # noqa: F401
                                          netns_skip_reason, procs_mentioning, reap_stale,
                                          skip_reason, sshd_path, worker_processes)


def test_hosts_fixture(request, tmp_path_factory):
    """Body of the ``ssh_hosts`` fixture: a ``TestHosts`` removed by a finalizer (runs even when
    the test fails or times out). Skips with the reason when sshd is not installed."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    hosts = TestHosts(tmp_path_factory.mktemp("sshhosts"))
    request.addfinalizer(hosts.close)
    return hosts
