"""The notebook ``Job`` handle (``varuna_sdk.notebook``) driven from a real Jupyter kernel, cell by
cell, as a user drives it: ``launch()`` returns at once with an ipywidgets progress bar; running
the launch cell again starts no second job (one manager thread, one run folder); a second ``Job``
of the same name refuses while the first runs, and ``Job.get`` hands the first back; ``status``,
``metrics``, ``events`` and ``morphs`` are the documented types and agree with the run folder's
``metrics.jsonl``; ``stop()`` checkpoints at a mini-batch boundary and leaves no worker process,
and ``launch()`` then continues at the next step to SUCCEEDED with every step trained once;
a config holding Python objects, or a built model instead of its class, is refused before
anything starts; shutting the kernel down
while a job runs on SSH test hosts leaves neither a worker nor a test host behind.

The job is the small GPT-2 of ``notebooks/03_spot_vms.ipynb`` (same name and shape, so the two
share one cached calibration) on 2 local worker processes. Everything is time-bounded.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from _jupyter import Kernel, kernel_manager, kernel_session
from ssh_hosts import procs_left, procs_mentioning, skip_reason

STEPS = 600  # long enough that the job still trains when the stop test reaches it on a fast machine (80 steps ran out in CI)

SETUP = f"""
import threading, time
from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig, TrainConfig
from varuna_sdk.notebook import Job, JobStatus

cfg = JobConfig(
    name="spot-tutorial",
    model=ModelConfig(preset="tiny", n_layer=4, n_head=4, n_embd=128),
    data=DataConfig(corpus="shakespeare", tokenizer="byte", seq_len=64),
    parallel=ParallelConfig(P=1, D=2, global_batch=8, micro_batch_size=2),
    train=TrainConfig(steps={STEPS}, lr=1e-3, min_lr=1e-4, warmup_steps=5, eval_batches=2, checkpoint_every=100),
    launch=LaunchConfig(gpus=2),
)
job = Job(cfg, manager_options={{"heartbeat_interval_s": 1.0, "straggler": None}})
job.calibrate()

