"""Tests for the ``Profile`` (``varuna_sdk.profiling.profile``): JSON round trip, errors that name
what a profile lacks (never a silent zero), version check, interpolation over micro-batch sizes,
and one real calibration of a tiny GPT-2 (``varuna_sdk.profiling.calibrate``, no network probes).
"""

from __future__ import annotations

import copy
import json
import time
from functools import partial

import pytest
import torch

from varuna_sdk.planner.plan import plan
from varuna_sdk.profiling.profile import PROFILE_VERSION, NetworkProfile, Profile, ProfileError, SegmentProfile


def small_profile(network: bool = True) -> Profile:
    """Three segments measured at micro-batch sizes 1, 2, 4 (hand-picked numbers)."""
    segs = [
        SegmentProfile(fwd_s=[1.0, 1.5, 2.5], rec_s=[1.2, 1.8, 3.0], bwd_s=[2.0, 3.0, 5.0],
                       out_bytes=[4096, 8192, 16384], act_bytes=[10_000, 20_000, 40_000], param_bytes=1 << 20),
        SegmentProfile(fwd_s=[0.5, 0.9, 1.7], rec_s=[0.6, 1.0, 2.0], bwd_s=[1.0, 1.8, 3.4],
                       out_bytes=[4096, 8192, 16384], act_bytes=[8_000, 16_000, 32_000], param_bytes=3 << 20),
        SegmentProfile(fwd_s=[0.2, 0.3, 0.5], rec_s=[0.25, 0.35, 0.6], bwd_s=[0.4, 0.6, 1.0],
                       out_bytes=[0, 0, 0], act_bytes=[5_000, 10_000, 20_000], param_bytes=2 << 20),
    ]
    net = NetworkProfile(p2p_alpha_s=5e-5, p2p_beta_Bps=1.25e9, ar_alpha_s=6e-5, ar_beta_Bps=1.1e9, consensus_s=2e-4,
                         samples={"p2p": [[4096, 5.3e-5]], "allreduce": [[2, 4096, 1e-4]], "consensus": [4, 2e-4]})
    return Profile(model={"num_segments": 3, "param_bytes": 6 << 20,
                          "shared": [{"name": "wte.weight", "bytes": 1 << 20, "segments": [0, 2]}]},
                   hardware={"device": "cpu (test)", "threads": 1}, software={"torch": torch.__version__},
                   micro_batch_sizes=[1, 2, 4], segments=segs, network=net if network else None,
                   per_action_s=1e-4, per_step_s=0.0, opt_s_per_param_byte=1e-10, calibration_s=1.5)


def as_dict(prof: Profile) -> dict:
    return json.loads(prof.to_json())


# ---- JSON --------------------------------------------------------------------------------------
def test_json_round_trip(tmp_path):
    prof = small_profile()
    path = tmp_path / "p.json"
    text = prof.to_json(path)
    assert json.loads(text)["version"] == PROFILE_VERSION
    assert Profile.load(path) == prof
    assert Profile.from_dict(json.loads(text)) == prof
    no_net = small_profile(network=False)
    assert Profile.from_dict(as_dict(no_net)) == no_net and Profile.from_dict(as_dict(no_net)).network is None
    # a plan before and after the round trip is the same
    assert plan(Profile.load(path), 2, 8).best.time_s == plan(prof, 2, 8).best.time_s


@pytest.mark.parametrize("key", ["segments", "micro_batch_sizes", "per_action_s", "per_step_s",
                                 "opt_s_per_param_byte", "model", "hardware", "software"])
def test_missing_top_level_key_is_named(key):
    d = as_dict(small_profile())
    del d[key]
    with pytest.raises(ProfileError, match=f"missing '{key}'"):
        Profile.from_dict(d)


@pytest.mark.parametrize("key", ["fwd_s", "rec_s", "bwd_s", "out_bytes", "act_bytes", "param_bytes"])
def test_missing_segment_key_is_named(key):
    d = as_dict(small_profile())
    del d["segments"][1][key]
    with pytest.raises(ProfileError, match=key):
        Profile.from_dict(d)


