"""Barrier over any transport: iterates its rank's actions of :func:`~paratrain.collectives.lower.barrier_plan`."""

from __future__ import annotations

import time

from paratrain.collectives.lower import barrier_plan
from paratrain.errors import CommTimeoutError
from paratrain.transport.base import Transport

__all__ = ["barrier"]


def barrier(transport: Transport, *, tag: int, timeout: float) -> None:
    """Blocks until every rank has entered the barrier with the same ``tag``.

    Each call of a job must use a fresh tag, the same on every rank (the context numbers its collectives), so
    tokens of consecutive barriers never mix. The dissemination barrier: round k signals ``r + 2**k`` and waits
    for ``r - 2**k``, ceil(log2 N) rounds.

    Raises:
        PeerLostError: a rank died or shut down before arriving.
        CommTimeoutError: some rank did not arrive within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    step = 0
    for action in barrier_plan(transport.world_size).ranks[transport.rank]:
        if action.kind == "send":
            transport.send(action.peer, tag, meta={"barrier": step}, timeout=timeout)
            continue
        remaining = deadline - time.monotonic()
        try:
            transport.recv(action.peer, tag, timeout=max(remaining, 0.0))
        except CommTimeoutError:
            raise CommTimeoutError(
                f"rank {transport.rank}: barrier not complete after {timeout}s (round {step}, waiting for rank "
                f"{action.peer}); some rank has not called barrier() — is it stuck or on another code path?"
            ) from None
        step += 1
