"""One generation of a job: the set of workers launched for one configuration (P, D, stage map)
on one list of hosts — started, watched, asked to stop, and stopped leaving nothing behind.

A morph ends a generation and starts the next (``manager.manager``); this module launches and
supervises one. ``Generation(job, hosts, run_dir, events=..., job_id=..., generation=g)``:

- **placement**: rank ``r = replica·P + stage`` (``pipeline.groups.Topology``), assigned to the
  hosts in order, a host with ``k`` GPUs taking ``k`` consecutive ranks (``LOCAL_RANK`` 0..k-1),
  a CPU host ``cpu_slots`` (default 1); hosts beyond what P·D needs are not used
  (``unused_hosts``). Too few slots → ``ValueError`` before anything starts.
- **start()**: a ``HeartbeatServer`` (``manager.heartbeat_server``) writing to ``events``; then the SSH
  hosts are bootstrapped and every worker starts at once (``manager.startup``: versions, code
  sync, config upload, the worker environment, the pre-emption notice watcher on SSH VMs).
  Output streams to ``options.sink`` and to ``RUN_DIR/gen<g>/workers.log``, each line prefixed
  ``[vm rank r]``. A host that cannot be reached, or disappears, during bootstrap or start-up is
  reported lost (``host_lost`` event, ``wait()`` → ``LOST``); a host whose software does not
  match fails the generation with the message naming the VM. ``start()`` raises only for misuse
  (called twice).
- **request_stop(reason)**: the heartbeat channel's signed ``stop`` command: every worker stops at
  the next mini-batch boundary (the ranks agree on the step, checkpoint and exit; ``wait()`` →
  ``"stopped"``).
- **wait(timeout_s)**: None while running; else a ``GenerationResult`` (``manager.results``) whose
  ``status`` is a ``GenerationStatus``: ``COMPLETED``, ``STOPPED`` (on request, at a boundary),
  ``LOST`` (a host lost: pre-empted, network cut, process killed, heartbeats stopped — within 2
  heartbeat intervals), ``FAILED`` (a worker raised: its own error in ``error``, its traceback ending
  with that exception line, prefixed by VM and rank, in ``failure``), ``KILLED`` (``stop()`` ended workers that had not finished). On ``LOST``/``FAILED``
  the surviving workers are stopped before it returns (``stop_on_failure``).
- **stop(grace_s, gone=())**: SIGTERM then SIGKILL every worker's whole session on every host in
  parallel (``gone``: hosts known to be unreachable, skipped); True when nothing survived.
- **heartbeats()**, **subscribe(callback(Event))**: every event of this generation (worker
  joined/finished/failed, host lost, stop requested...) as it is recorded in ``events``.

Rank 0's heartbeats carry each step's metrics row; the heartbeat server appends them to the event
log's metrics table (the dashboard's source), once per step, none dropped.

Settings: ``GenerationOptions`` (``manager.options``; every default there). Orphans of a dead
manager: ``manager.orphans``.

Owns ``Generation``, ``place``. Imports ``cluster`` (hosts, ssh, remote, localproc), ``config`` and
``manager.events|heartbeat|options|results|startup``; never torch, never ``manager.manager``.
"""

from __future__ import annotations

import logging
import secrets as _secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..cluster.hosts import Host, Secret
from ..cluster.localproc import LOCAL_ADDRESS, is_local
from ..cluster.remote import RemoteJob, RemoteWorker
from ..cluster.ssh import SSHPool
from ..config import JobConfig
from .events import Event, EventLog, Kind
from .heartbeat_server import HeartbeatServer
from .options import GenerationOptions
from .results import LOG_ONLY, GenerationResult, GenerationStatus, failure_excerpt
from .startup import WorkerStartup, route_source
from .wire import STOPPED

log = logging.getLogger(__name__)

REAP_TIMEOUT_S = 10.0   # reaching a VM lost by its heartbeats to kill what is left of the generation there
EXIT_REPORT_GRACE_S = 2.0  # how long an ended generation waits for its workers' exits to be reported (worker_exited)


