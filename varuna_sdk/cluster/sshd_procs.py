"""The processes of an sshd host on this machine (``cluster.sshd_hosts``): find every process a
host started, kill them all, and reap what runs that were SIGKILLed left behind.

Each sshd host runs in its own cgroup v2 (``_cgroup2_base()`` / ``varuna-testhosts-<pid>-...``),
so sessions that called ``setsid``, double-forked daemons and workers are all found and killed
at once (``cgroup.kill``); where no cgroup v2 is writable the fallback (``_host_pids_proc``)
finds processes by ancestry, by ``SSH_CONNECTION`` and, for a namespace host, by ``ip netns
pids``. Namespaces, bridges and veths are named after the owning pid (``varuna-th-<pid>-...``,
``vvb<pid36>-...``, ``vvh<pid36>-...``) so that ``reap_stale`` can delete those of dead runs.

Owns ``kill_sshd_host``, ``reap_stale``, the cgroup helpers (``_cgroup2_base``,
``_cgroup_pids``, ``_kill_cgroup``), the ``/proc`` helpers (``_proc_table``, ``_host_pids_proc``,
``_pid_alive``, ``_is_zombie``), ``_ip`` / ``_ip_path`` (iproute2) and the name prefixes.
Imports the standard library only; must never import torch, pytest or the manager.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

_PREFIX = "varuna-testhosts-"
_NS_PREFIX = "varuna-th-"      # network namespaces: varuna-th-<pid>-<seq>-<host>
_BR_PREFIX, _VH_PREFIX = "vvb", "vvh"  # links: vvb<pid36>-<seq>, vvh<pid36>-<seq>-<idx> (<= 15 chars)


def _ip_path() -> str | None:
    """The iproute2 ``ip`` binary, or None."""
    for p in (shutil.which("ip"), "/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"):
        if p and os.access(p, os.X_OK):
            return p
    return None



def _b36(n: int) -> str:
    """``n`` in base 36 (a pid short enough for a 15-character interface name)."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``; ``RuntimeError`` with its stderr when it fails and ``check``."""
    r = subprocess.run([_ip_path() or "ip", *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r


# -------------------------------------------------------------------------------------- cgroups
def _cgroup2_base() -> Path | None:
    """Our own cgroup v2 directory, if a cgroup2 hierarchy is mounted and writable."""
    mount = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                mount = left.split()[4]
                break
    if mount is None:
        return None
    rel = ""
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                rel = line.strip()[3:]
    base = Path(mount) / rel.lstrip("/")
    if not base.is_dir() or not os.access(base, os.W_OK):
        return None
    return base


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cgroup_pids(cg: Path) -> list[int]:
    pids: list[int] = []
    for sub in [cg, *[p for p in cg.rglob("*") if p.is_dir()]]:
        try:
            pids += [int(x) for x in (sub / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            pass
    return pids


def _kill_cgroup(cg: Path, timeout_s: float = 10.0) -> list[int]:
    """Kill every process in cgroup ``cg`` (and below), wait until it is empty, remove it.
    Returns the pids that were killed."""
    pids = _cgroup_pids(cg)
    deadline = time.monotonic() + timeout_s
    while True:
        if (cg / "cgroup.kill").exists():
            (cg / "cgroup.kill").write_text("1")
        else:  # kernel < 5.14: kill each
            for pid in _cgroup_pids(cg):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not _cgroup_pids(cg):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {_cgroup_pids(cg)} of {cg} survived SIGKILL")
        time.sleep(0.02)
    for sub in sorted([p for p in cg.rglob("*") if p.is_dir()], key=lambda p: -len(p.parts)):
        _rmdir_retry(sub, deadline)
    _rmdir_retry(cg, deadline)
    return pids


def _rmdir_retry(d: Path, deadline: float) -> None:
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:  # EBUSY while the last zombies are reaped
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def reap_stale(base: Path | None = None) -> list[str]:
    """Remove test-host cgroups, network namespaces and links left by runs that died without
    cleaning up (named after a pid that is no longer alive). Returns what was reaped."""
    base = base or _cgroup2_base()
    reaped: list[str] = []
    if base is not None:
        for d in base.glob(_PREFIX + "*"):
            try:
                owner = int(d.name[len(_PREFIX):].split("-")[0])
            except ValueError:
                continue
            if owner != os.getpid() and not _pid_alive(owner):
                _kill_cgroup(d)
                reaped.append(d.name)
    if os.geteuid() == 0 and _ip_path() is not None:
        r = _ip("netns", "list", check=False)
        for line in r.stdout.splitlines():
            ns = line.split()[0] if line.split() else ""
            if not ns.startswith(_NS_PREFIX):
                continue
            try:
                owner = int(ns[len(_NS_PREFIX):].split("-")[0])
            except ValueError:
                continue
            if owner != os.getpid() and not _pid_alive(owner):
                for pid in _netns_pids(ns):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _ip("netns", "del", ns, check=False)
                reaped.append(ns)
        r = _ip("-o", "link", "show", check=False)
        for line in r.stdout.splitlines():
            parts = line.split(":")
            if len(parts) < 2:
                continue
            name = parts[1].strip().split("@")[0]
            if not name.startswith((_BR_PREFIX, _VH_PREFIX)):
                continue
            try:
                owner = int(name[3:].split("-")[0], 36)
            except ValueError:
                continue
            if owner != os.getpid() and not _pid_alive(owner):
                _ip("link", "del", name, check=False)
                reaped.append(name)
    return reaped


# ----------------------------------------------------------------------------- /proc fallback
def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, SSH_CONNECTION or '') of every live (non-zombie) process."""
    table: dict[int, tuple[int, str]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat_ = (p / "stat").read_text()
            state, ppid = stat_[stat_.rindex(")") + 2:].split()[:2]
            if state == "Z":  # dead already (init may reap it late)
                continue
            ppid = int(ppid)
            conn = ""
            try:
                for kv in (p / "environ").read_bytes().split(b"\0"):
                    if kv.startswith(b"SSH_CONNECTION="):
                        conn = kv[15:].decode(errors="replace")
            except (PermissionError, ProcessLookupError):
                pass
            table[int(p.name)] = (ppid, conn)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return table


def _netns_pids(ns: str) -> set[int]:
    r = _ip("netns", "pids", ns, check=False)
    return {int(x) for x in r.stdout.split() if x.isdigit()}


def _host_pids_proc(root_pid: int, address: str, port: int, netns: str | None = None) -> set[int]:
    """Without a cgroup: sshd ``root_pid``, every process whose ``SSH_CONNECTION`` ends in
    ``address port``, those of namespace ``netns``, and all their descendants."""
    table = _proc_table()
    found = {root_pid} if root_pid in table else set()
    for pid, (_, conn) in table.items():
        parts = conn.split()
        if len(parts) == 4 and parts[2] == address and parts[3] == str(port):
            found.add(pid)
    if netns is not None:
        found |= _netns_pids(netns) & set(table)
    grew = True
    while grew:
        kids = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        grew = bool(kids)
        found |= kids
    return found


def _is_zombie(pid: int) -> bool:
    """Whether ``pid`` is a zombie or gone."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
        return s[s.rindex(")") + 2] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def kill_sshd_host(proc: subprocess.Popen, cg: Path | None, addr: str, port: int,
                   netns: str | None = None) -> list[int]:
    """Kill an sshd host — its sshd ``proc`` and every process it started: the cgroup ``cg``
    (v2 ``cgroup.kill``) and anything in namespace ``netns``, or, without a cgroup, every
    descendant of ``proc`` and every process whose ``SSH_CONNECTION`` names ``addr:port`` (each
    SIGSTOPped, then SIGKILLed). Waits until they are gone; returns the killed pids.
    ``RuntimeError`` when a process survives (10 s)."""
    if cg is not None:
        killed = _kill_cgroup(cg)
        if netns is not None:  # anything that entered the namespace from outside the cgroup
            extra = _netns_pids(netns) - {os.getpid()}
            for pid in extra:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed = sorted(set(killed) | extra)
    else:
        killed_set: set[int] = set()
        deadline = time.monotonic() + 10
        while True:
            found = _host_pids_proc(proc.pid, addr, port, netns) - {os.getpid()}
            if not found:
                break
            for sig in (signal.SIGSTOP, signal.SIGKILL):  # stop first: no new forks
                for pid in found:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            killed_set |= found
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(found)} of test host {addr} survive")
            time.sleep(0.05)
        killed = sorted(killed_set)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in killed if _pid_alive(p) and not _is_zombie(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if left:
        raise RuntimeError(f"test host {addr}: processes {left} are still alive after removal")
    return killed
