"""Per-layer checkpoints: saved by cut-point segment under parameter names (any stage map loads
them), written locally and published in the background to a path or any fsspec URL, made
complete only by a manifest written last, verified on load, the newest K kept (paper §4.2, §4.5).

Modules: ``store`` (layout, manifest, ``latest_complete``, pruning), ``writer`` (one rank's
background writer), ``stage`` (what a pipeline stage saves and loads, resume agreement),
``export`` (the whole trained model's ``state_dict`` read back from a checkpoint).
Sits on ``pipeline`` and ``model``; never imports ``trainer``, ``cluster`` or ``manager``.
"""

from .stage import (StageCheckpointer, StageState, default_staging_dir, default_store_url, load_verified, owner_segments,
                    plan_writes)
from .export import full_state_dict, read_model_state
from .store import CheckpointError, CheckpointInfo, Store, complete_checkpoints, latest_complete, prune
from .writer import CheckpointWriter

__all__ = [
    "CheckpointError", "CheckpointInfo", "CheckpointWriter", "StageCheckpointer", "StageState", "Store",
    "complete_checkpoints", "default_staging_dir", "default_store_url", "full_state_dict", "latest_complete",
    "load_verified", "owner_segments", "plan_writes", "prune", "read_model_state",
]
