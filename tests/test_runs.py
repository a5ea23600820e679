"""The morph record's pure parts and its sentence: downtime phases from the times each phase
ended, the planner's candidates from a real plan, and the sentence built from them (tolerant of
old or malformed payloads). No processes."""

from __future__ import annotations

import pytest

from varuna_sdk.manager.events import Event, Kind
from varuna_sdk.manager.state import MORPH_PHASES, MorphRecord, morph_phases, plan_candidates
from varuna_sdk.manager.runs import event_sentence, morph_sentence


def test_phases_are_measured_from_each_previous_end_and_sum_to_the_downtime():
    rec = MorphRecord(time=100.0, cause="notice", old={"P": 2, "D": 2}, host="vm3")
    rec.mark("stop", 102.5)
    rec.mark("stop", 109.0, first_only=True)      # a retried launch does not move the stop's end
    rec.mark("replan", 103.0)                      # no wait for VMs: that phase is 0 s
    rec.mark("start_workers", 104.25)
    rec.close(first_step_time=107.0)
    assert rec.downtime_s == pytest.approx(7.0)
    assert rec.phases_s == {"stop": 2.5, "wait_for_vms": 0.0, "replan": 0.5, "start_workers": 1.25, "first_step": 2.75}
    assert sum(rec.phases_s.values()) == pytest.approx(rec.downtime_s)
    assert "marks" not in rec.to_dict() and list(rec.to_dict()["phases_s"]) == list(MORPH_PHASES)
    # a clock that steps back never gives a negative phase
    assert min(morph_phases(10.0, {"stop": 9.0, "replan": 12.0}).values()) >= 0.0


def test_candidates_come_from_the_plan_fastest_first_with_the_chosen_one_marked():
    from dashboard_writer import GLOBAL_BATCH, profile
    from varuna_sdk.planner.plan import plan

    pl = plan(profile(), 4, GLOBAL_BATCH)
    cands, n = plan_candidates(pl, pl.best)
    assert n == len(pl.feasible) and 1 <= len(cands) <= 3
    rates = [c["examples_per_s"] for c in cands]
    assert rates == sorted(rates, reverse=True)
    assert cands[0]["chosen"] and (cands[0]["P"], cands[0]["D"]) == (pl.best.P, pl.best.D)
    assert len({(c["P"], c["D"]) for c in cands}) == len(cands)        # one row per P x D
    slowest = min(pl.feasible, key=lambda r: r.examples_per_s)           # a kept configured plan is listed
    cands2, _ = plan_candidates(pl, slowest)
    assert [c for c in cands2 if c["chosen"]][0]["P"] == slowest.P and not cands2[0]["chosen"]
    assert plan_candidates(None, None) == ([], 0)


