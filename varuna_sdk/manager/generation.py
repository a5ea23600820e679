"""One generation of a job: the set of workers launched for one configuration (P, D, stage map)
on one list of hosts — started, watched, asked to stop, and stopped leaving nothing behind.

A morph ends a generation and starts the next (``manager.manager``); this module launches and
supervises one. ``Generation(job, hosts, run_dir, events=..., job_id=..., generation=g)``:

- **placement**: rank ``r = replica·P + stage`` (``pipeline.groups.Topology``), assigned to the
  hosts in order, a host with ``k`` GPUs taking ``k`` consecutive ranks (``LOCAL_RANK`` 0..k-1),
  a CPU host ``cpu_slots`` (default 1); hosts beyond what P·D needs are not used
  (``unused_hosts``). Too few slots → ``ValueError`` before anything starts.
- **start()**: a ``HeartbeatServer`` (``manager.heartbeat``) writing to ``events``; SSH hosts are
  bootstrapped (``cluster.bootstrap``: versions, the user's ``code_dir`` synced by hash, optional
  ``setup`` command) and get the job's ``config.yaml`` by SFTP; then every worker starts at once
  (``cluster.remote.launch``): ``python -m varuna_sdk.worker CONFIG RUN_DIR`` with the host's
  Python, in its own process group/session — local hosts (``labels["kind"] == "local"``) as local
  subprocesses, the others over SSH — with the environment contract of ``cluster.remote`` plus
  ``VARUNA_GENERATION``, the heartbeat address (the address of this machine *as that host
  reaches it*), ``OMP_NUM_THREADS`` and the host's ``env.NAME`` labels (e.g.
  ``GLOO_SOCKET_IFNAME`` for network-namespace hosts). The first worker on each VM reached over
  SSH also watches the VM's pre-emption notices (``watches_notices``; ``VARUNA_NOTICE_WATCH=1``,
  polling every ``notice_poll_s``, default 5 s: ``cluster.notice``); a notice reaches the manager
  as a ``preemption_notice`` event of this generation. Output streams to ``sink`` and to
  ``RUN_DIR/gen<g>/workers.log``, each line prefixed ``[vm rank r]``. A host that cannot be
  reached, or disappears, during bootstrap or start-up is reported lost (``host_lost`` event,
  ``wait()`` → ``"lost"``); a host whose software does not match fails the generation with the
  message naming the VM. ``start()`` raises only for misuse (called twice, bad options).
- **request_stop(reason)**: the heartbeat channel's signed ``stop`` command: every worker stops at
  the next mini-batch boundary (the ranks agree on the step, checkpoint and exit; ``wait()`` →
  ``"stopped"``).
- **wait(timeout_s)**: None while running; else a ``GenerationResult``: ``"completed"``,
  ``"stopped"`` (on request, at a boundary), ``"lost"`` (a host lost: pre-empted, network cut,
  process killed, heartbeats stopped — within 2 heartbeat intervals), ``"failed"`` (a worker
  raised: its traceback, prefixed by VM and rank, is in ``failure``), ``"killed"`` (``stop()``
  ended workers that had not finished). On ``"lost"``/``"failed"`` the surviving workers are
  stopped before it returns (``stop_on_failure``).
- **stop(grace_s, gone=())**: SIGTERM then SIGKILL every worker's whole session on every host in
  parallel (``gone``: hosts known to be unreachable, skipped); True when nothing survived.
- **heartbeats()**, **subscribe(callback(Event))**: every event of this generation (worker
  joined/finished/failed, host lost, stop requested...) as it is recorded in ``events``.

Rank 0's heartbeats carry each step's metrics row; the heartbeat server appends them to the event
log's metrics table (the dashboard's source), once per step, none dropped.

**Orphans**: a worker that cannot reach its manager for ``orphan_after_s`` (the manager died)
stops at a boundary with a checkpoint by itself; ``wait_for_orphans`` lets a restarted manager
wait for that before it launches the next generation.

Owns ``Generation``, ``GenerationResult``, ``place``, ``watches_notices``, ``wait_for_orphans``. Imports ``cluster`` (hosts, ssh, bootstrap,
remote, localproc), ``config`` and ``manager.events|heartbeat``; never torch.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import posixpath
import secrets as _secrets
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..cluster.bootstrap import BootstrapError, VersionPolicy, bootstrap
from ..cluster.hosts import Host, Secret
from ..cluster.local import free_port
from ..cluster.localproc import LOCAL_ADDRESS, is_local
from ..cluster.notice import ENV_POLL as ENV_NOTICE_POLL
from ..cluster.notice import ENV_URL as ENV_NOTICE_URL
from ..cluster.notice import ENV_WATCH as ENV_NOTICE_WATCH
from ..cluster.remote import LineSink, RemoteJob, RemoteWorker, WorkerSpec, launch, print_sink
from ..cluster.ssh import SSHConnection, SSHError, SSHOptions, SSHPool
from ..config import JobConfig
from ..shipping import objects_file_name
from .events import Event, EventLog, Kind
from .heartbeat import STOPPED, HeartbeatServer

log = logging.getLogger(__name__)

STATUSES = ("completed", "stopped", "lost", "failed", "killed")
REAP_TIMEOUT_S = 10.0   # reaching a VM lost by its heartbeats to kill what is left of the generation there
ENV_LABEL = "env."


@dataclass
class GenerationResult:
    """How a generation ended. ``status``: one of ``STATUSES``; ``exit_codes``: rank → exit code
    (None: no exit code — connection lost, or never started); ``lost_hosts``: host name → reason
    (``connection_closed``, ``heartbeat_timeout``, ``worker_process_died``, ``vm_unreachable``,
    ``lost_during_bootstrap``, ``never_joined``, ``preempted``...); ``failure``: the first failed
    worker's traceback, each line prefixed ``[vm rank r]`` (or the bootstrap error naming the VM);
    ``last_step``: the last step rank 0 reported finished (None: none); ``seconds``: from
    ``start()`` to the end; ``stop_reason``: the ``request_stop`` reason, if any; ``cause``: why
    the worker named in ``failure`` failed (``heartbeat.FAILURE_CAUSES``; None: not said) — a
    ``"data"`` failure is deterministic, so retrying it would fail the same way."""

    status: str
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    lost_hosts: dict[str, str] = field(default_factory=dict)
    failure: str | None = None
    last_step: int | None = None
    seconds: float = 0.0
    stop_reason: str | None = None
    cause: str | None = None


class _Abandoned(Exception):
    """Another host failed, or the generation is being stopped: stop preparing this one."""


def watches_notices(h: Host) -> bool:
    """Whether the first worker on ``h`` runs the VM's pre-emption notice watcher
    (``cluster.notice``): on every VM reached over SSH; not on a local slot (this machine has no
    cloud metadata to read), nor on an sshd test host unless its labels name a metadata stand-in
    (``env.VARUNA_METADATA_URL``). A host label ``env.VARUNA_NOTICE_CLOUD=off`` turns it off."""
    if is_local(h):
        return False
    return h.labels.get("kind") != "test-host" or f"{ENV_LABEL}{ENV_NOTICE_URL}" in h.labels


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


def _route_source(address: str, port: int) -> str:
    """This machine's address on the route to ``address`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, port or 9))
            return s.getsockname()[0]
        except OSError:
            return LOCAL_ADDRESS


