"""Shared helpers of the benchmarks: command line, timing statistics, the benchmark model and
data, result figures, the printed table and ``benchmarks/results/NAME.json``.

Every benchmark measures its baseline in the same run and reports *ratios*, so results from
different machines compare by ratio, not by absolute time. Timings are medians over timed steps
after warm-up; the JSON also keeps the quartiles so that noise is visible.

Imports ``varuna_sdk`` (the model side only); never imported by the SDK.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
T = 128  # tokens per sequence in every benchmark
MICRO = 4  # sequences per micro-batch in every benchmark


# ---- command line ---------------------------------------------------------------------------
def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """``--quick`` (fewer steps, for smoke runs), ``--out`` (JSON path override) + ``extra`` flags."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="few steps: a smoke run, not a measurement")
    ap.add_argument("--out", default=None, help="where to write the JSON (default benchmarks/results/NAME.json)")
    ap.add_argument("--wait-idle", type=float, default=None,
                    help="wait up to this many seconds for the CPUs to go idle before measuring "
                         "(default 30, or 0 with --quick)")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    if hasattr(args, "P") and args.P is None:  # add_pipeline_args
        args.P = [2] if args.quick else [2, 4]
    if args.wait_idle is None:
        args.wait_idle = 0.0 if args.quick else 30.0
    return args


def add_pipeline_args(ap: argparse.ArgumentParser, timeout_s: float) -> None:
    """``--P`` (pipeline depths: default 2 4, quick 2), ``--m`` (micro-batches, default 8) and
    ``--timeout`` (seconds per multi-process run) of the multi-stage benchmarks."""
    ap.add_argument("--P", type=int, nargs="+", default=None, help="pipeline depths (default 2 4; quick: 2)")
    ap.add_argument("--m", type=int, default=8, help="micro-batches per mini-batch (default 8)")
    ap.add_argument("--timeout", type=float, default=timeout_s,
                    help=f"per-run worker timeout in seconds (default {timeout_s:g})")


# ---- timing ---------------------------------------------------------------------------------
def stats(values: Sequence[float]) -> dict:
    """Median, quartiles, min, max and count of ``values`` (seconds or bytes)."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"median": float("nan"), "p25": float("nan"), "p75": float("nan"), "min": float("nan"),
                "max": float("nan"), "n": 0}
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"median": statistics.median(v), "p25": q[0], "p75": q[2], "min": v[0], "max": v[-1], "n": len(v)}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed_optimizer(opt: torch.optim.Optimizer, sink: dict, key: str = "opt") -> None:
    """Add the wall time of every ``opt.step`` to ``sink[key]`` (step hooks, no patching)."""
    state = {}
    opt.register_step_pre_hook(lambda *a: state.__setitem__("t", time.perf_counter()))
    opt.register_step_post_hook(
        lambda *a: sink.__setitem__(key, sink.get(key, 0.0) + time.perf_counter() - state["t"]))


def accumulated_step(loss_of: Callable[[int], torch.Tensor], m: int, opt: torch.optim.Optimizer,
                     phase: dict) -> tuple[float, dict, float]:
    """One optimizer step as a user writes it in plain PyTorch: ``loss_of(i)`` for micro-batches
    ``i = 0..m-1``, ``(loss / m).backward()`` each, then ``opt.step()`` and ``zero_grad``. Returns
    (seconds, per-phase seconds ``fwd``/``bwd``/``opt``/``other``, the mean loss); ``opt`` must be
    wrapped by ``timed_optimizer(opt, phase)``."""
    t0 = time.perf_counter()
    total = fwd = bwd = 0.0
    for i in range(m):
        ta = time.perf_counter()
        loss = loss_of(i)
        tb = time.perf_counter()
        (loss / m).backward()
        tc = time.perf_counter()
        total += loss.item() / m
        fwd, bwd = fwd + tb - ta, bwd + tc - tb
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    ph = {"fwd": fwd, "bwd": bwd, "opt": phase.pop("opt", 0.0)}
    ph["other"] = dt - sum(ph.values())
    return dt, ph, total


def timed_method(obj: object, name: str, sink: dict, key: str) -> None:
    """Wrap ``obj.name`` (on the instance) so that each call adds its wall time to ``sink[key]``."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink[key] = sink.get(key, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


