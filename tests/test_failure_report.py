"""How a failed job tells its failure: the first rank's own error (never a line a dying peer wrote,
such as ``terminate called without an active exception``, nor a peer's consequent gloo error), in one
line for the SDK's explained errors (with where the workers' full output is), with that rank's
traceback ending with its exception line for any other error — on ``varuna train``'s stderr, in
``varuna status`` and in ``varuna logs --events``; the tracebacks stay in ``gen<g>/workers.log``.

The text selection (``manager.results.failure_excerpt``) on crafted rank output; real
``varuna train`` jobs (P=1 x D=2, local processes) whose model fails deterministically in the
workers only (the launcher's dry run passes): a loss that is NaN (``NonFiniteLossError``) and a
``TypeError`` raised by the model's code (``tests.thirdparty.misbehaving``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from varuna_sdk.manager.results import LOG_ONLY, explained, failure_excerpt, short_error

REPO = Path(__file__).resolve().parent.parent

NONFINITE = ("varuna_sdk.trainer.NonFiniteLossError: steps 1..3 of 4 (metrics.jsonl's \"step\" 0..2): the loss or "
             "the gradients were not finite (last loss nan) 3 steps in a row in fp32, so no step was applied")
TRACEBACK = [
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/work/main/varuna_sdk/worker.py", line 209, in <module>',
    "[rank1]:     _exit_now(main())",
    '[rank1]:   File "/work/main/varuna_sdk/trainer.py", line 632, in _count_skipped',
    "[rank1]:     raise NonFiniteLossError(",
    f"[rank1]: {NONFINITE}",
]
GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:49587")


# ------------------------------------------------------------------------------ text selection
def test_a_line_written_after_the_exception_is_not_the_error():
    """The tester's race: the failing rank's process aborted in its teardown after its traceback
    (``terminate called without an active exception``); the error is its exception line, and the
    excerpt ends with it, whether or not the worker's goodbye said the error."""
    tail = ["step 3/4 | loss nan", *TRACEBACK, "terminate called without an active exception"]
    for said in (NONFINITE, None):
        got = failure_excerpt(tail, said)
        assert got[0] == "Traceback (most recent call last):", got
        assert got[-1] == NONFINITE, got
        assert not any("terminate called" in x or x.startswith("[rank") for x in got), got


def test_a_peer_s_gloo_error_and_abort_are_not_taken():
    """A tail holding a peer-style gloo traceback after the rank's own: the goodbye's error picks the
    rank's own traceback; without a goodbye the last traceback is told (with its exception line)."""
    gloo_tb = ["Traceback (most recent call last):", '  File "x.py", line 1, in f', "    dist.all_reduce(t)", GLOO]
    tail = [*TRACEBACK, "terminate called without an active exception", *gloo_tb]
    assert failure_excerpt(tail, NONFINITE)[-1] == NONFINITE
    assert failure_excerpt(tail, None) == gloo_tb
    # nothing but the abort line in the tail: the goodbye's error, never the abort
    assert failure_excerpt(["terminate called without an active exception"], NONFINITE) == [NONFINITE]
    assert failure_excerpt(["terminate called without an active exception", "boom"], None) == ["boom"]


def test_the_worker_s_marked_report_is_preferred_and_chained_causes_come_first():
    """Lines the worker marked ``LOG_ONLY`` are its report (other lines in the tail are not); a
    chained exception's traceback starts with its cause's and ends with the last exception line;
    a message of several lines is kept whole."""
    report = ["Traceback (most recent call last):", '  File "a.py", line 1, in g', "KeyError: 'x'",
              "The above exception was the direct cause of the following exception:",
              "Traceback (most recent call last):", '  File "a.py", line 3, in f', "TypeError: bad",
              "second line of the message"]
    tail = ["some warning"] + [LOG_ONLY + x for x in report] + ["terminate called without an active exception"]
    assert failure_excerpt(tail, "TypeError: bad\nsecond line of the message") == report
    assert failure_excerpt(tail, None) == report[:-1]


def test_explained_errors_and_short_names():
    assert explained(NONFINITE) and explained("varuna_sdk.data.loader.DataError: example 3 ...")
    assert explained("ModelSpecError: the targets hold class id 14")
    assert not explained("TypeError: user code broke") and not explained(GLOO) and not explained(None)
    assert short_error(NONFINITE).startswith("NonFiniteLossError: steps 1..3 of 4")
    assert short_error("TypeError: a.b: c") == "TypeError: a.b: c"


# ------------------------------------------------------------------------------ real jobs
def nan_classifier(**kwargs):
    """``tests.thirdparty.user_data.Classifier`` whose output is NaN in a training worker (the
    launcher's dry run, without ``VARUNA_GENERATION``, sees finite outputs): every step's loss is NaN,
    so the job fails with ``NonFiniteLossError`` after 3 skipped steps, on every rank."""
    from tests.thirdparty.user_data import Classifier

    model = Classifier(**kwargs)
    if "VARUNA_GENERATION" not in os.environ:
        return model
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kw):
        return inner(*args, **kw) * float("nan")

    model.forward = forward
    return model


