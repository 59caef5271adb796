"""The collectives users call (allreduce, broadcast, allgather, reduce_scatter; reduce, gather, scatter and all-to-all
from :mod:`.personalized_calls`) on numpy arrays and torch tensors.

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

Steps 2-3 and the threads are :mod:`.calls`'; the allreduce calls are :mod:`.allreduce_calls`; the arrays in and
out :mod:`.views`; the registries' entries :mod:`.algorithms` (re-exported here).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from paratrain.collectives.algorithms import (
    DEFAULT_ALLREDUCE_ALGORITHMS,
    DEFAULT_BROADCAST_ALGORITHMS,
    AllreduceAlgorithm,
    AllreduceRun,
    BroadcastAlgorithm,
    planned_allreduce,
)
from paratrain.collectives.allreduce_calls import AllreduceCalls
from paratrain.collectives.hierarchical import HostLayout, hierarchical_allreduce
from paratrain.collectives.ops import Reducer
from paratrain.collectives.personalized_calls import PersonalizedCalls
from paratrain.collectives.plans import chunk_bounds
from paratrain.collectives.plans_blink import PackedTree
from paratrain.collectives.policy import (
    AUTO_BROADCAST_TREE_MAX_BYTES,
    AUTO_DIRECT_MAX_BYTES,
    AUTO_TREE_MAX_BYTES,
    LOOPBACK_BYTES_PER_SECOND,
    default_allreduce_choice,
    default_broadcast_choice,
    link_allreduce_choice,
    network_allreduce_choice,
)
from paratrain.collectives.ring import ring_allgather_run, ring_reduce_scatter_run
from paratrain.collectives.routing import EngineRoutes
from paratrain.collectives.signature import Signature
from paratrain.collectives.torch_engines import TorchEngine
from paratrain.collectives.views import as_array, wrap
from paratrain.transport.base import Handle, Transport

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


class Collectives(AllreduceCalls, PersonalizedCalls):
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
        super().__init__(transport=transport, next_tag=next_tag, timeout=timeout)
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

    def use_links(
        self, links: Mapping[tuple[int, int], tuple[float, float]], *, latency: float, bandwidth: float | None
    ) -> tuple[PackedTree, ...]:
        """Tells this group the links between its ranks: ``(a, b)`` -> ``(alpha, bytes per second)`` for the pairs
        with a link of their own (both directions), ``latency`` and ``bandwidth`` (None: unlimited) for the
        others, which share their nodes' links. Registers ``"blink"`` (weighted spanning trees packed over the
        links, :mod:`.plans_blink`: every rank packs the same) and makes ``auto`` pick by the cost of every
        plan replayed on these links. Returns the trees.
        """
        trees, self.choose_allreduce = link_allreduce_choice(
            self.world_size, links, latency=latency, bandwidth=bandwidth
        )
        self.allreduce_algorithms["blink"] = AllreduceAlgorithm(planned_allreduce("blink", trees=trees))
        return trees

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
        view, dtype_name = as_array(x, self._deadline(timeout))
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
            return wrap(x, dst.reshape(view.shape), dtype_name, self._deadline(timeout))

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
        view, dtype_name = as_array(x, self._deadline(timeout))
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
            return wrap(x, out.reshape((sum(rows), *trailing)), dtype_name, self._deadline(timeout))

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
        view, dtype_name = as_array(x, self._deadline(timeout))
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
            return wrap(x, part.reshape(shape), dtype_name, self._deadline(timeout))

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
