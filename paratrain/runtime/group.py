"""Process groups: a set of worker ranks with its own collectives and its own tag space.

A pipeline's stages run different sequences of calls (stage 0 never takes part in stage 1's data-parallel
allreduce), and a ring re-formed after a failure must not pick up the messages of the old one. Tags decide
which message meets which receive, and collectives number their calls to get tags, so ranks that issue
different sequences must draw their tags from different spaces. Every :class:`Group` has a *tag space*: its
calls' tags are ``COLLECTIVE_TAG_BASE - space * TAG_SPACE_SIZE - k`` for its k-th call, so no two groups that
share a rank ever use the same tag (user tags are >= 0, below the base nothing else lives).

The world group (every worker) is space 0, which keeps the tags of a job without sub-groups what they were.
Sub-groups come from :meth:`~paratrain.runtime.context.Context.new_group` (a list of ranks) and
:meth:`~paratrain.runtime.context.Context.split` (one group per key: by host, by pipeline stage...). Both are
*collective over the world*: every worker calls them, in the same order, with the same arguments, and they
check that with one agreement round, so a rank that disagrees makes every rank raise the same error instead of
hanging in a later call. Groups from one ``split`` are disjoint and share one space.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from paratrain.collectives.api import LOOPBACK_BYTES_PER_SECOND, Collectives, network_allreduce_choice
from paratrain.collectives.barrier import barrier as _barrier
from paratrain.collectives.policy import MESSAGE_SECONDS
from paratrain.device.events import SupportsQuery
from paratrain.errors import NotInitializedError
from paratrain.timeline import timeline_for
from paratrain.transport.base import Handle, Transport

if TYPE_CHECKING:
    from paratrain.config import Settings

__all__ = ["COLLECTIVE_TAG_BASE", "TAG_SPACE_SIZE", "CollectiveMethods", "Group"]

#: Collective operations use tags at or below this value; user tags are >= 0.
COLLECTIVE_TAG_BASE = -(1 << 50)

#: Tags per group: 2**40 calls (at a million calls a second, twelve days), and room for 2**12 spaces before
#: tags leave the 64-bit range of the wire format.
TAG_SPACE_SIZE = 1 << 40

#: The most tag spaces a job can use.
MAX_TAG_SPACES = ((1 << 63) + COLLECTIVE_TAG_BASE) // TAG_SPACE_SIZE

A = TypeVar("A")


class CollectiveMethods:
    """The collective calls of a set of ranks, through its :attr:`collectives`: shared by :class:`Group` and the
    :class:`~paratrain.runtime.context.Context` (whose calls run on its world group). Each behaves as the
    :class:`~paratrain.collectives.api.Collectives` method of the same name, among the set's ranks only."""

    @property
    def collectives(self) -> Collectives:
        """The :class:`~paratrain.collectives.api.Collectives` these calls run on."""
        raise NotImplementedError

    def allreduce(self, x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None) -> A:
        """Reduces ``x`` over the members into a new array/tensor. Blocks."""
        return self.collectives.allreduce(x, op, algorithm, timeout=timeout)

    def allreduce_(self, x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None) -> A:
        """Reduces ``x`` over the members in place and returns ``x``. Blocks."""
        return self.collectives.allreduce_(x, op, algorithm, timeout=timeout)

    def allreduce_async(
        self, x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None
    ) -> Handle[A]:
        """Starts an allreduce over the members in the background; ``.wait()`` gives the result."""
        return self.collectives.allreduce_async(x, op, algorithm, timeout=timeout)

    def allreduce_async_(
        self,
        x: A,
        op: str = "sum",
        algorithm: str = "auto",
        *,
        timeout: float | None = None,
        ready: SupportsQuery | None = None,
    ) -> Handle[A]:
        """Starts an in-place allreduce over the members in the background; leave ``x`` alone until ``.wait()``
        (which returns ``x``). ``ready``: waited for on the background thread before ``x`` is read (a CUDA event
        behind the copies that fill it; see :meth:`~paratrain.collectives.api.Collectives.allreduce_async_`)."""
        return self.collectives.allreduce_async_(x, op, algorithm, timeout=timeout, ready=ready)

    def broadcast(self, x: A, root: int = 0, *, algorithm: str = "auto", timeout: float | None = None) -> A:
        """A new array/tensor holding group rank ``root``'s ``x``. Blocks."""
        return self.collectives.broadcast(x, root, algorithm=algorithm, timeout=timeout)

    def allgather(self, x: A, *, timeout: float | None = None) -> A:
        """Every member's ``x`` concatenated along axis 0, in group-rank order. Blocks."""
        return self.collectives.allgather(x, timeout=timeout)

    def allgather_async(self, x: A, *, timeout: float | None = None) -> Handle[A]:
        """Starts an allgather over the members in the background (``x`` is copied); ``.wait()`` gives it."""
        return self.collectives.allgather_async(x, timeout=timeout)

    def reduce_scatter(self, x: A, op: str = "sum", *, timeout: float | None = None) -> A:
        """This member's part of the reduced ``x``, split along axis 0. Blocks."""
        return self.collectives.reduce_scatter(x, op, timeout=timeout)

    def reduce(self, x: A, root: int = 0, op: str = "sum", *, timeout: float | None = None) -> A | None:
        """``x`` reduced over the members, on member ``root``; None on the others. Blocks."""
        return self.collectives.reduce(x, root, op, timeout=timeout)

    def reduce_async(self, x: A, root: int = 0, op: str = "sum", *, timeout: float | None = None) -> Handle[A | None]:
        """Starts :meth:`reduce` in the background (``x`` is copied first)."""
        return self.collectives.reduce_async(x, root, op, timeout=timeout)

    def gather(self, x: A, root: int = 0, *, timeout: float | None = None) -> A | None:
        """Every member's ``x`` concatenated along axis 0 in member order, on ``root``; None on the others. Blocks."""
        return self.collectives.gather(x, root, timeout=timeout)

    def gather_async(self, x: A, root: int = 0, *, timeout: float | None = None) -> Handle[A | None]:
        """Starts :meth:`gather` in the background (``x`` is copied first)."""
        return self.collectives.gather_async(x, root, timeout=timeout)

    def scatter(self, x: A, root: int = 0, *, counts: Sequence[int] | None = None, timeout: float | None = None) -> A:
        """This member's part of ``root``'s ``x``, split along axis 0 (by ``counts`` rows if given). Blocks."""
        return self.collectives.scatter(x, root, counts=counts, timeout=timeout)

    def scatter_async(
        self, x: A, root: int = 0, *, counts: Sequence[int] | None = None, timeout: float | None = None
    ) -> Handle[A]:
        """Starts :meth:`scatter` in the background (``x`` is copied first)."""
        return self.collectives.scatter_async(x, root, counts=counts, timeout=timeout)

    def alltoall(self, x: A, *, counts: Sequence[int] | None = None, timeout: float | None = None) -> A:
        """Part q of ``x`` (split along axis 0) to member q; what each member sent here, in member order. Blocks."""
        return self.collectives.alltoall(x, counts=counts, timeout=timeout)

    def alltoall_async(self, x: A, *, counts: Sequence[int] | None = None, timeout: float | None = None) -> Handle[A]:
        """Starts :meth:`alltoall` in the background (``x`` is copied first)."""
        return self.collectives.alltoall_async(x, counts=counts, timeout=timeout)


