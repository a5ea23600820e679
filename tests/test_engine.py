"""Multi-process tests of the training engine (``Varuna.step``) against single-process PyTorch.

Every multi-process job runs in real ``spawn``-ed processes over gloo (``pipeline.spawn.
spawn_workers``). To pay the torch import once per world size, all jobs of one world size run
one after another in the same workers (``_workers.suite_worker``); each test reads its job's
per-rank results. Rank layout: ``rank = replica * P + stage``.

The reference is a plain PyTorch loop on the whole model (``_workers.reference_train``): same
weights, gradient accumulation over the same micro-batches (global index j = replica·m + i, each
forward under ``segment_rng(seed, step, j)``), loss / (m·D), ``clip_grad_norm_``, AdamW.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch

import _workers as W
from varuna_sdk.pipeline.spawn import WorkerFailure, spawn_workers
from varuna_sdk.config import ParallelConfig
from varuna_sdk.pipeline.engine import Varuna, split_batch

RTOL, ATOL = 1e-5, 1e-7
CLIP = 0.05  # far below the tiny model's gradient norm (~0.5-1), so clipping is active every step


def job(name, P, D=1, *, b, G, steps=3, kind="gpt2", model=None, policy="varuna", shared_params=None,
        split=None, recompute=None, caps=None, **opts):
    par = dict(P=P, D=D, global_batch=G, micro_batch_size=b, policy=policy)
    if shared_params is not None:
        par["shared_params"] = shared_params
    if split is not None:
        par["split_backward"] = split
    if recompute is not None:
        par["recompute"] = recompute
    if caps is not None:
        par["max_in_flight"] = caps
    return {"name": name, "kind": kind, "par": par, "model": model or {}, "steps": steps, "opts": opts}


# (P, D, m) per equivalence job; m = G / (b·D). fp32, dropout 0.1, GPT-2 bias=False, 3 blocks.
EQUIV_JOBS = [
    job("eq_p1_m2", 1, b=2, G=4),
    job("eq_p2_m1", 2, b=2, G=2),                         # m < P
    job("eq_p2_m4", 2, b=1, G=4, eval=True),
    job("eq_p2_m4_1f1b", 2, b=1, G=4, policy="1f1b"),
    job("eq_p3_m2", 3, b=2, G=4),                         # m < P
    job("eq_p3_m5", 3, b=1, G=5),                         # m not a multiple of P
    job("eq_p4_m1", 4, b=2, G=2),                         # m = 1
    job("eq_p4_m2", 4, b=2, G=4),                         # m < P
    job("eq_p4_m3_gpipe", 4, b=1, G=3, policy="gpipe"),
    job("eq_p2d2_m2", 2, 2, b=2, G=8, eval=True),         # P=2 × D=2
    job("mixed_p2_xms", 2, b=2, G=4, kind="mixed", model={"order": "xms"}),
    job("mixed_p2_mxs", 2, b=2, G=4, kind="mixed", model={"order": "mxs"}),
    job("mixed_p3_mxs", 3, b=2, G=4, kind="mixed", model={"order": "mxs"}),
    job("mixed_p3_xms", 3, b=1, G=4, kind="mixed", model={"order": "xms"}),
    job("nested_p3", 3, b=2, G=4, kind="nested"),         # cut-points inside sub-modules
    job("nested_p4", 4, b=1, G=4, kind="nested"),
    # the zero-bubble split (B = input gradient, W = weight gradients, deferred): same numbers
    job("zb_p1_m2", 1, b=2, G=4, split=True),
    job("zb_p2_m4", 2, b=1, G=4, split=True),
    job("zb_p2_m4_norc", 2, b=1, G=4, split=True, recompute=False),
    job("zb_p3_m5", 3, b=1, G=5, split=True),
    job("zb_p4_m3_norc", 4, b=1, G=3, split=True, recompute=False),
    job("zb_p2d2_m2", 2, 2, b=2, G=8, split=True),
    job("zb_mixed_p3_mxs", 3, b=2, G=4, kind="mixed", model={"order": "mxs"}, split=True),
    job("zb_nested_p3", 3, b=2, G=4, kind="nested", split=True),
    # recompute per stage and in-flight caps (the planner's memory choice): same numbers
    job("cap_p3_m5", 3, b=1, G=5, recompute=[True, False, False], caps=[0, 1, 0]),
    job("cap_p4_m6", 4, b=1, G=6, recompute=[False, True, False, False], caps=[2, 0, 1, 0]),
    job("zb_cap_p3_m5", 3, b=1, G=5, split=True, recompute=[False, False, False], caps=[2, 1, 0]),
]
CLIP_JOBS = [
    job("clip_p1", 1, b=2, G=4, clip=CLIP),
    job("clip_p2", 2, b=2, G=4, clip=CLIP),
    job("clip_p4", 4, b=2, G=4, clip=CLIP),
    job("zb_clip_p2", 2, b=2, G=4, clip=CLIP, split=True),
]
OTHER_JOBS = [
    job("tied_p3", 3, b=1, G=4, steps=10),
    job("inf_fp16", 2, b=2, G=4, steps=4, precision="fp16", loss_scale=1024.0, inject_inf=(2, 0), history=True),
    job("inf_fp32", 2, b=2, G=4, steps=3, inject_inf=(1, 1), history=True),
    job("zb_inf_fp16", 2, b=2, G=4, steps=4, precision="fp16", loss_scale=1024.0, inject_inf=(2, 0), history=True,
        split=True),
    job("bf16", 2, b=2, G=4, steps=6, model={"dropout": 0.0}, precision="bf16", repeat_batch=True, lr=1e-2),
    {**job("err_leaky", 2, b=2, G=4, kind="leaky"), "expect_error": True},
    {**job("err_declared", 2, b=2, G=4, shared_params=[]), "expect_error": True},
]
ALL_JOBS = {j["name"]: j for j in EQUIV_JOBS + CLIP_JOBS + OTHER_JOBS}


def world_of(j: dict) -> int:
    return j["par"]["P"] * j["par"].get("D", 1)


@pytest.fixture(scope="module")
def results(run_suite):
    """``results(name) -> [per-rank result]``; runs every job of that world size on first use
    (world 1 in this process, others in spawned workers) and caches the outcome (or error)."""
    cache: dict[int, object] = {}

    def get(name: str) -> list[dict]:
        world = world_of(ALL_JOBS[name])
        if world not in cache:
            jobs = [j for j in ALL_JOBS.values() if world_of(j) == world]
            try:
                if world == 1:
                    cache[world] = {j["name"]: [W.run_job(0, j)] for j in jobs}
                else:
                    cache[world] = run_suite(world, jobs, timeout_s=150)
            except Exception as e:  # noqa: BLE001 - re-raised for every test of this world
                cache[world] = e
        got = cache[world]
        if isinstance(got, Exception):
            raise got
        return got[name]

    return get


@pytest.fixture(scope="module")
def reference():
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = W.reference_train(ALL_JOBS[name])
        return cache[name]

    return get


def assert_matches_reference(name: str, ranks: list[dict], ref: dict) -> None:
    j = ALL_JOBS[name]
    P, D = j["par"]["P"], j["par"].get("D", 1)
    assert [(r["stage"], r["replica"]) for r in ranks] == [(rk % P, rk // P) for rk in range(P * D)]
    for rk, r in enumerate(ranks):
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name} rank {rk} losses: {m}")
        torch.testing.assert_close(r["norms"], ref["norms"], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name} rank {rk} grad norms: {m}")
        assert not r["skipped"].any()
        for pname, val in r["params"].items():
            torch.testing.assert_close(val, ref["params"][pname], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name} rank {rk} parameter {pname}: {m}")
    for d in range(D):
        held = [set(ranks[d * P + s]["params"]) for s in range(P)]
        assert set().union(*held) == set(ref["params"]), f"{name}: replica {d} does not hold every parameter"
        assert all(held), f"{name}: a stage holds no parameters"
    for s in range(P):  # data-parallel replicas stay bit-identical
        for d in range(1, D):
            a, b = ranks[s]["params"], ranks[d * P + s]["params"]
            assert a.keys() == b.keys()
            for pname in a:
                assert torch.equal(a[pname], b[pname]), f"{name}: stage {s} replica {d} {pname} drifted"


# ---------------------------------------------------------------------------------------------
# 1. equivalence with single-process training


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [j["name"] for j in EQUIV_JOBS + CLIP_JOBS])
def test_matches_single_process(name, results, reference):
    """Per-step losses, grad norms and every parameter after 3 AdamW steps equal the reference
    (rtol 1e-5), for P in 1..4, D in 1..2, m = 1, m < P, several policies, with dropout on, on
    GPT-2 and on a model whose stages exchange (float+grad, int64 mask, float without grad)."""
    assert_matches_reference(name, results(name), reference(name))


@pytest.mark.timeout(240)
def test_waiting_for_a_neighbour_is_timed_apart_from_compute(results):
    """``StepResult.wait_s``: the time a stage is blocked on an input. Stage 0 never waits for an
    activation and the last stage never for a gradient; every later stage waits for its first
    activation each step (it comes through the whole pipeline before it); compute and waiting
    together fit in the step."""
    ranks = results("eq_p4_m2")
    for r in ranks:
        sp, s = r["spent"], r["stage"]
        assert sp["compute_s"] > 0 and sp["compute_s"] + sp["wait_F"] + sp["wait_B"] <= sp["time_s"], (s, sp)
        if s == 0:
            assert sp["wait_F"] == 0.0, sp
        else:
            assert sp["wait_F"] > 0.0, (s, sp)
        if s == 3:
            assert sp["wait_B"] == 0.0, sp
        else:
            assert sp["wait_B"] > 0.0, (s, sp)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["cap_p3_m5", "cap_p4_m6", "zb_cap_p3_m5"])
def test_in_flight_cap_bounds_the_graphs_a_stage_holds(name, results):
    """A capped stage never holds more live activation graphs than its cap (with the split: until
    W), and an uncapped stage without recompute does hold more: the cap is what bounds it."""
    caps = ALL_JOBS[name]["par"]["max_in_flight"]
    for r in results(name):
        cap = caps[r["stage"]]
        # each step reports its own peak (StepResult.peak_live_graphs, in the metrics line), the
        # engine the peak over all steps
        assert max(r["step_peaks"]) == r["peak_live_graphs"] and min(r["step_peaks"]) >= 1, (name, r["step_peaks"])
        if cap:
            assert 1 <= r["peak_live_graphs"] <= cap, (name, r["stage"], r["peak_live_graphs"], cap)
    uncapped = [r["peak_live_graphs"] for r in results("zb_p2_m4_norc") if r["stage"] == 0]
    assert uncapped and uncapped[0] >= 2


@pytest.mark.parametrize("name", ["zb_p2_m4", "zb_p3_m5", "eq_p2_m4"])
def test_split_backward_runs_weight_work_apart(name, results):
    """With split_backward every rank spends time in W actions (the deferred weight gradients);
    without it none does — the equivalence above is then the split's, not a silent fallback."""
    split = ALL_JOBS[name]["par"].get("split_backward", False)
    for r in results(name):
        assert (r["spent"]["W"] > 0) == split, (name, r["stage"], r["spent"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["eq_p2d2_m2", "zb_p2d2_m2", "tied_p3"])
def test_gradient_all_reduce_starts_during_the_last_backward(name, results):
    """Every collective of the gradient sync (data-parallel buckets over the replicas, the tied
    embedding / LM-head sum over its stages) is launched from inside the step's last backward (or
    last W with the split backward) — none is left to start after it — and the numbers still
    match the single-process reference (test_matches_single_process, tied bit-identity)."""
    for r in results(name):
        steps = len(r["losses"])
        assert r["overlapped"] == steps * r["buckets"], (name, r["stage"], r["overlapped"], r["buckets"])
        assert r["buckets"] >= 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [j["name"] for j in CLIP_JOBS])
