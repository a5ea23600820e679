"""``varuna plan`` as a user runs it: the placement it assumes, a P/D/boundaries fixed in the job
config (the run ``varuna train`` would make, compared with the best), a profile of another model,
bad flags, and the exit status when nothing fits. Real subprocesses of the CLI; synthetic profiles
(no calibration). The numbers are checked against ``plan()`` called in this process."""

from __future__ import annotations

import os

import pytest

from test_planner import HEAVY, _cli, _job, plan, synthetic_profile  # _job's config: recompute true, as plan


@pytest.fixture
def files(tmp_path):
    prof = synthetic_profile(HEAVY, param_bytes=4e8)  # 8 segments = the tiny GPT-2 with 6 blocks of _job
    path = tmp_path / "profile.json"
    prof.to_json(path)

    def config(**parallel):
        cfg = tmp_path / f"job-{len(list(tmp_path.glob('job-*')))}.yaml"
        _job(**parallel).to_yaml(cfg)
        return str(cfg)

    return prof, str(path), config


def test_fixed_P_and_D_are_reported_as_the_run_train_makes(files):
    prof, path, config = files
    out = _cli("plan", config(P=2, D=2), "--gpus", "4", "--profile", path)
    assert out.returncode == 0, out.stderr[-2000:]
    best = plan(prof, 4, 32, shared_egress=True).best  # VMs: one egress link per worker, as the manager plans
    # train runs a configured P x D at the config's micro-batch size (_job: 1): so does this row
    kept = next(r for r in plan(prof, 4, 32, max_depth=2, replicas=2, shared_egress=True,
                                micro_batch_sizes=[1]).feasible if r.P == 2)
    line = next(ln for ln in out.stdout.splitlines()
                if ln.startswith("with parallel.P=2, parallel.D=2, parallel.micro_batch_size=1 from the config"))
    assert f"P=2 D=2 micro-batch {kept.micro_batch_size} (m={kept.m})" in line
    from varuna_sdk.planner.rows import format_duration   # as the table writes times (2.51 s, not 2510.0 ms)

    assert f"{format_duration(kept.time_s)} per mini-batch" in line and f"({kept.time_s / best.time_s:.2f}x" in line
    # nothing fixed: no such line; the placement assumed is said either way
    out = _cli("plan", config(), "--gpus", "4", "--profile", path)
    assert out.returncode == 0 and "with parallel." not in out.stdout
    assert "placement: 1 GPU(s) per VM" in out.stdout and "--local" in out.stdout


def test_local_plans_like_train_does(files):
    prof, path, config = files
    out = _cli("plan", config(), "--gpus", "4", "--profile", path, "--local")
    assert out.returncode == 0, out.stderr[-2000:]
    cores = os.cpu_count() or 1
    assert f"4 local workers sharing this machine's {cores} cores" in out.stdout
    local = plan(prof, 4, 32, gpus_per_vm=4, compute_slots_per_vm=cores).best
    first = out.stdout.splitlines()[2].split()
    assert first[:3] == ["1", str(local.P), str(local.D)]


def test_vms_are_planned_with_one_egress_link_per_worker_unless_told_per_pair_links(tmp_path):
    """On VMs a worker's activations (to the next stage) and gradients (to the one before) leave by
    one link, as the manager plans VMs: the table is ``plan(shared_egress=True)``'s, and
    ``--per-pair-links`` gives ``plan()``'s per-pair links; on a slow network they differ."""
    prof = synthetic_profile(HEAVY, out_bytes=4e6)  # heavy messages: links matter at P > 2
    path = tmp_path / "profile.json"
    prof.to_json(path)
    cfg = tmp_path / "job.yaml"
    _job(P=4, D=1).to_yaml(cfg)
    args = ("plan", str(cfg), "--gpus", "4", "--profile", str(path), "--bandwidth-gbps", "0.2")
    shared = plan(prof, 4, 32, max_depth=4, replicas=1, network_bandwidth_Bps=0.2e9 / 8, shared_egress=True)
    pairs = plan(prof, 4, 32, max_depth=4, replicas=1, network_bandwidth_Bps=0.2e9 / 8)
    r_shared = next(r for r in shared.feasible if r.P == 4)
    r_pairs = next(r for r in pairs.feasible if r.P == 4)
    assert r_shared.time_s > r_pairs.time_s * 1.01  # the test means something: the models differ here
    for flags, row, says in (((), r_shared, "leaving its VM by one link"),
                             (("--per-pair-links",), r_pairs, "a network link per pair")):
        out = _cli(*args, *flags)
        assert out.returncode == 0, out.stderr[-2000:]
        assert says in out.stdout
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("with parallel.P=4"))
        from varuna_sdk.planner.rows import format_duration

        assert f"{format_duration(row.time_s)} per mini-batch" in line   # the table's units


