"""The STRADS engine: a scheduler rank that plans blocks of coordinates, worker ranks that hold the data's rows.

Rank 0 of the job is the scheduler (under ``paratrain launch -n W+1`` or torchrun alike); ranks 1..W are the
workers, each holding a contiguous block of the rows (:func:`~paratrain.sched.lasso.row_bounds`) of X and y and
its part of the residual. A round:

1. the scheduler hands every worker the round's block (and the previous round's changes);
2. each worker applies the previous changes to its residual rows, then contributes its rows' dot products
   ``x_j . r`` for the block's coordinates;
3. the scheduler has the sums over the workers, computes the block's new values
   (:func:`~paratrain.sched.lasso.values_from_dots`), reports the changes to its priorities, and goes on.

Both halves of a round are one allreduce of a fixed-size array over the whole job (the scheduler contributes the
block and zeros for the sums, the workers zeros and their dot products): on one host that is the shared-memory
path, 2 allreduces per round took 636 us with 5 ranks on 2 cores where scheduler-worker messages took 1894 us
per round. Sums go in rank order from the scheduler's zeros, so they equal the one-process run's
(:func:`~paratrain.sched.lasso.run_blocks` with ``parts`` = W) to the bit.

Before the first round the workers send their rows' moments (``X^T X``, column sums) as messages, from which the
scheduler builds the correlations its dependency check reads and each coordinate's scale: the scheduler never
holds the data. With ``depth`` d >= 2 the scheduler draws the block of round t + d while the workers compute
round t + 1 (planning ahead, on priorities d rounds old), exactly as
:func:`~paratrain.sched.lasso.run_blocks` with the same depth, which a test compares with the engine. Nothing is
unpickled; every call has the context's timeout; a worker that dies makes the others raise (PeerLostError),
never hang.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.runtime.group import Group
from paratrain.sched.lasso import BlockRun, Scheduler, row_bounds, stop, values_from_dots
from paratrain.sched.strads import RandomScheduler, StradsScheduler, correlation_from_moments

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
    if ctx.rank == 0:
        if x is not None or y is not None:
            raise ConfigError("the scheduler (rank 0) holds no data: pass x=None, y=None there")
        plan = _Plan(alpha, make_scheduler, max_updates, target, depth, diverged)
        return _schedule(group, ctx.world_size - 1, down=down, up=up, timeout=timeout, plan=plan, on_round=on_round)
    if x is None or y is None:
        raise ConfigError(f"worker {ctx.rank} needs its rows of x and y")
    _work(group, np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), down=down, up=up, timeout=timeout)
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


def _work(group: Group, x: np.ndarray, y: np.ndarray, *, up: int, down: int, timeout: float) -> None:
    """A worker: its rows' moments, then rounds until the scheduler says stop."""
    transport = group.transport
    transport.send(0, up, [x.T @ x, x.sum(axis=0), np.array([len(y), y @ y], dtype=np.float64)])
    capacity = int(transport.recv(0, down, timeout=timeout).meta["capacity"])
    residual = y.copy()
    xt = np.ascontiguousarray(x.T)  # features as rows: a block's columns are one contiguous gather
    block = np.zeros(0, dtype=np.int64)
    while True:
        order = group.allreduce(np.zeros(2 + 2 * capacity), timeout=timeout)  # the scheduler's half
        if len(block):
            residual -= order[2 + capacity : 2 + capacity + len(block)] @ xt[block]
        if order[0]:
            return
        block = order[2 : 2 + int(order[1])].astype(np.int64)
        dots = np.zeros(capacity)
        dots[: len(block)] = xt[block] @ residual
        group.allreduce(dots, timeout=timeout)


def _schedule(
    group: Group,
    workers: int,
    *,
    up: int,
    down: int,
    timeout: float,
    plan: _Plan,
    on_round: Callable[[BlockRun], None] | None,
) -> BlockRun:
    """The scheduler: the correlations from the workers' moments, then rounds (see the module docstring)."""
    transport = group.transport
    moments = [transport.recv(w, up, timeout=timeout).arrays for w in range(1, workers + 1)]
    gram = np.zeros_like(np.asarray(moments[0][0], dtype=np.float64))
    sums = np.zeros_like(np.asarray(moments[0][1], dtype=np.float64))
    for m in moments:  # in rank order, from zero: as row_moments adds them
        gram += np.asarray(m[0], dtype=np.float64)
        sums += np.asarray(m[1], dtype=np.float64)
    n = int(sum(float(m[2][0]) for m in moments))
    rr = float(sum(float(m[2][1]) for m in moments))  # ||r||^2, r = y while beta = 0
    scheduler = plan.make_scheduler(correlation_from_moments(gram, sums, n)) if n >= 1 else None
    capacity = scheduler.block_size if scheduler is not None else 0
    for w in range(1, workers + 1):
        transport.send(w, down, [], {"capacity": capacity})
    if scheduler is None:
        group.allreduce(np.array([1.0, 0.0]), timeout=timeout)  # stop the workers, then say why
        raise ConfigError("the workers hold no rows")
    scale = np.diag(gram) / n
    beta = np.zeros(len(scale))
    result = BlockRun(beta)
    start = rr / (2 * n)

    def send(delta: np.ndarray, block: np.ndarray, *, last: bool) -> None:
        order = np.zeros(2 + 2 * capacity)
        order[0], order[1] = float(last), len(block)
        order[2 : 2 + len(block)] = block
        order[2 + capacity : 2 + capacity + len(delta)] = delta
        group.allreduce(order, timeout=timeout)

    planned = deque(scheduler.next_block() for _ in range(plan.depth))
    send(np.zeros(0), planned[0], last=False)
    began = time.perf_counter()
    while True:
        block = planned.popleft()
        dots = group.allreduce(np.zeros(capacity), timeout=timeout)[: len(block)]  # in rank order from zero
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
