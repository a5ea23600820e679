"""``scripts/gpu_check.py`` (the one-GPU readiness check) dry-run on the CPU with a tiny model, so
the script a GPU session runs once cannot rot unnoticed: every part runs, the engine at P=1 and
the plain PyTorch loop give the same fp32 losses, and the JSON carries every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["errors"] == []
    by = {r["precision"]: r for r in doc["results"]}
    assert set(by) == {"fp32", "bf16"}
    assert by["fp32"]["max_rel_loss_diff"] < 1e-5, by["fp32"]
    assert by["bf16"]["max_rel_loss_diff"] < 1e-2, by["bf16"]
    for r in by.values():
        assert r["engine_step_s"] > 0 and r["plain_step_s"] > 0 and r["engine_tokens_per_s"] > 0 and r["mfu"] > 0
    sim = doc["simulator"]
    assert sim["predicted_step_s"] > 0 and sim["measured_step_s"] > 0
