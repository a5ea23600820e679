"""One rank's background checkpoint writer: stage locally, publish, mark done, and (on the
manifest writer, rank 0) write the manifest last and keep the newest K.

Owns ``CheckpointWriter`` and the test-only crash hook. The caller hands it a CPU snapshot taken
at a mini-batch boundary; everything after that (``torch.save`` with the SHA-256 computed while
writing, the copy to the store, the done-marker, the manifest) runs in one background thread so
training goes on (paper §4.5). The thread uses no collective: rank 0's thread polls the store
for every rank's done-marker and only then writes the manifest, as one object. One checkpoint is
in flight per rank at a time: a new ``save`` first waits for the previous one (back-pressure).

Test hook: ``VARUNA_CKPT_CRASH="PHASE[,rank=R][,step=S]"`` makes the writing process
``os._exit(17)`` at that phase — ``staged`` (local files written), ``uploading`` (first file in the
store), ``uploaded`` (all of this rank's files in the store, no marker), ``marked`` (marker
written), ``markers`` (rank 0 saw every marker, no manifest), ``manifest-half`` (half the
manifest's bytes written in place, as a non-atomic store could leave it), ``published``
(manifest written, before pruning), ``pruning`` (an old checkpoint's manifest deleted, its files
not). Never imports ``pipeline``, ``trainer`` or ``manager``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .store import (DONE_DIR, FORMAT, MANIFEST, CheckpointError, CheckpointInfo, Store, manifest_checksum,
                    manifest_mac, prune, wait_for_markers)

CRASH_ENV = "VARUNA_CKPT_CRASH"
PHASES = ("staged", "uploading", "uploaded", "marked", "markers", "manifest-half", "published", "pruning")


def _crash_wanted(phase: str, rank: int, step: int) -> bool:
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return False
    name, *conds = [s.strip() for s in spec.split(",")]
    if name != phase:
        return False
    for c in conds:
        key, _, value = c.partition("=")
        if (key == "rank" and int(value) != rank) or (key == "step" and int(value) != step):
            return False
    return True


def _crash_point(phase: str, rank: int, step: int) -> None:
    if _crash_wanted(phase, rank, step):
        os._exit(17)


class _HashingFile:
    """File wrapper that hashes and counts what ``torch.save`` writes through it (one pass)."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        """Hash, count and write ``data``; returns bytes written."""
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        """Flush the wrapped file."""
        self.f.flush()


def save_hashed(obj: Any, path: str | Path) -> dict:
    """``torch.save(obj, path)``; returns ``{"size": bytes, "sha256": hex}`` of the file."""
    with open(path, "wb") as f:
        h = _HashingFile(f)
        torch.save(obj, h)
    return {"size": h.size, "sha256": h.sha.hexdigest()}


class CheckpointWriter:
    """Background writer of one rank (paper §4.5).

    Args:
        url: the published store (path or fsspec URL).
        rank, world: this rank and the job's world size (every rank writes a done-marker).
        staging_dir: local folder for files before they are published (this rank's own).
        manifest_writer: whether this rank writes the manifest and prunes (rank 0).
        keep: complete checkpoints to keep (>= 1).
        timeout_s: how long the manifest writer waits for every rank's marker.
        key: ``store.manifest_key(job secret)``: the manifest is signed with it (None: unsigned).

    A write that fails (a full disk, a store that went away) removes what it left: the local
    staging files and this rank's files of that checkpoint in the store (the manifest writer: the
    whole checkpoint, which can never complete), so a full store does not stay full.

    ``save`` returns once the thread has started; ``wait`` joins it and returns the published
    ``CheckpointInfo`` (manifest writer) or the checkpoint name (other ranks). A failure in the
    thread is raised as ``CheckpointError`` by the next ``save`` or ``wait``.
    """

    def __init__(self, url: str, rank: int, world: int, staging_dir: str | Path, *, manifest_writer: bool | None = None,
                 keep: int = 3, timeout_s: float = 600.0, key: bytes | None = None):
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1")
        self.key = key
        self.store = Store(url, key)
        self.rank, self.world = rank, world
        self.staging = Path(staging_dir)
        self.manifest_writer = rank == 0 if manifest_writer is None else manifest_writer
        self.keep, self.timeout_s = keep, timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Any = None
        self._mine: list[str] = []
        self._published = False
        self.timings: dict[str, float] = {}  # seconds of the last checkpoint's phases

    @property
    def busy(self) -> bool:
        """True while the background thread is writing or publishing."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, name: str, step: int, files: dict[str, Any], manifest: dict | None = None) -> float:
        """Write ``files`` ({file name: object for ``torch.save``}, CPU tensors, not touched again
        by the caller) as part of checkpoint ``name`` in the background. ``manifest``: the fields
        the manifest writer adds (``step``, ``P``, ``D``, ``segments`` ...). Returns the seconds it
        waited for the previous checkpoint of this rank (back-pressure)."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        self._result = None
        self._thread = threading.Thread(target=self._run, args=(name, step, files, manifest),
                                        name=f"varuna-ckpt-{name}", daemon=True)
        self._thread.start()
        return waited

    def wait(self, timeout_s: float | None = None) -> Any:
        """Join the checkpoint in flight (if any); returns its result (see the class). Raises
        ``CheckpointError`` if it failed or is still running after ``timeout_s``."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise CheckpointError(f"checkpoint write still running after {timeout_s:.0f} s")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"checkpoint write failed on rank {self.rank}: {err!r}") from err
        return self._result

    # ---- the thread -------------------------------------------------------------------------
    def _run(self, name: str, step: int, files: dict[str, Any], manifest: dict | None) -> None:
        try:
            self._result = self._write(name, step, files, manifest)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by wait()
            files.clear()
            self._clean_up(name)
            self._error = e

    def _clean_up(self, name: str) -> None:
        """After a failed write: drop the local staging of ``name`` and what this rank put in the
        store for it (the manifest writer: the whole checkpoint directory)."""
        shutil.rmtree(self.staging / name, ignore_errors=True)
        try:
            self.staging.rmdir()
        except OSError:
            pass
        if self._published:   # it failed while pruning: the checkpoint itself is complete
            return
        try:
            if self.manifest_writer:
                self.store.remove_checkpoint(name)
            else:
                for fname in self._mine:
                    try:
                        self.store.fs.rm_file(self.store.path(name, fname))
                    except (FileNotFoundError, OSError):
                        pass
        except Exception:  # noqa: BLE001 - the store itself may be gone; the error is reported anyway
            pass

    def _write(self, name: str, step: int, files: dict[str, Any], manifest: dict | None):
        r, t = self.rank, {}
        t0 = time.perf_counter()
        local = self.staging / name
        local.mkdir(parents=True, exist_ok=True)
        entries = {}
        self._mine, self._published = list(files), False
        for fname, obj in files.items():
            entries[fname] = {**save_hashed(obj, local / fname), "rank": r}
        files.clear()  # drop the snapshot as soon as it is on disk
        t["stage_s"] = time.perf_counter() - t0
        _crash_point("staged", r, step)
        t1 = time.perf_counter()
        for k, fname in enumerate(entries):
            self.store.put_file(str(local / fname), f"{name}/{fname}")
            if k == 0:
                _crash_point("uploading", r, step)
        shutil.rmtree(local, ignore_errors=True)
        try:  # this rank's own folder only: the parent is shared with other ranks on this machine
            self.staging.rmdir()
        except OSError:
            pass
        t["upload_s"] = time.perf_counter() - t1
        _crash_point("uploaded", r, step)
        marker = json.dumps({"rank": r, "step": step, "files": entries}).encode()
        self.store.write_bytes(f"{name}/{DONE_DIR}/rank-{r:05d}.json", marker)
        _crash_point("marked", r, step)
        if not self.manifest_writer:
            t["total_s"] = time.perf_counter() - t0
            self.timings = t
            return name
        t2 = time.perf_counter()
        markers = wait_for_markers(self.store, name, self.world, self.timeout_s)
        t["wait_markers_s"] = time.perf_counter() - t2
        _crash_point("markers", r, step)
        all_files: dict[str, dict] = {}
        for rk in sorted(markers):
            for fname, meta in markers[rk]["files"].items():
                if fname in all_files:
                    raise CheckpointError(f"checkpoint {name!r}: ranks {all_files[fname]['rank']} and {rk} "
                                          f"both wrote {fname!r}")
                all_files[fname] = meta
        body = {"format": FORMAT, **(manifest or {}), "step": step, "world": self.world, "files": all_files,
                "created": time.time()}
        if self.key is not None:
            body["mac"] = manifest_mac(self.key, body)
        body["checksum"] = manifest_checksum(body)
        data = json.dumps(body, indent=1, sort_keys=True).encode()
        if _crash_wanted("manifest-half", r, step):
            with open(self.store.path(name, MANIFEST), "wb") as f:  # a non-atomic store's torn object
                f.write(data[: len(data) // 2])
            os._exit(17)
        self.store.write_bytes(f"{name}/{MANIFEST}", data)
        self._published = True
        t["publish_s"] = time.perf_counter() - t2
        _crash_point("published", r, step)
        prune(self.store.url, self.keep, published=name, _crash=lambda: _crash_point("pruning", r, step), key=self.key)
        t["total_s"] = time.perf_counter() - t0
        self.timings = t
        return CheckpointInfo(self.store.url, name, step, body)
