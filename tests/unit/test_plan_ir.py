"""The plan IR: the builder's dependencies, validation, and the cost model replaying plans (exact tables)."""

from __future__ import annotations

import math

import pytest

from paratrain.collectives.lower import (
    allgather_plan,
    barrier_plan,
    broadcast_plan,
    reduce_scatter_plan,
)
from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.collectives.plans import chunk_bounds
from paratrain.plan import Action, Plan, PlanBuilder, PlanError, Received, Slice, simulate


def test_builder_waits_for_sends_reading_memory_before_writing_it() -> None:
    b = PlanBuilder()
    s0 = b.send(1, Slice("dst", 0, 4), itemsize=4)  # reads dst[0:4]
    s1 = b.send(1, Slice("src", 0, 4), itemsize=4)  # reads src[0:4]: another array unless aliased
    r = b.recv(1, items=4, itemsize=4)
    c = b.copy(Received(r), Slice("dst", 2, 6), itemsize=4)
    assert b.actions[c].deps == (s0, r)
    assert s1 not in b.actions[c].deps
    aliased = PlanBuilder(aliased=True)
    s = aliased.send(1, Slice("src", 0, 4), itemsize=4)
    c = aliased.copy(Slice("src", 0, 1), Slice("dst", 3, 4), itemsize=4)
    assert aliased.actions[c].deps == (s,)


def test_fence_joins_a_phase_to_the_next() -> None:
    b = PlanBuilder()
    r = b.recv(1, items=0, itemsize=1)
    b.fence([r])
    first = b.send(1, Slice("src", 0, 1), itemsize=1)
    second = b.send(1, Slice("src", 1, 2), itemsize=1)
    assert b.actions[first].deps == (r,)
    assert b.actions[second].deps == ()


def test_validate_names_unmatched_messages() -> None:
    send = Action("send", peer=1, nbytes=8)
    with pytest.raises(PlanError, match="rank 0 sends \\[8\\] bytes to rank 1"):
        Plan("bad", ((send,), (Action("recv", peer=0, nbytes=4),))).validate()
    with pytest.raises(PlanError, match="depends on a later action"):
        Plan("bad", ((Action("copy", deps=(0,)),),)).validate()


