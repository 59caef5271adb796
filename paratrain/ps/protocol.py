"""The parameter server's messages: tags, operation names, and the error a rejected request raises.

Requests go to a server with :data:`REQUEST_TAG` and carry ``meta = {"op": ..., "id": n, ...}``; the server
answers request ``n`` of a worker with tag :func:`reply_tag` ``(n)``, so a worker can have many requests in
flight and match each answer exactly. Replies carry ``"done"``, the server's slowest-worker clock, which is
what the worker's cache and its staleness bound rely on. Everything is msgpack header + raw arrays.
"""

from __future__ import annotations

from paratrain.errors import ParatrainError

__all__ = ["OPS", "REQUEST_TAG", "PSRequestError", "reply_tag"]

#: Tag of every request to a server. Below the collectives' range, far from user tags (>= 0).
REQUEST_TAG = -(1 << 56)
_REPLY_BASE = -(1 << 57)

#: Request operations a server understands.
OPS = ("init", "push", "pull", "clock", "wait_clock", "join", "leave")


def reply_tag(request_id: int) -> int:
    """The tag of the answer to request ``request_id`` (ids count up from 0 per worker)."""
    return _REPLY_BASE - request_id


class PSRequestError(ParatrainError, ValueError):
    """A server rejected a request (unknown key, wrong shape or dtype...). The server keeps serving.

    The message says which server, which key and what was wrong; fix the call and retry.
    """
