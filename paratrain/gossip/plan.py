"""One gossip round as a list of transfers ``(src, dst, nbytes)``: what the exchange sends, as plain data.

Pure (NumPy only): a round of D-PSGD sends each rank's whole model to every neighbour that the mixing matrix
names, in both directions, with no other traffic. A simulator or a recording transport can replay or check
the same list that :class:`~paratrain.gossip.exchange.NeighbourExchange` carries out (both derive the
neighbours from :func:`~paratrain.gossip.mixing.neighbors`).
"""

from __future__ import annotations

from typing import Any

from paratrain.errors import ConfigError
from paratrain.gossip.mixing import neighbors, validate_mixing

__all__ = ["Transfer", "round_plan"]

#: One message of a round: ``(src, dst, nbytes)``.
Transfer = tuple[int, int, int]


def round_plan(w: Any, nbytes: int) -> list[Transfer]:
    """The transfers of one gossip round for a model of ``nbytes`` bytes per rank, sorted by ``(src, dst)``.

    Rank ``src`` sends to each ``dst`` with ``W[src, dst] != 0`` and receives from the same ranks (``W`` is
    symmetric), so the receives of rank r are the transfers whose ``dst`` is r.

    Raises:
        ConfigError: ``w`` is not a valid mixing matrix, or ``nbytes`` is negative.

    Example:
        >>> from paratrain.gossip.mixing import metropolis_hastings
        >>> round_plan(metropolis_hastings(3, [(0, 1), (1, 2)]), 8)
        [(0, 1, 8), (1, 0, 8), (1, 2, 8), (2, 1, 8)]
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigError(f"nbytes must be an int >= 0, got {nbytes!r}")
    arr = validate_mixing(w)
    return [(src, dst, nbytes) for src in range(arr.shape[0]) for dst, _ in neighbors(arr, src)]
