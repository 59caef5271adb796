"""A worker's side of a resize (:mod:`.resize`): the notice, the fence, and the new placement of its keys.

The coordinator's notice waits in a posted receive; the worker looks at it at the start of every parameter-server
call and while it waits for an answer (a pull may wait for a worker that stands at its fence). It then waits until
every push it made is answered, sends its fence (the clock it reached), and waits for the coordinator's answer:
the servers holding keys now, for which it plans its keys again (``replan``). A round the coordinator gives up on
(``retry``: some worker did not fence within the window) releases it; it fences again at its next call.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from paratrain.errors import CommTimeoutError
from paratrain.ps.membership import ServerSet
from paratrain.ps.protocol import RESIZE_TAG, PSRequestError
from paratrain.ps.routing import Router
from paratrain.transport.base import Handle
from paratrain.transport.wire import Message

__all__ = ["ResizeHandle", "Resizer"]

log = logging.getLogger("paratrain.ps.client")


class Resizer:
    """The resizes one worker takes part in; ``servers`` is the placement it uses now.

    Attributes:
        fences: each resize this worker fenced for: when it saw the notice (``time.time()``) and how long it
            paused (its pushes answered, then the chunks moved), in seconds.
    """

    def __init__(self, router: Router, servers: ServerSet, replan: Callable[[ServerSet], None]) -> None:
        self.router = router
        self.servers = servers
        self.coordinator = router.servers[0]
        self.fences: list[tuple[float, float]] = []
        self._replan = replan
        self._notice: Handle[Message] = router.transport.irecv(self.coordinator, RESIZE_TAG)
        self._pending: int | None = None  # the epoch of a notice seen and not yet fenced for
        self._seen = 0.0
        self._retry_at = -1  # the call in which the coordinator released this worker's fence
        self._busy = False

    def poll(self) -> None:
        """Fences for a resize whose notice came (unless released from a fence in this very call)."""
        if self._busy or self.router.closed:
            return
        if self._pending is None:
            if not self._notice.done():
                return
            epoch = self._notice.wait(0).meta.get("epoch")
            self._notice = self.router.transport.irecv(self.coordinator, RESIZE_TAG)
            if type(epoch) is not int or epoch <= self.servers.epoch:
                return
            self._pending, self._seen = epoch, time.time()
        if self._retry_at == self.router.calls:
            return  # the others may wait for this worker to return from this call (a collective)
        self._busy = True
        try:
            self._fence(self._pending)
        finally:
            self._busy = False

    def _fence(self, epoch: int) -> None:
        router, started = self.router, time.monotonic()
        for push in router.outstanding:  # every push applied: the donors' chunks hold it when they move
            with contextlib.suppress(Exception):  # its error is the push's caller's to see
                push.wait(router.timeout)
        router.outstanding.clear()
        meta = {"op": "resize_fence", "epoch": epoch, "clock": router.clock}
        handle, _ = router.request(self.coordinator, meta)
        try:
            answer = handle.wait(router.timeout)
        except CommTimeoutError:
            raise CommTimeoutError(
                f"worker {router.rank}: the resize of the servers did not complete within {router.timeout:g}s; is a "
                "worker or server stuck, or is the timeout too short?"
            ) from None
        error = answer.meta.get("error")
        if error is not None:
            raise PSRequestError(f"worker {router.rank}: resize: {error}")
        if answer.meta.get("retry"):
            self._retry_at = router.calls
            return
        active = answer.meta.get("active")
        if answer.meta.get("epoch") != epoch or not isinstance(active, list):
            raise PSRequestError(f"worker {router.rank}: a malformed answer to its resize fence: {answer.meta}")
        self.servers = ServerSet(self.servers.slots, tuple(int(s) for s in active), epoch)
        self._pending = None
        self._replan(self.servers)
        self.fences.append((self._seen, time.monotonic() - started))
        log.info("worker %d: the servers holding keys are now %s", router.rank, list(self.servers.active))

    def request(self, **change: int) -> ResizeHandle:
        """Asks the coordinator to add (``add=t``) or remove (``remove=t``) a server; the handle of its answer."""
        meta = {"op": "resize", "slots": self.servers.slots, "active": list(self.servers.active), **change}
        reply, coordinator = self.router.request(self.coordinator, meta)
        return ResizeHandle(self.router, reply, coordinator)


class ResizeHandle(Handle[dict[str, Any]]):
    """The handle of :meth:`~.client.KVStore.add_server` / ``remove_server``: its ``wait`` fences this worker for the
    resize meanwhile (the resize waits for every worker's fence, this one's too), then says what moved."""

    def __init__(self, router: Router, reply: Handle[Message], coordinator: int) -> None:
        super().__init__()
        self._router, self._reply, self._coordinator = router, reply, coordinator

    def done(self) -> bool:
        return super().done() or self._reply.done()

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """What moved; waits up to the KVStore's timeout (``timeout`` is not used: the resize has that one)."""
        if not super().done():
            try:
                answer = self._router.wait(self._reply, self._coordinator, "resize of the servers")
            except BaseException as exc:
                self.set_error(exc)
                raise
            fields = ("active", "chunks", "bytes", "seconds", "rounds")
            self.set_result({k: answer.meta[k] for k in fields if k in answer.meta})
        return super().wait(0)
