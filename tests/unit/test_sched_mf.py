"""CCD++ matrix factorisation: the rank-1 rule reaches the known optimum of a dense matrix (shrunk SVD), the
record equals the objective computed from scratch, the priority order is what it says, and the engine over the
transport computes what one process computes, number for number."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.sched.mf import MFRun, ccdpp, mf_objective, observed, power_law_ratings, svd_optimum
from paratrain.sched.mf_engine import factorize, worker_block
from paratrain.testing import run_ranks


def _dense(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(60, 4)) @ rng.normal(size=(4, 25)) + 0.1 * rng.normal(size=(60, 25))


def test_svd_optimum_is_the_minimum_of_the_regularised_objective() -> None:
    """The closed form against its definition: the balanced factors of the shrunk SVD attain it."""
    r, lam = _dense(), 0.7
    u, s, vt = np.linalg.svd(r, full_matrices=False)
    shrunk = np.sqrt(np.maximum(s[:3] - lam, 0))
    w, h = u[:, :3] * shrunk, vt[:3].T * shrunk
    assert mf_objective(sp.csr_matrix(r), w, h, lam) == pytest.approx(svd_optimum(r, 3, lam), rel=1e-12)


@pytest.mark.parametrize("order", ["cyclic", "priority"])
def test_ccdpp_reaches_the_dense_optimum_and_records_the_true_objective(order: str) -> None:
    r, lam = _dense(), 0.5
    run, w = ccdpp(r, 4, lam, picks=400, inner=10, order=order, parts=3)
    assert run.objectives[-1] <= svd_optimum(r, 4, lam) * (1 + (1e-6 if order == "cyclic" else 1e-4))
    assert mf_objective(sp.csr_matrix(r), w, run.h, lam) == pytest.approx(run.objectives[-1], rel=1e-10)
    assert all(b <= a * (1 + 1e-12) for a, b in zip(run.objectives, run.objectives[1:], strict=False))  # descent


def test_a_dense_matrixs_zeros_are_observed_entries() -> None:
    """Zero pixels are data, not missing ratings: the factorisation of a matrix with zeros reaches the SVD's
    optimum (it would go below it if they were dropped)."""
    r = np.maximum(_dense(3), 0.0)  # about half zeros
    assert observed(r).nnz == r.size and worker_block(r, 1, 3).nnz == r.size // 2
    run, _ = ccdpp(r, 4, 0.5, picks=400, inner=10, parts=2)
    assert 0 <= run.objectives[-1] / svd_optimum(r, 4, 0.5) - 1 <= 1e-6


def test_priority_tries_every_factor_then_draws_by_gain_without_starving_any() -> None:
    r = _dense(1)
    run, _ = ccdpp(r, 4, 0.5, picks=40, inner=2, order="priority", seed=5)
    assert run.picks[:4] == [0, 1, 2, 3]
    assert set(run.picks[4:]) == {0, 1, 2, 3} and run.picks[4:12] != [0, 1, 2, 3] * 2
    assert ccdpp(r, 4, 0.5, picks=40, inner=2, order="priority", seed=5)[0].picks == run.picks  # seeded
    assert ccdpp(r, 4, 0.5, picks=8, order="cyclic")[0].picks == [0, 1, 2, 3, 0, 1, 2, 3]


def test_power_law_ratings_are_skewed_disjoint_and_seeded() -> None:
    train, test = power_law_ratings(400, 120, seed=3)
    per_col = np.bincount(train.indices, minlength=120)
    assert per_col.max() > 5 * np.median(per_col)  # a few popular columns
    per_row = np.diff(train.indptr)
    assert per_row.max() > 10 * np.median(per_row)  # a few very active rows
    assert train.multiply(test).nnz == 0 and 0.05 < test.nnz / (train.nnz + test.nnz) < 0.15
    again, _ = power_law_ratings(400, 120, seed=3)
    assert (train != again).nnz == 0


def _engine(workers: int, r: sp.csr_matrix, transport: str = "inproc", **kw: object) -> MFRun:
    def rank(ctx: Context) -> MFRun:
        rows = None if ctx.rank == 0 else worker_block(r, ctx.rank, ctx.world_size)
        return factorize(ctx, rows, cols=r.shape[1], **kw)  # type: ignore[arg-type]

    return run_ranks(workers + 1, rank, transport=transport, timeout=60)[0]


@pytest.mark.parametrize(
    ("workers", "order", "transport", "dense"),
    [
        (1, "cyclic", "inproc", False),
        (3, "priority", "inproc", False),
        (2, "priority", "zmq", False),
        (3, "cyclic", "inproc", True),
        (2, "priority", "zmq", True),
    ],
)
def test_the_engine_computes_what_one_process_computes(workers: int, order: str, transport: str, dense: bool) -> None:
    """Sparse rows (CSR products) and fully observed ones (the dense path), over in-process queues and sockets."""
    r = sp.csr_matrix(_dense(5)[:, :12]) if dense else power_law_ratings(90, 40, per_row=8, rank=3, seed=1)[0]
    ref, _ = ccdpp(r, 3, 0.3, picks=25, inner=2, order=order, parts=workers, seed=4)
    out = _engine(workers, r, transport, rank=3, lam=0.3, picks=25, inner=2, order=order, seed=4)
    assert out.picks == ref.picks and out.rounds == ref.rounds
    assert out.objectives == ref.objectives  # the same sums in the same order: to the last bit
    assert np.array_equal(out.h, ref.h)


def test_the_engine_stops_at_the_target() -> None:
    r = sp.csr_matrix(_dense(2))
    target = svd_optimum(r.toarray(), 4, 0.5) * 1.01
    out = _engine(2, r, rank=4, lam=0.5, picks=1000, inner=5, target=target)
    assert out.objectives[-1] <= target < out.objectives[-2]


def test_bad_calls_are_errors_not_hangs() -> None:
    r = sp.csr_matrix(_dense())

    def rows_everywhere(ctx: Context) -> MFRun:
        return factorize(ctx, r, cols=25, rank=2, lam=0.1, picks=3)

    with pytest.raises(ConfigError, match="holds no rows"):
        run_ranks(2, rows_everywhere, timeout=20)

    def bad_order(ctx: Context) -> MFRun:
        rows = None if ctx.rank == 0 else worker_block(r, ctx.rank, ctx.world_size)
        return factorize(ctx, rows, cols=25, rank=2, lam=0.1, picks=3, order="random")

    with pytest.raises(ConfigError, match="order"):
        run_ranks(2, bad_order, timeout=20)
    with pytest.raises(ConfigError, match="rank, picks"):
        ccdpp(r, 0, 0.1, picks=3)
