"""Scale-invariant calibration (paper §4.3): measure once, plan for any number of GPUs.

Owns ``calibrate``: on one device, every cut-point segment's forward (without and with grad),
backward time at a few micro-batch sizes, the bytes crossing each cut-point and the bytes
autograd saves; and the engine's own costs, read off real steps of the engine at P=1 (per action,
end of step per parameter byte, fixed per step). The network and the machine's shared cores are
measured by the host probes of ``profiling.network`` (``measure_host``). Nothing here depends on
G, so it runs once per model and device; the planner maps it onto a placement (who shares which
cores). Segment times come from one forward with a timestamp at each cut-point crossing and one
backward with a gradient hook on each crossing tensor — a single pass measures every segment at
once. Everything is measured as the workers run: with freed memory retained
(``pipeline.spawn.retain_freed_memory``), sizes and probes interleaved so that a machine whose
speed drifts shifts them alike, medians over repetitions.

Depends on ``model``, ``pipeline`` (to time the real engine, and to retain freed memory as the
workers do) and ``profiling.network``; must never import ``cluster``, ``planner``, ``trainer`` or
``manager``. Nothing depends on it except ``profiling.job``, ``planner`` and the front ends.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from ..config import ParallelConfig
from ..model.cutpoint import observe_cutpoints
from ..model.materialize import build_on_meta, materialize
from ..model.partition import unsplittable_cuts
from ..model.inputs import as_inputs, call_model, to_device
from ..model.tracer import loss_after, trace_model
from ..pipeline.spawn import retained_memory
from .network import compute_probe, measure_host
from .profile import NetworkProfile, Profile, SegmentProfile

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


class _Bench:
    """The materialised model and one real micro-batch per size, on ``device``, for timing passes."""

    def __init__(self, model: nn.Module, loss_fn, batches: dict[int, tuple], n: int, device: torch.device,
                 precision: str):
        self.model, self.loss_fn, self.batches, self.n, self.device = model, loss_fn, batches, n, device
        self.autocast = (contextlib.nullcontext if precision == "fp32" else
                         lambda: torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16))

    def time(self, b: int, **kwargs) -> dict:
        """``_time_segments`` of micro-batch size ``b`` (seconds and bytes per segment)."""
        return _time_segments(self.model, self.loss_fn, *self.batches[b], self.n, self.device, self.autocast, **kwargs)


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
    network: bool | NetworkProfile = True,
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
        network: also measure p2p and all-reduce in spawned processes (needed for P or D > 1);
            a ``NetworkProfile``: this machine's network as measured before (the per-host cache
            of ``profiling.job``), so only the model's own host probes run (optimizer and compute
            contention between processes).
        threads: torch intra-op threads, as each worker will use.
        grad_clip: the clipping the job will use (``TrainConfig.grad_clip``; its pass over the
            gradients is part of the end-of-step cost).

    Raises ``ValueError`` for an empty or non-positive size list. Units: seconds and bytes.
    """
    known = network if isinstance(network, NetworkProfile) else None
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"micro_batch_sizes={list(micro_batch_sizes)} must be positive integers")
    t_start = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    device = torch.device(device)
    # as in every worker process: memory freed by torch is reused, not faulted in afresh
    with retained_memory():
        try:
            structure, bench = _bench(model_fn, loss_fn, make_batch, sizes, seed, init_fn, precision, device)
            mid = bench.batches[sizes[len(sizes) // 2]]

            def probe_host():
                return _probe_host(model_fn, loss_fn, init_fn, seed, mid, precision, device, threads,
                                   sum(structure.segment_param_bytes), known)

            segments, host = _measure_segments(bench, sizes, structure, warmup, repeats,
                                               probe_host if network else None)
            params_bytes = {nm: q.numel() * q.element_size() for nm, q in bench.model.named_parameters()}
            b0 = sizes[0]
            costs = _engine_costs(model_fn, loss_fn, make_batch, b0, structure, seed, init_fn, precision, device,
                                  warmup, repeats, grad_clip)
            del bench
        finally:
            torch.set_num_threads(old_threads)
    net, opt_par, interference = None, 0.0, 0.0
    if network:
        net, opt_par, interference = host or probe_host()
    return Profile(
        model={"num_segments": structure.num_segments, "param_bytes": sum(structure.segment_param_bytes),
               "crossings": [[c["dtype"] for c in cr] for cr in structure.crossings],
               "shared": _shared(structure, params_bytes),
               "unsplittable_cuts": sorted(unsplittable_cuts(structure)), **(model_info or {})},
        hardware=_hardware(device, threads),
        software={"torch": torch.__version__, "python": platform.python_version(), "varuna_sdk": _version()},
        micro_batch_sizes=sizes, segments=segments, network=net, per_action_s=costs["per_action_s"],
        per_step_s=costs["per_step_s"], opt_s_per_param_byte=costs["opt_s_per_param_byte"],
        opt_parallelism=opt_par, compute_interference=interference, calibration_s=time.perf_counter() - t_start,
        calibrated_at=time.time(),
    )


def _bench(model_fn, loss_fn, make_batch: BatchFn, sizes: list[int], seed: int, init_fn, precision: str,
           device: torch.device) -> tuple:
    """The model traced on meta (its ``ModelStructure``) and a ``_Bench``: the model materialised
    on ``device`` with ``seed``/``init_fn``, in training mode, and a real batch per size."""
    meta_model = build_on_meta(model_fn)
    inputs0, targets0 = make_batch(sizes[0])
    # with the loss, as the workers trace it: its uses of earlier segments' tensors count too
    structure = trace_model(meta_model, as_inputs(inputs0), device,
                            after=loss_after(loss_fn, to_device(targets0, device)), targets=targets0)
    model = build_on_meta(model_fn)
    materialize(model, [nm for nm, _ in model.named_parameters()] + [nm for nm, _ in model.named_buffers()],
                seed=seed, device=device, init_fn=init_fn)
    model.train()
    batches = {}
    for b in sizes:
        inputs, targets = make_batch(b)
        batches[b] = (to_device(as_inputs(inputs), device), to_device(targets, device))
    return structure, _Bench(model, loss_fn, batches, structure.num_segments, device, precision)


def _measure_segments(bench: _Bench, sizes: list[int], structure, warmup: int, repeats: int,
                      probe_host: Callable[[], tuple] | None) -> tuple[list[SegmentProfile], tuple | None]:
    """Every segment's times (medians over ``repeats`` timed rounds after ``warmup``) and bytes
    at every size, and the host probes' result (``probe_host()``, run halfway; None without).

    Rounds go over the sizes (not one size after the other), so that a machine that speeds up or
    slows down meanwhile shifts every size alike; half the timed rounds run before the host probes
    and half after, so that the medians span the whole calibration (a VM's speed drifts over tens
    of seconds) instead of a few seconds of it."""
    saved = {b: bench.time(b, count_saved=True)["act_bytes"] for b in sizes}  # untimed: the hooks slow the forward
    runs: dict[int, list[dict]] = {b: [] for b in sizes}
    segment_of = {id(q): min(structure.state_segments[nm]) for nm, q in bench.model.named_parameters()
                  if nm in structure.state_segments}
    host = None
    for i in range(warmup + repeats):
        if probe_host is not None and host is None and i == warmup + (repeats + 1) // 2:
            host = probe_host()
            for b in sizes:  # untimed: caches and heap back after the probe processes
                bench.time(b)
        for b in sizes:
            r = bench.time(b, segment_of=segment_of)
            if i >= warmup:
                runs[b].append(r)
    per_size: dict[str, list[list]] = {k: [] for k in ("fwd_s", "rec_s", "bwd_s", "out_bytes", "act_bytes",
                                                       "bwd_in_s", "wgt_s")}
    for b in sizes:
        for key in ("fwd_s", "rec_s", "bwd_s", "bwd_in_s", "wgt_s"):
            per_size[key].append(_median_lists([r[key] for r in runs[b]]))
        per_size["out_bytes"].append(runs[b][-1]["out_bytes"])
        per_size["act_bytes"].append(saved[b])
    segments = [SegmentProfile(**{k: [per_size[k][j][i] for j in range(len(sizes))] for k in per_size},
                               param_bytes=int(structure.segment_param_bytes[i]))
                for i in range(structure.num_segments)]
    return segments, host


def _probe_host(model_fn, loss_fn, init_fn, seed: int, batch: tuple, precision: str, device: torch.device,
                threads: int, opt_bytes: int, known: NetworkProfile | None) -> tuple[NetworkProfile, float, float]:
    """``measure_host`` for this model: the compute probe only for fp32 on CPU; the network
    probes only without ``known`` figures."""
    probe = compute_probe(model_fn, loss_fn, init_fn, seed, batch, precision) if device.type == "cpu" else None
    return measure_host(threads=threads, opt_bytes=opt_bytes, compute=probe, known=known)


def _engine_costs(model_fn, loss_fn, make_batch, b: int, structure, seed, init_fn, precision, device,
                  warmup: int, repeats: int, grad_clip: float | None, m: int = 4) -> dict[str, float]:
    """The engine's own costs, read off real steps of ``Varuna`` at P=1, D=1 with ``m``
    micro-batches of size ``b`` (measured, not fitted: the step reports each action's time):

    * ``per_action_s``: what an F or B action costs beyond the model's own compute (scheduler,
      RNG fork, cut-point bookkeeping, sending and receiving), read off each action itself: its
      time less the time inside the model's forward and loss or autograd's backward
      (``StepResult.compute_s - model_s``), ``/ 2m``. Not the step less a separate segment pass:
      on a 2-vCPU VM one pass of the demo model varied by 20–40 % from the next, which moved that
      difference by ±20 ms per action and the median of 9 between 0 and 21 ms for a cost of ~1 ms;
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
        r = eng.step(batch, opt)
        if i >= warmup:
            acts = r.compute_s["F"] + r.compute_s["B"]
            action.append((acts - r.model_s["F"] - r.model_s["B"]) / (2 * m))
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
