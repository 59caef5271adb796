"""Who sends what to whom when a job re-forms after a failure: a pure function of every rank's state. No I/O.

After a failure the ranks meet again (:func:`paratrain.runtime.context.reform`) and tell each other four numbers
(:class:`RankState`): how many reliable operations each has completed, the version and position of the
checkpoint it holds, and the oldest operation whose result it still keeps. From these alone every rank computes
the same :class:`RecoveryPlan`:

- the *frontier* F is the most operations any survivor has completed. Ranks can differ by at most one operation
  (none can finish operation n + 1 before every rank has finished n), so a survivor is at F or at F - 1;
- a restarted rank gets the newest checkpoint any survivor holds (from the lowest such rank) and the results of
  the operations from that checkpoint up to F, which it replays instead of running them;
- a survivor at F - 1 gets the result of operation F - 1;
- every result comes from the lowest survivor that keeps it, in runs of consecutive operations per sender.

Then everyone runs operation F live. So no survivor rolls back, and a replayed rank computes exactly what the
fault-free run computed. The runtime executes the plan, the tests compare it with exact tables.

Example (rank 1 restarted; rank 0 took checkpoint 2 at operation 10 and has completed 13; rank 2 is one behind)::

    >>> plan = plan_recovery([RankState(13, 2, 10, 9), RankState.restarted(), RankState(12, 2, 10, 9)])
    >>> plan.frontier, plan.checkpoint
    (13, Ckpt(src=0, version=2, seq=10, dst=(1,)))
    >>> plan.transfers
    (Transfer(src=0, dst=1, lo=10, hi=13), Transfer(src=0, dst=2, lo=12, hi=13))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Ckpt", "RankState", "RecoveryError", "RecoveryPlan", "Transfer", "plan_recovery"]


class RecoveryError(RuntimeError):
    """The job cannot be recovered from memory (no survivor holds what a rank needs)."""


@dataclass(frozen=True, slots=True)
class RankState:
    """What one rank reports when the job re-forms.

    Attributes:
        completed: reliable operations it has completed (the number of the one it is in); -1: restarted.
        version: version of the checkpoint it holds (0: none).
        ckpt_seq: the operation count at which that checkpoint was taken.
        cache_lo: the oldest operation whose result it keeps; it keeps every one from there to ``completed``.
    """

    completed: int
    version: int
    ckpt_seq: int
    cache_lo: int

    @classmethod
    def restarted(cls) -> RankState:
        """The state of a process that replaces a failed rank: it holds nothing."""
        return cls(-1, 0, 0, 0)

    @property
    def is_restarted(self) -> bool:
        """True for a replacement process."""
        return self.completed < 0

    def as_list(self) -> list[int]:
        """The four numbers, in the order they travel."""
        return [self.completed, self.version, self.ckpt_seq, self.cache_lo]


@dataclass(frozen=True, slots=True)
class Ckpt:
    """The checkpoint ``src`` sends to the restarted ranks ``dst``."""

    src: int
    version: int
    seq: int
    dst: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    """``src`` sends ``dst`` the results of operations ``lo`` to ``hi - 1``, in order."""

    src: int
    dst: int
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """Everything that moves when the job re-forms; every rank computes the same one.

    Attributes:
        frontier: the operation everyone runs live next.
        checkpoint: the checkpoint the restarted ranks load, or None (none was taken: they start from scratch
            and replay from operation 0).
        transfers: cached results to send, in the order each receiver takes them.
    """

    frontier: int
    checkpoint: Ckpt | None
    transfers: tuple[Transfer, ...]

    def start(self, rank: int, states: Sequence[RankState]) -> int:
        """The operation ``rank`` resumes at: its checkpoint's for a restarted rank, else where it was."""
        if states[rank].is_restarted:
            return self.checkpoint.seq if self.checkpoint is not None else 0
        return states[rank].completed


def plan_recovery(states: Sequence[RankState]) -> RecoveryPlan:
    """The plan for re-forming a job whose ranks report ``states`` (indexed by rank).

    Raises:
        RecoveryError: every rank was restarted, or no survivor keeps a result some rank needs (more failed
            than the in-memory state can cover); the message says what is missing.
    """
    survivors = [r for r, s in enumerate(states) if not s.is_restarted]
    if not survivors:
        raise RecoveryError(
            "every rank was restarted at once: no survivor holds the training state in memory; start the job "
            "again from a checkpoint on disk"
        )
    frontier = max(states[r].completed for r in survivors)
    restarted = tuple(r for r, s in enumerate(states) if s.is_restarted)
    newest = max(states[r].version for r in survivors)
    checkpoint = None
    start = 0
    if newest > 0 and restarted:
        src = min(r for r in survivors if states[r].version == newest)
        checkpoint = Ckpt(src, newest, states[src].ckpt_seq, restarted)
        start = states[src].ckpt_seq
    needs = [(r, start if states[r].is_restarted else states[r].completed) for r in range(len(states))]
    transfers: list[Transfer] = []
    for dst, lo in needs:
        run: Transfer | None = None
        for seq in range(lo, frontier):
            holders = [r for r in survivors if r != dst and states[r].cache_lo <= seq < states[r].completed]
            if not holders:
                raise RecoveryError(
                    f"rank {dst} needs the result of reliable operation {seq}, and no survivor keeps it (they keep "
                    f"{[(r, states[r].cache_lo, states[r].completed) for r in survivors]} as (rank, from, to)); "
                    "too many ranks failed between two checkpoints"
                )
            src = holders[0]
            if run is not None and run.src == src and run.hi == seq:
                run = Transfer(src, dst, run.lo, seq + 1)
            else:
                if run is not None:
                    transfers.append(run)
                run = Transfer(src, dst, seq, seq + 1)
        if run is not None:
            transfers.append(run)
    return RecoveryPlan(frontier, checkpoint, tuple(transfers))
