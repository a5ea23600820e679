"""Field rules of a job config: the descriptors (``Int``, ``Num``, ``Text``, ``Flag``, ``Plain``) each
field of each section is checked with, the size limits of untrusted input (``MAX_*``), the job
name's pattern (``NAME_RE``, ``check_name``) and ``ConfigError``, the one error every check raises.

A rule checks one value alone (its type, its range, its size); how fields fit together is
``config.checks``'s. Imports nothing from ``varuna_sdk`` (not even the rest of ``config``): it is
the bottom of the dependency graph.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what would work."""


# ------------------------------------------------------------------------------ limits
# Every field of every section has a rule (``config.sections.RULES``; a test checks that none is
# missing); ``check_fields`` applies them before any relationship between fields is checked, so no
# comparison in ``config.checks`` ever meets a string, NaN or a list where a number belongs.
MAX_TEXT = 4096            # characters of any string field (paths, import paths, names)
MAX_ITEMS = 4096           # items of any list, and entries of a mapping tree (kwargs)
MAX_DEPTH = 8              # nesting of kwargs mappings
MAX_CONFIG_BYTES = 1 << 20  # a job YAML file or text
MAX_GPUS = 4096            # workers a job (and the planner's search) may have
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def plain(v: Any) -> Any:
    """``v`` as the plain data YAML and JSON hold: a NumPy scalar (``np.int64(4)``, ``np.bool_``,
    ``np.float32``) becomes its Python value and a tuple a list, inside lists and mappings too;
    anything else, and plain data already, is returned as is (the same object; the rules then judge
    it). NumPy is never imported."""
    if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        return v.item()
    if isinstance(v, (list, tuple)):
        got = [plain(x) for x in v]
        return v if isinstance(v, list) and all(a is b for a, b in zip(got, v)) else got
    if isinstance(v, dict):
        got = {k: plain(x) for k, x in v.items()}
        return v if all(got[k] is x for k, x in v.items()) else got
    return v


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@dataclass(frozen=True)
class Int:
    """An integer (not a bool) in [lo, hi]."""

    lo: int
    hi: int
    optional: bool = False

    def check(self, where: str, v: Any) -> None:
        """Raise ``ConfigError`` naming ``where`` (``section.field``) unless ``v`` follows this rule."""
        if v is None and self.optional:
            return
        null = ", or null" if self.optional else ""
        if not _is_int(v):
            raise ConfigError(f"{where}={_show(v)} must be an integer >= {self.lo}{null}")
        if v < self.lo:
            raise ConfigError(f"{where}={v} must be an integer >= {self.lo}{null}")
        if v > self.hi:
            raise ConfigError(f"{where}={v} must be an integer <= {self.hi}")


