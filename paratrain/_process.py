"""Whether a process on this host has exited: the one liveness test that needs no message from it.

Why here, below both users: the shared-memory collectives (:mod:`paratrain.shm.segment`) check a peer's pid while
they wait on memory it should write, and the socket transport (:mod:`paratrain.transport.zmq`) checks a same-host
peer whose connection is refused before it was ever made; the transport sits below the collectives, so the test
lives below both.
"""

from __future__ import annotations

import os

__all__ = ["process_dead"]


def process_dead(pid: int) -> bool:
    """True if ``pid`` has exited (also as an unreaped zombie, which ``kill(pid, 0)`` would call alive)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
