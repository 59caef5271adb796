"""paratrain: distributed training with a choice of synchronisation, measured on your own cluster.

The public API. Module-level functions act on the current context (see :func:`init`); every one of them is
also a method of :class:`Context` for code that passes contexts around.

Example:
    >>> import paratrain as pt
    >>> ctx = pt.init()              # reads RANK, WORLD_SIZE, ... (a single process without a launcher)
    >>> pt.rank(), pt.world_size()
    (0, 1)
    >>> pt.barrier()
    >>> pt.shutdown()

Subpackages load on first use, so ``import paratrain`` stays light (no torch): ``pt.torch.DistributedOptimizer``
imports :mod:`paratrain.torch` (and torch) the first time it is touched; likewise ``pt.ps``, ``pt.gossip``,
``pt.train``, ``pt.collectives``, ``pt.transport``, ``pt.config`` and ``pt.testing``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from paratrain import errors
from paratrain.runtime.context import Context, current, init, shutdown
from paratrain.transport.base import Handle

if TYPE_CHECKING:  # for type checkers: at run time these load on first use, through __getattr__ below
    from paratrain import collectives as collectives
    from paratrain import config as config
    from paratrain import gossip as gossip
    from paratrain import ps as ps
    from paratrain import testing as testing
    from paratrain import torch as torch
    from paratrain import train as train
    from paratrain import transport as transport

__all__ = [
    "Context",
    "Handle",
    "__version__",
    "allgather",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "alltoall",
    "barrier",
    "broadcast",
    "current",
    "errors",
    "gather",
    "init",
    "local_rank",
    "local_world_size",
    "ps",
    "rank",
    "reduce",
    "reduce_scatter",
    "scatter",
    "shutdown",
    "world_size",
]

__version__ = "0.1.0"

A = TypeVar("A")

# subpackages that ``pt.NAME`` imports on first use (not in __all__: ``from paratrain import *`` stays torch-free)
_LAZY = frozenset({"collectives", "config", "gossip", "ps", "testing", "torch", "train", "transport"})


def __getattr__(name: str) -> Any:
    """Imports the subpackage ``paratrain.NAME`` on first access (``pt.torch`` imports torch only then)."""
    if name in _LAZY:
        return importlib.import_module(f"paratrain.{name}")
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def rank() -> int:
    """This process's rank in the current context."""
    return current().rank


def world_size() -> int:
    """Number of ranks in the current context."""
    return current().world_size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return current().local_rank


def local_world_size() -> int:
    """Number of processes on this host."""
    return current().local_world_size


def barrier(timeout: float | None = None) -> None:
    """Blocks until every rank called ``barrier`` (see :meth:`Context.barrier`)."""
    current().barrier(timeout)


def allreduce(x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None) -> A:
    """Reduces ``x`` (numpy array or torch CPU tensor) over all ranks and returns a new one of the same type.

    ``op`` is ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``; ``algorithm`` ``"auto"``, ``"ring"``, ``"tree"`` or
    ``"direct"``.
    Blocks. See :meth:`paratrain.collectives.api.Collectives.allreduce`.

    Example:
        >>> import numpy as np, paratrain as pt
        >>> ctx = pt.init(transport="inproc")
        >>> pt.allreduce(np.array([1.0, 2.0]), op="mean")
        array([1., 2.])
        >>> pt.shutdown()
    """
    return current().allreduce(x, op, algorithm, timeout=timeout)


def allreduce_(x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None) -> A:
    """Like :func:`allreduce`, in place: writes the result into ``x`` and returns ``x``. Blocks."""
    return current().collectives.allreduce_(x, op, algorithm, timeout=timeout)


def allreduce_async(x: A, op: str = "sum", algorithm: str = "auto", *, timeout: float | None = None) -> Handle[A]:
    """Starts :func:`allreduce` in the background (calls run in order); ``handle.wait()`` returns the result."""
    return current().allreduce_async(x, op, algorithm, timeout=timeout)


def broadcast(x: A, root: int = 0, *, algorithm: str = "auto", timeout: float | None = None) -> A:
    """Returns a new array/tensor holding rank ``root``'s ``x`` (same shape and dtype on every rank). Blocks."""
    return current().broadcast(x, root, algorithm=algorithm, timeout=timeout)


def allgather(x: A, *, timeout: float | None = None) -> A:
    """Concatenates every rank's ``x`` along axis 0 in rank order (first dimensions may differ). Blocks."""
    return current().allgather(x, timeout=timeout)


def reduce_scatter(x: A, op: str = "sum", *, timeout: float | None = None) -> A:
    """This rank's part of ``x`` reduced over all ranks, split along axis 0 like ``numpy.array_split``. Blocks."""
    return current().reduce_scatter(x, op, timeout=timeout)


def reduce(x: A, root: int = 0, op: str = "sum", *, timeout: float | None = None) -> A | None:
    """``x`` reduced over all ranks, on rank ``root``; None on the others (same shape and dtype everywhere). Blocks."""
    return current().reduce(x, root, op, timeout=timeout)


def gather(x: A, root: int = 0, *, timeout: float | None = None) -> A | None:
    """Every rank's ``x`` concatenated along axis 0 in rank order, on ``root``; None on the others. Blocks."""
    return current().gather(x, root, timeout=timeout)


def scatter(x: A, root: int = 0, *, counts: Sequence[int] | None = None, timeout: float | None = None) -> A:
    """This rank's part of ``root``'s ``x``, split along axis 0 (``counts`` rows each, or as array_split). Blocks."""
    return current().scatter(x, root, counts=counts, timeout=timeout)


def alltoall(x: A, *, counts: Sequence[int] | None = None, timeout: float | None = None) -> A:
    """Part q of ``x`` (split along axis 0) to rank q; returns what every rank sent here, in rank order. Blocks."""
    return current().alltoall(x, counts=counts, timeout=timeout)
