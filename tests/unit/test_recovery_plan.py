"""plan_recovery: who sends what to whom when a job re-forms, as exact tables, and its refusals."""

from __future__ import annotations

import itertools

import pytest

from paratrain.recovery.plan import Ckpt, RankState, RecoveryError, Transfer, plan_recovery

R = RankState.restarted()


def test_a_restarted_rank_gets_the_newest_checkpoint_and_the_results_since_it() -> None:
    plan = plan_recovery([RankState(13, 2, 10, 9), R, RankState(13, 2, 10, 9)])
    assert plan.frontier == 13
    assert plan.checkpoint == Ckpt(src=0, version=2, seq=10, dst=(1,))
    assert plan.transfers == (Transfer(0, 1, 10, 13),)


def test_without_a_checkpoint_the_restarted_rank_replays_from_the_first_operation() -> None:
    plan = plan_recovery([R, RankState(5, 0, 0, 0)])
    assert plan.checkpoint is None
    assert plan.transfers == (Transfer(1, 0, 0, 5),)
    assert plan.start(0, [R, RankState(5, 0, 0, 0)]) == 0


def test_a_survivor_one_operation_behind_gets_that_one_result() -> None:
    states = [RankState(7, 1, 5, 4), RankState(8, 1, 5, 4), RankState(8, 1, 5, 4)]
    plan = plan_recovery(states)
    assert plan.frontier == 8 and plan.checkpoint is None
    assert plan.transfers == (Transfer(1, 0, 7, 8),)
    assert [plan.start(r, states) for r in range(3)] == [7, 8, 8]


def test_a_survivor_that_has_not_reached_the_newest_checkpoint_still_serves_and_is_not_the_source() -> None:
    # rank 0 completed op 10 and checkpointed (version 3 at 10, keeps from 9); rank 2 is still in op 9 with
    # version 2 at op 5 (keeps from 4): the restarted rank loads version 3 from rank 0, rank 2 gets op 9
    states = [RankState(10, 3, 10, 9), R, RankState(9, 2, 5, 4)]
    plan = plan_recovery(states)
    assert plan.checkpoint == Ckpt(0, 3, 10, (1,))
    assert plan.transfers == (Transfer(0, 2, 9, 10),)
    assert plan.start(1, states) == 10


def test_results_come_from_the_lowest_survivor_that_keeps_them_in_runs() -> None:
    # rank 0 keeps 6..9, rank 1 keeps 3..9; the restarted rank 2 loads version 1 at op 3 from rank 1
    states = [RankState(10, 2, 7, 6), RankState(10, 1, 3, 3), R]
    plan = plan_recovery(states)
    assert plan.checkpoint == Ckpt(0, 2, 7, (2,))
    assert plan.transfers == (Transfer(0, 2, 7, 10),)
    states = [RankState(10, 1, 7, 6), RankState(10, 1, 3, 3), R]  # equal versions: the lowest rank's
    assert plan_recovery(states).checkpoint == Ckpt(0, 1, 7, (2,))


def test_two_restarted_ranks_get_the_same_checkpoint_and_their_own_results() -> None:
    plan = plan_recovery([R, RankState(4, 1, 2, 1), R, RankState(4, 1, 2, 1)])
    assert plan.checkpoint == Ckpt(1, 1, 2, (0, 2))
    assert plan.transfers == (Transfer(1, 0, 2, 4), Transfer(1, 2, 2, 4))


def test_a_result_kept_by_different_survivors_in_turn_is_split_in_runs() -> None:
    # rank 0 keeps 2..5 only, rank 1 keeps 0..4 (it is one behind): ranks differ only in what they keep
    states = [RankState(6, 0, 0, 2), RankState(5, 0, 0, 0), R]
    plan = plan_recovery(states)
    assert plan.transfers == (Transfer(0, 1, 5, 6), Transfer(1, 2, 0, 2), Transfer(0, 2, 2, 6))


def test_nothing_moves_when_nobody_is_behind() -> None:
    plan = plan_recovery([RankState(3, 0, 0, 0)] * 3)
    assert plan.frontier == 3 and plan.checkpoint is None and plan.transfers == ()


def test_refusals_say_what_is_missing() -> None:
    with pytest.raises(RecoveryError, match="every rank was restarted"):
        plan_recovery([R, R])
    with pytest.raises(RecoveryError, match="rank 1 needs the result of reliable operation 0"):
        plan_recovery([RankState(6, 0, 0, 4), R])  # no checkpoint, and the results before 4 are gone


def test_every_plan_gives_each_rank_exactly_the_operations_it_lacks() -> None:
    """Over every small consistent situation: after the plan, each rank holds a contiguous history up to the
    frontier, from a survivor that really kept each result."""
    for completed, lag, ckpt_seq, restarted in itertools.product(range(1, 7), (0, 1), range(0, 7), range(3)):
        if ckpt_seq > completed - lag:
            continue
        states = []
        for r in range(3):
            if r == restarted:
                states.append(R)
                continue
            done = completed - (lag if r == 2 else 0)
            version = 1 if ckpt_seq > 0 else 0
            states.append(RankState(done, version, ckpt_seq if version else 0, max(0, ckpt_seq - 1) if version else 0))
        if all(s.is_restarted for s in states):
            continue
        plan = plan_recovery(states)
        for r in range(len(states)):
            got = sorted(seq for t in plan.transfers if t.dst == r for seq in range(t.lo, t.hi))
            assert got == list(range(plan.start(r, states), plan.frontier)), (states, plan)
        for t in plan.transfers:
            keeper = states[t.src]
            assert not keeper.is_restarted and keeper.cache_lo <= t.lo and t.hi <= keeper.completed