def test_profile_of_another_model_is_refused(files, tmp_path):
    _, _, config = files
    other = tmp_path / "other.json"
    synthetic_profile([1] * 5).to_json(other)  # 5 segments: not the job's 8
    out = _cli("plan", config(), "--gpus", "4", "--profile", str(other))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "5 cut-point segments" in out.stderr and "has 8" in out.stderr and "varuna calibrate" in out.stderr


@pytest.mark.parametrize("flags,says", [
    (["--gpus", "0"], "--gpus 0 must be >= 1"),
    (["--gpus", "4", "--global-batch", "0"], "--global-batch 0 must be >= 1"),
    (["--gpus", "4", "--gpus-per-vm", "0"], "--gpus-per-vm 0 must be >= 1"),
    (["--gpus", "4", "--spot-price", "-1"], "--spot-price -1.0 must be a finite number >= 0"),
    (["--gpus", "4", "--bandwidth-gbps", "0"], "--bandwidth-gbps 0.0 must be a finite number > 0"),
    (["--gpus", "4", "--target-examples", "-5"], "--target-examples -5 must be >= 1"),
    (["--gpus", "4", "--local", "--per-pair-links"], "--per-pair-links applies to VMs"),
])
def test_bad_flags_fail_before_any_work(files, flags, says):
    _, path, config = files
    out = _cli("plan", config(), "--profile", path, *flags)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_nothing_fits_exits_1(files):
    _, path, config = files
    # 3 GPUs: plans exist (P=1 D=2 ...), but none with the config's P=2 x D=2 = 4 workers
    out = _cli("plan", config(P=2, D=2), "--gpus", "3", "--profile", path)
    assert out.returncode == 1 and "no feasible plan keeps parallel.P=2, parallel.D=2" in out.stderr
    assert "P=2 x D=2 needs 4 GPUs, more than --gpus 3" in out.stderr, out.stderr   # why (helper-61)


def test_memory_gib_plans_recompute_per_stage_as_plan_does(tmp_path):
    """``varuna plan --memory-gib`` is ``plan(memory_limit_bytes=...)``: with a limit under which
    some stages must recompute, the table's ``recompute`` column and the best row's per-stage
    reasons are the planner's; a limit <= 0 is refused before planning."""
    from varuna_sdk.planner.plan import plan as plan_any

    prof = synthetic_profile(HEAVY)  # light parameters: activations decide
    path = tmp_path / "light.json"
    prof.to_json(path)
    job = _job()
    job.parallel.recompute = None  # the default: per stage
    cfg = tmp_path / "auto.yaml"
    job.to_yaml(cfg)
    free = plan_any(prof, 4, 32, shared_egress=True).best
    gib = next(f * max(free.stage_memory_bytes) / 2**30 for f in (0.9, 0.7, 0.5, 0.4, 0.3, 0.25, 0.2)
               if plan_any(prof, 4, 32, memory_limit_bytes=f * max(free.stage_memory_bytes),
                           shared_egress=True).best.recompute_label != "none")
    best = plan_any(prof, 4, 32, memory_limit_bytes=round(gib, 6) * 2**30, shared_egress=True).best
    out = _cli("plan", str(cfg), "--gpus", "4", "--profile", str(path), "--memory-gib", f"{gib:.6f}")
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.splitlines()[2]
    first = line.split()
    assert first[1:4] == [str(best.P), str(best.D), str(best.micro_batch_size)]
    assert f"  {best.recompute_label}  " in line and best.recompute_label.startswith(("stage", "all"))
    for s, why in enumerate(best.recompute_why):
        assert f"rank 1, stage {s}: {why}" in out.stdout
    bad = _cli("plan", str(cfg), "--gpus", "4", "--profile", str(path), "--memory-gib", "0")
    assert bad.returncode == 2 and "--memory-gib 0.0 must be a finite number > 0" in bad.stderr