def test_clipped_grad_norm_is_clip_grad_norm_total(name, results, reference):
    """With clipping active, the reported norm is ``clip_grad_norm_``'s pre-clip total norm."""
    ref = reference(name)
    assert (ref["norms"] > CLIP * 2).all(), "clipping must be active for this test to mean anything"
    for r in results(name):
        torch.testing.assert_close(r["norms"], ref["norms"], rtol=RTOL, atol=0.0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["eq_p2_m4", "eq_p2d2_m2"])
def test_evaluate_matches_reference(name, results, reference):
    """``evaluate`` (dropout off, collective) gives the single-process eval loss on every rank."""
    ref = reference(name)["eval"]
    for r in results(name):
        assert r["eval"] == pytest.approx(ref, rel=RTOL)


# ---------------------------------------------------------------------------------------------
# 2. tied weights


@pytest.mark.timeout(240)
def test_tied_embedding_copies_stay_bitwise_identical(results, reference):
    """GPT-2 ``wte``/``lm_head`` live on stage 0 and stage 2 (P=3); after 10 steps the two copies
    are bit-identical, have moved from their initial value, and the run matches the reference."""
    ranks = results("tied_p3")
    first, last = ranks[0]["params"], ranks[2]["params"]
    assert "wte.weight" in first and "wte.weight" in last and "wte.weight" not in ranks[1]["params"]
    assert torch.equal(first["wte.weight"], last["wte.weight"])
    ref = reference("tied_p3")
    torch.testing.assert_close(ranks[0]["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(first["wte.weight"], ref["params"]["wte.weight"], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 5. non-finite gradients skip the step on every stage


def _assert_skipped_everywhere(ranks: list[dict], bad_step: int) -> None:
    steps = len(ranks[0]["losses"])
    for r in ranks:
        assert r["skipped"].tolist() == [s == bad_step for s in range(steps)], r["skipped"]
        assert math.isinf(r["norms"][bad_step].item())
        hist = r["history"]  # hist[k] = parameters before step k
        for pname in hist[0]:
            assert torch.equal(hist[bad_step][pname], hist[bad_step + 1][pname]), \
                f"stage {r['stage']}: {pname} changed in the skipped step"
        # clean steps do move the parameters
        for s in range(steps):
            if s != bad_step:
                assert any(not torch.equal(hist[s][n], hist[s + 1][n]) for n in hist[0]), f"step {s} did not update"
    losses = torch.stack([r["losses"] for r in ranks])
    assert torch.isfinite(losses).all() and (losses == losses[0]).all()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["inf_fp16", "zb_inf_fp16"])
def test_fp16_inf_in_one_stage_skips_step_everywhere_and_halves_scale(name, results):
    """An inf injected into stage 0's gradient at step 2 (fp16, P=2; whole and split backward):
    both ranks report skipped=True for that step only, no parameter on any stage changes in it,
    and the shared loss scale halves (1024 → 512) on every rank, then training continues."""
    ranks = results(name)
    _assert_skipped_everywhere(ranks, bad_step=2)
    for r in ranks:
        assert r["scales"].tolist() == [1024.0, 1024.0, 512.0, 512.0]


@pytest.mark.timeout(240)
def test_fp32_nonfinite_norm_skips_step_everywhere(results):
    """fp32 (no loss scaling): an inf in stage 1's gradient at step 1 skips that step on both
    stages; the scale stays 1."""
    ranks = results("inf_fp32")
    _assert_skipped_everywhere(ranks, bad_step=1)
    for r in ranks:
        assert (r["scales"] == 1.0).all()


# ---------------------------------------------------------------------------------------------
# 6. errors and bf16


@pytest.mark.timeout(240)
def test_engine_reports_tensor_skipping_cut_point_on_every_rank(results):
    """A tensor made in segment 0 and used in segment 2 without a cut-point, split over P=2:
    every rank raises PartitionError naming both segments, before any collective."""
    for r in results("err_leaky"):
        assert r["error_type"] == "PartitionError"
        msg = r["error"]
        assert "segment 0" in msg and "segment 2" in msg and "cut-point" in msg.lower(), msg


@pytest.mark.timeout(240)
def test_engine_rejects_undeclared_shared_parameter(results):
    """shared_params=[] (declared mode) with GPT-2's tied embedding on stages 0 and 1:
    PartitionError naming the parameter, the stages and the fix."""
    for r in results("err_declared"):
        assert r["error_type"] == "PartitionError"
        msg = r["error"]
        assert "'wte.weight'" in msg and "[0, 1]" in msg and "shared_params" in msg, msg


@pytest.mark.timeout(240)
def test_bf16_trains(results, reference):
    """bf16 autocast on P=2: losses finite, close to fp32 at step 0, decreasing on a repeated batch."""
    ranks = results("bf16")
    losses = ranks[0]["losses"]
    assert torch.isfinite(losses).all()
    assert all(torch.equal(r["losses"], losses) for r in ranks)
    assert not any(r["skipped"].any() for r in ranks)
    assert losses[0].item() == pytest.approx(reference("bf16")["losses"][0].item(), rel=2e-2)
    assert losses[-1] < losses[0] - 0.1, losses
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= len(losses) - 2, losses


def test_wrong_batch_size_raises_value_error():
    """step() takes the global batch or this replica's share; anything else is a ValueError
    naming both sizes (checked before any compute or communication)."""
    p = ParallelConfig(P=1, D=1, global_batch=4, micro_batch_size=2)
    eng = Varuna(lambda: W.gpt2(W.tiny_cfg(n_layer=2)), W.lm_loss, p, (torch.zeros(2, 8, dtype=torch.long),), seed=0)
    opt = torch.optim.AdamW(eng.parameters())
    before = {n: q.detach().clone() for n, q in eng.named_parameters()}
    x, y = W.make_batch(0, 3, 8)
    with pytest.raises(ValueError, match=r"3 examples.*global batch \(4\)"):
        eng.step((x, y), opt)
    assert all(torch.equal(before[n], q) for n, q in eng.named_parameters())
    x, y = W.make_batch(0, 4, 8)
    assert math.isfinite(eng.step((x, y), opt).loss)
    # D = 2: the replica share (4) or the global batch (8) are accepted, 6 is not
    inputs, targets = split_batch((torch.arange(8), torch.arange(8)), 8, 4, 1)
    assert inputs[0].tolist() == [4, 5, 6, 7] and targets.tolist() == [4, 5, 6, 7]
    inputs, targets = split_batch((torch.arange(4), torch.arange(4)), 8, 4, 1)
    assert targets.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"global batch \(8\).*share \(4"):
        split_batch((torch.arange(6), torch.arange(6)), 8, 4, 0)


