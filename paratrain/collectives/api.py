"""The collectives users call (allreduce, broadcast, allgather, reduce_scatter) on numpy arrays and torch tensors.

:class:`Collectives` binds the executors of :mod:`.ring` and :mod:`.tree` to one rank's transport. Each call

1. validates its arguments locally (``ValueError``/``TypeError`` before any data moves; with several ranks the
   rejecting rank still takes part in step 3 as "invalid", so that the others fail at once instead of waiting
   for it, and the tags stay in step),
2. takes the context's next collective tag (the same on every rank, since every rank calls collectives in
   the same order),
3. runs the agreement: every rank learns every rank's :class:`~paratrain.collectives.signature.Signature` (op,
   dtype, shape, algorithm, root), and on any difference all of them raise the same
   :class:`~paratrain.errors.CollectiveMismatchError` before data moves, and stay usable. Over sockets that is
   :func:`~paratrain.collectives.tree.agree`; when all ranks share a host (:meth:`Collectives.enable_shared_memory`)
   it goes through the shared-memory segment for every call and algorithm (microseconds), and the shared-memory
   allreduce folds it into its first synchronisation,
4. runs the chosen algorithm on flat views of the data, writing into a fresh result (or in place for
   ``allreduce_``), and returns the result as the caller's type: numpy in, numpy out; torch in, torch out. A
   device (CUDA) tensor is staged: copied to pinned host memory when the call takes it, and the result copied
   back to its device, finished when the call (or the async handle's ``wait``) returns (:mod:`paratrain.device`).

Algorithms are looked up by name in per-instance registries (``allreduce_algorithms``,
``broadcast_algorithms``); ``algorithm="auto"`` asks a replaceable policy (``choose_allreduce``,
``choose_broadcast``), so a faster algorithm (e.g. shared memory inside a host) plugs in without touching
this module.

Thread safety: every method may be called from any thread, but all ranks must issue their collectives in the
same order (it decides the tags). Blocking calls run in the calling thread; ``*_async`` calls run, in call
order, on one background thread per :class:`Collectives` (:mod:`.background`). The ``auto`` policies live
in :mod:`.policy` (re-exported here).

Torch tensors on a device that has a torch.distributed engine (NCCL for CUDA tensors where every rank has a GPU of
its own; :mod:`.torch_engines`) keep steps 1-3 and hand step 4 to the engine (:mod:`.routing` builds those bodies).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from paratrain._arrays import dtype_name as wire_dtype_name
from paratrain._arrays import is_torch_tensor
from paratrain.collectives.background import BackgroundWorker
from paratrain.collectives.hierarchical import HostLayout, hierarchical_allreduce
from paratrain.collectives.ops import Reducer
from paratrain.collectives.plans import chunk_bounds
from paratrain.collectives.policy import (
    AUTO_BROADCAST_TREE_MAX_BYTES,
    AUTO_DIRECT_MAX_BYTES,
    AUTO_TREE_MAX_BYTES,
    LOOPBACK_BYTES_PER_SECOND,
    default_allreduce_choice,
    default_broadcast_choice,
    network_allreduce_choice,
)
from paratrain.collectives.ring import (
    chain_broadcast_run,
    ring_allgather_run,
    ring_allreduce_run,
    ring_reduce_scatter_run,
)
from paratrain.collectives.routing import EngineRoutes
from paratrain.collectives.signature import INVALID, Signature, mismatch_error
from paratrain.collectives.torch_engines import TorchEngine
from paratrain.collectives.tree import Exchange, agree, direct_allreduce, tree_allreduce, tree_broadcast
from paratrain.device import DEVICE_TIMEOUT, copy_to_device_, host_view, on_device, to_device, wait_event
from paratrain.device.events import SupportsQuery
from paratrain.errors import CollectiveMismatchError, DeviceTimeoutError, ParatrainError
from paratrain.transport.base import Handle, Transport

if TYPE_CHECKING:
    from paratrain.collectives.shm import ShmAllreduce, ShmGroup
    from paratrain.timeline import Timeline

__all__ = [
    "AUTO_BROADCAST_TREE_MAX_BYTES",
    "AUTO_DIRECT_MAX_BYTES",
    "AUTO_TREE_MAX_BYTES",
    "DEFAULT_ALLREDUCE_ALGORITHMS",
    "DEFAULT_BROADCAST_ALGORITHMS",
    "LOOPBACK_BYTES_PER_SECOND",
    "AllreduceAlgorithm",
    "AllreduceRun",
    "BroadcastAlgorithm",
    "Collectives",
    "default_allreduce_choice",
    "default_broadcast_choice",
    "network_allreduce_choice",
]

A = TypeVar("A")
T = TypeVar("T")

AllreduceRun = Callable[[Exchange, npt.NDArray[Any], npt.NDArray[Any], Reducer], None]


@dataclass(frozen=True, slots=True)
class AllreduceAlgorithm:
    """An allreduce implementation, registered under a name in :attr:`Collectives.allreduce_algorithms`.

    Attributes:
        run: ``run(exchange, src, dst, reducer)`` reduces every rank's flat ``src`` into its flat ``dst``
            (``dst`` may be ``src``); it is called after the agreement, on every rank, with equal shapes and
            dtypes, and must finish ``reducer.finish`` (mean) itself. It must use only ``exchange`` to talk
            (its tag, deadline and bookkeeping) and leave no send pending when it returns.
        data_in_agreement: the agreement also gathers every rank's ``src`` into ``exchange.gathered``.
        agreement: False for algorithms that check, themselves, that all ranks called them alike (the shared-
            memory one does, in the segment, folded into its first synchronisation); the API then skips its own
            agreement and passes the call's signature as ``exchange.signature``. Such an algorithm must raise the
            same ``CollectiveMismatchError`` on every rank, before data moves, when the signatures differ.
    """

    run: AllreduceRun
    data_in_agreement: bool = False
    agreement: bool = True


@dataclass(frozen=True, slots=True)
class _ShmCall:
    """An in-place allreduce of one op, algorithm, dtype and shape on the shared-memory path, worked out once
    (:meth:`Collectives._shm_allreduce_`); valid while ``choose`` is still the policy and ``impl`` still
    registered under ``name``."""

    choose: Callable[[int, int], str]
    name: str
    impl: AllreduceAlgorithm
    reducer: Reducer
    desc: bytes


#: How many shapes' fast paths a :class:`Collectives` keeps (a model's buckets are a handful).
_SHM_CALLS = 64

#: A broadcast algorithm: ``impl(exchange, dst, root=..., source=...)`` copies the root's flat ``source``
#: into every rank's flat ``dst``.
BroadcastAlgorithm = Callable[..., None]

DEFAULT_ALLREDUCE_ALGORITHMS: Mapping[str, AllreduceAlgorithm] = MappingProxyType(
    {
        "ring": AllreduceAlgorithm(ring_allreduce_run),
        "tree": AllreduceAlgorithm(tree_allreduce),
        "direct": AllreduceAlgorithm(direct_allreduce, data_in_agreement=True),
    }
)
DEFAULT_BROADCAST_ALGORITHMS: Mapping[str, BroadcastAlgorithm] = MappingProxyType(
    {"tree": tree_broadcast, "chain": chain_broadcast_run}
)


# -- the socket agreement ------------------------------------------------------------------------------------


def _socket_agree(ex: Exchange, sig: Signature, payload: npt.NDArray[Any] | None = None) -> list[Signature]:
    """Every rank's signature through :func:`agree`; raises the same ``CollectiveMismatchError`` on every rank."""
    sigs = [Signature.from_wire(wire, q) for q, wire in enumerate(agree(ex, sig.to_wire(), payload))]
    error = mismatch_error(sigs)
    if error is not None:
        raise error
    return sigs


