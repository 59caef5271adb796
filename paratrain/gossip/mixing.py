"""Doubly-stochastic mixing matrices for gossip: Metropolis-Hastings weights, checks, spectral gap and traffic.

One gossip step replaces every worker's vector by a weighted mean of its own and its neighbours':
``x_i <- sum_j W_ij x_j``. For the workers to agree on the *true* mean, ``W`` must be symmetric with rows and
columns summing to 1 (doubly stochastic) and non-negative; how fast they agree is set by the spectral gap
``1 - max(|lambda_2|, |lambda_n|)``: the distance to the mean shrinks at least by ``1 - gap`` per step (Lian et
al. NeurIPS'17 bound D-PSGD's convergence with it). All functions are pure (NumPy only, no torch, no I/O).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.errors import ConfigError
from paratrain.gossip.topology import Edge, normalize_edges, resolve_topology, validate_edges

__all__ = [
    "NodeTraffic",
    "load_mixing",
    "metropolis_hastings",
    "neighbors",
    "per_node_traffic",
    "resolve_mixing",
    "spectral_gap",
    "validate_mixing",
]

Matrix = npt.NDArray[np.float64]


def metropolis_hastings(n: int, edges: Iterable[Iterable[Any]]) -> Matrix:
    """The Metropolis-Hastings mixing matrix of a graph: ``w_ij = 1 / (1 + max(d_i, d_j))`` on edges.

    Each rank keeps ``w_ii = 1 - sum_j w_ij``. The rule needs only the degrees of a rank and its neighbours
    (no global knowledge), and always gives a symmetric, doubly-stochastic, non-negative matrix with a positive
    diagonal, whatever the degrees, which is why it is the default for arbitrary user graphs.

    Raises:
        ConfigError: the graph is invalid (see :func:`~paratrain.gossip.topology.validate_edges`).

    Example:
        >>> metropolis_hastings(2, [(0, 1)]).tolist()
        [[0.5, 0.5], [0.5, 0.5]]
    """
    norm = validate_edges(n, edges)
    degree = [0] * n
    for u, v in norm:
        degree[u] += 1
        degree[v] += 1
    w = np.zeros((n, n), dtype=np.float64)
    for u, v in norm:
        w[u, v] = w[v, u] = 1.0 / (1 + max(degree[u], degree[v]))
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def validate_mixing(w: Any, *, atol: float = 1e-9) -> Matrix:
    """Checks that ``w`` is a valid gossip matrix and returns it as a float64 array.

    Raises:
        ConfigError: not a square 2-D matrix, non-finite, not symmetric, a negative entry, or a row or column
            whose sum is not 1 within ``atol`` (the message names the first offending place and value).
    """
    arr = np.asarray(w, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] == 0:
        raise ConfigError(f"a mixing matrix must be square and non-empty, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ConfigError("the mixing matrix has NaN or infinite entries")
    asym = np.abs(arr - arr.T)
    if asym.max() > atol:
        i, j = np.unravel_index(int(np.argmax(asym)), asym.shape)
        raise ConfigError(
            f"the mixing matrix is not symmetric: W[{i},{j}] = {arr[i, j]:.6g} but W[{j},{i}] = {arr[j, i]:.6g}"
        )
    if arr.min() < -atol:
        i, j = np.unravel_index(int(np.argmin(arr)), arr.shape)
        raise ConfigError(f"the mixing matrix has a negative weight W[{i},{j}] = {arr[i, j]:.6g}")
    for axis, what in ((1, "row"), (0, "column")):
        sums = arr.sum(axis=axis)
        bad = np.flatnonzero(np.abs(sums - 1.0) > atol)
        if bad.size:
            k = int(bad[0])
            raise ConfigError(
                f"the mixing matrix is not doubly stochastic: {what} {k} sums to {sums[k]:.6g}, not 1 "
                "(the workers would drift away from the true mean)"
            )
    return arr


def spectral_gap(w: Any) -> float:
    """``1 - max(|lambda_2|, |lambda_n|)``: 1 minus the second largest absolute eigenvalue of ``W``.

    The larger the gap, the faster gossip reaches consensus: 1 for the complete graph (one step averages
    exactly), about ``2 pi^2 / (3 n^2)`` for a Metropolis-Hastings ring. A single rank has gap 1.

    Raises:
        ConfigError: ``w`` is not a valid mixing matrix (see :func:`validate_mixing`).
    """
    arr = validate_mixing(w)
    if arr.shape[0] == 1:
        return 1.0
    magnitudes = np.sort(np.abs(np.linalg.eigvalsh(arr)))[::-1]
    return float(1.0 - magnitudes[1])


def neighbors(w: Any, rank: int) -> list[tuple[int, float]]:
    """The peers ``rank`` mixes with, ``(peer, W[rank, peer])`` in increasing peer order (itself excluded).

    These are exactly the ranks a gossip step sends to and receives from.

    Raises:
        ConfigError: ``rank`` outside the matrix.
    """
    arr = np.asarray(w, dtype=np.float64)
    n = arr.shape[0]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
        raise ConfigError(f"rank {rank!r} outside 0..{n - 1}")
    return [(j, float(arr[rank, j])) for j in range(n) if j != rank and arr[rank, j] != 0.0]


@dataclass(frozen=True, slots=True)
class NodeTraffic:
    """What one rank sends and receives in one gossip step.

    Attributes:
        rank: the rank.
        neighbors: how many peers it exchanges with.
        bytes_sent: ``neighbors * nbytes`` (its whole model to each neighbour).
        bytes_received: the same (the graph is undirected).
    """

    rank: int
    neighbors: int
    bytes_sent: int
    bytes_received: int


def per_node_traffic(w: Any, nbytes: int) -> list[NodeTraffic]:
    """Per-rank traffic of one gossip step for a model of ``nbytes`` bytes.

    Unlike a ring allreduce (about ``2 nbytes`` per rank whatever ``n``), gossip costs ``degree * nbytes`` per
    rank, but only between neighbours and without a global synchronisation.

    Raises:
        ConfigError: negative ``nbytes``.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigError(f"nbytes must be an int >= 0, got {nbytes!r}")
    n = np.asarray(w).shape[0]
    out = []
    for rank in range(n):
        k = len(neighbors(w, rank))
        out.append(NodeTraffic(rank=rank, neighbors=k, bytes_sent=k * nbytes, bytes_received=k * nbytes))
    return out


