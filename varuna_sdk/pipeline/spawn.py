"""Local worker processes: start ``target(rank, world_size, *args)`` in fresh processes on this
machine, connect them with torch.distributed, and stop them all — on success, on the first
failure, on timeout and on Ctrl-C — so that no worker is ever left running.

The processes are forked from a ``multiprocessing`` fork server that has imported torch once
(``_PRELOAD``), not ``spawn``-ed: a spawned process imports torch and ``torch._dynamo`` (which
every optimizer's first call imports) again, ~2.5 s of CPU each, which on a 2-core VM was most
of a calibration's probe time. Each child gets the caller's environment, working directory,
``sys.path``, stdout and stderr as they are at the call, as a spawned one would, and imports the
main script again as a spawned one does (keep a script's work under ``if __name__ ==
"__main__":``). A ``target`` defined in the main script is spawned. What torch reads from the
environment when it is imported (``TORCH_COMPILE_DISABLE`` and the like) is what the first call
saw, when the fork server started: set such variables before it, or set
``VARUNA_SDK_START_METHOD=spawn``, which spawns every process.

Owns ``free_port``, ``spawn_workers`` (each child with its process group initialised),
``WorkerFailure`` and ``retain_freed_memory``/``retained_memory`` (the allocator setting of every
worker process, and of calibration in the user's process). Used by the worker entry point and
the front ends, the manager's generations (``free_port``), calibration's host probes
(``profiling``), tests and benchmarks.
Results come back as files written by the workers themselves (``torch.save`` of plain tensors,
loaded with ``weights_only=True``), never as pickles from a socket.

Lives in ``pipeline`` (layer 2) so that calibration can spawn its probes without reaching up into
``cluster``. Imports only the standard library and torch (lazily); must never import anything of
``varuna_sdk`` above ``pipeline`` (``profiling``, ``cluster``, ``manager``, ...).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence


class WorkerFailure(RuntimeError):
    """One or more workers failed; ``.failures`` maps rank → (exit code, traceback text)."""

    def __init__(self, message: str, failures: dict[int, tuple[int | None, str]]):
        super().__init__(message)
        self.failures = failures


def rerun_main_script() -> str | None:
    """The main script's path when the caller runs at the top level of that script being
    imported again in a child process (``multiprocessing`` imports the parent's main script as
    ``__mp_main__`` in every worker it starts, spawned or forked from the fork server, before the
    worker's target runs), else ``None``. Code of the script that a worker calls later (a
    function of it, a class's method) is not at its top level and gives ``None``. (Only
    ``multiprocessing`` runs a script as ``__mp_main__``; while it does, ``mp.parent_process()`` is
    not set yet.)"""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return str(frame.f_globals.get("__file__") or "the main script")
        frame = frame.f_back
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, below the kernel's ephemeral port range, so that no
    outgoing connection (gloo's own pairs, SSH, HTTP) is handed it before the rendezvous store
    binds it (a port from ``bind(0)`` is in that range and can be). Self-contained: its source is
    also run on a remote rank-0 VM (``manager.generation``)."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    draw = random.SystemRandom()   # not the global generator: a forward reseeds it (model.rng), which made every
    for _ in range(200):           # manager after a calibration of the same model try the same port first (EADDRINUSE)
        p = draw.randrange(max(1024, lo - 12000), max(1025, lo))
        with socket.socket() as s:
            try:
                s.bind((host, p))
                return p
            except OSError:
                pass
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters
_GLIBC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}


def retain_freed_memory(enable: bool = True) -> bool:
    """Keep memory that torch frees inside the process for reuse (glibc: never trim the heap, never
    ``mmap`` a large tensor) instead of handing it back to the kernel after every step.

    With glibc's defaults every large CPU tensor (logits, embedding gradients, all-reduce buffers,
    optimizer temporaries) is a fresh ``mmap``: its pages are faulted in and zeroed by the kernel
    each time — for the demo GPT-2 ~280k page faults and a third of the step in system time — and
    page faults of processes sharing a machine serialise, so step times grow erratically with the
    number of workers. Retained, the memory is reused at the process's peak footprint (which the
    planner's memory model counts anyway). Every worker calls this at start (``spawn_workers``,
    ``varuna_sdk.worker``); calibration measures under the same setting. ``enable=False`` restores
    glibc's default thresholds. Returns False (and does nothing) where the C library is not glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    values = {_M_TRIM_THRESHOLD: 2**31 - 1, _M_MMAP_MAX: 0} if enable else _GLIBC_DEFAULTS
    return all(mallopt(k, v) == 1 for k, v in values.items())


