"""Saying in words why a job's process failed, and which rank a chain of failures started from.

A user whose job died reads one line on stderr; it has to name the process, say how it ended in terms a person
knows ("killed by signal SIGKILL", not "-9"), hint at the usual fix, and, when ranks died of each other, point at
the rank where it started instead of the last one to notice.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ProcFailure",
    "describe_failure",
    "describe_returncode",
    "describe_spawn_error",
    "explain_failure",
    "plural",
    "signal_name",
]


@dataclass(frozen=True, slots=True)
class ProcFailure:
    """A child that failed, and how.

    Attributes:
        name: the child's ``ProcSpec.name``.
        pid: its process id, or 0 if it could not be started.
        returncode: as ``Popen`` gives it: negative means killed by that signal; 127 means it could not be
            started.
        cause: what happened, in words, e.g. ``"exited with code 3"`` or ``"was killed by signal SIGKILL"``.
    """

    name: str
    pid: int
    returncode: int
    cause: str


def describe_returncode(returncode: int) -> str:
    """Says in words how a child ended.

    Example:
        >>> describe_returncode(-9), describe_returncode(3)
        ('was killed by signal SIGKILL', 'exited with code 3')
    """
    if returncode < 0:
        return f"was killed by signal {signal_name(-returncode)}"
    cause = f"exited with code {returncode}"
    if returncode > 128 and _is_signal(returncode - 128):
        # Shells report a child killed by signal N as 128 + N; say so, since "137" alone means little.
        cause += f" (128 + {signal_name(returncode - 128)}: probably killed by that signal)"
    return cause


def _is_signal(number: int) -> bool:
    try:
        signal.Signals(number)
    except ValueError:
        return False
    return True


def signal_name(number: int) -> str:
    """``"SIGTERM"`` for 15; the number itself for one that is no signal here."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def describe_spawn_error(argv: Sequence[str], exc: BaseException) -> str:
    """Says why ``Popen`` could not start ``argv``, with a hint at the usual fix."""
    if isinstance(exc, FileNotFoundError):
        return f"could not be started: {exc.strerror}: {argv[0]!r} (is the command installed and on PATH?)"
    if isinstance(exc, PermissionError):
        return f"could not be started: {exc.strerror}: {argv[0]!r} (is the file executable?)"
    if isinstance(exc, OSError) and exc.strerror:
        return f"could not be started: {exc.strerror}: {argv[0]!r}"
    return f"could not be started: {exc}"


def describe_failure(failure: ProcFailure) -> str:
    """E.g. ``"rank 2 (pid 4242) exited with code 3"``; no pid for a child that could not be started."""
    who = f"{failure.name} (pid {failure.pid})" if failure.pid else failure.name
    return f"{who} {failure.cause}"


def plural(count: int) -> str:
    """``"1 process"``, ``"2 processes"``."""
    return f"{count} process" if count == 1 else f"{count} processes"


def _lost_peers(scratch_dir: str, rank: int) -> list[tuple[int, str]]:
    path = os.path.join(scratch_dir, f"peer-lost.{rank}")
    try:
        with open(path, encoding="utf-8") as fh:
            entries = [line.rstrip("\n").split("\t", 1) for line in fh if "\t" in line]
    except OSError:
        return []
    return [(int(peer), why) for peer, why in entries if peer.isdigit()]


def explain_failure(name: str, scratch_dir: str) -> str | None:
    """Follows the chain "rank A failed after losing rank B, which lost rank C..." to where it started.

    Ranks record lost peers in the scratch directory (see ``runtime.context``). When the failed rank lost a
    peer first, the peer is the more likely root cause, and a user debugging the job should look there.
    """
    if not name.startswith("rank "):
        return None
    rank = int(name.split()[1])
    chain = [rank]
    while True:
        lost = _lost_peers(scratch_dir, chain[-1])
        if not lost or lost[0][0] in chain:
            break
        chain.append(lost[0][0])
    if len(chain) == 1:
        return None
    origin = chain[-1]
    steps = " -> ".join(f"rank {r}" for r in chain)
    return f"rank {rank} failed after losing a peer ({steps}); look first at rank {origin}'s output above"
