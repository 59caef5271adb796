"""STRADS's scheduler: which parameters to update together, chosen by priority and checked for dependencies.

Model-parallel coordinate descent updates a block of parameters at once, each computed from the same state, and
that is only safe when their updates do not interfere. For Lasso two coordinates interfere when their features
are correlated: updating both at once from the same residual double-counts what they share, and with strongly
correlated features parallel coordinate descent (Shotgun, Bradley et al. 2011) diverges. STRADS (Lee et al.
NIPS'14; Kim et al. EuroSys'16) separates a scheduler from the workers, and the scheduler picks each round's
block in two steps:

1. **Prioritisation**: draw candidates, each coordinate with probability proportional to its recent change
   plus a base weight (:func:`sample_candidates`): coordinates that moved are likely to move again, and the base
   weight keeps every coordinate reachable. A coordinate not updated yet counts as the largest mover, so every
   coordinate is tried early. The base weight follows the scale of the changes (a fraction of their mean over
   all coordinates), or 1 while nothing has changed.
2. **Dependency check**: keep candidates greedily, in draw order, each only if its absolute correlation with
   every coordinate kept so far is below a threshold (:func:`select_independent`, STRADS's ``infthreshold``,
   0.1 by default), until the block is full.

:class:`StradsScheduler` holds the priorities and draws blocks; :class:`RandomScheduler` is the baseline (a block
of distinct coordinates uniformly at random: Shotgun). Both are deterministic for a seed, and their blocks are
plain index arrays that the workers execute, the tests check and a cost model can count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from paratrain.errors import ConfigError

__all__ = [
    "RandomScheduler",
    "StradsScheduler",
    "correlation",
    "correlation_from_moments",
    "sample_candidates",
    "select_independent",
    "standardize",
]


def standardize(x: np.ndarray) -> np.ndarray:
    """Columns centred and scaled so that the dot product of two is their Pearson correlation (a column that
    does not vary becomes zeros: uncorrelated with everything).

    Example:
        >>> z = standardize(np.array([[1.0, 2.0, 5.0], [2.0, 4.0, 5.0], [3.0, 7.0, 5.0]]))
        >>> round(float(z[:, 0] @ z[:, 1]), 4), float(z[:, 0] @ z[:, 2])
        (0.9934, 0.0)
    """
    centred = np.asarray(x, dtype=np.float64) - np.mean(x, axis=0)
    norms = np.linalg.norm(centred, axis=0)
    out: np.ndarray = np.divide(centred, norms, out=np.zeros_like(centred), where=norms > 0)
    return out


def correlation(x: np.ndarray) -> np.ndarray:
    """The absolute Pearson correlation of every pair of columns (p x p; 0 for a column that does not vary):
    what the dependency check reads. Dense: fine for thousands of features, not for millions."""
    z = standardize(x)
    out: np.ndarray = np.abs(z.T @ z)
    return out


def correlation_from_moments(gram: np.ndarray, sums: np.ndarray, count: int) -> np.ndarray:
    """:func:`correlation` from ``X^T X``, the column sums and the number of rows: what row partitions add up
    to, so that workers holding rows can give a scheduler that holds none the correlations.

    Example:
        >>> x = np.random.default_rng(0).normal(size=(20, 3))
        >>> bool(np.allclose(correlation_from_moments(x.T @ x, x.sum(axis=0), 20), correlation(x)))
        True
    """
    mean = sums / count
    cov = gram - count * np.outer(mean, mean)
    sd = np.sqrt(np.maximum(np.diag(cov), 0.0))
    scale = np.outer(sd, sd)
    out: np.ndarray = np.abs(np.divide(cov, scale, out=np.zeros_like(cov), where=scale > 0))
    return out


def sample_candidates(weights: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct coordinates, drawn one after another with probability proportional to ``weights``
    (all > 0) among those not drawn yet; in draw order.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> sample_candidates(np.array([1e-9, 1e-9, 1.0, 1e-9]), 1, rng).tolist()
        [2]
    """
    if np.any(weights <= 0):
        raise ConfigError("priorities must be positive (add a base weight)")
    count = min(count, len(weights))
    # Efraimidis-Spirakis: the largest keys u^(1/w) are a weighted draw without replacement, in draw order
    keys = np.log(rng.random(len(weights))) / weights
    if count < len(keys):  # the top ``count`` in linear time, then only they are sorted
        top = np.argpartition(-keys, count - 1)[:count]
        return top[np.argsort(-keys[top], kind="stable")]
    return np.argsort(-keys, kind="stable")


