"""The waiting side of a warm spare (``paratrain launch --max-restarts``): become the rank the launcher names.

A spare runs the job's own command; everything the command does before ``paratrain.init()`` (importing torch,
reading its arguments) is then already done when a rank fails, which is most of a cold start. In ``init()`` the
spare blocks on its standard input until the launcher writes the failed rank's environment as one JSON line
(:meth:`paratrain.launch.restarts.Restarts.assignment`); it takes that environment and goes on as that rank. At
the end of the job the launcher closes the pipe and the spare exits 0 without having done anything.

The line comes from the launcher, our parent, through a pipe nobody else holds; it is still parsed as data
(JSON of strings only), never executed.
"""

from __future__ import annotations

import json
import os
import sys

from paratrain.launch.restarts import SPARE_ENV, mark_spare_warm

__all__ = ["SPARE_ENV", "await_assignment"]


def await_assignment() -> None:
    """Blocks until the launcher assigns this spare a rank, then makes that rank's environment ours.

    Raises:
        SystemExit: (code 0) the launcher closed the pipe: the job ended without needing this spare.
        RuntimeError: the line is not a JSON map of strings (not something our launcher writes).
    """
    mark_spare_warm(os.environ.get("PARATRAIN_SCRATCH_DIR") or None)  # an elastic launcher may now rely on us
    line = sys.stdin.buffer.readline()
    if not line.strip():
        raise SystemExit(0)
    env = json.loads(line)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise RuntimeError("a spare's assignment must be a JSON map of strings (the environment of a rank)")
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    os.environ.update(env)
