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
    assert f"{kept.time_s * 1e3:.1f} ms" in line and f"({kept.time_s / best.time_s:.2f}x" in line
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
        assert f"{row.time_s * 1e3:.1f} ms per mini-batch" in line


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
    assert f"P=4 D={row.D} micro-batch 1 (m={row.m}), {row.time_s * 1e3:.1f} ms per mini-batch" in line, line


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
