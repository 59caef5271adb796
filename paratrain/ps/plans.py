"""A parameter-server round as a plan: every request and reply of one push and one pull, by server.

Pure. A key is cut into row chunks, each held by one server (:mod:`paratrain.ps.sharding`). A worker's push sends
the rows of the chunks each server holds to that server in one message (up to :data:`MAX_BATCH` chunks and
:data:`BATCH_BYTES` bytes: a *batch*, :mod:`paratrain.ps.protocol` says why) and gets one acknowledgement; a pull
sends one request per batch and gets the rows back in one reply, whose arrays are then copied into place.
:func:`push_actions` and :func:`pull_actions` are one worker's side in the plan IR (:mod:`paratrain.plan.ir`),
which :class:`~paratrain.ps.client.KVStore` iterates; :func:`round_plan` adds every server's side, so the cost
model can replay a whole round (which servers are hot, what a pull costs). A batch of one chunk is a plain
request.

Tags are symbolic: requests use offset 0 (the servers' request tag), replies offset 1 (in the runtime each
request has a reply tag of its own). Rows are addressed as ``Slice("rows", row_start, row_stop)``; a batch's
rows as :class:`~paratrain.plan.ir.Parts`, and the arrays of its reply as ``Received(recv, index)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paratrain.plan.ir import Action, Parts, Plan, PlanBuilder, Received, Slice
from paratrain.ps.sharding import Chunk

__all__ = [
    "BATCH_BYTES",
    "MAX_BATCH",
    "REPLY",
    "REQUEST",
    "batches",
    "clock_actions",
    "pull_actions",
    "push_actions",
    "round_plan",
    "serve_clock_action",
    "serve_pull_actions",
    "serve_push_actions",
]

#: Tag offsets of requests and replies in these plans.
REQUEST, REPLY = 0, 1
#: Chunks in one batch at most (its header stays far below the wire's 64 KiB).
MAX_BATCH = 256
#: Bytes in one batch at most (a chunk larger than this goes alone): a batch is one message, which inside a host
#: must fit the shared-memory lane (64 MiB) several times over, and several smaller messages let the server add
#: one while the worker still copies the next.
BATCH_BYTES = 4 << 20


def batches(chunks: Sequence[Chunk], row_bytes: int) -> list[list[Chunk]]:
    """The chunks in the messages a worker sends: each server's, in chunk order, cut into runs of at most
    :data:`MAX_BATCH` chunks and :data:`BATCH_BYTES` bytes; servers in the order their first chunk comes.

    Example:
        >>> cs = [Chunk(0, 0, 1, server=1), Chunk(1, 1, 2, server=0), Chunk(2, 2, 3, server=1)]
        >>> [[c.index for c in batch] for batch in batches(cs, 8)]
        [[0, 2], [1]]
        >>> [[c.index for c in batch] for batch in batches(cs, 3 << 20)]  # 3 MiB chunks: one per batch
        [[0], [2], [1]]
    """
    by_server: dict[int, list[list[Chunk]]] = {}
    for c in chunks:
        runs = by_server.setdefault(c.server, [[]])
        run = runs[-1]
        size = sum(x.num_rows for x in run) * row_bytes
        if run and (len(run) == MAX_BATCH or size + c.num_rows * row_bytes > BATCH_BYTES):
            runs.append(run := [])
        run.append(c)
    return [run for runs in by_server.values() for run in runs]


def _rows(batch: Sequence[Chunk]) -> Slice | Parts:
    slices = tuple(Slice("rows", c.row_start, c.row_stop) for c in batch)
    return slices[0] if len(slices) == 1 else Parts(slices)


def push_actions(chunks: Sequence[Chunk], row_bytes: int, servers: Sequence[int]) -> tuple[Action, ...]:
    """A worker's push: for every batch, the acknowledgement's receive is posted, then the rows are sent to
    ``servers[server]`` (a transport rank). Nothing waits: the push's handle completes with the replies.

    Example:
        >>> chunks = [Chunk(0, 0, 2, server=1), Chunk(1, 2, 3, server=0), Chunk(2, 3, 4, server=1)]
        >>> [(a.kind, a.peer, a.nbytes) for a in push_actions(chunks, 8, [4, 5])]
        [('recv', 5, 0), ('send', 5, 24), ('recv', 4, 0), ('send', 4, 8)]
    """
    b = PlanBuilder()
    for batch in batches(chunks, row_bytes):
        server = servers[batch[0].server]
        rows = sum(c.num_rows for c in batch)
        b.message("recv", server, nbytes=0, tag=REPLY)
        b.message("send", server, nbytes=rows * row_bytes, items=rows, tag=REQUEST, data=_rows(batch))
    return b.actions


def pull_actions(chunks: Sequence[Chunk], row_bytes: int, servers: Sequence[int]) -> tuple[Action, ...]:
    """A worker's pull: for every batch, the reply's receive (the rows) is posted and an empty request sent;
    then each chunk's rows are copied into place from its array of the reply."""
    b = PlanBuilder()
    posted = []
    for batch in batches(chunks, row_bytes):
        server = servers[batch[0].server]
        rows = sum(c.num_rows for c in batch)
        posted.append((batch, b.message("recv", server, nbytes=rows * row_bytes, items=rows, tag=REPLY)))
        b.message("send", server, nbytes=0, tag=REQUEST)
    for batch, handle in posted:
        for i, c in enumerate(batch):
            b.copy(Received(handle, i), Slice("rows", c.row_start, c.row_stop), itemsize=row_bytes)
    return b.actions


