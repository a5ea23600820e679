"""Worker entry point with heartbeats: ``python -m varuna_sdk.manager.heartbeat_worker CONFIG.yaml
RUN_DIR`` — ``varuna_sdk.worker`` plus a ``HeartbeatClient`` (``manager.heartbeat``) started from
the environment (``VARUNA_HEARTBEAT_ADDR``, ``VARUNA_JOB_TOKEN``; nothing happens without them).

The client starts *before* torch is imported, so the manager hears from the worker while it is
still starting; after every training step it gets the step's loss and this stage's per-micro-
batch forward / recompute / backward compute time; at the end it says goodbye — "ok", or
"failed" with the exception's last line — so a crash is never taken for a lost VM.

This is a bridge: once ``varuna_sdk.worker`` runs a client itself (it then sets
``worker.HEARTBEATS = True`` and takes ``main(argv, heartbeat=client)``) this module hands it the
already started client. Until then it feeds the client by wrapping ``Varuna.step``.
Imports ``manager.heartbeat`` first, then ``varuna_sdk.worker``.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from .heartbeat import HeartbeatClient


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    client = HeartbeatClient.from_env()
    if client is not None:
        client.start()  # heard from at once, while torch imports
    try:
        from .. import worker
        if getattr(worker, "HEARTBEATS", False):  # worker.main feeds and closes the client
            return worker.main(argv, heartbeat=client)
        if client is not None:
            from ..pipeline.engine import Varuna

            step = Varuna.step

            def step_with_heartbeat(self, *args, **kwargs):
                r = step(self, *args, **kwargs)
                client.record_step(r.step, loss=r.loss, compute_s=r.compute_s,
                                   micro_batches=self.m, step_time_s=r.time_s)
                return r

            Varuna.step = step_with_heartbeat
        if len(argv) == 2:
            Path(argv[1]).mkdir(parents=True, exist_ok=True)
        code = worker.main(argv)
    except BaseException as e:
        if client is not None:
            client.close(status="failed", error="".join(traceback.format_exception_only(e)).strip())
        raise
    if client is not None:
        client.close(status="ok" if code == 0 else "failed",
                     error=None if code == 0 else f"exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
