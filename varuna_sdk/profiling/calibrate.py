"""Scale-invariant calibration (paper §4.3): measure once, plan for any number of GPUs.

Owns ``calibrate``: on one device, every cut-point segment's forward (without and with grad),
backward time at a few micro-batch sizes, the bytes crossing each cut-point and
the bytes autograd saves; the engine's fixed costs (per action, per parameter byte of optimizer
step); and, in a few spawned processes, point-to-point α/β and ring all-reduce α/β. Nothing
here depends on G, so it runs once per model and device. Segment times come from one forward
with a timestamp at each cut-point crossing and one backward with a gradient hook on each
crossing tensor — a single pass measures every segment at once.

Depends on ``model``, ``pipeline`` (to time the real engine) and ``cluster.local`` (to spawn
the network probes); nothing depends on it except ``planner`` and the front ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..config import ParallelConfig
from ..model.cutpoint import observe_cutpoints
from ..model.materialize import build_on_meta, materialize
from ..model.tracer import trace_model
from .profile import NetworkProfile, Profile, SegmentProfile

BatchFn = Callable[[int], tuple]  # micro_batch_size -> (inputs tuple, targets)


class _Clock:
    """Cut-point observer: timestamps each crossing, tracks the current segment, optionally hooks
    the crossing tensors' gradients to timestamp the backward."""

    def __init__(self, hook_grads: bool = False):
        self.times: list[float] = []
        self.out_bytes: list[int] = []
        self.segment = 0
        self.hook_grads = hook_grads
        self.grad_times: dict[int, float] = {}

    def at_cutpoint(self, tensors):
        self.times.append(time.perf_counter())
        self.out_bytes.append(sum(t.numel() * t.element_size() for t in tensors))
        k = self.segment
        self.segment += 1
        if self.hook_grads:
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(self._mark(k))
        return tensors

    def _mark(self, k: int):
        def hook(grad):
            self.grad_times[k] = max(self.grad_times.get(k, 0.0), time.perf_counter())
            return grad
        return hook


class _SavedBytes:
    """Bytes autograd saves for backward, attributed to the segment running at the time."""

    def __init__(self, clock: _Clock, n: int):
        self.clock, self.bytes = clock, [0] * n
        self.seen: set[int] = set()

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        if key not in self.seen:
            self.seen.add(key)
            self.bytes[min(self.clock.segment, len(self.bytes) - 1)] += t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t


def _diffs(t0: float, marks: Sequence[float], t1: float) -> list[float]:
    pts = [t0, *marks, t1]
    return [max(0.0, b - a) for a, b in zip(pts, pts[1:])]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_segments(model: nn.Module, loss_fn, inputs: tuple, targets, n: int,
                   device: torch.device, autocast) -> dict[str, list[float] | list[int]]:
    out: dict = {}
    # forward without grad (first forward of a recomputing stage)
    clock = _Clock()
    with torch.no_grad(), observe_cutpoints(clock), autocast():
        _sync(device)
        t0 = time.perf_counter()
        loss_fn(model(*inputs), targets)
        _sync(device)
        out["fwd_s"] = _diffs(t0, clock.times, time.perf_counter())
    out["out_bytes"] = clock.out_bytes + [0]
    # forward with grad (= recompute) and backward, with saved-tensor accounting
    clock = _Clock(hook_grads=True)
    saved = _SavedBytes(clock, n)
    with observe_cutpoints(clock), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), autocast():
        _sync(device)
        t0 = time.perf_counter()
        loss = loss_fn(model(*inputs), targets)
        _sync(device)
        t1 = time.perf_counter()
    out["rec_s"] = _diffs(t0, clock.times, t1)
    out["act_bytes"] = saved.bytes
    tb0 = time.perf_counter()
    loss.backward()
    _sync(device)
    tb1 = time.perf_counter()
    marks = [clock.grad_times.get(k, tb0) for k in range(n - 2, -1, -1)]  # backward runs last → first
    bwd_rev = _diffs(tb0, marks, tb1)
    out["bwd_s"] = list(reversed(bwd_rev))
    model.zero_grad(set_to_none=True)
    return out


def _median_lists(runs: list[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*runs)]


