"""The zygote: one process per run folder that has imported torch (and ``torch._dynamo``, which an
optimizer's first call imports) once, and forks that run's local workers from it.

A fresh ``python -m varuna_sdk.worker`` spends ~1.2 s of CPU importing torch and ~2.5 s more
importing ``torch._dynamo`` before its first step; on a 2-core machine the 4 workers of a local
generation took ~7 s of a morph's downtime doing that, every generation. A worker forked from the
zygote starts with them imported.

``ZygoteClient`` (the launcher's side, ``cluster.localproc``) starts
``python -m varuna_sdk.worker --zygote FD RUN_DIR`` with one end of a ``SOCK_SEQPACKET`` socket
pair; each ``fork(args, env, cwd, stdout_fd, stderr_fd)`` sends the worker's arguments,
environment and working folder as one JSON message with its two output pipes attached
(``SCM_RIGHTS``), and gets back the worker's pid; the zygote reaps its children and reports each
exit code. The worker leads its own session (as a ``start_new_session`` subprocess does), its
stdin is ``/dev/null``, its environment exactly the one sent, its ``sys.path`` that of a fresh
``python -m`` in its working folder with that environment's ``PYTHONPATH`` (and the
``sitecustomize`` that path finds is run, as at an interpreter's start); its command line is
the zygote's, which names ``varuna_sdk.worker`` and the run folder (what ``ps``, the orphan check
and the tests look for). What torch reads from the environment when it is imported is what the
zygote saw (as for ``pipeline.spawn``'s fork server); the CUDA and NCCL settings are read later,
in the worker. The secret in a worker's environment crosses the socket pair only (never argv).

Nothing received is unpickled: messages are JSON between a process and the child it started.
When the zygote is gone (killed, failed to start) its workers' exit codes are unknown (-1, once
their pid is gone) and a new one is started for the next fork; ``localproc`` falls back to a
plain subprocess when a fork fails. ``VARUNA_SDK_START_METHOD=spawn`` turns it off.

Owns ``ZygoteClient``, ``ZygoteChild``, ``ZygoteError``, ``serve``. Imports the standard library
only (the zygote's preloads are given by ``varuna_sdk.worker``); never torch here.
"""

from __future__ import annotations

import io
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, Mapping, Sequence

log = logging.getLogger(__name__)

#: the largest message either side sends (a worker's environment and arguments)
MAX_MESSAGE = 1 << 20


class ZygoteError(RuntimeError):
    """The zygote could not start or fork a worker (the caller starts a plain subprocess)."""


class ZygoteChild:
    """A worker forked by the zygote: ``pid`` (= its session id), and its exit code once it ended
    (``poll``/``wait``; negative: killed by that signal; -1: not known, the zygote was gone)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()

    def _ended(self, code: int) -> None:
        if not self._done.is_set():
            self.returncode = code
            self._done.set()

    def poll(self) -> int | None:
        """The exit code once the worker ended, else None; never waits."""
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (None: for ever) for the exit code; None if still running."""
        self._done.wait(timeout)
        return self.returncode if self._done.is_set() else None


