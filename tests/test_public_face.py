"""``varuna_sdk``'s public face: every name of ``__all__`` resolves (lazily, PEP 562), and a
worker's import does not drag in the notebook, the manager or the dashboard."""

from __future__ import annotations

import subprocess
import sys

import varuna_sdk


def test_every_name_of_all_resolves() -> None:
    missing = [n for n in varuna_sdk.__all__ if getattr(varuna_sdk, n, None) is None]
    assert not missing, missing
    assert varuna_sdk.Job.__name__ == "Job" and callable(varuna_sdk.plan) and callable(varuna_sdk.calibrate)


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        varuna_sdk.launch_local   # the name the engine's error once suggested
    except AttributeError as e:
        assert "launch_local" in str(e)
    else:
        raise AssertionError("varuna_sdk.launch_local resolved")


def test_importing_the_worker_loads_no_notebook_manager_or_dashboard() -> None:
    code = ("import sys, varuna_sdk.worker; print(' '.join(sorted(m for m in sys.modules "
            "if m.startswith(('varuna_sdk', 'dashboard')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = out.stdout.split()
    assert "varuna_sdk.worker" in loaded, out
    heavy = [m for m in loaded if m.startswith(("varuna_sdk.notebook", "dashboard", "varuna_sdk.manager.manager",
                                                 "varuna_sdk.manager.events", "varuna_sdk.planner"))]
    assert not heavy, loaded