@pytest.mark.parametrize("key", ["p2p_alpha_s", "p2p_beta_Bps", "ar_alpha_s", "ar_beta_Bps", "consensus_s"])
def test_missing_network_key_is_named(key):
    d = as_dict(small_profile())
    del d["network"][key]
    with pytest.raises(ProfileError, match=key):
        Profile.from_dict(d)


@pytest.mark.parametrize("key", ["fwd_s", "bwd_s", "act_bytes"])
def test_segment_list_of_wrong_length_is_named(key):
    d = as_dict(small_profile())
    d["segments"][1][key] = d["segments"][1][key][:2]
    prof = Profile.from_dict(d)  # loads, but no plan can use it
    msg = f"segment 1 has 2 {key} values for 3 micro-batch sizes"
    with pytest.raises(ProfileError, match=msg):
        prof.require(network=False)
    with pytest.raises(ProfileError, match=msg):
        plan(prof, 1, 8)


def test_no_network_when_planning_more_than_one_gpu():
    prof = small_profile(network=False)
    prof.require(network=False)
    with pytest.raises(ProfileError, match=r"no network measurements \(p2p, all-reduce\)"):
        prof.require(network=True)
    with pytest.raises(ProfileError, match="no network measurements"):
        plan(prof, 2, 8)
    assert plan(prof, 1, 8).best.P == 1


def test_no_segments_and_bad_values_are_errors_not_zeros():
    empty = small_profile()
    empty.segments = []
    with pytest.raises(ProfileError, match="no segments"):
        empty.require(network=False)
    with pytest.raises(ProfileError, match="must be >= 1"):
        small_profile().require(network=False, micro_batch_size=0)
    d = as_dict(small_profile())
    d["segments"][0]["bwd_s"][2] = None
    with pytest.raises(ProfileError, match="segment 0 bwd_s at micro-batch size 4 is None"):
        plan(Profile.from_dict(d), 1, 8)
    d = as_dict(small_profile())
    d["micro_batch_sizes"] = [4, 2, 1]  # interpolation needs increasing sizes
    with pytest.raises(ProfileError, match=r"micro_batch_sizes=\[4, 2, 1\] must be increasing"):
        plan(Profile.from_dict(d), 1, 8)
    d = as_dict(small_profile())
    d["segments"][0]["param_bytes"] = -5
    with pytest.raises(ProfileError, match="segment 0 param_bytes is -5"):
        plan(Profile.from_dict(d), 1, 8)


@pytest.mark.parametrize("version", [0, PROFILE_VERSION + 1, "1", None])
def test_wrong_version_is_refused(version):
    d = as_dict(small_profile())
    d["version"] = version
    with pytest.raises(ProfileError, match=f"profile version {version!r} is not {PROFILE_VERSION}"):
        Profile.from_dict(d)
    del d["version"]
    with pytest.raises(ProfileError, match="profile version None"):
        Profile.from_dict(d)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        Profile.load(tmp_path / "none.json")


