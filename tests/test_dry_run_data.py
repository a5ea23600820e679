"""The dry run refuses data the workers would fail on (class ids beyond the model's classes, NaN or
inf where the loss would see it) before any worker starts, and accepts data that only looks odd
(an additive -inf attention mask, NaN a model handles itself, NaN in a field nothing reads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from varuna_sdk.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.data.sources import DataError
from varuna_sdk.jobspec import resolve_job

ROOT = Path(__file__).resolve().parents[1]
N, D_IN, CLASSES = 64, 8, 5


class Classifier(nn.Module):
    def __init__(self, classes: int = CLASSES):
        super().__init__()
        self.inp = nn.Linear(D_IN, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class Imputing(Classifier):
    """Missing features (NaN) replaced in the forward: its data may hold NaN."""

    def forward(self, x):
        return super().forward(torch.nan_to_num(x))


class Masked(Classifier):
    """An additive mask (0 kept, -inf dropped) on the features, as attention masks are given."""

    def forward(self, x, mask):
        return super().forward(torch.softmax(x + mask, dim=-1))


class Regressor(Classifier):
    def __init__(self):
        super().__init__(classes=1)


def mse(out, y):
    return torch.nn.functional.mse_loss(out.squeeze(-1), y)


def masked_mse(out, y):
    """Targets missing (NaN) where nothing was measured: left out of the mean."""
    keep = torch.isfinite(y)
    d = torch.where(keep, out.squeeze(-1) - torch.nan_to_num(y), torch.zeros(()))
    return (d * d).sum() / keep.sum()


class Examples(Dataset):
    """``(x, y)`` examples, spoilt by ``kind``: ``range`` labels 10.. everywhere, ``range_after``
    labels 10.. after the first 4 examples (the dry run's micro-batch reads 0..3), ``nan`` a NaN
    feature in example 3, ``nan_after`` in every example after the first 4, ``inf_target`` (``nan_target``)
    float targets with +inf (NaN) in example 1, ``mask`` dict examples with a 0/-inf mask, ``nan_unread`` a dict
    field nothing reads full of NaN."""

    def __init__(self, kind: str = "", n: int = N):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, D_IN, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.kind = kind

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x, y, k = self.x[i].clone(), self.y[i], self.kind
        if k == "range" or (k == "range_after" and i >= 4):
            y = y + 10
        if (k == "nan" and i == 3) or (k == "nan_after" and i >= 4):
            x[2] = float("nan")
        if k in ("inf_target", "nan_target"):
            return x, torch.tensor(float("inf" if k == "inf_target" else "nan") if i == 1 else 0.5)
        if k == "mask":
            mask = torch.zeros(D_IN)
            mask[i % D_IN] = float("-inf")
            return {"x": x, "mask": mask, "y": y}
        if k == "nan_unread":
            return {"x": x, "note": torch.full((2,), float("nan")), "y": y}
        return x, y


def make(kind: str = "", n: int = N) -> Examples:
    return Examples(kind, n)


def _job(tmp_path, kind: str, factory: str = "tests.test_dry_run_data:Classifier", loss=None) -> JobConfig:
    targets = "y" if kind in ("mask", "nan_unread") else None
    return JobConfig(name="dry", model=ModelConfig(factory=factory, loss=loss, targets=targets),
                     data=DataConfig(dataset="tests.test_dry_run_data:make", dataset_kwargs={"kind": kind},
                                     tokenizer=None),
                     parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=4),
                     train=TrainConfig(steps=2, eval_batches=1, run_dir=str(tmp_path / "runs")))


def test_class_ids_beyond_the_models_classes_are_refused_by_the_dry_run(tmp_path):
    """Labels 10..14 for a 5-class output: refused with cross-entropy's message when the job is
    checked (they failed in the workers' first held-out evaluation), in the micro-batch the dry run
    reads and in the held-out batch it reads."""
    with pytest.raises(DataError, match=r"examples 0\.\.3 \(read before any worker starts\): the targets hold "
                                         r"class id 1\d .* output has 5 classes .*map the dataset's labels to 0\.\.4"):
        resolve_job(_job(tmp_path, "range"))
    with pytest.raises(DataError, match=r"held-out examples [\d, …]+ \(read before any worker starts\): the targets "
                                         r"hold class id 1\d"):
        resolve_job(_job(tmp_path, "range_after"))
    resolve_job(_job(tmp_path, ""))   # ids 0..4: fine


def test_nan_or_inf_the_loss_would_see_is_refused_naming_the_example_and_field(tmp_path):
    with pytest.raises(DataError, match=r"example 3's field '0' \(example\[0\]\) holds NaN \(1 of its 8 values; 1 of "
                                         r"examples 0\.\.3, read before .*Clean the data .* filter those examples"):
        resolve_job(_job(tmp_path, "nan"))
    with pytest.raises(DataError, match=r"held-out example \d+'s field '0' \(example\[0\]\) holds NaN \(1 of its 8 "
                                         r"values; 8 of held-out examples [\d, …]+, read before any worker starts"):
        resolve_job(_job(tmp_path, "nan_after"))   # the first held-out batch, read by the check too
    with pytest.raises(DataError, match=r"example 1's field '1' \(example\[1\]\) holds inf .* in the loss's targets"):
        resolve_job(_job(tmp_path, "inf_target", "tests.test_dry_run_data:Regressor", loss="tests.test_dry_run_data:mse"))


def test_data_that_only_looks_non_finite_is_not_refused(tmp_path):
    """An additive mask (0 and -inf), NaN a forward replaces itself (``nan_to_num``), NaN targets a
    loss leaves out, NaN in a field nothing reads: all accepted."""
    resolve_job(_job(tmp_path, "mask", "tests.test_dry_run_data:Masked"))
    resolve_job(_job(tmp_path, "nan", "tests.test_dry_run_data:Imputing"))
    resolve_job(_job(tmp_path, "nan_target", "tests.test_dry_run_data:Regressor", loss="tests.test_dry_run_data:masked_mse"))
    with pytest.raises(DataError, match=r"example 1's field '1' \(example\[1\]\) holds NaN"):
        resolve_job(_job(tmp_path, "nan_target", "tests.test_dry_run_data:Regressor", loss="tests.test_dry_run_data:mse"))
    with pytest.warns(UserWarning, match="note"):
        resolve_job(_job(tmp_path, "nan_unread"))


def test_the_notebook_job_and_the_cli_refuse_it_before_any_run_folder(tmp_path):
    from varuna_sdk.notebook import Job

    runs = tmp_path / "runs"
    with pytest.raises(DataError, match=r"holds NaN"):
        Job(model=Classifier, data=lambda: Examples("nan"), tokenizer=None, P=2, D=1, global_batch=8,
            micro_batch_size=4, steps=2, run_dir=str(runs))
    assert not runs.exists() or not any(runs.iterdir())
    cfg = tmp_path / "job.yaml"
    _job(tmp_path, "range").to_yaml(cfg)
    r = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "train", str(cfg), "--run-dir", str(runs / "r")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "the targets hold class id" in r.stderr and "Traceback" not in r.stderr
    assert not (runs / "r").exists()
