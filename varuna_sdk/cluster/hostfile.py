"""Host files: hosts listed in a file, like the original Varuna's machine list, watched for
edits — the provider of ``varuna launch --hosts FILE`` and ``Job(provider=HostFileProvider(...))``.

``HOST_FILE_FORMAT`` is the format (one host a line: ``ADDRESS[:PORT]`` or ``NAME ADDRESS[:PORT]
key=value...``); ``parse_host_file(text)`` turns it into ``Host`` values, every error a
``HostFileError`` naming the line and the fix; ``HostFileProvider(path)`` is a ``PoolProvider``
(``cluster.provider``) whose thread re-reads the file when it changes and announces the
difference (``added`` / ``removed``). ``read_small_text`` is the bounded, UTF-8-checked file read
that the trace loader (``cluster.spot``) shares.

Owns ``HOST_FILE_FORMAT``, ``HostFileError``, ``parse_host_file``, ``HostFileProvider``,
``read_small_text``. Imports ``cluster.hosts``, ``cluster.provider`` and ``cluster.ssh`` only;
must never import torch or the manager.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from .hosts import Host, HostError
from .provider import PoolProvider
from .ssh import SSHOptions

log = logging.getLogger(__name__)

MAX_HOST_FILE_BYTES = 1 << 20   # a host file (some thousand hosts) is far smaller
MAX_GPUS_PER_HOST = 1024


def read_small_text(path: Path, limit: int, what: str, error: type[Exception]) -> str:
    """The UTF-8 text of ``path`` if it is at most ``limit`` bytes; else ``error`` saying which
    file and what is wrong (too big, not UTF-8) — never a decode traceback or an unbounded read."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} {path} is larger than {limit} bytes; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte {e.start}); save it as plain text") from None


class HostFileError(ValueError):
    """A host file is malformed; the message names the file, the line and the fix."""


HOST_FILE_FORMAT = """\
One host per line; blank lines and text after '#' are ignored. Either just an address
    10.0.0.5            (name derived from it: 10-0-0-5)
    10.0.0.6:2222       (SSH port 2222)
or a name, an address and options (key=value, no spaces):
    vm0 10.0.0.4 gpus=1 user=ubuntu python=/opt/venv/bin/python workdir=/home/ubuntu/run
        key=~/.ssh/id_ed25519 key_passphrase_env=VM_KEY_PASS label.zone=eastus env.NCCL_SOCKET_IFNAME=eth0
IPv6 addresses go in brackets: [fd00::5]:22. Options: user, gpus, python, workdir, key,
key_passphrase_env, label.NAME=VALUE, env.NAME=VALUE (an environment variable for the workers).
"""

_OPTS = {"user": "user", "gpus": "gpus", "python": "python", "workdir": "workdir",
         "key": "key_path", "key_passphrase_env": "key_passphrase_env"}


def _split_address(token: str) -> tuple[str, int | None]:
    if token.startswith("["):
        addr, _, rest = token[1:].partition("]")
        if not rest:
            return addr, None
        if not rest.startswith(":"):
            raise ValueError(f"{token!r}: write [IPv6]:PORT")
        return addr, int(rest[1:])
    if token.count(":") == 1:
        addr, port = token.split(":")
        return addr, int(port)
    return token, None


