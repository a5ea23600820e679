"""Host probes of calibration (paper §4.3): what the network and the machine's shared cores cost.

Owns ``measure_host``/``measure_network``: in a few spawned processes sharing this machine
(``pipeline.spawn.spawn_workers``), point-to-point α/β through the pipeline's ``Channel``, ring
all-reduce α/β of a gradient bucket as the engine reduces it, the share of a core an all-reduce
participant keeps busy, how many processes' end-of-step work the machine runs at full speed at
once, and how much compute slows down when the other cores compute too; and the fits that turn
those samples into a ``NetworkProfile`` and figures (``fit_alpha_beta``, ``crowded_share``,
``paired_ratio``, ``crowded_mean``, ``compute_interference``, ``oversubscription``).
Units: seconds, bytes, bytes/s.

Imports ``model`` (to build the compute probe's model), ``pipeline`` (``Channel``, the process
spawner), ``shipping`` (a model that plain pickle cannot carry to the probe processes travels by
value) and ``profiling.profile``; must never import ``cluster``, ``planner``, ``trainer`` or
``manager``.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from ..model.inputs import call_model, to_device
from ..model.materialize import build_on_meta, materialize
from ..pipeline.spawn import spawn_workers
from ..shipping import ByValue, find_objects, pack_objects
from .profile import NetworkProfile, ring_allreduce_s


def _bucket_allreduce(parts: list[torch.Tensor], group, scale: float) -> None:
    """All-reduce a gradient bucket the way the engine does (``Varuna._sync_and_step``): flatten,
    all-reduce, scale, copy back — so the probe's α–β include the copies around the collective."""
    import torch.distributed as dist

    flat = torch.cat([p.reshape(-1) for p in parts])
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    off = 0
    for p in parts:
        p.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()


_WARMUP = 2  # untimed repetitions of each probe (connections, buffers, the allocator's heap)


