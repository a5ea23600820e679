"""Bootstrap: make each VM ready to run the job's workers, before any worker starts.

Three steps, each run on every host in parallel and each failing with a ``BootstrapError`` that
names every VM concerned and what to change:

1. ``check_versions`` — run the host's Python (``Host.python``, by absolute path, never a login
   shell's PATH) with a tiny probe that reports its Python, torch and varuna-sdk versions (from
   package metadata: fast, nothing imported) and compare them with this machine's. Policy
   (``VersionPolicy``): Python major.minor must match (a patch difference is only noted), torch
   must match ignoring the local build tag (``2.13.0+cu124`` on a GPU VM matches a laptop's
   ``2.13.0+cpu``), varuna-sdk must match exactly. A missing interpreter (exit 127), one that
   cannot run (126) or prints no probe answer is a clear error too.
2. ``sync_code`` — mirror a local folder (the user's code, a job's config) into a folder on each
   VM by content: a SHA-256 manifest of the local files is compared with the hashes of the same
   paths on the VM (computed there by the host's Python), and only new or changed files travel,
   over SFTP, each written to a temporary name then renamed (a worker never imports a half
   written file). Files a previous sync placed that no longer exist locally are deleted; nothing
   else on the VM is ever touched. The report says how many files and bytes moved.
3. ``run_setup`` — an optional user command (``pip install -r requirements.txt``...) run in the
   synced folder with a timeout; past it the command's whole process group is killed.

``bootstrap(...)`` runs the three in order for a set of hosts. Owns ``BootstrapError``,
``HostVersions``, ``VersionPolicy``, ``SyncReport``, ``BootstrapReport``, ``local_versions``,
``manifest``. Imports ``cluster.hosts``, ``cluster.ssh`` and ``cluster.ssh_errors`` only; must never import torch (the
local torch version comes from package metadata) or the manager.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import platform
import posixpath
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

import paramiko

from .hosts import Host, Secret
from .ssh import SSHPool
from .ssh_errors import CommandTimeout, SSHError

log = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_MARK = "__VARUNA_PROBE__"
STATE_FILE = ".varuna-sync.json"
DEFAULT_EXCLUDE = ("__pycache__", "*.pyc", "*.pyo", ".git", ".hg", ".svn", ".venv", "venv",
                   ".ipynb_checkpoints", ".mypy_cache", ".pytest_cache", ".DS_Store", STATE_FILE,
                   "*.part-*")


class BootstrapError(RuntimeError):
    """One or more VMs are not ready. ``.failures`` maps host name → what is wrong there; the
    message lists them all, one line per VM."""

    def __init__(self, what: str, failures: Mapping[str, str]):
        self.failures = dict(failures)
        lines = "\n".join(f"  - {msg}" for msg in self.failures.values())
        super().__init__(f"{what} failed on {len(self.failures)} VM(s):\n{lines}")


# ------------------------------------------------------------------------------------- versions
_PROBE = f"""
import json, platform, sys
out = {{"python": platform.python_version(), "executable": sys.executable}}
try:
    from importlib import metadata
    for name in ("torch", "varuna-sdk"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
except Exception as e:
    out["error"] = type(e).__name__ + ": " + str(e)
print({PROBE_MARK!r} + json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class HostVersions:
    """What a Python interpreter reports: its version, torch's and varuna-sdk's (None: missing)."""

    python: str
    torch: str | None
    varuna_sdk: str | None
    executable: str | None = None


def local_versions() -> HostVersions:
    """This machine's versions (package metadata; torch is not imported)."""
    def ver(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    sdk = ver("varuna-sdk")
    if sdk is None:
        from .. import __version__ as sdk  # running from a source tree
    import sys
    return HostVersions(platform.python_version(), ver("torch"), sdk, sys.executable)


@dataclass(frozen=True)
class VersionPolicy:
    """How closely a VM must match. ``python``: "minor" (3.11.x == 3.11.y) or "exact".
    ``torch_ignore_local``: compare torch without its ``+cpu``/``+cu124`` build tag."""

    python: str = "minor"
    torch_ignore_local: bool = True

    def problems(self, local: HostVersions, remote: HostVersions) -> tuple[list[str], list[str]]:
        """(mismatches, notes) of ``remote`` against ``local``."""
        bad, notes = [], []
        lp, rp = local.python.split("."), remote.python.split(".")
        if (self.python == "exact" and lp != rp) or lp[:2] != rp[:2]:
            bad.append(f"Python {remote.python} (here {local.python})")
        elif lp != rp:
            notes.append(f"Python {remote.python} vs {local.python} here (patch level only)")
        if remote.torch is None:
            bad.append(f"torch is not installed (here {local.torch})")
        else:
            strip = (lambda v: v.split("+")[0]) if self.torch_ignore_local else (lambda v: v)
            if local.torch is not None and strip(remote.torch) != strip(local.torch):
                bad.append(f"torch {remote.torch} (here {local.torch})")
        if remote.varuna_sdk is None:
            bad.append(f"varuna-sdk is not installed (here {local.varuna_sdk})")
        elif remote.varuna_sdk != local.varuna_sdk:
            bad.append(f"varuna-sdk {remote.varuna_sdk} (here {local.varuna_sdk})")
        return bad, notes


def _python_of(host: Host) -> str:
    if not host.python:
        raise _HostProblem("Host.python is not set: give the absolute path of the venv's Python "
                           "on the VM (e.g. /opt/venv/bin/python)")
    return host.python


class _HostProblem(Exception):
    """A per-host failure whose message is already user-facing (the host is added by the caller)."""


def probe_versions(pool: SSHPool, host: Host, timeout_s: float = 60.0) -> HostVersions:
    """Run the probe with the host's Python; ``BootstrapError`` when it cannot."""
    try:
        return _probe(pool, host, timeout_s)
    except _HostProblem as e:
        raise BootstrapError("version check", {host.name: f"{host}: {e}"}) from None


def _probe(pool: SSHPool, host: Host, timeout_s: float) -> HostVersions:
    python = _python_of(host)
    try:
        r = pool.get(host).run([python, "-c", _PROBE], timeout_s=timeout_s)
    except CommandTimeout:
        raise _HostProblem(f"{python} did not answer the version probe within {timeout_s:g}s "
                          "(a login shell that is slow to start counts too: try `ssh HOST true` "
                          "and look at the VM's ~/.bashrc)") from None
    tail = (r.stderr.strip().splitlines() or [""])[-1]
    if r.exit_code == 127:
        raise _HostProblem(f"Python interpreter {python} not found on the VM (exit 127"
                           f"{': ' + tail if tail else ''}); install the environment there or set "
                           "Host.python to the right absolute path")
    if r.exit_code == 126:
        raise _HostProblem(f"Python interpreter {python} exists but cannot be executed (exit 126"
                           f"{': ' + tail if tail else ''})")
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(PROBE_MARK)), None)
    if r.exit_code != 0 or line is None:
        raise _HostProblem(f"{python} failed the version probe (exit {r.exit_code}"
                           f"{': ' + tail if tail else ''}); is it Python 3?")
    try:
        d = json.loads(line[len(PROBE_MARK):])
        return HostVersions(str(d["python"]), d.get("torch"), d.get("varuna-sdk"), d.get("executable"))
    except (ValueError, KeyError, TypeError):
        raise _HostProblem(f"{python} gave an unreadable version probe answer: {line[:200]!r}") from None


def _each(hosts: Sequence[Host], fn: Callable[[Host], T], what: str) -> dict[str, T]:
    """Run ``fn(host)`` for every host in parallel; one ``BootstrapError`` naming every failure."""
    results: dict[str, T] = {}
    failures: dict[str, str] = {}
    if not hosts:
        return results
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"host names must be unique: {names}")
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as ex:
        futures = {h.name: (h, ex.submit(fn, h)) for h in hosts}
        for name, (h, f) in futures.items():
            try:
                results[name] = f.result()
            except _HostProblem as e:
                failures[name] = f"{h}: {e}"
            except SSHError as e:  # already names the host
                failures[name] = str(e)
            except BootstrapError as e:
                failures.update(e.failures)
            except (OSError, paramiko.SSHException, EOFError) as e:
                failures[name] = f"{h}: {type(e).__name__}: {e}"
    if failures:
        raise BootstrapError(what, failures)
    return results


