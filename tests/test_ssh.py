"""The SSH layer (``varuna_sdk.cluster.ssh``) against real sshd test hosts (``tests/ssh_hosts.py``):
commands, SFTP, host-key checks, timeouts, retries, secrets, and pre-emption by killing a host.
Every test is time-bounded; each host's processes are checked gone at the end."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ssh_hosts import SSHDHosts, _cgroup2_base, _is_zombie, skip_reason, procs_mentioning
from varuna_sdk.cluster.hosts import Host, Secret
from varuna_sdk.cluster.ssh import SSHConnection, SSHPool
from varuna_sdk.cluster.ssh_errors import (AuthenticationError, CommandError, CommandTimeout, HostKeyError,
                                           HostUnreachableError, SFTPError)

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not _is_zombie(pid)


def _comms(pids) -> list[str]:
    out = []
    for p in pids:
        try:
            out.append(Path(f"/proc/{p}/comm").read_text().strip())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out




# --------------------------------------------------------------------------------- commands
def test_run_command_stdout_stderr_exit_code(ssh_hosts):
    host = ssh_hosts.add()
    with SSHConnection(host, ssh_hosts.options()) as conn:
        r = conn.run("echo out; echo err >&2; exit 3", timeout_s=10)
        assert (r.exit_code, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)
        r = conn.run([host.python, "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME", "'"],
                     timeout_s=10)
        assert r.ok and r.stdout == "['a b', '$HOME', \"'\"]\n"  # argv is quoted, not expanded
        r = conn.run("cat; printf '%s' \"$X\"", stdin="from stdin\n", env={"X": "y z"},
                     timeout_s=10)
        assert r.stdout == "from stdin\ny z"
        with pytest.raises(CommandError, match=rf"{host.name} .*exited with 7.*\n.*boom"):
            conn.run("echo boom >&2; exit 7", timeout_s=10, check=True)


def test_each_test_host_has_its_own_home_and_login_shell_rc(ssh_hosts):
    # the real user's ~/.bashrc may hang a login shell (a stale `pyenv rehash` lock waits 60 s
    # in every session: that failed a whole CI run); a test host's shell reads its own instead
    a, b = ssh_hosts.add(), ssh_hosts.add()
    home = ssh_hosts.root / a.name / "home"
    (home / ".bashrc").write_text("export FROM_RC=vm-a\n")
    with SSHConnection(a, ssh_hosts.options()) as ca, SSHConnection(b, ssh_hosts.options()) as cb:
        assert ca.run('echo "$HOME|$FROM_RC"', timeout_s=10).stdout == f"{home}|vm-a\n"
        assert cb.run('echo "$HOME|$FROM_RC"', timeout_s=10).stdout == \
            f"{ssh_hosts.root / b.name / 'home'}|\n"


def test_connection_is_reused(ssh_hosts):
    host = ssh_hosts.add()
    with SSHPool(ssh_hosts.options()) as pool:
        conn = pool.get(host)
        t0 = time.perf_counter()
        conn.run("true", timeout_s=10)
        first = time.perf_counter() - t0
        transport = conn.transport
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert pool.get(host).run("true", timeout_s=10).ok
            times.append(time.perf_counter() - t0)
        assert pool.get(host) is conn and conn.transport is transport and conn.connects == 1
        print(f"first command (connect+run) {first * 1e3:.0f} ms, reused {min(times) * 1e3:.0f} ms")
        # a dead transport is replaced transparently
        transport.close()
        assert conn.run("echo again", timeout_s=10).stdout == "again\n" and conn.connects == 2


# ------------------------------------------------------------------------------------ SFTP
def test_sftp_round_trip(ssh_hosts, tmp_path):
    host = ssh_hosts.add()
    data = os.urandom(1 << 20) + b"\n\x00end"
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    remote = f"{host.workdir}/sub/dir/blob.bin"
    with SSHConnection(host, ssh_hosts.options()) as conn:
        conn.put(src, remote, mode=0o640, mkdirs=True)
        r = conn.run(f"stat -c %a {remote}; ls {host.workdir}/sub/dir", timeout_s=10)
        assert r.stdout == "640\nblob.bin\n"  # no temporary file left behind
        back = tmp_path / "back.bin"
        conn.get(remote, back)
        assert back.read_bytes() == data
        with pytest.raises(SFTPError, match=rf"{host.name} .*get {host.workdir}/missing"):
            conn.get(f"{host.workdir}/missing", tmp_path / "x")
        assert not list(tmp_path.glob(".x.part-*"))


# -------------------------------------------------------------------------------- host keys
def test_wrong_host_key_is_refused_with_a_clear_message(ssh_hosts, tmp_path):
    host = ssh_hosts.add()
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    bad = tmp_path / "known_hosts"
    bad.write_text(f"{host.known_hosts_name} {' '.join(Path(str(other) + '.pub').read_text().split()[:2])}\n")
    for tofu in (False, True):  # trust-on-first-use never accepts a *changed* key
        t0 = time.monotonic()
        with pytest.raises(HostKeyError) as e:
            SSHConnection(host, ssh_hosts.options(known_hosts=bad, trust_on_first_use=tofu)).connect()
        msg = str(e.value)
        assert time.monotonic() - t0 < 3  # not retried
        assert msg.startswith(f"{host.name} ({host.endpoint})")
        assert "MISMATCH" in msg and "man-in-the-middle" in msg
        assert f"ssh-keygen -f {bad} -R '{host.known_hosts_name}'" in msg
    assert len(bad.read_text().splitlines()) == 1


def test_unknown_host_key_needs_explicit_trust_on_first_use(ssh_hosts, tmp_path, caplog):
    host = ssh_hosts.add()
    kh = tmp_path / "fresh" / "known_hosts"
    with pytest.raises(HostKeyError, match=r"unknown host key.*trust_on_first_use=True") as e:
        SSHConnection(host, ssh_hosts.options(known_hosts=kh)).connect()
    assert host.name in str(e.value) and "SHA256:" in str(e.value)
    with caplog.at_level(logging.WARNING, logger="varuna_sdk.cluster.ssh"):
        with SSHConnection(host, ssh_hosts.options(known_hosts=kh, trust_on_first_use=True)) as c:
            assert c.run("echo ok", timeout_s=10).stdout == "ok\n"
    assert any("trust_on_first_use" in r.message and host.name in r.message and "SHA256:" in
               r.message and r.levelno == logging.WARNING for r in caplog.records)
    assert kh.read_text().startswith(host.known_hosts_name + " ssh-ed25519 ")
    # learned: the strict default now accepts it, with no new warning
    caplog.clear()
    with SSHConnection(host, ssh_hosts.options(known_hosts=kh)) as c:
        assert c.run("true", timeout_s=10).ok
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ unreachable and retries
def test_unreachable_host_errors_within_its_timeout(ssh_hosts):
    addr = ssh_hosts.unused_address()
    host = Host(name="ghost", address=addr, key_path=ssh_hosts.client_key)
    t0 = time.monotonic()
    with pytest.raises(HostUnreachableError, match=rf"ghost .*{addr}.*attempt") as e:
        SSHConnection(host, ssh_hosts.options(connect_timeout_s=1.5, connect_attempts=10)).connect()
    took = time.monotonic() - t0
    assert took < 2.0, took
    assert "ConnectionRefused" in str(e.value) or "NoValidConnections" in str(e.value)
    print(f"unreachable: error after {took:.2f}s ({e.value})")


def test_silent_server_does_not_hang(ssh_hosts):
    """A VM whose TCP port accepts but whose sshd never answers (hung, half-booted)."""
    addr = ssh_hosts.unused_address()
    with socket.socket() as srv:
        srv.bind((addr, 0))
        srv.listen(8)  # never accept, never send a banner
        host = Host(name="mute", address=addr, port=srv.getsockname()[1],
                    key_path=ssh_hosts.client_key)
        t0 = time.monotonic()
        with pytest.raises(HostUnreachableError, match="mute"):
            SSHConnection(host, ssh_hosts.options(connect_timeout_s=1.5)).connect()
        took = time.monotonic() - t0
    assert took < 2.5, took


def test_transient_refusals_are_retried_with_backoff(ssh_hosts):
    """sshd comes up 0.8 s after the first attempt (a VM still booting): connect succeeds."""
    addr = ssh_hosts.unused_address()
    port = 22 if os.geteuid() == 0 else 2222
    host = Host(name="late", address=addr, port=port, key_path=ssh_hosts.client_key)
    timer = threading.Timer(0.8, lambda: ssh_hosts.add("late", address=addr, port=port))
    timer.start()
    try:
        conn = SSHConnection(host, ssh_hosts.options(connect_timeout_s=10, connect_attempts=20))
        t0 = time.monotonic()
        assert conn.run("echo up", timeout_s=10).stdout == "up\n"
        assert 0.7 < time.monotonic() - t0 < 8
        conn.close()
    finally:
        timer.join()


# ------------------------------------------------------------------------ auth and secrets
def test_auth_failure_is_not_retried(ssh_hosts, tmp_path):
    host = ssh_hosts.add()
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    h = Host(name=host.name, address=host.address, port=host.port, key_path=stranger)
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError, match=rf"{host.name} .*authentication as 'root'|"
                                                  rf"{host.name} .*authentication as"):
        SSHConnection(h, ssh_hosts.options(connect_timeout_s=10, connect_attempts=10)).connect()
    assert time.monotonic() - t0 < 3
    with pytest.raises(AuthenticationError, match="does not exist"):
        SSHConnection(Host(name="k", address=host.address, port=host.port,
                           key_path=tmp_path / "nope"), ssh_hosts.options()).connect()


def test_secrets_never_in_logs_or_errors(ssh_hosts, tmp_path, monkeypatch, caplog):
    host = ssh_hosts.add()
    passphrase, wrong = "pp-Correct-Horse-4711", "pp-Wrong-Battery-0815"
    token = "tok-" + os.urandom(8).hex()
    key = tmp_path / "enc_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(key)],
                   check=True)
    ssh_hosts.authorize(Path(str(key) + ".pub").read_text())
    h = Host(name=host.name, address=host.address, port=host.port, key_path=key,
             key_passphrase_env="VARUNA_TEST_KEY_PASSPHRASE", python=host.python)
    caplog.set_level(logging.DEBUG)  # paramiko's transport debug log included
    errors: list[str] = []

    monkeypatch.delenv("VARUNA_TEST_KEY_PASSPHRASE", raising=False)
    with pytest.raises(AuthenticationError, match="VARUNA_TEST_KEY_PASSPHRASE is not set") as e:
        SSHConnection(h, ssh_hosts.options()).connect()
    errors.append(str(e.value))
    monkeypatch.setenv("VARUNA_TEST_KEY_PASSPHRASE", wrong)
    with pytest.raises(AuthenticationError, match="could not load private key") as e:
        SSHConnection(h, ssh_hosts.options()).connect()
    errors.append(str(e.value))
    import traceback
    errors.append("".join(traceback.format_exception(e.value)))

    monkeypatch.setenv("VARUNA_TEST_KEY_PASSPHRASE", passphrase)
    with SSHConnection(h, ssh_hosts.options()) as conn:
        # the token reaches the command's environment ...
        r = conn.run('printf %s "$VARUNA_TOKEN" | sha256sum', env={"VARUNA_TOKEN": Secret(token)},
                     timeout_s=10)
        import hashlib
        assert r.stdout.split()[0] == hashlib.sha256(token.encode()).hexdigest()
        # ... but never a command line (ps) while it runs
        proc = conn.start("sleep 20", env={"VARUNA_TOKEN": Secret(token), "RANK": "3"})
        sid = proc.wait_started()
        time.sleep(0.3)
        cmdlines = b"".join(p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline")
                            if p.exists())
        assert token.encode() not in cmdlines
        sleeper = [p for p in ssh_hosts.pids(host) if _sid(p) == sid and _comms([p]) == ["sleep"]]
        environ = Path(f"/proc/{sleeper[0]}/environ").read_bytes()
        assert f"VARUNA_TOKEN={token}".encode() in environ and b"RANK=3" in environ
        assert proc.kill()
        # an error that echoes the secret masks it
        with pytest.raises(CommandError) as e:
            conn.run('echo "bad token $VARUNA_TOKEN" >&2; exit 1',
                     env={"VARUNA_TOKEN": Secret(token)}, timeout_s=10, check=True)
        errors.append(str(e.value))
        assert "bad token ***" in str(e.value)
    assert repr(Secret(token)) == "Secret('***')" and token not in f"{Secret(token)}"
    text = caplog.text + "\n".join(errors) + repr(h)
    for secret in (passphrase, wrong, token):
        assert secret not in text


# ------------------------------------------------------------------ timeouts and process death
def test_command_timeout_kills_the_remote_process_group(ssh_hosts):
    host = ssh_hosts.add()
    conn = SSHConnection(host, ssh_hosts.options(kill_grace_s=0.5))
    baseline = set(ssh_hosts.pids(host))
    script = ("trap '' TERM; sleep 30 & "  # ignores SIGTERM: needs the SIGKILL
              f"{host.python} -c 'import os, time; os.setpgid(0, 0); time.sleep(30)' & "
              "echo started; wait")
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout, match=rf"{host.name} .*timed out after 1s and was killed") as e:
        conn.run(script, timeout_s=1)
    took = time.monotonic() - t0
    assert e.value.killed and e.value.stdout == "started\n"
    assert took < 4, took
    time.sleep(0.2)
    left = set(ssh_hosts.pids(host)) - baseline
    assert not [c for c in _comms(left) if c in ("sleep", "python", "sh")], _comms(left)
    print(f"command timeout 1 s: raised after {took:.2f}s, process group gone")
    conn.close()


def test_kill_stops_a_started_process_and_its_children(ssh_hosts):
    host = ssh_hosts.add()
    lines: list[str] = []
    with SSHConnection(host, ssh_hosts.options()) as conn:
        proc = conn.start(f"{host.python} -u -c \"import time\nfor i in range(100): print(i, flush=True); time.sleep(0.1)\" & sleep 60",
                          on_stdout=lines.append)
        sid = proc.wait_started()
        deadline = time.monotonic() + 10
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines[:3] == ["0", "1", "2"]  # streamed while running
        members = [p for p in ssh_hosts.pids(host) if _sid(p) == sid]
        assert len(members) >= 3
        assert proc.kill() and proc.done()
        assert not [p for p in members if _alive(p)]


def _sid(pid: int) -> int | None:
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
        return int(s[s.rindex(")") + 2:].split()[3])
    except (FileNotFoundError, ProcessLookupError):
        return None


def test_removing_a_host_kills_all_its_processes(ssh_hosts):
    _remove_kills_everything(ssh_hosts)


def test_removing_a_host_without_cgroups_kills_all_its_processes(tmp_path):
    """The fallback for machines without a writable cgroup v2: ancestry + SSH_CONNECTION."""
    with SSHDHosts(tmp_path / "hosts", isolation="proc") as th:
        assert th.isolation == "proc"
        _remove_kills_everything(th)


def _remove_kills_everything(ssh_hosts):
    host, other = ssh_hosts.add(), ssh_hosts.add()
    conn = SSHConnection(host, ssh_hosts.options())
    daemon = (f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              f"        open('{host.workdir}/daemon.pid', 'w').write(str(os.getpid()))\n"
              f"        time.sleep(63)")
    out = conn.run("setsid sleep 61 </dev/null >/dev/null 2>&1 & echo $!; "
                   "nohup sleep 62 >/dev/null 2>&1 & echo $!; "
                   f"{host.python} -c \"{daemon}\" </dev/null >/dev/null 2>&1",
                   timeout_s=10).stdout.split()
    running = conn.start("sleep 64")
    assert running.wait_started() is not None
    deadline = time.monotonic() + 5
    while not Path(f"{host.workdir}/daemon.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    detached = [int(p) for p in out] + [int(Path(f"{host.workdir}/daemon.pid").read_text())]
    pids = ssh_hosts.pids(host)
    assert set(detached) <= set(pids)  # a new session, nohup, a double-forked daemon
    assert sum(1 for c in _comms(pids) if c == "sleep") == 3  # 61, 62, 64
    other_pids = ssh_hosts.pids(other)

    t0 = time.monotonic()
    killed = ssh_hosts.remove(host)
    took = time.monotonic() - t0
    assert set(pids) <= set(killed)
    assert not [p for p in pids if _alive(p)]
    assert all(_alive(p) for p in other_pids)  # the other host is untouched
    assert running.wait(5) is None and running.done() and running.connection_lost
    with pytest.raises(HostUnreachableError):
        SSHConnection(host, ssh_hosts.options(connect_timeout_s=1)).connect()
    assert SSHConnection(other, ssh_hosts.options()).run("echo alive", timeout_s=10).ok
    print(f"remove(host): {len(killed)} processes killed in {took * 1e3:.0f} ms")


# -------------------------------------------------------------------------------- cleanup
def test_no_sshd_or_process_left_after_the_hosts_are_closed(tmp_path):
    root = tmp_path / "hosts"
    with SSHDHosts(root) as th:
        hosts = [th.add() for _ in range(3)]
        for h in hosts:
            SSHConnection(h, th.options()).start("sleep 60").wait_started()
        pids = [p for h in hosts for p in th.pids(h)]
        assert len(pids) >= 3 * 3 and procs_mentioning(str(root))
        cg = th.cgroup_root
    assert not [p for p in pids if _alive(p)]
    assert not procs_mentioning(str(root))
    assert cg is None or not cg.exists()


_INNER_CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
import pytest
from ssh_hosts import test_hosts_fixture

@pytest.fixture
def ssh_hosts(request, tmp_path_factory):
    return test_hosts_fixture(request, tmp_path_factory)
"""

