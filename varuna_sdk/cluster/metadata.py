"""A stand-in for a cloud VM's instance metadata service, one per test host: a real HTTP server on
loopback that answers the pre-emption endpoints of AWS (IMDSv2, with its token flow), GCP and
Azure the way those services do, and that a test (or the spot emulator, or a benchmark) drives to
announce a notice. It is what ``cluster.notice.NoticeWatcher`` is tested against; it is not AWS,
GCP or Azure themselves.

``MetadataServer(vm_name="vm0", clouds=("aws",)).start()`` → ``.url`` (``http://127.0.0.1:PORT``,
for the host's ``env.VARUNA_METADATA_URL`` label); ``announce(lead_s=120, kind="preempt")`` makes
the endpoints report a notice whose deadline is ``lead_s`` from now (``kind="rebalance"``: AWS's
rebalance recommendation); ``clear()`` takes it back; ``misbehave("slow" | "error" | "garbage" |
None)`` makes every answer late (``slow_s``), a 500, or bytes that parse as nothing; ``requests``
counts what was asked, per path; ``close()`` stops it.

Endpoints (``clouds`` chooses which answer; the others 404, as on that cloud):

- AWS: ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` (1–21600) → a
  token; every ``GET /latest/...`` needs ``X-aws-ec2-metadata-token`` with a live token (else
  401): ``meta-data/instance-id``, ``meta-data/spot/instance-action`` (404, or
  ``{"action": "terminate", "time": ISO-8601}``), ``meta-data/events/recommendations/rebalance``
  (404, or ``{"noticeTime": ISO-8601}``).
- GCP: ``GET /computeMetadata/v1/instance/{id,name,preempted}`` needs ``Metadata-Flavor: Google``
  (else 403); answers carry that header; ``preempted`` is ``TRUE`` or ``FALSE``.
- Azure: ``GET /metadata/instance/compute/name`` and ``/metadata/scheduledevents`` need
  ``Metadata: true`` (else 400); the events document lists a ``Preempt`` event for this VM with
  ``NotBefore`` in RFC 1123 form while a notice stands.

Owns ``MetadataServer``. Standard library only.
"""

from __future__ import annotations

import collections
import email.utils
import json
import secrets
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable

_CLOUDS = ("aws", "gcp", "azure")


