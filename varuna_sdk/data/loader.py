"""Token arrays and deterministic language-model batches.

This module owns turning a corpus into token ids (cached on disk), the
train/validation split, and the batches each step trains on:

* ``tokenize_corpus(corpus, tokenizer, cache_dir)`` -> 1-D numpy token array,
  cached as ``.npy`` keyed by corpus, tokenizer and a hash of the text.
* ``train_val_split(tokens, val_fraction)`` -> contiguous (train, val); the
  held-out part is the *last* fraction. ``split_examples`` does it for a dataset of examples:
  a seeded random held-out subset.
* ``BatchLoader`` -> ``batch(step)`` is a pure function of ``(seed, step)``, so
  any replica, on any machine, after any restart or re-partitioning, computes
  exactly the same global batch for a step; ``replica_batch`` returns one
  data-parallel replica's contiguous share of it.
* ``eval_batches`` -> fixed non-overlapping held-out batches for perplexity.

This package (``varuna_sdk.data``) never imports ``varuna_sdk.pipeline``,
``varuna_sdk.cluster`` or ``varuna_sdk.manager``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .corpus import load_corpus
from .tokenizer import get_tokenizer

__all__ = [
    "BatchLoader",
    "DataError",
    "ExampleLoader",
    "LM_FIELDS",
    "collate",
    "example_eval_batches",
    "lm_fields",
    "default_cache_dir",
    "eval_batches",
    "tokenize_corpus",
    "train_val_split",
]

_CACHE_FORMAT = 1  # bump to invalidate every cached token file


class DataError(ValueError):
    """The data cannot be used as given: a source that cannot be opened, or a step's examples that
    cannot be read or batched. The message names the file, column or example and the fix. Data
    errors are deterministic (the same step reads the same examples on every try), so the manager
    does not retry a generation that failed with one."""


def default_cache_dir() -> Path:
    """``$VARUNA_SDK_CACHE_DIR`` if set, else ``~/.cache/varuna_sdk``."""
    env = os.environ.get("VARUNA_SDK_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "varuna_sdk"


def _token_dtype(vocab_size: int) -> type[np.integer]:
    return np.uint16 if vocab_size <= 65535 else np.int32


def tokenize_corpus(
    corpus: str, tokenizer: str, cache_dir: str | Path | None = None
) -> np.ndarray:
    """Token ids of corpus ``corpus`` under tokenizer ``tokenizer``, cached on disk.

    Args:
        corpus: a name accepted by :func:`varuna_sdk.data.corpus.load_corpus`.
        tokenizer: a name accepted by :func:`varuna_sdk.data.tokenizer.get_tokenizer`.
        cache_dir: where the ``.npy`` lives (created if missing); ``None`` means
            :func:`default_cache_dir`.

    Returns:
        1-D array, ``uint16`` when the vocabulary has <= 65535 ids, else ``int32``.
        The file name holds the corpus, the tokenizer and a SHA-256 prefix of the
        text, so a changed text is re-tokenized. The file is written to a temporary
        name and ``os.replace``-d into place, so concurrent writers and crashes never
        leave a partial cache file.
    """
    tok = get_tokenizer(tokenizer)
    text = load_corpus(corpus)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = cache / f"{corpus}-{tok.name}-v{_CACHE_FORMAT}-{digest}.npy"
    dtype = _token_dtype(tok.vocab_size)

    if path.exists():
        try:
            arr = np.load(path, allow_pickle=False)
            if arr.ndim == 1 and arr.dtype == dtype:
                return arr
        except (OSError, ValueError, EOFError):
            pass  # unreadable/corrupt cache: rebuild it below

    arr = np.ascontiguousarray(tok.encode_array(text), dtype=dtype)
    save_array(path, arr)
    return arr


def save_array(path: Path, arr: np.ndarray) -> None:
    """Write ``arr`` as ``.npy`` to ``path`` atomically: a temporary file in the same folder, then
    ``os.replace`` — concurrent writers and crashes never leave a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def train_val_split(
    tokens: np.ndarray, val_fraction: float = 0.05, min_val: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``tokens`` into contiguous (train, val); val is the last ``val_fraction``.

    Returns views (no copy). ``len(val) == max(min_val, round(len(tokens) * val_fraction))``
    tokens when ``val_fraction`` > 0 (``min_val``: the tokens of one held-out batch, so that a
    short text still measures a held-out loss), none when it is 0.
    """
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    n = len(tokens)
    n_val = max(int(min_val), int(round(n * float(val_fraction)))) if float(val_fraction) > 0 else 0
    return tokens[: n - n_val], tokens[n - n_val :]


def split_examples(n: int, val_fraction: float, seed: int, min_held: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held-out)`` dataset indices (sorted int64 arrays) of a dataset of ``n`` examples:
    the held-out part is ``max(min_held, round(n * val_fraction))`` examples (``min_held``: one
    held-out batch, so that a small dataset still measures a held-out loss) drawn at random from ``seed``
    (the data seed), none when ``val_fraction`` is 0 (no held-out evaluation), not the dataset's tail, which for a dataset stored in class order (an image
    folder) would be whole classes never trained on. The same for any P, D and morph.

    Raises ``ValueError`` when ``val_fraction`` is outside ``[0, 1)`` or nothing is left to train on."""
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    n_val = max(int(min_held), 1, int(round(n * float(val_fraction)))) if float(val_fraction) > 0 else 0
    if n - n_val < 1:
        raise ValueError(f"{n} examples are too few to hold out {float(val_fraction):.0%} and train on the rest")
    perm = np.random.default_rng([int(seed), 0x5EED]).permutation(n)   # a stream apart from the epoch orders
    return np.sort(perm[n_val:]).astype(np.int64), np.sort(perm[:n_val]).astype(np.int64)


def _as_token_array(tokens: Any) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    return arr


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class BatchLoader:
    """Deterministic next-token-prediction batches from a 1-D token array.

    Example ``k`` of step ``t`` is the window ``tokens[o : o + seq_len + 1]`` where
    the offsets ``o`` of step ``t`` are drawn uniformly from
    ``numpy.random.default_rng([seed, t])``: the batch of a step depends only on
    ``(tokens, seq_len, global_batch, seed, step)`` - never on which steps were
    drawn before, on the number of replicas, or on the process that asks.

    Iterating yields ``batch(position)`` and advances ``position`` (the number
    of steps consumed); the iterator is infinite. ``state_dict`` /
    ``load_state_dict`` save and restore the position.
    """

    def __init__(
        self, tokens: Any, seq_len: int, global_batch: int, seed: int = 0
    ) -> None:
        arr = _as_token_array(tokens)
        for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if len(arr) < seq_len + 1:
            raise ValueError(
                f"need at least seq_len + 1 = {seq_len + 1} tokens for one sequence, "
                f"got {len(arr)}: use a smaller seq_len (at most {max(len(arr) - 1, 0)}) "
                "or more data"
            )
        self.tokens = arr
        self.seq_len = int(seq_len)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self._step = 0
        self._window = np.arange(self.seq_len + 1, dtype=np.int64)

    # -- deterministic batches ---------------------------------------------------
    def offsets(self, step: int) -> np.ndarray:
        """Start offsets (int64, length ``global_batch``) of the examples of ``step``."""
        step = self._check_step(step)
        rng = np.random.default_rng([self.seed, step])
        high = len(self.tokens) - self.seq_len  # exclusive: o + seq_len + 1 <= len
        return rng.integers(0, high, size=self.global_batch, dtype=np.int64)

    def _gather(self, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[offsets[:, None] + self._window].astype(np.int64)
        chunk_t = torch.from_numpy(chunk)
        return chunk_t[:, :-1].contiguous(), chunk_t[:, 1:].contiguous()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of ``step``: int64, shape ``[global_batch, seq_len]``.

        ``targets[:, i] == inputs[:, i + 1]``; ``targets[:, -1]`` is the next token.
        """
        return self._gather(self.offsets(step))

    def replica_batch(
        self, step: int, replica: int, num_replicas: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[replica*b : (replica+1)*b]`` of ``batch(step)``, ``b = global_batch // num_replicas``.

        Only this replica's rows are gathered. Concatenating the results of
        replicas ``0 .. num_replicas-1`` gives ``batch(step)`` exactly.
        """
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, (int, np.integer)):
            raise ValueError(f"num_replicas must be an int, got {num_replicas!r}")
        if num_replicas < 1 or self.global_batch % num_replicas:
            raise ValueError(
                f"num_replicas={num_replicas} does not divide global_batch="
                f"{self.global_batch}; valid num_replicas: {_divisors(self.global_batch)}"
            )
        if isinstance(replica, bool) or not isinstance(replica, (int, np.integer)) or not (
            0 <= replica < num_replicas
        ):
            raise ValueError(
                f"replica must be an int in [0, {num_replicas}), got {replica!r}"
            )
        per = self.global_batch // num_replicas
        offs = self.offsets(step)[replica * per : (replica + 1) * per]
        return self._gather(offs)

    # -- iteration / resumption --------------------------------------------------
    @property
    def position(self) -> int:
        """The next step the iterator yields (= number of steps consumed)."""
        return self._step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self._step)
        self._step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """Position and identity of the stream, JSON-serialisable."""
        return {
            "step": self._step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_tokens": int(len(self.tokens)),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state["step"]`` with ``state["seed"]``.

        Raises ValueError if the state records a different ``seq_len``,
        ``global_batch`` or token count (the batches would not match).
        """
        if "step" not in state or "seed" not in state:
            raise ValueError(
                f"state must contain 'step' and 'seed', got keys {sorted(state)}"
            )
        for key in ("seq_len", "global_batch", "num_tokens"):
            mine = self.state_dict()[key]
            if key in state and int(state[key]) != mine:
                raise ValueError(
                    f"state was saved with {key}={state[key]} but this loader has "
                    f"{key}={mine}; build the loader with the same data and settings"
                )
        step = self._check_step(state["step"])
        seed = int(state["seed"])
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed}")
        self.seed = seed
        self._step = step

    @staticmethod
    def _check_step(step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return int(step)

    def __repr__(self) -> str:
        return (
            f"BatchLoader(num_tokens={len(self.tokens)}, seq_len={self.seq_len}, "
            f"global_batch={self.global_batch}, seed={self.seed}, position={self._step})"
        )


def eval_batches(
    val_tokens: Any, seq_len: int, batch_size: int, max_batches: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches for perplexity: consecutive, non-overlapping windows.

    Sequence ``i`` has inputs ``val[i*seq_len : (i+1)*seq_len]`` and targets shifted
    by one; sequences are taken in order from the start of ``val_tokens`` and
    grouped into full batches of ``batch_size`` (a trailing partial batch is
    dropped), at most ``max_batches`` of them (``None``: all). Every target token
    is predicted at most once, so averaging the loss over the batches gives the
    held-out loss/perplexity.

    Returns:
        list of ``(inputs, targets)`` int64 tensors of shape ``[batch_size, seq_len]``.
    """
    arr = _as_token_array(val_tokens)
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, (int, np.integer)) or max_batches < 1
    ):
        raise ValueError(f"max_batches must be None or an int >= 1, got {max_batches!r}")
    num_seqs = max(len(arr) - 1, 0) // seq_len
    num_batches = num_seqs // batch_size
    if max_batches is not None:
        num_batches = min(num_batches, int(max_batches))
    if num_batches == 0:
        raise ValueError(
            f"{len(arr)} held-out tokens give {num_seqs} sequences of seq_len={seq_len}, "
            f"fewer than one batch of {batch_size} sequences: need at least "
            f"{batch_size * seq_len + 1} tokens; use a smaller global batch (parallel.global_batch) "
            "or seq_len (data.seq_len), a larger data.val_fraction, or more text; data.val_fraction: 0 holds none out"
        )
    n = num_batches * batch_size * seq_len
    inputs = torch.from_numpy(arr[:n].astype(np.int64)).view(num_batches, batch_size, seq_len)
    targets = torch.from_numpy(arr[1 : n + 1].astype(np.int64)).view(
        num_batches, batch_size, seq_len
    )
    return [(inputs[b].clone(), targets[b].clone()) for b in range(num_batches)]


