"""Continuing a run folder with a config whose factory arguments differ only as written (a default
spelled out: ``seed: 0`` where the dataset function's default seed is 0) is the same job; other
arguments are refused, with the command the user ran (``varuna train`` or ``varuna launch``) as the
way to continue the run as it was. No worker starts: the checks run before anything does."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from varuna_sdk.config import ConfigError, JobConfig
from varuna_sdk.manager.events import EventLog
from varuna_sdk.runner import NOT_GIVEN, _changes_text, check_continuation, same_call_arguments

pytestmark = pytest.mark.timeout(120)

MODULE = "continue_checks_code"

CODE = textwrap.dedent('''
    def make_data(n=64, seed=0, delay=0.0, **extra):
        raise RuntimeError("the continuation check must not build the data")


    class Model:
        def __init__(self, width=8, depth=2):
            raise RuntimeError("the continuation check must not build the model")
''')


def _config(**data_kwargs) -> dict:
    return {"name": "cont", "model": {"factory": f"{MODULE}:Model", "kwargs": {"width": 8}},
            "data": {"dataset": f"{MODULE}:make_data", "dataset_kwargs": {"n": 64, **data_kwargs},
                     "tokenizer": None, "val_fraction": 0.1},
            "parallel": {"P": 1, "D": 1, "global_batch": 8, "micro_batch_size": 4},
            "train": {"steps": 20, "lr": 0.01}, "launch": {"gpus": 1}}


def _job(**data_kwargs) -> JobConfig:
    return JobConfig.from_dict(_config(**data_kwargs)).validate()


@pytest.fixture
def run(tmp_path, monkeypatch) -> Path:
    """A started run folder (an event log and its config.yaml) of ``_job()``: ``seed`` not given;
    the factories' module importable from the working folder, as the CLI finds it."""
    (tmp_path / f"{MODULE}.py").write_text(CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(MODULE, None)
    folder = tmp_path / "run"
    folder.mkdir()
    with EventLog(folder / "events.db"):   # a started job's log (an empty file: 10 s waiting for its schema)
        pass
    _job().to_yaml(folder / "config.yaml")
    yield folder
    sys.modules.pop(MODULE, None)


def test_a_default_spelled_out_continues_the_run_unchanged(run):
    before = (run / "config.yaml").read_text()
    # seed: 0 and delay: 0.0 are the function's defaults: the same call, no change to report
    assert check_continuation(_job(seed=0), run, "varuna train") == []
    assert check_continuation(_job(seed=0, delay=0.0), run) == []
    assert (run / "config.yaml").read_text() == before
    # a real change beside it is reported alone (not the spelled-out default)
    job = _job(seed=0)
    job.train.lr = 0.02
    assert check_continuation(job, run) == [("train.lr", 0.01, 0.02)]
    # model.kwargs too: depth=2 is Model's default
    job = _job()
    job.model.kwargs = {"width": 8, "depth": 2}
    assert check_continuation(job.validate(), run) == []
    # the optimizer's settings may change (its state still loads); another optimizer's state cannot
    job = _job()
    job.train.optimizer_kwargs = {"betas": [0.9, 0.99]}
    changed = check_continuation(job, run)
    assert changed == [("train.optimizer_kwargs.betas", NOT_GIVEN, [0.9, 0.99])]
    # said as the run had it: a setting it left out is "not given" (it printed "None -> True")
    assert _changes_text(changed) == "train.optimizer_kwargs.betas not given -> [0.9, 0.99]"
    job.train.optimizer = "SGD"
    with pytest.raises(ConfigError, match=r"another optimizer than this config \(train.optimizer: 'AdamW' in the "
                                          r"run, 'SGD' here\)"):
        check_continuation(job, run)
    # a setting whose optimizer needs state the run did not keep (amsgrad's max_exp_avg_sq) crashed the
    # continued run's workers and left it FAILED for good (helper-65): refused before any work
    job = _job()
    job.train.optimizer_kwargs = {"amsgrad": True}
    with pytest.raises(ConfigError, match=r"cannot step from the optimizer state the run saved \(KeyError: "
                                          r"'max_exp_avg_sq'\).*Continue with the run's settings"):
        check_continuation(job, run)
    job.train.optimizer, job.train.optimizer_kwargs = "adamw", {}   # the same class in another case: the same
    assert check_continuation(job, run) == [("train.optimizer", "AdamW", "adamw")]


@pytest.mark.parametrize("kwargs,said", [
    ({"seed": 1}, "data.dataset_kwargs.seed: not given in the run, 1 here"),
    ({"seed": None}, "data.dataset_kwargs.seed: not given in the run, None here"),   # null is not the default 0
    ({"seed": 0, "crop": 4}, "data.dataset_kwargs.crop: not given in the run, 4 here"),  # into **extra
    ({"seed": 0.0}, "data.dataset_kwargs.seed: not given in the run, 0.0 here"),  # another type: not shown the same
])
def test_other_arguments_are_refused_naming_the_command_run(run, kwargs, said):
    with pytest.raises(ConfigError) as e:
        check_continuation(_job(**kwargs), run, "varuna train")
    msg = str(e.value)
    assert said in msg and "other examples" in msg, msg
    assert f"Continue it as it was: `varuna train {run / 'config.yaml'} --run-dir {run}`" in msg, msg
    assert "varuna launch" not in msg, msg
    with pytest.raises(ConfigError, match=r"Continue it as it was: `varuna launch "):
        check_continuation(_job(**kwargs), run)


def test_a_refusal_for_another_field_does_not_import_the_users_code(run):
    job = _job(seed=0)
    job.data.val_fraction = 0.2
    with pytest.raises(ConfigError, match=r"data.val_fraction: 0.1 in the run, 0.2 here"):
        check_continuation(job, run)
    assert MODULE not in sys.modules


def test_arguments_of_a_factory_that_cannot_be_imported_are_compared_as_written(run):
    assert not same_call_arguments("no_such_module_here:make", {"a": 1}, {})
    assert not same_call_arguments("gpt2", {}, {"n_layer": 2})   # a registered model's name: no signature
    assert same_call_arguments(f"{MODULE}:make_data", {"n": 64}, {"n": 64, "seed": 0})
    assert not same_call_arguments(f"{MODULE}:make_data", {"n": 64}, {"n": 64, "seed": 3})
    assert not same_call_arguments(f"{MODULE}:Model", {}, {"height": 3})   # does not fit the signature


def test_varuna_train_on_the_folder_names_varuna_train(run, capsys):
    """In process: ``varuna train CONFIG --run-dir RUN`` refused before anything starts, the message
    naming ``varuna train`` (it named ``varuna launch``, a command the user had not run)."""
    from varuna_sdk.cli import main

    cfg = run.parent / "seed1.yaml"
    _job(seed=1).to_yaml(cfg)
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "data.dataset_kwargs.seed: not given in the run, 1 here" in err, err
    assert f"`varuna train {run / 'config.yaml'} --run-dir {run}`" in err and "varuna launch" not in err, err


TORCH_MODULE = "continue_checks_torch"

TORCH_CODE = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self, width=8, depth=2, classes=4):
            super().__init__()
            self.stem = nn.Linear(6, width)
            self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
            self.head = nn.Linear(width, classes)

        def forward(self, x):
            h = self.stem(x)
            for b in self.blocks:
                h = torch.relu(b(h))
            return self.head(h)


    class Points(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], self.y[i]


    def make_points(n=64, seed=0):
        return Points(n, seed)