class Group(CollectiveMethods):
    """Some of the workers, seen as a world of their own, with their own collectives and tags.

    Attributes:
        ranks: the members' ranks among the workers, ascending; group rank ``i`` is worker ``ranks[i]``.
        transport: the members' view of the workers' transport (group ranks), or the workers' transport itself
            for the world group.
        tag_space: this group's tag space (0 for the world).

    The collective methods behave as :class:`~paratrain.collectives.api.Collectives`' (which see), among the
    members only; they block, and may be called from any thread, but every member must issue the group's
    calls in the same order.

    Example:
        >>> import numpy as np
        >>> from paratrain.testing import run_ranks
        >>> def fn(ctx):
        ...     pair = ctx.split(lambda rank: rank // 2)      # {0, 1} and {2, 3}
        ...     return pair.allreduce(np.array([ctx.rank])).tolist()
        >>> run_ranks(4, fn)
        [[1], [1], [5], [5]]
    """

    def __init__(
        self,
        *,
        transport: Transport,
        ranks: Sequence[int],
        tag_space: int,
        settings: Settings,
        hosts: Sequence[str] | None,
        check_open: Callable[[], None],
    ) -> None:
        if not 0 <= tag_space < MAX_TAG_SPACES:
            raise ValueError(f"tag space {tag_space} outside 0..{MAX_TAG_SPACES - 1}: too many groups")
        self.transport = transport
        self.ranks = list(ranks)
        self.tag_space = tag_space
        self._settings = settings
        self._hosts = None if hosts is None else list(hosts)
        self._check_open = check_open
        self._calls = 0  # tags taken so far
        self._lock = threading.Lock()
        self._collectives: Collectives | None = None

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.transport.rank

    @property
    def world_size(self) -> int:
        """Number of members."""
        return self.transport.world_size

    def next_tag(self) -> int:
        """A fresh tag of this group's space for the next call (members call in the same order)."""
        return self.reserve_tags(1)

    def reserve_tags(self, count: int) -> int:
        """The first of ``count`` fresh consecutive tags, going down: ``first, first - 1, ...`` (a pipeline step's
        messages, one per micro-batch and direction). Members reserve the same counts in the same order."""
        if count < 1:
            raise ValueError(f"reserve at least one tag, not {count}")
        with self._lock:
            first, self._calls = self._calls, self._calls + count
            return COLLECTIVE_TAG_BASE - self.tag_space * TAG_SPACE_SIZE - first

    def barrier(self, timeout: float | None = None) -> None:
        """Blocks until every member has called ``barrier``.

        Raises:
            PeerLostError: a member died before arriving.
            CommTimeoutError: some member did not arrive within ``timeout`` (default ``PARATRAIN_TIMEOUT``).
        """
        self._check_open()
        _barrier(self.transport, tag=self.next_tag(), timeout=timeout or self._settings.timeout)

    @property
    def collectives(self) -> Collectives:
        """The members' :class:`~paratrain.collectives.api.Collectives` (where algorithms are registered).

        On one host without an emulated network they go through shared memory; with the fault injector's
        network on one host, ``auto`` picks by the alpha-beta model of its links.
        """
        self._check_open()
        if self._collectives is not None:  # set once: no lock on the path of every collective call
            return self._collectives
        with self._lock:
            if self._collectives is None:
                self._collectives = self._make_collectives()
            return self._collectives

    def _make_collectives(self) -> Collectives:
        hosts, faults = self._hosts, self._settings.faults
        collectives = Collectives(
            transport=self.transport, next_tag=self.next_tag, timeout=self._settings.timeout, hosts=hosts
        )
        collectives.timeline = timeline_for(self._settings.timeline, self._settings.rank)
        one_host = hosts is not None and len(set(hosts)) == 1
        if one_host and faults is None:
            collectives.enable_shared_memory(self._settings.run_id)  # shared memory would bypass emulated links
        elif faults is not None and (hosts is None or one_host):
            # an emulated network on one host: its links are known, so "auto" picks by the alpha-beta model
            # (across hosts the hierarchical algorithm stays)
            from paratrain.transport.faults import FaultSpec

            spec = FaultSpec.parse(faults)
            index = {world: mine for mine, world in enumerate(self.ranks)}
            own = MESSAGE_SECONDS  # (every message's own cost, on top of the emulated latency)
            links = {
                (index[link.a], index[link.b]): (link.latency + own, link.bandwidth or LOOPBACK_BYTES_PER_SECOND)
                for link in spec.links
                if link.a in index and link.b in index
            }
            if links:  # uneven links: "blink" packs trees over them, and "auto" replays every plan on them
                collectives.use_links(links, latency=spec.latency + own, bandwidth=spec.bandwidth)
            elif spec.latency > 0 or spec.bandwidth is not None:
                collectives.choose_allreduce = network_allreduce_choice(spec.latency + own, spec.bandwidth)
        return collectives

    def close(self) -> None:
        """Stops the group's background thread and leaves its shared-memory segment. Idempotent."""
        with self._lock:
            collectives, self._collectives = self._collectives, None
        if collectives is not None:
            collectives.close()

    def __repr__(self) -> str:
        return f"Group(ranks={self.ranks}, rank={self.rank}, tag_space={self.tag_space})"


def closed_check(closed: Callable[[], bool]) -> Callable[[], None]:
    """A ``check_open`` for :class:`Group` raising ``NotInitializedError`` once ``closed()`` is true."""

    def check() -> None:
        if closed():
            raise NotInitializedError("this paratrain context was shut down; call paratrain.init() again")

    return check
