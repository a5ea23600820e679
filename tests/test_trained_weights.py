"""The end of a run and its continuation, with real worker processes (``varuna train``'s path:
the manager, P=2 gloo workers):

- a finished run checkpoints its last step whatever ``checkpoint_every`` is, and its trained
  model comes back whole — ``Job.trained_weights()`` and ``varuna export`` — equal to the same
  steps of plain PyTorch (``varuna_sdk.reference``) and with ``initial_weights()``'s keys;
- a stopped run whose checkpoints are gone or all torn is refused before any worker starts (not
  restarted from step 0 with its first steps recorded twice), and stays STOPPED;
- ``train.resume: false`` on a stopped run is refused before any worker starts, the run left
  STOPPED and continued afterwards with ``resume: true``;
- a ``train.checkpoint_url`` under a file is refused with the config, leaving no run behind;
- a resume that skips torn checkpoints says "starting from scratch" once, naming each.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from varuna_sdk.checkpoint import CheckpointError, Store, complete_checkpoints
from varuna_sdk.config import ConfigError, DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.manager.events import Kind
from varuna_sdk.manager.runs import read_run, request_stop
from varuna_sdk.model.gpt2 import preset
from varuna_sdk.runner import JobStopped, train_local

TEXT = "".join(f"Line {i}: the quick brown fox jumps over {i % 7} lazy dogs.\n" for i in range(300))


@pytest.fixture(autouse=True)
def _cache(own_cache):
    """No calibration is needed (P and D fixed); keep any cache this test makes its own."""


def _job(tmp_path: Path, steps: int, every: int, **train) -> JobConfig:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(TEXT)
    return JobConfig(name="tw", model=ModelConfig(preset="tiny"),
                     data=DataConfig(path=str(corpus), tokenizer="byte", seq_len=32),
                     parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                     train=TrainConfig(steps=steps, lr=3e-3, warmup_steps=2, eval_batches=1, checkpoint_every=every,
                                       run_dir=str(tmp_path / "runs"), **train)).validate()


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "varuna_sdk.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_finished_run_keeps_its_last_step_and_exports_the_weights_plain_pytorch_trains(tmp_path):
    """7 steps with ``checkpoint_every: 5``: the run keeps step 7 too (it kept only step 5, so the
    trained model was lost); ``Job.trained_weights()`` has ``initial_weights()``'s keys (tied
    weights under each name) and equals the unpartitioned model trained 7 steps by plain PyTorch;
    ``varuna export`` writes the same tensors to one file that loads with ``weights_only=True``."""
    from varuna_sdk.notebook import Job
    from varuna_sdk.reference import initial_model, plain_losses

    job = _job(tmp_path, steps=7, every=5)
    run = tmp_path / "run"
    got = [m["loss"] for m in train_local(job, run_dir=run).metrics()]
    steps = sorted(i.step for i in complete_checkpoints(run / "checkpoints"))
    assert steps[-1] == 7 and 5 in steps, steps

    handle = Job(run / "config.yaml", run_dir=run)
    trained, initial = handle.trained_weights(), handle.initial_weights()
    assert list(trained) == list(initial)
    mine = initial_model(handle.config, handle.resolved)
    ref = plain_losses(handle.config, handle.resolved, 7, None, mine)   # trains ``mine`` in place
    assert got == pytest.approx(ref, rel=1e-5)
    want = mine.state_dict()
    for k in want:
        assert torch.allclose(trained[k], want[k], rtol=1e-5, atol=1e-5), (k, (trained[k] - want[k]).abs().max())
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)   # trained, not the start
    back = initial_model(handle.config, handle.resolved)
    back.load_state_dict(trained)   # strict: every key of the user's model, nothing else

    out = tmp_path / "model.pt"
    cp = _cli("export", str(run), "-o", str(out))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "after 7 step(s)" in cp.stdout, cp.stdout
    exported = torch.load(out, weights_only=True)
    assert list(exported) == list(trained) and all(torch.equal(exported[k], trained[k]) for k in trained)

    # the newest checkpoint torn: the export falls back to the older one, saying which (never torn)
    newest = complete_checkpoints(run / "checkpoints")[0]
    seg = next(f for f in newest.manifest["files"] if f.startswith("seg-"))
    path = run / "checkpoints" / newest.name / seg
    path.write_bytes(b"\0" * path.stat().st_size)   # same size, other bytes: only the SHA-256 tells
    cp = _cli("export", str(run), "-o", str(out))
    assert cp.returncode == 0 and "after 5 step(s)" in cp.stdout and "of 7" in cp.stdout, cp.stdout + cp.stderr
    from varuna_sdk.checkpoint import read_model_state

    skipped: list = []   # the library call names the torn one it passed over
    info, _ = read_model_state(str(run / "checkpoints"), skipped=skipped)
    assert info.step == 5 and [n for n, _ in skipped] == [newest.name], skipped
    assert _cli("export", str(tmp_path / "nowhere"), "-o", str(out)).returncode == 2
    cp = _cli("export", str(run), "-o", str(tmp_path / "no-folder" / "w.pt"))   # was a traceback (helper-61)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr
    assert "its folder" in cp.stderr and "does not exist" in cp.stderr, cp.stderr


def _stopped_run(tmp_path: Path) -> tuple[JobConfig, Path, int]:
    """A real run stopped (``varuna stop``'s request file) after a few steps, checkpointed there."""
    job = _job(tmp_path, steps=2000, every=1000)
    run = tmp_path / "run"

    def stop_soon():
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if len((run / "metrics.jsonl").read_text().splitlines()) >= 3:
                    request_stop(run)
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.02)

    t = threading.Thread(target=stop_soon, daemon=True)
    t.start()
    with pytest.raises(JobStopped):
        train_local(job, run_dir=run)
    t.join()
    info = read_run(run)
    assert info.state == "STOPPED" and info.steps_done >= 3, (info.state, info.steps_done)
    assert complete_checkpoints(run / "checkpoints")
    return job, run, info.steps_done


