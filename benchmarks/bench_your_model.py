"""Your own model through the engine: a Hugging Face ``GPT2LMHeadModel`` at P=1, D=1 vs a plain
PyTorch training loop on the same model and batches; and its calibration time.

The job names the model as a user would (``model.factory: hf-causal-lm``, ``model_type: gpt2``,
4 layers, d=128, byte vocabulary, 128 positions; random weights, nothing downloaded) and its data
as a text file (1 MB of Shakespeare), so the figures include everything the product adds for a
third-party model: the model spec's call (``input_ids=``, ``labels=`` → the model's own loss),
cut-point hooks at every decoder layer, the segment RNG, the engine's step. The baseline is what
a user writes: the same ``GPT2LMHeadModel`` (built by the same factory, without cut-points),
loaded with the engine's initial weights, gradient accumulation over the same m micro-batches
(``model(input_ids=x, labels=x).loss / m``), the same AdamW. Both run in this process in
alternating rounds (rotating order); the figure is the median time per optimizer step, target
engine / plain <= 1.05 (DESIGN.md). Loss trajectories must agree (fp32, no dropout).

Calibration: ``profiling.job.calibrate_job`` of the same job from scratch (fresh cache folder): every
segment at micro-batch sizes 1, 2, 4, the engine's fixed costs and the p2p / all-reduce probes;
target < 60 s.

Run: ``.venv/bin/python benchmarks/bench_your_model.py [--quick]``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.setup_path()

import torch  # noqa: E402

from varuna_sdk.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from varuna_sdk.jobspec import hf_causal_lm  # noqa: E402
from varuna_sdk.model.materialize import build_on_meta, materialize  # noqa: E402
from varuna_sdk.profiling.job import calibrate_job  # noqa: E402
from varuna_sdk.trainer import build_engine, resolve  # noqa: E402

SEED = 7
LR = 1e-3
CAL_TARGET_S = 60.0
MODEL = {"model_type": "gpt2", "n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 128,
         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def job_config(text: Path, b: int, m: int) -> JobConfig:
    return JobConfig(name="bench-your-model", model=ModelConfig(factory="hf-causal-lm", kwargs=dict(MODEL)),
                     data=DataConfig(path=str(text), tokenizer="byte", seq_len=common.T),
                     parallel=ParallelConfig(P=1, D=1, global_batch=b * m, micro_batch_size=b),
                     train=TrainConfig(lr=LR, seed=SEED, grad_clip=None)).validate()


class PlainLoop:
    """What a user writes for a Hugging Face model: accumulate m micro-batches, AdamW."""

    def __init__(self, job: JobConfig, r, b: int, m: int):
        meta = build_on_meta(r.spec.factory)
        names = [n for n, _ in meta.named_parameters()] + [n for n, _ in meta.named_buffers()]
        materialize(meta, names, seed=SEED, device="cpu", init_fn=r.spec.init_fn)  # the engine's weights
        start = dict(meta.state_dict(keep_vars=True))
        self.model = hf_causal_lm(**MODEL, vocab_size=256)
        self.model.config.use_cache = False
        with torch.no_grad():
            for n, t in list(self.model.named_parameters()) + list(self.model.named_buffers()):
                t.copy_(start[n])
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.b, self.m = b, m
        self.phase: dict[str, float] = {}
        common.timed_optimizer(self.opt, self.phase)

    def step(self, fields) -> tuple[float, dict, float]:
        x, b = fields["input_ids"], self.b
        return common.accumulated_step(
            lambda i: self.model(input_ids=x[i * b:(i + 1) * b], labels=x[i * b:(i + 1) * b]).loss,
            self.m, self.opt, self.phase)


class Engine:
    """The same job through ``Varuna(...).step`` at P=1, D=1, as ``trainer`` builds it."""

    def __init__(self, job: JobConfig, r):
        self.eng = build_engine(job, 0, r)
        self.r = r
        self.opt = torch.optim.AdamW(self.eng.parameters(), lr=LR)
        self.phase: dict[str, float] = {}
        common.timed_optimizer(self.opt, self.phase)

    def step(self, fields) -> tuple[float, dict, float]:
        t0 = time.perf_counter()
        res = self.eng.step(self.r.split(fields), self.opt)
        dt = time.perf_counter() - t0
        ph = {"fwd": res.compute_s.get("F", 0.0), "bwd": res.compute_s.get("B", 0.0) + res.compute_s.get("R", 0.0),
              "opt": self.phase.pop("opt", 0.0)}
        ph["other"] = dt - sum(ph.values())
        return dt, ph, res.loss


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda ap: ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1)"))
    torch.set_num_threads(args.threads)
    b, m = common.MICRO, 4
    work = Path(tempfile.mkdtemp(prefix="bench-your-model-"))
    from varuna_sdk.data.corpus import shakespeare_text

    text = work / "shakespeare-1mb.txt"
    text.write_text(shakespeare_text()[:1_000_000], encoding="utf-8")
    job = job_config(text, b, m)
    r = resolve(job)
    rounds, warmup = (3, 1) if args.quick else (16, 3)
    print(f"model: {r.spec.name} ({MODEL['n_layer']} layers, d={MODEL['n_embd']}, byte vocab, T={common.T}); "
          f"call {r.spec.call.describe()}; batch {b * m} = {m} micro-batches x {b}; AdamW; fp32; "
          f"torch threads={args.threads}; {rounds} rounds after {warmup} warm-up")
    loader, _ = r.data.loaders(job.data.seq_len, job.parallel.global_batch, job.data.seed, job.data.val_fraction, 1)
    systems = {"plain": PlainLoop(job, r, b, m), "engine": Engine(job, r)}
    times = {k: [] for k in systems}
    phases = {k: [] for k in systems}
    losses = {k: [] for k in systems}
    step_of = {k: 0 for k in systems}

    def run(name: str, n: int, record: bool) -> None:
        for _ in range(n):
            dt, ph, loss = systems[name].step(loader.batch(step_of[name]))
            losses[name].append(loss)
            step_of[name] += 1
            if record:
                times[name].append(dt)
                phases[name].append(ph)

    idle = common.wait_for_idle(args.wait_idle)
    load0 = common.load_average()
    names = list(systems)
    for name in names:
        run(name, warmup, record=False)
    for k in range(rounds):
        for name in names[k % 2:] + names[:k % 2]:
            run(name, 1, record=True)
    n = min(len(losses["plain"]), len(losses["engine"]))
    max_rel = max(abs(a - c) / max(abs(a), 1e-12) for a, c in zip(losses["plain"][:n], losses["engine"][:n]))
    st = {k: common.stats(v) for k, v in times.items()}
    paired = [e / p for e, p in zip(times["engine"], times["plain"])]
    phase_names = ("fwd", "bwd", "opt", "other")
    ph_med = {k: {p: common.median([d[p] for d in phases[k]]) for p in phase_names} for k in systems}
    step_fig = common.Figure("time per step, HF GPT-2 through the engine (P=1,D=1) vs plain loop",
                             st["engine"]["median"], "s", baseline=st["plain"]["median"], target="<= 1.05",
                             detail={"engine": st["engine"], "plain": st["plain"],
                                     "median_of_paired_ratios": common.median(paired)})
    figures = [step_fig]
    for p in phase_names:
        figures.append(common.Figure(f"  phase {p} (engine vs plain)", ph_med["engine"][p], "s",
                                     baseline=ph_med["plain"][p]))
    figures.append(common.Figure("max relative loss difference engine vs plain", max_rel, "",
                                 detail={"steps_compared": n}))

    cache = work / "profiles"
    t0 = time.perf_counter()
    prof = calibrate_job(job, cache_dir=cache, refresh=True, resolved=r)
    cal_s = time.perf_counter() - t0
    figures.append(common.Figure(f"calibration of the HF GPT-2 (target < {CAL_TARGET_S:.0f} s)", cal_s, "s",
                                 ratio=cal_s / CAL_TARGET_S, target="< 1",
                                 detail={"segments": prof.num_segments, "micro_batch_sizes": prof.micro_batch_sizes,
                                         "identity": prof.model.get("identity")}))
    common.print_table("Your own model: Hugging Face GPT-2 through the engine", figures)
    notes = (f"{r.spec.name} from a config ({MODEL}), byte vocabulary, T={common.T}, named by the job as "
             f"model.factory=hf-causal-lm and called {r.spec.call.describe()}; data: 1 MB of Shakespeare as a text "
             f"file. Baseline: the same model built by the same factory, the engine's initial weights, "
             f"model(input_ids, labels).loss over {m} micro-batches of {b}, AdamW lr={LR}, fp32; alternating rounds "
             f"in one process. Median engine/plain {step_fig.ratio:.3f} (paired {common.median(paired):.3f}; target "
             f"<= 1.05: {'met' if step_fig.met else 'NOT met'}); losses agree to {max_rel:.1e}. Calibration "
             f"{cal_s:.1f} s (target < {CAL_TARGET_S:.0f} s: {'met' if cal_s < CAL_TARGET_S else 'NOT met'}).")
    common.write_results("your_model", figures, notes,
                         machine=common.machine_info(torch_threads=args.threads,
                                                     load_average=[load0, common.load_average()], idle_before=idle),
                         extra={"config": {"model": MODEL, "T": common.T, "micro_batch": b, "m": m, "rounds": rounds,
                                           "warmup": warmup}, "phase_medians_s": ph_med, "quick": args.quick},
                         out=args.out)


if __name__ == "__main__":
    main()
