"""Tests for the cost model that maps a calibration onto a placement where ranks share a machine
(``csrc/search.cpp`` evaluate, the simulator's time-shared compute slots, the new ``Profile``
figures): time-sharing of cores instead of queueing, the synchronisation phase stretched by the
sharing of a host (all-reduce CPU share, optimizer parallelism), compute interference, and the
α–β fits of the calibration. Synthetic numbers only; ``benchmarks/bench_sim_accuracy.py``
measures the real thing.
"""

from __future__ import annotations

import json

import pytest

from varuna_sdk import _core
from varuna_sdk.planner.plan import plan
from varuna_sdk.planner.simulate import SimInput, SimOutput, allreduce_time
from varuna_sdk.profiling.network import (compute_interference, crowded_mean, crowded_share, fit_alpha_beta,
                                         oversubscription)
from varuna_sdk.profiling.profile import NetworkProfile, Profile, SegmentProfile


def run(inp: SimInput, time_share: bool) -> SimOutput:
    cfg = inp.to_core()
    cfg.time_share_slots = time_share
    return SimOutput.from_core(_core.simulate(cfg), inp.record_timeline)


# ---- time-shared slots --------------------------------------------------------------------------
def test_time_shared_slots_stretch_actions_instead_of_queueing():
    m, f, b = 8, 1.0, 2.0
    inp = SimInput(P=2, m=m, fwd=f, bwd=b, policy="1f1b", ranks_per_host=2, compute_slots_per_host=1,
                   record_timeline=True)
    queued, shared = run(inp, False), run(inp, True)
    assert any(s.kind == "WAIT" for rank in queued.timeline for s in rank)
    assert not any(s.kind == "WAIT" for rank in shared.timeline for s in rank)
    # work is work: busy time is the compute, whatever the sharing
    assert shared.stage_busy == pytest.approx([m * (f + b)] * 2)
    # one core for both ranks: never faster than all their work one after the other
    assert shared.pipeline_time >= 2 * m * (f + b) - 1e-9
    # while both run, each action takes twice its work
    walls = [s.end - s.start for rank in shared.timeline for s in rank if s.kind in "FB"]
    assert max(walls) == pytest.approx(2 * b)
    # actions still start only when their inputs are there, in the scheduler's order
    for s, rank in enumerate(shared.timeline):
        acts = [x for x in rank if x.kind in "FB"]
        assert all(a.end <= c.start + 1e-12 for a, c in zip(acts, acts[1:]))


def test_time_sharing_without_contention_changes_nothing():
    inp = SimInput(P=3, m=6, D=2, fwd=[1.0, 0.5, 2.0], bwd=[2.0, 1.0, 3.0], ranks_per_host=3,
                   compute_slots_per_host=3, p2p_alpha=0.1)
    a, b = run(inp, False), run(inp, True)
    assert a.minibatch_time == b.minibatch_time and a.stage_busy == b.stage_busy


def test_time_sharing_slows_a_bottleneck_that_shares_its_core():
    # a heavy last stage and two light ones on two cores: queued, the light stages wait for the
    # free core; time-shared (as the OS does), they also take turns with the heavy stage
    inp = SimInput(P=3, m=8, fwd=[0.3, 0.3, 3.0], bwd=[0.6, 0.6, 4.0], ranks_per_host=3,
                   compute_slots_per_host=2)
    queued, shared = run(inp, False), run(inp, True)
    assert shared.minibatch_time > queued.minibatch_time


# ---- the planner's mapping ----------------------------------------------------------------------
def profile(opt_parallelism=0.0, ar_cpu_share=1.0, compute_interference=0.0, opt_s_per_param_byte=1e-9,
            param_bytes=100e6) -> Profile:
    segs = [SegmentProfile(fwd_s=[0.1], rec_s=[0.12], bwd_s=[0.2], out_bytes=[1e6], act_bytes=[4e6],
                           param_bytes=int(param_bytes / 2)) for _ in range(2)]
    net = NetworkProfile(p2p_alpha_s=1e-4, p2p_beta_Bps=1e9, ar_alpha_s=1e-4, ar_beta_Bps=1e9, consensus_s=1e-3,
                         ar_cpu_share=ar_cpu_share)
    return Profile(model={"num_segments": 2, "shared": []}, hardware={}, software={}, micro_batch_sizes=[1],
                   segments=segs, network=net, per_action_s=0.0, per_step_s=0.0,
                   opt_s_per_param_byte=opt_s_per_param_byte, opt_parallelism=opt_parallelism,
                   compute_interference=compute_interference)


