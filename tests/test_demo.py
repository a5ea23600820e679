"""``varuna demo``'s spot scenario without training (``varuna_sdk.demo``): the trace it replays ships
with the SDK (byte-identical to the shared copy, with its licence), the demo's slice replayed on
real local slots gives exactly the VM events the demo promises (a notice, a VM back, three sudden
losses, a VM back) and nothing before the replay is started, bad input is refused before anything
starts, and the morph table shows what the manager recorded. The full demo (~4 min) is
``make demo``."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from varuna_sdk.cli import demo_config as cli_demo_config
from varuna_sdk.config import ConfigError
from varuna_sdk.demo import DEMO_SLICE, TRACES_DIR, demo_config, morph_table, run_spot_demo, trace_path



def test_the_demo_trace_ships_with_the_sdk_and_its_licence():
    p = trace_path(DEMO_SLICE.file)
    assert p.parent == TRACES_DIR and p.stat().st_size > 7000
    assert "MIT License" in (TRACES_DIR / "LICENSE-bamboo-traces").read_text()
    with pytest.raises(FileNotFoundError, match="aws-p3-trace.csv"):
        trace_path("no-such-trace.csv")
    assert cli_demo_config is demo_config  # `from varuna_sdk.cli import demo_config` keeps working


@pytest.mark.timeout(60)
def test_demo_slice_replays_the_promised_vm_events_on_local_slots():
    """The demo's slice at 470x (2 s) with a 0.2 s notice: held until begin_replay, then the events
    of trace lines 211-221 on local0..local3, the removals at 21240 s without notice."""
    fast = dataclasses.replace(DEMO_SLICE, compress=470.0, notice_s=0.2)
    emu = fast.emulator(backend="local", hold=True)
    seen, lock = [], threading.Lock()
    emu.subscribe(lambda e: (lock.acquire(), seen.append(e), lock.release()))
    try:
        emu.start()
        assert [h.name for h in emu.hosts()] == ["local0", "local1", "local2", "local3"]
        assert [emu.node_of(f"local{i}") for i in range(4)] == ["node39", "node50", "node55", "node60"]
        time.sleep(1.0)
        assert [e.kind for e in seen] == ["added"] * 4  # held: nothing replayed yet
        t0 = emu.begin_replay()
        deadline = time.time() + 20
        while len(seen) < 11 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        got = [(e.kind, e.host.name) for e in seen[4:]]
        assert got == [("notice", "local2"), ("removed", "local2"), ("added", "local2"),
                       ("removed", "local1"), ("removed", "local3"), ("removed", "local2"),
                       ("added", "local1")], seen
        notice = seen[4]
        assert notice.lead_s == pytest.approx(0.2, abs=0.05) and "node55" in notice.reason
        removal = seen[5].time - t0
        assert removal == pytest.approx(fast.wall_s(20760.0), abs=0.3)   # trace time 20760 s
        assert sorted(h.name for h in emu.hosts()) == ["local0", "local1"]
    finally:
        emu.close()
    assert emu.removed_count == 4


def test_bad_demo_input_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="no removal at 21000"):
        dataclasses.replace(DEMO_SLICE, sudden_at_s=(21000.0,)).load()
    job = demo_config()
    job.parallel.P, job.parallel.D = 4, 2
    with pytest.raises(ConfigError, match="holds at most 4 VMs"):
        run_spot_demo(job, run_dir=tmp_path / "run", out=lambda s: None)
    assert not (tmp_path / "run").exists()


def test_morph_table_shows_cause_plans_downtime_and_steps_lost():
    old = {"P": 2, "D": 2, "gpus": 4, "micro_batch_size": 8, "hosts": ["local0", "local1", "local2", "local3"]}
    new = {"P": 1, "D": 2, "gpus": 2, "micro_batch_size": 8, "hosts": ["local0", "local1"]}
    text = morph_table([{"time": 1018.6, "cause": "notice", "host": "local2", "old": old, "new": new,
                         "downtime_s": 9.34, "steps_lost": 0, "resume_step": 10},
                        {"time": 1097.5, "cause": "loss", "host": "local1", "old": new, "new": None,
                         "downtime_s": None, "steps_lost": 4, "resume_step": 50}], t0=1000.0)
    lines = text.splitlines()
    assert lines[0].split() [:4] == ["#", "time", "cause", "VM"] and set(lines[1]) == {"-"}
    assert "18.6 s" in lines[2] and "notice" in lines[2] and "P=2 x D=2 (4 workers) -> P=1 x D=2 (2 workers)" in lines[2]
    assert "local0,local1,local2,local3 -> local0,local1" in lines[2] and "9.3 s" in lines[2]
    assert lines[3].split()[-4:] == ["-", "4", "step", "50"]
    assert morph_table([]) == "(no morph)"


def test_a_continued_demo_tables_its_own_morphs_and_counts_the_earlier_ones():
    """A continued ``varuna demo`` held its first run's morphs in the summary and tabled them at
    negative times against the new replay ("-21.0 s", helper-66): they are counted and said apart."""
    from varuna_sdk.demo import SpotDemoResult, print_spot_result, split_morphs

    plan = {"P": 1, "D": 1, "gpus": 1, "micro_batch_size": 4, "hosts": ["local0"]}
    before = {"time": 979.0, "cause": "notice", "host": "local2", "old": plan, "new": plan, "downtime_s": 4.8,
              "steps_lost": 0, "resume_step": 10}
    after = {**before, "time": 1012.0, "cause": "loss", "steps_lost": 2}
    mine, earlier = split_morphs([before, after], t_start=1000.0)
    assert mine == [after] and earlier == 1
    lines: list[str] = []
    print_spot_result(SpotDemoResult(state="SUCCEEDED", morphs=mine, run_dir=Path("/r"), t0=1005.0,
                                     earlier_morphs=earlier), out=lines.append)
    text = "\n".join(lines)
    assert "-26.0 s" not in text and "7.0 s" in text, text   # the earlier one is 26 s before this replay
    assert "whose 1 earlier morph(s) are not above (`varuna status /r` lists every morph" in text, text


def test_a_demo_whose_vms_came_back_without_a_grow_says_why(tmp_path):
    """VMs came back and the job stayed (the planner's predicted gain under the rule's 1.10x):
    the report said nothing of it (helper-66's own job never grew); it says the manager's reason,
    read from the run's event log."""
    from varuna_sdk.demo import SpotDemoResult, print_spot_result
    from varuna_sdk.manager.events import EventLog, Kind

    log = EventLog(tmp_path / "events.db")
    log.append(Kind.GROW_DECISION, job_id="j", payload={"current_examples_per_s": 10.0, "new_examples_per_s": 10.7,
                                                        "decision": "stay", "min_gain": 1.1,
                                                        "why": "gain 1.07x below 1.10x"})
    log.close()
    lines: list[str] = []
    res = SpotDemoResult(state="SUCCEEDED", morphs=[], run_dir=tmp_path, t0=0.0,
                         vm_events=[(3.0, "notice", "local2", ""), (20.0, "added", "local2", "")])
    print_spot_result(res, out=lines.append)
    assert ("[demo] VMs came back but the job did not grow onto them: VMs free: a plan on them would run 10.7 "
            "examples/s against 10 now: stay (gain 1.07x below 1.10x)") in lines, lines