def test_bad_precision_and_missing_process_group():
    p = ParallelConfig(P=1, global_batch=2, micro_batch_size=2)
    model_fn = lambda: W.gpt2(W.tiny_cfg(n_layer=2))  # noqa: E731
    sample = (torch.zeros(2, 8, dtype=torch.long),)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        Varuna(model_fn, W.lm_loss, p, sample, precision="fp8")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised with 2 ranks"):
        Varuna(model_fn, W.lm_loss, ParallelConfig(P=2, global_batch=2, micro_batch_size=2), sample)


# ---------------------------------------------------------------------------------------------
# 8. a failing worker


def _live_children(pattern: str, parent: int | None = None) -> list[int]:
    """Pids of the non-zombie children of ``parent`` (default: this process) whose command line
    contains ``pattern``."""
    me, out = parent or os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == me and fields[0] != "Z" and pattern in cmd:
            out.append(int(d.name))
    return out


def _workers_left() -> list[int]:
    """Live worker processes started by this process: spawned children, and children of its fork
    server (the server itself stays, idle, for the next ``spawn_workers``)."""
    return _live_children("spawn_main") + [p for server in _live_children("forkserver")
                                           for p in _live_children("", parent=server)]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not a zombie); the workers' parent is the fork server."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


@pytest.mark.timeout(90)
def test_failing_worker_reports_traceback_and_stops_everyone(tmp_path):
    """Rank 1 raises while rank 0 blocks in a barrier: spawn_workers raises WorkerFailure with
    rank 1's traceback soon (not after the 60 s collective timeout), and no worker is left."""
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as ei:
        spawn_workers(W.failing_worker, 2, args=(str(tmp_path), 1), timeout_s=60, work_dir=tmp_path, backend="gloo")
    elapsed = time.monotonic() - t0
    err = ei.value
    # rank 0 usually fails too (its barrier sees the connection close), so the headline may name
    # either rank; rank 1's own traceback must be in ``failures``.
    assert str(err).startswith("worker rank ") and "failed" in str(err)
    assert 1 in err.failures
    code, tb = err.failures[1]
    assert code == 1
    assert "Traceback" in tb and "ValueError: deliberate failure on rank 1" in tb and "failing_worker" in tb
    assert elapsed < 45, f"failure took {elapsed:.0f} s to surface"
    pids = [int(Path(tmp_path, f"pid{r}").read_text()) for r in range(2) if Path(tmp_path, f"pid{r}").exists()]
    assert pids, "workers never started"
    assert not [p for p in pids if _alive(p)], "a worker process is still alive"
    assert _workers_left() == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_get_the_callers_environment_folder_path_and_stdout(tmp_path, monkeypatch, capfd, method):
    """A process forked from the fork server (started, with its own environment, by an earlier
    call) has what a spawned one has: the caller's environment, working directory, ``sys.path``
    and stdout as they are at this call. ``VARUNA_SDK_START_METHOD=spawn`` spawns instead; any
    other value is refused before a process starts."""
    import json
    import sys

    (tmp_path / "before").mkdir()   # the fork server runs before the environment below is set
    spawn_workers(W.caller_state_worker, 1, args=(str(tmp_path / "before"),), timeout_s=60,
                  work_dir=tmp_path / "before", backend="gloo")
    monkeypatch.setenv("VARUNA_SDK_START_METHOD", method)
    monkeypatch.setenv("VARUNA_TEST_CALLER", f"set at the call ({method})")
    monkeypatch.setenv("VARUNA_TEST_PATH", str(tmp_path / "on-path"))
    monkeypatch.syspath_prepend(str(tmp_path / "on-path"))
    monkeypatch.chdir(tmp_path)
    spawn_workers(W.caller_state_worker, 2, args=(str(tmp_path),), timeout_s=60, work_dir=tmp_path, backend="gloo")
    for r in range(2):
        got = json.loads((tmp_path / f"state{r}.json").read_text())
        assert got["env"] == f"set at the call ({method})" and got["cwd"] == str(tmp_path) and got["path"], got
        assert ("forkserver" in got["parent"]) is (method == "forkserver"), got["parent"]
        assert ("forkserver" in got["parent"] or "pytest" in got["parent"] or sys.executable in got["parent"]), got
    out = capfd.readouterr().out
    assert "rank 0 writes to the caller's stdout" in out and "rank 1 writes to the caller's stdout" in out, out
    monkeypatch.setenv("VARUNA_SDK_START_METHOD", "fork")
    with pytest.raises(ValueError, match="VARUNA_SDK_START_METHOD='fork': use 'forkserver'"):
        spawn_workers(W.caller_state_worker, 1, args=(str(tmp_path),), work_dir=tmp_path, backend="gloo")