@dataclass(frozen=True)
class Num:
    """A finite real number in [lo, hi] (``lo_open``/``hi_open``: the bound itself excluded)."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False
    unit: str = ""

    def describe(self) -> str:
        """The range in words, e.g. ``(0, 10]`` or ``[0, 1) (a probability)``."""
        return (f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
                + (f" ({self.unit})" if self.unit else ""))

    def check(self, where: str, v: Any) -> None:
        """Raise ``ConfigError`` naming ``where`` (``section.field``) unless ``v`` follows this rule."""
        if v is None and self.optional:
            return
        null = ", or null" if self.optional else ""
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"{where}={_show(v)} must be a finite number in {self.describe()}{null}")
        low = v <= self.lo if self.lo_open else v < self.lo
        high = v >= self.hi if self.hi_open else v > self.hi
        if low or high:
            raise ConfigError(f"{where}={v!r} must be in {self.describe()}{null}")


@dataclass(frozen=True)
class Text:
    """A non-empty string of at most ``MAX_TEXT`` characters (one of ``choices`` when given)."""

    choices: tuple[str, ...] | None = None
    optional: bool = False
    hint: str = ""   # what the value is, for the message ("a path or an fsspec URL ...")

    def check(self, where: str, v: Any) -> None:
        """Raise ``ConfigError`` naming ``where`` (``section.field``) unless ``v`` follows this rule."""
        if v is None and self.optional:
            return
        if self.choices is not None:
            if v not in self.choices:
                raise ConfigError(f"{where}={_show(v)}; choose one of {list(self.choices)}")
            return
        null = " or null" if self.optional else ""
        if not isinstance(v, str) or not v.strip():
            raise ConfigError(f"{where}={_show(v)} must be {self.hint or 'a non-empty string'}{null}")
        if len(v) > MAX_TEXT or "\x00" in v:
            raise ConfigError(f"{where} is {len(v)} characters{' with a NUL' if chr(0) in v else ''}; "
                              f"at most {MAX_TEXT}, no NUL")


@dataclass(frozen=True)
class Flag:
    """``true`` or ``false`` (or null when optional)."""

    optional: bool = False

    def check(self, where: str, v: Any) -> None:
        """Raise ``ConfigError`` naming ``where`` (``section.field``) unless ``v`` follows this rule."""
        if not (isinstance(v, bool) or (v is None and self.optional)):
            raise ConfigError(f"{where}={_show(v)} must be true or false" + (", or null" if self.optional else ""))


def _name_or_names(v: Any, least: int) -> bool:
    """Whether ``v`` is one non-blank name, or a list of ``least`` or more distinct ones (at most
    ``MAX_ITEMS``, each at most ``MAX_TEXT`` characters)."""
    def name(x: Any) -> bool:
        return isinstance(x, str) and 0 < len(x.strip()) and len(x) <= MAX_TEXT
    return name(v) or (isinstance(v, list) and least <= len(v) <= MAX_ITEMS and len(set(map(str, v))) == len(v)
                       and all(name(x) for x in v))


@dataclass(frozen=True)
class Plain:
    """Plain data: a mapping (``kind="map"``), a list of names (``"names"``), a list of lists of
    integers (``"index_lists"``), names-or-mapping (``"inputs"``), a name or a list of distinct names
    (``"targets"``; ``"blocks"``: 2 or more), one flag or a list of flags per
    stage (``"stage_flags"``) or an integer >= 0, or a list of them per stage (``"stage_counts"``); bounded in
    size and depth, floats finite, keys strings."""

    kind: str
    optional: bool = True

    def check(self, where: str, v: Any) -> None:
        """Raise ``ConfigError`` naming ``where`` (``section.field``) unless ``v`` follows this rule."""
        if v is None and self.optional:
            return
        if self.kind == "map":
            if not isinstance(v, dict):
                raise ConfigError(f"{where} must be a mapping of names to values, got {_show(v)}")
            _check_tree(where, v, [0], 0)
        elif self.kind == "names":
            if not (isinstance(v, list) and len(v) <= MAX_ITEMS
                    and all(isinstance(x, str) and 0 < len(x) <= MAX_TEXT for x in v)):
                raise ConfigError(f"{where}={_show(v)} must be a list of names (at most {MAX_ITEMS}), or null")
        elif self.kind == "index_lists":
            if not (isinstance(v, list) and len(v) <= MAX_ITEMS and all(
                    isinstance(x, list) and len(x) <= MAX_ITEMS and all(_is_int(i) and 0 <= i < 1 << 20 for i in x)
                    for x in v)):
                raise ConfigError(f"{where}={_show(v)} must be one list of segment indices (integers >= 0) per "
                                  "stage, e.g. [[0, 1], [2, 3]], or null")
        elif self.kind == "stage_flags":
            if not (isinstance(v, bool) or (isinstance(v, list) and 0 < len(v) <= MAX_ITEMS
                                            and all(isinstance(x, bool) for x in v))):
                raise ConfigError(f"{where}={_show(v)} must be true, false, one true/false per stage (e.g. "
                                  "[true, false]), or null")
        elif self.kind == "stage_counts":
            def count(x: Any) -> bool:
                return _is_int(x) and 0 <= x < 1 << 20
            if not (count(v) or (isinstance(v, list) and 0 < len(v) <= MAX_ITEMS and all(count(x) for x in v))):
                raise ConfigError(f"{where}={_show(v)} must be one integer >= 0 and < {1 << 20} per stage (e.g. "
                                  "[4, 2, 0]; 0 = no cap), one for every stage (e.g. 4), or null")
        elif self.kind == "targets":
            if not _name_or_names(v, least=1):
                raise ConfigError(f"{where}={_show(v)} must be the name of the batch field the loss compares the "
                                  "output with, a list of distinct names (the loss then gets a dict name -> tensor, "
                                  "e.g. [label, score]), or null")
        elif self.kind == "blocks":
            if not _name_or_names(v, least=2):
                raise ConfigError(f"{where}={_show(v)} must be the dotted name of the model's list of layers (e.g. "
                                  "transformer.h), a list of 2 or more distinct module names in the order the "
                                  "forward calls them (e.g. [b1, b2, b3]), or null")
        elif self.kind == "inputs":
            ok = (isinstance(v, list) and 0 < len(v) <= MAX_ITEMS and all(isinstance(x, str) for x in v)) or (
                isinstance(v, dict) and 0 < len(v) <= MAX_ITEMS
                and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()))
            if not ok:
                raise ConfigError(f"{where}={_show(v)} must be a list of batch field names (positional) or a "
                                  "mapping argument -> field name, e.g. {input_ids: input_ids, labels: labels}")


def _check_tree(where: str, v: Any, count: list[int], depth: int) -> None:
    count[0] += 1
    if count[0] > MAX_ITEMS:
        raise ConfigError(f"{where} holds more than {MAX_ITEMS} values; pass large data as a file")
    if depth > MAX_DEPTH:
        raise ConfigError(f"{where} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where}={v!r}: values must be finite numbers")
    if isinstance(v, str) and len(v) > MAX_TEXT:
        raise ConfigError(f"{where} holds a string of {len(v)} characters (at most {MAX_TEXT})")
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where} has key {_show(k)}; keys must be names (strings)")
            _check_tree(f"{where}.{k}", x, count, depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_tree(f"{where}[{i}]", x, count, depth + 1)
    elif not (v is None or isinstance(v, (bool, int, float, str))):
        raise ConfigError(f"{where}={_show(v)} must be plain data (numbers, strings, lists, mappings)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)



def check_name(name: Any) -> None:
    """A job name: 1-100 letters, digits, ``.``, ``_`` or ``-``, not starting with ``.``/``-`` — it names
    the run folder inside ``train.run_dir``, so it can never point elsewhere."""
    if not (isinstance(name, str) and NAME_RE.match(name)) or name in (".", ".."):
        raise ConfigError(f"name={_show(name)} must be 1-100 ASCII letters (a-z, A-Z), digits, '.', '_' or '-' "
                          "starting with a letter or digit (it names the run folder inside train.run_dir), e.g. "
                          "'my-model-run'")


#: names other tools use for the config's fields (Hugging Face ``TrainingArguments``, Lightning,
#: DeepSpeed): a key spelt so is told the field it means
SYNONYMS = {"learning_rate": "lr", "max_lr": "lr", "batch_size": "global_batch",
            "train_batch_size": "global_batch", "global_batch_size": "global_batch",
            "micro_batch": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
            "train_micro_batch_size_per_gpu": "micro_batch_size", "max_steps": "steps", "num_steps": "steps",
            "train_steps": "steps", "warmup": "warmup_steps", "num_warmup_steps": "warmup_steps",
            "max_grad_norm": "grad_clip", "gradient_clipping": "grad_clip", "clip_grad_norm": "grad_clip",
            "dtype": "precision", "mixed_precision": "precision", "pipeline_stages": "P",
            "pipeline_parallel_size": "P", "pp": "P", "data_parallel_size": "D", "dp": "D", "num_gpus": "gpus",
            "block_size": "seq_len", "max_seq_len": "seq_len", "max_length": "seq_len", "context_length": "seq_len",
            "save_steps": "checkpoint_every", "output_dir": "run_dir", "gradient_checkpointing": "recompute",
            "activation_checkpointing": "recompute", "schedule": "policy"}


_OPTIMIZER = ("the optimizer is train.optimizer (a torch.optim name such as AdamW, the default, or SGD; or "
              "'mypkg.optim:MyOptimizer'); its settings other than lr and weight_decay go in "
              "train.optimizer_kwargs, e.g. {momentum: 0.9} or {betas: [0.9, 0.999], eps: 1e-6}")
_SCHEDULE = ("the learning rate follows a linear warm-up over warmup_steps, then a cosine decay to min_lr by "
             "train.steps, fixed: for a constant rate set min_lr equal to lr and warmup_steps to 0")
#: other tools' settings this SDK names otherwise or fixes by design, and what to set instead
FIXED = {**dict.fromkeys(("optim", "optimizer_name", "optimizer_type", "optimizer_class", "betas", "adam_beta1",
                          "adam_beta2", "beta1", "beta2", "eps", "adam_epsilon", "momentum", "nesterov",
                          "optimizer_args", "optimizer_params", "optim_args"), _OPTIMIZER),
         **dict.fromkeys(("scheduler", "lr_scheduler", "lr_scheduler_type", "lr_schedule", "schedule_type",
                          "decay_style", "lr_decay_style"), _SCHEDULE)}


def fixed_hint(key: object) -> str | None:
    """Why ``key`` (another tool's setting: ``optimizer``, ``lr_scheduler``, ``betas``...) is no
    field here and what to set instead (``FIXED``), or ``None``."""
    return FIXED.get(str(key).lower())


def near_names(key: object, names: "list[str] | set[str]", n: int = 1) -> list[str]:
    """The field(s) of ``names`` a mistyped or foreign ``key`` most likely means: a known synonym
    (``SYNONYMS``: ``learning_rate`` → ``lr``), else the same name in another case, else the
    closest spellings (``difflib``, at most ``n``)."""
    import difflib

    k = str(key)
    pool = sorted(names)
    same = SYNONYMS.get(k) or SYNONYMS.get(k.lower())
    if same in pool:
        return [same]
    folded = [x for x in pool if x.lower() == k.lower()]
    return folded or difflib.get_close_matches(k, pool, n=n)
