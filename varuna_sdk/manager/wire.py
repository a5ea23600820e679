"""The heartbeat wire format: what a worker's ``HeartbeatClient`` (``manager.heartbeat_client``)
and the manager's ``HeartbeatServer`` (``manager.heartbeat_server``) both speak.

JSON lines over TCP, never pickle: nothing received over the channel is ever unpickled. On
accept the server sends a greeting ``{"v":1,"nonce":HEX}`` (``greeting``). Each line either way
is ``{"mac": HEX, "msg": TEXT}`` (``encode``) where ``TEXT`` is a JSON object and
``mac = HMAC-SHA256(key, TEXT)``.

- Client lines (``type`` in ``CLIENT_TYPES``: ``hello``/``hb``/``metrics``/``bye``) carry ``v``,
  ``job``, ``host``, ``rank``, ``seq``, ``nonce`` (the server's nonce of this connection),
  ``cnonce`` (the client's random nonce of this connection), ``time`` and the type's fields, and
  use ``key = derive_key(secret, "client") = HMAC-SHA256(job secret, "varuna-heartbeat-v1")``.
- Server lines (``type`` in ``SERVER_TYPES``: ``ack``/``stop``) carry ``v``, ``job``, ``seq``,
  ``nonce``, ``cnonce``, ``time`` and use the other direction's key
  ``derive_key(secret, "server") = HMAC-SHA256(job secret, "varuna-heartbeat-v1/server")``, so a
  client line can never pass for a server line.

A receiver checks the MAC in constant time *before* parsing ``TEXT`` (``open_line``), then the
protocol version, the job id, the connection's nonce (no replay from another connection) and a
strictly increasing ``seq`` (no replay within one) (``check_envelope``). Every failure raises
``WireError`` (a ``ValueError``) whose ``reason`` names what was wrong, never the message or the
secret.

Environment contract for workers (``HeartbeatServer.worker_env()`` makes the first two; the
launcher adds ``VARUNA_JOB_TOKEN``, ``VARUNA_JOB_ID``, ``VARUNA_HOST``, ``RANK``):
``VARUNA_HEARTBEAT_ADDR=host:port`` (``ENV_ADDR``), ``VARUNA_HEARTBEAT_INTERVAL=seconds``
(``ENV_INTERVAL``), optionally ``VARUNA_ORPHAN_AFTER=seconds`` (``ENV_ORPHAN``: a worker cut off
from its manager that long stops on its own).

Owns the constants, ``WireError``, ``derive_key``, ``encode``, ``seal``, ``open_line``,
``check_envelope``, ``greeting``/``read_greeting`` and ``json_safe``. Imports the standard library
and ``cluster.hosts`` (``Secret``) only; must never import the server, the client,
``manager.events`` or torch (workers load it before torch).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any, Mapping

from ..cluster.hosts import Secret

PROTOCOL_VERSION = 1
MAX_LINE = 64 * 1024          # bytes of one line at most, either way
ENV_ADDR = "VARUNA_HEARTBEAT_ADDR"
ENV_INTERVAL = "VARUNA_HEARTBEAT_INTERVAL"
ENV_TOKEN = "VARUNA_JOB_TOKEN"
ENV_ORPHAN = "VARUNA_ORPHAN_AFTER"
_KDF_LABEL = b"varuna-heartbeat-v1"
_KDF_LABEL_SERVER = b"varuna-heartbeat-v1/server"
CLIENT_TYPES = ("hello", "hb", "metrics", "bye")
SERVER_TYPES = ("ack", "stop")
METRICS_BUDGET = 32 * 1024    # bytes of metrics rows per line (well under MAX_LINE)
STOPPED = "stopped"           # bye status of a worker that stopped on request (not a failure)
#: why a worker failed (its goodbye's ``cause``): its data ("data": deterministic, never retried), a
#: programming error ("code": never retried), a loss that stayed non-finite ("diverged": resuming
#: replays the same steps, never retried), a peer that died first ("peer": a consequence, not the
#: cause), anything else ("error")
FAILURE_CAUSES = ("data", "code", "diverged", "peer", "error")
MAX_HOST_NAME = 253           # a DNS name's limit; longer host fields are malformed
MAX_RANK = 1 << 20
_HEX = frozenset("0123456789abcdef")


class WireError(ValueError):
    """A line that breaks the wire format (malformed, bad MAC, replayed, another job...).
    ``reason``: what was wrong, safe to log (never the message text or the secret)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def derive_key(secret: Secret | str, direction: str = "client") -> bytes:
    """The MAC key (32 bytes) of a job secret for one direction (``"client"``: worker → manager
    lines, ``"server"``: manager → worker lines); domain-separated, so the raw token is never the
    key. Raises ``ValueError`` for an empty secret or an unknown direction."""
    raw = secret.reveal() if isinstance(secret, Secret) else secret
    if not raw:
        raise ValueError("the job secret is empty")
    if direction not in ("client", "server"):
        raise ValueError(f"direction={direction!r}: use 'client' or 'server'")
    label = _KDF_LABEL if direction == "client" else _KDF_LABEL_SERVER
    return hmac.new(raw.encode(), label, hashlib.sha256).digest()