class MetadataServer:
    """See the module docstring. ``ValueError`` for an unknown cloud or misbehaviour."""

    def __init__(self, vm_name: str = "vm0", clouds: Iterable[str] = _CLOUDS, *,
                 address: str = "127.0.0.1", slow_s: float = 3.0):
        self.clouds = tuple(clouds)
        bad = [c for c in self.clouds if c not in _CLOUDS]
        if bad or not self.clouds:
            raise ValueError(f"MetadataServer: clouds {self.clouds!r}: choose among {_CLOUDS}")
        self.vm_name, self.address, self.slow_s = vm_name, address, slow_s
        self._lock = threading.Lock()
        self._notice: tuple[str, float, float] | None = None   # (kind, deadline, noticed at)
        self._tokens: dict[str, float] = {}
        self._mode: str | None = None
        self._incarnation = 1
        self.requests: collections.Counter[str] = collections.Counter()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------- driving
    @property
    def url(self) -> str:
        """``http://ADDRESS:PORT`` of the running server (for a host's ``env.VARUNA_METADATA_URL`` label). Raises
        ``RuntimeError`` before ``start()`` and after ``close()``."""
        if self._server is None:
            raise RuntimeError("MetadataServer is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def announce(self, lead_s: float = 120.0, kind: str = "preempt") -> float:
        """Report a notice from now on: the VM is taken ``lead_s`` seconds from now. Returns the
        deadline (Unix seconds)."""
        if kind not in ("preempt", "rebalance"):
            raise ValueError(f"announce: kind {kind!r}: use 'preempt' or 'rebalance'")
        now = time.time()
        with self._lock:
            self._notice = (kind, now + lead_s, now)
            self._incarnation += 1
        return now + lead_s

    def clear(self) -> None:
        """Withdraw the standing notice: the endpoints report no pre-emption again (AWS 404, GCP ``FALSE``, no Azure
        ``Preempt`` event)."""
        with self._lock:
            self._notice = None
            self._incarnation += 1

    def misbehave(self, mode: str | None) -> None:
        """Make every later answer misbehave: ``"slow"`` (sent ``slow_s`` seconds late), ``"error"`` (HTTP 500) or
        ``"garbage"`` (a body that parses as nothing); None: answer normally again. Raises ``ValueError`` for any other
        mode."""
        if mode not in (None, "slow", "error", "garbage"):
            raise ValueError(f"misbehave: {mode!r}: use 'slow', 'error', 'garbage' or None")
        self._mode = mode

    def start(self) -> "MetadataServer":
        """Serve on ``address`` at a free port the OS picks, from a daemon thread; returns self (read the address from
        ``url``)."""
        server = ThreadingHTTPServer((self.address, 0), _handler(self))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"metadata-{self.vm_name}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and free the port (idempotent); ``url`` raises afterwards."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "MetadataServer":
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------- answers
    def answer(self, method: str, path: str, headers) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) for one request (the HTTP handler's whole logic)."""
        self.requests[path.split("?")[0]] += 1
        mode = self._mode
        if mode == "slow":
            time.sleep(self.slow_s)
        elif mode == "error":
            return 500, {}, b"internal error"
        elif mode == "garbage":
            return 200, {"Metadata-Flavor": "Google"}, b"\x00\xff{not json"
        with self._lock:
            notice = self._notice
        route = path.split("?")[0]
        if route.startswith("/latest/") and "aws" in self.clouds:
            return self._aws(method, route, headers, notice)
        if route.startswith("/computeMetadata/") and "gcp" in self.clouds:
            return self._gcp(method, route, headers, notice)
        if route.startswith("/metadata/") and "azure" in self.clouds:
            return self._azure(method, route, headers, notice)
        return 404, {}, b"not found"

    def _aws(self, method, route, headers, notice):
        now = time.time()
        if route == "/latest/api/token":
            if method != "PUT":
                return 405, {}, b""
            try:
                ttl = int(headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                return 400, {}, b"missing or bad TTL"
            if not 1 <= ttl <= 21600:
                return 400, {}, b"bad TTL"
            tok = secrets.token_urlsafe(32)
            with self._lock:
                self._tokens[tok] = now + ttl
            return 200, {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)}, tok.encode()
        with self._lock:
            live = self._tokens.get(headers.get("X-aws-ec2-metadata-token", ""), 0) > now
        if not live:
            return 401, {}, b""
        if route == "/latest/meta-data/instance-id":
            return 200, {}, f"i-{self.vm_name}".encode()
        if route == "/latest/meta-data/spot/instance-action" and notice and notice[0] == "preempt":
            return 200, {}, json.dumps({"action": "terminate", "time": _iso(notice[1])}).encode()
        if route == "/latest/meta-data/events/recommendations/rebalance" and notice:
            return 200, {}, json.dumps({"noticeTime": _iso(notice[2])}).encode()
        return 404, {}, b""

    def _gcp(self, method, route, headers, notice):
        if headers.get("Metadata-Flavor") != "Google":
            return 403, {}, b"Missing Metadata-Flavor:Google header."
        flavor = {"Metadata-Flavor": "Google"}
        base = "/computeMetadata/v1/instance/"
        if route == base + "id":
            return 200, flavor, str(abs(hash(self.vm_name)) % 10**18).encode()
        if route == base + "name":
            return 200, flavor, self.vm_name.encode()
        if route == base + "preempted":
            return 200, flavor, b"TRUE" if notice and notice[0] == "preempt" else b"FALSE"
        return 404, flavor, b""

    def _azure(self, method, route, headers, notice):
        if headers.get("Metadata") != "true":
            return 400, {}, json.dumps({"error": "Bad request. Required metadata header not specified"}).encode()
        if route == "/metadata/instance/compute/name":
            return 200, {}, self.vm_name.encode()
        if route == "/metadata/scheduledevents":
            events = []
            if notice and notice[0] == "preempt":
                events.append({"EventId": f"{self.vm_name}-{self._incarnation}", "EventType": "Preempt",
                               "ResourceType": "VirtualMachine", "Resources": [self.vm_name],
                               "EventStatus": "Scheduled", "EventSource": "Platform",
                               "NotBefore": email.utils.formatdate(notice[1], usegmt=True),
                               "Description": "Spot eviction", "DurationInSeconds": -1})
            return 200, {"Content-Type": "application/json"}, json.dumps(
                {"DocumentIncarnation": self._incarnation, "Events": events}).encode()
        return 404, {}, b""


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _handler(md: MetadataServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def _serve(self):
            status, headers, body = md.answer(self.command, self.path, self.headers)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = _serve

        def log_message(self, *args) -> None:  # quiet
            pass

    return Handler
