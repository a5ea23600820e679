"""SSHD hosts: real "VMs" on this machine, each its own ``sshd`` with its own address — the hosts
behind the spot emulator's SSH backend (``cluster.spot``), tutorial 03, the demo, the benchmarks
and the test suite's ``ssh_hosts`` fixture (``tests/ssh_hosts.py``).

``SSHDHosts(root)`` creates hosts with ``add()``: per host a fresh ed25519 host key, an sshd
config (key auth only, ``StrictModes no``, ``UsePAM no``, ``Subsystem sftp internal-sftp``, and
``SetEnv HOME=<host dir>/home`` so that each host has its own home and its login shell does not
read the real user's ``~/.bashrc``, which may be slow or hang) and ``sshd -D -e -f CONFIG``. Two
kinds of host (both labelled ``kind=test-host``):

- **loopback** (default): sshd listens on its own ``127.0.0.x`` (port 22 when free, else a free
  port). Cheap; no root needed.
- **network namespace** (``add(netns=True)``, root and iproute2 only): the host gets its own
  network namespace with a veth pair into a bridge of this ``SSHDHosts`` (``10.a.b.0/24``; the
  bridge is ``10.a.b.1``, hosts ``10.a.b.2`` ...), its own ``eth0`` and its own port space; sshd
  runs inside it. Its ``Host.labels`` carry ``env.GLOO_SOCKET_IFNAME=eth0`` (inside a namespace
  the hostname resolves to 127.0.0.1, so gloo must be told the interface). ``cut(host)`` takes
  the bridge side of its veth down: every process keeps running and every TCP connection stays
  open, but no packet passes — a real network cut; ``cut(host, False)`` restores the link.
  ``limit(host, bandwidth_Bps)`` makes its link a slow one (``tc`` token bucket, both
  directions); ``limit(host, None)`` lifts it.

One client key authorises all hosts; ``known_hosts`` lists every host's key; ``options()`` gives
the ``SSHOptions`` to reach them.

A hung VM is ``freeze(host)``: everything it runs stops, its sockets stay open. Pre-emption is
real process death: ``remove(host)`` kills the host's sshd *and every process it started*
(``cluster.sshd_procs``: a cgroup v2 per host, else ``/proc`` ancestry), verifies nothing is
left and raises if something is; a namespace host's namespace and veth are deleted too. A
removed host may be ``add``-ed again under the same name (a spot VM coming back): it gets a new
host key.

``close()`` removes every host (and the bridge). A run that was SIGKILLed leaves cgroups,
namespaces and links named after its dead pid: the next ``SSHDHosts`` reaps them
(``sshd_procs.reap_stale``).

Owns ``SSHDHosts``, ``sshd_path``, ``skip_reason``, ``netns_skip_reason``. Imports
``cluster.hosts``, ``cluster.ssh`` and ``cluster.sshd_procs`` only (and the standard library);
must never import torch, pytest or the manager.
"""

from __future__ import annotations

import getpass
import ipaddress
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from .hosts import Host
from .ssh import SSHOptions
from .sshd_procs import (_BR_PREFIX, _NS_PREFIX, _PREFIX, _VH_PREFIX, _b36, _cgroup2_base, _cgroup_pids,
                         _host_pids_proc, _ip, _ip_path, _kill_cgroup, kill_sshd_host, reap_stale)

_seq = itertools.count()


def sshd_path() -> str | None:
    """The sshd binary (``PATH`` or ``/usr/sbin/sshd``); None when it is not installed."""
    found = shutil.which("sshd")
    if found:
        return found
    return "/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None


def skip_reason() -> str | None:
    """Why SSH test hosts cannot run here (None when they can)."""
    if sshd_path() is None:
        return ("sshd is not installed: run `bash scripts/setup.sh` as root (installs "
                "openssh-server) or `apt-get install -y openssh-server`")
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is not installed (package openssh-client)"
    return None


