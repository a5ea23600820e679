"""Model side: the model spec (``spec``: how any model is called and what its loss is),
cut-points, the dry-run tracer (weights on meta, inputs real: ``hybrid``), partitioning, stage
materialisation (the constructor replayed per stage: ``deferred``), the partition-invariant RNG
and the reference GPT-2 (one registered preset). Knows nothing of processes or networks; must
never import ``varuna_sdk.pipeline`` or anything above it."""

from .cutpoint import CutPoint, auto_cutpoints, observe_cutpoints
from .gpt2 import GPT2, GPT2Config, gpt2, init_gpt2, lm_loss, preset
from .materialize import build_on_meta, default_init, materialize
from .partition import PartitionError, StageMap, balanced_stage_map, shared_state, stage_state_names
from .rng import segment_rng
from .spec import CallSpec, ModelSpec, ModelSpecError, cross_entropy, model_loss
from .tracer import ModelStructure, trace_model

__all__ = [
    "CutPoint", "auto_cutpoints", "observe_cutpoints", "GPT2", "GPT2Config", "gpt2", "init_gpt2", "lm_loss",
    "preset", "build_on_meta", "default_init", "materialize", "PartitionError", "StageMap",
    "balanced_stage_map", "shared_state", "stage_state_names", "segment_rng", "ModelStructure", "trace_model",
    "CallSpec", "ModelSpec", "ModelSpecError", "cross_entropy", "model_loss",
]
