"""The scaling study's exchanges: the textbook costs where there is one, and the symmetric shortcuts exact."""

from __future__ import annotations

import pytest

from paratrain.bench.scaling import exchange_time, render_scaling, run_scaling
from paratrain.gossip.mixing import resolve_mixing
from paratrain.gossip.plan import gossip_plan
from paratrain.sim.engine import Network, replay
from paratrain.sim.machine import LinkCost

LINK = LinkCost(alpha=1e-5, beta=1e-9)
NBYTES = 64 * 1000 * 8  # divisible by every N below


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_is_flat_and_central_is_linear(n: int) -> None:
    ring = exchange_time("ring", n, NBYTES, LINK)
    assert ring == pytest.approx(2 * (n - 1) * (LINK.alpha + NBYTES / n * LINK.beta), rel=1e-9)
    central = exchange_time("central", n, NBYTES, LINK)
    # every worker's gradient into the server's link, and the model back out of it: 2 N n beta, plus latencies
    assert 2 * n * NBYTES * LINK.beta < central < 2 * n * NBYTES * LINK.beta + 8 * LINK.alpha


def test_the_gossip_round_is_the_runtimes_plan_of_the_ring_graph() -> None:
    from paratrain.bench.scaling import ring_gossip_plan

    w, _ = resolve_mixing("ring", 16)
    assert ring_gossip_plan(16, NBYTES).ranks == gossip_plan(w, NBYTES).ranks
    full = replay(gossip_plan(w, NBYTES), Network.uniform(LINK)).time
    assert exchange_time("gossip", 16, NBYTES, LINK) == pytest.approx(full, rel=1e-12)


def test_report_and_table() -> None:
    report = run_scaling(nbytes=NBYTES, link=LINK, workers=[2, 4], schemes=["ring", "tree"])
    assert [(r["scheme"], r["workers"]) for r in report["rows"]] == [("ring", 2), ("tree", 2), ("ring", 4), ("tree", 4)]
    table = render_scaling(report)
    assert table.splitlines()[0].startswith("| N | ring | tree |") and "| 4 |" in table
    with pytest.raises(ValueError, match="unknown scheme"):
        exchange_time("star", 4, NBYTES, LINK)
