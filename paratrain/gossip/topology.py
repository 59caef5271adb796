"""Communication graphs for gossip as pure, validated, sorted edge lists: ring, torus, exponential, complete, user.

A topology is an undirected graph over the ranks ``0..n-1`` given as a sorted list of edges ``(u, v)`` with
``u < v``. These are pure functions (no I/O except :func:`load_edges`), so the runtime, the simulator and the tests
see the same graph. Every builder returns a graph that passes :func:`validate_edges`: connected (otherwise the
workers split into groups that never agree), without self-loops (a rank's own weight comes from the mixing rule,
not from an edge) and with ranks in range.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

__all__ = [
    "TOPOLOGIES",
    "Edge",
    "build_topology",
    "complete",
    "exponential",
    "load_edges",
    "normalize_edges",
    "resolve_topology",
    "ring",
    "torus",
    "torus_shape",
    "validate_edges",
]

Edge = tuple[int, int]


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"the number of workers must be an int >= 1, got {n!r}")


def normalize_edges(edges: Iterable[Iterable[Any]]) -> list[Edge]:
    """Edges as sorted ``(min, max)`` int pairs, duplicates (including ``(v, u)`` for ``(u, v)``) removed.

    Self-loops are kept so that :func:`validate_edges` can name them.

    Raises:
        ConfigError: an edge is not a pair of ints.
    """
    out: set[Edge] = set()
    for edge in edges:
        pair = list(edge) if not isinstance(edge, (str, bytes)) else [edge]
        if len(pair) != 2 or not all(isinstance(r, int) and not isinstance(r, bool) for r in pair):
            raise ConfigError(f"an edge must be a pair of integer ranks such as (0, 1), got {edge!r}")
        u, v = int(pair[0]), int(pair[1])
        out.add((min(u, v), max(u, v)))
    return sorted(out)


def validate_edges(n: int, edges: Iterable[Iterable[Any]]) -> list[Edge]:
    """Checks a graph over ranks ``0..n-1`` and returns it normalised (see :func:`normalize_edges`).

    Raises:
        ConfigError: ``n`` < 1, a rank outside ``0..n-1``, a self-loop, or a disconnected graph (the message
            names the offending edge or the ranks that cannot be reached from rank 0).
    """
    _check_n(n)
    norm = normalize_edges(edges)
    for u, v in norm:
        if u < 0 or v >= n:
            raise ConfigError(f"edge ({u}, {v}) names a rank outside 0..{n - 1} (the job has {n} workers)")
        if u == v:
            raise ConfigError(f"edge ({u}, {v}) is a self-loop; a rank's own weight comes from the mixing matrix")
    adjacency: list[list[int]] = [[] for _ in range(n)]
    for u, v in norm:
        adjacency[u].append(v)
        adjacency[v].append(u)
    seen = {0}
    frontier = [0]
    while frontier:
        node = frontier.pop()
        for peer in adjacency[node]:
            if peer not in seen:
                seen.add(peer)
                frontier.append(peer)
    if len(seen) != n:
        missing = sorted(set(range(n)) - seen)
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise ConfigError(
            f"the graph is not connected: rank(s) {shown} cannot be reached from rank 0, so their parameters "
            "would never mix with the others'; add edges that join them"
        )
    return norm


def ring(n: int) -> list[Edge]:
    """Each rank talks to ``rank ± 1 (mod n)``: two neighbours (one for n = 2, none for n = 1).

    Example:
        >>> ring(4)
        [(0, 1), (0, 3), (1, 2), (2, 3)]
    """
    _check_n(n)
    return validate_edges(n, ((i, (i + 1) % n) for i in range(n) if n > 1))


def torus_shape(n: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == n``, ``rows <= cols`` and the two as close as possible.

    A prime ``n`` gives ``(1, n)``: the torus degenerates to a ring.

    Example:
        >>> torus_shape(12), torus_shape(16), torus_shape(7)
        ((3, 4), (4, 4), (1, 7))
    """
    _check_n(n)
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    return rows, n // rows


