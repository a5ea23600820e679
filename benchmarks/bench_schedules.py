"""Varuna's policy vs torch.distributed.pipelining's Schedule1F1B and ScheduleGPipe, on the same
stages, batch and micro-batches, without and with injected jitter at the stage boundaries.

One GPT-2 (byte vocabulary, 4 blocks, d=128, T=128) is split into P stages at the same
boundaries for every system: for Varuna by ``ParallelConfig.boundaries`` over its cut-point
segments, for torch by hand-built stage modules (embeddings + first blocks / middle blocks /
last blocks + final LayerNorm + tied LM head) wrapped in ``PipelineStage``. All systems start
from the same initial weights (name-keyed init), train on the same batches (B = m x b), apply the
same loss (``lm_loss``, gradients / m), sum the tied embedding/LM-head gradient between the first
and last stage, and step AdamW. They run in the same P gloo processes (one torch thread each),
interleaved round by round so load drift hits all of them.

Systems: Varuna with its default ``recompute=True`` (stores only stage inputs, recomputes the
rest just in time: extra forward compute on every non-last stage), Varuna with
``recompute=False`` (stores activations, same work as torch), torch Schedule1F1B and
ScheduleGPipe (no recompute: store activations).

Jitter: see ``jitter.py`` — seeded exponential delays on message delivery (mean a fraction of one
micro-batch's forward+backward time on a stage, measured in this run), identical per message for
every system, never blocking the sender. Figures: median time per mini-batch (from the first
rank's barrier exit to the last rank's finish, one shared monotonic clock), and throughput ratios
Varuna / 1F1B and Varuna / GPipe, each the median over rounds of the paired per-round ratio (the
systems' steps in a round run back to back, so load bursts on a shared machine hit both; ratio of
medians and of minima are printed alongside as a noise check). Targets (DESIGN.md): >= 1.0x
without jitter, >= 1.1x with.

Run: ``.venv/bin/python benchmarks/bench_schedules.py [--quick] [--P 2 4] [--jitter-frac 0.5]``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import jitter  # noqa: E402

common.setup_path()

import torch  # noqa: E402
from torch import nn  # noqa: E402

SEED = 11
LR = 1e-3
T, MICRO = 128, 4
SYSTEMS = ("varuna_rc", "varuna_norc", "torch_1f1b", "torch_gpipe")
LABEL = {"varuna_rc": "Varuna (recompute)", "varuna_norc": "Varuna (no recompute)",
         "torch_1f1b": "torch Schedule1F1B", "torch_gpipe": "torch ScheduleGPipe"}


# ---- torch stages ---------------------------------------------------------------------------
class TorchStage(nn.Module):
    """One hand-built stage of the GPT-2 for torch pipelining; shares the full model's modules."""

    def __init__(self, full: nn.Module, blocks: list[int], first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = full.wte, full.wpe, full.drop
        self.h = nn.ModuleList([full.h[i] for i in blocks])
        if last:
            self.ln_f, self.lm_head = full.ln_f, full.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for blk in self.h:
            x = blk(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


# ---- the systems, inside one worker -----------------------------------------------------------
class VarunaSystem:
    def __init__(self, cfg, P: int, m: int, blocks, recompute: bool):
        from varuna_sdk.config import ParallelConfig
        from varuna_sdk.model import gpt2, init_gpt2, lm_loss
        from varuna_sdk.pipeline.engine import Varuna

        par = ParallelConfig(P=P, D=1, global_batch=m * MICRO, micro_batch_size=MICRO, policy="varuna",
                             recompute=recompute, boundaries=common.varuna_boundaries(blocks))
        self.eng = Varuna(lambda: gpt2(cfg), lm_loss, par, (torch.zeros(MICRO, T, dtype=torch.long),),
                          seed=SEED, init_fn=partial(init_gpt2, n_layer=cfg.n_layer), timeout_s=120)
        self.opt = torch.optim.AdamW(self.eng.parameters(), lr=LR)
        self.last_compute = {}

    def step(self, batch) -> float | None:
        r = self.eng.step(batch, self.opt)
        self.last_compute = r.compute_s
        return r.loss


class TorchSystem:
    def __init__(self, cfg, P: int, m: int, blocks, rank: int, schedule_cls, tied_group):
        from torch.distributed.pipelining import PipelineStage

        from varuna_sdk.model import lm_loss

        full = common.full_model(cfg, SEED)
        self.rank, self.P = rank, P
        self.module = TorchStage(full, blocks[rank], rank == 0, rank == P - 1)
        self.stage = PipelineStage(self.module, rank, P, torch.device("cpu"))
        self.sched = schedule_cls(self.stage, n_microbatches=m, loss_fn=lm_loss)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR)
        self.tied_group = tied_group
        self.tied = None
        if rank == 0:
            self.tied = self.module.wte.weight
        elif rank == P - 1:
            self.tied = self.module.lm_head.weight

    def step(self, batch) -> float | None:
        x, y = batch
        losses: list = []
        if self.rank == 0:
            self.sched.step(x)
        elif self.rank == self.P - 1:
            self.sched.step(target=y, losses=losses)
        else:
            self.sched.step()
        if self.tied is not None:  # tied embedding / LM head: sum the two stages' gradients
            torch.distributed.all_reduce(self.tied.grad, group=self.tied_group)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(torch.stack([x.detach() for x in losses]).mean()) if losses else None


def stage_compute_per_mb(module: nn.Module, rank: int, P: int, cfg, reps: int = 3) -> float:
    """Median seconds of one micro-batch's forward + backward through this rank's stage module
    alone (no communication, no waiting); the module's gradients are cleared afterwards."""
    from varuna_sdk.model import lm_loss

    x, y = common.make_batch(0, MICRO, T, cfg.vocab_size, seed=9)
    if rank > 0:
        x = torch.randn(MICRO, T, cfg.n_embd, requires_grad=True)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        out = module(x)
        if rank == P - 1:
            lm_loss(out, y).backward()
        else:
            out.backward(torch.randn_like(out))
        times.append(time.perf_counter() - t0)
    module.zero_grad(set_to_none=True)
    return common.median(times[1:])


def worker(rank: int, world: int, out_dir: str, opts: dict) -> None:
    """Build every system on this rank, calibrate the jitter, run interleaved rounds, write times."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from varuna_sdk.pipeline import comm

    P, m = world, opts["m"]
    cfg = common.bench_gpt2_cfg()
    blocks = common.block_split(cfg.n_layer, P)
    gate = jitter.JitterGate(opts["ts_path"], world, rank, max_msgs=4 * m, seed=opts["seed"])
    comm.set_delivery_gate(gate)
    jitter.install_torch_gate(gate)

    tied_group = dist.new_group([0, P - 1])
    systems = {
        "varuna_rc": VarunaSystem(cfg, P, m, blocks, recompute=True),
        "varuna_norc": VarunaSystem(cfg, P, m, blocks, recompute=False),
        "torch_1f1b": TorchSystem(cfg, P, m, blocks, rank, Schedule1F1B, tied_group),
        "torch_gpipe": TorchSystem(cfg, P, m, blocks, rank, ScheduleGPipe, tied_group),
    }
    B = m * MICRO
    counters = {(s, j): 0 for s in systems for j in (False, True)}
    spans = {f"{s}|{int(j)}": [] for s in systems for j in (False, True)}
    first_loss = {}

    def one_step(name: str, jit: bool, record: bool) -> None:
        key = counters[(name, jit)]
        counters[(name, jit)] += 1
        batch = common.make_batch(key, B, T, cfg.vocab_size, seed=3)
        gate.begin(key=key, enabled=jit)
        dist.barrier()
        t0 = time.monotonic()
        loss = systems[name].step(batch)
        t1 = time.monotonic()
        if name not in first_loss and loss is not None:
            first_loss[name] = loss
        if record:
            spans[f"{name}|{int(jit)}"].append((t0, t1))

    # warm-up without jitter (torch infers shapes on its first step)
    for name in systems:
        for _ in range(opts["warmup"]):
            one_step(name, False, record=False)
    # jitter mean = frac x the slowest stage's pure forward+backward compute per micro-batch
    per_mb = torch.tensor([stage_compute_per_mb(systems["torch_1f1b"].module, rank, P, cfg)], dtype=torch.float64)
    dist.all_reduce(per_mb, op=dist.ReduceOp.MAX)
    gate.mean_s = opts["jitter_frac"] * float(per_mb)

    names = list(systems)
    for r in range(opts["rounds"]):  # one step of every system per round and jitter setting
        for jit in ((False, True) if r % 2 == 0 else (True, False)):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                one_step(name, jit, record=True)
    dist.barrier()
    pg_cpu = dist.group.WORLD._get_backend(torch.device("cpu"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "spans": spans, "first_loss": first_loss, "per_mb_compute_s": float(per_mb),
        "jitter_mean_s": gate.mean_s, "applied_delays": gate.delays,
        "gloo_supports_coalescing": bool(getattr(pg_cpu, "supports_coalescing", False)),
        "blocks": blocks,
    }))


# ---- parent ---------------------------------------------------------------------------------
def run_P(P: int, opts: dict, timeout_s: float) -> dict:
    from varuna_sdk.cluster.local import spawn_workers

    with tempfile.TemporaryDirectory(prefix="bench-sched-") as tmp:
        ts_path = str(Path(tmp) / "send_times.f64")
        jitter.create_send_time_table(ts_path, P, 4 * opts["m"])
        t0 = time.monotonic()
        spawn_workers(worker, P, args=(tmp, {**opts, "ts_path": ts_path}), backend="gloo", timeout_s=timeout_s,
                      threads_per_worker=1, work_dir=tmp)
        wall = time.monotonic() - t0
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(P)]
    out = {"wall_s": wall, "per_mb_compute_s": ranks[0]["per_mb_compute_s"], "jitter_mean_s": ranks[0]["jitter_mean_s"],
           "blocks": ranks[0]["blocks"], "gloo_supports_coalescing": ranks[0]["gloo_supports_coalescing"],
           "first_loss": ranks[-1]["first_loss"], "times": {}, "stats": {},
           "applied_delay_mean_s": common.median([d for r in ranks for d in r["applied_delays"]] or [0.0])}
    for key in ranks[0]["spans"]:
        n = len(ranks[0]["spans"][key])
        times = [max(r["spans"][key][i][1] for r in ranks) - min(r["spans"][key][i][0] for r in ranks) for i in range(n)]
        out["times"][key] = times
        out["stats"][key] = common.stats(times)
    return out


def static_order(P: int, m: int) -> str:
    """Stage 0's static Varuna order without recompute, e.g. ``F0 F1 F2 B0 B1 B2 F3 ...``."""
    from varuna_sdk.pipeline.schedule import format_schedule, stage_schedule

    return format_schedule(stage_schedule("varuna", P, m, 0, recompute=False))


def robustness(times: dict, v: str, base: str, jit: int) -> dict:
    """Throughput ratio v/base three ways: ratio of medians (the figure), median of per-round
    paired ratios (steps run back to back: robust to slow load drift), ratio of minima (best case)."""
    a, b = times[f"{v}|{jit}"], times[f"{base}|{jit}"]
    return {"ratio_of_medians": common.median(b) / common.median(a),
            "median_paired_ratio": common.median([y / x for x, y in zip(a, b)]),
            "ratio_of_minima": min(b) / min(a)}


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda ap: (
        ap.add_argument("--P", type=int, nargs="+", default=None, help="pipeline depths (default 2 4; quick: 2)"),
        ap.add_argument("--m", type=int, default=8, help="micro-batches per mini-batch (default 8)"),
        ap.add_argument("--jitter-frac", type=float, default=0.5,
                        help="mean delay as a fraction of one micro-batch's forward+backward time on a stage"),
        ap.add_argument("--timeout", type=float, default=300.0, help="per-P worker timeout in seconds")))
    Ps = args.P or ([2] if args.quick else [2, 4])
    opts = {"m": args.m, "jitter_frac": args.jitter_frac, "seed": 5,
            "warmup": 1 if args.quick else 2, "rounds": 2 if args.quick else 12}
    cfg = common.bench_gpt2_cfg()
    print(f"model: GPT-2 {cfg.n_layer} blocks d={cfg.n_embd} vocab={cfg.vocab_size} T={T}; batch {args.m * MICRO} = "
          f"{args.m} micro-batches x {MICRO}; P in {Ps}; 1 torch thread per process; "
          f"{opts['rounds']} rounds, each one timed step per system and jitter setting")
    load0 = common.load_average()

    figures, per_P = [], {}
    idle = {}
    for P in Ps:
        idle[P] = common.wait_for_idle(args.wait_idle)
        res = run_P(P, opts, args.timeout)
        per_P[P] = res
        st = res["stats"]
        med = {k: v["median"] for k, v in st.items()}
        note_p = " (4 processes on 2 cores: oversubscribed)" if P > (common.cpu_count()) else ""
        print(f"\nP={P}{note_p}: blocks per stage {res['blocks']}; per-micro-batch stage compute "
              f"{res['per_mb_compute_s'] * 1e3:.1f} ms; jitter mean {res['jitter_mean_s'] * 1e3:.1f} ms "
              f"(median applied wait {res['applied_delay_mean_s'] * 1e3:.1f} ms); workers {res['wall_s']:.0f} s")
        print("spread of time per mini-batch (p25..p75 ms): " + ", ".join(
            f"{LABEL[s_]}{' +jitter' if j else ''} {st[f'{s_}|{j}']['p25'] * 1e3:.0f}..{st[f'{s_}|{j}']['p75'] * 1e3:.0f}"
            for j in (0, 1) for s_ in SYSTEMS))
        print("first-step losses (same weights, same batch): "
              + ", ".join(f"{LABEL[k]} {v:.6f}" for k, v in sorted(res["first_loss"].items())))
        for jit in (0, 1):
            tag = "jitter" if jit else "no jitter"
            for s in SYSTEMS:
                figures.append(common.Figure(f"P={P} {tag}: time per mini-batch, {LABEL[s]}", med[f"{s}|{jit}"], "s",
                                             detail=st[f"{s}|{jit}"]))
            target = ">= 1.1" if jit else ">= 1.0"
            for v in ("varuna_rc", "varuna_norc"):
                for base in ("torch_1f1b", "torch_gpipe"):
                    rob = robustness(res["times"], v, base, jit)
                    figures.append(common.Figure(
                        f"P={P} {tag}: throughput {LABEL[v]} / {LABEL[base].replace('torch ', '')}",
                        1.0 / med[f"{v}|{jit}"], "mb/s", baseline=1.0 / med[f"{base}|{jit}"],
                        ratio=rob["median_paired_ratio"], target=target, detail=rob))
        for s in SYSTEMS:
            figures.append(common.Figure(f"P={P}: jitter slowdown, {LABEL[s]}", med[f"{s}|1"], "s",
                                         baseline=med[f"{s}|0"]))
    load1 = common.load_average()
    common.print_table("Pipeline schedules: Varuna vs torch.distributed.pipelining (value/baseline: median "
                       "mini-batches per second; ratio: median of per-round paired throughput ratios)", figures)
    print("\nthroughput ratios three ways (noise check): ratio of medians | median of paired per-round ratios | "
          "ratio of minima")
    for f in figures:
        if f.target:
            d = f.detail
            print(f"  {f.name:66s} {d['ratio_of_medians']:.3f} | {d['median_paired_ratio']:.3f} | {d['ratio_of_minima']:.3f}")

    ratio_figs = [f for f in figures if f.target]
    met = [f for f in ratio_figs if f.met]
    summary = "; ".join(f"{f.name.split(': ', 1)[0]} {f.name.split('throughput ')[1]} = {f.ratio:.3f}"
                        f" ({'met' if f.met else 'not met'}; ratio of medians {f.detail['ratio_of_medians']:.3f})"
                        for f in ratio_figs)
    notes = (
        "Same GPT-2 split at the same block boundaries for all systems; same initial weights, batches and "
        f"micro-batches ({args.m} x {MICRO}); tied embedding/LM-head gradient summed between first and last stage in "
        "both; AdamW; gloo on CPU, one torch thread per process; systems interleaved round by round in the same "
        "processes. Activation storage: Varuna (recompute) keeps only each micro-batch's stage input between "
        "forward and backward and recomputes the stage forward just in time (extra compute on every non-last stage, "
        "so on compute-bound CPU it pays ~1 extra forward per micro-batch on those stages); Varuna (no recompute), "
        "torch 1F1B and torch GPipe keep full activations (GPipe for all m micro-batches at once). "
        "Varuna's opportunistic reordering (a forward while a late gradient is awaited) applies only with recompute "
        "(it reorders around R actions); without recompute Varuna runs its static schedule. Varuna additionally "
        "runs one world all-reduce per step (overflow, grad-norm, loss consensus). "
        f"Jitter: seeded exponential delivery delays, mean {args.jitter_frac} x the slowest stage's pure forward+backward "
        "time per micro-batch (measured in-run without communication), "
        "counted from the sender's hand-off, in-order per link, identical per message for every system (jitter.py). "
        "Throughput ratio = median over rounds of the ratio of the two systems' steps in that round (they run back "
        "to back, so a burst of other load on this shared 2-core machine hits both); the ratio of medians and of "
        "minima are kept in each figure's detail. "
        f"Targets met {len(met)}/{len(ratio_figs)}: {summary}. "
        "Reading: on this CPU testbed compute is the bottleneck and the network is loopback, the regime least "
        "favourable to recompute; Varuna (recompute) runs 2F+B per micro-batch on non-last stages vs F+B, so ~0.75-0.8x "
        "1F1B without jitter is what the extra forward costs. Without recompute Varuna runs its static order, e.g. "
        + "; ".join(f"P={P} stage 0: {static_order(P, args.m)}" for P in Ps)
        + ", which lets later stages idle while stage 0 runs several backwards before the next forwards; its "
        "opportunistic rule only fires at R actions. The Varuna engine also pays its per-step overhead "
        "(see overhead.json: segment reseeding through torch.manual_seed). P=4 runs 4 processes on 2 cores. "
        f"Load average during the run: {load0} -> {load1} (other work on the machine adds noise)."
    )
    extra = {"config": {"m": args.m, "micro_batch": MICRO, "T": T, "model": cfg.to_dict(), **opts},
             "per_P": {str(P): {k: v for k, v in r.items() if k != "times"} | {"times": r["times"]} for P, r in per_P.items()},
             "quick": args.quick}
    common.write_results("schedules", figures, notes, machine=common.machine_info(load_average=[load0, load1], idle_before=idle, worker_threads=1),
                         extra=extra, out=args.out)


if __name__ == "__main__":
    main()
