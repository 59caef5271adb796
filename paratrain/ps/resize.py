"""Servers joining and leaving a running job: the servers' side of moving chunks while the workers train.

A resizable job (``KVStore(active_servers=S)``) starts more server processes than hold keys: the others stand by,
counting every worker's clock. ``kv.add_server(t)`` gives server t its share of the keys, ``kv.remove_server(t)``
hands t's chunks to the others (:mod:`.membership` says which chunks move where: ``1/(S + 1)`` of them for an
add). The first server (``servers[0]``, the *coordinator*) runs every resize, one at a time:

1. It sends every live worker a notice (:data:`~.protocol.RESIZE_TAG`). Each worker sees it at its next
   parameter-server call, or while it waits on one; it waits until every push it made is answered (so applied),
   and sends the coordinator a ``resize_fence`` with the clock it reached. It then waits, pushing nothing.
2. Once every live worker fenced, the coordinator asks each server that gives chunks away (every active server
   for an add, the leaving one for a remove) to ``migrate``. A donor waits until it has counted every fenced
   worker's clock up to its fence: with every worker held there, its chunks then hold exactly the pushes made
   before the fences, which are all applied. It sends each moving chunk (value, optimizer state, open rounds,
   version) to its new server (``adopt``), waits for each to be installed, drops its copy, answers the requests
   for those chunks still waiting here (deferred pulls, inits) with :data:`~.protocol.MOVED`, and tells the
   coordinator (``migrated``).
3. The coordinator answers every fence with the new set of active servers; the workers re-plan their keys and go
   on. A request for a moved chunk that reaches its old server later is answered :data:`~.protocol.MOVED` too, and
   sent again to the chunk's server now.

The receiving server needs no clocks from the donor: every server, active or standing by, counts every worker's
clock, so all of them agree on where each worker stands once the fenced workers' clocks arrived (a worker's clock
reaches a server before anything it sends after its fence, on the same link). A worker can also wait on another
outside the parameter server (a collective) while that one stands at its fence, so fences come in rounds, as a
restarted server's do (:mod:`.resync`): a round that is not complete within its window (0.1 s, doubled each time)
releases the fenced workers, which fence again at their next call.

Not covered: replicated chunks (``replicas > 1``) and jobs that restart workers; a resize is refused there.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paratrain.errors import CommTimeoutError, PeerLostError, TransportClosedError
from paratrain.ps.membership import ServerSet, moved_chunks
from paratrain.ps.protocol import REQUEST_TAG, RESIZE_TAG, reply_tag
from paratrain.ps.resync import CatchUpError, chunk_message, read_chunk
from paratrain.ps.store import RejectedError, ServerStore
from paratrain.transport.wire import Message

__all__ = ["FIRST_WINDOW_S", "Resizing"]

log = logging.getLogger("paratrain.ps.server")

#: Seconds a round of resize fences may take, from its first fence to its last; each retry doubles it.
FIRST_WINDOW_S = 0.1


@dataclass
class _Resize:
    """The coordinator's resize in progress."""

    before: ServerSet
    after: ServerSet
    requester: tuple[int, int]  # (worker, request id) of the add_server/remove_server call
    started: float
    window: float = FIRST_WINDOW_S
    fences: dict[int, tuple[int, int]] = field(default_factory=dict)  # worker -> (its clock, fence request id)
    opened: float | None = None  # when this round's first fence came
    rounds: int = 1
    migrating: set[int] = field(default_factory=set)  # donors (server ranks) not yet done
    moved: int = 0
    moved_bytes: int = 0
    error: str | None = None  # a donor's failure


@dataclass
class _Migration:
    """A donor's migration, asked for by the coordinator: done once every fenced worker's clock is counted."""

    coordinator: int
    before: ServerSet
    after: ServerSet
    fences: list[tuple[int, int]]


