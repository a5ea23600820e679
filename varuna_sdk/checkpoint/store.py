"""The published checkpoint store: a plain path or any fsspec URL shared by every worker VM.

Owns the store layout, the manifest (its format, checksum and verification), finding complete
checkpoints (``latest_complete``, ``complete_checkpoints``), reading a file with its size and
SHA-256 checked, and keeping the newest K complete checkpoints (``prune``). Paper §4.5
(checkpoints go to a store all VMs reach); varuna-original.md §6, §9 — here a checkpoint is only
ever *complete* when its manifest, written last as one object, parses, carries a valid checksum
and lists files that are all present with their recorded sizes (the original summed marker counts
and could load a torn checkpoint).

Layout (``<store>`` = the URL)::

    <store>/step-00000012-1f3a9c2e/          one checkpoint: step 12, write tag 1f3a9c2e
        seg-00003.pt ...                     per cut-point segment: parameters + AdamW state by name
        common.pt                            step, data position, loss scaler, RNG (rank 0)
        _done/rank-00005.json                per-rank completion markers (files, sizes, sha256)
        MANIFEST.json                        written last, after every rank's marker

The tag makes a retried step (after a crash) a different directory, so a stale marker of a torn
attempt can never complete a new one. Uses fsspec only; never imports ``pipeline``, ``trainer``
or ``manager``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

FORMAT = "varuna-checkpoint/1"
MANIFEST = "MANIFEST.json"
DONE_DIR = "_done"
_NAME = re.compile(r"^step-(\d{8,})-([0-9a-z]+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, corrupt or does not fit the model; the message names the
    checkpoint and the file."""


def checkpoint_name(step: int, tag: str) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps by write ``tag``."""
    if not re.fullmatch(r"[0-9a-z]+", tag):
        raise ValueError(f"checkpoint tag {tag!r} must be lower-case letters and digits")
    return f"step-{step:08d}-{tag}"


def parse_name(name: str) -> tuple[int, str] | None:
    """``(step, tag)`` of a checkpoint directory name, ``None`` for anything else."""
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")   # a plain file name: no '/', no '..'
MAX_MANIFEST_BYTES = 256 << 20


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def check_manifest_schema(body: dict) -> str | None:
    """What is wrong with the structure of a manifest whose checksum verified (``None``: nothing):
    the fields ``read_manifest``'s callers index must be there with the right types, and every
    listed file must be a plain name inside the checkpoint's directory. A manifest a bug or a
    hand edit made odd is skipped like a torn one instead of failing a worker later."""
    for key in ("step", "world"):
        if not _is_int(body.get(key), 0 if key == "step" else 1):
            return f"{key}={body.get(key)!r} is not an integer"
    for key in ("P", "D"):
        if key in body and not _is_int(body[key], 1):
            return f"{key}={body[key]!r} is not an integer >= 1"
    created = body.get("created", 0.0)
    if not isinstance(created, (int, float)) or isinstance(created, bool) or created != created:
        return f"created={created!r} is not a time"
    files = body.get("files")
    if not isinstance(files, dict):
        return "files is not a mapping"
    for fname, meta in files.items():
        if not (isinstance(fname, str) and _FILE.match(fname) and ".." not in fname):
            return f"file name {str(fname)[:80]!r} is not a plain file name"
        if not (isinstance(meta, dict) and _is_int(meta.get("size")) and isinstance(meta.get("sha256"), str)
                and _HEX64.match(meta["sha256"]) and _is_int(meta.get("rank"))):
            return f"file {fname!r}: expected {{size, sha256, rank}}, got {str(meta)[:80]}"
    items = body.get("items")
    if items is not None:
        if not isinstance(items, dict):
            return "items is not a mapping"
        for n, it in items.items():
            if not (isinstance(n, str) and isinstance(it, dict) and (it.get("tensor") is None or it.get("tensor") in files)
                    and isinstance(it.get("optim", []), list) and all(f in files for f in it.get("optim", []))):
                return f"item {str(n)[:80]!r} does not name files of the manifest"
    return None


_MAC_LABEL = b"varuna-checkpoint-manifest-v1"


def manifest_key(secret: str) -> bytes:
    """The manifest MAC key of a job secret (domain-separated: never the heartbeat key)."""
    if not secret:
        raise ValueError("the job secret is empty")
    return hmac.new(secret.encode(), _MAC_LABEL, hashlib.sha256).digest()


def manifest_mac(key: bytes, body: dict) -> str:
    """HMAC-SHA256 (hex) of the canonical JSON of a manifest without ``checksum`` and ``mac``."""
    rest = {k: v for k, v in body.items() if k not in ("checksum", "mac")}
    return hmac.new(key, json.dumps(rest, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def verify_manifest_mac(key: bytes, body: dict) -> bool:
    """Whether ``body`` carries a valid ``mac`` for ``key`` (constant-time comparison)."""
    mac = body.get("mac")
    return isinstance(mac, str) and len(mac) == 64 and hmac.compare_digest(manifest_mac(key, body), mac)


def manifest_checksum(body: dict) -> str:
    """SHA-256 (hex) of the canonical JSON of a manifest without its ``checksum`` field."""
    rest = {k: v for k, v in body.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete (verified) checkpoint: store URL, directory name, step and its manifest.

    ``step`` = optimizer steps completed when it was taken = the next step to run on resume.
    ``manifest`` holds ``P``, ``D``, ``world``, ``generation``, ``files`` ({name: {size, sha256,
    rank}}), ``segments`` ({segment: [parameter and buffer names]}) and ``created`` (Unix time).
    """

    url: str
    name: str
    step: int
    manifest: dict

    @property
    def path(self) -> str:
        """URL (or path) of the checkpoint's directory."""
        return self.url.rstrip("/") + "/" + self.name

    @property
    def P(self) -> int:
        """Pipeline depth the checkpoint was saved under."""
        return int(self.manifest["P"])

    @property
    def D(self) -> int:
        """Data-parallel width the checkpoint was saved under."""
        return int(self.manifest["D"])

    @property
    def total_bytes(self) -> int:
        """Bytes of all files listed in the manifest."""
        return sum(int(f["size"]) for f in self.manifest["files"].values())


