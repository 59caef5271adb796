"""Horovod's background loop: requests matched by name across ranks, small allreduces fused, ``join``, and the
timeline's negotiation phase.

Why a loop of its own instead of issuing each call as it comes: Horovod lets ranks ask for tensors in different
orders (hooks fire in whatever order autograd runs), lets a rank that ran out of data ``join`` while the others
go on, and fuses many small gradients into one message. All three need the ranks to agree, before data moves,
on *which* requests are ready everywhere. The rule, per process:

1. A call appends a :class:`Request` (its name, kind, dtype, shape, op...) to this process's queue and returns a
   future. A request is named ``<kind>.<name>`` (``allreduce.fc1.weight``), or ``<kind>.noname.<k>`` with a
   per-process counter, so that ranks that issue the same unnamed calls in the same order match them, as
   Horovod's unnamed tensors do.
2. The engine thread runs *cycles* while it has requests pending (or has joined): each cycle allgathers every
   rank's pending list as JSON (never pickle) and decodes the same table on every rank. A request is *ready*
   when every rank that has not joined asked for it; ready requests run in the order of the lowest such rank's
   list, so every rank runs them in the same order. A ready request whose ranks disagree (kind, dtype, shape,
   op, root, scale factors) fails on every rank with :class:`~paratrain.horovod.basics.HorovodInternalError`
   naming the difference; the others still run.
3. Consecutive ready allreduces of one dtype, device type, op and scaling (Sum, Average, Min, Max) are fused:
   copied into one buffer of at most ``HOROVOD_FUSION_THRESHOLD`` bytes (64 MiB by default, as Horovod's), reduced
   by one of paratrain's collectives (the shared-memory path on one host), copied out. Adasum, Product, allgather,
   broadcast, reducescatter, alltoall and barrier run one request each.
4. ``join``: a joined rank keeps cycling and takes part in the others' allreduces with a neutral tensor: zeros
   for Sum, Average and Adasum (as Horovod's joined ranks send zeros; Average still divides by ``size()``), the
   largest value for Min, the smallest for Max, ones for Product (where Horovod's zeros would decide the
   result). Other kinds with a joined rank fail, as in Horovod. When every rank has joined, each ``join``
   returns the rank that joined last.

A cycle with nothing ready (ranks asked for different tensors so far) is followed by the next as soon as this
rank submits something, else after a back-off of up to 50 ms, so that two ranks waiting for each other's
requests do not spin. A rank with nothing pending does not cycle: its peers' cycles wait for it in the
allgather (under the job's timeout, ``PARATRAIN_TIMEOUT``), which is how a rank that is ahead waits for one
that is behind. A failed cycle (a lost peer, a timeout) fails every pending request and every later call.
A request some ranks make and the others never do would keep every rank cycling forever (each cycle succeeds):
when a cycle finds nothing ready and some rank's request has waited longer than the job's timeout, every rank
fails in that same cycle (the flag travels in the cycle's small allreduce), naming each such request and the
ranks that did and did not make it. Horovod's stall inspector only warns; here it is an error on every rank.

Who runs a cycle: the engine thread, for requests nobody waits for yet (async handles, gradient hooks), or a
caller blocked in :meth:`Engine.wait` while the engine thread is idle (one lock makes cycles exclusive): a
blocking call then costs no hand-off between threads.

On the timeline (:mod:`paratrain.timeline`), each tensor's row shows ``NEGOTIATE_<KIND>`` from the call to the
cycle that found it ready, with an instant for the cycle at which each rank had asked for it, then
``<KIND>`` holding ``QUEUE``, ``MEMCPY_IN_FUSION_BUFFER``, ``COMMUNICATE`` and ``MEMCPY_OUT_FUSION_BUFFER``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paratrain.errors import CollectiveMismatchError, CommTimeoutError
from paratrain.horovod.adasum import adasum_tree
from paratrain.runtime.group import Group
from paratrain.timeline import Timeline

__all__ = ["DEFAULT_FUSION_BYTES", "Engine", "Request", "average_divide", "fusion_bytes_from_env", "scale"]

#: Horovod's default fusion threshold (HOROVOD_FUSION_THRESHOLD): 64 MiB.
DEFAULT_FUSION_BYTES = 64 * 1024 * 1024

# Horovod's ops (basics.Average...), repeated here to keep this module below basics.py
_AVERAGE, _SUM, _ADASUM, _MIN, _MAX, _PRODUCT = 0, 1, 2, 3, 4, 5
_FUSABLE = {_AVERAGE: "sum", _SUM: "sum", _MIN: "min", _MAX: "max"}
_OP_NAMES = {_AVERAGE: "Average", _SUM: "Sum", _ADASUM: "Adasum", _MIN: "Min", _MAX: "Max", _PRODUCT: "Product"}
_MAX_BACKOFF = 0.05


def fusion_bytes_from_env(env: dict[str, str] | Any) -> int:
    """``HOROVOD_FUSION_THRESHOLD`` in bytes (0 turns fusion off), default :data:`DEFAULT_FUSION_BYTES`."""
    raw = env.get("HOROVOD_FUSION_THRESHOLD", "")
    if not raw.strip():
        return DEFAULT_FUSION_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={raw!r} is not a number of bytes") from None
    if value < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={raw!r} must be >= 0")
    return value


def _stall_report(tables: list[list[dict[str, Any]]], active: list[int], stall_s: float) -> str:
    """Why the job stopped: the requests some ranks made and others did not, with the ranks on each side."""
    asked: dict[str, list[int]] = {}
    for r in active:
        for m in tables[r]:
            asked.setdefault(m["n"], []).append(r)
    lines = [
        f"{name} (asked for by ranks {ranks}, not by {sorted(set(active) - set(ranks))})"
        for name, ranks in asked.items()
        if len(ranks) < len(active)
    ]
    return (
        f"Horovod requests waited more than {stall_s:.0f}s (PARATRAIN_TIMEOUT) for ranks that never made them: "
        f"{'; '.join(lines[:8]) or 'none listed'}{' ...' if len(lines) > 8 else ''}. Every rank must make the same "
        "collective calls (by name); a gradient some ranks do not produce is reduced by step() as zeros"
    )


@dataclass
class Request:
    """One call of the Horovod API, as this rank made it.

    Attributes:
        kind: ``allreduce``, ``allgather``, ``broadcast``, ``reducescatter``, ``alltoall``, ``barrier``,
            ``join`` or ``call`` (an opaque function of the context, matched by name only).
        tensor: the input (detached; None for barrier, join and call).
        run: every kind but allreduce: the result from the engine's group, ``run(group) -> result``.
    """

    name: str
    kind: str
    tensor: torch.Tensor | None = None
    op: int = _SUM
    root: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    run: Callable[[Group], Any] | None = None
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    submitted: float = field(default_factory=time.time)

    def meta(self) -> dict[str, Any]:
        """What the ranks compare: everything but the data."""
        m: dict[str, Any] = {"n": self.name, "k": self.kind}
        if self.tensor is not None:
            m["d"] = str(self.tensor.dtype).removeprefix("torch.")
            m["s"] = list(self.tensor.shape)
            m["v"] = self.tensor.device.type
        if self.kind in ("allreduce", "reducescatter"):
            m |= {"o": self.op, "a": self.prescale, "b": self.postscale}
        elif self.kind == "broadcast":
            m["r"] = self.root
        return m


def _neutral(meta: dict[str, Any]) -> torch.Tensor:
    """A joined rank's contribution to an allreduce it did not ask for (see the module docstring)."""
    dtype = getattr(torch, meta["d"])
    shape = meta["s"]
    op = meta["o"]
    # on the device type the others reduce on (this rank's current GPU for CUDA), so that every rank's tensor
    # takes the same path (a CUDA engine, say)
    device = torch.device("cuda", torch.cuda.current_device()) if meta.get("v") == "cuda" else torch.device("cpu")
    if op in (_MIN, _MAX):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        fill = info.max if op == _MIN else info.min
        return torch.full(shape, fill, dtype=dtype, device=device)
    if op == _PRODUCT:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _difference(kind: str, metas: list[tuple[int, dict[str, Any]]]) -> str | None:
    """Horovod's checks of one ready request across ranks: None, or what differs and on which ranks."""
    (r0, first), rest = metas[0], metas[1:]
    what = {
        "k": "operation",
        "d": "dtype",
        "v": "device type",
        "o": "reduction op",
        "r": "root rank",
        "a": "prescale factor",
        "b": "postscale factor",
    }
    for r, m in rest:
        for key, label in what.items():
            if first.get(key) != m.get(key):
                a: Any = first.get(key)
                b: Any = m.get(key)
                if key == "o":
                    a, b = _OP_NAMES.get(a, a), _OP_NAMES.get(b, b)
                return f"Mismatched {kind} {label}: rank {r0} sent {a}, but rank {r} sent {b}"
        s0, s = first.get("s"), m.get("s")
        if s0 is None or s is None:
            continue
        if kind in ("allgather", "alltoall"):
            if len(s0) != len(s) or s0[1:] != s[1:]:
                return (
                    f"Mismatched {kind} tensor shapes: rank {r0} sent {tuple(s0)}, but rank {r} sent {tuple(s)} "
                    "(all dimensions but the first must agree)"
                )
        elif s0 != s:
            return f"Mismatched {kind} tensor shapes: rank {r0} sent {tuple(s0)}, but rank {r} sent {tuple(s)}"
    return None


