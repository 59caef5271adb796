"""Collectives through torch.distributed's own engines (NCCL for CUDA tensors, Gloo), inside paratrain's contract.

Why: where every rank has a GPU of its own, NCCL moves gradients device to device (NVLink, PCIe peer to peer,
InfiniBand with GPUDirect) with kernels tuned per topology; staging them through pinned host memory and
paratrain's sockets costs two PCIe copies and the host network on top. That is what Horovod and BytePS do inside
a machine, and what DDP does everywhere. So an allreduce-family call on a tensor of the engine's device goes to a
torch.distributed process group instead of paratrain's own algorithms; everything around the data movement stays
paratrain's:

* the call still agrees first (:mod:`.signature`, with the engine's name as the algorithm), so ranks that pass
  different shapes, dtypes or ops, or a CUDA tensor on one rank and a CPU tensor on another, raise the same
  ``CollectiveMismatchError`` before data moves instead of hanging inside NCCL;
* every call waits with the call's timeout, and a failure inside the engine becomes a paratrain error naming the
  engine, after which the engine refuses further calls (a broken communicator cannot be trusted);
* the reductions mean what paratrain's mean: ``"mean"`` is the sum divided by the world size after the engine
  summed (floor division for integer dtypes), so results equal paratrain's own paths bit for bit wherever the
  summation order cannot differ (two ranks, or integer-valued data);
* results are complete when the call, or an async handle's ``wait()``, returns: on CUDA the engine's work is
  ordered after the caller's current stream (an event recorded when the call takes the tensor) and waited for by
  an event behind it, never by synchronising the device.

The backend is a parameter and nothing else differs between backends, so CPU CI runs this module's whole path
with Gloo on CPU tensors (``Collectives.use_torch_distributed("gloo")``); only NCCL's constructor needs a GPU.

Which engine CUDA tensors get is :func:`choose_engine`'s pure decision over every rank's
:class:`DeviceIdentity`, made once, collectively, at the first collective on a CUDA tensor (:class:`Collectives`
does it): ``PARATRAIN_CUDA_COLLECTIVES=auto`` (default) takes NCCL when it is available on every rank and no two
ranks share a GPU (NCCL refuses two ranks on one device), and stays with staging otherwise; ``nccl`` insists
(an error on every rank where it cannot be had), ``gloo`` takes torch's Gloo (which stages CUDA tensors itself:
the anchor DDP-over-Gloo users know), ``staged`` keeps paratrain's own staged algorithms. The decision and its
reason are logged (logger ``paratrain.collectives``, INFO).

Which calls go to an engine lives in :mod:`.routing`.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from paratrain._arrays import is_torch_tensor
from paratrain.device.events import wait_event
from paratrain.errors import CommTimeoutError, ConfigError, TransportError
from paratrain.transport.base import Transport

__all__ = [
    "BACKENDS",
    "ENGINE_DTYPES",
    "PREFERENCES",
    "DeviceIdentity",
    "EngineChoice",
    "Sent",
    "TorchEngine",
    "choose_engine",
    "choose_link",
    "gpu_name",
    "own_address",
]

log = logging.getLogger("paratrain.collectives")

#: torch.distributed backends paratrain drives
BACKENDS: tuple[str, ...] = ("nccl", "gloo")
#: values of ``PARATRAIN_CUDA_COLLECTIVES``
PREFERENCES: tuple[str, ...] = ("auto", "nccl", "gloo", "staged")
#: dtypes the engines take (NCCL has no int16 nor bool; complex and bool stay on paratrain's paths)
ENGINE_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
_OPS = ("sum", "mean", "max", "min")
_IDENTITY_BYTES = 256


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """What one rank tells the others before the CUDA engine is chosen.

    Attributes:
        device: a name unique to the physical GPU (its UUID where torch reports one, else host and index).
        nccl: torch.distributed has NCCL on this rank.
        preference: this rank's ``PARATRAIN_CUDA_COLLECTIVES``.
    """

    device: str
    nccl: bool
    preference: str

    def encode(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Fixed-size bytes (JSON, zero-padded) for the identity allgather; never pickled."""
        raw = json.dumps({"device": self.device, "nccl": self.nccl, "preference": self.preference}).encode()
        if len(raw) > _IDENTITY_BYTES:
            raise ValueError(f"device identity too long ({len(raw)} bytes)")
        out = np.zeros(_IDENTITY_BYTES, dtype=np.uint8)
        out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return out

    @classmethod
    def decode(cls, row: np.ndarray[Any, Any]) -> DeviceIdentity:
        """The inverse of :meth:`encode`; anything malformed raises ``ValueError`` (a peer's bytes)."""
        raw = bytes(np.asarray(row, dtype=np.uint8)).rstrip(b"\0")
        fields = json.loads(raw.decode())
        if not isinstance(fields, dict):
            raise ValueError("a device identity is a JSON object")
        device, nccl, preference = fields.get("device"), fields.get("nccl"), fields.get("preference")
        if not isinstance(device, str) or not isinstance(nccl, bool) or not isinstance(preference, str):
            raise ValueError(f"malformed device identity {fields!r}")
        return cls(device, nccl, preference)


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """:func:`choose_engine`'s answer: ``backend`` (``"nccl"``, ``"gloo"``) or None for staging, and why."""

    backend: str | None
    reason: str


