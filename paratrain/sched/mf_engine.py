"""Matrix factorisation on the STRADS engine: a scheduler rank that holds H and picks the rank-1 factor to refine,
worker ranks that hold row blocks of R with their rows of W (the update rule: :mod:`paratrain.sched.mf`).

Rank 0 is the scheduler; ranks 1..W hold contiguous row blocks (:func:`worker_block`). A pick of factor t takes
``inner + 1`` rounds: in the first the scheduler hands out t and H's column t, every worker puts the factor back
into its residual, updates its rows' u and contributes its partial column sums; the scheduler gets them summed
into the new v and hands it out (the next inner iteration), and in the last round the workers take the final v
out of their residuals and contribute their share of the objective. Each half of a round is one allreduce over
the job (the scheduler contributes its order and zeros, the workers zeros and their sums), as in
:mod:`paratrain.sched.lasso_engine`: the shared-memory path on one host. Sums go in rank order from the scheduler's
zeros, so the numbers equal :func:`~paratrain.sched.mf.ccdpp` with ``parts`` = W to the bit (up to 64 KiB of
column sums, 4096 columns, where the shared-memory path reduces in one phase; to rounding beyond), which a test
checks. Every call has the context's timeout; a dead worker makes the others raise PeerLostError, never hang.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.runtime.group import Group
from paratrain.sched.lasso import row_bounds
from paratrain.sched.mf import MFRun, Picks, RowBlock, initial_h, observed

__all__ = ["factorize", "worker_block"]


def factorize(
    ctx: Context,
    r: sp.csr_matrix | None,
    *,
    cols: int,
    rank: int,
    lam: float,
    picks: int,
    inner: int = 3,
    order: str = "cyclic",
    seed: int = 0,
    target: float | None = None,
    on_pick: Callable[[MFRun], None] | None = None,
) -> MFRun:
    """CCD++ over the job (see the module docstring). Collective: rank 0 passes ``r=None``, worker w its rows
    (:func:`worker_block`); every rank passes the same ``cols`` (R's columns) and settings.

    Returns:
        The run on the scheduler (H, picks, objectives, times); on a worker, a run with only its rows of W.

    Raises:
        ConfigError: fewer than 2 ranks, rows on the scheduler or none on a worker, bad rank, picks or order.
        PeerLostError, CommTimeoutError: a rank died or fell silent (raised on every rank).
    """
    if ctx.world_size < 2:
        raise ConfigError("the STRADS engine needs a scheduler (rank 0) and at least one worker: 2 ranks or more")
    if rank < 1 or picks < 1 or cols < 1:
        raise ConfigError(f"rank, picks and cols must be >= 1, got {rank}, {picks}, {cols}")
    group = ctx.world
    timeout = ctx.settings.timeout
    if ctx.rank == 0:
        if r is not None:
            raise ConfigError("the scheduler (rank 0) holds no rows: pass r=None there")
        sched = Picks(initial_h(cols, rank, seed), lam, order=order, inner=inner, seed=seed)  # checks order, inner
        return _schedule(group, sched, timeout=timeout, picks=picks, target=target, on_pick=on_pick)
    if r is None:
        raise ConfigError(f"worker {ctx.rank} needs its rows of R")
    if r.shape[1] != cols:
        raise ConfigError(f"worker {ctx.rank}'s rows have {r.shape[1]} columns, the job says {cols}")
    block = RowBlock(r, rank, lam)
    _work(group, block, cols, timeout)
    return MFRun(np.zeros((0, rank)), w=block.w)


def worker_block(r: sp.csr_matrix | np.ndarray, rank: int, world_size: int) -> sp.csr_matrix:
    """Worker ``rank``'s rows of R (ranks 1..W; :func:`~paratrain.sched.lasso.row_bounds` over W); a dense R's
    zeros are observed entries (:func:`~paratrain.sched.mf.observed`)."""
    bounds = row_bounds(r.shape[0], world_size - 1)
    return observed(observed(r)[int(bounds[rank - 1]) : int(bounds[rank])])


_STOP, _BEGIN, _STEP, _FINISH = 0.0, 1.0, 2.0, 3.0  # the scheduler's orders, first slot of its array


def _work(group: Group, block: RowBlock, cols: int, timeout: float) -> None:
    """A worker: its rows' starting loss, then the scheduler's begin/step/finish orders until stop."""
    group.allreduce(np.array([block.loss()]), timeout=timeout)
    while True:
        order = group.allreduce(np.zeros(2 + cols), timeout=timeout)  # the scheduler's half
        op, v = order[0], order[2:]
        if op == _STOP:
            return
        if op == _FINISH:
            group.allreduce(np.array([block.finish(v)]), timeout=timeout)
            continue
        num, den = block.begin(int(order[1]), v) if op == _BEGIN else block.step(v)
        group.allreduce(np.concatenate([num, den]), timeout=timeout)


def _schedule(
    group: Group,
    sched: Picks,
    *,
    timeout: float,
    picks: int,
    target: float | None,
    on_pick: Callable[[MFRun], None] | None,
) -> MFRun:
    """The scheduler: picks until ``picks`` or the target, then stop."""
    cols = sched.h.shape[0]

    def order(op: float, t: int, v: np.ndarray) -> None:
        group.allreduce(np.concatenate([[op, float(t)], v]), timeout=timeout)

    sched.start(float(group.allreduce(np.zeros(1), timeout=timeout)[0]))  # in rank order from zero
    for _ in range(picks):
        t = sched.next_pick()
        v = sched.h[:, t].copy()
        for k in range(sched.inner):
            order(_BEGIN if k == 0 else _STEP, t, v)
            sums = group.allreduce(np.zeros(2 * cols), timeout=timeout)
            v = sched.v_from(sums[:cols], sums[cols:])
        order(_FINISH, t, v)
        objective = sched.record(t, v, float(group.allreduce(np.zeros(1), timeout=timeout)[0]), sched.inner + 1)
        if on_pick is not None:
            on_pick(sched.run)
        if target is not None and objective <= target:
            break
    order(_STOP, 0, np.zeros(cols))
    return sched.run