def encode(key: bytes, msg: Mapping[str, Any]) -> bytes:
    """One wire line: ``{"mac": HMAC(key, TEXT), "msg": TEXT}\\n`` with ``TEXT = json(msg)``.
    Raises ``TypeError``/``ValueError`` for a value that is not strict JSON."""
    text = json.dumps(msg, separators=(",", ":"), allow_nan=False, default=_not_json)
    mac = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
    return (json.dumps({"mac": mac, "msg": text}, separators=(",", ":")) + "\n").encode()


def _not_json(v):
    raise TypeError(f"not JSON: {type(v).__name__}")


def json_safe(v: Any) -> Any:
    """``v`` with every non-finite float replaced by None, recursively (strict JSON); tuples
    become lists."""
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def seal(key: bytes, body: Mapping[str, Any], **envelope: Any) -> bytes:
    """A signed line of ``body`` (made ``json_safe``) behind ``{"v", **envelope, "time"}``;
    ``envelope`` in wire order: ``job``, (client lines) ``host``, ``rank``, then ``seq``,
    ``nonce``, ``cnonce``."""
    return encode(key, {"v": PROTOCOL_VERSION, **envelope, "time": time.time(),
                        **json_safe(dict(body))})


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` that turns every failure on hostile input (bad UTF-8, deep nesting, huge
    numbers) into ``WireError``."""
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError, MemoryError):
        raise WireError("malformed: not a JSON line") from None


def open_line(key: bytes, line: bytes) -> dict:
    """The message object of one received line, after checking its MAC under ``key`` (in constant
    time, before the text is parsed). Raises ``WireError`` (malformed, bad MAC, not an object)."""
    outer = parse_json(line)
    if not (isinstance(outer, dict) and isinstance(outer.get("mac"), str)
            and isinstance(outer.get("msg"), str)):
        raise WireError("malformed: expected {\"mac\", \"msg\"}")
    mac = outer["mac"]
    if len(mac) != 64 or not _HEX.issuperset(mac):
        raise WireError("malformed: mac is not 64 hex digits")
    try:
        text = outer["msg"].encode()
    except UnicodeEncodeError:
        raise WireError("malformed: msg is not valid UTF-8 text") from None
    want = hmac.new(key, text, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, mac):
        raise WireError("bad MAC (wrong job secret or altered message)")
    try:
        msg = parse_json(outer["msg"])
    except WireError:
        raise WireError("malformed: authenticated text is not JSON") from None
    if not isinstance(msg, dict):
        raise WireError("malformed: message is not an object")
    return msg


def check_envelope(msg: Mapping[str, Any], *, job_id: str, nonce: str | None, last_seq: int) -> int:
    """Check an opened message's protocol version, job id, connection nonce and sequence number
    (strictly above ``last_seq``); returns its ``seq``. Raises ``WireError`` (another protocol or
    job, a replay from another connection, a replayed or reordered line)."""
    if msg.get("v") != PROTOCOL_VERSION:
        raise WireError(f"protocol version {repr(msg.get('v'))[:40]} (want {PROTOCOL_VERSION})")
    if msg.get("job") != job_id:
        raise WireError("message of another job")
    if msg.get("nonce") != nonce:
        raise WireError("replayed message (nonce of another connection)")
    seq = msg.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= last_seq:
        raise WireError("replayed or reordered message (seq did not increase)")
    return seq


def check_sender(msg: Mapping[str, Any]) -> tuple[str, int]:
    """The (host, rank) a client line speaks for; raises ``WireError`` when either is missing or
    out of range (host: 1..``MAX_HOST_NAME`` characters; rank: 0..``MAX_RANK``-1)."""
    host, rank = msg.get("host"), msg.get("rank")
    if not (isinstance(host, str) and 0 < len(host) <= MAX_HOST_NAME and isinstance(rank, int)
            and not isinstance(rank, bool) and 0 <= rank < MAX_RANK):
        raise WireError("malformed: host and rank required")
    return host, rank


def greeting(nonce: str) -> bytes:
    """The server's first line on a new connection: ``{"v": 1, "nonce": nonce}``, unsigned."""
    return (json.dumps({"v": PROTOCOL_VERSION, "nonce": nonce}) + "\n").encode()


def read_greeting(line: bytes) -> str:
    """The connection nonce of a server greeting line; raises ``WireError`` when ``line`` is not
    a varuna heartbeat server's greeting."""
    hello = parse_json(line)
    if not isinstance(hello, dict) or not isinstance(hello.get("nonce"), str):
        raise WireError("not a varuna heartbeat server")
    return hello["nonce"]