def choose_engine(identities: Sequence[DeviceIdentity]) -> EngineChoice:
    """Which engine carries CUDA tensors' collectives, from every rank's identity (rank order).

    Pure and computed from the same list on every rank, so every rank decides alike (and raises alike).

    Raises:
        ConfigError: ranks disagree on ``PARATRAIN_CUDA_COLLECTIVES``, one is unknown, or ``nccl`` was asked for
            where it cannot run.

    Example:
        >>> ids = [DeviceIdentity("GPU-a", True, "auto"), DeviceIdentity("GPU-b", True, "auto")]
        >>> choose_engine(ids).backend
        'nccl'
        >>> choose_engine([DeviceIdentity("GPU-a", True, "auto")] * 2).backend is None
        True
    """
    preferences = sorted({i.preference for i in identities})
    if len(preferences) != 1:
        raise ConfigError(
            f"ranks set PARATRAIN_CUDA_COLLECTIVES differently ({', '.join(preferences)}); set it alike on every rank"
        )
    preference = preferences[0]
    if preference not in PREFERENCES:
        raise ConfigError(f"PARATRAIN_CUDA_COLLECTIVES={preference!r}; choose one of {', '.join(PREFERENCES)}")
    if preference == "staged":
        return EngineChoice(None, "PARATRAIN_CUDA_COLLECTIVES=staged")
    if preference == "gloo":
        return EngineChoice("gloo", "PARATRAIN_CUDA_COLLECTIVES=gloo")
    without = [r for r, i in enumerate(identities) if not i.nccl]
    owners: dict[str, int] = {}
    shared: list[tuple[int, int, str]] = []
    for r, i in enumerate(identities):
        if i.device in owners:
            shared.append((owners[i.device], r, i.device))
        owners.setdefault(i.device, r)
    problem = ""
    if without:
        problem = f"torch.distributed has no NCCL on rank(s) {', '.join(map(str, without))}"
    elif shared:
        a, b, device = shared[0]
        problem = f"ranks {a} and {b} share GPU {device} (NCCL needs one GPU per rank)"
    if not problem:
        return EngineChoice("nccl", f"every one of {len(identities)} rank(s) has a GPU of its own and NCCL")
    if preference == "nccl":
        raise ConfigError(
            f"PARATRAIN_CUDA_COLLECTIVES=nccl, but {problem}; give each rank its own GPU "
            "(torch.cuda.set_device(ctx.local_rank)) or unset it to stage through host memory"
        )
    return EngineChoice(None, f"staging through pinned host memory: {problem}")


def choose_link(identities: Sequence[DeviceIdentity]) -> EngineChoice:
    """How pipeline stages pass activations and gradients to each other, from every stage's identity (a CPU
    stage's device name starts with ``cpu:``): NCCL, device to device, where every stage is on a GPU of its own;
    Gloo where asked for (CPU stages only: Gloo's GPU support has no send and receive); else None, paratrain's
    transport through host memory. Pure; every stage decides alike.

    Raises:
        ConfigError: as :func:`choose_engine`, and Gloo asked for with a stage on a GPU.

    Example:
        >>> choose_link([DeviceIdentity("cpu:0", False, "auto"), DeviceIdentity("GPU-b", True, "auto")])
        EngineChoice(backend=None, reason='stage(s) 0 on the CPU: through host memory')
    """
    on_cpu = [r for r, i in enumerate(identities) if i.device.startswith("cpu:")]
    preferences = {i.preference for i in identities}
    if on_cpu and preferences == {"auto"}:
        return EngineChoice(None, f"stage(s) {', '.join(map(str, on_cpu))} on the CPU: through host memory")
    choice = choose_engine(identities)
    if choice.backend == "gloo" and len(on_cpu) < len(identities):
        raise ConfigError("p2p='gloo' sends CPU tensors only (Gloo's GPU support has no send); use 'nccl' or 'staged'")
    return choice


