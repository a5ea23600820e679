"""An EC2 cloud on this machine for the tests: moto's EC2 server (a real HTTP API on loopback, in
its own process), an optional fault-injecting HTTP proxy in front of it (``RunInstances`` of
chosen instance types answers ``InsufficientInstanceCapacity``, as EC2 does when a zone has no
spot capacity), and a backing that makes each instance the API reports running a real VM: an sshd
test host with its own instance-metadata stand-in (AWS IMDSv2). An instance terminated through
the API loses its VM within half a second (its sshd and every process killed), as a cloud would.
It is an emulator and a stand-in, not AWS.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from varuna_sdk.cluster.aws import Reach
from varuna_sdk.pipeline.spawn import free_port
from varuna_sdk.cluster.metadata import MetadataServer

REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret-never-logged",
               "AWS_DEFAULT_REGION": REGION}


class MotoServer:
    """``python -m moto.server`` on a free loopback port; ``url``; ``close()`` ends the process."""

    def __init__(self):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("moto's EC2 server did not start")
                time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class CapacityFaults:
    """An HTTP proxy to ``upstream``: ``RunInstances`` for a type in ``no_capacity`` (a set the
    test changes) answers EC2's ``InsufficientInstanceCapacity`` error, for a type in ``errors``
    (type -> error code, e.g. ``UnauthorizedOperation``) that error; everything else passes."""

    def __init__(self, upstream: str):
        self.upstream, self.no_capacity, self.refused = upstream, set(), []
        self.errors: dict[str, str] = {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                form = urllib.parse.parse_qs(body.decode())
                itype = (form.get("InstanceType") or [""])[0]
                running = (form.get("Action") or [""])[0] == "RunInstances"
                if running and (itype in proxy.no_capacity or itype in proxy.errors):
                    proxy.refused.append(itype)
                    code = proxy.errors.get(itype, "InsufficientInstanceCapacity")
                    said = (f"We currently do not have sufficient {itype} capacity in the Availability Zone you "
                            "requested." if code == "InsufficientInstanceCapacity" else
                            "You are not authorized to perform this operation.")
                    self._reply(400, {"Content-Type": "text/xml"}, (
                        "<?xml version='1.0' encoding='UTF-8'?><Response><Errors><Error>"
                        f"<Code>{code}</Code><Message>{said}</Message></Error></Errors>"
                        "<RequestID>fault-injected</RequestID></Response>").encode())
                    return
                req = urllib.request.Request(proxy.upstream + self.path, data=body, method="POST",
                                             headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
                try:
                    with urllib.request.urlopen(req, timeout=30) as r:
                        self._reply(r.status, dict(r.headers), r.read())
                except urllib.error.HTTPError as e:
                    self._reply(e.code, dict(e.headers), e.read())

            def _reply(self, status, headers, data):
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Backing:
    """Each instance the API reports running is a test host (named ``vm-<instance id>``) with an
    AWS metadata stand-in, made by a thread that watches ``DescribeInstances`` (every 0.5 s) —
    also for instances a provider in *another process* requested; the same thread kills the VM of
    an instance the API says is terminated. ``reach`` is the provider's hook in this process;
    with ``registry`` (a JSON file, rewritten atomically) a provider in another process reaches
    the VMs through ``registry_reach(registry)``."""

    def __init__(self, test_hosts, ec2, registry: str | os.PathLike | None = None):
        self.test_hosts, self.ec2 = test_hosts, ec2
        self.registry = registry
        self.vms: dict[str, tuple] = {}       # instance id -> (Host, MetadataServer)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def reach(self, inst: dict) -> Reach:
        iid = inst["InstanceId"]
        with self._lock:
            if iid not in self.vms:
                self._back(iid)
            return self._reach(iid)

    def _back(self, iid: str) -> None:
        h = self.test_hosts.add(f"vm-{iid}")
        self.vms[iid] = (h, MetadataServer(iid, clouds=("aws",)).start())

    def _reach(self, iid: str) -> Reach:
        h, md = self.vms[iid]
        return Reach(h.address, h.port, (self.test_hosts.host_key(h),),
                     labels={"env.VARUNA_METADATA_URL": md.url}, workdir=h.workdir)

    def _publish(self) -> None:
        if self.registry is None:
            return
        with self._lock:
            data = {iid: dataclasses.asdict(self._reach(iid)) for iid in self.vms}
        tmp = f"{self.registry}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.registry)

    def metadata(self, iid: str) -> MetadataServer:
        return self.vms[iid][1]

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                view = {i["InstanceId"]: i["State"]["Name"] for r in self.ec2.describe_instances()["Reservations"]
                        for i in r["Instances"]}
            except Exception:  # noqa: BLE001 - the server is shutting down
                continue
            gone = {iid for iid, state in view.items() if state in ("shutting-down", "terminated")}
            changed = False
            for iid in gone & set(self.vms):
                self._kill(iid)
                changed = True
            for iid in sorted(iid for iid, state in view.items() if state == "running"):
                with self._lock:
                    if iid not in self.vms and not self._stop.is_set():
                        self._back(iid)
                        changed = True
            if changed:
                self._publish()

    def _kill(self, iid: str) -> None:
        with self._lock:
            h, md = self.vms.pop(iid)
        md.close()
        if h.name in self.test_hosts:
            self.test_hosts.remove(h.name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for iid in list(self.vms):
            self._kill(iid)
        self._publish()


def registry_reach(registry: str | os.PathLike):
    """The ``reach`` hook of a provider in another process than the ``Backing``: an instance's
    ``Reach`` from the registry file, or None while its VM is not there yet."""
    def reach(inst: dict) -> Reach | None:
        try:
            with open(registry) as f:
                entry = json.load(f).get(inst["InstanceId"])
        except (OSError, ValueError):
            return None
        if entry is None:
            return None
        entry["host_keys"] = tuple(entry["host_keys"])
        return Reach(**entry)
    return reach


def set_credentials(monkeypatch, tmp_path) -> None:
    """Fake credentials in the environment (boto3's standard chain), no shared files read."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.pop("AWS_CONTAINER_CREDENTIALS_FULL_URI", None)