def test_simulate_detects_deadlock() -> None:
    wait0 = (Action("recv", peer=1), Action("copy", deps=(0,)), Action("send", peer=1))
    wait1 = (Action("recv", peer=0), Action("copy", deps=(0,)), Action("send", peer=0))
    with pytest.raises(PlanError, match="deadlock"):
        simulate(Plan("cross", (wait0, wait1)), alpha=1.0, beta=0.0)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_every_collective_plan_is_well_formed(n: int) -> None:
    bounds = tuple(chunk_bounds(1000, n))
    plans = [
        allreduce_plan("ring", n, 1000, 4, segment_bytes=512),
        allreduce_plan("tree", n, 1000, 4),
        allreduce_plan("direct", n, 1000, 4, aliased=True),
        allreduce_plan("shm", n, 1000, 4, shm=(256, 16, 64)),  # blocks of 256 items
        allreduce_plan("shm", n, 10, 4, shm=(256, 16, 64)),  # one phase
        allreduce_plan("hierarchical", n, 1000, 4, hosts=tuple("ab"[r * 2 // n] for r in range(n))),
        broadcast_plan("tree", n, 1000, 4, root=n - 1),
        broadcast_plan("chain", n, 1000, 4, root=1, segment_bytes=300),
        reduce_scatter_plan(n, bounds, 8),
        allgather_plan(n, bounds, 8),
        barrier_plan(n),
    ]
    for plan in plans:
        plan.validate()
        assert simulate(plan, alpha=1e-6, beta=1e-9, gamma=1e-10).time > 0


@pytest.mark.parametrize("n", [2, 3, 4, 7, 16])
def test_cost_of_the_replayed_plans_equals_the_textbook_formulas(n: int) -> None:
    """With one segment per chunk and free compute, the replay gives Hockney's formulas exactly (the tree's and
    direct's for powers of two: otherwise some rank hears from two children at once, which the model lets
    overlap, so the replay is cheaper than the formula's bound)."""
    alpha, beta, nbytes = 1e-3, 1e-8, 16 * 1024
    rounds = math.ceil(math.log2(n))

    def cost(plan: Plan) -> float:
        return simulate(plan, alpha=alpha, beta=beta).time

    chunk = nbytes // n  # nbytes is a multiple of every n here except 3 and 7: use the largest chunk
    largest = max(b - a for a, b in chunk_bounds(nbytes, n))
    assert chunk <= largest
    ring = cost(allreduce_plan("ring", n, nbytes, 1, agreement=False))
    assert ring == pytest.approx(2 * (n - 1) * (alpha + largest * beta))
    tree = cost(allreduce_plan("tree", n, nbytes, 1, agreement=False))
    direct = cost(allreduce_plan("direct", n, nbytes, 1))
    if n & (n - 1) == 0:
        assert tree == pytest.approx(2 * rounds * (alpha + nbytes * beta))
        assert direct == pytest.approx(rounds * alpha + (n - 1) * nbytes * beta)
    else:
        assert tree < 2 * rounds * (alpha + nbytes * beta)
        assert direct <= rounds * alpha + (n - 1) * nbytes * beta + 1e-12
    assert cost(barrier_plan(n)) == pytest.approx(rounds * alpha)
    # the agreement adds its rounds of latency to every other call
    assert cost(allreduce_plan("ring", n, nbytes, 1)) == pytest.approx(rounds * alpha + ring)


def test_pipelined_chain_broadcast_costs_one_transfer_plus_a_segment_per_hop() -> None:
    """n beta + (N - 2 + S) segment latencies for S segments: the chain's promise in plans.chain_broadcast."""
    n, segments, seg_bytes, alpha, beta = 4, 8, 1000, 1e-4, 1e-7
    plan = broadcast_plan("chain", n, segments * seg_bytes, 1, segment_bytes=seg_bytes, agreement=False)
    t = simulate(plan, alpha=alpha, beta=beta).time
    assert t == pytest.approx((segments + n - 2) * seg_bytes * beta + (n - 1) * alpha)


def test_ring_plan_table_two_ranks_two_segments() -> None:
    """Exact table: rank 0 of a 2-rank ring allreduce of 8 float32 items in 8-byte segments."""
    actions = allreduce_plan("ring", 2, 8, 4, segment_bytes=8, agreement=False).ranks[0]
    table = [(a.kind, a.peer, a.nbytes, a.deps) for a in actions]
    assert table == [
        ("send", 1, 8, ()),  # chunk 1 (items 4..8) of src, two segments
        ("send", 1, 8, ()),
        ("recv", 1, 8, ()),  # chunk 0 arrives, reduced segment by segment
        ("recv", 1, 8, ()),
        ("reduce", -1, 8, (2,)),
        ("finish", -1, 8, ()),
        ("send", 1, 8, ()),  # the reduced segment goes straight back
        ("reduce", -1, 8, (3,)),
        ("finish", -1, 8, ()),
        ("send", 1, 8, ()),
        ("recv", 1, 8, ()),  # chunk 1 comes back reduced: copied into dst after its send released it
        ("recv", 1, 8, ()),
        ("copy", -1, 8, (10,)),
        ("copy", -1, 8, (11,)),
    ]
    # in place (src is dst), chunk 1 is overwritten only after the first sends released it
    in_place = allreduce_plan("ring", 2, 8, 4, segment_bytes=8, agreement=False, aliased=True).ranks[0]
    assert [a.deps for a in in_place[-2:]] == [(0, 10), (1, 11)]


def test_ps_and_gossip_rounds_are_plans_the_cost_model_replays() -> None:
    from paratrain.gossip.mixing import resolve_mixing
    from paratrain.gossip.plan import gossip_plan
    from paratrain.ps.plans import round_plan
    from paratrain.ps.sharding import plan_chunks

    chunks = plan_chunks("w", (1000, 10), 4, 2, chunk_bytes=8000)
    ps = round_plan(chunks, 40, num_workers=3, num_servers=2)
    ps.validate()
    # every worker sends its 40 kB gradient and gets 40 kB back; each server sends its chunks to 3 workers
    assert ps.bytes_sent()[:3] == [40_000] * 3
    assert sum(ps.bytes_sent()[3:]) == 3 * 40_000
    alpha, beta = 1e-4, 1e-8
    assert simulate(ps, alpha=alpha, beta=beta).time >= 2 * alpha + 40_000 * beta
    # a worker's chunks for one server travel as one batch: 2 requests (one per server) and 2 replies per call
    assert [len(ps.sends(w)) for w in range(3)] == [4, 4, 4]
    ring, _ = resolve_mixing("ring", 6)
    gossip = gossip_plan(ring, 1000)
    gossip.validate()
    assert gossip.bytes_sent() == [2000] * 6  # two neighbours, whatever the number of workers
    assert simulate(gossip, alpha=alpha, beta=beta).time == pytest.approx(alpha + 2000 * beta)


def test_a_shared_memory_wait_ends_alpha_after_the_last_signal() -> None:
    slow = (Action("copy", nbytes=1000), Action("signal", tag=1), Action("wait", tag=1))
    fast = (Action("signal", tag=1), Action("wait", tag=1))
    costs = simulate(Plan("sync", (slow, fast)), alpha=0.5, beta=0.0, gamma=0.001)
    assert costs.done[1] == (0.0, 1.5)  # the fast rank waits for the slow one's copy (1 s) and the hand-off
    with pytest.raises(PlanError, match="never signalled"):
        Plan("lonely", ((Action("wait", tag=3),), ())).validate()


def test_ps_batches_are_cut_by_count_and_by_bytes_and_keep_chunk_order() -> None:
    from paratrain.plan.ir import Parts, Received
    from paratrain.ps.plans import BATCH_BYTES, MAX_BATCH, batches, pull_actions, push_actions
    from paratrain.ps.sharding import Chunk

    tiny = [Chunk(i, i, i + 1, server=i % 2) for i in range(2 * MAX_BATCH + 20)]
    cut = batches(tiny, 8)
    assert [len(b) for b in cut] == [MAX_BATCH, 10, MAX_BATCH, 10]
    assert [c.index for b in cut for c in b] == [*range(0, len(tiny), 2), *range(1, len(tiny), 2)]
    row = 1 << 20  # 1 MiB rows: a batch holds BATCH_BYTES of them, a larger chunk goes alone
    big = [Chunk(0, 0, 3, server=0), Chunk(1, 3, 5, server=0), Chunk(2, 5, 11, server=0), Chunk(3, 11, 12, server=0)]
    assert 4 * row == BATCH_BYTES
    assert [[c.index for c in b] for b in batches(big, row)] == [[0], [1], [2], [3]]
    assert [[c.index for c in b] for b in batches(big[:2], row // 2)] == [[0, 1]]
    # the plans send one message per batch, its parts in chunk order, and copy each reply array into its rows
    push = push_actions(big[:2], row // 2, [7])
    assert [(a.kind, a.nbytes) for a in push] == [("recv", 0), ("send", 5 * row // 2)]
    assert isinstance(push[1].data, Parts) and [p.start for p in push[1].data.parts] == [0, 3]
    pull = pull_actions(big[:2], row // 2, [7])
    assert [a.kind for a in pull] == ["recv", "send", "copy", "copy"]
    assert [(a.data, a.out.start if a.out else None) for a in pull[2:]] == [(Received(0, 0), 0), (Received(0, 1), 3)]