class ZygoteClient:
    """The launcher's handle on one run's zygote (started at once; ready once it has imported its
    preloads). ``fork`` starts a worker; ``close`` ends the zygote (its workers run on).

    Args:
        python: the interpreter (the local host's, this one).
        run_dir: the run folder: on the zygote's command line, so its workers' name it too.
        env: the zygote's own environment (default this process's).
        ready_timeout_s: seconds a fork waits for the zygote to have imported its preloads.
        serve_args: the zygote's command after ``python``, before ``FD RUN_DIR`` (a program that
            calls ``serve``; default the worker's)."""

    def __init__(self, python: str, run_dir: str, env: Mapping[str, str] | None = None,
                 ready_timeout_s: float = 120.0, serve_args: Sequence[str] = ("-m", "varuna_sdk.worker", "--zygote")):
        self.python, self.run_dir, self.ready_timeout_s = python, run_dir, ready_timeout_s
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = mine
        try:
            self._proc = subprocess.Popen(
                [python, *serve_args, str(theirs.fileno()), run_dir],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True, env=dict(env if env is not None else os.environ))
        except OSError as e:
            mine.close()
            raise ZygoteError(f"the zygote could not start: {e}") from None
        finally:
            theirs.close()
        self._lock = threading.Lock()          # one fork request at a time
        self._ready = threading.Event()
        self._gone = threading.Event()
        self._replies: dict[int, dict] = {}
        self._reply = threading.Condition()
        self._children: dict[int, ZygoteChild] = {}
        self._next_id = 0
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()
        threading.Thread(target=self._read_stderr, daemon=True, name="zygote-stderr").start()

    @property
    def alive(self) -> bool:
        """The zygote runs and its socket is open."""
        return not self._gone.is_set() and self._proc.poll() is None

    def fork(self, args: Sequence[str], env: Mapping[str, str], cwd: str | None, stdout_fd: int,
             stderr_fd: int, timeout_s: float = 60.0) -> ZygoteChild:
        """Start ``python -m varuna_sdk.worker ARGS`` as a child of the zygote, with exactly ``env``,
        in ``cwd`` (default: the zygote's), its stdout and stderr the given file descriptors (the
        caller keeps its copies: close them). Raises ``ZygoteError`` when the zygote is gone, not
        ready within ``ready_timeout_s`` or does not answer within ``timeout_s`` seconds."""
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.1):
            if not self.alive or time.monotonic() > deadline:
                raise ZygoteError(self._why("was not ready"))
        msg = json.dumps({"args": list(args), "env": dict(env), "cwd": cwd}).encode()
        if len(msg) > MAX_MESSAGE:
            raise ZygoteError(f"a worker's environment and arguments of {len(msg)} bytes are over {MAX_MESSAGE}")
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            try:
                socket.send_fds(self._sock, [json.dumps({"id": rid}).encode() + b"\n" + msg],
                                [stdout_fd, stderr_fd])
            except OSError as e:
                raise ZygoteError(self._why(f"could not be asked ({e})")) from None
            end = time.monotonic() + timeout_s
            with self._reply:
                while rid not in self._replies:
                    left = end - time.monotonic()
                    if left <= 0 or self._gone.is_set():
                        raise ZygoteError(self._why("did not answer"))
                    self._reply.wait(min(left, 0.2))
                reply = self._replies.pop(rid)
        if "error" in reply:
            raise ZygoteError(f"the zygote could not fork the worker: {reply['error']}")
        return self._children[int(reply["pid"])]

    def close(self, timeout_s: float = 5.0) -> None:
        """End the zygote (its workers, in their own sessions, are not touched)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout_s)
        self._sock.close()

    # ----------------------------------------------------------------------------- internals
    def _why(self, what: str) -> str:
        tail = " | ".join(self._stderr[-5:])
        code = self._proc.poll()
        return (f"the zygote of {self.run_dir} {what}" + (f" (it exited with code {code})" if code is not None else "")
                + (f": {tail}" if tail else ""))

    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE)
                if not data:
                    break
                try:
                    msg = json.loads(data)
                except ValueError:
                    continue
                if msg.get("ready"):
                    self._ready.set()
                elif "exit" in msg:
                    child = self._children.get(int(msg["exit"]))
                    if child is not None:
                        child._ended(int(msg["code"]))
                elif "id" in msg:
                    if "pid" in msg:
                        self._children[int(msg["pid"])] = ZygoteChild(int(msg["pid"]))
                    with self._reply:
                        self._replies[int(msg["id"])] = msg
                        self._reply.notify_all()
        except OSError:
            pass
        finally:
            self._gone.set()
            with self._reply:
                self._reply.notify_all()
            self._watch_orphans()

    def _watch_orphans(self) -> None:
        """The zygote is gone: children still running are no longer reaped by it; each ends with
        exit code -1 (not known) once its pid is gone."""
        left = [c for c in self._children.values() if c.poll() is None]
        while left:
            left = [c for c in left if c.poll() is None and _pid_alive(c.pid)]
            for c in self._children.values():
                if c.poll() is None and c not in left:
                    c._ended(-1)
            time.sleep(0.1)

    def _read_stderr(self) -> None:
        try:
            for raw in iter(self._proc.stderr.readline, b""):
                self._stderr.append(raw.decode("utf-8", "replace").rstrip())
                del self._stderr[:-50]
        except (OSError, ValueError):
            pass


def _pid_alive(pid: int) -> bool:
    """A process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