@pytest.mark.timeout(90)
def test_workers_of_a_killed_fork_server_are_stopped_and_the_next_call_starts_a_new_server(tmp_path):
    """The fork server SIGKILLed while its workers run: spawn_workers fails saying so, no worker is
    left running (they outlive the server; its death reports them exited), and the next call
    starts a fresh server."""
    import signal
    import threading

    spawn_workers(W.caller_state_worker, 1, args=(str(tmp_path),), timeout_s=60, work_dir=tmp_path, backend="gloo")
    server, = _live_children("forkserver")
    failure: list = []

    def run() -> None:
        try:
            spawn_workers(W.hanging_worker, 2, args=(str(tmp_path),), timeout_s=60, work_dir=tmp_path, backend="gloo")
        except WorkerFailure as e:
            failure.append(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    os.kill(server, signal.SIGKILL)
    t.join(30)
    assert failure and "fork server was killed" in str(failure[0]), failure
    assert not [p for p in pids if _alive(p)], "a worker of the killed fork server is still running"
    spawn_workers(W.caller_state_worker, 2, args=(str(tmp_path),), timeout_s=60, work_dir=tmp_path, backend="gloo")
    assert _live_children("forkserver") and _live_children("forkserver") != [server]


@pytest.mark.timeout(60)
def test_hanging_workers_are_stopped_at_the_timeout(tmp_path):
    """Workers that never finish: WorkerFailure after ``timeout_s`` and every worker is gone."""
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure, match="did not finish within 10 s"):
        spawn_workers(W.hanging_worker, 2, args=(str(tmp_path),), timeout_s=10, work_dir=tmp_path, backend="gloo")
    assert time.monotonic() - t0 < 25
    pids = [int(Path(tmp_path, f"pid{r}").read_text()) for r in range(2) if Path(tmp_path, f"pid{r}").exists()]
    assert not [p for p in pids if _alive(p)], "a worker process is still alive"
    assert _workers_left() == []


