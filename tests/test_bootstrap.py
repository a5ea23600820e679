"""Bootstrap (``varuna_sdk.cluster.bootstrap``) on real sshd test hosts: version checks that name
the VM and the mismatch, content-hash code sync that moves only what changed, the user's set-up
command with its timeout."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path

import pytest

from ssh_hosts import _is_zombie, skip_reason
from varuna_sdk.cluster.bootstrap import (STATE_FILE, BootstrapError, bootstrap, check_versions,
                                          local_versions, manifest, run_setup, sync_code)
from varuna_sdk.cluster.ssh import SSHPool

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]


def _fake_python(path: Path, python="3.8.10", torch="1.13.1", sdk="0.0.9") -> str:
    """A stand-in interpreter that answers the probe with other versions."""
    torch_json = "null" if torch is None else f'"{torch}"'
    path.write_text("#!/bin/sh\n"
                    f"echo '__VARUNA_PROBE__{{\"python\": \"{python}\", \"torch\": {torch_json}, "
                    f"\"varuna-sdk\": \"{sdk}\", \"executable\": \"{path}\"}}'\n")
    path.chmod(0o755)
    return str(path)


def test_versions_match_on_every_host(ssh_hosts):
    hosts = [ssh_hosts.add(), ssh_hosts.add()]
    with SSHPool(ssh_hosts.options()) as pool:
        t0 = time.monotonic()
        got = check_versions(pool, hosts)
        took = time.monotonic() - t0
    mine = local_versions()
    assert set(got) == {"vm0", "vm1"}
    for v in got.values():
        assert (v.python, v.torch, v.varuna_sdk) == (mine.python, mine.torch, mine.varuna_sdk)
    print(f"version check of 2 VMs: {took * 1e3:.0f} ms")


def test_version_mismatch_names_the_vm_and_the_versions(ssh_hosts, tmp_path):
    good = ssh_hosts.add()
    bad = dataclasses.replace(ssh_hosts.add(), python=_fake_python(tmp_path / "oldpython"))
    mine = local_versions()
    with SSHPool(ssh_hosts.options()) as pool:
        with pytest.raises(BootstrapError) as e:
            check_versions(pool, [good, bad])
    msg = str(e.value)
    assert set(e.value.failures) == {"vm1"}, msg
    assert "vm1 (" in msg and "vm0" not in msg
    assert f"Python 3.8.10 (here {mine.python})" in msg
    assert f"torch 1.13.1 (here {mine.torch})" in msg
    assert f"varuna-sdk 0.0.9 (here {mine.varuna_sdk})" in msg
    assert "oldpython" in msg  # which interpreter was asked


def test_torch_build_tag_and_patch_level_are_tolerated_missing_torch_is_not(ssh_hosts, tmp_path):
    mine = local_versions()
    major_minor = ".".join(mine.python.split(".")[:2])
    base_torch = mine.torch.split("+")[0]
    h = ssh_hosts.add()
    ok = dataclasses.replace(h, python=_fake_python(tmp_path / "gpu", f"{major_minor}.99",
                                                    f"{base_torch}+cu124", mine.varuna_sdk))
    no_torch = dataclasses.replace(h, name="vm-notorch",
                                   python=_fake_python(tmp_path / "nt", mine.python, None, mine.varuna_sdk))
    with SSHPool(ssh_hosts.options()) as pool:
        assert check_versions(pool, [ok])["vm0"].torch == f"{base_torch}+cu124"
        with pytest.raises(BootstrapError, match=r"vm-notorch .*torch is not installed"):
            check_versions(pool, [no_torch])


def test_missing_interpreter_is_a_clear_error(ssh_hosts):
    h = dataclasses.replace(ssh_hosts.add(), python="/nonexistent/venv/bin/python")
    with SSHPool(ssh_hosts.options()) as pool:
        with pytest.raises(BootstrapError,
                           match=r"vm0 \(.*\): Python interpreter /nonexistent/venv/bin/python not "
                                 r"found on the VM \(exit 127"):
            check_versions(pool, [h])


def test_unreachable_vm_during_bootstrap_is_named(ssh_hosts):
    hosts = [ssh_hosts.add(), ssh_hosts.add()]
    ssh_hosts.remove(hosts[1])  # pre-empted before bootstrap reached it
    with SSHPool(ssh_hosts.options(connect_timeout_s=2.0)) as pool:
        t0 = time.monotonic()
        with pytest.raises(BootstrapError) as e:
            check_versions(pool, hosts)
        assert time.monotonic() - t0 < 5
    assert set(e.value.failures) == {"vm1"} and "no SSH session" in str(e.value)


def _tree(root: Path) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "train.py").write_text("print('hello')\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "model.py").write_text("X = 1\n" * 100)
    (root / "pkg" / "sub" / "data.bin").write_bytes(os.urandom(300_000))
    (root / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"junk")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)


def _remote_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file() and p.name != STATE_FILE}


def test_sync_moves_only_what_changed(ssh_hosts, tmp_path):
    hosts = [ssh_hosts.add(), ssh_hosts.add()]
    src = tmp_path / "code"
    _tree(src)
    local = manifest(src)
    assert "pkg/__pycache__/model.cpython-311.pyc" not in local and len(local) == 5
    total = sum(e.size for e in local.values())
    with SSHPool(ssh_hosts.options()) as pool:
        t0 = time.monotonic()
        first = sync_code(pool, hosts, src)
        t_first = time.monotonic() - t0
        for h in hosts:
            r = first[h.name]
            assert (r.files_total, r.files_sent, r.bytes_sent) == (5, 5, total), r
            dst = Path(h.workdir) / "code"
            assert r.remote_dir == str(dst)
            assert _remote_tree(dst) == {k: e.sha256 for k, e in local.items()}
            assert os.access(dst / "run.sh", os.X_OK) and not os.access(dst / "train.py", os.X_OK)
        # a file of the user's own on the VM: never touched by the mirror
        (Path(hosts[0].workdir) / "code" / "notes.txt").write_text("mine")

        t0 = time.monotonic()
        again = sync_code(pool, hosts, src)
        t_again = time.monotonic() - t0
        assert all((r.files_sent, r.bytes_sent, r.files_deleted) == (0, 0, 0) for r in again.values()), again

        (src / "pkg" / "model.py").write_text("X = 2\n" * 100)
        changed = sync_code(pool, hosts, src)
        for h in hosts:
            r = changed[h.name]
            assert (r.files_sent, r.bytes_sent, r.sent) == (1, 600, ["pkg/model.py"]), r
            assert (Path(h.workdir) / "code" / "pkg" / "model.py").read_text() == "X = 2\n" * 100

        # a file changed *on the VM* is put back; a file deleted locally is deleted remotely
        (Path(hosts[1].workdir) / "code" / "train.py").write_text("tampered")
        (src / "run.sh").unlink()
        last = sync_code(pool, hosts, src)
    assert last["vm0"].files_sent == 0 and last["vm1"].sent == ["train.py"]
    assert all(r.files_deleted == 1 for r in last.values())
    for h in hosts:
        dst = Path(h.workdir) / "code"
        assert not (dst / "run.sh").exists()
        assert (dst / "train.py").read_text() == "print('hello')\n"
    assert (Path(hosts[0].workdir) / "code" / "notes.txt").read_text() == "mine"
    print(f"sync 2 VMs: first {t_first * 1e3:.0f} ms ({total} B x 2), unchanged {t_again * 1e3:.0f} ms")


def test_setup_command_runs_fails_clearly_and_times_out(ssh_hosts, tmp_path):
    hosts = [ssh_hosts.add(), ssh_hosts.add()]
    src = tmp_path / "code"
    src.mkdir()
    (src / "requirements.txt").write_text("nothing\n")
    with SSHPool(ssh_hosts.options(kill_grace_s=0.3)) as pool:
        rep = bootstrap(pool, hosts, code_dir=src, setup="ls requirements.txt > setup.done")
        assert set(rep.setup_s) == {"vm0", "vm1"} and "vm0: Python" in str(rep)
        for h in hosts:
            assert (Path(h.workdir) / "code" / "setup.done").read_text() == "requirements.txt\n"
        fail = 'case "$PWD" in */vm1/work/code) echo "pip: no such package" >&2; exit 3;; esac'
        with pytest.raises(BootstrapError, match=r"vm1 .*exited with 3:\s+pip: no such package") as e:
            run_setup(pool, hosts, fail)
        assert set(e.value.failures) == {"vm1"}
        t0 = time.monotonic()
        with pytest.raises(BootstrapError, match="timed out after 1s and was killed"):
            run_setup(pool, hosts[:1], "sleep 30; echo never", timeout_s=1)
        assert time.monotonic() - t0 < 8
    def comm(pid: int) -> str:  # a process may end between listing and reading: then it is not left
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            return ""

    left = [p for p in ssh_hosts.pids(hosts[0]) if not _is_zombie(p) and comm(p) == "sleep"]
    assert not left