def calibrate(
    model_fn: Callable[[], nn.Module],
    loss_fn: Callable,
    make_batch: BatchFn,
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    *,
    seed: int = 0,
    init_fn: Callable[[nn.Module, str], None] | None = None,
    precision: str = "fp32",
    repeats: int = 5,
    warmup: int = 2,
    network: bool = True,
    threads: int = 1,
    device: str | torch.device = "cpu",
    model_info: dict | None = None,
) -> Profile:
    """Measure a model once (paper §4.3) and return a ``Profile``.

    Args:
        model_fn: builds the whole model with cut-points (called on meta, then materialised).
        loss_fn: ``(output, targets) -> scalar``.
        make_batch: ``micro_batch_size -> (inputs tuple, targets)`` with real data shapes.
        micro_batch_sizes: sizes to measure (≥ 2 sizes lets the planner interpolate).
        repeats, warmup: timed and untimed passes per size (medians are kept).
        network: also measure p2p and all-reduce in spawned processes (needed for P or D > 1).
        threads: torch intra-op threads, as each worker will use.

    Raises ``ValueError`` for an empty or non-positive size list. Units: seconds and bytes.
    """
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"micro_batch_sizes={list(micro_batch_sizes)} must be positive integers")
    t_start = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    device = torch.device(device)
    try:
        meta_model = build_on_meta(model_fn)
        inputs0, _ = make_batch(sizes[0])
        structure = trace_model(meta_model, tuple(inputs0))
        n = structure.num_segments
        model = build_on_meta(model_fn)
        materialize(model, [nm for nm, _ in model.named_parameters()] + [nm for nm, _ in model.named_buffers()],
                    seed=seed, device=device, init_fn=init_fn)
        model.train()
        autocast = (contextlib.nullcontext if precision == "fp32" else
                    lambda: torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16))
        per_size: dict[str, list[list]] = {k: [] for k in ("fwd_s", "rec_s", "bwd_s", "out_bytes", "act_bytes")}
        for b in sizes:
            inputs, targets = make_batch(b)
            inputs = tuple(t.to(device) for t in inputs)
            targets = targets.to(device)
            runs = [_time_segments(model, loss_fn, inputs, targets, n, device, autocast)
                    for _ in range(warmup + repeats)][warmup:]
            for key in ("fwd_s", "rec_s", "bwd_s"):
                per_size[key].append(_median_lists([r[key] for r in runs]))
            per_size["out_bytes"].append(runs[-1]["out_bytes"])
            per_size["act_bytes"].append(runs[-1]["act_bytes"])
        segments = [
            SegmentProfile(**{k: [per_size[k][j][i] for j in range(len(sizes))] for k in per_size},
                           param_bytes=int(structure.segment_param_bytes[i]))
            for i in range(n)
        ]
        per_action, opt_per_byte = _engine_costs(model_fn, loss_fn, make_batch, sizes[0], segments, structure,
                                                 seed, init_fn, precision, device, repeats)
        params_bytes = {nm: q.numel() * q.element_size() for nm, q in model.named_parameters()}
        del model
    finally:
        torch.set_num_threads(old_threads)
    net = measure_network(threads=threads) if network else None
    return Profile(
        model={"num_segments": n, "param_bytes": sum(structure.segment_param_bytes),
               "crossings": [[c["dtype"] for c in cr] for cr in structure.crossings],
               "shared": _shared(structure, params_bytes), **(model_info or {})},
        hardware=_hardware(device, threads),
        software={"torch": torch.__version__, "python": platform.python_version(), "varuna_sdk": _version()},
        micro_batch_sizes=sizes, segments=segments, network=net, per_action_s=per_action, per_step_s=0.0,
        opt_s_per_param_byte=opt_per_byte, calibration_s=time.perf_counter() - t_start,
    )


