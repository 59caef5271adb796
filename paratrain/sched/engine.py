"""The STRADS engine: a scheduler rank that plans blocks of coordinates, worker ranks that hold the data's rows.

Rank 0 of the job is the scheduler (under ``paratrain launch -n W+1`` or torchrun alike); ranks 1..W are the
workers, each holding a contiguous block of the rows (:func:`~paratrain.sched.lasso.row_bounds`) of X and y and
its part of the residual. A round:

1. the scheduler sends every worker the round's block (and the previous round's changes);
2. each worker applies the previous changes to its residual rows, then sends its rows' dot products
   ``x_j . r`` for the block's coordinates and its residual's squared norm;
3. the scheduler adds the workers' sums in rank order, computes the block's new values
   (:func:`~paratrain.sched.lasso.values_from_dots`), reports the changes to its priorities, and goes on.

Before the first round the workers send their rows' moments (``X^T X``, column sums, ``X^T y`` is not needed),
from which the scheduler builds the correlations its dependency check reads and each coordinate's scale: the
scheduler never holds the data. With ``depth`` d >= 2 the scheduler draws the block of round t + d while the
workers compute round t + 1 (planning ahead, on priorities d rounds old), exactly as
:func:`~paratrain.sched.lasso.run_blocks` with the same depth, which a test compares with the engine. Every
message is numpy arrays and msgpack metadata; every receive has the context's timeout; a worker that dies makes
the scheduler raise (PeerLostError), and the others with it, never a hang.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.sched.lasso import BlockRun, Scheduler, row_bounds, stop, values_from_dots
from paratrain.sched.strads import RandomScheduler, StradsScheduler, correlation_from_moments
from paratrain.transport.base import Transport

__all__ = ["SchedulerFactory", "lasso", "shotgun", "strads", "worker_rows"]

#: Builds the scheduler from the coordinates' absolute correlations (p x p): STRADS's, or the random baseline.
SchedulerFactory = Callable[[np.ndarray], Scheduler]


def strads(block_size: int, *, threshold: float = 0.1, seed: int = 0) -> SchedulerFactory:
    """STRADS's scheduler (priorities and the dependency check) as a factory for :func:`lasso`."""
    return lambda corr: StradsScheduler(corr, block_size, threshold=threshold, seed=seed)


def shotgun(block_size: int, *, seed: int = 0) -> SchedulerFactory:
    """Random blocks, no check (Shotgun), as a factory for :func:`lasso`."""
    return lambda corr: RandomScheduler(corr.shape[0], block_size, seed=seed)


def lasso(
    ctx: Context,
    x: np.ndarray | None,
    y: np.ndarray | None,
    *,
    alpha: float,
    make_scheduler: SchedulerFactory,
    max_updates: int,
    target: float | None = None,
    depth: int = 1,
    diverged: float = 1e6,
    on_round: Callable[[BlockRun], None] | None = None,
) -> BlockRun:
    """Lasso by scheduled coordinate blocks over the job (see the module docstring). Collective: every rank
    calls it; rank 0 passes ``x`` and ``y`` as None, worker w its rows (:func:`worker_rows`).

    Args:
        ctx: the job; at least 2 ranks (the scheduler and a worker).
        x, y: this worker's rows of X (float64) and y; None on the scheduler.
        alpha: the L1 weight (scikit-learn's ``alpha``).
        make_scheduler: :func:`strads` or :func:`shotgun`, run on rank 0.
        max_updates, target, diverged: when to stop (as :func:`~paratrain.sched.lasso.run_blocks`).
        depth: rounds the scheduler plans ahead.
        on_round: called on the scheduler after every round (progress).

    Raises:
        ConfigError: fewer than 2 ranks, data on the scheduler or missing on a worker, depth < 1.
        PeerLostError, CommTimeoutError: a rank died or fell silent (raised on every rank).
    """
    if ctx.world_size < 2:
        raise ConfigError("the STRADS engine needs a scheduler (rank 0) and at least one worker: 2 ranks or more")
    if depth < 1:
        raise ConfigError(f"depth must be >= 1, got {depth}")
    group = ctx.world
    base = group.reserve_tags(2)
    down, up = base, base - 1  # scheduler -> workers, workers -> scheduler
    timeout = ctx.settings.timeout
    transport = group.transport
    if ctx.rank == 0:
        if x is not None or y is not None:
            raise ConfigError("the scheduler (rank 0) holds no data: pass x=None, y=None there")
        plan = _Plan(alpha, make_scheduler, max_updates, target, depth, diverged)
        return _schedule(transport, ctx.world_size - 1, down=down, up=up, timeout=timeout, plan=plan, on_round=on_round)
    if x is None or y is None:
        raise ConfigError(f"worker {ctx.rank} needs its rows of x and y")
    _work(
        transport, np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), down=down, up=up, timeout=timeout
    )
    return BlockRun(np.zeros(0))


