"""Latency-bound collectives: the per-call message bookkeeping, the signature agreement, and binomial trees.

Everything here moves few, small messages in O(log N) rounds, which is what wins for small arrays:

* :class:`Exchange` is the bookkeeping of one collective call over a transport: its tag, its deadline (every
  wait takes what is left of one time budget, so a call never blocks longer than its timeout), the receives
  it posted (withdrawn if the call fails, so they cannot swallow later messages) and the sends still using
  its buffers.
* :func:`agree` is the handshake every collective starts with: a dissemination allgather of the ranks' call
  signatures (op, dtype, shape, algorithm, root). Its rounds depend only on the world size, so ranks that
  disagree about everything else still complete it, learn every rank's signature, and all raise the same
  :class:`~paratrain.errors.CollectiveMismatchError` instead of deadlocking in data phases of different
  lengths.
* :func:`direct_allreduce` rides on the agreement: its rounds carry the data too, and every rank reduces all
  contributions itself. For tiny arrays nothing is faster: one round of messages for two ranks.
* :func:`tree_allreduce` and :func:`tree_broadcast` execute the binomial plans of
  :mod:`paratrain.collectives.plans`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.collectives.ops import Reducer
from paratrain.collectives.plans import TreeStep, binomial_tree_broadcast, binomial_tree_reduce, dissemination_barrier
from paratrain.collectives.signature import Signature
from paratrain.errors import CommTimeoutError, MessageError
from paratrain.transport.base import Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["Exchange", "agree", "direct_allreduce", "tree_allreduce", "tree_broadcast", "tree_reduce"]


class Exchange:
    """The messages of one collective call: one tag, one deadline, its posted receives and pending sends.

    Use it as a context manager: if the body raises, receives still posted are withdrawn (a later message must
    not complete a receive nobody waits for). ``finish()`` waits until the transport no longer uses any buffer
    this call sent from, so the caller may modify them. Not thread-safe: one call, one thread.

    Args:
        transport: the transport to use.
        tag: the call's tag (fresh for each call, the same on every rank).
        timeout: seconds the whole call may take.
        label: what to call the operation in error messages, e.g. ``"allreduce (ring)"``.

    Example:
        >>> from paratrain.transport.inproc import InprocFabric
        >>> t = InprocFabric(1).transport(0)
        >>> with Exchange(t, tag=5, timeout=1.0, label="demo") as ex:
        ...     _ = ex.send(0, [np.arange(3)])
        ...     ex.recv_array(ex.post(0), 0, 3, np.dtype(np.int64))
        ...     ex.finish()
        array([0, 1, 2])
    """

    __slots__ = (
        "_posted",
        "_sends",
        "deadline",
        "gathered",
        "label",
        "rank",
        "signature",
        "tag",
        "timeout",
        "transport",
        "world_size",
    )

    def __init__(self, transport: Transport, *, tag: int, timeout: float, label: str) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.tag = tag
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.label = label
        self._posted: dict[Handle[Message], int] = {}
        self._sends: list[Handle[None]] = []
        #: Payloads the agreement carried, by rank (see :func:`agree`); None if it carried none.
        self.gathered: list[npt.NDArray[Any] | None] | None = None
        #: The call's signature, for an algorithm that runs the agreement itself (``AllreduceAlgorithm.agreement``
        #: False, like the shared-memory one); None otherwise.
        self.signature: Signature | None = None

    def left(self) -> float:
        """Seconds left of the call's time budget (never negative)."""
        return max(0.0, self.deadline - time.monotonic())

    def post(self, src: int) -> Handle[Message]:
        """Posts a receive from ``src`` with the call's tag. Does not block."""
        handle = self.transport.irecv(src, self.tag)
        self._posted[handle] = src
        return handle

    def recv(self, handle: Handle[Message]) -> Message:
        """Waits for a posted receive, within the deadline.

        Raises:
            CommTimeoutError: nothing arrived before the deadline (the receive is withdrawn).
            PeerLostError: the sender is gone.
        """
        src = self._posted.pop(handle)
        try:
            return handle.wait(self.left())
        except CommTimeoutError:
            if self.transport.cancel_recv(handle):
                raise CommTimeoutError(
                    f"rank {self.rank}: {self.label} not complete after {self.timeout:g}s: nothing from rank "
                    f"{src}; is that rank alive and calling the same collective in the same order? (if it is "
                    "only slow, raise the timeout)"
                ) from None
            return handle.wait(0)

    def recv_array(self, handle: Handle[Message], src: int, size: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """Waits for a posted receive carrying one flat array of ``size`` items of ``dtype``; returns it (read-only).

        Raises:
            MessageError: the message carries something else (a bug or a corrupted peer, never a user error:
                the agreement has checked shapes and dtypes already).
        """
        msg = self.recv(handle)
        if len(msg.arrays) != 1 or msg.arrays[0].shape != (size,) or msg.arrays[0].dtype != dtype:
            got = [(a.shape, str(a.dtype)) for a in msg.arrays]
            raise MessageError(
                f"rank {self.rank}: {self.label}: rank {src} sent {got} where ({size},) {dtype} was expected"
            )
        return msg.arrays[0]

    def send(self, dst: int, arrays: Sequence[Any], meta: Mapping[str, Any] | None = None) -> Handle[None]:
        """Starts a send to ``dst``; the returned handle completes when its buffers may be modified."""
        handle = self.transport.isend(dst, self.tag, arrays, meta)
        if not handle.done() or handle.exception() is not None:
            self._sends.append(handle)
        return handle

    def wait_sent(self, handle: Handle[None]) -> None:
        """Blocks, within the deadline, until a send's buffers may be modified."""
        handle.wait(self.left())

    def finish(self) -> None:
        """Waits, within the deadline, until every send of this call released its buffers."""
        for handle in self._sends:
            handle.wait(self.left())
        self._sends.clear()

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            for handle in list(self._posted):
                self.transport.cancel_recv(handle)
            self._posted.clear()


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
    for k, rnd in enumerate(dissemination_barrier(rank, n)):
        distance = 1 << k
        count = min(distance, n - distance)
        handle = ex.post(rnd.recv_from)
        mine = [(rank - i) % n for i in range(count)]
        blocks = [data_known[q] for q in mine]
        carried = [b for b in blocks if b is not None]
        ex.send(rnd.send_to, carried if len(carried) == count else (), {"sigs": [sigs_known[q] for q in mine]})
        msg = ex.recv(handle)
        sigs = msg.meta.get("sigs")
        if not isinstance(sigs, list) or len(sigs) != count or not all(isinstance(s, list) for s in sigs):
            raise MessageError(
                f"rank {rank}: {ex.label}: rank {rnd.recv_from} sent no valid signatures in the agreement round; "
                "do all ranks run the same paratrain version?"
            )
        arrays: Sequence[npt.NDArray[Any] | None] = msg.arrays if len(msg.arrays) == count else [None] * count
        for i, sig in enumerate(sigs):
            sigs_known[(rnd.recv_from - i) % n] = sig
            data_known[(rnd.recv_from - i) % n] = arrays[i]
    if payload is not None:
        ex.gathered = [data_known[q] for q in range(n)]
    return [sigs_known[q] for q in range(n)]


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
    if dst is src and rank >= 2:
        blocks[rank] = src.copy()  # dst is overwritten before our own turn comes
    reducer.combine(blocks[0], blocks[1], dst)
    for block in blocks[2:]:
        reducer.combine(dst, block, dst)
    reducer.finish(dst, n)


def _run_broadcast_steps(
    ex: Exchange, steps: list[TreeStep], source: npt.NDArray[Any] | None, dst: npt.NDArray[Any]
) -> None:
    """Receives (unless ``source`` is given) then forwards, per ``steps``; the data ends in ``dst``."""
    data: npt.NDArray[Any] | None = source
    for step in steps:
        if step.direction == "recv":
            data = ex.recv_array(ex.post(step.peer), step.peer, dst.size, dst.dtype)
        else:
            assert data is not None, "a broadcast plan receives before it sends"
            ex.send(step.peer, [data])  # forward the received buffer itself: the children need not wait
    if data is not None and data is not dst:
        np.copyto(dst, data)


def tree_broadcast(
    ex: Exchange,
    dst: npt.NDArray[Any],
    *,
    root: int,
    source: npt.NDArray[Any] | None = None,
    plan: Callable[[int, int, int], list[TreeStep]] = binomial_tree_broadcast,
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
    is_root = ex.rank == root
    _run_broadcast_steps(ex, plan(ex.rank, ex.world_size, root), source if is_root else None, dst)
    ex.finish()


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
    n, rank = ex.world_size, ex.rank
    tree_reduce(ex, src, dst, reducer)  # waits for its sends: the broadcast below overwrites dst
    if rank == 0:
        reducer.finish(dst, n)
        _run_broadcast_steps(ex, binomial_tree_broadcast(rank, n, 0), dst, dst)
    else:
        _run_broadcast_steps(ex, binomial_tree_broadcast(rank, n, 0), None, dst)
    ex.finish()


def tree_reduce(ex: Exchange, src: npt.NDArray[Any], dst: npt.NDArray[Any], reducer: Reducer) -> None:
    """Binomial-tree reduce of flat ``src`` to rank 0 of ``ex``: the result lands in rank 0's ``dst``.

    Partial results are combined in plan order (deterministic bits). ``mean`` is *not* finished here: the
    caller divides once, by whatever count is right (the world, or every host's ranks in a hierarchy). Returns
    when this rank's sends no longer read its buffers; other ranks' ``dst`` hold partial sums afterwards.
    """
    steps = binomial_tree_reduce(ex.rank, ex.world_size, 0)
    posted = {s.peer: ex.post(s.peer) for s in steps if s.direction == "recv"}
    acc = src
    for step in steps:
        if step.direction == "recv":
            data = ex.recv_array(posted[step.peer], step.peer, dst.size, dst.dtype)
            reducer.combine(acc, data, dst)
            acc = dst
        else:
            ex.send(step.peer, [acc])
    if ex.rank == 0 and acc is not dst:
        np.copyto(dst, acc)
    ex.finish()
