"""Blink's trees for uneven links: the packing against Nash-Williams' bound and the links' capacities, the
plans executed symbolically, the runtime under the fault injector's per-pair links against a one-process
reference, its sends against the plan, ``auto`` choosing it, and the cost model's per-pair links."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from paratrain import Context
from paratrain.collectives.api import Collectives
from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.collectives.plans_blink import PackedTree, orient, pack_trees, packing_rate
from paratrain.plan import simulate
from paratrain.testing import count_contributions, run_ranks
from paratrain.transport.recording import RecordingTransport

pytestmark = pytest.mark.timeout(60)


def _complete(n: int, rate: float = 1.0) -> dict[tuple[int, int], float]:
    return {(a, b): rate for a in range(n) for b in range(a + 1, n)}


@pytest.mark.parametrize(
    ("n", "capacity", "best"),
    [
        (4, _complete(4), 2.0),  # Nash-Williams: 6 links over 3 (all singletons)
        (4, {(0, 1): 1.0, (1, 2): 1.0, (2, 3): 1.0, (0, 3): 1.0}, 4 / 3),  # a ring: 4 links over 3
        (4, {**_complete(4), (0, 1): 0.1}, 1.7),  # one slow link: 5.1 over 3
        (5, _complete(5), 2.5),
    ],
)
def test_the_packing_nears_the_best_rate_and_fits_every_link(
    n: int, capacity: dict[tuple[int, int], float], best: float
) -> None:
    trees = pack_trees(n, capacity)
    assert len(trees) <= 6 and trees == pack_trees(n, dict(reversed(list(capacity.items()))))  # same on every rank
    assert 0.9 * best <= packing_rate(trees) <= best * (1 + 1e-9)
    for edge, cap in capacity.items():
        assert sum(t.rate for t in trees if edge in t.edges) <= cap * (1 + 1e-9)
    for tree in trees:
        assert len(tree.edges) == n - 1 and all(edge in capacity for edge in tree.edges)


def test_the_packing_refuses_links_that_leave_a_rank_out() -> None:
    with pytest.raises(ValueError, match="do not connect"):
        pack_trees(4, {(0, 1): 1.0, (2, 3): 1.0})
    with pytest.raises(ValueError, match="positive"):
        pack_trees(2, {(0, 1): 0.0})


def test_a_tree_hangs_from_its_centre() -> None:
    star = PackedTree(1.0, ((0, 3), (1, 3), (2, 3)))
    assert [tuple(p) for p in orient(star, 4)] == [(3, ()), (3, ()), (3, ()), (None, (0, 1, 2))]


@pytest.mark.parametrize("n", range(2, 9))
def test_blink_plans_sum_every_rank_once(n: int) -> None:
    rng = random.Random(n)
    capacity = {e: rng.choice([0.1, 0.5, 1.0]) for e in _complete(n)}
    trees = pack_trees(n, capacity)
    for count in (0, 1, n + 2, 50):
        for aliased in (False, True):
            plan = allreduce_plan("blink", n, count, 8, aliased=aliased, segment_bytes=40, trees=trees, agreement=False)
            plan.validate()
            for dst in count_contributions(plan, count, aliased=aliased):
                assert np.array_equal(dst, np.ones((count, n)))


def test_the_cost_model_puts_a_pairs_messages_on_its_own_link() -> None:
    """Ring over 4 ranks whose link 0-1 is 10x slower: rank 0's six sends to rank 1 queue back to back on it
    (each step's chunk reaches rank 0 over fast links before the previous one has left), so the call takes
    that link's 1.5 n bytes and one latency."""
    n, nbytes, alpha, beta = 4, 1 << 20, 1e-4, 1e-8
    slow = {(0, 1): (alpha, 10 * beta), (1, 0): (alpha, 10 * beta)}
    plan = allreduce_plan("ring", n, nbytes, 1, agreement=False)
    even = simulate(plan, alpha=alpha, beta=beta).time
    uneven = simulate(plan, alpha=alpha, beta=beta, links=slow).time
    assert even == pytest.approx(6 * alpha + 1.5 * nbytes * beta)
    assert uneven == pytest.approx(alpha + 1.5 * nbytes * 10 * beta)


def _links_file(tmp_path: Path, slow: str = "100Mbit") -> str:
    path = tmp_path / "links.json"
    pairs = [[a, b] for a in range(4) for b in range(a + 1, 4)]
    links = [{"between": p, "bandwidth": slow if p == [0, 1] else "1Gbit"} for p in pairs]
    path.write_text(json.dumps({"links": links}))
    return str(path)


def test_under_uneven_links_auto_picks_the_trees_and_they_sum_like_one_process(tmp_path: Path) -> None:
    faults = f"links={_links_file(tmp_path)}"

    def rank_fn(ctx: Context) -> tuple[str, list[np.ndarray]]:
        x = np.arange(100_003, dtype=np.int64) * (ctx.rank + 1) % 1009
        got = [ctx.allreduce(x, algorithm=a) for a in ("blink", "auto")]
        y = (x * 0.5).astype(np.float32)
        got.append(ctx.allreduce_(y, op="mean", algorithm="blink"))
        return ctx.collectives.choose_allreduce(16 << 20, 4), got

    results = run_ranks(4, rank_fn, faults=faults, timeout=50)
    x = [np.arange(100_003, dtype=np.int64) * (r + 1) % 1009 for r in range(4)]
    for choice, got in results:
        assert choice == "blink"
        assert np.array_equal(got[0], sum(x)) and np.array_equal(got[1], sum(x))
        np.testing.assert_allclose(got[2], sum(v * 0.5 for v in x) / 4, rtol=1e-6)
        assert np.array_equal(got[2], results[0][1][2])


def test_blink_sends_exactly_its_plan() -> None:
    capacity = {**_complete(4), (0, 1): 0.1}
    links = {(a, b): (0.0, rate * 1e9) for (a, b), rate in capacity.items()}

    def rank_fn(ctx: Context) -> list[tuple[int, int]]:
        rec = RecordingTransport(ctx.workers)
        coll = Collectives(transport=rec, next_tag=ctx.next_collective_tag, timeout=30)
        try:
            coll.use_links(links, latency=0.0, bandwidth=None)
            coll.allreduce(np.full(1001, ctx.rank, np.float32), algorithm="blink")
        finally:
            coll.close()
        return [(m.dst, m.nbytes) for m in rec.take()]

    recorded = run_ranks(4, rank_fn, timeout=30)
    plan = allreduce_plan("blink", 4, 1001, 4, trees=pack_trees(4, {e: c * 1e9 for e, c in capacity.items()}))
    for r in range(4):
        assert recorded[r] == [(m.dst, m.nbytes) for m in plan.sends(r)]
