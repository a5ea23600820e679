"""Tests for varuna_sdk.pipeline.schedule (C++ policies in csrc/schedule.cpp).

The executors here are independent of the C++ code: they only consume the
per-stage action lists (static) or the StageScheduler decisions (dynamic) and
check them against the pipeline dependencies
  F(s, i) needs F(s-1, i) done (s > 0),  B(s, i) needs B(s+1, i) done (s < P-1).
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import random

import pytest

from varuna_sdk.config import POLICIES
from varuna_sdk.pipeline import schedule as sch
from varuna_sdk.pipeline.schedule import (
    Action,
    StageScheduler,
    default_recompute,
    format_schedule,
    parse_schedule,
    pipeline_schedule,
    stage_schedule,
)

P_RANGE = range(1, 17)
M_RANGE = range(1, 65)


# --------------------------------------------------------------------------- helpers


def check_stage_list(actions, P, m, stage, recompute):
    """Per-stage invariants; returns nothing, asserts."""
    last = stage == P - 1
    pos = {}
    for k, a in enumerate(actions):
        assert a.kind in ("F", "R", "B"), a
        assert 0 <= a.mb < m, (a, m)
        key = (a.kind, a.mb)
        assert key not in pos, f"stage {stage}: duplicate {a}"
        pos[key] = k
    n_r = 0 if (last or not recompute) else m
    assert len(actions) == 2 * m + n_r, (stage, len(actions))
    for i in range(m):
        f, b = pos.get(("F", i)), pos.get(("B", i))
        assert f is not None and b is not None, f"stage {stage}: missing F{i} or B{i}"
        assert f < b, f"stage {stage}: B{i} before F{i}"
        r = pos.get(("R", i))
        if n_r:
            assert r is not None, f"stage {stage}: missing R{i}"
            assert f < r < b, f"stage {stage}: R{i} not between F{i} and B{i}"
        else:
            assert r is None, f"stage {stage}: unexpected R{i}"
    # forwards in micro-batch order, backwards in micro-batch order (the runtime's
    # FIFO channels depend on it)
    assert [a.mb for a in actions if a.kind == "F"] == list(range(m))
    assert [a.mb for a in actions if a.kind == "B"] == list(range(m))


def run_static(lists, dur=None):
    """Execute all stage lists concurrently, each strictly in order, actions of
    integer duration (unit by default), every action starting as soon as its stage
    is free and its dependency is done.  Returns the makespan; fails on a stall."""
    dur = dur or {"F": 1, "R": 1, "B": 1}
    P = len(lists)
    ptr = [0] * P
    free = [0] * P
    f_fin = [dict() for _ in range(P)]
    b_fin = [dict() for _ in range(P)]
    total = sum(len(x) for x in lists)
    executed = 0
    t = 0
    while executed < total:
        nxt = []
        for s in range(P):
            if free[s] > t:
                nxt.append(free[s])
                continue
            if ptr[s] >= len(lists[s]):
                continue
            a = lists[s][ptr[s]]
            if a.kind == "F" and s > 0:
                dep = f_fin[s - 1].get(a.mb)
            elif a.kind == "B" and s < P - 1:
                dep = b_fin[s + 1].get(a.mb)
            else:
                dep = 0
            if dep is None or dep > t:
                if dep is not None:
                    nxt.append(dep)
                continue
            end = t + dur[a.kind]
            if a.kind == "F":
                f_fin[s][a.mb] = end
            elif a.kind == "B":
                b_fin[s][a.mb] = end
            free[s] = end
            ptr[s] += 1
            executed += 1
            nxt.append(end)
        if executed == total:
            break
        if not nxt:
            stuck = {s: str(lists[s][ptr[s]]) for s in range(P) if ptr[s] < len(lists[s])}
            pytest.fail(f"static schedule stalls at t={t}; blocked heads: {stuck}")
        t = min(x for x in nxt if x > t) if any(x > t for x in nxt) else t + 1
    return max(free)


def run_dynamic(policy, P, m, recompute, seed, max_delay=3, delay_prob=0.5, dur=None, split=False):
    """Runtime view: each stage asks its StageScheduler for the next action when it
    is free, passing the number of activations / gradients that have *arrived*
    (FIFO channels, random extra delay per message).  The stage then waits for the
    action's input and runs it (a W needs nothing and sends nothing).  Returns
    (per-stage executed order, makespan)."""
    rng = random.Random(seed)
    dur = dur or {"F": 1, "R": 1, "B": 2}
    scheds = [StageScheduler(policy, P, m, s, recompute, split) for s in range(P)]
    act_arr = [[] for _ in range(P)]  # act_arr[s][i]: time activation i reaches stage s
    grad_arr = [[] for _ in range(P)]  # grad_arr[s][i]: time gradient i reaches stage s
    n_act = [0] * P
    n_grad = [0] * P
    pending = [None] * P
    free = [0] * P
    finished = [False] * P
    order = [[] for _ in range(P)]

    def delay():
        return rng.randint(1, max_delay) if rng.random() < delay_prob else 0

    def send(chan, t_done):
        prev = chan[-1] if chan else 0
        chan.append(max(prev, t_done + delay()))  # FIFO channel

    t = 0
    while not all(finished):
        for s in range(P):
            if finished[s] or free[s] > t:
                continue
            while n_act[s] < len(act_arr[s]) and act_arr[s][n_act[s]] <= t:
                n_act[s] += 1
            while n_grad[s] < len(grad_arr[s]) and grad_arr[s][n_grad[s]] <= t:
                n_grad[s] += 1
            if pending[s] is None:
                a = scheds[s].next(n_act[s], n_grad[s])
                if a is None:
                    assert scheds[s].done
                    finished[s] = True
                    continue
                pending[s] = a
                order[s].append(a)
            a = pending[s]
            if a.kind == "F" and s > 0 and n_act[s] <= a.mb:
                continue  # blocks on the activation queue
            if a.kind == "B" and s < P - 1 and n_grad[s] <= a.mb:
                continue  # blocks on the gradient queue
            end = t + dur[a.kind]
            free[s] = end
            pending[s] = None
            if a.kind == "F" and s < P - 1:
                assert len(act_arr[s + 1]) == a.mb, "activations must be sent in order"
                send(act_arr[s + 1], end)
            if a.kind == "B" and s > 0:
                assert len(grad_arr[s - 1]) == a.mb, "gradients must be sent in order"
                send(grad_arr[s - 1], end)
        if all(finished):
            break
        events = [f for f in free if f > t]
        for s in range(P):
            if n_act[s] < len(act_arr[s]):
                events.append(act_arr[s][n_act[s]])
            if n_grad[s] < len(grad_arr[s]):
                events.append(grad_arr[s][n_grad[s]])
        events = [e for e in events if e > t]
        if not events:
            heads = {s: str(pending[s]) for s in range(P) if not finished[s]}
            pytest.fail(
                f"dynamic run stalls: {policy} P={P} m={m} seed={seed} t={t}, waiting on {heads}"
            )
        t = min(events)
    return order, max(free)


def toks(s):
    return parse_schedule(s)


# --------------------------------------------------------------------------- golden lists
# All verified by hand from the rules in the module docs (quanta walk-throughs).


def test_golden_varuna_p4_m16():
    s2 = stage_schedule("varuna", 4, 16, 2)
    assert format_schedule(s2[:14]) == "F0 F1 F2 R0 B0 R1 B1 R2 B2 F3 F4 F5 R3 B3"
    s3 = stage_schedule("varuna", 4, 16, 3)
    assert s3 == [Action(k, i) for i in range(16) for k in ("F", "B")]
    # warm-up depth toward the front (varuna-original.md §3.1): F0..F8 / F0..F5 before R0
    s0 = stage_schedule("varuna", 4, 16, 0)
    s1 = stage_schedule("varuna", 4, 16, 1)
    assert s0.index(Action("R", 0)) == 9 and s0[:9] == [Action("F", i) for i in range(9)]
    assert s1.index(Action("R", 0)) == 6 and s1[:6] == [Action("F", i) for i in range(6)]


def test_golden_varuna_small():
    # P=2 m=3: quanta q1 F0 | q2 F1,F0 | q3 F2,b0 | q4 R0,(B0) | q5 b0,F1 | q6 (B0),b1 | ...
    assert pipeline_schedule("varuna", 2, 3) == [
        toks("F0 F1 F2 R0 B0 R1 B1 R2 B2"),
        toks("F0 B0 F1 B1 F2 B2"),
    ]
    assert pipeline_schedule("varuna", 3, 2) == [
        toks("F0 F1 R0 B0 R1 B1"),
        toks("F0 F1 R0 B0 R1 B1"),
        toks("F0 B0 F1 B1"),
    ]
    # recompute=False: a downstream backward releases the upstream backward directly
    # P=2 m=8: q1 F0 | q2 F1,F0 | q3 F2,b0 | q4 b0,(B0) | q5 (B0),F1 | q6 F3,b1 | q7 b1,(B1) ...
    assert pipeline_schedule("varuna", 2, 8, recompute=False) == [
        toks("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"),
        toks("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"),
    ]
    assert stage_schedule("varuna", 1, 3, 0) == toks("F0 B0 F1 B1 F2 B2")


def test_golden_1f1b():
    assert format_schedule(stage_schedule("1f1b", 4, 8, 0)) == (
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    )
    assert format_schedule(stage_schedule("1f1b", 4, 8, 2)) == (
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    )
    assert format_schedule(stage_schedule("1f1b", 4, 8, 3)) == (
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    )
    # warm-up capped at m
    assert format_schedule(stage_schedule("1f1b", 4, 2, 0)) == "F0 F1 B0 B1"
    assert format_schedule(stage_schedule("1f1b", 4, 2, 0, recompute=True)) == "F0 F1 R0 B0 R1 B1"
    assert format_schedule(stage_schedule("1f1b", 3, 3, 1, recompute=True)) == (
        "F0 F1 R0 B0 F2 R1 B1 R2 B2"
    )


def test_golden_gpipe():
    assert format_schedule(stage_schedule("gpipe", 2, 3, 0, recompute=True)) == (
        "F0 F1 F2 R0 B0 R1 B1 R2 B2"
    )
    assert format_schedule(stage_schedule("gpipe", 2, 3, 1, recompute=True)) == "F0 F1 F2 B0 B1 B2"
    assert format_schedule(stage_schedule("gpipe", 2, 3, 0)) == "F0 F1 F2 B0 B1 B2"


def test_default_recompute():
    assert default_recompute("varuna") is True
    assert default_recompute("gpipe") is False
    assert default_recompute("1f1b") is False
    assert POLICIES == ("varuna", "gpipe", "1f1b")
    # None means the policy default
    assert stage_schedule("varuna", 2, 2, 0) == stage_schedule("varuna", 2, 2, 0, True)
    assert stage_schedule("gpipe", 2, 2, 0) == stage_schedule("gpipe", 2, 2, 0, False)
    assert stage_schedule("1f1b", 2, 2, 0) == stage_schedule("1f1b", 2, 2, 0, False)


# --------------------------------------------------------------------------- exhaustive sweep


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
def test_all_shapes_valid_and_deadlock_free(policy, recompute):
    for P, m in itertools.product(P_RANGE, M_RANGE):
        lists = pipeline_schedule(policy, P, m, recompute)
        assert len(lists) == P
        for s, actions in enumerate(lists):
            check_stage_list(actions, P, m, s, recompute)
        makespan = run_static(lists)
        # lower bound: the busiest stage's work, and one micro-batch's round trip
        assert makespan >= max(len(x) for x in lists)
        assert makespan >= 2 * P


def test_stage_schedule_matches_pipeline_schedule():
    for policy, rc in itertools.product(POLICIES, (True, False)):
        for P, m in [(1, 1), (2, 5), (4, 16), (7, 3), (16, 64)]:
            lists = pipeline_schedule(policy, P, m, rc)
            for s in range(P):
                assert stage_schedule(policy, P, m, s, rc) == lists[s]


def test_varuna_bounds_in_flight_and_last_stage_is_1f1b():
    for P, m in itertools.product(range(1, 9), (1, 8, 33)):
        lists = pipeline_schedule("varuna", P, m)
        assert lists[-1] == [Action(k, i) for i in range(m) for k in ("F", "B")]
        for s, actions in enumerate(lists):
            # Forward has the lowest priority, so stash depth (forwarded but not yet
            # backwarded) stays bounded, about 3*(P-1-s)+1 (varuna-original.md §3.1).
            live = peak = 0
            for a in actions:
                live += a.kind == "F"
                live -= a.kind == "B"
                peak = max(peak, live)
            assert peak <= 3 * (P - 1 - s) + 1, (P, m, s, peak)


def test_checkers_detect_stalls(monkeypatch):
    # self-test of the executors: a cyclic wait must be reported, not hang or pass
    with pytest.raises(pytest.fail.Exception, match="stalls"):
        run_static([toks("B0 F0"), toks("F0 B0")])
    with pytest.raises(pytest.fail.Exception, match="stalls"):
        run_static([toks("F0 B0 F1 B1"), toks("F0 F1 B0 B1")])

    class Fixed:  # StageScheduler stand-in replaying a fixed (bad) list
        lists = {0: toks("F0 B0 F1 B1"), 1: toks("F1 F0 B0 B1")}

        def __init__(self, policy, P, m, s, rc, split=False):
            self.todo = list(self.lists[s])

        def next(self, acts, grads):
            return self.todo.pop(0) if self.todo else None

        @property
        def done(self):
            return not self.todo

    monkeypatch.setitem(globals(), "StageScheduler", Fixed)
    with pytest.raises(pytest.fail.Exception, match="dynamic run stalls"):
        run_dynamic("varuna", 2, 2, True, seed=0)


# --------------------------------------------------------------------------- dynamic (runtime view)


def test_dynamic_varuna_finishes_with_random_delays():
    fired = 0
    for P, m in itertools.product(range(1, 17), (1, 2, 3, 5, 8, 16, 27, 64)):
        for seed in range(3):
            order, _ = run_dynamic("varuna", P, m, True, seed=1000 * P + 10 * m + seed)
            static = pipeline_schedule("varuna", P, m)
            for s in range(P):
                check_stage_list(order[s], P, m, s, True)
                if order[s] != static[s]:
                    fired += 1
                    # the only change allowed is a forward pulled ahead of a recompute
                    k = next(k for k, (a, b) in enumerate(zip(order[s], static[s])) if a != b)
                    assert order[s][k].kind == "F" and static[s][k].kind == "R"
                    assert s < P - 1
            assert order[-1] == static[-1]  # last stage never reorders
            # the dynamic order is itself a deadlock-free static schedule
            run_static(order)
    assert fired > 0, "opportunistic rule never fired"


def test_dynamic_varuna_no_delay_and_no_recompute():
    for P, m in itertools.product(range(1, 7), (1, 4, 13)):
        order, _ = run_dynamic("varuna", P, m, True, seed=0, delay_prob=0.0)
        for s in range(P):
            check_stage_list(order[s], P, m, s, True)
        # without recompute a forward may be pulled ahead of a backward whose gradient is late
        order, _ = run_dynamic("varuna", P, m, False, seed=P * m)
        static = pipeline_schedule("varuna", P, m, False)
        for s in range(P):
            check_stage_list(order[s], P, m, s, False)
            if order[s] != static[s]:
                k = next(k for k, (a, b) in enumerate(zip(order[s], static[s])) if a != b)
                assert order[s][k].kind == "F" and static[s][k].kind == "B" and s < P - 1
        run_static(order)


@pytest.mark.parametrize("policy", ["gpipe", "1f1b"])
def test_dynamic_other_policies_follow_static_order(policy):
    for P, m, rc in itertools.product(range(1, 7), (1, 4, 13), (True, False)):
        order, _ = run_dynamic(policy, P, m, rc, seed=P + m)
        assert order == pipeline_schedule(policy, P, m, rc)


def _without_w(order):
    return [a for a in order if a.kind != "W"]


def test_split_backward_defers_w_into_waits_and_keeps_the_order_valid():
    """With split_backward: every W(i) runs after its B(i), at most max_deferred + 1 are pending at
    any moment, removing the W actions leaves a valid Varuna order, and with B = W = 1 (a
    backward of 2 split in two) the pipeline finishes sooner on average than with the backward
    whole, because input gradients travel upstream a W earlier."""
    gains = []
    for P, m in itertools.product(range(1, 9), (1, 2, 3, 5, 8, 16, 27)):
        for rc in (True, False):
            seed = 100 * P + m + rc
            order, t_split = run_dynamic("varuna", P, m, rc, seed=seed, delay_prob=0.3,
                                         dur={"F": 1, "R": 1, "B": 1, "W": 1}, split=True)
            _, t_whole = run_dynamic("varuna", P, m, rc, seed=seed, delay_prob=0.3,
                                     dur={"F": 1, "R": 1, "B": 2})
            gains.append(t_whole / t_split)
            for s in range(P):
                check_stage_list(_without_w(order[s]), P, m, s, rc)
                pending = 0
                for a in order[s]:
                    pending += {"B": 1, "W": -1}.get(a.kind, 0)
                    assert 0 <= pending <= P - s + 1, (P, m, s, format_schedule(order[s]))
                b_at = {a.mb: k for k, a in enumerate(order[s]) if a.kind == "B"}
                w_at = {a.mb: k for k, a in enumerate(order[s]) if a.kind == "W"}
                assert sorted(w_at) == list(range(m)) and all(b_at[i] < w_at[i] for i in range(m))
            run_static([_without_w(o) for o in order])
    assert sum(gains) / len(gains) > 1.02, sum(gains) / len(gains)
    assert min(gains) >= 0.9, min(gains)


def test_split_backward_golden_last_stage():
    """The last stage (cap 1 pending W) with every activation already there: F0 B0 F1 B1 W0 ...
    — a W runs only once two are pending, or at the end."""
    s = StageScheduler("varuna", 2, 4, 1, split_backward=True)
    assert s.max_deferred == 1 and s.split_backward
    got = []
    while (a := s.next(4, 0)) is not None:
        got.append(a)
    assert format_schedule(got) == "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"
    # a stage waiting for a gradient runs its pending W first
    s = StageScheduler("varuna", 2, 2, 0, recompute=False, split_backward=True)
    assert [str(s.next(0, g)) for g in (0, 0, 1, 1, 2, 2)] == ["F0", "F1", "B0", "W0", "B1", "W1"]
    assert s.next(0, 2) is None


def test_split_backward_rules():
    assert format_schedule(stage_schedule("varuna", 2, 2, 1, split_backward=True)) == "F0 B0 W0 F1 B1 W1"
    assert parse_schedule("B0 W0") == [Action("B", 0), Action("W", 0)]
    for policy in ("gpipe", "1f1b"):
        with pytest.raises(ValueError, match="varuna policy only"):
            stage_schedule(policy, 2, 2, 0, split_backward=True)
        with pytest.raises(ValueError, match="varuna policy only"):
            StageScheduler(policy, 2, 2, 0, split_backward=True)
    with pytest.raises(TypeError, match="split_backward must be a bool"):
        pipeline_schedule("varuna", 2, 2, split_backward=1)


def test_opportunistic_rule_deterministic():
    # stage 2 of 4, m=16: static "F0 F1 F2 R0 B0 R1 B1 R2 B2 F3 F4 F5 R3 B3 ..."
    sc = StageScheduler("varuna", 4, 16, 2)
    assert sc.next(1, 0) == Action("F", 0)
    assert sc.next(2, 0) == Action("F", 1)
    assert sc.next(3, 0) == Action("F", 2)
    # R0 next, gradient 0 missing, but F3's input (activation 3) has not arrived: R0
    assert sc.next(3, 0) == Action("R", 0)
    assert sc.next(3, 0) == Action("B", 0)  # backward is never skipped
    # R1 next, gradient 1 missing, activation 3 here: F3 is pulled ahead
    assert sc.next(4, 1) == Action("F", 3)
    assert sc.remaining()[:4] == toks("R1 B1 R2 B2")
    # gradient 1 arrived: R1 runs
    assert sc.next(4, 2) == Action("R", 1)
    assert sc.next(4, 2) == Action("B", 1)
    # R2 next, gradient 2 missing, activations 4 and 5 here: F4, F5, then R2 (F6 not here)
    assert sc.next(6, 2) == Action("F", 4)
    assert sc.next(6, 2) == Action("F", 5)
    assert sc.next(6, 2) == Action("R", 2)
    # the static F3 F4 F5 are gone from the remaining list
    rem = sc.remaining()
    assert rem[:4] == toks("B2 R3 B3 R4")
    assert all(a.kind != "F" or a.mb >= 6 for a in rem)


def test_opportunistic_rule_stage0_and_exhaustion():
    sc = StageScheduler("varuna", 2, 3, 0)  # F0 F1 F2 R0 B0 R1 B1 R2 B2
    for i in range(3):
        assert sc.next(0, 0) == Action("F", i)
    # no forwards left: R0 runs although its gradient is missing
    assert sc.next(0, 0) == Action("R", 0)
    out = [sc.next(0, 3) for _ in range(5)]
    assert format_schedule(out) == "B0 R1 B1 R2 B2"
    assert sc.done and sc.remaining() == []
    assert sc.next(0, 3) is None
    assert sc.next(0, 3) is None

    # stage 0 has its input always: with m > warm-up, F pulled ahead whenever gradient missing
    sc = StageScheduler("varuna", 4, 16, 0)
    for _ in range(9):
        assert sc.next(0, 0).kind == "F"
    assert sc.next(0, 0) == Action("F", 9)  # static would be R0


def test_opportunistic_rule_only_for_varuna():
    for policy in ("gpipe", "1f1b"):
        sc = StageScheduler(policy, 2, 4, 0, recompute=True)
        static = stage_schedule(policy, 2, 4, 0, recompute=True)
        got = []
        while (a := sc.next(4, 0)) is not None:
            got.append(a)
        assert got == static
    # grads already here: varuna follows the static order
    sc = StageScheduler("varuna", 3, 8, 0)
    static = stage_schedule("varuna", 3, 8, 0)
    got = []
    while (a := sc.next(8, 8)) is not None:
        got.append(a)
    assert got == static


def test_scheduler_properties():
    sc = StageScheduler("varuna", 4, 8, 1)
    assert (sc.policy, sc.P, sc.m, sc.stage, sc.recompute) == ("varuna", 4, 8, 1, True)
    assert not sc.done
    assert sc.remaining() == stage_schedule("varuna", 4, 8, 1)
    assert "StageScheduler(policy='varuna'" in repr(sc)
    assert StageScheduler("1f1b", 4, 8, 1).recompute is False


# --------------------------------------------------------------------------- formatting


def test_action_and_format_roundtrip():
    a = Action("B", 12)
    assert str(a) == "B12" and a.kind == "B" and a.mb == 12
    assert str(Action("F", 0)) == "F0" and str(Action("R", 3)) == "R3"
    for policy in POLICIES:
        s = stage_schedule(policy, 5, 11, 1, recompute=True)
        assert parse_schedule(format_schedule(s)) == s
    assert parse_schedule("") == []
    assert parse_schedule("F0,F1, R0  B0\n") == toks("F0 F1 R0 B0")
    assert format_schedule([]) == ""


@pytest.mark.parametrize("bad", ["X1", "F", "F-1", "f0", "F0x", "B1.5"])
def test_parse_schedule_rejects(bad):
    with pytest.raises(ValueError, match=r"bad schedule token .*expected F<i>, R<i>, B<i> or W<i>"):
        parse_schedule("F0 " + bad)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "args, match",
    [
        (("pipedream", 4, 8, 0), r"unknown schedule policy 'pipedream'; valid policies are: varuna, gpipe, 1f1b"),
        (("VARUNA", 4, 8, 0), r"valid policies are: varuna, gpipe, 1f1b"),
        (("varuna", 0, 8, 0), r"P \(number of pipeline stages\) must be >= 1, got 0"),
        (("gpipe", -3, 8, 0), r"P .* must be >= 1, got -3"),
        (("1f1b", 4, 0, 0), r"m \(number of micro-batches per mini-batch\) must be >= 1, got 0"),
        (("varuna", 4, 8, 4), r"0 <= stage < P \(P=4, valid stages 0..3\), got 4"),
        (("varuna", 4, 8, -1), r"valid stages 0..3\), got -1"),
    ],
)
def test_invalid_inputs_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        stage_schedule(*args)
    with pytest.raises(ValueError, match=match):
        StageScheduler(*args)
    policy, P, m, _ = args
    if P < 1 or m < 1 or policy not in POLICIES:
        with pytest.raises(ValueError, match=match):
            pipeline_schedule(policy, P, m)


def test_invalid_inputs_in_cpp_layer():
    # the C++ validation itself (not just the Python pre-checks) maps to ValueError
    from varuna_sdk import _core

    with pytest.raises(ValueError, match="valid policies are: varuna, gpipe, 1f1b"):
        _core.stage_schedule("zb", 2, 2, 0)
    with pytest.raises(ValueError, match="must be >= 1"):
        _core.pipeline_schedule("varuna", 2, 0)
    with pytest.raises(ValueError, match="valid stages 0..1"):
        _core.StageScheduler("1f1b", 2, 2, 2)


def test_invalid_misc():
    with pytest.raises(ValueError, match="valid policies are"):
        default_recompute("pipedream")
    sc = StageScheduler("varuna", 2, 2, 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        sc.next(-1, 0)
    with pytest.raises(TypeError, match="P must be an int"):
        stage_schedule("varuna", 2.0, 2, 0)
    with pytest.raises(TypeError, match="stage must be an int"):
        StageScheduler("varuna", 2, 2, True)


def test_numpy_integers_and_bools_are_accepted_and_the_last_stage_never_recomputes():
    """A sweep over NumPy arrays handed np.int64 counts and np.bool_ flags, which were refused;
    they act exactly as Python ints/bools. The last stage reported recompute=True when given it,
    though it never recomputes (its action list has no R)."""
    np = pytest.importorskip("numpy")
    flags = list(np.array([True, False, True]))
    for stage in range(3):
        a = StageScheduler("varuna", np.int64(3), np.int32(6), np.int64(stage), recompute=flags,
                           max_in_flight=list(np.array([2, 1, 0])))
        b = StageScheduler("varuna", 3, 6, stage, recompute=[True, False, True], max_in_flight=[2, 1, 0])
        assert (a.recompute, a.max_in_flight, a.remaining()) == (b.recompute, b.max_in_flight, b.remaining())
        assert a.next(np.int64(6), np.int64(0)) == b.next(6, 0)
    assert stage_schedule("varuna", np.int64(2), np.int64(2), np.int64(0), np.bool_(False)) == \
        stage_schedule("varuna", 2, 2, 0, False)
    assert StageScheduler("varuna", 3, 4, 1, recompute=True).recompute
    last = StageScheduler("varuna", 3, 4, 2, recompute=True)
    assert not last.recompute and all(x.kind != "R" for x in last.remaining())
    with pytest.raises(TypeError, match="recompute must be None, a bool or a list of 3 bools"):
        StageScheduler("varuna", 3, 4, 1, recompute=list(np.array([1, 0, 1])))
    with pytest.raises(TypeError, match="max_in_flight must be an int"):
        StageScheduler("varuna", 3, 4, 1, max_in_flight=np.float64(2.0))
    assert stage_schedule("varuna", 2, 2, 0, split_backward=np.bool_(True)) == \
        stage_schedule("varuna", 2, 2, 0, split_backward=True)
    # counts beyond the C++ int were pybind's "incompatible function arguments"
    for call, name in ((lambda: stage_schedule("varuna", 2 ** 40, 4, 0), "P"),
                       (lambda: stage_schedule("varuna", 2, 2 ** 33, 0), "m"),
                       (lambda: StageScheduler("varuna", 2, 2, 0).next(2 ** 40, 0), "acts_arrived")):
        with pytest.raises(ValueError, match=f"{name}=\\d+ is out of range: at most 2147483647"):
            call()


def test_module_never_imports_torch():
    src = pathlib.Path(sch.__file__).read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        assert not any(n == "torch" or n.startswith("torch.") for n in names), names


def test_the_c_core_runs_exactly_the_policies_config_names():
    """POLICIES is defined once (varuna_sdk.config); the C++ core must accept each name and refuse others."""
    for policy in POLICIES:
        assert stage_schedule(policy, 2, 4, 0), policy
    with pytest.raises((ValueError, RuntimeError)):
        stage_schedule("zero-bubble-v", 2, 4, 0)
