"""A wake-up for the supervision loop that signal handlers and other threads may trigger safely.

Why a pipe and not a ``threading.Event``: a signal handler runs on the main thread between two bytecodes,
possibly while that same thread holds the Event's internal lock, and would deadlock on it. A non-blocking
write to a pipe cannot: it takes no lock, and a full pipe only means a wake-up is already pending.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading

__all__ = ["WakePipe"]


class WakePipe:
    """A self-pipe: ``wait()`` sleeps until ``poke()`` or a timeout.

    Not thread-safe in general: one thread waits; signal handlers call :meth:`poke`, other threads
    :meth:`poke_from_thread`. Open it with :meth:`open`, and :meth:`close` it when the loop is done.

    Example:
        >>> wake = WakePipe()
        >>> wake.open()
        >>> wake.poke()
        >>> wake.wait(10.0)  # returns at once: a poke is pending
        >>> wake.close()
    """

    def __init__(self) -> None:
        self._r = -1
        self._w = -1
        self._lock = threading.Lock()  # so another thread never writes to a closed (reused) fd

    def open(self) -> None:
        """Creates the pipe; pokes before this are lost."""
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def poke(self) -> None:
        """Wakes the waiter; safe in a signal handler (one non-blocking write, no locks)."""
        w = self._w
        if w >= 0:
            # BlockingIOError: the pipe is full, so a wake-up is already pending.
            with contextlib.suppress(OSError):
                os.write(w, b"\0")

    def poke_from_thread(self) -> None:
        """Wakes the waiter from another thread, never racing with :meth:`close`."""
        with self._lock:
            self.poke()

    def wait(self, timeout: float) -> None:
        """Sleeps until poked or until ``timeout`` seconds have passed; takes every pending poke."""
        if timeout <= 0:
            return
        readable, _, _ = select.select([self._r], [], [], timeout)
        if readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._r, 512):
                    pass

    def close(self) -> None:
        """Closes the pipe; later pokes do nothing."""
        with self._lock:
            for fd in (self._r, self._w):
                if fd >= 0:
                    os.close(fd)
            self._r = self._w = -1
