"""The product's front door: `varuna train CONFIG.yaml` and `train_local` with real worker
processes, the metrics file, and errors that stop before any process starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from varuna_sdk.config import ConfigError, DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.runner import train_local


def tiny_job(tmp_path: Path, **parallel) -> JobConfig:
    return JobConfig(
        name="tiny",
        model=ModelConfig(preset="tiny", n_layer=3),
        data=DataConfig(tokenizer="byte", seq_len=32),
        parallel=ParallelConfig(**{"P": 2, "D": 1, "global_batch": 8, "micro_batch_size": 2, **parallel}),
        train=TrainConfig(steps=12, lr=3e-3, warmup_steps=2, eval_batches=2, run_dir=str(tmp_path / "runs")),
    )


@pytest.mark.timeout(180)
def test_train_local_writes_metrics_and_learns(tmp_path):
    job = tiny_job(tmp_path, P=2, D=2)
    job.launch.gpus = 2   # fewer than P x D: trained anyway, with a warning that the workers share devices
    with pytest.warns(UserWarning, match=r"P=2 x D=2 starts 4 local workers, more than launch.gpus=2; they share"):
        res = train_local(job)
    rows = res.metrics()
    assert [r["step"] for r in rows] == list(range(12))
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["examples_per_s"] > 0 for r in rows)
    assert rows[0]["P"] == 2 and rows[0]["D"] == 2
    # examples/s is global batch / step time, tokens/s adds the sequence length
    r = rows[-1]
    assert r["examples_per_s"] == pytest.approx(8 / r["step_time_s"], rel=1e-6)
    assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["step_time_s"], rel=1e-6)
    s = res.summary
    assert s["ppl_end"] < s["ppl_start"], s  # byte-level text is learnable within 12 steps
    assert (res.run_dir / "config.yaml").exists()
    assert JobConfig.from_yaml(res.run_dir / "config.yaml") == JobConfig.from_dict(json.loads(json.dumps(job.to_dict())))


@pytest.mark.timeout(180)
def test_cli_train_runs_yaml_and_reports_errors(tmp_path):
    job = tiny_job(tmp_path, P=3, D=1)
    job.train.steps = 3
    cfg = tmp_path / "job.yaml"
    job.to_yaml(cfg)
    out = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "train", str(cfg), "--run-dir", str(tmp_path / "mine")],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step    3/3" in out.stdout and "held-out perplexity" in out.stdout
    # --run-dir is the job's own folder (as for `varuna launch`), with the event log the dashboard reads
    assert (tmp_path / "mine" / "events.db").is_file() and (tmp_path / "mine" / "summary.json").is_file()
    # a bad batch identity fails at once, with the valid choices, and starts nothing
    bad = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "train", str(cfg), "--global-batch", "100", "--D", "3"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "not divisible by D=3" in bad.stderr and "Valid D" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "train", str(tmp_path / "nope.yaml")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_invalid_job_fails_before_start(tmp_path):
    job = tiny_job(tmp_path, P=2, D=1)
    job.train.precision = "fp8"
    with pytest.raises(ConfigError, match="fp8"):
        train_local(job)
    assert not (tmp_path / "runs").exists()
    job = tiny_job(tmp_path, P=2, D=1)
    job.model.preset = "gpt5"
    with pytest.raises(ValueError, match="unknown GPT-2 preset"):
        train_local(job)


def test_pipeline_deeper_than_model_fails_before_start(tmp_path):
    from varuna_sdk.model.partition import PartitionError

    job = tiny_job(tmp_path, P=6, D=1)  # tiny n_layer=3 -> 5 segments
    with pytest.raises(PartitionError, match="P=6 is larger than the model's 5 segments"):
        train_local(job)
    assert not (tmp_path / "runs").exists()
