"""Read the next step's batch while this step trains.

A rank reads its batch of step ``k + 1`` (the dataset's ``__getitem__``, collation, the job's
split into model inputs and targets) on one long-lived background thread while step ``k`` runs,
as ``torch.utils.data.DataLoader`` prefetches, so that the time a user's dataset takes to decode
its examples (images, audio, text tokenised on the fly) is hidden behind the pipeline instead of
being added to every step. One thread, not processes: torch's operators release the GIL, so
reading overlaps with the stage's compute without starting a process per rank (2 cores here,
each rank's process already holds its share), and every read after the first happens on the
same thread, in step order.

A dataset that draws from a process-wide random generator while reading (torch's, NumPy's or
Python's global one: torchvision's random transforms, ``np.random`` augmentation) is read on the
main thread instead: its draws would race with the stage's, whose forward seeds torch's and
NumPy's generators per segment so that a recompute replays the forward's dropout. The first read
runs on the caller's thread with nothing else running and is checked: when any of the three
generators' states moved, prefetching is turned off for the run (``off_reason`` says why).

Batches are a pure function of the step (``data.loader``), so reading one ahead changes no
number: the same step reads the same examples with or without prefetching. A read that fails
raises its error at the step that needed it, in the main thread (a ``DataError`` names the step
and the examples as without prefetching); a batch read ahead for a step that never runs (the
job stops or morphs at that boundary) is dropped. The thread is a daemon: an interpreter that
exits does not wait for a read in flight.

Imports nothing of ``varuna_sdk``.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from typing import Any, Callable

import numpy as np
import torch


class BatchPrefetcher:
    """``get(step)`` returns ``read(step)``, having read it on a background thread when the
    previous ``get(step - 1)`` asked for it; ``get`` then starts reading ``step + 1`` (unless
    ``step + 1 >= stop``, the run's step count).

    Args:
        read: ``step -> batch``, a pure function of the step (any exception it raises is raised
            again by the ``get`` of that step, with its traceback).
        stop: the first step never read (the job's ``train.steps``).
        enabled: ``False`` reads every batch in ``get`` itself (``data.prefetch: false``, for a
            dataset that must be read on the thread that opened it, e.g. an ``sqlite3``
            connection).
        on_stall: ``(step, seconds) -> None``, called (on a watchdog thread) every ``stall_s``
            seconds that a ``get`` has been waiting for its batch — a ``__getitem__`` that hangs
            (a stuck network mount) would otherwise stall the job without a word. None: no watchdog.
        stall_s: seconds between ``on_stall`` calls (> 0).
        draws: ``() -> names`` of the global generators the reads draw from by the reader's own
            account, asked after the first read: a reader that seeds and restores them around
            each read itself (``data.loader.ExampleLoader``) leaves their states as they were, so
            the first read's check cannot see its draws. None: the check alone.

    ``waited_s`` after each ``get``: seconds that ``get`` blocked for its batch (the whole read
    without prefetching; only what the step's compute did not hide with it). ``off_reason``: why
    prefetching was turned off after the first read (its read drew from a global random
    generator), else ``None``.
    """

    def __init__(self, read: Callable[[int], Any], stop: int, *, enabled: bool = True,
                 on_stall: Callable[[int, float], None] | None = None, stall_s: float = 60.0,
                 draws: Callable[[], list[str]] | None = None):
        self._read, self._stop, self.enabled = read, int(stop), bool(enabled)
        self._draws = draws
        if not stall_s > 0:
            raise ValueError(f"stall_s={stall_s!r} must be > 0 seconds")
        self._on_stall, self._stall_s = on_stall, float(stall_s)
        self._getting: tuple[int, float] | None = None   # (step, perf_counter at its get) while a get waits
        self._watch: threading.Thread | None = None
        self._cond = threading.Condition()
        self._want: int | None = None        # the step the thread is asked to read next
        self._reading: int | None = None     # the step it is reading now
        self._have: tuple[int, bool, Any] | None = None   # (step, ok, batch or exception) read last
        self._closed = False
        self._thread: threading.Thread | None = None
        self._probed = False
        self.off_reason: str | None = None
        self.waited_s = 0.0

    def get(self, step: int) -> Any:
        """The batch of ``step`` (read ahead when the previous ``get`` was of ``step - 1``); then
        the read of ``step + 1`` is started. Raises whatever ``read(step)`` raised."""
        if self._on_stall is None:
            return self._get(step)
        if self._watch is None:
            self._watch = threading.Thread(target=self._watchdog, name="varuna-data-watch", daemon=True)
            self._watch.start()
        self._getting = (step, time.perf_counter())
        try:
            return self._get(step)
        finally:
            self._getting = None

    def _watchdog(self) -> None:
        """Call ``on_stall`` every ``stall_s`` seconds that one ``get`` waits (until ``close``)."""
        told: tuple[int, float] | None = None
        calls = 0
        while not self._closed:
            time.sleep(min(self._stall_s / 4, 1.0))
            now, getting = time.perf_counter(), self._getting
            if getting is None:
                continue
            if getting != told:
                told, calls = getting, 0
            if now - getting[1] >= (calls + 1) * self._stall_s:
                calls += 1
                try:
                    self._on_stall(getting[0], now - getting[1])
                except Exception:  # noqa: BLE001 - a report that fails must not end the watch
                    pass

    def _get(self, step: int) -> Any:
        t0 = time.perf_counter()
        if not self._probed and self.enabled:
            self._probed = True
            batch, moved = draws_random(lambda: self._read(step))
            moved = moved or (list(self._draws()) if self._draws is not None else [])
            if moved:
                self.enabled = False
                self.off_reason = (f"reading a batch draws from the global {' and '.join(moved)} random generator(s) "
                                   "(random transforms in __getitem__?), which the stages' forwards seed; the batches "
                                   "are read on the main thread so that the draws do not race")
            elif step + 1 < self._stop:
                with self._cond:
                    self._ask(step + 1)
            self.waited_s = time.perf_counter() - t0
            return batch
        if not self.enabled or self._closed:
            batch = self._read(step)
            self.waited_s = time.perf_counter() - t0
            return batch
        with self._cond:
            if step not in (self._want, self._reading) and not self._holds(step):
                self._ask(step)
            while not self._holds(step):
                self._cond.wait()
            _, ok, value = self._have
            self._have = None
            if step + 1 < self._stop:
                self._ask(step + 1)
        self.waited_s = time.perf_counter() - t0
        if not ok:
            raise value
        return value

    def _holds(self, step: int) -> bool:
        return self._have is not None and self._have[0] == step

    def _ask(self, step: int) -> None:
        """Ask the thread (started on first use) to read ``step``; ``_cond`` held."""
        self._want = step
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="varuna-prefetch", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._want is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                step, self._want, self._reading = self._want, None, self._want
            try:
                result = (step, True, self._read(step))
            except BaseException as e:  # noqa: BLE001 - handed to the step that needs it
                result = (step, False, e)
            with self._cond:
                self._have, self._reading = result, None
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread after its current read (a batch read ahead is dropped); a later
        ``get`` reads on the caller's thread."""
        with self._cond:
            self._closed = True
            self._have = None
            self._cond.notify_all()


def draws_random(read: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``read()``'s result and the global random generators it drew from (``"torch"``,
    ``"NumPy"``, ``"Python random"``: their states moved), read on the caller's thread. A dataset
    whose reads draw from them cannot be read ahead on another thread (``BatchPrefetcher``); the
    calibration asks the same of the job's data so that the plan models what will run."""
    before = _global_rng_states()
    out = read()
    return out, [name for name, a, b in zip(("torch", "NumPy", "Python random"), before, _global_rng_states())
                 if a != b]


def _global_rng_states() -> tuple[bytes, bytes, bytes]:
    """Digests of torch's default CPU generator, NumPy's global and Python's ``random`` states."""
    np_state = np.random.get_state()
    return (hashlib.sha1(torch.default_generator.get_state().numpy().tobytes()).digest(),
            hashlib.sha1(np_state[1].tobytes() + repr(np_state[2:]).encode()).digest(),
            hashlib.sha1(repr(random.getstate()).encode()).digest())
