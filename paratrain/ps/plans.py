"""A parameter-server round as a plan: every request and reply of one push and one pull, by chunk.

Pure. A key is cut into row chunks, each held by one server (:mod:`paratrain.ps.sharding`). A worker's push
sends every chunk's rows to its server and gets an acknowledgement; a pull sends a request per chunk and gets
the rows back. :func:`push_actions` and :func:`pull_actions` are one worker's side in the plan IR
(:mod:`paratrain.plan.ir`), which :class:`~paratrain.ps.client.KVStore` iterates; :func:`round_plan` adds
every server's side, so the cost model can replay a whole round (which servers are hot, what a pull costs).

Tags are symbolic: requests use offset 0 (the servers' request tag), replies offset 1 (in the runtime each
request has a reply tag of its own). Rows are addressed as ``Slice("rows", row_start, row_stop)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.plan.ir import Action, Plan, PlanBuilder, Received, Slice
from paratrain.ps.sharding import Chunk

__all__ = ["REPLY", "REQUEST", "clock_actions", "pull_actions", "push_actions", "round_plan"]

#: Tag offsets of requests and replies in these plans.
REQUEST, REPLY = 0, 1


def push_actions(chunks: Sequence[Chunk], row_bytes: int, servers: Sequence[int]) -> tuple[Action, ...]:
    """A worker's push: for every chunk, the acknowledgement's receive is posted, then the rows are sent to
    ``servers[chunk.server]`` (a transport rank). Nothing waits: the push's handle completes with the replies.

    Example:
        >>> chunks = [Chunk(0, 0, 2, server=1), Chunk(1, 2, 3, server=0)]
        >>> [(a.kind, a.peer, a.nbytes) for a in push_actions(chunks, 8, [4, 5])]
        [('recv', 5, 0), ('send', 5, 16), ('recv', 4, 0), ('send', 4, 8)]
    """
    b = PlanBuilder()
    for c in chunks:
        server = servers[c.server]
        b.message("recv", server, nbytes=0, tag=REPLY)
        b.message(
            "send",
            server,
            nbytes=c.num_rows * row_bytes,
            items=c.num_rows,
            tag=REQUEST,
            data=Slice("rows", c.row_start, c.row_stop),
        )
    return b.actions


def pull_actions(chunks: Sequence[Chunk], row_bytes: int, servers: Sequence[int]) -> tuple[Action, ...]:
    """A worker's pull: for every chunk, the reply's receive (the rows) is posted and an empty request sent;
    then the rows are copied into place as each reply arrives."""
    b = PlanBuilder()
    posted = []
    for c in chunks:
        server = servers[c.server]
        posted.append(b.message("recv", server, nbytes=c.num_rows * row_bytes, items=c.num_rows, tag=REPLY))
        b.message("send", server, nbytes=0, tag=REQUEST)
    for c, handle in zip(chunks, posted, strict=True):
        b.copy(Received(handle), Slice("rows", c.row_start, c.row_stop), itemsize=row_bytes)
    return b.actions


def clock_actions(servers: Sequence[int]) -> tuple[Action, ...]:
    """A worker's clock: one empty notification to every server, never answered. (Under BSP/SSP a worker
    that runs too far ahead then also asks one server to tell it when the slowest caught up: that request
    depends on timing, so it is not part of the plan.)"""
    b = PlanBuilder()
    for server in servers:
        b.message("send", server, nbytes=0, tag=REQUEST)
    return b.actions


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
        b = PlanBuilder()
        mine = [c for c in chunks if c.server == s]
        for phase in ("push", "pull"):
            for w in range(num_workers):
                for c in mine:
                    nbytes = c.num_rows * row_bytes
                    request = b.message("recv", w, nbytes=nbytes if phase == "push" else 0, tag=REQUEST)
                    b.message("send", w, nbytes=0 if phase == "push" else nbytes, tag=REPLY, deps=[request])
        ranks.append(b.actions)
    return Plan("ps/round", tuple(ranks))
