"""``cluster.aws.AWSSpotProvider`` against moto's EC2 server (a real HTTP API on loopback, its own
process; ``tests/ec2_cloud.py``), each instance it runs backed by an sshd test host with an AWS
metadata stand-in. This is an API emulator and a metadata stand-in, not AWS.

Shown: bad settings are refused before anything is requested, each naming what to change
(unknown region or instance type, missing AMI, no credentials, a subnet of another region); a
type without spot capacity falls back to the next, and with none left the error lists every
try and nothing runs; a provider that died is replaced by one that adopts its job's instances
(none duplicated), and one of another job reaps the instances of a job that is over; and a P x D
job on spot instances morphs on an IMDS notice (0 steps lost, before the deadline), grows onto
the replacement the provider requests, survives an instance terminated through the API without
notice (at most the checkpoint interval lost), and at the end every instance it created is
terminated (checked through the EC2 API) — no credentials in any log.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

from ec2_cloud import CREDENTIALS, REGION, Backing, CapacityFaults, MotoServer, set_credentials
from ssh_hosts import skip_reason
from varuna_sdk.cluster.aws import AWSConfigError, AWSSpotConfig, AWSSpotProvider, CapacityError, host_keys_from_console

boto3 = pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    yield server
    server.close()


@pytest.fixture
def ec2(moto, monkeypatch, tmp_path):
    set_credentials(monkeypatch, tmp_path)
    client = boto3.client("ec2", region_name=REGION, endpoint_url=moto.url)
    yield client
    live = [i["InstanceId"] for r in client.describe_instances()["Reservations"] for i in r["Instances"]
            if i["State"]["Name"] in ("pending", "running")]
    if live:
        client.terminate_instances(InstanceIds=live)


_AMIS: list[str] = []


def _ami(ec2) -> str:
    """One of moto's AMIs (listing them takes seconds: once per module)."""
    if not _AMIS:
        _AMIS.append(ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"])
    return _AMIS[0]


def _config(ec2, **kw) -> AWSSpotConfig:
    base = dict(region=REGION, instance_types=("g5.xlarge", "g4dn.xlarge"), ami=_ami(ec2))
    return AWSSpotConfig(**{**base, **kw})


def _live(ec2, job: str | None = None) -> list[dict]:
    filters = [{"Name": "tag:varuna:job", "Values": [job]}] if job else []
    return [i for r in ec2.describe_instances(Filters=filters)["Reservations"] for i in r["Instances"]
            if i["State"]["Name"] in ("pending", "running")]


def test_bad_settings_are_refused_before_anything_is_requested(ec2, moto, monkeypatch, tmp_path):
    west = boto3.client("ec2", region_name="us-west-2", endpoint_url=moto.url)
    west_subnet = west.describe_subnets()["Subnets"][0]["SubnetId"]
    cases = [
        (dict(instance_types=("g5.xlarge", "p9.mega")), r"instance type 'p9.mega' is not offered in us-east-1"),
        (dict(region="xx-nowhere-9"), r"region 'xx-nowhere-9' is not an EC2 region"),
        (dict(region="useast1"), r"region 'useast1' is not an AWS region name \(e.g. us-east-1\)"),
        (dict(ami=""), r"ami is missing: give the AMI id"),
        (dict(ami="ami-0123456789abcdef0"), r"AMI ami-0123456789abcdef0 not found in us-east-1 \(AMIs are per region"),
        (dict(subnets=(west_subnet,)), rf"subnet {west_subnet} not found in us-east-1: it may be in another region"),
        (dict(instance_types=()), r"instance_types is empty"),
        (dict(host_keys="yes"), r"host_keys 'yes': use 'console' or 'trust-on-first-use'"),
        (dict(region=""), r"region is missing: pass --region"),
        (dict(security_group="default"), r"security_group 'default': give the group's id \(sg-...\), not its name"),
        (dict(user=""), r"user is empty: give the SSH login"),
        (dict(key_path=tmp_path), rf"key_path {tmp_path} is not a file"),
        # what a YAML file can hold: each wrong type named, no traceback
        (dict(instance_types=5), r"instance_types 5 must be a list of names"),
        (dict(region=5, ami=123), r"region 5 must be a string; ami 123 must be a string"),
        (dict(max_price="cheap"), r"max_price 'cheap' must be a number > 0"),
        (dict(max_price=float("inf")), r"max_price inf must be a number > 0"),
        (dict(on_demand_per_hour="1.0"), r"on_demand_per_hour '1.0' must be a number > 0 .* unquoted"),
        (dict(security_group=["sg-1"], key_name=7), r"key_name 7 must be a string"),
        (dict(use_private_ip="no"), r"use_private_ip 'no' must be true or false"),
    ]
    for kw, said in cases:
        p = AWSSpotProvider(_config(ec2, **kw), job_id="bad", target=2, endpoint_url=moto.url)
        with pytest.raises(AWSConfigError, match=said):
            p.start()
        p.close()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    p = AWSSpotProvider(_config(ec2), job_id="bad", target=2, endpoint_url=moto.url)
    with pytest.raises(AWSConfigError, match=r"no AWS credentials: set them the standard boto3 way"):
        p.start()
    with pytest.raises(AWSConfigError, match=r"unknown setting\(s\) \['instance_type'\]"):
        AWSSpotConfig.from_dict({"region": REGION, "instance_type": "g5.xlarge", "ami": "ami-12345678"})
    with pytest.raises(AWSConfigError, match=r"unknown setting\(s\) \['1', 'foo'\]"):
        AWSSpotConfig.from_dict({1: 2, "foo": 3})
    one = AWSSpotConfig.from_dict({"region": REGION, "instance_types": "g5.xlarge", "ami": "ami-12345678",
                                   "subnets": "subnet-0123abcd"})
    assert (one.instance_types, one.subnets) == (("g5.xlarge",), ("subnet-0123abcd",))   # a name alone: a list of one
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "only-the-key-id")    # half the credentials: said, not a traceback
    p = AWSSpotProvider(_config(ec2), job_id="bad", target=2, endpoint_url=moto.url)
    with pytest.raises(AWSConfigError, match=r"AWS credentials: PartialCredentialsError"):
        p.start()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    p = AWSSpotProvider(_config(ec2), job_id="bad", target=2, endpoint_url="not-a-url")
    with pytest.raises(AWSConfigError, match=r"endpoint_url 'not-a-url': Invalid endpoint"):
        p.start()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    p = AWSSpotProvider(_config(ec2), job_id="bad", target=2, endpoint_url=moto.url)
    with pytest.raises(AWSConfigError, match=r"AWS configuration: ProfileNotFound"):
        p.start()
    assert _live(ec2) == []       # nothing was requested


