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
