"""The morph manager's rules as plain numbers (``varuna_sdk.manager.decisions``): grow
hysteresis, straggler detection against the plan's prediction, steps lost, worker slots, when
an estimate has drifted and how measured compute rescales a profile."""

from __future__ import annotations

import json

import pytest

from varuna_sdk.cluster.hosts import Host
from varuna_sdk.manager.decisions import (GrowRule, StragglerRule, find_stragglers, pool_prices, pool_slots, steps_lost,
                                          worker_slots)


def test_worker_slots_one_per_gpu_or_one_per_cpu_vm():
    assert worker_slots(Host("a", "10.0.0.1", gpus=0)) == 1
    assert worker_slots(Host("b", "10.0.0.2", gpus=4)) == 4
    assert pool_slots([Host("a", "10.0.0.1"), Host("b", "10.0.0.2", gpus=8)]) == 9


def test_pool_prices_spread_each_vms_price_over_its_slots_and_average_the_pool():
    def vm(name, gpus, **labels):
        return Host(name=name, address="10.0.0.1", gpus=gpus, labels={k: str(v) for k, v in labels.items()})

    # 2 x 4-GPU at $8/h spot ($32/h on demand) and 1 x 1-GPU at $1/h (no on-demand price: its spot)
    pool = [vm("a", 4, price_per_hour=8, on_demand_per_hour=32, instance_type="g5.12xlarge"),
            vm("b", 4, price_per_hour=8, on_demand_per_hour=32, instance_type="g5.12xlarge"),
            vm("c", 1, price_per_hour=1.0, instance_type="g5.xlarge"), vm("d", 1)]      # d: no price, left out
    got = pool_prices(pool)
    assert got == {"spot_per_gpu_hour": pytest.approx(17 / 9), "on_demand_per_gpu_hour": pytest.approx(65 / 9),
                   "vm_type": "g5.12xlarge, g5.xlarge", "example": False}
    assert pool_prices([vm("d", 1), vm("e", 0, price_per_hour="n/a")]) is None
    assert pool_prices([vm("f", 0, price_per_hour=0.5, prices="example", kind="emulated")])["example"] is True


def test_grow_needs_the_gain_and_the_cooldown():
    rule = GrowRule(min_gain=1.1, cooldown_s=30)
    assert rule.worth_it(10.0, 11.0, 31.0)
    assert not rule.worth_it(10.0, 10.9, 31.0)          # 9 % faster: not worth a morph
    assert not rule.worth_it(10.0, 20.0, 29.0)          # too soon after the last morph
    assert rule.worth_it(0.0, 1.0, 100.0)
    # a "grow" onto no more workers than the running plan is none (seen: P=1 x D=2 -> P=1 x D=2
    # on the same VMs, predicted faster only because the running plan's estimate had drifted)
    assert not rule.worth_it(10.0, 20.0, 100.0, current_workers=2, new_workers=2)
    assert rule.worth_it(10.0, 20.0, 100.0, current_workers=2, new_workers=4)
    # a "stay" says which reason (it said "gain below 1.1x or in the cooldown" at a 2x gain: helper-63)
    assert rule.why_not(10.0, 20.0, 100.0, 2, 4) is None
    assert rule.why_not(10.0, 20.0, 12.0) == "in the cooldown: 12 s since the last morph or the start, 18 s of 30 s left"
    assert rule.why_not(10.0, 10.9, 31.0) == "gain 1.09x, below 1.10x"
    assert rule.why_not(10.0, 20.0, 100.0, 2, 2) == "that plan uses 2 workers, no more than the 2 running"
    from varuna_sdk.manager.events import Event, Kind
    from varuna_sdk.manager.runs import event_sentence

    def said(**payload) -> str:
        return event_sentence(Event(id=1, time=0.0, job_id="j", kind=Kind.GROW_DECISION, host=None, rank=None,
                                    payload={"current_examples_per_s": 24.63, "new_examples_per_s": 49.26,
                                             "min_gain": 1.1, **payload}))
    assert said(decision="stay", why=rule.why_not(24.63, 49.26, 12.0)).endswith(
        "49.26 examples/s against 24.63 now: stay (in the cooldown: 12 s since the last morph or the start, 18 s of "
        "30 s left)")
    assert said(decision="stay").endswith("stay (gain below 1.1x or in the cooldown)")   # an older log's event
    assert said(decision="grow").endswith("now: grow")
    with pytest.raises(ValueError, match="min_gain"):
        GrowRule(min_gain=0.9)
    with pytest.raises(ValueError, match="cooldown_s"):
        GrowRule(cooldown_s=-1)


