"""Remote commands over SSH (``cluster.ssh``): how a command line is wrapped and what a running
one is on the client side.

``_wrap`` makes the remote command line: a new session (``setsid``) whose id the command prints
first (``__VARUNA_SID__ <sid>``), then the environment read from stdin up to ``__VARUNA_ENV_END__``
(never on the command line), then the caller's command in its folder (exit 97 when the folder is
missing). ``RemoteProcess`` is a started command: a reader thread pumps its channel's output into
line callbacks and tails, learns its session id, and ``kill()`` stops the whole session through
``SSHConnection.kill_session``. ``CommandResult`` is a finished ``run``.

Owns ``CommandResult``, ``RemoteProcess`` and the wrapping helpers (``_command_line``,
``_check_env``, ``_wrap``). Imports paramiko, ``cluster.hosts`` and ``cluster.ssh_errors`` only
(the connection is passed in, never imported); must never import torch or the manager.
"""

from __future__ import annotations

import codecs
import logging
import re
import select
import shlex
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import paramiko

from .hosts import Host, Secret, notify
from .ssh_errors import SSHError

if TYPE_CHECKING:
    from .ssh import SSHConnection

log = logging.getLogger("varuna_sdk.cluster.ssh")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SID_MARK = "__VARUNA_SID__"
_ENV_END = "__VARUNA_ENV_END__"


@dataclass
class CommandResult:
    """A finished ``SSHConnection.run``: the host, the command as shown in logs, its ``exit_code``, everything it wrote
    to ``stdout`` and ``stderr`` (UTF-8, invalid bytes replaced) and ``duration_s``, the wall seconds it took."""

    host: Host
    command: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        """True when the command exited with status 0."""
        return self.exit_code == 0


def _command_line(command: str | Sequence[str]) -> str:
    if isinstance(command, str):
        return command
    return " ".join(shlex.quote(str(a)) for a in command)


def _check_env(env: Mapping[str, str | Secret] | None) -> list[tuple[str, str]]:
    items: list[tuple[str, str]] = []
    for k, v in (env or {}).items():
        if not _ENV_NAME.match(k):
            raise ValueError(f"environment variable name {k!r} is not a valid identifier")
        value = v.reveal() if isinstance(v, Secret) else str(v)
        if "\n" in value or "\0" in value:
            raise ValueError(f"environment variable {k}: value must not contain a newline or NUL")
        items.append((k, value))
    return items


def _wrap(command: str | Sequence[str], with_env: bool, cwd: str | None = None) -> str:
    """The remote command line: a new session whose id is printed first, the environment read
    from stdin (never on the command line), then the user's command (in ``cwd``)."""
    body = ("exec " + _command_line(command)) if not isinstance(command, str) else command
    if cwd is not None:
        body = f"cd {shlex.quote(cwd)} || exit 97; {body}"
    env_loop = (f'while IFS= read -r __v; do [ "$__v" = {_ENV_END} ] && break; export "$__v"; '
                "done; unset __v; ") if with_env else ""
    inner = f'printf "{_SID_MARK} %s\\n" "$$"; {env_loop}{body}'
    return f"exec setsid -w /bin/sh -c {shlex.quote(inner)}"


_EOF_GRACE_S = 2.0  # after the exit status: how long to wait for output still in flight


