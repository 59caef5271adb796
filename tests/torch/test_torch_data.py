"""shard / ShardSampler: disjoint, covering, equal length on every rank, deterministic per (seed, epoch)."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from paratrain import Context  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402
from paratrain.torch.data import ShardSampler, shard, shard_indices  # noqa: E402


def parts(n: int, world_size: int, **kw: object) -> list[list[int]]:
    return [shard_indices(n, rank=r, world_size=world_size, **kw) for r in range(world_size)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "world_size", "drop_last", "expected"),
    [
        (6, 3, False, [[0, 3], [1, 4], [2, 5]]),
        (7, 3, False, [[0, 3, 6], [1, 4, 0], [2, 5, 1]]),  # padded with the first indices
        (7, 3, True, [[0, 3], [1, 4], [2, 5]]),  # the tail is dropped
        (2, 3, False, [[0], [1], [0]]),
        (1, 4, False, [[0], [0], [0], [0]]),  # a tiny dataset is repeated as often as needed
        (2, 3, True, [[], [], []]),
        (0, 2, False, [[], []]),
    ],
)
def test_unshuffled_tables(n: int, world_size: int, drop_last: bool, expected: list[list[int]]) -> None:
    assert parts(n, world_size, shuffle=False, drop_last=drop_last) == expected


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 9, 12, 101])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_shards_are_disjoint_covering_and_equal(world_size: int, n: int, drop_last: bool) -> None:
    for epoch in range(3):
        shards = parts(n, world_size, epoch=epoch, seed=7, drop_last=drop_last)
        sizes = {len(s) for s in shards}
        assert len(sizes) == 1  # equal length everywhere: every rank runs the same number of steps
        counts = Counter(i for s in shards for i in s)
        if drop_last:
            assert sizes == {n // world_size}
            assert all(c == 1 for c in counts.values())  # disjoint
            assert len(counts) == n - n % world_size
        else:
            assert sizes == {-(-n // world_size)}
            assert set(counts) == set(range(n))  # covering
            assert sum(c - 1 for c in counts.values()) == (-n) % world_size  # only the padding repeats


def test_deterministic_per_seed_and_epoch() -> None:
    a = parts(50, 3, seed=1, epoch=2)
    assert a == parts(50, 3, seed=1, epoch=2)
    assert a != parts(50, 3, seed=1, epoch=3)  # a new order each epoch
    assert a != parts(50, 3, seed=2, epoch=2)
    assert parts(50, 3, seed=1, epoch=0) != parts(50, 3, seed=0, epoch=1)  # (seed, epoch) pairs do not collide


@pytest.mark.parametrize(
    "kw", [{"rank": 2, "world_size": 2}, {"rank": -1, "world_size": 2}, {"rank": 0, "world_size": 0}]
)
def test_rejects_bad_ranks(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="rank"):
        shard_indices(10, **kw)


def test_sampler_and_set_epoch() -> None:
    sampler = ShardSampler(list(range(10)), rank=1, world_size=2, seed=3)
    first = list(sampler)
    assert len(sampler) == 5 and first == shard_indices(10, rank=1, world_size=2, seed=3, epoch=0)
    sampler.set_epoch(1)
    assert list(sampler) == shard_indices(10, rank=1, world_size=2, seed=3, epoch=1) != first
    loader = torch.utils.data.DataLoader(torch.arange(10) * 10, batch_size=2, sampler=sampler)
    assert torch.cat(list(loader)).tolist() == [10 * i for i in sampler.indices]


def test_shard_over_ranks_uses_the_context() -> None:
    data = [f"sample{i}" for i in range(11)]

    def worker(ctx: Context) -> list[list[str]]:
        part = shard(data, context=ctx, seed=5)
        epochs = []
        for epoch in range(2):
            part.set_epoch(epoch)
            epochs.append([part[i] for i in range(len(part))])
        return epochs

    results = run_ranks(3, worker)
    for epoch in range(2):
        shards = [r[epoch] for r in results]
        assert [len(s) for s in shards] == [4, 4, 4]
        assert {x for s in shards for x in s} == set(data)
        assert shards == [
            [data[i] for i in shard_indices(11, rank=r, world_size=3, seed=5, epoch=epoch)] for r in range(3)
        ]
