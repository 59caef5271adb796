"""Which collective calls a torch.distributed engine carries, and their bodies (:class:`EngineRoutes`).

:class:`~paratrain.collectives.api.Collectives` asks its routes, for every call on a torch tensor, whether an
engine (:mod:`.torch_engines`) takes it; if so, the body built here replaces step 4 of the API's protocol (the
agreement of step 3 still runs first, with the engine's name as the resolved algorithm). Kept apart from the API
so that the API's module stays the protocol, and the engines' life cycle (the collective choice for CUDA
tensors, made once at the first collective on one; the process groups; closing) lives in one place.

Which device's tensors take which engine: ``engines`` maps a device type (``"cuda"``, ``"cpu"``) to its engine;
an entry appears by :meth:`EngineRoutes.use` (a user's choice, e.g. Gloo for CPU tensors) or by the automatic
choice for CUDA tensors (:func:`~.engine.choose_engine` over every rank's
:class:`~.engine.DeviceIdentity`, ``PARATRAIN_CUDA_COLLECTIVES``). A call goes to the engine when its tensor is on
that device type, its dtype and op are ones the engine reduces, and its ``algorithm`` is ``"auto"`` or the engine's
name; every rank decides alike, since the engines are opened collectively.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from paratrain._arrays import is_torch_tensor
from paratrain.collectives.plans import chunk_bounds
from paratrain.collectives.signature import Signature
from paratrain.collectives.torch_engines import (
    DeviceIdentity,
    EngineChoice,
    TorchEngine,
    choose_engine,
    gpu_name,
    own_address,
)
from paratrain.device import on_device
from paratrain.errors import ConfigError
from paratrain.transport.base import Transport

__all__ = ["EngineRoutes"]

log = logging.getLogger("paratrain.collectives")

#: ``agree(tag, signature, timeout, label)``: every rank's signature, or the same error on every rank
Agree = Callable[[int, Signature, "float | None", str], list[Signature]]
Body = Callable[[int], Any]


class EngineRoutes:
    """The torch.distributed engines of one :class:`~paratrain.collectives.api.Collectives` and its calls' bodies.

    Args:
        transport: the collectives' transport (rank, world size, the address rank 0's store listens on).
        timeout: the collectives' default timeout.
        host: this rank's host id, if known (a GPU's name where torch reports no UUID).
        allgather: the collectives' allgather (the identity and rendezvous exchanges ride on it).
        agree: the collectives' agreement for one tagged call.
    """

    def __init__(
        self,
        *,
        transport: Transport,
        timeout: float,
        host: str | None,
        allgather: Callable[..., Any],
        agree: Agree,
    ) -> None:
        self.transport = transport
        self.timeout = timeout
        self.host = host
        self._allgather = allgather
        self._agree = agree
        #: engines by device type ("cuda", "cpu"): tensors there go through them
        self.engines: dict[str, TorchEngine] = {}
        self._cuda_choice: EngineChoice | ConfigError | None = None  # decided at the first CUDA collective
        self._lock = threading.Lock()

    # -- which engine

    def use(self, backend: str, device_type: str | None, timeout: float | None) -> TorchEngine:
        """Opens an engine of ``backend`` for tensors of ``device_type``, collectively, and sends those tensors'
        collectives through it (see :meth:`Collectives.use_torch_distributed`)."""
        engine = self.open(backend, device_type, timeout)
        old = self.engines.pop(engine.device_type, None)
        if old is not None:
            old.close()
        self.engines[engine.device_type] = engine
        return engine

    def open(self, backend: str, device_type: str | None, timeout: float | None) -> TorchEngine:
        """Opens an engine of ``backend`` for tensors of ``device_type``, collectively, for its caller alone."""
        kind = device_type or ("cuda" if backend == "nccl" else "cpu")

        def gather(record: bytes) -> list[bytes]:
            row = np.zeros((1, 256), dtype=np.uint8)
            row[0, : len(record)] = np.frombuffer(record[:256], dtype=np.uint8)
            return [bytes(r).rstrip(b"\0") for r in self._allgather(row, timeout=timeout)]

        return TorchEngine.connect(
            backend=backend,
            device_type=kind,
            rank=self.transport.rank,
            world_size=self.transport.world_size,
            address=own_address(self.transport),
            gather=gather,
            timeout=self.timeout if timeout is None else timeout,
        )

    def device_engine(self, device: Any) -> TorchEngine | None:
        """The engine of torch device ``device``'s tensors, or None (see :meth:`Collectives.device_engine`)."""
        if device.type == "cuda":
            with self._lock:
                if self._cuda_choice is None:
                    self._choose_cuda_engine(device)
            if isinstance(self._cuda_choice, ConfigError):
                raise self._cuda_choice
        return self.engines.get(device.type)

    def _choose_cuda_engine(self, device: Any) -> None:
        import torch.distributed as dist

        preference = os.environ.get("PARATRAIN_CUDA_COLLECTIVES", "auto").strip().lower() or "auto"
        nccl = bool(dist.is_available() and dist.is_nccl_available())
        mine = DeviceIdentity(gpu_name(device, self.host), nccl, preference)
        rows = self._allgather(mine.encode().reshape(1, -1))
        try:
            choice = choose_engine([DeviceIdentity.decode(row) for row in rows])
        except ValueError as exc:  # ConfigError is one; a malformed identity (a peer's bytes) another
            error = exc if isinstance(exc, ConfigError) else ConfigError(f"a rank's device identity: {exc}")
            self._cuda_choice = error
            raise error from None
        if self.transport.rank == 0:
            log.info("collectives on CUDA tensors: %s (%s)", choice.backend or "staged", choice.reason)
        if choice.backend is not None:
            self.use(choice.backend, "cuda", None)
        self._cuda_choice = choice

    def route(self, x: Any) -> None:
        """Makes the CUDA engine choice at the first collective on a CUDA tensor (before that call's own tag)."""
        if not isinstance(self._cuda_choice, EngineChoice) and on_device(x) and x.device.type == "cuda":
            self.device_engine(x.device)

    def engine_for(self, x: Any, kind: str, algorithm: str = "auto", op: str | None = None) -> TorchEngine | None:
        """The engine that takes this call of collective ``kind``, or None (paratrain's own algorithms)."""
        if not self.engines or not is_torch_tensor(x):
            return None
        engine = self.engines.get(x.device.type)
        if engine is None or algorithm not in ("auto", engine.name) or not engine.takes(x, kind, op):
            return None
        return engine

    # -- the calls' bodies

    def _start(self, engine: TorchEngine, x: Any, *, copy: bool) -> Any:
        """The tensor the call works on: ``x`` itself, or a contiguous copy taken now (before the caller may change
        ``x``), and an event behind the caller's stream."""
        import torch

        t = x.detach()
        work = t if not copy and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
        return work, engine.mark(work)

    def _seconds(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def allreduce(self, x: Any, op: str, algorithm: str, timeout: float | None, *, mode: str) -> Body | None:
        """The body of an allreduce (``mode``: ``copy``, ``snapshot``, ``in_place``) on the engine, or None."""
        engine = self.engine_for(x, "allreduce", algorithm, op)
        if engine is None:
            return None
        sig = Signature("allreduce", op, _dtype(x), tuple(x.shape), algorithm, engine.name)
        work, after = self._start(engine, x, copy=mode != "in_place")

        def body(tag: int) -> Any:
            self._agree(tag, sig, timeout, f"allreduce ({engine.name})")
            engine.allreduce_(work, op, self._seconds(timeout), after)
            if mode != "in_place":
                return work
            if work.data_ptr() != x.data_ptr():
                x.detach().copy_(work)
            return x

        return body

    def broadcast(self, x: Any, root: int, algorithm: str, timeout: float | None) -> Body | None:
        """The body of a broadcast from ``root`` on the engine, or None."""
        engine = self.engine_for(x, "broadcast", algorithm)
        if engine is None:
            return None
        sig = Signature("broadcast", None, _dtype(x), tuple(x.shape), algorithm, engine.name, root)
        work, after = self._start(engine, x, copy=True)

        def body(tag: int) -> Any:
            self._agree(tag, sig, timeout, f"broadcast ({engine.name})")
            engine.broadcast_(work, root, self._seconds(timeout), after)
            return work

        return body

    def allgather(self, x: Any, timeout: float | None, *, copy: bool) -> Body | None:
        """The body of an allgather on the engine, or None."""
        engine = self.engine_for(x, "allgather")
        if engine is None:
            return None
        sig = Signature("allgather", None, _dtype(x), tuple(x.shape), "ring", engine.name)
        work, after = self._start(engine, x, copy=copy)

        def body(tag: int) -> Any:
            sigs = self._agree(tag, sig, timeout, f"allgather ({engine.name})")
            rows = [s.shape[0] if s.shape else 1 for s in sigs]
            return engine.allgather(work, rows, self._seconds(timeout), after)

        return body

    def reduce_scatter(self, x: Any, op: str, timeout: float | None) -> Body | None:
        """The body of a reduce_scatter on the engine, or None (0-d tensors: paratrain's path raises)."""
        engine = self.engine_for(x, "reduce_scatter", op=op)
        if engine is None or x.dim() == 0:
            return None
        sig = Signature("reduce_scatter", op, _dtype(x), tuple(x.shape), "ring", engine.name)
        work, _ = self._start(engine, x, copy=False)
        parts: Sequence[tuple[int, int]] = chunk_bounds(x.shape[0], self.transport.world_size)

        def body(tag: int) -> Any:
            self._agree(tag, sig, timeout, f"reduce_scatter ({engine.name})")
            return engine.reduce_scatter(work, op, parts, self._seconds(timeout))

        return body

    def close(self) -> None:
        """Closes every engine."""
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


def _dtype(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")