@contextlib.contextmanager
def retained_memory():
    """``retain_freed_memory()`` for the duration of a block (calibration in the user's process)."""
    on = retain_freed_memory(True)
    try:
        yield on
    finally:
        if on:
            retain_freed_memory(False)


def _pick_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() and torch.distributed.is_nccl_available() else "gloo"


#: what the fork server imports once for all the processes it forks
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


#: environment variable that selects ``spawn`` instead of the fork server (``=spawn``): for a
#: library that cannot be used in a forked process, and for the benchmark's baseline
START_METHOD_ENV = "VARUNA_SDK_START_METHOD"


def _context(target: Callable):
    """The ``multiprocessing`` context for ``target``: the fork server (torch preloaded) where this
    platform has one, else ``spawn``; ``spawn`` too for a target of the main script, or when
    ``VARUNA_SDK_START_METHOD=spawn``. Raises ``ValueError`` for another value of it."""
    chosen = os.environ.get(START_METHOD_ENV, "forkserver")
    if chosen not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={chosen!r}: use 'forkserver' (the default) or 'spawn'")
    if (chosen == "spawn" or getattr(target, "__module__", None) == "__main__"
            or "forkserver" not in mp.get_all_start_methods()):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _CallerState:
    """The caller's environment, stdout and stderr, pickled for a forked child (a fork server's
    child would otherwise have the server's, fixed when it started; ``multiprocessing`` itself
    gives it the caller's ``sys.path`` and working directory). ``apply()`` in the child makes them
    its own."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.fds: tuple = ()

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _restore_caller, (self.env, (DupFd(1), DupFd(2)))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        for target_fd, dup in zip((1, 2), self.fds):
            fd = dup.detach()
            os.dup2(fd, target_fd)
            os.close(fd)


def _restore_caller(env: dict, fds: tuple) -> _CallerState:
    state = _CallerState.__new__(_CallerState)
    state.env, state.fds = env, fds
    return state


def _fill_closed_std_fds() -> None:
    """A closed stdout or stderr (fd 1 or 2) of this process becomes ``/dev/null``: else the next
    file ``multiprocessing`` opens (its connection to the fork server) takes that number and is
    handed to the children as their stdout (a spawned child drops its output too)."""
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _child(rank: int, world_size: int, addr: str, port: int, backend: str, timeout_s: float, threads: int,
           err_dir: str, caller: _CallerState | None, target: Callable, args: tuple) -> None:
    if caller is not None:
        caller.apply()
    with contextlib.suppress(OSError):
        os.setpgrp()   # its own process group: stopping it stops what it started too
    os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": str(threads)})
    retain_freed_memory()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        backend = _pick_backend(backend)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            target(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may already be gone
                pass
    except BaseException:  # noqa: BLE001 - reported to the parent, then exit non-zero
        Path(err_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


def spawn_workers(
    target: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "auto",
    addr: str = "127.0.0.1",
    port: int = 0,
    timeout_s: float = 300.0,
    threads_per_worker: int = 1,
    work_dir: str | Path | None = None,
) -> None:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` fresh processes with
    torch.distributed initialised (gloo on CPU, NCCL where every worker has a GPU).

    ``target`` must be importable (a module-level function). Waits for all; on the first failure
    or after ``timeout_s`` seconds kills every worker's process group and raises
    ``WorkerFailure`` carrying each failed rank's traceback; on ``KeyboardInterrupt`` stops
    them all and re-raises. Raises ``ValueError`` for ``world_size < 1``, and what ``pickle``
    raises for a target or argument that cannot be sent to a process (when the first starts).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    port = port or free_port(addr)
    ctx = _context(target)
    forked = ctx.get_start_method() == "forkserver"
    if forked:
        _fill_closed_std_fds()
    err_dir = Path(work_dir or ".") / ".varuna-errors"
    err_dir.mkdir(parents=True, exist_ok=True)
    for f in err_dir.glob("rank*.err"):
        f.unlink()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, addr, port, backend, timeout_s, threads_per_worker,
                                         str(err_dir), _CallerState() if forked else None, target, tuple(args)),
                    name=f"varuna-worker-{r}")
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.exitcode for p in procs]
            if all(c == 0 for c in codes):
                return
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed or time.monotonic() > deadline:
                time.sleep(0.5 if failed else 0.0)  # let peers write their own tracebacks
                _kill(procs, forked)
                failures = {}
                for r, p in enumerate(procs):
                    if p.exitcode not in (0,):
                        f = err_dir / f"rank{r}.err"
                        failures[r] = (p.exitcode, f.read_text() if f.exists() else "")
                # the root cause is the rank that failed first: its peers fail after it
                # ("Connection closed by peer"), so order by when each traceback was written
                def written_at(r: int) -> float:
                    f = err_dir / f"rank{r}.err"
                    return f.stat().st_mtime_ns if f.exists() else float("inf")

                first = min(failed, key=lambda r: (written_at(r), r)) if failed else None
                if first is None:
                    msg = f"workers did not finish within {timeout_s:.0f} s; all {world_size} stopped"
                else:
                    tb = failures.get(first, (None, ""))[1].strip().splitlines()
                    msg = f"worker rank {first} failed (exit {codes[first]}): " + (tb[-1] if tb else _no_traceback(forked))
                raise WorkerFailure(msg, failures)
            time.sleep(0.05)
    except KeyboardInterrupt:
        _kill(procs, forked)
        raise


def _no_traceback(forked: bool) -> str:
    """Why a worker can fail without a traceback: before its target runs, ``multiprocessing``
    imports the parent's main script in it (spawned or forked from the fork server alike), whose
    top-level code then runs again; or the fork server it came from was killed (exit 255)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    server = " (or its fork server was killed)" if forked else ""
    if main:
        return (f"it exited without a traceback: it may have failed while re-importing the main script {main}{server} "
                "(each worker process starts by importing it, running its top-level code again; its error is on "
                "stderr). If that script plans, calibrates or trains at its top level, put that code under "
                "`if __name__ == \"__main__\":`")
    return f"it exited without a traceback{server} (its error, if any, is on stderr)"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a forked worker whose fork server died
    is reported exited, exit code 255, while it may still run)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group of worker ``pid`` (each worker leads its own), else to it."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _kill(procs: list, forked: bool = False) -> None:
    """SIGTERM every worker still running and what it started (its process group), SIGKILL what
    is left after 5 s."""
    def alive(p) -> bool:
        return p.exitcode is None or (forked and _running(p.pid))

    stopped = [p for p in procs if alive(p)]
    for p in stopped:
        _signal_group(p.pid, signal.SIGTERM)
    t = time.monotonic() + 5
    for p in procs:
        p.join(timeout=max(0.1, t - time.monotonic()))
        while forked and _running(p.pid) and time.monotonic() < t:
            time.sleep(0.05)
    for p in stopped:   # the worker, and anything of its group still running
        _signal_group(p.pid, signal.SIGKILL)
        p.join(timeout=2)