_INNER_TESTS = """
import time
from varuna_sdk.cluster.ssh import SSHConnection

def _up(ssh_hosts, tag):
    h = ssh_hosts.add()
    SSHConnection(h, ssh_hosts.options()).start("sleep 60").wait_started()
    with open({record!r}, "a") as f:
        f.write(str(ssh_hosts.root) + "\\n")

def test_fails(ssh_hosts):
    _up(ssh_hosts, "fails")
    assert False, "deliberate failure"

def test_raises(ssh_hosts):
    _up(ssh_hosts, "raises")
    raise RuntimeError("deliberate error")

def test_times_out(ssh_hosts):
    _up(ssh_hosts, "times out")
    time.sleep(30)
"""


@pytest.mark.timeout(90)
def test_fixture_cleans_up_when_tests_fail(tmp_path):
    """The ``ssh_hosts`` fixture removes its hosts when the test fails, raises or times out."""
    tests_dir = str(Path(__file__).parent)
    inner = tmp_path / "inner"
    inner.mkdir()
    record = tmp_path / "roots.txt"
    (inner / "conftest.py").write_text(_INNER_CONFTEST.format(tests=tests_dir))
    (inner / "test_inner.py").write_text(_INNER_TESTS.format(record=str(record)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--timeout", "4", "--rootdir", str(inner), str(inner)],
                       capture_output=True, text=True, timeout=80, cwd=inner)
    assert "3 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    roots = record.read_text().split()
    assert len(roots) == 3
    for root in roots:
        assert not procs_mentioning(root), root


@pytest.mark.skipif(_cgroup2_base() is None, reason="needs a writable cgroup v2 hierarchy")
def test_hosts_of_a_killed_test_run_are_reaped(tmp_path):
    """A test process SIGKILLed mid-test cannot run finalizers: the next SSHDHosts reaps its
    hosts (cgroup named after the dead pid)."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from ssh_hosts import SSHDHosts
        th = SSHDHosts({str(tmp_path / 'dead')!r})
        th.add(); th.add()
        print(th.cgroup_root, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    cg = Path(r.stdout.strip())
    assert r.returncode == -9 and cg.is_dir()
    orphans = procs_mentioning(str(tmp_path / "dead"))
    assert len(orphans) == 2  # two sshd survived their test process
    with SSHDHosts(tmp_path / "next"):
        pass
    assert not cg.exists() and not [p for p in orphans if _alive(p)]