def wait_until(cond, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {{job.status}}"
        assert job.status.state != "FAILED", job.status.error
        time.sleep(0.2)
"""

LAUNCH = "t0 = time.monotonic(); job.launch(); launch_s = time.monotonic() - t0; print(f'launch took {launch_s:.3f} s')"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    root = tmp_path_factory.mktemp("nbjob")
    with kernel_session(root, SETUP, "job.close()") as k:  # SETUP calibrates, unless cached
        yield k
    assert not _leftover(str(root), 20.0), "worker processes left behind"


def _leftover(text: str, timeout_s: float) -> list[int]:
    return procs_left(text, timeout_s=timeout_s)


@pytest.mark.timeout(120)
def test_launch_returns_at_once_with_a_progress_bar(kernel):
    res = kernel.ok(LAUNCH)
    launch_s = float(res.stdout.split("launch took ")[1].split(" s")[0])
    assert launch_s < 10.0, res.stdout  # typically 0.1-1.5 s: imports, the event log, a thread
    assert kernel.value("job.status.step") == 0  # nothing trained while launch() ran
    assert kernel.value("job.running") is True
    assert "application/vnd.jupyter.widget-view+json" in res.mimetypes(), res.outputs  # tqdm.auto -> widget
    assert "spot-tutorial" in res.text()


@pytest.mark.timeout(120)
def test_rerunning_the_launch_cell_does_not_start_a_second_job(kernel):
    before = kernel.value("[id(job.manager), str(job.run_dir)]")
    res = kernel.ok(LAUNCH)
    assert "already running" in res.stdout and "not starting a second one" in res.stdout
    assert kernel.value("[id(job.manager), str(job.run_dir)]") == before
    threads = kernel.value("sorted(t.name for t in threading.enumerate() if t.name.startswith('varuna-manager'))")
    assert len(threads) == 1, threads
    assert [p.name for p in (kernel.root / "runs").iterdir()] == [Path(before[1]).name]


@pytest.mark.timeout(120)
def test_a_second_job_with_the_same_name_refuses(kernel):
    res = kernel.run("job2 = Job(cfg)\njob2.launch()")
    assert res.status == "error" and res.ename == "RuntimeError", res.text()
    assert "already running" in res.evalue and "Job.get('spot-tutorial')" in res.evalue
    assert kernel.value("Job.get('spot-tutorial') is job and job2.manager is None and job2.run_dir is None")
    assert kernel.value("list(Job.running_jobs())") == ["spot-tutorial"]
    assert len(list((kernel.root / "runs").iterdir())) == 1


@pytest.mark.timeout(240)
def test_status_metrics_and_events_while_it_trains(kernel):
    kernel.ok("wait_until(lambda: job.status.step >= 4)", timeout_s=200)
    st = kernel.value("(lambda s: dict(type=type(s).__name__, **vars(s)))(job.status)")
    assert st["type"] == "JobStatus" and st["state"] == "RUNNING" and st["steps"] == STEPS
    assert st["step"] >= 4 and st["loss"] > 0 and st["tokens_per_s"] > 0 and (st["P"], st["D"]) == (1, 2)
    assert st["generation"] == 0 and st["morphs"] == 0 and st["error"] is None
    html = kernel.ok("job.status").outputs[0][1]["data"]
    assert "text/html" in html and "RUNNING" in html["text/plain"]
    m = kernel.value("(lambda df: dict(type=type(df).__name__, cols=list(df.columns), rows=df.to_dict('list')))"
                     "(job.metrics)")
    assert m["type"] == "DataFrame"
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "examples_per_s", "step_time_s", "P", "D",
            "generation", "job_id"} <= set(m["cols"])
    steps = m["rows"]["step"]
    assert steps == list(range(len(steps))) and len(steps) >= 4
    run_dir = Path(kernel.value("str(job.run_dir)"))
    jsonl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    by_step = {r["step"]: r["loss"] for r in jsonl}
    for s, loss in zip(steps, m["rows"]["loss"]):  # the event log's rows are rank 0's own lines
        assert loss == by_step[s]
    e = kernel.value("(lambda df: dict(type=type(df).__name__, cols=list(df.columns), kinds=sorted(set(df.kind)),"
                     " tz=str(df.time.dt.tz), hosts=sorted(set(df.host) - {''}), rank=str(df['rank'].dtype),"
                     " what=[w for w in df.what if w.startswith('job RUNNING')][:1]))(job.events)")
    assert e["type"] == "DataFrame" and e["cols"] == ["time", "what", "kind", "host", "rank", "payload"]
    assert e["tz"] == "UTC" and e["rank"] == "Int64" and e["what"], e   # ranks are integers; events in words
    assert {"job_state", "plan", "host_added", "worker_joined"} <= set(e["kinds"]), e["kinds"]
    assert e["hosts"] == ["local0", "local1"]
    mo = kernel.value("(lambda df: [type(df).__name__, len(df), list(df.columns)])(job.morphs)")
    assert mo[0] == "DataFrame" and mo[1] == 0 and "cause" in mo[2] and "downtime_s" in mo[2]


@pytest.mark.timeout(120)
def test_interrupting_a_cell_that_waits_leaves_the_job_training(kernel):
    """Jupyter's interrupt (SIGINT to the kernel) during ``job.wait()``: the cell ends with
    KeyboardInterrupt, the job goes on and ``stop()`` still reaches it. (Thread.join interrupted
    by Ctrl-C marked the live manager thread as ended in Python 3.11: ``job.running`` became False,
    ``stop()`` did nothing and ``launch()`` refused on the folder's own lock.)"""
    assert kernel.value("job.running") is True
    step0 = kernel.value("job.status.step")
    timer = threading.Timer(2.0, kernel.km.interrupt_kernel)
    timer.start()
    try:
        res = kernel.run("job.wait()", timeout_s=60)
    finally:
        timer.cancel()
    assert res.ename == "KeyboardInterrupt", res.text()
    assert "goes on training in the background; job.stop() stops it" in res.stderr, res.stderr
    assert kernel.value("job.running") is True
    kernel.ok(f"wait_until(lambda: job.status.step > {step0} + 1)", timeout_s=60)   # still training


@pytest.mark.timeout(300)
def test_stop_checkpoints_and_launch_continues(kernel):
    res = kernel.ok("st = job.stop(); st", timeout_s=150)
    assert "state='STOPPED'" in res.result, res.text()
    stopped_at = kernel.value("st.step")
    assert 0 < stopped_at < STEPS
    run_dir = kernel.value("str(job.run_dir)")
    assert not _leftover(run_dir, 15.0), "workers still running after stop()"
    ckpts = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step-*"))
    assert any(n.startswith(f"step-{stopped_at:08d}") for n in ckpts), (stopped_at, ckpts)
    assert kernel.value("job.running") is False
    kernel.ok("job.launch(progress=False)")
    res = kernel.ok("job.wait(240)", timeout_s=260)
    assert "state='SUCCEEDED'" in res.result, res.text()
    spans = kernel.value("job.metrics.groupby('job_id', sort=False)['step'].agg(['min', 'max', 'count'])"
                         ".reset_index().values.tolist()")
    assert len(spans) == 2, spans
    (_, a0, a1, an), (_, b0, b1, bn) = spans
    assert (a0, a1, an) == (0, stopped_at - 1, stopped_at)  # the first launch: steps 0 .. stop-1
    assert (b0, b1, bn) == (stopped_at, STEPS - 1, STEPS - stopped_at)  # continued at the next step
    summary = kernel.value("job.summary")
    assert summary["steps"] == STEPS and summary["ppl_end"] < summary["ppl_start"]
    assert "[local0 rank 0] [varuna] held-out perplexity" in kernel.value("job.logs(3)")
    res = kernel.ok("job.launch()")
    assert "already finished" in res.stdout


@pytest.mark.timeout(60)
def test_objects_the_workers_cannot_receive_are_refused(kernel):
    res = kernel.run("def make_model():\n    return None\nJob(make_model)")
    assert res.ename == "TypeError" and "make_model" in res.evalue and "JobConfig" in res.evalue
    assert "pass it as Job(model=make_model)" in res.evalue  # the config is plain data; a model goes in model=
    res = kernel.run("import torch\nJob(cfg, model=torch.nn.Linear(2, 2))")
    assert res.ename == "TypeError" and "pass its class or a function that builds it" in res.evalue
    res = kernel.run("import copy\nbad = copy.deepcopy(cfg)\nbad.model.preset = make_model\nJob(bad)")
    assert res.ename == "TypeError" and "config.model.preset" in res.evalue and "cannot be sent to the workers" in res.evalue
    res = kernel.run("import torch\nJob(torch.nn.Linear(2, 2))")
    assert res.ename == "TypeError" and "Linear" in res.evalue


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
@pytest.mark.timeout(240)
def test_shutting_the_kernel_down_leaves_no_vm_or_worker(tmp_path):
    """A job on SSH test hosts (spot emulator) is running when the kernel shuts down: the kernel's
    exit hook stops it and closes the provider, so no worker and no test host's sshd outlives the
    kernel (without the hook the sshd servers would run forever). The kernel's TMPDIR is under
    ``tmp_path``, so every such process mentions it on its command line."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    k = Kernel(kernel_manager(tmp_path, env={"TMPDIR": str(tmp)}), cwd=tmp_path)
    try:
        k.ok(SETUP + "\nfrom varuna_sdk.cluster.spot import SpotEmulator\n"
             "emu = SpotEmulator(capacity=2, backend='ssh', notice_s=None).start()\n"
             "job = Job(cfg, provider=emu, manager_options={'heartbeat_interval_s': 1.0, 'straggler': None})",
             timeout_s=200)
        k.ok("job.launch(progress=False)\nwait_until(lambda: job.status.step >= 2)", timeout_s=200)
        assert len(procs_mentioning(str(tmp))) >= 4, "expected 2 sshd and 2 workers under the test hosts"
    finally:
        t0 = time.monotonic()
        k.shutdown(now=False)  # a shutdown request: the kernel exits, running its exit hooks
        shutdown_s = time.monotonic() - t0
    assert not _leftover(str(tmp), 20.0), "a test host or worker outlived the kernel"
    assert shutdown_s < 5.0, f"the kernel took {shutdown_s:.1f} s to exit (jupyter kills it after 5 s)"


def test_a_bar_of_a_job_stopped_on_request_is_amber_not_red():
    """tqdm's notebook bar turns red when closed short of its total; a requested stop is not an
    error (the job is checkpointed and continues), a failure is."""
    from tqdm.notebook import tqdm

    from varuna_sdk.notebook.views import colour_finished_bar as _colour_finished_bar

    for state, style in (("STOPPED", "warning"), ("SUCCEEDED", "success"), ("FAILED", "danger")):
        bar = tqdm(total=10, disable=False)
        bar.update(4)
        bar.close()
        _colour_finished_bar(bar, state)
        assert bar.container.children[1].bar_style == style, state