def gpu_name(device: Any, host: str | None = None) -> str:
    """A name unique to the physical GPU behind torch device ``device``: its UUID where torch reports one (two
    processes given the same GPU under different indices still match), else host and index."""
    import socket

    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    found = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if found is not None:
        return f"GPU-{found}"
    return f"{host or socket.gethostname()}:cuda:{index}"


def own_address(transport: Transport) -> str:
    """The IP address this rank advertises to the others (its ZeroMQ TCP endpoint's), or loopback.

    Unwraps group views and the fault injector (``inner``) to reach the transport that bound a socket.
    """
    seen: Transport | None = transport
    while seen is not None:
        endpoints = getattr(seen, "endpoints", None)
        if callable(endpoints):
            tcp = str(endpoints().get("tcp", ""))
            if tcp.startswith("tcp://"):
                host = tcp[len("tcp://") :].rsplit(":", 1)[0]
                return host.strip("[]")
        seen = getattr(seen, "inner", None)
    return "127.0.0.1"


class TorchEngine:
    """One torch.distributed process group over the ranks of one :class:`~paratrain.collectives.api.Collectives`.

    Built collectively by :meth:`connect` (rank 0 opens a ``TCPStore`` on its advertised address; every rank
    learns where through paratrain's own allgather). Methods run after paratrain's agreement, on tensors of
    ``device_type``; each waits for its work with the call's timeout.
    """

    def __init__(self, backend: str, device_type: str, group: Any, store: Any, *, rank: int, world_size: int) -> None:
        self.name = backend
        self.device_type = device_type
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._store = store  # rank 0's TCPStore serves the group's rendezvous for as long as the group lives
        #: work items handed to the process group (a call on an empty tensor hands none)
        self.calls = 0
        self._broken: str | None = None
        self._lock = threading.Lock()  # one call at a time on the group: the blocking and the async thread

    # -- construction

    @classmethod
    def connect(
        cls,
        *,
        backend: str,
        device_type: str,
        rank: int,
        world_size: int,
        address: str,
        gather: Callable[[bytes], list[bytes]],
        timeout: float,
    ) -> TorchEngine:
        """Opens the process group, collectively.

        ``gather(record) -> every rank's record``: a paratrain allgather. Every rank's arguments travel in it
        and are checked by every rank, so a rank asking for another backend (or an unknown one) is the same
        ``ConfigError`` on every rank instead of a rank left waiting for the store. Rank 0 opens the
        ``TCPStore`` on its advertised address before, and its record says where.
        """
        dist = _dist()

        delta = datetime.timedelta(seconds=timeout)
        master = None
        where = ""
        if rank == 0:
            master = dist.TCPStore(address, 0, world_size, True, timeout=delta, wait_for_workers=False)
            where = f"{address}:{master.port}:{uuid.uuid4().hex}"
        mine = json.dumps({"backend": backend, "device_type": device_type, "where": where}).encode()
        records = [json.loads(r.decode()) for r in gather(mine)]
        asked = sorted({f"{r.get('backend')!r} for {r.get('device_type')!r} tensors" for r in records})
        if len(asked) != 1:
            raise ConfigError(f"ranks asked for different torch.distributed engines ({'; '.join(asked)})")
        if backend not in BACKENDS:
            raise ConfigError(f"unknown torch.distributed backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if device_type not in ("cpu", "cuda") or (backend == "nccl" and device_type != "cuda"):
            raise ConfigError(f"{backend} does not take {device_type!r} tensors (NCCL: 'cuda'; Gloo: 'cpu', 'cuda')")
        host, port, nonce = str(records[0]["where"]).rsplit(":", 2)
        store = master or dist.TCPStore(host, int(port), world_size, False, timeout=delta)
        prefixed = dist.PrefixStore(f"paratrain/{backend}/{nonce}/", store)
        if backend == "gloo":
            gloo = dist.ProcessGroupGloo
            options = gloo._Options()
            options._timeout = delta
            options._devices = [gloo.create_device(hostname=address)]
            group = gloo(prefixed, rank, world_size, options)
        else:
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None or not dist.is_nccl_available():
                raise ConfigError("this torch build has no NCCL; set PARATRAIN_CUDA_COLLECTIVES=staged or gloo")
            options = nccl.Options()
            options._timeout = delta
            group = nccl(prefixed, rank, world_size, options)
        log.info("rank %d: %s process group of %d rank(s) for %s tensors", rank, backend, world_size, device_type)
        return cls(backend, device_type, group, store, rank=rank, world_size=world_size)

    # -- what it takes

    def takes(self, x: object, kind: str, op: str | None = None) -> bool:
        """``x`` is a torch tensor on this engine's device type, of a dtype (and ``op``) the engine reduces, for a
        collective ``kind`` it runs there (Gloo runs only allreduce and broadcast on CUDA tensors)."""
        if not is_torch_tensor(x):
            return False
        t: Any = x
        if t.device.type != self.device_type or str(t.dtype).removeprefix("torch.") not in ENGINE_DTYPES:
            return False
        if self.name == "gloo" and self.device_type == "cuda" and kind not in ("allreduce", "broadcast"):
            return False
        return op is None or op in _OPS

    def mark(self, t: Any) -> Any:
        """An event behind the caller's current stream (CUDA), so that work run later on another thread starts
        after the kernels that produced ``t``; None elsewhere."""
        if t.device.type != "cuda":
            return None
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(t.device))
        return event

    # -- the calls

    def allreduce_(self, t: Any, op: str, timeout: float, after: Any = None) -> None:
        """Reduces contiguous ``t`` in place over the group (``mean``: the sum, then divided)."""
        dist = _dist()

        options = dist.AllreduceOptions()
        options.reduceOp = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM}.get(op) or getattr(
            dist.ReduceOp, op.upper()
        )
        self._do("allreduce", t, after, timeout, lambda: self._group.allreduce([t], options))
        if op == "mean" and self.world_size > 1:
            if t.is_floating_point():
                t.div_(self.world_size)
            else:
                t.div_(self.world_size, rounding_mode="floor")
        self._settle(t, timeout)

    def broadcast_(self, t: Any, root: int, timeout: float, after: Any = None) -> None:
        """Overwrites contiguous ``t`` with rank ``root``'s."""
        dist = _dist()

        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        self._do("broadcast", t, after, timeout, lambda: self._group.broadcast([t], options))
        self._settle(t, timeout)

    def allgather(self, t: Any, rows: Sequence[int], timeout: float, after: Any = None) -> Any:
        """Every rank's ``t`` (``rows[r]`` rows on rank r, equal trailing shape) concatenated in rank order;
        shorter parts travel padded to the longest."""
        import torch

        if after is not None:  # the copy into the padded part below reads t: after the kernels that wrote it
            torch.cuda.current_stream(t.device).wait_event(after)
        part = t.reshape((1, *t.shape)) if t.dim() == 0 else t
        longest = max(rows)
        padded = part.new_zeros((longest, *part.shape[1:]))
        padded[: part.shape[0]] = part
        outputs = [torch.empty_like(padded) for _ in rows]
        self._do("allgather", padded, None, timeout, lambda: self._group.allgather([outputs], [padded]))
        result = torch.cat([out[:n] for out, n in zip(outputs, rows, strict=True)])
        self._settle(result, timeout)
        return result

    def reduce_scatter(self, t: Any, op: str, row_bounds: Sequence[tuple[int, int]], timeout: float) -> Any:
        """Rank r's rows ``row_bounds[r]`` of the reduction of every rank's ``t``; parts travel padded to the
        longest."""
        dist = _dist()

        longest = max(b - a for a, b in row_bounds)
        chunks = []
        for a, b in row_bounds:
            chunk = t.new_zeros((longest, *t.shape[1:]))
            chunk[: b - a] = t[a:b]
            chunks.append(chunk)
        out = t.new_empty((longest, *t.shape[1:]))
        options = dist.ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp.SUM if op in ("sum", "mean") else getattr(dist.ReduceOp, op.upper())
        self._do(
            "reduce_scatter", t, self.mark(t), timeout, lambda: self._group.reduce_scatter([out], [chunks], options)
        )
        a, b = row_bounds[self.rank]
        mine = out[: b - a]
        if op == "mean" and self.world_size > 1:
            mine.div_(self.world_size, rounding_mode=None if mine.is_floating_point() else "floor")
        self._settle(mine, timeout)
        return mine

    # -- point to point (pipeline stages' activations and gradients: :mod:`paratrain.torch.pipeline`)

    def isend(self, t: Any, peer: int) -> Sent:
        """Starts sending contiguous ``t`` to rank ``peer``; :meth:`Sent.wait` finishes it. Sends to one peer arrive
        in the order they were started (tag 0 for all: NCCL matches point-to-point operations in order, and Gloo
        is held to the same rule, so a CPU test catches what would mismatch on a GPU). On CUDA the send starts
        after the kernels already queued on the current stream (those that produced ``t``)."""
        with self._lock:
            self._check()
            self.calls += 1
            try:
                if t.device.type == "cuda":
                    import torch

                    with torch.cuda.device(t.device):
                        work = self._group.send([t], peer, 0)
                else:
                    work = self._group.send([t], peer, 0)
            except RuntimeError as exc:
                raise self._failure("send", exc, 0.0) from exc
        return Sent(self, work, t)

    def recv_(self, t: Any, peer: int, timeout: float) -> None:
        """Fills contiguous ``t`` with the next tensor rank ``peer`` sends (in send order); on CUDA the current stream
        then waits for it (no host wait: the stage's next kernels use it on that stream)."""
        self._do("recv", t, None, timeout, lambda: self._group.recv([t], peer, 0))

    # -- plumbing

    def _check(self) -> None:
        if self._broken is not None:
            raise TransportError(
                f"the {self.name} engine failed earlier ({self._broken}) and takes no more calls; "
                "restart the job (set PARATRAIN_CUDA_COLLECTIVES=staged to keep off it)"
            )

    def _failure(self, what: str, exc: RuntimeError, timeout: float) -> TransportError:
        """``exc`` from the process group as a paratrain error; the engine is broken from now on."""
        self._broken = f"{what}: {exc}".splitlines()[0]
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            return CommTimeoutError(
                f"{self.name} {what} did not complete within {timeout:g} s ({self._broken}); a rank is "
                "stuck or slow: raise PARATRAIN_TIMEOUT or look for a straggler"
            )
        return TransportError(f"{self.name} {what} failed on rank {self.rank} ({self._broken}); a peer probably died")

    def _do(self, what: str, t: Any, after: Any, timeout: float, start: Any) -> None:
        """Runs ``start()`` (launches the work) after ``after`` and waits for it; failures become paratrain
        errors and break the engine."""
        with self._lock:
            self._check()
            if t.numel() == 0:
                return
            self.calls += 1
            try:
                if t.device.type == "cuda":
                    import torch

                    with torch.cuda.device(t.device):
                        if after is not None:
                            torch.cuda.current_stream().wait_event(after)
                        start().wait(datetime.timedelta(seconds=timeout))
                else:
                    start().wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as exc:
                raise self._failure(what, exc, timeout) from exc

    def _settle(self, t: Any, timeout: float) -> None:
        """Waits (host) for the device work that wrote ``t``: an event on the current stream, not the device, at
        most ``timeout`` seconds (:class:`~paratrain.errors.DeviceTimeoutError`)."""
        if t.device.type == "cuda":
            import torch

            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(torch.cuda.current_stream(t.device))
            wait_event(done, timeout, f"the {self.name} engine's work")

    def close(self) -> None:
        """Lets the process group go (NCCL's communicators are shut down); idempotent."""
        group, self._group = self._group, None
        self._store = None
        if group is not None and self.name == "nccl":
            shutdown = getattr(group, "shutdown", None)
            if callable(shutdown):
                shutdown()
        self._broken = self._broken or "closed"


def _dist() -> Any:
    """torch.distributed, untyped: its stubs leave the stores and the groups' options out."""
    import torch.distributed

    return torch.distributed


class Sent:
    """A send in flight (:meth:`TorchEngine.isend`); holds the tensor until the send is done."""

    def __init__(self, engine: TorchEngine, work: Any, tensor: Any) -> None:
        self._engine = engine
        self._work: Any = work
        self._tensor: Any = tensor

    def wait(self, timeout: float) -> None:
        """Blocks until the bytes are handed over (a failure: the engine's paratrain error)."""
        if self._work is None:
            return
        try:
            if self._tensor.device.type == "cuda":
                import torch

                with torch.cuda.device(self._tensor.device):
                    self._work.wait(datetime.timedelta(seconds=timeout))
            else:
                self._work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise self._engine._failure("send", exc, timeout) from exc
        self._work = self._tensor = None
