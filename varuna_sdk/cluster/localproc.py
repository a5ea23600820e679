"""Local hosts: "VMs" that are slots of this machine, whose workers run as local subprocesses
(the embedded default provider, ``LocalProvider``, and the spot emulator's local slots).

A local host is an ordinary ``Host`` marked ``labels["kind"] == "local"`` (``local_host(i)``,
``is_local(host)``); its address is ``127.0.0.1`` and its Python is this one. Nothing reaches it
over SSH: ``cluster.remote.start_workers`` starts its workers with ``start_local`` instead of an SSH
channel, with the very same environment contract, and gets back a ``LocalProcess`` that behaves
like ``ssh_process.RemoteProcess`` (``poll``, ``wait``, ``kill``, ``exit_code``, ``ended_at`` ...), so
one ``RemoteJob`` manages local and remote workers alike.

Every local worker runs in its own session (``setsid``); ``kill()`` signals the whole session —
the worker and anything it started — SIGTERM then SIGKILL, and checks that nothing is left.
Processes are registered under their host's name, so a local slot can be pre-empted like a VM:
``kill_host(name)`` SIGKILLs every session started for that slot (the spot emulator's removal).

A worker (``python -m varuna_sdk.worker CONFIG RUN_DIR``) is forked by its run's zygote
(``cluster.zygote``: torch imported once per run, not once per worker and generation), which
``close_zygotes`` ends when the job does; any other command, or ``VARUNA_SDK_START_METHOD=spawn``,
is a plain subprocess.

Owns ``LOCAL_KIND``, ``is_local``, ``local_host``, ``LocalProcess``, ``start_local``,
``local_processes``, ``kill_host``, ``close_zygotes``. Imports ``cluster.hosts``,
``cluster.zygote`` and ``pipeline.spawn``'s switch (``START_METHOD_ENV``); never torch,
paramiko or the manager.
"""

from __future__ import annotations

import atexit
import codecs
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..pipeline.spawn import START_METHOD_ENV   # =spawn: every worker a fresh subprocess, no zygote (torch-free import)
from .hosts import Host, Secret, notify
from .zygote import ZygoteClient, ZygoteError

log = logging.getLogger(__name__)

LOCAL_KIND = "local"
LOCAL_ADDRESS = "127.0.0.1"

_registry: dict[str, list["LocalProcess"]] = {}
_registry_lock = threading.Lock()


def is_local(host: Host) -> bool:
    """True for a local slot (``labels["kind"] == "local"``): workers run as subprocesses here."""
    return host.labels.get("kind") == LOCAL_KIND


def local_host(index_or_name: int | str, *, gpus: int = 0, labels: Mapping[str, str] | None = None) -> Host:
    """The local slot ``local<i>`` (or the given name): address 127.0.0.1, this Python, labelled
    ``kind=local`` (plus ``labels``). ``gpus``: GPUs the slot offers (0: CPU, one worker)."""
    name = f"local{index_or_name}" if isinstance(index_or_name, int) else index_or_name
    return Host(name=name, address=LOCAL_ADDRESS, gpus=gpus, python=os.path.abspath(sys.executable),
                labels={**dict(labels or {}), "kind": LOCAL_KIND})


def _session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid`` on this machine."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            s = (p / "stat").read_text()
            fields = s[s.rindex(")") + 2:].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                out.append(int(p.name))
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
    return out


