"""Long-lived description of the machines a job runs on: ``Host`` (one VM reached over SSH) and
``Secret`` (a value that must never be printed).

A ``Host`` says *where* a VM is and *how* to reach it (address, port, user, key file, the
environment variable that holds the key's passphrase), and what it offers (GPUs, the absolute
path of the Python that runs workers, a work folder). It holds no connection and no secret
value: connections live in ``cluster.ssh``, and a passphrase is read from the environment only
at connect time, so a ``Host`` can be logged, compared, written to YAML and sent to the
dashboard freely.

Owns: ``Host``, ``Secret``, ``HostError``, ``notify``. Must never import paramiko, torch or anything above
``cluster`` (manager, notebook, cli).
"""

from __future__ import annotations

import getpass
import logging
import ipaddress
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class HostError(ValueError):
    """A host description is invalid; the message says which field and what to change."""


class Secret:
    """A string that prints as ``***`` (``repr``, ``str``, f-strings, logging, tracebacks).

    Read the value with ``.reveal()`` at the one place that needs it (the SSH key loader, the
    remote environment sender). ``Secret.from_env(NAME)`` reads an environment variable.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str):
        if not isinstance(value, str):
            raise TypeError("Secret holds a str")
        self._value = value

    @classmethod
    def from_env(cls, name: str) -> "Secret | None":
        """The environment variable ``name`` as a ``Secret``, or None when it is not set (an empty value gives a
        ``Secret`` of ``""``)."""
        value = os.environ.get(name)
        return None if value is None else cls(value)

    def reveal(self) -> str:
        """The plain string. Call it only where the value is used (the SSH key loader, the remote environment sender),
        never to log or print it."""
        return self._value

    @classmethod
    def load_or_create(cls, path: "str | os.PathLike") -> "Secret":
        """The secret kept in ``path`` (mode 0600), made (32 random bytes, URL-safe) when the file
        does not exist yet — a job's secret outlives its manager, so a restarted manager and
        every later generation sign and verify with the same one. Raises ``PermissionError`` when
        the file is readable by others (fix with ``chmod 600``)."""
        import secrets as _secrets
        import stat

        p = os.fspath(path)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            mode = os.stat(p).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise PermissionError(f"{p} holds the job secret but is readable by others "
                                      f"(mode {stat.S_IMODE(mode):o}); chmod 600 it") from None
            with open(p, encoding="ascii") as f:
                value = f.read().strip()
            if len(value) < 16:
                raise PermissionError(f"{p} does not hold a job secret (too short); delete it to make a new one")
            return cls(value)
        value = _secrets.token_urlsafe(32)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(value + "\n")
        return cls(value)

    def __repr__(self) -> str:
        return "Secret('***')"

    def __str__(self) -> str:
        return "***"

    def __format__(self, spec: str) -> str:
        return "***"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    def __reduce__(self):  # never pickle the value by accident
        raise TypeError("a Secret cannot be pickled; pass the name of its environment variable")


@dataclass(frozen=True)
class Host:
    """One VM reached over SSH.

    name:    short unique name used in logs and the dashboard (``vm0``, ``spot-eastus-3``).
    address: IP address or DNS name the SSH client connects to; also what other workers use to
             reach this VM (e.g. ``MASTER_ADDR`` when it runs rank 0).
    port:    SSH port.
    user:    login user (default: the local user).
    key_path: private key file for key authentication (None: the SSH layer's default key).
    key_passphrase_env: name of the environment variable holding the key's passphrase (the
             value is read at connect time and never stored here).
    gpus:    GPUs the VM offers (0: CPU-only, gloo).
    python:  absolute path of the Python interpreter that runs workers on the VM (the venv's
             ``bin/python``); remote commands use it directly, never a login shell's PATH.
    workdir: folder on the VM where code is synced and runs (None: the user's home).
    labels:  free-form string tags (zone, instance type, provider id).
    """

    name: str
    address: str
    port: int = 22
    user: str = field(default_factory=getpass.getuser)
    key_path: Path | None = None
    key_passphrase_env: str | None = None
    gpus: int = 0
    python: str | None = None
    workdir: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise HostError(f"host name {self.name!r}: use letters, digits, '.', '_' or '-' "
                            "(no spaces), starting with a letter or digit")
        if not isinstance(self.address, str) or not self.address or any(c.isspace() for c in self.address):
            raise HostError(f"host {self.name}: address {self.address!r} must be an IP address or "
                            "a DNS name without spaces")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 1 <= self.port <= 65535:
            raise HostError(f"host {self.name}: port {self.port!r} must be an integer in 1..65535")
        if not isinstance(self.user, str) or not self.user or any(c.isspace() for c in self.user):
            raise HostError(f"host {self.name}: user {self.user!r} must be a non-empty login name")
        if self.key_path is not None:
            object.__setattr__(self, "key_path", Path(self.key_path).expanduser())
        if self.key_passphrase_env is not None and not _ENV_NAME.match(self.key_passphrase_env):
            raise HostError(f"host {self.name}: key_passphrase_env {self.key_passphrase_env!r} must "
                            "be the NAME of an environment variable (not the passphrase itself)")
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 0:
            raise HostError(f"host {self.name}: gpus {self.gpus!r} must be an integer >= 0")
        if self.python is not None and not self.python.startswith("/"):
            raise HostError(f"host {self.name}: python {self.python!r} must be an absolute path on "
                            "the VM (e.g. /opt/venv/bin/python), so that workers never depend on "
                            "a login shell's PATH")
        if self.workdir is not None and not str(self.workdir).startswith("/"):
            raise HostError(f"host {self.name}: workdir {self.workdir!r} must be an absolute path")
        labels = dict(self.labels)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise HostError(f"host {self.name}: labels must map strings to strings")
        object.__setattr__(self, "labels", labels)

    def __hash__(self) -> int:  # labels is a dict: hash on identity fields only
        return hash((self.name, self.address, self.port, self.user))

    @property
    def endpoint(self) -> str:
        """``user@address:port`` (what logs and error messages name)."""
        return f"{self.user}@{self.address}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH and paramiko use for this host in a known_hosts file."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """True when ``address`` is a loopback IP address (``127.0.0.0/8``, ``::1``) or the name ``localhost``; any
        other DNS name is False (it is not resolved)."""
        try:
            return ipaddress.ip_address(self.address).is_loopback
        except ValueError:
            return self.address == "localhost"

    def passphrase(self) -> Secret | None:
        """The key's passphrase from ``key_passphrase_env`` (None when unset or not configured)."""
        return Secret.from_env(self.key_passphrase_env) if self.key_passphrase_env else None

    def to_dict(self) -> dict[str, Any]:
        """The host as plain JSON-able data: every field, ``key_path`` as a string (or None) and ``labels`` as a plain
        dict; ``from_dict`` reads it back."""
        d = asdict(self)
        d["key_path"] = None if self.key_path is None else str(self.key_path)
        d["labels"] = dict(self.labels)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Host":
        """A ``Host`` from a mapping of its fields (what ``to_dict`` writes). Raises ``HostError`` naming unknown
        fields or an invalid value, ``TypeError`` when ``name`` or ``address`` is missing."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise HostError(f"host {d.get('name', '?')}: unknown field(s) {unknown}; "
                            f"known fields are {sorted(known)}")
        return cls(**dict(d))

    def __str__(self) -> str:
        return f"{self.name} ({self.endpoint})"


def notify(callbacks: Iterable[Callable[..., None] | None], *args: Any, logger: logging.Logger, what: str) -> None:
    """Call each callback (None entries skipped) with ``args``, in order, outside any lock the caller
    held; an exception in one is logged on ``logger`` as ``"<what> failed"`` and the rest still run:
    a faulty subscriber never stops the thread that emits (a provider's watcher, the heartbeat
    server, a process reaper)."""
    for cb in callbacks:
        if cb is None:
            continue
        try:
            cb(*args)
        except Exception:  # noqa: BLE001 - a faulty callback must not stop the emitter
            logger.exception("%s failed", what)
