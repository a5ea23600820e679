"""Objects shipped by value with a job: callables defined in a notebook cell or ``__main__`` (a
model factory, a loss, an init function, a dataset factory) packed with cloudpickle into one
objects file that travels only inside the job spec — to local worker processes through the run
folder, to the user's own VMs over the SSH/SFTP bootstrap — never over the heartbeat, metrics or
dashboard channels, which stay pickle-free.

File format: a magic line, one JSON line (the Python, torch and cloudpickle versions it was
packed under, each object's qualified name, size and SHA-256), then the payloads. A reader checks
the header *before* anything is unpickled: Python must match in major.minor (the pickled code's
bytecode), torch ignoring its build tag, cloudpickle exactly — a mismatch is a ``ShippingError``
naming the VM (``$VARUNA_HOST``) and the versions; a payload whose size or hash differs is refused
too.

Owns ``pack_objects``, ``write_objects``, ``read_objects``, ``find_objects``, ``Shipped``,
``ByValue``, ``ShippingError``, ``runtime_versions``, ``version_problems``,
``objects_file_name``. Imports neither torch (versions come from package metadata) nor anything
of the SDK, so the manager can ship files without loading torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

OBJECTS_MAGIC = b"VARUNA-OBJECTS 1\n"
OBJECTS_DIR_ENV = "VARUNA_OBJECTS_DIR"
MAX_OBJECTS_HEADER = 64 * 1024


class ShippingError(RuntimeError):
    """Objects shipped by value cannot be loaded here (versions differ, file missing or damaged)."""


class ByValue:
    """A callable shipped by value: the ``role`` payload of a ``Shipped`` (so only objects that
    came from ``pack_objects`` in this process or from a version- and SHA-256-checked objects
    file, ``read_objects``, can ever be unpickled), loaded with cloudpickle on first call. It
    pickles as its ``Shipped`` and role, so processes spawned on this machine get it with their job
    spec. Raises ``TypeError`` for anything but a ``Shipped``, ``KeyError`` for a role it lacks."""

    def __init__(self, shipped: "Shipped", role: str):
        if not isinstance(shipped, Shipped) or not any(shipped is v for v in _PACKED.values()):
            raise TypeError("ByValue loads only checked shipped objects (a Shipped from pack_objects or "
                            f"find_objects in this process), not {type(shipped).__name__}")
        self.shipped, self.role = shipped, role
        self.payload = shipped.payloads[role]
        self._obj = None

    def __call__(self, *args, **kwargs):
        """Call the shipped object with these arguments, unpickling it (cloudpickle) on the first call. Raises
        ``ShippingError`` naming this VM when the object needs a module that is not installed here."""
        if self._obj is None:
            import cloudpickle

            try:
                with _outside_torch_modes():   # (a first call inside the meta recorder: see below)
                    self._obj = cloudpickle.loads(self.payload)
            except ModuleNotFoundError as e:
                where = os.environ.get("VARUNA_HOST") or platform.node()
                raise ShippingError(
                    f"VM {where} cannot load an object shipped by value: it refers to module {e.name!r}, which is "
                    "not installed there. Put that module in the job's code folder (synced to the VMs), or ship "
                    f"it by value too: Job(..., ship_modules=[{e.name}])") from None
        return self._obj(*args, **kwargs)

    def __reduce__(self):
        return (_spawned_by_value, (self.shipped, self.role))


@contextlib.contextmanager
def _outside_torch_modes():
    """Unpickle as outside any torch mode: a shipped class's module-level tensors (``W =
    torch.tensor(...)`` in the notebook) are rebuilt on the CPU, as they were — the first call of a
    shipped model factory comes inside the meta recorder (``model.deferred``), which would make
    their storage meta ("set the storage of a tensor on device meta to a storage on different
    device cpu")."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _spawned_by_value(shipped: "Shipped", role: str) -> ByValue:
    """A ``ByValue`` arriving in the job spec of a worker this process spawned on this machine: its
    ``Shipped`` counts as checked only after the same checks as an objects file — the versions it
    was packed under against this process's, and its digest recomputed from its payloads. Nothing
    is unpickled before that (cloudpickle runs at the first call). Raises ``ShippingError``."""
    if not isinstance(shipped, Shipped):
        raise ShippingError(f"a job spec carried {type(shipped).__name__} where shipped objects belong")
    where = os.environ.get("VARUNA_HOST") or platform.node()
    problems = version_problems(shipped.versions, runtime_versions())
    if problems:
        raise ShippingError(f"VM {where} cannot load the objects shipped by value with the job: {'; '.join(problems)}")
    if not shipped.digest or objects_digest(shipped.versions, shipped.names, shipped.payloads) != shipped.digest:
        raise ShippingError(f"the objects shipped by value in this job spec on {where} do not match their digest "
                            "(damaged or made by hand): refused")
    _PACKED.setdefault(shipped.digest, shipped)
    return ByValue(_PACKED[shipped.digest], role)


def runtime_versions() -> dict[str, str]:
    """This process's Python, torch and cloudpickle versions (what shipped objects depend on)."""
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"python": platform.python_version(), "torch": version("torch"), "cloudpickle": version("cloudpickle")}


