"""A job on three SSH test hosts ("VMs") learns of each pre-emption from inside the VM, as on a real
cloud: every VM has its own instance-metadata stand-in (vm0 AWS IMDSv2, vm1 GCP, vm2 Azure
Scheduled Events; ``SpotEmulator(notices="metadata")``), the emulator only makes the
metadata announce a notice (no provider event), and the first worker on each VM polls it
(``cluster.notice``) and tells the manager over the heartbeat channel.

Shown, for a GCP notice and then an Azure one (30 s ahead each; AWS's is in ``test_aws.py``): the job
starts P=1 x D=2 on vm0 and vm1; the manager
hears of it within a poll interval + 1 s, runs the notice morph — workers stop at a boundary with
a checkpoint, re-plan without that VM, resume — with 0 steps lost (counted from the metrics rows:
every step trained once, none skipped), training under the new plan before the notice's deadline;
the provider itself never announced a notice. Afterwards no VM (sshd) or worker is left.
"""

from __future__ import annotations

import time

import pytest

from ssh_hosts import skip_reason
from test_manager import steps_redone, tiny_job, wait_morphs, wait_step
from varuna_sdk.cluster.spot import SpotEmulator
from ssh_hosts import procs_left
from varuna_sdk.manager.decisions import GrowRule
from varuna_sdk.manager.events import EventLog, Kind
from varuna_sdk.manager.manager import Manager
from varuna_sdk.manager.state import JobState

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

POLL_S = 1.0
# (AWS's IMDSv2 notice morphs a job on EC2 spot instances in tests/test_aws.py)
NOTICES = [("vm1", "gcp", 30.0), ("vm2", "azure", 30.0)]


@pytest.mark.timeout(400)
def test_notices_read_inside_each_vm_morph_the_job_losing_nothing(tmp_path):
    run = tmp_path / "run"
    emu = SpotEmulator(capacity=3, backend="ssh", root=tmp_path / "vms", notice_s=None, notices="metadata",
                       cloud=("aws", "gcp", "azure"))
    mgr = Manager(tiny_job(1000, P=1, D=2), emu, run_dir=run, heartbeat_interval_s=1.0, stop_timeout_s=60,
                  grow=GrowRule(min_gain=1.1, cooldown_s=0.0), straggler=None, drift=None,
                  generation_options={"sink": None, "remote_run_dir": str(run), "notice_poll_s": POLL_S})
    provider_notices = []
    emu.subscribe(lambda e: provider_notices.append(e) if e.kind == "notice" else None)
    announced = {}
    try:
        emu.start()
        assert all(h.labels["env.VARUNA_METADATA_URL"].startswith("http://127.0.0.1:") for h in emu.hosts())
        mgr.start()
        wait_step(run, 2, 150, generation=0)
        for i, (vm, _cloud, lead) in enumerate(NOTICES, start=1):
            in_use = mgr.summary()["morphs"][-1]["new"]["hosts"] if i > 1 else ["vm0", "vm1"]
            assert vm in in_use, (vm, in_use)
            announced[vm] = (time.time(), emu.remove_now(vm, notice_s=lead))   # (when, deadline)
            wait_morphs(mgr, i, 150)
        morphs = mgr.summary()["morphs"]
        wait_step(run, morphs[-1]["resume_step"] + 2, 60)
        mgr.cancel()
        assert mgr.wait(120) == JobState.STOPPED, (mgr.state, mgr.error)
    finally:
        mgr.cancel()
        mgr.wait(60)
        emu.close()
    assert not provider_notices, "the provider announced a notice: this test is about the VM's own"
    with EventLog.reader(run / "events.db") as log:
        seen = [e for e in log.events(kind=Kind.PREEMPTION_NOTICE)]
    assert [(e.host, e.payload["cloud"], e.payload["source"]) for e in seen] == [
        (vm, cloud, "vm") for vm, cloud, _ in NOTICES], [(e.host, e.payload) for e in seen]
    morphs = mgr.summary()["morphs"]
    assert [m["cause"] for m in morphs] == ["notice"] * 2, morphs
    for (vm, cloud, lead), ev, m in zip(NOTICES, seen, morphs):
        t_announced, deadline = announced[vm]
        aware = ev.time - t_announced
        print(f"{cloud}: manager aware {aware:.2f} s after the notice; downtime {m['downtime_s']} s; "
              f"resumed {deadline - (m['time'] + m['downtime_s']):.1f} s before the deadline")
        assert aware < POLL_S + 1.0, (cloud, aware)
        assert abs(ev.payload["deadline"] - deadline) < (1.5 if cloud != "gcp" else 3.0), (cloud, ev.payload)
        assert m["host"] == vm and vm not in m["new"]["hosts"] and m["steps_lost"] == 0, m
        assert m["time"] + m["downtime_s"] < deadline, (cloud, m)
    assert morphs[-1]["new"]["hosts"] == ["vm0"]
    assert steps_redone(run) == [0, 0]
    assert not procs_left(str(tmp_path)), "a VM or worker was left running"
