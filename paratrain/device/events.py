"""Waiting for device work with a deadline: every host wait on a CUDA event goes through :func:`wait_event`.

``torch.cuda.Event.synchronize()`` (and a stream's) has no timeout: a kernel that never finishes, or a copy
queued behind one, would hang the rank forever. :func:`wait_event` polls ``event.query()`` instead and raises
:class:`~paratrain.errors.DeviceTimeoutError` when the deadline passes. Between polls it sleeps, starting at
``_FIRST_PAUSE`` and doubling up to ``_MAX_PAUSE``: a sleeping poller leaves the GIL to the threads that need it
(the backward thread's gradient hooks, the caller); polls back to back with ``sleep(0)`` take it back at once,
which the H100 traces of benchmarks/gpu/README.md point to as part of the hooks' cost (not measured apart yet).
"""

from __future__ import annotations

import time
from typing import Protocol

from paratrain.errors import DeviceTimeoutError

__all__ = ["DEVICE_TIMEOUT", "SupportsQuery", "wait_event"]

#: seconds a device wait may take when the caller names no timeout (PARATRAIN_TIMEOUT's default)
DEVICE_TIMEOUT = 300.0
_FIRST_PAUSE = 20e-6
_MAX_PAUSE = 1e-3


class SupportsQuery(Protocol):
    """What :func:`wait_event` waits on: a ``torch.cuda.Event`` (True once the work before it completed)."""

    def query(self) -> bool: ...


def wait_event(event: SupportsQuery, timeout: float = DEVICE_TIMEOUT, what: str = "device work") -> None:
    """Blocks until ``event`` has completed, at most ``timeout`` seconds.

    Raises:
        DeviceTimeoutError: the event had not completed when the deadline passed (``what`` names it).

    Example:
        >>> class Done:
        ...     def query(self): return True
        >>> wait_event(Done(), 1.0)
    """
    if event.query():
        return
    deadline = time.monotonic() + timeout
    pause = _FIRST_PAUSE
    while not event.query():
        if time.monotonic() > deadline:
            raise DeviceTimeoutError(
                f"{what} did not complete on the device within {timeout:g} s: a kernel or copy queued before it is "
                "stuck or very slow (another process holding the GPU?); raise PARATRAIN_TIMEOUT if it is only slow"
            )
        time.sleep(pause)
        pause = min(_MAX_PAUSE, pause * 2)
