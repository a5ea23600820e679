"""Pre-emption notices read inside a VM: the cloud's instance metadata service, polled by a thread of
one worker per VM, so that the manager hears of a notice within a poll interval (paper §4: Varuna
acts on the cloud's advance warning; the notice morph checkpoints, re-plans and resumes before the
VM is taken, losing no step).

What is polled, every ``poll_s`` (default 5 s), on each cloud:

- **AWS** (IMDSv2): a session token from ``PUT /latest/api/token`` (header
  ``X-aws-ec2-metadata-token-ttl-seconds``; renewed before it expires and after a 401), then
  ``GET /latest/meta-data/spot/instance-action`` (404: none; 200: ``{"action": "terminate" |
  "stop" | "hibernate", "time": ISO-8601}`` — the deadline, 2 minutes ahead) and
  ``GET /latest/meta-data/events/recommendations/rebalance`` (200: ``{"noticeTime": ...}``, an
  elevated risk of pre-emption, reported as kind ``"rebalance"`` with a deadline 2 minutes on).
- **GCP**: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``
  (``TRUE``: pre-empted, the VM stops about 30 s later); answers without that header in the
  response are not GCP's and are ignored.
- **Azure**: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``: an
  event of ``EventType`` ``Preempt`` naming this VM (or no VM) in ``Resources``; its
  ``NotBefore`` (RFC 1123) is the deadline (about 30 s ahead).

Which cloud: ``cloud="auto"`` (default) probes AWS's token, then GCP's flavour header, then Azure's
instance name (each with a short timeout) and stays off — one log line — when none answers (a VM
of the user's own, a laptop), probing again after one poll interval, then backing off to every
``redetect_s`` (a probe a busy VM answered too late must not hide a notice for a minute). Every request has a timeout,
reads at most ``MAX_BODY`` bytes, bypasses HTTP proxies (the metadata address is link-local) and
never raises into the caller: a slow, failing or garbage-speaking service costs a poll, not the
worker (answers that do not parse are no notice, counted in ``errors``).

Environment contract (``manager.generation`` sets it for the first worker on every VM reached over
SSH; a host's ``env.NAME`` labels may override it): ``VARUNA_NOTICE_WATCH=1`` starts the watcher,
``VARUNA_METADATA_URL`` (default ``http://169.254.169.254``: the same link-local address on all
three clouds; the test suite points it at a ``cluster.metadata.MetadataServer``),
``VARUNA_NOTICE_CLOUD`` (``auto``/``aws``/``gcp``/``azure``/``off``), ``VARUNA_NOTICE_POLL_S``.

Owns ``Notice``, ``NoticeWatcher``, ``detect_cloud``, the per-cloud ``parse_*`` functions and the
environment names. Standard library only (it runs in every worker, before torch is imported).
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Mapping

log = logging.getLogger(__name__)

ENV_WATCH = "VARUNA_NOTICE_WATCH"
ENV_URL = "VARUNA_METADATA_URL"
ENV_CLOUD = "VARUNA_NOTICE_CLOUD"
ENV_POLL = "VARUNA_NOTICE_POLL_S"
DEFAULT_URL = "http://169.254.169.254"
CLOUDS = ("aws", "gcp", "azure")
MAX_BODY = 64 * 1024
#: how long before the VM is taken each cloud warns (seconds); used when a notice carries no time
LEAD_S = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}
AWS_TOKEN_TTL_S = 21600


@dataclass(frozen=True)
class Notice:
    """One pre-emption notice seen inside a VM. ``deadline``: when the cloud takes the VM (Unix
    seconds); ``kind``: ``"preempt"`` (it will be taken) or ``"rebalance"`` (AWS: elevated risk,
    move off early); ``cloud``: ``aws``/``gcp``/``azure``; ``reason``: words for the event log."""
    cloud: str
    kind: str
    deadline: float
    reason: str


class _Http:
    """Tiny metadata client: no proxies, a timeout on every request, bodies capped at MAX_BODY."""

    def __init__(self, base: str, timeout_s: float):
        self.base = base.rstrip("/")
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, path: str, headers: Mapping[str, str], method: str = "GET"
                ) -> tuple[int, dict[str, str], str]:
        """(status, lower-cased response headers, body text); 404/401/... are statuses, not errors.
        Raises ``OSError`` (timeouts, refusals, resets) only."""
        req = urllib.request.Request(self.base + path, headers=dict(headers), method=method,
                                     data=b"" if method == "PUT" else None)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, _text(r.read(MAX_BODY))
        except urllib.error.HTTPError as e:
            try:
                body = _text(e.read(MAX_BODY))
            except OSError:
                body = ""
            return e.code, {k.lower(): v for k, v in (e.headers or {}).items()}, body
        except (ValueError, http.client.HTTPException) as e:  # a garbage status line, a truncated answer
            raise OSError(f"bad HTTP answer: {type(e).__name__}") from e


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


# ------------------------------------------------------------------------------ parsing (pure)
def _iso_time(s: object) -> float | None:
    if not isinstance(s, str) or len(s) > 64:
        return None
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _rfc1123_time(s: object) -> float | None:
    if not isinstance(s, str) or len(s) > 64:
        return None
    try:
        return email.utils.parsedate_to_datetime(s).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


def parse_aws_instance_action(body: str, now: float) -> Notice | None:
    """The body of a 200 from ``spot/instance-action`` → a notice (None: garbage, no notice)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("action") not in ("terminate", "stop", "hibernate"):
        return None
    deadline = _iso_time(doc.get("time"))
    return Notice("aws", "preempt", deadline if deadline is not None else now + LEAD_S["aws"],
                  f"AWS spot instance-action: {doc['action']}")