def _net_worker(rank: int, world: int, out: str, sizes: list[int], reps: int, opt_bytes: int,
                compute: dict | None = None, network: bool = True) -> None:
    """One probe process (``spawn_workers`` target): every probe in turn, all ranks in step;
    rank 0 writes the samples to ``out`` as JSON (the compute probe's crowded ranks write their
    own times to ``<out>.compute<rank>``). Without ``network`` only the model's probes run
    (optimizer, compute): the network figures are known already."""
    import torch.distributed as dist

    cores = os.cpu_count() or 1
    res: dict[str, list] = {"p2p": [], "allreduce": [], "ar_cpu": [], "consensus": [], "opt": [], "cpu_count": cores}
    # processes that run at once on their own cores, each with this process's torch threads
    # (measure_host divides cpu_count by the threads the same way)
    k_max = min(world, max(1, cores // max(1, torch.get_num_threads())))
    if network:
        pair = dist.new_group([0, 1])
        res["p2p"] = _probe_p2p(rank, sizes, reps)
        _probe_allreduce(rank, world, pair, sizes, reps, res)
        res["consensus"] = [world, _probe_consensus(reps)]
    if opt_bytes > 0:
        res["opt"], res["opt_samples"] = _probe_optimizer(rank, k_max, opt_bytes, reps)
    if compute is not None:
        res["compute_ks"] = _probe_compute(rank, k_max, compute, reps, out)  # process counts probed: 1, then k
    # every rank waits for the last sample: a rank that left early would tear its process down
    # (a core's worth of work for ~1 s) while ranks < k still time their last crowded probe,
    # which made that sample up to 60 % slower and moved compute_interference by up to 0.05
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(res))


_TRAIN = 4  # messages each way in a duplex train of the p2p probe


def _probe_p2p(rank: int, sizes: list[int], reps: int, train: int = _TRAIN, duplex: bool = False) -> list[list]:
    """``[bytes, seconds one way, isolated, duplex]`` per size between ranks 0 and 1, sent as the
    pipeline sends: a ``Channel`` (header + tensors, its own two-rank communicator per direction).

    Isolated: one message ping-pong, halved. With ``duplex`` (a link between hosts): both ranks also
    send ``train`` messages back to back at once and receive the peer's (a pipeline's steady state:
    activations one way, gradients the other), seconds per message, and the one-way figure is the
    larger of the two. On a link with a token bucket (cloud egress caps, ``tc tbf``) an isolated
    message rides the bucket's burst (a 256 KiB message on a 14.6 MB/s link measured 28.6 MB/s), and
    on a slow duplex link the acknowledgements queue behind the other direction's data (3.4 MB/s one
    way measured 2.5 MB/s both ways), while a pipeline's messages follow one another both ways.
    Without ``duplex`` (the calibration's loopback probe; duplex column 0.0) the isolated time is
    the figure: on loopback a duplex train times two processes' copies contending for the cores
    (4 KiB: 0.3-1.9 ms from run to run on 2 cores), not a link."""
    import torch.distributed as dist

    from ..pipeline.comm import Channel

    fwd_g, bwd_g = dist.new_group([0, 1]), dist.new_group([0, 1])
    meet = dist.new_group([0, 1])  # the two ranks agree on the duplex time apart from the channels' groups
    dev = torch.device("cpu")
    if rank < 2:
        there = Channel(1 - rank, fwd_g if rank == 0 else bwd_g, dev)
        back = Channel(1 - rank, bwd_g if rank == 0 else fwd_g, dev)
    out = []
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        iso: list[float] = []
        dup: list[float] = []
        if rank < 2:  # a new signature: the first (untimed) message carries the header
            there.begin_step()
            back.begin_step()
        for i in range(reps + _WARMUP):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                there.send([t])
                there.wait_sends()
                back.recv()
            elif rank == 1:
                back.recv()
                there.send([t])
                there.wait_sends()
            if i >= _WARMUP:
                iso.append((time.perf_counter() - t0) / 2)
        for i in range(reps + _WARMUP if duplex else 0):
            dist.barrier()
            t0 = time.perf_counter()
            if rank < 2:
                for _ in range(train):
                    there.send([t])
                for _ in range(train):
                    back.recv()
                there.wait_sends()
            if i >= _WARMUP:
                dup.append((time.perf_counter() - t0) / train)
        if duplex and rank < 2:  # the slower direction's time: the larger of what rank 0 and rank 1 saw
            ends = torch.tensor([statistics.median(dup)], dtype=torch.float64)
            dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=meet)
            d = float(ends)
        else:
            d = 0.0
        i_s = statistics.median(iso)
        out.append([nbytes, max(i_s, d), i_s, d])
    return out


