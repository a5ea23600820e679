"""The README's first screen works as written: its "Train your own model" snippet defines a model
in ``__main__``-like code and makes a ``Job`` of it on a text file — resolved and checked (the
plan and launch lines are what the other tests run)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_train_your_own_model_snippet_resolves(tmp_path, monkeypatch):
    text = README.read_text()
    head = text[:text.index("## What `make demo` does")]
    assert "## Train your own model" in head, "the snippet must stay on the README's first screen"
    code = head.split("## Train your own model")[1].split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    Path("my_text.txt").write_text("To be, or not to be, that is the question. " * 2000)
    setup = code.split("job.plan(")[0]          # everything up to planning
    env: dict = {"__name__": "__main__"}
    exec(compile(setup, "README.md", "exec"), env)
    job = env["job"]
    assert job.resolved.spec.name == "MyModel"
    assert job.resolved.spec.call.describe() == "model(input_ids), loss(output, targets)"
    assert job.config.train.steps == 500 and job.config.data.path == "my_text.txt"
    assert "job.plan(gpus=8)" in code and "job.launch()" in code


SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from varuna_sdk import Job
from tests.thirdparty.user_data import Classifier, make_dataset

job = Job(model=Classifier, data=make_dataset, steps=2, global_batch=8)
print("BUILT", flush=True)
job.plan(gpus=2)
print("PLANNED", flush=True)
"""


def test_a_script_that_plans_at_its_top_level_fails_saying_to_add_the_main_guard(tmp_path):
    """Planning calibrates in worker processes, each of which imports the main script again (as
    ``multiprocessing`` does): a script without ``if __name__ == "__main__":`` ran its whole top
    level again in every calibration worker — building, checking and even launching the job
    there, while the calibration measured (a helper's script: 4 extra jobs, the step 3x slower).
    Each worker now refuses at ``Job()`` and the plan fails naming the script and the fix (a
    worker calling the script's functions later is not at its top level: the notebooks' and the
    CLI's plans are the other tests')."""
    import os
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "VARUNA_SDK_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": repo}
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=repo))
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode != 0 and p.stdout.split() == ["BUILT"], p.stdout + p.stderr   # built once: not in a worker
    assert f"ConfigError: {script} builds a job at its top level, and this worker process (varuna-worker-" in p.stderr
    assert "put the code that builds, plans and launches jobs under `if __name__ == \"__main__\":`" in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("varuna_sdk.pipeline.spawn.WorkerFailure: worker rank ") and \
        f"re-importing the main script {script}" in last and 'if __name__ == "__main__":' in last, last
