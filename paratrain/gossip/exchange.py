"""D-PSGD's neighbour exchange without torch: post this rank's arrays to its graph neighbours, then take theirs.

One exchange per step: :meth:`NeighbourExchange.post` hands this rank's arrays (its parameters, one flat array
per bucket) to every neighbour and returns at once; :meth:`NeighbourExchange.wait` blocks until every neighbour's
arrays are here and returns them, checked against this rank's layout, with the neighbour's mixing weight. The
caller mixes them (``x_i <- W_ii x_i + sum_j W_ij x_j``) in whatever arithmetic it likes: the torch front end
(:class:`~paratrain.torch.strategies.GossipStrategy`) is a thin adapter over this module.

Two backends behind the one interface; :func:`open_exchange` picks one:

- :class:`SocketExchange`: one message per neighbour per exchange through the workers' transport, tagged with
  a tag from ``next_tag`` (taken at the same point on every rank, so ranks stay matched without a handshake).
  Receives and sends are posted together, so exchanges with different neighbours run concurrently and no
  pair of ranks can deadlock.
- :class:`ShmExchange`: every worker on this host; each rank publishes into its slot of a shared-memory segment
  (:class:`~paratrain.gossip.shm.ShmExchangeGroup`) and reads its neighbours' slots in place, waiting only for
  their counters.

Every blocking call has a timeout; every call blocks only where its docstring says so. Not thread-safe: one
thread per rank drives an exchange.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from paratrain.errors import ConfigError
from paratrain.gossip.plan import round_actions
from paratrain.gossip.shm import ShmExchangeGroup
from paratrain.transport.base import Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["NeighbourExchange", "Received", "ShmExchange", "SocketExchange", "open_exchange"]

_Array = npt.NDArray[Any]


class Received(NamedTuple):
    """What one neighbour sent in one exchange.

    Attributes:
        peer: the neighbour's rank.
        weight: its weight ``W[rank, peer]`` in this rank's mix.
        arrays: its arrays, one per array this rank posted, of the same dtype and size. Valid until this rank's
            next :meth:`~NeighbourExchange.post` (with shared memory they are views of the neighbour's slot);
            copy them to keep them longer. They may be read-only.
    """

    peer: int
    weight: float
    arrays: list[_Array]


class NeighbourExchange(abc.ABC):
    """This rank's side of the exchanges with its graph neighbours: post, then wait, once per step.

    Attributes:
        neighbors: ``(peer, weight)`` for every neighbour, as :func:`paratrain.gossip.mixing.neighbors` gives them.
        timeout: seconds that :meth:`wait` and :meth:`close` wait for each neighbour.
        shared_memory: True for the shared-memory backend.
        receives: the receives in flight, ``(peer, weight, handle)`` (always empty with shared memory, which
            receives nothing); for tests and diagnostics.
    """

    shared_memory = False

    def __init__(self, *, rank: int, world_size: int, neighbors: Sequence[tuple[int, float]], timeout: float) -> None:
        for peer, _ in neighbors:
            if peer == rank or not 0 <= peer < world_size:
                raise ConfigError(f"rank {rank} cannot exchange with rank {peer} in a world of {world_size}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.neighbors = [(int(peer), float(weight)) for peer, weight in neighbors]
        self.timeout = timeout
        self.receives: list[tuple[int, float, Handle[Message]]] = []
        self._mine: list[_Array] | None = None  # what this rank posted, while the exchange is in flight

    @property
    def in_flight(self) -> bool:
        """True between :meth:`post` and the :meth:`wait` that completes it."""
        return self._mine is not None

    def post(self, arrays: Sequence[_Array]) -> None:
        """Sends ``arrays`` (flattened) to every neighbour and prepares to receive theirs. Never blocks.

        The arrays must stay unchanged until :meth:`wait` returns (sockets may still be reading them).

        Raises:
            RuntimeError: the previous exchange was not waited for.
        """
        if self._mine is not None:
            raise RuntimeError("post() while the previous exchange is in flight; wait() for it first")
        mine = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
        self._post(mine)
        self._mine = mine

    def wait(self) -> list[Received]:
        """Blocks until every neighbour's arrays of this exchange are here; returns them in neighbour order.

        Raises:
            RuntimeError: nothing was posted, or a neighbour sent a different number of arrays or sizes.
            CollectiveMismatchError: with shared memory, a neighbour published a different number of bytes.
            CommTimeoutError: a neighbour did not send within ``timeout``.
            PeerLostError: a neighbour died or left.
        """
        mine = self._mine
        if mine is None:
            raise RuntimeError("wait() without an exchange in flight; post() first")
        received = self._wait(mine)
        self._mine = None
        return received

    @abc.abstractmethod
    def close(self) -> None:
        """Ends the exchanges: completes or abandons the one in flight (see the backend), frees the backend."""

    @abc.abstractmethod
    def _post(self, mine: list[_Array]) -> None: ...

    @abc.abstractmethod
    def _wait(self, mine: list[_Array]) -> list[Received]: ...


class SocketExchange(NeighbourExchange):
    """The exchange as messages through a transport: one per neighbour per step, both directions at once.

    Args:
        transport: the workers' transport (ranks are its ranks).
        neighbors: ``(peer, weight)`` per neighbour (symmetric: this rank receives from whom it sends to).
        next_tag: gives the tag of each exchange; every rank must call it at the same point of its sequence
            of collectives (``context.next_collective_tag``).
        timeout: seconds to wait for each neighbour.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> def body(ctx):
        ...     ex = SocketExchange(ctx.transport, neighbors=[(1 - ctx.rank, 0.5)],
        ...                         next_tag=ctx.next_collective_tag, timeout=10)
        ...     ex.post([np.full(2, float(ctx.rank))])
        ...     [(peer, weight, [theirs])] = ex.wait()
        ...     ex.close()
        ...     return theirs.tolist()
        >>> run_ranks(2, body)
        [[1.0, 1.0], [0.0, 0.0]]
    """

    def __init__(
        self,
        transport: Transport,
        *,
        neighbors: Sequence[tuple[int, float]],
        next_tag: Callable[[], int],
        timeout: float,
    ) -> None:
        super().__init__(rank=transport.rank, world_size=transport.world_size, neighbors=neighbors, timeout=timeout)
        self._transport = transport
        self._next_tag = next_tag
        self._sends: list[Handle[None]] = []

    def _post(self, mine: list[_Array]) -> None:
        """Iterates the messages of this rank's round (:func:`~paratrain.gossip.plan.round_actions`)."""
        tag = self._next_tag()  # taken even without neighbours, so every rank stays in step
        transport = self._transport
        nbytes = sum(int(a.nbytes) for a in mine)
        weights = dict(self.neighbors)
        self.receives, self._sends = [], []
        for action in round_actions(tuple(peer for peer, _ in self.neighbors), nbytes):  # cached per size
            if action.kind == "recv":
                self.receives.append((action.peer, weights[action.peer], transport.irecv(action.peer, tag)))
            elif action.kind == "send":
                self._sends.append(transport.isend(action.peer, tag, mine))

    def _wait(self, mine: list[_Array]) -> list[Received]:
        receives, self.receives = self.receives, []
        received = [
            Received(peer, weight, _check(peer, handle.wait(self.timeout).arrays, mine))
            for peer, weight, handle in receives
        ]
        sends, self._sends = self._sends, []
        for sent in sends:
            sent.wait(self.timeout)
        return received

    def close(self) -> None:
        """Completes the exchange in flight, if any (its result is discarded). Blocks.

        It is waited for, not cancelled: a rank that left before its neighbours' last messages arrived would
        make their sends fail with ``PeerLostError``.

        Raises:
            CommTimeoutError, PeerLostError: a neighbour did not send its last arrays (it stopped early).
        """
        try:
            if self._mine is not None:
                self._wait(self._mine)
        finally:
            self._mine, self.receives, self._sends = None, [], []


def _check(peer: int, arrays: Sequence[_Array], mine: list[_Array]) -> list[_Array]:
    """``peer``'s arrays as flat arrays of this rank's dtypes (bfloat16 travels as its 16-bit pattern).

    Raises:
        RuntimeError: a different number of arrays, or of values in one.
    """
    if len(arrays) != len(mine):
        raise RuntimeError(
            f"gossip: rank {peer} sent {len(arrays)} buffers, expected {len(mine)}; every worker must build the "
            "same model and strategy"
        )
    out = []
    for array, ours in zip(arrays, mine, strict=True):
        theirs = array.reshape(-1)
        if theirs.dtype != ours.dtype and theirs.nbytes % ours.itemsize == 0:
            theirs = theirs.view(ours.dtype)
        if theirs.dtype != ours.dtype or theirs.size != ours.size:
            raise RuntimeError(
                f"gossip: rank {peer} sent {theirs.size} values for a bucket of {ours.size}; every worker must build "
                "the same model"
            )
        out.append(theirs)
    return out


class ShmExchange(NeighbourExchange):
    """The exchange through shared memory: publish into this rank's slot, read the neighbours' slots in place.

    Publishing never waits (a slow rank delays only its neighbours); :meth:`wait` waits for each neighbour's
    counter. The arrays it returns are views of the neighbours' slots.

    Args:
        group: the shared-memory group of all ranks (:meth:`create` makes it).
        neighbors: ``(peer, weight)`` per neighbour; must be symmetric (see :mod:`paratrain.gossip.shm`).
        timeout: seconds to wait for each neighbour.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> def body(ctx):
        ...     ex = ShmExchange.create(ctx.transport, neighbors=[(1 - ctx.rank, 0.5)], run_id="doc", timeout=10,
        ...                             tag=ctx.next_collective_tag(), nbytes=16)
        ...     ex.post([np.full(2, float(ctx.rank))])
        ...     [(peer, weight, [theirs])] = ex.wait()
        ...     got = theirs.tolist()  # a view of the neighbour's slot: read it before the next post
        ...     ex.close()
        ...     return got
        >>> run_ranks(2, body)
        [[1.0, 1.0], [0.0, 0.0]]
    """

    shared_memory = True

    def __init__(self, group: ShmExchangeGroup, *, neighbors: Sequence[tuple[int, float]], timeout: float) -> None:
        super().__init__(rank=group.rank, world_size=len(group.ranks), neighbors=neighbors, timeout=timeout)
        self.group = group

    @staticmethod
    def supported() -> bool:
        """True where shared memory between ranks is correct (x86-64)."""
        return ShmExchangeGroup.supported()

    @classmethod
    def create(
        cls,
        transport: Transport,
        *,
        neighbors: Sequence[tuple[int, float]],
        run_id: str,
        timeout: float,
        tag: int,
        nbytes: int,
    ) -> ShmExchange:
        """Creates the group of all ranks of ``transport``, with room for ``nbytes`` per exchange. Collective; blocks.

        Raises:
            ConfigError, PeerLostError, CommTimeoutError, TransportError: as :meth:`ShmExchangeGroup.create`.
        """
        group = ShmExchangeGroup.create(
            transport,
            ranks=list(range(transport.world_size)),
            run_id=run_id,
            timeout=timeout,
            tag=tag,
            capacity=max(4096, -(-nbytes // 4096) * 4096),
        )
        try:
            return cls(group, neighbors=neighbors, timeout=timeout)
        except BaseException:
            group.close()
            raise

    def _post(self, mine: list[_Array]) -> None:
        self.group.publish(mine)

    def _wait(self, mine: list[_Array]) -> list[Received]:
        total = sum(a.nbytes for a in mine)
        received = []
        for peer, weight in self.neighbors:
            raw = self.group.peer_array(peer, np.uint8, total, timeout=self.timeout)
            arrays, offset = [], 0
            for ours in mine:
                arrays.append(raw[offset : offset + ours.nbytes].view(ours.dtype))
                offset += ours.nbytes
            received.append(Received(peer, weight, arrays))
        return received

    def close(self) -> None:
        """Leaves the group. Never blocks: publishing never waits, so nothing of this rank is in flight, and
        neighbours that already hold its last exchange read it on."""
        self._mine = None
        self.group.close()


def open_exchange(
    transport: Transport,
    *,
    neighbors: Sequence[tuple[int, float]],
    next_tag: Callable[[], int],
    timeout: float,
    shared_memory: bool = False,
    run_id: str = "default",
    nbytes: int = 0,
) -> NeighbourExchange:
    """The exchange of this rank: through shared memory if asked (collective: it creates the segment over the tag
    ``next_tag()``), else through ``transport``'s messages.

    Args:
        transport: the workers' transport.
        neighbors: ``(peer, weight)`` per neighbour (:func:`paratrain.gossip.mixing.neighbors`).
        next_tag: the source of tags, called at the same point on every rank (``context.next_collective_tag``).
        timeout: seconds to wait for each neighbour.
        shared_memory: every rank is on this host and nothing emulates a network between them; all ranks must
            pass the same value.
        run_id: the job's id, part of the segment's name (shared memory only).
        nbytes: the most bytes one :meth:`~NeighbourExchange.post` carries (shared memory only).

    Raises:
        ConfigError: a neighbour outside the world, or a bad timeout.
        PeerLostError, CommTimeoutError, TransportError: creating the shared-memory segment failed.
    """
    if shared_memory:
        return ShmExchange.create(
            transport, neighbors=neighbors, run_id=run_id, timeout=timeout, tag=next_tag(), nbytes=nbytes
        )
    return SocketExchange(transport, neighbors=neighbors, next_tag=next_tag, timeout=timeout)
