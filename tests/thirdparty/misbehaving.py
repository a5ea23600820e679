"""User code that ends its own worker process: the model factory calls ``sys.exit(0)`` on one
rank — ``sys.exit(0)`` or ``os._exit(0)`` — (``RANK`` from the worker's environment; the launcher's dry run has none, so it passes)."""

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
