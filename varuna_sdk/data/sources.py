"""The user's own training data: where it is read from and how it becomes tokens or examples.

This module owns opening a data source and checking it before any worker starts:

* **text** — a text file, or a folder of text files (``*.txt``, ``*.md``…, sorted by path and
  joined with a blank line, as the Shakespeare corpus is), tokenized once and cached;
* **tokens** — a pre-tokenized file: raw ``uint16``/``uint32`` ids (``.bin``, read through
  ``numpy.memmap``: never loaded whole) or a ``.npy`` array (memory-mapped);
* **column data** — a Hugging Face ``datasets`` dataset saved with ``save_to_disk``, or local
  ``json``/``jsonl``/``parquet``/``csv`` files (read with ``datasets``, offline), whose text
  column (``text_column``) is tokenized row by row, rows joined by the tokenizer's end-of-text
  token (by a blank line when it has none);
* **examples** — a map-style ``torch.utils.data.Dataset`` made by the user's factory: each
  example a tensor, a tuple of tensors (``(x, y)``: inputs and targets) or a dict of tensors.

``open_tokens(cfg)`` returns a ``TokenData`` (a 1-D id array, its vocabulary bound and an
identity for checkpoints); ``open_examples(dataset)`` an ``ExampleData``. ``check_tokens``
refuses ids beyond a model's vocabulary. Every error names the file or column and the fix.

Never imports ``varuna_sdk.pipeline``, ``cluster`` or ``manager``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .loader import DataError, default_cache_dir, save_array, seeded_global_rngs
from .tokenizer import Tokenizer

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
TOKEN_SUFFIXES = (".bin", ".npy", ".u16", ".u32")
COLUMN_FORMATS = ("json", "jsonl", "parquet", "csv")
FORMATS = ("auto", "text", "tokens", "hf", *COLUMN_FORMATS)
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_CACHE_FORMAT = 1


@dataclass
class TokenData:
    """A token stream: ``tokens`` (1-D integer array, possibly memory-mapped), ``max_id`` (its
    largest id), ``source`` (what it was read from, for messages) and ``digest`` (content
    identity, kept in checkpoints)."""

    tokens: np.ndarray
    max_id: int
    source: str
    digest: str

    def __len__(self) -> int:
        return int(len(self.tokens))


def _cache_dir() -> Path:
    return default_cache_dir() / "tokens"


def _token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65535 else np.uint32


def detect_format(path: Path) -> str:
    """``text``, ``tokens``, ``hf`` or a column format, from what ``path`` is. Raises ``DataError``."""
    if not path.exists():
        where = "" if path.is_absolute() else f" (looked for {str(path.absolute())!r}: relative paths are taken from " \
                                               "the folder the job is launched from)"
        raise DataError(f"data path {str(path)!r} does not exist{where}; give a text file, a folder of text files, a token "
                        "file (.bin/.npy), a dataset saved with datasets' save_to_disk, or json/jsonl/parquet/csv files")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return "hf"
        return "text"
    suffix = path.suffix.lower()
    if suffix in TOKEN_SUFFIXES:
        return "tokens"
    if suffix.lstrip(".") in COLUMN_FORMATS:
        return suffix.lstrip(".")
    return "text"


# ---- text ------------------------------------------------------------------------------------
def text_files(path: Path) -> list[Path]:
    """The text files of ``path``: itself, or a folder's ``*.txt``/``*.md``/``*.text``/``*.rst``
    files at any depth (hidden ones skipped), sorted by relative path. Raises ``DataError`` when
    a folder has none."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"folder {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)}); put the training "
                        "text there, or point data.path at a file")
    return files


def read_text(path: Path) -> str:
    """All text of ``path`` (a file, or a folder's text files joined by a blank line), UTF-8.
    Raises ``DataError`` for a file that is not UTF-8 text or holds only whitespace."""
    parts = []
    for f in text_files(path):
        try:
            parts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{str(f)!r} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8, "
                            "or give a token file with data.format: tokens") from None
    text = "\n\n".join(parts)
    if not text.strip():
        raise DataError(f"{str(path)!r} holds no text (empty or whitespace only); add training text")
    return text


