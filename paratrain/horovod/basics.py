"""Horovod's process API over a paratrain context: ``init``, ``rank``, ``size``, the local and cross ranks, the
reduction ops and Horovod's error type.

``init`` joins the job the way :func:`paratrain.init` does (``paratrain launch``, torchrun, SLURM or one process),
or adopts the context a script already made. Horovod's *cross* communicator holds the ranks that share this
rank's local rank (one per host when hosts run equally many ranks): ``cross_rank`` is this rank's position among
them and ``cross_size`` their number, computed at ``init`` from every rank's local rank.

Every collective of :mod:`paratrain.horovod` is a request to this process's :class:`~.engine.Engine`, which
matches requests across ranks by name (unnamed ones by call order), fuses small allreduces, runs ``join`` and
records the timeline (``PARATRAIN_TIMELINE``), on a process group of its own: the script's own paratrain calls
on the context never meet the engine's messages.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from paratrain.errors import NotInitializedError
from paratrain.horovod.controller import Engine, Request, fusion_bytes_from_env
from paratrain.runtime.context import Context, current
from paratrain.runtime.context import init as _join
from paratrain.runtime.context import reform as _reform_context
from paratrain.runtime.group import Group
from paratrain.timeline import timeline_for

__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "Max",
    "Min",
    "Product",
    "Sum",
    "context",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reform",
    "rocm_built",
    "run",
    "shutdown",
    "size",
    "submit",
    "wait",
]

T = TypeVar("T")

# Horovod's reduction ops, with its values (horovod.common.basics)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank: the ranks called it with different shapes, dtypes or ops, or a peer
    was lost (Horovod raises this name; its elastic mode catches it)."""


@dataclass
class _State:
    ctx: Context
    owns: bool  # init made the context, so shutdown closes it
    cross_rank: int
    cross_size: int
    group: Group
    engine: Engine


_lock = threading.Lock()
_state: _State | None = None


def init(comm: object = None, process_sets: object = None) -> None:
    """Joins the job (idempotent). ``comm`` and ``process_sets`` are Horovod's MPI communicator and process sets,
    which this layer does not have: they must be None.

    Raises:
        ValueError: ``comm`` or ``process_sets`` given.
    """
    global _state
    if comm is not None or process_sets is not None:
        raise ValueError("paratrain.horovod runs on the whole job: comm= and process_sets= are not supported")
    with _lock:
        if _state is not None and not _state.ctx.closed:
            return
        try:
            ctx, owns = current(), False
        except NotInitializedError:
            ctx, owns = _join(), True
        locals_ = np.asarray(ctx.allgather(np.array([ctx.local_rank], dtype=np.int64)))
        peers = np.flatnonzero(locals_ == ctx.local_rank)
        group = ctx.new_group(range(ctx.world_size))
        assert group is not None  # every rank is a member
        group.collectives.timeline = None  # the engine records its own phases, per tensor
        engine = Engine(
            group,
            timeline=timeline_for(ctx.settings.timeline, ctx.rank),
            fusion_bytes=fusion_bytes_from_env(os.environ),
            error=_internal,
            stall_s=ctx.settings.timeout,
        )
        _state = _State(ctx, owns, int(np.searchsorted(peers, ctx.rank)), len(peers), group, engine)


def reform() -> None:
    """Re-forms the job after a lost worker or for a joiner (:func:`paratrain.runtime.context.reform`, for
    ``paratrain launch --min-workers`` jobs; :mod:`paratrain.horovod.elastic` calls it) and starts the engine
    again on the new context, which ``shutdown`` closes if ``init`` had made the old one.

    Raises:
        ValueError: not initialised.
        RendezvousError: the others did not arrive at the rendezvous in time.
    """
    global _state
    with _lock:
        state, _state = _state, None
    if state is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    state.ctx.abort()  # fails whatever the engine's thread waits for, at once
    state.engine.close(min(5.0, state.ctx.settings.timeout))
    if state.engine.timeline is not None:
        state.engine.timeline.flush()
    _reform_context(state.ctx)
    init()
    assert _state is not None
    _state.owns = state.owns


def is_initialized() -> bool:
    """Whether :func:`init` ran and the job is still up."""
    return _state is not None and not _state.ctx.closed


def shutdown() -> None:
    """Leaves the job if :func:`init` joined it (a context the script made itself stays open)."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is None:
        return
    state.engine.close(state.ctx.settings.timeout)
    state.group.close()
    if state.engine.timeline is not None:
        state.engine.timeline.flush()
    if state.owns and not state.ctx.closed:
        state.ctx.shutdown()


def _get() -> _State:
    if _state is None or _state.ctx.closed:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state


def context() -> Context:
    """The paratrain context behind the Horovod API (for paratrain's own strategies)."""
    return _get().ctx


def rank() -> int:
    """This process's rank in the job."""
    return _get().ctx.rank


def size() -> int:
    """The number of processes in the job."""
    return _get().ctx.world_size


def local_rank() -> int:
    """This process's rank on its host."""
    return _get().ctx.local_rank


def local_size() -> int:
    """The number of processes on this host."""
    return _get().ctx.local_world_size


def cross_rank() -> int:
    """This rank's position among the ranks with its local rank (its host's index, on equal hosts)."""
    return _get().cross_rank


def cross_size() -> int:
    """The number of ranks with this rank's local rank (the number of hosts, on equal hosts)."""
    return _get().cross_size


def mpi_built() -> bool:
    """False: paratrain moves data over its own transports (ZeroMQ, shared memory), not MPI."""
    return False


def mpi_enabled() -> bool:
    """False (see :func:`mpi_built`)."""
    return False


def mpi_threads_supported() -> bool:
    """False (see :func:`mpi_built`)."""
    return False


def gloo_built() -> bool:
    """False: not Gloo either (see :func:`mpi_built`)."""
    return False


def gloo_enabled() -> bool:
    """False (see :func:`gloo_built`)."""
    return False


def nccl_built() -> bool:
    """False: CPU tensors only, no NCCL."""
    return False


def cuda_built() -> bool:
    """False: CPU tensors only."""
    return False


def rocm_built() -> bool:
    """False: CPU tensors only."""
    return False


def _internal(exc: BaseException) -> BaseException:
    """Horovod's error for a failed collective: mismatched calls (found by the engine or the collectives) and
    lost peers, with paratrain's message."""
    if isinstance(exc, HorovodInternalError):
        return exc
    if type(exc) is RuntimeError:
        return HorovodInternalError(str(exc))
    return HorovodInternalError(f"{type(exc).__name__}: {exc}")


def submit(request: Request, *, wake: bool = True) -> concurrent.futures.Future[Any]:
    """Hands ``request`` to the engine (see the module docstring); ``wake=False`` when the caller waits at once."""
    return _get().engine.submit(request, wake=wake)


def wait(future: concurrent.futures.Future[T]) -> T:
    """``future``'s result, running the engine's cycles on this thread while it waits (no thread hand-off)."""
    result: T = _get().engine.wait(future)
    return result


def name(kind: str, given: str | None) -> str:
    """``given``, or the next automatic name of ``kind`` (``allreduce.noname.3``), the same on every rank that
    calls alike."""
    return _get().engine.name(kind, given)


def run(fn: Callable[[Group], T], name_: str | None = None) -> concurrent.futures.Future[T]:
    """Runs ``fn(group)`` (collective calls on the engine's group) as one request, matched by ``name_`` or by
    call order; paratrain's errors come out of the future as :class:`HorovodInternalError`."""
    return submit(Request(name("call", name_), "call", run=fn))
