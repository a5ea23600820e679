"""Masked-language-model inputs from token data (``data.mlm_probability``): BERT's masking
(Devlin et al., arXiv 1810.04805, §3.1 "Task #1: Masked LM"), as transformers'
``DataCollatorForLanguageModeling`` does it, but drawn per example from a seed, so the masks of a
step are the same whatever the pipeline depth, the number of replicas or a morph in between.

Each example of ``T`` tokens has exactly ``max(1, round(probability * T))`` tokens chosen, as
BERT's own pre-training data does (``num_to_predict`` in its ``create_pretraining_data.py``): so
every micro-batch predicts the same number of tokens, and the mean of the micro-batches' mean
losses equals the mini-batch's mean over its predicted tokens — the loss and its gradients do not
depend on the micro-batch size, D or a morph (with a per-token coin, they would). A chosen token
is replaced by the mask token (80 %), by a random token (10 %) or kept (10 %). ``labels`` hold the
original id where a token was chosen and ``IGNORE_INDEX`` (-100, which Hugging Face losses and
``F.cross_entropy`` skip) elsewhere.

No torch.distributed, no model: a pure function of (ids, keys, settings).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

#: The label of a position that is not predicted (``F.cross_entropy``'s default ``ignore_index``).
IGNORE_INDEX = -100
#: Mask token names looked up in a tokenizer's vocabulary when ``data.mask_token`` is not given.
MASK_TOKEN_CANDIDATES = ("[MASK]", "<mask>")
#: Streams of examples, so a train example never shares its draws with a held-out one.
TRAIN, HELD_OUT, SAMPLE = 0, 1, 2


@dataclass(frozen=True)
class MLMMasking:
    """BERT masking settings: ``probability`` of choosing a token (0 < p < 1), the tokenizer's
    ``mask_id``, ``vocab_size`` (random replacements are drawn from ``[0, vocab_size)``) and the
    data ``seed``."""

    probability: float
    mask_id: int
    vocab_size: int
    seed: int

    def apply(self, ids: torch.Tensor, keys: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(masked input_ids, labels)`` of ``ids`` (int64 ``[n, T]``), both int64 ``[n, T]``.
        ``keys[i]`` identifies example ``i`` (e.g. ``(TRAIN, step, row of the global batch)``):
        its masks depend only on ``(seed, key)``. Raises ``ValueError`` when ``len(keys) != n``."""
        if ids.dim() != 2 or len(keys) != ids.shape[0]:
            raise ValueError(f"MLMMasking.apply takes ids [n, T] and n keys; got ids {tuple(ids.shape)} and "
                             f"{len(keys)} keys")
        src = ids.cpu().numpy()
        masked, labels = src.copy(), np.full_like(src, IGNORE_INDEX)
        for i, key in enumerate(keys):
            chosen, how, random_ids = _draws(self.seed, key, src.shape[1], self.probability, self.vocab_size)
            labels[i, chosen] = src[i, chosen]
            masked[i, chosen & (how < 0.8)] = self.mask_id
            swap = chosen & (how >= 0.8) & (how < 0.9)
            masked[i, swap] = random_ids[swap]
        return torch.from_numpy(masked), torch.from_numpy(labels)


def predicted_per_example(p: float, T: int) -> int:
    """Tokens chosen in an example of ``T`` tokens: ``max(1, round(p * T))`` (at most ``T``)."""
    return min(T, max(1, int(round(p * T))))


def _draws(seed: int, key: Sequence[int], T: int, p: float, vocab_size: int):
    """One example's draws: which positions are chosen (bool ``[T]``, ``predicted_per_example``
    of them, uniformly), a uniform number per position deciding mask / random / keep, and the
    random ids."""
    rng = np.random.default_rng([int(seed), *(int(k) for k in key)])
    chosen = np.zeros(T, dtype=bool)
    chosen[rng.permutation(T)[:predicted_per_example(p, T)]] = True
    return chosen, rng.random(T), rng.integers(0, vocab_size, size=T)


def masking_for(probability: float | None, tokenizer, mask_token: str | None, seed: int) -> MLMMasking | None:
    """The job's ``MLMMasking`` (None when ``probability`` is None): the mask token is
    ``mask_token`` or the first of ``MASK_TOKEN_CANDIDATES`` in the tokenizer's vocabulary.
    Raises ``ValueError`` naming the tokenizer and the fix when it has no such token."""
    if probability is None:
        return None
    names = (mask_token,) if mask_token else MASK_TOKEN_CANDIDATES
    for name in names:
        mask_id = tokenizer.token_id(name)
        if mask_id is not None:
            specials = tokenizer.special_tokens()
            if specials and name not in specials:
                warnings.warn(f"data.mask_token {name!r} is an ordinary token of the tokenizer, not one of its special "
                              f"tokens {specials}: every masked position will read as that word", UserWarning,
                              stacklevel=2)
            return MLMMasking(float(probability), int(mask_id), int(tokenizer.vocab_size), int(seed))
    where = getattr(tokenizer, "path", None) or tokenizer.name
    specials = tokenizer.special_tokens()
    fix = (f"name one of its special tokens {specials} in data.mask_token" if specials and mask_token
           else f"its special tokens are {specials}: name the mask token in data.mask_token" if specials
           else "or name its mask token in data.mask_token")
    raise ValueError(f"data.mlm_probability needs a mask token, and the tokenizer {where!r} has no "
                     f"{' or '.join(repr(n) for n in names)}; give data.tokenizer the tokenizer.json of your masked "
                     f"language model (e.g. the one saved with it by save_pretrained), {fix}")


__all__ = ["HELD_OUT", "IGNORE_INDEX", "MASK_TOKEN_CANDIDATES", "MLMMasking", "SAMPLE", "TRAIN", "masking_for",
           "predicted_per_example"]
