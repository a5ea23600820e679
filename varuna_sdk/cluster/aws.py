"""Spot VMs from AWS EC2 (boto3): a ``Provider`` (``cluster.provider``) that keeps ``target`` spot
instances for one job, tagged with the job id, and never leaves one running behind it.

It is the worked example of the provider contract (``cluster/provider.py``'s docstring): what a
cloud provider does in ``start``, ``acquire``, ``release``, ``close`` and on its thread.

``AWSSpotProvider(AWSSpotConfig(region=..., instance_types=(...), ami=..., key_name=...,
key_path=...), job_id=..., target=4).start()``:

- **Checks first** (``check()``, before anything is requested; each ``AWSConfigError`` says what
  to change): credentials (boto3's standard chain only: environment, shared files, SSO, instance
  role — never in argv, logs or the event log), the region, every instance type (offered in the
  region), the AMI, every subnet (in this region: one of another region is "not found here"),
  the security group and the key pair.
- **Requests** one-time spot instances (``RunInstances`` with ``InstanceMarketOptions``
  ``spot``, ``max_price`` if set), each tagged ``varuna:job`` = job id, ``varuna:owner`` (who
  started it: ``user@machine``) and ``Name``. Capacity errors (``InsufficientInstanceCapacity``,
  ``MaxSpotInstanceCountExceeded``, ``SpotMaxPriceTooLow``, ...) fall back to the next subnet
  (zone), then the next instance type, in the config's order; when none is left a
  ``CapacityError`` names every try. Later shortfalls (a VM pre-empted) are requested again on
  the provider's thread, with back-off.
- **Ready** = the instance is ``running`` and answers SSH with a *verified* host key: the key is
  learned from the instance's console output (cloud-init prints ``-----BEGIN SSH HOST KEY
  KEYS-----``; ``host_keys="console"``, the default) and written to this provider's own
  known_hosts file, or — explicitly, ``host_keys="trust-on-first-use"`` — accepted on first
  connection with a WARNING naming its fingerprint. Then the host is announced (``added``) and the
  generation bootstraps it like any SSH VM.
- **Watches** ``DescribeInstances`` every ``poll_s``: an instance that leaves ``running``
  (pre-empted: ``Server.SpotInstanceTermination``, terminated, stopped) is ``removed``. The notice
  itself is read inside the VM (``cluster.notice``), 2 minutes ahead on AWS.
- **Prices**: the spot price history of each type and zone (``DescribeSpotPriceHistory``, the
  latest) goes on each host's ``price_per_hour`` label — the dashboard's cost and the planner's
  ``$ per 1,000 examples`` use it; ``on_demand_per_hour`` (config) is the comparison.
- **Cleans up**: ``release`` terminates those instances (and lowers the target), ``close``
  terminates every instance tagged with this job — found through the API, not from memory. On
  ``start`` instances of this job still alive are **adopted** (a restarted manager: none
  duplicated), and instances of this owner whose job is over (``job_alive(job_id)`` is False:
  finished, failed or unknown) are listed and terminated, one log line each.

Tests run against moto's EC2 server (a real HTTP API on loopback; ``endpoint_url``) with each
instance backed by an sshd test host (``reach``); not against AWS itself.

Owns ``AWSSpotConfig``, ``AWSSpotProvider``, ``AWSConfigError``, ``CapacityError``,
``Reach``, ``host_keys_from_console``. Imports ``cluster.hosts``, ``cluster.provider``,
``cluster.ssh``, ``cluster.ssh_errors`` and boto3 (lazily); never torch or the manager.
"""

from __future__ import annotations

import base64
import dataclasses
import getpass
import logging
import math
import re
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .hosts import Host
from .provider import PoolProvider
from .ssh import SSHConnection, SSHOptions
from .ssh_errors import SSHError

log = logging.getLogger(__name__)

TAG_JOB, TAG_OWNER = "varuna:job", "varuna:owner"
#: RunInstances errors that mean "no spot capacity here now": try the next zone / instance type
CAPACITY_CODES = frozenset({"InsufficientInstanceCapacity", "InsufficientCapacity", "MaxSpotInstanceCountExceeded",
                            "SpotMaxPriceTooLow", "InstanceLimitExceeded", "VcpuLimitExceeded",
                            "InsufficientFreeAddressesInSubnet", "Unsupported"})
