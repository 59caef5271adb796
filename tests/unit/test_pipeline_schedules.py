"""Pipeline schedules: exact tables, completeness, deadlock-freedom, bubble and memory without running a model."""

from __future__ import annotations

import pytest

from paratrain.pipeline.schedules import (
    Schedule,
    Step,
    check,
    gpipe,
    gradient_from,
    lower,
    one_f_one_b,
    pipedream,
    schedule,
)
from paratrain.plan import PlanError


def test_gpipe_table() -> None:
    assert gpipe(3, 2).table() == ["F0 F1 B0 B1 S1"] * 3


def test_one_f_one_b_tables() -> None:
    assert one_f_one_b(4, 6).table() == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 S1",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5 S1",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5 S1",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 S1",
    ]
    # fewer micro-batches than stages: the warm-up is cut short, every stage still runs each once
    assert one_f_one_b(4, 2).table() == ["F0 F1 B0 B1 S1"] * 3 + ["F0 B0 F1 B1 S1"]


def test_pipedream_table_and_weight_versions() -> None:
    sched = pipedream(3, 4)
    assert sched.table() == [
        "F0 F1 F2 B0 S1 F3 B1 S2 B2 S3 B3 S4",
        "F0 F1 B0 S1 F2 B1 S2 F3 B2 S3 B3 S4",
        "F0 B0 S1 F1 B1 S2 F2 B2 S3 F3 B3 S4",
    ]
    versions = [[(str(st), st.version) for st in steps if st.kind != "S"] for steps in sched.stages]
    # stage 0 runs F0..F2 on version 0 and F3 after one step; each backward uses its forward's (stashed) version
    assert versions[0] == [("F0", 0), ("F1", 0), ("F2", 0), ("B0", 0), ("F3", 1), ("B1", 0), ("B2", 0), ("B3", 1)]
    assert versions[2] == [("F0", 0), ("B0", 0), ("F1", 1), ("B1", 1), ("F2", 2), ("B2", 2), ("F3", 3), ("B3", 3)]


@pytest.mark.parametrize("vertical_sync", [False, True])
@pytest.mark.parametrize(("k", "m"), [(2, 1), (2, 5), (3, 3), (4, 8)])
def test_pipedream_backward_uses_the_version_of_its_forward(k: int, m: int, vertical_sync: bool) -> None:
    sched = pipedream(k, m, vertical_sync=vertical_sync)
    for steps in sched.stages:
        used = {st.microbatch: st.version for st in steps if st.kind == "F"}
        assert all(st.version == used[st.microbatch] for st in steps if st.kind == "B")
    if vertical_sync:  # one consistent model per micro-batch across stages
        first = {st.microbatch: st.version for st in sched.stages[0] if st.kind == "F"}
        for steps in sched.stages:
            assert {st.microbatch: st.version for st in steps if st.kind == "F"} == first
    check(sched)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 9])
def test_flushed_schedules_have_the_textbook_bubble_and_memory(k: int, m: int) -> None:
    for sched in (gpipe(k, m), one_f_one_b(k, m)):
        c = check(sched, forward_s=1.0, backward_s=2.0)
        assert c.bubble == pytest.approx((k - 1) / (m + k - 1)), sched.name
        assert c.makespan == pytest.approx((m + k - 1) * 3.0)
    assert check(gpipe(k, m)).peak_activations == (m,) * k
    assert check(one_f_one_b(k, m)).peak_activations == tuple(min(k - s, m) for s in range(k))


def test_check_finds_a_deadlock_and_an_incomplete_schedule() -> None:
    # stage 1 wants micro-batch 1 first, but stage 0 sends it only after B0, which needs stage 1's B0
    stage0 = (Step("F", 0, 0), Step("B", 0, 0), Step("F", 1, 0), Step("B", 1, 0))
    stage1 = (Step("F", 1, 0), Step("B", 1, 0), Step("F", 0, 0), Step("B", 0, 0))
    with pytest.raises(PlanError, match="deadlock"):
        check(Schedule("bad", (stage0, stage1), 2))
    with pytest.raises(PlanError, match="exactly once"):
        check(Schedule("short", ((Step("F", 0, 0),),), 1))
    with pytest.raises(PlanError, match="before its forward"):
        check(Schedule("backwards", ((Step("B", 0, 0), Step("F", 0, 0)),), 1))


def test_lowered_messages_carry_activations_forward_and_gradients_back() -> None:
    plan = lower(one_f_one_b(3, 2), activation_bytes=[100, 200, 0])
    plan.validate()
    assert plan.sends(0) == [m for m in plan.sends(0) if m.dst == 1]
    # stage 1 runs F0 F1 B0 B1: two activations of 200 bytes to stage 2, two gradients of 100 bytes to stage 0
    assert [(m.dst, m.nbytes) for m in plan.sends(1)] == [(2, 200), (2, 200), (0, 100), (0, 100)]
    assert schedule("gpipe", 2, 2) == gpipe(2, 2)
    # a stage 0 that learns nothing (a Flatten) gets no gradient and runs no backward; stage 1 sends it nothing
    front = lower(one_f_one_b(3, 2), activation_bytes=[100, 200, 0], first_learner=gradient_from([False, True, True]))
    front.validate()
    # instead an empty message ends stage 0's step when stage 1's ends
    assert [(m.dst, m.nbytes) for m in front.sends(1)] == [(2, 200), (2, 200), (0, 0)]
    assert [(a.kind, a.peer, a.nbytes) for a in front.ranks[0][-1:]] == [("recv", 1, 0)]
    assert [a.label for a in front.ranks[0] if a.kind == "compute"] == ["F0", "F1", "S1"]
    assert [m.dst for m in front.sends(2)] == [1, 1]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule("zigzag", 2, 2)