def _engine_costs(model_fn, loss_fn, make_batch, b: int, segments, structure, seed, init_fn, precision, device,
                  repeats: int) -> tuple[float, float]:
    """Fit the engine's own costs from real steps at P=1: step(m) = c0 + m·(Σ compute + 2a)."""
    from ..pipeline.engine import Varuna

    inputs, targets = make_batch(b)
    times = {}
    for m in (1, 4):
        par = ParallelConfig(P=1, D=1, global_batch=b * m, micro_batch_size=b, recompute=False)
        eng = Varuna(model_fn, loss_fn, par, tuple(inputs), seed=seed, init_fn=init_fn, precision=precision,
                     device=device, structure=structure)
        opt = torch.optim.AdamW(eng.parameters(), lr=1e-4)
        batch = (tuple(torch.cat([t] * m) for t in inputs), torch.cat([targets] * m))
        samples = []
        for i in range(2 + repeats):
            r = eng.step(batch, opt)
            if i >= 2:
                samples.append(r.time_s)
        times[m] = statistics.median(samples)
    compute = sum(s.rec_s[0] + s.bwd_s[0] for s in segments)
    a = max(0.0, ((times[4] - times[1]) / 3 - compute) / 2)
    c0 = max(0.0, times[1] - compute - 2 * a)
    pbytes = max(1, sum(s.param_bytes for s in segments))
    return a, c0 / pbytes


def _shared(structure, params_bytes: dict[str, int]) -> list[dict]:
    """Parameters used by more than one segment (tied weights): name, bytes, segments."""
    return [{"name": nm, "bytes": params_bytes.get(nm, 0), "segments": segs}
            for nm, segs in structure.state_segments.items() if len(segs) > 1 and nm in params_bytes]


def _hardware(device: torch.device, threads: int) -> dict:
    """Device name, cores, threads; ``memory_bytes`` (the planner's default limit) on a GPU."""
    hw = {"device": _device_name(device), "cpu_count": os.cpu_count(), "threads": threads,
          "machine": platform.machine()}
    if device.type == "cuda":
        hw["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    else:
        try:
            hw["host_memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            pass
    return hw


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _version() -> str:
    from .. import __version__

    return __version__


# ---- network --------------------------------------------------------------------------------
def _net_worker(rank: int, world: int, out: str, sizes: list[int], reps: int) -> None:
    import torch.distributed as dist

    res: dict[str, list] = {"p2p": [], "allreduce": [], "consensus": []}
    pair = dist.new_group([0, 1])
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        samples = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1, group=pair)
                dist.recv(t, 1, group=pair)
            elif rank == 1:
                dist.recv(t, 0, group=pair)
                dist.send(t, 0, group=pair)
            if i:
                samples.append((time.perf_counter() - t0) / 2)
        res["p2p"].append([nbytes, statistics.median(samples)])
    groups = {2: pair, world: None} if world > 2 else {2: pair}
    for n, grp in groups.items():
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4))
            samples = []
            for i in range(reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if rank < n:
                    dist.all_reduce(t, group=grp)
                if i:
                    samples.append(time.perf_counter() - t0)
            res["allreduce"].append([n, nbytes, statistics.median(samples)])
    small = torch.zeros(3)
    samples = []
    for i in range(reps * 3 + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(small)
        if i:
            samples.append(time.perf_counter() - t0)
    res["consensus"] = [world, statistics.median(samples)]
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``time = alpha + x / beta`` over ``(x, time)`` points; alpha ≥ 0, beta > 0."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 1e-15)
    alpha = max(0.0, my - slope * mx)
    return alpha, 1.0 / slope


def measure_network(world: int = 4, sizes: Sequence[int] = (4096, 262144, 4 << 20), reps: int = 5,
                    threads: int = 1, timeout_s: float = 120.0) -> NetworkProfile:
    """Measure p2p and ring all-reduce between ``world`` local processes (gloo/NCCL) and fit α–β
    models. Raises ``WorkerFailure`` if a probe process fails or times out."""
    from ..cluster.local import spawn_workers

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "net.json"
        spawn_workers(_net_worker, world, (str(out), list(sizes), reps), timeout_s=timeout_s,
                      threads_per_worker=threads, work_dir=d)
        res = json.loads(out.read_text())
    p_alpha, p_beta = fit_alpha_beta([(b, t) for b, t in res["p2p"]])
    # ring: t = 2(n-1)·α + 2(n-1)/n · bytes/β  → regress t/(2(n-1)) on bytes/n
    ar_alpha, ar_beta = fit_alpha_beta([(b / n, t / (2 * (n - 1))) for n, b, t in res["allreduce"]])
    return NetworkProfile(p2p_alpha_s=p_alpha, p2p_beta_Bps=p_beta, ar_alpha_s=ar_alpha, ar_beta_Bps=ar_beta,
                          consensus_s=res["consensus"][1], samples=res)
