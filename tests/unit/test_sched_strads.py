"""STRADS's scheduler: the dependency check's guarantee, priorities that follow the changes, and Lasso by
coordinate blocks against scikit-learn's optimum (converging where unchecked parallel blocks diverge)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from sklearn.linear_model import Lasso

from paratrain.errors import ConfigError
from paratrain.sched.lasso import block_values, lasso_objective, run_blocks
from paratrain.sched.strads import RandomScheduler, StradsScheduler, correlation, sample_candidates


def _design(n: int, p: int, group: int, rho: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features in groups of ``group`` that share a latent factor (correlation about ``rho`` inside a group,
    about 0 across), a sparse truth, noise."""
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(n, p // group))
    x = np.sqrt(rho) * np.repeat(latent, group, axis=1) + np.sqrt(1 - rho) * rng.normal(size=(n, p))
    truth = np.zeros(p)
    truth[rng.choice(p, max(1, p // 10), replace=False)] = 3 * rng.normal(size=max(1, p // 10))
    return x, x @ truth + 0.5 * rng.normal(size=n)


def _optimum(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    coef: np.ndarray = Lasso(alpha=alpha, fit_intercept=False, tol=1e-14, max_iter=1_000_000).fit(x, y).coef_
    return coef


@pytest.mark.parametrize("threshold", [0.1, 0.3])
def test_the_dependency_check_never_schedules_two_correlated_coordinates(threshold: float) -> None:
    """200 blocks of up to 8 over 60 features in correlated groups of 6: no two coordinates of a block have an
    absolute Pearson correlation at or above the threshold (numpy's corrcoef, computed apart), all distinct."""
    x, _ = _design(120, 60, 6, 0.9, seed=3)
    corr = np.abs(np.corrcoef(x.T))
    scheduler = StradsScheduler(correlation(x), block_size=8, threshold=threshold, seed=2)
    sizes = []
    for _ in range(200):
        block = scheduler.next_block()
        assert len(set(block.tolist())) == len(block)
        assert all(corr[i, j] < threshold for i, j in itertools.combinations(block.tolist(), 2))
        scheduler.report(block, np.ones(len(block)))
        sizes.append(len(block))
    assert max(sizes) == 8  # the check drops correlated candidates, not whole blocks


def test_priorities_follow_the_reported_changes() -> None:
    """A coordinate that just moved a lot is drawn first far more often than one that did not move."""
    scheduler = StradsScheduler(correlation(np.random.default_rng(0).normal(size=(40, 10))), block_size=1)
    scheduler.report(np.arange(10), np.array([5.0] + [0.01] * 9))
    first = [int(scheduler.next_block()[0]) for _ in range(200)]
    assert first.count(0) > 100
    assert set(first) != {0}  # the base weight keeps the others reachable
    with pytest.raises(ConfigError, match="positive"):
        sample_candidates(np.array([1.0, 0.0]), 1, np.random.default_rng(0))


@pytest.mark.parametrize("which", ["strads", "random"])
def test_one_coordinate_at_a_time_reaches_scikit_learns_optimum(which: str) -> None:
    x, y = _design(80, 30, 3, 0.5, seed=1)
    alpha = 0.05
    coef = _optimum(x, y, alpha)
    optimum = lasso_objective(x, y, coef, alpha)
    scheduler = StradsScheduler(correlation(x), block_size=1, seed=4) if which == "strads" else RandomScheduler(30, 1)
    run = run_blocks(x, y, alpha, scheduler, max_updates=200_000, target=optimum * (1 + 1e-9))
    assert run.objectives[-1] <= optimum * (1 + 1e-9)
    np.testing.assert_allclose(run.beta, coef, atol=1e-4)


def test_unchecked_parallel_blocks_diverge_where_the_checked_ones_converge() -> None:
    """20 features correlated about 0.95 with each other: 8 updated at once from one residual overshoot and the
    objective explodes (Shotgun's limit); the dependency check admits one at a time and reaches scikit-learn's
    optimum within 1e-4."""
    x, y = _design(60, 20, 20, 0.95, seed=0)
    alpha = 0.05
    optimum = lasso_objective(x, y, _optimum(x, y, alpha), alpha)
    unchecked = run_blocks(x, y, alpha, RandomScheduler(20, 8, seed=1), max_updates=20_000, target=optimum * 1.0001)
    assert unchecked.objectives[-1] > 1e4 * optimum
    checked = run_blocks(
        x, y, alpha, StradsScheduler(correlation(x), 8, seed=1), max_updates=20_000, target=optimum * 1.0001
    )
    assert checked.objectives[-1] <= optimum * 1.0001
    assert all(len(b) == 1 for b in checked.blocks)


def test_a_block_is_each_coordinates_minimiser_from_the_same_residual() -> None:
    """Each value of a block minimises the objective along its coordinate with the others fixed (checked on a
    grid around it), and a feature of zeros stays 0."""
    rng = np.random.default_rng(5)
    x = np.column_stack([rng.normal(size=(30, 3)), np.zeros(30)])
    y, beta, alpha = rng.normal(size=30), rng.normal(size=4) * 0.1, 0.1
    beta[3] = 0.0
    scale = (x * x).sum(axis=0) / 30
    values = block_values(x, y - x @ beta, beta, np.arange(4), alpha=alpha, scale=scale)
    assert values[3] == 0.0
    for j in range(3):
        trial = beta.copy()

        def along(v: float, j: int = j, trial: np.ndarray = trial) -> float:
            trial[j] = v
            return lasso_objective(x, y, trial, alpha)

        best = along(values[j])
        assert all(best <= along(values[j] + d) + 1e-15 for d in (-1e-3, -1e-6, 1e-6, 1e-3))