def _signal_session(sid: int, sig: int) -> None:
    try:
        os.killpg(sid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in _session_pids(sid):  # members that changed process group
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class LocalProcess:
    """A command running here in its own session, with the interface of ``ssh_process.RemoteProcess``.
    Output is delivered line by line to the callbacks from reader threads."""

    connection_lost = False  # there is no connection to lose

    def __init__(self, host: Host, argv: Sequence[str], env: Mapping[str, str], cwd: str | None,
                 on_stdout: Callable[[str], None] | None, on_stderr: Callable[[str], None] | None,
                 on_exit: Callable[[], None] | None = None, kill_grace_s: float = 2.0):
        self.host, self.command = host, " ".join(argv)
        self.kill_grace_s = kill_grace_s
        self.killed = False
        self.exit_code: int | None = None
        self.started_at = time.monotonic()
        self.ended_at: float | None = None
        self._done = threading.Event()
        self._on_exit = on_exit
        self._proc, out, err = _start(host, list(argv), dict(env), cwd)
        self.pid = self.sid = self._proc.pid
        self._readers = [threading.Thread(target=self._pump, args=(s, cb), daemon=True,
                                          name=f"local-{host.name}-{i}")
                         for i, (s, cb) in enumerate(((out, on_stdout), (err, on_stderr)))]
        for t in self._readers:
            t.start()
        threading.Thread(target=self._reap, daemon=True, name=f"local-{host.name}-wait").start()

    def _pump(self, stream, cb) -> None:
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        partial = ""
        try:
            for chunk in iter(lambda: stream.read1(65536), b""):
                text = partial + dec.decode(chunk)
                *lines, partial = text.split("\n")
                for line in lines:
                    self._emit(cb, line.rstrip("\r"))
        except (OSError, ValueError):
            pass
        finally:
            partial += dec.decode(b"", True)
            if partial:
                self._emit(cb, partial)
            try:
                stream.close()
            except OSError:
                pass

    def _emit(self, cb, line: str) -> None:
        if cb is not None:
            try:
                cb(line)
            except Exception:  # noqa: BLE001 - a faulty callback must not stop the pump
                log.exception("output callback for %s failed", self.host.name)

    def _reap(self) -> None:
        code = self._proc.wait()
        for t in self._readers:  # a daemon child may hold the pipes open: do not wait forever
            t.join(1.0)
        self.exit_code, self.ended_at = code, time.monotonic()
        self._done.set()
        notify([self._on_exit], logger=log, what=f"exit callback for {self.host.name}")

    # ------------------------------------------------------------------- RemoteProcess's face
    def poll(self) -> int | None:
        """The exit code once the process has ended (negative: killed by that signal), else None; never waits."""
        return self.exit_code if self._done.is_set() else None

    def done(self) -> bool:
        """True once the process has exited and its output readers have finished (or were given up on after 1 s)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (None: for ever) for the process to end; its exit code, or None if it is
        still running."""
        self._done.wait(timeout)
        return self.exit_code if self._done.is_set() else None

    def wait_started(self, timeout: float = 10.0) -> int | None:
        """The session id (the process id: the command leads its own session). Known at once, since the process is
        already started; ``timeout`` is unused, kept for ``RemoteProcess``'s interface."""
        return self.sid

    def pids(self) -> list[int]:
        """Live processes of this worker's session (the worker and what it started)."""
        return _session_pids(self.sid)

    def kill(self, grace_s: float | None = None, timeout_s: float = 15.0) -> bool:
        """SIGTERM the whole session, SIGKILL what is left after ``grace_s``; True when nothing
        of the session is left."""
        self.killed = True
        grace = self.kill_grace_s if grace_s is None else grace_s
        _signal_session(self.sid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _session_pids(self.sid) and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + max(1.0, timeout_s - grace)
        while _session_pids(self.sid) and time.monotonic() < deadline:
            _signal_session(self.sid, signal.SIGKILL)
            time.sleep(0.05)
        self._done.wait(min(5.0, timeout_s))
        return not _session_pids(self.sid)

    def _close_channel(self) -> None:
        """Nothing to close (``RemoteJob.stop(gone=...)`` calls this for lost hosts)."""

    def __repr__(self) -> str:
        state = "running" if not self.done() else f"exit={self.exit_code}"
        return f"<LocalProcess {self.host.name} pid={self.pid} {state}: {self.command[:60]}>"


_zygotes: dict[tuple[str, str], ZygoteClient] = {}
_zygotes_lock = threading.Lock()


def _start(host: Host, argv: list[str], env: dict[str, str], cwd: str | None):
    """``(process, stdout, stderr)``: a worker (``python -m varuna_sdk.worker CONFIG RUN_DIR``)
    forked by its run's zygote (``cluster.zygote``: torch already imported), else — any other
    command, the zygote off or failing — a subprocess in a new session. ``process`` has ``pid``,
    ``poll()`` and ``wait()``; the streams are binary pipes."""
    z = _zygote_for(argv)
    if z is not None:
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        try:
            child = z.fork(argv[3:], env, cwd, w_out, w_err)
        except ZygoteError as e:
            log.warning("%s: starting the worker as a new process instead (%s)", host.name, e)
            for fd in (r_out, r_err):
                os.close(fd)
        else:
            return child, open(r_out, "rb"), open(r_err, "rb")
        finally:
            for fd in (w_out, w_err):
                os.close(fd)
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    return proc, proc.stdout, proc.stderr


def _zygote_for(argv: list[str]) -> ZygoteClient | None:
    """The zygote of the run ``argv`` starts a worker of (started now if none is alive), or None:
    not a worker command, ``VARUNA_SDK_START_METHOD=spawn``, or no fork here."""
    if (len(argv) != 5 or argv[1:3] != ["-m", "varuna_sdk.worker"] or os.environ.get(START_METHOD_ENV) == "spawn"
            or not sys.platform.startswith("linux") or not hasattr(socket, "send_fds")):
        return None
    key = (argv[0], str(Path(argv[4]).resolve()))
    with _zygotes_lock:
        z = _zygotes.get(key)
        if z is not None and z.alive:
            return z
        if z is not None:
            z.close(0.5)
        try:
            z = _zygotes[key] = ZygoteClient(argv[0], key[1])
        except ZygoteError as e:
            log.warning("no zygote for %s: %s", key[1], e)
            return None
        return z


def close_zygotes(run_dir: str | Path | None = None) -> None:
    """End the zygote of ``run_dir`` (every zygote: None) — the manager, when its job ends; the
    workers they forked are not touched."""
    want = None if run_dir is None else str(Path(run_dir).resolve())
    with _zygotes_lock:
        keys = [k for k in _zygotes if want is None or k[1] == want]
        gone = [_zygotes.pop(k) for k in keys]
    for z in gone:
        z.close()


atexit.register(close_zygotes)


def start_local(host: Host, argv: Sequence[str], *, env: Mapping[str, str | Secret] | None = None,
                cwd: str | None = None, on_stdout: Callable[[str], None] | None = None,
                on_stderr: Callable[[str], None] | None = None,
                on_exit: Callable[[], None] | None = None, kill_grace_s: float = 2.0) -> LocalProcess:
    """Start ``argv`` for local host ``host`` in a new session, with this process's environment
    plus ``env`` (``Secret`` values revealed only into the child's environment, never onto its
    command line). Raises ``ValueError`` if ``host`` is not a local host, ``FileNotFoundError``
    if ``cwd`` or the program does not exist."""
    if not is_local(host):
        raise ValueError(f"{host.name} is not a local host (labels kind={host.labels.get('kind')!r}); "
                         "reach it over SSH with cluster.remote.start_workers")
    if cwd is not None and not Path(cwd).is_dir():
        raise FileNotFoundError(f"{host.name}: working folder {cwd} does not exist")
    full = dict(os.environ)
    for k, v in (env or {}).items():
        full[k] = v.reveal() if isinstance(v, Secret) else str(v)
    proc = LocalProcess(host, argv, full, cwd, on_stdout, on_stderr, on_exit, kill_grace_s)
    with _registry_lock:
        live = [p for p in _registry.get(host.name, []) if not p.done()]
        _registry[host.name] = live + [proc]
    return proc


def local_processes(host_name: str) -> list[LocalProcess]:
    """The processes started for local host ``host_name`` that have not ended."""
    with _registry_lock:
        return [p for p in _registry.get(host_name, []) if not p.done()]


def kill_host(host_name: str, timeout_s: float = 10.0) -> list[int]:
    """Pre-empt local slot ``host_name``: SIGKILL every session started for it (no grace, like a
    VM taken away) and wait until none is left. Returns the pids that were killed; raises
    ``RuntimeError`` if any survive."""
    with _registry_lock:
        procs = list(_registry.pop(host_name, []))
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        left = {pid for p in procs for pid in _session_pids(p.sid)}
        if not left:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"local host {host_name}: processes {sorted(left)} survive SIGKILL")
        killed |= left
        for p in procs:
            _signal_session(p.sid, signal.SIGKILL)
        time.sleep(0.02)
    for p in procs:
        p.wait(5.0)
    return sorted(killed)