def test_no_capacity_falls_back_to_the_next_type_and_then_says_what_was_tried(ec2, moto):
    faults = CapacityFaults(moto.url)
    try:
        faults.no_capacity = {"g5.xlarge"}
        p = AWSSpotProvider(_config(ec2), job_id="fallback", target=2, endpoint_url=faults.url,
                            reach=lambda inst: None, poll_s=0.5).start()
        types = sorted(i["InstanceType"] for i in _live(ec2, "fallback"))
        p.close()
        assert types == ["g4dn.xlarge", "g4dn.xlarge"] and faults.refused == ["g5.xlarge"]
        assert _live(ec2, "fallback") == []          # close terminated both, found by tag
        faults.no_capacity = {"g5.xlarge", "g4dn.xlarge"}
        _refused_at_start(ec2, faults.url, "none", CapacityError, r"tried g5.xlarge: InsufficientInstanceCapacity; "
                          r"g4dn.xlarge: InsufficientInstanceCapacity\. Add instance types")
        # a refusal no retry helps (IAM lacks ec2:RunInstances): said at once, nothing left running
        faults.no_capacity, faults.errors = {"g5.xlarge"}, {"g4dn.xlarge": "UnauthorizedOperation"}
        _refused_at_start(ec2, faults.url, "denied", AWSConfigError, r"EC2 refused to start a g4dn.xlarge spot "
                          r"instance \(UnauthorizedOperation: .*\); check the IAM permissions")
    finally:
        faults.close()


def _refused_at_start(ec2, url: str, job: str, error: type, match: str) -> None:
    """A provider for ``job`` whose start raises ``error`` (message matching ``match``) leaves no
    instance of the job running."""
    p = AWSSpotProvider(_config(ec2), job_id=job, target=1, endpoint_url=url, reach=lambda inst: None)
    with pytest.raises(error, match=match):
        p.start()
    p.close()
    assert _live(ec2, job) == []