def parse_aws_rebalance(body: str, now: float) -> Notice | None:
    """The body of a 200 from ``events/recommendations/rebalance`` → a ``rebalance`` notice."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or _iso_time(doc.get("noticeTime")) is None:
        return None
    return Notice("aws", "rebalance", now + LEAD_S["aws"], "AWS rebalance recommendation")


def parse_gcp_preempted(body: str, now: float) -> Notice | None:
    """The body of ``instance/preempted`` (``TRUE``/``FALSE``) → a notice or None."""
    if body.strip() == "TRUE":
        return Notice("gcp", "preempt", now + LEAD_S["gcp"], "GCP instance/preempted: TRUE")
    return None


def parse_azure_events(body: str, now: float, vm_name: str | None) -> Notice | None:
    """A Scheduled Events document → a notice for a ``Preempt`` event naming this VM (or no VM)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    events = doc.get("Events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        return None
    for ev in events[:256]:
        if not isinstance(ev, dict) or ev.get("EventType") != "Preempt":
            continue
        res = ev.get("Resources")
        if vm_name is not None and isinstance(res, list) and res and vm_name not in res:
            continue
        deadline = _rfc1123_time(ev.get("NotBefore"))
        return Notice("azure", "preempt", deadline if deadline is not None else now + LEAD_S["azure"],
                      "Azure Scheduled Events: Preempt")
    return None


# ------------------------------------------------------------------------------ the clouds
_GCP = {"Metadata-Flavor": "Google"}
_AZURE = {"Metadata": "true"}


class _Aws:
    name = "aws"

    def __init__(self, client: _Http):
        self.http = client
        self._token: str | None = None
        self._token_until = 0.0

    def token(self) -> str | None:
        if self._token is None or time.monotonic() > self._token_until:
            status, _, body = self.http.request(
                "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}, "PUT")
            tok = body.strip()
            if status != 200 or not tok or len(tok) > 512 or not tok.isprintable():
                self._token = None
                return None
            self._token, self._token_until = tok, time.monotonic() + AWS_TOKEN_TTL_S - 60
        return self._token

    def poll(self, now: float) -> tuple[Notice | None, bool]:
        """(notice or None, answered sensibly)."""
        ok = True
        for path, parse in (("/latest/meta-data/spot/instance-action", parse_aws_instance_action),
                            ("/latest/meta-data/events/recommendations/rebalance", parse_aws_rebalance)):
            tok = self.token()
            if tok is None:
                return None, False
            status, _, body = self.http.request(path, {"X-aws-ec2-metadata-token": tok})
            if status == 401:          # the token expired early: a fresh one next time
                self._token = None
                ok = False
                continue
            if status == 200:
                n = parse(body, now)
                if n is not None:
                    return n, True
                ok = False             # a 200 that does not parse: garbage
            elif status != 404:
                ok = False
        return None, ok


class _Gcp:
    name = "gcp"

    def __init__(self, client: _Http):
        self.http = client

    def poll(self, now: float) -> tuple[Notice | None, bool]:
        status, headers, body = self.http.request("/computeMetadata/v1/instance/preempted", _GCP)
        if status != 200 or headers.get("metadata-flavor") != "Google":
            return None, False
        return parse_gcp_preempted(body, now), body.strip() in ("TRUE", "FALSE")


class _Azure:
    name = "azure"

    def __init__(self, client: _Http, vm_name: str | None = None):
        self.http, self.vm_name = client, vm_name

    def poll(self, now: float) -> tuple[Notice | None, bool]:
        status, _, body = self.http.request("/metadata/scheduledevents?api-version=2020-07-01", _AZURE)
        if status != 200:
            return None, False
        n = parse_azure_events(body, now, self.vm_name)
        try:
            sensible = n is not None or isinstance(json.loads(body).get("Events"), list)
        except (ValueError, AttributeError):
            sensible = False
        return n, sensible


def detect_cloud(base: str = DEFAULT_URL, timeout_s: float = 1.0):
    """Which cloud's metadata service answers at ``base``: an object with ``name`` (``aws``,
    ``gcp``, ``azure``) and ``poll(now) -> (Notice | None, ok)``, or None when none does. Never
    raises."""
    client = _Http(base, timeout_s)
    aws = _Aws(client)
    try:
        if aws.token() is not None:
            return aws
    except OSError:
        pass
    try:
        status, headers, _ = client.request("/computeMetadata/v1/instance/id", _GCP)
        if status == 200 and headers.get("metadata-flavor") == "Google":
            return _Gcp(client)
    except OSError:
        pass
    try:
        status, _, body = client.request("/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                                       _AZURE)
        if status == 200:
            name = body.strip()
            return _Azure(client, name if 0 < len(name) <= 256 and name.isprintable() else None)
    except OSError:
        pass
    return None


def _for(cloud: str, base: str, timeout_s: float):
    if cloud == "auto":
        return detect_cloud(base, timeout_s)
    return {"aws": _Aws, "gcp": _Gcp, "azure": _Azure}[cloud](_Http(base, timeout_s))


class NoticeWatcher:
    """A daemon thread that polls this VM's metadata service and calls ``on_notice(Notice)`` once
    for every new notice (a new kind or a deadline that moved by more than a second).

    ``NoticeWatcher(on_notice, base=..., cloud="auto", poll_s=5.0).start()``; ``close()`` ends it
    within one request timeout. ``cloud``: ``auto`` (detect, see the module docstring), ``aws``,
    ``gcp``, ``azure`` or ``off``. Counters: ``polls``, ``errors`` (failed or nonsensical answers),
    ``notices``; ``cloud_name``: the cloud found (None until found). Detection that finds no
    service is tried again after ``poll_s``, then twice as long each time up to ``redetect_s``
    seconds (a probe can fail on a VM too busy to answer in ``timeout_s``). ``ValueError`` for an unknown
    cloud or a poll interval not in (0, 3600] s.
    """

    def __init__(self, on_notice: Callable[[Notice], None], *, base: str = DEFAULT_URL,
                 cloud: str = "auto", poll_s: float = 5.0, timeout_s: float | None = None,
                 redetect_s: float = 60.0):
        if cloud not in ("auto", "off", *CLOUDS):
            raise ValueError(f"notice watcher: unknown cloud {cloud!r}; use auto, off, aws, gcp or azure")
        if not 0 < poll_s <= 3600:
            raise ValueError(f"notice watcher: poll interval {poll_s!r} s must be in (0, 3600]")
        self.on_notice, self.base, self.cloud, self.poll_s = on_notice, base, cloud, float(poll_s)
        self.timeout_s = timeout_s if timeout_s is not None else min(2.0, max(0.2, self.poll_s / 2))
        self.redetect_s = redetect_s
        self.polls = self.errors = self.notices = 0
        self.cloud_name: str | None = None
        self._seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, on_notice: Callable[[Notice], None], env: Mapping[str, str] | None = None
                 ) -> "NoticeWatcher | None":
        """A watcher configured by the environment contract, or None when ``VARUNA_NOTICE_WATCH``
        is not ``1`` or the cloud is ``off``. A bad value is logged and turns the watcher off
        (a worker must not fail over it)."""
        env = os.environ if env is None else env
        if env.get(ENV_WATCH) != "1":
            return None
        cloud = env.get(ENV_CLOUD, "auto").strip().lower() or "auto"
        if cloud == "off":
            return None
        try:
            return cls(on_notice, base=env.get(ENV_URL) or DEFAULT_URL, cloud=cloud,
                       poll_s=float(env.get(ENV_POLL) or 5.0))
        except ValueError as e:
            log.warning("pre-emption notices will not be watched on this VM: %s", e)
            return None

    def start(self) -> "NoticeWatcher":
        """Start the daemon thread that polls the metadata service every ``poll_s`` seconds and calls ``on_notice``
        once per new pre-emption notice (paper §4: pre-emptions trigger morphing); returns self."""
        self._thread = threading.Thread(target=self._run, name="varuna-notice-watcher", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop polling; waits up to ``timeout_s`` seconds for the thread to end (a request in flight ends within the
        request timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        source = None
        said_off = False
        next_detect = 0.0
        backoff = self.poll_s
        while not self._stop.is_set():
            now_m = time.monotonic()
            if source is None and now_m >= next_detect:
                try:
                    source = _for(self.cloud, self.base, self.timeout_s)
                except Exception:  # noqa: BLE001 - never let the watcher die
                    source = None
                # a probe that failed (a busy VM answering late, a service still starting) is tried
                # again soon, then less and less often: a notice must not wait a whole redetect_s
                next_detect = time.monotonic() + backoff
                backoff = min(2 * backoff, self.redetect_s)
                if source is None:
                    if not said_off:
                        log.info("no cloud metadata service answers at %s: pre-emption notices are not "
                                 "watched on this VM (probing again, at most every %g s)", self.base,
                                 self.redetect_s)
                        said_off = True
                else:
                    self.cloud_name = source.name
                    log.info("watching %s pre-emption notices at %s every %g s", source.name, self.base, self.poll_s)
            if source is not None:
                self._poll(source)
            self._stop.wait(self.poll_s)

    def _poll(self, source) -> None:
        self.polls += 1
        try:
            notice, ok = source.poll(time.time())
        except Exception as e:  # noqa: BLE001 - a slow, failing or garbage service costs one poll
            notice, ok = None, False
            if self.errors % 20 == 0:
                log.warning("metadata poll failed (%s: %s)", type(e).__name__, str(e)[:200])
        if not ok:
            self.errors += 1
        if notice is None:
            return
        last = self._seen.get(notice.kind)
        if last is not None and abs(last - notice.deadline) <= 1.0:
            return
        self._seen[notice.kind] = notice.deadline
        self.notices += 1
        log.warning("pre-emption notice: %s, deadline in %.0f s", notice.reason, notice.deadline - time.time())
        try:
            self.on_notice(notice)
        except Exception:  # noqa: BLE001
            log.exception("notice callback failed")