def _files_digest(files: Sequence[Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for f in files:
        h.update(str(f.name).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _cached_tokens(key: str, build) -> np.ndarray:
    path = _cache_dir() / f"{key}-v{_CACHE_FORMAT}.npy"
    if path.exists():
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            pass  # a corrupt cache file is rebuilt
    arr = build()
    save_array(path, arr)
    return np.load(path, mmap_mode="r", allow_pickle=False)


def text_tokens(path: Path, tokenizer: Tokenizer) -> TokenData:
    """Tokens of a text file or folder (cached by content and tokenizer)."""
    files = text_files(path)
    digest = _files_digest(files, tokenizer.name)

    def build():
        return np.ascontiguousarray(tokenizer.encode_array(read_text(path)), dtype=_token_dtype(tokenizer.vocab_size))

    arr = _cached_tokens(f"text-{digest}", build)
    if len(arr) == 0:
        raise DataError(f"{str(path)!r} gives no tokens; add training text")
    return TokenData(arr, int(arr.max()), str(path), digest)


# ---- pre-tokenized files ---------------------------------------------------------------------
def token_file(path: Path, dtype: str | None) -> TokenData:
    """A pre-tokenized file, memory-mapped: ``.npy`` (its own dtype, 1-D integers) or raw ids
    (``.bin``: ``dtype`` must say ``uint16`` or ``uint32``; ``.u16``/``.u32`` say it themselves).
    Raises ``DataError`` for an empty file, a size that is not a whole number of ids, or a
    missing/unknown dtype."""
    if path.stat().st_size == 0:
        raise DataError(f"token file {str(path)!r} is empty; write the token ids into it")
    if path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"{str(path)!r} is not a .npy array numpy can read: {e}") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"{str(path)!r} holds a {arr.ndim}-D {arr.dtype} array; a token file is 1-D integer ids")
    else:
        dt = {".u16": "uint16", ".u32": "uint32"}.get(path.suffix.lower(), dtype)
        if dt not in TOKEN_DTYPES:
            raise DataError(f"raw token file {str(path)!r}: set data.token_dtype to uint16 or uint32 (the width of "
                            f"each id in the file; got {dt!r})")
        width = np.dtype(TOKEN_DTYPES[dt]).itemsize
        if path.stat().st_size % width:
            raise DataError(f"{str(path)!r} has {path.stat().st_size} bytes, not a whole number of {dt} ids; is "
                            f"data.token_dtype right?")
        arr = np.memmap(path, dtype=TOKEN_DTYPES[dt], mode="r")
    if len(arr) == 0:
        raise DataError(f"token file {str(path)!r} holds no ids")
    st = path.stat()
    digest = hashlib.sha256(f"{path.name}:{st.st_size}:{int(arr[:4096].sum())}:{int(arr[-4096:].sum())}"
                            .encode()).hexdigest()[:16]
    if np.issubdtype(arr.dtype, np.signedinteger) and int(arr.min()) < 0:
        raise DataError(f"token file {str(path)!r} holds negative ids (min {int(arr.min())})")
    return TokenData(arr, int(arr.max()), str(path), digest)


# ---- column data (datasets) ------------------------------------------------------------------
def _column_files(path: Path, fmt: str) -> list[str]:
    if path.is_dir():
        ext = "json" if fmt == "jsonl" else fmt
        files = sorted(str(p) for p in path.rglob(f"*.{fmt}")) + (sorted(str(p) for p in path.rglob("*.json"))
                                                                    if ext == "json" and fmt == "jsonl" else [])
        if not files:
            raise DataError(f"folder {str(path)!r} holds no .{fmt} files")
        return files
    return [str(path)]


def load_rows(path: Path, fmt: str):
    """A ``datasets.Dataset`` of the rows at ``path``: saved with ``save_to_disk`` (``hf``; a
    ``DatasetDict``'s ``train`` split) or read from local json/jsonl/parquet/csv files (offline)."""
    import datasets

    datasets.disable_progress_bars()
    if fmt == "hf":
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DataError(f"{str(path)!r} is not a dataset saved with datasets' save_to_disk: {e}") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"dataset {str(path)!r} has splits {sorted(ds)} and no 'train'; save the split to "
                                "train on by itself, or name it train")
            ds = ds["train"]
        return ds
    builder = "json" if fmt in ("json", "jsonl") else fmt
    try:
        return datasets.load_dataset(builder, data_files=_column_files(path, fmt), split="train",
                                     cache_dir=str(_cache_dir().parent / "datasets"))
    except Exception as e:  # noqa: BLE001 - the library's parse errors, reported with the file
        raise DataError(f"cannot read {str(path)!r} as {fmt}: {type(e).__name__}: {e}") from None