def clock_actions(servers: Sequence[int]) -> tuple[Action, ...]:
    """A worker's clock: one empty notification to every server, never answered. (Under BSP/SSP a worker
    that runs too far ahead then also asks one server to tell it when the slowest caught up: that request
    depends on timing, so it is not part of the plan.)"""
    b = PlanBuilder()
    for server in servers:
        b.message("send", server, nbytes=0, tag=REQUEST)
    return b.actions


def serve_push_actions(batch: Sequence[Chunk], row_bytes: int, worker: int) -> tuple[Action, Action]:
    """A server's side of one batch of ``worker``'s push: the rows received, then the empty acknowledgement.

    Example:
        >>> [(a.kind, a.peer, a.nbytes, a.tag) for a in serve_push_actions([Chunk(0, 0, 2, server=0)], 8, 1)]
        [('recv', 1, 16, 0), ('send', 1, 0, 1)]
    """
    rows = sum(c.num_rows for c in batch)
    received = Action("recv", peer=worker, nbytes=rows * row_bytes, items=rows, tag=REQUEST)
    return received, Action("send", peer=worker, nbytes=0, tag=REPLY, deps=(0,))


def serve_pull_actions(batch: Sequence[Chunk], row_bytes: int, worker: int) -> tuple[Action, Action]:
    """A server's side of one batch of ``worker``'s pull: the empty request received, then the reply with the
    batch's rows."""
    rows = sum(c.num_rows for c in batch)
    request = Action("recv", peer=worker, nbytes=0, tag=REQUEST)
    return request, Action("send", peer=worker, nbytes=rows * row_bytes, items=rows, tag=REPLY, deps=(0,))


def serve_clock_action(worker: int) -> Action:
    """A server's side of ``worker``'s clock: the empty notification received (:func:`clock_actions`)."""
    return Action("recv", peer=worker, nbytes=0, tag=REQUEST, label="clock")


def round_plan(chunks: Sequence[Chunk], row_bytes: int, *, num_workers: int, num_servers: int) -> Plan:
    """One push then one pull of a key by every worker, with the servers' receives and replies; ranks are the
    job's (workers ``0..W-1``, servers ``W..W+S-1``).

    Example:
        >>> plan = round_plan([Chunk(0, 0, 4, server=0)], 8, num_workers=2, num_servers=1)
        >>> plan.bytes_sent()
        [32, 32, 64]
    """
    servers = [num_workers + s for s in range(num_servers)]
    ranks: list[tuple[Action, ...]] = [
        push_actions(chunks, row_bytes, servers) + pull_actions(chunks, row_bytes, servers) for _ in range(num_workers)
    ]
    for s in range(num_servers):
        actions: list[Action] = []
        mine = [batch for batch in batches(chunks, row_bytes) if batch[0].server == s]
        for serve in (serve_push_actions, serve_pull_actions):
            for w in range(num_workers):
                for batch in mine:
                    received, answer = serve(batch, row_bytes, w)
                    actions += [received, dataclasses.replace(answer, deps=(len(actions),))]
        ranks.append(tuple(actions))
    return Plan("ps/round", tuple(ranks))
