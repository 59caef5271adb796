"""Restarting a failed rank while the job goes on (``paratrain launch --max-restarts R``), from a warm spare.

torchrun answers a failure by stopping every worker and starting the whole group again, so every process pays
Python's and torch's start-up (about a second here) and the user's code reloads a checkpoint from disk. Here only
the failed rank is replaced, and the survivors keep their state in memory (:mod:`paratrain.recovery` brings the
newcomer up to date from them). The replacement is usually already running: a *spare* started with the job has
imported everything the command imports before ``paratrain.init()`` and waits there, reading its standard input.
When a rank fails the supervisor writes that rank's environment to the spare as one line of JSON
(:func:`assignment`), the spare becomes the rank, and a new spare is started for the next failure while the
budget lasts. Without a live spare (two failures at once) the rank is started cold, from its command.

The budget is the job's, as torchrun's ``--max-restarts``: R restarts in all, whichever ranks fail. A replaced
process carries ``PARATRAIN_RESTART_COUNT`` one higher than the one it replaces, and never the failed one's kill
schedule (an injected fault fires once, not in every replacement).

An *elastic* job (``--min-workers M``, :class:`Membership`) does not make the survivors wait for a cold start:
when a worker fails and no warm spare is ready (or the budget is spent), the launcher drops it from the
rendezvous's members and the survivors go on without it, as long as M remain; a cold replacement, if the budget
allows one, joins when it is ready (at the members' next checkpoint). A warm spare still replaces in place, since
that is faster than re-forming twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Protocol

from paratrain.launch.kills import ENV as KILL_ENV
from paratrain.launch.specs import ProcSpec

__all__ = [
    "JOIN_FILE",
    "SPARE_ENV",
    "Membership",
    "Restarts",
    "mark_spare_warm",
    "read_join_round",
    "spare_is_warm",
    "spare_spec",
    "write_join_round",
]

#: In the launcher's scratch directory: the rendezvous round in which a waiting joiner will be admitted (written
#: when one registers; an elastic job's members read it at their checkpoints, :mod:`paratrain.recovery`).
JOIN_FILE = "join-round"

#: Set in a spare's environment: its ``paratrain.init()`` waits on standard input for the rank it becomes
#: (:mod:`paratrain.runtime.spare`).
SPARE_ENV = "PARATRAIN_SPARE"


class Members(Protocol):
    """What :class:`Membership` needs of the rendezvous (:class:`~paratrain.transport.rendezvous.RendezvousServer`)."""

    @property
    def members(self) -> list[int]:
        """The job's member ids now."""
        ...

    def remove(self, member: int) -> bool:
        """Drops ``member`` from the job for good."""
        ...

    def finish(self, member: int) -> None:
        """``member`` completed its work."""
        ...


@dataclass(slots=True)
class Membership:
    """An elastic job's floor and the rendezvous that tracks its members.

    Attributes:
        min_workers: the fewest workers the job goes on with.
        rendezvous: where the members meet (it forms each round without the dropped ones).
    """

    min_workers: int
    rendezvous: Members

    def drop(self, failed: ProcSpec) -> int | None:
        """Drops ``failed``'s member if at least ``min_workers`` remain; the workers left, or None (too few)."""
        member = int(failed.env["RANK"])
        members = self.rendezvous.members
        if member in members and len(members) - 1 < self.min_workers:
            return None
        self.rendezvous.remove(member)  # a joiner not yet admitted is not a member: nothing to drop
        return len(self.rendezvous.members)

    def finished(self, spec: ProcSpec) -> None:
        """A worker exited 0: once every member has, joiners still waiting are told the job is over."""
        self.rendezvous.finish(int(spec.env["RANK"]))


def _warm_path(scratch_dir: str, pid: int) -> str:
    return os.path.join(scratch_dir, f"spare-warm.{pid}")


def mark_spare_warm(scratch_dir: str | None) -> None:
    """Called by a spare when it waits for its rank with everything imported: it can take over at once."""
    if scratch_dir is not None:
        with open(_warm_path(scratch_dir, os.getpid()), "w", encoding="ascii"):
            pass