class RemoteProcess:
    """A command running on a host in its own session. Output is delivered line by line to the
    callbacks (from a reader thread) and, with ``collect=True``, kept for ``.stdout``/``.stderr``.

    ``wait(timeout)`` → exit code (None while running); ``kill()`` stops the whole session
    (TERM, then KILL after the grace period) and reports whether nothing is left.
    """

    def __init__(self, conn: "SSHConnection", channel: paramiko.Channel, display: str,
                 on_stdout: Callable[[str], None] | None, on_stderr: Callable[[str], None] | None,
                 collect: bool, on_exit: Callable[[], None] | None = None):
        self.conn, self.host, self.command = conn, conn.host, display
        self._chan = channel
        self._on = {1: on_stdout, 2: on_stderr}
        self._collect = collect
        self._out: dict[int, list[str]] = {1: [], 2: []}
        self._partial = {1: "", 2: ""}
        self._dec = {i: codecs.getincrementaldecoder("utf-8")("replace") for i in (1, 2)}
        self.sid: int | None = None
        self._head, self._head_done = "", False
        self._sid_event = threading.Event()
        self._done = threading.Event()
        self.exit_code: int | None = None
        self.connection_lost = False
        self.killed = False  # kill() was called (the exit code is then the signal's)
        self.started_at = time.monotonic()
        self.ended_at: float | None = None
        self._on_exit = on_exit
        self._thread = threading.Thread(target=self._pump, name=f"ssh-{self.host.name}-reader",
                                        daemon=True)
        self._thread.start()

    # reader thread ------------------------------------------------------------------------
    def _emit(self, stream: int, line: str) -> None:
        cb = self._on[stream]
        if cb is not None:
            try:
                cb(line)
            except Exception:  # a faulty callback must not stop the pump
                log.exception("output callback for %s failed", self.host.name)

    def _feed(self, stream: int, data: bytes, final: bool = False) -> None:
        text = self._dec[stream].decode(data, final)
        if stream == 1 and not self._head_done:  # first line: the wrapper's session id
            self._head += text
            if "\n" not in self._head and not final:
                return
            first, sep, rest = self._head.partition("\n")
            if first.startswith(_SID_MARK):
                try:
                    self.sid = int(first.split()[1])
                except (IndexError, ValueError):
                    pass
                text = rest
            else:  # no marker: the wrapper did not run (no setsid?)
                text = self._head
            self._head, self._head_done = "", True
            self._sid_event.set()
        if self._collect and text:
            self._out[stream].append(text)
        text = self._partial[stream] + text
        *lines, rest = text.split("\n")
        for line in lines:
            self._emit(stream, line.rstrip("\r"))
        self._partial[stream] = rest
        if final and rest:
            self._partial[stream] = ""
            self._emit(stream, rest)

    def _drain(self) -> None:
        while self._chan.recv_ready():
            self._feed(1, self._chan.recv(65536))
        while self._chan.recv_stderr_ready():
            self._feed(2, self._chan.recv_stderr(65536))

    def _pump(self) -> None:
        chan = self._chan
        try:
            fd = chan.fileno()
            eof_deadline = None
            while True:
                select.select([fd], [], [], 0.5 if eof_deadline is None else 0.05)
                self._drain()
                if chan.exit_status_ready():
                    # sshd may send the exit status before the last output: read on until the
                    # channel's EOF (bounded: a leftover background process may hold the pipes)
                    if eof_deadline is None:
                        eof_deadline = time.monotonic() + _EOF_GRACE_S
                    if chan.eof_received or chan.closed or time.monotonic() > eof_deadline:
                        self._drain()
                        break
            status = chan.exit_status  # -1: closed without a status (connection lost)
            if chan.status_event.is_set() and status != -1:
                self.exit_code = status
            else:
                self.connection_lost = True
        except Exception as e:  # noqa: BLE001 - transport died under us
            log.debug("reader for %s stopped: %s", self.host.name, type(e).__name__)
            self.connection_lost = True
        finally:
            for s in (1, 2):
                self._feed(s, b"", final=True)
            self._sid_event.set()
            try:
                chan.close()
            except Exception:  # noqa: BLE001
                pass
            self.ended_at = time.monotonic()
            self._done.set()
            notify([self._on_exit], logger=log, what=f"exit callback for {self.host.name}")

    # public --------------------------------------------------------------------------------
    @property
    def stdout(self) -> str:
        """Everything the command wrote to stdout so far (``collect=True``)."""
        return "".join(self._out[1])

    @property
    def stderr(self) -> str:
        """Everything the command wrote to stderr so far (``collect=True``; else empty)."""
        return "".join(self._out[2])

    def poll(self) -> int | None:
        """The exit code once the command has ended, else None (also None after a lost connection: see
        ``.connection_lost``); never waits."""
        return self.exit_code if self._done.is_set() else None

    def done(self) -> bool:
        """True once the command has ended or its connection was lost (the reader thread is done)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the command to end; its exit code, or None if still running after
        ``timeout`` (or the connection was lost: see ``.connection_lost``)."""
        self._done.wait(timeout)
        return self.exit_code if self._done.is_set() else None

    def wait_started(self, timeout: float = 10.0) -> int | None:
        """Wait until the remote session id is known (None if the wrapper never reported it)."""
        self._sid_event.wait(timeout)
        return self.sid

    def kill(self, grace_s: float | None = None, timeout_s: float = 15.0) -> bool:
        """Stop the command and every process in its session: SIGTERM, then SIGKILL after
        ``grace_s``. Returns True when nothing of the session is left on the host."""
        self.killed = True
        if self.wait_started(min(timeout_s, 5.0)) is None:
            # never started (or no setsid): closing the channel is all we can do
            self._close_channel()
            return self.done()
        try:
            left = self.conn.kill_session(self.sid, grace_s=grace_s, timeout_s=timeout_s)
        except SSHError as e:  # host gone or unreachable: nothing more we can do from here
            log.warning("could not stop session %s on %s: %s", self.sid, self.host.name, e)
            left = False
        self._done.wait(min(timeout_s, 5.0))
        self._close_channel()
        return left

    def _close_channel(self) -> None:
        try:
            self._chan.close()
        except Exception:  # noqa: BLE001
            pass

    def __repr__(self) -> str:
        state = "running" if not self.done() else f"exit={self.exit_code}"
        return f"<RemoteProcess {self.host.name} sid={self.sid} {state}: {self.command[:60]}>"
