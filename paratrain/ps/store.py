"""What one parameter server holds, shared by its protocols: the chunks, the workers' clocks, and the replies.

The server's loop (:mod:`.server`), replication (:mod:`.replication`) and the catch-up donor (:mod:`.donor`) are
objects over one :class:`ServerStore`: a key's chunks are created and read here, pushes are validated and applied
here (in rounds, :mod:`.rounds`), and every answer to a worker leaves through :meth:`ServerStore.reply` (alone, or
with the other replies of the batch it came in, :mod:`.protocol`). One thread owns it all: no locks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain._arrays import DTYPE_NAMES, dtype_from_name
from paratrain.collectives.ops import bf16_to_f32
from paratrain.errors import CommTimeoutError, PeerLostError, TransportClosedError
from paratrain.ps.consistency import required_met
from paratrain.ps.optim import make_optimizer
from paratrain.ps.protocol import pack, reply_tag
from paratrain.ps.resync import StoredChunk
from paratrain.ps.rounds import RoundSum, commit_ready, mode_of, preview, staleness_weight
from paratrain.ps.shared import SHARED_MIN_BYTES, SharedValue, value_prefix
from paratrain.transport.base import Transport
from paratrain.transport.wire import Message

__all__ = ["INCARNATION_BITS", "ChunkMovedError", "RejectedError", "ServerStats", "ServerStore", "lost_push_error"]

log = logging.getLogger("paratrain.ps.server")

#: A worker process restarted in a job that restarts workers numbers its pushes from ``incarnation << INCARNATION_BITS``
#: (:meth:`ServerStore.stale`).
INCARNATION_BITS = 40


def lost_push_error(worker: int, round_id: int, key: Any) -> str:
    """Why a job with restarted workers cannot go on exactly: a dead worker's push of a counted clock is lost."""
    return (
        f"worker {worker}'s push of clock {round_id} to key {key!r} was lost: the worker and every server that held "
        "its data died before it reached another replica, and the clock is counted, so no replacement makes it "
        "again. The job cannot go on exactly: restart it"
    )


#: (wire dtype, key dtype) pairs a push may widen: gradients compressed to 16 bits for the wire
_WIDENED = frozenset((w, k) for w in ("float16", "bfloat16") for k in ("float32", "float64"))


class RejectedError(Exception):
    """A request the server refuses; the message goes back to the worker."""


class ChunkMovedError(RejectedError):
    """A request for a chunk that moved to another server (:mod:`.resize`): the worker sends it there."""


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
    chunks_adopted: int = 0  # chunks that moved here from other servers (.resize)
    chunks_given: int = 0  # chunks that moved from here to other servers (.resize)


@dataclass
class Batch:
    """A worker's batch request (:mod:`.protocol`): its replies as they come, sent together with the last."""

    worker: int
    request_id: int
    replies: list[tuple[dict[str, Any], list[Any], StoredChunk | None]]
    left: int