def test_plan_checks_the_config_as_train_does(tmp_path):
    """A config field out of range is refused by ``varuna plan`` before anything is planned (exit 2,
    the field named), as ``varuna train`` refuses it."""
    prof = synthetic_profile(HEAVY)
    path = tmp_path / "p.json"
    prof.to_json(path)
    cfg = tmp_path / "bad.yaml"
    _job(P=2).to_yaml(cfg)
    text = cfg.read_text()
    assert "max_in_flight: null" in text
    cfg.write_text(text.replace("max_in_flight: null", "max_in_flight: [-1, 0]"))
    out = _cli("plan", str(cfg), "--gpus", "4", "--profile", str(path))
    assert out.returncode == 2 and "parallel.max_in_flight" in out.stderr, (out.returncode, out.stderr[-500:])


def _cli_here(capsys, *argv: str):
    """``varuna ARGV`` run in this process (the planner needs no worker): (exit code, stdout, stderr)."""
    from varuna_sdk.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_configs_in_flight_ceiling_and_split_are_planned_as_train_plans_them(tmp_path, capsys):
    """``parallel.max_in_flight: 2`` (the user's ceiling) and ``split_backward`` in the config: the
    row printed for the kept P is the one ``plan_for_job`` (what ``varuna train`` runs) gives, caps
    and all; before, ``varuna plan`` dropped both (5012.0 ms as train plans it, 4988.2 ms printed)."""
    from varuna_sdk.planner.plan import plan_for_job

    prof = synthetic_profile(HEAVY)
    path = tmp_path / "profile.json"
    prof.to_json(path)
    job = _job(P=4, gpus=8)
    job.parallel.recompute, job.parallel.max_in_flight, job.parallel.split_backward = None, 2, False
    cfg = tmp_path / "job.yaml"
    job.to_yaml(cfg)
    _, pl = plan_for_job(job, prof, micro_batch_sizes=[1])
    row = next(r for r in pl.feasible if r.P == 4)
    assert row.max_in_flight and max(row.max_in_flight) <= 2 and not row.split_backward
    rc, stdout, stderr = _cli_here(capsys, "plan", str(cfg), "--gpus", "8", "--profile", str(path), "--local")
    assert rc == 0, stderr[-2000:]
    line = next(ln for ln in stdout.splitlines() if ln.startswith("with parallel.P=4"))
    from varuna_sdk.planner.rows import format_duration

    assert f"P=4 D={row.D} micro-batch 1 (m={row.m}), {format_duration(row.time_s)} per mini-batch" in line, line


def test_a_kept_micro_batch_that_cannot_divide_the_batch_is_said_so_not_a_crash(tmp_path, capsys):
    """``--global-batch 15`` with the config's micro-batch 4: the search's candidates have no
    micro-batch, and the cut-point refinement looked theirs up ("varuna: 0 is not in list", rc 2,
    helper-42); now the kept row is refused with the reason; so is a P beyond the segments."""
    prof = synthetic_profile(HEAVY)
    path = tmp_path / "profile.json"
    prof.to_json(path)
    job = _job(P=2, D=1, gpus=2)
    job.parallel.micro_batch_size = 4
    cfg = tmp_path / "job.yaml"
    job.to_yaml(cfg)
    rc, _, stderr = _cli_here(capsys, "plan", str(cfg), "--gpus", "2", "--profile", str(path), "--global-batch", "15")
    assert rc == 1 and "not in list" not in stderr, stderr[-2000:]
    assert "no feasible plan keeps parallel.P=2" in stderr and "divides the replica batch 15" in stderr
    job.parallel.P = 9
    job.to_yaml(cfg)
    rc, _, stderr = _cli_here(capsys, "plan", str(cfg), "--gpus", "9", "--profile", str(path))
    assert rc in (1, 2) and "at most 8" in stderr, stderr[-2000:]


def _profile_measured_on(job, **settings):
    """A synthetic profile (8 segments: the tiny GPT-2 of ``_job``) that records what a calibration
    of ``job`` records of its model (identity) and inputs (per-example shapes, precision), then
    ``settings`` over the profile's fields (``data_read_s``)."""
    import json

    from varuna_sdk.profiling.job import profile_inputs
    from varuna_sdk.trainer import resolve

    r = resolve(job.validate())
    prof = synthetic_profile(HEAVY, param_bytes=4e8)
    prof.model.update(identity=json.loads(json.dumps(r.spec.identity, default=str)), **profile_inputs(job, r))
    for k, v in settings.items():
        setattr(prof, k, v)
    return prof


