"""The ``algorithm="auto"`` policies: measured crossovers on loopback, or the alpha-beta cost of the plans.

A policy is ``(nbytes, world_size) -> algorithm name``; :class:`~paratrain.collectives.api.Collectives` holds
one per operation and may be given another (shared memory inside a host, a known emulated network).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from paratrain.collectives.lower_allreduce import PLANNED_ALGORITHMS, allreduce_plan
from paratrain.collectives.plans_blink import PackedTree, link_capacity, pack_trees
from paratrain.plan.cost import simulate

__all__ = [
    "AUTO_BROADCAST_TREE_MAX_BYTES",
    "AUTO_DIRECT_MAX_BYTES",
    "AUTO_TREE_MAX_BYTES",
    "LOOPBACK_BYTES_PER_SECOND",
    "MESSAGE_SECONDS",
    "default_allreduce_choice",
    "default_broadcast_choice",
    "link_allreduce_choice",
    "network_allreduce_choice",
]

#: ``algorithm="auto"`` uses ``"direct"`` while each rank receives at most this many bytes in all
#: ((N - 1) x the array): the agreement's ceil(log2 N) rounds carry the data, and nothing else is sent.
#: These thresholds must come from measurement on the machines that run the job. Measured here: separate
#: processes over the ZeroMQ transport (ipc) on a 2-core VM, float32 sum, median ms, best of 3 rounds:
#:
#:     N  bytes/rank   direct    tree    ring       N  bytes/rank   direct    tree    ring
#:     2     1 KiB      0.54     0.88    1.33       3     1 KiB      0.95     1.37    2.54
#:     2    64 KiB      0.73     1.21    1.14       3   256 KiB      2.27     2.63    4.14
#:     2   256 KiB      1.14     1.71    3.11       3     1 MiB      5.08     4.56    5.39
#:     2     1 MiB      1.55     2.10    2.26       3     4 MiB     16.2     10.9    12.6
#:     2     4 MiB      4.63     4.54    4.57       3    16 MiB       -      44.5    30.2
#:     2    16 MiB     14.3     16.7    13.5        4    64 KiB      1.85     2.76    4.59
#:
#: (Gloo in the same session: N = 2, 1 KiB 0.86 ms, 16 MiB 17.5 ms.) With 2 cores N = 3 and 4 oversubscribe
#: the machine, which favours the tree; with a core (or a host) per rank the ring wins earlier.
AUTO_DIRECT_MAX_BYTES = 1 << 19

#: ``algorithm="auto"`` uses the binomial tree up to this many bytes per rank (where ``"direct"`` does not
#: apply), the ring above: the tree needs 2 log2 N latencies, the ring 2(N - 1), but the ring moves
#: 2(N - 1)/N of the data per rank against the tree's up to 2 log2 N times all of it. Measured crossover
#: (table above): about 4 MiB for N = 2 and 3.
AUTO_TREE_MAX_BYTES = 1 << 22

#: ``algorithm="auto"`` broadcasts at most this many bytes along a binomial tree (log2 N latencies), larger
#: arrays along a pipelined chain (every link carries the data once, instead of log2 N times on the tree's
#: critical path). Measured as above for N = 2 and 3 from 64 KiB to 16 MiB: within 10% of each other
#: everywhere (on 2 cores the chain's parallelism has no idle core to use), so this value comes from the
#: alpha-beta model, not from a crossover; re-measure with more ranks and cores.
AUTO_BROADCAST_TREE_MAX_BYTES = 1 << 20


def default_allreduce_choice(nbytes: int, world_size: int) -> str:
    """What ``algorithm="auto"`` runs for an allreduce of ``nbytes`` per rank.

    ``"direct"`` while ``(world_size - 1) * nbytes <= AUTO_DIRECT_MAX_BYTES``, else ``"tree"`` up to
    ``AUTO_TREE_MAX_BYTES``, else ``"ring"``.

    Example:
        >>> [default_allreduce_choice(nbytes, 4) for nbytes in (1024, 1 << 20, 1 << 24)]
        ['direct', 'tree', 'ring']
    """
    if (world_size - 1) * nbytes <= AUTO_DIRECT_MAX_BYTES:
        return "direct"
    return "tree" if nbytes <= AUTO_TREE_MAX_BYTES else "ring"


#: Bytes per second assumed for a link whose bandwidth the emulated network leaves unlimited: the loopback TCP
#: throughput measured on the 2-core development machine (2.2-3.8 GB/s), its lower end.
LOOPBACK_BYTES_PER_SECOND = 2.2e9

#: Seconds every message costs on top of an emulated network's latency: the ZeroMQ transport's own per-message
#: time (header, receiver thread, Python bookkeeping), ``paratrain profile``'s ``ipc`` alpha on the 2-core
#: development machine (0.33 ms between 2 processes; ``benchmarks/simulator/machine.json``). Without it, an
#: emulated network of latency 0 made the policy pick the ring for every size at 4 ranks and 1 Gbit/s, where
#: halving-doubling measured 11-20 % faster from 64 KiB to 1 MiB (``benchmarks/allreduce``). Re-measure on the
#: target machine.
MESSAGE_SECONDS = 3.3e-4


def network_allreduce_choice(
    latency: float,
    bandwidth: float | None,
    *,
    links: Mapping[tuple[int, int], tuple[float, float]] | None = None,
    trees: tuple[PackedTree, ...] | None = None,
) -> Callable[[int, int], str]:
    """An ``algorithm="auto"`` policy for a network whose per-node links are known (the fault injector's).

    The measured crossovers behind :func:`default_allreduce_choice` come from loopback, where bandwidth is
    almost free; on a slow emulated link they pick the tree for a 1 MiB gradient and pay 2 log2 N full copies.
    This policy instead takes the cheapest call plan (:func:`~paratrain.collectives.lower.allreduce_plan`: the
    agreement, then the algorithm) by the alpha-beta model of one full-duplex link per node
    (:func:`paratrain.plan.cost.simulate`), latency ``a`` and ``b`` bytes/s (``b`` =
    :data:`LOOPBACK_BYTES_PER_SECOND` when unlimited). The replay reproduces the textbook costs, with
    ``L = ceil(log2 N)`` agreement rounds before every call (``direct`` carries its data in them)::

        direct            L a + (N - 1) n / b                 every rank gets every array, reduces locally
        tree              L a + 2 L (a + n / b)               binomial reduce, then broadcast
        ring              L a + 2 (N - 1) (a + n / (N b))     reduce-scatter, then allgather
        halving_doubling  L a + 2 log2 N a + 2 (N - 1) n / (N b)   (N a power of two; else 2 more steps of n)
        torus (R x C)     L a + 2 (R + C - 2) a + 2 (N - 1) n / (N b)
        double_tree       about L a + 2 log2 N a + n / b       (segments pipelined up and down two trees)

    (Messages above the pipelining segment are cut, which adds latencies.) With ``links`` (``(src, dst)`` ->
    ``(alpha, beta)`` of pairs with a link of their own: the fault injector's ``links=``) the replay puts their
    messages there, and with ``trees`` (their packing, :func:`~.plans_blink.pack_trees`) ``"blink"`` is a
    candidate too. Ties (within a part in a million) go to the simpler algorithm, in the order of
    :data:`~.lower_allreduce.PLANNED_ALGORITHMS`, then ``"blink"``.

    Example:
        >>> choose = network_allreduce_choice(0.002, 12.5e6)   # 2 ms, 100 Mbit/s
        >>> choose(1 << 24, 4), choose(1 << 20, 4), choose(1 << 10, 4)
        ('ring', 'halving_doubling', 'direct')
    """
    beta = 1.0 / (bandwidth if bandwidth is not None else LOOPBACK_BYTES_PER_SECOND)

    @functools.lru_cache(maxsize=1024)
    def choose(nbytes: int, world_size: int) -> str:
        if world_size <= 1:
            return "direct"
        plans = {name: allreduce_plan(name, world_size, nbytes, 1) for name in PLANNED_ALGORITHMS}
        if trees is not None:
            plans["blink"] = allreduce_plan("blink", world_size, nbytes, 1, trees=trees)
        costs = {name: simulate(plan, alpha=latency, beta=beta, links=links).time for name, plan in plans.items()}
        best = min(costs.values())
        return next(name for name, cost in costs.items() if cost <= best * (1 + 1e-6))

    return choose


def link_allreduce_choice(
    n: int, links: Mapping[tuple[int, int], tuple[float, float]], *, latency: float, bandwidth: float | None
) -> tuple[tuple[PackedTree, ...], Callable[[int, int], str]]:
    """The trees ``"blink"`` packs over ``links`` (``(a, b)`` -> ``(alpha, bytes per second)`` of the pairs of
    ``n`` ranks with a link of their own; the others share their nodes' links of ``latency`` and ``bandwidth``)
    and the :func:`network_allreduce_choice` that replays every plan, those trees' too, on those links."""
    fast = bandwidth if bandwidth is not None else LOOPBACK_BYTES_PER_SECOND
    trees = pack_trees(n, link_capacity(n, {pair: rate for pair, (_, rate) in links.items()}, fast))
    directed: dict[tuple[int, int], tuple[float, float]] = {}
    for (a, b), (alpha, rate) in links.items():
        directed[(a, b)] = directed[(b, a)] = (alpha, 1.0 / rate)
    return trees, network_allreduce_choice(latency, bandwidth, links=directed, trees=trees)


def default_broadcast_choice(nbytes: int, world_size: int) -> str:
    """What ``algorithm="auto"`` runs for a broadcast of ``nbytes``: tree if small, pipelined chain otherwise.

    Example:
        >>> default_broadcast_choice(1024, 4), default_broadcast_choice(1 << 24, 4)
        ('tree', 'chain')
    """
    return "tree" if nbytes <= AUTO_BROADCAST_TREE_MAX_BYTES else "chain"
