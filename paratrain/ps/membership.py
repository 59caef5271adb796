"""Which servers hold keys now, and where each chunk lives then: the placement of a job whose servers change. No I/O.

A job starts ``slots`` server processes; the *active* ones hold keys, the others stand by (they count every
worker's clock, so one can take keys at any moment). A chunk's *order* is the full replica list of
:func:`~.sharding.replica_servers` over every slot (its balanced, consistent primary, then the others by the chunk's
own rendezvous weights), and the chunk lives on the first active server of its order. So:

* with every slot active a chunk lives on its primary: the placement of a job that never resizes;
* adding server t moves only the chunks whose order puts t before every server active now, all of them to t:
  ``1/(S + 1)`` of the chunks in expectation (a chunk whose primary is t, ``1/slots``, plus, of those whose
  primary stands by, the ``1/(S + 1)`` that rank t first among the S + 1);
* removing server t moves only t's chunks, each to the next active server of its order: they spread evenly over
  the others, and nothing else moves (the failover rule of replicated chunks).

Every worker and server computes the same owners from the key, its chunk count, the slots and the active set: no
directory. :mod:`.resize` moves the chunks between two such placements while workers train.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from paratrain.ps.sharding import replica_servers

__all__ = ["ServerSet", "moved_chunks", "owner_slots"]


@dataclass(frozen=True, slots=True)
class ServerSet:
    """The active servers of ``slots`` (indices ``0..slots-1``), after ``epoch`` resizes.

    Example:
        >>> s = ServerSet.first(4, 2)
        >>> s.active, s.with_server(3).active, s.with_server(3).without(0).active
        ((0, 1), (0, 1, 3), (1, 3))
    """

    slots: int
    active: tuple[int, ...]
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"a job needs at least one server slot, got {self.slots}")
        if not self.active or sorted(set(self.active)) != list(self.active):
            raise ValueError(f"active servers must be a sorted, non-empty list without repeats, got {self.active}")
        if self.active[0] < 0 or self.active[-1] >= self.slots:
            raise ValueError(f"active servers {list(self.active)} outside the slots 0..{self.slots - 1}")

    @classmethod
    def first(cls, slots: int, active: int | None = None) -> ServerSet:
        """Slots ``0..active-1`` active (all by default)."""
        count = slots if active is None else active
        if not 1 <= count <= slots:
            raise ValueError(f"active servers {count} outside 1..{slots} (the servers started)")
        return cls(slots, tuple(range(count)))

    def with_server(self, slot: int) -> ServerSet:
        """This set with ``slot`` added (the next epoch)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"server {slot} outside 0..{self.slots - 1}: start the job with more servers")
        if slot in self.active:
            raise ValueError(f"server {slot} holds keys already (active: {list(self.active)})")
        return ServerSet(self.slots, tuple(sorted((*self.active, slot))), self.epoch + 1)

    def without(self, slot: int) -> ServerSet:
        """This set with ``slot`` removed (the next epoch)."""
        if slot not in self.active:
            raise ValueError(f"server {slot} holds no keys (active: {list(self.active)})")
        if len(self.active) == 1:
            raise ValueError(f"server {slot} is the last one holding keys: add another before removing it")
        return ServerSet(self.slots, tuple(s for s in self.active if s != slot), self.epoch + 1)


def owner_slots(key: str | int, num_chunks: int, servers: ServerSet) -> list[int]:
    """The slot holding each chunk of a key: the first active server of the chunk's order.

    Example:
        >>> owner_slots("emb", 5, ServerSet.first(5))  # every slot active: the primaries
        [1, 2, 0, 3, 4]
        >>> owner_slots("emb", 5, ServerSet.first(5, 4))  # slot 4 stands by: its chunk goes to its next server
        [1, 2, 0, 3, 1]
    """
    active = servers.active
    if len(active) == servers.slots:
        return [order[0] for order in replica_servers(key, num_chunks, servers.slots)]
    orders = replica_servers(key, num_chunks, servers.slots, servers.slots)
    live = set(active)
    return [next(s for s in order if s in live) for order in orders]


def moved_chunks(
    key: str | int, num_chunks: int, before: ServerSet, after: ServerSet, chunks: Iterable[int] | None = None
) -> dict[int, tuple[int, int]]:
    """The chunks of a key whose slot differs between two placements: chunk index -> (slot before, slot after).

    ``chunks`` limits the answer to those indices (a server asks about the chunks it holds).

    Example:
        >>> moved_chunks("emb", 5, ServerSet.first(5, 4), ServerSet.first(5))
        {4: (1, 4)}
    """
    old, new = owner_slots(key, num_chunks, before), owner_slots(key, num_chunks, after)
    indices = range(num_chunks) if chunks is None else chunks
    return {i: (old[i], new[i]) for i in indices if old[i] != new[i]}
