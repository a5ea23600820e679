"""The ``varuna`` command line as a user meets it: ``--version``, and every subcommand with a
description, at least one example and help text for every flag (introspected from the parser the
command runs, so a flag added without help fails here)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from varuna_sdk import __version__
from varuna_sdk.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_is_printed_by_the_installed_command():
    out = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"varuna-sdk {__version__}", out


@pytest.mark.parametrize("name", sorted(_subcommands(build_parser())))
def test_every_subcommand_has_a_description_examples_and_help_for_every_flag(name):
    sp = _subcommands(build_parser())[name]
    assert sp.description and len(sp.description) > 40, name
    assert sp.epilog and sp.epilog.startswith("examples:") and f"varuna {name}" in sp.epilog, name
    undocumented = [a.option_strings or [a.dest] for a in sp._actions
                    if not isinstance(a, argparse._HelpAction) and not (a.help and len(a.help) > 8)]
    assert not undocumented, f"varuna {name}: flags without help: {undocumented}"
    assert f"varuna {name}" in sp.format_help()


@pytest.mark.parametrize("text,said", [
    ("name: x\nparallel: {P: 2\ntrain:\n  steps: 5\n", "job.yaml: line 3, column 6: not valid YAML"),
    ("name: x\ntrain:\n  lr: 1e-3\n  steps: five\n", "job.yaml: line 4: train.steps='five' must be an integer >= 1"),
    ("name: x\ntrain:\n  stepz: 5\n", "job.yaml: line 3: unknown key(s) ['stepz'] in 'train'"),
    ("name: x\ntrian:\n  steps: 5\n", "job.yaml: line 2: unknown config section 'trian'"),
])
def test_yaml_errors_name_the_file_and_line_without_a_traceback(tmp_path, capsys, text, said):
    from varuna_sdk.cli import main

    (tmp_path / "job.yaml").write_text(text)
    assert main(["train", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, said", [
    (["status", "runs/x", "--run-dir", "y"], "varuna status: error: unrecognized arguments: --run-dir y (--run-dir is a "
                                              "flag of varuna demo / varuna launch / varuna train, not of varuna status)"),
    (["launch", "job.yaml", "--steps", "5"], "varuna launch: error: unrecognized arguments: --steps 5 (--steps is a flag "
                                             "of varuna demo / varuna train, not of varuna launch)"),
    (["train", "job.yaml", "--stpes", "5"], "varuna train: error: unrecognized arguments: --stpes 5 (--stpes: did you "
                                            "mean --steps?)"),
    (["launch", "job.yaml", "--stpes", "5"], "varuna launch: error: unrecognized arguments: --stpes 5 (--stpes: --steps? "
                                             "that is a flag of varuna demo / varuna train, not of varuna launch)"),
    (["train", "job.yaml", "--step", "5"], "varuna train: error: unrecognized arguments: --step 5 (--step: did you "
                                           "mean --steps?)"),
])
def test_a_flag_the_subcommand_does_not_take_is_said_by_the_subcommand(capsys, argv, said):
    """An unknown flag after a subcommand printed ``varuna``'s own usage (helper-61): now the
    subcommand's, with the flag it likely meant or the subcommands that take it. A prefix of a
    flag (``--step``) is no flag either: argparse took it as ``--steps`` (a later flag sharing the
    prefix would have changed what an old command line meant)."""
    from varuna_sdk.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and f"usage: varuna {argv[0]} " in err, err


def test_a_value_overridden_on_the_command_line_is_not_blamed_on_the_file(tmp_path, capsys):
    from varuna_sdk.cli import main

    (tmp_path / "job.yaml").write_text("name: x\ntrain:\n  steps: 5\n")
    assert main(["train", str(tmp_path / "job.yaml"), "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "train.steps=0 must be an integer >= 1" in err and "line" not in err, err
    assert "[flags given over the config's values: --steps 0]" in err, err
    # a file value that fitted until a flag changed another field: the file's line, and the flag
    (tmp_path / "job.yaml").write_text("name: x\nparallel:\n  P: 2\n  max_in_flight: [4, 0]\n")
    assert main(["train", str(tmp_path / "job.yaml"), "--P", "3"]) == 2
    err = capsys.readouterr().err
    assert "line 4: parallel.max_in_flight lists 2 stages but P=3" in err and "[flags given over the config's values: --P 3]" in err, err


TINY = """name: tiny-cli
model: {preset: tiny, n_layer: 2}
data: {tokenizer: byte, seq_len: 16}
parallel: {P: 2, D: 1, global_batch: 4, micro_batch_size: 2}
train: {steps: 4000, lr: 0.001, warmup_steps: 2, eval_batches: 1, checkpoint_every: 1000}
launch: {gpus: 2}
"""


def _launch(cfg, run, *python_flags: str):
    import os

    return subprocess.Popen([sys.executable, *python_flags, "-m", "varuna_sdk.cli", "launch", str(cfg), "--run-dir",
                             str(run), "--local", "2", "--heartbeat", "0.5"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _imported_torch(said: str) -> bool:
    """Whether ``python -X importtime``'s report (in ``said``) shows torch imported."""
    return any(line.startswith("import time:") and line.rstrip().endswith("| torch") for line in said.splitlines())


