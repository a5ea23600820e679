"""Pre-emption notices read inside a VM (``cluster.notice``) against a real HTTP metadata stand-in
per VM (``cluster.metadata``: AWS IMDSv2 with its token flow, GCP, Azure Scheduled Events), and
carried to the manager's heartbeat server over a real authenticated socket.

Shown: the watcher finds which cloud it is on (or none: it stays off without harm), sees a
notice within a poll interval with the cloud's deadline, reuses its IMDSv2 token, reports each
notice once; a service that is slow, returns errors or garbage costs polls and never yields a
false notice or kills the watcher, and a notice after it recovers is seen; the parsers never
raise on any text; the heartbeat server turns a worker's notice into one ``preemption_notice``
event per deadline and ignores malformed ones without dropping the worker.
"""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from varuna_sdk.cluster.hosts import Secret
from varuna_sdk.pipeline.spawn import free_port
from varuna_sdk.cluster.metadata import MetadataServer
from varuna_sdk.cluster.notice import (NoticeWatcher, detect_cloud, parse_aws_instance_action, parse_aws_rebalance,
                                       parse_azure_events, parse_gcp_preempted)
from varuna_sdk.manager.events import EventLog, Kind
from varuna_sdk.manager.heartbeat_client import HeartbeatClient
from varuna_sdk.manager.heartbeat_server import HeartbeatServer


class Seen:
    def __init__(self):
        self.notices, self.cv = [], threading.Condition()

    def __call__(self, n):
        with self.cv:
            self.notices.append(n)
            self.cv.notify_all()

    def wait(self, count: int, timeout_s: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: len(self.notices) >= count, timeout_s)


@pytest.fixture
def md():
    servers = []

    def make(clouds=("aws", "gcp", "azure"), **kw):
        s = MetadataServer("vm7", clouds=clouds, **kw).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_each_cloud_is_detected_and_its_notice_seen_within_a_poll(md, cloud):
    server = md(clouds=(cloud,))
    assert detect_cloud(server.url).name == cloud
    tokens_before = server.requests["/latest/api/token"]
    seen = Seen()
    w = NoticeWatcher(seen, base=server.url, poll_s=0.3).start()
    try:
        time.sleep(0.7)
        assert w.cloud_name == cloud and w.polls >= 2 and not seen.notices and w.errors == 0
        lead = 120.0 if cloud == "aws" else 30.0
        t0 = time.time()
        deadline = server.announce(lead_s=lead)
        assert seen.wait(1, 2.0), "no notice within a poll interval"
        n = seen.notices[0]
        assert time.time() - t0 < 0.3 + 1.0
        assert (n.cloud, n.kind) == (cloud, "preempt")
        # AWS and Azure give the deadline (to the second); GCP says only TRUE: now + its ~30 s
        assert abs(n.deadline - deadline) < 1.5, (n, deadline)
        time.sleep(0.7)
        assert len(seen.notices) == 1, "the same notice reported twice"
    finally:
        w.close()
    if cloud == "aws":   # one IMDSv2 session token, reused by every poll
        assert server.requests["/latest/api/token"] - tokens_before == 1
        assert server.requests["/latest/meta-data/spot/instance-action"] >= 3


def test_an_aws_rebalance_recommendation_is_reported_as_such(md):
    server = md(clouds=("aws",))
    seen = Seen()
    w = NoticeWatcher(seen, base=server.url, poll_s=0.3).start()
    try:
        server.announce(kind="rebalance")
        assert seen.wait(1, 3.0)
        assert seen.notices[0].kind == "rebalance" and seen.notices[0].cloud == "aws"
        server.announce(lead_s=120.0)     # ... then the real notice
        assert seen.wait(2, 3.0)
        assert seen.notices[1].kind == "preempt"
    finally:
        w.close()


def test_no_metadata_service_keeps_the_watcher_off_without_harm():
    port = free_port()   # nothing listens there
    assert detect_cloud(f"http://127.0.0.1:{port}", timeout_s=0.3) is None
    seen = Seen()
    w = NoticeWatcher(seen, base=f"http://127.0.0.1:{port}", poll_s=0.2, timeout_s=0.3).start()
    time.sleep(1.0)
    w.close()
    assert w.cloud_name is None and w.polls == 0 and not seen.notices
    assert NoticeWatcher.from_env(seen, {}) is None                       # not asked to watch
    assert NoticeWatcher.from_env(seen, {"VARUNA_NOTICE_WATCH": "1", "VARUNA_NOTICE_CLOUD": "off"}) is None
    assert NoticeWatcher.from_env(seen, {"VARUNA_NOTICE_WATCH": "1", "VARUNA_NOTICE_POLL_S": "-1"}) is None
    with pytest.raises(ValueError, match="unknown cloud 'ibm'"):
        NoticeWatcher(seen, cloud="ibm")


