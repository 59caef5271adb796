"""Hierarchical allreduce for ranks spread over hosts: reduce inside each host, ring across hosts, broadcast.

Inside a host, messages are cheap (ipc or shared memory); between hosts the network is the bottleneck. The
flat ring sends 2(N - 1)/N of the array over the network from *every* rank; the hierarchy sends it only from
one leader per host (the lowest rank there), so inter-host traffic shrinks by the number of ranks per host.
This is what Horovod's hierarchical allreduce and NCCL's tree/ring-of-rings do.

    host A: r0 r1 ─reduce→ r0 ─┐                       ┌─ r0 ─broadcast→ r0 r1
                              ring allreduce (leaders)
    host B: r2 r3 ─reduce→ r2 ─┘                       └─ r2 ─broadcast→ r2 r3

The three phases are one plan (:func:`.lower.hierarchical_allreduce_into`: the tree reduce, ring and tree
broadcast schedules composed in world ranks), run by the one executor with the call's own tag: within one
call the phases use disjoint (sender, receiver) pairs or opposite directions, and messages of one pair and tag
are matched in order, so they cannot be confused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from paratrain.collectives.exchange import Exchange
from paratrain.collectives.execute import run_actions
from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.collectives.ops import Reducer

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
    plan = allreduce_plan(
        "hierarchical",
        ex.world_size,
        src.size,
        src.itemsize,
        aliased=dst is src,
        hosts=tuple(layout.hosts),
        agreement=False,
    )
    run_actions(ex, plan.ranks[ex.rank], {"src": src, "dst": dst}, reducer, dst.dtype)