class Generation:
    """Launch and supervise one set of workers (see the module docstring).

    ``job``: the configuration with P and D chosen; ``hosts``: in rank order; ``run_dir``: the
    job's run folder here (local workers write into it; ``gen<g>/`` holds this generation's
    config and log); ``events``: the job's event log; ``job_id``; ``generation``: 0, 1, ...

    Options: ``heartbeat_interval_s`` / ``miss_limit`` (a host is lost after ``miss_limit``
    silent intervals; ``startup_grace_s``: the silence allowed before a worker's first step —
    torch import on a busy VM); ``start_timeout_s`` (a worker must say hello this long after
    launch); ``kill_grace_s`` (SIGTERM → SIGKILL); ``orphan_after_s`` (a worker that cannot
    reach this manager that long — the manager died — stops at a boundary by itself, with a
    checkpoint; None: never);
    ``ssh_options`` or ``pool``; ``code_dir`` (synced to ``<workdir>/code`` on SSH hosts, the
    workers' working folder there), ``setup`` / ``setup_timeout_s``, ``version_policy``,
    ``bootstrap=False`` (skip the checks); ``remote_run_dir`` (the run folder on SSH hosts: a
    path, or ``host -> path``; default ``<workdir>/varuna/<job_id>/run`` — give a shared
    filesystem path, such as ``run_dir`` itself for test hosts on this machine, when ranks must
    see each other's checkpoints); ``cpu_slots``; ``manager_address`` (what the workers connect
    to for heartbeats; default: this machine's address on the route to each host);
    ``master_port`` (0: a free one on rank 0's host); ``env`` (extra worker environment);
    ``sink`` (prefixed output lines; None: only the log file); ``token`` (the job secret; default
    a fresh one per generation).

    After ``start()``: ``server`` (the ``HeartbeatServer``), ``remote`` (the ``RemoteJob``),
    ``bootstrap_report`` (host name → ``BootstrapReport``), ``rank_hosts`` (host name per rank).
    """

    def __init__(self, job: JobConfig, hosts: Sequence[Host], run_dir: str | Path, *,
                 events: EventLog, job_id: str, generation: int = 0,
                 heartbeat_interval_s: float = 2.0, miss_limit: float = 2.0,
                 start_timeout_s: float = 180.0, ssh_options: SSHOptions | None = None,
                 pool: SSHPool | None = None, code_dir: str | Path | None = None,
                 setup: str | Sequence[str] | None = None, setup_timeout_s: float = 600.0,
                 version_policy: VersionPolicy | None = None, bootstrap: bool = True,
                 remote_run_dir: str | Callable[[Host], str] | None = None, cpu_slots: int = 1,
                 manager_address: str | None = None, master_port: int = 0,
                 env: Mapping[str, str] | None = None, sink: LineSink | None = print_sink,
                 token: Secret | None = None, kill_grace_s: float = 2.0,
                 startup_grace_s: float = 15.0, orphan_after_s: float | None = 60.0,
                 notice_poll_s: float = 5.0):
        job = JobConfig.from_dict(job.to_dict()).validate()
        if not 0 < notice_poll_s <= 3600:
            raise ValueError(f"notice_poll_s={notice_poll_s!r}: the metadata poll interval must be in (0, 3600] s")
        self.notice_poll_s = float(notice_poll_s)
        if job.parallel.planned:
            raise ValueError("job.parallel.P and D must be chosen before a generation starts "
                             "(run the planner: manager.Manager or launch.plan_job)")
        if heartbeat_interval_s <= 0 or miss_limit < 1 or start_timeout_s <= 0:
            raise ValueError("heartbeat_interval_s and start_timeout_s must be > 0 and miss_limit >= 1")
        self.job, self.job_id, self.generation = job, job_id, int(generation)
        self.world_size = job.parallel.P * job.parallel.D
        self.placement = place(hosts, self.world_size, cpu_slots=cpu_slots)
        used = {h.name for h, _ in self.placement}
        self.hosts = [h for h in hosts if h.name in used]
        self.unused_hosts = [h for h in hosts if h.name not in used]
        self.rank_hosts = [h.name for h, _ in self.placement]
        self.run_dir = Path(run_dir)
        self.events = events
        self.interval_s, self.miss_limit = float(heartbeat_interval_s), float(miss_limit)
        self.start_timeout_s = float(start_timeout_s)
        self.code_dir, self.setup, self.setup_timeout_s = code_dir, setup, setup_timeout_s
        self.version_policy, self.do_bootstrap = version_policy, bootstrap
        self.remote_run_dir, self.manager_address = remote_run_dir, manager_address
        self.master_port, self.extra_env, self.user_sink = master_port, dict(env or {}), sink
        self.kill_grace_s, self.startup_grace_s = kill_grace_s, startup_grace_s
        if orphan_after_s is not None and orphan_after_s <= self.miss_limit * self.interval_s:
            raise ValueError(f"orphan_after_s={orphan_after_s} must exceed the loss timeout "
                             f"({self.miss_limit * self.interval_s:g} s), or be None")
        self.orphan_after_s = orphan_after_s
        self.token = token or Secret(_secrets.token_urlsafe(24))
        self.ssh_hosts = [h for h in self.hosts if not is_local(h)]
        self._own_pool = pool is None and bool(self.ssh_hosts)
        self.pool = pool if pool is not None else (SSHPool(ssh_options) if self.ssh_hosts else None)
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
        advertise = {h.name: self.manager_address or (LOCAL_ADDRESS if is_local(h) else
                                                      _route_source(h.address, h.port))
                     for h in self.hosts}
        loop = all(a == LOCAL_ADDRESS for a in advertise.values())
        self.server = HeartbeatServer(
            self.job_id, self.token, self.events, interval_s=self.interval_s,
            miss_limit=self.miss_limit, startup_grace_s=self.startup_grace_s, placed_only=True,
            bind=LOCAL_ADDRESS if loop else "0.0.0.0",
            advertise=next(iter(advertise.values())), on_event=self._on_event).start()
        self._emit("generation_started", payload={
            "generation": self.generation, "P": self.job.parallel.P, "D": self.job.parallel.D,
            "world_size": self.world_size, "hosts": self.rank_hosts,
            "unused_hosts": [h.name for h in self.unused_hosts],
            "local_hosts": sorted({h.name for h in self.hosts if is_local(h)}),
            "interval_s": self.interval_s, "orphan_after_s": self.orphan_after_s})
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
        ``stop_on_failure`` the surviving workers are stopped before a ``"lost"`` or
        ``"failed"`` result is returned."""
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
        if res.status in ("lost", "failed") and stop_on_failure and not self._stopping:
            # a VM lost by its heartbeats alone may still be there: not "gone" (``stop`` reaps it)
            self.stop(gone=[h for h, why in res.lost_hosts.items() if why != "heartbeat_timeout"])
            res.exit_codes = self._exit_codes()
        res.seconds = time.monotonic() - (self._t_start or time.monotonic())
        with self._cond:
            first = self._result is None
            if first:
                self._result = res
        if first:
            self._emit("generation_ended", payload={
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
            grace = self.kill_grace_s if grace_s is None else grace_s
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
        if self._log_file is not None:
            try:
                self._log_file.flush()
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
            self._emit("stale_worker_reaped", host=w.host.name, rank=w.rank, payload={"stopped": ok})

    def close(self) -> None:
        """``stop()``, record how the generation ended (``generation_ended``, if ``wait`` did
        not yet) and close the log file."""
        self.stop()
        if self._started:
            self.wait(timeout_s=10.0, stop_on_failure=False)
        if self._log_file is not None:
            self._log_file.close()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------------------- starting
    def _prepare_ssh_hosts(self, cfg: Path) -> tuple[dict | None, dict, dict]:
        """Bootstrap every SSH host and put the config there, each host on its own thread, so a
        host that fails is handled (probed, reported lost or failed) the moment it fails, not
        when the slowest host is done. Returns (remote config path, remote run dir, working
        folder) per host; (None, ..) when any host failed."""
        if not self.ssh_hosts:
            return {}, {}, {}
        t0 = time.monotonic()
        reports: dict[str, object] = {}
        objects = self._objects_files()

        def one(h: Host) -> tuple[str, str, str]:
            sync = None
            if self.do_bootstrap:
                rep = bootstrap(self.pool, [h], code_dir=self.code_dir, setup=self.setup,
                                setup_timeout_s=self.setup_timeout_s, policy=self.version_policy)
                reports[h.name] = rep
                sync = rep.sync.get(h.name)
            if self._stopping or self._lost:
                raise _Abandoned()
            base = h.workdir or self.pool.get(h).run(["sh", "-c", 'printf %s "$HOME"'], timeout_s=30,
                                                     check=True).stdout.strip()
            gen = posixpath.join(base, "varuna", self.job_id, f"gen{self.generation}")
            remote = posixpath.join(gen, "config.yaml")
            self.pool.get(h).put(cfg, remote, mkdirs=True)
            for f in objects:  # callables shipped by value travel with the job spec, over SFTP only
                self.pool.get(h).put(f, posixpath.join(gen, f.name), mkdirs=True, mode=0o600)
            rr = self.remote_run_dir
            run = (rr(h) if callable(rr) else rr) if rr is not None else \
                posixpath.join(base, "varuna", self.job_id, "run")
            return remote, str(run), (sync.remote_dir if sync is not None else gen)

        def guarded(h: Host):
            try:
                return one(h)
            except _Abandoned:
                return None
            except BootstrapError as e:
                self._host_failed(h, e.failures.get(h.name, str(e)))
            except SSHError as e:
                self._host_failed(h, str(e))
            except Exception as e:  # noqa: BLE001 - SFTP/OS errors while uploading
                self._host_failed(h, f"{h}: {type(e).__name__}: {e}")
            return None

        with ThreadPoolExecutor(max_workers=min(16, len(self.ssh_hosts))) as ex:
            out = dict(zip([h.name for h in self.ssh_hosts], ex.map(guarded, self.ssh_hosts)))
        if any(v is None for v in out.values()):
            return None, {}, {}
        if reports:
            vers = {n: r.versions[n] for n, r in reports.items()}
            self._emit(Kind.BOOTSTRAP, payload={
                "generation": self.generation, "seconds": round(time.monotonic() - t0, 3),
                "hosts": {n: {"python": v.python, "torch": v.torch, "varuna_sdk": v.varuna_sdk}
                          for n, v in vers.items()},
                "files_sent": {n: r.sync[n].files_sent for n, r in reports.items() if n in r.sync}})
            self.bootstrap_report = reports
        return ({n: v[0] for n, v in out.items()}, {n: v[1] for n, v in out.items()},
                {n: v[2] for n, v in out.items()})

    def _objects_files(self) -> list[Path]:
        """The job's objects files (callables shipped by value, ``varuna_sdk.shipping``) in the run
        folder. Raises ``FileNotFoundError`` naming one that is missing."""
        out = []
        for ref in (self.job.model.by_value, self.job.data.by_value):
            if ref:
                f = self.run_dir / objects_file_name(ref.split(":", 1)[-1])
                if not f.is_file():
                    raise FileNotFoundError(f"the job ships objects by value ({f.name}) but {f} is missing; "
                                            "launch it with Job.launch() or launch_job, which write it")
                out.append(f)
        return out

    def _host_failed(self, h: Host, message: str) -> None:
        """A host failed during bootstrap or config upload: lost if it cannot be reached now
        (probed afresh), else the generation failed (the message names the VM)."""
        if self._stopping:
            return
        self.pool.drop(h)
        probe = SSHConnection(h, dataclasses.replace(  # one quick attempt: refused = gone
            self.pool.options, connect_attempts=1,
            connect_timeout_s=min(self.pool.options.connect_timeout_s, self.miss_limit * self.interval_s)))
        try:
            probe.connect()
            reachable = True
        except SSHError:
            reachable = False
        finally:
            probe.close()
        if reachable:
            self._start_failed(f"bootstrap failed on {h.name}: {message}")
        else:
            self._mark_lost(h.name, "lost_during_bootstrap", message)

    def _start_failed(self, text: str) -> None:
        with self._cond:
            self._start_failure = text if self._start_failure is None else f"{self._start_failure}\n{text}"
            if self._first_problem_at is None:
                self._first_problem_at = time.monotonic()
            self._cond.notify_all()

    def _mark_lost(self, name: str, reason: str, detail: str = "") -> None:
        with self._cond:
            if name in self._lost:
                return
            self._lost[name] = reason
            self._cond.notify_all()
        if self.server is not None:
            self.server.report_lost(name, reason, payload={"detail": detail[-500:]} if detail else None)

    def _master_port(self, h0: Host) -> int:
        """A port free on rank 0's host for the rendezvous store, chosen *below* the kernel's
        ephemeral range, so that no outgoing connection (heartbeats, SSH, gloo) can take it in
        the seconds before rank 0 binds it."""
        if self.master_port:
            return self.master_port
        if is_local(h0) or h0.is_loopback:
            return int(free_port(h0.address))
        code = f"{inspect.getsource(free_port)}\nprint(free_port(''))"
        return int(self.pool.get(h0).run([h0.python, "-c", code], timeout_s=30, check=True).stdout.split()[-1])

    def _launch(self, cfg: Path, remote_cfg: dict, remote_run: dict, cwd: dict,
                advertise: dict[str, str]) -> None:
        h0 = self.placement[0][0]
        master_addr = LOCAL_ADDRESS if is_local(h0) else h0.address
        try:
            port = self._master_port(h0)
        except (SSHError, OSError) as e:
            self._mark_lost(h0.name, "vm_unreachable", str(e))
            return
        specs = []
        hb_port = self.server.address[1]
        for rank, (h, local_rank) in enumerate(self.placement):
            env = {k[len(ENV_LABEL):]: v for k, v in h.labels.items() if k.startswith(ENV_LABEL)}
            if local_rank == 0 and watches_notices(h):
                env = {ENV_NOTICE_WATCH: "1", ENV_NOTICE_POLL: repr(self.notice_poll_s), **env}
            env.update({"VARUNA_GENERATION": str(self.generation),
                        "VARUNA_HEARTBEAT_ADDR": f"{advertise[h.name]}:{hb_port}",
                        "OMP_NUM_THREADS": str(self.job.launch.threads_per_worker)})
            if self.orphan_after_s is not None:
                env["VARUNA_ORPHAN_AFTER"] = repr(float(self.orphan_after_s))
            env.update(self.extra_env)
            if is_local(h):
                cmd = [h.python, "-m", "varuna_sdk.worker", str(cfg.resolve()), str(self.run_dir.resolve())]
                # the user's folder, as on an SSH VM (its synced code folder): relative data paths
                # and a model given by import path mean what they mean in the user's session
                where = str(Path(self.code_dir).resolve()) if self.code_dir is not None else os.getcwd()
                # ... and everything the launcher can import (a local slot is this machine), as spawned
                # processes get the parent's sys.path
                paths = [where, env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")]
                paths += [p for p in sys.path if p and os.path.isdir(p)]
                env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
            else:
                cmd = [h.python, "-m", "varuna_sdk.worker", remote_cfg[h.name], remote_run[h.name]]
                where = cwd[h.name]
            specs.append(WorkerSpec(h, rank, cmd, local_rank=local_rank, env=env, cwd=where))
        for rank, (h, _) in enumerate(self.placement):
            self.server.expect(h.name, rank, within_s=self.start_timeout_s)
        with self._lock:
            if self._stopping:
                return
            try:
                self.remote = launch(specs, pool=self.pool, master_addr=master_addr, master_port=port,
                                     job_id=self.job_id, token=self.token,
                                     env={"VARUNA_HEARTBEAT_INTERVAL": repr(self.interval_s)},
                                     sink=self._sink, on_exit=self._on_exit)
            except SSHError as e:  # a VM gone between bootstrap and launch
                self._mark_lost(e.host.name, "vm_unreachable", str(e))
            except FileNotFoundError as e:
                self._start_failed(str(e))
        log.info("generation %d of job %s: %d workers on %s", self.generation, self.job_id,
                 self.world_size, sorted({h.name for h in self.hosts}))

    # -------------------------------------------------------------------------- watching
    def _sink(self, stream: str, worker: RemoteWorker, line: str) -> None:
        f = self._log_file
        if f is not None:
            try:
                f.write(line + "\n")
            except (OSError, ValueError):
                pass
        if self.user_sink is not None:
            self.user_sink(stream, worker, line)

    def _on_exit(self, w: RemoteWorker) -> None:
        p = w.process
        code = None if p is None or p.connection_lost else p.exit_code
        if self.server is not None:
            self.server.report_exit(w.host.name, w.rank, code, at=p.ended_at if p else None)
        with self._cond:
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

    def _emit(self, kind: str, *, host: str | None = None, rank: int | None = None,
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

    def _failure_text(self) -> str | None:
        if self._start_failure is not None:
            return self._start_failure
        root = self._root_failure()
        if self.remote is None or root is None:
            return None
        w = self.remote.workers[root[0]]
        lines = [x for x in list(w.stderr_tail) if x.strip()]
        if not lines:
            lines = [root[1]["error"]] if root[1].get("error") else [
                f"exited with {w.exit_code} and wrote nothing to stderr"]
        return "\n".join(f"{w.prefix} {x}" for x in lines)

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
            return GenerationResult("lost", lost_hosts=lost, failure=self._failure_text(), **base)
        if start_failure is not None:
            return GenerationResult("failed", failure=start_failure, **base)
        if failed:
            # the peers of a killed worker fail before its loss is declared: give it a moment
            pending = any(s.status == "disconnected" for s in senders.values())
            if (time.monotonic() - (first_problem or 0.0) < self.interval_s or pending) and not stopping:
                return None
            return GenerationResult("failed", failure=self._failure_text(), cause=self._failure_cause(), **base)
        if self.remote is None:
            return GenerationResult("killed", **base) if stopping else None
        if not self.remote.done():
            return None
        codes = base["exit_codes"]
        if all(c == 0 for c in codes.values()):
            status = STOPPED if any(s == STOPPED for s in byes.values()) else "completed"
            return GenerationResult(status, **base)
        if stopping:
            return GenerationResult("killed", **base)
        return None  # a non-zero exit is handled by _failed_ranks (next evaluation)


def wait_for_orphans(events: EventLog, job_id: str, *, timeout_s: float = 120.0) -> dict:
    """After a manager restart on the same event log: if the job's last generation never ended
    (no ``generation_ended``), its workers may still run — orphans. They stop by themselves at a
    mini-batch boundary, with a checkpoint, ``orphan_after_s`` after they lost the manager
    (``HeartbeatClient``); wait for that: until every local worker process of that generation
    (pids from its ``worker_joined`` events) has exited and, when it had remote workers, until
    ``orphan_after_s`` + 2 intervals + 10 s after its last recorded heartbeat — at most
    ``timeout_s``. Records an ``orphans`` event; returns what it found (``generation``,
    ``local_pids``, ``left``: pids still alive, ``waited_s``)."""
    t0 = time.monotonic()
    marks = events.events(job_id=job_id, kind=("generation_started", "generation_ended"))
    if not marks or marks[-1].kind != "generation_started":
        return {"generation": None, "local_pids": [], "left": [], "waited_s": 0.0}
    started = marks[-1]
    g = started.payload.get("generation")
    local = set(started.payload.get("local_hosts") or [])
    joined = events.events(job_id=job_id, kind=(Kind.WORKER_JOINED, Kind.WORKER_REJOINED),
                           since_id=started.id)
    pids = sorted({int(e.payload["pid"]) for e in joined
                   if e.host in local and isinstance(e.payload.get("pid"), int)})
    remote = set(started.payload.get("hosts") or []) - local
    orphan_after = started.payload.get("orphan_after_s")
    interval = float(started.payload.get("interval_s") or 2.0)
    beats = events.heartbeats(job_id=job_id, since_id=0)
    last_beat = beats[-1].time if beats else started.time
    remote_until = (last_beat + float(orphan_after) + 2 * interval + 10.0) if (remote and orphan_after) else 0.0

    def alive(pid: int) -> bool:
        try:
            return b"varuna_sdk.worker" in Path(f"/proc/{pid}/cmdline").read_bytes() and \
                Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    while True:
        left = [p for p in pids if alive(p)]
        if (not left and time.time() >= remote_until) or time.monotonic() - t0 >= timeout_s:
            break
        time.sleep(0.2)
    out = {"generation": g, "local_pids": pids, "left": left, "waited_s": round(time.monotonic() - t0, 3),
           "remote_hosts": sorted(remote)}
    events.append("orphans", job_id=job_id, payload=out)
    return out