class Engine:
    """This process's Horovod loop over ``group`` (see the module docstring).

    Args:
        group: every rank of the job, in a group of its own (its own tags: the user's calls on the context
            never meet the engine's).
        timeline: where to record the phases, or None.
        fusion_bytes: the fusion buffer's size; 0 sends every allreduce alone.
        error: turns an exception of the collectives into the error callers see.
    """

    def __init__(
        self,
        group: Group,
        *,
        timeline: Timeline | None,
        fusion_bytes: int = DEFAULT_FUSION_BYTES,
        error: Callable[[BaseException], BaseException],
        stall_s: float = 300.0,
    ) -> None:
        self.group = group
        self.stall_s = stall_s
        self.timeline = timeline
        self.fusion_bytes = fusion_bytes
        self._error = error
        self._cond = threading.Condition()
        self._queue: list[Request] = []
        self._names: set[str] = set()  # queued or pending here: a second request of a name is refused
        self._counters: dict[str, int] = {}
        self._pending: dict[str, Request] = {}  # the engine thread's; insertion order is this rank's order
        self._asked: dict[str, dict[int, float]] = {}  # name -> rank -> when a cycle first saw its request
        self._joined_at: dict[int, int] = {}  # rank -> the cycle in which it was first seen joined
        self._cycles = 0
        self._failed: BaseException | None = None
        self._closing = False
        self._cycle_lock = threading.Lock()  # held for each cycle, by the engine thread or a waiting caller
        #: cycles run, how many found something ready, how many compared the ranks' lists in full (the others
        #: found every rank's list the same), fused messages and the tensors in them (tests, diagnostics)
        self.stats = {"cycles": 0, "productive": 0, "negotiated": 0, "fused_messages": 0, "fused_tensors": 0}
        self._thread = threading.Thread(target=self._loop, name="paratrain-horovod", daemon=True)
        self._thread.start()

    # -- the caller's side ----------------------------------------------------------------------------------

    def name(self, kind: str, name: str | None) -> str:
        """``<kind>.<name>``, or without a name the next ``<kind>.noname.<k>`` (the same sequence on every rank
        that calls alike): Horovod's names, which its timeline shows."""
        if name is not None:
            return f"{kind}.{name}"
        with self._cond:
            k = self._counters.get(kind, 0)
            self._counters[kind] = k + 1
        return f"{kind}.noname.{k}"

    def submit(self, request: Request, *, wake: bool = True) -> concurrent.futures.Future[Any]:
        """Queues ``request``; its future gets the result or the error. ``wake=False``: the caller will
        :meth:`wait` for it at once (and run the cycle itself), so the engine thread is not woken.

        Raises:
            ValueError: a request of the same name is still in flight on this rank (as Horovod refuses it), or
                the engine was shut down.
            HorovodInternalError: an earlier cycle failed (a lost peer): the job cannot go on.
        """
        with self._cond:
            if self._failed is not None:
                raise self._error(self._failed)
            if self._closing:
                raise ValueError("Horovod has been shut down; call hvd.init() again")
            if request.name in self._names:
                raise ValueError(
                    f"Requested to {request.kind} a tensor with the same name as another tensor that is currently "
                    f"being processed: {request.name!r}. Give each in-flight tensor its own name."
                )
            self._names.add(request.name)
            self._queue.append(request)
            if wake:
                self._cond.notify()
        return request.future

    def wait(self, future: concurrent.futures.Future[Any]) -> Any:
        """``future``'s result. While the engine thread is not in a cycle, this thread runs the cycles itself:
        a blocking call then costs no hand-off between threads (each costs 100-200 us on a busy VM), and the
        engine thread only serves requests nobody waits for yet (async handles, gradient hooks).

        Raises:
            what the request raised (HorovodInternalError, ValueError...).
        """
        idle = 0
        while not future.done():
            if not self._cycle_lock.acquire(blocking=False):  # the engine thread is cycling: it progresses
                concurrent.futures.wait([future], timeout=1e-3)
                continue
            progress = True
            try:
                with self._cond:
                    self._take_queue()
                if self._failed is None and self._pending:
                    progress = self._cycle()
            except BaseException as exc:  # as on the engine thread: every caller learns it
                self._fail(exc)
            finally:
                self._cycle_lock.release()
            if self._failed is not None and not future.done():
                break
            idle = 0 if progress else idle + 1
            if idle:  # nothing was ready: let the others submit (a request of ours would be ready anyway)
                concurrent.futures.wait([future], timeout=min(_MAX_BACKOFF, 1e-4 * 2 ** min(idle, 10)))
        return future.result()

    def _take_queue(self) -> None:
        """Moves the queued requests to the pending ones (holding the cycle lock and the condition)."""
        for request in self._queue:
            self._pending[request.name] = request
        self._queue.clear()

    def close(self, timeout: float) -> None:
        """Stops the loop once nothing is pending; requests still pending then fail."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        idle = 0  # cycles in a row that found nothing ready
        while True:
            with self._cond:
                if idle:
                    # nothing was ready: wait for a request of ours, or a while (the others may be submitting)
                    self._cond.wait_for(
                        lambda: bool(self._queue) or self._closing, min(_MAX_BACKOFF, 1e-4 * 2 ** min(idle, 10))
                    )
                self._cond.wait_for(
                    lambda: bool(self._queue) or bool(self._pending) or self._closing or self._failed is not None
                )
                if self._failed is not None:
                    return
            with self._cycle_lock:  # a caller in wait() may be cycling: one cycle at a time
                with self._cond:
                    self._take_queue()
                    if self._closing and (not self._pending or idle):
                        break
                if not self._pending:  # a waiting caller served them
                    idle = 0
                    continue
                try:
                    idle = 0 if self._cycle() else idle + 1
                except BaseException as exc:  # every failure ends the loop and reaches every caller
                    self._fail(exc)
                    return
        self._fail(ValueError("Horovod was shut down with this request pending"))

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._failed = self._failed or exc
            self._cond.notify_all()
            pending = [*self._pending.values(), *self._queue]
            self._pending.clear()
            self._queue.clear()
            self._names.clear()
        for request in pending:
            if not request.future.done():
                request.future.set_exception(exc if isinstance(exc, ValueError) else self._error(exc))

    def _done(self, request: Request) -> None:
        self._pending.pop(request.name, None)
        self._asked.pop(request.name, None)
        with self._cond:
            self._names.discard(request.name)

    def _cycle(self) -> bool:
        """One negotiation and the execution of what it found ready; whether anything was."""
        group, now = self.group, time.time()
        self._cycles += 1
        self.stats["cycles"] += 1
        metas = [r.meta() for r in self._pending.values()]
        mine = json.dumps(metas, separators=(",", ":")).encode()
        digest = int.from_bytes(hashlib.blake2b(mine, digest_size=7).digest(), "little")
        joined_here = int(any(m["k"] == "join" for m in metas))
        stalled_here = int(any(now - r.submitted > self.stall_s for r in self._pending.values()))
        # one small allreduce (the shared-memory path on one host): the largest and smallest digest of the
        # ranks' pending lists, the longest list, whether any rank joined, whether any rank's request is stalled
        vector = np.array([digest, -digest, len(mine), joined_here, stalled_here], dtype=np.int64)
        top = np.asarray(group.allreduce(vector, "max"))
        if top[0] == -top[1] and not top[3]:
            # every rank has the same requests pending, in the same order: all ready, nothing to compare
            self.stats["productive"] += 1
            if self.timeline is not None:  # every rank had asked for each of them by this cycle
                for m in metas:
                    asked = self._asked.setdefault(m["n"], {})
                    for r in range(group.world_size):
                        asked.setdefault(r, now)
            self._execute([(m["n"], m, None) for m in metas], decided=time.time())
            return True
        self.stats["negotiated"] += 1
        width = int(top[2]) + 4
        slots = np.zeros((group.world_size, width), dtype=np.uint8)  # an allgather by one sum: own row only
        slots[group.rank, :4] = np.frombuffer(len(mine).to_bytes(4, "little"), dtype=np.uint8)
        slots[group.rank, 4 : 4 + len(mine)] = np.frombuffer(mine, dtype=np.uint8)
        rows = np.asarray(group.allreduce(slots, "sum"))
        tables: list[list[dict[str, Any]]] = []
        for row in rows:
            length = int.from_bytes(row[:4].tobytes(), "little")
            tables.append(json.loads(row[4 : 4 + length].tobytes()))
        joined = [any(m["k"] == "join" for m in table) for table in tables]
        for r, j in enumerate(joined):
            if j:
                self._joined_at.setdefault(r, self._cycles)
        for r, table in enumerate(tables):
            for m in table:
                self._asked.setdefault(m["n"], {}).setdefault(r, now)
        active = [r for r in range(group.world_size) if not joined[r]]
        if not active:
            return self._finish_join(tables)
        by_rank = [{m["n"]: m for m in table} for table in tables]
        ready: list[tuple[str, dict[str, Any], str | None]] = []
        for m in tables[active[0]]:
            name = m["n"]
            if all(name in by_rank[r] for r in active):
                problem = _difference(m["k"], [(r, by_rank[r][name]) for r in active])
                if problem is None and len(active) < group.world_size and m["k"] != "allreduce":
                    problem = f"{m['k'].capitalize()} is not supported with Join at this time (only allreduce is)"
                ready.append((name, m, problem))
        if ready:
            self.stats["productive"] += 1
            self._execute(ready, decided=time.time())
        elif top[4]:  # every rank decides alike: the tables and the flag are the same everywhere
            raise CommTimeoutError(_stall_report(tables, active, self.stall_s))
        return bool(ready)

    def _finish_join(self, tables: list[list[dict[str, Any]]]) -> bool:
        """Every rank joined: each join returns the rank that joined last (the latest cycle, then the highest)."""
        last = max(self._joined_at, key=lambda r: (self._joined_at[r], r))
        self._joined_at.clear()
        for request in [r for r in self._pending.values() if r.kind == "join"]:
            self._record_negotiation(request, time.time())
            self._done(request)
            request.future.set_result(last)
        return True

    def _record_negotiation(self, request: Request, decided: float) -> None:
        tl = self.timeline
        if tl is None:
            return
        tl.span(request.name, f"NEGOTIATE_{request.kind.upper()}", request.submitted, decided)
        for r, when in sorted(self._asked.get(request.name, {}).items()):
            tl.mark(request.name, str(r), when)

    def _execute(self, ready: list[tuple[str, dict[str, Any], str | None]], *, decided: float) -> None:
        batch: list[tuple[Request | None, dict[str, Any]]] = []
        key: tuple[Any, ...] | None = None
        batch_bytes = 0
        for name, meta, problem in ready:
            request = self._pending.get(name)
            if request is not None:
                self._record_negotiation(request, decided)
            if problem is not None:
                if request is not None:
                    self._done(request)
                    request.future.set_exception(self._error(RuntimeError(problem)))
                continue
            nbytes = math.prod(meta.get("s", [])) * getattr(torch, meta["d"]).itemsize if "d" in meta else 0
            fusable = meta["k"] == "allreduce" and meta["o"] in _FUSABLE and self.fusion_bytes > 0
            this_key = (meta["d"], meta.get("v"), meta["o"], meta["a"], meta["b"]) if fusable else None
            if batch and (this_key is None or this_key != key or batch_bytes + nbytes > self.fusion_bytes):
                self._allreduce(batch, decided)
                batch, batch_bytes = [], 0
            if this_key is None:
                self._single(request, meta, decided)
                continue
            key = this_key
            batch.append((request, meta))
            batch_bytes += nbytes
        if batch:
            self._allreduce(batch, decided)

    def _span(self, request: Request | None, name: str, start: float, end: float, **args: Any) -> None:
        if self.timeline is not None and request is not None:
            self.timeline.span(request.name, name, start, end, **args)

    def _allreduce(self, batch: list[tuple[Request | None, dict[str, Any]]], decided: float) -> None:
        """Fused Sum/Average/Min/Max allreduce of ``batch`` (one dtype, device type, op and scaling)."""
        first = batch[0][1]
        dtype, op = getattr(torch, first["d"]), first["o"]
        start = time.time()
        parts = [
            (_neutral(meta) if req is None or req.tensor is None else scale(req.tensor, first["a"])).reshape(-1)
            for req, meta in batch
        ]
        buffer = parts[0] if len(parts) == 1 else torch.cat(parts)
        copied = time.time()
        reduced = torch.as_tensor(self.group.allreduce(buffer, _FUSABLE[op]))
        communicated = time.time()
        if len(batch) > 1:
            self.stats["fused_messages"] += 1
            self.stats["fused_tensors"] += len(batch)
        offset, outputs = 0, []
        for req, meta in batch:
            n = math.prod(meta["s"])
            out = reduced[offset : offset + n].reshape(meta["s"])
            offset += n
            if op == _AVERAGE:
                out = average_divide(out, self.group.world_size)
            outputs.append((req, scale(out, first["b"]).to(dtype)))
        end = time.time()
        nbytes = buffer.numel() * buffer.element_size()
        for req, out in outputs:
            if req is None:
                continue
            self._span(req, "ALLREDUCE", decided, end, fused=len(batch), bytes=nbytes)
            self._span(req, "QUEUE", decided, start)
            if len(batch) > 1:
                self._span(req, "MEMCPY_IN_FUSION_BUFFER", start, copied)
            self._span(req, "COMMUNICATE", copied, communicated, bytes=nbytes)
            if len(batch) > 1:
                self._span(req, "MEMCPY_OUT_FUSION_BUFFER", communicated, end)
            self._done(req)
            req.future.set_result(out.clone() if len(batch) > 1 else out)

    def _single(self, request: Request | None, meta: dict[str, Any], decided: float) -> None:
        """One request of any other kind (allreduce with Adasum or Product, allgather, broadcast...)."""
        start = time.time()
        if request is None:  # joined: an allreduce the others asked for, with this rank's neutral tensor
            _reduce_one(self.group, _neutral(meta), meta["o"], 1.0, 1.0)
            return
        try:
            if request.kind == "allreduce":
                assert request.tensor is not None
                result = _reduce_one(self.group, request.tensor, request.op, request.prescale, request.postscale)
            elif request.run is not None:
                result = request.run(self.group)
            else:
                raise RuntimeError(f"request {request.name!r} of kind {request.kind} has nothing to run")
        except CollectiveMismatchError as exc:  # the ranks disagreed inside the call; all stay usable
            self._done(request)
            request.future.set_exception(self._error(exc))
            return
        except (ValueError, TypeError) as exc:  # the request's own error (raised the same on every rank)
            self._done(request)
            request.future.set_exception(exc)
            return
        except Exception as exc:
            self._done(request)
            request.future.set_exception(self._error(exc))
            raise
        end = time.time()
        self._span(request, request.kind.upper(), decided, end)
        self._span(request, "QUEUE", decided, start)
        self._span(request, "COMMUNICATE", start, end)
        self._done(request)
        request.future.set_result(result)


def scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``factor * t``; integers as Horovod scales them (the product truncated toward zero)."""
    if factor == 1.0:
        return t
    if t.is_floating_point() or t.is_complex():
        return t * factor
    return (t.double() * factor).trunc().to(t.dtype)


def average_divide(t: torch.Tensor, n: int) -> torch.Tensor:
    """Average's division: exact for floats, truncating toward zero for integers."""
    return t / n if t.is_floating_point() or t.is_complex() else torch.div(t, n, rounding_mode="trunc")


def _reduce_one(group: Group, tensor: torch.Tensor, op: int, prescale: float, postscale: float) -> torch.Tensor:
    """One allreduce by any of Horovod's ops (see :mod:`paratrain.horovod.ops` for the rule)."""
    x = scale(tensor.contiguous(), prescale)
    if op == _ADASUM:
        out = adasum_tree(list(torch.as_tensor(group.allgather(x.reshape(1, *x.shape)))))
    elif op == _PRODUCT:
        out = torch.as_tensor(group.allgather(x.reshape(1, *x.shape))).prod(dim=0).to(x.dtype)
    else:
        out = torch.as_tensor(group.allreduce(x, _FUSABLE[op]))
        if op == _AVERAGE:
            out = average_divide(out, group.world_size)
    return scale(out, postscale)
