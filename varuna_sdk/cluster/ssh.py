"""SSH to the job's VMs, on paramiko: connections, remote commands and processes, SFTP.

What this module guarantees:

- **Host keys are verified.** By default every server key must already be in the known_hosts
  file (``SSHOptions.known_hosts``, default ``~/.ssh/known_hosts``); an unknown or changed key
  raises ``HostKeyError`` naming the host, the key's fingerprint and the fix. Freshly
  provisioned VMs whose keys cannot be known in advance need an explicit opt-in,
  ``SSHOptions(trust_on_first_use=True)``: an *unknown* key is then accepted, appended to the
  known_hosts file and logged as a WARNING with its fingerprint; a *changed* key is still
  refused.
- **Key authentication only** (``Host.key_path``; the passphrase comes from the environment
  variable named by ``Host.key_passphrase_env``). No passwords.
- **Nothing waits forever.** Connecting (TCP, SSH banner, key exchange, authentication) is
  bounded by ``connect_timeout_s`` in total, retries included; every command has a timeout
  (``run(timeout_s=...)``), after which its whole remote process group is killed.
- **Transient errors are retried** with exponential back-off (refused or reset connections,
  a VM whose sshd is still starting, timeouts) within the connect deadline; authentication and
  host-key failures are never retried.
- **Connections are reused**: one SSH transport per host (``SSHPool``), many channels on it.
- **Secrets stay secret**: key passphrases and environment values sent to remote commands are
  never logged, never put on a command line (values travel on the command's stdin) and are
  masked in exception messages.

Remote commands run in a new session (``setsid``) whose id the client learns on start, so
``RemoteProcess.kill()`` can stop the command *and everything it started* (``kill -- -SID`` +
``pkill -s SID``). Needs on the VM: POSIX ``sh`` and util-linux ``setsid`` (any Linux).

Owns: ``SSHOptions``, ``SSHConnection``, ``SSHPool``, the host-key policies (verify against
known_hosts, or trust on first use) and ``fingerprint``. The ``SSHError`` family is in
``cluster.ssh_errors``; ``RemoteProcess`` / ``CommandResult`` and the command wrapping in
``cluster.ssh_process``. Imports paramiko, ``cluster.hosts``, ``cluster.ssh_errors`` and
``cluster.ssh_process`` only; must never import torch, the manager, the notebook or the CLI.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import logging
import os
import shlex
import stat
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import paramiko

from .hosts import Host, Secret
from .ssh_errors import (AuthenticationError, CommandError, CommandTimeout, ConnectionLostError, HostKeyError,
                         HostUnreachableError, SFTPError, _mask)
from .ssh_process import _ENV_END, CommandResult, RemoteProcess, _check_env, _command_line, _wrap

log = logging.getLogger(__name__)

_known_hosts_lock = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:...`` fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# --------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class SSHOptions:
    """How to connect. ``known_hosts``: the file host keys are checked against (OpenSSH format,
    hashed entries allowed). ``trust_on_first_use``: accept and record keys of hosts absent from
    that file (for fresh VMs; logged as a warning) — changed keys are refused regardless.
    ``connect_timeout_s``: total time to establish a session, retries included.
    ``connect_attempts`` and ``backoff_s``/``backoff_max_s``: retry schedule for transient errors.
    ``command_timeout_s``: default timeout of ``run`` when none is given.
    ``kill_grace_s``: SIGTERM → SIGKILL delay when a remote process group is stopped.
    ``keepalive_s``: SSH keepalive interval (detects a vanished VM on an idle connection).
    """

    known_hosts: Path = field(default_factory=lambda: Path("~/.ssh/known_hosts").expanduser())
    trust_on_first_use: bool = False
    connect_timeout_s: float = 15.0
    connect_attempts: int = 5
    backoff_s: float = 0.2
    backoff_max_s: float = 2.0
    command_timeout_s: float = 600.0
    kill_grace_s: float = 2.0
    keepalive_s: float = 10.0

    def __post_init__(self):
        object.__setattr__(self, "known_hosts", Path(self.known_hosts).expanduser())
        if self.connect_timeout_s <= 0 or self.command_timeout_s <= 0:
            raise ValueError("SSHOptions: timeouts must be > 0 seconds")
        if self.connect_attempts < 1:
            raise ValueError("SSHOptions: connect_attempts must be >= 1")


# ------------------------------------------------------------------------------ host-key policies
class _UnknownHostKey(Exception):
    def __init__(self, name: str, key: paramiko.PKey):
        super().__init__(name)
        self.name, self.key = name, key


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key):
        raise _UnknownHostKey(hostname, key)


class _TrustOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Accept an unknown key, append it to the known_hosts file, warn loudly."""

    def __init__(self, host: Host, path: Path):
        self.host, self.path = host, path

    def missing_host_key(self, client, hostname, key):
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.seek(0)
                if line not in f.read().splitlines(keepends=True):
                    f.seek(0, os.SEEK_END)
                    f.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)
        log.warning("trust_on_first_use: accepted the unverified %s host key %s of %s (%s) and "
                    "recorded it in %s; later connections must present the same key",
                    key.get_name(), fingerprint(key), self.host.name, hostname, self.path)