def version_problems(shipped: Mapping[str, str], here: Mapping[str, str]) -> list[str]:
    """Why objects pickled under ``shipped`` versions cannot load under ``here``: Python must match
    in major.minor (bytecode), torch ignoring its build tag (``+cpu``/``+cu124``), cloudpickle exactly."""
    out = []
    if shipped.get("python", "").split(".")[:2] != here.get("python", "").split(".")[:2]:
        out.append(f"Python {here.get('python')} here, {shipped.get('python')} on the launcher")
    if shipped.get("torch", "").split("+")[0] != here.get("torch", "").split("+")[0]:
        out.append(f"torch {here.get('torch')} here, {shipped.get('torch')} on the launcher")
    if shipped.get("cloudpickle") != here.get("cloudpickle"):
        out.append(f"cloudpickle {here.get('cloudpickle')} here, {shipped.get('cloudpickle')} on the launcher")
    return out


#: the name a dataset object given as ``Job(data=ds)`` travels under (``data=`` and its type), so
#: messages say "the tuple given as data=" rather than calling it a factory
GIVEN_DATA = "data="


@dataclass(frozen=True)
class Shipped:
    """Objects shipped by value: cloudpickle ``payloads`` by role (``factory``, ``loss``, ``init``,
    ``dataset``) and the ``names`` (qualified names) they had on the launcher, for messages."""

    payloads: dict[str, bytes]
    names: dict[str, str]
    versions: dict[str, str] = field(default_factory=dict)   # what it was packed under
    digest: str = ""   # ``objects_digest`` of the above: what the job spec names


def _header(versions: Mapping[str, str], names: Mapping[str, str], payloads: Mapping[str, bytes]) -> dict:
    return {"versions": dict(versions), "names": dict(names),
            "objects": {k: {"bytes": len(p), "sha256": hashlib.sha256(p).hexdigest()} for k, p in payloads.items()}}


#: what cloudpickle writes for a class defined in a notebook or script: a random ``uuid4().hex``
#: tracker id per class *object*, so the same cell run twice pickles to different bytes
_TRACKER_ID = re.compile(rb"[0-9a-f]{32}")
#: what a tensor's storage pickles with (torch's legacy ``torch.save`` inside ``_load_from_bytes``):
#: its key, the storage's address in decimal, as a protocol-2 string (``X``, 4-byte length, digits,
#: then a memo ``q``): another address in every process, so the same data pickles to other bytes
_STORAGE_KEY = re.compile(rb"X([\x01-\x20])\x00\x00\x00(\d{1,32})(?=q)")


def code_sha256(payload: bytes) -> str:
    """SHA-256 of a cloudpickle payload with its class tracker ids and its tensors' storage keys
    numbered in order of appearance: equal for the same code and captured values however many
    times the defining cell ran (a class re-defined by re-running its cell, or after a kernel
    restart, is the same model; a dataset of tensors passed by value is the same data)."""
    ids: dict[bytes, int] = {}
    keys: dict[bytes, int] = {}

    def storage_key(m: re.Match) -> bytes:
        if m.group(1)[0] != len(m.group(2)):  # not a length-prefixed string of exactly these digits
            return m.group(0)
        return b"X<key %d>" % keys.setdefault(m.group(2), len(keys))

    out = _TRACKER_ID.sub(lambda m: b"<%d>" % ids.setdefault(m.group(0), len(ids)), payload)
    return hashlib.sha256(_STORAGE_KEY.sub(storage_key, out)).hexdigest()


