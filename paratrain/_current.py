"""Where algorithms find the current context without importing the runtime that owns it.

The runtime (:mod:`paratrain.runtime.context`) keeps the current context (per thread, else per process) and
registers its lookup here when it is imported; algorithms that offer ``context=None`` as a convenience (the
parameter server's :class:`~paratrain.ps.KVStore`) call :func:`current_context`. So imports go one way — the
runtime builds on the algorithms, never the reverse — and the algorithms type what they need as a protocol.
"""

from __future__ import annotations

from collections.abc import Callable

from paratrain.errors import NotInitializedError

__all__ = ["current_context", "set_lookup"]

_lookup: Callable[[], object] | None = None


def set_lookup(lookup: Callable[[], object]) -> None:
    """Registers the runtime's ``current()`` (called once, when :mod:`paratrain.runtime.context` is imported)."""
    global _lookup
    _lookup = lookup


def current_context() -> object:
    """The calling thread's context, else the process's.

    Raises:
        NotInitializedError: no context (the runtime was never imported, or ``paratrain.init()`` never called).
    """
    if _lookup is None:
        raise NotInitializedError("paratrain is not initialised in this process; call paratrain.init() first")
    return _lookup()