# ---- activation memory ----------------------------------------------------------------------
def rss_bytes() -> int:
    """This process's resident set size, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class ActivationMeter:
    """Live bytes of saved-for-backward tensors (+ stashed stage inputs) and their peak: use
    ``pack``/``unpack`` as ``torch.autograd.graph.saved_tensors_hooks`` (each storage counted
    once, while autograd holds it; parameters — ``param_ptrs``, their storages' addresses — and
    meta-device stand-ins excluded) and ``stash_add``/``stash_pop`` for stage inputs a
    recomputing stage keeps between its no-grad forward and its recompute."""

    def __init__(self, param_ptrs: set[int]):
        self.param_ptrs = param_ptrs
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, refcount]
        self.saved = 0
        self.stash = 0
        self.stashed: dict[int, int] = {}
        self.peak = 0
        self.peak_saved = 0
        self.peak_stash = 0
        self.rss_peak = 0
        self.sample_rss = False

    def _update(self) -> None:
        total = self.saved + self.stash
        if total > self.peak:
            self.peak = total
        self.peak_saved = max(self.peak_saved, self.saved)
        self.peak_stash = max(self.peak_stash, self.stash)
        if self.sample_rss:
            self.rss_peak = max(self.rss_peak, rss_bytes())

    def reset_peak(self) -> None:
        self.peak = self.peak_saved = self.peak_stash = self.saved + self.stash

    # saved_tensors_hooks ---------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if t.device.type == "meta":
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.param_ptrs or st.nbytes() == 0:
            return t
        e = self.storages.get(ptr)
        if e is None:
            self.storages[ptr] = [st.nbytes(), 1]
            self.saved += st.nbytes()
            self._update()
        else:
            e[1] += 1
        return _Saved(self, ptr, t)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Saved) else h

    def release(self, ptr: int) -> None:
        e = self.storages[ptr]
        e[1] -= 1
        if e[1] == 0:
            self.saved -= e[0]
            del self.storages[ptr]

    # stash of received stage inputs (recompute) ----------------------------------------------
    def stash_add(self, mb: int, tensors) -> None:
        n = sum(t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta")
        self.stashed[mb] = n
        self.stash += n
        self._update()

    def stash_pop(self, mb: int) -> None:
        self.stash -= self.stashed.pop(mb, 0)


class _Saved:
    __slots__ = ("meter", "ptr", "t")

    def __init__(self, meter: ActivationMeter, ptr: int, t: torch.Tensor):
        self.meter, self.ptr, self.t = meter, ptr, t

    def __del__(self):
        self.meter.release(self.ptr)



def count_stash(meter: "ActivationMeter", eng) -> None:
    """Count a ``Varuna`` engine's stashed stage inputs (recompute) in ``meter`` from now on."""
    orig_forward = eng._forward

    def counted_forward(inputs, received, mb, grad, **timing):
        if received is not None:
            if not grad:  # forward of the recompute policy: the stage input waits in the stash
                meter.stash_add(mb, received)
            else:  # recompute (or a normal forward): from now on autograd holds the input
                meter.stash_pop(mb)
        return orig_forward(inputs, received, mb, grad, **timing)

    eng._forward = counted_forward


