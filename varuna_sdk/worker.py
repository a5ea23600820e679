"""Entry point started on every worker VM (and, for local hosts, as a local subprocess):
``python -m varuna_sdk.worker CONFIG.yaml RUN_DIR``.

Reads its rank, world size and rendezvous from the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; ``VARUNA_GENERATION`` = which launch of the job
this is, 0 first, +1 per morph), initialises torch.distributed (NCCL with a GPU, else gloo) and
runs the training loop (``trainer.run_worker``). ``manager.generation.Generation`` starts it and
sets that environment; ``pipeline.spawn.spawn_workers`` calls the same ``run_worker`` in-process.

Heartbeats: when the launcher set ``VARUNA_HEARTBEAT_ADDR`` (and ``VARUNA_JOB_TOKEN``), a
``manager.heartbeat_client.HeartbeatClient`` starts *before torch is imported* (the manager hears from
the worker while it is still starting) and reports this worker's step, loss, per-micro-batch
compute times and memory every interval; rank 0 also hands it every step's metrics row (the
``metrics.jsonl`` line) for the manager's metrics table. The training loop polls the client's
``stop_requested`` at every mini-batch boundary (the manager's ``stop`` command: the workers agree,
checkpoint and return "stopped"). At the end the worker says goodbye — "ok", "stopped", or
"failed" with the exception's last line — so a crash is never taken for a lost VM. A worker that
says goodbye writes its traceback with every line marked ``manager.results.LOG_ONLY`` (the manager
keeps it in ``gen<g>/workers.log`` and tells the failure once itself, instead of streaming every
rank's traceback) and exits 1 at once (``_exit_now``: no interpreter teardown, whose C++ threads may
abort with ``terminate called without an active exception`` after the real error).

Pre-emption notices: on the worker the launcher marks (``VARUNA_NOTICE_WATCH=1``, the first on each
VM reached over SSH) a ``cluster.notice.NoticeWatcher`` thread polls the cloud's metadata service
and hands every notice to the heartbeat client, which tells the manager at once.

Imports ``config``, ``pipeline.spawn``, ``cluster.notice``, ``manager.heartbeat_client``,
``manager.wire`` and ``trainer`` (torch lazily, after the heartbeat client started); never
``manager.heartbeat_server``, ``manager.events`` or ``manager.manager``.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
from pathlib import Path

from .cluster.notice import NoticeWatcher
from .manager.heartbeat_client import HeartbeatClient
from .manager.results import LOG_ONLY, SENT_BEFORE, SENT_END
from .manager.wire import ENV_TOKEN, STOPPED
from .shipping import OBJECTS_DIR_ENV

ENV_GENERATION = "VARUNA_GENERATION"

#: what a run's zygote imports once for the workers it forks (``cluster.zygote``): torch, and
#: ``torch._dynamo``, which an optimizer's first call imports (~2.5 s of CPU each time otherwise)
ZYGOTE_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "varuna_sdk.trainer")


class _OutputThatSurvives:
    """stdout/stderr of a worker whose manager may die: the manager reads the other end of the
    pipe (local worker) or SSH channel (remote worker); when it is gone, writes fail with
    EPIPE. A worker must outlive its manager (it then stops at a boundary with a checkpoint),
    so on the first failed write this stream switches to ``fallback``
    (``RUN_DIR/gen<g>/worker-<rank>.log``, ``own_log``), which ``varuna logs`` shows after that
    generation's ``workers.log``. It first replays there the last ``KEPT_BYTES`` it had sent (between
    ``SENT_BEFORE`` and ``SENT_END`` lines): the lines still in the pipe when the manager died were
    never saved (``varuna logs`` shows only those its ``workers.log`` lacks)."""

    #: how much of what was last sent is kept, to replay on the switch: the bytes a dead manager may
    #: have left unread (a pipe holds 64 KiB) — ``varuna logs`` shows those workers.log lacks
    KEPT_BYTES = 1 << 16

    def __init__(self, stream, fallback: Path):
        self._stream, self._fallback, self._file = stream, fallback, None
        self._sent: collections.deque[str] = collections.deque()
        self._sent_bytes, self._mid_line = 0, False   # _mid_line: what is kept begins mid-line

    def write(self, text: str) -> int:
        if self._file is None:
            try:
                n = self._stream.write(text)
                self._stream.flush()
                self._keep(text)
                return n
            except (BrokenPipeError, OSError, ValueError):
                self._fallback.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self._fallback, "a", buffering=1)
                self._replay()
        return self._file.write(text.replace(LOG_ONLY, ""))   # (no manager reads this file: no marks)

    def _keep(self, text: str) -> None:
        self._sent.append(text)
        self._sent_bytes += len(text)
        while self._sent_bytes > self.KEPT_BYTES and len(self._sent) > 1:
            dropped = self._sent.popleft()
            self._sent_bytes -= len(dropped)
            self._mid_line = not dropped.endswith("\n")

    def _replay(self) -> None:
        """Write what was last sent to the manager, between ``SENT_BEFORE`` and ``SENT_END`` lines."""
        sent = "".join(self._sent)
        if self._mid_line:   # the rest of a line whose start was dropped: not shown
            sent = sent[sent.find("\n") + 1:]
        self._sent.clear()
        if sent.strip():
            self._file.write(f"{SENT_BEFORE}\n{sent.replace(LOG_ONLY, '')}{'' if sent.endswith(chr(10)) else chr(10)}"
                             f"{SENT_END}\n")

    def flush(self) -> None:
        try:
            (self._file or self._stream).flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def __getattr__(self, name):  # isatty, fileno, encoding...
        return getattr(self._stream, name)


def own_log(run_dir: str | Path, env) -> Path:
    """Where a worker writes its output itself once its manager no longer reads it:
    ``RUN_DIR/gen<g>/worker-<rank>.log`` (``g``: ``VARUNA_GENERATION``, ``rank``: ``RANK`` of the
    mapping ``env``), beside that generation's ``workers.log``, so that ``varuna logs`` shows it in
    its place (a job orphaned twice keeps two files); ``RUN_DIR/worker-<rank>.log`` without a
    generation number."""
    g = str(env.get(ENV_GENERATION, ""))
    name = f"worker-{env.get('RANK', 'x')}.log"
    return Path(run_dir) / f"gen{g}" / name if g.isdigit() else Path(run_dir) / name


def main(argv: list[str] | None = None, heartbeat: HeartbeatClient | None = None) -> int:
    """Run one worker; returns the process exit code (0: completed or stopped on request, 1:
    failed, told to the manager, 2: bad usage). ``heartbeat``: an already started client (else one
    from the environment, or none); main feeds it after every step and closes it. Without a
    heartbeat client (no manager) an exception propagates as usual."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--zygote":   # the run's zygote (``cluster.zygote``): forks workers
        from .cluster.zygote import serve

        return serve(int(argv[1]), ZYGOTE_PRELOAD, main, warm=lambda: _warm_zygote(argv[2]))
    if len(argv) != 2:
        print("usage: python -m varuna_sdk.worker CONFIG.yaml RUN_DIR", file=sys.stderr)
        return 2
    log = own_log(argv[1], os.environ)
    sys.stdout = _OutputThatSurvives(sys.stdout, log)
    sys.stderr = _OutputThatSurvives(sys.stderr, log)
    hb = heartbeat or HeartbeatClient.from_env()
    if hb is not None and not hb.started:
        hb.start()
    watcher = _start_notice_watcher(hb)
    try:
        status = _train(argv, hb)
    except BaseException as e:
        told = hb is not None and isinstance(e, Exception)
        if told:   # before the goodbye: the manager reads the traceback once the goodbye came
            _write_traceback(e)
        if hb is not None:
            hb.close(status="failed", error="".join(traceback.format_exception_only(e)).strip(),
                     cause=failure_cause(e))
        if not told:
            raise
        return 1
    finally:
        if watcher is not None:
            watcher.close(timeout_s=0.0)
    if hb is not None:
        hb.close(status=STOPPED if status == STOPPED else "ok")
    return 0