@pytest.mark.timeout(60)
def test_what_a_stopped_worker_started_is_stopped_too(tmp_path):
    """A worker that started a process of its own and hangs: at the timeout its process group is
    stopped, so its child is gone too (it ran on, re-parented, when only the worker was signalled)."""
    with pytest.raises(WorkerFailure, match="did not finish within 5 s"):
        spawn_workers(W.hanging_worker_with_a_child, 2, args=(str(tmp_path),), timeout_s=5, work_dir=tmp_path,
                      backend="gloo")
    kids = [int((tmp_path / f"child{r}").read_text()) for r in range(2) if (tmp_path / f"child{r}").exists()]
    assert len(kids) == 2, kids
    deadline = time.monotonic() + 5
    while [k for k in kids if _alive(k)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if _alive(k)], "a process a worker started is still running"


@pytest.mark.timeout(60)
def test_grad_sync_leaves_a_parameter_no_replica_used_without_gradient(tmp_path):
    """Over 2 replicas: a parameter used on both gets the mean, one used on one replica gets half
    its gradient (zeros on the other, as DDP), one used on neither keeps ``.grad = None`` (as plain
    PyTorch: AdamW skips it) on every replica."""
    spawn_workers(W.grad_sync_worker, 2, args=(str(tmp_path),), timeout_s=45, work_dir=tmp_path, backend="gloo")
    for r in range(2):
        g = torch.load(tmp_path / f"sync{r}.pt", weights_only=True)
        assert torch.equal(g["a"], torch.full((3,), 1.5))
        assert torch.equal(g["b"], torch.full((3,), 1.0))
        assert g["c"] is None


