"""How one collective call runs, whatever it is: its tag, its order against the async calls, its agreement.

:class:`CollectiveCalls` is the base of :class:`~paratrain.collectives.api.Collectives`: every call's local checks
build a body ``body(tag)``, which :meth:`CollectiveCalls._run` runs in the calling thread or
:meth:`CollectiveCalls._submit` queues on the background thread, in tag order. A call whose checks fail still
joins its agreement as "invalid" (:meth:`CollectiveCalls._checked`), so that the other ranks fail at once and the
tags stay in step. The agreement goes through the shared-memory segment when every rank shares this host, else
over sockets (:func:`~paratrain.collectives.tree.agree`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from paratrain.collectives.algorithms import (
    DEFAULT_ALLREDUCE_ALGORITHMS,
    DEFAULT_BROADCAST_ALGORITHMS,
    AllreduceAlgorithm,
    BroadcastAlgorithm,
)
from paratrain.collectives.background import BackgroundWorker
from paratrain.collectives.policy import default_allreduce_choice, default_broadcast_choice
from paratrain.collectives.signature import INVALID, Signature, mismatch_error
from paratrain.collectives.tree import Exchange, agree
from paratrain.collectives.views import nbytes as nbytes_of
from paratrain.errors import CollectiveMismatchError, DeviceTimeoutError, ParatrainError
from paratrain.transport.base import Handle, Transport

if TYPE_CHECKING:
    from paratrain.collectives.routing import EngineRoutes
    from paratrain.collectives.shm import ShmAllreduce, ShmGroup
    from paratrain.timeline import Timeline

__all__ = ["CollectiveCalls"]

T = TypeVar("T")


def _socket_agree(ex: Exchange, sig: Signature, payload: npt.NDArray[Any] | None = None) -> list[Signature]:
    """Every rank's signature through :func:`agree`; raises the same ``CollectiveMismatchError`` on every rank."""
    sigs = [Signature.from_wire(wire, q) for q, wire in enumerate(agree(ex, sig.to_wire(), payload))]
    error = mismatch_error(sigs)
    if error is not None:
        raise error
    return sigs


