"""Horovod's ``broadcast_object`` and ``allgather_object``, with a serialisation that cannot run code: JSON.

Horovod pickles the objects (cloudpickle), so any rank can make every other rank execute code. Here an object
travels as UTF-8 JSON (dicts with string keys, lists, strings, numbers, booleans, None; tuples arrive as lists),
and a rank whose object JSON cannot express makes every rank raise, instead of the others waiting for it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from paratrain.horovod.basics import HorovodInternalError, rank, run

__all__ = ["allgather_object", "broadcast_object"]


def _encode(obj: Any) -> tuple[np.ndarray, str | None]:
    """The object's bytes, or an empty array and why it cannot be sent."""
    try:
        return np.frombuffer(json.dumps(obj, allow_nan=True).encode(), dtype=np.uint8).copy(), None
    except (TypeError, ValueError) as exc:
        return np.zeros(0, dtype=np.uint8), f"{type(obj).__name__}: {exc}"


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: object = None) -> Any:
    """``root_rank``'s object on every rank (the others' ``obj`` is ignored).

    Raises:
        TypeError: on the root, an object JSON cannot express; HorovodInternalError on the others, naming it.
    """
    if process_set is not None:
        raise ValueError("paratrain.horovod runs on the whole job: process_set= is not supported")
    data, problem = _encode(obj) if rank() == root_rank else (np.zeros(0, dtype=np.uint8), None)
    header = np.array([len(data) if problem is None else -1], dtype=np.int64)
    length = int(np.asarray(run(lambda ctx: ctx.broadcast(header, root_rank)).result())[0])
    if length < 0:
        if problem is not None:
            raise TypeError(f"broadcast_object sends JSON (no pickle: a peer must not run what it receives): {problem}")
        raise HorovodInternalError(f"broadcast_object: rank {root_rank}'s object is not JSON-serialisable")
    buffer = data if rank() == root_rank else np.zeros(length, dtype=np.uint8)
    received = np.asarray(run(lambda ctx: ctx.broadcast(buffer, root_rank)).result(), dtype=np.uint8)
    return json.loads(received.tobytes().decode())


def allgather_object(obj: Any, name: str | None = None, process_set: object = None) -> list[Any]:
    """Every rank's object, in rank order.

    Raises:
        TypeError: on a rank whose object JSON cannot express; HorovodInternalError on the others, naming it.
    """
    if process_set is not None:
        raise ValueError("paratrain.horovod runs on the whole job: process_set= is not supported")
    data, problem = _encode(obj)
    lengths = np.asarray(
        run(lambda ctx: ctx.allgather(np.array([len(data) if problem is None else -1], dtype=np.int64))).result()
    )
    bad = [int(q) for q in np.flatnonzero(lengths < 0)]
    if bad:
        if problem is not None:
            raise TypeError(f"allgather_object sends JSON (no pickle: a peer must not run what it receives): {problem}")
        raise HorovodInternalError(f"allgather_object: the objects of rank(s) {bad} are not JSON-serialisable")
    everything = np.asarray(run(lambda ctx: ctx.allgather(data)).result(), dtype=np.uint8).tobytes()
    out, start = [], 0
    for length in lengths.tolist():
        out.append(json.loads(everything[start : start + length].decode()))
        start += length
    return out
