"""Matrix factorisation on the STRADS engine: a scheduler rank that holds H and picks the rank-1 factor to refine,
worker ranks that hold row blocks of R with their rows of W (the update rule: :mod:`paratrain.sched.mf`).

Rank 0 is the scheduler; ranks 1..W hold contiguous row blocks (:func:`worker_block`). A pick of factor t takes
``inner + 1`` rounds: in the first the scheduler sends t and H's column t, every worker puts the factor back into
its residual, updates its rows' u and returns its partial column sums; the scheduler adds them in rank order into
the new v and sends it back (the next inner iteration), and in the last round the workers take the final v out of
their residuals and return their share of the objective. The numbers equal :func:`~paratrain.sched.mf.ccdpp` with
``parts`` = W, which a test checks. Messages are numpy arrays with msgpack metadata; every receive has the context's
timeout; a dead worker makes the scheduler raise PeerLostError, and the others with it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.sched.lasso import row_bounds
from paratrain.sched.mf import MFRun, Picks, RowBlock, add_in_order, initial_h
from paratrain.transport.base import Transport

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
    base = group.reserve_tags(2)
    down, up = base, base - 1
    timeout = ctx.settings.timeout
    transport = group.transport
    if ctx.rank == 0:
        if r is not None:
            raise ConfigError("the scheduler (rank 0) holds no rows: pass r=None there")
        sched = Picks(initial_h(cols, rank, seed), lam, order=order, inner=inner, seed=seed)  # checks order, inner
        return _schedule(
            transport,
            ctx.world_size - 1,
            sched,
            down=down,
            up=up,
            timeout=timeout,
            picks=picks,
            target=target,
            on_pick=on_pick,
        )
    if r is None:
        raise ConfigError(f"worker {ctx.rank} needs its rows of R")
    if r.shape[1] != cols:
        raise ConfigError(f"worker {ctx.rank}'s rows have {r.shape[1]} columns, the job says {cols}")
    block = RowBlock(r, rank, lam)
    _work(transport, block, down, up, timeout)
    return MFRun(np.zeros((0, rank)), w=block.w)


def worker_block(r: sp.csr_matrix | np.ndarray, rank: int, world_size: int) -> sp.csr_matrix:
    """Worker ``rank``'s rows of R (ranks 1..W; :func:`~paratrain.sched.lasso.row_bounds` over W)."""
    bounds = row_bounds(r.shape[0], world_size - 1)
    out: sp.csr_matrix = sp.csr_matrix(r[int(bounds[rank - 1]) : int(bounds[rank])], dtype=np.float64)
    return out


def _work(transport: Transport, block: RowBlock, down: int, up: int, timeout: float) -> None:
    """A worker: its rows' starting loss, then the scheduler's begin/step/finish messages until stop."""
    transport.send(0, up, [np.array([block.loss()])])
    while True:
        msg = transport.recv(0, down, timeout=timeout)
        op = msg.meta.get("op")
        if op == "stop":
            return
        v = np.asarray(msg.arrays[0], dtype=np.float64)
        if op == "begin":
            sums = block.begin(int(msg.meta["t"]), v)
        elif op == "step":
            sums = block.step(v)
        elif op == "finish":
            transport.send(0, up, [np.array([block.finish(v)])])
            continue
        else:
            raise ConfigError(f"the scheduler sent an unknown operation {op!r}")
        transport.send(0, up, list(sums))


def _schedule(
    transport: Transport,
    workers: int,
    sched: Picks,
    *,
    down: int,
    up: int,
    timeout: float,
    picks: int,
    target: float | None,
    on_pick: Callable[[MFRun], None] | None,
) -> MFRun:
    """The scheduler: picks until ``picks`` or the target, then stop."""
    ranks = range(1, workers + 1)

    def gather(part: int) -> np.ndarray:  # added in rank order: the same sums every run
        got = [np.asarray(transport.recv(w, up, timeout=timeout).arrays, dtype=np.float64) for w in ranks]
        return add_in_order([g[part] for g in got]) if part >= 0 else add_in_order(got)

    sched.start(float(gather(0)[0]))
    for _ in range(picks):
        t = sched.next_pick()
        v = sched.h[:, t].copy()
        for k in range(sched.inner):
            for w in ranks:
                transport.send(w, down, [v], {"op": "begin", "t": t} if k == 0 else {"op": "step"})
            num, den = gather(-1)
            v = sched.v_from(num, den)
        for w in ranks:
            transport.send(w, down, [v], {"op": "finish"})
        objective = sched.record(t, v, float(gather(0)[0]), sched.inner + 1)
        if on_pick is not None:
            on_pick(sched.run)
        if target is not None and objective <= target:
            break
    for w in ranks:
        transport.send(w, down, [], {"op": "stop"})
    return sched.run
