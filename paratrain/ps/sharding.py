"""Where each part of each key lives: stable key hashing, row chunks, and their balanced, consistent placement. No I/O.

A key's array is viewed as rows along axis 0 (a 1-D array: one element per row; a 0-d array: one row of one
element; an embedding table ``(R, D)``: R rows of D). A key is cut into chunks of contiguous rows (PHub's
fine-grained key chunking), and every chunk gets a *replica list*: distinct servers in failover order, its
primary first (:func:`replica_servers`). A big layer spreads over every server, small keys spread by hash, and a
sparse row push or pull (embeddings) maps to the chunks that hold those rows with one ``searchsorted``::

    key "emb", shape (10, 4) float32, chunk_bytes 64 -> 4 rows per chunk; 3 servers, 2 replicas

    rows      0  1  2  3 | 4  5  6  7 | 8  9
    chunk          0     |     1      |  2
    primary        1     |     2      |  0
    backup         0     |     0      |  2

Every worker and every server computes the same plan from the key, the shape, the dtype and the number of
servers alone, so no directory service is needed and nothing has to be looked up at run time.

**Placement.** A key's n chunks are where they would be had the servers joined one at a time: server 0 holds
them all; server t, joining servers 0..t-1, takes ``q_t = floor(n / (t + 1) + u_t)`` of them (``u_t`` uniform in
[0, 1), drawn from the key's hash), one at a time, each the chunk that weighs most for server t among the chunks of
the fullest servers. The primaries on S servers are the state after server S - 1 joined. So:

* *balanced per key*: every server holds the floor or the ceiling of n / S of the key's chunks, as round-robin dealing
  does (counts of chunks: the last chunk is short, so bytes differ by up to a chunk);
* *consistent*: from S to S + 1 servers exactly ``q_S`` chunks move, all to the new server, n / (S + 1) in
  expectation; removing the last server moves exactly its chunks back. A key of one chunk follows the rule of
  jump consistent hashing (Lamping & Veach 2014): it jumps to the t-th new server with probability 1/(t + 1);
* *replicas*: a chunk's backups are the other servers in the order of the chunk's own weights (rendezvous or
  highest-random-weight hashing, Thaler & Ravishankar 1998), weights drawn apart from those that chose the
  primaries. When a server fails, each of its chunks goes to the first live server of its list, the first backup;
  those spread evenly over all the survivors, and nothing else moves. From S to S + 1 servers a list of R changes
  with probability about R / (S + 1).

Weights and draws are splitmix64 outputs (a bijection of 64-bit words) seeded by :func:`key_hash`, in NumPy uint64
arithmetic, which wraps the same way on every platform: the same plan in every process.

The rule keeps both the balance of round-robin dealing and the small moves of consistent hashing, which plain
rendezvous and bounded-load hashing each give up; ``benchmarks/ps/README.md`` (placement) has the comparison and
the measurements. A :class:`~paratrain.ps.KVStore` plans each key once, at ``init``.
"""

from __future__ import annotations

import functools
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
    "replica_servers",
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


# -- the hash family --------------------------------------------------------------------------------------------
#
# Every random choice of the placement is an output of splitmix64: _stream(seed, n) are its outputs 1..n from
# `seed`. A key's chunk j has the seed c_j = _stream(key_hash, n)[j] and server s two salts, a_s =
# _stream(_TAKE_SALT, S)[s] and b_s = _stream(_BACKUP_SALT, S)[s]. Chunk j weighs mix(c_j ^ a_s) for server s
# when s joins and picks the chunks it takes, and mix(c_j ^ b_s) when its backups are ranked: the backups must
# not depend on how the primaries were chosen (with one weight for both, the first backups of server 0's
# chunks avoided server 1 by half, since server 1 had taken the chunks that weigh most for it). The share a
# joining server takes comes from _stream(key_hash ^ _SHARE_SALT, S). mix is a bijection, so a key's chunks weigh
# differently for any one server and a chunk weighs differently for every server: no ties to break.

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: 2**64 / golden ratio, odd
_TAKE_SALT = 0xD1B54A32D192ED03
_BACKUP_SALT = 0xA0761D6478BD642F
_SHARE_SALT = 0x8CB92BA72F3D8DD7


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser (Steele, Lea, Flood 2014): a bijection of 64-bit words in which every input bit
    flips every output bit with probability about 1/2. uint64 arithmetic wraps modulo 2**64 on every platform."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _stream(seed: int, count: int) -> npt.NDArray[np.uint64]:
    return _mix(np.uint64(seed) + np.arange(1, count + 1, dtype=np.uint64) * _GAMMA)


