"""The worker's side of the parameter server: ``KVStore`` with push/pull, sparse rows, clocks and a cache.

Every key is split into row chunks spread over the servers (:mod:`.sharding`), so one big layer loads all
servers and small keys spread by hash. A push is asynchronous (a handle); a pull blocks until every chunk is
back. The consistency model is the worker's: each pull tells the servers which clock every worker must have
completed (:meth:`~.consistency.Policy.required_done`), and the servers answer only then. A pull is served
from the local cache when the cached copy is fresh enough under the model ("check the cache first; if too
old, update from the network"); pushes always go to the servers, so caching never loses an update.

With ``replicas=R`` every chunk lives on R servers (primary-backup, Li et al. OSDI'14; the server side is in
:mod:`.server`): a request goes to the chunk's first live replica, and a push is acknowledged only when every live
replica has it (under BSP/SSP once its owner's state of the chunk after the push's round reached the others:
replication after aggregation; waiting for a push before this worker's clock completes that round asks the owners
to send their states at once, ``flush``). Requests to one owner travel in batches, cut as the unreplicated plan
cuts a server's (with every primary alive, the same messages). A batch whose server dies is sent again, each
request to its chunk's next live replica (a push with the same sequence number, so the servers apply it once). A
server that died and was
restarted is brought up to date by a *fence* this worker takes part in the first time it sees the server back
(:mod:`.resync`): it waits for its pushes' acknowledgements and for the server's answer, then counts the server as a
live replica again, the last to own its chunks. :meth:`KVStore.clock` does not wait for its pushes' acknowledgements
(that was a server-to-server round trip on every clock): it tells each server how many of this clock's pushes that
server replicates, and a server counts the clock only once it holds that many (under BSP/SSP a backup holds a push
once its owner told it of it, its data following in the owner's state), so a server that takes over a chunk knows
which pushes of which rounds it must still get. (Tested under BSP, where the replicated run is bitwise the unreplicated
one even when every clock overtakes the forwarded pushes, and SSP(2) across a server kill; under ASP an integer
audit across a server kill, each push waited for, counts every push once.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, overload, runtime_checkable

import numpy as np
import numpy.typing as npt

from paratrain._arrays import dtype_from_name, is_torch_tensor, wire_array
from paratrain._current import current_context
from paratrain.config import Settings
from paratrain.device import host_view, on_device
from paratrain.errors import CommTimeoutError, ConfigError, PeerLostError, TransportClosedError
from paratrain.plan.ir import Action, Parts, Received, Slice
from paratrain.ps.consistency import Policy
from paratrain.ps.optim import ServerOptimizer, make_optimizer
from paratrain.ps.plans import batches, clock_actions, pull_actions, push_actions
from paratrain.ps.protocol import CATCHING_UP, MAX_BATCH, REQUEST_TAG, PSRequestError, pack, reply_tag, unpack
from paratrain.ps.sharding import DEFAULT_CHUNK_BYTES, Chunk, plan_chunks, split_rows
from paratrain.ps.shared import ValueReader, value_prefix
from paratrain.transport.base import Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["KVStore", "WorkerContext"]

log = logging.getLogger("paratrain.ps.client")


class _Tensor(Protocol):
    """A torch tensor, as far as :meth:`KVStore.pull` into one is concerned (torch is not imported here)."""

    def copy_(self, src: Any, non_blocking: bool = ...) -> Any: ...


_TensorT = TypeVar("_TensorT", bound=_Tensor)

#: Seconds between looks for a restarted server while a replicated worker waits for an answer.
_REJOIN_POLL_S = 0.05


@runtime_checkable
class WorkerContext(Protocol):
    """What a KVStore needs of a worker's context (a :class:`~paratrain.Context` has it): typed here so that
    the parameter server does not import the runtime built on top of it."""

    @property
    def settings(self) -> Settings: ...

    @property
    def transport(self) -> Transport: ...

    @property
    def rank(self) -> int: ...


def _default_context() -> WorkerContext:
    ctx = current_context()
    if not isinstance(ctx, WorkerContext):
        raise TypeError(f"the current context is a {type(ctx).__name__}, not a worker's context")
    return ctx


@dataclass(frozen=True, slots=True)
class _Key:
    shape: tuple[int, ...]
    dtype_name: str
    chunks: list[Chunk]
    push: tuple[Action, ...] = ()  # this worker's side of a push and a pull (paratrain.ps.plans), per batch
    pull: tuple[Action, ...] = ()
    at_row: dict[int, Chunk] = field(default_factory=dict)  # each chunk by its first row (how plan slices name it)
    row_bytes: int = 0  # bytes of one row (how batches are cut)

    @property
    def storage(self) -> np.dtype[Any]:
        return dtype_from_name(self.dtype_name)


def _parts(action: Action) -> tuple[Slice, ...]:
    """The rows of each chunk a send of a PS plan carries (one, or a batch's)."""
    if isinstance(action.data, Parts):
        return action.data.parts
    assert isinstance(action.data, Slice)
    return (action.data,)


def _rows(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``arr`` as rows along axis 0 (a 0-d array is one row of one element)."""
    return arr.reshape(1) if arr.ndim == 0 else arr


#: A request sent with failover: its chunk, meta and arrays, and the handle its answer completes.
_Entry = tuple[Chunk, dict[str, Any], Sequence[Any], Handle[Message]]


class _PushHandle(Handle[None]):
    """A replicated push's handle whose first wait before it is done calls ``flush`` (:meth:`KVStore._push_handle`)."""

    __slots__ = ("_flush",)

    def __init__(self, flush: Callable[[], None]) -> None:
        super().__init__()
        self._flush: Callable[[], None] | None = flush

    def wait(self, timeout: float | None = None) -> None:
        flush, self._flush = self._flush, None
        if flush is not None and not self.done():
            flush()
        return super().wait(timeout)


def _split_batch(batch: Handle[Message], *, parts: list[Handle[Message]], worker: int) -> None:
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


class KVStore:
    """A worker's handle on the job's parameter servers.

    Args:
        consistency: ``"bsp"``, ``"ssp"`` or ``"asp"``.
        staleness: SSP's bound s (a pull at clock c reflects every push made at clocks < c - s, and no worker
            runs more than s clocks ahead of the slowest). Larger s hides stragglers and network delay at the
            cost of staler parameters; s = 0 is BSP.
        optimizer: server-side update rule: None (servers add pushed arrays into the values), a name
            (``"adam"``, ``"adagrad"``), a spec dict (``{"name": "sgd", "lr": 0.1, "momentum": 0.9}``) or an
            optimizer from :mod:`paratrain.ps.optim`. With an optimizer pushes are gradients, applied as one
            optimizer step on the mean of each round of pushes (a clock under BSP/SSP, every N pushes under
            ASP: :mod:`paratrain.ps.rounds`), so every model takes the same step per clock.
        staleness_lr: scale each gradient by ``1 / max(1, τ)``, τ the rounds between the parameters it was
            computed on and the round it joins (Zhang et al. 2016's staleness-aware learning rate). Off by
            default; it changes nothing under BSP (τ = 0).
        context: the paratrain context (default: the current one).
        timeout: seconds any call may wait (default: the context's timeout).
        chunk_bytes: target chunk size; smaller balances servers better and overlaps more, at more messages.
        cache: serve pulls from a local copy when the model allows it.
        join: announce this worker to the servers (needed only to come back after :meth:`close`).
        replicas: servers holding each chunk, ``1 <= R <= S``. With 2 or more, a push is acknowledged only
            once every replica has it and the job survives the death of R - 1 servers (requests fail over to
            the next replica). The price: under BSP/SSP each owner sends each chunk's state once per round to
            the other replicas (the workers' pushes aggregated: a backup receives and copies one chunk per
            round, not one push per worker), and a push is acknowledged a round trip after its round is
            complete, so wait for pushes after :meth:`clock` (a wait before it works, at the cost of an extra
            state); under ASP each push is forwarded. Default: ``settings.ps_replicas``
            (``PARATRAIN_PS_REPLICAS``, set by ``paratrain launch --replicas``; 1 unless set).

    Example:
        >>> import numpy as np
        >>> from paratrain.testing import run_ranks
        >>> def worker(ctx):
        ...     kv = KVStore(consistency="ssp", staleness=1, context=ctx)
        ...     kv.init(0, np.zeros(2, dtype=np.int64))
        ...     for _ in range(3):
        ...         kv.push(0, np.ones(2, dtype=np.int64))
        ...         kv.clock()
        ...     kv.close()
        ...     return ctx.rank
        >>> run_ranks(2, worker, servers=2)
        [0, 1]
    """

    def __init__(
        self,
        consistency: str = "bsp",
        staleness: int | None = None,
        optimizer: str | Mapping[str, Any] | ServerOptimizer | None = None,
        *,
        context: WorkerContext | None = None,
        timeout: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cache: bool = True,
        join: bool = False,
        staleness_lr: bool = False,
        replicas: int | None = None,
    ) -> None:
        ctx = context if context is not None else _default_context()
        settings = ctx.settings
        if settings.num_servers == 0:
            raise ConfigError(
                "this job has no parameter servers: start it with 'paratrain launch -n W --servers S -- ...' "
                "(or set PARATRAIN_SERVERS=S under torchrun/SLURM)"
            )
        if settings.role != "worker":
            raise ConfigError("a KVStore is used by workers; this process is a server")
        if chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if replicas is None:
            replicas = settings.ps_replicas
        if not 1 <= replicas <= settings.num_servers:
            raise ConfigError(
                f"replicas={replicas} needs 1..{settings.num_servers} servers (the job has {settings.num_servers}); "
                "start more servers or lower replicas"
            )
        self.replicas = replicas
        self._next_seq = 0  # push sequence numbers: servers apply each (worker, seq) once
        # replicated pushes not yet seen acknowledged, as (their first sequence number, handle): clock() tells the
        # servers the lowest of them, below which they may forget the sequence numbers they applied
        self._unacked: list[tuple[int, Handle[None]]] = []
        # server rank -> how many of this clock's pushes it must hold before it counts the clock (replicated)
        self._expect: dict[int, int] = {}
        self._dead: set[int] = set()  # server ranks seen lost
        self.failovers = 0  # requests sent again to another replica after their server died
        # restarted servers (.resync): each server's incarnation as last brought up to date (or seen dead), and
        # those that rejoined, in order: they own a chunk only when every replica that never died is gone
        self._known: dict[int, int] = {}
        self._demoted: list[int] = []
        self._fencing = False
        self._calls = 0  # public calls so far
        self._retry_at = -1  # the call in which a restarted server asked this worker to fence again later
        self.resyncs = 0  # restarted servers this worker fenced for (each caught up and is a backup again)
        # each fence: when this worker saw the server back (time.time()) and how long it paused (pushes drained,
        # then the server's catch-up), in seconds
        self.fences: list[tuple[float, float]] = []
        self.policy = Policy.parse(consistency, staleness)
        self._optimizer = make_optimizer(optimizer)
        self._transport = ctx.transport
        self._known = ctx.transport.incarnations()
        self.rank = ctx.rank
        self.num_servers = settings.num_servers
        self._servers = list(range(settings.num_workers, settings.world_size))
        self.timeout = settings.timeout if timeout is None else timeout
        self._chunk_bytes = chunk_bytes
        self._use_cache = cache
        self._staleness_lr = bool(staleness_lr)
        # key -> the version (rounds applied) of each chunk as last read: pushes say what they were computed on
        self._versions: dict[str | int, list[int | None]] = {}
        self._keys: dict[str | int, _Key] = {}
        # key -> (slowest clock when fetched, the received chunks, their versions): the chunks are the read-only
        # arrays the transport already holds, so caching costs no copy; a hit assembles a fresh array from them.
        # A pull that read values in place from a same-host server (.shared) caches nothing: it received nothing,
        # and a copy would cost as much as the next pull
        self._values = ValueReader()  # the value files of same-host servers, read in place (.shared)
        # servers whose values this worker may read in place (they share its host): pulls ask for a reference
        self._local = {s for s in self._servers if ctx.transport.memory_prefix(s) is not None}
        self._cache: dict[str | int, tuple[int, list[npt.NDArray[Any]], list[int | None]]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._clock = 0
        self._min_done = 0
        self._closed = False
        if join:
            replies = [self._request(s, {"op": "join"}) for s in self._servers]
            self._clock = max(int(self._wait(h, s, "join").meta.get("clock", 0)) for h, s in replies)

    @property
    def clock_value(self) -> int:
        """This worker's clock: how many times it called :meth:`clock`."""
        return self._clock

    # -- plumbing ------------------------------------------------------------------------------------------

    def _request(self, server: int, meta: dict[str, Any], arrays: Sequence[Any] = ()) -> tuple[Handle[Message], int]:
        if self._closed:
            raise ConfigError("this KVStore was closed; create a new one (join=True) to come back")
        with self._lock:
            request_id = next(self._ids)
        handle = self._transport.irecv(server, reply_tag(request_id))
        try:
            self._transport.isend(server, REQUEST_TAG, arrays, {**meta, "id": request_id})
        except PeerLostError:
            self._transport.cancel_recv(handle)
            raise
        return handle, server

    def _request_batch(self, server: int, items: Sequence[tuple[dict[str, Any], Sequence[Any]]]) -> Handle[Message]:
        """Requests to one server in one message each way (:mod:`.protocol` says why): the handle of the batch's
        answer (of the request itself when there is one), for :func:`_split_batch`."""
        if len(items) == 1:
            return self._request(server, *items[0])[0]
        assert len(items) <= MAX_BATCH  # the plan cuts batches (paratrain.ps.plans.batches)
        with self._lock:
            ids = [next(self._ids) for _ in items]
        ops, arrays = pack([({**meta, "id": i}, arrs) for (meta, arrs), i in zip(items, ids, strict=True)])
        return self._request(server, {"op": "batch", "ops": ops}, arrays)[0]

    def _request_many(
        self, server: int, items: Sequence[tuple[dict[str, Any], Sequence[Any]]]
    ) -> list[tuple[Handle[Message], int]]:
        """Requests to one server, one batch of the plan; a handle per request, completed with its own reply."""
        batch = self._request_batch(server, items)
        if len(items) == 1:
            return [(batch, server)]
        parts: list[Handle[Message]] = [Handle() for _ in items]
        batch.add_done_callback(functools.partial(_split_batch, parts=parts, worker=self.rank))
        return [(part, server) for part in parts]

    def _seq(self, chunk: Chunk) -> int:
        """A new push sequence number for a push to ``chunk``, counted for every replica of the chunk: each of them
        must hold this push before it counts this worker's next clock."""
        seq = self._next_seq
        self._next_seq += 1
        for index in chunk.replicas:
            server = self._servers[index]
            self._expect[server] = self._expect.get(server, 0) + 1
        return seq

    def _live(self, server: int) -> bool:
        if server in self._dead:
            return False
        if server in self._transport.lost_peers() or self._rejoined(server):
            self._dead.add(server)  # a restarted server is dead to this worker until it fenced it
            return False
        return True

    def _rejoined(self, server: int) -> bool:
        """Whether ``server`` came back as a new process since this worker last brought it up to date."""
        return self._transport.incarnations().get(server, 0) != self._known.get(server, 0)

    def _owner(self, chunk: Chunk) -> int:
        """The transport rank of the chunk's first live replica (its owner now), servers that rejoined last."""
        order = [self._servers[index] for index in chunk.replicas]
        if self._demoted:
            order = [s for s in order if s not in self._demoted] + [s for s in self._demoted if s in order]
        for server in order:
            if self._live(server):
                return server
        raise PeerLostError(
            f"worker {self.rank}: every replica of chunk {chunk.index} (servers {list(chunk.replicas)}) is gone; "
            "the job cannot go on: restart it (with more replicas to survive more failures)",
            peer=self._servers[chunk.replicas[-1]],
        )

    def _lost(self, exc: PeerLostError, server: int) -> None:
        """Records that ``server`` died; re-raises when requests have nowhere else to go.

        The error may be an earlier process's of that rank, surfacing only now: a request in flight when the old
        process died can fail after this worker already fenced the restarted one (:meth:`_await` fences before it
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
        """Whether ``server`` is a restarted process that this worker fenced and still counts live: an error or a
        refusal of that rank that arrives now belongs to an earlier process (or to before the fence)."""
        incarnation = self._transport.incarnations().get(server, 0)
        return (
            incarnation > 0
            and self._known.get(server, 0) == incarnation
            and server not in self._dead
            and server not in self._transport.lost_peers()
        )

    def _not_fenced_yet(self, server: int, what: str, answer: Message) -> PeerLostError:
        """``server`` refused a request because it is a restarted process still catching up (:mod:`.resync`):
        this worker sent it before it saw the restart (the transport had the new process's connection already,
        not yet counted as a new incarnation here). It is dead to this worker until it fenced it, as after a
        death; the error, for :meth:`_lost` and the callers that send the request to another replica. A refusal
        read only after this worker fenced that server (a wait fences first) is stale: the server stays live."""
        if not self._fenced_since(server):
            self._dead.add(server)
        return PeerLostError(f"worker {self.rank}: {what} not served: {answer.meta.get('error')}", peer=server)

    def _send_failover(
        self, items: Sequence[tuple[Chunk, dict[str, Any], Sequence[Any]]], row_bytes: int
    ) -> list[Handle[Message]]:
        """Sends each request ``(chunk, meta, arrays)`` to its chunk's owner now, the requests to one owner batched
        as the plan batches a server's chunks (:func:`~paratrain.ps.plans.batches`: with every primary alive, the
        same messages as unreplicated). A batch whose server dies before answering is sent again, its requests
        regrouped by their chunks' next live replicas.

        Non-blocking: a handle per request, completed with its answer (or the error of its last replica)."""
        entries: list[_Entry] = [(chunk, meta, arrays, Handle()) for chunk, meta, arrays in items]
        self._dispatch(entries, row_bytes)
        return [entry[3] for entry in entries]

    def _dispatch(self, entries: Sequence[_Entry], row_bytes: int) -> None:
        """Sends ``entries`` in batches, one or more per owner (see :meth:`_send_failover`)."""
        owned: list[Chunk] = []
        by_index: dict[int, _Entry] = {}
        for entry in entries:
            try:
                owner = self._owner(entry[0])
            except PeerLostError as exc:
                entry[3].set_error(exc)
                continue
            owned.append(dataclasses.replace(entry[0], server=self._servers.index(owner)))
            by_index[entry[0].index] = entry
        for batch in batches(owned, row_bytes):
            self._send_batch(self._servers[batch[0].server], [by_index[c.index] for c in batch], row_bytes)

    def _send_batch(self, server: int, entries: list[_Entry], row_bytes: int) -> None:
        try:
            handle = self._request_batch(server, [(meta, arrays) for _, meta, arrays, _ in entries])
        except PeerLostError as exc:
            self._lost(exc, server)
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
        if isinstance(exc, PeerLostError) and not self._closed:
            self._lost(exc, server)
            self._dispatch(entries, row_bytes)
        elif exc is None and handle.wait(0).meta.get(CATCHING_UP) is True and not self._closed:
            self._lost(self._not_fenced_yet(server, "a batch", handle.wait(0)), server)
            self._dispatch(entries, row_bytes)
        else:
            _split_batch(handle, parts=[entry[3] for entry in entries], worker=self.rank)

    def _ask(self, chunk: Chunk, meta: dict[str, Any], arrays: Sequence[Any], what: str) -> Message:
        """A blocking request to the chunk's owner, sent again to the next replica if that server dies."""
        while True:
            server = self._owner(chunk)
            try:
                handle, _ = self._request(server, meta, arrays)
                return self._wait(handle, server, what)
            except PeerLostError as exc:
                self._lost(exc, server)

    def _wait(self, handle: Handle[Message], server: int, what: str) -> Message:
        try:
            msg = self._await(handle)
        except CommTimeoutError:
            # (a request of a batch has no receive of its own to cancel: it is not done either)
            if self._transport.cancel_recv(handle) or not handle.done():
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
        if isinstance(done, int) and done > self._min_done:
            self._min_done = done
        return msg

    def _await(self, handle: Handle[Message]) -> Message:
        """``handle.wait(self.timeout)``; replicated, it fences any server that rejoins meanwhile, since the
        answer may wait on another worker that waits on that fence (:mod:`.resync`)."""
        if self.replicas == 1 or self._fencing:
            return handle.wait(self.timeout)
        deadline = time.monotonic() + self.timeout
        while True:
            self._fence_rejoined()
            remaining = deadline - time.monotonic()
            try:
                return handle.wait(max(0.0, min(_REJOIN_POLL_S, remaining)))
            except CommTimeoutError:
                if remaining <= _REJOIN_POLL_S:
                    raise

    def _fence_rejoined(self) -> None:
        """Fences every server that came back as a new process since this worker last looked (:mod:`.resync`):
        waits until its own pushes are acknowledged, tells the server the clock it is at and how many of this
        clock's pushes the server's chunks already hold, and waits until the server has caught up. A server that
        dies again, or gives up, stays dead until it comes back once more."""
        incarnations = self._transport.incarnations()
        if self.replicas == 1 or self._fencing or incarnations == self._known or self._closed:
            return
        if self._retry_at == self._calls:
            return  # released from a fence in this call: the others may wait for it to return (a collective)
        self._fencing = True
        try:
            for server, incarnation in sorted(incarnations.items()):
                if self._known.get(server, 0) == incarnation:
                    continue
                self._dead.add(server)
                if server in self._transport.lost_peers():
                    self._known[server] = incarnation
                    continue
                if self._fence(server):
                    self._known[server] = incarnation
        finally:
            self._fencing = False

    def _fence(self, server: int) -> bool:
        """One fence of ``server`` (see :meth:`_fence_rejoined`); False when the server asks to fence again."""
        seen, started = time.time(), time.monotonic()
        for _, push in self._unacked:  # every push applied by every live replica: the donors' copies have it
            with contextlib.suppress(Exception):  # its error is reported by clock(), as without a fence
                push.wait(self.timeout)
        live = [s for s in self._servers if s != server and self._live(s)]
        meta = {"op": "fence", "clock": self._clock, "held": self._expect.get(server, 0), "servers": live}
        try:
            handle, _ = self._request(server, meta)
            answer = self._wait(handle, server, f"fence of restarted server rank {server}")
        except (PeerLostError, PSRequestError) as exc:
            log.warning("worker %d: restarted server rank %d did not catch up: %s", self.rank, server, exc)
            return True
        if answer.meta.get("retry"):
            self._retry_at = self._calls
            return False  # a round of fences the server gave up on: fence again at the next call
        self._dead.discard(server)
        if server in self._demoted:
            self._demoted.remove(server)
        self._demoted.append(server)
        self.resyncs += 1
        self.fences.append((seen, time.monotonic() - started))
        log.info("worker %d: server rank %d caught up after its restart; it is a backup again", self.rank, server)
        return True

    def _push_handle(self) -> Handle[None]:
        """The handle of a replicated push. Under BSP/SSP a push is acknowledged once a state of its chunk that
        holds it reached every replica, which its owner sends when the push's round is complete: waiting for it
        before this worker's clock completes that round would wait forever, so such a wait first asks the owners
        to send their states now (``flush``)."""
        if self.policy.kind == "asp":
            return Handle()
        clock = self._clock

        def flush() -> None:
            if self._clock != clock or self._closed:
                return
            for server in self._servers:
                if self._live(server):
                    with contextlib.suppress(PeerLostError, TransportClosedError):
                        self._transport.isend(server, REQUEST_TAG, (), {"op": "flush", "id": -1})

        return _PushHandle(flush)

    def _all(
        self, pending: list[tuple[Handle[Message], int]], what: str, result: Handle[None] | None = None
    ) -> Handle[None]:
        """One handle for many replies (``result``, or a new one): completes when all arrived, fails with the
        first error."""
        result = Handle() if result is None else result
        remaining = [len(pending)]
        lock = threading.Lock()
        if not pending:
            result.set_result(None)
            return result

        def arrived(h: Handle[Message]) -> None:
            error = h.exception()
            if error is None:
                meta = h.wait(0).meta
                if meta.get("error") is not None:
                    error = PSRequestError(f"worker {self.rank}: {what} rejected: {meta['error']}")
            if error is not None:
                result.set_error(error)
                return
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                result.set_result(None)

        for handle, _ in pending:
            handle.add_done_callback(arrived)
        return result

    def _key(self, key: str | int) -> _Key:
        info = self._keys.get(key)
        if info is None:
            raise KeyError(f"unknown key {key!r}: call kv.init({key!r}, array) on every worker first")
        return info

    def _check(self, key: str | int, info: _Key, arr: npt.NDArray[Any], dtype_name: str, rows: int | None) -> None:
        expected = info.shape if rows is None else (rows, *info.shape[1:])
        widened = dtype_name in ("float16", "bfloat16") and info.dtype_name in ("float32", "float64")
        if (dtype_name != info.dtype_name and not widened) or tuple(arr.shape) != tuple(expected):
            raise ValueError(
                f"key {key!r} is {info.shape} {info.dtype_name}; got {tuple(arr.shape)} {dtype_name}"
                + ("" if rows is None else f" for {rows} rows")
            )

    # -- the API -------------------------------------------------------------------------------------------

    def init(self, key: str | int, array: Any) -> None:
        """Creates ``key`` on the servers; call it on every worker. Rank 0's value wins. Blocks until it exists.

        Raises:
            PSRequestError: another worker initialised ``key`` with a different shape or dtype.
        """
        self._calls += 1
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"keys are str or int, not {type(key).__name__}")
        arr, dtype_name = host_view(array)
        if dtype_name == "bfloat16":
            raise TypeError(
                f"key {key!r}: bfloat16 keys are not supported (the servers add in the key's dtype): keep the key "
                "float32 and push bfloat16 gradients, as compression='bf16' does"
            )
        shape = tuple(int(d) for d in arr.shape)
        chunks = plan_chunks(
            key, shape, arr.itemsize, self.num_servers, chunk_bytes=self._chunk_bytes, replicas=self.replicas
        )
        rows = _rows(arr)
        spec = self._optimizer.spec() if self._optimizer is not None else None
        pending = []
        for chunk in chunks:
            part = rows[chunk.row_start : chunk.row_stop]
            meta = {
                "op": "init",
                "key": key,
                "chunk": chunk.index,
                "dtype": dtype_name,
                "shape": list(part.shape),
                "key_shape": list(shape),
                "optimizer": spec,
                "consistency": self.policy.kind,
                "staleness_lr": self._staleness_lr,
                "eager": self.policy.kind == "asp" or self.policy.staleness > 0,
            }
            if self.replicas > 1:
                meta["replicas"] = [self._servers[r] for r in chunk.replicas]
            for server in (self._servers[r] for r in chunk.replicas):
                if self.replicas == 1 or self._live(server):
                    try:
                        pending.append(self._request(server, meta, [part] if self.rank == 0 else []))
                    except PeerLostError as exc:  # died since _live looked: as below
                        self._lost(exc, server)
        for handle, server in pending:
            try:
                self._wait(handle, server, f"init of key {key!r}")
            except PeerLostError as exc:  # a replica died: the others hold the chunk (else the next call says so)
                self._lost(exc, server)
        if self.replicas > 1:
            for chunk in chunks:
                self._owner(chunk)  # raises if every replica of a chunk is gone
        row_bytes = math.prod(rows.shape[1:]) * arr.itemsize
        self._keys[key] = _Key(
            shape,
            dtype_name,
            chunks,
            push=push_actions(chunks, row_bytes, self._servers),
            pull=pull_actions(chunks, row_bytes, self._servers),
            at_row={c.row_start: c for c in chunks},
            row_bytes=row_bytes,
        )
        self._versions[key] = [None] * len(chunks)
        self._cache.pop(key, None)

    def push(self, key: str | int, array: Any) -> Handle[None]:
        """Sends ``array`` to be added (or applied as a gradient) to ``key``. Asynchronous: ``.wait()`` for it.

        Do not modify ``array`` until the handle is done (it is sent without copying, and sent again should its
        server die). Replicated under BSP/SSP the handle completes once the push's round is complete and on every
        replica: wait for it after :meth:`clock` (see ``replicas``).
        """
        self._calls += 1
        info = self._key(key)
        arr, dtype_name = host_view(array)
        self._check(key, info, arr, dtype_name, None)
        rows = _rows(arr)
        self._cache.pop(key, None)
        versions = self._versions[key]
        if self.replicas > 1:  # each chunk to its owner now, batched per owner (failover)
            requests = [
                (
                    c,
                    {
                        "op": "push",
                        "key": key,
                        "chunk": c.index,
                        "version": versions[c.index],
                        "seq": self._seq(c),
                        "wclock": self._clock,
                    },
                    [wire_array(rows[c.row_start : c.row_stop], dtype_name)],
                )
                for c in info.chunks
            ]
            answers = self._send_failover(requests, info.row_bytes)
            handle = self._all([(h, -1) for h in answers], f"push to key {key!r}", self._push_handle())
            self._unacked.append((self._next_seq - len(requests), handle))
            return handle
        # the plan's sends, one message per batch (each chunk in it a request of its own); each request posts its
        # reply's receive first (the plan's recv)
        pending = []
        for a in (a for a in info.push if a.kind == "send"):
            batch = [info.at_row[part.start] for part in _parts(a)]
            items = [
                (
                    {"op": "push", "key": key, "chunk": c.index, "version": versions[c.index]},
                    [wire_array(rows[c.row_start : c.row_stop], dtype_name)],
                )
                for c in batch
            ]
            pending += self._request_many(a.peer, items)
        return self._all(pending, f"push to key {key!r}")

    @overload
    def pull(self, key: str | int, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]: ...

    @overload
    def pull(self, key: str | int, out: _TensorT) -> _TensorT: ...

    def pull(self, key: str | int, out: Any = None) -> Any:
        """The value of ``key`` as the consistency model allows at this worker's clock. Blocks.

        Returns a new array, or ``out`` filled in: a C-contiguous writeable numpy array of the key's shape and
        dtype, reused from pull to pull (as MXNet's ``pull(key, out=...)``), which saves allocating and
        first-touching the memory every time (for a 16 MiB key that costs about as much as copying it); or a
        torch tensor of the key's shape and dtype, on any device (a contiguous CPU tensor is filled in place; a
        CUDA tensor through a host copy, finished when this returns).
        """
        if is_torch_tensor(out):
            return self._pull_tensor(key, out)
        return self._pull(key, out)

    def _pull_tensor(self, key: str | int, out: Any) -> Any:
        info = self._key(key)
        name = str(out.dtype).removeprefix("torch.")
        if tuple(out.shape) != info.shape or name != info.dtype_name:
            raise ValueError(
                f"out= for key {key!r} must be of shape {info.shape} and dtype {info.dtype_name}, got "
                f"{tuple(out.shape)} {name}"
            )
        if not on_device(out) and out.is_contiguous():
            self._pull(key, out.detach().numpy())  # into the tensor's own memory
            return out
        import torch

        with torch.no_grad():
            out.copy_(torch.from_numpy(self._pull(key, None)))  # (keys are never bfloat16: numpy has their dtype)
        return out

    def _pull(self, key: str | int, out: npt.NDArray[Any] | None) -> npt.NDArray[Any]:
        self._calls += 1
        info = self._key(key)
        if out is not None and not (
            isinstance(out, np.ndarray)
            and out.shape == info.shape
            and out.dtype == info.storage
            and out.flags.c_contiguous
            and out.flags.writeable
        ):
            raise ValueError(
                f"out= for key {key!r} must be a writeable C-contiguous numpy array of shape {info.shape} and "
                f"dtype {info.storage}, got {type(out).__name__} {getattr(out, 'shape', '')} "
                f"{getattr(out, 'dtype', '')}"
            )
        if self._use_cache and key in self._cache:
            cached_done, parts, cached_versions = self._cache[key]
            if self.policy.cache_fresh(cached_done, self._clock):
                self._versions[key] = list(cached_versions)
                hit = np.empty(info.shape, dtype=info.storage) if out is None else out
                hit_rows = _rows(hit)
                for chunk, part in zip(info.chunks, parts, strict=True):
                    hit_rows[chunk.row_start : chunk.row_stop] = part
                return hit
        required = self.policy.required_done(self._clock)
        if out is None:
            out = np.empty(info.shape, dtype=info.storage)
        rows = _rows(out)
        what = f"pull of key {key!r}"
        ref = bool(self._local)  # a server off this host ignores it
        asked = {"op": "pull", "key": key, "required": required, "ref": ref}
        pending: list[tuple[Chunk, Handle[Message], int]] = []
        if self.replicas == 1:
            # the plan: a receive, then its request; the copies out of each reply say which chunks it carries
            carried: dict[int, list[Chunk]] = {}
            for a in info.pull:
                if a.kind == "copy":
                    assert isinstance(a.data, Received) and a.out is not None
                    carried.setdefault(a.data.action, []).append(info.at_row[a.out.start])
            for i, a in enumerate(info.pull):
                if a.kind == "send":
                    batch = carried[i - 1]
                    items = [({**asked, "chunk": c.index}, ()) for c in batch]
                    pending += [
                        (c, *answer) for c, answer in zip(batch, self._request_many(a.peer, items), strict=True)
                    ]
        else:
            answers = self._send_failover([(c, {**asked, "chunk": c.index}, ()) for c in info.chunks], info.row_bytes)
            pending = [(c, h, -1) for c, h in zip(info.chunks, answers, strict=True)]
        done = None
        versions = self._versions[key]
        received: dict[int, npt.NDArray[Any]] | None = {}  # chunk index -> its array, what the cache may keep
        for chunk, handle, server in pending:
            msg = self._wait(handle, server, what)
            target = rows[chunk.row_start : chunk.row_stop]
            if "ref" in msg.meta:
                received = None  # read in place: nothing received to keep, and a copy costs as much as a new pull
                if not self._read_in_place(msg, target):
                    meta = {"op": "pull", "key": key, "chunk": chunk.index, "required": required, "ref": False}
                    msg = self._ask(chunk, meta, (), what)  # it changed while copied: the data itself, this once
                    target[...] = msg.arrays[0]
            else:
                target[...] = msg.arrays[0]
                if received is not None:
                    received[chunk.index] = msg.arrays[0]
            chunk_done = int(msg.meta.get("done", 0))
            done = chunk_done if done is None else min(done, chunk_done)
            version = msg.meta.get("version")
            versions[chunk.index] = version if isinstance(version, int) else None
        if self._use_cache and self.policy.kind != "asp" and received is not None:
            self._cache[key] = (done or 0, [received[c.index] for c in info.chunks], list(versions))
        return out

    def _read_in_place(self, msg: Message, target: npt.NDArray[Any]) -> bool:
        """Copies a value that a same-host server answered with a reference to (:mod:`.shared`) into
        ``target``; False when it changed during the copy (then the caller asks for the data).

        Raises:
            PSRequestError: the reference does not fit this server or chunk (a server of another version?).
        """
        prefix = self._transport.memory_prefix(msg.src)
        try:
            if prefix is None:
                raise ValueError(f"server rank {msg.src} is not on this host")
            return self._values.read(msg.meta["ref"], value_prefix(prefix, msg.src), msg.meta.get("seq"), target)
        except (ValueError, OSError) as exc:
            raise PSRequestError(
                f"worker {self.rank}: server rank {msg.src} answered a pull unreadably: {exc}"
            ) from None

    def pull_replicas(self, key: str | int) -> list[npt.NDArray[Any]]:
        """Every replica's copy of ``key`` (the i-th: each chunk as its i-th live replica holds it), read as
        :meth:`pull` reads. For audits and tests: with ``replicas=R`` all R copies are equal after every clock.
        Blocks; bypasses the cache."""
        self._calls += 1
        info = self._key(key)
        required = self.policy.required_done(self._clock)
        copies = []
        for i in range(self.replicas):
            out = np.empty(info.shape, dtype=info.storage)
            rows = _rows(out)
            for c in info.chunks:
                live = [self._servers[r] for r in c.replicas if self._live(self._servers[r])]
                server = live[min(i, len(live) - 1)]
                handle, _ = self._request(server, {"op": "pull", "key": key, "chunk": c.index, "required": required})
                rows[c.row_start : c.row_stop] = self._wait(handle, server, f"pull of a replica of key {key!r}").arrays[
                    0
                ]
            copies.append(out)
        return copies

    def push_rows(self, key: str | int, row_ids: Any, values: Any) -> Handle[None]:
        """Adds ``values[i]`` to row ``row_ids[i]`` of ``key`` (embedding-style sparse update). Asynchronous."""
        self._calls += 1
        info = self._key(key)
        ids = host_view(row_ids)[0] if is_torch_tensor(row_ids) else np.asarray(row_ids)
        vals, dtype_name = host_view(values)
        if ids.ndim != 1:
            raise ValueError(f"row_ids must be 1-D, got shape {ids.shape}")
        self._check(key, info, vals, dtype_name, ids.size)
        self._cache.pop(key, None)
        parts = []
        for c, positions, local in split_rows(info.chunks, ids):
            meta = {"op": "push", "key": key, "chunk": c.index, "rows": True, "version": self._versions[key][c.index]}
            parts.append((c, meta, [local.astype(np.int64), wire_array(vals[positions], dtype_name)]))
        return self._push_parts(parts, info.row_bytes, f"push_rows to key {key!r}")

    def _push_parts(
        self, parts: list[tuple[Chunk, dict[str, Any], list[Any]]], row_bytes: int, what: str
    ) -> Handle[None]:
        """Sends row pushes (chunk, meta, arrays), to the chunk's server or, replicated, with failover."""
        if self.replicas == 1:
            return self._all([self._request(self._servers[c.server], meta, arrays) for c, meta, arrays in parts], what)
        items = [(c, {**meta, "seq": self._seq(c), "wclock": self._clock}, arrays) for c, meta, arrays in parts]
        handle = self._all([(h, -1) for h in self._send_failover(items, row_bytes)], what, self._push_handle())
        self._unacked.append((self._next_seq - len(items), handle))
        return handle

    def push_sparse(self, key: str | int, indices: Any, values: Any) -> Handle[None]:
        """Pushes a dense gradient of a 1-D ``key`` given by its nonzero entries (top-k compression). Asynchronous.

        Unlike :meth:`push_rows` (an embedding's rows: a lazy sparse step that moves only those rows), this is one
        worker's gradient, zero elsewhere: every chunk gets a push (possibly of no entries), the round's mean is
        over all workers and every element's optimizer state steps, exactly as if the dense array were pushed.
        Only the entries travel (index and value).

        Raises:
            ValueError: ``key`` is not 1-D, ``indices`` and ``values`` differ in length or an index is out of range.
        """
        self._calls += 1
        info = self._key(key)
        if len(info.shape) != 1:
            raise ValueError(f"push_sparse needs a 1-D key; {key!r} is {info.shape}")
        ids = (host_view(indices)[0] if is_torch_tensor(indices) else np.asarray(indices)).astype(np.int64, copy=False)
        vals, dtype_name = host_view(values)
        if ids.ndim != 1 or vals.shape != ids.shape:
            raise ValueError(f"indices and values must be 1-D of one length, got {ids.shape} and {vals.shape}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= info.shape[0]):
            raise ValueError(f"an index of push_sparse is outside 0..{info.shape[0] - 1} of key {key!r}")
        self._check(key, info, vals, dtype_name, ids.size)
        self._cache.pop(key, None)
        parts = []
        for c in info.chunks:
            inside = (ids >= c.row_start) & (ids < c.row_stop)
            version = self._versions[key][c.index]
            meta = {"op": "push", "key": key, "chunk": c.index, "rows": True, "densify": True, "version": version}
            parts.append((c, meta, [ids[inside] - c.row_start, wire_array(vals[inside], dtype_name)]))
        return self._push_parts(parts, info.row_bytes, f"push_sparse to key {key!r}")

    def pull_rows(self, key: str | int, row_ids: Any) -> npt.NDArray[Any]:
        """Rows ``row_ids`` of ``key`` (shape ``(len(row_ids), *key.shape[1:])``), as the model allows. Blocks."""
        self._calls += 1
        info = self._key(key)
        ids = host_view(row_ids)[0] if is_torch_tensor(row_ids) else np.asarray(row_ids)
        if ids.ndim != 1:
            raise ValueError(f"row_ids must be 1-D, got shape {ids.shape}")
        out = np.empty((ids.size, *info.shape[1:]), dtype=info.storage)
        required = self.policy.required_done(self._clock)
        pending = []
        split = split_rows(info.chunks, ids)
        requests = [
            (
                c,
                {"op": "pull", "key": key, "chunk": c.index, "rows": True, "required": required},
                [local.astype(np.int64)],
            )
            for c, _, local in split
        ]
        if self.replicas == 1:
            answers = [self._request(self._servers[c.server], meta, arrays) for c, meta, arrays in requests]
        else:
            answers = [(h, -1) for h in self._send_failover(requests, info.row_bytes)]
        for (c, positions, _), (handle, server) in zip(split, answers, strict=True):
            pending.append((c.index, positions, handle, server))
        versions = self._versions[key]
        for index, positions, handle, server in pending:
            msg = self._wait(handle, server, f"pull_rows of key {key!r}")
            out[positions] = msg.arrays[0]
            version = msg.meta.get("version")
            versions[index] = version if isinstance(version, int) else None
        return out

    def clock(self) -> None:
        """Ends this worker's iteration. Under BSP/SSP it waits while this worker would be more than s ahead.

        Raises:
            PSRequestError: (replicated) a push already answered was rejected; the clock was counted anyway.
        """
        self._calls += 1
        meta: dict[str, Any] = {"op": "clock", "clock": self._clock + 1, "id": -1}
        expect: dict[int, int] = {}
        rejected: BaseException | None = None
        if self.replicas > 1:
            # Sent at once, without waiting for this clock's pushes to be acknowledged: each server is told how
            # many of them it must hold (its own and those forwarded by other replicas) and counts the clock only
            # then (ParameterServer._op_clock), so a backup still never counts a clock before it has its pushes.
            still: list[tuple[int, Handle[None]]] = []
            for first, push in self._unacked:
                if not push.done():
                    still.append((first, push))
                elif rejected is None:
                    rejected = push.exception()  # raised once the clock is sent: the servers count it anyway
            self._unacked = still
            # every push numbered below this is acknowledged: never sent again, its number may be forgotten
            meta["acked"] = min((first for first, _ in still), default=self._next_seq)
            expect, self._expect = self._expect, {}
        self._clock += 1
        for action in clock_actions(self._servers):
            if self.replicas > 1 and not self._live(action.peer):
                continue
            try:
                sent = {**meta, "expect": expect.get(action.peer, 0)} if self.replicas > 1 else meta
                self._transport.isend(action.peer, REQUEST_TAG, (), sent)
            except PeerLostError as exc:
                self._lost(exc, action.peer)
        self._fence_rejoined()
        if not self.policy.may_run(self._clock, self._min_done):
            required = self.policy.required_done(self._clock)
            what = f"clock {self._clock} (waiting for the slowest worker)"
            while True:
                live = [s for s in self._servers if self._live(s)]
                if not live:
                    raise PeerLostError(f"worker {self.rank}: every server is gone", peer=self._servers[-1])
                server = live[self.rank % len(live)]
                try:
                    handle, _ = self._request(server, {"op": "wait_clock", "required": required})
                    self._wait(handle, server, what)
                    break
                except PeerLostError as exc:
                    self._lost(exc, server)
        if rejected is not None:
            raise rejected

    def close(self) -> None:
        """Leaves: the servers stop counting this worker's clock. Idempotent."""
        if self._closed:
            return
        pending = []
        for server in self._servers:
            rejoined = self.replicas > 1 and self._rejoined(server)
            if not self._live(server) and not (rejoined and server not in self._transport.lost_peers()):
                continue  # (a restarted server not yet fenced waits for this worker: it is told it left)
            try:
                pending.append(self._request(server, {"op": "leave"}))
            except PeerLostError as exc:
                self._lost(exc, server)
        self._closed = True
        self._values.close()
        for handle, server in pending:
            try:
                self._wait(handle, server, "leave")
            except PeerLostError as exc:
                self._lost(exc, server)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
