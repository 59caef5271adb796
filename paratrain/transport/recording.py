"""A transport wrapper that records every message sent through it: how tests prove a run sent its plan.

The plan IR (:mod:`paratrain.plan.ir`) promises that an executor sends exactly its plan's messages. Wrap a
rank's transport in a :class:`RecordingTransport`, run the collective, and compare :attr:`sent` with
``plan.sends(rank)``: same peers, same sizes, same order. Recording costs a lock and a list append per send,
so it also serves as a cheap message counter outside tests.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paratrain.plan.ir import Message as PlannedMessage
from paratrain.transport.base import Handle, Transport, TransportWrapper

__all__ = ["RecordingTransport"]


def _nbytes(array: Any) -> int:
    """Bytes of a numpy array or a torch tensor (without importing torch)."""
    if hasattr(array, "element_size"):
        return int(array.numel() * array.element_size())
    return int(np.asarray(array).nbytes)


class RecordingTransport(TransportWrapper):
    """Forwards everything to ``inner`` and records each send as ``(src, dst, tag, nbytes)``.

    ``nbytes`` counts the arrays' bytes (not the header, which carries metadata such as the agreement's
    signatures), which is what plans count. Thread-safe as far as ``inner`` is.

    Example:
        >>> from paratrain.transport.inproc import InprocFabric
        >>> fabric = InprocFabric(2)
        >>> a, b = RecordingTransport(fabric.transport(0)), fabric.transport(1)
        >>> a.send(1, tag=7, arrays=[np.zeros(3, np.float32)])
        >>> _ = b.recv(0, 7)
        >>> a.sent
        [Message(src=0, dst=1, tag=7, nbytes=12)]
    """

    name = "recording"

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        #: Every message sent so far, in send order (the tag as given, not relative to a call).
        self.sent: list[PlannedMessage] = []

    def isend(
        self, dst: int, tag: int, arrays: Sequence[Any] = (), meta: Mapping[str, Any] | None = None
    ) -> Handle[None]:
        """Records, then forwards."""
        nbytes = sum(_nbytes(a) for a in arrays)
        with self._lock:
            self.sent.append(PlannedMessage(self.rank, dst, tag, nbytes))
        return self.inner.isend(dst, tag, arrays, meta)

    def take(self) -> list[PlannedMessage]:
        """The messages recorded so far, clearing the record."""
        with self._lock:
            sent, self.sent = self.sent, []
        return sent

    def close(self) -> None:
        """A wrapper owns nothing: closing it leaves ``inner`` open."""

    def abort(self, reason: BaseException | None = None) -> None:
        """A wrapper owns nothing: aborting it leaves ``inner`` alone."""
