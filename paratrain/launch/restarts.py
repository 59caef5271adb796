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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from paratrain.launch.kills import ENV as KILL_ENV
from paratrain.launch.procs import ProcSpec

__all__ = ["SPARE_ENV", "Restarts", "spare_spec"]

#: Set in a spare's environment: its ``paratrain.init()`` waits on standard input for the rank it becomes
#: (:mod:`paratrain.runtime.spare`).
SPARE_ENV = "PARATRAIN_SPARE"


@dataclass(slots=True)
class Restarts:
    """The job's restart budget and the template of its spares (the supervisor's :class:`~.procs.RestartPolicy`).

    Attributes:
        budget: restarts allowed in the whole job.
        spare: the spec a spare is started from (None: every restart is cold).
        used: restarts made so far.
    """

    budget: int
    spare: ProcSpec | None = None
    used: int = 0

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
