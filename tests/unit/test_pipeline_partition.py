"""The stage partitioner against brute force on every small case: the slowest stage is as fast as it can be."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from paratrain.pipeline.partition import LayerCost, partition, partition_replicated, stage_time


def _splits(n: int, k: int) -> list[list[tuple[int, int]]]:
    """Every split of n layers into k non-empty contiguous stages."""
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        out.append([(edges[i], edges[i + 1]) for i in range(k)])
    return out


def _layers(rng: random.Random, n: int) -> list[LayerCost]:
    return [
        LayerCost(rng.uniform(0.1, 5.0), activation_bytes=rng.randrange(0, 4000), param_bytes=rng.randrange(0, 9000))
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(40))
def test_partition_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    k = rng.randint(1, n)
    bandwidth = rng.choice([math.inf, 1000.0, 10_000.0])
    layers = _layers(rng, n)
    split = partition(layers, k, bandwidth=bandwidth)
    brute = min(
        max(stage_time(layers, a, b, bandwidth=bandwidth, last=b == n) for a, b in stages) for stages in _splits(n, k)
    )
    assert split.slowest == pytest.approx(brute)
    assert len(split.bounds) == k and all(b > a for a, b in split.bounds)  # no empty stage
    assert split.bounds[0][0] == 0 and split.bounds[-1][1] == n


@pytest.mark.parametrize("seed", range(25))
def test_replicated_partition_equals_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n, workers = rng.randint(1, 5), rng.randint(1, 4)
    bandwidth = rng.choice([1000.0, 10_000.0, 100_000.0])
    layers = _layers(rng, n)
    split = partition_replicated(layers, workers, bandwidth=bandwidth)
    best = math.inf
    for k in range(1, min(n, workers) + 1):
        for stages in _splits(n, k):
            for replicas in itertools.product(range(1, workers + 1), repeat=k):
                if sum(replicas) <= workers:
                    slowest = max(
                        stage_time(layers, a, b, bandwidth=bandwidth, last=b == n, replicas=r)
                        for (a, b), r in zip(stages, replicas, strict=True)
                    )
                    best = min(best, slowest)
    assert split.slowest == pytest.approx(best)
    assert sum(split.replicas) <= workers


def test_balanced_layers_split_evenly_and_bad_requests_are_refused() -> None:
    assert partition([LayerCost(1.0)] * 8, 4).balance == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="non-empty"):
        partition([LayerCost(1.0)] * 2, 3)
    with pytest.raises(ValueError, match="at least one worker"):
        partition_replicated([], 2, bandwidth=1.0)