# ---- interpolation -----------------------------------------------------------------------------
def test_at_interpolates_and_extrapolates_by_hand():
    prof = small_profile()  # sizes 1, 2, 4; segment 0 fwd_s = 1.0, 1.5, 2.5
    assert [prof.at("fwd_s", 0, b) for b in (1, 2, 4)] == [1.0, 1.5, 2.5]  # measured points
    assert prof.at("fwd_s", 0, 3) == pytest.approx(2.0)  # 1.5 + (2.5 - 1.5) * (3 - 2) / (4 - 2)
    assert prof.at("fwd_s", 0, 8) == pytest.approx(4.5)  # last interval's slope 0.5/example: 2.5 + 0.5 * 4
    assert prof.at("fwd_s", 0, 16) == pytest.approx(8.5)
    assert prof.at("out_bytes", 1, 3) == pytest.approx(12288)
    assert prof.at("out_bytes", 2, 8) == 0.0  # the last segment sends nothing
    # below the smallest size: the first interval's slope, never above the smallest value nor below 0
    p2 = Profile(model={}, hardware={}, software={}, micro_batch_sizes=[2, 4], network=None, per_action_s=0.0,
                 per_step_s=0.0, opt_s_per_param_byte=0.0,
                 segments=[SegmentProfile([2.0, 3.0], [3.0, 2.0], [1.0, 5.0], [0, 0], [0, 0], 0)])
    assert p2.at("fwd_s", 0, 1) == pytest.approx(1.5)  # 2 - 0.5
    assert p2.at("rec_s", 0, 1) == pytest.approx(3.0)  # decreasing data: clamped at the smallest size's value
    assert p2.at("bwd_s", 0, 1) == 0.0  # 1 - 2 < 0: clamped at 0
    # one measured size: proportional to the micro-batch size
    p1 = Profile(model={}, hardware={}, software={}, micro_batch_sizes=[4], network=None, per_action_s=0.0,
                 per_step_s=0.0, opt_s_per_param_byte=0.0, segments=[SegmentProfile([2.0], [2.0], [2.0], [8], [8], 0)])
    assert p1.at("fwd_s", 0, 8) == pytest.approx(4.0) and p1.at("fwd_s", 0, 1) == pytest.approx(0.5)
    assert p1.at("out_bytes", 0, 2) == pytest.approx(4)


# ---- a real calibration ------------------------------------------------------------------------
def test_real_calibration_of_tiny_gpt2():
    from varuna_sdk.model.gpt2 import gpt2, init_gpt2, lm_loss, preset
    from varuna_sdk.profiling.calibrate import calibrate

    cfg = preset("tiny")  # byte vocabulary (256), 2 blocks, d=32
    T, sizes = 32, (1, 2, 4)

    def make_batch(b: int):
        x = torch.randint(0, cfg.vocab_size, (b, T + 1), generator=torch.Generator().manual_seed(b))
        return (x[:, :-1],), x[:, 1:]

    t0 = time.perf_counter()
    prof = calibrate(partial(gpt2, cfg), lm_loss, make_batch, sizes, network=False,
                     init_fn=partial(init_gpt2, n_layer=cfg.n_layer))
    wall = time.perf_counter() - t0
    assert 0 < prof.calibration_s <= wall   # its own record of the time it took (speed: bench_calibration)
    n = cfg.n_layer + 2  # embeddings, each block, final LayerNorm + head
    assert prof.num_segments == n and prof.micro_batch_sizes == list(sizes) and prof.network is None
    for k, s in enumerate(prof.segments):
        for key in ("fwd_s", "rec_s", "bwd_s"):
            assert all(v > 0 for v in getattr(s, key)), (k, key, getattr(s, key))
        # bytes crossing the cut-point after segment k: hidden states [b, T, n_embd] in fp32
        expect = [b * T * cfg.n_embd * 4 if k < n - 1 else 0 for b in sizes]
        assert s.out_bytes == expect, (k, s.out_bytes)
        assert all(a > 0 for a in s.act_bytes) and s.act_bytes[-1] > s.act_bytes[0]
    # parameters: every byte counted once, the tied embedding / LM head with its first use
    assert sum(s.param_bytes for s in prof.segments) == cfg.num_parameters() * 4 == prof.model["param_bytes"]
    assert prof.segments[0].param_bytes >= cfg.vocab_size * cfg.n_embd * 4
    (tied,) = prof.model["shared"]
    assert tied["name"] == "wte.weight" and tied["segments"] == [0, n - 1]
    assert tied["bytes"] == cfg.vocab_size * cfg.n_embd * 4
    assert prof.per_action_s >= 0 and prof.opt_s_per_param_byte >= 0
    assert prof.hardware["threads"] == 1 and "torch" in prof.software
    # the real profile survives JSON and plans one GPU; more GPUs need the network figures
    again = Profile.from_dict(json.loads(prof.to_json()))
    assert again == prof
    assert plan(again, 1, 8).best.P == 1
    with pytest.raises(ProfileError, match="network"):
        plan(again, 2, 8)
    with_net = copy.deepcopy(again)
    with_net.network = small_profile().network
    assert {r.P for r in plan(with_net, 4, 8).rows} == {1, 2, 3, 4}


