"""One daemon thread per :class:`~paratrain.collectives.api.Collectives` that runs the ``*_async`` calls in order.

Calls must complete in the order every rank issued them (it decides their tags, and the shared-memory path
relies on one order), so a single thread runs them, and a blocking call first drains what was queued before.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from paratrain.errors import TransportClosedError
from paratrain.transport.base import Handle

__all__ = ["BackgroundWorker"]

T = TypeVar("T")


class BackgroundWorker:
    """One daemon thread that runs submitted collectives in submission order, started on first use."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Handle[Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.last: Handle[Any] | None = None  # the most recently submitted call

    def drain(self, timeout: float) -> None:
        """Waits until every call submitted so far has finished (their errors stay with their handles)."""
        last = self.last
        if last is not None and not last.done():
            with contextlib.suppress(BaseException):
                last.wait(timeout)

    def submit(self, fn: Callable[[], T]) -> Handle[T]:
        """Queues ``fn``; the handle completes with its result or error. Call under the caller's order lock."""
        if self._closed:
            raise TransportClosedError(f"{self._name}: collectives are shut down")
        handle: Handle[T] = Handle()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((fn, handle))
        self.last = handle
        return handle

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, handle = item
            try:
                handle.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the handle
                handle.set_error(exc)

    def close(self, timeout: float) -> None:
        """Stops after the queued work (which fails fast once the transport is closed); waits ``timeout`` s."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
