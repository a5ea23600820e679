"""Partition-invariant random numbers: the seed of every random op depends on (seed, step,
micro-batch, segment) — never on the pipeline depth P, the replica count D or the stage.

This fixes the original's bug (varuna-original.md §8.4) where restoring the RNG for a recompute
rewound the *global* generator: here every segment of every micro-batch runs under its own
derived seed inside a forked RNG, so a recompute sees the same dropout masks as its forward,
different micro-batches see different masks, and the caller's RNG stream is untouched.

Single-process code gets the same numbers with ``segment_rng`` (the reference that tests
compare against). Must never import ``varuna_sdk.pipeline``.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from typing import Iterator

import numpy as np
import torch

from .cutpoint import observe_cutpoints


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts (stable across processes and Python runs)."""
    h = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF


def seed_segment(seed: int, step: int, microbatch: int, segment: int | str) -> None:
    """Seed torch's generators (CPU and, if present, CUDA), NumPy's global one and Python's
    ``random`` for one segment of one micro-batch (``segment`` ``LOSS``: the loss after the forward).

    ``microbatch`` is the global micro-batch index ``replica * m + i`` so that it does not depend
    on which replica ran it.
    """
    s = derive_seed("segment", seed, step, microbatch, segment)
    # the generators directly: torch.manual_seed also records stack traces (~130 µs a call)
    torch.default_generator.manual_seed(s)
    # NumPy's global generator too (a forward that draws from it, as Hugging Face's SpecAugment masks
    # do, gets the same draws in a recompute as in its forward, at any P and D); not saved and
    # restored as torch's are (that costs ~170 µs): after a forward it holds a segment's seed
    np.random.seed(s & 0xFFFF_FFFF)
    random.seed(s)   # (Python's too: a forward drawing from it is then the same at any P and D; ~1 µs)
    if torch.cuda.is_initialized():   # (False without CUDA; cheaper than is_available, asked per segment)
        torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(s)


@contextlib.contextmanager
def forked_rng() -> Iterator[None]:
    """Save torch's RNG states (CPU and the current CUDA device), restore them on exit."""
    if torch.cuda.is_initialized():
        with torch.random.fork_rng(devices=[torch.cuda.current_device()], enabled=True):
            yield
        return
    # CPU only: the generator's state directly (fork_rng also asks which accelerator is present,
    # once per forward of every micro-batch)
    state = torch.default_generator.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(state)


class SegmentSeeder:
    """Cut-point observer that reseeds at every crossing; tensors pass through unchanged."""

    def __init__(self, seed: int, step: int, microbatch: int):
        self.seed, self.step, self.microbatch = seed, step, microbatch
        self.segment = 0

    def start(self) -> None:
        """Seed segment 0 (before the forward starts)."""
        self.segment = 0
        seed_segment(self.seed, self.step, self.microbatch, 0)

    def at_cutpoint(self, tensors):
        """Seed the next segment; the tensors pass through unchanged."""
        self.segment += 1
        seed_segment(self.seed, self.step, self.microbatch, self.segment)
        return tensors


#: the segment name the loss of a micro-batch is seeded with (after the forward's last segment)
LOSS = "loss"


@contextlib.contextmanager
def loss_rng(seed: int, step: int, microbatch: int) -> Iterator[None]:
    """Run a micro-batch's loss with its own seed, (``seed``, step, micro-batch, ``LOSS``): random
    numbers a loss draws (dropout on the logits, noise) are then the same at any P × D, in every
    run, and in the plain reference; the caller's torch RNG state is restored afterwards."""
    with forked_rng():
        seed_segment(seed, step, microbatch, LOSS)
        yield


@contextlib.contextmanager
def segment_rng(seed: int, step: int, microbatch: int) -> Iterator[SegmentSeeder]:
    """Run a plain forward with the same random numbers the pipeline uses for micro-batch
    ``microbatch`` of step ``step``; the caller's RNG state is restored afterwards."""
    seeder = SegmentSeeder(seed, step, microbatch)
    with forked_rng(), observe_cutpoints(seeder):
        seeder.start()
        yield seeder