class ServerStore:
    """The state of one server over ``transport``: workers ``0..num_workers-1``, servers at ranks ``servers``.

    Attributes:
        chunks: (key, chunk index) -> the chunk as stored here.
        done: each worker's completed clocks; ``live``: the workers taking part; ``min_done``: the slowest one's.
        applied: per worker, the push sequence numbers applied here (replication: each is applied once).
        held: (worker, its clock) -> that clock's pushes held here (a clock is counted once it holds them all).
        servers_lost: other servers seen dead (or restarted and not yet sent their copy).
        waiting_pulls: pulls deferred until the consistency rule (or a push's data) allows them.
    """

    def __init__(self, transport: Transport, *, num_workers: int, servers: Sequence[int], timeout: float) -> None:
        self.transport = transport
        self.num_workers = num_workers
        self.servers = tuple(servers)
        self.timeout = timeout
        self.stats = ServerStats()
        self.chunks: dict[tuple[Any, int], StoredChunk] = {}
        self.done: dict[int, int] = dict.fromkeys(range(num_workers), 0)
        self.live: set[int] = set(range(num_workers))
        self.min_done = 0
        self.applied: dict[int, set[int]] = {}
        self.held: dict[tuple[int, int], int] = {}
        self.servers_lost: set[int] = set()
        self.waiting_pulls: list[tuple[int, Mapping[str, Any], Message]] = []
        self.waiting_inits: dict[tuple[Any, int], list[tuple[int, Mapping[str, Any]]]] = {}
        # (worker, request id) of a request that came in a batch -> the batch and its place in it
        self.batched: dict[tuple[int, int], tuple[Batch, int]] = {}
        self.keep_previous = False  # keep each BSP chunk's value from before its last step (.rejoin)
        self.absent: set[int] = set()  # dead workers whose places are held (.rejoin): live, but pushing nothing
        self.moved: set[tuple[Any, int]] = set()  # chunks that moved to another server (.resize)

    # -- replies -------------------------------------------------------------------------------------------

    def reply(
        self,
        worker: int,
        request_id: int,
        arrays: Sequence[Any] = (),
        *,
        chunk: StoredChunk | None = None,
        **fields: Any,
    ) -> None:
        """Answers request ``request_id`` of ``worker`` (or keeps the answer for its batch's one message)."""
        meta = {"done": self.min_done, **fields}
        batched = self.batched.pop((worker, request_id), None)
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

    def _answer_batch(self, batch: Batch) -> None:
        metas, arrays = pack([(meta, arrs) for meta, arrs, _ in batch.replies])
        try:
            handle = self.transport.isend(
                batch.worker, reply_tag(batch.request_id), arrays, {"done": self.min_done, "replies": metas}
            )
        except (PeerLostError, TransportClosedError) as exc:
            log.warning("server %d: cannot answer rank %d: %s", self.transport.rank, batch.worker, exc)
            return
        self.stats.bytes_out += sum(int(getattr(a, "nbytes", 0)) for a in arrays)
        if not handle.done():
            for _, _, chunk in batch.replies:
                if chunk is not None:
                    chunk.sends.append(handle)

    # -- values in memory ----------------------------------------------------------------------------------

    def share(self, chunk: StoredChunk) -> None:
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

    def unshare(self) -> None:
        for chunk in self.chunks.values():
            if chunk.shared is not None:
                chunk.shared.unlink()

    def quiesce(self, chunk: StoredChunk) -> None:
        """Waits until no reply still reads ``chunk.value`` (sent zero-copy) before it is modified, and tells
        same-host workers that may be copying it in place (:mod:`.shared`). Every change of a value calls it."""
        if chunk.shared is not None:
            chunk.shared.changing()
        self.settle(chunk)

    def settle(self, chunk: StoredChunk) -> None:
        """Waits until no message still reads ``chunk``'s arrays (replies and states are sent zero-copy)."""
        for handle in chunk.sends:
            try:
                handle.wait(self.timeout)
            except (CommTimeoutError, PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: reply not delivered: %s", self.transport.rank, exc)
        chunk.sends.clear()

    def flush_sends(self) -> None:
        for chunk in self.chunks.values():
            self.quiesce(chunk)

    # -- workers -------------------------------------------------------------------------------------------

    def ready(self, meta: Mapping[str, Any]) -> bool:
        """Whether the consistency rule a request asks for (``required``) holds now."""
        required = meta.get("required")
        return required_met(None if required is None else int(required), self.min_done if self.live else None)

    def forget(self, worker: int, *, awaited: bool = True) -> None:
        """Drops what replication kept of ``worker`` (it left, joined again or died); ``awaited=False`` keeps the
        pushes whose data another replica holds (a dead worker's place held for its replacement: its counted
        clocks need that data, which comes in that replica's state)."""
        self.applied.pop(worker, None)
        for pending in [b for b in self.batched if b[0] == worker]:
            del self.batched[pending]
        self.drop_held(worker, awaited=awaited)

    def drop_waiting(self, worker: int) -> None:
        """Drops ``worker``'s pulls and inits still waiting here (its process died: their ids died with it, and a
        replacement numbers its requests afresh); its batches went with :meth:`forget`, called first."""
        self.waiting_pulls = [p for p in self.waiting_pulls if p[0] != worker]
        for waiting in self.waiting_inits.values():
            waiting[:] = [w for w in waiting if w[0] != worker]

    def drop_held(self, worker: int, *, awaited: bool = True) -> None:
        """Stops counting ``worker``'s pushes towards its clocks and (``awaited``) waiting for their data (it left
        or died: it will not send them again)."""
        for held in [h for h in self.held if h[0] == worker]:
            del self.held[held]
        if not awaited:
            return
        for chunk in self.chunks.values():
            if chunk.awaited:
                for pending in [a for a in chunk.awaited if a[0] == worker]:
                    del chunk.awaited[pending]

    def stale(self, worker: int, seq: Any) -> bool:
        """Whether push number ``seq`` of ``worker`` was made by a predecessor of the worker's process now (a job
        that restarts workers numbers each process's pushes from ``incarnation << INCARNATION_BITS``, :mod:`.rejoin`):
        its data may still count in a state, but its replacement's clock does not wait for it."""
        if not self.keep_previous or not isinstance(seq, int):
            return False
        return seq >> INCARNATION_BITS < self.transport.incarnations().get(worker, 0)

    def consume(self, worker: int, seq: Any, wclock: Any, *, count: bool = True) -> bool:
        """Whether push ``seq`` of ``worker`` is new here (to apply), recording it and counting it as held for the
        worker's clock ``wclock`` if so (unless ``count`` is False: a notice of it counted it already). A push
        without a sequence number (unreplicated) is always new."""
        if not isinstance(seq, int):
            return True
        applied = self.applied.setdefault(worker, set())
        if seq in applied:
            self.stats.duplicates += 1
            return False
        applied.add(seq)
        if count and isinstance(wclock, int) and not self.stale(worker, seq):
            self.held[(worker, wclock)] = self.held.get((worker, wclock), 0) + 1
        return True

    # -- keys ----------------------------------------------------------------------------------------------

    def chunk(self, meta: Mapping[str, Any]) -> StoredChunk:
        key, index = meta.get("key"), meta.get("chunk")
        if not isinstance(key, (str, int)) or not isinstance(index, int):
            raise RejectedError("request without a valid key and chunk index")
        chunk = self.chunks.get((key, index))
        if chunk is None and (key, index) in self.moved:
            raise ChunkMovedError(f"key {key!r} chunk {index} moved to another server")
        if chunk is None:
            raise RejectedError(f"unknown key {key!r} (chunk {index}); call kv.init(key, array) on every worker first")
        return chunk

    def init(self, msg: Message) -> list[tuple[int, Mapping[str, Any]]]:
        """Creates a key's chunk (the first worker's init carries its value), or answers an init of one that
        exists, or keeps it until the chunk exists; the inits that waited for this one, to handle now.

        Raises:
            RejectedError: the init is malformed or disagrees with the chunk stored.
        """
        meta = msg.meta
        key, index = meta.get("key"), meta.get("chunk")
        dtype_name, shape, key_shape = meta.get("dtype"), meta.get("shape"), meta.get("key_shape")
        if not isinstance(key, (str, int)) or not isinstance(index, int):
            raise RejectedError("init without a valid key and chunk index")
        if dtype_name not in DTYPE_NAMES or not isinstance(shape, list) or not isinstance(key_shape, list):
            raise RejectedError("init without a valid dtype and shape")
        if dtype_name == "bfloat16":  # stored as its bit pattern, it cannot be added to: bf16 travels, keys do not
            raise RejectedError(f"init of key {key!r}: bfloat16 keys are not supported; keep the key float32")
        consistency = meta.get("consistency", "bsp")
        if consistency not in ("bsp", "ssp", "asp"):
            raise RejectedError(f"init with an unknown consistency {consistency!r}")
        if (key, index) in self.moved:
            raise ChunkMovedError(f"key {key!r} chunk {index} moved to another server")
        existing = self.chunks.get((key, index))
        if existing is not None:
            if existing.dtype_name != dtype_name or list(existing.key_shape) != key_shape:
                raise RejectedError(
                    f"key {key!r} exists as {tuple(existing.key_shape)} {existing.dtype_name}, but rank {msg.src} "
                    f"initialises it as {tuple(key_shape)} {dtype_name}: every worker must init a key alike"
                )
            if existing.optimizer is not None and existing.consistency != consistency:
                raise RejectedError(
                    f"key {key!r} is updated under {existing.consistency}, but rank {msg.src} uses {consistency}: "
                    "every worker of a key must use the same consistency model"
                )
            self.reply(msg.src, meta["id"])
            return []
        if not msg.arrays:  # not the first worker: wait until the key exists
            self.waiting_inits.setdefault((key, index), []).append((msg.src, meta))
            return []
        value = msg.arrays[0]
        if list(value.shape) != shape or msg.dtypes[0] != dtype_name:
            raise RejectedError(
                f"init of key {key!r}: data {value.shape} {msg.dtypes[0]} != announced {shape} {dtype_name}"
            )
        replicas = meta.get("replicas", [])
        if not isinstance(replicas, list) or not all(isinstance(r, int) and r in self.servers for r in replicas):
            raise RejectedError(f"init of key {key!r}: replicas must be a list of server ranks")
        optimizer = make_optimizer(meta.get("optimizer"))
        if optimizer is not None and np.dtype(dtype_from_name(dtype_name)).kind != "f":
            raise RejectedError(f"key {key!r}: an optimizer needs a float array, not {dtype_name}")
        stored = np.array(value, copy=True)
        self.chunks[(key, index)] = StoredChunk(
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
            num_chunks=num_chunks if type(num_chunks := meta.get("chunks", 0)) is int and num_chunks > index else 0,
        )
        self.share(self.chunks[(key, index)])
        self.reply(msg.src, meta["id"])
        return self.waiting_inits.pop((key, index), [])

    def rows_of(self, chunk: StoredChunk, msg: Message) -> npt.NDArray[np.int64] | None:
        """The row ids a row push or pull addresses (None: the whole chunk), validated against ``chunk``."""
        if not msg.meta.get("rows"):
            return None
        rows = msg.arrays[0]
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise RejectedError("row ids must be a 1-D integer array")
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= chunk.value.shape[0]):
            raise RejectedError(f"row ids outside 0..{chunk.value.shape[0] - 1} of chunk {msg.meta.get('chunk')}")
        return rows.astype(np.int64, copy=False)

    def push_data(self, chunk: StoredChunk, msg: Message) -> tuple[npt.NDArray[np.int64] | None, npt.NDArray[Any]]:
        """The row ids (or None) and the data of a push or a forwarded push, validated against ``chunk``."""
        rows = self.rows_of(chunk, msg)
        data = msg.arrays[-1] if msg.arrays else None
        if data is not None and (msg.dtypes[-1], chunk.dtype_name) in _WIDENED:
            # a gradient compressed to 16 bits for the wire (compression="fp16"/"bf16"): added at the key's width
            data = bf16_to_f32(data) if msg.dtypes[-1] == "bfloat16" else data
            data = data.astype(chunk.value.dtype, copy=False)
        elif data is None or msg.dtypes[-1] != chunk.dtype_name:
            got = msg.dtypes[-1] if msg.arrays else "nothing"
            raise RejectedError(f"push to key {msg.meta['key']!r} of dtype {chunk.dtype_name} carries {got}")
        expected = chunk.value.shape if rows is None else (rows.size, *chunk.value.shape[1:])
        if data.shape != expected:
            raise RejectedError(
                f"push to key {msg.meta['key']!r} chunk {msg.meta['chunk']} has shape {data.shape}, expected "
                f"{expected} (the key is {chunk.key_shape} {chunk.dtype_name})"
            )
        return rows, data

    def apply(
        self,
        chunk: StoredChunk,
        rows: npt.NDArray[np.int64] | None,
        data: npt.NDArray[Any],
        round_id: int,
        read: Any,
        *,
        densify: bool = False,
        worker: int | None = None,
    ) -> None:
        """Adds a push into the value, or (an optimizer) into its round, stepping every round now complete.

        A BSP round of a job that restarts workers (:mod:`.rejoin`) holds each worker's push and sums them in
        worker order when it completes: floating-point addition is not associative, so with three workers or more
        the order they arrived in would change the last bits, and a recovered run must equal the fault-free one."""
        self.stats.bytes_in += data.nbytes
        if chunk.optimizer is None:
            self.quiesce(chunk)
            if rows is None:
                np.add(chunk.value, data, out=chunk.value)
            else:
                np.add.at(chunk.value, rows, data)
        else:
            weight = staleness_weight(round_id, read if isinstance(read, int) else None, aware=chunk.staleness_lr)
            self.settle(chunk)  # a state in flight may still read the open rounds' sums
            open_round = chunk.pending.setdefault(round_id, RoundSum())
            if self.keep_previous and chunk.consistency == "bsp" and worker is not None:
                part = (data.copy(), None if rows is None else rows.copy(), weight, densify)
                chunk.ordered.setdefault(round_id, {}).setdefault(worker, []).append(part)
            else:
                open_round.add(data, rows, weight, chunk.value, densify=densify)
            chunk.view = None
            self.commit(chunk)

    def commit(self, chunk: StoredChunk) -> None:
        """Takes the step of every complete round of ``chunk``, oldest first (the rule of :mod:`.rounds`)."""
        if chunk.optimizer is None:
            return
        limit = self.min_done
        if len(chunk.replicas) > 1 and chunk.mode == "clock":
            if not chunk.owned:
                return  # a backup's rounds come stepped, in the owner's states
            if chunk.awaited:  # (it took over) a round waits for the pushes the dead owner had
                limit = min(limit, *chunk.awaited.values())
        for round_id in sorted(chunk.pending):
            open_round = chunk.pending[round_id]
            # (an absent worker is live for the clocks, but an ASP round does not wait for its pushes)
            pushing = len(self.live - self.absent)
            if not commit_ready(chunk.mode, round_id, open_round.count, limit, pushing):
                break
            del chunk.pending[round_id]
            chunk.view = None
            self.quiesce(chunk)
            if self.keep_previous and chunk.mode == "clock":
                self._keep_previous(chunk, round_id)
            held = chunk.ordered.pop(round_id, {})
            for worker in sorted(held):
                for data, rows, weight, densify in held[worker]:
                    open_round.add(data, rows, weight, chunk.value, densify=densify)
            open_round.apply(chunk.optimizer, chunk.value, chunk.state)
            if chunk.mode == "arrival":
                chunk.version += 1
        if chunk.mode == "clock":
            chunk.version = max(chunk.version, limit)

    @staticmethod
    def _keep_previous(chunk: StoredChunk, round_id: int) -> None:
        """Keeps ``chunk``'s value before round ``round_id``'s step (in the buffer of the one before)."""
        if chunk.previous is None or chunk.previous.shape != chunk.value.shape:
            chunk.previous = chunk.value.copy()
        else:
            np.copyto(chunk.previous, chunk.value)
        chunk.previous_round = round_id

    def _exact(self, chunk: StoredChunk, version: int) -> npt.NDArray[Any] | None:
        """A BSP chunk's value at ``version`` (rounds applied) when it has moved past it: the value kept from
        before its last step, or the value itself when no step since ``version`` changed it; None: at ``version``.

        Raises:
            RejectedError: that version is no longer held here.
        """
        if chunk.mode != "clock" or chunk.version <= version:
            return None
        last = chunk.previous_round
        if last is None or last < version:
            return None  # no step since that version: the value is what it was
        if last == version and chunk.previous is not None:
            return chunk.previous
        raise RejectedError(f"version {version} of chunk is no longer held (the chunk is at {chunk.version})")

    def answer_pull(self, msg: Message) -> None:
        """Answers a pull whose consistency rule holds: the value (or a preview of its open rounds), its rows, or
        a reference a same-host worker copies from (:mod:`.shared`). A rejoined worker asks for the version it
        computes on (``exact``, :mod:`.rejoin`)."""
        chunk = self.chunk(msg.meta)
        rows = self.rows_of(chunk, msg)
        self.stats.pulls += 1
        exact = msg.meta.get("exact")
        held = self._exact(chunk, exact) if type(exact) is int else None
        if held is not None:
            before = held.copy()  # the kept buffer is overwritten by the next step: a copy travels
            self.reply(msg.src, msg.meta["id"], [before if rows is None else before[rows]], version=exact)
        elif chunk.eager and chunk.pending and chunk.optimizer is not None:
            if chunk.view is None:
                chunk.view = preview(chunk.optimizer, chunk.value, chunk.state, chunk.pending)
            view = chunk.view  # a fresh array, never modified afterwards: sent without waiting
            self.reply(msg.src, msg.meta["id"], [view if rows is None else view[rows]], version=chunk.version)
        elif rows is None and chunk.shared is not None and msg.meta.get("ref") is True:
            # the worker copies it out itself (.shared): the sequence number says which value it must find
            self.stats.pulls_in_place += 1
            self.reply(msg.src, msg.meta["id"], ref=chunk.shared.name, seq=chunk.shared.seq, version=chunk.version)
        elif rows is None:
            self.reply(msg.src, msg.meta["id"], [chunk.value], chunk=chunk, version=chunk.version)
        else:
            self.reply(msg.src, msg.meta["id"], [chunk.value[rows]], version=chunk.version)
