"""The allreduce calls of :class:`~paratrain.collectives.api.Collectives`: blocking, in place, async, and the
shared-memory fast path of a small in-place allreduce.

Each call's checks build its body (:meth:`AllreduceCalls._prepare_allreduce`), which
:class:`~paratrain.collectives.calls.CollectiveCalls` runs: agreement first, then the registered algorithm on
flat views of the data. Torch tensors on a device with a torch.distributed engine hand their data to it
(:mod:`.routing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from paratrain._arrays import dtype_name as wire_dtype_name
from paratrain.collectives.algorithms import AllreduceAlgorithm
from paratrain.collectives.calls import CollectiveCalls
from paratrain.collectives.ops import Reducer
from paratrain.collectives.signature import Signature
from paratrain.collectives.views import as_array, nbytes, shares_memory, wrap, write_back
from paratrain.device import wait_event
from paratrain.device.events import SupportsQuery
from paratrain.errors import DeviceTimeoutError
from paratrain.transport.base import Handle, Transport

if TYPE_CHECKING:
    from paratrain.collectives.shm import ShmGroup

__all__ = ["AllreduceCalls"]

A = TypeVar("A")
T = TypeVar("T")


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


class AllreduceCalls(CollectiveCalls):
    """Allreduce in all its forms; how each call takes its tag and agrees is
    :class:`~paratrain.collectives.calls.CollectiveCalls`' (arguments as there)."""

    def __init__(self, *, transport: Transport, next_tag: Callable[[], int], timeout: float) -> None:
        super().__init__(transport=transport, next_tag=next_tag, timeout=timeout)
        self._reducers: dict[tuple[str, str], Reducer] = {}
        self._shm_calls: dict[tuple[Any, ...], _ShmCall] = {}  # (op, algorithm, dtype, shape) -> its fast path
        #: bytes this rank handed to allreduce calls (whatever path carried them: sockets or shared memory)
        self.allreduce_bytes = 0

    def _counted(self, body: Callable[[int], T], x: Any) -> Callable[[int], T]:
        """``body``, adding ``x``'s bytes to :attr:`allreduce_bytes` when it runs."""
        size = nbytes(x)

        def counted(tag: int) -> T:
            self.allreduce_bytes += size
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
        view, dtype_name = as_array(x, self._deadline(timeout))
        reducer = self._reducer(op, dtype_name)
        name = self._resolve(algorithm, self.allreduce_algorithms, self.choose_allreduce, view.nbytes)
        impl = self.allreduce_algorithms[name]
        if mode == "in_place" and isinstance(x, np.ndarray) and not x.flags.writeable:
            raise ValueError("allreduce_ needs a writable array; this one is read-only (use allreduce)")
        in_place = mode == "in_place" and shares_memory(x, view)
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
                    write_back(x, result, dtype_name, self._deadline(timeout))
                return x
            return wrap(x, result, dtype_name, self._deadline(timeout))

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
