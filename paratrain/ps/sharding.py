"""Where each part of each key lives: stable key hashing, range partitioning, and row-aligned chunks. No I/O.

A key's array is viewed as rows along axis 0 (a 1-D array: one element per row; a 0-d array: one row of one
element; an embedding table ``(R, D)``: R rows of D). A key is cut into chunks of contiguous rows (PHub's
fine-grained key chunking), and the chunks are dealt round-robin over the servers starting at the key's *home*
server, the one its hash falls on. So a big layer spreads over every server, small keys spread by hash, and a
sparse row push or pull (embeddings) maps to the chunks that hold those rows with one ``searchsorted``::

    key "emb", shape (10, 4) float32, chunk_bytes 64 -> 4 rows per chunk, home server 2 of 3

    rows    0  1  2  3 | 4  5  6  7 | 8  9
    chunk        0     |     1      |  2
    server       2     |     0      |  1

Every worker and every server computes the same plan from the key, the shape and the dtype alone, so no
directory service is needed and nothing has to be looked up at run time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Chunk",
    "as_rows",
    "home_server",
    "key_hash",
    "plan_chunks",
    "server_load",
    "split_rows",
]

#: Target size of one chunk, in bytes (1 MiB).
#:
#: The trade-off: smaller chunks balance load better (a layer of n bytes spreads over min(S, n / chunk) servers,
#: and the last chunk's remainder matters less) and let transfers overlap (a server starts updating chunk 0
#: while chunk 1 is still on the wire), but every chunk is one message per push and per pull, with its fixed
#: cost (a header, a ZeroMQ frame, a dictionary lookup and a Python call on the server). At 1 MiB that fixed
#: cost of tens of microseconds is a few percent of the transfer even on a 10-100 Gbit/s link, and a 100 MB
#: layer still spreads over up to 100 servers. PHub uses far smaller chunks (tens of KB) because its per-message
#: cost is an RDMA verb, not a Python call; BytePS partitions at about 4 MB. Lower it (e.g. 256 KiB) for many
#: servers and mid-sized layers; raise it when message counts dominate (profiles show time in small messages).
DEFAULT_CHUNK_BYTES: int = 1 << 20

_HASH_SPACE = 1 << 64


def _normalise_key(key: object) -> str | int:
    if isinstance(key, bool):
        raise TypeError(f"key {key!r} is a bool; use a str or an int key")
    if isinstance(key, str | int):
        return key
    if isinstance(key, np.integer):
        return int(key)  # numpy integers hash like the equal Python int
    raise TypeError(f"key {key!r} of type {type(key).__name__} is not a str or an int")


def key_hash(key: str | int) -> int:
    """A 64-bit unsigned hash of a key, the same in every process, run, platform and Python version.

    Python's ``hash()`` is salted per process (``PYTHONHASHSEED``), so two processes would disagree on where a
    key lives. This is BLAKE2b with an 8-byte digest (read big-endian) over a typed encoding: ``b"str:"`` + the
    UTF-8 text for a ``str``, ``b"int:"`` + the decimal digits for an ``int``, so ``"7"`` and ``7`` are
    different keys. NumPy integers hash like the equal ``int``; ``bool`` is refused (``True`` is almost
    certainly a bug, not key 1).

    Example:
        >>> key_hash("layer1.weight")
        2892967348787316195
        >>> key_hash(7) != key_hash("7")
        True
    """
    k = _normalise_key(key)
    data = b"str:" + k.encode("utf-8", "surrogatepass") if isinstance(k, str) else b"int:" + str(k).encode("ascii")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _check_num_servers(num_servers: int) -> None:
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers must be an int >= 1, got {num_servers!r}")


def home_server(key: str | int, num_servers: int) -> int:
    """The server that holds a key's first chunk: range partitioning of the hash space, ``floor(h * S / 2**64)``.

    Ranges rather than ``h mod S`` so that the split is exact for any S (no modulo bias) and so that server s
    owns one contiguous slice of the hash space, which is what a later consistent-hashing or range-splitting
    scheme (ps-lite's key ranges) can refine when servers join or leave.

    Example:
        >>> [home_server("emb", s) for s in (1, 2, 3, 4)]
        [0, 1, 2, 3]
    """
    _check_num_servers(num_servers)
    return (key_hash(key) * num_servers) >> 64


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows ``[row_start, row_stop)`` of a key, the ``index``-th chunk of it, held by server ``server``.

    Example:
        >>> Chunk(index=1, row_start=4, row_stop=8, server=2).num_rows
        4
    """

    index: int
    row_start: int
    row_stop: int
    server: int

    @property
    def num_rows(self) -> int:
        """How many rows the chunk holds."""
        return self.row_stop - self.row_start


def as_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, elements per row)`` of an array of this shape viewed as rows along axis 0.

    The runtime reshapes a key's array to this 2-D view to slice chunks and rows out of it.

    Example:
        >>> as_rows(()), as_rows((5,)), as_rows((10, 4)), as_rows((3, 2, 5))
        ((1, 1), (5, 1), (10, 4), (3, 10))
    """
    if not isinstance(shape, tuple) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    if not shape:
        return 1, 1
    width = 1
    for d in shape[1:]:
        width *= d
    return shape[0], width


def plan_chunks(
    key: str | int,
    shape: tuple[int, ...],
    itemsize: int,
    num_servers: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[Chunk]:
    """Cuts a key into chunks of whole rows and deals them round-robin over the servers from its home server.

    A chunk holds ``max(1, chunk_bytes // row_bytes)`` rows: a row is never split, because it is the unit of a
    sparse push or pull, so a row larger than ``chunk_bytes`` is a chunk on its own. Chunk j goes to server
    ``(home_server(key, S) + j) % S``. An array with no rows gets exactly one empty chunk (``row_start ==
    row_stop == 0``) on its home server, so that the key still exists somewhere (its shape and optimizer state
    have a home); an array whose rows hold no bytes (e.g. shape ``(5, 0)``) is one chunk of all its rows.

    Args:
        key: the key's name.
        shape: the array's shape; rows are along axis 0.
        itemsize: bytes per element (``dtype.itemsize``).
        num_servers: number of servers S.
        chunk_bytes: target chunk size; see :data:`DEFAULT_CHUNK_BYTES` for the trade-off.

    Returns:
        The chunks in row order; their ``index`` is their position in the list.

    Example:
        >>> [(c.row_start, c.row_stop, c.server) for c in plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64)]
        [(0, 4, 2), (4, 8, 0), (8, 10, 1)]
    """
    rows, width = as_rows(shape)
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize must be an int >= 1, got {itemsize!r}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
    home = home_server(key, num_servers)
    row_bytes = width * itemsize
    if rows == 0 or row_bytes == 0:
        return [Chunk(index=0, row_start=0, row_stop=rows, server=home)]
    per_chunk = max(1, chunk_bytes // row_bytes)
    return [
        Chunk(index=j, row_start=start, row_stop=min(start + per_chunk, rows), server=(home + j) % num_servers)
        for j, start in enumerate(range(0, rows, per_chunk))
    ]


def split_rows(
    chunks: list[Chunk], row_ids: npt.ArrayLike
) -> list[tuple[Chunk, npt.NDArray[np.intp], npt.NDArray[np.int64]]]:
    """Groups sparse row ids by the chunk that holds them, for a sparse push or pull.

    Vectorised: one ``searchsorted`` against the chunk starts and one stable ``argsort``, no Python loop over
    the ids. Ids may come in any order and repeat; every occurrence is kept, so a push of two gradients for
    the same row sends both (the server sums them, or the client coalesces first).

    Args:
        chunks: the key's chunks from :func:`plan_chunks` (they must tile ``[0, rows)`` in order).
        row_ids: a 1-D array of integer row ids in ``[0, rows)``; negative ids are not wrapped.

    Returns:
        One ``(chunk, positions, local_ids)`` per chunk that holds at least one id, in chunk order:
        ``positions`` index into ``row_ids`` (ascending), and ``local_ids = row_ids[positions] -
        chunk.row_start`` are the rows within the chunk (int64). No ids give an empty list.

    Raises:
        TypeError: the ids are not integers.
        IndexError: an id is outside ``[0, rows)``.
        ValueError: ``row_ids`` is not 1-D, or the chunks do not tile the rows.

    Example:
        >>> chunks = plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64)
        >>> [(c.index, p.tolist(), r.tolist()) for c, p, r in split_rows(chunks, np.array([9, 0, 5, 9]))]
        [(0, [1], [0]), (1, [2], [1]), (2, [0, 3], [1, 1])]
    """
    ids: npt.NDArray[Any] = np.asarray(row_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"row ids must be integers, got dtype {ids.dtype}; convert with .astype(np.int64)")
    if ids.ndim != 1:
        raise ValueError(f"row ids must be a 1-D array, got shape {ids.shape}")
    if not chunks:
        raise ValueError("no chunks: plan them with plan_chunks(), which returns at least one")
    starts = np.fromiter((c.row_start for c in chunks), dtype=np.int64, count=len(chunks))
    stops = np.fromiter((c.row_stop for c in chunks), dtype=np.int64, count=len(chunks))
    if starts[0] != 0 or not np.array_equal(starts[1:], stops[:-1]) or np.any(stops < starts):
        raise ValueError("chunks do not tile [0, rows) in order; pass the list plan_chunks() returned, unchanged")
    num_rows = int(stops[-1])
    if ids.size == 0:
        return []
    low, high = ids.min(), ids.max()
    if low < 0 or high >= num_rows:
        bad = low if low < 0 else high
        raise IndexError(f"row id {int(bad)} is outside [0, {num_rows}) of this key ({len(chunks)} chunks)")
    ids64 = ids.astype(np.int64, copy=False)
    owner = np.searchsorted(starts, ids64, side="right") - 1
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=len(chunks))
    bounds = np.concatenate(([0], np.cumsum(counts)))
    groups: list[tuple[Chunk, npt.NDArray[np.intp], npt.NDArray[np.int64]]] = []
    for j in np.flatnonzero(counts).tolist():
        positions = order[bounds[j] : bounds[j + 1]]
        groups.append((chunks[j], positions, ids64[positions] - starts[j]))
    return groups


def server_load(chunks: list[Chunk], row_bytes: int, num_servers: int) -> list[int]:
    """Bytes each server holds of one key (or of many: pass all their chunks if they share ``row_bytes``).

    Example:
        >>> server_load(plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64), 16, 3)
        [64, 32, 64]
    """
    _check_num_servers(num_servers)
    if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 0:
        raise ValueError(f"row_bytes must be an int >= 0, got {row_bytes!r}")
    load = [0] * num_servers
    for c in chunks:
        if not 0 <= c.server < num_servers:
            raise ValueError(f"chunk {c.index} is on server {c.server}, outside 0..{num_servers - 1}")
        load[c.server] += c.num_rows * row_bytes
    return load
