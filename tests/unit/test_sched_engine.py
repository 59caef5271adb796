"""The STRADS engine over the transport: a scheduler rank and workers holding rows compute what one process
computes (the same blocks, the same coefficients), plan ahead as told, and refuse bad calls on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import Lasso

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.sched.lasso import BlockRun, lasso_objective, row_bounds, row_moments, run_blocks
from paratrain.sched.lasso_engine import lasso, shotgun, strads, worker_rows
from paratrain.sched.strads import RandomScheduler, StradsScheduler, correlation_from_moments
from paratrain.testing import run_ranks


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(90, 30))
    x[:, 1] = x[:, 0] + 0.1 * rng.normal(size=90)  # two near-copies: the check keeps them apart
    truth = rng.normal(size=30) * (rng.random(30) < 0.3)
    return x, x @ truth + 0.1 * rng.normal(size=90)


def _run(workers: int, x: np.ndarray, y: np.ndarray, transport: str = "inproc", **kw: object) -> BlockRun:
    def rank(ctx: Context) -> BlockRun:
        rows = (None, None) if ctx.rank == 0 else worker_rows(x, y, ctx.rank, ctx.world_size)
        return lasso(ctx, *rows, **kw)  # type: ignore[arg-type]

    return run_ranks(workers + 1, rank, transport=transport, timeout=60)[0]


@pytest.mark.parametrize(("workers", "depth"), [(1, 1), (3, 1), (3, 3), (4, 2)])
def test_the_engine_computes_what_one_process_computes(workers: int, depth: int) -> None:
    """The same blocks in the same order (the scheduler's draws depend on the changes the workers' sums give),
    and the same coefficients and objectives to rounding, against run_blocks with the same depth and row parts."""
    x, y = _data()
    alpha = 0.05
    gram, sums = row_moments(x, row_bounds(len(y), workers))  # the scheduler's view, summed as it sums it
    corr = correlation_from_moments(gram, sums, len(y))
    ref = run_blocks(x, y, alpha, StradsScheduler(corr, 4, seed=2), max_updates=300, depth=depth, parts=workers)
    out = _run(workers, x, y, alpha=alpha, make_scheduler=strads(4, seed=2), max_updates=300, depth=depth)
    assert len(out.blocks) == len(ref.blocks)
    assert all(np.array_equal(a, b) for a, b in zip(out.blocks, ref.blocks, strict=True))
    np.testing.assert_allclose(out.beta, ref.beta, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out.objectives, ref.objectives, rtol=1e-12)
    assert out.updates == ref.updates and len(out.seconds) == len(out.blocks)


def test_over_sockets_the_engine_reaches_scikit_learns_optimum() -> None:
    """Real sockets (zmq on loopback), 2 workers, blocks of 4 with the dependency check: the objective comes
    within 1e-6 of scikit-learn's optimum and the coefficients match it."""
    x, y = _data(1)
    alpha = 0.05
    coef = Lasso(alpha=alpha, fit_intercept=False, tol=1e-14, max_iter=1_000_000).fit(x, y).coef_
    optimum = lasso_objective(x, y, coef, alpha)
    out = _run(
        2, x, y, "zmq", alpha=alpha, make_scheduler=strads(4, seed=0), max_updates=50_000, target=optimum * (1 + 1e-6)
    )
    assert out.objectives[-1] <= optimum * (1 + 1e-6)
    np.testing.assert_allclose(out.beta, coef, atol=1e-3)
    assert lasso_objective(x, y, out.beta, alpha) == pytest.approx(out.objectives[-1], rel=1e-9)


def test_the_random_baseline_runs_the_same_rounds() -> None:
    x, y = _data(2)
    ref = run_blocks(x, y, 0.05, RandomScheduler(30, 6, seed=3), max_updates=120, parts=2)
    out = _run(2, x, y, alpha=0.05, make_scheduler=shotgun(6, seed=3), max_updates=120)
    assert all(np.array_equal(a, b) for a, b in zip(out.blocks, ref.blocks, strict=True))
    np.testing.assert_allclose(out.beta, ref.beta, atol=1e-12)


def test_bad_calls_are_errors_not_hangs() -> None:
    x, y = _data()

    def alone(ctx: Context) -> BlockRun:
        return lasso(ctx, None, None, alpha=0.1, make_scheduler=strads(2), max_updates=10)

    with pytest.raises(ConfigError, match="at least one worker"):
        run_ranks(1, alone)

    def data_everywhere(ctx: Context) -> BlockRun:
        return lasso(ctx, x, y, alpha=0.1, make_scheduler=strads(2), max_updates=10)

    with pytest.raises(ConfigError, match="holds no data"):
        run_ranks(2, data_everywhere, timeout=20)