def _refused_and_still_stopped(run: Path, done: int, cfg: Path, *what: str) -> None:
    before = (run / "metrics.jsonl").read_text()
    cp = _cli("train", str(cfg), "--run-dir", str(run))
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert "Traceback" not in cp.stderr and all(w in cp.stderr for w in what), cp.stderr
    assert (run / "metrics.jsonl").read_text() == before   # no worker started: no step again
    assert read_run(run).state == "STOPPED"


@pytest.mark.timeout(300)
def test_a_stopped_run_without_usable_checkpoints_is_refused_not_restarted_from_scratch(tmp_path):
    """Its checkpoints all torn, then removed: ``varuna train`` on the folder exits 2 before any
    worker starts, saying how many steps were done, that no usable checkpoint remains (each torn
    one named with its reason) and what to do; the API refuses too (``ConfigError``; the manager
    itself ``ManagerError``); the run stays STOPPED. It used to start again from step 0, recording
    its first steps in metrics.jsonl twice."""
    from varuna_sdk.cluster.provider import LocalProvider
    from varuna_sdk.manager.manager import Manager
    from varuna_sdk.manager.state import ManagerError

    job, run, done = _stopped_run(tmp_path)
    cfg = run / "config.yaml"
    names = [i.name for i in complete_checkpoints(run / "checkpoints")]
    for name in names:   # torn: a manifest cut short
        man = run / "checkpoints" / name / "MANIFEST.json"
        man.write_bytes(man.read_bytes()[:40])
    _refused_and_still_stopped(run, done, cfg, f"stopped after {done} step(s)", "no usable checkpoint remains",
                               *[f"{n} (" for n in names], "not valid JSON", "--run-dir")
    shutil.rmtree(run / "checkpoints")
    _refused_and_still_stopped(run, done, cfg, f"stopped after {done} step(s)", "no usable checkpoint remains",
                               "it holds none")
    with pytest.raises(ConfigError, match="no usable checkpoint remains"):
        train_local(job, run_dir=run)
    mgr = Manager(JobConfig.from_yaml(cfg), LocalProvider(2), run_dir=run, calibrate_first=False)
    with pytest.raises(ManagerError, match="no usable checkpoint remains"):
        mgr.run()
    assert mgr.state.value == "STOPPED" and read_run(run).state == "STOPPED"


