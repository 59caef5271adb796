"""Hierarchical allreduce (reduce in each host, ring over leaders, broadcast) equals the flat reference."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain import Context
from paratrain.collectives.api import Collectives
from paratrain.collectives.hierarchical import HostLayout
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