class CollectiveCalls:
    """The machinery every collective call of one rank goes through; the calls themselves are its subclasses'.

    Args:
        transport: this rank's transport.
        next_tag: gives each collective call a fresh tag, the same on every rank (``Context.next_collective_tag``).
        timeout: default seconds a call may take before ``CommTimeoutError``.
    """

    #: the torch.distributed engines and the calls they take (:mod:`.routing`), set by the subclass
    _routes: EngineRoutes

    def __init__(self, *, transport: Transport, next_tag: Callable[[], int], timeout: float) -> None:
        self.transport = transport
        self.timeout = timeout
        self._next_tag = next_tag
        self._order = threading.Lock()
        self._worker = BackgroundWorker(f"paratrain-collectives-{transport.rank}")
        self.allreduce_algorithms: dict[str, AllreduceAlgorithm] = dict(DEFAULT_ALLREDUCE_ALGORITHMS)
        self.broadcast_algorithms: dict[str, BroadcastAlgorithm] = dict(DEFAULT_BROADCAST_ALGORITHMS)
        self.choose_allreduce: Callable[[int, int], str] = default_allreduce_choice
        self.choose_broadcast: Callable[[int, int], str] = default_broadcast_choice
        self._shm: ShmAllreduce | None = None
        #: where calls are recorded (``PARATRAIN_TIMELINE``; :mod:`paratrain.timeline`), or None
        self.timeline: Timeline | None = None

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.transport.world_size

    def _resolve(
        self, algorithm: str, registry: Mapping[str, Any], choose: Callable[[int, int], str], nbytes: int
    ) -> str:
        if algorithm == "auto":
            algorithm = choose(nbytes, self.world_size)
            if algorithm not in registry:
                raise ValueError(f"the auto policy chose {algorithm!r}, which is not registered")
            return algorithm
        if algorithm not in registry:
            choices = ", ".join(repr(a) for a in ("auto", *registry))
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {choices}")
        return algorithm

    def _run(self, body: Callable[[int], T], label: str = "collective", x: object = None) -> T:
        """Takes the call's tag and runs ``body(tag)`` in the calling thread (recorded on the timeline as
        ``label``, with ``x``'s bytes)."""
        with self._order:
            tag = self._next_tag()
        # calls complete in call order: a blocking call waits for the async calls issued before it (algorithms
        # outside the tag scheme, like shared memory, rely on every rank running calls in one order)
        self._worker.drain(self.timeout)
        timeline = self.timeline
        if timeline is None:
            return body(tag)
        start = time.time()
        try:
            return body(tag)
        finally:
            timeline.span(label, label.upper(), start, time.time(), bytes=nbytes_of(x))

    def _submit(self, body: Callable[[int], T], label: str = "collective", x: object = None) -> Handle[T]:
        """Takes the call's tag and queues ``body(tag)`` on the worker; tags and queue order agree. On the
        timeline: ``QUEUE`` until the worker starts it, then ``label``."""
        timeline = self.timeline
        queued, size = time.time(), nbytes_of(x) if timeline is not None else 0

        def timed(tag: int) -> T:
            if timeline is None:
                return body(tag)
            start = time.time()
            timeline.span(label, "QUEUE", queued, start)
            try:
                return body(tag)
            finally:
                timeline.span(label, label.upper(), start, time.time(), bytes=size)

        with self._order:
            tag = self._next_tag()
            return self._worker.submit(lambda: timed(tag))

    def _deadline(self, timeout: float | None) -> float:
        """The seconds a call with ``timeout`` may take (the collectives' default where None)."""
        return self.timeout if timeout is None else timeout

    def _exchange(self, tag: int, timeout: float | None, label: str) -> Exchange:
        return Exchange(self.transport, tag=tag, timeout=self._deadline(timeout), label=label)

    def _agree(self, ex: Exchange, sig: Signature, payload: npt.NDArray[Any] | None = None) -> list[Signature]:
        """Every rank's signature, by rank; the same ``CollectiveMismatchError`` on every rank if they differ.

        Through the shared-memory segment when it is enabled (every rank is on this host), else over sockets.
        A ``payload`` (every rank's array, in ``ex.gathered`` afterwards) rides on the socket rounds, after the
        agreement proper; through the segment, an integer one (the personalized calls' counts) is summed there
        instead, each rank's in its own row of zeros (exact for integers; 0.7 ms less per scatter of 4 KiB
        between 2 processes, whose sockets took two more round trips).
        """
        if self._shm is None:
            return _socket_agree(ex, sig, payload)
        sigs: list[Signature] = self._shm.agree(ex, sig)
        group = self._segment()
        if payload is not None and payload.dtype == np.int64 and payload.ndim == 1 and group is not None:
            rows = np.zeros((self.world_size, payload.size), dtype=np.int64)
            rows[self.transport.rank] = payload
            group.allreduce_(rows, "sum", timeout=max(ex.left(), 0.001))
            ex.gathered = list(rows)
        elif payload is not None:
            agree(ex, sig.to_wire(), payload)
        return sigs

    def _segment(self) -> ShmGroup | None:
        """The host's shared-memory group once an agreement created it (every rank on this host), else None."""
        return self._shm.group if self._shm is not None else None

    def _checked(
        self, prepare: Callable[[], Callable[[int], T]], timeout: float | None, mode: str = ""
    ) -> Callable[[int], T]:
        """``prepare()``: the call's local checks, which return its body. When they raise ``ValueError`` or
        ``TypeError`` with several ranks, this rank first takes the call's tag and joins its agreement as
        "invalid" (the others raise ``CollectiveMismatchError`` at once instead of waiting for it until their
        timeout, and every rank's tags stay in step), then raises the error. Blocks for that round, which runs on
        the background thread instead for ``mode="snapshot"`` (the async calls)."""
        try:
            return prepare()
        except (ValueError, TypeError, DeviceTimeoutError):
            if self.world_size > 1:

                def reject(tag: int) -> None:
                    self._reject(tag, timeout)

                if mode == "snapshot":
                    self._submit(reject)
                else:
                    with suppress(ParatrainError):  # the caller's own error, raised next, says more
                        self._run(reject)
            raise

    def _reject(self, tag: int, timeout: float | None) -> None:
        """Joins call ``tag``'s agreement as "invalid": the other ranks raise ``CollectiveMismatchError`` at once."""
        if self.world_size > 1:
            with self._exchange(tag, timeout, "a rejected call") as ex, suppress(CollectiveMismatchError):
                self._agree(ex, INVALID)  # raises the mismatch it causes, which is no news here

    def _agree_tagged(self, tag: int, sig: Signature, timeout: float | None, label: str) -> list[Signature]:
        """The agreement of one call on its own (an engine's call: the data moves elsewhere afterwards)."""
        if self.world_size == 1:
            return [sig]
        with self._exchange(tag, timeout, label) as ex:
            return self._agree(ex, sig)
