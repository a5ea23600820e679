"""Peak activation memory per stage with recompute vs without (Varuna policy).

Each configuration runs in fresh gloo processes (one per stage) training the benchmark GPT-2
(byte vocabulary, 4 blocks, d=128, T=128, m micro-batches of 4) split into P stages. On every
stage the step runs under ``torch.autograd.graph.saved_tensors_hooks`` that count the bytes of
tensors saved for backward while they are alive (each storage once; parameters and meta-device
stand-ins excluded), plus the bytes of stage inputs stashed for recompute (received activations
held between a no-grad forward and its recompute). The figure per stage is the peak of
saved + stashed bytes over a step (max over the measured steps: Varuna's opportunistic order
depends on arrival times). Process RSS growth over the first step (sampled at the same events)
is reported alongside; it includes allocator behaviour, gradients and receive buffers.

The in-flight cap (``parallel.max_in_flight``, P - stage here: what 1F1B holds) is measured on
Varuna without recompute: it bounds what the opportunistic forwards keep. Reference rows use the
engine's ``1f1b`` policy without recompute (activations of up to P
micro-batches in flight) and ``gpipe`` (all m).

Run: ``.venv/bin/python benchmarks/bench_memory.py [--quick] [--P 2 4] [--m 8]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.setup_path()

import torch  # noqa: E402

SEED = 13
T, MICRO = common.T, common.MICRO
CONFIGS = {  # name -> (policy, recompute)
    "varuna_rc": ("varuna", True),
    "varuna_norc": ("varuna", False),
    "varuna_capped": ("varuna", False),  # in-flight cap P - stage on every stage but the last
    "1f1b_norc": ("1f1b", False),
    "gpipe_norc": ("gpipe", False),
}
LABEL = {"varuna_rc": "Varuna, recompute", "varuna_norc": "Varuna, no recompute",
         "varuna_capped": "Varuna, no recompute, in-flight cap P - stage",
         "1f1b_norc": "1F1B (engine), no recompute", "gpipe_norc": "GPipe (engine), no recompute"}


def worker(rank: int, world: int, out_dir: str, opts: dict) -> None:
    P, m = world, opts["m"]
    policy, recompute = CONFIGS[opts["config"]]
    cfg = common.bench_gpt2_cfg()
    caps = [P - s if s < P - 1 else 0 for s in range(P)] if opts["config"] == "varuna_capped" else None
    eng = common.varuna_engine(cfg, P, m, SEED, policy=policy, recompute=recompute, max_in_flight=caps)
    opt = torch.optim.AdamW(eng.parameters(), lr=1e-3)
    meter = common.ActivationMeter({p.untyped_storage().data_ptr() for p in eng.parameters()})
    common.count_stash(meter, eng)
    B = m * MICRO
    peaks, rss_delta = [], None
    for step in range(opts["steps"]):
        batch = common.make_batch(step, B, T, cfg.vocab_size, seed=2)
        meter.reset_peak()
        first = step == 0
        meter.sample_rss = first
        rss0 = common.rss_bytes()
        meter.rss_peak = rss0
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            eng.step(batch, opt)
        if first:
            rss_delta = meter.rss_peak - rss0
        peaks.append({"peak": meter.peak, "saved": meter.peak_saved, "stash": meter.peak_stash,
                      "live_after": meter.saved + meter.stash})
    common.write_rank(out_dir, rank, {
        "stage": eng.stage, "peaks": peaks, "rss_delta_first_step": rss_delta,
        "describe": eng.describe(),
    })


def run(P: int, config: str, opts: dict, timeout_s: float) -> list[dict]:
    return common.spawn_collect(worker, P, {**opts, "config": config}, timeout_s)[0]


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda ap: common.add_pipeline_args(ap, timeout_s=180.0))
    Ps = args.P
    configs = ["varuna_rc", "varuna_norc", "varuna_capped"] if args.quick else list(CONFIGS)
    opts = {"m": args.m, "steps": 2 if args.quick else 3}
    cfg = common.bench_gpt2_cfg()
    hidden = MICRO * T * cfg.n_embd * 4
    print(f"model: GPT-2 {cfg.n_layer} blocks d={cfg.n_embd} vocab={cfg.vocab_size} T={T}; {args.m} micro-batches x "
          f"{MICRO}; one stage boundary activation = {hidden / 2**20:.2f} MiB; {opts['steps']} steps per run")

    idle = common.wait_for_idle(args.wait_idle)
    load0 = common.load_average()
    t0 = time.monotonic()
    results: dict[int, dict[str, list[dict]]] = {}
    for P in Ps:
        results[P] = {c: run(P, c, opts, args.timeout) for c in configs}
    wall = time.monotonic() - t0

    figures = []
    table = {}
    for P in Ps:
        for s in range(P):
            row = {}
            for c in configs:
                r = results[P][c][s]
                row[c] = {"peak": max(p["peak"] for p in r["peaks"]), "saved": max(p["saved"] for p in r["peaks"]),
                          "stash": max(p["stash"] for p in r["peaks"]), "rss_delta": r["rss_delta_first_step"],
                          "per_step_peaks": [p["peak"] for p in r["peaks"]],
                          "leak": [p["live_after"] for p in r["peaks"]]}
            table[f"P{P}s{s}"] = row
            rc, norc = row["varuna_rc"], row["varuna_norc"]
            figures.append(common.Figure(
                f"P={P} stage {s}: peak activations, recompute vs no recompute", rc["peak"], "B", baseline=norc["peak"],
                detail={"recompute": rc, "no_recompute": norc}))
            if 0 < s < P - 1:  # stage 0's input is the token ids (in the batch anyway); the last stage never recomputes
                figures.append(common.Figure(f"P={P} stage {s}:   of which stashed stage inputs (recompute)", rc["stash"], "B"))
            figures.append(common.Figure(f"P={P} stage {s}:   RSS growth first step, recompute vs not",
                                         float(rc["rss_delta"]), "B", baseline=float(norc["rss_delta"])))
            figures.append(common.Figure(f"P={P} stage {s}:   no recompute, in-flight cap {P - s if s < P - 1 else 0} "
                                         "(0 = none) vs uncapped", row["varuna_capped"]["peak"], "B",
                                         baseline=norc["peak"]))
            for c in configs[3:]:
                figures.append(common.Figure(f"P={P} stage {s}:   reference {LABEL[c]}", row[c]["peak"], "B",
                                             baseline=norc["peak"]))
    common.print_table("Peak activation memory per stage (saved-for-backward + stashed inputs)", figures)
    leaks = {k: {c: v["leak"] for c, v in row.items() if any(v["leak"])} for k, row in table.items()}
    leaks = {k: v for k, v in leaks.items() if v}
    if leaks:
        print(f"\nWARNING: saved tensors still alive after a step: {leaks}")

    notes = (
        f"Saved-for-backward bytes counted with torch.autograd.graph.saved_tensors_hooks (each storage once while any "
        f"saved reference is alive; parameters and meta stand-ins excluded) + stage inputs stashed for recompute; peak "
        f"per stage over a step, max over {opts['steps']} steps; {args.m} micro-batches of {MICRO} x {T} tokens, "
        f"d={cfg.n_embd} (one boundary activation = {hidden / 2**20:.2f} MiB). Recompute keeps, per micro-batch in flight, "
        "only the stage input, plus the full activations of the one micro-batch being recomputed/backpropagated; "
        "without recompute every in-flight micro-batch keeps its full activations, and how many are in flight is "
        "the policy's: 1F1B at most P - stage, GPipe all m, Varuna's opportunistic rule runs any ready forward ahead "
        "of a backward whose gradient has not arrived, so up to m (compare the reference rows). "
        "The last stage never recomputes "
        "(its ratio is ~1). Stage 0's stashed input is the token ids, which stay in the batch anyway (not counted). "
        "RSS growth is sampled at the same events on the first step in a fresh process and includes allocator "
        "caching, gradients and receive buffers: indicative only. "
        f"Workers took {wall:.0f} s in all."
    )
    machine = common.machine_info(idle_before=idle, worker_threads=1, load_average=[load0, common.load_average()])
    extra = {"config": {"m": args.m, "micro_batch": MICRO, "T": T, "model": cfg.to_dict(), **opts},
             "per_stage": table, "quick": args.quick, "saved_alive_after_step": leaks}
    common.write_results("memory", figures, notes, machine=machine, extra=extra, out=args.out)


if __name__ == "__main__":
    main()