def place(hosts: Sequence[Host], world_size: int, *, cpu_slots: int = 1) -> list[tuple[Host, int]]:
    """Rank → (host, local rank) for ``world_size`` ranks on ``hosts`` in order: a host with ``k``
    GPUs takes ``k`` consecutive ranks, a CPU host ``cpu_slots``. Raises ``ValueError`` naming
    the slots when there are too few, or for duplicate host names."""
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"host names must be unique, got {names}")
    if cpu_slots < 1:
        raise ValueError(f"cpu_slots={cpu_slots} must be >= 1")
    out: list[tuple[Host, int]] = []
    for h in hosts:
        for k in range(h.gpus if h.gpus > 0 else cpu_slots):
            if len(out) < world_size:
                out.append((h, k))
    if len(out) < world_size:
        offer = ", ".join(f"{h.name}: {h.gpus if h.gpus > 0 else cpu_slots}" for h in hosts) or "none"
        raise ValueError(f"P x D = {world_size} workers need {world_size} slots but the hosts offer "
                         f"{len(out)} ({offer}); give more hosts, or plan for {len(out)} workers")
    return out


class Generation(WorkerStartup):
    """Launch and supervise one set of workers (see the module docstring).

    ``job``: the configuration with P and D chosen; ``hosts``: in rank order; ``run_dir``: the
    job's run folder here (local workers write into it; ``gen<g>/`` holds this generation's
    config and log); ``events``: the job's event log; ``job_id``; ``generation``: 0, 1, ...;
    ``options``: a ``GenerationOptions`` (None: the defaults), and any of its fields as keywords
    on top (``heartbeat_interval_s=1.0, sink=None``). Raises ``ValueError`` for a job whose P and D
    are not chosen, too few slots or bad option values; ``TypeError`` for an unknown option.

    After ``start()``: ``server`` (the ``HeartbeatServer``), ``remote`` (the ``RemoteJob``),
    ``bootstrap_report`` (host name → ``BootstrapReport``), ``rank_hosts`` (host name per rank).
    """

    def __init__(self, job: JobConfig, hosts: Sequence[Host], run_dir: str | Path, *,
                 events: EventLog, job_id: str, generation: int = 0,
                 options: GenerationOptions | None = None, **option_overrides: Any):
        job = JobConfig.from_dict(job.to_dict()).validate()
        self.options = opts = GenerationOptions.merged(options, **option_overrides).validate()
        if job.parallel.planned:
            raise ValueError("job.parallel.P and D must be chosen before a generation starts "
                             "(run the planner: manager.Manager or launch.plan_job)")
        self.job, self.job_id, self.generation = job, job_id, int(generation)
        self.world_size = job.parallel.P * job.parallel.D
        self.placement = place(hosts, self.world_size, cpu_slots=opts.cpu_slots)
        used = {h.name for h, _ in self.placement}
        self.hosts = [h for h in hosts if h.name in used]
        self.unused_hosts = [h for h in hosts if h.name not in used]
        self.rank_hosts = [h.name for h, _ in self.placement]
        self.run_dir = Path(run_dir)
        self.events = events
        self.token = opts.token or Secret(_secrets.token_urlsafe(24))
        self.ssh_hosts = [h for h in self.hosts if not is_local(h)]
        self._own_pool = opts.pool is None and bool(self.ssh_hosts)
        self.pool = opts.pool if opts.pool is not None else (SSHPool(opts.ssh_options) if self.ssh_hosts else None)
        self.gen_dir = self.run_dir / f"gen{self.generation}"
        self.server: HeartbeatServer | None = None
        self.remote: RemoteJob | None = None
        self.bootstrap_report = None
        self._callbacks: list[Callable[[Event], None]] = []
        self._cond = threading.Condition()
        self._lock = threading.RLock()
        self._lost: dict[str, str] = {}          # hosts lost before/while launching
        self._start_failure: str | None = None   # bootstrap/launch failure (not a loss)
        self._failed_ranks: list[int] = []       # ranks in the order their failure was seen
        self._exit_reported: set[int] = set()    # ranks whose exit the watcher has reported (worker_exited)
        self._all_ended_at: float | None = None  # when every process was first seen ended
        self._bye: dict[int, str] = {}           # rank -> bye status
        self._stop_reason: str | None = None
        self._stopping = False
        self._remote_clean = False
        self._started = False
        self._t_start: float | None = None
        self._first_problem_at: float | None = None
        self._result: GenerationResult | None = None
        self._log_file = None

    # ------------------------------------------------------------------------------ public
    def subscribe(self, callback: Callable[[Event], None]) -> None:
        """``callback(event)`` for every event this generation records (server thread or
        launcher threads: keep it short)."""
        with self._lock:
            self._callbacks.append(callback)

    def heartbeats(self):
        """Every worker's heartbeat state: (host, rank) → ``SenderState`` (empty before start)."""
        return {} if self.server is None else self.server.senders()

    @property
    def started_at(self) -> float | None:
        """``time.monotonic()`` when ``start()`` was called."""
        return self._t_start

    def start(self) -> "Generation":
        """Start the heartbeat server, bootstrap the SSH hosts, launch every worker. Returns once
        all are started (or the generation already ended: see ``wait``). Raises
        ``RuntimeError`` if called twice."""
        with self._lock:
            if self._started:
                raise RuntimeError(f"generation {self.generation} was started already")
            self._started = True
        self._t_start = time.monotonic()
        self.gen_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.gen_dir / "workers.log", "a", buffering=1)
        cfg = self.gen_dir / "config.yaml"
        self.job.to_yaml(cfg)
        advertise = {h.name: self.options.manager_address or (LOCAL_ADDRESS if is_local(h) else
                                                      route_source(h.address, h.port))
                     for h in self.hosts}
        loop = all(a == LOCAL_ADDRESS for a in advertise.values())
        self.server = HeartbeatServer(
            self.job_id, self.token, self.events, interval_s=self.options.heartbeat_interval_s,
            miss_limit=self.options.miss_limit, startup_grace_s=self.options.startup_grace_s, placed_only=True,
            bind=LOCAL_ADDRESS if loop else "0.0.0.0",
            advertise=next(iter(advertise.values())), on_event=self._on_event).start()
        self._emit(Kind.GENERATION_STARTED, payload={
            "generation": self.generation, "P": self.job.parallel.P, "D": self.job.parallel.D,
            "world_size": self.world_size, "hosts": self.rank_hosts,
            "unused_hosts": [h.name for h in self.unused_hosts],
            "local_hosts": sorted({h.name for h in self.hosts if is_local(h)}),
            "interval_s": self.options.heartbeat_interval_s, "orphan_after_s": self.options.orphan_after_s})
        try:
            remote_cfg, remote_run, cwd = self._prepare_ssh_hosts(cfg)
            if remote_cfg is None or self._stopping:
                return self
            self._launch(cfg, remote_cfg, remote_run, cwd, advertise)
        except Exception as e:  # noqa: BLE001 - anything else: the generation failed to start
            log.exception("generation %d did not start", self.generation)
            self._start_failed(f"{type(e).__name__}: {e}")
        return self

    def request_stop(self, reason: str = "stop") -> None:
        """Ask every worker to stop at its next mini-batch boundary (checkpoint, exit "stopped").
        Workers still starting get the command when they connect."""
        self._stop_reason = reason
        if self.server is not None:
            self.server.request_stop(reason, generation=self.generation)

    def wait(self, timeout_s: float | None = None, *, stop_on_failure: bool = True
             ) -> GenerationResult | None:
        """Wait up to ``timeout_s`` (None: forever) for the generation to end; its
        ``GenerationResult``, or None while it still runs. A failure waits up to one heartbeat
        interval for a host loss behind it (peers of a killed worker fail first). With
        ``stop_on_failure`` the surviving workers are stopped before a ``LOST`` or ``FAILED``
        result is returned."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._result is not None:
                return self._result
            res = self._evaluate()
            if res is not None:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            with self._cond:
                self._cond.wait(0.2 if left is None else min(0.2, left))
        if res.status in (GenerationStatus.LOST, GenerationStatus.FAILED) and stop_on_failure and not self._stopping:
            # a VM lost by its heartbeats alone may still be there: not "gone" (``stop`` reaps it)
            self.stop(gone=[h for h, why in res.lost_hosts.items() if why != "heartbeat_timeout"])
            res.exit_codes = self._exit_codes()
        res.seconds = time.monotonic() - (self._t_start or time.monotonic())
        with self._cond:
            first = self._result is None
            if first:
                self._result = res
        if first:
            self._emit(Kind.GENERATION_ENDED, payload={
                "generation": self.generation, "status": res.status,
                "lost_hosts": res.lost_hosts, "last_step": res.last_step,
                "seconds": round(res.seconds, 3), "stop_reason": res.stop_reason,
                "failure": None if res.failure is None else res.failure[-2000:]})
        return self._result

    def stop(self, grace_s: float | None = None, gone: Sequence[str] = ()) -> bool:
        """Stop every worker (SIGTERM, SIGKILL after ``grace_s``) on every host in parallel,
        then the heartbeat server; ``gone``: names of hosts known to be unreachable (their
        workers are not contacted; local slots are always cleaned). True when nothing
        survived. Idempotent."""
        with self._lock:
            self._stopping = True
        if self.server is not None:
            self.server.stop_expecting()
        clean = True
        if self.remote is not None and not (self._remote_clean and self.remote.done()):
            lost = set(gone) | set(self._lost) | (set(self.server.lost_hosts()) if self.server else set())
            skip = {h.name for h in self.hosts if h.name in lost and not is_local(h)}
            grace = self.options.kill_grace_s if grace_s is None else grace_s
            # a VM lost by its heartbeats (a hung worker, a cut link) may still be there: its workers
            # are killed in the background, so the morph does not wait for an SSH timeout
            maybe_there = [w for w in self.remote.workers
                           if w.host.name in skip - set(gone) and w.process is not None and not w.process.done()]
            clean = self.remote.stop(grace, gone=skip)
            self._remote_clean = clean
            if maybe_there:
                threading.Thread(target=self._reap, args=(maybe_there, min(grace, 1.0)), daemon=True,
                                 name=f"varuna-reap-gen{self.generation}").start()
        if self.server is not None:
            self.server.close()
        if self._own_pool and self.pool is not None:
            self.pool.close()
        with self._cond:
            self._cond.notify_all()
        f = self._log_file
        if f is not None:
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        return clean

    def _reap(self, workers: list, grace_s: float) -> None:
        """Kill the sessions of ``workers`` on VMs declared lost by their heartbeats (hung, or cut
        off and perhaps back): a worker left running there would train on unrecorded beside the
        next generation. Over a fresh SSH connection with a short timeout and a short grace (a hung
        worker cannot checkpoint anyway); each outcome is a ``stale_worker_reaped`` event."""
        from ..cluster.ssh import SSHConnection

        options = self.pool.options if self.pool is not None else None
        for w in workers:
            sid = w.process.sid
            if sid is None:
                continue   # never started there: nothing to stop
            conn = SSHConnection(w.host, options)   # (the generation's pool is closed by now)
            try:
                ok = bool(conn.kill_session(sid, grace_s=grace_s, timeout_s=REAP_TIMEOUT_S))
            except Exception as e:  # noqa: BLE001 - unreachable still: nothing more to do from here
                log.warning("could not reach %s to stop rank %s: %s", w.host.name, w.rank, type(e).__name__)
                ok = False
            finally:
                conn.close()
            self._emit(Kind.STALE_WORKER_REAPED, host=w.host.name, rank=w.rank, payload={"stopped": ok})

    def close(self) -> None:
        """``stop()``, record how the generation ended (``generation_ended``, if ``wait`` did
        not yet) and close the log file."""
        self.stop()
        if self._started:
            self.wait(timeout_s=10.0, stop_on_failure=False)
        self.close_log()

    def close_log(self) -> None:
        """Close ``workers.log`` once the generation is over (idempotent; a worker line that
        arrives later is dropped, as after ``close``)."""
        f, self._log_file = self._log_file, None
        if f is not None:
            f.close()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------------------- watching
    def _sink(self, stream: str, worker: RemoteWorker, line: str) -> None:
        """A worker's line: to ``workers.log``, and to ``options.sink`` unless the worker marked it
        ``LOG_ONLY`` (its failure's traceback: the manager tells the failure once, not every rank)."""
        mark = f"{worker.prefix} {LOG_ONLY}"
        log_only = line.startswith(mark)
        if log_only:
            line = f"{worker.prefix} {line[len(mark):]}"
        f = self._log_file
        if f is not None:
            try:
                f.write(line + "\n")
            except (OSError, ValueError):
                pass
        if self.options.sink is not None and not log_only:
            self.options.sink(stream, worker, line)

    def _on_exit(self, w: RemoteWorker) -> None:
        p = w.process
        code = None if p is None or p.connection_lost else p.exit_code
        if self.server is not None:
            self.server.report_exit(w.host.name, w.rank, code, at=p.ended_at if p else None)
        with self._cond:
            self._exit_reported.add(w.rank)
            if code not in (0,) and not self._stopping and w.rank not in self._failed_ranks:
                self._failed_ranks.append(w.rank)
                if self._first_problem_at is None:
                    self._first_problem_at = time.monotonic()
            self._cond.notify_all()

    def _on_event(self, ev: Event) -> None:
        if ev.kind in (Kind.WORKER_FAILED, Kind.WORKER_FINISHED) and ev.rank is not None:
            with self._cond:
                self._bye[ev.rank] = ev.payload.get("status") or "?"
                if ev.kind == Kind.WORKER_FAILED and not self._stopping:
                    if ev.rank not in self._failed_ranks:
                        self._failed_ranks.append(ev.rank)
                    if self._first_problem_at is None:
                        self._first_problem_at = time.monotonic()
        if ev.kind == Kind.HOST_LOST:
            with self._cond:
                if self._first_problem_at is None:
                    self._first_problem_at = time.monotonic()
        with self._cond:
            self._cond.notify_all()
        self._deliver(ev)

    def _deliver(self, ev: Event) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for cb in callbacks:
            try:
                cb(ev)
            except Exception:  # noqa: BLE001
                log.exception("generation event callback failed")

    def _emit(self, kind: Kind, *, host: str | None = None, rank: int | None = None,
              payload: Mapping | None = None) -> None:
        t = time.time()
        try:
            eid = self.events.append(kind, job_id=self.job_id, host=host, rank=rank,
                                     payload=payload, time_s=t)
        except Exception as e:  # noqa: BLE001
            log.error("event log write failed (%s): %s", type(e).__name__, kind)
            eid = -1
        self._deliver(Event(eid, t, self.job_id, kind, host, rank, dict(payload or {})))

    def _exit_codes(self) -> dict[int, int | None]:
        if self.remote is None:
            return {r: None for r in range(self.world_size)}
        return {w.rank: (None if w.process is None or w.process.connection_lost else w.process.poll())
                for w in self.remote.workers}

    def _last_step(self) -> int | None:
        if self.server is None:
            return None
        if self.server.last_metric_step is not None:
            return self.server.last_metric_step
        steps = [s.last.get("step") for (h, r), s in self.server.senders().items() if r == 0]
        steps = [x for x in steps if isinstance(x, int)]
        return max(steps) if steps else None

    def _failures_said(self) -> dict[int, dict]:
        """rank → the payload of its WORKER_FAILED goodbye (error, cause), for the ranks that said one."""
        return {e.rank: e.payload for e in list(self.server.emitted if self.server else [])
                if e.kind == Kind.WORKER_FAILED and e.rank is not None}

    def _root_failure(self) -> tuple[int, dict] | None:
        """The failed rank that explains the failure, with its goodbye (``{}``: none said): the
        first to fail whose cause is not a peer that died first (its peers' collectives then fail
        with "connection closed" in whichever order the OS reports it), else the first to fail."""
        if not self._failed_ranks:
            return None
        said = self._failures_said()
        roots = [r for r in self._failed_ranks if said.get(r, {}).get("cause") != "peer"]
        rank = (roots or self._failed_ranks)[0]
        return rank, said.get(rank, {})

    def _failure_report(self) -> dict:
        """The ``GenerationResult`` fields that tell the failure: ``failure`` (the root rank's
        traceback ending with its exception line, each line prefixed ``[vm rank r]``; or the start
        failure), ``error`` (that rank's own exception as its goodbye said it, else its traceback's
        exception line), ``rank`` and ``host``. Never a line written after the exception (a C++
        ``terminate called...`` of a process dying while its peers fail): ``failure_excerpt``."""
        if self._start_failure is not None:
            return {"failure": self._start_failure}
        root = self._root_failure()
        if self.remote is None or root is None:
            return {"failure": None}
        w = self.remote.workers[root[0]]
        said = str(root[1].get("error") or "").strip() or None
        lines = failure_excerpt(list(w.stderr_tail), said) or [
            f"exited with {w.exit_code} and wrote nothing to stderr"]
        return {"failure": "\n".join(f"{w.prefix} {x}" for x in lines), "error": said or lines[-1].strip(),
                "rank": w.rank, "host": w.host.name}

    def _exits_reported(self) -> bool:
        """Every ended worker's exit has been reported (its ``worker_exited`` recorded before
        ``generation_ended``: the processes are seen ended on one thread, their exits reported on
        the watcher's), or ``EXIT_REPORT_GRACE_S`` passed since all were seen ended."""
        with self._cond:
            if len(self._exit_reported) >= len(self.remote.workers):
                return True
            now = time.monotonic()
            self._all_ended_at = self._all_ended_at or now
            return now - self._all_ended_at >= EXIT_REPORT_GRACE_S

    def _failure_cause(self) -> str | None:
        root = self._root_failure() if self._start_failure is None else None
        return None if root is None else root[1].get("cause")

    def _evaluate(self) -> GenerationResult | None:
        """The result if the generation has ended, else None. Called without ``_cond`` held
        (the server's callbacks take it while holding the server's lock)."""
        srv_lost = self.server.lost_hosts() if self.server is not None else {}
        senders = self.server.senders() if self.server is not None else {}
        with self._cond:
            lost = dict(self._lost)
            failed = bool(self._failed_ranks)
            start_failure, first_problem = self._start_failure, self._first_problem_at
            stopping, byes = self._stopping, dict(self._bye)
        for name, ev in srv_lost.items():
            lost.setdefault(name, str(ev.payload.get("reason", "lost")))
        base = dict(exit_codes=self._exit_codes(), last_step=self._last_step(),
                    stop_reason=self._stop_reason)
        if lost:
            return GenerationResult(GenerationStatus.LOST, lost_hosts=lost, **self._failure_report(), **base)
        if start_failure is not None:
            return GenerationResult(GenerationStatus.FAILED, failure=start_failure, **base)
        if failed:
            # the peers of a killed worker fail before its loss is declared: give it a moment
            pending = any(s.status == "disconnected" for s in senders.values())
            if (time.monotonic() - (first_problem or 0.0) < self.options.heartbeat_interval_s or pending) and not stopping:
                return None
            return GenerationResult(GenerationStatus.FAILED, cause=self._failure_cause(), **self._failure_report(), **base)
        if self.remote is None:
            return GenerationResult(GenerationStatus.KILLED, **base) if stopping else None
        if not self.remote.done() or not self._exits_reported():
            return None
        codes = base["exit_codes"]
        if all(c == 0 for c in codes.values()):
            status = (GenerationStatus.STOPPED if any(s == STOPPED for s in byes.values())
                      else GenerationStatus.COMPLETED)
            return GenerationResult(status, **base)
        if stopping:
            return GenerationResult(GenerationStatus.KILLED, **base)
        return None  # a non-zero exit is handled by _failed_ranks (next evaluation)