class Store:
    """One checkpoint store (``url``: a path or an fsspec URL such as ``file:///x``, ``s3://b/p``).

    Small, whole-object operations only: every write is one object, so an object store never shows
    half a manifest; on a local file system writes go to a unique temporary name and are renamed
    into place (``os.replace``), and a failed write removes its temporary file. ``key``
    (``manifest_key(job secret)``): manifests are signed with it and only manifests signed with it
    are read (so only the job's own writers can publish a checkpoint it loads); ``None``: checksum
    only (a run without a manager). Raises ``CheckpointError`` when the URL cannot be opened.
    """

    def __init__(self, url: str | os.PathLike, key: bytes | None = None):
        self.url = str(url)
        self.key = key
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except Exception as e:  # noqa: BLE001 - any driver's error: unknown scheme, DNS, credentials
            raise CheckpointError(f"cannot open checkpoint store {self.url!r}: {e}") from None
        self.root = self.root.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        """The store path of ``parts`` under its root."""
        return "/".join([self.root, *parts])

    # ---- objects ----------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write one whole object at ``rel`` (atomic rename on a local file system)."""
        dest = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, dest)
            except BaseException:
                _unlink_quietly(tmp)
                raise
        else:
            self.fs.pipe_file(dest, data)

    def put_file(self, local_path: str, rel: str, move: bool = True) -> None:
        """Publish the local file ``local_path`` at ``rel`` (a rename when the store is on the same
        local file system and ``move``; else an upload)."""
        dest = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                (shutil.move if move else shutil.copyfile)(local_path, tmp)
                os.replace(tmp, dest)
            except BaseException:
                _unlink_quietly(tmp)   # a full disk leaves no partial copy behind
                raise
        else:
            self.fs.put_file(local_path, dest)
            if move:
                os.unlink(local_path)

    def probe(self, need_bytes: int = 0) -> None:
        """Check, before training starts, that this store takes a write (an object written and
        removed) and, on a local file system, that it has ``need_bytes`` free. Raises
        ``CheckpointError`` saying what is wrong and what to change."""
        rel = f".probe-{uuid.uuid4().hex[:12]}"
        try:
            self.write_bytes(rel, b"varuna store probe\n")
            self.fs.rm_file(self.path(rel))
        except Exception as e:  # noqa: BLE001 - any driver's error: read-only, no permission, gone
            raise CheckpointError(f"checkpoint store {self.url!r} is not writable ({type(e).__name__}: "
                                  f"{str(e)[:200]}); give train.checkpoint_url a location every worker can write "
                                  "(checked before the first step, so no training is lost)") from None
        if self.local and need_bytes > 0:
            free = shutil.disk_usage(self.root).free
            if free < need_bytes:
                raise CheckpointError(f"checkpoint store {self.url!r} has {free / 2**20:.1f} MiB free but one "
                                      f"checkpoint of this rank needs about {need_bytes / 2**20:.1f} MiB; free "
                                      "space or give train.checkpoint_url another location")

    def read_bytes(self, rel: str) -> bytes:
        """The whole file at ``rel`` (relative to the root)."""
        return self.fs.cat_file(self.path(rel))

    def listdir(self, rel: str = "") -> dict[str, int]:
        """``{basename: size}`` of the plain files directly under ``rel`` ({} if it does not exist)."""
        try:
            entries = self.fs.ls(self.path(rel) if rel else self.root, detail=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}

    def checkpoint_names(self) -> list[str]:
        """Every checkpoint directory in the store (complete or not), oldest step first. Raises
        ``CheckpointError`` when the store's location is no folder (a file, or a path under a
        file) or cannot be listed (no permission)."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        except (NotADirectoryError, PermissionError, OSError) as e:
            raise CheckpointError(f"checkpoint store {self.url!r} cannot be listed ({type(e).__name__}: "
                                  f"{e.strerror or e}); give train.checkpoint_url a folder (or a URL) every worker "
                                  "can write") from None
        if self.local and os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointError(f"checkpoint store {self.url!r} is a file, not a folder; give "
                                  "train.checkpoint_url a folder (or a URL) every worker can write")
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return sorted((n for n in names if parse_name(n)), key=lambda n: (parse_name(n)[0], n))

    def remove_checkpoint(self, name: str, _on_manifest_removed=None) -> None:
        """Delete one checkpoint: its manifest first (so it is never seen as complete while half
        deleted), then the rest of its directory."""
        man = self.path(name, MANIFEST)
        try:
            self.fs.rm_file(man)
        except FileNotFoundError:
            pass
        if _on_manifest_removed is not None:
            _on_manifest_removed()
        try:
            self.fs.rm(self.path(name), recursive=True)
        except FileNotFoundError:
            pass

    # ---- manifests ----------------------------------------------------------------------------
    def read_manifest(self, name: str) -> dict:
        """The verified manifest of checkpoint ``name``.

        Raises ``CheckpointError`` naming the checkpoint and the reason: no manifest (incomplete),
        a manifest that does not parse or whose checksum does not match (torn write), another
        format, or a listed file that is missing or has another size than recorded.
        """
        where = f"checkpoint {name!r} in {self.url!r}"
        try:
            raw = self.read_bytes(f"{name}/{MANIFEST}")
        except FileNotFoundError:
            raise CheckpointError(f"{where} is incomplete: it has no {MANIFEST} (its write did not finish)") from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{where}: {MANIFEST} is {len(raw)} bytes (at most {MAX_MANIFEST_BYTES})")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise CheckpointError(f"{where}: {MANIFEST} is not valid JSON ({len(raw)} bytes; a torn write)") from None
        try:
            ok = isinstance(body, dict) and body.get("checksum") == manifest_checksum(body)
        except (TypeError, ValueError, RecursionError):
            ok = False
        if not ok:
            raise CheckpointError(f"{where}: {MANIFEST} checksum does not match its content (torn or edited)")
        if body.get("format") != FORMAT:
            raise CheckpointError(f"{where}: format {str(body.get('format'))[:40]!r}, this SDK reads {FORMAT!r}")
        if self.key is not None and not verify_manifest_mac(self.key, body):
            raise CheckpointError(f"{where}: {MANIFEST} is not signed with this job's secret (written by another job "
                                  "or by someone without the secret)")
        problem = check_manifest_schema(body)
        if problem is not None:
            raise CheckpointError(f"{where}: {MANIFEST} is malformed: {problem}")
        present = self.listdir(name)
        for fname, meta in sorted(body["files"].items()):
            if fname not in present:
                raise CheckpointError(f"{where}: file {fname!r} listed in the manifest is missing")
            if present[fname] != int(meta["size"]):
                raise CheckpointError(f"{where}: file {fname!r} has {present[fname]} bytes, the manifest "
                                      f"says {meta['size']} (truncated or replaced)")
        return body

    def read_verified(self, name: str, fname: str, manifest: dict) -> bytes:
        """The bytes of ``fname`` of checkpoint ``name``, checked against the manifest's size and
        SHA-256. Raises ``CheckpointError`` naming the file when it is missing or corrupt."""
        where = f"checkpoint {name!r} in {self.url!r}"
        meta = manifest["files"].get(fname)
        if meta is None:
            raise CheckpointError(f"{where} has no file {fname!r} in its manifest")
        try:
            data = self.read_bytes(f"{name}/{fname}")
        except FileNotFoundError:
            raise CheckpointError(f"{where}: file {fname!r} is missing") from None
        if len(data) != int(meta["size"]):
            raise CheckpointError(f"{where}: file {fname!r} is corrupt: it has {len(data)} bytes, the manifest says "
                                  f"{meta['size']} (truncated or replaced)")
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise CheckpointError(f"{where}: file {fname!r} is corrupt: its size matches the manifest's "
                                  f"({len(data)} bytes) but its SHA-256 differs (its bytes were changed)")
        return data


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def complete_checkpoints(url: str | os.PathLike, key: bytes | None = None,
                         skipped: list[tuple[str, str]] | None = None) -> list[CheckpointInfo]:
    """Every complete checkpoint in the store at ``url`` whose manifest verifies (signed with
    ``key`` when given), newest first (by step, then by creation time). Incomplete, torn, unsigned
    or malformed ones are skipped; ``skipped`` (a list) receives ``(name, reason)`` of each. ``[]``
    if none or the store does not exist yet. Raises ``CheckpointError`` if the URL cannot be
    opened."""
    store = Store(url, key)
    out = []
    for name in store.checkpoint_names():
        try:
            body = store.read_manifest(name)
        except CheckpointError as e:
            if skipped is not None:
                skipped.append((name, str(e)))
            continue
        out.append(CheckpointInfo(store.url, name, int(body["step"]), body))
    out.sort(key=lambda i: (i.step, float(i.manifest.get("created", 0.0)), i.name), reverse=True)
    return out


def latest_complete(url: str | os.PathLike, key: bytes | None = None) -> CheckpointInfo | None:
    """The newest checkpoint in the store at ``url`` whose manifest verifies (``None`` if there is
    none): the one a resumed job starts from. Cheap: reads manifests and one directory listing per
    checkpoint, not the tensor files (those are checked against their SHA-256 when loaded)."""
    found = complete_checkpoints(url, key)
    return found[0] if found else None


def prune(url: str | os.PathLike, keep: int, published: str | None = None, _crash=None,
          key: bytes | None = None) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints; delete older complete ones and incomplete
    ones older than ``published`` (the one just completed; torn leftovers of earlier attempts).
    Incomplete checkpoints newer than that are left alone (they may still be being written).
    Returns the deleted names. Raises ``ValueError`` for ``keep < 1``."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    store = Store(url, key)
    complete = complete_checkpoints(url, key)
    if not complete:
        return []
    kept = {i.name for i in complete[:keep]}
    newest = parse_name(published)[0] if published and parse_name(published) else complete[0].step
    complete_names = {i.name for i in complete}
    doomed = [n for n in store.checkpoint_names() if n not in kept
              and (n in complete_names or parse_name(n)[0] < newest)]
    for n in doomed:
        store.remove_checkpoint(n, _on_manifest_removed=_crash)
    return doomed


def wait_for_markers(store: Store, name: str, world: int, timeout_s: float, poll_s: float = 0.05) -> dict[int, Any]:
    """Poll ``<name>/_done/`` until all ``world`` ranks' markers are there and parse; returns
    ``{rank: marker}``. Raises ``CheckpointError`` listing the missing ranks after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    markers: dict[int, Any] = {}
    delay = poll_s
    while True:
        for fname in store.listdir(f"{name}/{DONE_DIR}"):
            m = re.fullmatch(r"rank-(\d+)\.json", fname)
            if not m or int(m.group(1)) in markers:
                continue
            try:
                markers[int(m.group(1))] = json.loads(store.read_bytes(f"{name}/{DONE_DIR}/{fname}"))
            except (ValueError, FileNotFoundError):
                pass  # being written; read it again on the next poll
        if len(markers) >= world:
            return markers
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(markers))
            raise CheckpointError(f"checkpoint {name!r} in {store.url!r}: ranks {missing} did not finish writing "
                                  f"within {timeout_s:.0f} s; it stays incomplete and will not be loaded (a rank died, or the "
                                  "store is not shared by every worker: give train.checkpoint_url a location all VMs reach)")
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)