#: The fields of a language-model batch: ``input_ids`` ``[B, T]``, ``targets`` ``[B, T]`` (the next
#: token of each position: ``input_ids`` shifted by one) and ``labels`` ``[B, T]`` (= ``input_ids``,
#: the Hugging Face convention: the model shifts them itself). All int64.
LM_FIELDS = ("input_ids", "targets", "labels")


def lm_fields(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """A language-model batch as named fields (``LM_FIELDS``)."""
    return {"input_ids": inputs, "targets": targets, "labels": inputs}


def collate(examples: list, ids: Sequence[int] | None = None) -> dict[str, Any]:
    """Examples of a user dataset as one batch of named fields: a dict example keeps its keys, a
    tuple/list example ``(x, y, …)`` gives fields ``"0"``, ``"1"``, …, a lone tensor ``"0"``.
    Stacked with ``torch.utils.data.default_collate`` (numbers become tensors). ``ids``: the
    examples' dataset indices, to name the odd one out. Raises ``DataError`` naming the example
    whose fields differ from the others'."""
    from torch.utils.data import default_collate

    first = examples[0]
    missing = next((pos for pos, ex in enumerate(examples) if ex is None), None)
    if missing is not None:
        which = f"example {int(ids[missing])}" if ids is not None else f"example {missing} of the batch"
        raise DataError(f"the dataset gives None for {which}: its __getitem__ returned nothing (a missing return, or a "
                        "row it skips); every index below len(dataset) must give an example")
    try:
        batch = default_collate(examples)
    except (RuntimeError, TypeError, KeyError, ValueError) as e:   # KeyError: dicts with other keys
        raise DataError(f"the dataset's examples cannot be stacked into one batch: {_unstackable(examples, ids)}; "
                        "every example must hold tensors of the same shapes (pad or crop them to one shape in "
                        f"__getitem__) [{type(e).__name__}: {str(e).splitlines()[0][:200]}]") from None
    if isinstance(first, Mapping):
        return dict(batch)
    if isinstance(first, (tuple, list)):
        return {str(i): v for i, v in enumerate(batch)}
    return {"0": batch}


def _unstackable(examples: list, ids: Sequence[int] | None = None) -> str:
    """Which field of which example differs in shape or type from the rest of the batch (the kind
    most examples have), naming the example by its dataset index when ``ids`` are given."""
    def fields(ex: Any) -> dict[str, Any]:
        if isinstance(ex, Mapping):
            return {str(k): v for k, v in ex.items()}
        if isinstance(ex, (tuple, list)):
            return {str(i): v for i, v in enumerate(ex)}
        return {"0": ex}

    def kind(v: Any) -> str:
        return f"shape {tuple(v.shape)}" if hasattr(v, "shape") else f"a {type(v).__name__}"

    def name(pos: int) -> str:
        return f"example {int(ids[pos])}" if ids is not None else f"example {pos} of the batch"

    all_fields = [fields(ex) for ex in examples]
    keys = [tuple(sorted(f)) for f in all_fields]
    common = max(keys, key=keys.count)   # ties: the first example's
    for pos, k in enumerate(keys):
        if k != common:
            return f"{name(pos)} has fields {list(k)}, the others {list(common)}"
    for field_name in common:
        kinds = [kind(f[field_name]) for f in all_fields]
        usual = max(kinds, key=kinds.count)
        for pos, k in enumerate(kinds):
            if k == usual:
                continue
            if 2 * kinds.count(usual) <= len(kinds):   # no majority (2 examples): neither is "the odd one"
                first = kinds.index(usual)
                a, b = sorted((first, pos))
                return f"{name(a)} has field {field_name!r} of {kinds[a]} and {name(b)} of {kinds[b]}"
            return f"{name(pos)} has field {field_name!r} of {k} where the others have {usual}"
    return "their fields differ in type"


@contextlib.contextmanager
def seeded_global_rngs() -> Iterator[Callable[[int], None]]:
    """Yields ``reseed(seed)``, which seeds the global generators (torch's CPU generator, NumPy's,
    Python's ``random``) from the int ``seed``; their states are put back on leaving, so the
    user's training draws what it would have. (A user's dataset factory or ``__getitem__`` that
    draws from them then draws alike in every worker and in the kernel.)"""
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    def reseed(seed: int) -> None:
        seed = int(seed) % (2 ** 63)
        torch.random.default_generator.manual_seed(seed)
        np.random.seed(seed % (2 ** 32))
        random.seed(seed)
    try:
        yield reseed
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


def draw_seed(seed: int, stream: int, position: int) -> int:
    """The seed (an int in [0, 2**63)) the global generators get before the example read at
    ``position`` of a stream (``stream`` 0: training, position ``step * global_batch + k``; 1:
    held-out, position ``batch * size + k``) of the data seed ``seed``: a pure function, so an
    example's random augmentation is the same in every stage and replica, at any D and after a
    morph."""
    h = hashlib.blake2b(f"{int(seed)}:{int(stream)}:{int(position)}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def read_examples(dataset: Any, idx: Sequence[int], where: str, draws: Sequence[int] | None = None,
                  drew: list[str] | None = None) -> list:
    """``dataset[i]`` for each of ``idx``; with ``draws`` (a seed per example, ``draw_seed``) each read
    with the global random generators seeded by its draw (restored after): a ``__getitem__`` that
    draws at random (an augmentation, a random crop) gives every stage of the pipeline the same
    example. ``drew``: a list that gets the names of the generators a read drew from (checked per
    read; for a first read). Seeding touches process-wide state: call it with ``draws`` only on the
    thread that trains. Raises ``DataError`` naming the example, ``where`` it
    was read for (e.g. "step 12, replica 1 of 2") and the fix when ``__getitem__`` fails (an
    ``IndexError`` below ``__len__``: a length that counts examples that are not there)."""
    with seeded_global_rngs() if draws is not None else contextlib.nullcontext() as reseed:
        return [_read_one(dataset, i, pos, len(idx), where, reseed, draws, drew) for pos, i in enumerate(idx)]


def _read_one(dataset: Any, i: int, pos: int, n: int, where: str, reseed, draws, drew) -> Any:
    """``dataset[i]`` (``read_examples``' ``pos``-th of ``n``), seeded by ``draws[pos]`` when given,
    the generators it drew from added to ``drew`` when given."""
    from .prefetch import draws_random

    if reseed is not None:
        reseed(draws[pos])
    try:
        if drew is None:
            return dataset[int(i)]
        ex, moved = draws_random(lambda: dataset[int(i)])
        drew.extend(m for m in moved if m not in drew)
        return ex
    except Exception as e:  # noqa: BLE001 - any failure of the user's __getitem__ is a data error
        raise DataError(
            f"the dataset could not give example {int(i)} ({where}, example {pos + 1} of {n}): "
            f"{type(e).__name__}: {e}. Its __len__ says {len(dataset)} examples, so every index "
            "below that must be readable: fix __getitem__ (or the file it reads), or make __len__ "
            "count only the examples there are") from e


class ExampleLoader:
    """Deterministic batches of a map-style dataset, the twin of ``BatchLoader`` for examples.

    The examples of step ``t`` are positions ``t·B … t·B + B - 1`` of an endless stream that visits
    ``indices`` (the training part of the dataset) once per epoch, each epoch in the order of
    ``numpy.random.default_rng([seed, epoch]).permutation``: a pure function of ``(seed, step)``,
    so every replica, after any restart or a change of D, sees the same examples in the same
    order. ``replica_batch`` gathers only one replica's contiguous share. ``state_dict`` /
    ``load_state_dict`` save and restore the position (the step).

    A dataset whose ``__getitem__`` draws from the global random generators (torch's, NumPy's,
    Python's: random augmentation) gets them seeded before each read by the example's stream
    position (``draw_seed``; restored after), so the first stage's inputs and the last stage's
    targets come from the same draw, at any P and D and after a morph, and the kernel's reference
    draws alike. The first batch read finds out (``draws_random``: the generators moved); later
    reads of a dataset that drew nothing touch no generator (they may run on a prefetch thread).
    """

    def __init__(self, dataset: Any, global_batch: int, seed: int = 0, indices: Any = None) -> None:
        n = len(dataset)
        self.dataset = dataset
        self.indices = np.arange(n, dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
        if len(self.indices) == 0:
            raise ValueError("the dataset has no training examples; give it more examples or a smaller val_fraction")
        if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
            raise ValueError(f"global_batch must be an int >= 1, got {global_batch!r}")
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self._step = 0
        self._perm: tuple[int, np.ndarray] | None = None
        self.draws_random: list[str] | None = None   # the global generators reads draw from; None: not read yet

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.indices)))
        return self._perm[1]

    def example_indices(self, step: int) -> np.ndarray:
        """Dataset indices (int64, length ``global_batch``) of the examples of ``step``."""
        step = BatchLoader._check_step(step)
        n = len(self.indices)
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        out = np.empty(len(pos), dtype=np.int64)
        for epoch in np.unique(pos // n):
            sel = pos // n == epoch
            out[sel] = self.indices[self._epoch_order(int(epoch))[pos[sel] % n]]
        return out

    def _gather(self, idx: np.ndarray, first: int, where: str) -> dict[str, Any]:
        """The examples ``idx`` batched, read at stream positions ``first, first + 1, ...`` (their
        random draws, ``draw_seed``); ``where`` (e.g. "step 12, replica 1 of 2") names them in the
        ``DataError`` raised when the dataset cannot give one of them or they cannot be batched."""
        seeded = self.draws_random != []   # unknown (the first read: checked) or known to draw
        draws = [draw_seed(self.seed, 0, first + k) for k in range(len(idx))] if seeded else None
        drew: list[str] | None = [] if self.draws_random is None else None
        examples = read_examples(self.dataset, idx, where, draws, drew)
        if drew is not None:
            self.draws_random = drew
        try:
            return collate(examples, [int(i) for i in idx])
        except DataError as e:
            raise DataError(f"{e} ({where})") from None
        except Exception as e:  # noqa: BLE001 - examples of different shapes or types
            raise DataError(
                f"examples {[int(i) for i in idx[:8]]}{'...' if len(idx) > 8 else ''} ({where}) cannot be "
                f"batched: {type(e).__name__}: {e}. Every example must have the same fields and shapes (pad or "
                "truncate them to one length in the dataset)") from e

    def batch(self, step: int) -> dict[str, Any]:
        """The fields of step ``step``'s global batch (see ``collate``). Raises ``DataError`` naming the
        example the dataset could not give."""
        return self._gather(self.example_indices(step), step * self.global_batch, f"step {step}")

    def replica_batch(self, step: int, replica: int, num_replicas: int) -> dict[str, Any]:
        """Rows ``[replica*b : (replica+1)*b]`` of ``batch(step)``, ``b = global_batch // num_replicas``.
        Raises ``DataError`` naming the example, the step and the replica when the dataset cannot give
        one of them (an index error, a missing file) or they cannot be batched."""
        if num_replicas < 1 or self.global_batch % num_replicas or not 0 <= replica < num_replicas:
            raise ValueError(f"replica {replica} of {num_replicas} does not fit global_batch={self.global_batch}; "
                             f"valid num_replicas: {_divisors(self.global_batch)}")
        per = self.global_batch // num_replicas
        return self._gather(self.example_indices(step)[replica * per:(replica + 1) * per],
                            step * self.global_batch + replica * per,
                            f"step {step}, replica {replica} of {num_replicas}")

    @property
    def position(self) -> int:
        """The next step the iterator yields (= number of steps consumed)."""
        return self._step

    def state_dict(self) -> dict[str, int]:
        """Position and identity of the stream, JSON-serialisable."""
        return {"step": self._step, "seed": self.seed, "global_batch": self.global_batch,
                "num_examples": int(len(self.indices))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state["step"]``; raises ``ValueError`` for a state of another dataset or batch."""
        for key in ("global_batch", "num_examples"):
            mine = self.state_dict()[key]
            if key in state and int(state[key]) != mine:
                raise ValueError(f"state was saved with {key}={state[key]} but this loader has {key}={mine}; build "
                                 "the loader with the same data and settings")
        self._step = BatchLoader._check_step(state["step"])
        self.seed = int(state.get("seed", self.seed))


def example_eval_batches(dataset: Any, indices: Any, batch_size: int, max_batches: int | None = None,
                         seed: int = 0) -> list:
    """Fixed held-out batches of a user dataset: ``indices`` in order, in full batches of
    ``batch_size`` (a trailing partial batch is dropped), at most ``max_batches``; each example read
    with the global generators seeded by ``draw_seed(seed, 1, position)``. Raises
    ``ValueError`` when there is not one full batch, ``DataError`` when an example cannot be read."""
    idx = np.asarray(indices, dtype=np.int64)
    n = len(idx) // batch_size
    if max_batches is not None:
        n = min(n, int(max_batches))
    if n == 0:
        raise ValueError(f"{len(idx)} held-out examples are fewer than one batch of {batch_size}; use a larger "
                         "data.val_fraction or a smaller global batch, or data.val_fraction: 0 to hold none out")
    out = []
    for k in range(n):
        ids = [int(i) for i in idx[k * batch_size:(k + 1) * batch_size]]
        draws = [draw_seed(seed, 1, k * batch_size + j) for j in range(len(ids))]
        out.append(collate(read_examples(dataset, ids, f"held-out batch {k + 1} of {n}", draws), ids))
    return out