def one_host(prof: Profile, P: int, D: int, slots: int) -> float:
    bounds = [[0, 1]] if P == 1 else [[0], [1]]
    row = plan(prof, P * D, 4 * D, boundaries=bounds, micro_batch_sizes=[1], gpus_per_vm=P * D,
               compute_slots_per_vm=slots, replicas=D).rows[0]
    assert (row.P, row.D) == (P, D)
    return row.time_s


def test_optimizer_steps_of_a_host_share_its_memory_bandwidth():
    # two replicas step their optimizers at once on a 2-core machine that sustains 1 (memory-bound)
    w = 1e-9 * 100e6  # one rank's end of step
    assert one_host(profile(opt_parallelism=1.0), 1, 2, 2) - one_host(profile(opt_parallelism=2.0), 1, 2, 2) == \
        pytest.approx(w, rel=1e-6)
    # unmeasured (0) = as many as the slots
    assert one_host(profile(opt_parallelism=0.0), 1, 2, 2) == one_host(profile(opt_parallelism=2.0), 1, 2, 2)
    # no compute slots (GPUs): no sharing at all
    assert one_host(profile(opt_parallelism=1.0), 1, 2, 0) == one_host(profile(opt_parallelism=2.0), 1, 2, 0)


def test_all_reduce_of_a_crowded_host_is_stretched_by_its_cpu_share():
    # 4 replicas all-reduce 100 MB among themselves on 2 cores: each keeps u of a core busy
    ar = allreduce_time(100e6, 4, 1e-4, 1e9)
    full, half = one_host(profile(ar_cpu_share=1.0), 1, 4, 2), one_host(profile(ar_cpu_share=0.5), 1, 4, 2)
    assert full - half == pytest.approx(ar * (oversubscription(4 * 1.0, 2) - oversubscription(4 * 0.5, 2)), rel=1e-6)
    # a share the cores can carry costs nothing extra: u·n = 2 cores' worth
    assert half == one_host(profile(ar_cpu_share=0.25), 1, 4, 2)


def test_crowded_share_is_fitted_where_the_gradient_buckets_are():
    from varuna_sdk.profiling.profile import ring_allreduce_s

    alpha, beta, cores = 1e-3, 1e9, 2

    def ring(n, b):
        return ring_allreduce_s(b, n, alpha, beta)

    # 4 participants on 2 cores, each keeping 0.62 of a core busy: the 32 MiB all-reduce is
    # stretched 1.24x; the 1 MiB one, latency-bound, ran faster than the ring model says (as
    # measured here: 0.86x) and must not drag u below the 0.5 at which crowding would vanish
    probes = [(4, 1 << 20, 0.86 * ring(4, 1 << 20)), (4, 8 << 20, 1.24 * ring(4, 8 << 20)),
              (4, 32 << 20, 1.24 * ring(4, 32 << 20))]
    u = crowded_share(probes, alpha, beta, cores)
    assert u == pytest.approx(0.62, abs=0.005)
    # what the planner then charges the 32 MiB all-reduce: the measured time, within 1 %
    assert ring(4, 32 << 20) * max(1.0, u * 4 / cores) == pytest.approx(probes[2][2], rel=0.01)
    exact = [(4, b, ring(4, b) * 0.7 * 4 / cores) for b in (1 << 20, 8 << 20, 32 << 20)]
    assert crowded_share(exact, alpha, beta, cores) == pytest.approx(0.7)  # a model that fits: recovered
    with pytest.raises(ValueError, match="no crowded"):
        crowded_share([], alpha, beta, cores)


def test_compute_interference_slows_ranks_whose_host_is_busy():
    base = one_host(profile(compute_interference=0.0), 1, 2, 2)
    slow = one_host(profile(compute_interference=0.05), 1, 2, 2)
    alone = one_host(profile(compute_interference=0.05), 1, 1, 2)
    assert slow > base  # two replicas computing side by side
    assert alone == one_host(profile(compute_interference=0.0), 1, 1, 2)  # nobody to interfere