''')


def test_a_run_folder_is_continued_with_a_spelled_out_default_and_its_data_digest_agrees(tmp_path, monkeypatch):
    """``prepare_run`` as ``varuna train`` runs it on a started run folder (the model built, the data
    read and its digest compared with the folder's record): ``seed: 0`` spelled out is the job it
    began; ``seed: 1`` (other examples) is refused naming ``varuna train``."""
    from varuna_sdk.runner import DATA_IDENTITY, prepare_run

    (tmp_path / f"{TORCH_MODULE}.py").write_text(TORCH_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(TORCH_MODULE, None)

    def job(**data_kwargs):
        cfg = _config(**data_kwargs)
        cfg["model"] = {"factory": f"{TORCH_MODULE}:Net", "kwargs": {"width": 8}}
        cfg["data"]["dataset"] = f"{TORCH_MODULE}:make_points"
        return JobConfig.from_dict(cfg).validate()

    run = tmp_path / "run"
    prepare_run(job(), run, command="varuna train")
    assert (run / DATA_IDENTITY).is_file()
    with EventLog(run / "events.db"):   # the job started
        pass
    before = (run / "config.yaml").read_text()
    _, out, _ = prepare_run(job(seed=0), run, command="varuna train")
    assert out == run and (run / "config.yaml").read_text() == before
    with pytest.raises(ConfigError, match=r"data.dataset_kwargs.seed: not given in the run, 1 here.*"
                                          r"Continue it as it was: `varuna train "):
        prepare_run(job(seed=1), run, command="varuna train")
    sys.modules.pop(TORCH_MODULE, None)


def test_a_field_left_to_its_default_is_said_so_in_the_refusal(tmp_path):
    """A preset's depth left null in one config and given in the other: "null (its default)", not
    "None here" (helper-68 read None as a broken value)."""
    folder = tmp_path / "run"
    folder.mkdir()
    with EventLog(folder / "events.db"):
        pass
    mine = JobConfig.from_dict({"name": "p", "model": {"preset": "tiny"}, "data": {"tokenizer": "byte", "seq_len": 16},
                                "parallel": {"P": 1, "D": 1, "global_batch": 4, "micro_batch_size": 2}}).validate()
    deeper = JobConfig.from_dict(mine.to_dict())
    deeper.model.n_layer = 8
    deeper.to_yaml(folder / "config.yaml")
    with pytest.raises(ConfigError, match=r"model.n_layer: 8 in the run, null \(its default\) here"):
        check_continuation(mine, folder)
