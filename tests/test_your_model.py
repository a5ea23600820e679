"""Your own model, from a notebook cell, through the whole managed path, in a real Jupyter kernel
(jupyter_client, as nbclient drives the tutorials): a model class defined in a cell (with its own
RMSNorm that has no ``reset_parameters``) on the user's own text file is planned and launched with
``Job(model=..., data=...)``; on emulated spot VMs it survives a pre-emption with notice and a
sudden loss, and every per-step loss equals an uninterrupted run of the same job (fp32, dropout
0.1, 1e-5); the steps redone, counted from the metrics rows, are the manager's record (0 with
notice); its calibration is cached under the model's identity; nothing is left running.
"""

from __future__ import annotations


import pytest

from _jupyter import kernel_session
from ssh_hosts import procs_left

# enough steps that the run is still going when the test removes its second VM: at 100 the tiny
# model on an idle machine finished the 44 steps after its first resume (about 1 s) before the
# sudden loss could be injected, so no second morph came
STEPS = 300

SETUP = f'''
import time
import torch, torch.nn as nn, torch.nn.functional as F
from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ParallelConfig, TrainConfig
from varuna_sdk.notebook import Job
from varuna_sdk.cluster.provider import LocalProvider
from varuna_sdk.cluster.spot import SpotEmulator

class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(d))
    def forward(self, x):
        return self.gain * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = RMSNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)
    def forward(self, x):
        return x + self.drop(self.down(F.silu(self.up(self.norm(x)))))

class NotebookLM(nn.Module):
    """A model that exists only in this notebook."""
    def __init__(self, vocab=256, d=64, n_layers=4, context=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n_layers))
        self.norm, self.out = RMSNorm(d), nn.Linear(d, vocab, bias=False)
    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))

text = ("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
        "and nothing particular to interest me on shore, I thought I would sail about a little and see the "
        "watery part of the world.\\n") * 60
open("my_notes.txt", "w").write(text)

def config(name):
    return JobConfig(name=name, data=DataConfig(tokenizer="byte", seq_len=32),
                     parallel=ParallelConfig(P=2, D=1, global_batch=8, micro_batch_size=2),
                     train=TrainConfig(steps={STEPS}, lr=2e-3, min_lr=2e-4, warmup_steps=4, eval_batches=1,
                                       checkpoint_every=4),
                     launch=LaunchConfig(gpus=2))

def wait_until(job, cond, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {{job.status}}"
        assert job.status.state != "FAILED", job.status.error
        time.sleep(0.2)
'''


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    root = tmp_path_factory.mktemp("yourmodel")
    with kernel_session(root, SETUP, "[j.close() for j in list(globals().values()) if isinstance(j, Job)]") as k:
        yield k
    assert not procs_left(str(root)), "worker processes left behind"


