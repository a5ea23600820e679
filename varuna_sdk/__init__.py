"""varuna-sdk: pipeline x data parallel training on pre-emptible VMs (after Varuna, arXiv 2111.04007).

The public face, imported lazily (PEP 562): ``from varuna_sdk import Job`` loads the notebook
handle only then, and ``import varuna_sdk.worker`` (on every VM) loads none of the notebook,
manager or dashboard. ``_EXPORTS`` maps each name of ``__all__`` to the module that owns it;
that module is the place to read about it.

    from varuna_sdk import Job, JobConfig          # a job from a notebook or script
    from varuna_sdk import Varuna, CutPoint        # the pipeline engine on your own model
    from varuna_sdk import calibrate, plan         # measure once, then rank (P, D, micro-batch)

Owns nothing but ``__version__`` and that table; imports nothing at import time (layering,
DESIGN.md: ``notebook/cli -> manager -> cluster, planner, checkpoint -> pipeline -> model``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # a job, end to end
    "Job": "varuna_sdk.notebook",
    "JobStatus": "varuna_sdk.notebook",
    "PlanView": "varuna_sdk.notebook",
    "train_local": "varuna_sdk.runner",
    "launch_job": "varuna_sdk.runner",
    "prepare_run": "varuna_sdk.runner",
    "JobObjects": "varuna_sdk.runner",
    # configuration
    "JobConfig": "varuna_sdk.config",
    "ModelConfig": "varuna_sdk.config",
    "DataConfig": "varuna_sdk.config",
    "ParallelConfig": "varuna_sdk.config",
    "TrainConfig": "varuna_sdk.config",
    "LaunchConfig": "varuna_sdk.config",
    "ClusterConfig": "varuna_sdk.config",
    "ConfigError": "varuna_sdk.config",
    # the model and the pipeline engine
    "CutPoint": "varuna_sdk.model",
    "auto_cutpoints": "varuna_sdk.model",
    "Varuna": "varuna_sdk.pipeline.engine",
    # calibration and planning
    "calibrate": "varuna_sdk.profiling.calibrate",
    "calibrate_job": "varuna_sdk.profiling.job",
    "Profile": "varuna_sdk.profiling.profile",
    "plan": "varuna_sdk.planner.plan",
    "Plan": "varuna_sdk.planner.rows",
    "Prices": "varuna_sdk.planner.rows",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """``varuna_sdk.<name>`` for a name of ``__all__``: imported from its module on first use
    (then cached here). Raises ``AttributeError`` for any other name."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'varuna_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