def _warm_zygote(run_dir: str) -> None:
    """What the zygote of ``run_dir`` builds once for its workers besides imports: the built-in
    GPT-2 tokenizer's tables (~1.2 s of CPU per worker) when the run's ``config.yaml`` uses it."""
    from .config import JobConfig
    from .data.tokenizer import TOKENIZER_NAMES, get_tokenizer

    name = JobConfig.from_yaml(Path(run_dir) / "config.yaml").data.tokenizer
    if name in TOKENIZER_NAMES:
        get_tokenizer(name)


def _write_traceback(e: BaseException) -> None:
    """``e``'s traceback on stderr, each line marked ``LOG_ONLY``: for the workers' log, not the
    live output (the manager tells the failure itself: the root rank's error once, not every rank's
    traceback nor a peer's consequent "connection closed")."""
    text = "".join(traceback.format_exception(e))
    sys.stderr.write("".join(f"{LOG_ONLY}{line}\n" for line in text.splitlines()))
    sys.stderr.flush()


def _start_notice_watcher(hb: HeartbeatClient | None) -> NoticeWatcher | None:
    """The VM's pre-emption notice watcher (``cluster.notice``), when the launcher asked this
    worker to run it (``VARUNA_NOTICE_WATCH=1``: the first worker on each VM): each notice goes to
    the manager on the heartbeat channel at once."""
    if hb is None:
        return None
    watcher = NoticeWatcher.from_env(lambda n: hb.report_notice(cloud=n.cloud, kind=n.kind,
                                                                deadline=n.deadline, reason=n.reason))
    return watcher.start() if watcher is not None else None


