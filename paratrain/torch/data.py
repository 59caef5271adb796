"""Each rank's part of a dataset: ``shard(dataset)`` and ``ShardSampler``, deterministic and equal-sized.

Data parallelism needs every worker to see a different part of the data each epoch, and every worker to run
the same number of steps (a worker with one batch more would wait forever in its extra allreduce). The
indices come from a pure function, :func:`shard_indices`:

1. the permutation of ``range(n)`` drawn from a generator seeded with ``(seed, epoch)`` (identity without
   shuffling): every rank computes the same one without talking, and a new epoch gives a new order;
2. made divisible by the world size, by *padding* (default: the first indices of the permutation are repeated,
   so a few samples count twice per epoch) or by *dropping* the tail (``drop_last=True``: a few samples are
   skipped this epoch, different ones each epoch when shuffling);
3. dealt out round-robin: rank r takes positions r, r + N, r + 2N, ... (torch's ``DistributedSampler`` does the
   same, so switching between the two keeps each rank's data).

Call ``set_epoch(e)`` at the start of every epoch, with the same ``e`` on every rank; forgetting it replays the
order of epoch 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Generic, TypeVar

import numpy as np
import torch.utils.data

from paratrain.runtime.context import Context, current

__all__ = ["Shard", "ShardSampler", "shard", "shard_indices"]

T_co = TypeVar("T_co", covariant=True)


def shard_indices(
    num_samples: int,
    *,
    rank: int,
    world_size: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """The dataset indices rank ``rank`` of ``world_size`` reads in ``epoch``; every rank gets as many.

    Each rank gets ``ceil(num_samples / world_size)`` indices (padding) or ``floor(...)`` (``drop_last``).

    Raises:
        ValueError: negative sizes, or a rank outside ``0 .. world_size - 1``.

    Example:
        Five samples over two ranks without shuffling: padding repeats sample 0, dropping skips sample 4.

        >>> [shard_indices(5, rank=r, world_size=2, shuffle=False) for r in range(2)]
        [[0, 2, 4], [1, 3, 0]]
        >>> [shard_indices(5, rank=r, world_size=2, shuffle=False, drop_last=True) for r in range(2)]
        [[0, 2], [1, 3]]
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if epoch < 0 or seed < 0:
        raise ValueError(f"epoch and seed must be >= 0, got epoch={epoch}, seed={seed}")
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(num_samples).tolist()
    else:
        order = list(range(num_samples))
    if drop_last:
        order = order[: num_samples - num_samples % world_size]
    else:
        total = -(-num_samples // world_size) * world_size
        while order and len(order) < total:  # tiny datasets may need the permutation several times
            order += order[: total - len(order)]
    return [int(i) for i in order[rank::world_size]]


def _rank_and_size(context: Context | None, rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    ctx = context if context is not None else current()
    return (ctx.rank if rank is None else rank), (ctx.world_size if world_size is None else world_size)


class ShardSampler(torch.utils.data.Sampler[int]):
    """A sampler giving this rank its part of the dataset (a drop-in for torch's ``DistributedSampler``).

    Args:
        data_source: the dataset (only its length is used) or its length.
        context: the paratrain context (default: the current one), for the rank and world size.
        rank: overrides the context's rank.
        world_size: overrides the context's world size.
        shuffle: a new permutation every epoch (see :meth:`set_epoch`).
        seed: the permutation's seed; equal on every rank.
        drop_last: drop the tail instead of padding it (see :mod:`paratrain.torch.data`).

    Example:
        >>> sampler = ShardSampler(10, rank=1, world_size=3, shuffle=False)
        >>> list(sampler), len(sampler)
        ([1, 4, 7, 0], 4)
        >>> # DataLoader(dataset, batch_size=32, sampler=sampler); call sampler.set_epoch(e) every epoch
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        context: Context | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.num_samples_total = data_source if isinstance(data_source, int) else len(data_source)
        self.rank, self.world_size = _rank_and_size(context, rank, world_size)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.indices = self._compute()

    def _compute(self) -> list[int]:
        return shard_indices(
            self.num_samples_total,
            rank=self.rank,
            world_size=self.world_size,
            epoch=self.epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        """Selects the permutation of ``epoch``; call it with the same value on every rank before each epoch."""
        self.epoch = epoch
        self.indices = self._compute()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Shard(torch.utils.data.Dataset[T_co], Generic[T_co]):
    """A dataset restricted to this rank's indices (a ``Subset`` whose indices change with the epoch).

    Built by :func:`shard`; ``len`` is the same on every rank.

    Attributes:
        dataset: the full dataset.
        sampler: the :class:`ShardSampler` that chooses the indices.
    """

    def __init__(self, dataset: Any, sampler: ShardSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler

    @property
    def indices(self) -> list[int]:
        """The indices of the full dataset this rank reads in the current epoch."""
        return self.sampler.indices

    def set_epoch(self, epoch: int) -> None:
        """Selects the permutation of ``epoch`` (same value on every rank)."""
        self.sampler.set_epoch(epoch)

    def __getitem__(self, i: int) -> T_co:
        item: T_co = self.dataset[self.sampler.indices[i]]
        return item

    def __len__(self) -> int:
        return len(self.sampler)


def shard(
    dataset: Any,
    *,
    context: Context | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> Shard[Any]:
    """This rank's part of ``dataset``: disjoint from the others' (up to padding), equal in length everywhere.

    Args:
        dataset: anything with ``__len__`` and ``__getitem__`` (a torch ``Dataset``, a list, ...).
        context: the paratrain context (default: the current one).
        shuffle: a new order every epoch (call ``set_epoch``); deterministic given ``seed`` and the epoch.
        seed: equal on every rank.
        drop_last: drop the tail instead of padding it.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> run_ranks(2, lambda ctx: list(shard(list("abcde"), context=ctx, shuffle=False)))
        [['a', 'c', 'e'], ['b', 'd', 'a']]
        >>> # loader = DataLoader(shard(train_set), batch_size=64, shuffle=False); loader.dataset.set_epoch(e)
    """
    sampler = ShardSampler(dataset, context=context, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return Shard(dataset, sampler)
