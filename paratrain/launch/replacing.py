"""Replacing the failed children of a supervised job: restarts within a budget, from a warm spare when one is
ready, and an elastic job's going on with fewer workers while a replacement joins later (:mod:`.restarts` holds
the budget; :class:`~paratrain.launch.procs.Supervisor` decides when a failure is covered)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from paratrain.launch.failures import ProcFailure, describe_failure
from paratrain.launch.pump import Pump, Stream
from paratrain.launch.specs import Child, ProcSpec, RestartPolicy

__all__ = ["Replacing"]


def _workers(count: int) -> str:
    return "worker" if count == 1 else "workers"


class Replacing:
    """The restart half of :class:`~paratrain.launch.procs.Supervisor`, which holds the state and the children."""

    _restarts: RestartPolicy | None
    _children: list[Child]
    _replaced: set[int]  # pids of failed children that a restart replaced
    _finished: set[int]  # pids of children seen to exit 0 (told to the restart policy)
    _pump: Pump | None
    _spawn: Callable[[ProcSpec], Child | None]
    _streams_of: Callable[[Child], list[Stream]]
    _say: Callable[[str], None]

    def _restart(self, failure: ProcFailure) -> bool:
        """Replaces a failed child, from a spare if one runs, if the budget allows; False if it does not."""
        assert self._restarts is not None
        failed = next(c for c in self._children if c.popen.pid == failure.pid)
        left = self._restarts.shrink(failed.spec, spare_ready=self._warm_spare())
        if left is not None:
            return self._shrink(failure, failed, left)
        spec = self._restarts.replacement(failed.spec)
        if spec is None:
            return False
        self._replaced.add(failure.pid)
        # a spare runs the workers' command: a parameter server is restarted cold
        spares = self._idle_spares() if spec.env.get("PARATRAIN_ROLE", "worker") == "worker" else []
        how = "cold (no spare was ready)"
        child: Child | None = None
        for spare in spares:
            assert spare.popen.stdin is not None
            try:
                spare.popen.stdin.write(self._restarts.assignment(spec))
                spare.popen.stdin.close()
            except OSError:
                continue  # it died meanwhile; its exit is reported like any spare's
            spare.spec = spec
            for stream in spare.streams:
                stream.prefix = spec.prefix
            child, how = spare, f"from the warm spare (pid {spare.popen.pid})"
            break
        if child is None:
            child = self._spawn(spec)
            if child is None:
                return True  # the failure to spawn is recorded and stops the job
            if self._pump is not None:
                self._pump.add(self._streams_of(child))
        budget = self._restarts
        self._say(
            f"{describe_failure(failure)}; restarting it {how}: restart {budget.used} of {budget.budget}, "
            "the other ranks go on"
        )
        if budget.left > 0 and budget.spare is not None and not self._idle_spares():
            spare_child = self._spawn(budget.spare)
            if spare_child is not None and self._pump is not None:
                self._pump.add(self._streams_of(spare_child))
        return True

    def _shrink(self, failure: ProcFailure, failed: Child, left: int) -> bool:
        """The elastic job went on without ``failed``; a cold replacement, if the budget allows, joins later."""
        assert self._restarts is not None
        self._replaced.add(failure.pid)
        spec = self._restarts.replacement(failed.spec)
        if spec is None:
            self._say(f"{describe_failure(failure)}; the job goes on with {left} {_workers(left)}")
            return True
        child = self._spawn(spec)
        if child is not None and self._pump is not None:
            self._pump.add(self._streams_of(child))
        budget = self._restarts
        self._say(
            f"{describe_failure(failure)}; the job goes on with {left} {_workers(left)}, and a replacement "
            f"started cold joins it at a checkpoint: restart {budget.used} of {budget.budget}"
        )
        return True

    def _note_finished(self) -> None:
        assert self._restarts is not None
        for child in self._children:
            if child.popen.pid not in self._finished and not child.spec.spare and child.popen.poll() == 0:
                self._finished.add(child.popen.pid)
                self._restarts.finished(child.spec)

    def _warm_spare(self) -> bool:
        """Whether an idle spare has finished starting (imported everything) and can take over at once."""
        assert self._restarts is not None
        return any(self._restarts.warm(c.spec, c.popen.pid) for c in self._idle_spares())

    def _idle_spares(self) -> list[Child]:
        return [
            c
            for c in self._children
            if c.spec.spare and c.popen.poll() is None and c.popen.stdin is not None and not c.popen.stdin.closed
        ]

    def _release_spares(self) -> None:
        """The work is done: spares read end-of-file and exit 0."""
        for child in self._children:
            if child.spec.spare and child.popen.stdin is not None and not child.popen.stdin.closed:
                with contextlib.suppress(OSError):
                    child.popen.stdin.close()