def load_mixing(source: str | Path) -> Matrix | None:
    """A user-given ``W`` from a JSON file holding an object with ``"mixing_matrix"`` (None for other files).

    That is the format ``paratrain topology --json`` writes, so a matrix can be printed, edited (say, to give
    a fast link more weight) and trained with. The matrix is validated (:func:`validate_mixing`).

    Raises:
        ConfigError: unreadable file, invalid JSON, or an invalid matrix.
    """
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not text.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or "mixing_matrix" not in data:
        raise ConfigError(
            f"{path}: a JSON object must hold 'mixing_matrix' (a square list of lists, as written by "
            "'paratrain topology --json'); a graph file is a list of [u, v] pairs or 'u v' lines"
        )
    try:
        matrix = np.asarray(data["mixing_matrix"], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: 'mixing_matrix' is not a matrix of numbers ({exc})") from None
    try:
        return validate_mixing(matrix)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def resolve_mixing(spec: str | Path | Any, n: int) -> tuple[Matrix, list[Edge]]:
    """The mixing matrix and graph of a gossip strategy over ``n`` ranks.

    ``spec`` is a topology name, a graph file, a networkx graph or a list of edges ``(u, v)``
    (Metropolis-Hastings weights on its edges), a JSON file with a user-given ``"mixing_matrix"`` (see
    :func:`load_mixing`), or a NumPy matrix (a nested list is read as edges: ``[[0, 1], [1, 0]]`` is both). A
    user's matrix must be ``n x n``, valid, and connect the ranks (its non-zero off-diagonal entries are the
    edges).

    Raises:
        ConfigError: any invalid graph or matrix, with what is wrong.
    """
    w: Matrix | None = None
    if isinstance(spec, np.ndarray):
        w = validate_mixing(np.array(spec, dtype=np.float64))  # a copy: later edits of the caller's do not leak in
    elif isinstance(spec, (list, tuple)):
        edges = validate_edges(n, normalize_edges(spec))
        return metropolis_hastings(n, edges), edges
    elif isinstance(spec, (str, Path)) and Path(spec).is_file():
        w = load_mixing(spec)
    if w is None:
        edges = resolve_topology(spec, n)
        return metropolis_hastings(n, edges), edges
    if w.shape[0] != n:
        raise ConfigError(f"the mixing matrix is {w.shape[0]} x {w.shape[0]} but the job has {n} workers")
    edges = validate_edges(n, [(i, j) for i in range(n) for j in range(i + 1, n) if w[i, j] > 0.0])
    return w, edges
