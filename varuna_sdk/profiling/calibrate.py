"""Scale-invariant calibration (paper §4.3): measure once, plan for any number of GPUs.

Owns ``calibrate``: on one device, every cut-point segment's forward (without and with grad),
backward time at a few micro-batch sizes, the bytes crossing each cut-point and the bytes
autograd saves; the engine's own costs, read off real steps of the engine at P=1 (per action,
end of step per parameter byte, fixed per step); and, in a few spawned processes sharing the
machine (``measure_host``), point-to-point α/β through the pipeline's ``Channel``, ring
all-reduce α/β of a gradient bucket as the engine reduces it, the share of a core an all-reduce
participant keeps busy, how many processes' end-of-step work the machine runs at full speed at
once, and how much compute slows down when the other cores compute too. Nothing here depends on
G, so it runs once per model and device; the planner maps it onto a placement (who shares which
cores). Segment times come from one forward with a timestamp at each cut-point crossing and one
backward with a gradient hook on each crossing tensor — a single pass measures every segment at
once. Everything is measured as the workers run: with freed memory retained
(``cluster.local.retain_freed_memory``), sizes and probes interleaved so that a machine whose
speed drifts shifts them alike, medians over repetitions.

Depends on ``model``, ``pipeline`` (to time the real engine) and ``cluster.local`` (to spawn
the probes); nothing depends on it except ``planner`` and the front ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
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
from ..model.inputs import as_inputs, call_model, to_device
from ..model.tracer import trace_model
from .profile import NetworkProfile, Profile, SegmentProfile, ring_allreduce_s

BatchFn = Callable[[int], tuple]  # micro_batch_size -> (inputs, targets)


class _Clock:
    """Cut-point observer: timestamps each crossing, tracks the current segment, optionally hooks
    the crossing tensors' gradients to timestamp the backward."""

    def __init__(self, hook_grads: bool = False):
        self.times: list[float] = []
        self.out_bytes: list[int] = []
        self.segment = 0
        self.hook_grads = hook_grads
        self.grad_times: dict[int, float] = {}
        self.first_crossing: tuple = ()  # the tensors crossing cut-point 0 (a stage's input)

    def at_cutpoint(self, tensors):
        self.times.append(time.perf_counter())
        self.out_bytes.append(sum(t.numel() * t.element_size() for t in tensors))
        k = self.segment
        self.segment += 1
        if k == 0:
            self.first_crossing = tuple(tensors)
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
                   device: torch.device, autocast, count_saved: bool = False,
                   segment_of: dict[int, int] | None = None) -> dict[str, list[float] | list[int]]:
    """One forward without grad, one with grad and its backward, timed per segment.
    ``count_saved``: also attribute the bytes autograd saves to segments (``act_bytes``) — a
    hook on every saved tensor, which slows the forward: use it on an untimed pass.
    ``segment_of`` (``id(parameter) -> segment``): also one forward and the backward split into
    B and W (``bwd_in_s``, ``wgt_s``; see ``_time_split_backward``)."""
    out: dict = {}
    # forward without grad (first forward of a recomputing stage)
    clock = _Clock()
    with torch.no_grad(), observe_cutpoints(clock), autocast():
        _sync(device)
        t0 = time.perf_counter()
        loss_fn(call_model(model, inputs), targets)
        _sync(device)
        out["fwd_s"] = _diffs(t0, clock.times, time.perf_counter())
    out["out_bytes"] = clock.out_bytes + [0]
    # forward with grad (= recompute) and backward, optionally with saved-tensor accounting
    clock = _Clock(hook_grads=True)
    saved = _SavedBytes(clock, n)
    hooks = (torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack) if count_saved
             else contextlib.nullcontext())
    with observe_cutpoints(clock), hooks, autocast():
        _sync(device)
        t0 = time.perf_counter()
        loss = loss_fn(call_model(model, inputs), targets)
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
    if segment_of is not None:
        out.update(_time_split_backward(model, loss_fn, inputs, targets, n, device, autocast, segment_of))
    return out