def test_the_sentence_says_vm_cause_choice_phases_and_what_was_lost():
    m = {"time": 1030.0, "cause": "loss", "host": "vm2", "old": {"P": 2, "D": 2, "hosts": ["vm0", "vm1", "vm2"]},
         "new": {"P": 1, "D": 2, "hosts": ["vm0", "vm1"]}, "downtime_s": 9.0, "steps_lost": 3, "resume_step": 40,
         "phases_s": {"stop": 4.0, "wait_for_vms": 0.0, "replan": 0.5, "start_workers": 1.5, "first_step": 3.0},
         "candidates": [{"P": 1, "D": 2, "examples_per_s": 8.0, "chosen": True},
                        {"P": 2, "D": 1, "examples_per_s": 6.5, "chosen": False}], "feasible_plans": 5}
    s = morph_sentence(m, t0=1000.0)
    assert s.startswith("at 30 s: VM vm2 was lost without notice; re-planned P=2 x D=2 on vm0, vm1, vm2 -> "
                        "P=1 x D=2 on vm0, vm1"), s
    assert "(the fastest predicted of 5 feasible plan(s): P=1 x D=2 8.0 ex/s (chosen); P=2 x D=1 6.5 ex/s)" in s
    assert ", 9.0 s down (stop 4.0 s, re-plan 0.5 s, start workers 1.5 s, resume + first step 3.0 s)" in s
    assert s.endswith("3 step(s) redone: resumed from the checkpoint of step 40"), s
    # a restarted job's first plan keeps the config's fixed D: the plans compared are those, not all
    kept = morph_sentence({**m, "cause": "manager_restart", "kept": {"D": 1}, "feasible_plans": 2,
                           "candidates": [{"P": 2, "D": 1, "examples_per_s": 11.8, "chosen": True},
                                          {"P": 1, "D": 1, "examples_per_s": 7.6, "chosen": False}]})
    assert ("(the config's parallel.D=1 kept (null lets the planner choose), of 2 feasible plan(s) compared: "
            "P=2 x D=1 11.8 ex/s (chosen); P=1 x D=1 7.6 ex/s)") in kept, kept
    # a payload from before phases and candidates were recorded, or a mangled one, still reads
    old = morph_sentence({"cause": "notice", "host": "vm1", "old": {"P": 2, "D": 1}, "new": {"P": 1, "D": 1},
                          "downtime_s": 5.0, "resume_step": 7, "candidates": [{"P": "x"}], "phases_s": {"stop": "?"}})
    assert old == "VM vm1 got a pre-emption notice; re-planned P=2 x D=1 -> P=1 x D=1, 5.0 s down; nothing lost: resumed at step 7"
    e = Event(id=1, time=0.0, job_id="j", kind=Kind.MORPH, host="vm2", rank=None, payload=m)
    assert event_sentence(e).startswith("morph: VM vm2 was lost without notice")


def test_the_drift_sentence_says_how_far_why_and_the_recalibrated_estimate():
    from varuna_sdk.manager.runs import drift_sentence

    p = {"generation": 0, "drift": 0.42, "steps": 5, "predicted_step_s": 0.2, "measured_step_s": 0.284,
         "recalibrated_step_s": 0.27, "recalibrated_examples_per_s": 29.6, "calibrated_at": 1000.0,
         "calibrated_on": "cpu", "load_1min": 3.4, "cpu_count": 2, "workers_here": 4}
    s = drift_sentence(p, now=1000.0 + 7200)
    assert s.startswith("measured step 0.284 s is 42% slower than predicted 0.200 s for 5 steps — "), s
    assert "calibrated 2.0 h ago on cpu" in s and "load was 3.4 on 2 cores with 4 workers (busier than its cores" in s
    assert s.endswith("re-calibrated from the job's heartbeats: 0.270 s per step (29.6 examples/s), which later "
                      "morphs plan from"), s
    assert drift_sentence({"drift": -0.3}).startswith("steps run 30% faster than predicted")
    assert drift_sentence({"drift": "x"}) == "the step time left the prediction"


def test_a_log_tail_is_whole_lines_within_the_budget(tmp_path):
    from varuna_sdk.manager.runs import log_tail

    f = tmp_path / "workers.log"
    f.write_bytes(b"".join(b"line %05d \xff\n" % i for i in range(10_000)))   # 12 bytes a line, one not UTF-8
    tail = log_tail(f, max_bytes=1000)
    lines = tail.splitlines()
    assert lines[-1] == "line 09999 \ufffd" and len(tail.encode()) <= 1000 + 2 * len(lines)
    assert all(x.startswith("line ") and len(x) == 12 for x in lines), lines[:2]   # no cut first line
    assert log_tail(tmp_path / "missing.log") == "" and log_tail(f, 10**9).count("\n") == 10_000


def test_a_job_is_alive_while_a_manager_holds_its_run_folder(tmp_path):
    """``jobs_alive_beside``: the cloud provider's reaping asks whether a job of this owner still
    runs; it does while a manager holds the lock of the run folder named after it (beside this
    one), and not once the lock is released, nor for a job with no folder at all."""
    import os

    from varuna_sdk.manager.runs import acquire_run_lock, jobs_alive_beside

    (tmp_path / "live").mkdir()
    (tmp_path / "over").mkdir()
    alive = jobs_alive_beside(tmp_path / "me")
    fd = acquire_run_lock(tmp_path / "live")
    try:
        assert alive("live") and not alive("over") and not alive("never-ran")
    finally:
        os.close(fd)
    assert not alive("live")