def test_straggler_found_against_prediction_even_with_one_replica():
    rule = StragglerRule(factor=1.5, beats=3)
    predicted = {0: 1.0, 1: 2.0, 2: 0.5}                 # P=3, D=1: no same-stage peers
    history = {0: [1.0, 1.1, 0.9], 1: [2.1, 1.9, 2.0], 2: [1.2, 1.1, 1.3]}   # rank 2 at ~2.4x
    found = find_stragglers(history, predicted, rule)
    assert set(found) == {2}
    assert found[2] == pytest.approx(1.2 / 0.5 / 1.0 * 1.0, rel=0.2)


def test_straggler_must_stand_out_in_every_recent_beat():
    rule = StragglerRule(factor=1.5, beats=3)
    predicted = {0: 1.0, 1: 1.0, 2: 1.0}
    history = {0: [1.0, 1.0, 1.0], 1: [1.0, 1.0, 1.0], 2: [3.0, 1.0, 3.0]}   # one fast beat: not persistent
    assert find_stragglers(history, predicted, rule) == {}
    history[2] = [1.0, 3.0, 3.0, 3.0]                    # the last three all slow
    assert set(find_stragglers(history, predicted, rule)) == {2}
    assert find_stragglers({0: [1.0, 1.0, 1.0]}, {0: 1.0}, rule) == {}    # nobody to compare with
    assert find_stragglers({0: [1.0], 1: [5.0]}, {0: 1.0, 1: 1.0}, rule) == {}   # too few beats
    with pytest.raises(ValueError, match="factor"):
        StragglerRule(factor=1.0)


def test_steps_lost():
    assert steps_lost(None, 0) == 0
    assert steps_lost(9, 10) == 0          # notice: checkpoint at the boundary after step 9
    assert steps_lost(14, 10) == 5         # sudden loss: steps 10..14 redone
    assert steps_lost(3, 10) == 0


def test_drift_needs_every_recent_step_beyond_the_threshold_on_one_side():
    from varuna_sdk.manager.decisions import DriftRule, step_time_drift

    rule = DriftRule(threshold=0.15, steps=5, warmup=2)
    warm = [9.0, 9.0]                                   # a restart's first steps do not count
    assert step_time_drift(warm + [1.2, 1.3, 1.25, 1.4, 1.2], 1.0, rule) == pytest.approx(0.25)
    assert step_time_drift(warm + [0.8, 0.7, 0.75, 0.8, 0.6], 1.0, rule) == pytest.approx(-0.25)
    assert step_time_drift(warm + [1.2, 1.3, 1.1, 1.4, 1.2], 1.0, rule) is None     # one step within 15 %
    assert step_time_drift(warm + [1.3, 0.7, 1.3, 0.7, 1.3], 1.0, rule) is None     # both sides: noise
    assert step_time_drift(warm + [1.3] * 4, 1.0, rule) is None                      # too few steps yet
    assert step_time_drift(warm + [1.3] * 5, None, rule) is None                     # nothing predicted
    with pytest.raises(ValueError, match="threshold"):
        DriftRule(threshold=0.0)


def test_measured_ratios_rescale_each_stages_segments_by_its_fastest_replica():
    from dashboard_writer import profile
    from varuna_sdk.manager.decisions import compute_ratios, segment_factors

    hist = {0: [0.2, 0.3, 0.3], 1: [0.9, 0.9], 2: [0.3], 3: [0.2, 0.2, 0.6, 0.6]}   # P=2 x D=2
    ratios = compute_ratios(hist, {0: 0.1, 1: 0.3, 2: 0.1, 3: 0.3}, last=2)
    assert ratios == pytest.approx({0: 3.0, 1: 3.0, 2: 3.0, 3: 2.0})
    # stage 0 = segments 0-2 (ranks 0, 2), stage 1 = segments 3-5 (ranks 1, 3): its fastest replica
    # (rank 1 at 3x is a straggler next to rank 3 at 2x: the profile follows the healthy one)
    f = segment_factors(ratios, [[0, 1, 2], [3, 4, 5]], 2, 6)
    assert f == pytest.approx([3.0, 3.0, 3.0, 2.0, 2.0, 2.0])
    assert segment_factors({0: 3.0}, [[0], [1]], 2, 2) == [3.0, 1.0]            # no sample: as calibrated
    base = profile()
    fast = base.scaled([0.5] * len(base.segments))
    again = fast.scaled(f)
    assert again.segments[4].bwd_s == pytest.approx([x * 0.5 * 2.0 for x in base.segments[4].bwd_s])
    assert again.segments[0].act_bytes == base.segments[0].act_bytes and again.network == base.network
    assert again.live_scale == pytest.approx([1.5, 1.5, 1.5, 1.0, 1.0, 1.0])
    assert type(base).from_dict(json.loads(again.to_json())).live_scale == again.live_scale
    with pytest.raises(ValueError, match="one per segment"):
        base.scaled([1.0])
    with pytest.raises(ValueError, match="positive"):
        base.scaled([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