@pytest.mark.parametrize("mode", ["slow", "error"])
def test_a_service_that_fails_the_first_probe_is_probed_again_within_polls_not_a_minute(md, mode):
    # the VM was too busy (or its service still starting) when the watcher looked for a cloud:
    # the notice must still be seen within a few poll intervals, not after redetect_s (60 s)
    server = md(clouds=("aws",), slow_s=1.0)
    server.misbehave(mode)
    seen = Seen()
    w = NoticeWatcher(seen, base=server.url, poll_s=0.2, timeout_s=0.3).start()
    try:
        time.sleep(1.2)
        assert w.cloud_name is None and w._thread.is_alive()
        server.misbehave(None)
        t0 = time.time()
        server.announce(lead_s=120.0)
        assert seen.wait(1, 5.0), "the notice was not seen after the service answered"
        assert w.cloud_name == "aws" and time.time() - t0 < 5.0
    finally:
        w.close()


@pytest.mark.parametrize("mode", ["slow", "error", "garbage"])
def test_a_slow_failing_or_garbage_service_costs_polls_not_the_watcher(md, mode):
    server = md(clouds=("aws",), slow_s=1.5)
    seen = Seen()
    w = NoticeWatcher(seen, base=server.url, cloud="aws", poll_s=0.2, timeout_s=0.5).start()
    try:
        time.sleep(0.6)
        server.misbehave(mode)
        server.announce(lead_s=120.0)        # a notice stands, but the service is broken
        time.sleep(2.0)
        assert not seen.notices, f"a {mode} service produced a notice"
        assert w.errors >= 2 and w._thread.is_alive()
        server.misbehave(None)                # it recovers: the notice is seen
        assert seen.wait(1, 4.0), "the notice was not seen after the service recovered"
        assert seen.notices[0].kind == "preempt"
    finally:
        w.close()


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_the_parsers_never_raise_on_any_text(body):
    now = time.time()
    for n in (parse_aws_instance_action(body, now), parse_aws_rebalance(body, now),
              parse_gcp_preempted(body, now), parse_azure_events(body, now, "vm0")):
        assert n is None or n.deadline > 0


def test_the_parsers_read_the_clouds_documents():
    now = 1_700_000_000.0
    n = parse_aws_instance_action('{"action": "terminate", "time": "2023-11-14T22:15:20Z"}', now)
    assert n.kind == "preempt" and n.deadline == 1_700_000_120.0  # 2 minutes after now
    assert parse_aws_instance_action('{"action": "reboot"}', now) is None
    doc = ('{"DocumentIncarnation": 2, "Events": [{"EventType": "Freeze", "Resources": ["vm0"]}, '
           '{"EventType": "Preempt", "Resources": ["other"], "NotBefore": "Tue, 14 Nov 2023 22:13:50 GMT"}, '
           '{"EventType": "Preempt", "Resources": ["vm0"], "NotBefore": "Tue, 14 Nov 2023 22:13:50 GMT"}]}')
    n = parse_azure_events(doc, now, "vm0")
    assert n.cloud == "azure" and n.deadline == 1_700_000_030.0
    assert parse_azure_events(doc.replace('["vm0"]', '["x"]'), now, "vm0") is None   # another VM's
    assert parse_gcp_preempted("TRUE\n", now).deadline == now + 30.0
    assert parse_gcp_preempted("FALSE", now) is None


def test_a_workers_notice_reaches_the_server_as_one_event_per_deadline(tmp_path):
    secret = Secret("s" * 32)
    log = EventLog(tmp_path / "events.db")
    seen = []
    server = HeartbeatServer("job1", secret, log, interval_s=0.3, on_event=seen.append).start()
    client = HeartbeatClient(server.address, secret, job_id="job1", host="vm3", rank=0, interval_s=0.3).start()
    try:
        assert server.wait_heartbeats(1, 10)
        deadline = time.time() + 90
        # malformed notices ride on heartbeats too: ignored, the worker stays connected
        for bad in ({"deadline": "soon"}, {"deadline": float("inf")}, {"deadline": time.time() + 10**9}, "x"):
            client._state["notice"] = bad
            time.sleep(0.4)
        client.report_notice(cloud="azure", kind="preempt", deadline=deadline, reason="Azure Scheduled Events: Preempt")
        t0 = time.monotonic()
        ev = server.wait_for(Kind.PREEMPTION_NOTICE, 5.0)
        assert ev is not None and time.monotonic() - t0 < 0.5   # the next heartbeat goes at once
        time.sleep(1.0)                                         # later heartbeats repeat it: no new event
        client.report_notice(cloud="azure", kind="preempt", deadline=deadline + 20, reason="moved")
        time.sleep(0.7)
    finally:
        client.close()
        server.close()
    notices = [e for e in seen if e.kind == Kind.PREEMPTION_NOTICE]
    assert len(notices) == 2, notices
    p = notices[0].payload
    assert notices[0].host == "vm3" and p["source"] == "vm" and p["cloud"] == "azure"
    assert p["deadline"] == pytest.approx(deadline) and 85 < p["lead_s"] <= 90
    assert not [e for e in seen if e.kind in ("auth_failed", Kind.HOST_LOST)]
    log.close()