def test_a_run_whose_manager_died_counts_the_steps_its_workers_wrote_themselves(tmp_path):
    """The manager was killed (no lock holder) while RUNNING; its orphaned workers trained on and
    wrote ``metrics.jsonl`` rows it never heard of: ``read_run`` counts those steps (the event log
    alone said 1 of 60 with an ETA, after the workers had finished all 60)."""
    import json

    from varuna_sdk.manager.events import EventLog
    from varuna_sdk.manager.runs import read_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train: {steps: 60}\n")
    with EventLog(run / "events.db") as log:
        log.append(Kind.JOB_STATE, job_id="j", payload={"state": "RUNNING", "previous": "PROVISIONING"})
        log.append_metric(0, {"step": 0, "loss": 5.0, "step_time_s": 0.1}, job_id="j")
    assert read_run(run).steps_done == 1
    rows = [json.dumps({"step": s, "loss": 5.0 - s / 100}) for s in range(60)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n" + '{"step": 6')   # a torn last line is skipped
    info = read_run(run)
    assert info.orphaned and info.steps_done == 60 and info.eta_s == 0, info


def _orphaned_run(run, generation: int = 0) -> None:
    """A run folder whose manager died (no lock holder) while RUNNING generation ``generation``."""
    from varuna_sdk.manager.events import EventLog

    run.mkdir()
    (run / "config.yaml").write_text("train: {steps: 60}\n")
    with EventLog(run / "events.db") as log:
        log.append(Kind.JOB_STATE, job_id="j", payload={"state": "RUNNING", "previous": "PROVISIONING",
                                                        "reason": f"generation {generation}: P=2 x D=1"})
        for g in range(generation + 1):
            if g:
                log.append(Kind.GENERATION_ENDED, job_id="j", payload={"generation": g - 1})
            log.append(Kind.GENERATION_STARTED, job_id="j", payload={"generation": g, "P": 2, "D": 1})
        log.append_metric(0, {"step": 0, "loss": 5.0, "step_time_s": 0.1}, job_id="j")


def test_a_run_whose_orphaned_workers_stopped_by_themselves_is_stopped_with_how_to_continue(tmp_path):
    """The manager was killed; its workers stopped by themselves with a checkpoint and wrote
    ``outcome.json`` ("stopped", generation 0): ``read_run`` says STOPPED (no manager), the step and
    the checkpoint, the command that continues the job, and no ETA — it said "RUNNING (no manager)
    ... ETA 22 s" for ever (helper trial). An outcome of an earlier generation is not this one's."""
    import json

    from varuna_sdk.manager.runs import read_run

    run = tmp_path / "run"
    _orphaned_run(run)
    rows = [json.dumps({"step": s, "loss": 5.0}) for s in range(21)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    info = read_run(run)
    assert info.state == "RUNNING" and info.orphaned and info.eta_s is not None   # the workers may run on
    (run / "outcome.json").write_text(json.dumps({"status": "stopped", "step": 21, "generation": 0,
                                                  "checkpoint": "step-00000021-ab"}))
    info = read_run(run)
    assert info.state == "STOPPED" and not info.active and not info.orphaned, info
    assert info.state_text == "STOPPED (no manager)" and info.eta_s is None and info.steps_done == 21
    assert "stopped by themselves after step 21 with a checkpoint (step-00000021-ab)" in info.reason, info.reason
    assert f"`varuna launch {run / 'config.yaml'} --run-dir {run}`" in info.reason, info.reason
    assert info.last_event.startswith("its workers stopped by themselves after step 21")
    (run / "outcome.json").write_text(json.dumps({"status": "completed", "step": 60, "generation": 0}))
    info = read_run(run)
    assert (info.state, info.steps_done, info.eta_s) == ("SUCCEEDED", 60, None), info

    old = tmp_path / "old"   # generation 1 runs orphaned; generation 0's outcome says nothing of it
    _orphaned_run(old, generation=1)
    (old / "outcome.json").write_text(json.dumps({"status": "stopped", "step": 21, "generation": 0}))
    assert read_run(old).state_text == "RUNNING (no manager)"


def test_worker_logs_put_what_workers_wrote_themselves_after_their_generations_log(tmp_path):
    """A worker whose manager died writes its output itself, to ``gen<g>/worker-<rank>.log``
    (``worker.own_log``): ``varuna logs`` lists it right after that generation's ``workers.log`` and
    before the next generation's (they came after every generation's, out of order), ranks in
    numeric order, labelled as written after the manager was gone; files of older workers in the
    run folder itself come last."""
    from varuna_sdk.manager.runs import log_label, worker_logs
    from varuna_sdk.worker import own_log

    run = tmp_path / "run"
    assert own_log(run, {"VARUNA_GENERATION": "0", "RANK": "1"}) == run / "gen0" / "worker-1.log"
    assert own_log(run, {"RANK": "1"}) == run / "worker-1.log"
    for f in ("gen0/workers.log", "gen0/worker-10.log", "gen0/worker-2.log", "gen1/workers.log",
              "gen10/workers.log", "worker-0.log"):
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text("x\n")
    got = [str(p.relative_to(run)) for p in worker_logs(run)]
    assert got == ["gen0/workers.log", "gen0/worker-2.log", "gen0/worker-10.log", "gen1/workers.log",
                   "gen10/workers.log", "worker-0.log"], got
    assert [log_label(p) for p in worker_logs(run)][:2] == ["gen0", "gen0 rank 2, after the manager was gone"]


def test_a_worker_replays_what_its_dead_manager_may_not_have_saved_and_logs_shows_it_once(tmp_path):
    """A worker's output goes to its manager through a pipe; the lines still in the pipe when the
    manager is killed are lost with it (steps 145-150 were missing from ``varuna logs``, helper
    trial). On the first failed write the worker's stream replays what it last sent into its own
    log, between marker lines; ``OwnLogFilter`` hides the markers and the replayed lines the
    manager saved in ``workers.log`` (for that rank), so each line shows once."""
    from varuna_sdk.manager.results import LOG_ONLY, SENT_BEFORE, SENT_END
    from varuna_sdk.manager.runs import OwnLogFilter
    from varuna_sdk.worker import _OutputThatSurvives

    class Pipe:   # the manager reads lines 1-3 (saved in workers.log), then dies with 4 and 5 unread
        def __init__(self):
            self.dead = False

        def write(self, text):
            if self.dead:
                raise BrokenPipeError(32, "Broken pipe")
            return len(text)

        def flush(self):
            pass

    gen = tmp_path / "gen0"
    gen.mkdir()
    (gen / "workers.log").write_text("".join(f"[local0 rank 0] step {i}\n" for i in (1, 2, 3))
                                     + "[local1 rank 1] step 4\n")
    pipe = Pipe()
    out = _OutputThatSurvives(pipe, gen / "worker-0.log")
    for i in (1, 2, 3, 4):
        print(f"step {i}", file=out)
    print(f"{LOG_ONLY}step 5", file=out)
    pipe.dead = True
    print("step 6", file=out)
    text = (gen / "worker-0.log").read_text()
    assert text == (f"{SENT_BEFORE}\nstep 1\nstep 2\nstep 3\nstep 4\nstep 5\n{SENT_END}\nstep 6\n"), text
    keep = OwnLogFilter(gen / "worker-0.log").keep
    assert [ln for ln in text.splitlines() if keep(ln)] == ["step 4", "step 5", "step 6"]

    small = _OutputThatSurvives(Pipe(), tmp_path / "w.log")   # only the last KEPT_BYTES, whole lines
    small.KEPT_BYTES = 10
    for i in range(5):
        small.write(f"line {i}\n")
    small._stream.dead = True
    small.write("after\n")
    assert (tmp_path / "w.log").read_text() == f"{SENT_BEFORE}\nline 4\n{SENT_END}\nafter\n"
    cut = _OutputThatSurvives(Pipe(), tmp_path / "cut.log")   # print() writes a line's text and its newline apart
    cut.KEPT_BYTES = 8
    for piece in ("abcdef", "\n", "gh", "\n"):
        cut.write(piece)
    cut._stream.dead = True
    cut.write("after\n")
    assert (tmp_path / "cut.log").read_text() == f"{SENT_BEFORE}\ngh\n{SENT_END}\nafter\n"


def test_a_plan_is_said_with_how_it_ranks_and_the_slots_it_leaves_idle():
    """The PLAN event's sentence says whether the plan is the fastest predicted (and the next one),
    or, where the config fixed it, which was; and the pool's slots it leaves idle. A payload
    without a table says the plan alone."""
    rows = [{"P": 1, "D": 1, "micro_batch_size": 8, "examples_per_s": 2018.7, "feasible": True},
            {"P": 2, "D": 1, "micro_batch_size": 8, "examples_per_s": 1325.2, "feasible": True},
            {"P": 3, "D": 1, "micro_batch_size": 8, "examples_per_s": 0.0, "feasible": False}]
    base = {"generation": 0, "P": 1, "D": 1, "micro_batch_size": 8, "num_micro_batches": 1, "hosts": ["local0"],
            "predicted_step_s": 0.004, "gpus": 1, "pool_gpus": 2, "rows": rows}
    said = event_sentence(Event(1, 0.0, "j", Kind.PLAN, None, None, base))
    assert said == ("plan for generation 0: P=1 x D=1 on local0, micro-batch 8 x 1, predicted 0.004 s per step (the "
                    "fastest predicted of the 2 depths that fit; the next, P=2 x D=1, 1325.2 ex/s against 2018.7; 1 of "
                    "the pool's 2 worker slots left idle)"), said
    # what the plan was held to (the config's P and D, the kept micro-batch) is said: the table ranked one
    # row per depth under them, and "2 feasible" read as every plan there is (helper-68)
    fixed = {**base, "P": 2, "gpus": 2, "hosts": ["local0", "local1"], "held": {"P": 2, "micro_batch_size": 8}}
    said = event_sentence(Event(1, 0.0, "j", Kind.PLAN, None, None, fixed))
    assert said.endswith("(as the config fixes it; the fastest predicted of the 2 depths that fit (keeping P=2, "
                         "micro-batch=8) is P=1 x D=1 at 2018.7 ex/s against 1325.2)"), said
    bare = {k: v for k, v in base.items() if k not in ("rows", "pool_gpus")}
    assert event_sentence(Event(1, 0.0, "j", Kind.PLAN, None, None, bare)).endswith("0.004 s per step")


def test_the_narrator_says_the_events_a_run_appends_after_it_started(tmp_path):
    """``Narrator`` (the console of ``varuna launch``/``train``) says each new event of its kinds
    once, in order, from a real event log written beside it; events from before it started (a
    continued run's) and other kinds are not said."""
    import time

    from varuna_sdk.manager.events import EventLog
    from varuna_sdk.manager.runs import Narrator

    log = EventLog(tmp_path / "events.db")
    try:
        log.append(Kind.PREEMPTION_NOTICE, job_id="j", host="old", payload={"lead_s": 30})   # before: not said
        lines: list[str] = []
        with Narrator(tmp_path, lines.append, poll_s=0.05):
            log.append(Kind.CHECKPOINT, job_id="j", payload={"step": 3})                      # not narrated
            log.append(Kind.PREEMPTION_NOTICE, job_id="j", host="vm2", payload={"lead_s": 30})
            deadline = time.time() + 10
            while not lines and time.time() < deadline:
                time.sleep(0.05)
            log.append(Kind.HOST_LOST, job_id="j", host="vm3", payload={"reason": "heartbeats stopped"})
        assert lines == ["[varuna] VM vm2 will be pre-empted in 30 s", "[varuna] VM vm3 lost (heartbeats stopped)"]
    finally:
        log.close()