def spare_is_warm(spec: ProcSpec, pid: int) -> bool:
    """Whether spare process ``pid`` (started from ``spec``) has said it is warm (:func:`mark_spare_warm`).

    Why ask: a spare started for the next failure is idle at once but needs seconds to import torch; an elastic
    job should not wait for one that is not ready yet when it can go on without the failed worker.
    """
    scratch = spec.env.get("PARATRAIN_SCRATCH_DIR")
    return scratch is not None and os.path.exists(_warm_path(scratch, pid))


def write_join_round(scratch_dir: str, round_number: int) -> None:
    """Tells the members that a joiner waits for ``round_number`` (read at their checkpoints; atomic)."""
    path = os.path.join(scratch_dir, JOIN_FILE)
    with open(path + ".tmp", "w", encoding="ascii") as fh:
        fh.write(f"{round_number}\n")
    os.replace(path + ".tmp", path)


def read_join_round(scratch_dir: str | None) -> int:
    """The rendezvous round a waiting joiner will be admitted in (0: none waits, or no scratch directory)."""
    if scratch_dir is None:
        return 0
    try:
        with open(os.path.join(scratch_dir, JOIN_FILE), encoding="ascii") as fh:
            return int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return 0


@dataclass(slots=True)
class Restarts:
    """The job's restart budget and the template of its spares (the supervisor's :class:`~.procs.RestartPolicy`).

    Attributes:
        budget: restarts allowed in the whole job.
        spare: the spec a spare is started from (None: every restart is cold).
        used: restarts made so far.
        membership: an elastic job's (see the module docstring); None: a failure waits for its restart.
        rendezvous: a fixed-size job's rendezvous, told when a worker finished: a restarted worker that has not
            met the others by then never will, and is told so rather than left waiting out its timeout.
    """

    budget: int
    spare: ProcSpec | None = None
    used: int = 0
    membership: Membership | None = None
    rendezvous: Members | None = None

    def shrink(self, failed: ProcSpec, *, spare_ready: bool) -> int | None:
        """In an elastic job, drops ``failed`` rather than wait for it when no warm spare can replace it in place
        (``spare_ready``: one is idle and has said it is warm).

        Returns:
            The workers left when it dropped the failed member; None when the job waits for a restart instead
            (not elastic, a spare is ready with budget left, or too few would remain).
        """
        if self.membership is None or failed.spare or (spare_ready and self.left > 0):
            return None
        return self.membership.drop(failed)

    @staticmethod
    def warm(spec: ProcSpec, pid: int) -> bool:
        """Whether spare ``pid`` has said it is warm (:func:`spare_is_warm`)."""
        return spare_is_warm(spec, pid)

    def finished(self, spec: ProcSpec) -> None:
        """``spec``'s process exited 0 (see :meth:`Membership.finished`)."""
        if spec.spare or spec.env.get("PARATRAIN_ROLE", "worker") != "worker":
            return
        if self.membership is not None:
            self.membership.finished(spec)
        elif self.rendezvous is not None:
            self.rendezvous.finish(int(spec.env["RANK"]))

    @property
    def left(self) -> int:
        """Restarts still allowed."""
        return self.budget - self.used

    def replacement(self, failed: ProcSpec) -> ProcSpec | None:
        """The spec of the process that replaces ``failed``, counting it against the budget; None when spent."""
        if self.left <= 0 or failed.spare:
            return None
        self.used += 1
        env = {k: v for k, v in failed.env.items() if k != KILL_ENV}
        env["PARATRAIN_RESTART_COUNT"] = str(int(failed.env.get("PARATRAIN_RESTART_COUNT", "0")) + 1)
        return replace(failed, env=env, kill_after=None)

    @staticmethod
    def assignment(spec: ProcSpec) -> bytes:
        """The line a spare reads to become the rank of ``spec``: that rank's whole environment, as JSON."""
        return json.dumps(spec.env, sort_keys=True).encode("utf-8") + b"\n"


def spare_spec(template: ProcSpec, *, prefix: bool) -> ProcSpec:
    """A spare like ``template`` (a rank's spec): same command, waits for its rank on standard input."""
    env = {k: v for k, v in template.env.items() if k != KILL_ENV}
    env[SPARE_ENV] = "1"
    return ProcSpec(
        name="spare", argv=template.argv, env=env, prefix="[spare]: " if prefix else "", essential=False, spare=True
    )