@pytest.mark.timeout(120)
def test_a_profile_of_other_inputs_is_refused_and_one_of_the_same_inputs_reused(tmp_path, capsys):
    """A profile saved from a job of the same model but another sequence length (or precision) was
    accepted: its times are for other micro-batches (the tester's plan said 9.1 ms per step for a
    job that takes 330 ms). Now refused, naming what differs and the calibration to run; a profile
    of the same model and input shapes is reused."""
    path = tmp_path / "profile.json"
    _profile_measured_on(_job()).to_json(path)          # seq_len 32, fp32
    longer = _job()
    longer.data.seq_len = 64                             # the same model (block_size 64): other inputs
    cfg = tmp_path / "longer.yaml"
    longer.to_yaml(cfg)
    rc, out, err = _cli_here(capsys, "plan", str(cfg), "--gpus", "4", "--profile", str(path))
    assert rc == 2 and "Traceback" not in err and not out, err[-2000:]
    assert "was measured on other inputs than this job's" in err, err
    assert ("input 'input_ids': torch.int64 of shape [32] per example in the profile, torch.int64 of shape [64] "
            "per example in the job") in err, err
    assert f"calibrate this job with `varuna calibrate {cfg} -o PROFILE.json`" in err, err
    assert "another model" not in err, err
    bf16 = _job()
    bf16.train.precision = "bf16"
    bf16.to_yaml(cfg)
    rc, _, err = _cli_here(capsys, "plan", str(cfg), "--gpus", "4", "--profile", str(path))
    assert rc == 2 and "precision fp32 in the profile, bf16 in the job" in err, err
    # the same model and inputs (another global batch, another P: not inputs): reused
    same = _job(P=2)
    same.parallel.global_batch = 64
    same.to_yaml(cfg)
    rc, out, err = _cli_here(capsys, "plan", str(cfg), "--gpus", "4", "--profile", str(path))
    assert rc == 0 and "plan for G=4 GPUs, global batch 64" in out, err[-2000:]


@pytest.mark.timeout(120)
def test_a_reused_profile_times_this_jobs_data_reads(tmp_path, capsys):
    """A profile file holds the data read time of the job it was made from (a fast dataset, or a slow
    one); planning another job of the same model and shapes from it timed the other job's reads
    with it. Now they are timed again on this job's data, as a cached calibration's are: a profile
    saying 2 s per example (a slow store) plans this job's in-memory tokens as one saying 0 does."""
    job = _job()
    cfg = tmp_path / "job.yaml"
    job.to_yaml(cfg)
    path = tmp_path / "profile.json"
    rows = {}
    for read_s in (2.0, 0.0):
        _profile_measured_on(job, data_read_s=read_s).to_json(path)
        rc, out, err = _cli_here(capsys, "plan", str(cfg), "--gpus", "4", "--profile", str(path))
        assert rc == 0, err[-2000:]
        rows[read_s] = out.splitlines()[2]
    assert rows[2.0] == rows[0.0], rows
    # the test means something: planned with the reads it holds, the profile's best plan is 6x slower
    slow, fast = (plan(_profile_measured_on(job, data_read_s=s), 4, 32, shared_egress=True).best.time_s
                  for s in (2.0, 0.0))
    assert slow > 5 * fast and f"{fast:.2f} s" in rows[0.0], (slow, fast, rows)


@pytest.mark.timeout(120)
def test_a_profile_without_recorded_inputs_is_reused_with_a_warning(tmp_path, capsys):
    """A calibration saved before the inputs were recorded cannot be checked: it is used (as
    before), with a warning saying so and how to calibrate this job."""
    job = _job()
    cfg = tmp_path / "job.yaml"
    job.to_yaml(cfg)
    old = _profile_measured_on(job)
    del old.model["inputs"], old.model["precision"]
    path = tmp_path / "old.json"
    old.to_json(path)
    with pytest.warns(UserWarning, match=r"does not record the input shapes it was measured on .* `varuna calibrate "):
        rc, _, err = _cli_here(capsys, "plan", str(cfg), "--gpus", "4", "--profile", str(path))
    assert rc == 0, err[-2000:]