@pytest.mark.timeout(90)
def test_a_script_without_a_main_guard_gets_told_to_add_one(tmp_path):
    """A user script that starts workers at its top level (no ``if __name__ == "__main__":``):
    each spawned worker re-imports it and fails before its target runs; the error names the script
    and the guard, not "no traceback"."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from varuna_sdk.pipeline.spawn import spawn_workers\n"
        "def work(rank, world):\n"
        "    pass\n"
        f"spawn_workers(work, 2, timeout_s=40, work_dir={str(tmp_path)!r}, backend='gloo')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80, env=env,
                       cwd=tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("varuna_sdk.pipeline.spawn.WorkerFailure: worker rank"), r.stderr[-2000:]
    assert f"re-importing the main script {script}" in last and 'if __name__ == "__main__":' in last


def test_a_free_port_does_not_follow_the_global_random_generator():
    """A forward reseeds Python's global generator (``model.rng``: the same draws at any P), so a
    port drawn from it after a calibration was the same in every manager process of that model, and
    two jobs clashed (EADDRINUSE at the rendezvous: helper-68). Ports come from the OS's entropy."""
    import random

    from varuna_sdk.pipeline.spawn import free_port

    drawn = []
    for _ in range(4):
        random.seed(1234)   # what model.rng does before each segment's forward
        drawn.append(free_port())
    assert len(set(drawn)) > 1, drawn
