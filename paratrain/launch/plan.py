"""The plan of a local job: what runs, under which run id, and on which ports, decided before anything starts."""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from paratrain.errors import ConfigError

__all__ = ["LaunchPlan", "free_port", "resolve_command"]


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """What ``launch`` will start: the command and the job-wide settings.

    Attributes:
        nproc: worker processes.
        argv: the command every worker runs (see :func:`resolve_command`).
        run_id: names the job's scratch directory and shared-memory segments, so that they can be swept.
        master_port: ``MASTER_PORT`` for torch code.
        rdzv_port: the port of paratrain's rendezvous server, hosted by the launcher.
        scratch_dir: a directory the ranks share (lost-peer records); removed after the job.
        faults: a fault spec every rank applies to its transport, or None.
        timeout: ``PARATRAIN_TIMEOUT`` of blocking calls in the ranks, or None for the default.
        servers: parameter-server processes started beside the workers.
        secret: the job's secret in hex (``PARATRAIN_SECRET`` of every process, spares too); not shown by ``repr``.
    """

    nproc: int
    argv: list[str]
    run_id: str
    master_port: int
    rdzv_port: int
    scratch_dir: str
    faults: str | None = None
    timeout: float | None = None
    servers: int = 0
    secret: str = field(default="", repr=False)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers that cannot bind port 0 themselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_command(cmd: Sequence[str]) -> list[str]:
    """The argv to run: 'python' means this interpreter; a ``.py`` file runs under it.

    Why: the ranks must import the same paratrain as the launcher, whatever ``python`` is first on PATH.

    Example:
        >>> resolve_command(["--", "python", "-m", "x"])[1:]
        ['-m', 'x']
    """
    argv = list(cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ConfigError("no command given; usage: paratrain launch -n N -- CMD [ARGS...]")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    return argv
