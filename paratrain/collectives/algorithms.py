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

from paratrain.collectives.execute import run_actions
from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.collectives.ops import Reducer
from paratrain.collectives.plans_blink import PackedTree
from paratrain.collectives.ring import chain_broadcast_run, ring_allreduce_run
from paratrain.collectives.tree import Exchange, direct_allreduce, tree_allreduce, tree_broadcast

__all__ = [
    "DEFAULT_ALLREDUCE_ALGORITHMS",
    "DEFAULT_BROADCAST_ALGORITHMS",
    "AllreduceAlgorithm",
    "AllreduceRun",
    "BroadcastAlgorithm",
    "planned_allreduce",
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


def planned_allreduce(
    name: str, *, segment_bytes: int | None = None, trees: tuple[PackedTree, ...] | None = None
) -> AllreduceRun:
    """The runner of allreduce plan ``name`` (:func:`~.lower_allreduce.allreduce_plan`, without the agreement,
    which the API ran), its messages cut into ``segment_bytes`` (``"blink"``: over ``trees``): this rank's
    actions, executed. Blocks."""

    def run(ex: Exchange, src: npt.NDArray[Any], dst: npt.NDArray[Any], reducer: Reducer) -> None:
        plan = allreduce_plan(
            name, ex.world_size, dst.size, dst.itemsize, aliased=dst is src, segment_bytes=segment_bytes,
            trees=trees, agreement=False,
        )  # fmt: skip
        run_actions(ex, plan.ranks[ex.rank], {"src": src, "dst": dst}, reducer, dst.dtype)

    run.__name__ = f"{name}_allreduce"
    return run


#: A broadcast algorithm: ``impl(exchange, dst, root=..., source=...)`` copies the root's flat ``source``
#: into every rank's flat ``dst``.
BroadcastAlgorithm = Callable[..., None]

DEFAULT_ALLREDUCE_ALGORITHMS: Mapping[str, AllreduceAlgorithm] = MappingProxyType(
    {
        "ring": AllreduceAlgorithm(ring_allreduce_run),
        "tree": AllreduceAlgorithm(tree_allreduce),
        "direct": AllreduceAlgorithm(direct_allreduce, data_in_agreement=True),
        **{name: AllreduceAlgorithm(planned_allreduce(name)) for name in ("halving_doubling", "torus", "double_tree")},
    }
)
DEFAULT_BROADCAST_ALGORITHMS: Mapping[str, BroadcastAlgorithm] = MappingProxyType(
    {"tree": tree_broadcast, "chain": chain_broadcast_run}
)
