"""Hierarchical allreduce (reduce in each host, ring over leaders, broadcast) equals the flat reference."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain import Context
from paratrain.collectives.api import Collectives
from paratrain.collectives.hierarchical import HostLayout
from paratrain.errors import CollectiveMismatchError
from paratrain.testing import run_ranks
from paratrain.transport.group import GroupTransport
from paratrain.transport.inproc import InprocFabric

pytestmark = pytest.mark.timeout(60)

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "uneven": ["a", "b", "b", "b", "c"],
    "interleaved": ["a", "b", "a", "b", "a"],
}


def _collectives(ctx: Context, hosts: list[str]) -> Collectives:
    return Collectives(transport=ctx.transport, next_tag=ctx.next_collective_tag, timeout=20, hosts=hosts)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(("op", "dtype"), [("sum", "int64"), ("mean", "float64"), ("max", "float32")])
@pytest.mark.parametrize("size", [0, 1, 7, 100_003])
def test_matches_numpy_reference(layout: str, op: str, dtype: str, size: int) -> None:
    hosts = LAYOUTS[layout]
    n = len(hosts)
    inputs = [np.random.default_rng(r).integers(-50, 50, size).astype(dtype) for r in range(n)]
    stacked = np.stack(inputs)
    expected = {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.max(0)}[op].astype(dtype)

    def rank_fn(ctx: Context) -> np.ndarray:
        coll = _collectives(ctx, hosts)
        out = coll.allreduce(inputs[ctx.rank], op, algorithm="hierarchical")
        coll.close()
        return out

    results = run_ranks(n, rank_fn)
    for r in results:
        np.testing.assert_allclose(r, expected, rtol=1e-6)
        np.testing.assert_array_equal(r, results[0])  # identical bits on every rank


HIERARCHICAL_MISMATCHES = [
    (
        lambda c, bad: c.allreduce(np.zeros((17, 23, 57) if bad else (17, 1311), np.float32), algorithm="hierarchical"),
        "rank 0 has shape (17, 1311) float32 but rank 3 has (17, 23, 57) float32",
    ),
    (
        lambda c, bad: c.allreduce(np.zeros(8, np.int32 if bad else np.float32), algorithm="hierarchical"),
        "rank 0 has shape (8,) float32 but rank 3 has (8,) int32",
    ),
    (
        lambda c, bad: c.allreduce(np.zeros(8), "max" if bad else "sum", algorithm="hierarchical"),
        "rank 0 has op 'sum' but rank 3 has op 'max'",
    ),
    (
        lambda c, bad: c.allreduce(np.zeros(8), algorithm="ring" if bad else "hierarchical"),
        "rank 0 has algorithm 'hierarchical' but rank 3 has algorithm 'ring'",
    ),
]


def test_mismatch_raises_on_every_rank_and_ranks_stay_usable() -> None:
    """Rank 3 (on the second host, not a leader) deviates: all four raise the same error, then work on."""

    def rank_fn(ctx: Context) -> list[str]:
        coll = _collectives(ctx, LAYOUTS["2x2"])
        messages = []
        for call, _ in HIERARCHICAL_MISMATCHES:
            with pytest.raises(CollectiveMismatchError) as info:
                call(coll, ctx.rank == 3)
            messages.append(str(info.value))
            assert coll.allreduce(np.full(3, ctx.rank + 1.0), algorithm="hierarchical").tolist() == [10.0] * 3
        coll.close()
        return messages

    per_rank = run_ranks(4, rank_fn)
    for i, (_, difference) in enumerate(HIERARCHICAL_MISMATCHES):
        assert len({messages[i] for messages in per_rank}) == 1, "every rank must raise the same error"
        assert difference in per_rank[0][i]


def test_auto_uses_hierarchy_only_when_it_helps() -> None:
    assert HostLayout(["a", "a", "b", "b"]).is_hierarchical
    assert not HostLayout(["a", "a", "a"]).is_hierarchical  # one host
    assert not HostLayout(["a", "b", "c"]).is_hierarchical  # one rank per host: the flat ring is the same

    def rank_fn(ctx: Context) -> tuple[str, str, bool]:
        coll = _collectives(ctx, LAYOUTS["2x2"])
        flat = _collectives(ctx, ["a"] * 4)
        picks = (
            coll.choose_allreduce(1 << 24, 4),
            coll.choose_allreduce(64, 4),
            "hierarchical" in flat.allreduce_algorithms,
        )
        coll.close()
        flat.close()
        return picks

    assert run_ranks(4, rank_fn)[0] == ("hierarchical", "direct", False)


def test_group_view_translates_ranks_both_ways() -> None:
    fabric = InprocFabric(5)
    views = {r: GroupTransport(fabric.transport(r), [4, 1, 3]) for r in (4, 1, 3)}
    assert [views[r].rank for r in (4, 1, 3)] == [0, 1, 2]
    views[4].send(2, 9, [np.arange(3)])
    msg = views[3].recv(0, 9, timeout=5)
    assert msg.src == 0 and msg.arrays[0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="not in the group"):
        GroupTransport(fabric.transport(0), [1, 2])
    with pytest.raises(ValueError, match="ANY_SOURCE"):
        views[4].irecv()