def netns_skip_reason() -> str | None:
    """Why network-namespace test hosts cannot run here (None when they can)."""
    base = skip_reason()
    if base:
        return base
    if os.geteuid() != 0:
        return "network-namespace test hosts need root (ip netns add, veth, bridge)"
    if _ip_path() is None:
        return "the `ip` command is missing: `apt-get install -y iproute2` (scripts/setup.sh does)"
    r = subprocess.run([_ip_path(), "netns", "list"], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        return f"`ip netns` does not work here: {r.stderr.strip()[:200]}"
    return None



# ----------------------------------------------------------------------------------- test hosts
class _Running:
    def __init__(self, host: Host, proc: subprocess.Popen, dir_: Path, cgroup: Path | None,
                 pubkey: str, netns: str | None = None, veth: str | None = None):
        self.host, self.proc, self.dir, self.cgroup, self.pubkey = host, proc, dir_, cgroup, pubkey
        self.netns, self.veth = netns, veth


class _Bridge:
    """The bridge namespace hosts hang off: ``name`` with ``10.a.b.1/24``."""

    def __init__(self, name: str, net: ipaddress.IPv4Network):
        self.name, self.net = name, net
        self.gateway = str(net.network_address + 1)
        self.next = 2


def _addr_port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
            return True
        except OSError:
            return False


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _keygen(path: Path, comment: str) -> str:
    for p in (path, Path(str(path) + ".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, timeout=30)
    return Path(str(path) + ".pub").read_text().strip()


def _used_ipv4_nets() -> list[ipaddress.IPv4Network]:
    r = _ip("-4", "-o", "addr", "show", check=False)
    nets = []
    for line in r.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets


class SSHDHosts:
    """A set of sshd hosts under ``root`` (see the module docstring). Thread-safe ``add`` /
    ``remove`` (the spot emulator calls them from its replay thread). ``python``: the
    interpreter the hosts' workers run; ``isolation``: ``"cgroup"``, ``"proc"`` or ``"auto"``
    (cgroup v2 where writable). ``RuntimeError`` when sshd cannot run here (``skip_reason()``)."""

    def __init__(self, root: str | Path, *, python: str = sys.executable,
                 prefer_port_22: bool = True, isolation: str = "auto"):
        reason = skip_reason()
        if reason:
            raise RuntimeError(reason)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.python = os.path.abspath(python)
        self.prefer_port_22 = prefer_port_22 and os.geteuid() == 0
        self.sshd = sshd_path()
        self.user = getpass.getuser()
        self.known_hosts = self.root / "known_hosts"
        self.client_key = self.root / "id_ed25519"
        self._client_pub = _keygen(self.client_key, "varuna-test-client")
        (self.root / "authorized_keys").write_text(self._client_pub + "\n")
        self.known_hosts.write_text("")
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        if isolation not in ("auto", "cgroup", "proc"):
            raise ValueError(f"isolation={isolation!r}: use 'auto', 'cgroup' or 'proc'")
        cg_base = _cgroup2_base() if isolation != "proc" else None
        if isolation == "cgroup" and cg_base is None:
            raise RuntimeError("isolation='cgroup': no writable cgroup v2 hierarchy here")
        self._seq = next(_seq)
        self._lock = threading.RLock()
        try:
            reap_stale(cg_base)
        except (OSError, RuntimeError):
            pass
        self.cgroup_root: Path | None = None
        if cg_base is not None:
            try:
                self.cgroup_root = cg_base / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
                self.cgroup_root.mkdir()
            except OSError:
                self.cgroup_root = None
        self._hosts: dict[str, _Running] = {}
        self._next = 0
        self._bridge: _Bridge | None = None
        self._veth_idx = itertools.count()
        # start addresses at a per-process offset so concurrent test runs rarely collide
        self._octet = 2 + (os.getpid() * 7) % 200
        self.closed = False

    # ---------------------------------------------------------------------------------------
    @property
    def hosts(self) -> list[Host]:
        """The hosts up now (added and not removed)."""
        with self._lock:
            return [r.host for r in self._hosts.values()]

    def __contains__(self, name: object) -> bool:
        """Whether a host of this name is up."""
        with self._lock:
            return name in self._hosts

    @property
    def isolation(self) -> str:
        """How a host's processes are found: ``"cgroup"`` (cgroup v2) or ``"proc"`` (``/proc``)."""
        return "cgroup" if self.cgroup_root is not None else "proc"

    @property
    def bridge_address(self) -> str | None:
        """This machine's address on the namespace hosts' bridge (what they reach us at)."""
        return None if self._bridge is None else self._bridge.gateway

    def options(self, **overrides) -> SSHOptions:
        """The ``SSHOptions`` that reach these hosts (their ``known_hosts``, short timeouts);
        ``overrides``: other ``SSHOptions`` fields."""
        kw = dict(known_hosts=self.known_hosts, connect_timeout_s=5.0, command_timeout_s=30.0,
                  kill_grace_s=1.0)
        kw.update(overrides)
        return SSHOptions(**kw)

    def unused_address(self) -> str:
        """A loopback address where nothing listens on port 22 (for 'unreachable' tests)."""
        for _ in range(250):
            addr = self._take_address()
            if _addr_port_free(addr, 22) and _addr_port_free(addr, 2222):
                return addr
        raise RuntimeError("no unused loopback address found")

    def _take_address(self) -> str:
        addr = f"127.0.0.{self._octet}"
        self._octet = 2 + (self._octet - 1) % 253
        return addr

    def add(self, name: str | None = None, *, gpus: int = 0, address: str | None = None,
            port: int | None = None, netns: bool = False) -> Host:
        """Create and start one host; returns its ``Host`` (already in ``known_hosts``).
        ``address``/``port`` pin where a loopback host listens (default: the next free
        127.0.0.x, port 22 when free, else a free port). ``netns=True``: a host in its own
        network namespace (see the module docstring; raises ``RuntimeError`` with the reason
        where that is not possible). A name that was removed may be added again."""
        with self._lock:
            if self.closed:
                raise RuntimeError("SSHDHosts is closed")
            if name is None:
                while f"vm{self._next}" in self._hosts or (self.root / f"vm{self._next}").exists():
                    self._next += 1
                name = f"vm{self._next}"
                self._next += 1
            if name in self._hosts:
                raise ValueError(f"test host {name} exists")
            hdir = self.root / name
            hdir.mkdir(exist_ok=True)
            hostkey = hdir / "ssh_host_ed25519_key"
            pub = _keygen(hostkey, f"varuna-test-{name}")
            if netns:
                return self._add_netns(name, hdir, hostkey, gpus, pub)
            last_err = ""
            for _ in range(1 if address else 20):
                addr = address or self._take_address()
                if any(r.host.address == addr for r in self._hosts.values()):
                    continue
                if port is not None:
                    p = port
                else:
                    p = 22 if self.prefer_port_22 and _addr_port_free(addr, 22) else _free_port(addr)
                # known_hosts first: a client may connect the moment sshd listens
                self._write_known_hosts(extra=(Host(name=name, address=addr, port=p), pub))
                running = self._start(name, hdir, hostkey, addr, p, gpus, pub)
                if running is not None:
                    self._hosts[name] = running
                    self._write_known_hosts()
                    return running.host
                last_err = (hdir / "sshd.log").read_text()[-500:]
            self._write_known_hosts()
            raise RuntimeError(f"could not start sshd for {name}: {last_err}")

    # ---------------------------------------------------------------------- namespace hosts
    def _ensure_bridge(self) -> _Bridge:
        if self._bridge is not None:
            return self._bridge
        reason = netns_skip_reason()
        if reason:
            raise RuntimeError(reason)
        used = _used_ipv4_nets()
        start = (os.getpid() * 131 + self._seq * 17) % (150 * 256)
        for k in range(150 * 256):
            i = (start + k) % (150 * 256)
            net = ipaddress.ip_network(f"10.{100 + i // 256}.{i % 256}.0/24")
            if not any(net.overlaps(u) for u in used):
                break
        else:
            raise RuntimeError("no free 10.x.y.0/24 subnet for the namespace hosts' bridge")
        name = f"{_BR_PREFIX}{_b36(os.getpid())}-{self._seq}"
        _ip("link", "add", name, "type", "bridge")
        try:
            _ip("addr", "add", f"{net.network_address + 1}/{net.prefixlen}", "dev", name)
            _ip("link", "set", name, "up")
        except RuntimeError:
            _ip("link", "del", name, check=False)
            raise
        self._bridge = _Bridge(name, net)
        return self._bridge

    def _add_netns(self, name: str, hdir: Path, hostkey: Path, gpus: int, pub: str) -> Host:
        br = self._ensure_bridge()
        ns = f"{_NS_PREFIX}{os.getpid()}-{self._seq}-{name}"
        veth = f"{_VH_PREFIX}{_b36(os.getpid())}-{self._seq}-{next(self._veth_idx)}"
        if len(veth) > 15:
            raise RuntimeError(f"interface name {veth} too long")
        addr = str(br.net.network_address + br.next)
        br.next += 1
        try:
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", br.name)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{br.net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", br.gateway)
            self._write_known_hosts(extra=(Host(name=name, address=addr, port=22), pub))
            running = self._start(name, hdir, hostkey, addr, 22, gpus, pub, netns=ns)
        except BaseException:
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", veth, check=False)
            self._write_known_hosts()
            raise
        if running is None:
            _ip("netns", "del", ns, check=False)
            self._write_known_hosts()
            raise RuntimeError(f"could not start sshd for {name} in namespace {ns}: "
                               f"{(hdir / 'sshd.log').read_text()[-500:]}")
        running.veth = veth
        self._hosts[name] = running
        self._write_known_hosts()
        return running.host

    def cut(self, host: Host | str, cut: bool = True) -> None:
        """Cut (``cut=True``) or restore the network link of a namespace host: its processes keep
        running and its TCP connections stay open, but no packet passes."""
        with self._lock:
            r = self._hosts[host if isinstance(host, str) else host.name]
        if r.veth is None:
            raise ValueError(f"test host {r.host.name} is a loopback host: only a host made with "
                             "add(netns=True) has a link to cut (use freeze() to hang a loopback host)")
        _ip("link", "set", r.veth, "down" if cut else "up")

    def limit(self, host: Host | str, bandwidth_Bps: float | None, *, latency_s: float = 0.1) -> None:
        """Limit a namespace host's link to ``bandwidth_Bps`` bytes per second in each direction
        (``None``: lift the limit): a token-bucket filter (``tc`` ``tbf``) on both ends of its
        veth — the bridge side shapes what the host receives, ``eth0`` inside its namespace what
        it sends — so activations, gradients and all-reduces to or from it cross a real slow
        link. The bucket holds ~10 ms of traffic (at least 32 KiB); packets wait in a queue of
        up to ``latency_s`` seconds before they are dropped (TCP then backs off, as on a
        congested link). ``netem`` is not used (absent on these machines). Raises
        ``ValueError`` for a loopback host or a bandwidth that is not > 0, ``RuntimeError``
        when ``tc`` fails."""
        with self._lock:
            r = self._hosts[host if isinstance(host, str) else host.name]
        if r.veth is None or r.netns is None:
            raise ValueError(f"test host {r.host.name} is a loopback host: only a host made with "
                             "add(netns=True) has a link to limit")
        tc = shutil.which("tc") or "/usr/sbin/tc"
        ends = [[tc], [_ip_path() or "ip", "netns", "exec", r.netns, tc]]
        devs = [r.veth, "eth0"]
        for cmd, dev in zip(ends, devs):
            if bandwidth_Bps is None:
                argv = [*cmd, "qdisc", "del", "dev", dev, "root"]
            else:
                if not bandwidth_Bps > 0:
                    raise ValueError(f"bandwidth_Bps={bandwidth_Bps!r} must be > 0 bytes per second (or None)")
                burst = max(32 * 1024, int(bandwidth_Bps * 0.01))
                argv = [*cmd, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(bandwidth_Bps * 8)}bit",
                        "burst", str(burst), "latency", f"{int(latency_s * 1000)}ms"]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
            if out.returncode != 0 and not (bandwidth_Bps is None and "No such file" in out.stderr
                                            or bandwidth_Bps is None and "Cannot delete qdisc" in out.stderr):
                raise RuntimeError(f"`{' '.join(argv)}` failed: {out.stderr.strip()}")

    # ---------------------------------------------------------------------------------------
    def host_key(self, host: Host | str) -> str:
        """The host's public key line (``ssh-ed25519 AAAA...``), as it would print it."""
        with self._lock:
            r = self._hosts[host if isinstance(host, str) else host.name]
        return " ".join(r.pubkey.split()[:2])

    def authorize(self, public_key: str) -> None:
        """Let ``public_key`` (an OpenSSH ``.pub`` line) log in to every host."""
        with open(self.root / "authorized_keys", "a") as f:
            f.write(public_key.strip() + "\n")

    def _start(self, name: str, hdir: Path, hostkey: Path, addr: str, port: int, gpus: int,
               pub: str, netns: str | None = None) -> _Running | None:
        cfg = hdir / "sshd_config"
        cfg.write_text("\n".join([
            f"ListenAddress {addr}:{port}",
            f"HostKey {hostkey}",
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
            "PidFile none",
            "StrictModes no",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "HostbasedAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "UseDNS no",
            "PrintMotd no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "MaxSessions 64",
            "MaxStartups 64:30:128",
            "LogLevel INFO",
            "Subsystem sftp internal-sftp",
            # each VM has its own home: the login shell reads this host's (empty) rc files, not
            # the real user's, whose ~/.bashrc may hang (a stale `pyenv rehash` lock waits 60 s)
            f'SetEnv HOME="{hdir / "home"}"',
            "",
        ]))
        (hdir / "home").mkdir(exist_ok=True)
        cg = None
        argv = [self.sshd, "-D", "-e", "-f", str(cfg)]
        if netns is not None:  # `ip netns exec` execs in place (same pid) and remounts /sys
            argv = [_ip_path(), "netns", "exec", netns, *argv]
        if self.cgroup_root is not None:
            cg = self.cgroup_root / name
            cg.mkdir(exist_ok=True)
            # join the cgroup *before* exec, so nothing sshd starts can escape it
            argv = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg), *argv]
        log = open(hdir / "sshd.log", "ab")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, close_fds=True)
        finally:
            log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                if cg is not None:
                    _kill_cgroup(cg)
                return None
            try:
                with socket.create_connection((addr, port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        break
            except OSError:
                time.sleep(0.05)
        else:
            kill_sshd_host(proc, cg, addr, port, netns)
            return None
        labels = {"kind": "test-host"}
        if netns is not None:
            labels.update({"netns": netns, "env.GLOO_SOCKET_IFNAME": "eth0"})
        host = Host(name=name, address=addr, port=port, user=self.user,
                    key_path=self.client_key, gpus=gpus, python=self.python,
                    workdir=str(hdir / "work"), labels=labels)
        (hdir / "work").mkdir(exist_ok=True)
        return _Running(host, proc, hdir, cg, pub, netns=netns)

    def _write_known_hosts(self, extra: tuple[Host, str] | None = None) -> None:
        entries = [(r.host, r.pubkey) for r in self._hosts.values()]
        if extra is not None:
            entries.append(extra)
        lines = [f"{h.known_hosts_name} {' '.join(pub.split()[:2])}" for h, pub in entries]
        tmp = self.known_hosts.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.known_hosts)

    def pids(self, host: Host | str) -> list[int]:
        """Every live process of the host: its sshd, sessions and what they started."""
        with self._lock:
            r = self._hosts[host if isinstance(host, str) else host.name]
        if r.cgroup is not None:
            return sorted(_cgroup_pids(r.cgroup))
        return sorted(_host_pids_proc(r.proc.pid, r.host.address, r.host.port, r.netns))

    def freeze(self, host: Host | str, frozen: bool = True) -> None:
        """Freeze ``host`` like a VM that hangs: its sshd and every process it started stop
        running (cgroup v2 ``cgroup.freeze``, else SIGSTOP), their sockets stay open and send
        nothing. ``freeze(host, False)`` thaws; ``remove`` works on a frozen host."""
        with self._lock:
            r = self._hosts[host if isinstance(host, str) else host.name]
        if r.cgroup is not None:
            (r.cgroup / "cgroup.freeze").write_text("1" if frozen else "0")
            want = f"frozen {1 if frozen else 0}"
            deadline = time.monotonic() + 10
            while want not in (r.cgroup / "cgroup.events").read_text():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"test host {r.host.name}: cgroup did not reach '{want}'")
                time.sleep(0.01)
            return
        for pid in _host_pids_proc(r.proc.pid, r.host.address, r.host.port, r.netns) - {os.getpid()}:
            try:
                os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)
            except ProcessLookupError:
                pass

    def remove(self, host: Host | str) -> list[int]:
        """Pre-empt ``host``: kill its sshd and every process it started; verify none is left
        (a namespace host's namespace and veth are deleted too). Returns the killed pids."""
        name = host if isinstance(host, str) else host.name
        with self._lock:
            r = self._hosts.pop(name)
            self._write_known_hosts()
        try:
            return kill_sshd_host(r.proc, r.cgroup, r.host.address, r.host.port, r.netns)
        finally:
            if r.netns is not None:
                _ip("netns", "del", r.netns, check=False)
                if r.veth is not None:
                    _ip("link", "del", r.veth, check=False)  # normally gone with the namespace

    def close(self) -> None:
        """Remove every host, the bridge and the cgroup root; idempotent."""
        errors = []
        with self._lock:
            names = list(self._hosts)
            self.closed = True
        for name in names:
            try:
                self.remove(name)
            except Exception as e:  # noqa: BLE001 - keep cleaning the others
                errors.append(f"{name}: {e}")
        if self._bridge is not None:
            _ip("link", "del", self._bridge.name, check=False)
            self._bridge = None
        if self.cgroup_root is not None and self.cgroup_root.exists():
            try:
                _kill_cgroup(self.cgroup_root)
            except Exception as e:  # noqa: BLE001
                errors.append(f"cgroup root: {e}")
        if errors:
            raise RuntimeError("test host cleanup failed: " + "; ".join(errors))

    def __enter__(self) -> "SSHDHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
