"""The parameter server's round rule (paratrain.ps.rounds): when a round closes and what its one step is."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain.ps.optim import SGD, Adam
from paratrain.ps.rounds import RoundSum, commit_ready, mode_of, round_of_push, staleness_weight


def test_modes_and_round_ids() -> None:
    assert [mode_of(k) for k in ("bsp", "ssp", "asp")] == ["clock", "clock", "arrival"]
    with pytest.raises(ValueError, match="unknown consistency"):
        mode_of("bulk")
    assert round_of_push("clock", 5, 2) == 5
    assert round_of_push("clock", 1, 2) == 2  # a lost worker's late push joins the oldest open round
    assert round_of_push("arrival", 5, 2) == 2


@pytest.mark.parametrize("live", [1, 2, 4])
def test_clock_rounds_close_when_every_live_worker_is_past_them(live: int) -> None:
    table = [[commit_ready("clock", r, 1, min_done=d, live=live) for d in range(4)] for r in range(3)]
    assert table == [
        [False, True, True, True],
        [False, False, True, True],
        [False, False, False, True],
    ]


def test_arrival_rounds_close_at_n_pushes_and_at_least_one() -> None:
    assert [commit_ready("arrival", 0, c, min_done=0, live=3) for c in range(5)] == [False, False, False, True, True]
    assert commit_ready("arrival", 0, 1, min_done=0, live=0)  # nobody left: apply rather than lose
    assert not commit_ready("arrival", 0, 0, min_done=0, live=0)


def test_staleness_weights() -> None:
    assert [staleness_weight(8, v, aware=True) for v in (8, 7, 6, 4, None)] == [1.0, 1.0, 0.5, 0.25, 1.0]
    assert staleness_weight(8, 0, aware=False) == 1.0


def test_dense_round_is_one_step_on_the_weighted_mean() -> None:
    opt = Adam(lr=0.01)
    value, ref = np.ones(6), np.ones(6)
    state, ref_state = opt.init_state(value), opt.init_state(ref)
    g1, g2, g3 = np.arange(6.0), np.full(6, -2.0), np.linspace(0, 1, 6)
    rnd = RoundSum()
    for g, w in ((g1, 1.0), (g2, 0.5), (g3, 1.0)):
        rnd.add(g, None, w, value)
    rnd.apply(opt, value, state)
    opt.step(ref, (g1 + 0.5 * g2 + g3) / 3, ref_state)
    np.testing.assert_allclose(value, ref, rtol=1e-14)
    assert int(state["step"][0]) == 1  # Adam's step counter advanced once for three pushes


def test_sparse_round_is_a_lazy_step_and_a_dense_push_densifies() -> None:
    opt = SGD(lr=1.0, momentum=0.5)
    value = np.zeros((4, 2))
    state = opt.init_state(value)
    rnd = RoundSum()
    rnd.add(np.ones((2, 2)), np.array([1, 3]), 1.0, value)
    rnd.add(np.full((1, 2), 4.0), np.array([3]), 0.5, value)
    assert rnd.dense is None and rnd.count == 2
    rnd.apply(opt, value, state)
    np.testing.assert_allclose(value, [[0, 0], [-0.5, -0.5], [0, 0], [-1.5, -1.5]])

    mixed = RoundSum()
    mixed.add(np.ones((1, 2)), np.array([0]), 1.0, value)
    mixed.add(np.ones((4, 2)), None, 1.0, value)
    mixed.add(np.ones((1, 2)), np.array([2]), 1.0, value)
    assert mixed.dense is not None
    np.testing.assert_allclose(mixed.dense, [[2, 2], [1, 1], [2, 2], [1, 1]])


def test_an_empty_round_changes_nothing() -> None:
    opt = SGD(lr=1.0)
    value = np.ones(3)
    RoundSum().apply(opt, value, opt.init_state(value))
    np.testing.assert_array_equal(value, np.ones(3))
