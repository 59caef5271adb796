"""What the process supervisor is given: a process to start (:class:`ProcSpec`), a restart budget's interface
(:class:`RestartPolicy`); and what it holds of each child it started (:class:`Child`)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Protocol

from paratrain.launch.pump import Stream

__all__ = ["Child", "ProcSpec", "RestartPolicy"]


@dataclass(frozen=True, slots=True)
class ProcSpec:
    """One process to start.

    Attributes:
        name: human name used in messages, e.g. ``"rank 2"``.
        argv: the command to run; ``argv[0]`` is looked up on the ``PATH`` of ``env``.
        env: the child's complete environment (nothing is inherited implicitly, so that what a rank sees
            is exactly what the launcher decided).
        prefix: prepended to every output line of this child, e.g. ``"[rank2]: "`` (``""`` for none).
        essential: if False, this child's failure is reported but does not stop the others (elastic jobs,
            where the survivors carry on without a lost worker); the job still ends with exit code 1.
        kill_after: an injected failure ``(seconds after the start, signal, description)``: the supervisor sends
            the signal then and says so (``paratrain launch --kill``).
        spare: a warm standby (:mod:`.restarts`): its standard input is a pipe on which it is told which failed
            rank it replaces; it does not count as running work, and it is released when the work is done.
        restartable: whether the restart budget covers this child: None (the default) for essential children only;
            True for one that is not essential either (a replicated parameter server, which catches up from the
            other replicas, :mod:`paratrain.ps.resync`); False for none (a parameter-server job's workers).
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    prefix: str
    essential: bool = True
    kill_after: tuple[float, int, str] | None = None
    spare: bool = False
    restartable: bool | None = None


class RestartPolicy(Protocol):
    """What the supervisor asks of a restart budget (:class:`paratrain.launch.restarts.Restarts` is the one)."""

    budget: int
    used: int
    spare: ProcSpec | None

    @property
    def left(self) -> int:
        """Restarts still allowed."""
        ...

    def replacement(self, failed: ProcSpec) -> ProcSpec | None:
        """The spec that replaces ``failed`` (counted against the budget), or None when the budget is spent."""
        ...

    def assignment(self, spec: ProcSpec) -> bytes:
        """The line a warm spare reads to become ``spec``'s process."""
        ...

    def shrink(self, failed: ProcSpec, *, spare_ready: bool) -> int | None:
        """An elastic job drops ``failed`` instead of waiting for it: the workers left, or None (it waits)."""
        ...

    def finished(self, spec: ProcSpec) -> None:
        """``spec``'s process exited 0 (an elastic job then stops waiting for joiners once every member has)."""
        ...

    def warm(self, spec: ProcSpec, pid: int) -> bool:
        """Whether the spare ``pid`` has finished starting and can take over at once."""
        ...


@dataclass(slots=True, eq=False)
class Child:
    """A started child: its spec (a spare takes the one it replaces), its process, and its output streams."""

    spec: ProcSpec
    popen: subprocess.Popen[bytes]
    streams: tuple[Stream, ...] = ()