def test_compute_interference_from_paired_samples_ignores_drift_and_outliers():
    import random

    rng = random.Random(3)
    # the machine slows down by 30 % over the probe; crowded samples are 4 % (k=2) slower than the
    # lone sample just before them, with 1 % noise and one sample disturbed by another process
    lone = [0.3 * (1 + 0.3 * i / 17) * (1 + 0.01 * rng.gauss(0, 1)) for i in range(18)]
    crowded = [t * 1.04 * (1 + 0.01 * rng.gauss(0, 1)) for t in lone]
    crowded[17] *= 1.6
    assert compute_interference(lone, crowded, 2) == pytest.approx(0.04, abs=0.006)
    # k processes share the slowdown among k - 1 other busy cores; never below 0
    assert compute_interference(lone, [t * 1.09 for t in lone], 4) == pytest.approx(0.03)
    assert compute_interference(lone, [t * 0.98 for t in lone], 2) == 0.0
    with pytest.raises(ValueError, match="k >= 2"):
        compute_interference(lone, crowded, 1)
    for bad in (([], [], 2), (lone, crowded[:-1], 2)):
        with pytest.raises(ValueError, match="as many crowded samples as lone"):
            compute_interference(*bad)


def test_crowded_samples_are_the_mean_over_the_processes_that_ran_them():
    # two processes at once; the first (rank 0, which also ran the lone sample) 2 % crowded, the
    # other 6 %: the per-process slowdown is their mean, 4 %, not rank 0's 2 %
    lone = [0.30, 0.31, 0.29, 0.30]
    r0, r1 = [t * 1.02 for t in lone], [t * 1.06 for t in lone]
    assert crowded_mean([r0, r1]) == pytest.approx([t * 1.04 for t in lone])
    assert compute_interference(lone, crowded_mean([r0, r1]), 2) == pytest.approx(0.04)
    assert compute_interference(lone, r0, 2) == pytest.approx(0.02)
    assert crowded_mean([lone]) == lone
    for bad in ([], [[]], [r0, r1[:-1]]):
        with pytest.raises(ValueError, match="all of one length"):
            crowded_mean(bad)


@pytest.mark.parametrize("world", [2, 3])
def test_measure_host_averages_every_crowded_process(monkeypatch, world):
    """Real probe processes (``world`` gloo ranks on this machine, a tiny GPT-2): the compute
    probe's crowded samples are the mean of the k = min(world, cores) processes' own times, read
    from their files (ranks >= k take no part), and the interference is read off them."""
    import os
    from functools import partial

    import torch

    from varuna_sdk.model.gpt2 import gpt2, init_gpt2, lm_loss, preset
    from varuna_sdk.profiling import network as cal

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no crowded compute probe")
    cfg = preset("tiny")
    x = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    probe = {"model_fn": partial(gpt2, cfg), "loss_fn": lm_loss, "init_fn": partial(init_gpt2, n_layer=cfg.n_layer),
             "seed": 0, "inputs": (x[:, :-1],), "targets": x[:, 1:]}
    seen, real_mean = [], cal.crowded_mean

    def spy(per_rank):  # what measure_host read from the probe processes' files
        seen.append([list(v) for v in per_rank])
        return real_mean(per_rank)

    monkeypatch.setattr(cal, "crowded_mean", spy)
    net, _, interference = cal.measure_host(world=world, sizes=(4096, 1 << 16), reps=3, timeout_s=120,
                                            compute=probe)
    k = min(world, net.samples["cpu_count"])
    samples = dict((n, v) for n, v in net.samples["compute_samples"])
    crowded = [v for v in seen if len(v) > 1]
    assert [len(v) for v in seen] == [1, k] and len(crowded) == 1
    assert all(len(v) == 2 * 3 and min(v) > 0 for v in crowded[0])
    assert crowded[0][0] != crowded[0][1]  # each process's own times, not one rank's twice
    assert samples[k] == pytest.approx([sum(col) / k for col in zip(*crowded[0])])
    assert samples[1] == seen[0][0]  # the lone samples: rank 0's, unchanged
    assert interference == pytest.approx(compute_interference(samples[1], samples[k], k))


