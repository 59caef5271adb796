"""One rank of ``paratrain bench ps``'s ceiling engine: the PS's bytes over the PS's path, with no PS at all.

Run as ``paratrain launch -n W+S`` (no ``--servers``: every rank runs this module). Ranks ``0..W-1`` play the
workers, ranks ``W..W+S-1`` the servers, with the same transport (ZeroMQ, ipc inside a host) between the same
kind of processes as the PS job. The key is cut with the PS's own chunk plan
(:func:`~paratrain.ps.sharding.plan_chunks`), and one iteration of a worker sends every chunk to the server
that would hold it and receives every chunk back (receives posted first, as the KVStore does). A server rank
echoes each chunk to its sender as soon as it arrives, zero-copy, and does nothing else: no dictionary of keys,
no addition, no clock bookkeeping, no consistency rule. So ``ps time / ceiling time`` isolates what the
parameter server adds on top of moving the same bytes. Workers write ``ceiling-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import numpy as np

from paratrain._exit import exit_with
from paratrain.bench._ps_worker import Phases, add_args, time_iterations
from paratrain.bench._timing import each_size, progress_printer, record_result, start_watchdog
from paratrain.ps.sharding import plan_chunks
from paratrain.transport.base import ANY_SOURCE, Handle
from paratrain.transport.wire import Message

#: Tags of the echo protocol (user tags >= 0; the collectives' barrier uses negative ones).
_DATA_TAG = 1
_STOP_TAG = 2
_ECHO_BASE = 1 << 20
_BARRIER_BASE = -(1 << 40)
_barriers = itertools.count()


def _echo_server(transport: Any, workers: int, timeout: float) -> None:
    """Sends every data message straight back to its sender until each worker has said stop. Blocks."""
    stopped = 0
    in_flight: list[Handle[None]] = []
    while stopped < workers:
        msg: Message = transport.recv(ANY_SOURCE, timeout=timeout)
        if msg.tag == _STOP_TAG:
            stopped += 1
            continue
        chunk = int(msg.meta["chunk"])
        in_flight.append(transport.isend(msg.src, _ECHO_BASE + chunk, msg.arrays))
        in_flight = [h for h in in_flight if not h.done()]
    for handle in in_flight:
        handle.wait(timeout)


def _measure_size(ctx: Any, servers: int, nbytes: int, iters: int, warmup: int) -> dict[str, Any]:
    transport = ctx.transport
    workers = transport.world_size - servers
    key = f"bench-{nbytes}"
    chunks = plan_chunks(key, (nbytes // 4,), 4, servers)
    grad = np.full(nbytes // 4, ctx.rank + 1, dtype=np.float32)
    back: list[Message] = []

    def transfer() -> None:
        # Post every receive before the first send, as KVStore._request does, so that no reply waits unmatched.
        receives = [(c, transport.irecv(workers + c.server, _ECHO_BASE + c.index)) for c in chunks]
        sends = [
            transport.isend(workers + c.server, _DATA_TAG, [grad[c.row_start : c.row_stop]], {"chunk": c.index})
            for c in chunks
        ]
        back.clear()
        back.extend(handle.wait(ctx.settings.timeout) for _, handle in receives)
        for send in sends:
            send.wait(ctx.settings.timeout)

    phases: Phases = [("transfer", transfer)]
    transfer()
    for chunk, msg in zip(chunks, back, strict=True):  # the checked round: every byte came back unchanged
        if not np.array_equal(msg.arrays[0], grad[chunk.row_start : chunk.row_stop]):
            raise RuntimeError(f"the echo of chunk {chunk.index} ({nbytes} bytes) differs from what was sent")
    record = time_iterations(phases, iters=iters, warmup=warmup, barrier=lambda: _worker_barrier(ctx, workers))
    record.update({"bytes": nbytes, "chunks": len(chunks), "servers_used": len({c.server for c in chunks})})
    return record


def _worker_barrier(ctx: Any, workers: int) -> None:
    """A barrier of the worker ranks only (the echo ranks are busy echoing), over the same transport."""
    from paratrain.collectives.barrier import barrier
    from paratrain.transport.group import GroupTransport

    group = GroupTransport(ctx.transport, list(range(workers)))
    barrier(group, tag=_BARRIER_BASE - next(_barriers), timeout=ctx.settings.timeout)


def main(argv: list[str] | None = None) -> int:
    """Plays a worker or an echo server on every size; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline, "paratrain bench ps ceiling rank")

    import paratrain as pt

    ctx = pt.init()
    transport = ctx.transport
    workers = transport.world_size - args.servers
    rank = transport.rank
    if rank >= workers:
        try:
            _echo_server(transport, workers, ctx.settings.timeout)
        finally:
            pt.shutdown()
        return 0
    payload: dict[str, Any] = {"world_size": workers, "servers": args.servers}

    def measure() -> list[dict[str, Any]]:
        try:
            return each_size(
                args,
                lambda nbytes, iters: _measure_size(ctx, args.servers, nbytes, iters, args.warmup),
                progress_printer("ceiling", rank, unit="ms/iteration"),
            )
        finally:
            for server in range(workers, transport.world_size):
                transport.send(server, _STOP_TAG, timeout=ctx.settings.timeout)

    code = record_result(args.out, "ceiling", rank, payload, measure)
    pt.shutdown()
    return code


if __name__ == "__main__":
    exit_with(main)