def _time_split_backward(model: nn.Module, loss_fn, inputs: tuple, targets, n: int, device: torch.device,
                         autocast, segment_of: dict[int, int]) -> dict[str, list[float]]:
    """The backward split as the engine runs it (``pipeline.split_backward``), timed per segment:
    ``bwd_in_s`` — B, the input gradient from the loss down to cut-point 0, one segment per
    crossing (segment 0 has none: it always sits on the first stage, whose B is empty), the time
    spent reading the autograd graph before it shared among the segments in proportion to their
    backward (a stage reads only its own part); ``wgt_s`` — W, each weight group's time given to
    the first segment using its weights (the group of segment 0's weights runs segment 0's whole
    backward, and a weight used twice, as a tied embedding and LM head in one graph, repeats the
    path between its uses, which stages split apart do not). ``segment_of``: ``id(parameter) ->
    segment of its first use``."""
    from ..pipeline.split_backward import backward_input

    clock = _Clock(hook_grads=True)
    with observe_cutpoints(clock), autocast():
        loss = loss_fn(call_model(model, inputs), targets)
    first = [t for t in clock.first_crossing if t.requires_grad]
    _sync(device)
    tb0 = time.perf_counter()
    timing: dict[str, float] = {}
    _, work = backward_input([loss], [None], first, [p for p in model.parameters() if p.requires_grad], timing)
    _sync(device)
    tb1 = time.perf_counter()
    analysis = timing.get("analysis_s", 0.0)
    marks = [clock.grad_times.get(k, tb0) for k in range(n - 2, 0, -1)]  # crossings n-2 .. 1
    bwd_in = [0.0] + list(reversed(_diffs(tb0 + analysis, marks, tb1))) if n > 1 else [0.0]
    total = sum(bwd_in[1:])
    if total > 0:
        bwd_in = [0.0] + [b + analysis * b / total for b in bwd_in[1:]]
    wgt = [0.0] * n

    def charge(weights: list[torch.Tensor], seconds: float) -> None:
        wgt[min(segment_of.get(id(w), 0) for w in weights)] += seconds

    work.run(on_group=charge, sync=lambda: _sync(device))
    model.zero_grad(set_to_none=True)
    return {"bwd_in_s": bwd_in, "wgt_s": wgt}


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
    repeats: int = 9,
    warmup: int = 3,
    network: bool = True,
    threads: int = 1,
    device: str | torch.device = "cpu",
    model_info: dict | None = None,
    grad_clip: float | None = 1.0,
) -> Profile:
    """Measure a model once (paper §4.3) and return a ``Profile``.

    Args:
        model_fn: builds the whole model with cut-points (called on meta, then materialised).
        loss_fn: ``(output, targets) -> scalar``.
        make_batch: ``micro_batch_size -> (inputs, targets)``: real data of that many examples
            (inputs a tuple or a mapping of tensors, targets a tensor, any nesting, or None).
        micro_batch_sizes: sizes to measure (≥ 2 sizes lets the planner interpolate).
        repeats, warmup: timed and untimed passes per size (medians are kept).
        network: also measure p2p and all-reduce in spawned processes (needed for P or D > 1).
        threads: torch intra-op threads, as each worker will use.
        grad_clip: the clipping the job will use (``TrainConfig.grad_clip``; its pass over the
            gradients is part of the end-of-step cost).

    Raises ``ValueError`` for an empty or non-positive size list. Units: seconds and bytes.
    """
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"micro_batch_sizes={list(micro_batch_sizes)} must be positive integers")
    from ..cluster.local import retained_memory

    t_start = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    device = torch.device(device)
    # as in every worker process: memory freed by torch is reused, not faulted in afresh
    with retained_memory():
        try:
            meta_model = build_on_meta(model_fn)
            inputs0, _ = make_batch(sizes[0])
            structure = trace_model(meta_model, as_inputs(inputs0), device)
            n = structure.num_segments
            model = build_on_meta(model_fn)
            materialize(model, [nm for nm, _ in model.named_parameters()] + [nm for nm, _ in model.named_buffers()],
                        seed=seed, device=device, init_fn=init_fn)
            model.train()
            autocast = (contextlib.nullcontext if precision == "fp32" else
                        lambda: torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16))
            batches = {}
            for b in sizes:
                inputs, targets = make_batch(b)
                batches[b] = (to_device(as_inputs(inputs), device), to_device(targets, device))
            # rounds over the sizes (not one size after the other), so that a machine that speeds
            # up or slows down meanwhile shifts every size alike; half the timed rounds before the
            # host probes and half after, so that the medians span the whole calibration (a VM's
            # speed drifts over tens of seconds) instead of a few seconds of it
            saved = {b: _time_segments(model, loss_fn, *batches[b], n, device, autocast, count_saved=True)["act_bytes"]
                     for b in sizes}  # untimed: the accounting hooks slow the forward
            runs: dict[int, list[dict]] = {b: [] for b in sizes}
            segment_of = {id(q): min(structure.state_segments[nm]) for nm, q in model.named_parameters()
                          if nm in structure.state_segments}

            def probe_host():
                return _probe_host(model_fn, loss_fn, init_fn, seed, batches[sizes[len(sizes) // 2]], precision,
                                   device, threads, sum(structure.segment_param_bytes))

            host = None
            for i in range(warmup + repeats):
                if network and host is None and i == warmup + (repeats + 1) // 2:
                    host = probe_host()
                    for b in sizes:  # untimed: caches and heap back after the probe processes
                        _time_segments(model, loss_fn, *batches[b], n, device, autocast)
                for b in sizes:
                    r = _time_segments(model, loss_fn, *batches[b], n, device, autocast, segment_of=segment_of)
                    if i >= warmup:
                        runs[b].append(r)
            per_size: dict[str, list[list]] = {k: [] for k in ("fwd_s", "rec_s", "bwd_s", "out_bytes", "act_bytes",
                                                               "bwd_in_s", "wgt_s")}
            for b in sizes:
                for key in ("fwd_s", "rec_s", "bwd_s", "bwd_in_s", "wgt_s"):
                    per_size[key].append(_median_lists([r[key] for r in runs[b]]))
                per_size["out_bytes"].append(runs[b][-1]["out_bytes"])
                per_size["act_bytes"].append(saved[b])
            segments = [
                SegmentProfile(**{k: [per_size[k][j][i] for j in range(len(sizes))] for k in per_size},
                               param_bytes=int(structure.segment_param_bytes[i]))
                for i in range(n)
            ]
            params_bytes = {nm: q.numel() * q.element_size() for nm, q in model.named_parameters()}
            b0 = sizes[0]

            def segment_compute() -> float:  # Σ(rec + bwd) of one pass at b0, for a paired difference
                r = _time_segments(model, loss_fn, *batches[b0], n, device, autocast)
                return sum(r["rec_s"]) + sum(r["bwd_s"])

            costs = _engine_costs(model_fn, loss_fn, make_batch, b0, segment_compute, structure, seed, init_fn,
                                  precision, device, warmup, repeats, grad_clip)
            del model
        finally:
            torch.set_num_threads(old_threads)
    net, opt_par, interference = None, 0.0, 0.0
    if network:
        net, opt_par, interference = host or probe_host()
    return Profile(
        model={"num_segments": n, "param_bytes": sum(structure.segment_param_bytes),
               "crossings": [[c["dtype"] for c in cr] for cr in structure.crossings],
               "shared": _shared(structure, params_bytes), **(model_info or {})},
        hardware=_hardware(device, threads),
        software={"torch": torch.__version__, "python": platform.python_version(), "varuna_sdk": _version()},
        micro_batch_sizes=sizes, segments=segments, network=net, per_action_s=costs["per_action_s"],
        per_step_s=costs["per_step_s"], opt_s_per_param_byte=costs["opt_s_per_param_byte"],
        opt_parallelism=opt_par, compute_interference=interference, calibration_s=time.perf_counter() - t_start,
        calibrated_at=time.time(),
    )


def _probe_host(model_fn, loss_fn, init_fn, seed: int, batch: tuple, precision: str, device: torch.device,
                threads: int, opt_bytes: int) -> tuple[NetworkProfile, float, float]:
    """``measure_host`` for this model: the compute probe only for fp32 on CPU."""
    probe = _compute_probe(model_fn, loss_fn, init_fn, seed, batch, precision) if device.type == "cpu" else None
    return measure_host(threads=threads, opt_bytes=opt_bytes, compute=probe)


def _engine_costs(model_fn, loss_fn, make_batch, b: int, segment_compute: Callable[[], float], structure, seed,
                  init_fn, precision, device, warmup: int, repeats: int, grad_clip: float | None,
                  m: int = 4) -> dict[str, float]:
    """The engine's own costs, read off real steps of ``Varuna`` at P=1, D=1 with ``m``
    micro-batches of size ``b`` (measured, not fitted: the step reports each action's time):

    * ``per_action_s``: what an F or B action costs beyond its segments' compute (scheduler,
      RNG fork, cut-point bookkeeping, gradient accumulation), ``(F + B - m·Σ(rec + bwd)) / 2m``,
      each step paired with a segment pass (``segment_compute()``) run just before it;
    * ``opt_s_per_param_byte``: the end of the step (gradient norm, clipping, optimizer step;
      no collective runs at P=D=1) per parameter byte;
    * ``per_step_s``: the rest of the step (batch split, receivers, schedule set-up).
    """
    from ..pipeline.engine import Varuna

    inputs, targets = make_batch(b)
    par = ParallelConfig(P=1, D=1, global_batch=b * m, micro_batch_size=b, recompute=False)
    eng = Varuna(model_fn, loss_fn, par, as_inputs(inputs), seed=seed, init_fn=init_fn, precision=precision,
                 device=device, structure=structure, grad_clip=grad_clip)
    opt = torch.optim.AdamW(eng.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sync_s: list[float] = []
    sync = eng._sync_and_step

    def timed_sync(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return sync(*args, **kwargs)
        finally:
            sync_s.append(time.perf_counter() - t0)

    eng._sync_and_step = timed_sync  # this instance only: the end-of-step phase, timed
    batch = (to_device(_repeat_rows(as_inputs(inputs), m), device), to_device(_repeat_rows(targets, m), device))
    action, end, rest = [], [], []
    for i in range(warmup + repeats):
        compute = segment_compute()
        r = eng.step(batch, opt)
        if i >= warmup:
            acts = r.compute_s["F"] + r.compute_s["B"]
            action.append((acts - m * compute) / (2 * m))
            end.append(sync_s[-1])
            rest.append(r.time_s - acts - sync_s[-1])
    pbytes = max(1, sum(structure.segment_param_bytes))
    return {"per_action_s": max(0.0, statistics.median(action)),
            "opt_s_per_param_byte": statistics.median(end) / pbytes,
            "per_step_s": max(0.0, statistics.median(rest))}


def _repeat_rows(obj, m: int):
    """Every tensor leaf of ``obj`` repeated ``m`` times along the batch dimension."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: torch.cat([t] * m) if isinstance(t, torch.Tensor) else t, obj)


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
                compute: dict | None = None) -> None:
    import torch.distributed as dist

    from ..pipeline.comm import Channel

    cores = os.cpu_count() or 1
    res: dict[str, list] = {"p2p": [], "allreduce": [], "ar_cpu": [], "consensus": [], "opt": [], "cpu_count": cores}
    # processes that run at once on their own cores, each with this process's torch threads
    # (measure_host divides cpu_count by the threads the same way)
    k_max = min(world, max(1, cores // max(1, torch.get_num_threads())))
    pair = dist.new_group([0, 1])
    # p2p as the pipeline sends: a Channel (header + tensors, own two-rank communicator per direction)
    fwd_g, bwd_g = dist.new_group([0, 1]), dist.new_group([0, 1])
    dev = torch.device("cpu")
    if rank < 2:
        there = Channel(1 - rank, fwd_g if rank == 0 else bwd_g, dev)
        back = Channel(1 - rank, bwd_g if rank == 0 else fwd_g, dev)
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        samples = []
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
                samples.append((time.perf_counter() - t0) / 2)
        res["p2p"].append([nbytes, statistics.median(samples)])
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
    small = torch.zeros(3)
    samples = []
    for i in range(reps * 3 + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(small)
        if i:
            samples.append(time.perf_counter() - t0)
    res["consensus"] = [world, statistics.median(samples)]
    if opt_bytes > 0:
        # the end of a step is memory-bound passes over the parameters (norm, clip, AdamW): its
        # time with 1 process, then with one per core at once (all ranks step together)
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
        res["opt"] = [[k, statistics.median(samples[k])] for k in ks]
        res["opt_samples"] = [[k, samples[k]] for k in ks]
    if compute is not None:
        # the model's forward + backward in 1 process, then in one per core at once: how much
        # compute slows down when the machine's other cores compute too (memory, caches)
        ks = sorted({1, k_max})
        model = None
        if rank < ks[-1]:
            model = build_on_meta(compute["model_fn"])
            materialize(model, [nm for nm, _ in model.named_parameters()] + [nm for nm, _ in model.named_buffers()],
                        seed=compute["seed"], device=dev, init_fn=compute["init_fn"])
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
        res["compute_ks"] = ks  # process counts probed: 1, then k
    # every rank waits for the last sample: a rank that left early would tear its process down
    # (a core's worth of work for ~1 s) while ranks < k still time their last crowded probe,
    # which made that sample up to 60 % slower and moved compute_interference by up to 0.05
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(res))


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
                 compute: dict | None = None) -> tuple[NetworkProfile, float, float]:
    """Measure p2p (the pipeline's ``Channel``), bucket all-reduce (flatten, ring all-reduce,
    scale, copy back, as the engine does) and, with ``opt_bytes``, the end-of-step memory
    contention between ``world`` local processes (gloo/NCCL); fit α–β models.

    The probes share this machine's cores. α–β come from the all-reduces with a core per
    participant; with more participants than cores an all-reduce is stretched by
    ``max(1, u·n / cores)``, ``u`` being the share of a core a participant keeps busy — read off
    those crowded probes when there are any, else its CPU time / wall time — and the planner
    applies the same sharing to its own placement.

    Returns ``(network, opt_parallelism, compute_interference)`` with ``k = min(world, cores)``
    processes at once (``cores`` = CPUs // ``threads``): ``k × t(1 process) / t(k processes)`` of
    AdamW steps over ``opt_bytes`` of parameters (``paired_ratio``; 0.0 without ``opt_bytes``), and
    how much slower the model's forward + backward runs per other busy core,
    ``(t(k processes) / t(1 process) - 1) / (k - 1)``, the ratio being the median over adjacent
    pairs of samples, a crowded sample's time the mean over its k processes (``crowded_mean``)
    (0.0 without ``compute`` or with k = 1; ``compute`` is a dict of
    picklable ``model_fn``, ``loss_fn``, ``init_fn``, ``seed``, ``inputs``, ``targets``).
    Raises ``WorkerFailure`` if a probe process fails or times out."""
    from ..cluster.local import spawn_workers

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "net.json"
        spawn_workers(_net_worker, world, (str(out), list(sizes), reps, int(opt_bytes), compute),
                      timeout_s=timeout_s, threads_per_worker=threads, work_dir=d)
        res = json.loads(out.read_text())
        if res.get("compute_ks"):
            ks = res["compute_ks"]
            per_rank = [json.loads(Path(f"{out}.compute{r}").read_text()) for r in range(ks[-1])]
            res["compute_samples"] = [[k, crowded_mean([pr[str(k)] for pr in per_rank[:k]])] for k in ks]
            res["compute"] = [[k, statistics.median(v)] for k, v in res["compute_samples"]]
    cores = max(1, int(res.get("cpu_count") or 1) // max(1, threads))
    p_alpha, p_beta = fit_alpha_beta([(b, t) for b, t in res["p2p"]])
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
    opt_par = 0.0
    if res.get("opt"):
        (k1, s1), (k, sk) = res["opt_samples"][0], res["opt_samples"][-1]
        opt_par = min(float(k), max(1.0, k / paired_ratio(s1, sk))) if k > k1 else float(k)
    interference = 0.0
    if res.get("compute") and len(res["compute"]) > 1:
        (_, s1), (k, sk) = res["compute_samples"][0], res["compute_samples"][-1]
        interference = compute_interference(s1, sk, k)
    net = NetworkProfile(p2p_alpha_s=p_alpha, p2p_beta_Bps=p_beta, ar_alpha_s=ar_alpha, ar_beta_Bps=ar_beta,
                         consensus_s=res["consensus"][1], samples=res, ar_cpu_share=share)
    return net, opt_par, interference


def measure_network(world: int = 4, sizes: Sequence[int] = (4096, 1 << 20, 8 << 20, 32 << 20), reps: int = 9,
                    threads: int = 1, timeout_s: float = 120.0) -> NetworkProfile:
    """The network part of ``measure_host``: p2p and all-reduce α–β, consensus latency."""
    return measure_host(world, sizes, reps, threads, timeout_s)[0]


def _compute_probe(model_fn, loss_fn, init_fn, seed: int, batch: tuple, precision: str) -> dict | None:
    """What the probe processes need to run the model (``measure_host(compute=...)``), or None
    when it cannot travel to them (a lambda or closure: not picklable) or is not fp32 on CPU."""
    if precision != "fp32":
        return None
    probe = {"model_fn": model_fn, "loss_fn": loss_fn, "init_fn": init_fn, "seed": seed,
             "inputs": to_device(batch[0], "cpu"), "targets": to_device(batch[1], "cpu")}
    try:
        pickle.dumps({k: v for k, v in probe.items() if k not in ("inputs", "targets")})
    except Exception:  # noqa: BLE001 - any pickling failure means: no compute probe
        return None
    return probe
