"""One-GPU readiness check (issue 18, item 6): run by ``scripts/gpu_check.sh``, never by CI.

On ``cuda:0`` it measures, for a GPT-2 (12 blocks, d=768, T=512, GPT-2 vocabulary, dropout 0):
  1. the engine at P=1 vs a plain PyTorch loop on the same weights and batches — fp32, bf16
     (autocast) and fp16 (autocast + loss scaler: the engine's own, torch.amp.GradScaler in the
     loop) — per-step losses (largest relative difference) and the median step-time ratio;
  2. calibration on CUDA (``profiling.calibrate``, no network probes: one GPU);
  3. the simulator's prediction for P=1 (``planner.plan`` on that profile) vs the measured step;
  4. tokens/s and model FLOPs utilisation (6 x parameters x tokens + attention, over the
     H200's dense bf16 peak 989 TFLOP/s, fp32 against 67 TFLOP/s);
  5. a class id beyond a classifier's logits: a clear error, not a device-side assert.
One GPU cannot host several NCCL ranks, so multi-rank NCCL stays unverified here.
Prints one JSON document (also written to $OUT/gpu_check.json when OUT is set).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from varuna_sdk.config import ParallelConfig  # noqa: E402
from varuna_sdk.model import build_on_meta, gpt2, init_gpt2, lm_loss, materialize, preset  # noqa: E402
from varuna_sdk.pipeline.engine import Varuna  # noqa: E402

# GPU_CHECK_DRY=1: the same code on the CPU with a tiny model, to try the script without a GPU
DRY = os.environ.get("GPU_CHECK_DRY") == "1"
DEV = torch.device("cpu" if DRY else "cuda:0")
SEED, MICRO, M, T = 5, (2 if DRY else 8), 4, (32 if DRY else 512)
STEPS, WARMUP = (2, 1) if DRY else (8, 3)
PEAK_FLOPS = {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12}  # H200 dense (SXM datasheet)
CFG = (preset("cpu-demo", n_layer=2, n_embd=64, n_head=2, block_size=T, vocab_size=256, dropout=0.0) if DRY else
       preset("cpu-demo", n_layer=12, n_embd=768, n_head=12, block_size=T, vocab_size=50304, dropout=0.0))


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (MICRO * M, T + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def run_engine(precision: str) -> dict:
    par = ParallelConfig(P=1, D=1, global_batch=MICRO * M, micro_batch_size=MICRO)
    eng = Varuna(lambda: gpt2(CFG), lm_loss, par, (torch.zeros(MICRO, T, dtype=torch.long),), seed=SEED,
                 init_fn=partial(init_gpt2, n_layer=CFG.n_layer), precision=precision, device=DEV)
    opt = torch.optim.AdamW(eng.parameters(), lr=1e-4)
    losses, times = [], []
    for step in range(WARMUP + STEPS):
        out = {}
        dt = timed(lambda: out.setdefault("r", eng.step(batch(step), opt)))
        losses.append(out["r"].loss)
        if step >= WARMUP:
            times.append(dt)
    n_params = sum(p.numel() for p in eng.parameters())
    return {"losses": losses, "step_s": statistics.median(times), "params": n_params}


def run_plain(precision: str) -> dict:
    model = build_on_meta(lambda: gpt2(CFG))
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    materialize(model, names, seed=SEED, device=DEV, init_fn=partial(init_gpt2, n_layer=CFG.n_layer))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(DEV.type, init_scale=2.0 ** 16, enabled=precision == "fp16")
    losses, times = [], []

    def step(k: int) -> None:
        x, y = batch(k)
        x, y = x.to(DEV), y.to(DEV)
        total = torch.zeros((), device=DEV)
        for j in range(M):
            sl = slice(j * MICRO, (j + 1) * MICRO)
            with torch.autocast(DEV.type, dtype=dtype, enabled=dtype is not None):
                loss = lm_loss(model(x[sl]), y[sl])
            scaler.scale(loss / M).backward()
            total += loss.detach() / M
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))

    for k in range(WARMUP + STEPS):
        dt = timed(lambda: step(k))
        if k >= WARMUP:
            times.append(dt)
    return {"losses": losses, "step_s": statistics.median(times)}


def flops_per_step() -> float:
    n = sum(p.numel() for p in build_on_meta(lambda: gpt2(CFG)).parameters())
    tokens = MICRO * M * T
    return 6 * n * tokens + 12 * CFG.n_layer * CFG.n_embd * T * tokens  # weights + attention (fwd + bwd)


def check_precision(precision: str) -> dict:
    eng, ref = run_engine(precision), run_plain(precision)
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(eng["losses"], ref["losses"]))
    tokens = MICRO * M * T
    return {"precision": precision, "engine_losses": eng["losses"], "plain_losses": ref["losses"],
            "max_rel_loss_diff": rel, "engine_step_s": eng["step_s"], "plain_step_s": ref["step_s"],
            "engine_over_plain_time": eng["step_s"] / ref["step_s"],
            "engine_tokens_per_s": tokens / eng["step_s"],
            "mfu": flops_per_step() / eng["step_s"] / PEAK_FLOPS[precision]}


def check_calibration_and_simulator(measured_step_s: float) -> dict:
    from varuna_sdk.planner.plan import plan
    from varuna_sdk.profiling.calibrate import calibrate

    def make_batch(b: int):
        x, y = batch(0)
        return (x[:b],), y[:b]

    t0 = time.perf_counter()
    prof = calibrate(lambda: gpt2(CFG), lm_loss, make_batch, (MICRO // 2, MICRO), seed=SEED,
                     init_fn=partial(init_gpt2, n_layer=CFG.n_layer), network=False, device=DEV, repeats=5)
    cal_s = time.perf_counter() - t0
    pl = plan(prof, 1, MICRO * M, micro_batch_sizes=[MICRO])
    pred = pl.best.time_s
    return {"calibration_s": cal_s, "predicted_step_s": pred, "measured_step_s": measured_step_s,
            "prediction_error": pred / measured_step_s - 1.0}


def check_class_ids() -> dict:
    """5. A class id beyond the logits on CUDA: the engine's last stage checks the targets' host
    copy (``model.spec.check_class_ids``) and raises the ``ModelSpecError`` naming it, instead of
    a device-side assert that poisons the process; a good step on the same engine follows."""
    from varuna_sdk.model.spec import ModelSpecError, cross_entropy

    par = ParallelConfig(P=1, D=1, global_batch=8, micro_batch_size=4)
    eng = Varuna(lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
                 cross_entropy, par, (torch.zeros(4, 16),), seed=SEED, device=DEV)
    opt = torch.optim.AdamW(eng.parameters(), lr=1e-3)
    x, bad = torch.randn(8, 16), torch.tensor([0, 1, 2, 3, 0, 1, 7, 2])
    said = None
    try:
        eng.step(((x,), bad), opt)
    except ModelSpecError as e:
        said = str(e)
    good = eng.step(((x,), bad.clamp(max=3)), opt).loss
    sync()
    return {"error_named_the_id": said is not None and "class id 7" in said, "message": said,
            "good_step_after_loss": good}


def main() -> None:
    if not DRY and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device visible"}))
        sys.exit(2)
    out: dict = {"torch": torch.__version__, "device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(0),
                 "model": CFG.to_dict(),
                 "micro_batch": MICRO, "m": M, "T": T, "steps": STEPS, "results": [], "errors": []}
    for precision in ("fp32", "bf16") if DRY else ("fp32", "bf16", "fp16"):
        try:
            out["results"].append(check_precision(precision))
        except Exception:  # noqa: BLE001 - every part reports, one failure does not hide the rest
            out["errors"].append({"part": precision, "traceback": traceback.format_exc()})
    fp32 = next((r for r in out["results"] if r["precision"] == "fp32"), None)
    if fp32 is not None:
        try:
            out["simulator"] = check_calibration_and_simulator(fp32["engine_step_s"])
        except Exception:  # noqa: BLE001
            out["errors"].append({"part": "calibration/simulator", "traceback": traceback.format_exc()})
    try:   # last: were the check missing, a device-side assert would poison the process
        out["class_ids"] = check_class_ids()
    except Exception:  # noqa: BLE001
        out["errors"].append({"part": "class ids", "traceback": traceback.format_exc()})
    text = json.dumps(out, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
    sys.exit(1 if out["errors"] else 0)


if __name__ == "__main__":
    main()
