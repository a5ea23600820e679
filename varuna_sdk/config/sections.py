"""The five sections of a job config (``ModelConfig``, ``DataConfig``, ``ParallelConfig``,
``TrainConfig``, ``LaunchConfig``: one YAML mapping each), the rule of every one of their fields
(``RULES``) and ``check_fields``, which applies them. The names of the pipeline schedules
(``POLICIES``) and of the numeric precisions (``PRECISIONS``) are defined here, once.

How fields fit together is ``config.checks``'s; the whole job (``JobConfig``) is the package's.
Imports only ``config.fields`` from ``varuna_sdk`` (``config`` is the bottom of the dependency
graph).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .fields import MAX_GPUS, ConfigError, Flag, Int, Num, Plain, Text, plain

POLICIES = ("varuna", "gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class ModelConfig:
    """Which model to train (the *model spec*, DESIGN.md), named one of three ways:

    - ``factory``: an import path ``package.module:function`` (or ``:Class``) in the user's code
      folder, called as ``function(**kwargs)`` and returning the whole ``nn.Module`` (its tensors
      are made on the meta device; each worker computes only its stage's) — or the name of a
      registered model (``gpt2``, ``hf-causal-lm``, ``hf-masked-lm``; see ``varuna_sdk.jobspec.MODELS``);
    - ``by_value``: set by ``Job(model=...)`` for a callable defined in a notebook cell or
      ``__main__``, shipped by value (cloudpickle) with the job — not written by hand;
    - neither: the GPT-2 ``preset`` (``tiny``, ``cpu-demo``, ``gpt2`` … ``gpt2-xl``, default
      ``cpu-demo``) with ``n_layer``/``n_head``/``n_embd``/``dropout`` overriding it.

    ``loss``: ``null`` (automatic: the model's own loss when its forward takes ``labels`` or
    ``targets``, else cross-entropy of its logits), ``model``, ``cross_entropy`` or an import path
    of ``(output, targets) -> scalar``. ``inputs``: which batch fields feed the forward — a list
    (positional) or a mapping argument → field; ``targets``: the field the loss compares with
    (``null``: automatic; see ``model.spec.infer_call``), or a list of fields for a loss of several
    targets (a multi-task loss: it gets a dict field → tensor). ``blocks``: the dotted name of the
    model's list of layers where cut-points go (``null``: its largest ``ModuleList``), or a list of
    its blocks' dotted names in the order the forward calls them (blocks kept as attributes). ``init``:
    ``null`` (the model's own constructor, replayed per stage) or an import path of
    ``init_fn(module, name)`` for a model too large to record once."""

    preset: str | None = None
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    dropout: float = 0.0
    factory: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss: str | None = None
    inputs: list[str] | dict[str, str] | None = None
    targets: str | list[str] | None = None
    blocks: str | list[str] | None = None
    init: str | None = None
    by_value: str | None = None


@dataclass
class DataConfig:
    """Training data, tokenizer and sequence length.

    Where the data comes from (the first that is set): ``by_value`` (a dataset factory shipped
    by ``Job(data=...)``), ``dataset`` (an import path ``pkg.mod:fn`` returning a map-style
    ``torch.utils.data.Dataset``, called with ``dataset_kwargs``), ``path`` (a text file, a folder
    of text files, a pre-tokenized ``.bin`` (``token_dtype`` ``uint16``/``uint32``) or ``.npy``
    file, a ``datasets`` dataset saved with ``save_to_disk``, or local ``json``/``jsonl``/
    ``parquet``/``csv`` files whose ``text_column`` holds the text; ``format`` ``auto`` tells them
    apart), else the shipped ``corpus`` (``shakespeare``, the default; ignored when one of the
    others is set). ``tokenizer``: ``gpt2`` (real BPE),
    ``byte``, the path of a ``tokenizer.json``, or ``None`` for a dataset whose examples are already
    tensors (``dataset``/``by_value``) and a model that takes its vocabulary from nowhere else.
    ``seq_len`` tokens per example, the held-out fraction (the end of a text or token stream; of a
    dataset, examples drawn at random from the data seed; ``0``: none held out, every example trains and no
    held-out loss is measured) and the data seed (the order of examples). ``mlm_probability``
    (token data only; e.g. 0.15): masked-LM examples for a model such as BERT — each token chosen
    with that probability is masked (80 %), replaced by a random token (10 %) or kept (10 %), and
    ``labels``/``targets`` hold the chosen tokens' ids (-100 elsewhere: not predicted); drawn per
    example from ``seed``, so they are the same at any P, D and through morphs (``data.mlm``).
    ``mask_token``: the mask token's text (default: ``[MASK]`` or ``<mask>``, whichever the
    tokenizer has; ``gpt2`` and ``byte`` have none: give a tokenizer.json). ``prefetch``: each rank
    reads the next step's batch on a background thread while a step trains (``data.prefetch``);
    ``false`` reads it on the main thread, for a dataset that must be read on the thread that
    opened it (an ``sqlite3`` connection)."""

    corpus: str | None = "shakespeare"
    path: str | None = None
    format: str = "auto"
    text_column: str = "text"
    token_dtype: str | None = None
    dataset: str | None = None
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    by_value: str | None = None
    tokenizer: str | None = "gpt2"
    seq_len: int = 128
    val_fraction: float = 0.05
    seed: int = 0
    mlm_probability: float | None = None
    mask_token: str | None = None
    prefetch: bool = True


@dataclass
class ParallelConfig:
    """How the job is split. ``P`` stages × ``D`` replicas; ``global_batch`` examples per
    optimizer step (fixed, never changed by morphing) = ``micro_batch_size`` × m × ``D``.
    ``boundaries`` optionally gives the segment indices of each stage (``[[0, 1], [2, 3]]``);
    ``None`` balances stages on estimated cost. ``recompute``: one flag for every stage or a list
    of P flags (one per stage, the last stage's ignored: it never recomputes; the planner's choice,
    ``planner.recompute``); ``None`` = the policy's default (Varuna: on; GPipe, 1F1B: off), which
    the planner replaces by a per-stage choice from the memory limit. ``max_in_flight`` (Varuna
    only): per stage, the most micro-batches whose activations the stage holds at once (0 = no
    cap; ``pipeline.schedule.StageScheduler``), one integer for every stage, or ``None`` = no
    caps; the planner keeps one integer as a ceiling on its per-stage caps and replaces a list. ``split_backward`` (Varuna only) splits each backward into
    the input gradient (B, sent upstream at once) and the weight gradients (W, deferred into the
    stage's waits; the zero-bubble split); ``None`` = the policy's default. ``P``/``D`` ``None`` =
    let the planner choose for ``launch.gpus`` workers from a calibration (paper §4.4); it then
    chooses ``micro_batch_size`` too (the configured one, still an integer >= 1 that sizes the dry run,
    is replaced by the plan's; ``varuna plan`` keeps it only where P or D is fixed)."""

    P: int | None = 1
    D: int | None = 1
    global_batch: int = 8
    micro_batch_size: int = 1
    policy: str = "varuna"
    recompute: bool | list[bool] | None = None
    boundaries: list[list[int]] | None = None
    shared_params: list[str] | None = None
    split_backward: bool | None = None
    max_in_flight: int | list[int] | None = None

    def __post_init__(self) -> None:
        _make_plain(self)   # tuples and NumPy scalars kept as the lists and ints YAML and JSON give

    def stage_caps(self, P: int) -> list[int]:
        """``max_in_flight`` as one cap per stage of a ``P``-stage pipeline (0 = no cap): the list
        itself, one integer repeated, or zeros for ``None``. Raises ``ValueError`` when a list does
        not have ``P`` entries or P is not an integer >= 1, and ``ConfigError`` (a ``ValueError``)
        for a cap that is not an integer >= 0."""
        if not (isinstance(P, int) and not isinstance(P, bool) and P >= 1):
            raise ValueError(f"P={P!r} must be an integer >= 1 (the pipeline's stages)")
        caps = plain(self.max_in_flight)
        RULES[ParallelConfig]["max_in_flight"].check("parallel.max_in_flight", caps)   # each cap an integer >= 0
        if caps is None:
            return [0] * P
        if not isinstance(caps, list):
            return [caps] * P
        if len(caps) != P:
            raise ValueError(f"parallel.max_in_flight lists {len(caps)} stages but P={P}; give one cap per stage, "
                             "one integer for every stage, or null")
        return list(caps)

    @property
    def num_micro_batches(self) -> int:
        """m = global_batch / (micro_batch_size × D)."""
        return self.global_batch // (self.micro_batch_size * self.D)

    @property
    def replica_batch(self) -> int:
        """Examples each replica processes per step (= global_batch / D)."""
        return self.global_batch // self.D

    @property
    def world_size(self) -> int:
        """Workers of the job (= P × D); ``ConfigError`` while P or D is left to the planner."""
        if self.P is None or self.D is None:
            raise ConfigError("P and D are not chosen yet (null = planned); run the planner first")
        return self.P * self.D

    @property
    def planned(self) -> bool:
        """True when P or D is left to the planner."""
        return self.P is None or self.D is None


@dataclass
class TrainConfig:
    """Optimisation: steps, learning rate and weight decay (on matrices only), the optimizer
    (``optimizer``: a ``torch.optim`` class by name — ``AdamW``, the default, with betas (0.9,
    0.95) — or ``'mypkg.optim:Lion'``; its other settings in ``optimizer_kwargs``, e.g.
    ``{momentum: 0.9}``: ``varuna_sdk.optimizer``), warm-up steps (linear) then
    cosine decay to ``min_lr``, global grad-norm clipping (``None`` = off), numeric precision,
    initial dynamic loss scale for fp16, model seed, evaluation size, where runs are written.

    Checkpoints (paper §4.5, ``varuna_sdk.checkpoint``): ``checkpoint_every`` optimizer steps
    (0 = automatic: every job the manager runs — ``varuna train``/``launch``, ``Job.launch()`` —
    checkpoints about every 10 % of its steps, at least every 25 and at most every step, so that a
    sudden loss cannot lose the run; a worker run without a manager then checkpoints only when
    asked to stop), and after the last step (the trained model: ``Job.trained_weights()``,
    ``varuna export``), published to ``checkpoint_url`` (a path or any fsspec
    URL such as ``s3://bucket/job``; ``None`` = ``<run folder>/checkpoints``), the newest
    ``keep_checkpoints`` complete ones kept; ``resume`` starts from the newest complete checkpoint
    in that store (under the job's current P, D and stage boundaries) when there is one."""

    steps: int = 50
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    optimizer: str = "AdamW"
    optimizer_kwargs: dict = field(default_factory=dict)
    warmup_steps: int = 5
    grad_clip: float | None = 1.0
    precision: str = "fp32"
    loss_scale: float = 2.0**16
    seed: int = 1234
    eval_batches: int = 8
    run_dir: str = "runs"
    checkpoint_every: int = 0
    checkpoint_url: str | None = None
    keep_checkpoints: int = 3
    resume: bool = True


@dataclass
class LaunchConfig:
    """Local launch: torch.distributed backend (``auto`` = NCCL when every worker has a GPU,
    else gloo), ``gpus`` = workers the planner may use when P/D are null, rendezvous address
    and port (0 = pick a free one), timeouts in seconds."""

    backend: str = "auto"
    gpus: int = 4
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 120.0
    threads_per_worker: int = 1


_OPT = Text(optional=True)
BIG = 10 ** 9
RULES: dict[type, dict[str, Any]] = {
    ModelConfig: {"preset": _OPT, "n_layer": Int(1, 4096, True), "n_head": Int(1, 4096, True),
                  "n_embd": Int(1, 1 << 17, True), "dropout": Num(0.0, 1.0, hi_open=True, unit="a probability"),
                  "factory": _OPT, "kwargs": Plain("map", optional=False), "loss": _OPT,
                  "inputs": Plain("inputs"), "targets": Plain("targets"), "blocks": Plain("blocks"), "init": _OPT, "by_value": _OPT},
    DataConfig: {"corpus": _OPT, "path": _OPT,
                 "format": Text(("auto", "text", "tokens", "hf", "json", "jsonl", "parquet", "csv")),
                 "text_column": Text(), "token_dtype": Text(("uint16", "uint32"), optional=True), "dataset": _OPT,
                 "dataset_kwargs": Plain("map", optional=False), "by_value": _OPT,
                 "tokenizer": Text(optional=True, hint="'gpt2', 'byte' or the path of a tokenizer.json"),
                 "seq_len": Int(1, 1 << 20), "val_fraction": Num(0.0, 1.0, False, True),
                 "seed": Int(0, 2 ** 63 - 1),
                 "mlm_probability": Num(0.0, 1.0, True, True, optional=True, unit="a probability"),
                 "mask_token": _OPT, "prefetch": Flag()},
    ParallelConfig: {"P": Int(1, 4096, True), "D": Int(1, 1 << 20, True), "global_batch": Int(1, 1 << 30),
                     "micro_batch_size": Int(1, 1 << 20), "policy": Text(POLICIES),
                     "recompute": Plain("stage_flags"), "max_in_flight": Plain("stage_counts"),
                     "split_backward": Flag(True), "boundaries": Plain("index_lists"), "shared_params": Plain("names")},
    TrainConfig: {"steps": Int(1, BIG), "lr": Num(0.0, 10.0, lo_open=True), "min_lr": Num(0.0, 10.0),
                  "weight_decay": Num(0.0, 10.0), "warmup_steps": Int(0, BIG),
                  "optimizer": Text(hint="a torch.optim optimizer's name (AdamW, SGD, Adam, ...) or the import "
                                         "path of an optimizer class of your own ('mypkg.optim:Lion')"),
                  "optimizer_kwargs": Plain("map", optional=False),
                  "grad_clip": Num(0.0, 1e9, lo_open=True, optional=True), "precision": Text(PRECISIONS),
                  "loss_scale": Num(1.0, 2.0 ** 64), "seed": Int(0, 2 ** 63 - 1), "eval_batches": Int(1, 1 << 20),
                  "run_dir": Text(), "checkpoint_every": Int(0, BIG), "checkpoint_url": Text(optional=True, hint=(
                      "a path or an fsspec URL (e.g. '/shared/ckpt', 'file:///shared/ckpt', 's3://bucket/job'); "
                      "null: <run folder>/checkpoints")),
                  "keep_checkpoints": Int(1, 10_000), "resume": Flag()},
    LaunchConfig: {"backend": Text(("auto", "gloo", "nccl")), "gpus": Int(1, MAX_GPUS), "master_addr": Text(),
                   "master_port": Int(0, 65535), "timeout_s": Num(0.0, 7 * 86400.0, lo_open=True, unit="seconds"),
                   "threads_per_worker": Int(1, 1024)},
}


def check_fields(section: str, obj: Any) -> None:
    """Apply ``RULES`` to every field of the section ``obj`` (a config dataclass): each value has
    its type and range (finite floats, integers that are integers, bounded strings, lists and
    mappings). Raises ``ConfigError`` naming ``section.field``, the value and what would work."""
    rules = RULES[type(obj)]
    _make_plain(obj)   # NumPy scalars and tuples (a notebook's values, set at any time) as plain data
    for f in fields(obj):
        rules[f.name].check(f"{section}.{f.name}", getattr(obj, f.name))


def _make_plain(obj: Any) -> None:
    """Replace, in place, every field of the config dataclass ``obj`` that ``plain`` changes."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if plain(v) is not v:
            setattr(obj, f.name, plain(v))