def torus(n: int) -> list[Edge]:
    """A 2-D torus: rank ``r * cols + c`` talks to its four grid neighbours, with wraparound (see :func:`torus_shape`).

    Rows or columns of length 2 give one edge, not two, and length 1 none, so degrees may be below 4.

    Example:
        >>> torus(4)  # 2 x 2
        [(0, 1), (0, 2), (1, 3), (2, 3)]
    """
    rows, cols = torus_shape(n)
    edges: list[Edge] = []
    for r in range(rows):
        for c in range(cols):
            me = r * cols + c
            right, down = r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c
            edges += [(me, peer) for peer in (right, down) if peer != me]
    return validate_edges(n, edges)


def exponential(n: int) -> list[Edge]:
    """Rank ``i`` talks to ``i ± 2^k (mod n)`` for every ``2^k < n``: O(log n) neighbours, fast mixing.

    Example:
        >>> exponential(5)
        [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (3, 4)]
    """
    _check_n(n)
    edges: list[Edge] = []
    for i in range(n):
        hop = 1
        while hop < n:
            edges.append((i, (i + hop) % n))
            hop *= 2
    return validate_edges(n, (e for e in edges if e[0] != e[1]))


def complete(n: int) -> list[Edge]:
    """Every rank talks to every other: gossip then averages exactly, like an allreduce, at n - 1 messages each.

    Example:
        >>> complete(3)
        [(0, 1), (0, 2), (1, 2)]
    """
    _check_n(n)
    return [(u, v) for u in range(n) for v in range(u + 1, n)]


#: The named topologies, by name.
TOPOLOGIES: dict[str, Callable[[int], list[Edge]]] = {
    "ring": ring,
    "torus": torus,
    "exponential": exponential,
    "complete": complete,
}


def build_topology(name: str, n: int) -> list[Edge]:
    """The edges of the named topology (``ring``, ``torus``, ``exponential``, ``complete``) over ``n`` ranks.

    Raises:
        ConfigError: unknown name (the message lists the valid ones) or bad ``n``.
    """
    builder = TOPOLOGIES.get(name.strip().lower())
    if builder is None:
        raise ConfigError(f"unknown topology {name!r}; choose one of {', '.join(TOPOLOGIES)} or give a graph file")
    return builder(n)


def _parse_text(text: str, where: str) -> list[list[int]]:
    pairs: list[list[int]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.replace(",", " ").split()
        try:
            if len(fields) != 2:
                raise ValueError
            pairs.append([int(fields[0]), int(fields[1])])
        except ValueError:
            raise ConfigError(
                f"{where}, line {lineno}: expected two integer ranks 'u v', got {raw.strip()!r}"
            ) from None
    return pairs


def load_edges(source: str | Path | Any) -> list[Edge]:
    """A user's graph: a file path, or any object with an ``.edges()`` method (a networkx graph).

    Files hold either one edge ``u v`` per line (blank lines and ``#`` comments ignored; ``u,v`` also accepted)
    or a JSON list of pairs ``[[0, 1], [1, 2]]``. The result is normalised but not validated: the number of
    ranks is the job's, so call :func:`validate_edges` (or :func:`resolve_topology`) with it.

    Raises:
        ConfigError: the file is missing or unreadable, or its content is not a list of integer pairs.
    """
    if hasattr(source, "edges") and callable(source.edges):  # networkx, duck-typed: it is an optional extra
        return normalize_edges((u, v) for u, v, *_ in source.edges())
    if not isinstance(source, (str, Path)):
        raise ConfigError(f"a graph must be a file path or have .edges() (networkx), got {type(source).__name__}")
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the graph file {str(path)!r}: {exc.strerror or exc}") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, list):
            raise ConfigError(f"{path}: the JSON must be a list of [u, v] pairs")
        return normalize_edges(data)
    return normalize_edges(_parse_text(text, str(path)))


def resolve_topology(spec: str | Path | Any, n: int) -> list[Edge]:
    """A named topology or a user's graph (see :func:`load_edges`) over ``n`` ranks, validated.

    Raises:
        ConfigError: unknown name that is no existing file either, or an invalid graph for ``n`` ranks.
    """
    if isinstance(spec, str) and spec.strip().lower() in TOPOLOGIES:
        return build_topology(spec, n)
    if isinstance(spec, (str, Path)) and not Path(spec).exists():
        raise ConfigError(
            f"topology {str(spec)!r} is neither one of {', '.join(TOPOLOGIES)} nor an existing graph file"
        )
    return validate_edges(n, load_edges(spec))
