"""Lasso by coordinate descent, a block of coordinates at a time: the update rule the scheduler's workers run.

The objective is scikit-learn's ``Lasso``: ``1/(2n) ||y - X b||^2 + alpha ||b||_1``. Coordinate j's minimiser
with the others fixed is ``S(x_j . r / n + c_j b_j, alpha) / c_j`` with ``r = y - X b`` the residual,
``c_j = ||x_j||^2 / n`` and ``S`` soft thresholding. A *block* (the scheduler's round) computes every
coordinate's minimiser from the same residual, then applies them all and updates the residual once: with one
coordinate per block this is sequential coordinate descent, which converges to scikit-learn's optimum; with
several it is parallel coordinate descent, which is safe only when the block's features are nearly uncorrelated
(:mod:`paratrain.sched.strads`).

Pure numpy; :func:`run_blocks` drives a scheduler in one process, the reference the distributed engine is
compared with.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from paratrain.errors import ConfigError

__all__ = [
    "BlockRun",
    "Scheduler",
    "block_values",
    "lasso_objective",
    "row_bounds",
    "row_moments",
    "run_blocks",
    "soft_threshold",
    "stop",
    "values_from_dots",
]


class Scheduler(Protocol):
    """What :func:`run_blocks` needs of a scheduler (:class:`~paratrain.sched.strads.StradsScheduler`); its
    blocks hold at most ``block_size`` coordinates (the engine's messages have that many slots)."""

    block_size: int

    def next_block(self) -> np.ndarray: ...

    def report(self, coordinates: np.ndarray, deltas: np.ndarray) -> None: ...


def lasso_objective(x: np.ndarray, y: np.ndarray, beta: np.ndarray, alpha: float) -> float:
    """``1/(2n) ||y - X beta||^2 + alpha ||beta||_1`` (scikit-learn's ``Lasso`` objective)."""
    r = y - x @ beta
    return float(r @ r / (2 * len(y)) + alpha * np.abs(beta).sum())


def soft_threshold(z: np.ndarray, t: float) -> np.ndarray:
    """``sign(z) max(|z| - t, 0)``, elementwise."""
    out: np.ndarray = np.sign(z) * np.maximum(np.abs(z) - t, 0.0)
    return out


def block_values(
    x: np.ndarray, residual: np.ndarray, beta: np.ndarray, coordinates: np.ndarray, *, alpha: float, scale: np.ndarray
) -> np.ndarray:
    """Each coordinate's minimiser given ``residual`` (all from the same one: a parallel block). ``scale`` is
    ``||x_j||^2 / n`` per coordinate; a coordinate whose feature is all zeros stays 0.

    Example:
        One feature equal to y: the least-squares coefficient 1 shrunk by alpha / c.

        >>> x = np.array([[1.0], [-1.0]]); y = np.array([1.0, -1.0])
        >>> block_values(x, y, np.zeros(1), np.array([0]), alpha=0.25, scale=np.array([1.0])).tolist()
        [0.75]
    """
    dots = x[:, coordinates].T @ residual
    return values_from_dots(dots, beta[coordinates], scale[coordinates], n=len(residual), alpha=alpha)


@dataclass
class BlockRun:
    """What a run of blocks did: :func:`run_blocks` in one process, or the scheduler of the engine
    (:func:`paratrain.sched.lasso_engine.lasso`; its workers get an empty one).

    Attributes:
        beta: the coefficients at the end.
        updates: coordinate updates after each block (cumulative).
        objectives: the objective after each block.
        blocks: every block, in order.
        seconds: wall time since the first block began, after each block.
    """

    beta: np.ndarray
    updates: list[int] = field(default_factory=list)
    objectives: list[float] = field(default_factory=list)
    blocks: list[np.ndarray] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def add(self, block: np.ndarray, objective: float, began: float) -> None:
        """Records a finished block (``began``: the run's start on :func:`time.perf_counter`)."""
        self.updates.append((self.updates[-1] if self.updates else 0) + len(block))
        self.objectives.append(objective)
        self.blocks.append(block)
        self.seconds.append(time.perf_counter() - began)


def run_blocks(
    x: np.ndarray,
    y: np.ndarray,
    alpha: float,
    scheduler: Scheduler,
    *,
    max_updates: int,
    target: float | None = None,
    diverged: float = 1e6,
    depth: int = 1,
    parts: int = 1,
) -> BlockRun:
    """Blocks from ``scheduler`` until ``max_updates`` coordinate updates, the objective at or below
    ``target``, or the objective above ``diverged`` times its start (parallel updates of correlated features
    blow up).

    ``depth`` is how far the scheduler plans ahead: the block of round k is drawn after the changes of round
    k - depth were reported (1: after the previous round's; the distributed engine draws the blocks of later
    rounds while the workers compute, from priorities that much older). ``parts`` sums each coordinate's dot
    product over that many row blocks, in order, as the engine's workers do.

    Raises:
        ConfigError: shapes that do not match, or depth or parts below 1.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ConfigError(f"x must be n x p and y n long, got {x.shape} and {y.shape}")
    if depth < 1 or parts < 1:
        raise ConfigError(f"depth and parts must be >= 1, got {depth} and {parts}")
    n = len(y)
    xt = np.ascontiguousarray(x.T)  # a block's features are rows here: one gather, as the engine's workers hold them
    bounds = row_bounds(n, parts)
    beta = np.zeros(x.shape[1])
    residual = y.copy()
    gram, _ = row_moments(x, bounds)
    scale = np.diag(gram) / n  # as the engine's scheduler gets it from its workers' moments
    start = lasso_objective(x, y, beta, alpha)
    run = BlockRun(beta)
    planned = deque(scheduler.next_block() for _ in range(depth))
    began = time.perf_counter()
    while not run.updates or run.updates[-1] < max_updates:
        block = planned.popleft()
        dots = sum(
            (xt[block, a:b] @ residual[a:b] for a, b in itertools.pairwise(bounds.tolist())),
            start=np.zeros(len(block)),
        )
        new = values_from_dots(dots, beta[block], scale[block], n=n, alpha=alpha)
        delta = new - beta[block]
        beta[block] = new
        for a, b in itertools.pairwise(bounds.tolist()):  # per row block, as the engine's workers do
            residual[a:b] -= delta @ xt[block, a:b]
        scheduler.report(block, delta)
        planned.append(scheduler.next_block())
        objective = float(residual @ residual / (2 * n) + alpha * np.abs(beta).sum())
        run.add(block, objective, began)
        if stop(objective, start=start, target=target, diverged=diverged):
            break
    return run


def row_moments(x: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``X^T X`` and the column sums, added up over the row blocks in order (as the engine's scheduler adds its
    workers' moments), so that a one-process run and the engine see the same numbers to the last bit."""
    gram = np.zeros((x.shape[1], x.shape[1]))
    sums = np.zeros(x.shape[1])
    for a, b in itertools.pairwise(bounds.tolist()):
        gram += x[a:b].T @ x[a:b]
        sums += x[a:b].sum(axis=0)
    return gram, sums


def row_bounds(n: int, parts: int) -> np.ndarray:
    """Where ``parts`` contiguous row blocks of ``n`` rows begin (and the last ends), sizes within one.

    Example:
        >>> row_bounds(10, 3).tolist()
        [0, 3, 6, 10]
    """
    return np.array([k * n // parts for k in range(parts + 1)], dtype=np.int64)


def values_from_dots(dots: np.ndarray, beta: np.ndarray, scale: np.ndarray, *, n: int, alpha: float) -> np.ndarray:
    """:func:`block_values` from the dot products ``x_j . r`` (summed over the rows' holders)."""
    rho = dots / n + scale * beta
    values: np.ndarray = np.divide(soft_threshold(rho, alpha), scale, out=np.zeros_like(rho), where=scale > 0)
    return values


def stop(objective: float, *, start: float, target: float | None, diverged: float) -> bool:
    """Whether a run ends: the target reached, or the objective not finite or ``diverged`` times its start."""
    reached = target is not None and objective <= target
    return reached or not np.isfinite(objective) or objective > diverged * start
