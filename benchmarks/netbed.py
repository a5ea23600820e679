"""The bandwidth-limited network testbed for the benchmarks: P test hosts, each its own network
namespace with a veth link into a bridge (``cluster.sshd_hosts.SSHDHosts.add(netns=True)``), every
link limited to the same bandwidth by ``tc`` token buckets in both directions
(``SSHDHosts.limit``; ``netem`` does not exist on these machines). One benchmark worker process
runs per host, started inside the host's namespace with ``ip netns exec`` (the namespace the
host's sshd serves), so activations, gradients and all-reduces between ranks cross two limited
links, as between two VMs on a slow network. Rendezvous is gloo over TCP on the hosts' ``eth0``.

``run_on_slow_links(worker, P, opts, bandwidth_Bps, timeout_s)`` mirrors ``common.spawn_collect``:
``worker(rank, P, out_dir, opts)`` must end with ``common.write_rank``. ``measure_link`` measures
a limited link's alpha-beta the way the calibration measures a network. Needs root, iproute2, tc
and sshd; ``skip_reason()`` says what is missing. Run as a script it is the worker launcher.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def skip_reason() -> str | None:
    """Why this machine cannot host the testbed, or ``None``."""
    from varuna_sdk.cluster.sshd_hosts import netns_skip_reason

    if os.geteuid() != 0:
        return "the slow-network testbed needs root (network namespaces, tc)"
    return netns_skip_reason()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_on_slow_links(worker: Callable, P: int, opts: dict, bandwidth_Bps: float, timeout_s: float,
                      prepare: Callable[[Path], dict] | None = None) -> tuple[list[dict], float]:
    """Run ``worker`` on P namespace hosts whose links carry ``bandwidth_Bps`` bytes/s each way.

    Returns the ranks' documents in rank order and the wall seconds. Raises ``RuntimeError`` with
    the failing rank's output when a worker fails or ``timeout_s`` passes (every worker and host
    is removed either way)."""
    from varuna_sdk.cluster.sshd_hosts import SSHDHosts

    with tempfile.TemporaryDirectory(prefix="varuna-netbed-") as tmp:
        tmpp = Path(tmp)
        opts = {**opts, **(prepare(tmpp) if prepare else {})}
        (tmpp / "opts.json").write_text(json.dumps(opts))
        th = SSHDHosts(tmpp / "hosts")
        procs: list[subprocess.Popen] = []
        try:
            hosts = [th.add(netns=True) for _ in range(P)]
            for h in hosts:
                th.limit(h, bandwidth_Bps)
            master, port = hosts[0].address, _free_port()
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            t0 = time.monotonic()
            for r, h in enumerate(hosts):
                log = open(tmpp / f"rank{r}.log", "w")
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", h.labels["netns"], sys.executable, str(Path(__file__).resolve()),
                     worker.__module__, worker.__name__, str(r), str(P), master, str(port), tmp, str(timeout_s)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE.parent)))
            deadline = t0 + timeout_s
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    r = failed[0] if failed else 0
                    tail = (tmpp / f"rank{r}.log").read_text()[-4000:]
                    why = f"rank {r} failed" if failed else f"timed out after {timeout_s:.0f} s"
                    raise RuntimeError(f"slow-link worker {why}:\n{tail}")
                time.sleep(0.2)
            wall = time.monotonic() - t0
            return [json.loads((tmpp / f"rank{r}.json").read_text()) for r in range(P)], wall
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            th.close()


def link_probe(rank: int, world: int, out_dir: str, opts: dict) -> None:
    """netbed worker: one-way seconds of each size between ranks 0 and 1, sent as the pipeline
    sends (the calibration's own p2p probe, ``profiling.network``, for a link between hosts: the
    larger of an isolated message's and a duplex train's per-message time)."""
    from varuna_sdk.profiling.network import _probe_p2p

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"p2p": _probe_p2p(rank, opts["sizes"], opts["reps"], duplex=True)}))


def measure_link(bandwidth_Bps: float, act_bytes: int, timeout_s: float, reps: int = 5) -> tuple[float, float, list]:
    """The testbed link as the calibration measures a network: (alpha seconds, beta bytes/s) fitted
    to one-way times of 1/4, 1 and 4 activations between two namespace hosts limited to
    ``bandwidth_Bps``, and the probe's rows ``[bytes, one-way s, isolated s, duplex s]``."""
    from varuna_sdk.profiling.network import fit_alpha_beta

    sizes = [act_bytes // 4, act_bytes, 4 * act_bytes]
    ranks, _ = run_on_slow_links(link_probe, 2, {"sizes": sizes, "reps": reps}, bandwidth_Bps, timeout_s)
    rows = ranks[0]["p2p"]
    alpha, beta = fit_alpha_beta([(x[0], x[1]) for x in rows])
    return alpha, beta, rows


def _main(argv: list[str]) -> None:
    module, func, rank, world, master, port, out_dir, timeout_s = argv
    rank, world = int(rank), int(world)
    import torch
    import torch.distributed as dist

    from varuna_sdk.pipeline.spawn import retain_freed_memory

    retain_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(timeout_s)))
    try:
        opts = json.loads(Path(out_dir, "opts.json").read_text())
        getattr(importlib.import_module(module), func)(rank, world, out_dir, opts)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
