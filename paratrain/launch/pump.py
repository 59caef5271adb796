"""The output relay of a supervised job: the children's pipes copied to our streams, one whole line at a time.

A rank's output is only useful if it can be told apart from the others' and read whole: the relay prefixes
each line with its rank and never lets two lines interleave mid-line. It must also never stop the job: a
child writing undecodable bytes, never writing a newline, or writing to a closed terminal is relayed as well
as can be, and the child keeps running.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

__all__ = ["Pump", "Stream"]

# How long the output thread may block in ``select`` before it looks at its stop flag again.
_PUMP_POLL_S = 0.1
# Once asked to stop (a process outside the job still holds a pipe open), spend at most this long taking
# what is already buffered.
_DRAIN_BUDGET_S = 0.5
# A process that writes without ever writing a newline (progress bars redrawn with "\r") would otherwise
# make the supervisor buffer its output without bound; past this size the pending bytes go out as a line.
_MAX_PENDING = 1 << 16
_READ_SIZE = 1 << 16


@dataclass(slots=True, eq=False)
class Stream:
    """One pipe from a child, with the bytes read since its last newline."""

    fd: int
    prefix: str
    out: TextIO
    pending: bytearray


class Pump:
    """A thread that copies the children's pipes to the supervisor's streams, one whole line at a time.

    One thread with ``selectors`` serves all pipes, so the cost does not grow with the number of ranks.
    Lines are written whole, under one lock shared with the supervisor's own messages, so lines of
    different children (and of the supervisor) never interleave mid-line.
    """

    def __init__(self, streams: list[Stream], lock: threading.Lock, on_eof: Callable[[], None]) -> None:
        self._streams = streams
        self._lock = lock
        self._on_eof = on_eof
        self._stop = threading.Event()
        self._added: list[Stream] = []  # pipes of children started later (restarted ranks), not yet watched
        self._add_lock = threading.Lock()
        self._more = True  # more pipes may come: keep running even while none is open
        self._thread = threading.Thread(target=self._run, name="paratrain-launch-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, streams: list[Stream]) -> None:
        """Relays these pipes too (a child started after the others); picked up within ``_PUMP_POLL_S``."""
        with self._add_lock:
            self._added.extend(streams)
            self._streams.extend(streams)

    def finish(self, timeout: float) -> bool:
        """Waits for end-of-file on every pipe, then settles for what is already buffered.

        Returns:
            True if the thread has ended (so the pipes may be closed).
        """
        self._more = False
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout + _DRAIN_BUDGET_S)
        return not self._thread.is_alive()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            with self._add_lock:
                initial, self._added = list(self._streams), []
            for stream in initial:
                sel.register(stream.fd, selectors.EVENT_READ, stream)
            drain_deadline: float | None = None
            while True:
                with self._add_lock:
                    added, self._added = self._added, []
                for stream in added:
                    sel.register(stream.fd, selectors.EVENT_READ, stream)
                if not sel.get_map():
                    if not self._more or self._stop.is_set():
                        break
                    time.sleep(_PUMP_POLL_S)  # every pipe is closed, and a restarted child's may yet come
                    continue
                if self._stop.is_set():
                    # Asked to stop: take what is readable now, but do not chase a writer that never stops.
                    if drain_deadline is None:
                        drain_deadline = time.monotonic() + _DRAIN_BUDGET_S
                    events = sel.select(0)
                    if not events or time.monotonic() >= drain_deadline:
                        break
                else:
                    events = sel.select(_PUMP_POLL_S)
                for key, _ in events:
                    source: Stream = key.data
                    if not self._read(source):
                        sel.unregister(source.fd)
                        self._on_eof()
        finally:
            sel.close()
            for stream in self._streams:
                if stream.pending:
                    self._emit(stream, bytes(stream.pending))
                    stream.pending.clear()

    def _read(self, stream: Stream) -> bool:
        """Reads what is available on one pipe and writes out its complete lines; False at end-of-file."""
        try:
            data = os.read(stream.fd, _READ_SIZE)
        except OSError:
            data = b""
        if not data:
            if stream.pending:
                # A last line without a newline is still a line: the child's final words often are.
                self._emit(stream, bytes(stream.pending))
                stream.pending.clear()
            return False
        pending = stream.pending
        pending += data
        start = 0
        while (newline := pending.find(b"\n", start)) >= 0:
            self._emit(stream, bytes(pending[start : newline + 1]))
            start = newline + 1
        del pending[:start]
        if len(pending) >= _MAX_PENDING:
            self._emit(stream, bytes(pending))
            pending.clear()
        return True

    def _emit(self, stream: Stream, raw: bytes) -> None:
        # Decoding whole lines (split on b"\n") never cuts a UTF-8 sequence in two; invalid bytes from a
        # child must not kill the relay, hence errors="replace".
        text = raw.decode("utf-8", errors="replace")
        if not text.endswith("\n"):
            text += "\n"
        # A closed or broken terminal must not stop the relay: the children would then block on full
        # pipes. Their output is lost, but they keep running and can still be stopped.
        with self._lock, contextlib.suppress(OSError, ValueError):
            stream.out.write(stream.prefix + text)
            stream.out.flush()
