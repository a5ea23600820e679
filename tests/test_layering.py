"""The layering of DESIGN.md, enforced: every import in varuna_sdk/ and dashboard/ points down.

Each module belongs to a *unit* (a sub-package such as ``manager`` or a top-level module such as
``trainer``), and each unit to a layer. A module may import its own unit and any unit of a lower
layer, never a unit of its own or a higher layer. Imports inside functions count the same as
top-level ones: a lazy import is still a dependency. The table below is the order; a new unit
must be placed in it (the test says so), which is the point: where a new module sits is a
decision, not an accident.

Three places may import the dashboard (it sits above the SDK it displays): the ``varuna
dashboard`` command serves it, and a notebook's ``Job.dashboard()`` shows it inline. They are
listed by name in ``DASHBOARD_ENTRY_POINTS``; anything else (a colour table, say) lives below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# bottom -> top. A unit may import only units in strictly lower layers (or itself).
LAYERS: list[set[str]] = [
    {"_core"},  # the compiled C++ core, reached only through _native
    {"varuna_sdk", "_native", "config", "shipping", "palette"},  # leaves; the root's __version__
    {"model", "data"},
    {"pipeline", "checkpoint"},
    {"jobspec"},  # resolves a job's model/data/loss spec
    {"optimizer"},  # the job's optimizer (train.optimizer): built by the workers and the reference, sized by the planner
    {"profiling"},  # calibration, including of a whole job (calibrate_job)
    {"planner"},  # simulator face and configuration search
    {"cluster"},  # hosts, SSH, providers
    {"manager"},  # morphing, heartbeats, event log
    {"trainer"},  # the training loop a worker runs: never imported by the manager
    {"reference"},  # the unpartitioned model trained by plain PyTorch (Job.plain_pytorch_losses)
    {"runner", "worker"},  # runner: the one run façade (was launch.py)
    {"demo"},
    {"dashboard"},
    {"notebook", "cli"},
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}

# (importing unit, imported module) -> names it may take; None means the whole module.
DASHBOARD_ENTRY_POINTS: dict[tuple[str, str], set[str] | None] = {
    ("cli", "dashboard.server"): None,  # `varuna dashboard RUN_DIR`
    ("cli", "dashboard.store"): None,
    ("notebook", "dashboard.app"): {"build_app"},  # Job.dashboard() shows it inline
}


def unit_of(module: str) -> str:
    """``varuna_sdk.manager.wire`` -> ``manager``; ``varuna_sdk`` -> ``varuna_sdk``; ``dashboard.x`` -> ``dashboard``."""
    parts = module.split(".")
    if parts[0] == "dashboard":
        return "dashboard"
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[str, set[str], int]]:
    """Every (imported module, names taken, line) in ``source``, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, set(), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = {alias.name for alias in node.names}
            if (node.level and not node.module) or target == "varuna_sdk":  # `from . import x`
                # x is a sub-module (or, from the root, a name of the public face: its module)
                found += [(target, {n}, node.lineno) if n == "__version__"
                          else (f"{target}.{n}", set(), node.lineno) for n in names]
            else:
                found.append((target, names, node.lineno))
    return [f for f in found if f[0].split(".")[0] in ("varuna_sdk", "dashboard")]


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What ``source`` (the text of ``module``) imports against the layering, in words."""
    me = unit_of(module)
    if module == "varuna_sdk":  # the root's public face re-exports lazily by name; exempt
        return []
    if me not in LAYER_OF:
        return [f"{module}: unit {me!r} is in no layer: place it in tests/test_layering.py LAYERS"]
    out = []
    for target, names, line in imports_of(source, module, is_package):
        other = unit_of(target)
        if other == me:
            continue
        if other == "varuna_sdk" and names <= {"__version__"}:
            continue
        if other == "dashboard":
            allowed = DASHBOARD_ENTRY_POINTS.get((me, target), set())
            if allowed is None or (names and names <= allowed):
                continue
            out.append(f"{module}:{line} imports {sorted(names) or target} from {target}: only the "
                       "dashboard's entry points may; move what it needs below the dashboard")
            continue
        if other not in LAYER_OF:
            out.append(f"{module}:{line} imports {target}: unit {other!r} is in no layer")
        elif LAYER_OF[other] >= LAYER_OF[me]:
            out.append(f"{module}:{line} imports {target} ({other}, layer {LAYER_OF[other]}) but "
                       f"{me} is layer {LAYER_OF[me]}: dependencies must point down")
    return out


def all_modules() -> list[Path]:
    return sorted(p for d in ("varuna_sdk", "dashboard") for p in (ROOT / d).rglob("*.py"))


def test_every_import_points_down() -> None:
    bad = []
    for path in all_modules():
        bad += violations(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not bad, "layering broken (DESIGN.md):\n" + "\n".join(bad)


@pytest.mark.parametrize("module, source, expected", [
    # each inversion fixed by the house issue, put back: the checker must see it
    ("varuna_sdk.manager.manager", "def f():\n    from ..trainer import calibrate_job\n", "trainer"),
    ("varuna_sdk.notebook", "from dashboard.app import ACTION_COLORS\n", "ACTION_COLORS"),
    ("varuna_sdk.profiling.calibrate", "from ..cluster.local import spawn_workers\n", "cluster"),
    ("varuna_sdk.worker", "import varuna_sdk.notebook\n", "notebook"),
    ("varuna_sdk.brand_new", "import torch\n", "in no layer"),
])
def test_the_checker_sees_an_inversion(module: str, source: str, expected: str) -> None:
    found = violations(source, module)
    assert found and expected in found[0], found


def test_the_checker_allows_what_is_allowed() -> None:
    assert violations("from dashboard.app import build_app\n", "varuna_sdk.notebook") == []
    assert violations("from ..pipeline import engine\n", "varuna_sdk.manager.manager") == []
    assert violations("from .. import __version__\n", "varuna_sdk.cluster.bootstrap") == []
    assert violations("from . import wire\n", "varuna_sdk.manager", is_package=True) == []