@pytest.mark.timeout(300)
def test_resume_false_on_a_stopped_run_is_refused_before_any_worker_and_it_continues_after(tmp_path):
    """``train.resume: false`` on a stopped run: exit 2 before any worker starts (it used to fail in
    the workers and end the run FAILED, which then refused ``resume: true`` as "already ended");
    the run stays STOPPED, and with ``resume: true`` it continues from its checkpoint to the end,
    every step recorded once."""
    job, run, done = _stopped_run(tmp_path)
    # the model's code edited in place (its config the same, so only the checkpoint can tell): refused
    # before anything starts — the workers failed loading the checkpoint and the run ended FAILED for
    # good (helper-61). Emulated by building a wider model for the same run folder.
    from varuna_sdk.runner import check_same_model
    from varuna_sdk.trainer import resolve

    check_same_model(job, resolve(job, run), run)   # the same model: nothing to say
    wider = copy.deepcopy(job)
    wider.model.n_embd = 2 * (job.model.n_embd or preset("tiny").n_embd)
    with pytest.raises(ConfigError, match=r"the model of the run in .* changed since its checkpoint of step \d+: "
                                          r"'.*' \(\d+,?.*\) in the checkpoint, \(\d+,?.*\) now.*put the code back"):
        check_same_model(wider, resolve(wider, run), run)
    renamed = copy.deepcopy(job)   # every layer under other names: the names gone, counted, and the new ones
    renamed.model = ModelConfig(factory="tests.thirdparty.singlefile_gpt:make_gpt",
                                kwargs={"n_layer": 2, "block_size": 32, "vocab_size": 256})
    with pytest.raises(ConfigError, match=r"\[.*\] \(and \d+ more\) not in the model now; \[.*\] \(and \d+ more\) "
                                          r"not in the checkpoint — its code was edited"):
        check_same_model(renamed, resolve(renamed, run), run)
    cfg = tmp_path / "noresume.yaml"
    j = JobConfig.from_yaml(run / "config.yaml")
    j.train.resume = False
    j.to_yaml(cfg)
    _refused_and_still_stopped(run, done, cfg, "train.resume is false", f"stopped after {done} step(s)",
                               "Set train.resume to true")
    assert JobConfig.from_yaml(run / "config.yaml").train.resume is True   # the run's config left as it was
    j.train.resume, j.train.steps = True, done + 3
    j.to_yaml(cfg)
    cp = _cli("train", str(cfg), "--run-dir", str(run), timeout=240)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert read_run(run).state == "SUCCEEDED"
    assert _steps(run) == list(range(done + 3))   # every step once: none trained again from scratch


@pytest.mark.timeout(120)
def test_a_checkpoint_url_under_a_file_is_refused_with_the_config_and_leaves_no_run(tmp_path):
    """``train.checkpoint_url`` below a file (or a file itself): exit 2 with the reason, no
    traceback, and no run folder left in a PROVISIONING state with no manager (it raised
    NotADirectoryError from the manager's first look at the store)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for url in (str(afile / "ck"), str(afile), f"file://{afile}/ck"):
        cfg = tmp_path / "bad.yaml"
        _job(tmp_path, steps=3, every=1, checkpoint_url=url).to_yaml(cfg)
        run = tmp_path / "bad-run"
        cp = _cli("train", str(cfg), "--run-dir", str(run))
        assert cp.returncode == 2, cp.stdout + cp.stderr
        assert "Traceback" not in cp.stderr and "not a folder" in cp.stderr and "train.checkpoint_url" in cp.stderr, \
            cp.stderr
        assert not (run / "events.db").exists()
    with pytest.raises(CheckpointError, match="cannot be listed"):
        Store(str(afile / "ck")).checkpoint_names()
    # the manager itself (a caller that skips the launcher's checks) refuses before any state or worker
    from varuna_sdk.cluster.provider import LocalProvider
    from varuna_sdk.manager.manager import Manager
    from varuna_sdk.manager.state import ManagerError

    mgr = Manager(_job(tmp_path, steps=3, every=1, checkpoint_url=str(afile / "ck")), LocalProvider(2),
                  run_dir=tmp_path / "api-run", calibrate_first=False)
    with pytest.raises(ManagerError, match="cannot be listed"):
        mgr.run()
    assert mgr.state.value == "PENDING" and not mgr.log.events(kind=Kind.JOB_STATE)


@pytest.mark.timeout(120)
def test_a_resume_that_finds_only_torn_checkpoints_says_starting_from_scratch_once(tmp_path, capsys):
    """Every checkpoint torn: one "no usable checkpoint: starting from scratch" (it was said once per
    torn checkpoint), followed by each one skipped with its reason."""
    from varuna_sdk.trainer import run_worker

    job = _job(tmp_path, steps=3, every=1).to_dict()
    job["parallel"] = {**job["parallel"], "P": 1}
    out = run_worker(0, 1, job, str(tmp_path / "r"))
    assert out.status == "completed"
    store = tmp_path / "r" / "checkpoints"
    names = [i.name for i in complete_checkpoints(store)]
    assert len(names) == 3
    for name in names:
        (store / name / "MANIFEST.json").write_text("{")
    capsys.readouterr()
    again = run_worker(0, 1, {**job, "train": {**job["train"], "steps": 4}}, str(tmp_path / "r"))
    said = capsys.readouterr().out
    assert again.resumed_from is None or again.resumed_from == 0
    assert said.count("starting from scratch") == 1, said
    assert "skipped 3 checkpoint(s)" in said and all(f"skipped checkpoint {n} (" in said for n in names), said
