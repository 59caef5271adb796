"""A live server's side of a restarted server's catch-up (:mod:`.resync`): who takes part, and the snapshot.

A restarted server asks its donors which workers take part (``members``), then, once every one of them stands at
its fence, for a ``snapshot`` at the fences: a donor sends it once it has counted every fenced worker's clock up to
its fence, so every donor sends the same state. Until a donor has sent its copy it counts the newcomer as lost
(:meth:`~.replication.Replication.check_servers`), so nothing is forwarded to it early; from then on it is a backup
again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from paratrain.errors import CommTimeoutError, PeerLostError, TransportClosedError
from paratrain.ps.protocol import reply_tag
from paratrain.ps.resync import chunk_message
from paratrain.ps.store import RejectedError, ServerStore
from paratrain.transport.wire import Message

__all__ = ["Donor"]

log = logging.getLogger("paratrain.ps.server")


class Donor:
    """Answers restarted servers' ``members`` and ``snapshot`` requests from ``store``; ``check_lost`` is the
    server's look for lost peers (a restart counts as a loss first: nothing was forwarded to the newcomer since)."""

    def __init__(self, store: ServerStore, check_lost: Callable[[], None]) -> None:
        self.store = store
        self._check_lost = check_lost
        # copies asked for, not yet sent: (server, request id, its fences as (worker, clock))
        self.snapshots: list[tuple[int, int, list[tuple[int, int]]]] = []

    def handlers(self) -> dict[str, Callable[[Message], None]]:
        """The operations a restarted server sends, by name."""
        return {"members": self._op_members, "snapshot": self._op_snapshot}

    def _op_members(self, msg: Message) -> None:
        """A restarted server asks which workers take part (to know whose fences to wait for)."""
        self._check_lost()
        self.store.reply(msg.src, msg.meta["id"], live=sorted(self.store.live))

    def _op_snapshot(self, msg: Message) -> None:
        """A restarted server asks for its chunks as they stand at the workers' fences: sent once this server
        has counted every fenced worker's clock up to its fence (:meth:`send_snapshots`)."""
        fences = msg.meta.get("fences")
        if not isinstance(fences, list) or not all(
            isinstance(f, list) and len(f) == 2 and all(type(x) is int for x in f) for f in fences
        ):
            raise RejectedError("snapshot without valid fences")
        self._check_lost()  # its rejoin counts as a loss here first: nothing was forwarded to it since
        self.snapshots.append((msg.src, msg.meta["id"], [(int(w), int(c)) for w, c in fences]))
        self.send_snapshots()

    def send_snapshots(self) -> None:
        """Sends every snapshot asked for whose fences this server's clocks have reached."""
        store = self.store
        still = []
        for server, request_id, fences in self.snapshots:
            if all(w not in store.live or store.done[w] >= c for w, c in fences if w in store.done):
                self._send_snapshot(server, request_id)
            else:
                still.append((server, request_id, fences))
        self.snapshots = still

    def _send_snapshot(self, server: int, request_id: int) -> None:
        """Sends ``server`` every chunk it replicates, then the clocks; from now on it gets forwarded pushes."""
        store = self.store
        tag = reply_tag(request_id)
        handles = []
        try:
            for (key, index), chunk in store.chunks.items():
                if server in chunk.replicas:
                    meta, arrays = chunk_message(key, index, chunk)
                    handles.append(store.transport.isend(server, tag, arrays, meta))
            end = {"part": "end", "done": [[w, d] for w, d in sorted(store.done.items())], "min_done": store.min_done}
            handles.append(store.transport.isend(server, tag, (), end))
            for handle in handles:  # the arrays go zero-copy and are modified by the next push: wait for them
                handle.wait(store.timeout)
        except (PeerLostError, TransportClosedError, CommTimeoutError) as exc:
            log.warning("server %d: restarted server %d did not take its copy: %s", store.transport.rank, server, exc)
            return
        store.servers_lost.discard(server)
        store.stats.snapshots_sent += 1
        log.info("server %d: sent restarted server %d its copy; it is a backup again", store.transport.rank, server)
