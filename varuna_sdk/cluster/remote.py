"""Remote workers: start one job's worker processes on VMs over SSH (or, for local hosts, as
subprocesses of this machine), stream their output back prefixed by VM and rank, notice when one
fails, and stop them all leaving no process behind.

Each worker runs in its own session on its VM (``SSHConnection.start``), with the job's
environment — ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``VARUNA_JOB_ID``, ``VARUNA_HOST`` and the job's secret ``VARUNA_JOB_TOKEN`` plus anything
the caller adds — sent on stdin, so values never appear in a log, an exception or a process
listing's arguments. ``RemoteJob.stop()`` kills every worker's whole session on every VM in
parallel and reports whether anything survived.

The command is the caller's (normally ``[host.python, "-m", "varuna_sdk.worker", ...]`` —
the venv's Python by absolute path, never a login shell's PATH).

Local hosts (``cluster.localproc.is_local``: the embedded default's slots) take the same path
without SSH: ``start_workers`` starts their workers with ``localproc.start_local`` — own session, same
environment, same prefixed output — and ``RemoteJob`` waits for and stops them like the others,
so one job may mix both (all must reach rank 0's ``MASTER_ADDR``).

Owns: ``WorkerSpec``, ``RemoteWorker``, ``RemoteJob``, ``start_workers``, ``RemoteWorkerFailure``.
Imports ``cluster.hosts``, ``cluster.ssh`` (and its ``ssh_errors`` / ``ssh_process``) and
``cluster.localproc`` only; must never import torch
or the manager.
"""

from __future__ import annotations

import collections
import logging
import secrets as _secrets
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, Sequence

from .hosts import Host, Secret
from .localproc import LocalProcess, is_local, start_local
from .ssh import SSHPool
from .ssh_errors import SSHError
from .ssh_process import RemoteProcess

log = logging.getLogger(__name__)

LineSink = Callable[[str, "RemoteWorker", str], None]
"""``sink(stream, worker, line)``; ``stream`` is ``"stdout"`` or ``"stderr"``; ``line`` is
already prefixed (``[vm0 rank 3] ...``)."""


class RemoteWorkerFailure(RuntimeError):
    """A worker exited non-zero, lost its VM, or the job timed out. ``.failures`` maps rank →
    (host name, exit code or None, the last lines of its stderr)."""

    def __init__(self, message: str, failures: dict[int, tuple[str, int | None, str]]):
        super().__init__(message)
        self.failures = failures


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: which host, which global rank, what to run there and where."""

    host: Host
    rank: int
    command: Sequence[str]
    local_rank: int = 0
    env: Mapping[str, str | Secret] = field(default_factory=dict)
    cwd: str | None = None


def print_sink(stream: str, worker: "RemoteWorker", line: str) -> None:
    """Default sink: the prefixed line on this process's stdout or stderr (a notebook cell)."""
    print(line, file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)


class RemoteWorker:
    """A started worker: its spec, its ``RemoteProcess`` and the tail of its output."""

    def __init__(self, spec: WorkerSpec, tail_lines: int = 50):
        self.spec = spec
        self.host, self.rank = spec.host, spec.rank
        self.prefix = f"[{spec.host.name} rank {spec.rank}]"
        self.stdout_tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.process: RemoteProcess | LocalProcess | None = None

    @property
    def exit_code(self) -> int | None:
        """The worker's exit code once it has ended; None while it runs, before it is started, or when its connection
        was lost without an exit status."""
        return None if self.process is None else self.process.poll()

    def done(self) -> bool:
        """True once the worker's process has ended or its connection was lost; False before it is started."""
        return self.process is not None and self.process.done()

    def failed(self) -> bool:
        """True when the worker ended badly: a non-zero exit code, or a lost SSH connection (e.g. a pre-empted VM)."""
        p = self.process
        return p is not None and p.done() and (p.connection_lost or p.exit_code != 0)

    def __repr__(self) -> str:
        return f"<RemoteWorker {self.prefix} {self.process!r}>"