def row_texts(rows, column: str, source: str) -> list[str]:
    """The ``column`` of every row, as strings. Raises ``DataError`` naming the columns there are
    when it is missing, and naming the row when a value is not text."""
    if column not in rows.column_names:
        raise DataError(f"{source} has no column {column!r}; its columns are {rows.column_names}. Set "
                        "data.text_column to the one holding the text")
    texts = rows[column]
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise DataError(f"{source}, row {i}: column {column!r} holds a {type(t).__name__}, not text")
    if not any(t.strip() for t in texts):
        raise DataError(f"{source}: column {column!r} is empty in every row; add training text")
    return texts


def join_documents(token_lists: Iterable[Sequence[int]], eot: int | None) -> list[int]:
    """Documents' tokens back to back, each followed by ``eot`` when the tokenizer has one."""
    out: list[int] = []
    for ids in token_lists:
        out.extend(ids)
        if eot is not None:
            out.append(eot)
    return out


def encode_documents(texts: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """The token stream of ``texts`` as documents: each encoded and followed by the end-of-text
    token, or (a tokenizer without one) all joined by a blank line and encoded at once."""
    dtype = _token_dtype(tokenizer.vocab_size)
    if tokenizer.eot_token is None:
        return np.ascontiguousarray(tokenizer.encode_array("\n\n".join(texts)), dtype=dtype)
    batch = getattr(tokenizer, "encode_batch", None)
    lists = batch(texts) if batch is not None else [tokenizer.encode(t) for t in texts]
    return np.asarray(join_documents(lists, tokenizer.eot_token), dtype=dtype)


def column_tokens(path: Path, fmt: str, column: str, tokenizer: Tokenizer) -> TokenData:
    """Tokens of a column dataset's text column (cached by content, column and tokenizer)."""
    files = [Path(f) for f in _column_files(path, fmt)] if fmt != "hf" else sorted(
        p for p in path.rglob("*") if p.is_file())
    digest = _files_digest(files, f"{fmt}:{column}:{tokenizer.name}")

    def build():
        rows = load_rows(path, fmt)
        return encode_documents(row_texts(rows, column, repr(str(path))), tokenizer)

    arr = _cached_tokens(f"{fmt}-{digest}", build)
    return TokenData(arr, int(arr.max()), f"{path} (column {column!r})", digest)


# ---- examples (a user Dataset) ---------------------------------------------------------------
@dataclass
class ExampleData:
    """A map-style dataset of examples (``len`` and ``[i]``), each a tensor, a tuple/list of
    tensors, or a dict of tensors (numbers become tensors when batched)."""

    dataset: Any
    source: str

    def __len__(self) -> int:
        return len(self.dataset)

    def digest(self, samples: int = 3) -> str | None:
        """A content fingerprint (16 hex digits) of the dataset: its length and the values of up to
        ``samples`` examples spread over it (first, middle, last: 2 x ``samples`` reads before a
        continued run starts, so few for a slow dataset), read twice with the global
        random generators seeded alike (and restored after); None when the two reads differ (the
        dataset draws from a generator of its own: no stable fingerprint). Catches the files
        behind a dataset edited or replaced between a run and its continuation; an edit that
        misses every sampled example is not caught. Raises what reading an example raises."""
        n = len(self.dataset)
        picks = sorted({i for i in (0, n - 1, n // 2, 1, n - 2)[:max(1, samples)] if 0 <= i < n})
        digests = []
        with seeded_global_rngs() as reseed:
            for _ in range(2):
                reseed(0)
                h = hashlib.sha256(str(n).encode())
                for i in picks:
                    _hash_value(h, self.dataset[i])
                digests.append(h.hexdigest()[:16])
        return digests[0] if digests[0] == digests[1] else None


def _hash_value(h, v) -> None:
    """Feed an example's value (tensors, arrays, numbers, nested in tuples, lists and dicts) to ``h``."""
    import torch

    if isinstance(v, dict):
        for k in sorted(v, key=str):
            h.update(str(k).encode())
            _hash_value(h, v[k])
    elif isinstance(v, (tuple, list)):
        h.update(f"[{len(v)}".encode())
        for x in v:
            _hash_value(h, x)
    elif isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(v, np.ndarray):
        a = np.ascontiguousarray(v)
        h.update(f"{a.dtype}{a.shape}".encode() + a.tobytes())
    else:
        h.update(repr(v).encode())


def _refuse_columns_as_examples(dataset: Any, source: str) -> None:
    """Refuse ``(X, Y)`` — a tuple or list of 2 or 3 arrays/tensors of one length N but different
    shapes, e.g. ``X [N, 16]`` and ``Y [N]`` — which a map-style reading takes as 2 or 3 examples;
    raises ``DataError`` saying to wrap the columns in a ``TensorDataset``."""
    import torch

    if not isinstance(dataset, (tuple, list)) or not 2 <= len(dataset) <= 3:
        return
    cols = list(dataset)
    if not all(isinstance(c, (torch.Tensor, np.ndarray)) and c.ndim >= 1 for c in cols):
        return
    rows = {int(c.shape[0]) for c in cols}
    if len(rows) != 1 or next(iter(rows)) <= len(cols) or len({tuple(c.shape) for c in cols}) == 1:
        return
    shapes = ", ".join(f"{type(c).__name__} {list(c.shape)}" for c in cols)
    wrap = ", ".join(f"torch.from_numpy({'XYZ'[i]})" if isinstance(c, np.ndarray) else "XYZ"[i]
                     for i, c in enumerate(cols))
    raise DataError(f"{source} is a {type(dataset).__name__} of {len(cols)} columns ({shapes}) of "
                    f"{next(iter(rows))} examples each, which would be read as {len(cols)} examples; give the "
                    f"examples row by row: torch.utils.data.TensorDataset({wrap}) (NumPy arrays as tensors)")


#: what to do with class labels given as strings
_STRING_LABELS = ("class labels must be class ids, not strings: map them to 0 .. C-1, e.g. classes = "
                  "sorted(set(labels)); ids = [classes.index(c) for c in labels] (datasets: "
                  ".class_encode_column('label'))")


def _label_like(key: str, example: Any) -> bool:
    """Whether field ``key`` of ``example`` reads as its label: named so, or a tuple's last."""
    if isinstance(example, (tuple, list)):
        return key == str(len(example) - 1)
    return key.lower() in ("label", "labels", "target", "targets", "y", "class", "category")


class _WithoutFields:
    """A dict-example dataset read without some of its fields (``drop``): ``len`` and ``[i]``."""

    def __init__(self, dataset: Any, drop: Sequence[str]):
        self.dataset, self.drop = dataset, frozenset(drop)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {k: v for k, v in self.dataset[i].items() if k not in self.drop}


def _without_text_fields(dataset: Any, first: dict, source: str, ok) -> tuple[Any, dict]:
    """A dict-example dataset without its string fields (a ``text`` column left after tokenizing,
    an id), warned about, when its other fields are tensors: no model takes strings. String class
    labels raise ``DataError`` (they must become class ids); anything else is left to the caller."""
    import warnings

    strings = [k for k, v in first.items() if isinstance(v, str)]
    rest = [k for k in first if k not in strings]
    if not strings or not all(ok(first[k]) for k in rest) or all(_label_like(k, first) for k in rest):
        return dataset, first   # (only labels left: the text was meant as the input, untokenized)
    labels = [k for k in strings if _label_like(k, first)]
    if labels:
        raise DataError(f"{source}: example 0 holds strings at {labels}: " + _STRING_LABELS)
    warnings.warn(f"{source}: field(s) {strings} hold strings (e.g. {_short_str(first[strings[0]])}), which no model "
                  "takes: the examples are read without them (to train on text, tokenize it into input_ids; "
                  "datasets: .remove_columns([...]) says so yourself)", UserWarning, stacklevel=4)
    if hasattr(dataset, "remove_columns"):   # a Hugging Face Dataset: columnar, as fast as before
        dataset = dataset.remove_columns(strings)
    else:
        dataset = _WithoutFields(dataset, strings)
    return dataset, dataset[0]


def _short_str(v: str) -> str:
    return repr(v if len(v) <= 24 else v[:21] + "...")


def open_examples(dataset: Any, source: str) -> ExampleData:
    """Check that ``dataset`` is a non-empty map-style dataset whose first example is a tensor, a
    tuple/list or a dict of tensors (or numbers); a Hugging Face ``datasets.Dataset`` in its default
    (Python) format is read in its torch format. Raises ``DataError`` saying what it is instead."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DataError(f"{source} returned a {type(dataset).__name__}; it must return a map-style dataset (with "
                        "__len__ and __getitem__), e.g. a torch.utils.data.Dataset or TensorDataset")
    if type(dataset).__module__.split(".")[0] == "datasets" and hasattr(dataset, "with_format") \
            and getattr(dataset, "format", {}).get("type") is None:
        dataset = dataset.with_format("torch")   # a Hugging Face Dataset gives Python lists otherwise
    n = len(dataset)
    if n == 0:
        raise DataError(f"{source} returned an empty dataset; it needs at least one example per step's global batch")
    import torch

    _refuse_columns_as_examples(dataset, source)

    first = dataset[0]

    def ok(v):
        return isinstance(v, (torch.Tensor, int, float, np.ndarray, np.number))
    if isinstance(first, dict):
        dataset, first = _without_text_fields(dataset, first, source, ok)
    if isinstance(first, dict):
        bad = [k for k, v in first.items() if not ok(v)]
    elif isinstance(first, (tuple, list)):
        bad = [str(i) for i, v in enumerate(first) if not ok(v)]
    else:
        bad = [] if ok(first) else ["the example itself"]
    if bad:
        items = first.items() if isinstance(first, dict) else enumerate(first) if isinstance(first, (tuple, list)) else []
        what = {str(k): v for k, v in items}
        hints = []
        if any(isinstance(what.get(k), (tuple, list)) and what[k] and all(ok(x) for x in what[k]) for k in bad):
            hints.append("a nested tuple such as ((x_cat, x_num), y) can be flattened to (x_cat, x_num, y), or give "
                         "a dict {'x_cat': ..., 'x_num': ..., 'labels': ...}; a list of numbers can be "
                         "torch.tensor(values)")
        nested = [k for k in bad if isinstance(what.get(k), dict)]
        if nested:
            keys = [str(x) for k in nested for x in what[k]]
            hints.append(f"a dict inside an example (at {nested}) is not taken: return one flat dict of tensors "
                         f"instead, e.g. {{{', '.join(repr(x) + ': ...' for x in keys[:4])}"
                         + (", 'labels': y" if isinstance(first, (tuple, list)) and len(first) > len(nested) else "")
                         + "} (the forward gets the fields its parameters name; model.targets names the loss's "
                         "targets field, Job(..., targets=...) in a notebook)")
        if any(isinstance(what.get(k), str) and _label_like(k, first) for k in bad):
            hints.append(_STRING_LABELS)
        elif any(isinstance(what.get(k), str) for k in bad):
            hints.append("text must be token ids: tokenize it in __getitem__ (or use data.path with a tokenizer), or "
                         "drop the column (datasets: .remove_columns([...]))")
        raise DataError(f"{source}: example 0 holds non-tensor values at {bad}; each example must be a tensor, a "
                        "tuple of tensors or a dict of tensors (numbers are fine)" + "".join(f"; {h}" for h in hints))
    return ExampleData(dataset, source)


def check_tokens(data: TokenData, vocab_size: int | None) -> None:
    """Raise ``DataError`` when ``data`` holds an id the model's vocabulary cannot embed."""
    if vocab_size is not None and data.max_id >= vocab_size:
        raise DataError(f"{data.source} holds token id {data.max_id}, beyond the model's vocabulary of {vocab_size} "
                        f"ids; use the tokenizer the model was made for, or a model with vocab_size >= "
                        f"{data.max_id + 1}")


def open_tokens(path: str | None, *, tokenizer: Tokenizer, fmt: str = "auto", text_column: str = "text",
                token_dtype: str | None = None, corpus: str | None = None) -> TokenData:
    """The token stream of a data source: ``path`` (any of the forms in the module docstring;
    ``fmt`` ``auto`` tells them apart) or, without a path, the shipped ``corpus``.
    Raises ``DataError`` naming the file or column and the fix."""
    if path is None:
        from .corpus import load_corpus
        from .loader import tokenize_corpus

        name = corpus or "shakespeare"
        arr = tokenize_corpus(name, tokenizer.name if tokenizer.name in ("gpt2", "byte") else "gpt2")
        if tokenizer.name not in ("gpt2", "byte"):
            arr = np.ascontiguousarray(tokenizer.encode_array(load_corpus(name)), dtype=_token_dtype(tokenizer.vocab_size))
        digest = hashlib.sha256(f"{name}:{tokenizer.name}:{len(arr)}".encode()).hexdigest()[:16]
        return TokenData(arr, int(arr.max()), f"corpus {name!r}", digest)
    p = Path(path).expanduser()
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r}; choose one of {list(FORMATS)}")
    kind = detect_format(p) if fmt == "auto" else fmt
    if not p.exists():
        detect_format(p)  # raises with the list of accepted forms
    if kind == "tokens":
        if p.is_dir():
            raise DataError(f"data.format is tokens but {str(p)!r} is a folder; give the token file itself")
        return token_file(p, token_dtype)
    if kind == "text":
        return text_tokens(p, tokenizer)
    return column_tokens(p, kind, text_column, tokenizer)