def test_compute_probe_carries_a_lambda_model_by_value_to_the_probe_processes(monkeypatch):
    """A model given as a lambda and a loss defined in a function (neither importable by reference,
    as in a notebook) still reach the probe processes — by value, checked as a job's shipped code —
    so the interference is measured, not silently taken as 0; so does a function of ``__main__``;
    a callable that cloudpickle cannot pack either gives a warning and no probe."""
    import os
    import threading
    from functools import partial

    import torch

    from varuna_sdk.model.gpt2 import gpt2, init_gpt2, lm_loss, preset
    from varuna_sdk.profiling import network as cal

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no crowded compute probe")
    cfg = preset("tiny")
    x = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))

    def loss(logits, targets):  # a local function: plain pickle refuses it
        return lm_loss(logits, targets)

    probe = cal.compute_probe(lambda: gpt2(cfg), loss, lambda m, n: init_gpt2(m, n, n_layer=cfg.n_layer), 0,
                              ((x[:, :-1],), x[:, 1:]), "fp32")
    assert probe is not None
    net, _, interference = cal.measure_host(world=2, sizes=(4096,), reps=2, timeout_s=120, compute=probe)
    samples = dict((k, v) for k, v in net.samples["compute_samples"])
    assert sorted(samples) == [1, 2] and all(t > 0 for v in samples.values() for t in v)
    assert interference == pytest.approx(compute_interference(samples[1], samples[2], 2))

    # defined in __main__ (a notebook cell): picklable here by reference, but a spawned process has
    # another __main__, so it travels by value; an installed module's function goes by reference
    import sys

    from varuna_sdk.shipping import ByValue

    def nb_model():
        return gpt2(cfg)

    nb_model.__module__, nb_model.__qualname__ = "__main__", "_varuna_test_nb_model"
    monkeypatch.setattr(sys.modules["__main__"], "_varuna_test_nb_model", nb_model, raising=False)
    batch = ((x[:, :-1],), x[:, 1:])
    assert isinstance(cal.compute_probe(nb_model, lm_loss, None, 0, batch, "fp32")["model_fn"], ByValue)
    assert cal.compute_probe(partial(gpt2, cfg), lm_loss, None, 0, batch, "fp32")["model_fn"].func is gpt2

    lock = threading.Lock()
    with pytest.warns(RuntimeWarning, match="compute_interference is taken as 0"):
        assert cal.compute_probe(lambda: (lock, gpt2(cfg))[1], lm_loss, None, 0, ((x[:, :-1],), x[:, 1:]),
                                 "fp32") is None


# ---- profile and fits ---------------------------------------------------------------------------
def test_new_figures_round_trip_and_old_profiles_load():
    prof = profile(opt_parallelism=1.4, ar_cpu_share=0.6, compute_interference=0.03)
    d = json.loads(prof.to_json())
    assert Profile.from_dict(d) == prof
    for key in ("opt_parallelism", "compute_interference"):
        del d[key]
    del d["network"]["ar_cpu_share"]
    old = Profile.from_dict(d)  # a profile from before these figures: neutral defaults
    assert (old.opt_parallelism, old.compute_interference, old.network.ar_cpu_share) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize("relative", [True, False])
def test_alpha_beta_fit_recovers_exact_data(relative):
    pts = [(x, 2e-4 + x / 3e9) for x in (4096, 1 << 20, 8 << 20, 32 << 20)]
    alpha, beta = fit_alpha_beta(pts, relative=relative)
    assert alpha == pytest.approx(2e-4, rel=1e-6) and beta == pytest.approx(3e9, rel=1e-6)


# ---- the per-host network cache ----------------------------------------------------------------
def _fake_network(alpha: float = 123.0) -> NetworkProfile:
    """Figures no machine measures (α = 123 s), so a profile that carries them was read from the cache."""
    return NetworkProfile(p2p_alpha_s=alpha, p2p_beta_Bps=1e6, ar_alpha_s=2 * alpha, ar_beta_Bps=2e6, consensus_s=0.5,
                          samples={"p2p": [[4096, 1.0, 1.0, 0.0]], "cpu_count": 2, "opt": [[1, 9.9]],
                                   "compute": [[1, 9.9]]}, ar_cpu_share=0.5)


