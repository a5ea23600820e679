"""Where a job keeps its run, and what a user is told before any work: a folder *of* runs given as
a job's own run folder is refused by every front door (``prepare_run``, ``Job()``, ``varuna train
--run-dir``), naming what to pass instead; ``varuna status`` (``find_runs``) still lists run folders
that ended up inside another run folder; a refused job says its own error without an unrelated
warning first; a typo in ``model.kwargs`` names the factory, the key, the likely one and the
factory's parameters; ``micro_batch_size=None`` says what null would mean; ``varuna config`` marks
the demo's own values beside the defaults; and the optimiser the README spells out for a
hand-written loop gives the pipeline's reference losses. All fast (no worker process starts)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from varuna_sdk.config import ConfigError, DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.config.checks import keyword_problem

README = Path(__file__).resolve().parents[1] / "README.md"


def _fake_runs(root: Path, *names: str) -> list[Path]:
    """Run folders as ``find_runs`` knows them (each holding ``events.db``)."""
    out = []
    for n in names:
        (root / n).mkdir(parents=True)
        (root / n / "events.db").write_bytes(b"")
        (root / n / "config.yaml").write_text("name: x\n")
        out.append(root / n)
    return out


def _job(tmp_path: Path, **parallel) -> JobConfig:
    return JobConfig(name="classify", model=ModelConfig(factory="tests.thirdparty.user_data:Classifier"),
                     data=DataConfig(dataset="tests.thirdparty.user_data:make_dataset", dataset_kwargs={"n": 64},
                                     tokenizer=None),
                     parallel=ParallelConfig(**{"P": 2, "D": 1, "global_batch": 8, "micro_batch_size": 2, **parallel}),
                     train=TrainConfig(steps=2, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "runs")))


def _no_work(monkeypatch):
    """Fail the test if the model or the data were resolved (the refusal must come first)."""
    import varuna_sdk.trainer as trainer

    def boom(*a, **k):
        raise AssertionError("resolved the job before refusing its run folder")
    monkeypatch.setattr(trainer, "resolve", boom)


SAID = (r"run folder '.*/runs' is a folder of runs, not a job's own run folder: it holds 4 run folder\(s\) "
        r"\(a, b, c and 1 more\), and a run folder holds one job\. Give a new folder inside it \(--run-dir "
        r".*/runs/classify; in a notebook Job\(\.\.\., run_dir='.*/runs/classify'\)\), or leave the run folder out "
        r"and set train\.run_dir: .*/runs \(--run-dir left out; in a notebook Job\(\.\.\., train_run_dir='.*/runs'\)\)")


def test_a_folder_of_runs_is_refused_as_a_run_folder_before_any_work(tmp_path, monkeypatch):
    from varuna_sdk.runner import prepare_run, train_local

    root = tmp_path / "runs"
    _fake_runs(root, "a", "b", "c", "d")
    (root / "notes").mkdir()   # a folder that is no run is not counted
    job = _job(tmp_path, P=8)   # more workers than launch.gpus: no warning before the refusal either
    job.launch.gpus = 2
    _no_work(monkeypatch)
    with pytest.raises(ConfigError, match=SAID):
        prepare_run(job, root)
    with warnings.catch_warnings(record=True) as got, pytest.raises(ConfigError, match=SAID):
        warnings.simplefilter("always")
        train_local(job, run_dir=root)   # `varuna train --run-dir runs`
    assert not [w for w in got if "local workers" in str(w.message)]
    assert sorted(p.name for p in root.iterdir()) == ["a", "b", "c", "d", "notes"]   # nothing written there

    from varuna_sdk.notebook import Job

    with pytest.raises(ConfigError, match=SAID):
        Job(model="tests.thirdparty.user_data:Classifier", data="tests.thirdparty.user_data:make_dataset",
            tokenizer=None, P=2, D=1, global_batch=8, micro_batch_size=2, steps=2, run_dir=root, name="classify")


def test_what_the_refusal_says_to_pass_works(tmp_path, monkeypatch):
    """A new folder inside, or ``train_run_dir`` with no run folder: both accepted (no refusal)."""
    from varuna_sdk.runner import check_run_dir, new_run_dir

    root = tmp_path / "runs"
    _fake_runs(root, "a")
    check_run_dir(root / "classify", "classify")   # a new folder inside: fine
    check_run_dir(root / "a", "classify")          # a run folder itself: continued (or refused) as before
    check_run_dir(tmp_path / "empty", "classify")  # not there yet ...
    check_run_dir(tmp_path / "new" / "deeper", "classify")
    assert not (tmp_path / "empty").exists() and not (tmp_path / "new").exists()   # ... and still not: tried, removed
    # a folder that cannot be made is refused at once (it failed after a calibration: helper-68)
    with pytest.raises(ConfigError, match=r"--run-dir '/proc/varuna-x': the run folder cannot be made \(No such file"):
        check_run_dir("/proc/varuna-x", "classify")
    job = _job(tmp_path)
    job.train.run_dir = str(root)
    made = new_run_dir(job)
    assert made.parent == root and made.name.startswith("classify-")
    from varuna_sdk.notebook.arguments import apply_settings

    apply_settings(job, {"train_run_dir": str(tmp_path / "elsewhere")})   # the notebook spelling named
    assert job.train.run_dir == str(tmp_path / "elsewhere")


def test_a_run_folder_that_holds_other_runs_says_so_when_another_job_is_refused(tmp_path):
    from varuna_sdk.runner import prepare_run

    root = tmp_path / "runs"
    root.mkdir()
    other = _job(tmp_path)
    other.model.kwargs = {"depth": 2}
    other.to_yaml(root / "config.yaml")
    (root / "events.db").write_bytes(b"")
    _fake_runs(root, "cnn1", "resmlp1")
    with pytest.raises(ConfigError, match=r"holds a job that trains another model.*Note: .*/runs also holds 2 run "
                                          r"folder\(s\) of other jobs inside it \(cnn1, resmlp1\): to start a new job "
                                          r"beside them, give a new folder inside it"):
        prepare_run(_job(tmp_path), root)


def test_status_lists_run_folders_inside_a_run_folder(tmp_path):
    from varuna_sdk.manager.runs import find_runs

    root = tmp_path / "runs"
    inner = _fake_runs(root, "old", "new")
    import os

    os.utime(inner[0] / "events.db", (1, 1))   # "old" is older
    assert find_runs(root) == [root / "new", root / "old"]   # a folder of runs: its runs, newest first
    (root / "events.db").write_bytes(b"")      # the folder was made a job's run folder itself
    assert find_runs(root) == [root, root / "new", root / "old"]
    assert find_runs(root / "new") == [root / "new"]   # a plain run folder: itself (gen0/, checkpoints/ are no runs)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_runs(tmp_path / "nowhere")


def test_a_refused_job_says_its_own_error_without_the_shared_workers_warning(tmp_path):
    from varuna_sdk.model.partition import PartitionError
    from varuna_sdk.runner import train_local

    job = _job(tmp_path, P=8)
    job.launch.gpus = 2
    with warnings.catch_warnings(record=True) as got, pytest.raises(PartitionError, match="P=8 is larger"):
        warnings.simplefilter("always")
        train_local(job, run_dir=tmp_path / "run")
    assert not [w for w in got if "local workers" in str(w.message)], [str(w.message) for w in got]
    assert not (tmp_path / "run").exists()


def build(d_in=16, d=32, layers=4, classes=5):
    return torch.nn.Linear(d_in, classes)


class Net(torch.nn.Module):
    def __init__(self, features=16, *, hidden=32):
        super().__init__()


def test_keyword_problem_names_the_key_the_likely_one_and_the_parameters():
    said = keyword_problem(build, {"d_in": 16, "layer": 4}, "the model factory mypkg:build", "model.kwargs")
    assert said == ("model.kwargs gives the model factory mypkg:build the keyword(s) 'layer' (did you mean 'layers'?), "
                    "which it does not take; it takes (d_in=16, d=32, layers=4, classes=5): fix or remove the key in "
                    "model.kwargs")
    assert "'depth', which" in keyword_problem(Net, {"depth": 2}, "Net", "model.kwargs")   # a class: no self
    assert "it takes (features=16, hidden=32)" in keyword_problem(Net, {"depth": 2}, "Net", "model.kwargs")
    assert keyword_problem(build, {"layers": 2}, "b", "model.kwargs") is None   # fits: the error is the body's
    assert keyword_problem(lambda **kw: None, {"x": 1}, "f", "model.kwargs") is None   # takes anything


def test_a_model_kwargs_typo_names_factory_key_and_parameters(tmp_path):
    from varuna_sdk.trainer import resolve

    job = _job(tmp_path)
    job.model.kwargs = {"hiden": 8}
    with pytest.raises(ConfigError, match=r"^model\.kwargs gives the model factory tests\.thirdparty\.user_data:"
                                          r"Classifier the keyword\(s\) 'hiden' \(did you mean 'hidden'\?\), which it "
                                          r"does not take; it takes \(features=16, hidden=32, depth=3, classes=4\)"):
        resolve(job)
    from varuna_sdk.notebook import Job
    from tests.thirdparty.user_data import Classifier, make_dataset

    class Mine(Classifier):   # defined here: shipped by value
        pass

    with pytest.raises(ConfigError, match=r"gives the model factory .*Mine the keyword\(s\) 'dpeth' \(did you mean "
                                          r"'depth'\?\)"):
        Job(model=Mine, data=make_dataset(64), tokenizer=None, kwargs={"dpeth": 2}, P=1, D=1, global_batch=8,
            micro_batch_size=2, steps=2)


def test_micro_batch_size_none_says_what_null_would_mean():
    cfg = JobConfig(parallel=ParallelConfig(P=None, D=None, micro_batch_size=None))
    with pytest.raises(ConfigError, match=r"parallel\.micro_batch_size=None must be an integer >= 1: with P or D null "
                                          r"the first plan chooses the micro-batch size itself"):
        cfg.validate()
    with pytest.raises(ConfigError, match=r"null would let the planner choose only with P or D null"):
        JobConfig(parallel=ParallelConfig(P=1, D=1, micro_batch_size=None)).validate()
    readme = " ".join(README.read_text().split())
    assert "with P or D null the first plan chooses the micro-batch size, replacing the config's " \
           "`micro_batch_size` — still an integer" in readme


def test_varuna_config_marks_the_demos_own_values_beside_the_defaults(capsys):
    from varuna_sdk.cli import _main
    from varuna_sdk.demo import demo_config

    assert _main(["config"]) == 0
    text = capsys.readouterr().out
    assert JobConfig.from_dict(yaml.safe_load(text)) == demo_config()   # still the demo's config, as YAML
    lines = text.splitlines()
    assert lines[0].startswith("# values marked `the demo's` are the demo's own")
    assert "  lr: 0.002   # the demo's; left out: 0.001" in lines
    assert "  min_lr: 0.0002   # the demo's; left out: 0.0001" in lines
    assert "  weight_decay: 0.1" in lines   # the default: unmarked
    defaults = TrainConfig()
    assert (defaults.lr, defaults.min_lr) == (0.001, 0.0001)


def test_the_readme_optimiser_in_a_hand_written_loop_gives_the_reference_losses(tmp_path):
    """The paragraph beside ``plain_pytorch_losses``: AdamW betas (0.9, 0.95), decay on dim >= 2
    only, warm-up then cosine to min_lr, each micro-batch's loss / m, global-norm clipping."""
    from varuna_sdk.notebook import Job
    from tests.thirdparty.user_data import Classifier

    readme = " ".join(README.read_text().split())
    for said in ("`betas=(0.9, 0.95)`", "`p.dim() >= 2`", "`lr * (step + 1) / warmup_steps`",
                 "`min_lr + 0.5 * (lr - min_lr) * (1 + cos(pi * (step - warmup_steps) / max(1, steps - warmup_steps)))`",
                 "`torch.nn.utils.clip_grad_norm_(params, train.grad_clip)`"):
        assert said in readme, said
    steps, lr, min_lr, warm, clip, wd = 5, 3e-2, 2e-3, 2, 0.5, 0.1
    job = Job(model="tests.thirdparty.user_data:Classifier", data="tests.thirdparty.user_data:make_dataset",
              tokenizer=None, P=1, D=1, global_batch=16, micro_batch_size=4, steps=steps, lr=lr, min_lr=min_lr,
              warmup_steps=warm, grad_clip=clip, weight_decay=wd, run_dir=tmp_path / "run")
    ref = job.plain_pytorch_losses(steps=steps)
    m = Classifier()
    m.load_state_dict(job.initial_weights())
    ps = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))

    def lr_at(step):
        if step < warm:
            return lr * (step + 1) / warm
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
    mine = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        mbs = job.batch(step)
        total = 0.0
        for x, y in mbs:
            x = x[0] if isinstance(x, (tuple, list)) else x
            loss = torch.nn.functional.cross_entropy(m(x), y) / len(mbs)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()
        opt.zero_grad()
        mine.append(total)
    assert mine == pytest.approx(ref, rel=1e-6)
