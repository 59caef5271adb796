"""What an algorithm is to :class:`~paratrain.collectives.api.Collectives`: the registries' entries and defaults.

Algorithms are looked up by name in per-instance registries (``allreduce_algorithms``, ``broadcast_algorithms``)
that start as copies of the defaults here; registering one is adding an entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy.typing as npt

from paratrain.collectives.ops import Reducer
from paratrain.collectives.ring import chain_broadcast_run, ring_allreduce_run
from paratrain.collectives.tree import Exchange, direct_allreduce, tree_allreduce, tree_broadcast

__all__ = [
    "DEFAULT_ALLREDUCE_ALGORITHMS",
    "DEFAULT_BROADCAST_ALGORITHMS",
    "AllreduceAlgorithm",
    "AllreduceRun",
    "BroadcastAlgorithm",
]

AllreduceRun = Callable[[Exchange, npt.NDArray[Any], npt.NDArray[Any], Reducer], None]


@dataclass(frozen=True, slots=True)
class AllreduceAlgorithm:
    """An allreduce implementation, registered under a name in ``Collectives.allreduce_algorithms``.

    Attributes:
        run: ``run(exchange, src, dst, reducer)`` reduces every rank's flat ``src`` into its flat ``dst``
            (``dst`` may be ``src``); it is called after the agreement, on every rank, with equal shapes and
            dtypes, and must finish ``reducer.finish`` (mean) itself. It must use only ``exchange`` to talk
            (its tag, deadline and bookkeeping) and leave no send pending when it returns.
        data_in_agreement: the agreement also gathers every rank's ``src`` into ``exchange.gathered``.
        agreement: False for algorithms that check, themselves, that all ranks called them alike (the shared-
            memory one does, in the segment, folded into its first synchronisation); the API then skips its own
            agreement and passes the call's signature as ``exchange.signature``. Such an algorithm must raise the
            same ``CollectiveMismatchError`` on every rank, before data moves, when the signatures differ.
    """

    run: AllreduceRun
    data_in_agreement: bool = False
    agreement: bool = True


#: A broadcast algorithm: ``impl(exchange, dst, root=..., source=...)`` copies the root's flat ``source``
#: into every rank's flat ``dst``.
BroadcastAlgorithm = Callable[..., None]

DEFAULT_ALLREDUCE_ALGORITHMS: Mapping[str, AllreduceAlgorithm] = MappingProxyType(
    {
        "ring": AllreduceAlgorithm(ring_allreduce_run),
        "tree": AllreduceAlgorithm(tree_allreduce),
        "direct": AllreduceAlgorithm(direct_allreduce, data_in_agreement=True),
    }
)
DEFAULT_BROADCAST_ALGORITHMS: Mapping[str, BroadcastAlgorithm] = MappingProxyType(
    {"tree": tree_broadcast, "chain": chain_broadcast_run}
)