def _stream_ints(seed: int, count: int) -> list[int]:
    """:func:`_stream` in plain Python ints, faster for a few words (tests check that both agree)."""
    out = []
    for k in range(1, count + 1):
        z = (seed + k * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        out.append(z ^ (z >> 31))
    return out


@functools.lru_cache(maxsize=128)
def _server_salts(salt: int, num_servers: int) -> npt.NDArray[np.uint64]:
    salts = _stream(salt, num_servers)
    salts.flags.writeable = False
    return salts


def _weights(h: int, num_chunks: int, num_servers: int, salt: int) -> npt.NDArray[np.uint64]:
    """``w[j, s]``: how much chunk j of the key with hash ``h`` weighs for server s (``salt``: for what)."""
    return _mix(_stream(h, num_chunks)[:, None] ^ _server_salts(salt, num_servers)[None, :])


def _check_num_servers(num_servers: int) -> None:
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers must be an int >= 1, got {num_servers!r}")


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


# -- placement ---------------------------------------------------------------------------------------------------


def _share(num_chunks: int, t: int, u: int) -> int:
    """How many of ``num_chunks`` chunks server ``t`` takes when it joins servers ``0..t-1``: ``floor(n / (t + 1)
    + u / 2**64)``, exactly ``n / (t + 1)`` in expectation and the floor or the ceiling of it (exact integers)."""
    return ((num_chunks << 64) + u * (t + 1)) // ((t + 1) << 64)


def _primaries_small(weights: npt.NDArray[np.uint64], shares: list[int]) -> list[int]:
    """:func:`_primaries_large` in plain Python, faster for a few chunks (tests check that both agree)."""
    num_chunks, num_servers = weights.shape
    columns = weights.T.tolist()
    owner = [0] * num_chunks
    load = [num_chunks] + [0] * (num_servers - 1)
    for t in range(1, num_servers):
        q = _share(num_chunks, t, shares[t])
        if q == 0:
            continue
        weight = columns[t]
        rank = [0] * t
        levels = []
        for j in sorted(range(num_chunks), key=weight.__getitem__, reverse=True):
            levels.append((load[owner[j]] - rank[owner[j]], weight[j], j))
            rank[owner[j]] += 1
        for _, _, j in sorted(levels, reverse=True)[:q]:
            load[owner[j]] -= 1
            owner[j] = t
        load[t] = q
    return owner


def _primaries_large(weights: npt.NDArray[np.uint64], shares: list[int]) -> list[int]:
    """The primary server of each chunk: servers join one at a time, and server t takes its share q
    (:func:`_share`) one chunk at a time, each the chunk that weighs most for it among the chunks of the fullest
    servers.

    Vectorised over the chunks: a server's r-th heaviest chunk goes when the server is down to ``load - r``
    chunks, so the q taken are the first q in the order of (that level, weight), both descending.
    """
    num_chunks, num_servers = weights.shape
    heaviest_first = np.argsort(~weights, axis=0)
    owner = np.zeros(num_chunks, dtype=np.intp)
    load = np.zeros(num_servers, dtype=np.intp)
    load[0] = num_chunks
    positions = np.arange(num_chunks)
    for t in range(1, num_servers):
        q = _share(num_chunks, t, shares[t])
        if q == 0:
            continue
        order = heaviest_first[:, t]
        holder = owner[order]
        by_holder = np.argsort(holder, kind="stable")
        grouped = holder[by_holder]
        rank = np.empty_like(positions)
        rank[by_holder] = positions - np.searchsorted(grouped, grouped)
        taken = order[np.argsort(rank - load[holder], kind="stable")[:q]]
        load[:t] -= np.bincount(owner[taken], minlength=t)
        load[t] = q
        owner[taken] = t
    return owner.tolist()


#: Up to this many chunks a key is placed in plain Python, above it with NumPy (about equally fast there).
_SMALL_KEY_CHUNKS = 40


def replica_servers(key: str | int, num_chunks: int, num_servers: int, replicas: int = 1) -> list[tuple[int, ...]]:
    """The replica list of every chunk of a key: ``replicas`` distinct servers, the primary first.

    The primaries are balanced per key (each server holds ``floor`` or ``ceil`` of ``num_chunks / num_servers``
    of the key's chunks) and consistent: going from S to S + 1 servers moves only chunks that the new server
    takes, ``num_chunks / (S + 1)`` in expectation. A chunk's backups are the other servers by the chunk's own
    weights (rendezvous hashing), so a failed primary's chunks spread over all the other servers, and "the first
    live server of the list" moves nothing but the failed server's chunks. See the module docstring.

    Args:
        key: the key's name.
        num_chunks: how many chunks the key has. A key's primaries depend on all its chunks, so pass the count
            :func:`plan_chunks` made (``len(plan_chunks(...))``).
        num_servers: number of servers S.
        replicas: the length R of each list, ``1 <= R <= S``; 1 is the primary alone.

    Returns:
        One tuple per chunk, in chunk order.

    Raises:
        ValueError: a count is not an int >= 1, or ``replicas`` exceeds ``num_servers``.

    Example:
        >>> replica_servers("emb", 3, 3, 2)
        [(1, 0), (2, 0), (0, 2)]
        >>> [[servers[0] for servers in replica_servers("emb", 5, s)] for s in (4, 5)]  # server 4 takes one
        [[1, 2, 0, 3, 0], [1, 2, 0, 3, 4]]
    """
    _check_positive("num_chunks", num_chunks)
    _check_num_servers(num_servers)
    _check_positive("replicas", replicas)
    if replicas > num_servers:
        raise ValueError(
            f"replicas={replicas} needs as many distinct servers but there are {num_servers}; "
            "lower replicas or start more servers"
        )
    if num_servers == 1:
        return [(0,)] * num_chunks
    h = key_hash(key)
    shares = _stream_ints(h ^ _SHARE_SALT, num_servers)
    if num_chunks == 1:  # the chunk is on the last server that took it (jump consistent hashing)
        owner = [max(t for t in range(num_servers) if t == 0 or _share(1, t, shares[t]))]
    else:
        take = _weights(h, num_chunks, num_servers, _TAKE_SALT)
        owner = (_primaries_small if num_chunks <= _SMALL_KEY_CHUNKS else _primaries_large)(take, shares)
    if replicas == 1:
        return [(s,) for s in owner]
    primary = np.asarray(owner, dtype=np.intp)[:, None]
    by_weight = np.argsort(~_weights(h, num_chunks, num_servers, _BACKUP_SALT), axis=1)
    backups = by_weight[by_weight != primary].reshape(num_chunks, num_servers - 1)[:, : replicas - 1]
    return [tuple(row) for row in np.concatenate((primary, backups), axis=1).tolist()]


def home_server(key: str | int, num_servers: int) -> int:
    """The server that holds a key of one chunk: where a small key lives.

    A key of several chunks spreads them over the servers (:func:`plan_chunks`); its chunk 0 need not be here.

    Example:
        >>> [home_server("emb", s) for s in range(1, 9)]
        [0, 0, 0, 0, 4, 4, 4, 4]
    """
    return replica_servers(key, 1, num_servers)[0][0]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows ``[row_start, row_stop)`` of a key, the ``index``-th chunk of it, held by server ``server``, and
    copied to the servers ``backups`` (in failover order) when the key is replicated.

    Example:
        >>> c = Chunk(index=1, row_start=4, row_stop=8, server=2, backups=(0,))
        >>> c.num_rows, c.replicas
        (4, (2, 0))
    """

    index: int
    row_start: int
    row_stop: int
    server: int
    backups: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        """How many rows the chunk holds."""
        return self.row_stop - self.row_start

    @property
    def replicas(self) -> tuple[int, ...]:
        """The primary then the backups: where the chunk lives, in failover order."""
        return (self.server, *self.backups)


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
    replicas: int = 1,
) -> list[Chunk]:
    """Cuts a key into chunks of whole rows and places them on the servers (:func:`replica_servers`).

    A chunk holds ``max(1, chunk_bytes // row_bytes)`` rows: a row is never split, because it is the unit of a
    sparse push or pull, so a row larger than ``chunk_bytes`` is a chunk on its own. An array with no rows gets
    exactly one empty chunk (``row_start == row_stop == 0``) on its home server (:func:`home_server`), so that
    the key still exists somewhere (its shape and optimizer state have a home); an array whose rows hold no
    bytes (e.g. shape ``(5, 0)``) is one chunk of all its rows.

    Args:
        key: the key's name.
        shape: the array's shape; rows are along axis 0.
        itemsize: bytes per element (``dtype.itemsize``).
        num_servers: number of servers S.
        chunk_bytes: target chunk size; see :data:`DEFAULT_CHUNK_BYTES` for the trade-off.
        replicas: servers per chunk, ``1 <= R <= S``: the primary (``Chunk.server``) and R - 1 ``Chunk.backups``.
            The trade-off: R copies survive R - 1 failed servers but take R times the memory, and a primary
            forwards every push R - 1 times (``KVStore(replicas=R)``, ``paratrain launch --replicas R``; measured
            in ``benchmarks/ps_replication``). 1 (no backups) by default; 2 is the usual when servers may fail.

    Returns:
        The chunks in row order; their ``index`` is their position in the list.

    Example:
        >>> chunks = plan_chunks("emb", (10, 4), 4, 3, chunk_bytes=64, replicas=2)
        >>> [(c.row_start, c.row_stop, c.server, c.backups) for c in chunks]
        [(0, 4, 1, (0,)), (4, 8, 2, (0,)), (8, 10, 0, (2,))]
    """
    rows, width = as_rows(shape)
    _check_positive("itemsize", itemsize)
    _check_positive("chunk_bytes", chunk_bytes)
    row_bytes = width * itemsize
    per_chunk = max(1, chunk_bytes // row_bytes) if rows and row_bytes else max(rows, 1)
    starts = range(0, max(rows, 1), per_chunk)
    placed = replica_servers(key, len(starts), num_servers, replicas)
    return [
        Chunk(index=j, row_start=start, row_stop=min(start + per_chunk, rows), server=r[0], backups=r[1:])
        for j, (start, r) in enumerate(zip(starts, placed, strict=True))
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
        [32, 64, 64]
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