def test_a_restarted_provider_adopts_its_jobs_instances_and_instances_of_a_finished_job_are_reaped(ec2, moto):
    a = AWSSpotProvider(_config(ec2), job_id="job-a", target=2, endpoint_url=moto.url, reach=lambda i: None,
                        poll_s=0.5).start()
    first = sorted(i["InstanceId"] for i in _live(ec2, "job-a"))
    a._stop.set()                  # the manager holding it is SIGKILLed: nothing is cleaned up
    b = AWSSpotProvider(_config(ec2), job_id="job-a", target=2, endpoint_url=moto.url, reach=lambda i: None,
                        poll_s=0.5).start()
    time.sleep(1.5)
    assert sorted(i["InstanceId"] for i in _live(ec2, "job-a")) == first     # adopted, none duplicated
    b._stop.set()                  # ... and that one dies too; job-a is over
    c = AWSSpotProvider(_config(ec2), job_id="job-c", target=0, endpoint_url=moto.url, reach=lambda i: None,
                        job_alive=lambda job: False).start()
    assert sorted(c.terminated) == first and _live(ec2, "job-a") == []
    other = AWSSpotProvider(_config(ec2), job_id="job-d", target=1, endpoint_url=moto.url, reach=lambda i: None,
                            owner="someone@else").start()
    other._stop.set()
    d = AWSSpotProvider(_config(ec2), job_id="job-e", target=0, endpoint_url=moto.url, reach=lambda i: None,
                        job_alive=lambda job: False).start()
    assert d.terminated == [] and len(_live(ec2, "job-d")) == 1   # another owner's instance is left alone
    for p in (c, d):
        p.close()
    other.closed = False
    other.close()


