"""Hierarchical allreduce for ranks spread over hosts: reduce inside each host, ring across hosts, broadcast.

Inside a host, messages are cheap (ipc or shared memory); between hosts the network is the bottleneck. The
flat ring sends 2(N - 1)/N of the array over the network from *every* rank; the hierarchy sends it only from
one leader per host (the lowest rank there), so inter-host traffic shrinks by the number of ranks per host.
This is what Horovod's hierarchical allreduce and NCCL's tree/ring-of-rings do.

    host A: r0 r1 ─reduce→ r0 ─┐                       ┌─ r0 ─broadcast→ r0 r1
                              ring allreduce (leaders)
    host B: r2 r3 ─reduce→ r2 ─┘                       └─ r2 ─broadcast→ r2 r3

Each phase runs an existing algorithm on a :class:`~paratrain.transport.group.GroupTransport` view, with the
call's own tag: within one call the phases use disjoint (sender, receiver) pairs or opposite directions, and
messages of one pair and tag are matched in order, so they cannot be confused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from paratrain.collectives.ops import Reducer
from paratrain.collectives.ring import ring_allreduce_run
from paratrain.collectives.tree import Exchange, tree_broadcast, tree_reduce
from paratrain.transport.group import GroupTransport

__all__ = ["HostLayout", "hierarchical_allreduce"]


class HostLayout:
    """Which ranks share a host: ``hosts[r]`` is rank r's host id.

    Example:
        >>> layout = HostLayout(["a", "a", "b", "b", "b"])
        >>> layout.local_ranks(3), layout.leaders
        ([2, 3, 4], [0, 2])
    """

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)
        self._groups: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            self._groups.setdefault(host, []).append(rank)
        self.leaders = [group[0] for group in self._groups.values()]

    def local_ranks(self, rank: int) -> list[int]:
        """The ranks on ``rank``'s host, ascending (the first is the leader)."""
        return self._groups[self.hosts[rank]]

    @property
    def is_hierarchical(self) -> bool:
        """True when the hierarchy helps: several hosts, and some host with several ranks."""
        return 1 < len(self._groups) < len(self.hosts)


def hierarchical_allreduce(
    ex: Exchange, src: npt.NDArray[Any], dst: npt.NDArray[Any], reducer: Reducer, *, layout: HostLayout
) -> None:
    """Allreduce of flat ``src`` into flat ``dst`` over ``layout``'s hosts (see the module docstring).

    Every rank ends with identical bits (the leaders' ring gives them equal results; the broadcast copies).
    ``mean`` divides by the total number of ranks once, at the leaders, before the broadcast.
    """
    transport = ex.transport
    partial = Reducer("sum" if reducer.op == "mean" else reducer.op, reducer.dtype_name)
    local = layout.local_ranks(transport.rank)
    is_leader = local[0] == transport.rank
    local_view = GroupTransport(transport, local)
    with Exchange(local_view, tag=ex.tag, timeout=ex.left(), label=f"{ex.label}, intra-host reduce") as lex:
        tree_reduce(lex, src, dst, partial)
    if is_leader:  # dst now holds the host's partial result
        if len(layout.leaders) > 1:
            leaders = GroupTransport(transport, layout.leaders)
            with Exchange(leaders, tag=ex.tag, timeout=ex.left(), label=f"{ex.label}, inter-host ring") as gex:
                ring_allreduce_run(gex, dst, dst, partial)
        reducer.finish(dst, transport.world_size)
    with Exchange(local_view, tag=ex.tag, timeout=ex.left(), label=f"{ex.label}, intra-host broadcast") as bex:
        tree_broadcast(bex, dst, root=0, source=dst if is_leader else None)
