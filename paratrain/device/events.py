"""Waiting for device work with a deadline: every host wait on a CUDA event goes through :func:`wait_event`.

``torch.cuda.Event.synchronize()`` (and a stream's) has no timeout: a kernel that never finishes, or a copy
queued behind one, would hang the rank forever. :func:`wait_event` polls ``event.query()`` instead, yielding the
GIL between polls (the backward thread and the communication thread run Python meanwhile), and raises
:class:`~paratrain.errors.DeviceTimeoutError` when the deadline passes. Polls are back to back for the first
fraction of a millisecond (a staged copy usually completes within it, and the wait is on the critical path of a
step), then spaced out to at most ``_MAX_PAUSE`` seconds, so a long wait costs no core.
"""

from __future__ import annotations

import time
from typing import Protocol

from paratrain.errors import DeviceTimeoutError

__all__ = ["DEVICE_TIMEOUT", "SupportsQuery", "wait_event"]

#: seconds a device wait may take when the caller names no timeout (PARATRAIN_TIMEOUT's default)
DEVICE_TIMEOUT = 300.0
_SPIN = 200e-6  # seconds of back-to-back polls (each yields the GIL) before the pauses grow
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
    start = time.monotonic()
    pause = 0.0
    while not event.query():
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise DeviceTimeoutError(
                f"{what} did not complete on the device within {timeout:g} s: a kernel or copy queued before it is "
                "stuck or very slow (another process holding the GPU?); raise PARATRAIN_TIMEOUT if it is only slow"
            )
        if elapsed > _SPIN:
            pause = min(_MAX_PAUSE, max(pause * 2, 20e-6))
        time.sleep(pause)  # sleep(0) still releases the GIL to the other threads
