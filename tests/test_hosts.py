"""``Host`` and ``Secret`` (``varuna_sdk.cluster.hosts``): validation messages, round trip,
and a secret that never prints."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from varuna_sdk.cluster.hosts import Host, HostError, Secret


def test_host_defaults_round_trip_and_known_hosts_name():
    h = Host(name="vm0", address="10.0.0.5", user="alice", key_path="~/.ssh/id_ed25519", gpus=2,
             python="/opt/venv/bin/python", labels={"zone": "eastus"})
    assert h.port == 22 and h.key_path == Path("~/.ssh/id_ed25519").expanduser()
    assert h.known_hosts_name == "10.0.0.5" and h.endpoint == "alice@10.0.0.5:22"
    assert Host(name="b", address="127.0.0.3", port=2222).known_hosts_name == "[127.0.0.3]:2222"
    assert Host.from_dict(h.to_dict()) == h and hash(Host.from_dict(h.to_dict())) == hash(h)
    assert str(h) == "vm0 (alice@10.0.0.5:22)"
    assert Host(name="l", address="127.0.0.9").is_loopback and not h.is_loopback


@pytest.mark.parametrize("kw, message", [
    (dict(name="vm 0"), "host name 'vm 0'"),
    (dict(address=""), "address '' must be"),
    (dict(port=0), "port 0 must be an integer in 1..65535"),
    (dict(gpus=-1), "gpus -1 must be"),
    (dict(python="python3"), "must be an absolute path on the VM"),
    (dict(workdir="work"), "workdir 'work' must be an absolute path"),
    (dict(key_passphrase_env="hunter2 is my passphrase"), "must be the NAME of an environment"),
])
def test_host_validation_says_what_to_change(kw, message):
    args = dict(name="vm0", address="10.0.0.5") | kw
    with pytest.raises(HostError, match=message):
        Host(**args)


def test_unknown_field_is_named():
    with pytest.raises(HostError, match=r"unknown field\(s\) \['gpu'\]"):
        Host.from_dict({"name": "vm0", "address": "10.0.0.5", "gpu": 1})


def test_secret_never_prints_or_pickles(monkeypatch):
    s = Secret("s3cr3t-value")
    assert repr(s) == f"{s!r}" == "Secret('***')" and str(s) == f"{s}" == f"{s:>20}" == "***"
    assert "s3cr3t" not in repr([s, {"k": s}]) and s.reveal() == "s3cr3t-value"
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(s)
    monkeypatch.setenv("VARUNA_T_PASS", "pw-123")
    h = Host(name="vm0", address="10.0.0.5", key_passphrase_env="VARUNA_T_PASS")
    assert h.passphrase().reveal() == "pw-123" and "pw-123" not in repr(h) + str(h.to_dict())
    monkeypatch.delenv("VARUNA_T_PASS")
    assert h.passphrase() is None


def test_ssh_tests_skip_with_a_clear_reason_without_sshd(monkeypatch):
    import ssh_hosts
    from varuna_sdk.cluster import sshd_hosts

    monkeypatch.setattr(sshd_hosts, "sshd_path", lambda: None)
    assert "apt-get install -y openssh-server" in ssh_hosts.skip_reason()
    with pytest.raises(pytest.skip.Exception, match="sshd is not installed"):
        ssh_hosts.test_hosts_fixture(None, None)
