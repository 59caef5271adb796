"""A subset of ranks seen as a world of its own, so that any algorithm runs unchanged on a subgroup.

Group rank ``i`` is global rank ``ranks[i]``. Sends and receives are forwarded to the underlying transport
with ranks translated both ways; the view owns nothing (closing it is a no-op). Hierarchical collectives use
one view per host and one over the hosts' leaders.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from paratrain.transport.base import ANY_SOURCE, ANY_TAG, Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["GroupTransport"]


class GroupTransport(Transport):
    """The ranks ``ranks`` of ``inner`` as a world of ``len(ranks)``; ``inner.rank`` must be one of them.

    Thread-safe as far as ``inner`` is.

    Example:
        >>> from paratrain.transport.inproc import InprocFabric
        >>> fabric = InprocFabric(4)
        >>> odd = [GroupTransport(fabric.transport(r), [1, 3]) for r in (1, 3)]
        >>> odd[0].send(1, tag=2, meta={"hi": 1})
        >>> msg = odd[1].recv(0, 2)
        >>> (odd[1].rank, msg.src)
        (1, 0)
    """

    name = "group"

    def __init__(self, inner: Transport, ranks: Sequence[int]) -> None:
        members = list(ranks)
        if len(set(members)) != len(members):
            raise ValueError(f"group ranks {members} contain duplicates")
        if inner.rank not in members:
            raise ValueError(f"rank {inner.rank} is not in the group {members}")
        super().__init__(rank=members.index(inner.rank), world_size=len(members), timeout=inner.timeout)
        self.inner = inner
        self.ranks = members
        self.stats = inner.stats
        self._index = {g: i for i, g in enumerate(members)}
        self._outer_to_inner: dict[int, Handle[Message]] = {}
        self._lock = threading.Lock()

    def isend(
        self, dst: int, tag: int, arrays: Sequence[Any] = (), meta: Mapping[str, Any] | None = None
    ) -> Handle[None]:
        """Sends to group rank ``dst``."""
        self._check_peer(dst)
        return self.inner.isend(self.ranks[dst], tag, arrays, meta)

    def irecv(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle[Message]:
        """Receives from group rank ``src`` (``ANY_SOURCE`` is not supported: it could match a non-member)."""
        if src == ANY_SOURCE:
            raise ValueError("a group view receives from a named member only, not from ANY_SOURCE")
        self._check_peer(src)
        inner_handle = self.inner.irecv(self.ranks[src], tag)
        outer: Handle[Message] = Handle()
        with self._lock:
            self._outer_to_inner[id(outer)] = inner_handle

        def translate(h: Handle[Message]) -> None:
            with self._lock:
                self._outer_to_inner.pop(id(outer), None)
            error = h.exception()
            if error is not None:
                outer.set_error(error)
                return
            msg = h.wait(0)
            outer.set_result(Message(src=src, tag=msg.tag, meta=msg.meta, arrays=msg.arrays, dtypes=msg.dtypes))

        inner_handle.add_done_callback(translate)
        return outer

    def cancel_recv(self, handle: Handle[Message]) -> bool:
        """Withdraws a posted receive."""
        with self._lock:
            inner_handle = self._outer_to_inner.pop(id(handle), None)
        return inner_handle is not None and self.inner.cancel_recv(inner_handle)

    def lost_peers(self) -> frozenset[int]:
        """Group ranks whose process is gone."""
        return frozenset(self._index[g] for g in self.inner.lost_peers() if g in self._index)

    def departed_peers(self) -> frozenset[int]:
        """Group ranks whose process shut down cleanly."""
        return frozenset(self._index[g] for g in self.inner.departed_peers() if g in self._index)

    def close(self) -> None:
        """A view owns nothing: closing it leaves ``inner`` open."""

    def abort(self, reason: BaseException | None = None) -> None:
        """A view owns nothing: aborting it leaves ``inner`` alone."""
