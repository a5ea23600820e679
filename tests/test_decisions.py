"""The morph manager's rules as plain numbers (``varuna_sdk.manager.decisions``): grow
hysteresis, straggler detection against the plan's prediction, steps lost, worker slots."""

from __future__ import annotations

import pytest

from varuna_sdk.cluster.hosts import Host
from varuna_sdk.manager.decisions import GrowRule, StragglerRule, find_stragglers, pool_slots, steps_lost, worker_slots


def test_worker_slots_one_per_gpu_or_one_per_cpu_vm():
    assert worker_slots(Host("a", "10.0.0.1", gpus=0)) == 1
    assert worker_slots(Host("b", "10.0.0.2", gpus=4)) == 4
    assert pool_slots([Host("a", "10.0.0.1"), Host("b", "10.0.0.2", gpus=8)]) == 9


def test_grow_needs_the_gain_and_the_cooldown():
    rule = GrowRule(min_gain=1.1, cooldown_s=30)
    assert rule.worth_it(10.0, 11.0, 31.0)
    assert not rule.worth_it(10.0, 10.9, 31.0)          # 9 % faster: not worth a morph
    assert not rule.worth_it(10.0, 20.0, 29.0)          # too soon after the last morph
    assert rule.worth_it(0.0, 1.0, 100.0)
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
