"""One gossip round as a plan: what the exchange sends, as plain data.

Pure (NumPy only): a round of D-PSGD sends each rank's whole model to every neighbour that the mixing matrix
names, in both directions, with no other traffic. :func:`round_actions` is one rank's round in the plan IR
(:mod:`paratrain.plan.ir`: post a receive from every neighbour, send to every neighbour, then mix what
arrived), which :class:`~paratrain.gossip.exchange.SocketExchange` iterates and the cost model replays;
:func:`gossip_plan` is the world's, and :func:`round_plan` the same messages as ``(src, dst, nbytes)``.
"""

from __future__ import annotations

import functools
from typing import Any

from paratrain.errors import ConfigError
from paratrain.gossip.mixing import neighbors, validate_mixing
from paratrain.plan.ir import Action, Plan, PlanBuilder, Slice

__all__ = ["Transfer", "gossip_plan", "round_actions", "round_plan"]

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


@functools.lru_cache(maxsize=64)
def round_actions(peers: tuple[int, ...], nbytes: int) -> tuple[Action, ...]:
    """One rank's round: a receive posted from every neighbour, then one send of the model (``nbytes``) to
    each, then the mixing (``sum_j W_ij x_j``, one reduce per neighbour) once each message is in.

    Example:
        >>> [(a.kind, a.peer, a.nbytes) for a in round_actions((1, 3), 8)][:4]
        [('recv', 1, 8), ('recv', 3, 8), ('send', 1, 8), ('send', 3, 8)]
    """
    b = PlanBuilder()
    posted = [b.message("recv", peer, nbytes=nbytes) for peer in peers]
    for peer in peers:
        b.message("send", peer, nbytes=nbytes, data=Slice("src", 0, nbytes))
    for handle in posted:
        b.reduce(
            Slice("mixed", 0, nbytes), Slice("src", 0, nbytes), Slice("mixed", 0, nbytes), itemsize=1, deps=[handle]
        )
    return b.actions


def gossip_plan(w: Any, nbytes: int) -> Plan:
    """The world's plan of one gossip round for a model of ``nbytes`` bytes per rank (see :func:`round_plan`)."""
    arr = validate_mixing(w)
    return Plan(
        "gossip",
        tuple(round_actions(tuple(peer for peer, _ in neighbors(arr, r)), nbytes) for r in range(arr.shape[0])),
    )
