"""User code that misbehaves on one rank (``RANK`` from the worker's environment; the launcher's
dry run has none, so it passes): a model factory that ends its own worker process (``sys.exit(0)``
or ``os._exit(0)``), and a model whose forward raises after a few calls, every launch."""

import functools
import os
import sys

from .singlefile_gpt import make_gpt


def exits_on_rank(rank: int = 1, how: str = "sys.exit", **overrides):
    if os.environ.get("RANK") == str(rank):
        if how == "os._exit":   # no exception, no goodbye: the process is just gone, with code 0
            sys.stdout.flush()
            os._exit(0)
        sys.exit(0)
    return make_gpt(**overrides)


def raises_on_rank(rank: int = 1, at_call: int = 3, error: str = "TypeError", **overrides):
    """A model whose forward raises ``error`` (a builtin exception's name) on its ``at_call``-th call
    on training worker ``rank`` (not in a calibration), every launch: a bug in user code, as the
    same code hits it on every retry."""
    model = make_gpt(**overrides)
    if rank not in (-1, int(os.environ.get("RANK", "-2"))) or "VARUNA_GENERATION" not in os.environ:
        return model   # rank -1: every rank; only in training workers
    exc = {"TypeError": TypeError, "RuntimeError": RuntimeError}[error]
    calls = [0]
    inner = model.forward

    @functools.wraps(inner)   # the same signature: the SDK reads it to call the model and its loss
    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= at_call:
            raise exc(f"user code broke on call {calls[0]} ({error})")
        return inner(*args, **kwargs)

    model.forward = forward
    return model
