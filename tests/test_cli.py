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