@pytest.mark.timeout(600)
def test_notebook_model_survives_notice_and_sudden_loss_with_the_same_losses(kernel):
    k = kernel
    # the uninterrupted run: 1 local worker, P=1 x D=1 (the losses of any P x D to 1e-5; no calibration)
    k.ok("one = config('nb-ref'); one.parallel.P = 1\n"
         "ref = Job(one, model=NotebookLM, data='my_notes.txt', provider=LocalProvider(1),\n"
         "          manager_options={'calibrate_first': False, 'straggler': None, 'grow': None})\n"
         "print(ref.resolved.spec.describe())\n"
         "ref.launch(progress=False); st = ref.wait(240); assert st.state == 'SUCCEEDED', st")
    assert k.value("ref.resolved.spec.name") == "NotebookLM"
    # the morphing run: 3 emulated spot VMs; calibrated once (cached by the model's identity)
    res = k.ok("job = Job(config('nb-spot'), model=NotebookLM, data='my_notes.txt',\n"
               "          provider=SpotEmulator(capacity=3, backend='local', notice_s=None).start(),\n"
               "          manager_options={'heartbeat_interval_s': 1.0, 'straggler': None, 'grow': None})\n"
               "prof = job.calibrate()\n"
               "again = Job(config('nb-other-name'), model=NotebookLM, data='my_notes.txt', provider=LocalProvider(2)).calibrate()",
               timeout_s=300)
    # another job (another name) of the same model and data shapes reads the cached profile: the same
    # measured seconds, not new ones — but for the data read, timed afresh on each job's own data
    assert k.value("__import__('dataclasses').replace(again, data_read_s=0.0).to_json() == "
                   "__import__('dataclasses').replace(prof, data_read_s=0.0).to_json() and "
                   "prof.segments[0].fwd_s[0] > 0 and again.data_read_s > 0"), res.stdout
    assert k.value("prof.model['identity']['kind']") == "by_value"
    k.ok("job.launch(progress=False)\nwait_until(job, lambda: job.status.step >= 8)", timeout_s=200)
    used = k.value("[h.name for h in job.provider.hosts()][:2]")
    k.ok(f"job.provider.remove_now({used[1]!r}, notice_s=3.0)\n"           # 1) pre-emption with notice
         "wait_until(job, lambda: len(job.morphs) >= 1, 180)", timeout_s=200)
    k.ok("resumed = int(job.morphs.iloc[-1]['resume_step'])\n"
         "wait_until(job, lambda: job.status.step >= resumed + 6, 180)", timeout_s=200)
    in_use = k.value("job.morphs.iloc[-1]['new']['hosts']")
    k.ok(f"job.provider.remove_now({in_use[-1]!r})\n"                       # 2) a sudden loss
         "wait_until(job, lambda: len(job.morphs) >= 2, 180)\n"
         "st = job.wait(300); assert st.state == 'SUCCEEDED', st", timeout_s=400)
    causes = k.value("list(job.morphs['cause'])")
    assert causes[0] == "notice" and causes[1] == "loss", causes
    assert k.value("int(job.morphs.iloc[0]['steps_lost'])") == 0
    # the steps each later generation trained again, counted from the metrics rows
    redone = k.value("[int(len(set(g['step']) & set(job.metrics[job.metrics['generation'] < gen]['step'])))\n"
                     " for gen, g in job.metrics.groupby('generation') if gen > 0]")
    assert redone == k.value("[int(x) for x in job.morphs['steps_lost']]"), redone
    got = k.value("{int(s): float(l) for s, l in job.metrics.groupby('step')['loss'].last().items()}")
    ref = k.value("{int(s): float(l) for s, l in ref.metrics.groupby('step')['loss'].last().items()}")
    assert sorted(int(s) for s in got) == list(range(STEPS)) == sorted(int(s) for s in ref)
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=1e-5), (s, got[s], ref[s])
    assert k.value("ref.summary['ppl_end'] < ref.summary['ppl_start']")


def test_a_notebook_jobs_fixed_p_by_d_beyond_launch_gpus_runs_as_given_as_varuna_train_does(tmp_path):
    """``Job(P=1, D=3)`` with ``launch.gpus=2`` and no provider: it starts the 3 local workers its
    fixed shape needs (warning that they share the machine), as ``varuna train`` does, and trains
    P=1 x D=3 with the losses of plain PyTorch. It launched 2 slots before, and its manager replanned
    for them (calibrating though ``calibrate_first`` was off), ignoring the shape asked for; here it
    starts at once, uncalibrated, as configured."""
    import pytest
    import warnings

    from varuna_sdk.notebook import Job

    job = Job(model="tests.thirdparty.user_data:Classifier", data="tests.thirdparty.user_data:make_dataset",
              tokenizer=None, P=1, D=3, global_batch=12, micro_batch_size=2, steps=3, warmup_steps=1,
              eval_batches=1, checkpoint_every=0, gpus=2, run_dir=tmp_path / "run",
              manager_options={"calibrate_first": False})
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            job.launch(progress=False)
        assert any("P=1 x D=3 starts 3 local workers, more than launch.gpus=2" in str(w.message) for w in said), \
            [str(w.message) for w in said]
        st = job.wait(240)
        assert st.state == "SUCCEEDED" and (st.P, st.D) == (1, 3), st
        assert job.metrics["loss"].tolist() == pytest.approx(job.plain_pytorch_losses(steps=3), rel=1e-5)
    finally:
        job.close()