def test_host_network_is_reused_only_fresh_whole_and_for_the_same_threads(tmp_path):
    """``store_host_network`` keeps the model-free part (the model's probe samples are dropped);
    ``cached_host_network`` returns it until ``HOST_NETWORK_MAX_AGE_S``, never for other threads per
    worker, and never from a torn or foreign file."""
    from varuna_sdk.profiling.job import HOST_NETWORK_MAX_AGE_S, cached_host_network, host_key, store_host_network

    net = _fake_network()
    path = store_host_network(tmp_path, 1, net, now=1000.0)
    got = cached_host_network(tmp_path, 1, now=1000.0 + HOST_NETWORK_MAX_AGE_S - 1)
    assert got is not None and got.p2p_alpha_s == 123.0 and got.ar_cpu_share == 0.5
    assert got.samples == {"p2p": [[4096, 1.0, 1.0, 0.0]], "cpu_count": 2}   # no model's samples
    assert cached_host_network(tmp_path, 1, now=1000.0 + HOST_NETWORK_MAX_AGE_S + 1) is None   # stale
    assert cached_host_network(tmp_path, 1, now=999.0 - 60) is None                              # from the future
    assert cached_host_network(tmp_path, 2, now=1000.0) is None and host_key(2) != host_key(1)   # other threads
    for torn in (path.read_text()[:40], "[]", json.dumps({"measured_at": 1000.0, "network": {"p2p_alpha_s": 1}})):
        path.write_text(torn)
        assert cached_host_network(tmp_path, 1, now=1000.0) is None
    assert not list(tmp_path.glob("*.tmp"))


def test_a_calibration_on_a_known_host_runs_only_the_models_probes(tmp_path, monkeypatch):
    """``calibrate_job`` with this host's network in the cache: the profile carries those figures,
    and the host probes spawn only the k = min(4, cores) processes that the optimizer and compute
    probes use (not 4 for the p2p and all-reduce probes), which measure this model afresh."""
    import os

    from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig
    from varuna_sdk.profiling import network as cal
    from varuna_sdk.profiling.job import calibrate_job, store_host_network

    store_host_network(tmp_path / "hosts", 1, _fake_network())
    worlds, real_spawn = [], cal.spawn_workers

    def spy(fn, world, *args, **kwargs):
        worlds.append(world)
        return real_spawn(fn, world, *args, **kwargs)

    monkeypatch.setattr(cal, "spawn_workers", spy)
    job = JobConfig(name="known-host", model=ModelConfig(preset="tiny", n_layer=2, n_embd=32, n_head=2),
                    data=DataConfig(tokenizer="byte", seq_len=16), parallel=ParallelConfig(global_batch=8),
                    launch=LaunchConfig(gpus=2))
    prof = calibrate_job(job, cache_dir=tmp_path, micro_batch_sizes=(1, 2))
    k = min(4, os.cpu_count() or 1)
    assert prof.network.p2p_alpha_s == 123.0 and prof.network.ar_cpu_share == 0.5
    assert worlds == ([k] if k > 1 else [])
    if k > 1:   # this model's own samples, not the planted ones
        assert prof.network.samples["opt"] != [[1, 9.9]] and prof.network.samples["compute_ks"] == [1, k]
        assert prof.opt_parallelism >= 1.0 and prof.compute_interference >= 0.0
    assert prof.network.samples["p2p"] == [[4096, 1.0, 1.0, 0.0]]