# -- arrays in and out ----------------------------------------------------------------------------------------


def _as_array(x: Any, timeout: float = DEVICE_TIMEOUT) -> tuple[npt.NDArray[Any], str]:
    """The host view a collective works on: ``x``'s own memory where it can be, a staged host copy of a device
    (CUDA) tensor (:mod:`paratrain.device`)."""
    if not (isinstance(x, np.ndarray) or is_torch_tensor(x)):
        raise TypeError(f"collectives take numpy arrays or torch tensors, not {type(x).__name__}")
    return host_view(x, timeout)


def _host_tensor(arr: npt.NDArray[Any], dtype_name: str) -> Any:
    """``arr`` as a CPU torch tensor sharing its memory (bfloat16 travels as its 16-bit pattern)."""
    import torch

    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _wrap(like: Any, arr: npt.NDArray[Any], dtype_name: str, timeout: float = DEVICE_TIMEOUT) -> Any:
    """``arr`` as the caller's type: a torch tensor (sharing memory; on the caller's device for a device tensor)
    for torch input, else the array itself."""
    if not is_torch_tensor(like):
        return arr
    tensor = _host_tensor(arr, dtype_name)
    return to_device(tensor, like, timeout) if on_device(like) else tensor


def _shares_memory(x: Any, view: npt.NDArray[Any]) -> bool:
    """True if ``view`` (from :func:`_as_array`) is ``x``'s own memory rather than a contiguous or host copy."""
    if isinstance(x, np.ndarray):
        return bool(x.flags.c_contiguous)
    return not on_device(x) and bool(x.is_contiguous())


def _write_back(x: Any, result: npt.NDArray[Any], dtype_name: str, timeout: float = DEVICE_TIMEOUT) -> None:
    if isinstance(x, np.ndarray):
        x[...] = result.reshape(x.shape)
    elif on_device(x):
        copy_to_device_(x.detach(), _host_tensor(result, dtype_name), timeout)
    else:
        x.detach().copy_(_host_tensor(result, dtype_name).reshape(x.shape))


# -- the user-facing class ------------------------------------------------------------------------------------


