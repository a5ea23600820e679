#!/usr/bin/env bash
# One prepared GPU check for a single-GPU machine (issue 18 item 6); at most 8 minutes; never CI.
# Uses the machine's own torch (PYTHON, else /opt/torch/.venv/bin/python, else python3), builds the
# C++ core in place without network access, then runs scripts/gpu_check.py (see its docstring).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
[ -z "$PY" ] && [ -x /opt/torch/.venv/bin/python ] && PY=/opt/torch/.venv/bin/python
PY="${PY:-python3}"
echo "gpu_check: $($PY -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# the C++ core (schedules, simulator): scikit-build-core + pybind11 from that environment, offline
if ! $PY -c "import varuna_sdk._core" 2>/dev/null; then
  timeout 180 $PY -m pip install -q --no-index --no-build-isolation --no-deps -e . \
    || { echo "gpu_check: could not build varuna_sdk._core with $PY" >&2; exit 3; }
fi
missing=$($PY - <<'PY'
import importlib
print(" ".join(m for m in ("numpy", "yaml", "tqdm") if importlib.util.find_spec(m) is None))
PY
)
[ -n "$missing" ] && echo "gpu_check: missing Python modules on this machine: $missing (the engine needs them)" >&2
timeout 420 $PY scripts/gpu_check.py