def test_the_machines_load_is_measured_from_proc_stat_and_decides_a_fresh_calibration(tmp_path):
    """``busy_fraction`` reads the CPUs' busy share of a window from /proc/stat: two real processes
    spinning on this 2-core machine's cores are seen (>= 0.7), and a calibration made then warns
    that its figures are inflated. ``measured_under_load``: only a
    calibration measured under load (>= BUSY_STALE) on a machine quiet now (<= BUSY_QUIET), at least
    BUSY_RECHECK_AGE_S old, is measured again; one still busy, a recent one, or an unknown load
    keeps its calibration."""
    import os
    import subprocess
    import sys
    import time

    from varuna_sdk.profiling.job import (BUSY_QUIET, BUSY_RECHECK_AGE_S, BUSY_STALE, busy_fraction,
                                          measured_under_load, under_load_warning)

    from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig
    from varuna_sdk.profiling.job import calibrate_job, store_host_network

    store_host_network(tmp_path / "hosts", 1, _fake_network())
    job = JobConfig(name="busy", model=ModelConfig(preset="tiny", n_layer=1, n_embd=16, n_head=2),
                    data=DataConfig(tokenizer="byte", seq_len=8), parallel=ParallelConfig(global_batch=4),
                    launch=LaunchConfig(gpus=1))
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 60\nwhile time.time() < t: pass"])
            for _ in range(max(2, os.cpu_count() or 1))]
    try:
        time.sleep(0.3)
        assert busy_fraction(0.5) >= 0.7
        # a calibration made now says its figures are inflated (the manager logs the same as a WARNING event)
        with pytest.warns(UserWarning, match=r"calibrated while other work kept \d+% of this machine's CPUs busy: "
                                             r"its compute times are inflated"):
            prof = calibrate_job(job, cache_dir=tmp_path, micro_batch_sizes=(1,))
        assert prof.busy_at_calibration >= BUSY_STALE
    finally:
        for p in spin:
            p.kill()
            p.wait()
    old = BUSY_RECHECK_AGE_S
    assert measured_under_load(0.9, 0.05, old) and measured_under_load(BUSY_STALE, BUSY_QUIET, old)
    assert not measured_under_load(0.9, 0.05, old - 1)       # moments ago: one calibration for calls close together
    assert not measured_under_load(0.9, 0.6, old)            # still busy: the same load would be measured
    assert not measured_under_load(BUSY_STALE - 0.01, 0.0, old) and not measured_under_load(0.1, 0.0, old)
    assert not measured_under_load(None, 0.0, old) and not measured_under_load(0.9, None, old)
    assert under_load_warning(BUSY_STALE - 0.01) is None and under_load_warning(None) is None


def test_a_calibration_cached_under_load_is_measured_again_once_the_machine_is_quiet(tmp_path):
    """A cached profile marked as measured (long ago) while other work kept 95 % of the CPUs busy: on a quiet
    machine ``calibrate_job`` warns and measures it again (its time, its load and its compute
    figures new, the cache rewritten); the new one is then reused as it is."""
    import time

    from varuna_sdk.config import DataConfig, JobConfig, LaunchConfig, ModelConfig, ParallelConfig
    from varuna_sdk.profiling.job import BUSY_QUIET, busy_fraction, calibrate_job, profile_key, store_host_network
    from varuna_sdk.profiling.profile import Profile

    from test_planner import synthetic_profile

    store_host_network(tmp_path / "hosts", 1, _fake_network())
    job = JobConfig(name="loaded", model=ModelConfig(preset="tiny", n_layer=2, n_embd=32, n_head=2),
                    data=DataConfig(tokenizer="byte", seq_len=16), parallel=ParallelConfig(global_batch=8),
                    launch=LaunchConfig(gpus=1))
    path = tmp_path / f"{profile_key(job)}.json"   # the cache holds a profile of it made under load
    loaded = Profile.from_dict({**json.loads(synthetic_profile([1, 1, 1, 1]).to_json()), "busy_at_calibration": 0.95,
                                "calibrated_at": 1.0})
    path.write_text(loaded.to_json())
    deadline = time.time() + 20
    while (busy_fraction() or 1.0) > BUSY_QUIET / 2:   # quiet with a margin, as a user's idle machine is
        if time.time() > deadline:
            pytest.skip("this machine stayed busy for 20 s: the quiet case cannot be shown here")
        time.sleep(0.5)
    with pytest.warns(UserWarning, match=r"measured while other work kept 95% of this machine's CPUs busy"):
        again = calibrate_job(job, cache_dir=tmp_path, micro_batch_sizes=(1, 2))
    assert again.calibrated_at > 1.0 and again.busy_at_calibration is not None and again.busy_at_calibration < 0.95
    assert again.segments[0].fwd_s != loaded.segments[0].fwd_s   # measured, not the cached figures
    assert Profile.load(path).calibrated_at == again.calibrated_at
    # reused as it is (measured moments ago, and quiet)
    assert calibrate_job(job, cache_dir=tmp_path, micro_batch_sizes=(1, 2)).calibrated_at == again.calibrated_at
