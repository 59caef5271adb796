"""The bookkeeping of one collective call over a transport: its tag, its deadline, its receives and sends.

Every wait takes what is left of one time budget, so a call never blocks longer than its timeout; the
receives it posted are withdrawn if the call fails (so they cannot swallow later messages); the sends still
reading its buffers are waited for before the caller may write them. The executors (:mod:`.execute`, the
agreement, the shared-memory path) all talk through one of these.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.collectives.signature import Signature
from paratrain.errors import CommTimeoutError, MessageError
from paratrain.transport.base import Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["Exchange"]


class Exchange:
    """The messages of one collective call: one tag, one deadline, its posted receives and pending sends.

    Use it as a context manager: if the body raises, receives still posted are withdrawn (a later message must
    not complete a receive nobody waits for). ``finish()`` waits until the transport no longer uses any buffer
    this call sent from, so the caller may modify them. Not thread-safe: one call, one thread.

    Args:
        transport: the transport to use.
        tag: the call's tag (fresh for each call, the same on every rank).
        timeout: seconds the whole call may take.
        label: what to call the operation in error messages, e.g. ``"allreduce (ring)"``.

    Example:
        >>> from paratrain.transport.inproc import InprocFabric
        >>> t = InprocFabric(1).transport(0)
        >>> with Exchange(t, tag=5, timeout=1.0, label="demo") as ex:
        ...     _ = ex.send(0, [np.arange(3)])
        ...     ex.recv_array(ex.post(0), 0, 3, np.dtype(np.int64))
        ...     ex.finish()
        array([0, 1, 2])
    """

    __slots__ = (
        "_posted",
        "_sends",
        "deadline",
        "gathered",
        "label",
        "rank",
        "signature",
        "tag",
        "timeout",
        "transport",
        "world_size",
    )

    def __init__(self, transport: Transport, *, tag: int, timeout: float, label: str) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.tag = tag
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.label = label
        self._posted: dict[Handle[Message], int] = {}
        self._sends: list[Handle[None]] = []
        #: Payloads the agreement carried, by rank (see :func:`agree`); None if it carried none.
        self.gathered: list[npt.NDArray[Any] | None] | None = None
        #: The call's signature, for an algorithm that runs the agreement itself (``AllreduceAlgorithm.agreement``
        #: False, like the shared-memory one); None otherwise.
        self.signature: Signature | None = None

    def left(self) -> float:
        """Seconds left of the call's time budget (never negative)."""
        return max(0.0, self.deadline - time.monotonic())

    def post(self, src: int) -> Handle[Message]:
        """Posts a receive from ``src`` with the call's tag. Does not block."""
        handle = self.transport.irecv(src, self.tag)
        self._posted[handle] = src
        return handle

    def recv(self, handle: Handle[Message]) -> Message:
        """Waits for a posted receive, within the deadline.

        Raises:
            CommTimeoutError: nothing arrived before the deadline (the receive is withdrawn).
            PeerLostError: the sender is gone.
        """
        src = self._posted.pop(handle)
        try:
            return handle.wait(self.left())
        except CommTimeoutError:
            if self.transport.cancel_recv(handle):
                raise CommTimeoutError(
                    f"rank {self.rank}: {self.label} not complete after {self.timeout:g}s: nothing from rank "
                    f"{src}; is that rank alive and calling the same collective in the same order? (if it is "
                    "only slow, raise the timeout)"
                ) from None
            return handle.wait(0)

    def recv_array(self, handle: Handle[Message], src: int, size: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """Waits for a posted receive carrying one flat array of ``size`` items of ``dtype``; returns it (read-only).

        Raises:
            MessageError: the message carries something else (a bug or a corrupted peer, never a user error:
                the agreement has checked shapes and dtypes already).
        """
        msg = self.recv(handle)
        if len(msg.arrays) != 1 or msg.arrays[0].shape != (size,) or msg.arrays[0].dtype != dtype:
            got = [(a.shape, str(a.dtype)) for a in msg.arrays]
            raise MessageError(
                f"rank {self.rank}: {self.label}: rank {src} sent {got} where ({size},) {dtype} was expected"
            )
        return msg.arrays[0]

    def send(self, dst: int, arrays: Sequence[Any], meta: Mapping[str, Any] | None = None) -> Handle[None]:
        """Starts a send to ``dst``; the returned handle completes when its buffers may be modified."""
        handle = self.transport.isend(dst, self.tag, arrays, meta)
        if not handle.done() or handle.exception() is not None:
            self._sends.append(handle)
        return handle

    def wait_sent(self, handle: Handle[None]) -> None:
        """Blocks, within the deadline, until a send's buffers may be modified."""
        handle.wait(self.left())

    def finish(self) -> None:
        """Waits, within the deadline, until every send of this call released its buffers."""
        for handle in self._sends:
            handle.wait(self.left())
        self._sends.clear()

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            for handle in list(self._posted):
                self.transport.cancel_recv(handle)
            self._posted.clear()