class Collectives:
    """The collective operations of one rank, over its transport.

    Usually reached through a :class:`~paratrain.Context` (``ctx.allreduce(...)``) or the module-level
    functions (``paratrain.allreduce(...)``), which delegate here.

    Args:
        transport: this rank's transport.
        next_tag: gives each collective call a fresh tag, the same on every rank (``Context.next_collective_tag``).
        timeout: default seconds a call may take before ``CommTimeoutError``.
        hosts: host id of every rank (ranks with equal ids share a host), or None if unknown.

    Attributes:
        allreduce_algorithms: name -> :data:`AllreduceAlgorithm`; add entries to register an algorithm.
            With ``hosts`` spanning several hosts (some with several ranks), ``"hierarchical"`` is registered
            and ``auto`` picks it above the ``"direct"`` size.
        broadcast_algorithms: name -> :data:`BroadcastAlgorithm`.
        choose_allreduce: ``(nbytes, world_size) -> name``, the policy behind ``algorithm="auto"``.
        choose_broadcast: the same for broadcast.

    Example:
        >>> import numpy as np
        >>> from paratrain.testing import run_ranks
        >>> run_ranks(2, lambda ctx: ctx.collectives.allreduce(np.array([ctx.rank + 1.0])).tolist())
        [[3.0], [3.0]]
    """

    def __init__(
        self,
        *,
        transport: Transport,
        next_tag: Callable[[], int],
        timeout: float,
        hosts: Sequence[str] | None = None,
    ) -> None:
        self.transport = transport
        self.timeout = timeout
        self._next_tag = next_tag
        self._order = threading.Lock()
        self._worker = BackgroundWorker(f"paratrain-collectives-{transport.rank}")
        self.allreduce_algorithms: dict[str, AllreduceAlgorithm] = dict(DEFAULT_ALLREDUCE_ALGORITHMS)
        self.broadcast_algorithms: dict[str, BroadcastAlgorithm] = dict(DEFAULT_BROADCAST_ALGORITHMS)
        self.choose_allreduce: Callable[[int, int], str] = default_allreduce_choice
        self.choose_broadcast: Callable[[int, int], str] = default_broadcast_choice
        self._shm: ShmAllreduce | None = None
        self._reducers: dict[tuple[str, str], Reducer] = {}
        self._shm_calls: dict[tuple[Any, ...], _ShmCall] = {}  # (op, algorithm, dtype, shape) -> its fast path
        #: where calls are recorded (``PARATRAIN_TIMELINE``; :mod:`paratrain.timeline`), or None
        self.timeline: Timeline | None = None
        #: bytes this rank handed to allreduce calls (whatever path carried them: sockets or shared memory)
        self.allreduce_bytes = 0
        # torch.distributed engines (NCCL for CUDA tensors where it fits) and the calls they take (:mod:`.routing`)
        self._routes = EngineRoutes(
            transport=transport,
            timeout=timeout,
            host=None if hosts is None else hosts[transport.rank],
            allgather=self.allgather,
            agree=self._agree_tagged,
        )
        if hosts is not None and HostLayout(hosts).is_hierarchical:
            self._enable_hierarchy(HostLayout(hosts))

    def _enable_hierarchy(self, layout: HostLayout) -> None:
        """Registers ``"hierarchical"`` and lets ``auto`` use it for everything ``"direct"`` does not cover."""
        self.allreduce_algorithms["hierarchical"] = AllreduceAlgorithm(
            functools.partial(hierarchical_allreduce, layout=layout)
        )
        flat = self.choose_allreduce

        def choose(nbytes: int, world_size: int) -> str:
            name = flat(nbytes, world_size)
            return name if name == "direct" else "hierarchical"

        self.choose_allreduce = choose

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.transport.world_size

    # -- plumbing

    def _resolve(
        self, algorithm: str, registry: Mapping[str, Any], choose: Callable[[int, int], str], nbytes: int
    ) -> str:
        if algorithm == "auto":
            algorithm = choose(nbytes, self.world_size)
            if algorithm not in registry:
                raise ValueError(f"the auto policy chose {algorithm!r}, which is not registered")
            return algorithm
        if algorithm not in registry:
            choices = ", ".join(repr(a) for a in ("auto", *registry))
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {choices}")
        return algorithm

    def _run(self, body: Callable[[int], T], label: str = "collective", x: object = None) -> T:
        """Takes the call's tag and runs ``body(tag)`` in the calling thread (recorded on the timeline as
        ``label``, with ``x``'s bytes)."""
        with self._order:
            tag = self._next_tag()
        # calls complete in call order: a blocking call waits for the async calls issued before it (algorithms
        # outside the tag scheme, like shared memory, rely on every rank running calls in one order)
        self._worker.drain(self.timeout)
        timeline = self.timeline
        if timeline is None:
            return body(tag)
        start = time.time()
        try:
            return body(tag)
        finally:
            timeline.span(label, label.upper(), start, time.time(), bytes=_nbytes(x))

    def _submit(self, body: Callable[[int], T], label: str = "collective", x: object = None) -> Handle[T]:
        """Takes the call's tag and queues ``body(tag)`` on the worker; tags and queue order agree. On the
        timeline: ``QUEUE`` until the worker starts it, then ``label``."""
        timeline = self.timeline
        queued, nbytes = time.time(), _nbytes(x) if timeline is not None else 0

        def timed(tag: int) -> T:
            if timeline is None:
                return body(tag)
            start = time.time()
            timeline.span(label, "QUEUE", queued, start)
            try:
                return body(tag)
            finally:
                timeline.span(label, label.upper(), start, time.time(), bytes=nbytes)

        with self._order:
            tag = self._next_tag()
            return self._worker.submit(lambda: timed(tag))

    def _deadline(self, timeout: float | None) -> float:
        """The seconds a call with ``timeout`` may take (the collectives' default where None)."""
        return self.timeout if timeout is None else timeout

    def _exchange(self, tag: int, timeout: float | None, label: str) -> Exchange:
        return Exchange(self.transport, tag=tag, timeout=self._deadline(timeout), label=label)

    def _agree(self, ex: Exchange, sig: Signature, payload: npt.NDArray[Any] | None = None) -> list[Signature]:
        """Every rank's signature, by rank; the same ``CollectiveMismatchError`` on every rank if they differ.

        Through the shared-memory segment when it is enabled (every rank is on this host), else over sockets.
        A ``payload`` (for ``"direct"``) always rides on the socket rounds, after the agreement proper.
        """
        if self._shm is None:
            return _socket_agree(ex, sig, payload)
        sigs: list[Signature] = self._shm.agree(ex, sig)
        if payload is not None:
            agree(ex, sig.to_wire(), payload)
        return sigs

    def _checked(
        self, prepare: Callable[[], Callable[[int], T]], timeout: float | None, mode: str = ""
    ) -> Callable[[int], T]:
        """``prepare()``: the call's local checks, which return its body. When they raise ``ValueError`` or
        ``TypeError`` with several ranks, this rank first takes the call's tag and joins its agreement as
        "invalid" (the others raise ``CollectiveMismatchError`` at once instead of waiting for it until their
        timeout, and every rank's tags stay in step), then raises the error. Blocks for that round, which runs on
        the background thread instead for ``mode="snapshot"`` (the async calls)."""
        try:
            return prepare()
        except (ValueError, TypeError, DeviceTimeoutError):
            if self.world_size > 1:

                def reject(tag: int) -> None:
                    self._reject(tag, timeout)

                if mode == "snapshot":
                    self._submit(reject)
                else:
                    with suppress(ParatrainError):  # the caller's own error, raised next, says more
                        self._run(reject)
            raise

    def _reject(self, tag: int, timeout: float | None) -> None:
        """Joins call ``tag``'s agreement as "invalid": the other ranks raise ``CollectiveMismatchError`` at once."""
        if self.world_size > 1:
            with self._exchange(tag, timeout, "a rejected call") as ex, suppress(CollectiveMismatchError):
                self._agree(ex, INVALID)  # raises the mismatch it causes, which is no news here

    # -- torch.distributed engines (:mod:`.torch_engines`, :mod:`.routing`)

    def use_torch_distributed(
        self, backend: str = "gloo", device_type: str | None = None, *, timeout: float | None = None
    ) -> TorchEngine:
        """Sends this group's collectives on torch tensors of ``device_type`` through a torch.distributed process
        group of ``backend`` (``"nccl"``: CUDA tensors; ``"gloo"``: CPU, default, or CUDA tensors). Collective:
        every rank calls it, in the order of its other collectives.

        Calls with ``algorithm="auto"`` (or the backend's name) on such tensors then agree as always and hand the
        data to the engine; numpy arrays, other devices and the dtypes the engines lack (bool, complex, int16)
        keep paratrain's algorithms. CUDA tensors get their engine by themselves at the first collective on one
        (:func:`~paratrain.collectives.torch_engines.choose_engine`, ``PARATRAIN_CUDA_COLLECTIVES``); this call is for
        choosing yourself, e.g. Gloo for CPU tensors to compare it with paratrain's own algorithms in one program.

        Raises:
            ConfigError: ranks asked for different engines, or for one that cannot take ``device_type``.

        Example:
            >>> import torch
            >>> from paratrain.testing import run_ranks
            >>> def fn(ctx):
            ...     ctx.collectives.use_torch_distributed("gloo")
            ...     return ctx.allreduce(torch.tensor([ctx.rank + 1.0])).tolist()
            >>> run_ranks(2, fn)
            [[3.0], [3.0]]
        """
        return self._routes.use(backend, device_type, timeout)

    def open_torch_distributed(
        self, backend: str, device_type: str | None = None, *, timeout: float | None = None
    ) -> TorchEngine:
        """A torch.distributed process group of ``backend`` over these ranks for the caller's own traffic (the
        pipeline's point-to-point sends: :mod:`paratrain.torch.pipeline`); the collectives do not use it. Collective
        (every rank calls it, in the order of its other collectives); :meth:`TorchEngine.close` lets it go.

        Raises:
            ConfigError: as :meth:`use_torch_distributed`.
        """
        return self._routes.open(backend, device_type, timeout)

    def device_engine(self, device: Any) -> TorchEngine | None:
        """The engine that carries collectives of tensors on torch device ``device``, or None where paratrain's own
        algorithms do (staging device tensors through host memory).

        For a CUDA device the first call decides, collectively (every rank calls it, in the order of its other
        collectives; the first collective on a CUDA tensor does), with :func:`~.engine.choose_engine` over every
        rank's GPU and ``PARATRAIN_CUDA_COLLECTIVES``; the decision is logged.

        Raises:
            ConfigError: ``PARATRAIN_CUDA_COLLECTIVES`` differs between ranks, is unknown, or asks for NCCL where it
                cannot run (the same error on every rank, and at every later call).
        """
        return self._routes.device_engine(device)

    @property
    def engines(self) -> dict[str, TorchEngine]:
        """The torch.distributed engines by device type (``"cuda"``, ``"cpu"``): tensors there go through them."""
        return self._routes.engines

    def _agree_tagged(self, tag: int, sig: Signature, timeout: float | None, label: str) -> list[Signature]:
        """The agreement of one call on its own (an engine's call: the data moves elsewhere afterwards)."""
        if self.world_size == 1:
            return [sig]
        with self._exchange(tag, timeout, label) as ex:
            return self._agree(ex, sig)

    # -- allreduce

    def _counted(self, body: Callable[[int], T], x: Any) -> Callable[[int], T]:
        """``body``, adding ``x``'s bytes to :attr:`allreduce_bytes` when it runs."""
        nbytes = _nbytes(x)

        def counted(tag: int) -> T:
            self.allreduce_bytes += nbytes
            return body(tag)

        return counted

    def _allreduce(self, x: Any, op: str, algorithm: str, timeout: float | None, *, mode: str) -> Callable[[int], Any]:
        return self._checked(lambda: self._prepare_allreduce(x, op, algorithm, timeout, mode), timeout, mode)

    def _prepare_allreduce(
        self, x: Any, op: str, algorithm: str, timeout: float | None, mode: str
    ) -> Callable[[int], Any]:
        routed = self._routes.allreduce(x, op, algorithm, timeout, mode=mode)
        if routed is not None:
            return self._counted(routed, x)
        view, dtype_name = _as_array(x, self._deadline(timeout))
        reducer = self._reducer(op, dtype_name)
        name = self._resolve(algorithm, self.allreduce_algorithms, self.choose_allreduce, view.nbytes)
        impl = self.allreduce_algorithms[name]
        if mode == "in_place" and isinstance(x, np.ndarray) and not x.flags.writeable:
            raise ValueError("allreduce_ needs a writable array; this one is read-only (use allreduce)")
        in_place = mode == "in_place" and _shares_memory(x, view)
        if mode == "snapshot":  # async: the caller may change x as soon as the call returns
            src = view.reshape(-1).copy()
            dst = src
        else:
            src = view.reshape(-1)
            dst = src if in_place else np.empty_like(src)
        sig = Signature("allreduce", op, dtype_name, view.shape, algorithm, name)
        # the algorithm agrees itself (folded into its own synchronisation), unless shared memory is on and it is
        # not the shared-memory one: then every call agrees through the segment
        agrees_itself = not impl.agreement and (self._shm is None or impl.run is self._shm)

        def body(tag: int) -> Any:
            self.allreduce_bytes += src.nbytes
            if self.world_size == 1:
                if dst is not src:
                    np.copyto(dst, src)
            else:
                with self._exchange(tag, timeout, f"allreduce ({name})") as ex:
                    if agrees_itself:
                        ex.signature = sig
                    else:
                        self._agree(ex, sig, src if impl.data_in_agreement else None)
                    impl.run(ex, src, dst, reducer)
            result = dst.reshape(view.shape)
            if mode == "in_place":
                if not in_place:
                    _write_back(x, result, dtype_name, self._deadline(timeout))
                return x
            return _wrap(x, result, dtype_name, self._deadline(timeout))

        return body

    def allreduce(self, x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None) -> A:
        """Reduces ``x`` over all ranks and returns the result as a new array of ``x``'s type, shape and dtype.

        Blocks until done; ``x`` is only read. Every rank receives identical bits.

        Args:
            x: a numpy array or torch tensor, any shape (0-d and empty included), same shape and dtype on
                every rank.
            op: ``"sum"``, ``"mean"`` (floor division for integer dtypes), ``"max"`` or ``"min"``; see
                :mod:`paratrain.collectives.ops`.
            algorithm: ``"auto"`` (see :func:`default_allreduce_choice`), ``"ring"``, ``"tree"``,
                ``"direct"`` (every rank gathers all contributions; tiny arrays only), or any name registered
                in :attr:`allreduce_algorithms`.
            timeout: seconds the call may take (default: the context's timeout).

        Raises:
            ValueError: unknown op or algorithm. TypeError: unsupported type or dtype for the op. (With several
                ranks, the others then raise ``CollectiveMismatchError`` at once; see the module notes.)
            CollectiveMismatchError: ranks passed different shapes, dtypes, ops or algorithms, or one rejected
                its own arguments (the same error on every rank, before data moves; all stay usable).
            PeerLostError: a rank died. CommTimeoutError: a rank did not take part in time.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(3, lambda ctx: ctx.allreduce(np.full(2, ctx.rank), op="max").tolist())
            [[2, 2], [2, 2], [2, 2]]
        """
        self._routes.route(x)
        result: A = self._run(self._allreduce(x, op, algorithm, timeout, mode="copy"), "allreduce", x)
        return result

    def allreduce_(self, x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None) -> A:
        """Like :meth:`allreduce` but writes the result into ``x`` and returns ``x`` itself.

        Contiguous arrays are reduced in place without a copy; non-contiguous ones through a contiguous copy.

        Raises:
            ValueError: ``x`` is a read-only numpy array (and as :meth:`allreduce`).

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> def fn(ctx):
            ...     x = np.ones(3)
            ...     return ctx.allreduce_(x) is x and x.tolist()
            >>> run_ranks(2, fn)
            [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
        """
        if (
            self._shm is not None
            and type(x) is np.ndarray
            and self._shm_allreduce_(cast(Any, x), op, algorithm, timeout)
        ):
            return x  # (numpy arrays never go to an engine: the route check stays off this hot path)
        self._routes.route(x)
        result: A = self._run(self._allreduce(x, op, algorithm, timeout, mode="in_place"), "allreduce", x)
        return result

    def _shm_allreduce_(self, x: npt.NDArray[Any], op: str, algorithm: str, timeout: float | None) -> bool:
        """:meth:`allreduce_` of a numpy array on the shared-memory path, with what stays the same between calls
        of one op, algorithm, dtype and shape worked out at the first (:class:`_ShmCall`): a small allreduce's
        checks, lookups and bookkeeping cost more than its synchronisation otherwise. False (nothing done) when
        the call does not qualify: the full path then runs it (and raises its errors, with every rank told).

        The call still takes its tag and waits for the queued async calls, as the full path does, so ranks on
        either path stay in step; the descriptor the ranks compare is the full path's, byte for byte.
        """
        group = self._shm.group if self._shm is not None else None
        flags = x.flags
        if group is None or self.timeline is not None or not (flags.c_contiguous and flags.writeable):
            return False
        key = (op, algorithm, x.dtype, x.shape)
        call = self._shm_calls.get(key)
        if (
            call is None
            or call.choose is not self.choose_allreduce
            or self.allreduce_algorithms.get(call.name) is not call.impl
        ):
            call = self._plan_shm_call(key, x, group)
            if call is None:
                return False
        with self._order:
            self._next_tag()
        self._worker.drain(self.timeout)
        self.allreduce_bytes += x.nbytes
        group.allreduce_described_(
            x.reshape(-1), call.reducer, call.desc, timeout=self.timeout if timeout is None else timeout
        )
        return True

    def _reducer(self, op: str, dtype_name: str) -> Reducer:
        """The reducer of ``(op, dtype_name)``, built once: its checks cost microseconds per call otherwise."""
        reducer = self._reducers.get((op, dtype_name))
        if reducer is None:
            reducer = self._reducers[(op, dtype_name)] = Reducer(op, dtype_name)
        return reducer

    def _plan_shm_call(self, key: tuple[Any, ...], x: npt.NDArray[Any], group: ShmGroup) -> _ShmCall | None:
        """The :class:`_ShmCall` of ``key`` (``(op, algorithm, dtype, shape)``), or None if the call is invalid or
        ``auto`` (or the caller) picks another algorithm."""
        op, algorithm = key[0], key[1]
        try:
            name = wire_dtype_name(x.dtype)
            reducer = self._reducer(op, name)
            resolved = self._resolve(algorithm, self.allreduce_algorithms, self.choose_allreduce, x.nbytes)
        except (ValueError, TypeError):
            return None
        impl = self.allreduce_algorithms[resolved]
        if impl.run is not self._shm:
            return None
        desc = group.describe(Signature("allreduce", op, name, x.shape, algorithm, resolved))
        if len(self._shm_calls) >= _SHM_CALLS:
            self._shm_calls.clear()
        call = self._shm_calls[key] = _ShmCall(self.choose_allreduce, resolved, impl, reducer, desc)
        return call

    def allreduce_async(
        self, x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None
    ) -> Handle[A]:
        """Starts :meth:`allreduce` on the background thread; ``handle.wait()`` returns the new result.

        ``x`` is copied before this returns, so the caller may modify it at once. Queued calls run one at a
        time in call order; errors are raised by ``wait()``. Does not block (beyond the copy).

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> def fn(ctx):
            ...     handles = [ctx.allreduce_async(np.full(2, float(i))) for i in range(3)]
            ...     return [h.wait().tolist() for h in handles]
            >>> run_ranks(2, fn)[0]
            [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
        """
        self._routes.route(x)
        return self._submit(self._allreduce(x, op, algorithm, timeout, mode="snapshot"), "allreduce", x)

    def allreduce_async_(
        self,
        x: A,
        op: str = "sum",
        algorithm: str = "auto",
        *,
        timeout: float | None = None,
        ready: SupportsQuery | None = None,
    ) -> Handle[A]:
        """Starts :meth:`allreduce_` (in place) on the background thread; ``handle.wait()`` returns ``x``, which
        then holds the result.

        Unlike :meth:`allreduce_async`, nothing is copied: ``x`` must not be read or written until ``wait()``
        returns (a fusion buffer that its owner leaves alone meanwhile saves two copies of its size per call).
        Queued calls run one at a time in call order; errors are raised by ``wait()``.

        ``ready``: ``x``'s bytes are still on their way (a CUDA event recorded behind the device-to-host copies
        that fill a pinned buffer): the background thread waits until ``ready.query()`` is true before it reads
        ``x`` (at most ``timeout``; then this rank raises :class:`~paratrain.errors.DeviceTimeoutError` and the
        others a ``CollectiveMismatchError`` at once), so the caller (a gradient hook) returns at once and the
        copies overlap the rest of its work.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> def fn(ctx):
            ...     x = np.full(2, float(ctx.rank + 1))
            ...     return ctx.allreduce_async_(x).wait() is x and x.tolist()
            >>> run_ranks(2, fn)
            [[3.0, 3.0], [3.0, 3.0]]
        """
        self._routes.route(x)
        body = self._allreduce(x, op, algorithm, timeout, mode="in_place")
        if ready is not None:
            run = body

            def body(tag: int) -> Any:
                start = time.time()
                try:
                    wait_event(ready, self._deadline(timeout), "the copies into an allreduce's buffer")
                except DeviceTimeoutError:
                    self._reject(tag, timeout)
                    raise
                if self.timeline is not None:  # how long the communication waited for the device's copies
                    self.timeline.span("allreduce", "WAIT_FOR_DEVICE_COPY", start, time.time())
                return run(tag)

        return self._submit(body, "allreduce", x)

    # -- broadcast

    def broadcast(self, x: A, root: int = 0, *, algorithm: str = "auto", timeout: float | None = None) -> A:
        """Returns a new array/tensor holding ``root``'s ``x`` on every rank.

        Every rank passes an ``x`` of the same shape and dtype (non-root values are ignored). Blocks until
        done.

        Args:
            x: numpy array or torch tensor.
            root: the rank whose data is sent.
            algorithm: ``"auto"``, ``"tree"`` (binomial, for small arrays) or ``"chain"`` (pipelined, for large).
            timeout: seconds the call may take.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(3, lambda ctx: ctx.broadcast(np.array([ctx.rank]), root=2).tolist())
            [[2], [2], [2]]
        """
        self._routes.route(x)
        result: A = self._run(
            self._checked(lambda: self._prepare_broadcast(x, root, algorithm, timeout), timeout), "broadcast", x
        )
        return result

    def _prepare_broadcast(self, x: Any, root: int, algorithm: str, timeout: float | None) -> Callable[[int], Any]:
        if type(root) is not int or not 0 <= root < self.world_size:
            raise ValueError(f"root {root!r} outside 0..{self.world_size - 1}")
        routed = self._routes.broadcast(x, root, algorithm, timeout)
        if routed is not None:
            return routed
        view, dtype_name = _as_array(x, self._deadline(timeout))
        name = self._resolve(algorithm, self.broadcast_algorithms, self.choose_broadcast, view.nbytes)
        impl = self.broadcast_algorithms[name]
        src = view.reshape(-1)
        dst = np.empty_like(src)
        sig = Signature("broadcast", None, dtype_name, view.shape, algorithm, name, root)

        def body(tag: int) -> Any:
            if self.world_size == 1:
                np.copyto(dst, src)
            else:
                with self._exchange(tag, timeout, f"broadcast ({name})") as ex:
                    self._agree(ex, sig)
                    impl(ex, dst, root=root, source=src)
            return _wrap(x, dst.reshape(view.shape), dtype_name, self._deadline(timeout))

        return body

    # -- allgather

    def allgather(self, x: A, *, timeout: float | None = None) -> A:
        """Concatenates every rank's ``x`` along axis 0, in rank order; returns a new array/tensor.

        First dimensions may differ between ranks; the others and the dtype must agree. 0-d inputs count as
        one row each (the result has shape ``(world_size,)``). Uses the ring; blocks until done.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(2, lambda ctx: ctx.allgather(np.arange(ctx.rank + 1)).tolist())
            [[0, 0, 1], [0, 0, 1]]
        """
        self._routes.route(x)
        result: A = self._run(self._checked(lambda: self._prepare_allgather(x, timeout), timeout), "allgather", x)
        return result

    def allgather_async(self, x: A, *, timeout: float | None = None) -> Handle[A]:
        """Starts :meth:`allgather` on the background thread; ``handle.wait()`` returns the concatenation.

        ``x`` is copied before this returns, so the caller may modify it at once. Queued calls run one at a time
        in call order with the other ``*_async`` calls; errors are raised by ``wait()``. Does not block (beyond
        the copy).

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(2, lambda ctx: ctx.allgather_async(np.full(ctx.rank + 1, ctx.rank)).wait().tolist())
            [[0, 1, 1], [0, 1, 1]]
        """
        self._routes.route(x)
        return self._submit(
            self._checked(lambda: self._prepare_allgather(x, timeout, copy=True), timeout, "snapshot"), "allgather", x
        )

    def _prepare_allgather(self, x: Any, timeout: float | None, *, copy: bool = False) -> Callable[[int], Any]:
        routed = self._routes.allgather(x, timeout, copy=copy)
        if routed is not None:
            return routed
        view, dtype_name = _as_array(x, self._deadline(timeout))
        trailing = view.shape[1:]
        row = math.prod(trailing)
        src = view.reshape(-1).copy() if copy else view.reshape(-1)
        sig = Signature("allgather", None, dtype_name, view.shape, "ring", "ring")

        def body(tag: int) -> Any:
            if self.world_size == 1:
                out = src.copy()
                rows = [1 if view.ndim == 0 else view.shape[0]]
            else:
                with self._exchange(tag, timeout, "allgather (ring)") as ex:
                    sigs = self._agree(ex, sig)
                    rows = [s.shape[0] if s.shape else 1 for s in sigs]
                    offsets = np.cumsum([0, *rows]) * row
                    bounds = [(int(offsets[i]), int(offsets[i + 1])) for i in range(len(rows))]
                    out = np.empty(int(offsets[-1]), dtype=src.dtype)
                    mine = bounds[self.transport.rank]
                    np.copyto(out[mine[0] : mine[1]], src)
                    ring_allgather_run(ex, out, bounds)
            return _wrap(x, out.reshape((sum(rows), *trailing)), dtype_name, self._deadline(timeout))

        return body

    # -- reduce_scatter

    def reduce_scatter(self, x: A, op: str = "sum", *, timeout: float | None = None) -> A:
        """Reduces ``x`` over all ranks and returns this rank's part, split along axis 0 as numpy.array_split.

        Rank r gets ``numpy.array_split(reduced, world_size)[r]`` as a new array/tensor: the first
        ``len(x) % world_size`` ranks get one row more, and parts may be empty. Uses the ring (each rank sends
        (N - 1)/N of the data); blocks until done.

        Raises:
            ValueError: ``x`` is 0-d (there is no axis 0 to split), or unknown op.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(2, lambda ctx: ctx.reduce_scatter(np.arange(5)).tolist())
            [[0, 2, 4], [6, 8]]
        """
        self._routes.route(x)
        result: A = self._run(
            self._checked(lambda: self._prepare_reduce_scatter(x, op, timeout), timeout), "reduce_scatter", x
        )
        return result

    def _prepare_reduce_scatter(self, x: Any, op: str, timeout: float | None) -> Callable[[int], Any]:
        routed = self._routes.reduce_scatter(x, op, timeout)
        if routed is not None:
            return routed
        view, dtype_name = _as_array(x, self._deadline(timeout))
        if view.ndim == 0:
            raise ValueError("reduce_scatter splits along axis 0; a 0-d array has none (use allreduce)")
        reducer = Reducer(op, dtype_name)
        trailing = view.shape[1:]
        row = math.prod(trailing)
        src = view.reshape(-1)
        rank, n = self.transport.rank, self.world_size
        row_bounds = chunk_bounds(view.shape[0], n)
        bounds = [(a * row, b * row) for a, b in row_bounds]
        shape = (row_bounds[rank][1] - row_bounds[rank][0], *trailing)
        sig = Signature("reduce_scatter", op, dtype_name, view.shape, "ring", "ring")

        def body(tag: int) -> Any:
            if n == 1:
                part = src.copy()
            else:
                dst = np.empty_like(src)
                with self._exchange(tag, timeout, "reduce_scatter (ring)") as ex:
                    self._agree(ex, sig)
                    ring_reduce_scatter_run(ex, src, dst, bounds, reducer)
                part = dst[bounds[rank][0] : bounds[rank][1]].copy()
            return _wrap(x, part.reshape(shape), dtype_name, self._deadline(timeout))

        return body

    # -- life cycle

    def close(self, timeout: float = 10.0) -> None:
        """Stops the background thread (queued async calls fail fast once the transport is closed)."""
        self._worker.close(timeout)
        if self._shm is not None:
            self._shm.close()
        self._routes.close()

    def enable_shared_memory(self, run_id: str) -> bool:
        """Registers ``"shm"`` and makes ``auto`` use it for every size: all ranks must share this host.

        From then on every call of every collective, whatever its algorithm, runs its agreement through the
        shared-memory segment (created collectively by the first call): a few microseconds instead of
        ceil(log2 N) socket round trips, and ranks that call different collectives or algorithms (shm on one,
        ring on another) still meet in one agreement step and raise the same ``CollectiveMismatchError``.

        Returns False (and changes nothing) where the shared-memory path is unsupported (not x86-64 Linux).
        """
        from paratrain.collectives.shm import ShmAllreduce, ShmGroup

        if not ShmGroup.supported() or self.world_size < 2:
            return False
        self._shm = ShmAllreduce(run_id=run_id)
        self.allreduce_algorithms["shm"] = AllreduceAlgorithm(self._shm, agreement=False)
        self.choose_allreduce = lambda nbytes, world_size: "shm"
        return True


def _nbytes(x: object) -> int:
    """Bytes of an array or tensor (0 for anything else), for the timeline."""
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    if is_torch_tensor(x):
        return int(x.numel() * x.element_size())  # type: ignore[attr-defined]
    return 0