def _train(tmp_path: Path, model: str, data: str) -> tuple[subprocess.CompletedProcess, Path]:
    run = tmp_path / "run"
    (tmp_path / "job.yaml").write_text(
        f"model: {model}\ndata: {data}\n"
        "parallel: {P: 1, D: 2, global_batch: 8, micro_batch_size: 4}\n"
        "train: {steps: 6, eval_batches: 1, checkpoint_every: 0}\n")
    out = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", "train", str(tmp_path / "job.yaml"),
                          "--run-dir", str(run)], capture_output=True, text=True, timeout=150, cwd=REPO)
    return out, run


def _varuna(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "varuna_sdk.cli", *args], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _after_failure(stderr: str) -> list[str]:
    return stderr[stderr.index("varuna: training failed"):].strip().splitlines()


@pytest.mark.timeout(200)
def test_an_explained_error_is_one_line_naming_the_rank_s_own_error(tmp_path):
    """Every rank raises ``NonFiniteLossError``: the job's reason is that error (never ``terminate
    called...``), said in one line with where the full output is; no traceback on the terminal,
    in ``varuna status`` or in ``varuna logs --events``; the tracebacks are in the workers' log."""
    out, run = _train(tmp_path, "{factory: 'tests.test_failure_report:nan_classifier'}",
                      "{dataset: 'tests.thirdparty.user_data:make_dataset', dataset_kwargs: {n: 200}}")
    assert out.returncode == 1, out.stderr[-3000:]
    after = _after_failure(out.stderr)
    assert len(after) < 15 and len(out.stderr.strip().splitlines()) < 15, out.stderr
    assert "training diverged" in after[0] and "NonFiniteLossError: steps 1..3" in after[0], after
    assert f"varuna logs {run.resolve()}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "terminate called" not in out.stderr, out.stderr
    assert "Connection closed" not in out.stderr and "[rank1]:" not in out.stderr, out.stderr
    status = _varuna("status", str(run))
    reason = [x for x in status.splitlines() if x.startswith("FAILED: ")]
    assert reason and "NonFiniteLossError: steps 1..3" in reason[0], status
    assert "Traceback" not in status and "terminate called" not in status, status
    events = _varuna("logs", str(run), "--events")
    assert "Traceback" not in events and "NonFiniteLossError" in events, events
    logs = _varuna("logs", str(run))   # the full output: every rank's traceback, unmarked
    assert logs.count("Traceback (most recent call last):") >= 1 and LOG_ONLY not in logs, logs[-3000:]
    assert any(x.rstrip().endswith(("NonFiniteLossError: " + NONFINITE.split(": ", 1)[1][:30]))
               or "NonFiniteLossError: steps 1..3" in x for x in logs.splitlines()), logs[-3000:]


@pytest.mark.timeout(200)
def test_a_bug_in_the_user_s_code_shows_that_rank_s_traceback_ending_with_its_error(tmp_path):
    """Rank 1's model raises ``TypeError`` (rank 0 then fails in a collective): the job's reason is
    rank 1's error, then rank 1's traceback only, ending with the exception line; rank 0's gloo
    error is not shown; ``varuna status`` shows the same, ending with the exception line."""
    text = tmp_path / "tale.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 100)
    out, run = _train(tmp_path, "{factory: 'tests.thirdparty.misbehaving:raises_on_rank', "
                                "kwargs: {rank: 1, at_call: 3, n_layer: 2, block_size: 32}}",
                      f"{{path: '{text}', tokenizer: byte, seq_len: 16}}")
    assert out.returncode == 1, out.stderr[-3000:]
    after = _after_failure(out.stderr)
    error = "TypeError: user code broke on call 3 (TypeError)"
    assert "programming error" in after[0] and error in after[0] and "rank 1 on local1" in after[0], after
    assert after[1].endswith("Traceback (most recent call last):") and after[-1].endswith(error), after
    assert all(x.startswith("[local1 rank 1] ") for x in after[1:]), after
    assert out.stderr.count("Traceback (most recent call last):") == 1, out.stderr
    assert "Connection closed" not in out.stderr and "terminate called" not in out.stderr, out.stderr
    status = _varuna("status", str(run)).strip().splitlines()
    assert any(x.startswith("FAILED: ") and error in x for x in status), status
    shown = status[[i for i, x in enumerate(status) if x.startswith("FAILED: ")][0]:]
    assert [x for x in shown if x.startswith("[local1 rank 1]")][-1].endswith(error), status
    events = _varuna("logs", str(run), "--events")
    assert error in events and "Traceback" not in events and "Connection closed" not in events, events