# ------------------------------------------------------------------------------- the zygote itself
def serve(fd: int, preload: Sequence[str], run: Callable[[list[str]], int],
          warm: Callable[[], None] | None = None) -> int:
    """The zygote's loop (``python -m varuna_sdk.worker --zygote FD RUN_DIR``): import ``preload``,
    call ``warm()`` (what else every worker of the run would build first: its errors are ignored,
    the workers meet them), say ready on socket ``fd``, then fork a worker per request, which runs
    ``run(args)`` and exits with its return value; report each child's pid and exit code. Returns
    0 when the launcher closes its end."""
    import importlib

    sock = socket.socket(fileno=fd)
    for name in preload:
        importlib.import_module(name)
    if warm is not None:
        try:
            warm()
        except Exception:  # noqa: BLE001 - a worker builds it again, and says what fails
            pass
    own = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    base = [p for p in sys.path[1:] if p not in own]   # the interpreter's own (stdlib, site-packages)
    _send(sock, {"ready": True, "pid": os.getpid()})
    while True:
        _reap(sock)
        try:
            readable, _, _ = select.select([sock], [], [], 0.05)
        except InterruptedError:
            continue
        if not readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except OSError:
            return 0
        if not data:
            return 0
        head, _, body = data.partition(b"\n")
        rid = json.loads(head)["id"]
        try:
            req = json.loads(body)
            if len(fds) != 2:
                raise ValueError(f"{len(fds)} file descriptors came with the request, not 2")
            pid = os.fork()
        except Exception as e:  # noqa: BLE001 - told to the launcher, which starts a subprocess instead
            for f in fds:
                os.close(f)
            _send(sock, {"id": rid, "error": f"{type(e).__name__}: {e}"})
            continue
        if pid == 0:
            _child(sock, fds, req, base, run)   # never returns
        for f in fds:
            os.close(f)
        _send(sock, {"id": rid, "pid": pid})


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.send(json.dumps(msg).encode())
    except OSError:
        pass


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _site_customize() -> None:
    """As a fresh interpreter's ``site`` does at start-up: import the ``sitecustomize`` module the
    worker's ``sys.path`` finds (a folder on its ``PYTHONPATH`` may hold one), unless the zygote
    ran that very file already; an error in it is said on stderr, as ``site`` says it, and the
    worker goes on."""
    import importlib
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    had = sys.modules.get("sitecustomize")
    if spec is None or (had is not None and getattr(had, "__file__", None) == spec.origin):
        return
    sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except Exception as e:  # noqa: BLE001 - as site.execsitecustomize: said, not fatal
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}", file=sys.stderr)


def _child(sock: socket.socket, fds: list[int], req: dict, base: list[str], run: Callable[[list[str]], int]) -> None:
    """In the forked worker: become what a fresh ``python -m varuna_sdk.worker`` started in its
    own session would be, run it, exit with its code."""
    code = 1
    try:
        sock.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for target, f in zip((1, 2), fds):
            os.dup2(f, target)
            os.close(f)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = {str(k): str(v) for k, v in req["env"].items()}
        cwd = req.get("cwd") or os.getcwd()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = [cwd] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + base
        sys.argv = [sys.argv[0], *req["args"]]
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True, write_through=True)
        if "numpy" in sys.modules:   # a fresh process's global NumPy generator is seeded afresh
            sys.modules["numpy"].random.seed()
        _site_customize()
        code = run(list(req["args"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a fresh Python: traceback, 1
        try:
            traceback.print_exc()
        except Exception:  # noqa: BLE001
            pass
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code if isinstance(code, int) else 1)
