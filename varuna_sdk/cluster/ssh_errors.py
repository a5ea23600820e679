"""The errors of SSH to the job's VMs (``cluster.ssh``): one family under ``SSHError``, each
message naming the host and, where there is one, the fix; and ``_mask``, which keeps secrets
(key passphrases, environment values) out of every message.

Owns ``SSHError``, ``HostKeyError``, ``AuthenticationError``, ``HostUnreachableError``,
``ConnectionLostError``, ``CommandTimeout``, ``CommandError``, ``SFTPError``. Imports
``cluster.hosts`` only; must never import paramiko, torch or the manager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from .hosts import Host

if TYPE_CHECKING:
    from .ssh_process import CommandResult


class SSHError(RuntimeError):
    """Base of every error this module raises; ``.host`` is the ``Host`` concerned."""

    def __init__(self, host: Host, message: str):
        super().__init__(f"{host.name} ({host.endpoint}): {message}")
        self.host = host


class HostKeyError(SSHError):
    """The server's host key is unknown (and trust-on-first-use is off) or does not match."""


class AuthenticationError(SSHError):
    """The server refused our key, or the private key could not be loaded/decrypted."""


class HostUnreachableError(SSHError):
    """No SSH session could be established within the connect timeout (after retries)."""


class ConnectionLostError(SSHError):
    """The SSH connection dropped while a command or transfer was using it."""


class CommandTimeout(SSHError):
    """A command ran past its timeout; it was killed (``.killed``), partial output attached."""

    def __init__(self, host: Host, message: str, stdout: str = "", stderr: str = "",
                 killed: bool = False):
        super().__init__(host, message)
        self.stdout, self.stderr, self.killed = stdout, stderr, killed


class CommandError(SSHError):
    """``run(check=True)`` and the command exited non-zero; ``.result`` has its output."""

    def __init__(self, host: Host, message: str, result: "CommandResult"):
        super().__init__(host, message)
        self.result = result


class SFTPError(SSHError):
    """A file transfer failed (missing file, permission, ...); the message names both paths."""


def _mask(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every non-empty string of ``secrets`` replaced by ``***``."""
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text