LIVE_STATES = ("pending", "running")
_REGION = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
_AMI = re.compile(r"^ami-[0-9a-f]{8,17}$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")
_GROUP = re.compile(r"^sg-[0-9a-f]{8,17}$")


class AWSConfigError(ValueError):
    """The AWS settings cannot work; the message says what to change. Raised before any request."""


class CapacityError(RuntimeError):
    """No instance type / zone of the config had spot capacity; the message lists every try."""


@dataclass(frozen=True)
class AWSSpotConfig:
    """What to request. ``instance_types``: in order of preference; ``subnets``: one per zone to
    try, in order (empty: the region's default VPC picks); ``max_price``: US $ per instance-hour
    (None: up to the on-demand price); ``user``/``python``/``workdir``: how workers run on the AMI;
    ``host_keys``: ``"console"`` or ``"trust-on-first-use"`` (see the module docstring);
    ``on_demand_per_hour``: the on-demand price per instance-hour, for cost comparisons."""
    region: str
    instance_types: tuple[str, ...]
    ami: str
    key_name: str | None = None
    key_path: Path | None = None
    subnets: tuple[str, ...] = ()
    security_group: str | None = None
    max_price: float | None = None
    user: str = "ubuntu"
    python: str = "/usr/bin/python3"
    workdir: str | None = None
    host_keys: str = "console"
    use_private_ip: bool = False
    on_demand_per_hour: float | None = None

    def __post_init__(self):
        for name in ("instance_types", "subnets"):   # one name alone is a list of one
            v = getattr(self, name)
            if isinstance(v, str):
                v = (v,) if v else ()
            elif isinstance(v, (list, tuple)):
                v = tuple(v)
            object.__setattr__(self, name, v)         # anything else: problems() names it
        if isinstance(self.key_path, (str, Path)):
            object.__setattr__(self, "key_path", Path(self.key_path).expanduser())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AWSSpotConfig":
        """From a job config's ``aws:`` section (unknown keys are refused, naming the known ones)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in set(d) - known)
        if unknown:
            raise AWSConfigError(f"aws: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(d))

    def type_problems(self) -> list[str]:
        """Settings of the wrong type (a YAML file can hold anything), each saying what it must be."""
        out = []
        for name in ("region", "ami", "user", "python", "host_keys"):
            v = getattr(self, name)
            if not isinstance(v, str):
                out.append(f"{name} {v!r} must be a string")
        for name in ("key_name", "security_group", "workdir"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                out.append(f"{name} {v!r} must be a string (or left out)")
        for name, eg in (("instance_types", "[g5.xlarge, g4dn.xlarge]"), ("subnets", "[subnet-aaaa1111]")):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, str) for x in v):
                out.append(f"{name} {v!r} must be a list of names, e.g. {eg}")
        for name in ("max_price", "on_demand_per_hour"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                out.append(f"{name} {v!r} must be a number > 0 of US $ per instance-hour, unquoted (or left out)")
        if not isinstance(self.use_private_ip, bool):
            out.append(f"use_private_ip {self.use_private_ip!r} must be true or false")
        if self.key_path is not None and not isinstance(self.key_path, Path):
            out.append(f"key_path {self.key_path!r} must be the path of a private key file")
        return out

    def problems(self) -> list[str]:
        """What is wrong without asking AWS (types, formats, ranges, files)."""
        out = self.type_problems()
        if out:
            return out
        if not self.region:
            out.append("region is missing: pass --region (or region: in the --aws file, or set AWS_DEFAULT_REGION)")
        elif not _REGION.match(self.region):
            out.append(f"region {self.region!r} is not an AWS region name (e.g. us-east-1)")
        if not self.instance_types:
            out.append("instance_types is empty: name at least one (e.g. ['g5.xlarge', 'g4dn.xlarge'])")
        out += [f"instance type {t!r} is not an EC2 type name (e.g. g5.xlarge)" for t in self.instance_types
                if not _TYPE.match(str(t))]
        if not self.ami:
            out.append("ami is missing: give the AMI id workers boot from (ami-...), with Python, torch and varuna-sdk")
        elif not _AMI.match(self.ami):
            out.append(f"ami {self.ami!r} is not an AMI id (ami- and 8 or 17 hex digits)")
        out += [f"subnet {s!r} is not a subnet id (subnet-...)" for s in self.subnets if not _SUBNET.match(str(s))]
        if self.security_group is not None and not _GROUP.match(self.security_group):
            out.append(f"security_group {self.security_group!r}: give the group's id (sg-...), not its name")
        if self.host_keys not in ("console", "trust-on-first-use"):
            out.append(f"host_keys {self.host_keys!r}: use 'console' or 'trust-on-first-use'")
        for name, what in (("user", "the SSH login on the AMI (e.g. ubuntu)"),
                           ("python", "the Python workers run with on the AMI (e.g. /usr/bin/python3)")):
            if not getattr(self, name).strip():
                out.append(f"{name} is empty: give {what}")
        if self.key_path is not None and not self.key_path.is_file():
            of = f" of key pair {self.key_name!r}" if self.key_name else ""
            out.append(f"key_path {self.key_path} is not a file: give the private key{of} that SSH logs in with")
        return out


@dataclass(frozen=True)
class Reach:
    """How to reach one instance over SSH: address, port, its host key line(s) (``"ssh-ed25519
    AAAA..."``; empty: learn it per ``host_keys``), extra host labels and, when it differs from
    the config's, the VM's work folder."""
    address: str
    port: int = 22
    host_keys: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None


def host_keys_from_console(text: str) -> list[str]:
    """The host key lines cloud-init printed to the console (``-----BEGIN SSH HOST KEY
    KEYS-----`` ... ``-----END SSH HOST KEY KEYS-----``): ``["ssh-ed25519 AAAA...", ...]``."""
    m = re.search(r"-----BEGIN SSH HOST KEY KEYS-----(.*?)-----END SSH HOST KEY KEYS-----", text, re.S)
    if not m:
        return []
    keys = []
    for line in m.group(1).splitlines():
        parts = line.split()
        if len(parts) >= 2 and re.match(r"^(ssh-(ed25519|rsa)|ecdsa-sha2-nistp\d+)$", parts[0]):
            keys.append(f"{parts[0]} {parts[1]}")
    return keys


def default_owner() -> str:
    """The default ``varuna:owner`` tag of the instances this user starts: ``user@hostname`` of this machine (``reap``
    only ever touches instances with the same owner)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


class AWSSpotProvider(PoolProvider):
    """See the module docstring. ``target``: how many instances to keep (``acquire(n)`` raises
    it); ``job_alive(job_id) -> bool``: whether another job of this owner still runs (None: only
    this job's instances are touched); ``reach(instance) -> Reach``: how to reach an instance
    (default: its public IP, or private with ``use_private_ip``, port 22, keys per
    ``host_keys``); ``endpoint_url``: another EC2 endpoint (an emulator); ``poll_s``: the
    ``DescribeInstances`` interval. Raises ``AWSConfigError`` from ``check()``/``start()``."""

    def __init__(self, config: AWSSpotConfig, *, job_id: str, target: int = 1, event_log: Any = None,
                 endpoint_url: str | None = None, reach: Callable[[dict], Reach] | None = None,
                 job_alive: Callable[[str], bool] | None = None, owner: str | None = None,
                 poll_s: float = 10.0, ssh_ready_timeout_s: float = 600.0,
                 known_hosts: str | Path | None = None, session: Any = None):
        if not job_id or not re.match(r"^[\w.:@-]{1,128}$", job_id):
            raise ValueError(f"job_id {job_id!r}: 1-128 letters, digits, '.', ':', '@', '-' or '_'")
        if not isinstance(target, int) or target < 0:
            raise ValueError(f"target={target!r} must be an integer >= 0 (instances to keep)")
        self._kh_dir = None
        if known_hosts is None:
            self._kh_dir = tempfile.mkdtemp(prefix="varuna-aws-")
            known_hosts = Path(self._kh_dir) / "known_hosts"
        self.known_hosts = Path(known_hosts)
        self.known_hosts.touch()
        opts = SSHOptions(known_hosts=self.known_hosts,
                          trust_on_first_use=config.host_keys == "trust-on-first-use",
                          connect_timeout_s=10.0, connect_attempts=2)
        super().__init__(event_log=event_log, job_id=job_id, ssh_options=opts)
        self.config, self.target = config, target
        self.endpoint_url, self._reach_fn, self.job_alive = endpoint_url, reach, job_alive
        self.owner = owner or default_owner()
        self.poll_s, self.ssh_ready_timeout_s = float(poll_s), float(ssh_ready_timeout_s)
        self._session = session
        self._ec2 = None
        self._instances: dict[str, dict] = {}     # id -> last DescribeInstances view (this job's)
        self._first_seen: dict[str, float] = {}
        self._gpus: dict[str, int] = {}
        self._prices: dict[tuple[str, str], float] = {}
        self._next_request = 0.0
        self._backoff_s = 5.0
        self.terminated: list[str] = []           # every instance this provider terminated
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------- checks
    def client(self):
        """The boto3 EC2 client for ``config.region`` (and ``endpoint_url`` when given), made on first use from the
        given session or a default one and reused after. Raises ``ModuleNotFoundError`` without boto3."""
        if self._ec2 is None:
            import boto3

            session = self._session or boto3.session.Session()
            self._ec2 = session.client("ec2", region_name=self.config.region, endpoint_url=self.endpoint_url)
        return self._ec2

    def check(self) -> None:
        """Every problem with the settings, credentials and named resources, in one
        ``AWSConfigError``; nothing is requested or changed."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        problems = self.config.problems()
        if problems:
            raise AWSConfigError("AWS settings: " + "; ".join(problems))
        import boto3

        try:
            session = self._session or boto3.session.Session()
            regions = {r for part in ("aws", "aws-us-gov", "aws-cn")
                       for r in session.get_available_regions("ec2", partition_name=part)}
        except BotoCoreError as e:   # a named profile that does not exist, an unreadable config file
            raise AWSConfigError(f"AWS configuration: {_err(e)}; fix AWS_PROFILE / ~/.aws/config") from None
        if self.config.region not in regions:
            raise AWSConfigError(f"region {self.config.region!r} is not an EC2 region (known: "
                                 f"{', '.join(sorted(r for r in regions if r.startswith(('us-', 'eu-'))))}, ...)")
        try:
            ec2 = self.client()
        except ValueError as e:      # botocore: "Invalid endpoint: ..."
            raise AWSConfigError(f"endpoint_url {self.endpoint_url!r}: {e}; give a URL such as "
                                 "https://ec2.us-east-1.amazonaws.com (or leave it out)") from None
        except BotoCoreError as e:   # partial credentials, an unreadable credentials file
            raise AWSConfigError(f"AWS credentials: {_err(e)}; set them the standard boto3 way (AWS_PROFILE / "
                                 "~/.aws/credentials, SSO, or the instance role)") from None
        try:
            ec2.describe_regions(RegionNames=[self.config.region])
        except NoCredentialsError:
            raise AWSConfigError("no AWS credentials: set them the standard boto3 way (AWS_PROFILE / "
                                 "~/.aws/credentials, SSO, or the instance role); they are never taken "
                                 "from the job config or the command line") from None
        except (ClientError, BotoCoreError) as e:
            raise AWSConfigError(f"cannot reach EC2 in {self.config.region}: {_err(e)}") from None
        problems = []
        offered = {o["InstanceType"] for o in _pages(ec2, "describe_instance_type_offerings",
                                                     "InstanceTypeOfferings", LocationType="region")}
        for t in self.config.instance_types:
            if t not in offered:
                problems.append(f"instance type {t!r} is not offered in {self.config.region}")
        try:
            ec2.describe_images(ImageIds=[self.config.ami])["Images"][0]
        except (ClientError, IndexError):
            problems.append(f"AMI {self.config.ami} not found in {self.config.region} (AMIs are per region: "
                            "copy it here or use this region's id)")
        for s in self.config.subnets:
            try:
                ec2.describe_subnets(SubnetIds=[s])
            except ClientError:
                problems.append(f"subnet {s} not found in {self.config.region}: it may be in another region; "
                                "use subnets of this region")
        if self.config.security_group:
            try:
                ec2.describe_security_groups(GroupIds=[self.config.security_group])
            except ClientError:
                problems.append(f"security group {self.config.security_group} not found in {self.config.region}")
        if self.config.key_name:
            try:
                ec2.describe_key_pairs(KeyNames=[self.config.key_name])
            except ClientError:
                problems.append(f"key pair {self.config.key_name!r} not found in {self.config.region}")
        if problems:
            raise AWSConfigError("AWS settings: " + "; ".join(problems))

    # ---------------------------------------------------------------------------- provider
    def start(self) -> "AWSSpotProvider":
        """Check, reap instances of finished jobs, adopt this job's live ones, request the
        shortfall, and watch. ``AWSConfigError``/``CapacityError`` when nothing can start."""
        if self._started:
            return self
        self.check()
        self.started = True
        try:
            self._gpus = self._gpu_counts()
            self.reap()
            adopted = [i for i in self._describe() if i["State"]["Name"] in LIVE_STATES]
            for i in adopted:
                log.info("adopting instance %s (%s, %s) of job %s", i["InstanceId"], i["InstanceType"],
                         i["State"]["Name"], self.job_id)
            self._instances = {i["InstanceId"]: i for i in adopted}
            short = self.target - len(adopted)
            if short > 0:
                try:
                    self._request(short)  # CapacityError when no type / zone has any capacity
                except CapacityError as e:
                    if not adopted:
                        raise
                    log.warning("%s; the job starts on its %d adopted instance(s), the rest is asked for "
                                "again later", e, len(adopted))
        except BaseException:
            self.close()              # a failed start leaves no instance running
            raise
        self._thread = threading.Thread(target=self._run, name="aws-spot", daemon=True)
        self._thread.start()
        return self

    def acquire(self, n: int) -> list[Host]:
        """Up to ``n`` usable instances nobody holds, marked in use (at once; maybe fewer). When fewer than ``n`` are
        free, ``target`` is raised by the shortfall and the watcher thread requests it at its next pass; the new VMs
        are announced as ``added`` once they answer SSH. ``ValueError`` for ``n < 0``."""
        got = super().acquire(n)
        with self._lock:
            want = len(self._in_use) + max(0, n - len(got))
            if want > self.target:
                self.target = want     # the thread requests the rest
                self._next_request = 0.0
        return got

    def release(self, hosts) -> None:
        """Give hosts back (``Host`` values or names, i.e. instance ids): they are marked free, and those that are this
        job's instances are terminated, announced as ``removed`` (reason ``"released"``) and taken off ``target`` so
        they are not replaced. Unknown names are ignored; an EC2 API error (botocore ``ClientError``) propagates."""
        names = [h if isinstance(h, str) else h.name for h in hosts]
        super().release(names)
        mine = [n for n in names if n in self._instances]
        if mine:
            with self._lock:
                self.target = max(0, self.target - len(mine))
            self._terminate(mine, "released")
            for n in mine:
                self._remove_host(n, reason="released")

    def close(self) -> None:
        """Stop watching and terminate every instance tagged with this job (found through the
        API). Idempotent; raises ``RuntimeError`` naming the instances it could not terminate."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)
        if not self._started:
            return
        left = [i["InstanceId"] for i in self._describe() if i["State"]["Name"] not in ("terminated", "shutting-down")]
        if left:
            self._terminate(left, "job closed")
        still = [i["InstanceId"] for i in self._describe() if i["State"]["Name"] not in ("terminated", "shutting-down")]
        if still:
            raise RuntimeError(f"instances of job {self.job_id} still running after terminate: {still}")

    # ----------------------------------------------------------------------------- reaping
    def reap(self) -> list[str]:
        """Terminate this owner's instances whose job is over (``job_alive`` False); returns them."""
        if self.job_alive is None:
            return []
        victims = []
        for i in self._describe(every_job=True):
            tags = _tags(i)
            job = tags.get(TAG_JOB)
            if job == self.job_id or tags.get(TAG_OWNER) != self.owner or i["State"]["Name"] not in (*LIVE_STATES, "stopped"):
                continue
            if not self.job_alive(job):
                log.warning("terminating instance %s (%s) left by job %s, which is not running", i["InstanceId"],
                            i["InstanceType"], job)
                victims.append(i["InstanceId"])
        if victims:
            self._terminate(victims, "job not running")
        return victims

    # ------------------------------------------------------------------------------ internals
    def _describe(self, job: str | None = None, *, every_job: bool = False) -> list[dict]:
        """Instances tagged with ``job`` (default: this job), or with any job (``every_job``)."""
        filters = [{"Name": "tag-key", "Values": [TAG_JOB]}] if every_job else \
            [{"Name": f"tag:{TAG_JOB}", "Values": [job or self.job_id]}]
        out = []
        for r in _pages(self.client(), "describe_instances", "Reservations", Filters=filters):
            out += r["Instances"]
        return out

    def _gpu_counts(self) -> dict[str, int]:
        out = {}
        info = self.client().describe_instance_types(InstanceTypes=list(self.config.instance_types))
        for t in info.get("InstanceTypes", []):
            out[t["InstanceType"]] = sum(g.get("Count", 0) for g in t.get("GpuInfo", {}).get("Gpus", []))
        return out

    def _request(self, n: int) -> list[dict]:
        """Start ``n`` spot instances, one request each, falling back over subnets (zones), then
        instance types, in the config's order; a pair without capacity is not asked again in
        this call. ``CapacityError`` when none could be started."""
        from botocore.exceptions import ClientError

        pairs = [(t, s) for t in self.config.instance_types for s in (self.config.subnets or (None,))]
        tries, started = [], []
        while len(started) < n and pairs:
            itype, subnet = pairs[0]
            try:
                inst = self.client().run_instances(**self._run_args(itype, subnet))["Instances"][0]
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                if code not in CAPACITY_CODES:   # permissions, a parameter EC2 refuses: no retry helps
                    raise AWSConfigError(f"EC2 refused to start a {itype} spot instance ({_err(e)}); check the "
                                         "IAM permissions (README: AWS EC2 spot VMs) and the settings") from None
                tries.append(f"{itype}{' in ' + subnet if subnet else ''}: {code}")
                log.info("no spot capacity for %s%s (%s): trying the next", itype, f" in {subnet}" if subnet else "", code)
                pairs.pop(0)
                continue
            self._instances[inst["InstanceId"]] = inst
            log.info("requested spot instance %s (%s) for job %s", inst["InstanceId"], itype, self.job_id)
            started.append(inst)
        if not started and n > 0:
            raise CapacityError(f"no spot capacity for {n} instance(s): tried {'; '.join(tries)}. Add instance "
                                "types or subnets in other zones, raise max_price, or ask AWS for a higher spot limit")
        return started

    def _run_args(self, itype: str, subnet: str | None) -> dict[str, Any]:
        spot = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
        if self.config.max_price:
            spot["MaxPrice"] = f"{self.config.max_price:g}"
        tags = [{"Key": TAG_JOB, "Value": self.job_id}, {"Key": TAG_OWNER, "Value": self.owner},
                {"Key": "Name", "Value": f"varuna-{self.job_id}"[:255]}]
        kw: dict[str, Any] = {"ImageId": self.config.ami, "InstanceType": itype, "MinCount": 1, "MaxCount": 1,
                              "InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": spot},
                              "TagSpecifications": [{"ResourceType": rt, "Tags": tags} for rt in ("instance", "volume")]}
        if subnet:
            kw["SubnetId"] = subnet
        if self.config.security_group:
            kw["SecurityGroupIds"] = [self.config.security_group]
        if self.config.key_name:
            kw["KeyName"] = self.config.key_name
        return kw

    def _terminate(self, ids: Sequence[str], why: str) -> None:
        ids = list(ids)
        self.client().terminate_instances(InstanceIds=ids)
        self.terminated += ids
        for i in ids:
            log.info("terminated instance %s (%s)", i, why)

    def _price(self, itype: str, zone: str) -> float | None:
        key = (itype, zone)
        if key not in self._prices:
            try:
                hist = self.client().describe_spot_price_history(
                    InstanceTypes=[itype], ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
                    Filters=[{"Name": "availability-zone", "Values": [zone]}], MaxResults=20)["SpotPriceHistory"]
            except Exception as e:  # noqa: BLE001 - a price is nice to have, not needed to train
                log.info("no spot price history for %s in %s: %s", itype, zone, _err(e))
                return None
            hist.sort(key=lambda h: str(h.get("Timestamp")), reverse=True)
            if hist:
                self._prices[key] = float(hist[0]["SpotPrice"])
        return self._prices.get(key)

    def reach(self, inst: dict) -> Reach | None:
        """How to reach ``inst`` now (None: it has no address yet)."""
        if self._reach_fn is not None:
            return self._reach_fn(inst)
        addr = inst.get("PrivateIpAddress") if self.config.use_private_ip else inst.get("PublicIpAddress")
        if not addr:
            return None
        keys: tuple[str, ...] = ()
        if self.config.host_keys == "console":
            out = self.client().get_console_output(InstanceId=inst["InstanceId"], Latest=True).get("Output") or ""
            try:
                text = base64.b64decode(out).decode("utf-8", "replace") if not out.startswith("-") else out
            except ValueError:
                text = out
            keys = tuple(host_keys_from_console(text))
        return Reach(addr, 22, keys)

    def _host(self, inst: dict, r: Reach) -> Host:
        itype, zone = inst["InstanceType"], inst.get("Placement", {}).get("AvailabilityZone", "")
        labels = {"kind": "aws", "provider": "aws", "instance_id": inst["InstanceId"], "instance_type": itype,
                  "zone": zone, "lifecycle": "spot"}
        price = self._price(itype, zone)
        if price is not None:
            labels["price_per_hour"] = f"{price:g}"
        if self.config.on_demand_per_hour:
            labels["on_demand_per_hour"] = f"{self.config.on_demand_per_hour:g}"
        labels.update(r.labels)
        return Host(name=inst["InstanceId"], address=r.address, port=r.port, user=self.config.user,
                    key_path=self.config.key_path, gpus=self._gpus.get(itype, 0), python=self.config.python,
                    workdir=r.workdir or self.config.workdir, labels=labels)

    def _ready(self, inst: dict) -> Host | None:
        """The instance's Host once it answers SSH with a verified key; None: not yet."""
        r = self.reach(inst)
        if r is None or (not r.host_keys and self.config.host_keys == "console"):
            return None          # cloud-init has not printed the keys yet
        host = self._host(inst, r)
        if r.host_keys:
            self._learn_keys(host, r.host_keys)
        try:
            with SSHConnection(host, self._ssh_options) as conn:
                conn.run("true", timeout_s=10)
        except (SSHError, OSError) as e:
            log.debug("instance %s not answering SSH yet: %s", inst["InstanceId"], e)
            return None
        return host

    def _learn_keys(self, host: Host, keys: Sequence[str]) -> None:
        name = host.known_hosts_name
        lines = [ln for ln in self.known_hosts.read_text().splitlines() if ln.split(" ", 1)[0] != name]
        lines += [f"{name} {k}" for k in keys]
        tmp = self.known_hosts.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in lines))
        tmp.replace(self.known_hosts)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - the watcher must outlive a flaky API
                log.warning("AWS poll failed (%s); retrying in %g s", _err(e), self.poll_s)
            self._stop.wait(self.poll_s)

    def _tick(self) -> None:
        now = time.time()
        view = {i["InstanceId"]: i for i in self._describe()}
        held = {h.name for h in self.all_hosts()}
        for iid, inst in view.items():
            state = inst["State"]["Name"]
            if state == "running" and iid not in held and not self._stop.is_set():
                self._first_seen.setdefault(iid, now)
                host = self._ready(inst)
                if host is not None:
                    self._add_host(host, reason=f"spot instance {inst['InstanceType']} ready")
                elif now - self._first_seen[iid] > self.ssh_ready_timeout_s:
                    log.warning("instance %s never answered SSH in %g s: terminating it", iid, self.ssh_ready_timeout_s)
                    self._terminate([iid], "never answered SSH")
            elif state not in LIVE_STATES and iid in held:
                reason = (inst.get("StateReason") or {}).get("Code") or state
                self._remove_host(iid, reason=f"instance {state} ({reason})")
        self._instances = {k: v for k, v in view.items() if v["State"]["Name"] in LIVE_STATES}
        short = self.target - len(self._instances)
        if short > 0 and now >= self._next_request and not self._stop.is_set():
            try:
                self._request(short)
                self._backoff_s = 5.0
            except (CapacityError, AWSConfigError) as e:
                log.warning("%s; trying again in %g s", e, self._backoff_s)
                self._next_request = now + self._backoff_s
                self._backoff_s = min(300.0, self._backoff_s * 2)


def _tags(inst: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}


def _pages(client, op: str, key: str, **kw) -> list:
    out = []
    for page in client.get_paginator(op).paginate(**kw):
        out += page.get(key, [])
    return out


def _err(e: BaseException) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict) and "Error" in resp:
        return f"{resp['Error'].get('Code')}: {resp['Error'].get('Message', '')[:200]}"
    return f"{type(e).__name__}: {str(e)[:200]}"