class Resizing:
    """The resize protocol of one server over ``store`` (see the module docstring); ``advance`` is the server's
    recount of clocks and deferred requests, ``refusal`` says why this job cannot resize (None: it can)."""

    def __init__(self, store: ServerStore, advance: Callable[[], None], refusal: Callable[[], str | None]) -> None:
        self.store = store
        self._advance = advance
        self._refusal = refusal
        self.servers: ServerSet | None = None  # the coordinator's current set (told by the first resize)
        self.resizes = 0  # resizes this server coordinated
        self.current: _Resize | None = None
        self.pending: list[_Migration] = []
        self._ids = itertools.count(1 << 40)  # adopt requests: apart from the ids of every worker's requests

    def handlers(self) -> dict[str, Callable[[Message], None]]:
        """The operations of the protocol, by name."""
        return {
            "resize": self._op_resize,
            "resize_fence": self._op_resize_fence,
            "migrate": self._op_migrate,
            "migrated": self._op_migrated,
            "adopt": self._op_adopt,
        }

    @property
    def _coordinator(self) -> bool:
        return self.store.transport.rank == self.store.servers[0]

    # -- the coordinator -----------------------------------------------------------------------------------

    def _op_resize(self, msg: Message) -> None:
        """A worker's ``add_server``/``remove_server``: starts the resize (answered once it is done)."""
        if not self._coordinator:
            raise RejectedError(f"resizes go to the first server (rank {self.store.servers[0]})")
        why = self._refusal()
        if why is not None:
            raise RejectedError(why)
        if self.current is not None:
            raise RejectedError("another resize is in progress: wait for it to end")
        meta = msg.meta
        slots, active, add, remove = meta.get("slots"), meta.get("active"), meta.get("add"), meta.get("remove")
        if type(slots) is not int or slots != len(self.store.servers):
            raise RejectedError(f"the job has {len(self.store.servers)} servers, the worker says {slots!r}")
        if not isinstance(active, list) or not all(type(s) is int for s in active):
            raise RejectedError("resize without the active servers")
        try:
            before = self.servers or ServerSet(slots, tuple(active))
            if list(before.active) != active:
                raise ValueError(f"the servers holding keys are {list(before.active)}, the worker says {active}")
            if type(add) is int:
                after = before.with_server(add)
            elif type(remove) is int:
                after = before.without(remove)
            else:
                raise ValueError("a resize adds or removes one server")
        except ValueError as exc:
            raise RejectedError(str(exc)) from None
        self.current = _Resize(before, after, (msg.src, meta["id"]), time.monotonic())
        log.info(
            "server %d: resizing the servers holding keys from %s to %s",
            self.store.transport.rank,
            list(before.active),
            list(after.active),
        )
        notice = {"epoch": after.epoch, "active": list(after.active)}
        for worker in sorted(self.store.live):
            try:
                self.store.transport.isend(worker, RESIZE_TAG, (), notice)
            except (PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: worker %d not told of the resize: %s", self.store.transport.rank, worker, exc)

    def _op_resize_fence(self, msg: Message) -> None:
        """A worker stands at its fence (it saw the notice; every push of it is applied)."""
        resize, clock = self.current, msg.meta.get("clock")
        if resize is None or msg.meta.get("epoch") != resize.after.epoch or type(clock) is not int:
            raise RejectedError("a resize fence of no resize in progress")
        if resize.opened is None:
            resize.opened = time.monotonic()
        resize.fences[msg.src] = (clock, msg.meta["id"])
        self.tick()

    def tick(self) -> None:
        """Moves the coordinator's resize on: migrates once every live worker fenced, retries a late round."""
        resize = self.current
        if resize is None or resize.migrating:
            return
        live = self.store.live
        if live and live <= set(resize.fences):
            self._migrate_all(resize)
            return
        if resize.opened is not None and time.monotonic() - resize.opened > resize.window:
            for worker, (_, request_id) in resize.fences.items():
                self.store.reply(worker, request_id, retry=True)
            resize.fences.clear()
            resize.opened = None
            resize.window *= 2
            resize.rounds += 1

    def timeout_s(self, poll: float) -> float:
        """How long the server's loop may wait for a message before :meth:`tick` must look again."""
        resize = self.current
        if resize is None or resize.opened is None or resize.migrating:
            return poll
        return max(0.0, min(poll, resize.opened + resize.window - time.monotonic()))

    def _migrate_all(self, resize: _Resize) -> None:
        fences = [[w, c] for w, (c, _) in sorted(resize.fences.items()) if w in self.store.live]
        removed = set(resize.before.active) - set(resize.after.active)
        donors = sorted(removed) if removed else list(resize.before.active)
        resize.migrating = {self.store.servers[s] for s in donors}
        meta = {
            "op": "migrate",
            "id": -1,
            "slots": resize.after.slots,
            "before": list(resize.before.active),
            "after": list(resize.after.active),
            "epoch": resize.after.epoch,
            "fences": fences,
        }
        me = self.store.transport.rank
        for donor in sorted(resize.migrating):
            if donor == me:
                self._op_migrate(Message(src=me, tag=REQUEST_TAG, meta=meta))
            else:
                self.store.transport.isend(donor, REQUEST_TAG, (), meta)

    def _op_migrated(self, msg: Message) -> None:
        """A donor moved its chunks away."""
        resize = self.current
        if resize is None or msg.src not in resize.migrating:
            raise RejectedError("a migration report of no resize in progress")
        resize.migrating.discard(msg.src)
        resize.moved += int(msg.meta.get("chunks", 0))
        resize.moved_bytes += int(msg.meta.get("bytes", 0))
        if isinstance(error := msg.meta.get("error"), str):
            resize.error = resize.error or error
        if resize.migrating:
            return
        self.current = None
        if resize.error is not None:
            why = f"server {self.store.transport.rank}: the resize failed, some chunks may be lost: {resize.error}"
            for worker, (_, request_id) in sorted(resize.fences.items()):
                self.store.reply(worker, request_id, error=why)
            self.store.reply(*resize.requester, error=why)
            return
        self.servers = resize.after
        self.resizes += 1
        seconds = time.monotonic() - resize.started
        epoch, active = resize.after.epoch, list(resize.after.active)
        for worker, (_, request_id) in sorted(resize.fences.items()):
            self.store.reply(worker, request_id, epoch=epoch, active=active)
        log.info(
            "server %d: servers holding keys now %s: %d chunk(s), %d bytes moved in %.3f s (%d round(s) of fences)",
            self.store.transport.rank,
            list(resize.after.active),
            resize.moved,
            resize.moved_bytes,
            seconds,
            resize.rounds,
        )
        worker, request_id = resize.requester
        self.store.reply(
            worker,
            request_id,
            epoch=epoch,
            active=active,
            chunks=resize.moved,
            bytes=resize.moved_bytes,
            seconds=seconds,
            rounds=resize.rounds,
        )

    # -- a donor -------------------------------------------------------------------------------------------

    def _op_migrate(self, msg: Message) -> None:
        meta = msg.meta
        if msg.src != self.store.servers[0]:
            raise RejectedError("migrations are asked for by the first server")
        slots, fences, epoch = meta.get("slots"), meta.get("fences"), meta.get("epoch")
        try:
            if type(slots) is not int or type(epoch) is not int:
                raise TypeError("slots and epoch are ints")
            before = ServerSet(slots, tuple(meta["before"]), epoch - 1)
            after = ServerSet(slots, tuple(meta["after"]), epoch)
        except (KeyError, TypeError, ValueError) as exc:
            raise RejectedError(f"malformed migration: {exc}") from None
        if not isinstance(fences, list) or not all(
            isinstance(f, list) and len(f) == 2 and all(type(x) is int for x in f) for f in fences
        ):
            raise RejectedError("migration without valid fences")
        self.pending.append(_Migration(msg.src, before, after, [(w, c) for w, c in fences]))
        self.migrate_ready()

    def migrate_ready(self) -> None:
        """Carries out every migration whose fences this server's clocks have reached."""
        store = self.store
        ready = [m for m in self.pending if all(w not in store.live or store.done.get(w, 0) >= c for w, c in m.fences)]
        self.pending = [m for m in self.pending if m not in ready]  # (a migration recounts clocks: no recursion)
        for migration in ready:
            self._migrate(migration)

    def _migrate(self, migration: _Migration) -> None:
        """Sends every chunk that leaves this server to its new one, drops it here, reports to the coordinator."""
        store = self.store
        me = store.transport.rank
        moves: dict[tuple[Any, int], int] = {}  # (key, chunk) -> the server rank it goes to
        by_key: dict[Any, dict[int, tuple[int, int]]] = {}
        for (key, index), chunk in store.chunks.items():
            if chunk.num_chunks <= 0:
                raise RejectedError(f"key {key!r} chunk {index} does not know its key's chunk count")
            if key not in by_key:
                by_key[key] = moved_chunks(key, chunk.num_chunks, migration.before, migration.after)
            if index in by_key[key]:
                moves[(key, index)] = store.servers[by_key[key][index][1]]
        handles = []
        for (key, index), dst in sorted(moves.items(), key=lambda kv: str(kv[0])):
            chunk = store.chunks[(key, index)]
            store.settle(chunk)
            meta, arrays = chunk_message(key, index, chunk)
            request_id = next(self._ids)
            reply = store.transport.irecv(dst, reply_tag(request_id))
            store.transport.isend(dst, REQUEST_TAG, arrays, {**meta, "op": "adopt", "id": request_id})
            handles.append((reply, dst, key, index))
        moved_bytes, failed = 0, None
        for reply, dst, key, index in handles:
            try:
                answer = reply.wait(store.timeout)
                error = answer.meta.get("error")
            except (CommTimeoutError, PeerLostError, TransportClosedError) as exc:
                error = str(exc)
            if error is not None:
                failed = failed or f"server rank {dst} did not take key {key!r} chunk {index}: {error}"
                continue
            chunk = store.chunks.pop((key, index))
            moved_bytes += chunk.value.nbytes
            if chunk.shared is not None:
                chunk.shared.unlink()
            store.moved.add((key, index))
        store.stats.chunks_given += len(handles)
        self._answer_moved(migration)
        log.info("server %d: moved %d chunk(s), %d bytes, to other servers", me, len(handles), moved_bytes)
        report: dict[str, Any] = {"op": "migrated", "id": -1, "chunks": len(handles), "bytes": moved_bytes}
        if failed is not None:
            report["error"] = failed
        if migration.coordinator == me:
            self._op_migrated(Message(src=me, tag=REQUEST_TAG, meta=report))
        else:
            store.transport.isend(migration.coordinator, REQUEST_TAG, (), report)

    def _answer_moved(self, migration: _Migration) -> None:
        """Answers the requests waiting here for chunks that are elsewhere now (deferred pulls, inits)."""
        store = self.store
        still = []
        for worker, meta, msg in store.waiting_pulls:
            if (meta.get("key"), meta.get("chunk")) in store.moved:
                store.reply(worker, meta["id"], moved=True)
            else:
                still.append((worker, meta, msg))
        store.waiting_pulls = still
        for (key, index), waiting in list(store.waiting_inits.items()):
            count = waiting[0][1].get("chunks") if waiting else None
            if type(count) is not int or not 0 <= index < count:
                continue
            if index in moved_chunks(key, count, migration.before, migration.after, [index]):
                del store.waiting_inits[(key, index)]
                for worker, meta in waiting:
                    store.reply(worker, meta["id"], moved=True)
        self._advance()

    # -- a receiver ----------------------------------------------------------------------------------------

    def _op_adopt(self, msg: Message) -> None:
        """A chunk that moves here from another server: installed, then acknowledged."""
        store = self.store
        request_id = msg.meta["id"]
        tag = reply_tag(request_id)
        try:
            (key, index), chunk = read_chunk(msg, servers=store.servers)
        except CatchUpError as exc:
            store.transport.isend(msg.src, tag, (), {"error": str(exc)})
            return
        if (key, index) in store.chunks:
            store.transport.isend(msg.src, tag, (), {"error": f"key {key!r} chunk {index} is here already"})
            return
        store.chunks[(key, index)] = chunk
        store.moved.discard((key, index))
        store.share(chunk)
        store.commit(chunk)
        store.stats.chunks_adopted += 1
        store.transport.isend(msg.src, tag, (), {"chunk": index})