class _Jittery(torch.autograd.Function):
    """Identity whose forward and backward each sleep a random time (seconds drawn from ``rng``,
    recorded in ``log``): model compute that varies from call to call, as on a noisy VM."""

    @staticmethod
    def forward(ctx, x, rng, log):
        ctx.rng, ctx.log = rng, log
        d = rng.uniform(0.001, 0.081)
        log["F"].append(d)
        time.sleep(d)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        d = ctx.rng.uniform(0.001, 0.081)
        ctx.log["B"].append(d)
        time.sleep(d)
        return g, None, None


class _JitteryModel(torch.nn.Module):
    def __init__(self, rng, log):
        super().__init__()
        from varuna_sdk.model import CutPoint

        self.rng, self.log = rng, log
        self.a, self.cut, self.b = torch.nn.Linear(8, 8), CutPoint(), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(self.cut(_Jittery.apply(self.a(x), self.rng, self.log)))


def test_per_action_cost_is_read_off_each_action_not_a_noisy_difference_of_passes():
    """The engine's own cost per action (``Profile.per_action_s``) is the action's time less the time inside
    the model: a model whose forward and backward each take a random 1-81 ms (a noisy VM's compute) leaves it
    at the engine's fraction of a millisecond. (The old estimate, the step less a separate segment pass, moved
    by ~10 ms per sample on such a model.) The engine reports the split per action kind (``StepResult.model_s``)."""
    import random

    from varuna_sdk.config import ParallelConfig
    from varuna_sdk.pipeline.engine import Varuna
    from varuna_sdk.profiling.calibrate import calibrate

    rng, log = random.Random(5), {"F": [], "B": []}

    def mse(out, y):
        return torch.nn.functional.mse_loss(out, y)

    def make_batch(b):
        g = torch.Generator().manual_seed(b)
        return (torch.randn(b, 8, generator=g),), torch.randn(b, 1, generator=g)

    # the step's split: every sleep is the model's, and the engine's remainder is small
    eng = Varuna(lambda: _JitteryModel(rng, log), mse, ParallelConfig(P=1, D=1, global_batch=8, micro_batch_size=2),
                 (torch.zeros(2, 8),), seed=0)
    opt = torch.optim.SGD(eng.parameters(), lr=0.01)
    x, y = make_batch(8)
    log["F"].clear(), log["B"].clear()
    r = eng.step((x[0], y), opt)
    assert len(log["F"]) == len(log["B"]) == 4
    for kind in ("F", "B"):
        assert r.model_s[kind] >= sum(log[kind]), (kind, r.model_s, log)
        assert 0 < r.compute_s[kind] - r.model_s[kind] < 4 * 0.005, (kind, r.compute_s, r.model_s)
    # the calibration reads that remainder: a fraction of a millisecond per action on this tiny model,
    # whatever the sleeps (the old estimate's samples spread by ~20 ms here; its median of 5 followed them)
    for seed in (0, 1, 2):  # three draws of the noise: the estimate must not follow any of them
        rng.seed(seed)
        prof = calibrate(lambda: _JitteryModel(rng, log), mse, make_batch, (2,), network=False, repeats=5, warmup=1)
        assert 0 < prof.per_action_s < 0.003, (seed, prof.per_action_s)


def test_a_cache_file_is_written_whole_even_where_its_folder_was_removed(tmp_path):
    """Another process removing the profile cache while a calibration ran made the cache write fail
    (``FileNotFoundError`` on its temporary file), and the job was told its code fails (helper-63):
    the folder is made again; the file appears whole, no temporary file is left."""
    from varuna_sdk.profiling.job import _write_atomic

    path = tmp_path / "gone" / "profiles" / "x.json"
    _write_atomic(path, '{"a": 1}')
    assert path.read_text() == '{"a": 1}' and [p.name for p in path.parent.iterdir()] == ["x.json"]
