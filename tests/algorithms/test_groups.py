"""Process groups: sub-groups with their own collectives and tag spaces, running different sequences at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.runtime.context import COLLECTIVE_TAG_BASE, Context
from paratrain.runtime.group import TAG_SPACE_SIZE
from paratrain.testing import run_ranks


def test_two_groups_run_different_sequences_at_once() -> None:
    """Stages {0, 1} and {2, 3} issue unrelated calls; each gets the single-process reference."""

    def fn(ctx: Context) -> list[list[float]]:
        stage = ctx.split(lambda r: r // 2)
        out: list[list[float]] = []
        if ctx.rank < 2:
            for size in (1, 1000, 70_000):  # direct, tree/ring sizes: different plans, different message counts
                out.append(stage.allreduce(np.full(size, ctx.rank + 1.0), op="mean")[:2].tolist())
            out.append(stage.broadcast(np.array([10.0 * ctx.rank]), root=1).tolist())
        else:
            stage.barrier()
            out.append(stage.allgather(np.array([float(ctx.rank)])).tolist())
            out.append(stage.reduce_scatter(np.arange(4.0) * ctx.rank).tolist())
        out.append(ctx.allreduce(np.array([1.0])).tolist())  # the world afterwards, untouched by the groups
        return out

    results = run_ranks(4, fn, timeout=60)
    for rank in (0, 1):
        assert results[rank] == [[1.5], [1.5, 1.5], [1.5, 1.5], [10.0], [4.0]]
    assert results[2] == [[2.0, 3.0], [0.0, 5.0], [4.0]]
    assert results[3] == [[2.0, 3.0], [10.0, 15.0], [4.0]]


def test_a_group_and_the_world_run_concurrently_in_two_threads() -> None:
    """Ranks 0 and 1 allreduce in a pair on one thread while all three run world calls on another."""

    def fn(ctx: Context) -> tuple[list[float], list[float]]:
        pair = ctx.new_group([0, 1])
        pair_sums: list[float] = []

        def pair_loop() -> None:
            assert pair is not None
            for i in range(20):
                pair_sums.append(float(pair.allreduce(np.array([i + ctx.rank]))[0]))

        worker = threading.Thread(target=pair_loop) if pair is not None else None
        if worker is not None:
            worker.start()
        world_sums = [float(ctx.allreduce(np.array([i * 1.0]))[0]) for i in range(20)]
        if worker is not None:
            worker.join(60)
        return pair_sums, world_sums

    results = run_ranks(3, fn, timeout=60)
    for rank in (0, 1):
        assert results[rank][0] == [2.0 * i + 1 for i in range(20)]
    assert results[2][0] == []
    for rank in range(3):
        assert results[rank][1] == [3.0 * i for i in range(20)]


def test_tag_spaces_are_disjoint_and_the_world_keeps_its_tags() -> None:
    def fn(ctx: Context) -> tuple[int, int, int, list[int]]:
        world_first = ctx.next_collective_tag()
        group = ctx.split([0, 0])
        again = ctx.split([0, 1])
        return world_first, group.next_tag(), again.next_tag(), [group.tag_space, again.tag_space]

    world_first, group_first, again_first, spaces = run_ranks(2, fn)[0]
    assert world_first == COLLECTIVE_TAG_BASE  # a job without groups sees the tags it always saw
    assert spaces == [1, 2]
    assert group_first == COLLECTIVE_TAG_BASE - TAG_SPACE_SIZE
    assert again_first == COLLECTIVE_TAG_BASE - 2 * TAG_SPACE_SIZE


def test_groups_by_list_by_host_and_by_key() -> None:
    def fn(ctx: Context) -> tuple[object, list[int], list[int], int]:
        odd = ctx.new_group([3, 1])
        host = ctx.split_by_host()
        stage = ctx.split(["a", "b", "a", "b"])
        return (None if odd is None else odd.ranks), host.ranks, stage.ranks, stage.rank

    results = run_ranks(4, fn)
    assert [r[0] for r in results] == [None, [1, 3], None, [1, 3]]
    assert all(r[1] == [0, 1, 2, 3] for r in results)  # in-process ranks share one host
    assert [r[2] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r[3] for r in results] == [0, 0, 1, 1]


def test_ranks_that_disagree_on_a_group_all_raise() -> None:
    def fn(ctx: Context) -> str:
        try:
            ctx.new_group([0, 1] if ctx.rank != 2 else [0, 2])
        except ConfigError as exc:
            return str(exc)
        return "no error"

    messages = run_ranks(3, fn, timeout=60)
    assert all("disagree" in m for m in messages), messages
    assert len(set(messages)) == 1


def test_bad_group_arguments_are_refused_locally() -> None:
    def fn(ctx: Context) -> None:
        with pytest.raises(ValueError, match="distinct worker ranks"):
            ctx.new_group([0, 0])
        with pytest.raises(ValueError, match="one per worker"):
            ctx.split([1, 2, 3])

    run_ranks(2, fn)