def check_versions(pool: SSHPool, hosts: Sequence[Host], *, policy: VersionPolicy | None = None,
                   expected: HostVersions | None = None,
                   timeout_s: float = 60.0) -> dict[str, HostVersions]:
    """Probe every host; raise ``BootstrapError`` naming each VM whose interpreter is missing or
    whose Python/torch/varuna-sdk differ from ``expected`` (default: this machine's)."""
    policy = policy or VersionPolicy()
    want = expected or local_versions()

    def one(h: Host) -> HostVersions:
        got = _probe(pool, h, timeout_s)
        bad, notes = policy.problems(want, got)
        if bad:
            raise _HostProblem("version mismatch: " + "; ".join(bad) + f" — with {h.python}. "
                               "Install the same versions on the VM (or point Host.python at a "
                               "venv that has them)")
        for n in notes:
            log.info("%s: %s", h.name, n)
        return got

    return _each(hosts, one, "version check")


# ------------------------------------------------------------------------------------ code sync
@dataclass(frozen=True)
class FileEntry:
    """One file of a code-sync manifest (``manifest``): its SHA-256 (hex), its size in bytes and its permission bits
    (``stat.S_IMODE``, e.g. ``0o644``), which ``sync_code`` compares with the VM's copy."""

    sha256: str
    size: int
    mode: int


