"""Starting one generation's workers (``manager.generation``): bootstrapping the SSH hosts (versions,
the user's code synced by hash, the job's config and shipped objects by SFTP, each host on its
own thread), choosing the rendezvous port, and launching every worker at once with the
environment contract of ``cluster.remote`` plus ``VARUNA_GENERATION``, the heartbeat address as
that host reaches this machine, ``OMP_NUM_THREADS``, the host's ``env.NAME`` labels and, for the
first worker on each VM reached over SSH, the pre-emption notice watcher (``watches_notices``).

A host that cannot be reached, or disappears, while it is prepared is reported lost; a host that
answers but fails its bootstrap fails the generation with a message naming the VM.

``WorkerStartup`` is the start-up half of ``Generation`` (a mixin: it uses the generation's
``job``, ``placement``, ``pool``, ``options``, ``server`` and state fields, set by
``Generation.__init__``); this module exists so the watching half can be read without it.

Owns ``WorkerStartup``, ``watches_notices``, ``route_source``, ``ENV_LABEL``. Imports ``cluster`` (hosts, ssh,
bootstrap, remote, localproc, notice), ``pipeline.spawn`` (``free_port``) and ``shipping``; never
torch, never ``manager.manager``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import posixpath
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..cluster.bootstrap import BootstrapError, bootstrap
from ..cluster.hosts import Host
from ..cluster.localproc import LOCAL_ADDRESS, is_local
from ..cluster.notice import ENV_POLL as ENV_NOTICE_POLL
from ..cluster.notice import ENV_URL as ENV_NOTICE_URL
from ..cluster.notice import ENV_WATCH as ENV_NOTICE_WATCH
from ..cluster.remote import WorkerSpec, start_workers
from ..cluster.ssh import SSHConnection
from ..cluster.ssh_errors import SSHError
from ..pipeline.spawn import free_port
from ..shipping import objects_file_name
from .events import Kind

log = logging.getLogger(__name__)

ENV_LABEL = "env."


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


def route_source(address: str, port: int) -> str:
    """This machine's address on the route to ``address`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, port or 9))
            return s.getsockname()[0]
        except OSError:
            return LOCAL_ADDRESS


class WorkerStartup:
    """The start-up half of ``Generation`` (see the module docstring)."""

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
            if self.options.bootstrap:
                rep = bootstrap(self.pool, [h], code_dir=self.options.code_dir, setup=self.options.setup,
                                setup_timeout_s=self.options.setup_timeout_s, policy=self.options.version_policy)
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
            rr = self.options.remote_run_dir
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
            connect_timeout_s=min(self.pool.options.connect_timeout_s, self.options.miss_limit * self.options.heartbeat_interval_s)))
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
        if self.options.master_port:
            return self.options.master_port
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
                env = {ENV_NOTICE_WATCH: "1", ENV_NOTICE_POLL: repr(self.options.notice_poll_s), **env}
            env.update({"VARUNA_GENERATION": str(self.generation),
                        "VARUNA_HEARTBEAT_ADDR": f"{advertise[h.name]}:{hb_port}",
                        "OMP_NUM_THREADS": str(self.job.launch.threads_per_worker)})
            if self.options.orphan_after_s is not None:
                env["VARUNA_ORPHAN_AFTER"] = repr(float(self.options.orphan_after_s))
            env.update(self.options.env or {})
            if is_local(h):
                cmd = [h.python, "-m", "varuna_sdk.worker", str(cfg.resolve()), str(self.run_dir.resolve())]
                # the user's folder, as on an SSH VM (its synced code folder): relative data paths
                # and a model given by import path mean what they mean in the user's session
                where = str(Path(self.options.code_dir).resolve()) if self.options.code_dir is not None else os.getcwd()
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
            self.server.expect(h.name, rank, within_s=self.options.start_timeout_s)
        with self._lock:
            if self._stopping:
                return
            try:
                self.remote = start_workers(specs, pool=self.pool, master_addr=master_addr, master_port=port,
                                     job_id=self.job_id, token=self.token,
                                     env={"VARUNA_HEARTBEAT_INTERVAL": repr(self.options.heartbeat_interval_s)},
                                     sink=self._sink, on_exit=self._on_exit)
            except SSHError as e:  # a VM gone between bootstrap and launch
                self._mark_lost(e.host.name, "vm_unreachable", str(e))
            except FileNotFoundError as e:
                self._start_failed(str(e))
        log.info("generation %d of job %s: %d workers on %s", self.generation, self.job_id,
                 self.world_size, sorted({h.name for h in self.hosts}))