# ----------------------------------------------------------------------------------- connection
class SSHConnection:
    """One reusable SSH session to one host (thread-safe; reconnects when the transport died).

    ``run`` a command to completion, ``start`` a long-running one, ``put``/``get`` files."""

    def __init__(self, host: Host, options: SSHOptions | None = None):
        self.host = host
        self.options = options or SSHOptions()
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._lock = threading.RLock()
        self.connects = 0  # how many sessions were established (reuse is observable)

    # connection ---------------------------------------------------------------------------
    @property
    def transport(self) -> paramiko.Transport | None:
        """The paramiko ``Transport`` of this connection, or None before ``connect()`` and after ``close()``."""
        return None if self._client is None else self._client.get_transport()

    def is_connected(self) -> bool:
        """True when the SSH session is up and authenticated (False when its transport died, e.g. the VM vanished)."""
        t = self.transport
        return t is not None and t.is_active() and t.is_authenticated()

    def connect(self) -> "SSHConnection":
        """Establish the session if there is none (or it died). Raises ``HostKeyError``,
        ``AuthenticationError`` (never retried) or ``HostUnreachableError`` (after retries, within
        ``connect_timeout_s``)."""
        with self._lock:
            if self.is_connected():
                return self
            self._close_locked()
            opts, host = self.options, self.host
            passphrase = host.passphrase()
            secrets = [passphrase.reveal()] if passphrase else []
            pkey = self._load_key(passphrase, secrets)
            deadline = time.monotonic() + opts.connect_timeout_s
            delay, attempt, last = opts.backoff_s, 0, "no attempt"
            while True:
                attempt += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                client = paramiko.SSHClient()
                try:
                    if opts.known_hosts.exists():
                        client.load_host_keys(str(opts.known_hosts))
                    client.set_missing_host_key_policy(
                        _TrustOnFirstUse(host, opts.known_hosts) if opts.trust_on_first_use
                        else _RejectUnknown())
                    client.connect(
                        host.address, port=host.port, username=host.user, pkey=pkey,
                        key_filename=None, allow_agent=pkey is None, look_for_keys=pkey is None,
                        timeout=remaining, banner_timeout=remaining, auth_timeout=remaining,
                        channel_timeout=opts.connect_timeout_s)
                    t = client.get_transport()
                    if opts.keepalive_s:
                        t.set_keepalive(max(1, int(opts.keepalive_s)))
                    self._client = client
                    self.connects += 1
                    log.debug("connected to %s (attempt %d)", host, attempt)
                    return self
                except paramiko.BadHostKeyException as e:
                    client.close()
                    raise HostKeyError(host, (
                        f"host key MISMATCH: the server presented {e.key.get_name()} "
                        f"{fingerprint(e.key)}, but {opts.known_hosts} records "
                        f"{fingerprint(e.expected_key)} for {host.known_hosts_name}. Connection "
                        "refused: this can be a man-in-the-middle. If the VM was re-provisioned, "
                        f"remove its old entry with `ssh-keygen -f {opts.known_hosts} -R "
                        f"'{host.known_hosts_name}'` and reconnect")) from None
                except _UnknownHostKey as e:
                    client.close()
                    raise HostKeyError(host, (
                        f"unknown host key: {e.key.get_name()} {fingerprint(e.key)} is not in "
                        f"{opts.known_hosts} for {e.name}. Verify the fingerprint and add it "
                        f"(`ssh-keyscan -p {host.port} {host.address} >> {opts.known_hosts}`), "
                        "or, for freshly provisioned VMs, opt in with "
                        "SSHOptions(trust_on_first_use=True)")) from None
                except paramiko.AuthenticationException as e:
                    client.close()
                    raise AuthenticationError(host, (
                        f"authentication as {host.user!r} failed "
                        f"({_mask(str(e) or type(e).__name__, secrets)}); check that the public "
                        f"key of {host.key_path or 'your default key'} is in the VM's "
                        "authorized_keys")) from None
                except (OSError, EOFError, paramiko.SSHException) as e:
                    client.close()
                    last = f"{type(e).__name__}: {_mask(str(e), secrets)}" if str(e) else type(e).__name__
                    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):
                        break
                    if attempt >= opts.connect_attempts:
                        break
                    sleep = min(delay, deadline - time.monotonic())
                    if sleep <= 0:
                        break
                    log.debug("connect to %s failed (%s); retry %d in %.2fs", host, last,
                              attempt, sleep)
                    time.sleep(sleep)
                    delay = min(delay * 2, opts.backoff_max_s)
            raise HostUnreachableError(host, (
                f"no SSH session after {attempt} attempt(s) within {opts.connect_timeout_s:g}s "
                f"(last error: {last}); check that the VM is up, that sshd listens on port "
                f"{host.port} and that the address is reachable"))

    def _load_key(self, passphrase: Secret | None, secrets: list[str]) -> paramiko.PKey | None:
        host = self.host
        if host.key_path is None:
            return None
        try:
            return paramiko.PKey.from_path(host.key_path,
                                           passphrase.reveal().encode() if passphrase else None)
        except FileNotFoundError:
            raise AuthenticationError(host, f"private key file {host.key_path} does not "
                                            "exist") from None
        except (paramiko.PasswordRequiredException, TypeError) as e:
            if isinstance(e, TypeError) and (passphrase is not None or "password" not in str(e)):
                raise AuthenticationError(host, f"could not load private key {host.key_path}: "
                                                f"{type(e).__name__}") from None
            where = (f"the environment variable {host.key_passphrase_env} is not set"
                     if host.key_passphrase_env else "set Host.key_passphrase_env to the name "
                     "of the environment variable that holds it")
            raise AuthenticationError(host, f"private key {host.key_path} is encrypted and needs "
                                            f"a passphrase: {where}") from None
        except (paramiko.SSHException, ValueError) as e:
            raise AuthenticationError(host, (
                f"could not load private key {host.key_path}: "
                f"{_mask(str(e) or type(e).__name__, secrets)} (wrong passphrase in "
                f"{host.key_passphrase_env or 'key_passphrase_env'}, or not a private key)")) from None

    def close(self) -> None:
        """Close the SFTP client and the SSH session (idempotent); the next command or transfer connects again."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._sftp is not None:
            try:
                self._sftp.close()
            except Exception:  # noqa: BLE001
                pass
            self._sftp = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "SSHConnection":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    # commands -----------------------------------------------------------------------------
    def _open_channel(self) -> paramiko.Channel:
        """A new session channel; reconnects once if the cached transport turned out dead."""
        for attempt in (1, 2):
            self.connect()
            t = self.transport
            try:
                return t.open_session(timeout=self.options.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError) as e:
                if attempt == 2:
                    raise ConnectionLostError(self.host, f"could not open a channel: "
                                                         f"{type(e).__name__}: {e}") from None
                with self._lock:
                    self._close_locked()
        raise AssertionError("unreachable")

    def start(self, command: str | Sequence[str], *,
              env: Mapping[str, str | Secret] | None = None,
              stdin: bytes | str | None = None,
              on_stdout: Callable[[str], None] | None = None,
              on_stderr: Callable[[str], None] | None = None,
              collect: bool = True, cwd: str | None = None,
              on_exit: Callable[[], None] | None = None) -> RemoteProcess:
        """Start ``command`` (a shell line for ``/bin/sh``, or an argv list that is quoted and
        ``exec``-ed) in a new session on the host and return at once. ``env`` values are sent on
        stdin and exported before the command runs: they never appear in a command line, a
        process listing's arguments or a log. Output lines go to the callbacks as they come.
        ``cwd``: folder to run in (exit code 97 when it does not exist). ``on_exit()`` is called
        (from the reader thread) once the command has ended or its connection was lost."""
        env_items = _check_env(env)
        display = _command_line(command)
        chan = self._open_channel()
        watchdog = threading.Timer(self.options.connect_timeout_s, chan.close)
        watchdog.daemon = True
        watchdog.start()
        try:
            chan.exec_command(_wrap(command, bool(env_items), cwd))
        except (paramiko.SSHException, EOFError, OSError) as e:
            chan.close()
            raise ConnectionLostError(self.host, f"could not start the command: "
                                                 f"{type(e).__name__}") from None
        finally:
            watchdog.cancel()
        log.debug("started on %s: %s (env: %s)", self.host.name, display,
                  ", ".join(k for k, _ in env_items) or "-")
        proc = RemoteProcess(self, chan, display, on_stdout, on_stderr, collect, on_exit)
        try:
            if env_items:
                chan.sendall("".join(f"{k}={v}\n" for k, v in env_items) + _ENV_END + "\n")
            if stdin is not None:
                chan.sendall(stdin.encode() if isinstance(stdin, str) else stdin)
            chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command already ended; its exit status tells
        return proc

    def run(self, command: str | Sequence[str], *, timeout_s: float | None = None,
            env: Mapping[str, str | Secret] | None = None, stdin: bytes | str | None = None,
            check: bool = False, cwd: str | None = None) -> CommandResult:
        """Run ``command`` to completion. Past ``timeout_s`` the command's whole process group
        is killed and ``CommandTimeout`` raised (with the output so far); with ``check=True`` a
        non-zero exit raises ``CommandError``."""
        timeout = self.options.command_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        proc = self.start(command, env=env, stdin=stdin, cwd=cwd)
        code = proc.wait(timeout)
        if not proc.done():
            killed = proc.kill()
            raise CommandTimeout(
                self.host, f"command timed out after {timeout:g}s and was "
                           f"{'killed' if killed else 'signalled (some processes may remain)'}: "
                           f"{_short(proc.command)}", proc.stdout, proc.stderr, killed)
        if proc.connection_lost:
            raise ConnectionLostError(self.host, f"connection lost while running "
                                                 f"{_short(proc.command)}")
        result = CommandResult(self.host, proc.command, code, proc.stdout, proc.stderr,
                               time.monotonic() - t0)
        if check and not result.ok:
            tail = "\n".join(result.stderr.strip().splitlines()[-10:])
            secrets = [v.reveal() for v in (env or {}).values() if isinstance(v, Secret)]
            raise CommandError(self.host, _mask(
                f"command exited with {code}: {_short(proc.command)}"
                + (f"\n{tail}" if tail else ""), secrets), result)
        return result

    def kill_session(self, sid: int, *, grace_s: float | None = None,
                     timeout_s: float = 15.0) -> bool:
        """SIGTERM every process of session ``sid`` on the host, SIGKILL what is left after
        ``grace_s``; True when none is left."""
        if not isinstance(sid, int) or sid <= 1:
            raise ValueError(f"refusing to kill session {sid!r}")
        grace = self.options.kill_grace_s if grace_s is None else grace_s
        ticks = max(1, int(grace * 10))
        # POSIX sh, no procps needed: scan /proc for live (non-zombie) members of the session;
        # zombies are ignored (dead already; on some VMs init reaps them slowly).
        script = (
            f"s={sid}; "
            "each() { for f in /proc/[0-9]*/stat; do IFS= read -r l < \"$f\" 2>/dev/null "
            "|| continue; p=${f#/proc/}; p=${p%/stat}; set -- ${l##*) }; "
            "[ \"$4\" = \"$s\" ] && [ \"$1\" != Z ] && echo $p; done; }; "
            "sig() { kill -$1 -$s 2>/dev/null; for p in $(each); do kill -$1 $p 2>/dev/null; "
            "done; }; has() { [ -n \"$(each)\" ]; }; "
            f"sig TERM; i=0; while has && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; "
            "has || exit 0; sig KILL; i=0; while has && [ $i -lt 20 ]; do sleep 0.1; "
            "i=$((i+1)); done; has && exit 1; exit 0")
        chan = self._open_channel()
        try:
            chan.settimeout(timeout_s)
            chan.exec_command("exec /bin/sh -c " + shlex.quote(script))
            chan.shutdown_write()
            deadline = time.monotonic() + timeout_s
            while not chan.exit_status_ready() and time.monotonic() < deadline:
                chan.status_event.wait(0.2)
            ok = chan.exit_status_ready() and chan.recv_exit_status() == 0
        except (OSError, EOFError, paramiko.SSHException):
            ok = False
        finally:
            chan.close()
        log.debug("killed session %d on %s: %s", sid, self.host.name, "clean" if ok else "LEFT")
        return ok

    # files ----------------------------------------------------------------------------------
    def sftp(self) -> paramiko.SFTPClient:
        """This connection's SFTP client, connecting first if needed and reopened when its channel closed; its
        operations time out after ``command_timeout_s`` seconds. Raises ``SFTPError`` when SFTP cannot be opened, and
        ``connect()``'s errors."""
        with self._lock:
            self.connect()
            if self._sftp is None or self._sftp.sock.closed:
                try:
                    self._sftp = self._client.open_sftp()
                except (paramiko.SSHException, EOFError, OSError) as e:
                    raise SFTPError(self.host, f"could not open SFTP: {type(e).__name__}: {e}") from None
                self._sftp.get_channel().settimeout(self.options.command_timeout_s)
            return self._sftp

    def put(self, local: str | os.PathLike, remote: str, *, mode: int | None = None,
            mkdirs: bool = False) -> None:
        """Upload a file atomically (to ``remote.part-*``, then rename over ``remote``)."""
        local = Path(local)
        if not local.is_file():
            raise SFTPError(self.host, f"put {local} -> {remote}: local file does not exist")
        sftp = self.sftp()
        tmp = f"{remote}.part-{uuid.uuid4().hex[:8]}"
        try:
            if mkdirs:
                self._mkdirs(sftp, os.path.dirname(remote))
            sftp.put(str(local), tmp)
            sftp.chmod(tmp, stat.S_IMODE(local.stat().st_mode) if mode is None else mode)
            sftp.posix_rename(tmp, remote)
        except (OSError, paramiko.SSHException, EOFError) as e:
            try:
                sftp.remove(tmp)
            except Exception:  # noqa: BLE001
                pass
            raise SFTPError(self.host, f"put {local} -> {remote} failed: "
                                       f"{type(e).__name__}: {e}") from None

    def get(self, remote: str, local: str | os.PathLike) -> None:
        """Download ``remote`` to ``local`` (written to a temporary name, then renamed)."""
        local = Path(local)
        tmp = local.with_name(f".{local.name}.part-{uuid.uuid4().hex[:8]}")
        sftp = self.sftp()
        try:
            sftp.get(remote, str(tmp))
            os.replace(tmp, local)
        except (OSError, paramiko.SSHException, EOFError) as e:
            tmp.unlink(missing_ok=True)
            raise SFTPError(self.host, f"get {remote} -> {local} failed: "
                                       f"{type(e).__name__}: {e}") from None

    @staticmethod
    def _mkdirs(sftp: paramiko.SFTPClient, path: str) -> None:
        parts, cur = [p for p in path.split("/") if p], "/" if path.startswith("/") else ""
        for p in parts:
            cur = f"{cur}{p}" if cur in ("", "/") else f"{cur}/{p}"
            try:
                sftp.stat(cur)
            except FileNotFoundError:
                sftp.mkdir(cur)

    def __repr__(self) -> str:
        return f"<SSHConnection {self.host} {'connected' if self.is_connected() else 'idle'}>"


def _short(cmd: str, n: int = 120) -> str:
    return cmd if len(cmd) <= n else cmd[: n - 3] + "..."


class SSHPool:
    """One ``SSHConnection`` per host, shared by everything that talks to that host."""

    def __init__(self, options: SSHOptions | None = None):
        self.options = options or SSHOptions()
        self._conns: dict[tuple, SSHConnection] = {}
        self._lock = threading.Lock()

    def get(self, host: Host) -> SSHConnection:
        """The shared ``SSHConnection`` to ``host``, made on first use (not yet connected) and replaced when the host's
        description changed. Thread-safe."""
        key = (host.name, host.address, host.port, host.user)
        with self._lock:
            conn = self._conns.get(key)
            if conn is None or conn.host != host:
                conn = self._conns[key] = SSHConnection(host, self.options)
        return conn

    def drop(self, host: Host) -> None:
        """Close and forget the connection to ``host`` (e.g. a VM that went away); the next ``get`` makes a new one. A
        host without a connection is ignored."""
        with self._lock:
            conn = self._conns.pop((host.name, host.address, host.port, host.user), None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close every connection in the pool; the pool stays usable (``get`` makes new ones)."""
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()

    def __enter__(self) -> "SSHPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