def _wait_steps(run, n, proc, timeout_s=120):
    import time

    from varuna_sdk.manager.runs import read_run

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (run / "events.db").exists() and read_run(run).steps_done >= n:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError(f"{n} steps not reached in {timeout_s} s")


@pytest.mark.timeout(300)
def test_ctrl_c_and_varuna_stop_checkpoint_at_a_boundary_and_launch_continues(tmp_path, capsys):
    """``varuna launch`` interrupted by Ctrl-C (SIGINT) stops at a mini-batch boundary with a
    checkpoint (exit 130, not a traceback, no worker left); the same command continues the job with
    no step redone; ``varuna stop RUN`` stops it again the same way (exit 0: a clean stop asked for,
    not an interrupt), and so does SIGTERM (exit 143, 128 + its number, as a shell says); ``varuna status`` and ``varuna
    logs`` show the run, its progress and its workers' output."""
    import signal

    from test_manager import steps_redone
    from varuna_sdk.cli import main
    from ssh_hosts import procs_left
    from varuna_sdk.manager.events import EventLog, Kind
    from varuna_sdk.manager.runs import read_run

    cfg, run = tmp_path / "tiny.yaml", tmp_path / "runs" / "tiny"
    cfg.write_text(TINY)
    # `varuna logs --follow` started before the job: it waits for the folder, then follows it to the stop
    follow = subprocess.Popen([sys.executable, "-m", "varuna_sdk.cli", "logs", str(run), "--follow", "--events"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = _launch(cfg, run)
    try:
        _wait_steps(run, 8, first)
        # a second launch on the live run is refused (one manager per run folder), writing nothing
        with EventLog.reader(run / "events.db") as log:
            before = log.count("events")
        again = _launch(cfg, run)
        said = again.communicate(timeout=120)[0]
        assert again.returncode == 2 and "is being run by another manager (pid" in said, said
        assert "Traceback" not in said, said
        with EventLog.reader(run / "events.db") as log:   # (the first manager's own events go on)
            took = [e.payload for e in log.events(since_id=before, kind=Kind.JOB_STATE)
                    if "manager restarted" in e.payload.get("reason", "")]
        assert not took, took
        assert read_run(run).manager and read_run(run).manager["pid"] == first.pid
        first.send_signal(signal.SIGINT)
        out = first.communicate(timeout=60)[0]
    finally:
        first.kill()
    assert first.returncode == 130 and "SIGINT: stopping at the next mini-batch boundary" in out, out
    # the console says the plan as the manager makes it, beside the workers' output
    assert "[varuna] plan for generation 0: P=2 x D=1 on local0, local1, micro-batch 2 x 2, predicted" in out, out
    try:
        followed = follow.communicate(timeout=30)[0]
    finally:
        follow.kill()
    assert follow.returncode == 0 and followed.startswith("[varuna] waiting for a job to start in"), followed
    assert "asked to stop from outside (SIGINT)" in followed, followed
    assert "Traceback" not in out and "STOPPED" in out, out
    # the command that continues it repeats every flag given (--local, --heartbeat), not only the folder
    assert f"`varuna launch {cfg} --local 2 --heartbeat 0.5 --run-dir {run}` continues the job" in out, out
    stopped_at = read_run(run).steps_done
    assert read_run(run).state == "STOPPED" and stopped_at >= 8
    assert list((run / "checkpoints").glob(f"step-{stopped_at:08d}-*")), "no checkpoint at the stop"
    assert not procs_left(str(run), timeout_s=10)
    # launched again with another model: refused before anything starts, the run left as it was
    bad = tmp_path / "other-model.yaml"
    bad.write_text(TINY.replace("n_layer: 2}", "n_layer: 3}"))
    refused = _launch(bad, run, "-X", "importtime")
    said = refused.communicate(timeout=120)[0]
    assert refused.returncode == 2 and "model.n_layer: 2 in the run, 3 here" in said, said
    assert not _imported_torch(said), "refused only after building the model (torch imported)"
    assert read_run(run).state == "STOPPED"
    short = tmp_path / "tiny-short.yaml"        # fewer steps than it has done: would train nothing
    short.write_text(TINY.replace("steps: 4000", "steps: 3"))
    fewer = _launch(short, run, "-X", "importtime")
    said = fewer.communicate(timeout=120)[0]
    assert fewer.returncode == 2 and f"has done {stopped_at} step(s) already; train.steps=3 is fewer" in said, said
    assert not _imported_torch(said), "refused only after building the model (torch imported)"
    # continued with another learning rate: said, and config.yaml says what runs now
    cfg2 = tmp_path / "tiny-lr.yaml"
    cfg2.write_text(TINY.replace("lr: 0.001", "lr: 0.002"))
    second = _launch(cfg2, run)
    try:
        _wait_steps(run, stopped_at + 8, second)
        assert main(["stop", str(run), "--wait", "60"]) == 0
        out = second.communicate(timeout=60)[0]
    finally:
        second.kill()
    assert second.returncode == 0, out   # a clean stop asked by `varuna stop`: not an interrupt (130)
    assert "with changes: train.lr 0.001 -> 0.002" in out, out
    assert "lr: 0.002" in (run / "config.yaml").read_text()
    stopped_again = read_run(run).steps_done
    assert stopped_again >= stopped_at + 8
    info = read_run(run)   # (SIGTERM, a scheduler's kill, does the same: the `train` test below)
    assert info.state == "STOPPED" and info.steps_total == 4000
    assert list((run / "checkpoints").glob(f"step-{info.steps_done:08d}-*")), "no checkpoint at the stop"
    assert set(steps_redone(run)) == {0}     # no continued generation redid a step
    with EventLog.reader(run / "events.db") as log:   # ... each launch under the configured plan (P=2 x D=1, mbs 2)
        evs = log.events(kind=(Kind.PLAN, Kind.JOB_STATE))
    after_stop = [e.payload for i, e in enumerate(evs) if e.kind == Kind.PLAN and i > 0
                  and evs[i - 1].kind == Kind.JOB_STATE and evs[i - 1].payload.get("previous") == "STOPPED"]
    first_plan = next(e.payload for e in evs if e.kind == Kind.PLAN)
    assert after_stop and all((p["P"], p["D"], p["micro_batch_size"]) == (2, 1, 2) for p in [first_plan, *after_stop]), \
        [(e.kind, e.payload.get("P"), e.payload.get("D"), e.payload.get("micro_batch_size"), e.payload.get("state"))
         for e in evs]
    capsys.readouterr()
    assert main(["status", str(tmp_path / "runs")]) == 0
    table = capsys.readouterr().out
    assert "tiny" in table and "STOPPED" in table and f"{info.steps_done}/4000" in table, table
    assert " cost " in table.splitlines()[0] and " free " in table.splitlines()[2], table   # local slots cost nothing
    assert main(["status", str(run)]) == 0
    one = capsys.readouterr().out
    assert "cost so far: free (local)" in one, one
    from varuna_sdk.notebook import Job

    jobs = Job.list(tmp_path / "runs")            # the same, in a notebook
    assert list(jobs["job"]) == ["tiny"] and jobs["state"][0] == "STOPPED" and jobs["steps_done"][0] == info.steps_done
    assert jobs["cost"][0] == "free (local)"
    assert main(["logs", str(run)]) == 0
    logs = capsys.readouterr().out
    assert "===== gen0 =====" in logs and "===== gen1 =====" in logs and "[local0 rank 0] step" in logs, logs[-2000:]
    assert main(["logs", str(run), "--events"]) == 0
    events = capsys.readouterr().out
    assert "asked to stop from outside (SIGINT)" in events and "asked to stop from outside (varuna stop)" in events
    assert not procs_left(str(run), timeout_s=10)


@pytest.mark.timeout(240)
def test_train_ctrl_c_names_train_to_continue_and_a_finished_folder_says_so(tmp_path):
    """``varuna train`` stopped by Ctrl-C names the ``varuna train ... --run-dir`` command that
    continues it, with the flags given (``--steps`` over the file's); that command trains the
    remaining steps (no step redone); run once more on the
    finished folder it trains nothing and says the job had already ended; ``varuna launch`` says
    the same."""
    import os
    import signal

    from test_manager import steps_redone
    from varuna_sdk.manager.runs import read_run

    cfg, run = tmp_path / "tiny.yaml", tmp_path / "runs" / "tiny"
    cfg.write_text(TINY.replace("P: 2, D: 1", "P: 1, D: 1").replace("steps: 4000", "steps: 200")
                   .replace("gpus: 2", "gpus: 1"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    train = [sys.executable, "-m", "varuna_sdk.cli", "train", str(cfg), "--steps", "300", "--run-dir", str(run)]
    first = subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_steps(run, 3, first)
        first.send_signal(signal.SIGTERM)   # a scheduler's kill: as Ctrl-C (SIGINT: the `launch` test above)
        out = first.communicate(timeout=60)[0]
    finally:
        first.kill()
    assert first.returncode == 143 and "SIGTERM: stopping at the next mini-batch boundary" in out, out
    assert "Traceback" not in out, out
    assert f"`varuna train {cfg} --steps 300 --run-dir {run}` continues the job" in out, out   # the flags too
    stopped_at = read_run(run).steps_done
    assert 3 <= stopped_at < 300, stopped_at
    assert list((run / "checkpoints").glob(f"step-{stopped_at:08d}-*")), "no checkpoint at the SIGTERM stop"
    from varuna_sdk.manager.events import EventLog, Kind
    with EventLog.reader(run / "events.db") as log:
        asked = [e.payload.get("by") for e in log.events(kind=Kind.STOP_REQUEST_RECEIVED)]
    assert asked == ["SIGTERM"], asked
    second = subprocess.run(train, capture_output=True, text=True, env=env, timeout=120)
    assert second.returncode == 0 and "already ended" not in second.stdout, second.stdout + second.stderr
    assert read_run(run).state == "SUCCEEDED" and read_run(run).steps_done == 300
    assert set(steps_redone(run)) == {0}
    mtime = (run / "metrics.jsonl").stat().st_mtime_ns
    third = subprocess.run(train, capture_output=True, text=True, env=env, timeout=120)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "had already ended (300 step(s)); nothing was trained" in third.stdout, third.stdout
    assert (run / "metrics.jsonl").stat().st_mtime_ns == mtime       # nothing ran, nothing written
    fourth = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "launch", str(cfg), "--run-dir", str(run),
                             "--local", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert fourth.returncode == 0 and "had already ended (SUCCEEDED)" in fourth.stdout, fourth.stdout + fourth.stderr


@pytest.mark.timeout(180)
def test_a_failed_training_says_its_cause_once(tmp_path):
    """``varuna train`` whose data fails on one replica at P=1 x D=2: exit 1, and the cause (the
    failing rank's error, with the example's index) is printed once after ``training failed``, not
    once in the message and again in a per-rank listing; the peer's gloo error is not shown."""
    from tests.thirdparty.user_data import make_dataset
    from varuna_sdk.data.loader import ExampleLoader, split_examples

    n, gb = 400, 16
    train, _ = split_examples(n, 0.05, seed=0)
    bad = int(ExampleLoader(make_dataset(n), gb, seed=0, indices=train).example_indices(1)[gb // 2])
    (tmp_path / "job.yaml").write_text(
        "model: {factory: 'tests.thirdparty.user_data:Classifier'}\n"
        f"data: {{dataset: 'tests.thirdparty.user_data:OneBadExample', dataset_kwargs: {{n: {n}, bad: {bad}}}}}\n"
        f"parallel: {{P: 1, D: 2, global_batch: {gb}, micro_batch_size: 4}}\n"
        "train: {steps: 6, eval_batches: 1, checkpoint_every: 0}\n")
    out = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "train", str(tmp_path / "job.yaml"),
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=150)
    assert out.returncode == 1, out.stderr[-3000:]
    said = out.stderr[out.stderr.index("varuna: training failed"):]
    assert said.count(f"DataError: the dataset could not give example {bad}") == 1, said
    assert "--- rank" not in said and "Connection closed" not in said, said


def test_an_interrupt_passed_on_twice_at_once_is_one_stop_and_a_later_one_kills(tmp_path):
    """``timeout`` (or ``uv run``) passes on the SIGINT its process group got, so the manager's
    process gets two at once: that is one Ctrl-C — the job stops at a boundary with a checkpoint —
    not the second Ctrl-C that kills the workers (which it was). A second interrupt
    ``REPEAT_SIGNAL_S`` later still raises ``KeyboardInterrupt``. Real signals to this process."""
    import os
    import signal
    import time

    from varuna_sdk.manager.events import EventLog, Kind
    from varuna_sdk.runner import REPEAT_SIGNAL_S, stop_on_signals

    class Mgr:
        job_id = "sig"

        def __init__(self):
            self.log, self.cancels = EventLog(tmp_path / "events.db"), 0

        def cancel(self):
            self.cancels += 1

    mgr = Mgr()
    try:
        with stop_on_signals(mgr):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert mgr.cancels == 1
            time.sleep(REPEAT_SIGNAL_S)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1.0)
        assert [e.payload["by"] for e in mgr.log.events(kind=Kind.STOP_REQUEST_RECEIVED)] == ["SIGINT"]
    finally:
        mgr.log.close()


def test_logs_refuses_a_file_and_follow_on_a_new_folder_can_be_interrupted(tmp_path, capsys):
    """``varuna logs FILE`` (a config given by mistake) is refused at once, with or without
    ``--follow``, not waited on; ``--follow`` on a folder with no job yet waits, and a Ctrl-C
    (SIGINT) ends the wait with exit 130 and a line saying so, not a timeout message."""
    import signal
    import time

    from varuna_sdk.cli import main

    cfg = tmp_path / "job.yaml"
    cfg.write_text(TINY)
    for extra in ([], ["--follow"]):
        assert main(["logs", str(cfg), *extra]) == 2
        assert "is a file, not a run folder" in capsys.readouterr().err
    # SIGINT as a terminal's foreground command has it (a test run in a background job inherits it ignored)
    follow = subprocess.Popen([sys.executable, "-m", "varuna_sdk.cli", "logs", str(tmp_path / "new"), "--follow"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 60
        line = follow.stdout.readline()   # it says it waits, then waits
        assert line.startswith("[varuna] waiting for a job to start in"), line
        assert follow.poll() is None and time.time() < deadline
        follow.send_signal(signal.SIGINT)
        out = follow.communicate(timeout=30)[0]
    finally:
        follow.kill()
    assert follow.returncode == 130 and "varuna: interrupted (the job, if any, goes on)" in out, out
    assert "within" not in out and "Traceback" not in out, out


@pytest.mark.timeout(180)
def test_varuna_demo_runs_a_job_yaml_of_ones_own_on_the_emulated_spot_vms(tmp_path, capsys, monkeypatch):
    """``varuna demo job.yaml``: a job of one's own on the demo's emulated spot VMs (there was no
    command-line way to rehearse one's own job's morphs: helper-63). A job that ends before the
    trace's first pre-emption says why it saw no morph; a job of examples reports its held-out
    loss (no perplexity); a missing file is refused."""
    import json

    from varuna_sdk.cli import main

    monkeypatch.setenv("VARUNA_SDK_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "job.yaml").write_text(
        "name: mine\nmodel: {factory: 'tests.thirdparty.user_data:Classifier'}\n"
        "data: {dataset: 'tests.thirdparty.user_data:make_dataset'}\n"
        "parallel: {global_batch: 16, micro_batch_size: 4}\n"
        "train: {steps: 12, lr: 0.01, optimizer: SGD, optimizer_kwargs: {momentum: 0.9}, weight_decay: 0}\n")
    assert main(["demo", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "[demo] mine: tests.thirdparty.user_data:Classifier, global batch 16, 12 steps" in out, out
    assert "[demo] no morph: the job ended" in out and "before the trace pre-empted any VM" in out, out
    assert "[demo] held-out loss: start " in out and "perplexity" not in out, out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    assert main(["demo", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err