# ---- machine --------------------------------------------------------------------------------
def machine_info(**extra) -> dict:
    """CPU count, torch/python versions, platform and thread settings (+ ``extra``)."""
    info = {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    try:
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        pass
    info.update(extra)
    return info


# ---- model and data -------------------------------------------------------------------------
def bench_gpt2_cfg(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, block_size: int = 128,
                   vocab_size: int = 256, dropout: float = 0.0):
    """The benchmark GPT-2: the ``cpu-demo`` shape with a byte vocabulary (256 tokens), so the
    transformer blocks — not the LM head — dominate the compute (environment.md)."""
    from varuna_sdk.model import preset

    return preset("cpu-demo", n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size,
                  vocab_size=vocab_size, dropout=dropout)


def make_batch(step: int, B: int, T: int, vocab: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random token batch ``(inputs [B, T], targets [B, T])`` for ``step``."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def full_model(cfg, seed: int, cutpoints: bool = False) -> torch.nn.Module:
    """The whole GPT-2 on CPU with exactly the initial weights ``Varuna(..., seed=seed)`` gives
    (initialisation is keyed by parameter name), as a plain ``nn.Module``."""
    from functools import partial

    from varuna_sdk.model import build_on_meta, gpt2, init_gpt2, materialize

    model = build_on_meta(lambda: gpt2(cfg, cutpoints=cutpoints))
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    materialize(model, names, seed=seed, device="cpu", init_fn=partial(init_gpt2, n_layer=cfg.n_layer))
    return model.train()


def block_split(n_layer: int, P: int) -> list[list[int]]:
    """Blocks per stage, as even as possible (earlier stages get the extra block)."""
    base, extra = divmod(n_layer, P)
    out, k = [], 0
    for s in range(P):
        n = base + (1 if s < extra else 0)
        out.append(list(range(k, k + n)))
        k += n
    return out


def varuna_boundaries(blocks: list[list[int]]) -> list[list[int]]:
    """Segments of ``auto_cutpoints`` GPT-2: 0 = embeddings, 1 + i = block i, n_layer + 1 = head."""
    n_layer = sum(len(b) for b in blocks)
    out = []
    for s, bl in enumerate(blocks):
        segs = [1 + i for i in bl]
        if s == 0:
            segs = [0] + segs
        if s == len(blocks) - 1:
            segs = segs + [n_layer + 1]
        out.append(segs)
    return out


def varuna_engine(cfg, P: int, m: int, seed: int, *, policy: str = "varuna", recompute: bool | None = None,
                  timeout_s: float = 120.0, split_backward: bool | None = None,
                  max_in_flight: list[int] | None = None):
    """``Varuna`` on the benchmark GPT-2: P stages split at ``block_split`` (P = 1: the whole model),
    D = 1, m micro-batches of ``MICRO`` x ``T`` tokens, name-keyed initial weights from ``seed``.
    Inside a worker of ``spawn_collect`` when P > 1."""
    from functools import partial

    from varuna_sdk.config import ParallelConfig
    from varuna_sdk.model import gpt2, init_gpt2, lm_loss
    from varuna_sdk.pipeline.engine import Varuna

    boundaries = varuna_boundaries(block_split(cfg.n_layer, P)) if P > 1 else None
    par = ParallelConfig(P=P, D=1, global_batch=m * MICRO, micro_batch_size=MICRO, policy=policy,
                         recompute=recompute, boundaries=boundaries, split_backward=split_backward,
                         max_in_flight=max_in_flight)
    return Varuna(lambda: gpt2(cfg), lm_loss, par, (torch.zeros(MICRO, T, dtype=torch.long),), seed=seed,
                  init_fn=partial(init_gpt2, n_layer=cfg.n_layer), timeout_s=timeout_s)


# ---- worker processes -----------------------------------------------------------------------
def spawn_collect(worker: Callable, P: int, opts: dict, timeout_s: float, prepare: Callable[[Path], dict] | None = None
                  ) -> tuple[list[dict], float]:
    """Run ``worker(rank, P, out_dir, opts)`` in P fresh gloo processes (one torch thread each);
    every worker ends with ``write_rank``. ``prepare(out_dir)`` may add options (files the workers
    share) before they start. Returns the ranks' documents in rank order and the wall seconds."""
    import tempfile

    from varuna_sdk.pipeline.spawn import spawn_workers

    with tempfile.TemporaryDirectory(prefix="varuna-bench-") as tmp:
        opts = {**opts, **(prepare(Path(tmp)) if prepare else {})}
        t0 = time.monotonic()
        spawn_workers(worker, P, args=(tmp, opts), backend="gloo", timeout_s=timeout_s, threads_per_worker=1,
                      work_dir=tmp)
        wall = time.monotonic() - t0
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(P)], wall


def write_rank(out_dir: str, rank: int, doc: dict) -> None:
    """A worker's result for ``spawn_collect``."""
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(doc))


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two equally long lists (1: same order, -1: reversed)."""
    n, score = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            score += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return score / (n * (n - 1) / 2) if n > 1 else 1.0


# ---- results --------------------------------------------------------------------------------
@dataclass
class Figure:
    """One reported number and how it compares with the baseline measured in the same run.

    ``ratio`` = value / baseline unless given; ``target`` is a string such as ``"<= 1.05"`` or
    ``">= 1.0"`` applied to the ratio; ``met`` is ``None`` when there is no target.
    """

    name: str
    value: float
    unit: str
    baseline: float | None = None
    ratio: float | None = None
    target: str | None = None
    met: bool | None = None
    detail: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ratio is None and self.baseline not in (None, 0):
            self.ratio = self.value / self.baseline
        if self.target is not None and self.ratio is not None and self.met is None:
            self.met = check_target(self.ratio, self.target)


def check_target(ratio: float, target: str) -> bool:
    op, num = target.split()
    x = float(num)
    return {"<=": ratio <= x, ">=": ratio >= x, "<": ratio < x, ">": ratio > x}[op]


def fmt_value(v: float | None, unit: str = "") -> str:
    """Human-readable ``v`` in ``unit``: seconds as us/ms/s, bytes as MiB, ``mb/s`` as mini-batches/s."""
    if v is None:
        return "-"
    if unit == "s":
        if abs(v) < 1e-3:
            return f"{v * 1e6:.1f} us"
        return f"{v * 1e3:.1f} ms" if abs(v) < 10 else f"{v:.1f} s"
    if unit == "B":
        return f"{v / 2**20:.2f} MiB"
    if unit == "x":
        return f"{v:.3f}x"
    if unit == "mb/s":
        return f"{v:.2f} mini-batches/s"
    return f"{v:.4g}{(' ' + unit) if unit else ''}"


def print_table(title: str, figures: Sequence[Figure]) -> None:
    """Print ``figures`` as an aligned table (value, baseline, ratio, target, met)."""
    rows = [("figure", "value", "baseline", "ratio", "target", "met")]
    for f in figures:
        met = "-" if f.met is None else ("yes" if f.met else "NO")
        rows.append((f.name, fmt_value(f.value, f.unit), fmt_value(f.baseline, f.unit),
                     "-" if f.ratio is None else f"{f.ratio:.3f}", f.target or "-", met))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = "-" * (sum(widths) + 3 * (len(widths) - 1))
    print(f"\n{title}\n{line}")
    for k, r in enumerate(rows):
        print(" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            print(line)
    print(line)


def write_results(name: str, figures: Sequence[Figure], notes: str, machine: dict | None = None,
                  extra: dict | None = None, out: str | Path | None = None) -> Path:
    """Write ``{"benchmark", "date", "machine", "figures", "notes", ...extra}`` to
    ``benchmarks/results/NAME.json`` (or ``out``); ``date`` is UTC, ISO 8601; returns the path."""
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine or machine_info(),
           "figures": [asdict(f) for f in figures], "notes": notes}
    if extra:
        doc.update(extra)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    tmp.replace(path)
    print(f"\nwrote {path}")
    return path


def _json_default(o):
    if isinstance(o, float):
        return o
    if isinstance(o, (torch.Tensor,)):
        return o.tolist()
    return str(o)


def setup_path() -> None:
    """Make ``varuna_sdk`` importable when a script runs from a checkout without installation."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.append(root)


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (rounded), to show how busy the machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return []


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int]:
    """``(idle, total)`` CPU ticks of the machine (``varuna_sdk.profiling.job.cpu_times``)."""
    from varuna_sdk.profiling.job import cpu_times

    t = cpu_times()
    if t is None:
        raise RuntimeError("no /proc/stat here: the benchmarks measure the machine's load on Linux only")
    return t


def wait_for_idle(max_wait_s: float, idle_frac: float = 0.85, window_s: float = 3.0) -> dict:
    """Wait (at most ``max_wait_s``) until the machine's CPUs were at least ``idle_frac`` idle over
    a ``window_s`` window: other work on a shared machine makes timings noisy.
    Returns what was seen (``waited_s``, ``idle_frac_seen``, ``quiet``), for the JSON."""
    t0 = time.monotonic()
    streak, seen = 0, 0.0
    if max_wait_s <= 0:
        return {"waited_s": 0.0, "idle_frac_seen": None, "quiet": None}
    while True:
        i0, a0 = _cpu_times()
        time.sleep(window_s)
        i1, a1 = _cpu_times()
        seen = (i1 - i0) / max(1, a1 - a0)
        streak = streak + 1 if seen >= idle_frac else 0
        waited = time.monotonic() - t0
        if streak >= 1:
            return {"waited_s": round(waited, 1), "idle_frac_seen": round(seen, 3), "quiet": True}
        if waited >= max_wait_s:
            print(f"note: machine still busy after {waited:.0f} s (CPUs {seen:.0%} idle); measuring anyway")
            return {"waited_s": round(waited, 1), "idle_frac_seen": round(seen, 3), "quiet": False}