def _excluded(rel: str, exclude: Sequence[str]) -> bool:
    parts = rel.split("/")
    return any(fnmatch.fnmatch(p, pat) for p in parts for pat in exclude) or \
        any(fnmatch.fnmatch(rel, pat) for pat in exclude)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(folder: str | os.PathLike, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> dict[str, FileEntry]:
    """The SHA-256 manifest of the regular files under ``folder`` (relative POSIX path → entry).
    Symbolic links to files are followed; links to folders are not descended; ``exclude`` are
    glob patterns matched against every path component and the whole relative path."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"code folder {root} does not exist or is not a folder")
    out: dict[str, FileEntry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        dirnames[:] = sorted(d for d in dirnames
                             if not _excluded(posixpath.join(rel_dir, d) if rel_dir else d, exclude))
        for fn in sorted(filenames):
            rel = posixpath.join(rel_dir, fn) if rel_dir else fn
            if _excluded(rel, exclude):
                continue
            p = Path(dirpath) / fn
            try:
                st = p.stat()
            except FileNotFoundError:  # dangling link
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            out[rel] = FileEntry(_sha256(p), st.st_size, stat.S_IMODE(st.st_mode))
    return out


_SCAN = r"""
import hashlib, json, os, stat, sys
req = json.loads(sys.stdin.read())
root = os.path.abspath(os.path.expanduser(req["root"]))
synced = []
try:
    with open(os.path.join(root, req["state"])) as f:
        synced = [p for p in json.load(f).get("files", []) if isinstance(p, str)]
except (OSError, ValueError, AttributeError):
    pass
files = {}
for rel in sorted(set(req["paths"]) | set(synced)):
    p = os.path.normpath(os.path.join(root, rel))
    if not p.startswith(root + os.sep):
        continue
    try:
        st = os.lstat(p)
    except OSError:
        continue
    if not stat.S_ISREG(st.st_mode):
        files[rel] = None
        continue
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    files[rel] = [h.hexdigest(), st.st_size, stat.S_IMODE(st.st_mode)]
print(MARK + json.dumps({"root": root, "files": files, "synced": synced}), flush=True)
""".replace("MARK", repr(PROBE_MARK))


@dataclass
class SyncReport:
    """What ``sync_code`` did on one host."""

    host: str
    remote_dir: str
    files_total: int
    files_sent: int
    bytes_sent: int
    files_deleted: int = 0
    modes_fixed: int = 0
    seconds: float = 0.0
    sent: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.host}: {self.files_sent}/{self.files_total} files, {self.bytes_sent} bytes "
                f"sent to {self.remote_dir}" + (f", {self.files_deleted} deleted" if self.files_deleted else "")
                + f" in {self.seconds:.2f}s")


def default_remote_dir(host: Host, name: str = "code") -> str:
    """``<Host.workdir>/code`` (``~/code`` when the host has no workdir)."""
    return posixpath.join(host.workdir or "~", name)


def _sync_one(pool: SSHPool, host: Host, local: Path, files: dict[str, FileEntry],
              remote_dir: str, delete: bool, timeout_s: float) -> SyncReport:
    t0 = time.monotonic()
    python = _python_of(host)
    conn = pool.get(host)
    req = json.dumps({"root": remote_dir, "paths": sorted(files), "state": STATE_FILE})
    try:
        r = conn.run([python, "-c", _SCAN], stdin=req, timeout_s=timeout_s)
    except CommandTimeout:
        raise _HostProblem(f"scanning {remote_dir} did not finish within {timeout_s:g}s") from None
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(PROBE_MARK)), None)
    if r.exit_code != 0 or line is None:
        tail = (r.stderr.strip().splitlines() or [""])[-1]
        raise _HostProblem(f"could not scan {remote_dir} with {python} (exit {r.exit_code}"
                           f"{': ' + tail if tail else ''})")
    scan = json.loads(line[len(PROBE_MARK):])
    root: str = scan["root"]
    remote: dict[str, list | None] = scan["files"]
    send = [rel for rel, e in files.items()
            if remote.get(rel) is None or remote[rel][0] != e.sha256]
    chmod = [rel for rel, e in files.items()
             if rel not in send and remote.get(rel) is not None and remote[rel][2] != e.mode]
    stale = sorted(set(scan["synced"]) - set(files)) if delete else []
    sftp = conn.sftp()
    made: set[str] = set()

    def mkdirs(d: str) -> None:
        if d in made or d in ("", "/"):
            return
        mkdirs(posixpath.dirname(d))
        try:
            sftp.stat(d)
        except FileNotFoundError:
            try:
                sftp.mkdir(d)
            except OSError:  # created concurrently
                sftp.stat(d)
        made.add(d)

    try:
        mkdirs(root)
        sent_bytes = 0
        for rel in send:
            target = posixpath.join(root, rel)
            mkdirs(posixpath.dirname(target))
            conn.put(local / rel, target, mode=files[rel].mode)
            sent_bytes += files[rel].size
        for rel in chmod:
            sftp.chmod(posixpath.join(root, rel), files[rel].mode)
        deleted = 0
        for rel in stale:
            if remote.get(rel) is None:
                continue  # already gone (or no longer a plain file: not ours to remove)
            try:
                sftp.remove(posixpath.join(root, rel))
                deleted += 1
            except FileNotFoundError:
                pass
        # record what this sync placed (so that the next one may delete what disappears locally)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"files": sorted(files)}, f)
            tmp = f.name
        try:
            conn.put(tmp, posixpath.join(root, STATE_FILE), mode=0o644)
        finally:
            os.unlink(tmp)
    except (OSError, paramiko.SSHException, EOFError) as e:
        raise _HostProblem(f"sync to {root} failed: {type(e).__name__}: {e}") from None
    rep = SyncReport(host.name, root, len(files), len(send), sent_bytes, deleted, len(chmod),
                     time.monotonic() - t0, sorted(send))
    log.info("sync %s", rep)
    return rep


def sync_code(pool: SSHPool, hosts: Sequence[Host], local_dir: str | os.PathLike, *,
              remote_dir: str | Callable[[Host], str] | None = None,
              exclude: Sequence[str] = DEFAULT_EXCLUDE, delete: bool = True,
              timeout_s: float = 120.0) -> dict[str, SyncReport]:
    """Mirror ``local_dir`` into ``remote_dir`` (default ``<workdir>/code``) on every host,
    sending only files whose SHA-256 differs. Returns host name → ``SyncReport``."""
    local = Path(local_dir)
    files = manifest(local, exclude)

    def where(h: Host) -> str:
        return remote_dir(h) if callable(remote_dir) else (remote_dir or default_remote_dir(h))

    return _each(hosts, lambda h: _sync_one(pool, h, local, files, where(h), delete, timeout_s),
                 "code sync")


# --------------------------------------------------------------------------------------- set-up
def run_setup(pool: SSHPool, hosts: Sequence[Host], command: str | Sequence[str], *,
              timeout_s: float = 600.0, cwd: str | Callable[[Host], str] | None = None,
              env: Mapping[str, str | Secret] | None = None) -> dict[str, float]:
    """Run the user's set-up ``command`` on every host (in ``cwd``, default ``<workdir>/code``),
    at most ``timeout_s`` each (then killed). Returns host name → seconds it took."""

    def one(h: Host) -> float:
        where = cwd(h) if callable(cwd) else (cwd or default_remote_dir(h))
        t0 = time.monotonic()
        try:
            r = pool.get(h).run(command, timeout_s=timeout_s, cwd=where, env=env)
        except CommandTimeout as e:
            raise _HostProblem(f"set-up command timed out after {timeout_s:g}s and was "
                               f"{'killed' if e.killed else 'signalled'}") from None
        if r.exit_code == 97:
            raise _HostProblem(f"set-up folder {where} does not exist (sync the code first)")
        if not r.ok:
            tail = "\n      ".join(r.stderr.strip().splitlines()[-5:])
            raise _HostProblem(f"set-up command exited with {r.exit_code}"
                               + (f":\n      {tail}" if tail else ""))
        return time.monotonic() - t0

    return _each(hosts, one, "set-up")


# ------------------------------------------------------------------------------------ all three
@dataclass
class BootstrapReport:
    """What ``bootstrap`` did, keyed by VM name: the versions found (``versions``), the code sync (``sync``; empty
    without ``code_dir``), the set-up command's run time in seconds (``setup_s``; empty without ``setup``), and
    ``seconds``, the whole bootstrap's wall time. ``str()`` gives one line per VM."""

    versions: dict[str, HostVersions]
    sync: dict[str, SyncReport]
    setup_s: dict[str, float]
    seconds: float

    def __str__(self) -> str:
        lines = [f"bootstrap of {len(self.versions)} VM(s) in {self.seconds:.2f}s"]
        for name, v in self.versions.items():
            s = self.sync.get(name)
            lines.append(f"  {name}: Python {v.python}, torch {v.torch}, varuna-sdk {v.varuna_sdk}"
                         + (f"; {s.files_sent}/{s.files_total} files, {s.bytes_sent} B" if s else "")
                         + (f"; set-up {self.setup_s[name]:.1f}s" if name in self.setup_s else ""))
        return "\n".join(lines)


def bootstrap(pool: SSHPool, hosts: Sequence[Host], *, code_dir: str | os.PathLike | None = None,
              remote_dir: str | Callable[[Host], str] | None = None,
              setup: str | Sequence[str] | None = None, setup_timeout_s: float = 600.0,
              policy: VersionPolicy | None = None, expected: HostVersions | None = None,
              exclude: Sequence[str] = DEFAULT_EXCLUDE) -> BootstrapReport:
    """Check versions, sync ``code_dir`` (if given), run ``setup`` (if given) on every host.
    Stops at the first step that fails anywhere, with a ``BootstrapError`` naming every VM."""
    t0 = time.monotonic()
    versions = check_versions(pool, hosts, policy=policy, expected=expected)
    sync = (sync_code(pool, hosts, code_dir, remote_dir=remote_dir, exclude=exclude)
            if code_dir is not None else {})
    setup_s = (run_setup(pool, hosts, setup, timeout_s=setup_timeout_s, cwd=remote_dir)
               if setup is not None else {})
    return BootstrapReport(versions, sync, setup_s, time.monotonic() - t0)
