"""Which examples each worker trains on in a step, for a job whose size may change (elastic training).

Data parallelism splits each step's *global batch* among the workers. The job is launched with ``S`` workers
and cuts every epoch's permutation into ``S`` *shards*, one per launched worker; step ``i`` of an epoch uses the
``i``-th ``batch`` examples of every shard, ``S x batch`` in all. That global batch is fixed by the launch, not by
who is still there: when an elastic job runs with ``W < S`` workers, worker ``r`` takes the shards ``v`` with
``v mod W = r``, so the step still covers the same examples.

Each worker then scales its mean loss by ``k W / S`` (``k``: shards it holds). The ``"allreduce"`` strategy
averages the workers' gradients, and the average of ``k_r W / S`` times the mean over ``k_r`` shards is the mean
over all ``S`` shards: the gradient of the whole global batch, whatever ``W``. With ``W = S`` every worker holds
one shard and the scale is exactly 1, so the job computes bit for bit what a fixed-size job computes; after a
shrink it computes the same step up to the order of floating-point additions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["StepShare", "step_share"]


@dataclass(frozen=True, slots=True)
class StepShare:
    """One worker's part of a step.

    Attributes:
        indices: the examples, sorted (indices into the training set).
        shards: the launched workers' shards it covers, in order.
        scale: what the mean loss over ``indices`` is multiplied by (1.0 when the job has its launched size).
    """

    indices: npt.NDArray[np.int64]
    shards: tuple[int, ...]
    scale: float


def step_share(order: npt.NDArray[Any], *, shards: int, batch: int, step: int, world_size: int, rank: int) -> StepShare:
    """The examples worker ``rank`` of ``world_size`` trains on in ``step`` of the epoch permuted as ``order``.

    Args:
        order: the epoch's permutation of the training set (the same on every worker).
        shards: workers the job was launched with.
        batch: examples per shard per step.
        step: the step within the epoch (``0 <= step < len(order) // shards // batch``).

    Raises:
        ValueError: ``rank`` outside the job, more workers than shards, or a step past the epoch's end.
    """
    if not 0 <= rank < world_size <= shards:
        raise ValueError(f"worker {rank} of {world_size} in a job of {shards} shards")
    per_shard = len(order) // shards
    if not 0 <= step < per_shard // batch:
        raise ValueError(f"step {step} outside the epoch's {per_shard // batch} steps")
    mine = tuple(range(rank, shards, world_size))
    parts = [order[v * per_shard + step * batch : v * per_shard + (step + 1) * batch] for v in mine]
    indices = np.sort(np.concatenate(parts)).astype(np.int64, copy=False)
    scale = 1.0 if world_size == shards else len(mine) * world_size / shards
    return StepShare(indices, mine, scale)
