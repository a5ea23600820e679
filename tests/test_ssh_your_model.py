"""A model of the user's own, named by import path from their code folder, trained on SSH test
hosts ("VMs") under the morph manager: the bootstrap syncs the folder (the model's module and its
data file) to every VM by content hash, each worker imports the model there — nothing of it is
pickled — and the job survives a pre-emption with notice with the same per-step losses as an
uninterrupted local run (fp32, dropout 0.1, 1e-5), no step redone (counted from the metrics rows).
No VM or worker is left behind."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ssh_hosts import skip_reason
from test_manager import steps_redone
from ssh_hosts import procs_left
from varuna_sdk.cluster.spot import SpotEmulator
from varuna_sdk.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.runner import launch_job, train_local
from varuna_sdk.manager.events import EventLog, Kind

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

MODULE = '''
"""The user's model: a tiny pre-norm transformer-ish LM, in their own package."""
import torch
import torch.nn as nn


class Mixer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d), nn.Dropout(0.1))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class MyLM(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.mixers = nn.ModuleList([Mixer(width) for _ in range(depth)])
        self.unembed = nn.Linear(width, 256)

    def forward(self, tokens):
        h = self.embed(tokens)
        for m in self.mixers:
            h = m(h)
        return self.unembed(h)


def build(width=48, depth=4):
    return MyLM(width, depth)
'''

STEPS = 120


def _job(run_root: Path) -> JobConfig:
    return JobConfig(name="mine-ssh", model=ModelConfig(factory="usermodels.lm:build", kwargs={"width": 48}),
                     data=DataConfig(path="data/notes.txt", tokenizer="byte", seq_len=32),
                     parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                     train=TrainConfig(steps=STEPS, lr=2e-3, warmup_steps=4, eval_batches=1, checkpoint_every=5,
                                       run_dir=str(run_root)))


@pytest.fixture
def code_folder(tmp_path, monkeypatch):
    code = tmp_path / "myproject"
    (code / "usermodels").mkdir(parents=True)
    (code / "usermodels" / "__init__.py").write_text("")
    (code / "usermodels" / "lm.py").write_text(MODULE)
    (code / "data").mkdir()
    (code / "data" / "notes.txt").write_text("Whose woods these are I think I know. His house is in the village "
                                             "though; he will not see me stopping here to watch his woods fill up "
                                             "with snow.\n" * 50)
    monkeypatch.chdir(code)   # the user's session runs in their project folder
    monkeypatch.syspath_prepend(str(code))
    yield code
    for name in [m for m in sys.modules if m == "usermodels" or m.startswith("usermodels.")]:
        del sys.modules[name]


@pytest.mark.timeout(480)
def test_import_path_model_on_ssh_vms_morphs_with_the_same_losses(tmp_path, code_folder):
    one = _job(tmp_path / "ref")
    one.parallel.P = 1   # the uninterrupted run in one process (the losses of any P x D, to 1e-5)
    ref = train_local(one, run_dir=tmp_path / "ref")
    reference = {m["step"]: m["loss"] for m in ref.metrics()}
    run, vms = tmp_path / "run", tmp_path / "vms"
    emu = SpotEmulator(capacity=3, backend="ssh", root=vms, notice_s=None).start()
    result: dict = {}
    import threading

    def launch():
        result["summary"] = launch_job(_job(tmp_path), run_dir=run, provider=emu, heartbeat_interval_s=1.0,
                                       stop_timeout_s=60, grow=None, straggler=None,
                                       generation_options={"sink": None, "remote_run_dir": str(run),
                                                           "code_dir": str(code_folder)})

    t = threading.Thread(target=launch, daemon=True)
    try:
        t.start()
        deadline = time.time() + 240
        while time.time() < deadline:
            steps = _steps(run)
            if steps and max(steps) >= 5:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the job did not reach step 5 on the VMs")
        emu.remove_now("vm1", notice_s=3.0)   # a VM in use (P=2 x D=1 on vm0, vm1) is pre-empted
        t.join(300)
        assert not t.is_alive(), "the job did not finish"
    finally:
        emu.close()
    s = result["summary"]
    assert s["state"] == "SUCCEEDED", s
    assert [m["cause"] for m in s["morphs"]] == ["notice"] and s["morphs"][0]["steps_lost"] == 0
    assert steps_redone(run) == [0]
    log = EventLog.reader(run / "events.db")
    try:
        boots = log.events(kind=Kind.BOOTSTRAP)
        losses = {m["step"]: m["loss"] for m in log.metrics()}
    finally:
        log.close()
    assert boots and all(n >= 3 for n in boots[0].payload["files_sent"].values()), boots[0].payload
    # the code travelled as files, the model was imported there: no objects file anywhere
    assert not list(vms.rglob("objects-*")) and not list(run.rglob("objects-*"))
    assert list(vms.rglob("usermodels/lm.py")) and list(vms.rglob("data/notes.txt"))
    assert sorted(losses) == list(range(STEPS))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), (step, losses[step], loss)
    assert not procs_left(str(vms), str(run), timeout_s=10), "a VM or worker was left running"


def _steps(run: Path) -> list[int]:
    if not (run / "events.db").exists():
        return []
    log = EventLog.reader(run / "events.db")
    try:
        return [m["step"] for m in log.metrics()]
    finally:
        log.close()
