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


def test_a_value_overridden_on_the_command_line_is_not_blamed_on_the_file(tmp_path, capsys):
    from varuna_sdk.cli import main

    (tmp_path / "job.yaml").write_text("name: x\ntrain:\n  steps: 5\n")
    assert main(["train", str(tmp_path / "job.yaml"), "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "train.steps=0 must be an integer >= 1" in err and "line" not in err, err
