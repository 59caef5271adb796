"""One parameter-server process: stores its chunks of every key, applies pushes, answers pulls when allowed.

The server is a single-threaded event loop over the transport (no locks: one thread owns all state) that
dispatches each request to the protocol it belongs to: the workers' keys, pushes, pulls and clocks here, over
the chunks and clocks of a :class:`~.store.ServerStore`; replication to backups in :mod:`.replication`; a
restarted server's catch-up in :mod:`.donor` (the live side) and :mod:`.resync` (the restarted side). It
answers a pull only when the consistency rule the worker asked for holds — the worker sends the clock every
worker must have completed (``required``), and the server defers the answer until its slowest live worker
has (Petuum's SSP, with BSP as s = 0 and ASP as no requirement). Worker clocks arrive as ``clock`` messages
in order with that worker's pushes, so "worker w completed clock k" means "every push w made at clocks <= k
has been applied here".

Server-side update rules (``optimizer`` of the key): ``None`` adds the pushed array into the stored value; an
optimizer (SGD, Adam, Adagrad from :mod:`.optim`) treats pushes as gradients and applies them in *rounds*, one
optimizer step on the mean gradient of a round, in every consistency model (:mod:`.rounds` states the rule and
why): under BSP and SSP a round is a clock, applied when every live worker has completed it; under ASP a round
is every N pushes as they arrive, N the live workers.

Replicated, a worker sends its clock without waiting for its pushes' acknowledgements, with the number of that
clock's pushes this server must hold (``expect``: those whose chunk it replicates, direct, forwarded or noticed,
counted per (worker, clock)): until it holds them the clock and everything its worker sends after it wait in
``_queued`` (except a push of that clock sent again after its owner died, or a batch of them, which the clock may be
waiting for). So a backup that takes over a chunk knows which pushes its owner had and in which round, and a push
its owner never noticed holds back its worker's clock until it arrives.

Robustness: a malformed or invalid request is answered with an error and the loop goes on; a worker whose
process dies (its connection drops, or heartbeats stop) is removed from the clock bookkeeping and logged, so
the others are not blocked forever; the loop ends when no live worker is left.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from paratrain.errors import CommTimeoutError, PeerLostError, TransportClosedError
from paratrain.ps.consistency import min_done
from paratrain.ps.donor import Donor
from paratrain.ps.protocol import REQUEST_TAG, unpack
from paratrain.ps.rejoin import Rejoins
from paratrain.ps.replication import FORWARDS, Replication
from paratrain.ps.resize import Resizing
from paratrain.ps.resync import CaughtUp, StoredChunk, catch_up
from paratrain.ps.rounds import round_of_push
from paratrain.ps.store import Batch, ChunkMovedError, RejectedError, ServerStats, ServerStore
from paratrain.transport.base import ANY_SOURCE, Transport
from paratrain.transport.wire import Message

__all__ = ["ParameterServer", "ServerStats"]

log = logging.getLogger("paratrain.ps.server")

#: Operations one server sends another (replication, and a restarted one catching up), from server ranks only.
_SERVER_OPS = (
    "replicate",
    "replicate_batch",
    "notice",
    "replicate_states",
    "replicated",
    "members",
    "snapshot",
    "migrate",
    "migrated",
    "adopt",
)


def _pushed_before(meta: Any, clock: int) -> bool:
    """Whether ``meta`` is a push its worker made before clock ``clock`` (a retried push, once that clock came)."""
    if not isinstance(meta, Mapping) or meta.get("op") != "push":
        return False
    wclock = meta.get("wclock")
    return isinstance(wclock, int) and wclock < clock


class ParameterServer:
    """The event loop of one server over ``transport`` (whose ranks ``0..num_workers-1`` are the workers).

    Args:
        transport: the server's transport (the whole job's ranks).
        num_workers: workers in the job; all start as live members at clock 0.
        servers: the transport ranks of the job's servers, this one included (default: the ranks after the
            workers').
        timeout: seconds a reply may take to leave before the server gives up on it.
        poll: seconds between checks for lost workers while idle.
        rejoin: this process replaces a server that died (``paratrain launch --max-restarts``): before serving
            it takes its chunks and clocks from the other replicas (:mod:`.resync`).
        worker_restarts: the job restarts dead workers: their places are held for their replacements
            (:mod:`.rejoin`) rather than dropped.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> from paratrain.ps import KVStore
        >>> import numpy as np
        >>> def worker(ctx):
        ...     kv = KVStore(context=ctx)
        ...     kv.init("w", np.zeros(3))
        ...     kv.push("w", np.ones(3)).wait()
        ...     kv.clock()
        ...     out = kv.pull("w")
        ...     kv.close()
        ...     return out.tolist()
        >>> run_ranks(2, worker, servers=1)
        [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """

    def __init__(
        self,
        transport: Transport,
        *,
        num_workers: int,
        servers: Sequence[int] | None = None,
        timeout: float = 60.0,
        poll: float = 0.2,
        rejoin: bool = False,
        worker_restarts: bool = False,
    ) -> None:
        if not 0 < num_workers <= transport.world_size:
            raise ValueError(f"num_workers {num_workers} outside 1..{transport.world_size}")
        servers = range(num_workers, transport.world_size) if servers is None else servers
        self.transport = transport
        self.num_workers = num_workers
        self.timeout = timeout
        self.poll = poll
        self.store = ServerStore(transport, num_workers=num_workers, servers=servers, timeout=timeout)
        self.replication = Replication(self.store, self._advance)
        self.donor = Donor(self.store, self._check_lost)
        self.rejoins = Rejoins(self.store, self._drop_requests, enabled=worker_restarts, restarted=rejoin)
        self.replication.duplicate, self.replication.pushed = self.rejoins.duplicate, self.rejoins.pushed
        self.resizing = Resizing(self.store, self._advance, self._resize_refusal)
        self._waiting_clocks: list[tuple[int, Mapping[str, Any]]] = []
        # worker -> its requests held back behind a clock of it that waits for pushes still on their way from
        # other replicas (_op_clock); its first is that clock
        self._queued: dict[int, list[Message]] = {}
        self._rejoin = rejoin
        self._handlers: dict[str, Callable[[Message], None]] = {
            "init": self._op_init,
            "push": self._op_push,
            "pull": self._op_pull,
            "clock": self._op_clock,
            "wait_clock": self._op_wait_clock,
            "join": self._op_join,
            "leave": self._op_leave,
            "batch": self._op_batch,
            "fence": self._op_fence,
            **self.replication.handlers(),
            **self.donor.handlers(),
            **self.rejoins.handlers(),
            **self.resizing.handlers(),
        }

    @property
    def stats(self) -> ServerStats:
        """What this server did so far."""
        return self.store.stats

    @property
    def done(self) -> dict[int, int]:
        """Each worker's completed clocks, as this server counted them."""
        return self.store.done

    @property
    def live(self) -> set[int]:
        """The workers taking part (not left, not lost)."""
        return self.store.live

    @property
    def _chunks(self) -> dict[tuple[Any, int], StoredChunk]:
        return self.store.chunks

    # -- the loop ------------------------------------------------------------------------------------------

    def serve(self, stop: threading.Event | None = None) -> ServerStats:
        """Serves until every worker has left or is lost (or ``stop`` is set). Blocks; one thread only."""
        t = self.transport
        if self._rejoin:
            self._rejoin = False
            caught = catch_up(t, servers=self.store.servers, timeout=self.timeout, poll=self.poll)
            if caught is None:  # the job ended while this server restarted
                self.store.live.clear()
            else:
                self._install(caught)
        while self.store.live and not (stop is not None and stop.is_set()):
            try:
                msg = t.recv(ANY_SOURCE, REQUEST_TAG, timeout=self.resizing.timeout_s(self.poll))
            except CommTimeoutError:
                self._check_lost()
                self.resizing.tick()
                continue
            except (PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: %s; stopping", t.rank, exc)
                break
            self._receive(msg)
            if self._queued:
                self._release()
            self._check_lost()
            self.resizing.tick()
        self.store.flush_sends()
        self.store.unshare()
        return self.store.stats

    def _receive(self, msg: Message) -> None:
        """Handles a request, or holds it back behind a clock of its worker not counted yet (in order, as if that
        clock arrived later). A push of a clock already sent is not held back: it is a push sent again after its
        server died, and the held-back clock may be waiting for it."""
        queue = self._queued.get(msg.src)
        if queue is not None and msg.meta.get("op") != "rejoin":  # (a replacement's: it drops its predecessor's)
            until = queue[0].meta.get("clock")
            requests = msg.meta.get("ops") if msg.meta.get("op") == "batch" else [msg.meta]
            retry = (
                isinstance(until, int)
                and isinstance(requests, list)
                and all(_pushed_before(r, until) for r in requests)
            )
            if not retry:
                queue.append(msg)
                return
        self._handle(msg)

    def _release(self) -> None:
        """Handles the held-back requests of every worker whose first held-back clock now has all its pushes.

        Each goes through :meth:`_receive` again: behind a later clock that waits in turn, the others stay held
        back, but a push sent again for that later clock (it arrived behind the first one) is applied, or the
        later clock would wait for a push held back behind itself. Repeats while that releases a clock."""
        released = True
        while released:
            released = False
            for worker in list(self._queued):
                queue = self._queued.get(worker)
                if queue is None or not self._holds_pushes(queue[0]):
                    continue
                del self._queued[worker]
                released = True
                for msg in queue:
                    self._receive(msg)

    def _holds_pushes(self, clock: Message) -> bool:
        """Whether this server holds every push the worker made in the clock that ``clock`` ends (replication:
        the worker says how many, ``expect``; the pushes come from it or, forwarded, from other replicas)."""
        expect, number = clock.meta.get("expect"), clock.meta.get("clock")
        if not isinstance(expect, int) or not isinstance(number, int) or expect <= 0:
            return True
        return self.store.held.get((clock.src, number - 1), 0) >= expect

    def _forget(self, worker: int, *, awaited: bool = True) -> None:
        """Drops what replication kept of ``worker`` (it left, joined again or died; ``awaited``: see ServerStore)."""
        self.store.forget(worker, awaited=awaited)
        self._queued.pop(worker, None)
        self.replication.forget(worker)

    def _drop_requests(self, worker: int) -> None:
        """Drops every request of ``worker`` still waiting here (its process died: their ids die with it; its place
        is held, so the data of its pushes that another replica holds is still awaited)."""
        self._forget(worker, awaited=False)
        self.store.drop_waiting(worker)
        self.replication.drop_requests(worker)
        self._waiting_clocks = [c for c in self._waiting_clocks if c[0] != worker]

    def _handle(self, msg: Message) -> None:
        op = msg.meta.get("op")
        handler = self._handlers.get(op) if isinstance(op, str) else None
        try:
            if not isinstance(msg.meta.get("id"), int):
                raise RejectedError("request without an integer id")
            if handler is None:
                raise RejectedError(f"unknown operation {op!r}")
            if msg.src not in self.store.done and not (op in _SERVER_OPS and msg.src in self.store.servers):
                raise RejectedError(f"rank {msg.src} is not a worker of this job")
            handler(msg)
        except ChunkMovedError:  # the worker knows the chunk's server now: it sends the request there
            self.store.reply(msg.src, msg.meta["id"], moved=True)
        except RejectedError as exc:
            self._reject(msg, str(exc))
        except Exception as exc:  # a bug or a hostile request must not take the server down
            log.exception("server %d: request %r from rank %d failed", self.transport.rank, op, msg.src)
            self._reject(msg, f"server error: {type(exc).__name__}: {exc}")

    def _reject(self, msg: Message, why: str) -> None:
        self.store.stats.rejected += 1
        request_id = msg.meta.get("id")
        log.error("server %d rejected %r from rank %d: %s", self.transport.rank, msg.meta.get("op"), msg.src, why)
        if not isinstance(request_id, int):
            return
        if msg.meta.get("op") in FORWARDS and msg.src in self.store.servers:
            self.replication.refuse(msg, why)
            return
        self.store.reply(msg.src, request_id, error=f"server {self.transport.rank}: {why}")

    def _op_batch(self, msg: Message) -> None:
        """Several requests of one worker in one message (:mod:`.protocol`): each handled as if it came alone,
        in order; their replies leave together, in one message, when the last is ready."""
        try:
            requests = unpack(msg, "ops")
        except ValueError as exc:
            raise RejectedError(f"malformed batch: {exc}") from None
        ids = [r.meta.get("id") for r in requests]
        if any(r.meta.get("op") == "batch" for r in requests) or not all(type(i) is int for i in ids):
            raise RejectedError("a batch holds requests with integer ids, and no batch")
        numbers = [int(i) for i in ids if type(i) is int]
        batched = self.store.batched
        if len(set(numbers)) != len(ids) or any((msg.src, i) in batched for i in numbers):
            raise RejectedError("a batch reuses a request id")
        self.store.stats.batches += 1
        batch = Batch(msg.src, msg.meta["id"], [({}, [], None)] * len(requests), len(requests))
        for index, request_id in enumerate(numbers):
            batched[(msg.src, request_id)] = (batch, index)
        outer = self.replication.batching()
        try:
            for request in requests:
                self._receive(request)
        finally:
            if outer:
                self.replication.flush_forwards()

    # -- membership and clocks -----------------------------------------------------------------------------

    def _check_lost(self) -> None:
        store = self.store
        gone = self.transport.lost_peers()
        self.replication.check_servers(gone)
        if self.replication.newly_lost:
            self.replication.newly_lost = False
            self._advance()  # (it refuses the waiting pulls of the chunks lost)
        lost = (gone & store.live) - self.rejoins.absent
        departed = self.transport.departed_peers() if lost else frozenset()
        for worker in sorted(lost):
            if self.rejoins.enabled and worker not in departed:  # its place is held (an ASP round may close)
                self.rejoins.hold(worker)
                continue
            if worker in departed:
                log.info(
                    "server %d: worker %d shut down without kv.close() at clock %d; it leaves the clock "
                    "bookkeeping as close() would have",
                    self.transport.rank,
                    worker,
                    store.done[worker],
                )
            else:
                log.warning(
                    "server %d: worker %d is gone (crashed, killed or disconnected); removed from the clock "
                    "bookkeeping at clock %d so that the others go on",
                    self.transport.rank,
                    worker,
                    store.done[worker],
                )
                store.stats.workers_lost.append(worker)
            store.live.discard(worker)
            self._queued.pop(worker, None)  # its held-back requests die with it (its pushes are applied)
            store.drop_held(worker)
        if lost:
            self._advance()
        elif self.donor.snapshots:
            self.donor.send_snapshots()

    def _lost_chunk(self, meta: Mapping[str, Any]) -> str | None:
        """Why the chunk a request names cannot go on exactly (:attr:`StoredChunk.lost`), if it cannot."""
        chunk = self.store.chunks.get((meta.get("key"), meta.get("chunk")))  # type: ignore[arg-type]
        return None if chunk is None else chunk.lost

    def _advance(self) -> None:
        """Recomputes the slowest clock; applies completed synchronous steps; answers what became allowed."""
        store = self.store
        slowest = min_done(store.done, store.live)
        if slowest is not None:
            store.min_done = max(store.min_done, slowest)
        for chunk in store.chunks.values():
            store.commit(chunk)
        still: list[tuple[int, Mapping[str, Any], Message]] = []
        for worker, meta, msg in store.waiting_pulls:
            lost = self._lost_chunk(meta)
            if lost is not None:
                self._reject(msg, lost)
            elif worker in store.done and store.ready(meta) and not self.replication.awaits(meta):
                self._answer_pull(msg)
            else:
                still.append((worker, meta, msg))
        store.waiting_pulls = still
        waiting, self._waiting_clocks = self._waiting_clocks, []
        for worker, meta in waiting:
            if store.ready(meta):
                store.reply(worker, meta["id"])
            else:
                self._waiting_clocks.append((worker, meta))
        if self.replication.unsent:  # after the pulls: their answers need not wait for the copies into the states
            self.replication.send_states()
        if self.donor.snapshots:
            self.donor.send_snapshots()
        if self.resizing.pending:
            self.resizing.migrate_ready()

    def _resize_refusal(self) -> str | None:
        """Why this job cannot move chunks between servers (:mod:`.resize`), or None."""
        if self.rejoins.enabled:
            return "a job that restarts workers cannot resize its servers (not supported yet)"
        if any(len(chunk.replicas) > 1 for chunk in self.store.chunks.values()):
            return "a replicated job cannot resize its servers (not supported yet): use replicas=1"
        return None

    def _op_clock(self, msg: Message) -> None:
        store = self.store
        clock = msg.meta.get("clock")
        if msg.src not in store.live:
            raise RejectedError(f"worker {msg.src} has left; create a new KVStore (join=True) to come back")
        if not self._holds_pushes(msg):
            # Replicated: pushes of this clock forwarded by their owner are still on their way. Counting the clock
            # now could take a step of the server-side optimizer without them (the replicas would differ), so the
            # clock, and whatever its worker sends after it, waits for them (_receive, _release).
            self._queued[msg.src] = [msg]
            store.stats.clocks_held += 1
            return
        if self.rejoins.counted_before(msg.src, clock):
            return  # a restarted worker's clock that its predecessor's message counted here (.rejoin)
        if isinstance(clock, int):
            store.held.pop((msg.src, clock - 1), None)
        self.replication.forget(msg.src)
        store.done[msg.src] += 1
        self.rejoins.counted(msg.src)
        acked = msg.meta.get("acked")  # every push numbered below it is acknowledged: it will not be retried
        applied = store.applied.get(msg.src)
        if isinstance(acked, int) and applied:
            applied.difference_update([seq for seq in applied if seq < acked])
        if clock != store.done[msg.src]:
            log.error(
                "server %d: worker %d says clock %r, expected %d",
                self.transport.rank,
                msg.src,
                clock,
                store.done[msg.src],
            )
        self._advance()

    def _op_wait_clock(self, msg: Message) -> None:
        if self.store.ready(msg.meta):
            self.store.reply(msg.src, msg.meta["id"])
        else:
            self._waiting_clocks.append((msg.src, msg.meta))

    def _op_join(self, msg: Message) -> None:
        store = self.store
        self._forget(msg.src)  # a new KVStore numbers its pushes and clocks afresh
        others = [store.done[w] for w in store.live if w != msg.src]
        store.done[msg.src] = max(store.done[msg.src], min(others) if others else store.min_done)
        store.live.add(msg.src)
        log.info("server %d: worker %d joined at clock %d", self.transport.rank, msg.src, store.done[msg.src])
        store.reply(msg.src, msg.meta["id"], clock=store.done[msg.src])

    def _op_leave(self, msg: Message) -> None:
        self.store.live.discard(msg.src)
        self._forget(msg.src)
        self.store.reply(msg.src, msg.meta["id"])
        self._advance()

    # -- a restarted server catching up (.resync) -------------------------------------------------------------

    def _install(self, caught: CaughtUp) -> None:
        """Takes what the donors sent at the workers' fences, then lets the fenced workers go on."""
        store = self.store
        store.chunks = caught.chunks
        for chunk in store.chunks.values():
            store.share(chunk)
        store.done.update(caught.done)
        store.live = set(caught.live)
        store.min_done = caught.min_done
        store.held.update(caught.held)
        # the servers no worker counted as live when it fenced are dead: forward nothing to them
        self.replication.restarted(caught.donors)
        store.stats.catch_up_s = caught.seconds
        store.stats.fence_rounds = caught.rounds
        log.warning(  # (not a problem: the counterpart of "server N is gone", which users see too)
            "server %d: caught up after a restart: %d chunks from servers %s, workers %s at clocks %s "
            "(%.3f s, %d round(s) of fences)",
            self.transport.rank,
            len(caught.chunks),
            caught.donors,
            sorted(caught.live),
            [caught.done.get(w) for w in sorted(caught.live)],
            caught.seconds,
            caught.rounds,
        )
        for worker, request_id in caught.fences:
            store.reply(worker, request_id)

    def _op_fence(self, msg: Message) -> None:
        """A worker's fence after this server caught up (a KVStore created later): nothing to wait for."""
        self.store.reply(msg.src, msg.meta["id"])

    # -- keys ----------------------------------------------------------------------------------------------

    def _op_init(self, msg: Message) -> None:
        waiting = self.store.init(msg)
        chunk = self.store.chunks.get((msg.meta["key"], msg.meta["chunk"]))
        if chunk is not None and len(chunk.replicas) > 1:
            self.replication.active = True
        for worker, meta in waiting:
            self._handle(Message(src=worker, tag=REQUEST_TAG, meta=meta))

    def _op_push(self, msg: Message) -> None:
        store = self.store
        chunk = store.chunk(msg.meta)
        if chunk.lost is not None:
            raise RejectedError(chunk.lost)
        seq = msg.meta.get("seq")
        if isinstance(seq, int) and len(chunk.replicas) > 1:
            self.replication.push(chunk, msg, seq)
            return
        key = (msg.meta["key"], msg.meta["chunk"])
        new = store.consume(msg.src, seq, msg.meta.get("wclock"))
        if new and self.rejoins.duplicate(msg.src, key, msg.meta.get("wclock")):
            store.stats.duplicates += 1  # a restarted worker's push that its predecessor's was applied as
            new = False
        rows, data = store.push_data(chunk, msg)
        store.stats.pushes += 1
        round_id = round_of_push(chunk.mode, store.done[msg.src], chunk.version)
        if new:
            read, densify = msg.meta.get("version"), bool(msg.meta.get("densify"))
            store.apply(chunk, rows, data, round_id, read, densify=densify, worker=msg.src)
            self.rejoins.pushed(msg.src, key, msg.meta.get("wclock"))
        store.reply(msg.src, msg.meta["id"])

    def _op_pull(self, msg: Message) -> None:
        chunk = self.store.chunk(msg.meta)  # validates now: an unknown key is an error at once, not after waiting
        if chunk.lost is not None:
            raise RejectedError(chunk.lost)
        if len(chunk.replicas) > 1 and chunk.mode == "clock" and not chunk.owned and msg.meta.get("replica") is None:
            # a worker reads a replicated chunk here: its owner died (for that worker), so this replica owns it now,
            # as a push would make it, and takes the steps of the rounds complete here itself: the owner's last
            # state may hold a round still open (a push waited for before its clock sends it at once, ``flush``)
            chunk.owned = True
            self.store.commit(chunk)
        if self.store.ready(msg.meta) and not self.replication.awaits(msg.meta):
            self._answer_pull(msg)
        else:
            self.store.stats.deferred_pulls += 1
            self.store.waiting_pulls.append((msg.src, msg.meta, msg))

    def _answer_pull(self, msg: Message) -> None:
        try:
            self.store.answer_pull(msg)
        except RejectedError as exc:
            self._reject(msg, str(exc))

    def idle_since(self) -> float:
        """Monotonic time now (a hook for tests that want to see the loop is alive)."""
        return time.monotonic()