def _probe_allreduce(rank: int, world: int, pair, sizes: list[int], reps: int, res: dict) -> None:
    """Bucket all-reduces among 2 and among all ``world`` processes, every size: appends
    ``[n, bytes, seconds]`` to ``res["allreduce"]`` and ``[n, bytes, rank 0's CPU share]`` to
    ``res["ar_cpu"]``."""
    import torch.distributed as dist

    groups = {2: pair, world: None} if world > 2 else {2: pair}
    parts = {b: [torch.ones(max(1, b // 16)) for _ in range(4)] for b in sizes}
    walls: dict[tuple, list] = {(n, b): [] for n in groups for b in sizes}
    shares: dict[tuple, list] = {(n, b): [] for n in groups for b in sizes}
    for i in range(2 * reps + _WARMUP):  # interleaved: every group size sees the same machine
        for n, grp in groups.items():
            for nbytes in sizes:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                if rank < n:
                    _bucket_allreduce(parts[nbytes], grp, 1.0 / n)
                if i >= _WARMUP:
                    walls[n, nbytes].append(time.perf_counter() - t0)
                    shares[n, nbytes].append((time.process_time() - c0) / walls[n, nbytes][-1])
    for (n, nbytes), w in walls.items():
        res["allreduce"].append([n, nbytes, statistics.median(w)])
        res["ar_cpu"].append([n, nbytes, statistics.median(shares[n, nbytes])])  # rank 0's CPU share


def _probe_consensus(reps: int) -> float:
    """Seconds of one all-reduce of a few numbers among all processes (the stop agreement)."""
    import torch.distributed as dist

    small = torch.zeros(3)
    samples = []
    for i in range(reps * 3 + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(small)
        if i:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _probe_optimizer(rank: int, k_max: int, opt_bytes: int, reps: int) -> tuple[list, list]:
    """The end of a step is memory-bound passes over the parameters (norm, clip, AdamW): AdamW
    steps over ``opt_bytes`` with 1 process, then with ``k_max`` at once (all ranks step
    together). Returns ``([[k, median seconds]], [[k, samples]])``."""
    import torch.distributed as dist

    params = [torch.nn.Parameter(torch.randn(max(1, opt_bytes // 16))) for _ in range(4)]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ks = sorted({1, k_max})
    samples = {k: [] for k in ks}
    for i in range(3 * reps + _WARMUP):  # alternating, so that both see the same machine
        for k in ks:
            dist.barrier()
            t0 = time.perf_counter()
            if rank < k:
                opt.step()
            if i >= _WARMUP:
                samples[k].append(time.perf_counter() - t0)
    dist.barrier()  # nobody starts the next probe (building a model) during the last sample
    return [[k, statistics.median(samples[k])] for k in ks], [[k, samples[k]] for k in ks]


def _probe_compute(rank: int, k_max: int, compute: dict, reps: int, out: str) -> list[int]:
    """The model's forward + backward in 1 process, then in ``k_max`` at once: how much compute
    slows down when the machine's other cores compute too (memory, caches). Each crowded rank
    writes its own times (seconds) to ``<out>.compute<rank>``; returns the process counts probed."""
    import torch.distributed as dist

    ks = sorted({1, k_max})
    model = None
    if rank < ks[-1]:
        model = build_on_meta(compute["model_fn"])
        materialize(model, [nm for nm, _ in model.named_parameters()] + [nm for nm, _ in model.named_buffers()],
                    seed=compute["seed"], device=torch.device("cpu"), init_fn=compute["init_fn"])
        model.train()
    samples = {k: [] for k in ks}
    for i in range(2 * reps + _WARMUP):  # a 2-vCPU VM's samples scatter by ~5 %: twice the reps
        for k in ks:
            dist.barrier()
            t0 = time.perf_counter()
            if rank < k:
                compute["loss_fn"](call_model(model, compute["inputs"]), compute["targets"]).backward()
                model.zero_grad(set_to_none=True)
            if i >= _WARMUP and rank < k:
                samples[k].append(time.perf_counter() - t0)
    if rank < ks[-1]:  # every crowded process's own times, for measure_host to average
        Path(f"{out}.compute{rank}").write_text(json.dumps({str(k): v for k, v in samples.items() if v}))
    return ks


def fit_alpha_beta(points: Sequence[tuple[float, float]], relative: bool = True) -> tuple[float, float]:
    """Least-squares ``time = alpha + x / beta`` over ``(x, time)`` points; alpha ≥ 0, beta > 0.
    ``relative``: minimise relative residuals (weights 1/time²), so that the small sizes fix the
    latency and the large ones the bandwidth, instead of the largest size deciding both."""
    ws = [1.0 / max(p[1], 1e-12) ** 2 if relative else 1.0 for p in points]
    sw = sum(ws)
    mx = sum(w * p[0] for w, p in zip(ws, points)) / sw
    my = sum(w * p[1] for w, p in zip(ws, points)) / sw
    var = sum(w * (p[0] - mx) ** 2 for w, p in zip(ws, points))
    slope = sum(w * (p[0] - mx) * (p[1] - my) for w, p in zip(ws, points)) / var if var > 0 else 0.0
    slope = max(slope, 1e-15)
    alpha = max(0.0, my - slope * mx)
    return alpha, 1.0 / slope


def crowded_share(probes: Sequence[tuple[int, int, float]], alpha: float, beta: float, cores: int) -> float:
    """The share ``u`` of a core an all-reduce participant keeps busy, from all-reduces with more
    participants than ``cores``: ``(n, bytes, seconds)`` probes. The model (the planner's) is the
    ring time stretched by the host's sharing, ``t = ring_allreduce_s(bytes, n, alpha, beta) ·
    u·n / cores`` (seconds; alpha in s, beta in bytes/s);
    least squares with absolute residuals, so that the large buckets, which gradients are, decide
    (the small ones are latency-bound and barely crowded). Raises ``ValueError`` without probes."""
    if not probes:
        raise ValueError("no crowded all-reduce probes (n > cores) to fit the CPU share from")
    xs = [ring_allreduce_s(b, n, alpha, beta) * n / cores for n, b, _ in probes]
    return sum(x * t for x, (_, _, t) in zip(xs, probes)) / sum(x * x for x in xs)


def paired_ratio(lone: Sequence[float], crowded: Sequence[float]) -> float:
    """``median(crowded[i] / lone[i])`` over interleaved samples (seconds) of a probe run by one
    process alone and by several at once, ``crowded[i]`` taken just after ``lone[i]``: paired, so
    that a machine whose speed drifts during the probe does not bias the ratio; the median drops
    outliers. Raises ``ValueError`` for no samples or lists of different lengths."""
    if not lone or len(lone) != len(crowded):
        raise ValueError(f"need as many crowded samples as lone ones (>= 1), got {len(lone)} lone and "
                         f"{len(crowded)} crowded")
    return statistics.median(b / a for a, b in zip(lone, crowded))


def crowded_mean(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Sample by sample, the mean over the processes that ran it at once (seconds): every one of
    them measured the crowded time. Not rank 0's alone: rank 0 also ran the lone sample just before
    and came out 1-4 points less crowded than its peer in 8 of 8 probe runs on the 2-vCPU testbed
    (compute_interference 0.008-0.035 from rank 0 against 0.027-0.064 from the mean). Raises
    ``ValueError`` for no processes or lists of different lengths."""
    if not per_rank or len({len(v) for v in per_rank}) != 1 or not per_rank[0]:
        raise ValueError(f"need samples of >= 1 process, all of one length >= 1; got lengths "
                         f"{[len(v) for v in per_rank]}")
    return [statistics.fmean(col) for col in zip(*per_rank)]


def compute_interference(lone: Sequence[float], crowded: Sequence[float], k: int) -> float:
    """How much slower compute runs per other busy core (≥ 0): ``(paired_ratio(lone, crowded) -
    1) / (k - 1)`` from samples of one process alone and of ``k`` processes at once.
    Raises ``ValueError`` for ``k < 2`` or unpaired samples."""
    if k < 2:
        raise ValueError(f"need k >= 2 processes at once to measure interference, got k={k}")
    return max(0.0, (paired_ratio(lone, crowded) - 1.0) / (k - 1))


def oversubscription(demand: float, cores: int) -> float:
    """How much slower work that needs ``demand`` cores in all runs on ``cores`` cores (≥ 1)."""
    return max(1.0, demand / cores) if cores > 0 else 1.0

def measure_host(world: int = 4, sizes: Sequence[int] = (4096, 1 << 20, 8 << 20, 32 << 20), reps: int = 9,
                 threads: int = 1, timeout_s: float = 120.0, opt_bytes: int = 0,
                 compute: dict | None = None, known: NetworkProfile | None = None) -> tuple[NetworkProfile, float, float]:
    """Measure p2p (the pipeline's ``Channel``), bucket all-reduce (flatten, ring all-reduce,
    scale, copy back, as the engine does) and, with ``opt_bytes``, the end-of-step memory
    contention between ``world`` local processes (gloo/NCCL); fit α–β models.

    The probes share this machine's cores. α–β come from the all-reduces with a core per
    participant; with more participants than cores an all-reduce is stretched by
    ``max(1, u·n / cores)``, ``u`` being the share of a core a participant keeps busy — read off
    those crowded probes when there are any, else its CPU time / wall time — and the planner
    applies the same sharing to its own placement.

    ``known``: this machine's network figures from an earlier measurement (``profiling.job``
    keeps them per host): the p2p, all-reduce and consensus probes are skipped and only the
    model's probes run, in ``k`` processes instead of ``world`` (none at all when ``k`` = 1);
    the returned profile is ``known`` with this model's samples.

    Returns ``(network, opt_parallelism, compute_interference)`` with ``k = min(world, cores)``
    processes at once (``cores`` = CPUs // ``threads``): ``k × t(1 process) / t(k processes)`` of
    AdamW steps over ``opt_bytes`` of parameters (``paired_ratio``; 0.0 without ``opt_bytes``), and
    how much slower the model's forward + backward runs per other busy core,
    ``(t(k processes) / t(1 process) - 1) / (k - 1)``, the ratio being the median over adjacent
    pairs of samples, a crowded sample's time the mean over its k processes (``crowded_mean``)
    (0.0 without ``compute`` or with k = 1; ``compute`` is a dict of
    picklable ``model_fn``, ``loss_fn``, ``init_fn``, ``seed``, ``inputs``, ``targets``).
    Raises ``WorkerFailure`` if a probe process fails or times out."""
    k_max = min(world, max(1, (os.cpu_count() or 1) // max(1, threads)))
    if known is not None and (k_max == 1 or (opt_bytes <= 0 and compute is None)):
        return known, (1.0 if opt_bytes > 0 else 0.0), 0.0   # nothing to contend with: as measured with k = 1
    procs = world if known is None else k_max
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "net.json"
        spawn_workers(_net_worker, procs, (str(out), list(sizes), reps, int(opt_bytes), compute, known is None),
                      timeout_s=timeout_s, threads_per_worker=threads, work_dir=d)
        res = json.loads(out.read_text())
        if res.get("compute_ks"):
            ks = res["compute_ks"]
            per_rank = [json.loads(Path(f"{out}.compute{r}").read_text()) for r in range(ks[-1])]
            res["compute_samples"] = [[k, crowded_mean([pr[str(k)] for pr in per_rank[:k]])] for k in ks]
            res["compute"] = [[k, statistics.median(v)] for k, v in res["compute_samples"]]
    if known is None:
        net = _fit_network(res, threads)
    else:
        model_part = {key: res[key] for key in MODEL_SAMPLES if key in res}
        net = replace(known, samples={**{key: v for key, v in known.samples.items() if key not in MODEL_SAMPLES},
                                      **model_part})
    return net, _opt_parallelism(res), _interference(res)


# the samples of ``_net_worker`` that belong to the model probed, not to the machine's network
MODEL_SAMPLES = ("opt", "opt_samples", "compute_ks", "compute_samples", "compute")


def _fit_network(res: dict, threads: int) -> NetworkProfile:
    """The ``NetworkProfile`` of ``_net_worker``'s samples (``res``): p2p and ring all-reduce α–β,
    the all-reduce's share of a core, consensus latency."""
    cores = max(1, int(res.get("cpu_count") or 1) // max(1, threads))
    p_alpha, p_beta = fit_alpha_beta([(row[0], row[1]) for row in res["p2p"]])
    # ring α–β from the all-reduces with a core per participant (absolute residuals: the large
    # buckets, which gradients are, decide the bandwidth); all of them if there are none
    ar = res["allreduce"]
    alone = [row for row in ar if row[0] <= cores] or ar
    ar_alpha, ar_beta = fit_alpha_beta([(b / n, t / (2 * (n - 1))) for n, b, t in alone], relative=False)
    # sharing: with more participants than cores, t = ring(n) · max(1, u·n / cores); u fitted to
    # those probes (buckets of >= 1 MiB) if any, else from the CPU time a participant used
    crowded = [(n, b, t) for n, b, t in ar if n > cores and b >= 1 << 20]
    if crowded:
        share = crowded_share(crowded, ar_alpha, ar_beta, cores)
    else:
        n_min = min(n for n, _, _ in res["ar_cpu"])
        share = max((row for row in res["ar_cpu"] if row[0] == n_min), key=lambda row: row[1])[2]
    share = min(1.0, max(0.05, share))
    return NetworkProfile(p2p_alpha_s=p_alpha, p2p_beta_Bps=p_beta, ar_alpha_s=ar_alpha, ar_beta_Bps=ar_beta,
                          consensus_s=res["consensus"][1], samples=res, ar_cpu_share=share)


def _opt_parallelism(res: dict) -> float:
    """``k × t(1) / t(k)`` of the optimizer probe's samples (0.0 when it did not run)."""
    if not res.get("opt"):
        return 0.0
    (k1, s1), (k, sk) = res["opt_samples"][0], res["opt_samples"][-1]
    return min(float(k), max(1.0, k / paired_ratio(s1, sk))) if k > k1 else float(k)


def _interference(res: dict) -> float:
    """``compute_interference`` of the compute probe's samples (0.0 when it did not run or k = 1)."""
    if not (res.get("compute") and len(res["compute"]) > 1):
        return 0.0
    (_, s1), (k, sk) = res["compute_samples"][0], res["compute_samples"][-1]
    return compute_interference(s1, sk, k)


def measure_network(world: int = 4, sizes: Sequence[int] = (4096, 1 << 20, 8 << 20, 32 << 20), reps: int = 9,
                    threads: int = 1, timeout_s: float = 120.0) -> NetworkProfile:
    """The network part of ``measure_host``: p2p and all-reduce α–β, consensus latency."""
    return measure_host(world, sizes, reps, threads, timeout_s)[0]


def compute_probe(model_fn, loss_fn, init_fn, seed: int, batch: tuple, precision: str) -> dict | None:
    """What the probe processes need to run the model (``measure_host(compute=...)``): ``batch``
    is ``(inputs, targets)`` of one micro-batch, copied to the CPU. Callables that plain pickle
    cannot carry to a spawned process (a lambda, a closure, anything defined in ``__main__`` — a
    notebook cell, a script — which a spawned process does not have) travel by value, as a job's
    own code does (``shipping.pack_objects`` / ``ByValue``: cloudpickle, versions and digest
    checked in the probe process before anything is unpickled). None (and a
    ``RuntimeWarning`` saying the compute interference is taken as 0) when even that fails, or
    when ``precision`` is not fp32 (the probe runs fp32 only)."""
    if precision != "fp32":
        return None
    fns = {"model_fn": model_fn, "loss_fn": loss_fn, "init_fn": init_fn}
    if not all(_by_reference(f) for f in fns.values()):
        try:
            fns = _by_value(fns)
        except TypeError as e:
            warnings.warn(f"calibration: the compute-interference probe cannot run this model in other processes "
                          f"({e}); compute_interference is taken as 0 (the planner then assumes stages on one "
                          "machine do not slow each other down)", RuntimeWarning, stacklevel=3)
            return None
    return {**fns, "seed": seed, "inputs": to_device(batch[0], "cpu"), "targets": to_device(batch[1], "cpu")}


def _by_reference(f) -> bool:
    """Whether a spawned process can load ``f`` by plain pickle: already shipped by value, or
    picklable without naming ``__main__`` (a spawned process has another one)."""
    if f is None or isinstance(f, ByValue):
        return True
    try:
        return b"__main__" not in pickle.dumps(f)
    except Exception:  # noqa: BLE001 - any pickling failure: not by reference
        return False


def _by_value(fns: dict) -> dict:
    """``fns`` as ``ByValue`` callables of one checked ``Shipped`` (raises ``TypeError`` naming one
    that cloudpickle cannot pack either)."""
    roles = {"model_fn": "factory", "loss_fn": "loss", "init_fn": "init"}
    digest, _ = pack_objects({roles[k]: v for k, v in fns.items()})
    shipped = find_objects(digest)
    return {k: (ByValue(shipped, roles[k]) if v is not None else None) for k, v in fns.items()}