#: what a collective raises on a rank whose peer died first (gloo, NCCL, the TCP store)
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "remote process exited", "socket closed", "read error", "timed out")


#: exception types that are programming errors: the same code fails the same way on a retry
CODE_ERRORS = frozenset({"TypeError", "AttributeError", "NameError", "ImportError", "SyntaxError",
                         "NotImplementedError", "ConfigError", "ShippingError", "UnboundLocalError",
                         "ModelSpecError"})


def failure_cause(e: BaseException) -> str:
    """Why a worker failed, for the manager (``manager.wire.FAILURE_CAUSES``): ``"data"`` for a
    ``DataError`` (deterministic: retrying reads the same examples), ``"code"`` for a programming
    error in the code the job runs (``CODE_ERRORS``: a retry runs the same code into the same
    error), ``"diverged"`` for a ``FloatingPointError`` (``trainer.NonFiniteLossError``: the loss
    or the gradients stayed non-finite; resuming replays the same steps), ``"peer"`` for a collective that failed because another rank died first (a
    consequence, not the cause), else ``"error"`` (may be transient: retried)."""
    from .data.loader import DataError

    seen = e
    while seen is not None:
        if isinstance(seen, DataError):
            return "data"
        seen = seen.__cause__
    names = {c.__name__ for c in type(e).__mro__}
    if names & CODE_ERRORS:
        return "code"
    if "FloatingPointError" in names:
        return "diverged"
    text = str(e).lower()
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"} or (
            isinstance(e, RuntimeError) and any(k in text for k in _PEER_GONE)):
        return "peer"
    return "error"


def _train(argv: list[str], hb: HeartbeatClient | None) -> str:
    """Train; returns the outcome's status ("completed" or "stopped")."""
    import datetime

    import torch
    import torch.distributed as dist

    from .pipeline.spawn import retain_freed_memory
    from .config import JobConfig
    from .trainer import run_worker

    job = JobConfig.from_yaml(argv[0]).validate()
    # callables shipped by value travel next to the config (``shipping``); they are unpickled only
    # after this VM's Python/torch/cloudpickle versions are checked against the launcher's
    os.environ.setdefault(OBJECTS_DIR_ENV, str(Path(argv[0]).resolve().parent))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    generation = int(os.environ.get(ENV_GENERATION, "0"))
    if job.launch.backend == "nccl" and not torch.cuda.is_available():
        import socket

        raise RuntimeError(f"launch.backend: nccl, but this VM ({socket.gethostname()}) has no CUDA GPU; set "
                           "launch.backend: auto (NCCL where every worker has a GPU, else gloo) or gloo")
    backend = "nccl" if torch.cuda.is_available() and job.launch.backend != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    torch.set_num_threads(job.launch.threads_per_worker)
    retain_freed_memory()
    m = job.parallel.num_micro_batches
    kwargs: dict = {"generation": generation, "secret": os.environ.get(ENV_TOKEN) or None}
    if hb is not None:
        def on_step(step, r, metrics) -> None:
            hb.record_step(step, loss=r.loss, compute_s=r.compute_s, micro_batches=m,
                           step_time_s=r.time_s, wait_s=r.wait_s)
            if rank == 0:
                hb.record_metrics(metrics)

        kwargs["on_step"] = on_step
        kwargs["should_stop"] = lambda progress: hb.stop_requested  # every rank polls (agreed each step)
    Path(argv[1]).mkdir(parents=True, exist_ok=True)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=job.launch.timeout_s))
    try:
        outcome = run_worker(rank, world, job.to_dict(), argv[1], **kwargs)
    finally:
        dist.destroy_process_group()
    return getattr(outcome, "status", "completed")


def _exit_now(code: int) -> None:
    """End the process at once with ``code``, skipping the interpreter's teardown (unloading
    torch, freeing the model and optimizer state, joining library threads: 1-2 s measured on a
    shared 2-core machine, spent while the manager waits to start the next generation; after a
    failure, a C++ thread's ``terminate called without an active exception``). Only after ``main``
    returned: the checkpoint is published (or the failure told), the process group destroyed,
    the goodbye delivered; the streams are flushed here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing left to save
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