def test_host_keys_are_read_from_the_console_output():
    console = ("cloud-init: ...\n-----BEGIN SSH HOST KEY KEYS-----\n"
               "ecdsa-sha2-nistp256 AAAAE2VjZHNh root@ip-10-0-0-1\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5 root@ip-10-0-0-1\n"
               "-----END SSH HOST KEY KEYS-----\ncloud-init finished\n")
    assert host_keys_from_console(console) == ["ecdsa-sha2-nistp256 AAAAE2VjZHNh", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5"]
    assert host_keys_from_console("no keys yet") == []


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
@pytest.mark.timeout(420)
def test_a_job_on_spot_instances_morphs_on_imds_notice_loss_and_new_capacity(ec2, moto, tmp_path, caplog):
    from test_manager import EVERY, steps_redone, tiny_job, wait_morphs, wait_step
    from ssh_hosts import SSHDHosts, procs_left
    from varuna_sdk.manager.decisions import GrowRule
    from varuna_sdk.manager.manager import Manager
    from varuna_sdk.manager.state import JobState

    caplog.set_level(logging.INFO)
    run = tmp_path / "run"
    hosts = SSHDHosts(tmp_path / "vms")
    backing = Backing(hosts, ec2)
    cfg = _config(ec2, instance_types=("c5.large",), user=hosts.user, python=sys.executable,
                  key_path=hosts.client_key, on_demand_per_hour=0.085)
    provider = AWSSpotProvider(cfg, job_id="ec2-job", target=2, endpoint_url=moto.url, reach=backing.reach,
                               poll_s=1.0)
    # 2 VMs: on this 2-core testbed a third adds no speed, so the grow onto a replacement is
    # predicted only after a shrink to 1
    mgr = Manager(tiny_job(3000, P=1, D=2), provider, run_dir=run, job_id="ec2-job", heartbeat_interval_s=1.0,
                  stop_timeout_s=60, grow=GrowRule(min_gain=1.1, cooldown_s=0.0), straggler=None, drift=None,
                  wait_for_hosts_s=120,
                  generation_options={"sink": None, "remote_run_dir": str(run), "notice_poll_s": 1.0})
    try:
        provider.start()
        deadline = time.time() + 60
        while len(provider.hosts()) < 2 and time.time() < deadline:
            time.sleep(0.5)
        assert len(provider.hosts()) == 2, provider.hosts()
        assert {h.labels["price_per_hour"] for h in provider.hosts()} == {"1e-05"}   # moto's spot price history
        mgr.start()
        wait_step(run, 2, 150, generation=0)
        noticed = sorted(h.name for h in provider.hosts())[-1]
        t_notice = time.time()
        notice_deadline = backing.metadata(noticed).announce(lead_s=120.0)      # the IMDS notice
        notice = wait_morphs(mgr, 1, 150)[0]
        ec2.terminate_instances(InstanceIds=[noticed])                         # ... AWS takes the VM
        grow = wait_morphs(mgr, 2, 150)[1]                                     # the replacement joins
        victim = grow["new"]["hosts"][-1]
        ec2.terminate_instances(InstanceIds=[victim])                          # lost without notice
        loss = wait_morphs(mgr, 3, 150)[2]
        wait_step(run, loss["from_step"] + 2, 120)                             # trained past what it lost
        mgr.cancel()
        assert mgr.wait(120) == JobState.STOPPED, (mgr.state, mgr.error)
    finally:
        mgr.cancel()
        mgr.wait(60)
        provider.close()
        backing.close()
        hosts.close()
    assert (notice["cause"], notice["host"], notice["steps_lost"]) == ("notice", noticed, 0), notice
    assert noticed not in notice["new"]["hosts"]
    assert notice["time"] - t_notice < 1.0 + 1.5 and notice["time"] + notice["downtime_s"] < notice_deadline
    assert grow["cause"] == "grow" and grow["steps_lost"] == 0, grow
    assert (loss["cause"], loss["host"]) == ("loss", victim) and 0 <= loss["steps_lost"] <= EVERY, loss
    # steps redone, counted from the metrics rows of each generation: none after the notice and the
    # grow; after the loss exactly what the manager counted lost (a later grow may split them), or
    # one fewer when the killed VM took its last step's row with it
    redone = steps_redone(run)
    assert redone[:2] == [0, 0] and loss["steps_lost"] - 1 <= sum(redone[2:]) <= loss["steps_lost"], (redone, loss)
    created = {i["InstanceId"] for r in ec2.describe_instances(Filters=[{"Name": "tag:varuna:job",
                                                                        "Values": ["ec2-job"]}])["Reservations"]
               for i in r["Instances"]}
    assert len(created) >= 4 and _live(ec2, "ec2-job") == []     # 2 + 2 replacements, all terminated
    assert not procs_left(str(tmp_path)), "a VM or worker was left running"
    # the cost field: every VM billed at moto's spot price history (1e-05 $/h) while held, against
    # the same VM-hours on demand
    from varuna_sdk.manager.billing import Billing, cost_text
    from varuna_sdk.manager.events import EventLog

    with EventLog.reader(run / "events.db") as log:
        bill = Billing.of(log.events())
        plans = [e.payload for e in log.events(kind="plan") if e.payload.get("rows")]
    cost = bill.cost(time.time())
    # the planner priced every plan it made on these VMs at the spot price history, not the example
    assert plans and all(p["prices"] == {"spot_per_gpu_hour": 1e-05, "on_demand_per_gpu_hour": 0.085,
                                         "vm_type": "c5.large", "example": False} for p in plans), plans[0]["prices"]
    for r in (r for p in plans for r in p["rows"] if r["feasible"]):
        assert r["cost_per_1k_spot"] == pytest.approx(1000 / r["examples_per_s"] / 3600 * r["P"] * r["D"] * 1e-05)
    assert len(bill.meters) >= 3 and cost["local"] is False and not cost["example"], cost
    assert 0 < cost["spent"] < cost["on_demand"] and cost["on_demand"] / cost["spent"] == pytest.approx(8500, rel=1e-3)
    assert "saves 100% vs on-demand" in cost_text(cost)
    secret = CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    assert secret not in caplog.text and secret.encode() not in (run / "events.db").read_bytes()


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
@pytest.mark.timeout(420)
def test_a_sigkilled_manager_restarted_adopts_its_instances_none_leaked_none_duplicated(ec2, moto, tmp_path):
    """The manager (``tests/_aws_manager.py``: ``varuna launch --provider aws``'s path in its own
    process) is SIGKILLed mid-job: its instances keep running (a crash cannot clean up), its
    workers stop at a boundary with a checkpoint; the same command started again adopts exactly
    those instances (no new request: none duplicated), continues the job without losing a step,
    finishes, and terminates every instance (none leaked), checked through the EC2 API."""
    import os
    import signal
    import subprocess

    from test_manager import steps_redone, tiny_job, wait_step
    from ssh_hosts import SSHDHosts, procs_left
    from varuna_sdk.manager.events import EventLog, Kind

    run = tmp_path / "ec2-restart"
    job = tmp_path / "job.yaml"
    tiny_job(50, P=1, D=2).to_yaml(job)
    hosts = SSHDHosts(tmp_path / "vms")
    backing = Backing(hosts, ec2, registry=tmp_path / "reach.json")
    cmd = [sys.executable, str(Path(__file__).with_name("_aws_manager.py")), str(job), str(run), moto.url,
           str(tmp_path / "reach.json"), _ami(ec2), str(hosts.client_key), hosts.user, "2"]
    first = subprocess.Popen(cmd, stdout=open(tmp_path / "first.log", "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        try:
            wait_step(run, 8, 200)
        except AssertionError:
            raise AssertionError((tmp_path / "first.log").read_text()[-3000:]) from None
        before = sorted(i["InstanceId"] for i in _live(ec2, run.name))
        os.killpg(first.pid, signal.SIGKILL)                  # the manager dies; nothing is cleaned up
        first.wait(10)
        assert sorted(i["InstanceId"] for i in _live(ec2, run.name)) == before and len(before) == 2
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        backing.close()
        hosts.close()
    said = second.stdout[-3000:] + second.stderr[-3000:]
    assert second.returncode == 0 and "SUCCEEDED" in second.stdout, said
    for iid in before:
        assert f"adopting instance {iid}" in second.stderr, said
    created = sorted(i["InstanceId"] for r in ec2.describe_instances(
        Filters=[{"Name": "tag:varuna:job", "Values": [run.name]}])["Reservations"] for i in r["Instances"])
    assert created == before, (created, before)                 # adopted, none requested again
    assert _live(ec2, run.name) == []                            # ... and all terminated at the end
    with EventLog.reader(run / "events.db") as log:
        morphs = [e.payload for e in log.events(kind=Kind.MORPH)]
    assert [m["cause"] for m in morphs] == ["manager_restart"] and morphs[0]["steps_lost"] == 0, morphs
    assert steps_redone(run) == [0]
    assert not procs_left(str(tmp_path)), "a VM or worker was left running"


def test_varuna_launch_provider_aws_refuses_bad_settings_with_exit_2(ec2, moto, tmp_path, capsys):
    """The first two cases run ``varuna launch`` as its own process (exit code 2, no traceback);
    the rest call the CLI's ``main`` in this process (the same code, ~3 s less each)."""
    import subprocess

    from test_manager import tiny_job
    from varuna_sdk.cli import main

    job = tmp_path / "job.yaml"
    tiny_job(10).to_yaml(job)
    varuna = [sys.executable, "-m", "varuna_sdk.cli", "launch", str(job), "--provider", "aws",
              "--endpoint-url", moto.url]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("region: us-east-1\ninstance_types: [g5.xlarge\nami: x\n")
    (tmp_path / "a-file").write_text("in the way")
    cases = [
        ([], "--provider aws needs --run-dir"),
        (["--run-dir", str(tmp_path / "r1"), "--region", REGION, "--instance-type", "p9.mega", "--ami", _ami(ec2)],
         "instance type 'p9.mega' is not offered in us-east-1"),
        (["--run-dir", str(tmp_path / "r2"), "--region", REGION, "--instance-type", "c5.large"], "ami is missing"),
        (["--run-dir", str(tmp_path / "r3"), "--job-id", "other", "--region", REGION, "--instance-type", "c5.large",
          "--ami", _ami(ec2)], "--job-id other is not the run folder's name ('r3')"),
        (["--run-dir", str(tmp_path / "bad name"), "--region", REGION, "--instance-type", "c5.large",
          "--ami", _ami(ec2)], "job_id 'bad name': 1-128 letters"),
        (["--run-dir", str(tmp_path / "r4"), "--instances", "0"], "--instances 0: give the number of spot instances"),
        (["--run-dir", str(tmp_path / "r5"), "--aws", str(tmp_path / "none.yaml")], "none.yaml: cannot read it"),
        (["--run-dir", str(tmp_path / "r6"), "--aws", str(bad_yaml)], "bad.yaml: not valid YAML at line 3"),
        # the run folder is checked before an instance is requested (and billed)
        (["--run-dir", str(tmp_path / "a-file" / "r8"), "--region", REGION, "--instance-type", "c5.large",
          "--ami", _ami(ec2)], "a-file', a file, not a folder"),
    ]
    for i, (extra, said) in enumerate(cases):
        if i < 2:
            r = subprocess.run(varuna + extra, capture_output=True, text=True, timeout=120)
            code, out, err = r.returncode, r.stdout, r.stderr
        else:
            code = main(varuna[3:] + extra)
            out, err = capsys.readouterr()
        assert code == 2 and said in err, (extra, code, err[-2000:])
        assert "Traceback" not in err and CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in err + out
    aws_log = logging.getLogger("varuna_sdk.cluster.aws")     # the CLI's stderr lines, not for later tests
    for h in [h for h in aws_log.handlers if getattr(h, "_varuna", False)]:
        aws_log.removeHandler(h)
    assert _live(ec2) == []