def objects_digest(versions: Mapping[str, str], names: Mapping[str, str], payloads: Mapping[str, bytes]) -> str:
    """The digest of shipped objects: SHA-256 over the versions, names and each payload's
    ``code_sha256``, 24 hex digits — the same for the same code re-defined (the objects file's
    header keeps each payload's plain SHA-256, to check it is intact)."""
    doc = {"versions": dict(versions), "names": dict(names), "objects": {k: code_sha256(p) for k, p in payloads.items()}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


_PACKED: dict[str, Shipped] = {}  # digest -> objects packed or read in this process


def pack_objects(objects: Mapping[str, Any], by_value_modules: Sequence[Any] = ()) -> tuple[str, bytes]:
    """Pack callables (``{"factory": f, "loss": g, ...}``; ``None`` values are dropped) with
    cloudpickle, each separately; modules in ``by_value_modules`` (the user's own, not installed
    on the VMs) are pickled by value too. Returns ``(digest, file bytes)``: a magic line, a JSON
    header (versions, names, sizes, SHA-256 of each payload), the payloads. Raises
    ``TypeError`` naming an object that cannot be pickled."""
    import cloudpickle

    mods = list(by_value_modules)
    for m in mods:
        cloudpickle.register_pickle_by_value(m)
    try:
        payloads = {}
        for k, v in objects.items():
            if v is None:
                continue
            try:
                payloads[k] = cloudpickle.dumps(v)
            except Exception as e:  # noqa: BLE001 - report which object, and why
                raise TypeError(f"the job's {k} ({getattr(v, '__qualname__', type(v).__name__)}) cannot be shipped "
                                f"by value: {type(e).__name__}: {e}") from None
    finally:
        for m in mods:
            cloudpickle.unregister_pickle_by_value(m)
    names = {k: str(getattr(objects[k], "__qualname__", type(objects[k]).__name__)) for k in payloads}
    versions = runtime_versions()
    header = _header(versions, names, payloads)
    digest = objects_digest(versions, names, payloads)
    header["digest"] = digest
    blob = OBJECTS_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + b"".join(payloads.values())
    _PACKED[digest] = Shipped(payloads, names, versions, digest)
    return digest, blob


def objects_file_name(digest: str) -> str:
    """File name of the objects with ``digest`` (next to the job's config, in the run folder)."""
    return f"objects-{digest}.bin"


def write_objects(folder: str | Path, objects: Mapping[str, Any], by_value_modules: Sequence[Any] = ()) -> str:
    """``pack_objects`` and write the file into ``folder`` (atomically); returns the digest."""
    digest, blob = pack_objects(objects, by_value_modules)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / objects_file_name(digest)
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    return digest


def read_objects(path: str | Path, where: str | None = None) -> Shipped:
    """The payloads of an objects file, after checking its header: the versions it was packed
    under against this process's (``version_problems``), each payload's size and SHA-256.
    Nothing is unpickled here. ``where`` names this VM in errors (default ``$VARUNA_HOST`` or
    the host name). Raises ``ShippingError`` saying what differs."""
    where = where or os.environ.get("VARUNA_HOST") or platform.node()
    data = Path(path).read_bytes()
    if not data.startswith(OBJECTS_MAGIC):
        raise ShippingError(f"{path} on {where} is not a varuna objects file")
    end = data.find(b"\n", len(OBJECTS_MAGIC), len(OBJECTS_MAGIC) + MAX_OBJECTS_HEADER)
    if end < 0:
        raise ShippingError(f"{path} on {where}: its header is missing or too long")
    try:
        header = json.loads(data[len(OBJECTS_MAGIC):end])
        entries = dict(header["objects"])
        shipped = dict(header["versions"])
        names = {str(k): str(v) for k, v in dict(header.get("names") or {}).items()}
    except (ValueError, KeyError, TypeError) as e:
        raise ShippingError(f"{path} on {where}: unreadable header ({e})") from None
    problems = version_problems(shipped, runtime_versions())
    if problems:
        raise ShippingError(f"VM {where} cannot load the objects shipped by value with the job (model or data "
                            f"defined in the notebook): {'; '.join(problems)}. Install the launcher's versions on "
                            "the VM, or give the model by import path from the code folder")
    out, off = {}, end + 1
    for k, e in entries.items():
        n = int(e["bytes"])
        p = data[off:off + n]
        off += n
        if len(p) != n or hashlib.sha256(p).hexdigest() != e["sha256"]:
            raise ShippingError(f"{path} on {where}: the {k} payload is damaged (size or SHA-256 differs)")
        out[k] = p
    return Shipped(out, names, {str(k): str(v) for k, v in shipped.items()}, objects_digest(shipped, names, out))


def find_objects(digest: str, search: Sequence[str | Path | None] = ()) -> Shipped:
    """The objects with ``digest``: packed in this process, or read (checked) from
    ``objects-<digest>.bin`` in ``$VARUNA_OBJECTS_DIR`` or one of ``search``. Raises
    ``ShippingError`` when no such file is found."""
    if digest in _PACKED:
        return _PACKED[digest]
    dirs = [os.environ.get(OBJECTS_DIR_ENV)] + list(search)
    for d in dirs:
        if d and (Path(d) / objects_file_name(digest)).is_file():
            shipped = read_objects(Path(d) / objects_file_name(digest))
            _PACKED[digest] = shipped
            return shipped
    raise ShippingError(f"the objects shipped by value with this job ({objects_file_name(digest)}) are not in "
                        f"{[str(d) for d in dirs if d]}; launch the job through Job.launch(), varuna launch or "
                        "launch_job, which ship them")


