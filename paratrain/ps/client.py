"""The worker's side of the parameter server: ``KVStore`` with push/pull, sparse rows, clocks and a cache.

Every key is split into row chunks spread over the servers (:mod:`.sharding`), so one big layer loads all
servers and small keys spread by hash. A push is asynchronous (a handle); a pull blocks until every chunk is
back. The consistency model is the worker's: each pull tells the servers which clock every worker must have
completed (:meth:`~.consistency.Policy.required_done`), and the servers answer only then. A pull is served
from the local cache when the cached copy is fresh enough under the model ("check the cache first; if too
old, update from the network"); pushes always go to the servers, so caching never loses an update.

A push, a pull and a clock iterate this worker's side of the plan (:mod:`.plans`) for the chunks' owners now:
with one replica, or with ``replicas=R`` and every primary alive, the same messages. With replicas every chunk
lives on R servers (primary-backup, Li et al. OSDI'14; the server side is in :mod:`.server` and
:mod:`.replication`): a request goes to the chunk's first live replica and fails over to the next
(:mod:`.routing`), and a push is acknowledged only when every live replica has it (under BSP/SSP once its owner's
state of the chunk after the push's round reached the others: waiting for a push before this worker's clock
completes that round asks the owners to send their states at once, ``flush``). :meth:`KVStore.clock` does not wait
for its pushes' acknowledgements: it tells each server how many of this clock's pushes that server replicates, and a
server counts the clock only once it holds that many, so a server that takes over a chunk knows which pushes of
which rounds it must still get.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, overload, runtime_checkable

import numpy as np
import numpy.typing as npt

from paratrain._arrays import dtype_from_name, is_torch_tensor, wire_array
from paratrain._current import current_context
from paratrain.config import Settings
from paratrain.device import host_view, on_device
from paratrain.errors import ConfigError, PeerLostError
from paratrain.plan.ir import Action, Parts, Received, Slice
from paratrain.ps.consistency import Policy
from paratrain.ps.membership import ServerSet, owner_slots
from paratrain.ps.optim import ServerOptimizer, make_optimizer
from paratrain.ps.plans import clock_actions, pull_actions, push_actions
from paratrain.ps.protocol import MOVED, REQUEST_TAG, PSRequestError
from paratrain.ps.rejoin import take_place
from paratrain.ps.resizer import Resizer
from paratrain.ps.routing import Route, Router
from paratrain.ps.sharding import DEFAULT_CHUNK_BYTES, Chunk, plan_chunks, split_rows
from paratrain.ps.shared import ValueReader, value_prefix
from paratrain.transport.base import Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["KVStore", "WorkerContext"]


class _Tensor(Protocol):
    """A torch tensor, as far as :meth:`KVStore.pull` into one is concerned (torch is not imported here)."""

    def copy_(self, src: Any, non_blocking: bool = ...) -> Any: ...


_TensorT = TypeVar("_TensorT", bound=_Tensor)


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
    at_row: dict[int, Chunk] = field(default_factory=dict)  # each chunk by its first row (how plan slices name it)
    row_bytes: int = 0  # bytes of one row (how batches are cut)
    routes: dict[tuple[int, ...], Route] = field(default_factory=dict)  # by each chunk's owner (a server index)

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


def _read_in_place(
    values: ValueReader, transport: Transport, worker: int, msg: Message, target: npt.NDArray[Any]
) -> bool:
    """Copies a value that a same-host server answered with a reference to (:mod:`.shared`) into ``target``;
    False when it changed during the copy (then the caller asks for the data).

    Raises:
        PSRequestError: the reference does not fit this server or chunk (a server of another version?).
    """
    prefix = transport.memory_prefix(msg.src)
    try:
        if prefix is None:
            raise ValueError(f"server rank {msg.src} is not on this host")
        return values.read(msg.meta["ref"], value_prefix(prefix, msg.src), msg.meta.get("seq"), target)
    except (ValueError, OSError) as exc:
        raise PSRequestError(f"worker {worker}: server rank {msg.src} answered a pull unreadably: {exc}") from None


def _replicas(settings: Settings, servers: Sequence[int], replicas: int | None) -> int:
    """The replicas of each chunk (``settings.ps_replicas`` unless given), checked against ``servers``."""
    if not servers:
        raise ConfigError("a KVStore needs the ranks of one or more servers")
    if replicas is None:
        replicas = settings.ps_replicas
    if not 1 <= replicas <= len(servers):
        raise ConfigError(
            f"replicas={replicas} needs 1..{len(servers)} servers (the job has {len(servers)}); "
            "start more servers or lower replicas"
        )
    return replicas


def _all(pending: Sequence[tuple[Handle[Message], int]], what: str, worker: int, result: Handle[None]) -> Handle[None]:
    """``result``, completed when every reply arrived; failed with the first error."""
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
                error = PSRequestError(f"worker {worker}: {what} rejected: {meta['error']}")
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
        servers: the transport ranks of the servers, in server order (default: the job's, from the context's
            settings: the ranks after the workers').
        replicas: servers holding each chunk, ``1 <= R <= S``. With 2 or more, a push is acknowledged only
            once every replica has it and the job survives the death of R - 1 servers (requests fail over to
            the next replica). The price: under BSP/SSP each owner sends each chunk's state once per round to
            the other replicas (the workers' pushes aggregated: a backup receives and copies one chunk per
            round, not one push per worker), and a push is acknowledged a round trip after its round is
            complete, so wait for pushes after :meth:`clock` (a wait before it works, at the cost of an extra
            state); under ASP each push is forwarded. Default: ``settings.ps_replicas``
            (``PARATRAIN_PS_REPLICAS``, set by ``paratrain launch --replicas``; 1 unless set).
        rejoin: this process replaces a dead worker (:mod:`.rejoin`): take its place on the servers and go on
            from :attr:`resumed_clock` (run the steps from there). Default: when this process is a restarted
            worker of a job that restarts them (``paratrain launch --servers S --max-restarts R``). Raises
            :class:`~paratrain.errors.WorkDoneError` if the dead worker had finished (left the servers).

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
        servers: Sequence[int] | None = None,
        rejoin: bool | None = None,
        active_servers: int | None = None,
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
        servers = settings.server_ranks if servers is None else tuple(servers)
        self.replicas = replicas = _replicas(settings, servers, replicas)
        self.policy = Policy.parse(consistency, staleness)
        self._optimizer = make_optimizer(optimizer)
        self._transport = ctx.transport
        self.rank = ctx.rank
        self.num_servers = len(servers)
        self._servers = list(servers)
        self.timeout = settings.timeout if timeout is None else timeout
        self._router = Router(ctx.transport, rank=ctx.rank, servers=servers, replicas=replicas, timeout=self.timeout)
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
        self._resumed = 0  # the clock a rejoined worker resumed at
        self._exact: int | None = None  # ... and the version its first pulls ask for (BSP)
        if join:
            router = self._router
            replies = [router.request(s, {"op": "join"}) for s in self._servers]
            router.clock = max(int(router.wait(h, s, "join").meta.get("clock", 0)) for h, s in replies)
        elif rejoin if rejoin is not None else ctx.transport.rejoined and settings.ps_worker_restarts:
            self._resumed = take_place(self._router, self.policy.staleness, self.rank)
            self._exact = self._resumed if self.policy.staleness == 0 else None
        self._initialising: dict[str | int, tuple[tuple[int, ...], int]] = {}  # key -> (shape, itemsize) in init
        self._resizer: Resizer | None = None
        if active_servers is not None:
            if replicas > 1 or settings.ps_worker_restarts:
                raise ConfigError(
                    "active_servers makes the servers holding keys resizable, which replicated jobs and jobs that "
                    "restart workers do not support yet: use replicas=1 without --max-restarts"
                )
            try:
                placement = ServerSet.first(len(servers), active_servers)
            except ValueError as exc:
                raise ConfigError(f"active_servers: {exc}") from None
            self._resizer = Resizer(self._router, placement, self._replan)
            self._router.resizer = self._resizer
            self._router.rehome = self._rehome

    @property
    def clock_value(self) -> int:
        """This worker's clock: how many times it called :meth:`clock`."""
        return self._router.clock

    @property
    def resumed_clock(self) -> int:
        """The clock this worker resumed at when it replaced a dead one (:mod:`.rejoin`); 0 otherwise."""
        return self._resumed

    @property
    def failovers(self) -> int:
        """Requests sent again to another replica after their server died."""
        return self._router.failovers

    @property
    def resyncs(self) -> int:
        """Restarted servers this worker fenced for (each caught up and is a backup again)."""
        return self._router.resyncs

    @property
    def fences(self) -> list[tuple[float, float]]:
        """Each fence: when this worker saw the server back (``time.time()``) and how long it paused, in seconds."""
        return self._router.fences

    # -- plumbing ------------------------------------------------------------------------------------------

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
        router = self._router
        router.begin()
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"keys are str or int, not {type(key).__name__}")
        arr, dtype_name = host_view(array)
        if dtype_name == "bfloat16":
            raise TypeError(
                f"key {key!r}: bfloat16 keys are not supported (the servers add in the key's dtype): keep the key "
                "float32 and push bfloat16 gradients, as compression='bf16' does"
            )
        shape = tuple(int(d) for d in arr.shape)
        chunks = self._plan(key, shape, arr.itemsize)
        rows = _rows(arr)
        spec = self._optimizer.spec() if self._optimizer is not None else None
        items = []
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
                "chunks": len(chunks),
            }
            if self.replicas > 1:
                meta["replicas"] = [self._servers[r] for r in chunk.replicas]
            items.append((chunk, meta, [part] if self.rank == 0 else []))
        self._initialising[key] = (shape, arr.itemsize)
        try:
            router.create(items, f"init of key {key!r}")
        finally:
            del self._initialising[key]
        row_bytes = math.prod(rows.shape[1:]) * arr.itemsize
        chunks = self._plan(key, shape, arr.itemsize)  # (the placement may have changed meanwhile: a resize)
        self._keys[key] = self._key_info(shape, dtype_name, chunks, row_bytes)
        self._versions[key] = [None] * len(chunks)
        self._cache.pop(key, None)

    def _plan(self, key: str | int, shape: tuple[int, ...], itemsize: int) -> list[Chunk]:
        """The key's chunks where they live now (resizable: on the servers holding keys, :mod:`.membership`)."""
        chunks = plan_chunks(
            key, shape, itemsize, self.num_servers, chunk_bytes=self._chunk_bytes, replicas=self.replicas
        )
        if self._resizer is None:
            return chunks
        owners = owner_slots(key, len(chunks), self._resizer.servers)
        return [dataclasses.replace(c, server=s) for c, s in zip(chunks, owners, strict=True)]

    def _key_info(self, shape: tuple[int, ...], dtype_name: str, chunks: list[Chunk], row_bytes: int) -> _Key:
        primaries = tuple(c.server for c in chunks)
        route = (push_actions(chunks, row_bytes, self._servers), pull_actions(chunks, row_bytes, self._servers))
        return _Key(shape, dtype_name, chunks, {c.row_start: c for c in chunks}, row_bytes, routes={primaries: route})

    def _replan(self, servers: ServerSet) -> None:
        """Plans every key again for the servers holding keys now (a resize, :mod:`.resizer`)."""
        assert self._resizer is not None and self._resizer.servers == servers  # _plan reads it there
        for key, info in self._keys.items():
            chunks = self._plan(key, info.shape, info.storage.itemsize)
            self._keys[key] = self._key_info(info.shape, info.dtype_name, chunks, info.row_bytes)

    def _rehome(self, meta: dict[str, Any]) -> Chunk:
        """The chunk a request (``meta``: its key and chunk index) goes to now, after its chunk moved."""
        key, index = meta["key"], int(meta["chunk"])
        initialising = self._initialising.get(key)
        return (self._key(key).chunks if initialising is None else self._plan(key, *initialising))[index]

    def push(self, key: str | int, array: Any) -> Handle[None]:
        """Sends ``array`` to be added (or applied as a gradient) to ``key``. Asynchronous: ``.wait()`` for it.

        Do not modify ``array`` until the handle is done (it is sent without copying, and sent again should its
        server die). Replicated under BSP/SSP the handle completes once the push's round is complete and on every
        replica: wait for it after :meth:`clock` (see ``replicas``).
        """
        router = self._router
        router.begin()
        info = self._key(key)
        arr, dtype_name = host_view(array)
        self._check(key, info, arr, dtype_name, None)
        rows = _rows(arr)
        self._cache.pop(key, None)
        versions = self._versions[key]
        stamps = {c.index: router.stamp(c) for c in info.chunks}  # replicated: sequence numbers, in chunk order
        (actions, _), orphans = router.route(info.chunks, info.row_bytes, info.routes)
        # the plan's sends, one message per batch (each chunk in it a request of its own); each request posts its
        # reply's receive first (the plan's recv)
        pending: list[tuple[Handle[Message], int]] = [(h, -1) for _, h in orphans]
        for a in (a for a in actions if a.kind == "send"):
            items = [
                (
                    c,
                    {"op": "push", "key": key, "chunk": c.index, "version": versions[c.index], **stamps[c.index]},
                    [wire_array(rows[c.row_start : c.row_stop], dtype_name)],
                )
                for c in (info.at_row[part.start] for part in _parts(a))
            ]
            pending += [(h, a.peer) for h in router.send(a.peer, items, info.row_bytes)]
        handle = _all(pending, f"push to key {key!r}", self.rank, router.push_handle(self.policy.kind))
        router.pushed(len(info.chunks), handle)
        return handle

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
        router = self._router
        router.begin()
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
            if self.policy.cache_fresh(cached_done, router.clock):
                self._versions[key] = list(cached_versions)
                hit = np.empty(info.shape, dtype=info.storage) if out is None else out
                hit_rows = _rows(hit)
                for chunk, part in zip(info.chunks, parts, strict=True):
                    hit_rows[chunk.row_start : chunk.row_stop] = part
                return hit
        required = self.policy.required_done(router.clock)
        if out is None:
            out = np.empty(info.shape, dtype=info.storage)
        rows = _rows(out)
        what = f"pull of key {key!r}"
        ref = bool(self._local)  # a server off this host ignores it
        asked = {"op": "pull", "key": key, "required": required, "ref": ref}
        if self._exact is not None and self._exact == router.clock:  # a rejoined worker computes this clock again
            asked["exact"] = self._exact
        (_, actions), orphans = router.route(info.chunks, info.row_bytes, info.routes)
        # the plan: a receive, then its request; the copies out of each reply say which chunks it carries
        carried: dict[int, list[Chunk]] = {}
        for a in actions:
            if a.kind == "copy":
                assert isinstance(a.data, Received) and a.out is not None
                carried.setdefault(a.data.action, []).append(info.at_row[a.out.start])
        pending: list[tuple[Chunk, Handle[Message], int]] = []
        for i, a in enumerate(actions):
            if a.kind == "send":
                batch = carried[i - 1]
                items = [(c, {**asked, "chunk": c.index}, ()) for c in batch]
                answers = router.send(a.peer, items, info.row_bytes)
                pending += [(c, h, a.peer) for c, h in zip(batch, answers, strict=True)]
        pending += [(c, h, -1) for c, h in orphans]
        done = None
        versions = self._versions[key]
        received: dict[int, npt.NDArray[Any]] | None = {}  # chunk index -> its array, what the cache may keep
        for chunk, handle, server in pending:
            msg = router.wait(handle, server, what)
            if msg.meta.get(MOVED) is True:  # a resize moved it meanwhile: asked again where it is now
                again = {**asked, "chunk": chunk.index}
                msg = router.ask(router.moved_to(again), again, (), what)
            target = rows[chunk.row_start : chunk.row_stop]
            if "ref" in msg.meta:
                received = None  # read in place: nothing received to keep, and a copy costs as much as a new pull
                if not _read_in_place(self._values, self._transport, self.rank, msg, target):
                    meta = {"op": "pull", "key": key, "chunk": chunk.index, "required": required, "ref": False}
                    msg = router.ask(chunk, meta, (), what)  # it changed while copied: the data itself, this once
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

    def pull_replicas(self, key: str | int) -> list[npt.NDArray[Any]]:
        """Every replica's copy of ``key`` (the i-th: each chunk as its i-th live replica holds it), read as
        :meth:`pull` reads. For audits and tests: with ``replicas=R`` all R copies are equal after every clock.
        Blocks; bypasses the cache."""
        router = self._router
        router.begin()
        info = self._key(key)
        required = self.policy.required_done(router.clock)
        copies = []
        for i in range(self.replicas):
            out = np.empty(info.shape, dtype=info.storage)
            rows = _rows(out)
            for c in info.chunks:
                live = [self._servers[r] for r in c.replicas if router.live(self._servers[r])]
                server = live[min(i, len(live) - 1)]
                meta = {"op": "pull", "key": key, "chunk": c.index, "required": required, "replica": i}
                handle, _ = router.request(server, meta)
                rows[c.row_start : c.row_stop] = router.wait(
                    handle, server, f"pull of a replica of key {key!r}"
                ).arrays[0]
            copies.append(out)
        return copies

    def push_rows(self, key: str | int, row_ids: Any, values: Any) -> Handle[None]:
        """Adds ``values[i]`` to row ``row_ids[i]`` of ``key`` (embedding-style sparse update). Asynchronous."""
        self._router.begin()
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
        """Sends row pushes (chunk, meta, arrays) to their chunks' owners (:meth:`.Router.send_each`)."""
        router = self._router
        items = [(c, {**meta, **router.stamp(c)}, arrays) for c, meta, arrays in parts]
        handle = _all(router.send_each(items, row_bytes), what, self.rank, router.push_handle(self.policy.kind))
        router.pushed(len(items), handle)
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
        self._router.begin()
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
        router = self._router
        router.begin()
        info = self._key(key)
        ids = host_view(row_ids)[0] if is_torch_tensor(row_ids) else np.asarray(row_ids)
        if ids.ndim != 1:
            raise ValueError(f"row_ids must be 1-D, got shape {ids.shape}")
        out = np.empty((ids.size, *info.shape[1:]), dtype=info.storage)
        required = self.policy.required_done(router.clock)
        split = split_rows(info.chunks, ids)
        requests = [
            (
                c,
                {"op": "pull", "key": key, "chunk": c.index, "rows": True, "required": required},
                [local.astype(np.int64)],
            )
            for c, _, local in split
        ]
        answers = router.send_each(requests, info.row_bytes)
        versions = self._versions[key]
        for (c, positions, _), (_, meta, arrays), (handle, server) in zip(split, requests, answers, strict=True):
            msg = router.wait(handle, server, f"pull_rows of key {key!r}")
            if msg.meta.get(MOVED) is True:  # a resize moved it meanwhile: asked again where it is now
                msg = router.ask(router.moved_to(meta), meta, arrays, f"pull_rows of key {key!r}")
            out[positions] = msg.arrays[0]
            version = msg.meta.get("version")
            versions[c.index] = version if isinstance(version, int) else None
        return out

    def clock(self) -> None:
        """Ends this worker's iteration. Under BSP/SSP it waits while this worker would be more than s ahead.

        Raises:
            PSRequestError: (replicated) a push already answered was rejected; the clock was counted anyway.
        """
        router = self._router
        router.begin()
        meta: dict[str, Any] = {"op": "clock", "clock": router.clock + 1, "id": -1}
        # Replicated, sent at once, without waiting for this clock's pushes to be acknowledged: each server is told
        # how many of them it must hold (its own and those forwarded by other replicas) and counts the clock only
        # then (ParameterServer's clocks), so a backup still never counts a clock before it has its pushes.
        fields, rejected = router.clock_fields()
        router.clock += 1
        for action in clock_actions(router.members()):
            try:
                self._transport.isend(action.peer, REQUEST_TAG, (), {**meta, **fields[action.peer]} if fields else meta)
            except PeerLostError as exc:
                router.lost(exc, action.peer)
        router.fence_rejoined()
        if not self.policy.may_run(router.clock, router.min_done):
            required = self.policy.required_done(router.clock)
            router.wait_clock(required, f"clock {router.clock} (waiting for the slowest worker)")
        if rejected is not None:
            raise rejected

    # -- servers joining and leaving (.resize) -------------------------------------------------------------

    @property
    def active_servers(self) -> tuple[int, ...]:
        """The servers holding keys now (indices into the job's servers)."""
        return tuple(range(self.num_servers)) if self._resizer is None else self._resizer.servers.active

    @property
    def moved_requests(self) -> int:
        """Requests sent again to a chunk's new server because a resize moved the chunk while they waited."""
        return self._router.rehomed

    @property
    def resize_fences(self) -> list[tuple[float, float]]:
        """Each resize this worker took part in: when it saw it (``time.time()``) and how long it paused, in s."""
        return [] if self._resizer is None else list(self._resizer.fences)

    def add_server(self, server: int) -> Handle[dict[str, Any]]:
        """Gives server ``server`` (standing by) its share of every key. Call it on one worker; it returns at once.

        The chunks move at the workers' next parameter-server calls (each pauses at a fence until they moved:
        :mod:`.resize`); the handle's ``wait()`` says what moved (``active``, ``chunks``, ``bytes``, ``seconds``
        from the request to the end, ``rounds`` of fences).

        Raises:
            ConfigError: this KVStore was not created with ``active_servers``.
            PSRequestError: (from ``wait``) the server holds keys already or does not exist, another resize is in
                progress, or the job cannot resize (replicated, restarting workers).
        """
        return self._resize(add=server)

    def remove_server(self, server: int) -> Handle[dict[str, Any]]:
        """Hands server ``server``'s chunks to the other servers holding keys (it then stands by); as
        :meth:`add_server`."""
        return self._resize(remove=server)

    def _resize(self, **change: int) -> Handle[dict[str, Any]]:
        self._router.begin()
        if self._resizer is None:
            raise ConfigError("this KVStore cannot resize: create it with active_servers=S (and start more servers)")
        return self._resizer.request(**change)

    def close(self) -> None:
        """Leaves: the servers stop counting this worker's clock. Idempotent."""
        if not self._router.closed:
            self._router.leave()
            self._values.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