def select_independent(candidates: np.ndarray, corr: np.ndarray, threshold: float, size: int) -> np.ndarray:
    """Of ``candidates`` (in priority order), greedily the first that are pairwise below ``threshold`` in
    absolute correlation (``corr``, :func:`correlation`), at most ``size``.

    Example:
        Coordinates 0 and 1 are the same feature, 2 another: 1 is dropped, 2 kept.

        >>> c = correlation(np.array([[1.0, 1.0, 0.0], [2.0, 2.0, 1.0], [3.0, 3.0, 0.0]]))
        >>> select_independent(np.array([0, 1, 2]), c, 0.1, 8).tolist()
        [0, 2]
    """
    clash = corr[np.ix_(candidates, candidates)] >= threshold  # one gather, then a scan of a small table
    blocked = np.zeros(len(candidates), dtype=bool)
    kept: list[int] = []
    for i in range(len(candidates)):
        if len(kept) >= size:
            break
        if not blocked[i]:
            kept.append(i)
            blocked |= clash[i]
    return np.asarray(candidates, dtype=np.int64)[kept]


@dataclass
class StradsScheduler:
    """Blocks of coordinates by priority and dependency check (see the module docstring).

    Attributes:
        corr: the features' absolute correlations (:func:`correlation` or :func:`correlation_from_moments`).
        block_size: coordinates per block (the parallel degree).
        threshold: the largest absolute correlation two coordinates of a block may have (exclusive).
        oversample: candidates drawn per block, as a multiple of ``block_size`` (the dependency check drops some).
        base_fraction: the base weight as a fraction of the mean recent change over all coordinates: the
            coordinates that did not move share about this fraction of the draws (0.3 by default; relative to the
            movers' mean instead, thousands of zero coordinates would take most of the draws).
        seed: the draws' seed.

    Example:
        >>> rng = np.random.default_rng(1)
        >>> s = StradsScheduler(correlation(rng.normal(size=(50, 6))), block_size=3)
        >>> block = s.next_block()
        >>> len(block), len(set(block.tolist()))
        (3, 3)
    """

    corr: np.ndarray
    block_size: int
    threshold: float = 0.1
    oversample: int = 4
    base_fraction: float = 0.3
    seed: int = 0
    changes: np.ndarray = field(init=False)
    _tried: np.ndarray = field(init=False, repr=False)
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.oversample < 1 or not 0 < self.threshold <= 1:
            raise ConfigError(
                f"block_size and oversample must be >= 1 and 0 < threshold <= 1, got {self.block_size}, "
                f"{self.oversample}, {self.threshold}"
            )
        if self.corr.ndim != 2 or self.corr.shape[0] != self.corr.shape[1]:
            raise ConfigError(f"corr must be a square matrix, got shape {self.corr.shape}")
        self.changes = np.zeros(self.corr.shape[0])
        self._tried = np.zeros(self.corr.shape[0], dtype=bool)
        self._rng = np.random.default_rng(self.seed)

    def priorities(self) -> np.ndarray:
        """Each coordinate's weight: its last change plus the base weight; a coordinate never updated yet counts
        as having made the largest change seen (it may well be one of the big movers)."""
        moved = self.changes[self.changes > 0]
        base = self.base_fraction * float(self.changes.mean()) if len(moved) else 1.0
        fresh = float(moved.max()) if len(moved) else 1.0
        return np.where(self._tried, self.changes, fresh) + base

    def next_block(self) -> np.ndarray:
        """The next block: candidates by priority, then the dependency check."""
        candidates = sample_candidates(self.priorities(), self.block_size * self.oversample, self._rng)
        return select_independent(candidates, self.corr, self.threshold, self.block_size)

    def report(self, coordinates: np.ndarray, deltas: np.ndarray) -> None:
        """The workers' changes to ``coordinates`` (new value minus old): the next draws' priorities."""
        self.changes[coordinates] = np.abs(deltas)
        self._tried[coordinates] = True


@dataclass
class RandomScheduler:
    """Shotgun's blocks: ``block_size`` distinct coordinates uniformly at random, no check.

    Example:
        >>> RandomScheduler(10, block_size=4).next_block().tolist()
        [2, 4, 5, 7]
    """

    num_coordinates: int
    block_size: int
    seed: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        self._rng = np.random.default_rng(self.seed)

    def next_block(self) -> np.ndarray:
        """``block_size`` distinct coordinates (all of them if fewer)."""
        n = min(self.block_size, self.num_coordinates)
        return self._rng.choice(self.num_coordinates, size=n, replace=False).astype(np.int64)

    def report(self, coordinates: np.ndarray, deltas: np.ndarray) -> None:
        """Ignored: no priorities."""
