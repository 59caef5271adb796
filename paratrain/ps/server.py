"""One parameter-server process: stores its chunks of every key, applies pushes, answers pulls when allowed.

The server is a single-threaded event loop over the transport (no locks: one thread owns all state). It
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

Replication (``KVStore(replicas=R)``, Li et al. OSDI'14's primary-backup scheme): every chunk has a replica list of
server ranks, given at ``init``; the first live one owns it, and a push is acknowledged to its worker only when
every live replica has it, so an acknowledged update survives the loss of any R - 1 servers. Two ways, by the
chunk's rounds:

* **BSP and SSP: replication after aggregation** (OSDI'14, section 4.3). The owner applies a worker's push and
  tells the other live replicas of it at once, without its data (a ``notice``: worker, sequence number, clock,
  round). When the push's round is complete (every live worker's clock counted, the round's step taken), the owner
  sends each backup the chunk's *state* (value, optimizer state, open rounds, version: what a restarted replica's
  catch-up carries, :mod:`.resync`) with the list of the pushes it holds; the backup installs it in place of its
  own and acknowledges, and the owner answers those pushes. A backup receives and copies one chunk per round, not
  one push per worker (with N workers, N times fewer bytes; on one host, a copy instead of a copy and an add per
  push), and never steps a round itself, so the replicas cannot differ. A worker that waits for a push before its
  clock completes the round sends ``flush``: the owner sends the states of that worker's pushes at once.
* **ASP: every push forwarded** (``replicate``, with the round it joined) and acknowledged by each backup
  (``replicated``) before the worker is answered: rounds of arrival have no point at which a state is complete.

The loop never blocks on a backup: pushes awaiting acknowledgements are kept in ``_forwards`` and answered as they
arrive, or at once when a backup is lost. A worker's batch of pushes goes on to each backup in one message (its
notices, or its forwards), states in messages of up to :data:`~.plans.BATCH_BYTES`, acknowledgements in one message
each (:mod:`.protocol`). Pushes carry a per-worker sequence number; a server applies each (worker, sequence) once, so
a push the worker retries on a backup after its owner died is never applied twice nor lost. A worker sends its clock
without waiting for acknowledgements, with the number of that clock's pushes this server must hold (``expect``:
those whose chunk it replicates, direct, forwarded or noticed, counted per (worker, clock)): until it holds them the
clock and everything its worker sends after it wait in ``_queued`` (except a push of that clock sent again after its
owner died, or a batch of them, which the clock may be waiting for). So a backup that takes over a chunk knows which
pushes its owner had (noticed ones, awaited until the worker sends them again; a pull waits for them) and in which
round (the noticed one), and a push its owner never noticed holds back its worker's clock until it arrives.

A dead replicated server can be restarted (``paratrain launch --max-restarts``): the new process catches up from
the other replicas of its chunks before it serves, at a fence every worker takes part in (:mod:`.resync`; here
``rejoin=True`` on its side, and ``members``/``snapshot`` on the donors' side). Until a donor has sent it its copy,
the donor counts it as lost, so nothing is forwarded to it early.

Robustness: a malformed or invalid request is answered with an error and the loop goes on; a worker whose
process dies (its connection drops, or heartbeats stop) is removed from the clock bookkeeping and logged, so
the others are not blocked forever; the loop ends when no live worker is left.

The pure rules live in :mod:`.rounds`, :mod:`.consistency` and :mod:`.sharding`, the restarted side and the
snapshot format in :mod:`.resync`, the values that same-host workers read in place in :mod:`.shared`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain._arrays import DTYPE_NAMES, dtype_from_name, wire_array
from paratrain.collectives.ops import bf16_to_f32
from paratrain.errors import CommTimeoutError, PeerLostError, TransportClosedError
from paratrain.ps.consistency import min_done, required_met
from paratrain.ps.optim import make_optimizer
from paratrain.ps.plans import BATCH_BYTES, MAX_BATCH
from paratrain.ps.protocol import REQUEST_TAG, forward_ids, pack, reply_tag, unpack
from paratrain.ps.resync import CatchUpError, CaughtUp, StoredChunk, catch_up, chunk_message, read_chunk
from paratrain.ps.rounds import RoundSum, commit_ready, mode_of, preview, round_of_push, staleness_weight
from paratrain.ps.shared import SHARED_MIN_BYTES, SharedValue, value_prefix
from paratrain.transport.base import ANY_SOURCE, Transport
from paratrain.transport.wire import Message

__all__ = ["ParameterServer", "ServerStats"]

log = logging.getLogger("paratrain.ps.server")


#: (wire dtype, key dtype) pairs a push may widen: gradients compressed to 16 bits for the wire
_WIDENED = frozenset((w, k) for w in ("float16", "bfloat16") for k in ("float32", "float64"))
#: Operations one server sends another (replication, and a restarted one catching up), from server ranks only.
_SERVER_OPS = ("replicate", "replicate_batch", "notice", "replicate_states", "replicated", "members", "snapshot")


def _nbytes(arrays: Sequence[Any]) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for a in arrays)


def _pushed_before(meta: Any, clock: int) -> bool:
    """Whether ``meta`` is a push its worker made before clock ``clock`` (a retried push, once that clock came)."""
    if not isinstance(meta, Mapping) or meta.get("op") != "push":
        return False
    wclock = meta.get("wclock")
    return isinstance(wclock, int) and wclock < clock


class _RejectedError(Exception):
    """A request the server refuses; the message goes back to the worker."""


@dataclass
class _Forward:
    """Pushes applied here (one forwarded, or those a chunk's state carries) whose workers are answered once every
    other live replica has them too."""

    answers: list[tuple[int, int]]  # (worker, request id) of each push
    waiting: set[int]  # server ranks that have not acknowledged yet
    error: str | None = None  # a backup rejected it (a bug: replicas hold the same chunks), told to the worker


@dataclass
class _Batch:
    """A worker's batch request (:mod:`.protocol`): its replies as they come, sent together with the last."""

    worker: int
    request_id: int
    replies: list[tuple[dict[str, Any], list[Any], StoredChunk | None]]
    left: int


@dataclass
class ServerStats:
    """What a server did (for logs and benchmarks)."""

    pushes: int = 0
    pulls: int = 0
    deferred_pulls: int = 0
    rejected: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    workers_lost: list[int] = field(default_factory=list)  # crashed or killed (not those that shut down cleanly)
    forwarded: int = 0  # pushes sent on to backups, or (BSP/SSP) made known to them, their data to follow in a state
    forward_messages: int = 0  # messages that carried them (a worker's batch forwards its pushes together)
    replicated: int = 0  # pushes received from another replica and applied here (or in a state installed here)
    states_sent: int = 0  # chunk states sent to the other replicas (BSP/SSP: once per chunk and round)
    duplicates: int = 0  # pushes (or forwards) already applied here, acknowledged without applying again
    clocks_held: int = 0  # worker clocks that arrived before pushes of theirs forwarded by another replica
    servers_lost: list[int] = field(default_factory=list)  # other servers seen dead (their chunks fail over)
    snapshots_sent: int = 0  # copies sent to restarted servers (:mod:`.resync`)
    catch_up_s: float | None = None  # restarted: seconds from the first worker's fence to the last snapshot
    fence_rounds: int = 0  # restarted: rounds of fences the catch-up took (more than 1: some were retried)
    pulls_in_place: int = 0  # pulls answered with a reference: the same-host worker copied the value (.shared)
    batches: int = 0  # batch requests (each several requests in one message: .protocol)


class ParameterServer:
    """The event loop of one server over ``transport`` (whose ranks ``0..num_workers-1`` are the workers).

    Args:
        transport: the server's transport (the whole job's ranks).
        num_workers: workers in the job; all start as live members at clock 0.
        timeout: seconds a reply may take to leave before the server gives up on it.
        poll: seconds between checks for lost workers while idle.
        rejoin: this process replaces a server that died (``paratrain launch --max-restarts``): before serving
            it takes its chunks and clocks from the other replicas (:mod:`.resync`).

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
        self, transport: Transport, *, num_workers: int, timeout: float = 60.0, poll: float = 0.2, rejoin: bool = False
    ) -> None:
        if not 0 < num_workers <= transport.world_size:
            raise ValueError(f"num_workers {num_workers} outside 1..{transport.world_size}")
        self.transport = transport
        self.num_workers = num_workers
        self.timeout = timeout
        self.poll = poll
        self.stats = ServerStats()
        self.done: dict[int, int] = dict.fromkeys(range(num_workers), 0)
        self.live: set[int] = set(range(num_workers))
        self._chunks: dict[tuple[Any, int], StoredChunk] = {}
        self._waiting_pulls: list[tuple[int, Mapping[str, Any], Message]] = []
        self._waiting_clocks: list[tuple[int, Mapping[str, Any]]] = []
        self._waiting_inits: dict[tuple[Any, int], list[tuple[int, Mapping[str, Any]]]] = {}
        self._min_done = 0
        # replication: sequence numbers applied per worker, pushes awaiting backups, server ranks seen lost
        self._applied: dict[int, set[int]] = {}
        self._forwards: dict[int, _Forward] = {}
        self._unsent: set[tuple[Any, int]] = set()  # chunks whose applied pushes are not yet in a state sent
        self._flushing: set[int] = set()  # workers waiting for pushes before their clock (_op_flush)
        self._forward_ids = 0
        self._servers_lost: set[int] = set()
        # (worker, its clock) -> that clock's pushes held here; worker -> its requests held back behind a clock
        # of it that waits for pushes still on their way from other replicas (_op_clock); its first is that clock
        self._held: dict[tuple[int, int], int] = {}
        self._queued: dict[int, list[Message]] = {}
        self._replicated = False  # some chunk here has backups
        self._gone_seen: frozenset[int] = frozenset()  # the lost peers when servers were last checked
        # restarted servers: how often each peer rejoined as last seen; copies asked for, not yet sent (.resync)
        self._incarnations: dict[int, int] = transport.incarnations()
        self._snapshots: list[tuple[int, int, list[tuple[int, int]]]] = []
        self._rejoin = rejoin
        # (worker, request id) of a request that came in a batch -> the batch and its place in it
        self._batched: dict[tuple[int, int], tuple[_Batch, int]] = {}
        # while a worker's batch is handled: the forwards to each backup, sent together when it is done
        self._outbox: dict[int, list[tuple[dict[str, Any], Sequence[Any]]]] | None = None

    # -- the loop ------------------------------------------------------------------------------------------

    def serve(self, stop: threading.Event | None = None) -> ServerStats:
        """Serves until every worker has left or is lost (or ``stop`` is set). Blocks; one thread only."""
        t = self.transport
        if self._rejoin:
            self._rejoin = False
            self._install(catch_up(t, num_workers=self.num_workers, timeout=self.timeout, poll=self.poll))
        while self.live and not (stop is not None and stop.is_set()):
            try:
                msg = t.recv(ANY_SOURCE, REQUEST_TAG, timeout=self.poll)
            except CommTimeoutError:
                self._check_lost()
                continue
            except (PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: %s; stopping", t.rank, exc)
                break
            self._receive(msg)
            if self._queued:
                self._release()
            self._check_lost()
        self._flush_sends()
        self._unshare()
        return self.stats

    def _share(self, chunk: StoredChunk) -> None:
        """Moves a large dense value into shared memory when a worker shares this host (:mod:`.shared`)."""
        if chunk.shared is not None or chunk.value.nbytes < SHARED_MIN_BYTES:
            return
        t = self.transport
        prefix = next((p for w in range(self.num_workers) if (p := t.memory_prefix(w)) is not None), None)
        if prefix is None:
            return
        try:
            chunk.shared = SharedValue(value_prefix(prefix, t.rank), chunk.value)
        except OSError as exc:
            log.warning("server %d: a value stays private (%s); pulls of it carry the data", t.rank, exc)
            return
        chunk.value = chunk.shared.value

    def _unshare(self) -> None:
        for chunk in self._chunks.values():
            if chunk.shared is not None:
                chunk.shared.unlink()

    def _receive(self, msg: Message) -> None:
        """Handles a request, or holds it back behind a clock of its worker not counted yet (in order, as if that
        clock arrived later). A push of a clock already sent is not held back: it is a push sent again after its
        server died, and the held-back clock may be waiting for it."""
        queue = self._queued.get(msg.src)
        if queue is not None:
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
        return self._held.get((clock.src, number - 1), 0) >= expect

    def _forget(self, worker: int) -> None:
        """Drops what replication kept of ``worker`` (it left, joined again or died)."""
        self._applied.pop(worker, None)
        self._queued.pop(worker, None)
        for pending in [b for b in self._batched if b[0] == worker]:
            del self._batched[pending]
        for held in [h for h in self._held if h[0] == worker]:
            del self._held[held]
        self._drop_awaited(worker)
        self._flushing.discard(worker)

    def _drop_awaited(self, worker: int) -> None:
        """Stops waiting for the data of ``worker``'s pushes (it left or died: it will not send them again)."""
        for chunk in self._chunks.values():
            if chunk.awaited:
                for pending in [a for a in chunk.awaited if a[0] == worker]:
                    del chunk.awaited[pending]

    def _handle(self, msg: Message) -> None:
        op = msg.meta.get("op")
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        try:
            if not isinstance(msg.meta.get("id"), int):
                raise _RejectedError("request without an integer id")
            if handler is None:
                raise _RejectedError(f"unknown operation {op!r}")
            if msg.src not in self.done and not (op in _SERVER_OPS and msg.src >= self.num_workers):
                raise _RejectedError(f"rank {msg.src} is not a worker of this job")
            handler(msg)
        except _RejectedError as exc:
            self._reject(msg, str(exc))
        except Exception as exc:  # a bug or a hostile request must not take the server down
            log.exception("server %d: request %r from rank %d failed", self.transport.rank, op, msg.src)
            self._reject(msg, f"server error: {type(exc).__name__}: {exc}")

    def _reject(self, msg: Message, why: str) -> None:
        self.stats.rejected += 1
        request_id = msg.meta.get("id")
        log.error("server %d rejected %r from rank %d: %s", self.transport.rank, msg.meta.get("op"), msg.src, why)
        if not isinstance(request_id, int):
            return
        if msg.meta.get("op") in ("replicate", "replicate_batch", "replicate_states", "notice") and (
            msg.src >= self.num_workers
        ):
            ids = forward_ids(msg.meta)
            if ids:
                self._acknowledge(msg.src, ids, [f"backup {why}"] * len(ids))
            return
        self._reply(msg.src, request_id, error=f"server {self.transport.rank}: {why}")

    def _reply(
        self,
        worker: int,
        request_id: int,
        arrays: Sequence[Any] = (),
        *,
        chunk: StoredChunk | None = None,
        **fields: Any,
    ) -> None:
        meta = {"done": self._min_done, **fields}
        batched = self._batched.pop((worker, request_id), None)
        if batched is not None:
            batch, index = batched
            batch.replies[index] = (meta, list(arrays), chunk)
            batch.left -= 1
            if batch.left == 0:
                self._answer_batch(batch)
            return
        try:
            handle = self.transport.isend(worker, reply_tag(request_id), arrays, meta)
        except (PeerLostError, TransportClosedError) as exc:
            log.warning("server %d: cannot answer rank %d: %s", self.transport.rank, worker, exc)
            return
        self.stats.bytes_out += sum(int(getattr(a, "nbytes", 0)) for a in arrays)
        if chunk is not None and not handle.done():
            chunk.sends.append(handle)

    def _op_batch(self, msg: Message) -> None:
        """Several requests of one worker in one message (:mod:`.protocol`): each handled as if it came alone,
        in order; their replies leave together, in one message, when the last is ready."""
        try:
            requests = unpack(msg, "ops")
        except ValueError as exc:
            raise _RejectedError(f"malformed batch: {exc}") from None
        ids = [r.meta.get("id") for r in requests]
        if any(r.meta.get("op") == "batch" for r in requests) or not all(type(i) is int for i in ids):
            raise _RejectedError("a batch holds requests with integer ids, and no batch")
        numbers = [int(i) for i in ids if type(i) is int]
        if len(set(numbers)) != len(ids) or any((msg.src, i) in self._batched for i in numbers):
            raise _RejectedError("a batch reuses a request id")
        self.stats.batches += 1
        batch = _Batch(msg.src, msg.meta["id"], [({}, [], None)] * len(requests), len(requests))
        for index, request_id in enumerate(numbers):
            self._batched[(msg.src, request_id)] = (batch, index)
        outer, self._outbox = self._outbox, self._outbox if self._outbox is not None else {}
        try:
            for request in requests:
                self._receive(request)
        finally:
            if outer is None:
                self._flush_forwards()

    def _answer_batch(self, batch: _Batch) -> None:
        metas, arrays = pack([(meta, arrs) for meta, arrs, _ in batch.replies])
        try:
            handle = self.transport.isend(
                batch.worker, reply_tag(batch.request_id), arrays, {"done": self._min_done, "replies": metas}
            )
        except (PeerLostError, TransportClosedError) as exc:
            log.warning("server %d: cannot answer rank %d: %s", self.transport.rank, batch.worker, exc)
            return
        self.stats.bytes_out += sum(int(getattr(a, "nbytes", 0)) for a in arrays)
        if not handle.done():
            for _, _, chunk in batch.replies:
                if chunk is not None:
                    chunk.sends.append(handle)

    def _quiesce(self, chunk: StoredChunk) -> None:
        """Waits until no reply still reads ``chunk.value`` (sent zero-copy) before it is modified, and tells
        same-host workers that may be copying it in place (:mod:`.shared`). Every change of a value calls it."""
        if chunk.shared is not None:
            chunk.shared.changing()
        self._settle(chunk)

    def _settle(self, chunk: StoredChunk) -> None:
        """Waits until no message still reads ``chunk``'s arrays (replies and states are sent zero-copy)."""
        for handle in chunk.sends:
            try:
                handle.wait(self.timeout)
            except (CommTimeoutError, PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: reply not delivered: %s", self.transport.rank, exc)
        chunk.sends.clear()

    def _flush_sends(self) -> None:
        for chunk in self._chunks.values():
            self._quiesce(chunk)

    # -- membership and clocks -----------------------------------------------------------------------------

    def _check_lost(self) -> None:
        gone = self.transport.lost_peers()
        if self._replicated:
            incarnations = self.transport.incarnations()
            if incarnations != self._incarnations:
                # a server that came back as a new process is lost as far as this one is concerned (even if its
                # death went unseen) until it has caught up from this server's snapshot (_op_snapshot)
                changed = {s for s, n in incarnations.items() if n != self._incarnations.get(s, 0)}
                changed.discard(self.transport.rank)  # (this process's own successor: it is dead itself)
                self._incarnations = incarnations
                self._check_lost_servers(frozenset(changed - self._servers_lost))
            if gone != self._gone_seen:
                self._gone_seen = gone
                self._check_lost_servers(gone)
        lost = gone & self.live
        departed = self.transport.departed_peers() if lost else frozenset()
        for worker in sorted(lost):
            if worker in departed:
                log.info(
                    "server %d: worker %d shut down without kv.close() at clock %d; it leaves the clock "
                    "bookkeeping as close() would have",
                    self.transport.rank,
                    worker,
                    self.done[worker],
                )
            else:
                log.warning(
                    "server %d: worker %d is gone (crashed, killed or disconnected); removed from the clock "
                    "bookkeeping at clock %d so that the others go on",
                    self.transport.rank,
                    worker,
                    self.done[worker],
                )
                self.stats.workers_lost.append(worker)
            self.live.discard(worker)
            self._queued.pop(worker, None)  # its held-back requests die with it (its pushes are applied)
            for held in [h for h in self._held if h[0] == worker]:
                del self._held[held]
            self._drop_awaited(worker)
        if lost:
            self._advance()
        elif self._snapshots:
            self._send_snapshots()

    def _check_lost_servers(self, gone: frozenset[int]) -> None:
        """Stops waiting for backups that died: their pushes are acknowledged with the replicas still alive."""
        new = sorted(s for s in gone if s >= self.num_workers and s not in self._servers_lost)
        departed = self.transport.departed_peers() if new else frozenset()
        for server in new:
            self._servers_lost.add(server)
            if server in departed:  # a clean shutdown, at the end of the job
                log.info("server %d: server %d shut down", self.transport.rank, server)
                continue
            self.stats.servers_lost.append(server)
            log.warning(
                "server %d: server %d is gone; its chunks fail over to their backups", self.transport.rank, server
            )
        for forward_id, forward in list(self._forwards.items()):
            forward.waiting -= self._servers_lost
            if not forward.waiting:
                del self._forwards[forward_id]
                self._answer_forward(forward)

    def _advance(self) -> None:
        """Recomputes the slowest clock; applies completed synchronous steps; answers what became allowed."""
        slowest = min_done(self.done, self.live)
        if slowest is not None:
            self._min_done = max(self._min_done, slowest)
        for chunk in self._chunks.values():
            self._commit(chunk)
        still: list[tuple[int, Mapping[str, Any], Message]] = []
        for worker, meta, msg in self._waiting_pulls:
            if worker in self.done and self._ready(meta) and not self._awaits(meta):
                self._answer_pull(msg)
            else:
                still.append((worker, meta, msg))
        self._waiting_pulls = still
        waiting, self._waiting_clocks = self._waiting_clocks, []
        for worker, meta in waiting:
            if self._ready(meta):
                self._reply(worker, meta["id"])
            else:
                self._waiting_clocks.append((worker, meta))
        if self._unsent:  # after the pulls: their answers need not wait for the copies into the states
            self._send_states()
        if self._snapshots:
            self._send_snapshots()

    def _commit(self, chunk: StoredChunk) -> None:
        """Takes the step of every complete round of ``chunk``, oldest first (the rule of :mod:`.rounds`)."""
        if chunk.optimizer is None:
            return
        limit = self._min_done
        if len(chunk.replicas) > 1 and chunk.mode == "clock":
            if not chunk.owned:
                return  # a backup's rounds come stepped, in the owner's states
            if chunk.awaited:  # (it took over) a round waits for the pushes the dead owner had
                limit = min(limit, *chunk.awaited.values())
        for round_id in sorted(chunk.pending):
            open_round = chunk.pending[round_id]
            if not commit_ready(chunk.mode, round_id, open_round.count, limit, len(self.live)):
                break
            del chunk.pending[round_id]
            chunk.view = None
            self._quiesce(chunk)
            open_round.apply(chunk.optimizer, chunk.value, chunk.state)
            if chunk.mode == "arrival":
                chunk.version += 1
        if chunk.mode == "clock":
            chunk.version = max(chunk.version, limit)

    def _ready(self, meta: Mapping[str, Any]) -> bool:
        required = meta.get("required")
        return required_met(None if required is None else int(required), self._min_done if self.live else None)

    def _op_clock(self, msg: Message) -> None:
        clock = msg.meta.get("clock")
        if msg.src not in self.live:
            raise _RejectedError(f"worker {msg.src} has left; create a new KVStore (join=True) to come back")
        if not self._holds_pushes(msg):
            # Replicated: pushes of this clock forwarded by their owner are still on their way. Counting the clock
            # now could take a step of the server-side optimizer without them (the replicas would differ), so the
            # clock, and whatever its worker sends after it, waits for them (_receive, _release).
            self._queued[msg.src] = [msg]
            self.stats.clocks_held += 1
            return
        if isinstance(clock, int):
            self._held.pop((msg.src, clock - 1), None)
        self._flushing.discard(msg.src)
        self.done[msg.src] += 1
        acked = msg.meta.get("acked")  # every push numbered below it is acknowledged: it will not be retried
        applied = self._applied.get(msg.src)
        if isinstance(acked, int) and applied:
            applied.difference_update([seq for seq in applied if seq < acked])
        if clock != self.done[msg.src]:
            log.error(
                "server %d: worker %d says clock %r, expected %d",
                self.transport.rank,
                msg.src,
                clock,
                self.done[msg.src],
            )
        self._advance()

    def _op_wait_clock(self, msg: Message) -> None:
        if self._ready(msg.meta):
            self._reply(msg.src, msg.meta["id"])
        else:
            self._waiting_clocks.append((msg.src, msg.meta))

    def _op_join(self, msg: Message) -> None:
        self._forget(msg.src)  # a new KVStore numbers its pushes and clocks afresh
        others = [self.done[w] for w in self.live if w != msg.src]
        self.done[msg.src] = max(self.done[msg.src], min(others) if others else self._min_done)
        self.live.add(msg.src)
        log.info("server %d: worker %d joined at clock %d", self.transport.rank, msg.src, self.done[msg.src])
        self._reply(msg.src, msg.meta["id"], clock=self.done[msg.src])

    def _op_leave(self, msg: Message) -> None:
        self.live.discard(msg.src)
        self._forget(msg.src)
        self._reply(msg.src, msg.meta["id"])
        self._advance()

    # -- a restarted server catching up (.resync) -------------------------------------------------------------

    def _install(self, caught: CaughtUp) -> None:
        """Takes what the donors sent at the workers' fences, then lets the fenced workers go on."""
        self._chunks = caught.chunks
        for chunk in self._chunks.values():
            self._share(chunk)
        self.done.update(caught.done)
        self.live = set(caught.live)
        self._min_done = caught.min_done
        self._held.update(caught.held)
        self._replicated = True
        # the servers no worker counted as live when it fenced are dead: forward nothing to them
        servers = set(range(self.num_workers, self.transport.world_size)) - {self.transport.rank}
        self._servers_lost |= servers - set(caught.donors)
        self._incarnations = self.transport.incarnations()
        self.stats.catch_up_s = caught.seconds
        self.stats.fence_rounds = caught.rounds
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
            self._reply(worker, request_id)

    def _op_fence(self, msg: Message) -> None:
        """A worker's fence after this server caught up (a KVStore created later): nothing to wait for."""
        self._reply(msg.src, msg.meta["id"])

    def _op_members(self, msg: Message) -> None:
        """A restarted server asks which workers take part (to know whose fences to wait for)."""
        self._check_lost()
        self._reply(msg.src, msg.meta["id"], live=sorted(self.live))

    def _op_snapshot(self, msg: Message) -> None:
        """A restarted server asks for its chunks as they stand at the workers' fences: sent once this server
        has counted every fenced worker's clock up to its fence (:meth:`_send_snapshots`)."""
        fences = msg.meta.get("fences")
        if not isinstance(fences, list) or not all(
            isinstance(f, list) and len(f) == 2 and all(type(x) is int for x in f) for f in fences
        ):
            raise _RejectedError("snapshot without valid fences")
        self._check_lost()  # its rejoin counts as a loss here first: nothing was forwarded to it since
        self._snapshots.append((msg.src, msg.meta["id"], [(int(w), int(c)) for w, c in fences]))
        self._send_snapshots()

    def _send_snapshots(self) -> None:
        still = []
        for server, request_id, fences in self._snapshots:
            if all(w not in self.live or self.done[w] >= c for w, c in fences if w in self.done):
                self._send_snapshot(server, request_id)
            else:
                still.append((server, request_id, fences))
        self._snapshots = still

    def _send_snapshot(self, server: int, request_id: int) -> None:
        """Sends ``server`` every chunk it replicates, then the clocks; from now on it gets forwarded pushes."""
        tag = reply_tag(request_id)
        handles = []
        try:
            for (key, index), chunk in self._chunks.items():
                if server in chunk.replicas:
                    meta, arrays = chunk_message(key, index, chunk)
                    handles.append(self.transport.isend(server, tag, arrays, meta))
            end = {"part": "end", "done": [[w, d] for w, d in sorted(self.done.items())], "min_done": self._min_done}
            handles.append(self.transport.isend(server, tag, (), end))
            for handle in handles:  # the arrays go zero-copy and are modified by the next push: wait for them
                handle.wait(self.timeout)
        except (PeerLostError, TransportClosedError, CommTimeoutError) as exc:
            log.warning("server %d: restarted server %d did not take its copy: %s", self.transport.rank, server, exc)
            return
        self._servers_lost.discard(server)
        self.stats.snapshots_sent += 1
        log.info("server %d: sent restarted server %d its copy; it is a backup again", self.transport.rank, server)

    # -- keys ----------------------------------------------------------------------------------------------

    def _chunk(self, meta: Mapping[str, Any]) -> StoredChunk:
        key, index = meta.get("key"), meta.get("chunk")
        if not isinstance(key, (str, int)) or not isinstance(index, int):
            raise _RejectedError("request without a valid key and chunk index")
        chunk = self._chunks.get((key, index))
        if chunk is None:
            raise _RejectedError(f"unknown key {key!r} (chunk {index}); call kv.init(key, array) on every worker first")
        return chunk

    def _op_init(self, msg: Message) -> None:
        meta = msg.meta
        key, index = meta.get("key"), meta.get("chunk")
        dtype_name, shape, key_shape = meta.get("dtype"), meta.get("shape"), meta.get("key_shape")
        if not isinstance(key, (str, int)) or not isinstance(index, int):
            raise _RejectedError("init without a valid key and chunk index")
        if dtype_name not in DTYPE_NAMES or not isinstance(shape, list) or not isinstance(key_shape, list):
            raise _RejectedError("init without a valid dtype and shape")
        if dtype_name == "bfloat16":  # stored as its bit pattern, it cannot be added to: bf16 travels, keys do not
            raise _RejectedError(f"init of key {key!r}: bfloat16 keys are not supported; keep the key float32")
        consistency = meta.get("consistency", "bsp")
        if consistency not in ("bsp", "ssp", "asp"):
            raise _RejectedError(f"init with an unknown consistency {consistency!r}")
        existing = self._chunks.get((key, index))
        if existing is not None:
            if existing.dtype_name != dtype_name or list(existing.key_shape) != key_shape:
                raise _RejectedError(
                    f"key {key!r} exists as {tuple(existing.key_shape)} {existing.dtype_name}, but rank {msg.src} "
                    f"initialises it as {tuple(key_shape)} {dtype_name}: every worker must init a key alike"
                )
            if existing.optimizer is not None and existing.consistency != consistency:
                raise _RejectedError(
                    f"key {key!r} is updated under {existing.consistency}, but rank {msg.src} uses {consistency}: "
                    "every worker of a key must use the same consistency model"
                )
            self._reply(msg.src, meta["id"])
            return
        if not msg.arrays:  # not the first worker: wait until the key exists
            self._waiting_inits.setdefault((key, index), []).append((msg.src, meta))
            return
        value = msg.arrays[0]
        if list(value.shape) != shape or msg.dtypes[0] != dtype_name:
            raise _RejectedError(
                f"init of key {key!r}: data {value.shape} {msg.dtypes[0]} != announced {shape} {dtype_name}"
            )
        replicas = meta.get("replicas", [])
        if not isinstance(replicas, list) or not all(
            isinstance(r, int) and self.num_workers <= r < self.transport.world_size for r in replicas
        ):
            raise _RejectedError(f"init of key {key!r}: replicas must be a list of server ranks")
        optimizer = make_optimizer(meta.get("optimizer"))
        if optimizer is not None and np.dtype(dtype_from_name(dtype_name)).kind != "f":
            raise _RejectedError(f"key {key!r}: an optimizer needs a float array, not {dtype_name}")
        stored = np.array(value, copy=True)
        self._chunks[(key, index)] = StoredChunk(
            value=stored,
            dtype_name=dtype_name,
            key_shape=tuple(key_shape),
            optimizer=optimizer,
            state=optimizer.init_state(stored) if optimizer is not None else {},
            consistency=str(consistency),
            mode=mode_of(str(consistency)),
            staleness_lr=bool(meta.get("staleness_lr", False)),
            eager=bool(meta.get("eager", False)),
            replicas=tuple(replicas),
        )
        self._share(self._chunks[(key, index)])
        self._replicated = self._replicated or len(replicas) > 1
        self._reply(msg.src, meta["id"])
        for worker, waiting in self._waiting_inits.pop((key, index), []):
            fake = Message(src=worker, tag=REQUEST_TAG, meta=waiting)
            self._handle(fake)

    def _rows_of(self, chunk: StoredChunk, msg: Message, n_arrays: int) -> npt.NDArray[np.int64] | None:
        if not msg.meta.get("rows"):
            return None
        rows = msg.arrays[0]
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise _RejectedError("row ids must be a 1-D integer array")
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= chunk.value.shape[0]):
            raise _RejectedError(f"row ids outside 0..{chunk.value.shape[0] - 1} of chunk {msg.meta.get('chunk')}")
        return rows.astype(np.int64, copy=False)

    def _push_data(self, chunk: StoredChunk, msg: Message) -> tuple[npt.NDArray[np.int64] | None, npt.NDArray[Any]]:
        """The row ids (or None) and the data of a push or a forwarded push, validated against ``chunk``."""
        rows = self._rows_of(chunk, msg, 2)
        data = msg.arrays[-1] if msg.arrays else None
        if data is not None and (msg.dtypes[-1], chunk.dtype_name) in _WIDENED:
            # a gradient compressed to 16 bits for the wire (compression="fp16"/"bf16"): added at the key's width
            data = bf16_to_f32(data) if msg.dtypes[-1] == "bfloat16" else data
            data = data.astype(chunk.value.dtype, copy=False)
        elif data is None or msg.dtypes[-1] != chunk.dtype_name:
            got = msg.dtypes[-1] if msg.arrays else "nothing"
            raise _RejectedError(f"push to key {msg.meta['key']!r} of dtype {chunk.dtype_name} carries {got}")
        expected = chunk.value.shape if rows is None else (rows.size, *chunk.value.shape[1:])
        if data.shape != expected:
            raise _RejectedError(
                f"push to key {msg.meta['key']!r} chunk {msg.meta['chunk']} has shape {data.shape}, expected "
                f"{expected} (the key is {chunk.key_shape} {chunk.dtype_name})"
            )
        return rows, data

    def _consume(self, worker: int, seq: Any, wclock: Any, *, count: bool = True) -> bool:
        """Whether push ``seq`` of ``worker`` is new here (to apply), recording it and counting it as held for the
        worker's clock ``wclock`` if so (unless ``count`` is False: a notice of it counted it already). A push
        without a sequence number (unreplicated) is always new."""
        if not isinstance(seq, int):
            return True
        applied = self._applied.setdefault(worker, set())
        if seq in applied:
            self.stats.duplicates += 1
            return False
        applied.add(seq)
        if count and isinstance(wclock, int):
            self._held[(worker, wclock)] = self._held.get((worker, wclock), 0) + 1
        return True

    def _apply(
        self,
        chunk: StoredChunk,
        rows: npt.NDArray[np.int64] | None,
        data: npt.NDArray[Any],
        round_id: int,
        read: Any,
        *,
        densify: bool = False,
    ) -> None:
        self.stats.bytes_in += data.nbytes
        if chunk.optimizer is None:
            self._quiesce(chunk)
            if rows is None:
                np.add(chunk.value, data, out=chunk.value)
            else:
                np.add.at(chunk.value, rows, data)
        else:
            weight = staleness_weight(round_id, read if isinstance(read, int) else None, aware=chunk.staleness_lr)
            self._settle(chunk)  # a state in flight may still read the open rounds' sums
            chunk.pending.setdefault(round_id, RoundSum()).add(data, rows, weight, chunk.value, densify=densify)
            chunk.view = None
            self._commit(chunk)

    def _op_push(self, msg: Message) -> None:
        chunk = self._chunk(msg.meta)
        seq = msg.meta.get("seq")
        if isinstance(seq, int) and len(chunk.replicas) > 1 and chunk.mode == "clock":
            self._push_aggregated(chunk, msg, seq)
            return
        new = self._consume(msg.src, seq, msg.meta.get("wclock"))
        replicated = len(chunk.replicas) > 1 and isinstance(seq, int)
        try:
            rows, data = self._push_data(chunk, msg)
        except _RejectedError:
            if replicated and new:  # the backups count it too (applying nothing), so no clock waits for it
                self._forward(chunk, msg, {"skip": True, "id": -1}, ())
            raise
        self.stats.pushes += 1
        round_id = round_of_push(chunk.mode, self.done[msg.src], chunk.version)
        # forward to the other live replicas first, so that they apply it while this server does (again after a
        # failover: they drop what they already have); the frames are read, never written, so they go zero-copy
        waiting: set[int] = set()
        forward_id = self._forward_ids
        if replicated:
            arrays = [wire_array(a, name) for a, name in zip(msg.arrays, msg.dtypes, strict=True)]  # bfloat16 stays so
            waiting = self._forward(chunk, msg, {"id": forward_id, "round": round_id}, arrays)
        if new:
            self._apply(chunk, rows, data, round_id, msg.meta.get("version"), densify=bool(msg.meta.get("densify")))
        if waiting:
            self._forward_ids += 1
            self._forwards[forward_id] = _Forward([(msg.src, msg.meta["id"])], waiting)
        else:
            self._reply(msg.src, msg.meta["id"])

    # -- replication after aggregation (BSP, SSP) ------------------------------------------------------------

    def _push_aggregated(self, chunk: StoredChunk, msg: Message, seq: int) -> None:
        """A worker's push to a replicated chunk under BSP/SSP: applied here, made known to the other replicas at
        once (a ``notice``: no data), and answered once a state of the chunk that holds it reached them
        (:meth:`_send_states`). A push another replica had applied and told this one of (it died before its
        state came) joins the round it joined there."""
        worker, ck = msg.src, (msg.meta["key"], msg.meta["chunk"])
        wclock = msg.meta.get("wclock")
        wclock = wclock if type(wclock) is int else -1
        noticed = chunk.awaited.pop((worker, seq), None)
        new = self._consume(worker, seq, msg.meta.get("wclock"), count=noticed is None)
        try:
            rows, data = self._push_data(chunk, msg)
        except _RejectedError:
            if new:  # the backups count it too (applying nothing), so no clock waits for it
                self._forward(chunk, msg, {"op": "notice", "id": -1, "skip": True}, ())
            raise
        chunk.owned = True
        me = self.transport.rank
        alone = all(s == me or s in self._servers_lost for s in chunk.replicas)  # the last live replica
        if not new:
            # a state of the owner that died had it; it goes on in this one's next state (now), which tells a
            # replica that the dead owner's state did not reach that it holds the push
            if alone:
                self._reply(worker, msg.meta["id"])
            else:
                chunk.unsent.append((worker, msg.meta["id"], seq, -1, wclock))
                self._unsent.add(ck)
                self._send_states(flush=worker)
            return
        self.stats.pushes += 1
        round_id = noticed if noticed is not None else round_of_push(chunk.mode, self.done[worker], chunk.version)
        self._forward(chunk, msg, {"op": "notice", "id": -1, "round": round_id}, ())
        self._apply(chunk, rows, data, round_id, msg.meta.get("version"), densify=bool(msg.meta.get("densify")))
        if alone:
            self._reply(worker, msg.meta["id"])
        else:
            chunk.unsent.append((worker, msg.meta["id"], seq, round_id, wclock))
            self._unsent.add(ck)
        if noticed is not None and self._waiting_pulls:
            self._advance()  # a pull (or a round) may have waited for this push's data
        elif round_id < self._min_done or worker in self._flushing:
            self._send_states(flush=worker)

    def _send_states(self, flush: int | None = None) -> None:
        """Sends the state of every chunk whose pushes of a complete round (or, with ``flush``, of that worker) are
        not yet on the other replicas: to each other live replica, in messages of up to :data:`MAX_BATCH` chunks
        and :data:`BATCH_BYTES` bytes (``replicate_states``), acknowledged in one message each. The workers of the
        pushes a state holds are answered once every replica it went to acknowledged it."""
        me = self.transport.rank
        outbox: dict[int, list[tuple[dict[str, Any], list[Any]]]] = {}
        for ck in list(self._unsent):
            chunk = self._chunks.get(ck)
            if chunk is None or not chunk.unsent:
                self._unsent.discard(ck)
                continue
            if min(e[3] for e in chunk.unsent) >= self._min_done and all(e[0] != flush for e in chunk.unsent):
                continue
            entries, chunk.unsent = chunk.unsent, []
            self._unsent.discard(ck)
            targets = {s for s in chunk.replicas if s != me and s not in self._servers_lost}
            forward = _Forward([(worker, request_id) for worker, request_id, *_ in entries], targets)
            if not targets:
                self._answer_forward(forward)
                continue
            forward_id = self._forward_ids
            self._forward_ids += 1
            self._forwards[forward_id] = forward
            meta, arrays = chunk_message(ck[0], ck[1], chunk)
            pushes = [[w, seq, wclock] for w, _, seq, _, wclock in entries]
            meta.update(op="replicate_state", id=forward_id, pushes=pushes)
            for server in targets:
                outbox.setdefault(server, []).append((meta, arrays))
        for server, items in outbox.items():
            start = 0
            while start < len(items):  # messages of up to MAX_BATCH states and BATCH_BYTES (at least one state)
                stop, size = start + 1, _nbytes(items[start][1])
                while stop < len(items) and stop - start < MAX_BATCH and size + _nbytes(items[stop][1]) <= BATCH_BYTES:
                    size += _nbytes(items[stop][1])
                    stop += 1
                self._send_state_batch(server, items[start:stop])
                start = stop

    def _send_state_batch(self, server: int, items: list[tuple[dict[str, Any], list[Any]]]) -> None:
        metas, arrays = pack(items)
        ids = [int(meta["id"]) for meta, _ in items]
        try:
            handle = self.transport.isend(
                server, REQUEST_TAG, arrays, {"op": "replicate_states", "id": -1, "ops": metas}
            )
        except (PeerLostError, TransportClosedError) as exc:
            log.warning("server %d: cannot send states to server %d: %s", self.transport.rank, server, exc)
            self._unreachable(server, ids)
            return
        self.stats.states_sent += len(items)
        self.stats.forward_messages += 1
        if not handle.done():  # (sent zero-copy: the chunks wait for it before they change)
            for meta, _ in items:
                self._chunks[(meta["key"], meta["chunk"])].sends.append(handle)

    def _op_flush(self, msg: Message) -> None:
        """A worker waits for a push before its clock completes the push's round: its state goes now, and so do
        those of its pushes that arrive before that clock (sent again to this server after their owner died)."""
        self._flushing.add(msg.src)
        self._send_states(flush=msg.src)

    def _op_notice(self, msg: Message) -> None:
        """Another replica applied a worker's push (or, ``skip``, rejected it): counted towards the worker's clock
        here, its data awaited in that replica's next state (or from the worker, should that replica die)."""
        meta = msg.meta
        worker, seq = meta.get("worker"), meta.get("seq")
        if not isinstance(worker, int) or worker not in self.done or not isinstance(seq, int):
            raise _RejectedError("notice without a valid worker and sequence number")
        chunk = self._chunk(meta)
        if meta.get("skip"):
            self._consume(worker, seq, meta.get("wclock"))
            return
        round_id = meta.get("round")
        if not isinstance(round_id, int):
            raise _RejectedError("notice without a valid round")
        if seq in self._applied.get(worker, ()) or (worker, seq) in chunk.awaited:
            return  # known already (a state had it, or its first owner told this one before it died)
        wclock = meta.get("wclock")
        if isinstance(wclock, int):
            self._held[(worker, wclock)] = self._held.get((worker, wclock), 0) + 1
        chunk.awaited[(worker, seq)] = round_id

    def _op_replicate_states(self, msg: Message) -> None:
        """Another replica's states of chunks (:meth:`_send_states`): each checked, all acknowledged in one message,
        then installed in place of this one's, with the pushes each holds. Acknowledged before the copies: from
        then on this process holds the states, and its death would lose them copied or not."""
        try:
            entries = unpack(msg, "ops")
        except ValueError as exc:
            raise _RejectedError(f"malformed states: {exc}") from None
        ids: list[int] = []
        errors: list[str | None] = []
        valid: list[tuple[StoredChunk, StoredChunk, list[list[int]]]] = []
        for entry in entries:
            try:
                if entry.meta.get("op") != "replicate_state" or type(entry.meta.get("id")) is not int:
                    raise _RejectedError("a states message holds replicate_state entries with integer ids")
                valid.append(self._check_state(entry))
                error = None
            except _RejectedError as exc:
                error = f"backup {exc}"
                self.stats.rejected += 1
                log.error("server %d rejected a state from server %d: %s", self.transport.rank, msg.src, exc)
            ids.extend(forward_ids(entry.meta))
            errors.extend([error] * len(forward_ids(entry.meta)))
        if ids:
            self._acknowledge(msg.src, ids, errors)
        resolved = False
        for chunk, got, pushes in valid:
            resolved = self._install_state(chunk, got, pushes) or resolved
        if resolved and self._waiting_pulls:
            self._advance()

    def _check_state(self, msg: Message) -> tuple[StoredChunk, StoredChunk, list[list[int]]]:
        """This server's chunk, the state another replica sent of it (its arrays still the message's), the pushes
        it holds; or why it cannot be installed."""
        meta = msg.meta
        chunk = self._chunk(meta)
        pushes = meta.get("pushes")
        if not isinstance(pushes, list) or not all(
            isinstance(p, list) and len(p) == 3 and all(type(x) is int for x in p) for p in pushes
        ):
            raise _RejectedError("state without a valid list of pushes")
        try:
            _, got = read_chunk(msg, servers=range(self.num_workers, self.transport.world_size), copy=False)
        except CatchUpError as exc:
            raise _RejectedError(str(exc)) from None
        if chunk.owned:  # two owners: a worker took this live server for dead; neither copy may be lost silently
            raise _RejectedError(
                f"chunk {meta.get('chunk')} of key {meta.get('key')!r} is owned here: server {msg.src} took it over "
                f"while server {self.transport.rank} is alive (a worker counted it as dead); restart the job"
            )
        if (
            got.dtype_name != chunk.dtype_name
            or got.value.shape != chunk.value.shape
            or sorted(got.state) != sorted(chunk.state)
            or any(got.state[n].shape != chunk.state[n].shape for n in got.state)
        ):
            raise _RejectedError(f"state of key {meta.get('key')!r} chunk {meta.get('chunk')} does not fit the chunk")
        return chunk, got, pushes

    def _install_state(self, chunk: StoredChunk, got: StoredChunk, pushes: list[list[int]]) -> bool:
        """Makes ``chunk`` the state ``got``; whether that brought the data of a push this server awaited."""
        chunk.view = None
        self._quiesce(chunk)
        np.copyto(chunk.value, got.value)
        for name, array in got.state.items():
            np.copyto(chunk.state[name], array)
        chunk.pending, chunk.version, chunk.owned = got.pending, got.version, False
        self.stats.replicated += len(pushes)
        resolved = False
        for worker, seq, wclock in pushes:
            if worker not in self.done:
                continue
            applied = self._applied.setdefault(worker, set())
            if chunk.awaited.pop((worker, seq), None) is not None:
                resolved = True
            elif seq not in applied and wclock >= 0:  # its notice is still on its way: counted here instead
                self._held[(worker, wclock)] = self._held.get((worker, wclock), 0) + 1
            applied.add(seq)
        return resolved

    def _awaits(self, meta: Mapping[str, Any]) -> bool:
        """Whether a pull must wait for pushes of the rounds it reads whose data this replica does not hold yet."""
        chunk = self._chunks.get((meta.get("key"), meta.get("chunk")))  # type: ignore[arg-type]
        if chunk is None or not chunk.awaited:
            return False
        required = meta.get("required")
        return not isinstance(required, int) or min(chunk.awaited.values()) < required

    def _forward(self, chunk: StoredChunk, msg: Message, fields: dict[str, Any], arrays: Sequence[Any]) -> set[int]:
        """Sends worker push ``msg`` on to the chunk's other live replicas (``replicate``); returns their ranks."""
        meta = {
            "op": "replicate",
            "key": msg.meta["key"],
            "chunk": msg.meta["chunk"],
            "worker": msg.src,
            "seq": msg.meta["seq"],
            "wclock": msg.meta.get("wclock"),
            "version": msg.meta.get("version"),
            "rows": bool(msg.meta.get("rows")),
            "densify": bool(msg.meta.get("densify")),
            **fields,
        }
        me = self.transport.rank
        sent: set[int] = set()
        for server in chunk.replicas:
            if server == me or server in self._servers_lost:
                continue
            if self._outbox is not None:  # inside a worker's batch: sent with the batch's other forwards
                self._outbox.setdefault(server, []).append((meta, arrays))
                sent.add(server)
                self.stats.forwarded += 1
                continue
            try:
                self.transport.isend(server, REQUEST_TAG, arrays, meta)
            except (PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: cannot forward to server %d: %s", me, server, exc)
                continue
            sent.add(server)
            self.stats.forwarded += 1
            self.stats.forward_messages += 1
        return sent

    def _flush_forwards(self) -> None:
        """Sends the forwards a worker's batch collected, one message per backup (:mod:`.protocol`). A backup
        that cannot be reached is not waited for (as when a forward alone cannot be sent)."""
        outbox, self._outbox = self._outbox or {}, None
        for server, items in outbox.items():
            if len(items) == 1:
                meta, arrays = items[0]
            else:
                metas, arrays = pack(items)
                meta = {"op": "replicate_batch", "id": -1, "ops": metas}
            try:
                self.transport.isend(server, REQUEST_TAG, arrays, meta)
                self.stats.forward_messages += 1
            except (PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: cannot forward to server %d: %s", self.transport.rank, server, exc)
                self._unreachable(server, [m["id"] for m, _ in items])

    def _unreachable(self, server: int, ids: Sequence[int]) -> None:
        """Stops waiting for ``server`` to acknowledge forwards ``ids`` (it cannot be reached: it died)."""
        for forward_id in ids:
            forward = self._forwards.get(forward_id)
            if forward is not None:
                forward.waiting.discard(server)
                if not forward.waiting:
                    del self._forwards[forward_id]
                    self._answer_forward(forward)

    def _op_replicate(self, msg: Message) -> None:
        """A push another replica applied: apply it here in the same round, then acknowledge it to that server."""
        if self._replicate(msg):
            self._acknowledge(msg.src, [msg.meta["id"]], [None])

    def _op_replicate_batch(self, msg: Message) -> None:
        """The forwards of one worker's batch (:mod:`.protocol`): each applied as if it came alone, in order, and
        acknowledged together in one message (a rejected one with its error)."""
        try:
            forwards = unpack(msg, "ops")
        except ValueError as exc:
            raise _RejectedError(f"malformed replicate batch: {exc}") from None
        ids: list[int] = []
        errors: list[str | None] = []
        for forward in forwards:
            try:
                if forward.meta.get("op") not in ("replicate", "notice") or type(forward.meta.get("id")) is not int:
                    raise _RejectedError("a replicate batch holds replicate requests and notices with integer ids")
                if forward.meta["op"] == "notice":
                    self._op_notice(forward)
                    continue
                if not self._replicate(forward):
                    continue
                error = None
            except _RejectedError as exc:
                error = str(exc)
            except Exception as exc:  # as _handle: a bug must not take the server down
                log.exception("server %d: a forward from server %d failed", self.transport.rank, msg.src)
                error = f"server error: {type(exc).__name__}: {exc}"
            if error is not None:
                self.stats.rejected += 1
                log.error("server %d rejected a forward from server %d: %s", self.transport.rank, msg.src, error)
            ids.extend(forward_ids(forward.meta))
            errors.extend([None if error is None else f"backup {error}"] * len(forward_ids(forward.meta)))
        if ids:
            self._acknowledge(msg.src, ids, errors)

    def _acknowledge(self, server: int, ids: list[int], errors: list[str | None]) -> None:
        """Tells ``server`` that its forwards ``ids`` are applied here (or why not, per id)."""
        meta: dict[str, Any] = (
            {"op": "replicated", "id": ids[0], "error": errors[0]}
            if len(ids) == 1
            else {"op": "replicated", "id": -1, "ids": ids, "errors": errors}
        )
        try:
            self.transport.isend(server, REQUEST_TAG, (), meta)
        except (PeerLostError, TransportClosedError) as exc:
            log.warning("server %d: cannot acknowledge to server %d: %s", self.transport.rank, server, exc)

    def _replicate(self, msg: Message) -> bool:
        """Applies forward ``msg`` here in the round it joined at its owner; whether to acknowledge it.

        It counts towards its worker's clock here (``wclock``) even when it carries nothing to apply (``skip``: its
        owner rejected it, and nobody waits for an acknowledgement), so that the clock is not held back for it."""
        meta = msg.meta
        worker, round_id = meta.get("worker"), meta.get("round")
        if not isinstance(worker, int) or worker not in self.done:
            raise _RejectedError("replicate without a valid worker")
        chunk = self._chunk(meta)
        new = self._consume(worker, meta.get("seq"), meta.get("wclock"))
        if meta.get("skip"):
            return False
        if not isinstance(round_id, int):
            raise _RejectedError("replicate without a valid round")
        rows, data = self._push_data(chunk, msg)
        if new:
            self.stats.replicated += 1
            self._apply(
                chunk,
                rows,
                data,
                max(round_id, chunk.version) if chunk.mode == "clock" else round_id,
                meta.get("version"),
                densify=bool(meta.get("densify")),
            )
        return True

    def _op_replicated(self, msg: Message) -> None:
        """A backup has forwarded pushes (one, or a batch's): answer each worker once every backup has its push."""
        ids, errors = msg.meta.get("ids"), msg.meta.get("errors")
        if not isinstance(ids, list):
            ids, errors = [msg.meta["id"]], [msg.meta.get("error")]
        if not isinstance(errors, list) or len(errors) != len(ids):
            errors = [None] * len(ids)
        for forward_id, error in zip(ids, errors, strict=True):
            forward = self._forwards.get(forward_id) if type(forward_id) is int else None
            if forward is None:
                continue
            forward.waiting.discard(msg.src)
            if isinstance(error, str):
                forward.error = f"server {msg.src}: {error}"
            if not forward.waiting:
                del self._forwards[forward_id]
                self._answer_forward(forward)

    def _answer_forward(self, forward: _Forward) -> None:
        if forward.error is not None:
            self.stats.rejected += 1
        for worker, request_id in forward.answers:
            if forward.error is None:
                self._reply(worker, request_id)
            else:
                self._reply(worker, request_id, error=forward.error)

    def _op_pull(self, msg: Message) -> None:
        self._chunk(msg.meta)  # validates now: an unknown key is an error at once, not after waiting
        if self._ready(msg.meta) and not self._awaits(msg.meta):
            self._answer_pull(msg)
        else:
            self.stats.deferred_pulls += 1
            self._waiting_pulls.append((msg.src, msg.meta, msg))

    def _answer_pull(self, msg: Message) -> None:
        try:
            chunk = self._chunk(msg.meta)
            rows = self._rows_of(chunk, msg, 1)
        except _RejectedError as exc:
            self._reject(msg, str(exc))
            return
        self.stats.pulls += 1
        if chunk.eager and chunk.pending and chunk.optimizer is not None:
            if chunk.view is None:
                chunk.view = preview(chunk.optimizer, chunk.value, chunk.state, chunk.pending)
            view = chunk.view  # a fresh array, never modified afterwards: sent without waiting
            self._reply(msg.src, msg.meta["id"], [view if rows is None else view[rows]], version=chunk.version)
        elif rows is None and chunk.shared is not None and msg.meta.get("ref") is True:
            # the worker copies it out itself (.shared): the sequence number says which value it must find
            self.stats.pulls_in_place += 1
            self._reply(msg.src, msg.meta["id"], ref=chunk.shared.name, seq=chunk.shared.seq, version=chunk.version)
        elif rows is None:
            self._reply(msg.src, msg.meta["id"], [chunk.value], chunk=chunk, version=chunk.version)
        else:
            self._reply(msg.src, msg.meta["id"], [chunk.value[rows]], version=chunk.version)

    def idle_since(self) -> float:
        """Monotonic time now (a hook for tests that want to see the loop is alive)."""
        return time.monotonic()
