"""``paratrain.recovery.rollback.plan_rollback``: the step a gossip job rolls back to after a death, and who sends a
replacement its state, as exact tables; and the reports' round trip through the integers an allgather carries."""

from __future__ import annotations

import pytest

from paratrain.recovery.plan import RecoveryError
from paratrain.recovery.rollback import Copy, RollbackPlan, RollbackState, buddy_of, plan_rollback

R = RollbackState.replacement()


def held(own: tuple[int, ...], ward: tuple[int, ...]) -> RollbackState:
    return RollbackState(own, ward)


@pytest.mark.parametrize(
    ("states", "plan"),
    [
        # rank 1 replaced; its copy of step 20 reached rank 2 before it died: the newest step
        ([held((20, 10), (20, 10)), R, held((20, 10), (20, 10))], RollbackPlan(20, (Copy(2, 1),))),
        # ... its copy of 20 had not arrived: 10, held by everyone
        ([held((20, 10), (20, 10)), R, held((20, 10), (10, 0))], RollbackPlan(10, (Copy(2, 1),))),
        # a survivor one checkpoint behind (it had not taken 20 yet): 10
        ([held((10, 0), (10, 0)), R, held((20, 10), (20, 10))], RollbackPlan(10, (Copy(2, 1),))),
        # a death before the first copy arrived: step 0, which the replacement builds itself (no copy sent)
        ([held((0,), ()), R, held((0,), ())], RollbackPlan(0, ())),
        # rank 0 replaced: its buddy is rank 1; 4 ranks, ward of rank 3 is rank 2
        ([R, *[held((30, 20), (30, 20))] * 3], RollbackPlan(30, (Copy(1, 0),))),
        # two replacements whose buddies survived (ranks 0 and 2 of 4)
        ([R, held((10, 0), (10, 0)), R, held((10, 0), (10, 0))], RollbackPlan(10, (Copy(1, 0), Copy(3, 2)))),
        # a re-formed job with no replacement (a rank failed during recovery and came back as itself): the newest
        ([held((5, 0), (5,)), held((5, 0), (5,))], RollbackPlan(5, ())),
    ],
)
def test_plan_rollback_tables(states: list[RollbackState], plan: RollbackPlan) -> None:
    assert plan_rollback(states) == plan


def test_a_replacement_whose_buddy_was_replaced_too_goes_back_to_step_0_or_cannot_recover() -> None:
    """Its copies died with its buddy: only the initial state is left to it (rebuilt, not sent); once every survivor
    dropped step 0, nothing."""
    assert plan_rollback([held((0,), (0,)), R, R]) == RollbackPlan(0, ())
    assert plan_rollback([held((10, 0), (10, 0)), R, R]) == RollbackPlan(0, ())
    with pytest.raises(RecoveryError, match="rank 1's copies died with rank 2, which kept them"):
        plan_rollback([held((20, 10), (20, 10)), R, R])


def test_every_rank_replaced_cannot_recover() -> None:
    with pytest.raises(RecoveryError, match="every rank was restarted"):
        plan_rollback([R, R])


def test_no_common_step_is_reported_with_what_each_holds() -> None:
    with pytest.raises(RecoveryError, match=r"no step's checkpoint is held by every rank"):
        plan_rollback([held((20, 10), (20, 10)), R, held((40, 30), (30, 20))])


def test_reports_travel_as_fixed_width_integers() -> None:
    for state in (R, held((20, 10), (20, 10)), held((0,), ()), held((7,), (7, 0))):
        row = state.as_row()
        assert len(row) == 5
        assert RollbackState.from_row(row) == state


def test_buddies_form_a_ring() -> None:
    assert [buddy_of(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert buddy_of(0, 1) == 0


def test_a_replicated_stage_s_replacement_gets_its_state_from_its_twin() -> None:
    def twin(rank: int, n: int) -> int:  # two pipelines of two stages: rank r and r + 2 hold one state
        return (rank + 2) % n

    held = RollbackState((6, 3), (6, 3))  # a twin's copies are its own checkpoints
    states = [held, RollbackState.replacement(), held, RollbackState((6, 3), (6, 3))]
    assert plan_rollback(states, twin) == RollbackPlan(6, (Copy(3, 1),))
    both = [held, RollbackState.replacement(), held, RollbackState.replacement()]  # a stage's two copies died
    with pytest.raises(RecoveryError, match="rank 1's copies died with rank 3"):
        plan_rollback(both, twin)
