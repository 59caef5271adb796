"""The parameter server's messages: tags, operation names, and the error a rejected request raises.

Requests go to a server with :data:`REQUEST_TAG` and carry ``meta = {"op": ..., "id": n, ...}``; the server
answers request ``n`` of a worker with tag :func:`reply_tag` ``(n)``, so a worker can have many requests in
flight and match each answer exactly. Replies carry ``"done"``, the server's slowest-worker clock, which is
what the worker's cache and its staleness bound rely on. Everything is msgpack header + raw arrays.

Batches: a worker's requests to one server in one call (every chunk of a key that server holds, for a push or
a pull) travel as one ``batch`` request, ``{"op": "batch", "ops": [request meta + "n", ...]}`` with the
requests' arrays one after the other (``n`` of them each), and the server answers with one message,
``{"replies": [reply meta + "n", ...]}``, once every request of it is answered. Why: each message costs a
round of thread wake-ups in both processes (a few hundred microseconds on a small VM), far more than a
chunk's bookkeeping, so 16 chunks in 16 messages spent more time waking threads than moving bytes; each
request inside keeps its own id, meta and reply, so the server handles them exactly as if sent alone.

Replication batches the same way: the pushes of one worker's batch that a server forwards to a backup (ASP), or
tells it of (``notice``, no data: BSP/SSP), go in one ``replicate_batch`` message (``{"ops": [replicate or notice
meta + "n", ...]}``, packed as above); the chunk states an owner sends once a round is complete (BSP/SSP) go in
``replicate_states`` messages of up to :data:`~.plans.BATCH_BYTES` (``{"ops": [replicate_state meta + "n",
...]}``, each entry a chunk as :func:`~.resync.chunk_message` writes it plus the ``pushes`` it holds). The backup
acknowledges a message's forwards or states in one ``replicated`` message, ``{"ids": [...], "errors": [str or
None, ...]}`` (a single forward: ``replicate`` and ``{"id": n, "error": ...}``); notices are not acknowledged. A
worker waiting for a push before its clock sends ``flush`` (no answer): its owners send their states at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from paratrain.errors import ParatrainError
from paratrain.ps.plans import MAX_BATCH
from paratrain.transport.wire import Message

__all__ = [
    "CATCHING_UP",
    "MAX_BATCH",
    "MOVED",
    "OPS",
    "REQUEST_TAG",
    "RESIZE_TAG",
    "PSRequestError",
    "forward_ids",
    "pack",
    "reply_tag",
    "unpack",
]

#: Tag of every request to a server. Below the collectives' range, far from user tags (>= 0).
REQUEST_TAG = -(1 << 56)
_REPLY_BASE = -(1 << 57)

#: The field of a restarted server's refusal while it catches up (:mod:`.resync`): the request was not served,
#: and the worker sends it to another replica, as if the server had died (it has not fenced that server yet).
CATCHING_UP = "catching_up"

#: The field of an answer to a request for a chunk that moved to another server (:mod:`.resize`): the worker, which
#: knows the new placement by then (it fenced before anything moved), sends the request to the chunk's server now.
MOVED = "moved"

#: Tag of the notice a resizing job's coordinator sends every worker: the set of servers holding keys changes
#: (:mod:`.resize`). Server to worker, outside the request/answer pairs.
RESIZE_TAG = -(1 << 56) - 1

#: Request operations a server understands.
#: every request a worker sends a server (servers send each other ``replicate``, ``replicate_batch``,
#: ``replicate_states``, ``notice``, ``replicated``, ``members`` and ``snapshot``)
OPS = (
    "init",
    "push",
    "pull",
    "clock",
    "wait_clock",
    "join",
    "leave",
    "batch",
    "fence",
    "flush",
    "rejoin",
    "resize",
    "resize_fence",
)


def forward_ids(meta: Mapping[str, Any]) -> list[int]:
    """The ids of the forwards a ``replicate``, ``replicate_batch`` or ``replicate_states`` message carries (what
    its sender waits to see acknowledged), as far as they can be read: a receiver that cannot apply them answers
    each with an error.

    Example:
        >>> forward_ids({"op": "replicate_batch", "ops": [{"id": 3}, {"id": -1}, "junk", {"id": 4}]})
        [3, 4]
    """
    entries = meta.get("ops") if meta.get("op") in ("replicate_batch", "replicate_states") else [meta]
    if not isinstance(entries, list):
        return []
    return [e["id"] for e in entries if isinstance(e, dict) and type(e.get("id")) is int and e["id"] >= 0]


def reply_tag(request_id: int) -> int:
    """The tag of the answer to request ``request_id`` (ids count up from 0 per worker)."""
    return _REPLY_BASE - request_id


class PSRequestError(ParatrainError, ValueError):
    """A server rejected a request (unknown key, wrong shape or dtype...). The server keeps serving.

    The message says which server, which key and what was wrong; fix the call and retry.
    """


def pack(items: Sequence[tuple[Mapping[str, Any], Sequence[Any]]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The ``ops`` (or ``replies``) list and the arrays of a batch of ``(meta, arrays)`` items."""
    metas: list[dict[str, Any]] = []
    arrays: list[Any] = []
    for meta, arrs in items:
        metas.append({**meta, "n": len(arrs)})
        arrays.extend(arrs)
    return metas, arrays


def unpack(msg: Message, field: str) -> list[Message]:
    """The messages a batch carries in ``msg.meta[field]``, each as if it had come alone.

    Raises:
        ValueError: the list is malformed, too long, or does not account for exactly the arrays that came.
    """
    entries = msg.meta.get(field)
    if not isinstance(entries, list) or not 0 < len(entries) <= MAX_BATCH:
        raise ValueError(f"{field!r} is not a list of 1..{MAX_BATCH} entries")
    out: list[Message] = []
    at = 0
    for entry in entries:
        n = entry.get("n") if isinstance(entry, dict) else None
        if type(n) is not int or not 0 <= n <= len(msg.arrays) - at:
            raise ValueError(f"entry {len(out)} of {field!r} does not say how many of the arrays are its own")
        meta = {k: v for k, v in entry.items() if k != "n"}
        out.append(
            Message(src=msg.src, tag=msg.tag, meta=meta, arrays=msg.arrays[at : at + n], dtypes=msg.dtypes[at : at + n])
        )
        at += n
    if at != len(msg.arrays):
        raise ValueError(f"{len(msg.arrays) - at} arrays of the batch belong to no entry")
    return out
