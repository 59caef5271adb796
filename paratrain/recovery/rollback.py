"""Where a job whose ranks hold *different* states rolls back to after a death: a pure function. No I/O.

Gossip's workers (D-PSGD) each hold their own parameters and optimizer state, so Rabit's model, in which every
rank holds the same checkpoint, does not apply. Instead every rank keeps its own in-memory checkpoint at the same
steps (every ``K`` steps, and step 0) and sends a copy to its *buddy*, the next rank on the ring (``(r + 1) % n``),
which keeps its ward's two newest. When a rank dies, the job re-forms, each rank reports the steps of the
checkpoints it holds (:class:`RollbackState`), and every rank computes the same :class:`RollbackPlan`: the newest
step at which every survivor holds its own checkpoint and every replacement's buddy holds its copy. Everyone
restores that step's state (a replacement receives its copy from its buddy) and trains on from there.

The states at one step form a consistent cut (step ``k + 1`` of D-PSGD depends only on every worker's state after
step ``k``), and training is deterministic (data order a function of the step), so the job computes again exactly
what it computed before: the final models are the fault-free run's, bit for bit. The price of the rollback is at
most ``K`` steps of every rank's work done again (Rabit avoids it for replicated states; here it would need each
neighbour's messages since the checkpoint, kept and sent again, which this plan does without).

Example (3 ranks, rank 1 replaced; ranks 0 and 2 checkpointed at steps 10 and 20, but rank 1's copy of step 20 had
not reached its buddy, rank 2, before it died)::

    >>> states = [RollbackState((20, 10), (20, 10)), RollbackState.replacement(), RollbackState((20, 10), (10, 0))]
    >>> plan_rollback(states)
    RollbackPlan(step=10, copies=(Copy(src=2, dst=1),))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from paratrain.recovery.plan import RecoveryError

__all__ = ["Copy", "RollbackPlan", "RollbackState", "buddy_of", "plan_rollback"]

#: Checkpoints kept per rank, of its own and of its ward's: a copy in flight when its owner died is not lost
#: with the older one.
KEPT = 2


def buddy_of(rank: int, world_size: int) -> int:
    """The rank that keeps ``rank``'s checkpoint copies: the next one on the ring.

    Example:
        >>> [buddy_of(r, 3) for r in range(3)]
        [1, 2, 0]
    """
    return (rank + 1) % world_size


@dataclass(frozen=True, slots=True)
class RollbackState:
    """What one rank reports when the job re-forms.

    Attributes:
        own: the steps of its own checkpoints, newest first (at most :data:`KEPT`).
        ward: the steps of its ward's copies it keeps (the ward: the rank whose buddy it is), newest first.
        restarted: it replaces a dead rank and holds nothing.
    """

    own: tuple[int, ...]
    ward: tuple[int, ...]
    restarted: bool = False

    @classmethod
    def replacement(cls) -> RollbackState:
        """A replacement's state: it holds nothing."""
        return cls((), (), restarted=True)

    def as_row(self) -> list[int]:
        """Fixed-width integers for an allgather: restarted, own steps, ward steps (-1 for none)."""
        own = [*self.own, *[-1] * KEPT][:KEPT]
        ward = [*self.ward, *[-1] * KEPT][:KEPT]
        return [int(self.restarted), *own, *ward]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> RollbackState:
        """The inverse of :meth:`as_row`."""
        own = tuple(int(s) for s in row[1 : 1 + KEPT] if s >= 0)
        ward = tuple(int(s) for s in row[1 + KEPT : 1 + 2 * KEPT] if s >= 0)
        return cls(own, ward, restarted=bool(row[0]))


@dataclass(frozen=True, slots=True)
class Copy:
    """``src`` sends ``dst`` (a replacement) the copy of its checkpoint at the plan's step."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class RollbackPlan:
    """Every rank restores its state at ``step``; the replacements receive theirs by ``copies`` (none at step 0:
    the initial state, which a replacement builds itself)."""

    step: int
    copies: tuple[Copy, ...]


def plan_rollback(states: Sequence[RollbackState], keeper: Callable[[int, int], int] = buddy_of) -> RollbackPlan:
    """The plan for ranks reporting ``states`` (indexed by rank); ``keeper(rank, n)`` holds ``rank``'s copies (its
    buddy; for ranks with a twin holding the same state, a replicated pipeline stage, the twin, whose ``ward`` is
    its own checkpoints).

    Raises:
        RecoveryError: every rank was restarted, a replacement's buddy was restarted too (its copy died with it),
            or no step is held by everyone; the message says which.
    """
    n = len(states)
    survivors = [r for r, s in enumerate(states) if not s.restarted]
    if not survivors:
        raise RecoveryError("every rank was restarted at once: no survivor holds a checkpoint in memory")
    common = set(states[survivors[0]].own)
    for r in survivors[1:]:
        common &= set(states[r].own)
    copies, lost = [], []
    for r, s in enumerate(states):
        if not s.restarted:
            continue
        buddy = keeper(r, n)
        # step 0: the seeded initial state, which a replacement builds itself; later ones only from a live buddy
        if states[buddy].restarted:
            lost.append(f"rank {r}'s copies died with rank {buddy}, which kept them")
            common &= {0}
        else:
            common &= {0, *states[buddy].ward}
            copies.append(Copy(buddy, r))
    if not common:
        raise RecoveryError(
            "no step's checkpoint is held by every rank (own, and a replacement's copy at its buddy): "
            f"{[(r, s.own, s.ward) for r, s in enumerate(states)]} as (rank, own steps, ward's steps)"
            + (f"; {'; '.join(lost)}" if lost else "; a second death came before the job checkpointed again")
            + "; start the job again"
        )
    step = max(common)
    return RollbackPlan(step, tuple(copies) if step > 0 else ())