def worker_rows(x: np.ndarray, y: np.ndarray, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``rank``'s rows (ranks 1..W; :func:`~paratrain.sched.lasso.row_bounds` over W), as float64."""
    bounds = row_bounds(len(y), world_size - 1)
    a, b = int(bounds[rank - 1]), int(bounds[rank])
    return np.asarray(x[a:b], dtype=np.float64), np.asarray(y[a:b], dtype=np.float64)


@dataclass(frozen=True)
class _Plan:
    alpha: float
    make_scheduler: SchedulerFactory
    max_updates: int
    target: float | None
    depth: int
    diverged: float


def _work(transport: Transport, x: np.ndarray, y: np.ndarray, *, down: int, up: int, timeout: float) -> None:
    """A worker: its rows' moments, then rounds until the scheduler says stop."""
    transport.send(0, up, [x.T @ x, x.sum(axis=0), np.array([len(y), y @ y], dtype=np.float64)])
    residual = y.copy()
    xt = np.ascontiguousarray(x.T)  # features as rows: a block's columns are one contiguous gather
    del x
    block = np.zeros(0, dtype=np.int64)
    while True:
        msg = transport.recv(0, down, timeout=timeout)
        delta, upcoming = (np.asarray(a) for a in msg.arrays)
        if len(block):
            residual -= delta.astype(np.float64) @ xt[block]
        if msg.meta.get("stop"):
            return
        block = upcoming.astype(np.int64)
        transport.send(0, up, [xt[block] @ residual])


def _schedule(
    transport: Transport,
    workers: int,
    *,
    down: int,
    up: int,
    timeout: float,
    plan: _Plan,
    on_round: Callable[[BlockRun], None] | None,
) -> BlockRun:
    """The scheduler: the correlations from the workers' moments, then rounds (see the module docstring)."""
    moments = [transport.recv(w, up, timeout=timeout).arrays for w in range(1, workers + 1)]
    gram = np.zeros_like(np.asarray(moments[0][0], dtype=np.float64))
    sums = np.zeros_like(np.asarray(moments[0][1], dtype=np.float64))
    for m in moments:  # in rank order, from zero: as row_moments adds them
        gram += np.asarray(m[0], dtype=np.float64)
        sums += np.asarray(m[1], dtype=np.float64)
    n = int(sum(float(m[2][0]) for m in moments))
    rr = float(sum(float(m[2][1]) for m in moments))  # ||r||^2, r = y while beta = 0
    if n < 1:
        raise ConfigError("the workers hold no rows")
    scale = np.diag(gram) / n
    scheduler = plan.make_scheduler(correlation_from_moments(gram, sums, n))
    beta = np.zeros(len(scale))
    result = BlockRun(beta)
    start = rr / (2 * n)

    def send(delta: np.ndarray, block: np.ndarray, *, last: bool) -> None:
        for w in range(1, workers + 1):
            transport.send(w, down, [delta, block], {"stop": last})

    planned = deque(scheduler.next_block() for _ in range(plan.depth))
    send(np.zeros(0), planned[0], last=False)
    began = time.perf_counter()
    while True:
        block = planned.popleft()
        dots = np.zeros(len(block))
        for w in range(1, workers + 1):  # in rank order: the same sum every run
            dots += np.asarray(transport.recv(w, up, timeout=timeout).arrays[0], dtype=np.float64)
        new = values_from_dots(dots, beta[block], scale[block], n=n, alpha=plan.alpha)
        delta = new - beta[block]
        beta[block] = new
        rr = max(0.0, rr - 2 * float(delta @ dots) + float(delta @ gram[np.ix_(block, block)] @ delta))
        scheduler.report(block, delta)
        objective = rr / (2 * n) + plan.alpha * float(np.abs(beta).sum())
        result.add(block, objective, began)
        if on_round is not None:
            on_round(result)
        if result.updates[-1] >= plan.max_updates or stop(
            objective, start=start, target=plan.target, diverged=plan.diverged
        ):
            send(delta, np.zeros(0, dtype=np.int64), last=True)
            return result
        if plan.depth == 1:
            planned.append(scheduler.next_block())
            send(delta, planned[0], last=False)
        else:  # the workers start the next round while the scheduler plans the one after
            send(delta, planned[0], last=False)
            planned.append(scheduler.next_block())