def parse_host_file(text: str, *, source: str = "<host file>",
                    defaults: Mapping[str, Any] | None = None) -> list[Host]:
    """Hosts of a host file (format: ``HOST_FILE_FORMAT``). ``defaults``: ``Host`` fields applied
    to every host unless its line says otherwise (e.g. ``{"python": "/opt/venv/bin/python",
    "key_path": "~/.ssh/id_ed25519"}``). Raises ``HostFileError`` naming the line."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{no}"
        tokens = line.split()
        pos = [t for t in tokens if "=" not in t]
        opts = [t for t in tokens if "=" in t]
        bad = next((t for t in opts if not t.partition("=")[0]), None)
        if bad is not None:   # '=' or '=x': no key
            raise HostFileError(f"{where}: {bad!r} is not a key=value option (no key): {raw.strip()!r}\n"
                                f"{HOST_FILE_FORMAT}")
        if tokens[: len(pos)] != pos:
            raise HostFileError(f"{where}: options (key=value) must come after the name and "
                                f"address: {raw.strip()!r}\n{HOST_FILE_FORMAT}")
        if len(pos) not in (1, 2):
            more = f" before its {len(opts)} key=value option(s)" if opts else ""
            raise HostFileError(f"{where}: expected 'ADDRESS[:PORT]' or 'NAME ADDRESS[:PORT]', got "
                                f"{len(pos)} words{more} ({' '.join(pos)!r}): {raw.strip()!r}\n{HOST_FILE_FORMAT}")
        try:
            addr, port = _split_address(pos[-1])
        except ValueError as e:
            raise HostFileError(f"{where}: bad address {pos[-1]!r} ({e}); write ADDRESS or "
                                "ADDRESS:PORT") from None
        name = pos[0] if len(pos) == 2 else re.sub(r"[^A-Za-z0-9]+", "-", addr).strip("-") + (
            f"-{port}" if port not in (None, 22) else "")
        kw: dict[str, Any] = dict(defaults or {})
        labels: dict[str, str] = dict(kw.pop("labels", {}) or {})
        kw.update(name=name, address=addr)
        if port is not None:
            kw["port"] = port
        for opt in opts:
            k, _, v = opt.partition("=")
            if k.startswith(("label.", "env.")):
                labels[k[6:] if k.startswith("label.") else k] = v
            elif k in _OPTS:
                if k == "gpus":
                    if not (v.isascii() and v.isdigit() and len(v) <= 5 and int(v) <= MAX_GPUS_PER_HOST):
                        raise HostFileError(f"{where}: gpus={v[:20]!r} must be a whole number in "
                                            f"0..{MAX_GPUS_PER_HOST}")
                    kw["gpus"] = int(v)
                else:
                    kw[_OPTS[k]] = v
            else:
                raise HostFileError(f"{where}: unknown option {k!r}; known: {sorted(_OPTS)}, "
                                    "label.NAME, env.NAME")
        kw["labels"] = labels
        try:
            host = Host(**kw)
        except (HostError, TypeError) as e:
            raise HostFileError(f"{where}: {e}") from None
        if host.name in seen:
            raise HostFileError(f"{where}: host name {host.name!r} already used on line "
                                f"{seen[host.name]}; names must be unique")
        seen[host.name] = no
        hosts.append(host)
    return hosts


class HostFileProvider(PoolProvider):
    """Hosts listed in a file (format: ``HOST_FILE_FORMAT``), like the original's machine list,
    watched for changes: every ``poll_s`` seconds its modification time and size are checked; on
    a change the file is re-read (twice, ``settle_s`` apart, until it stops changing — an editor
    mid-write) and the differences announced: a new line → ``added``, a deleted line →
    ``removed`` (reason ``"removed from host file"``), a changed line → ``removed`` then
    ``added``. A file that stops parsing (or disappears) keeps the previous hosts and logs a
    warning naming the line; the next valid version is applied.

    ``defaults``: ``Host`` fields for every line (see ``parse_host_file``); ``ssh_options``: how
    to reach the hosts. Raises ``FileNotFoundError`` / ``HostFileError`` at construction.
    """

    def __init__(self, path: str | os.PathLike, *, poll_s: float = 1.0, settle_s: float = 0.05,
                 defaults: Mapping[str, Any] | None = None, ssh_options: SSHOptions | None = None,
                 event_log: Any = None, job_id: str | None = None):
        super().__init__(event_log=event_log, job_id=job_id, ssh_options=ssh_options)
        if poll_s <= 0:
            raise ValueError(f"poll_s={poll_s} must be > 0 seconds")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"host file {self.path} does not exist; create it with one "
                                    f"host per line:\n{HOST_FILE_FORMAT}")
        self.poll_s, self.settle_s = poll_s, settle_s
        self.defaults = dict(defaults or {})
        self._sig = self._signature()
        self._text = self._read()
        for h in parse_host_file(self._text, source=str(self.path), defaults=self.defaults):
            self._pool[h.name] = h
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _signature(self) -> tuple | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def start(self) -> "HostFileProvider":
        """Announce every host of the file as ``added`` (once) and start the daemon thread that checks the file every
        ``poll_s`` seconds and announces its changes (see the class docstring). Idempotent; returns self."""
        if self._started:
            return self
        self.started = True
        self._announce_all()
        self._thread = threading.Thread(target=self._watch, name=f"hostfile-{self.path.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def _read(self) -> str:
        return read_small_text(self.path, MAX_HOST_FILE_BYTES, "host file", HostFileError)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("host file watcher")

    def check(self) -> bool:
        """Look at the file now (the watcher does this every ``poll_s``); apply a change.
        True when the host set changed."""
        sig = self._signature()
        if sig == self._sig:
            return False
        if sig is None:
            self._sig = None
            self._warn(f"host file {self.path} disappeared; keeping the previous "
                       f"{len(self.all_hosts())} host(s)")
            return False
        try:
            text = self._read()
            while True:  # wait until the content stops changing
                time.sleep(self.settle_s)
                again = self._read() if self.path.exists() else text
                if again == text:
                    break
                text = again
        except (HostFileError, OSError) as e:
            self._sig = self._signature()
            self._warn(f"{e} — keeping the previous hosts until the file is fixed")
            return False
        self._sig = self._signature()
        if text == self._text:
            return False
        try:
            new = parse_host_file(text, source=str(self.path), defaults=self.defaults)
        except HostFileError as e:
            self._warn(f"{e} — keeping the previous hosts until the file is fixed")
            return False
        self._text, self.last_error = text, None
        old = {h.name: h for h in self.all_hosts()}
        fresh = {h.name: h for h in new}
        changed = False
        for name, h in old.items():
            if name not in fresh or fresh[name].to_dict() != h.to_dict():
                self._remove_host(name, reason="removed from host file" if name not in fresh
                                  else "changed in host file")
                changed = True
        for name, h in fresh.items():
            if name not in old or old[name].to_dict() != h.to_dict():
                self._add_host(h, reason="listed in host file")
                changed = True
        return changed

    def _warn(self, msg: str) -> None:
        if msg != self.last_error:
            log.warning("%s", msg)
        self.last_error = msg

    def close(self) -> None:
        """Stop watching the file (waits up to 5 s for the watcher thread). Idempotent; the hosts themselves are left
        as they are."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)


__all__ = ["HOST_FILE_FORMAT", "HostFileError", "HostFileProvider", "MAX_GPUS_PER_HOST",
           "MAX_HOST_FILE_BYTES", "parse_host_file", "read_small_text"]
