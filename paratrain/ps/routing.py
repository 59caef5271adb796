"""Where a worker's requests go: each chunk's owner now, another replica when a server dies, fences at restarts.

A :class:`Router` is a worker's link to the job's servers (the transport ranks it is given). It sends requests,
one or a plan's batch (:mod:`.plans`) per message, and matches each answer by its request id (:mod:`.protocol`).
With ``replicas=R`` a chunk's owner is its first live replica, servers that restarted last: a batch whose server
dies is sent again, its requests regrouped by their chunks' next live replicas (a push with the same sequence
number, so the servers apply it once), and a restarted server is brought up to date by a *fence* this worker takes
part in the first time it sees the server back (:mod:`.resync`). With one replica a chunk's owner is its server,
and a lost server is an error at once: there is nowhere else to go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from paratrain.errors import CommTimeoutError, ConfigError, PeerLostError, TransportClosedError
from paratrain.plan.ir import Action
from paratrain.ps.plans import batches, pull_actions, push_actions
from paratrain.ps.protocol import CATCHING_UP, MAX_BATCH, MOVED, REQUEST_TAG, PSRequestError, pack, reply_tag, unpack
from paratrain.ps.sharding import Chunk
from paratrain.transport.base import Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["Route", "Router", "split_batch"]

log = logging.getLogger("paratrain.ps.client")

#: Seconds between looks for a restarted server while a replicated worker waits for an answer.
_REJOIN_POLL_S = 0.05


class Poller(Protocol):
    """What a worker's requests look at before a call and while they wait (:class:`~.resizer.Resizer`)."""

    def poll(self) -> None: ...


#: This worker's side of a push and of a pull of a key (:mod:`.plans`), for one owner map.
Route = tuple[tuple[Action, ...], tuple[Action, ...]]

#: A request sent with failover: its chunk, meta and arrays, and the handle its answer completes.
_Entry = tuple[Chunk, dict[str, Any], Sequence[Any], Handle[Message]]


def split_batch(batch: Handle[Message], *, parts: list[Handle[Message]], worker: int) -> None:
    """Completes each request's handle with its own reply from a batch's answer (:mod:`.protocol`); a batch of
    one request is that request (its answer is the reply)."""
    error = batch.exception()
    if error is None and len(parts) == 1:
        parts[0].set_result(batch.wait(0))
        return
    if error is None:
        msg = batch.wait(0)
        if msg.meta.get("error") is not None:  # the batch itself was refused: so is each request in it
            for part in parts:
                part.set_result(msg)
            return
        try:
            replies = unpack(msg, "replies")
            if len(replies) != len(parts):
                raise ValueError(f"{len(replies)} replies to {len(parts)} requests")
        except ValueError as exc:
            error = PSRequestError(f"worker {worker}: server rank {msg.src} answered a batch malformedly: {exc}")
        else:
            for part, reply in zip(parts, replies, strict=True):
                part.set_result(reply)
            return
    for part in parts:
        part.set_error(error)


class _PushHandle(Handle[None]):
    """A replicated push's handle whose first wait before it is done calls ``flush`` (:meth:`Router.push_handle`)."""

    __slots__ = ("_flush",)

    def __init__(self, flush: Callable[[], None]) -> None:
        super().__init__()
        self._flush: Callable[[], None] | None = flush

    def wait(self, timeout: float | None = None) -> None:
        flush, self._flush = self._flush, None
        if flush is not None and not self.done():
            flush()
        return super().wait(timeout)


