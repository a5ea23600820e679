"""Training data for varuna_sdk: tokenizers, corpora, cached token arrays, batches.

* ``tokenizer`` - the real GPT-2 BPE (offline, via tiktoken) and a byte tokenizer.
* ``corpus`` - raw text corpora (Shakespeare, offline).
* ``loader`` - cached tokenization, train/val split, deterministic batches.

This package never imports ``varuna_sdk.pipeline``, ``varuna_sdk.cluster`` or
``varuna_sdk.manager``; those depend on it, not the other way round.
"""

from .corpus import CORPUS_NAMES, load_corpus, shakespeare_text
from .loader import (
    BatchLoader,
    default_cache_dir,
    eval_batches,
    tokenize_corpus,
    train_val_split,
)
from .tokenizer import (
    TOKENIZER_NAMES,
    ByteTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    get_tokenizer,
    gpt2_tokenizer,
)

__all__ = [
    "CORPUS_NAMES",
    "TOKENIZER_NAMES",
    "BatchLoader",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "Tokenizer",
    "default_cache_dir",
    "eval_batches",
    "get_tokenizer",
    "gpt2_tokenizer",
    "load_corpus",
    "shakespeare_text",
    "tokenize_corpus",
    "train_val_split",
]
