"""Barrier over any transport, executing :func:`~paratrain.collectives.plans.dissemination_barrier`."""

from __future__ import annotations

import time

from paratrain.collectives.plans import dissemination_barrier
from paratrain.errors import CommTimeoutError
from paratrain.transport.base import Transport

__all__ = ["barrier"]


def barrier(transport: Transport, *, tag: int, timeout: float) -> None:
    """Blocks until every rank has entered the barrier with the same ``tag``.

    Each call of a job must use a fresh tag, the same on every rank (the context numbers its collectives), so
    tokens of consecutive barriers never mix.

    Raises:
        PeerLostError: a rank died or shut down before arriving.
        CommTimeoutError: some rank did not arrive within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    for step, rnd in enumerate(dissemination_barrier(transport.rank, transport.world_size)):
        transport.send(rnd.send_to, tag, meta={"barrier": step}, timeout=timeout)
        remaining = deadline - time.monotonic()
        try:
            transport.recv(rnd.recv_from, tag, timeout=max(remaining, 0.0))
        except CommTimeoutError:
            raise CommTimeoutError(
                f"rank {transport.rank}: barrier not complete after {timeout}s (round {step}, waiting for rank "
                f"{rnd.recv_from}); some rank has not called barrier() — is it stuck or on another code path?"
            ) from None