class Router:
    """A worker's requests to the servers ``servers`` (transport ranks, in server order), with failover over
    ``replicas`` copies of each chunk. Thread-safe for sending; the rest is the worker's thread's.

    Attributes:
        clock: the worker's clock (what its fences and replicated pushes say).
        calls: the worker's public calls so far (a fence asked to wait is tried again at the next one).
        min_done: the slowest worker's clock, as the servers' last answers said.
        failovers: requests sent again to another replica after their server died.
        resyncs: restarted servers this worker fenced for (each caught up and is a backup again).
        fences: each fence: when this worker saw the server back (``time.time()``) and how long it paused
            (pushes drained, then the server's catch-up), in seconds.
        replacing: this worker replaces a dead one (:mod:`.rejoin`): its pushes say their clock.
    """

    def __init__(
        self, transport: Transport, *, rank: int, servers: Sequence[int], replicas: int, timeout: float
    ) -> None:
        self.transport = transport
        self.rank = rank
        self.servers = list(servers)
        self._server_set = frozenset(self.servers)
        self.replicas = replicas
        self.timeout = timeout
        self.clock = 0
        self.calls = 0
        self.min_done = 0
        self.closed = False
        self.failovers = 0
        self.resyncs = 0
        self.fences: list[tuple[float, float]] = []
        self.replacing = False
        self._next_seq = 0  # push sequence numbers: servers apply each (worker, seq) once
        # replicated pushes not yet seen acknowledged, as (their first sequence number, handle): the clock tells the
        # servers the lowest of them, below which they may forget the sequence numbers they applied
        self.unacked: list[tuple[int, Handle[None]]] = []
        # server rank -> how many of this clock's pushes it must hold before it counts the clock (replicated)
        self.expect: dict[int, int] = {}
        self._dead: set[int] = set()  # server ranks seen lost
        # restarted servers (.resync): each server's incarnation as last brought up to date (or seen dead), and
        # those that rejoined, in order: they own a chunk only when every replica that never died is gone
        self._known: dict[int, int] = self._server_incarnations()
        self._fenced: dict[int, int] = {}  # server rank -> the incarnation this worker fenced last
        self._demoted: list[int] = []
        # servers to fence whatever their incarnation says (a replacement's: restarted before it connected, .rejoin)
        self.must_fence: set[int] = set()
        self._fencing = False
        self._retry_at = -1  # the call in which a restarted server asked this worker to fence again later
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # a resizable job (.resize): the worker's side of resizes, the pushes not yet answered (a fence waits for
        # them), and the chunk a request for a moved chunk goes to now (from its meta: key and chunk index)
        self.resizer: Poller | None = None
        self.outstanding: list[Handle[None]] = []
        self.rehome: Callable[[dict[str, Any]], Chunk] | None = None
        self.rehomed = 0  # requests sent again because their chunk moved

    def _server_incarnations(self) -> dict[int, int]:
        """The servers' incarnations (a worker restarted in the same job is no server to fence)."""
        return {peer: n for peer, n in self.transport.incarnations().items() if peer in self._server_set}

    def resume_numbering(self, seq: int) -> None:
        """A replacement numbers its pushes from ``seq`` on (its incarnation's numbers, ``ServerStore.stale``)."""
        self._next_seq = max(self._next_seq, seq)

    def begin(self) -> None:
        """A public call of the worker starts: counted, and a resize whose notice came is fenced for first."""
        self.calls += 1
        if self.resizer is not None:
            self.resizer.poll()

    # -- requests ------------------------------------------------------------------------------------------

    def request(self, server: int, meta: dict[str, Any], arrays: Sequence[Any] = ()) -> tuple[Handle[Message], int]:
        """Sends one request; the handle of its answer, and ``server``. Non-blocking."""
        if self.closed:
            raise ConfigError("this KVStore was closed; create a new one (join=True) to come back")
        with self._lock:
            request_id = next(self._ids)
        handle = self.transport.irecv(server, reply_tag(request_id))
        try:
            self.transport.isend(server, REQUEST_TAG, arrays, {**meta, "id": request_id})
        except PeerLostError:
            self.transport.cancel_recv(handle)
            raise
        return handle, server

    def _request_batch(self, server: int, items: Sequence[tuple[dict[str, Any], Sequence[Any]]]) -> Handle[Message]:
        """Requests to one server in one message each way (:mod:`.protocol` says why): the handle of the batch's
        answer (of the request itself when there is one), for :func:`split_batch`."""
        if len(items) == 1:
            return self.request(server, *items[0])[0]
        assert len(items) <= MAX_BATCH  # the plan cuts batches (paratrain.ps.plans.batches)
        with self._lock:
            ids = [next(self._ids) for _ in items]
        ops, arrays = pack([({**meta, "id": i}, arrs) for (meta, arrs), i in zip(items, ids, strict=True)])
        return self.request(server, {"op": "batch", "ops": ops}, arrays)[0]

    def send(
        self, server: int, items: Sequence[tuple[Chunk, dict[str, Any], Sequence[Any]]], row_bytes: int
    ) -> list[Handle[Message]]:
        """Sends one batch of a plan, the requests ``(chunk, meta, arrays)`` to ``server``, their chunks' owner;
        a handle per request, completed with its own reply. Non-blocking. Replicated, should the server die
        before it answers, the requests go on to their chunks' next live replicas (and the handles complete with
        their answers, or the error of their last replica)."""
        if self.replicas == 1:
            batch = self._request_batch(server, [(meta, arrays) for _, meta, arrays in items])
            if len(items) == 1:
                return [batch]
            parts: list[Handle[Message]] = [Handle() for _ in items]
            batch.add_done_callback(functools.partial(split_batch, parts=parts, worker=self.rank))
            return parts
        entries: list[_Entry] = [(chunk, meta, arrays, Handle()) for chunk, meta, arrays in items]
        self._send_batch(server, entries, row_bytes)
        return [entry[3] for entry in entries]

    def send_each(
        self, items: Sequence[tuple[Chunk, dict[str, Any], Sequence[Any]]], row_bytes: int
    ) -> list[tuple[Handle[Message], int]]:
        """Sends each request ``(chunk, meta, arrays)`` to its chunk's owner (row requests, outside the plans):
        one message each, or, replicated, batched per owner as the plans batch a server's chunks, with failover.
        A handle per request and the server it went to first (-1 replicated). Non-blocking."""
        if self.replicas == 1:
            return [self.request(self.servers[c.server], meta, arrays) for c, meta, arrays in items]
        entries: list[_Entry] = [(chunk, meta, arrays, Handle()) for chunk, meta, arrays in items]
        self._dispatch(entries, row_bytes)
        return [(entry[3], -1) for entry in entries]

    def stamp(self, chunk: Chunk) -> dict[str, Any]:
        """The fields a push to ``chunk`` carries for its replicas: a new sequence number, counted for every replica
        of the chunk (each must hold this push before it counts this worker's next clock), and the clock it was
        made in. With one replica: the clock of a rejoined worker's push (a server may have its predecessor's)."""
        if self.replicas == 1:
            return {"wclock": self.clock} if self.replacing else {}
        seq = self._next_seq
        self._next_seq += 1
        for index in chunk.replicas:
            server = self.servers[index]
            self.expect[server] = self.expect.get(server, 0) + 1
        return {"seq": seq, "wclock": self.clock}

    def pushed(self, count: int, handle: Handle[None]) -> None:
        """Records a push of ``count`` requests, stamped last: its clock tells the servers when it is acknowledged
        (replicated); a resize's fence waits for it (resizable)."""
        if self.replicas > 1:
            self.unacked.append((self._next_seq - count, handle))
        if self.resizer is not None:
            self.outstanding = [h for h in self.outstanding if not h.done()]
            self.outstanding.append(handle)

    def clock_fields(self) -> tuple[dict[int, dict[str, Any]], BaseException | None]:
        """Replicated: what this worker's next clock tells each server (every push numbered below ``acked`` is
        acknowledged, never sent again; ``expect``: how many of this clock's pushes the server must hold before
        it counts the clock), and the error of a push answered since, raised once the clock is sent."""
        if self.replicas == 1:
            return {}, None
        rejected: BaseException | None = None
        still: list[tuple[int, Handle[None]]] = []
        for first, push in self.unacked:
            if not push.done():
                still.append((first, push))
            elif rejected is None:
                rejected = push.exception()  # raised once the clock is sent: the servers count it anyway
        self.unacked = still
        acked = min((first for first, _ in still), default=self._next_seq)
        expect, self.expect = self.expect, {}
        return {s: {"acked": acked, "expect": expect.get(s, 0)} for s in self.servers}, rejected

    def create(self, items: Sequence[tuple[Chunk, dict[str, Any], Sequence[Any]]], what: str) -> None:
        """Sends each request ``(chunk, meta, arrays)`` to every live replica of its chunk and waits for their
        answers. Blocks. Replicated, a replica that dies meanwhile is left out (the others hold the chunk).

        Raises:
            PeerLostError: every replica of a chunk is gone (or, with one replica, its server).
        """
        pending = []
        for chunk, meta, arrays in items:
            for server in (self.servers[r] for r in chunk.replicas):
                if self.replicas == 1 or self.live(server):
                    try:
                        pending.append((*self.request(server, meta, arrays), meta, arrays))
                    except PeerLostError as exc:  # died since live() looked: as below
                        self.lost(exc, server)
        for handle, server, meta, arrays in pending:
            try:
                if self.wait(handle, server, what).meta.get(MOVED) is True:  # (a resize: one replica)
                    self.ask(self.moved_to(meta), meta, arrays, what)
            except PeerLostError as exc:  # a replica died: the others hold the chunk (else the next call says so)
                self.lost(exc, server)
        if self.replicas > 1:
            for chunk, _, _ in items:
                self.owner(chunk)  # raises if every replica of a chunk is gone

    def wait_clock(self, required: int | None, what: str) -> None:
        """Waits until the slowest worker completed clock ``required``, as a live server tells. Blocks."""
        while True:
            live = [s for s in self.servers if self.live(s)]
            if not live:
                raise PeerLostError(f"worker {self.rank}: every server is gone", peer=self.servers[-1])
            server = live[self.rank % len(live)]
            try:
                handle, _ = self.request(server, {"op": "wait_clock", "required": required})
                self.wait(handle, server, what)
                break
            except PeerLostError as exc:
                self.lost(exc, server)

    def leave(self) -> None:
        """Tells every server that this worker leaves, then sends nothing more. Blocks for their answers."""
        pending = []
        for server in self.servers:
            rejoined = self.replicas > 1 and self.rejoined(server)
            if not self.live(server) and not (rejoined and server not in self.transport.lost_peers()):
                continue  # (a restarted server not yet fenced waits for this worker: it is told it left)
            try:
                pending.append(self.request(server, {"op": "leave"}))
            except PeerLostError as exc:
                self.lost(exc, server)
        self.closed = True
        for handle, server in pending:
            try:
                self.wait(handle, server, "leave")
            except PeerLostError as exc:
                self.lost(exc, server)

    def push_handle(self, consistency: str) -> Handle[None]:
        """The handle of a push. Replicated under BSP/SSP a push is acknowledged once a state of its chunk that
        holds it reached every replica, which its owner sends when the push's round is complete: waiting for it
        before this worker's clock completes that round would wait forever, so such a wait first asks the owners
        to send their states now (``flush``)."""
        if self.replicas == 1 or consistency == "asp":
            return Handle()
        clock = self.clock

        def flush() -> None:
            if self.clock != clock or self.closed:
                return
            for server in self.servers:
                if self.live(server):
                    with contextlib.suppress(PeerLostError, TransportClosedError):
                        self.transport.isend(server, REQUEST_TAG, (), {"op": "flush", "id": -1})

        return _PushHandle(flush)

    # -- owners and failover -------------------------------------------------------------------------------

    def route(
        self, chunks: Sequence[Chunk], row_bytes: int, routes: dict[tuple[int, ...], Route]
    ) -> tuple[Route, list[tuple[Chunk, Handle[Message]]]]:
        """This worker's side of a push and a pull of a key's ``chunks`` to their owners now (:mod:`.plans`;
        with every primary alive, the key's plan), kept in ``routes`` by owner map, and a failed handle for each
        chunk whose every replica is gone."""
        owners: list[int] = []
        orphans: list[tuple[Chunk, Handle[Message]]] = []
        for c in chunks:
            try:
                owners.append(self.owner_index(c))
            except PeerLostError as exc:
                owners.append(-1)
                orphan: Handle[Message] = Handle()
                orphan.set_error(exc)
                orphans.append((c, orphan))
        route = routes.get(owners_key := tuple(owners))
        if route is None:
            owned = [dataclasses.replace(c, server=s) for c, s in zip(chunks, owners, strict=True) if s >= 0]
            route = routes[owners_key] = (
                push_actions(owned, row_bytes, self.servers),
                pull_actions(owned, row_bytes, self.servers),
            )
        return route, orphans

    def members(self) -> list[int]:
        """The servers a clock goes to: every one, replicated the live ones."""
        return self.servers if self.replicas == 1 else [s for s in self.servers if self.live(s)]

    def owner_index(self, chunk: Chunk) -> int:
        """The server index of the chunk's owner now (its server, with one replica); raises when every replica
        of the chunk is gone."""
        if self.replicas == 1:
            return chunk.server
        return self.servers.index(self.owner(chunk))

    def live(self, server: int) -> bool:
        if server in self._dead:
            return False
        if server in self.transport.lost_peers() or self.rejoined(server):
            self._dead.add(server)  # a restarted server is dead to this worker until it fenced it
            return False
        return True

    def rejoined(self, server: int) -> bool:
        """Whether ``server`` came back as a new process since this worker last brought it up to date."""
        return self.transport.incarnations().get(server, 0) != self._known.get(server, 0)

    def owner(self, chunk: Chunk) -> int:
        """The transport rank of the chunk's first live replica (its owner now), servers that rejoined last."""
        order = [self.servers[index] for index in chunk.replicas]
        if self._demoted:
            order = [s for s in order if s not in self._demoted] + [s for s in self._demoted if s in order]
        for server in order:
            if self.live(server):
                return server
        raise PeerLostError(
            f"worker {self.rank}: every replica of chunk {chunk.index} (servers {list(chunk.replicas)}) is gone; "
            "the job cannot go on: restart it (with more replicas to survive more failures)",
            peer=self.servers[chunk.replicas[-1]],
        )

    def lost(self, exc: PeerLostError, server: int) -> None:
        """Records that ``server`` died; re-raises when requests have nowhere else to go.

        The error may be an earlier process's of that rank, surfacing only now: a request in flight when the old
        process died can fail after this worker already fenced the restarted one (:meth:`wait` fences before it
        looks at the request again). The restarted process is alive then (the transport does not count the rank
        lost) and fenced: it stays live here, or this worker would never send it another clock and every worker
        waiting for a clock on it would wait until its timeout."""
        if self.replicas == 1:
            raise exc
        self.failovers += 1
        if not self._fenced_since(server):
            self._dead.add(server)
        # else: the request is sent again (to the chunk's owner now); the restarted server serves on

    def _fenced_since(self, server: int) -> bool:
        """Whether this worker fenced ``server``'s process now running and still counts it live: an error or a
        refusal of that rank that arrives now belongs to an earlier process (or to before the fence). Recorded
        per fence, not read off the incarnation: a replacement that connected after the server's restart sees
        incarnation 0, and took a stale refusal for a live server's (it never sent it a clock again: a stall)."""
        return (
            self._fenced.get(server) == self.transport.incarnations().get(server, 0)
            and server not in self._dead
            and server not in self.transport.lost_peers()
        )

    def _not_fenced_yet(self, server: int, what: str, answer: Message) -> PeerLostError:
        """``server`` refused a request because it is a restarted process still catching up (:mod:`.resync`):
        this worker sent it before it saw the restart (the transport had the new process's connection already,
        not yet counted as a new incarnation here). It is dead to this worker until it fenced it, as after a
        death, and fenced at the next call even where its incarnation looks known (a process that connected after
        the restart counts it as the first); the error, for :meth:`lost` and the callers that send the request to
        another replica. A refusal read only after this worker fenced that server (a wait fences first) is stale:
        the server stays live."""
        if not self._fenced_since(server):
            self._dead.add(server)
            self.must_fence.add(server)
        return PeerLostError(f"worker {self.rank}: {what} not served: {answer.meta.get('error')}", peer=server)

    def _dispatch(self, entries: Sequence[_Entry], row_bytes: int) -> None:
        """Sends ``entries`` to their chunks' owners now, in batches as the plans cut a server's chunks
        (:func:`~paratrain.ps.plans.batches`: with every primary alive, the same messages as unreplicated)."""
        owned: list[Chunk] = []
        by_index: dict[int, _Entry] = {}
        for entry in entries:
            try:
                owner = self.owner(entry[0])
            except PeerLostError as exc:
                entry[3].set_error(exc)
                continue
            owned.append(dataclasses.replace(entry[0], server=self.servers.index(owner)))
            by_index[entry[0].index] = entry
        for batch in batches(owned, row_bytes):
            self._send_batch(self.servers[batch[0].server], [by_index[c.index] for c in batch], row_bytes)

    def _send_batch(self, server: int, entries: list[_Entry], row_bytes: int) -> None:
        try:
            handle = self._request_batch(server, [(meta, arrays) for _, meta, arrays, _ in entries])
        except PeerLostError as exc:
            self.lost(exc, server)
            self._dispatch(entries, row_bytes)
            return
        except BaseException as exc:
            for entry in entries:
                entry[3].set_error(exc)
            return
        handle.add_done_callback(
            functools.partial(self._batch_answered, server=server, entries=entries, row_bytes=row_bytes)
        )

    def _batch_answered(self, handle: Handle[Message], *, server: int, entries: list[_Entry], row_bytes: int) -> None:
        exc = handle.exception()
        if isinstance(exc, PeerLostError) and not self.closed:
            self.lost(exc, server)
            self._dispatch(entries, row_bytes)
        elif exc is None and handle.wait(0).meta.get(CATCHING_UP) is True and not self.closed:
            self.lost(self._not_fenced_yet(server, "a batch", handle.wait(0)), server)
            self._dispatch(entries, row_bytes)
        else:
            split_batch(handle, parts=[entry[3] for entry in entries], worker=self.rank)

    def ask(self, chunk: Chunk, meta: dict[str, Any], arrays: Sequence[Any], what: str) -> Message:
        """A blocking request to the chunk's owner, sent again to the next replica if that server dies, or to the
        chunk's server now if it moved (:mod:`.resize`)."""
        while True:
            server = self.owner(chunk)
            try:
                handle, _ = self.request(server, meta, arrays)
                answer = self.wait(handle, server, what)
            except PeerLostError as exc:
                self.lost(exc, server)
                continue
            if answer.meta.get(MOVED) is not True:
                return answer
            chunk = self.moved_to(meta)

    def moved_to(self, meta: dict[str, Any]) -> Chunk:
        """The chunk a request for a chunk that moved goes to now (this worker fenced before anything moved)."""
        if self.rehome is None:
            raise PSRequestError(f"worker {self.rank}: a server says key {meta.get('key')!r} moved; nothing resizes")
        self.rehomed += 1
        return self.rehome(meta)

    def wait(self, handle: Handle[Message], server: int, what: str) -> Message:
        """The answer of a request (blocks up to the timeout), its error raised; notes the slowest clock."""
        try:
            msg = self._await(handle)
        except CommTimeoutError:
            # (a request of a batch has no receive of its own to cancel: it is not done either)
            if self.transport.cancel_recv(handle) or not handle.done():
                raise CommTimeoutError(
                    f"worker {self.rank}: no answer to {what} from server rank {server} within {self.timeout:g}s; "
                    "under BSP/SSP a pull waits for the slowest worker: is one stuck, or is the timeout too short?"
                ) from None
            msg = handle.wait(0)
        error = msg.meta.get("error")
        if msg.meta.get(CATCHING_UP) is True and self.replicas > 1:
            raise self._not_fenced_yet(server, what, msg)  # the callers send it to another replica
        if error is not None:
            raise PSRequestError(f"worker {self.rank}: {what} rejected: {error}")
        done = msg.meta.get("done")
        if isinstance(done, int) and done > self.min_done:
            self.min_done = done
        return msg

    def _await(self, handle: Handle[Message]) -> Message:
        """``handle.wait(self.timeout)``; replicated, it fences any server that rejoins meanwhile, since the
        answer may wait on another worker that waits on that fence (:mod:`.resync`)."""
        if (self.replicas == 1 and self.resizer is None) or self._fencing:
            return handle.wait(self.timeout)
        deadline = time.monotonic() + self.timeout
        while True:
            self.fence_rejoined()
            if self.resizer is not None:
                self.resizer.poll()
            remaining = deadline - time.monotonic()
            try:
                return handle.wait(max(0.0, min(_REJOIN_POLL_S, remaining)))
            except CommTimeoutError:
                if remaining <= _REJOIN_POLL_S:
                    raise

    # -- restarted servers (.resync) -----------------------------------------------------------------------

    def fence_rejoined(self) -> None:
        """Fences every server that came back as a new process since this worker last looked (:mod:`.resync`):
        waits until its own pushes are acknowledged, tells the server the clock it is at and how many of this
        clock's pushes the server's chunks already hold, and waits until the server has caught up. A server that
        dies again, or gives up, stays dead until it comes back once more."""
        incarnations = self._server_incarnations()
        if self.replicas == 1 or self._fencing or (incarnations == self._known and not self.must_fence) or self.closed:
            return
        if self._retry_at == self.calls:
            return  # released from a fence in this call: the others may wait for it to return (a collective)
        self._fencing = True
        try:
            pending = {s for s, n in incarnations.items() if self._known.get(s, 0) != n} | self.must_fence
            for server in sorted(pending):
                incarnation = incarnations.get(server, 0)
                self._dead.add(server)
                if server in self.transport.lost_peers() or self._fence(server):
                    self._known[server] = incarnation
                    self._fenced[server] = incarnation
                    self.must_fence.discard(server)
        finally:
            self._fencing = False

    def _fence(self, server: int) -> bool:
        """One fence of ``server`` (see :meth:`fence_rejoined`); False when the server asks to fence again."""
        seen, started = time.time(), time.monotonic()
        for _, push in self.unacked:  # every push applied by every live replica: the donors' copies have it
            with contextlib.suppress(Exception):  # its error is reported by clock(), as without a fence
                push.wait(self.timeout)
        live = [s for s in self.servers if s != server and self.live(s)]
        meta = {"op": "fence", "clock": self.clock, "held": self.expect.get(server, 0), "servers": live}
        try:
            handle, _ = self.request(server, meta)
            answer = self.wait(handle, server, f"fence of restarted server rank {server}")
        except (PeerLostError, PSRequestError) as exc:
            log.warning("worker %d: restarted server rank %d did not catch up: %s", self.rank, server, exc)
            return True
        if answer.meta.get("retry"):
            self._retry_at = self.calls
            return False  # a round of fences the server gave up on: fence again at the next call
        self._dead.discard(server)
        if server in self._demoted:
            self._demoted.remove(server)
        self._demoted.append(server)
        self.resyncs += 1
        self.fences.append((seen, time.monotonic() - started))
        log.info("worker %d: server rank %d caught up after its restart; it is a backup again", self.rank, server)
        return True
