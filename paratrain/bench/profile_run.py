"""The measuring processes of a profile: a job of ranks under the launch library, and the JSON they hand back.

Each measurement runs ``python -m paratrain.bench.profile links|model ...`` (:mod:`paratrain.bench.profile`'s worker)
in real processes started as ``paratrain launch`` starts them; the ranks write their results to a file that the
parent reads once the job has ended.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

from paratrain.errors import ParatrainError

__all__ = ["CALL_TIMEOUT_S", "WORKER_MODULE", "ProfileError", "read_json", "run_job", "write_json"]

#: Seconds a rank's blocking call may wait for its peer before the measurement fails.
CALL_TIMEOUT_S = 60.0
#: What the measuring processes run (``python -m``): the profile's worker.
WORKER_MODULE = "paratrain.bench.profile"


class ProfileError(ParatrainError, RuntimeError):
    """A measurement did not complete (a measuring process failed or ran past its deadline); its output says why."""


def run_job(argv: list[str], *, nproc: int, faults: str | None, timeout: float, what: str) -> None:
    """Runs ``python -m paratrain.bench.profile ARGV`` in ``nproc`` ranks under the launch library; blocks.

    Raises:
        ProfileError: a rank failed or the job ran past ``timeout`` (the ranks' output, above, says why).
    """
    from paratrain.launch.procs import EXIT_TIMED_OUT
    from paratrain.launch.run import run_launch

    code = run_launch(
        ["python", "-m", WORKER_MODULE, *argv],
        nproc=nproc,
        faults=faults,
        timeout=min(CALL_TIMEOUT_S, timeout),
        deadline_s=timeout,
        stdout=sys.stderr,  # the ranks print only trouble; stdout is the table's
    )
    if code == EXIT_TIMED_OUT:
        raise ProfileError(f"measuring {what} took longer than {timeout:.0f}s and was stopped; try --quick")
    if code:
        raise ProfileError(f"measuring {what} failed (exit code {code}); the processes' errors are above")


def read_json(path: pathlib.Path, what: str) -> Any:
    """The result a measuring process wrote to ``path``; a missing or partial file is a failed measurement."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"measuring {what}: no result from the measuring process ({exc})") from None


def write_json(path: pathlib.Path, data: Any) -> None:
    """Writes atomically: the parent never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