class RemoteJob:
    """The workers of one job. ``wait()`` until all exit (raising on the first failure after
    stopping the others), ``stop()`` them all; a context manager that stops on exit."""

    def __init__(self, job_id: str, workers: list[RemoteWorker], pool: SSHPool | None):
        self.job_id, self.workers, self.pool = job_id, workers, pool
        self._changed = threading.Event()
        self.stopped = False

    def _notify(self) -> None:
        self._changed.set()

    def done(self) -> bool:
        """True once every worker has ended, whatever its exit code."""
        return all(w.done() for w in self.workers)

    def exit_codes(self) -> dict[int, int | None]:
        """Global rank → exit code of every worker (None for one still running or not started)."""
        return {w.rank: w.exit_code for w in self.workers}

    def wait(self, timeout_s: float | None = None, *, stop_on_failure: bool = True) -> dict[int, int]:
        """Wait for every worker to exit 0; returns rank → exit code. On the first failure (or
        after ``timeout_s``) stops all workers and raises ``RemoteWorkerFailure`` naming the VM
        and rank that failed first, with its stderr tail (its traceback)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._changed.clear()
            failed = [w for w in self.workers if w.failed()]
            if failed and stop_on_failure:
                time.sleep(0.3)  # let peers' last lines arrive
                self.stop()
                first = min(failed, key=lambda w: (w.process.ended_at or 0, w.rank))
                raise RemoteWorkerFailure(self._failure_message(first), self._failures())
            if self.done():
                if failed:
                    raise RemoteWorkerFailure(self._failure_message(failed[0]), self._failures())
                return {w.rank: w.exit_code for w in self.workers}
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise RemoteWorkerFailure(
                    f"job {self.job_id}: workers did not finish within {timeout_s:g}s; all "
                    f"{len(self.workers)} stopped", self._failures())
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            self._changed.wait(wait)

    def _failure_message(self, w: RemoteWorker) -> str:
        p = w.process
        why = ("lost its connection (VM gone?)" if p.connection_lost
               else f"exited with {p.exit_code}")
        last = next((line for line in reversed(w.stderr_tail) if line.strip()), "")
        return f"job {self.job_id}: worker {w.prefix} {why}" + (f": {last.strip()}" if last else "")

    def _failures(self) -> dict[int, tuple[str, int | None, str]]:
        return {w.rank: (w.host.name, w.exit_code, "\n".join(w.stderr_tail))
                for w in self.workers if w.failed() or not w.done()}

    def stop(self, grace_s: float | None = None, *, gone: Collection[str] = ()) -> bool:
        """Stop every worker's whole process session on every VM (in parallel): SIGTERM, SIGKILL
        after ``grace_s``. True when nothing is left anywhere. ``gone``: names of VMs known to be
        lost (pre-empted, declared lost by the manager): their workers' channels are closed
        without trying to reach the VM (which would cost a connect timeout)."""
        self.stopped = True
        for w in self.workers:
            if w.process is not None and w.host.name in gone:
                w.process.killed = True
                w.process._close_channel()
        live = [w for w in self.workers if w.process is not None and w.host.name not in gone]
        if not live:
            return True
        with ThreadPoolExecutor(max_workers=min(16, len(live))) as ex:
            results = list(ex.map(lambda w: w.process.kill(grace_s=grace_s), live))
        clean = all(results)
        if not clean:
            log.warning("job %s: processes may remain on %s", self.job_id,
                        sorted({w.host.name for w, ok in zip(live, results) if not ok}))
        return clean

    def __enter__(self) -> "RemoteJob":
        return self

    def __exit__(self, *exc) -> None:
        if not self.done():
            self.stop()


def start_workers(specs: Sequence[WorkerSpec], *, pool: SSHPool | None, master_addr: str, master_port: int,
                  job_id: str | None = None, token: Secret | None = None,
                  env: Mapping[str, str | Secret] | None = None, sink: LineSink | None = print_sink,
                  tail_lines: int = 50,
                  on_exit: Callable[[RemoteWorker], None] | None = None) -> RemoteJob:
    """Start every worker of ``specs`` (world size = len(specs), ranks 0..N-1 exactly once).

    Each gets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``,
    ``VARUNA_JOB_ID``, ``VARUNA_HOST`` and ``VARUNA_JOB_TOKEN`` (``token`` or a fresh random
    one), then ``env`` and the spec's own ``env``. Output lines go to ``sink`` prefixed
    ``[host rank N]``. Workers of local hosts (``localproc.is_local``) start as subprocesses
    here (``pool`` may be None when every host is local). ``on_exit(worker)`` is called (from a
    reader thread) when a worker's process ends or its connection is lost. ``ValueError`` for
    bad ranks, an empty command or an SSH host without ``pool``; if any worker cannot be
    started, those already started are stopped and the error is raised.
    """
    _check_specs(specs, pool)
    job_id = job_id or uuid.uuid4().hex[:12]
    token = token or Secret(_secrets.token_urlsafe(24))
    workers = [RemoteWorker(s, tail_lines) for s in sorted(specs, key=lambda s: s.rank)]
    job = RemoteJob(job_id, workers, pool)
    base_env: dict[str, str | Secret] = {
        "WORLD_SIZE": str(len(specs)), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "VARUNA_JOB_ID": job_id, "VARUNA_JOB_TOKEN": token}

    def start(w: RemoteWorker) -> None:
        _start_worker(w, job, pool, base_env, env or {}, sink, on_exit)

    log.info("job %s: starting %d workers on %s", job_id, len(workers),
             sorted({w.host.name for w in workers}))
    with ThreadPoolExecutor(max_workers=min(16, len(workers))) as ex:
        futures = [ex.submit(start, w) for w in workers]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        job.stop()
        raise errors[0]
    return job


def _check_specs(specs: Sequence[WorkerSpec], pool: SSHPool | None) -> None:
    """``ValueError`` unless the ranks are 0..N-1 exactly once, every command is non-empty and
    every SSH host has a ``pool`` to reach it."""
    ranks = sorted(s.rank for s in specs)
    if ranks != list(range(len(specs))):
        raise ValueError(f"ranks must be 0..{len(specs) - 1} exactly once, got {ranks}")
    for s in specs:
        if not s.command:
            raise ValueError(f"rank {s.rank}: empty command")
        if pool is None and not is_local(s.host):
            raise ValueError(f"rank {s.rank}: host {s.host.name} is reached over SSH: pass pool=SSHPool(...)")


def _start_worker(w: RemoteWorker, job: RemoteJob, pool: SSHPool | None,
                  base_env: Mapping[str, str | Secret], env: Mapping[str, str | Secret],
                  sink: LineSink | None, on_exit: Callable[[RemoteWorker], None] | None) -> None:
    """Start one worker (a local subprocess or an SSH session) and set ``w.process``; its
    environment is ``base_env`` + its rank and host, then ``env`` and the spec's own ``env``.
    ``SSHError`` when an SSH worker does not report its session id within 15 s."""
    s = w.spec
    wenv: dict[str, str | Secret] = {
        "RANK": str(s.rank), "WORLD_SIZE": base_env["WORLD_SIZE"], "LOCAL_RANK": str(s.local_rank),
        "MASTER_ADDR": base_env["MASTER_ADDR"], "MASTER_PORT": base_env["MASTER_PORT"],
        "VARUNA_JOB_ID": base_env["VARUNA_JOB_ID"], "VARUNA_HOST": s.host.name,
        "VARUNA_JOB_TOKEN": base_env["VARUNA_JOB_TOKEN"], "PYTHONUNBUFFERED": "1"}
    wenv.update(env)
    wenv.update(s.env)

    assigned = threading.Event()

    def ended() -> None:
        assigned.wait(30.0)  # (a process may end before start() returned it)
        job._notify()
        if on_exit is not None:
            on_exit(w)

    def line(stream: str, tail: collections.deque):
        def on(text: str) -> None:
            tail.append(text)
            if sink is not None:
                sink(stream, w, f"{w.prefix} {text}")
        return on

    if is_local(s.host):
        try:
            w.process = start_local(
                s.host, list(s.command), env=wenv, cwd=s.cwd or s.host.workdir,
                on_stdout=line("stdout", w.stdout_tail), on_stderr=line("stderr", w.stderr_tail),
                on_exit=ended, kill_grace_s=pool.options.kill_grace_s if pool else 2.0)
        finally:
            assigned.set()
        return
    try:
        w.process = pool.get(s.host).start(
            list(s.command), env=wenv, cwd=s.cwd or s.host.workdir,
            on_stdout=line("stdout", w.stdout_tail), on_stderr=line("stderr", w.stderr_tail),
            collect=False, on_exit=ended)
    finally:
        assigned.set()
    if w.process.wait_started(15.0) is None and not w.process.done():
        raise SSHError(s.host, f"rank {s.rank}: the worker did not report its session id")
