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
"""

from __future__ import annotations

from paratrain import errors
from paratrain.runtime.context import Context, current, init, shutdown

__all__ = [
    "Context",
    "__version__",
    "barrier",
    "current",
    "errors",
    "init",
    "local_rank",
    "local_world_size",
    "rank",
    "shutdown",
    "world_size",
]

__version__ = "0.1.0"


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