@pytest.mark.timeout(120)
def test_a_saved_calibration_records_the_inputs_it_was_measured_on(tmp_path):
    """``calibrate_job`` records the per-example input shapes and the precision in the profile's
    ``model`` (what ``varuna plan --profile`` checks); a cached calibration from before they were
    recorded gets them from its cache key, which holds them."""
    from varuna_sdk.profiling.job import calibrate_job, profile_inputs, profile_key
    from varuna_sdk.trainer import resolve

    job = _job().validate()
    r = resolve(job)
    cached = synthetic_profile(HEAVY, param_bytes=4e8)   # a cache file without them
    cached.to_json(tmp_path / f"{profile_key(job, r)}.json")
    prof = calibrate_job(job, cache_dir=tmp_path, resolved=r)
    assert {k: prof.model.get(k) for k in ("inputs", "precision")} == profile_inputs(job, r)
    assert prof.model["inputs"]["input_ids"] == [[32], "torch.int64"] and prof.model["precision"] == "fp32"


def test_rows_left_as_searched_are_refined_with_refine_and_the_notes_name_the_flags(tmp_path):
    """Under a memory limit, depths that cannot beat the best row are left as searched (``*``); the
    command line's notes name its own flags (``--top N``, ``--refine P``; they named the Python
    calls ``table(top=N)``, ``plan.refine(P)``), and ``--refine P`` prints that row refined exactly
    as ``Plan.refine(P)`` refines it in Python; a depth the plan has no row of is refused."""
    from test_planner import _cli_here
    from varuna_sdk.planner.plan import plan as plan_any

    prof = synthetic_profile(HEAVY)
    path = tmp_path / "light.json"
    prof.to_json(path)
    job = _job()
    job.parallel.recompute = None
    cfg = tmp_path / "auto.yaml"
    job.to_yaml(cfg)
    limit = 0.5 * max(plan_any(prof, 8, 32, shared_egress=True).best.stage_memory_bytes)
    gib = f"{limit / 2**30:.9f}"
    ref = plan_any(prof, 8, 32, memory_limit_bytes=float(gib) * 2**30, shared_egress=True)
    raw = [r.P for r in ref.feasible if not r.refined]
    assert raw, "no depth left as searched: the test's limit no longer makes one"
    r = _cli_here("plan", str(cfg), "--gpus", "8", "--profile", str(path), "--memory-gib", gib, "--top", "2")
    assert r.returncode == 0, r.stderr
    assert f"(--top {len(ref.feasible)} shows all)" in r.stdout and "table(top=" not in r.stdout, r.stdout
    r = _cli_here("plan", str(cfg), "--gpus", "8", "--profile", str(path), "--memory-gib", gib,
                               "--top", "20")
    assert r.returncode == 0 and "--refine P refines one" in r.stdout and "plan.refine" not in r.stdout, r.stdout
    P = raw[0]
    got = ref.refine(P)
    r = _cli_here("plan", str(cfg), "--gpus", "8", "--profile", str(path), "--memory-gib", gib,
                               "--top", "20", "--refine", str(P))
    assert r.returncode == 0, r.stderr
    rank = [r.P for r in ref.feasible].index(P) + 1 if got.feasible else None
    if rank is not None:
        line = next(ln for ln in r.stdout.splitlines() if ln.split()[:2] == [str(rank), str(P)])
        assert f"  {got.recompute_label}  " in line and "*" not in line, line
        # and says what came of it (it was silent: helper-68)
        assert f"--refine {P}: refined per stage: recompute {got.recompute_label}" in r.stdout, r.stdout
    best = ref.best.P
    r = _cli_here("plan", str(cfg), "--gpus", "8", "--profile", str(path), "--memory-gib", gib, "--refine", str(best))
    assert r.returncode == 0 and f"--refine {best}: the row of P={best} was refined per stage already" in r.stdout
    r = _cli_here("plan", str(cfg), "--gpus", "8", "--profile", str(path), "--memory-gib", gib,
                               "--refine", "99")
    assert r.returncode == 2 and "--refine 99: this plan has no row of depth P=99" in r.stderr, (r.stdout, r.stderr)
