"""Latency-bound collectives: the per-call message bookkeeping, the signature agreement, and binomial trees.

Everything here moves few, small messages in O(log N) rounds, which is what wins for small arrays:

* :func:`agree` is the handshake every collective starts with: a dissemination allgather of the ranks' call
  signatures (op, dtype, shape, algorithm, root). Its rounds depend only on the world size, so ranks that
  disagree about everything else still complete it, learn every rank's signature, and all raise the same
  :class:`~paratrain.errors.CollectiveMismatchError` instead of deadlocking in data phases of different
  lengths.
* :func:`direct_allreduce` rides on the agreement: its rounds carry the data too, and every rank reduces all
  contributions itself. For tiny arrays nothing is faster: one round of messages for two ranks.
* :func:`tree_allreduce` and :func:`tree_broadcast` execute the binomial plans of
  :mod:`paratrain.collectives.plans`.

Each of them iterates its rank's actions of a plan from :mod:`.lower`; the bookkeeping of a call is an
:class:`~paratrain.collectives.exchange.Exchange` (imported from here too, where it used to live).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.collectives.exchange import Exchange
from paratrain.collectives.execute import Buffers, run_actions
from paratrain.collectives.lower import agreement_plan, broadcast_plan, reduce_plan
from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.collectives.ops import Reducer
from paratrain.errors import MessageError
from paratrain.transport.base import Handle
from paratrain.transport.wire import Message

__all__ = ["Exchange", "agree", "direct_allreduce", "tree_allreduce", "tree_broadcast", "tree_reduce"]


def agree(ex: Exchange, signature: list[Any], payload: npt.NDArray[Any] | None = None) -> list[list[Any]]:
    """Every rank's call signature, in rank order: a dissemination allgather in ceil(log2 N) rounds.

    In round k rank r sends to ``r + 2**k`` the signatures it knows of ranks ``r, r - 1, ...`` (as many as the
    receiver still lacks) and receives those of ``r - 2**k, ...``; after the last round it knows all N (this
    is Bruck's allgather). The rounds do not depend on the signatures, so ranks that disagree still finish it
    together; the caller then compares the signatures and, on a mismatch, every rank raises the same error.
    Cost: ceil(log2 N) small-message latencies per collective call.

    With ``payload`` (a flat array) the same rounds also carry every rank's payload, and afterwards
    ``ex.gathered[q]`` is rank q's (None where a rank sent none, which only a mismatch explains). That is how
    :func:`direct_allreduce` gets its data with no latency beyond the agreement.

    Raises:
        MessageError: a peer sent something that is not a signature list.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         return agree(ex, ["allreduce", ctx.rank])
        >>> run_ranks(3, rank_fn)[0]
        [['allreduce', 0], ['allreduce', 1], ['allreduce', 2]]
    """
    n, rank = ex.world_size, ex.rank
    sigs_known: dict[int, list[Any]] = {rank: signature}
    data_known: dict[int, npt.NDArray[Any] | None] = {rank: payload}
    actions = agreement_plan(n, 0 if payload is None else payload.size, _itemsize(payload)).ranks[rank]
    posted: dict[int, tuple[Handle[Message], int, int]] = {}  # recv action -> (handle, peer, round)
    rounds = 0

    def take(index: int) -> None:
        handle, peer, k = posted.pop(index)
        count = min(1 << k, n - (1 << k))
        msg = ex.recv(handle)
        sigs = msg.meta.get("sigs")
        if not isinstance(sigs, list) or len(sigs) != count or not all(isinstance(s, list) for s in sigs):
            raise MessageError(
                f"rank {rank}: {ex.label}: rank {peer} sent no valid signatures in the agreement round; "
                "do all ranks run the same paratrain version?"
            )
        arrays: Sequence[npt.NDArray[Any] | None] = msg.arrays if len(msg.arrays) == count else [None] * count
        for i, sig in enumerate(sigs):
            sigs_known[(peer - i) % n] = sig
            data_known[(peer - i) % n] = arrays[i]

    for index, action in enumerate(actions):
        if action.kind == "recv":
            posted[index] = (ex.post(action.peer), action.peer, rounds)
            continue
        for d in action.deps:  # the previous round's message: what it brought is forwarded now
            take(d)
        count = min(1 << rounds, n - (1 << rounds))
        mine = [(rank - i) % n for i in range(count)]
        blocks = [data_known[q] for q in mine]
        carried = [b for b in blocks if b is not None]
        ex.send(action.peer, carried if len(carried) == count else (), {"sigs": [sigs_known[q] for q in mine]})
        rounds += 1
    for index in sorted(posted):
        take(index)
    if payload is not None:
        ex.gathered = [data_known[q] for q in range(n)]
    return [sigs_known[q] for q in range(n)]


def _itemsize(payload: npt.NDArray[Any] | None) -> int:
    return 0 if payload is None else payload.itemsize


def direct_allreduce(ex: Exchange, src: npt.NDArray[Any], dst: npt.NDArray[Any], reducer: Reducer) -> None:
    """Allreduce from the payloads the agreement gathered (:func:`agree` with ``payload=src``): reduce locally.

    Every rank combines all N contributions itself, in rank order, so all get identical bits; the only
    communication is the agreement's ceil(log2 N) rounds, against 3 ceil(log2 N) for agreement plus tree.
    Each rank receives (N - 1) times the array, so this is for small arrays (latency-bound), and the auto
    policy uses it only below :data:`~paratrain.collectives.api.AUTO_DIRECT_MAX_BYTES`.

    Raises:
        MessageError: the agreement did not gather a well-formed contribution from every rank.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     x = np.full(2, ctx.rank + 1)
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         agree(ex, ["allreduce"], payload=x)
        ...         direct_allreduce(ex, x, x, Reducer("max", "int64"))
        ...     return x.tolist()
        >>> run_ranks(3, rank_fn)
        [[3, 3], [3, 3], [3, 3]]
    """
    n, rank = ex.world_size, ex.rank
    gathered = ex.gathered or []
    blocks = [b for b in gathered if b is not None and b.shape == src.shape and b.dtype == src.dtype]
    if len(gathered) != n or len(blocks) != n:
        raise MessageError(
            f"rank {rank}: {ex.label}: the agreement did not gather one contribution of {src.shape} {src.dtype} "
            "from every rank"
        )
    ex.finish()  # our own block may still be on its way out of src, which may be dst
    actions = allreduce_plan("direct", n, src.size, src.itemsize, aliased=dst is src).ranks[rank]
    agreement = len(agreement_plan(n, src.size, src.itemsize).ranks[rank])  # ran in agree() already
    own = np.empty_like(src) if dst is src and rank >= 2 else src  # a copy only where the plan makes one
    buffers: Buffers = {"src": src, "dst": dst, "gathered": blocks, "own": own}
    run_actions(ex, actions, buffers, reducer, dst.dtype, start=agreement)


def tree_broadcast(
    ex: Exchange,
    dst: npt.NDArray[Any],
    *,
    root: int,
    source: npt.NDArray[Any] | None = None,
) -> None:
    """Broadcasts the root's ``source`` into every rank's ``dst`` (flat arrays) along a binomial tree.

    On the root ``source`` is sent (and copied into ``dst`` unless it is ``dst``); elsewhere ``source`` is
    ignored. Non-root ranks forward the received buffer to their children before copying it into ``dst``,
    which takes the copy off the critical path. Blocks until this rank's part is done. See
    :func:`~paratrain.collectives.plans.binomial_tree_broadcast` for the cost.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     out = np.zeros(2)
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         tree_broadcast(ex, out, root=2, source=np.array([7.0, 8.0]))
        ...     return out.tolist()
        >>> run_ranks(4, rank_fn)[0]
        [7.0, 8.0]
    """
    plan = broadcast_plan(
        "tree", ex.world_size, dst.size, dst.itemsize, root=root, aliased=source is dst, agreement=False
    )
    run_actions(ex, plan.ranks[ex.rank], {"src": dst if source is None else source, "dst": dst}, None, dst.dtype)


def tree_allreduce(ex: Exchange, src: npt.NDArray[Any], dst: npt.NDArray[Any], reducer: Reducer) -> None:
    """Allreduce of flat ``src`` into flat ``dst`` (which may be ``src``): binomial reduce to 0, then broadcast.

    Children's partial results are combined in plan order, so results are deterministic, and the broadcast
    gives every rank the root's bits. 2 ceil(log2 N) latencies and the full array on every tree edge: the
    choice for small arrays. ``mean`` is finished by the root before the broadcast.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     x, out = np.array([ctx.rank, 1.0]), np.empty(2)
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         tree_allreduce(ex, x, out, Reducer("mean", "float64"))
        ...     return out.tolist()
        >>> run_ranks(5, rank_fn)[4]
        [2.0, 1.0]
    """
    plan = allreduce_plan("tree", ex.world_size, dst.size, dst.itemsize, aliased=dst is src, agreement=False)
    run_actions(ex, plan.ranks[ex.rank], {"src": src, "dst": dst}, reducer, dst.dtype)


def tree_reduce(ex: Exchange, src: npt.NDArray[Any], dst: npt.NDArray[Any], reducer: Reducer) -> None:
    """Binomial-tree reduce of flat ``src`` to rank 0 of ``ex``: the result lands in rank 0's ``dst``.

    Partial results are combined in plan order (deterministic bits). ``mean`` is *not* finished here: the
    caller divides once, by whatever count is right (the world, or every host's ranks in a hierarchy). Returns
    when this rank's sends no longer read its buffers; other ranks' ``dst`` hold partial sums afterwards.
    """
    plan = reduce_plan(ex.world_size, dst.size, dst.itemsize, aliased=dst is src)
    run_actions(ex, plan.ranks[ex.rank], {"src": src, "dst": dst}, reducer, dst.dtype)
