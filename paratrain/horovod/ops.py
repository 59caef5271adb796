"""Horovod's tensor collectives: allreduce, allgather, broadcast and their async, in-place and grouped forms,
with Horovod's handles (``poll``/``synchronize``) and autograd through the collective.

The update rules, in one place:

* ``allreduce(t, op)``: every rank gets ``postscale * REDUCE_r(prescale * t_r)`` with REDUCE the sum (``Sum``),
  the sum divided by ``size()`` (``Average``, the default, as Horovod's), the elementwise ``Min``, ``Max`` or
  ``Product`` (the product in rank order), or ``Adasum`` (:func:`adasum_tree`: pairwise adaptive sums in a
  binary tree; floating tensors; gathered from every rank, N times a ring's bytes). Integer tensors are scaled
  as Horovod scales them (the product with the factor, truncated toward zero); an integer ``Average`` divides
  exactly, truncating toward zero.
* ``allgather(t)``: the ranks' tensors concatenated on the first dimension in rank order (first dimensions may
  differ); ``broadcast(t, root_rank)``: ``root_rank``'s tensor everywhere.
* Gradients (the differentiable forms): allreduce's is the same allreduce of the gradient; allgather's is this
  rank's slice of the summed gradient; broadcast's is the summed gradient on the root, zero elsewhere.

Each call is a request to the Horovod engine (:mod:`paratrain.horovod.controller`), which matches the ranks'
requests by ``name`` (unnamed ones by call order, as Horovod's), fuses small allreduces into one of paratrain's
collectives (the shared-memory path on one host, ring or tree across hosts), supports :func:`join` and records
the timeline (``PARATRAIN_TIMELINE``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.horovod.adasum import adasum_pair, adasum_tree
from paratrain.horovod.basics import Adasum, Average, Max, Min, Product, Sum, rank, size, submit, wait
from paratrain.horovod.basics import name as _auto_name
from paratrain.horovod.compression import Compression, Compressor
from paratrain.horovod.controller import Request, average_divide, scale
from paratrain.runtime.group import Group

__all__ = [
    "adasum_pair",
    "adasum_tree",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "join",
    "poll",
    "reducescatter",
    "synchronize",
]

_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max"}


@dataclass
class _Pending:
    future: concurrent.futures.Future[torch.Tensor]
    out: torch.Tensor | None  # the in-place forms' tensor, written at synchronize
    name: str | None


_handles: dict[int, _Pending] = {}
_ids = itertools.count(1)
_handles_lock = threading.Lock()


def _op(op: int | None, average: bool | None) -> int:
    """Horovod's op from ``op`` or the deprecated ``average`` (never both)."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Average if average is None or average else Sum
    if op not in (*_OPS, Product, Adasum):
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Adasum, Min, Max or Product")
    return op


_local = threading.local()


@contextlib.contextmanager
def _blocking() -> Iterator[None]:
    """Marks the requests submitted inside as waited for at once: the caller runs their cycle itself (see
    :meth:`~paratrain.horovod.controller.Engine.wait`), so the engine thread is not woken for them."""
    previous = getattr(_local, "blocking", False)
    _local.blocking = True
    try:
        yield
    finally:
        _local.blocking = previous


def _wake() -> bool:
    return not getattr(_local, "blocking", False)


def _now(start: Callable[..., int], *args: Any) -> torch.Tensor:
    """``synchronize(start(*args))``, the request marked as waited for at once (:func:`_blocking`)."""
    with _blocking():
        handle = start(*args)
    return synchronize(handle)


def _allreduce_request(
    tensor: torch.Tensor, name: str | None, op: int, prescale: float, postscale: float
) -> concurrent.futures.Future[torch.Tensor]:
    if op == Adasum and not tensor.is_floating_point():
        raise ValueError(f"Adasum combines floating-point tensors, got {tensor.dtype}")
    t = tensor.detach().clone()  # the caller may change its tensor before the collective runs
    return submit(Request(_auto_name("allreduce", name), "allreduce", t, op, 0, prescale, postscale), wake=_wake())


def _register(future: concurrent.futures.Future[torch.Tensor], out: torch.Tensor | None, name: str | None) -> int:
    with _handles_lock:
        handle = next(_ids)
        _handles[handle] = _Pending(future, out, name)
    return handle


def poll(handle: int) -> bool:
    """Whether the async operation ``handle`` finished (never blocks)."""
    with _handles_lock:
        pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"handle {handle} was not created or has been cleared")
    return pending.future.done()


def synchronize(handle: int) -> torch.Tensor:
    """Waits for ``handle`` and returns its result (for the in-place forms, the tensor passed in, now holding it).

    Raises:
        HorovodInternalError: the collective failed on every rank (mismatched calls, a lost peer).
    """
    with _handles_lock:
        pending = _handles.pop(handle, None)
    if pending is None:
        raise ValueError(f"handle {handle} was not created or has been cleared")
    result = wait(pending.future)
    if pending.out is None:
        return result
    with torch.no_grad():
        pending.out.copy_(result)
    return pending.out


def allreduce_async(  # noqa: PLR0917 (Horovod's positional signature)
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> int:
    """Starts an allreduce of ``tensor`` (see the module docstring); the input is not modified. Returns a handle
    for :func:`poll` and :func:`synchronize`."""
    _whole_job(process_set)
    future = _allreduce_request(tensor, name, _op(op, average), prescale_factor, postscale_factor)
    return _register(future, None, name)


def allreduce_async_(  # noqa: PLR0917 (Horovod's positional signature)
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> int:
    """Like :func:`allreduce_async`; :func:`synchronize` writes the result into ``tensor``."""
    _whole_job(process_set)
    future = _allreduce_request(tensor, name, _op(op, average), prescale_factor, postscale_factor)
    return _register(future, tensor, name)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes apply's arguments positionally)
        ctx: Any, tensor: torch.Tensor, op: int, name: str | None, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return _now(allreduce_async, tensor, None, name, op, pre, post)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post), None, None, None, None


def allreduce(  # noqa: PLR0917 (Horovod's positional signature)
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> torch.Tensor:
    """The reduced tensor (Average by default, see the module docstring); differentiable. ``compression``
    (``Compression.fp16``) casts floating tensors to 16 bits on the wire and back."""
    _whole_job(process_set)
    o = _op(op, average)
    compressed, state = compression.compress(tensor)
    out = _Allreduce.apply(  # type: ignore[no-untyped-call]
        compressed, o, name, prescale_factor, postscale_factor
    )
    return compression.decompress(out, state)


def allreduce_(  # noqa: PLR0917 (Horovod's positional signature)
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> torch.Tensor:
    """In place: ``tensor`` holds the result, and is returned."""
    return _now(allreduce_async_, tensor, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async(  # noqa: PLR0917 (Horovod's positional signature)
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> list[int]:
    """One handle per tensor, the group reduced together (in order, on the Horovod thread)."""
    return [
        allreduce_async(
            t, average, None if name is None else f"{name}.{i}", op, prescale_factor, postscale_factor, process_set
        )
        for i, t in enumerate(tensors)
    ]


def grouped_allreduce(  # noqa: PLR0917 (Horovod's positional signature)
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> list[torch.Tensor]:
    """:func:`allreduce` of each tensor, differentiable, in order."""
    return [
        allreduce(
            t,
            average,
            None if name is None else f"{name}.{i}",
            compression,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
        for i, t in enumerate(tensors)
    ]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> int:
    """Starts an allgather (first dimensions may differ); returns a handle."""
    _whole_job(process_set)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension (it concatenates on the first)")
    t = tensor.detach().clone().contiguous()
    request = Request(_auto_name("allgather", name), "allgather", t, run=lambda g: torch.as_tensor(g.allgather(t)))
    return _register(submit(request, wake=_wake()), None, name)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        ctx.dim = tensor.shape[0]
        return _now(allgather_async, tensor, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = allreduce(grad, op=Sum)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64))
        offset = int(dims[: rank()].sum())
        return summed.narrow(0, offset, ctx.dim), None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> torch.Tensor:
    """Every rank's tensor concatenated on the first dimension in rank order; differentiable."""
    _whole_job(process_set)
    out: torch.Tensor = _Allgather.apply(  # type: ignore[no-untyped-call]
        tensor, name
    )
    return out


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None) -> int:
    """Starts a broadcast of ``root_rank``'s tensor; the input is not modified. Returns a handle."""
    return _register(_broadcast_request(tensor, root_rank, name, process_set), None, name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None) -> int:
    """Like :func:`broadcast_async`; :func:`synchronize` writes the result into ``tensor``."""
    return _register(_broadcast_request(tensor, root_rank, name, process_set), tensor, name)


def _broadcast_request(
    tensor: torch.Tensor, root_rank: int, name: str | None, process_set: object
) -> concurrent.futures.Future[torch.Tensor]:
    _whole_job(process_set)
    if type(root_rank) is not int or not 0 <= root_rank < size():
        raise ValueError(f"root_rank {root_rank!r} outside 0..{size() - 1}")
    t = tensor.detach().clone().contiguous()
    run = lambda g: torch.as_tensor(g.broadcast(t, root_rank))  # noqa: E731
    return submit(Request(_auto_name("broadcast", name), "broadcast", t, root=root_rank, run=run), wake=_wake())


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root = root_rank
        return _now(broadcast_async, tensor, root_rank, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        summed = allreduce(grad, op=Sum)
        return (summed if rank() == ctx.root else torch.zeros_like(summed)), None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    """``root_rank``'s tensor on every rank; differentiable."""
    _whole_job(process_set)
    out: torch.Tensor = _Broadcast.apply(  # type: ignore[no-untyped-call]
        tensor, root_rank, name
    )
    return out


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    """In place: ``tensor`` takes ``root_rank``'s value, and is returned."""
    return _now(broadcast_async_, tensor, root_rank, name, process_set)


def barrier(process_set: object = None) -> None:
    """Blocks until every rank called it (after this rank's earlier collectives)."""
    _whole_job(process_set)
    wait(submit(Request(_auto_name("barrier", None), "barrier", run=lambda g: g.barrier()), wake=False))


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, it takes part in the others' allreduces with
    a neutral tensor (zeros for Sum, Average and Adasum, as Horovod's; see :mod:`paratrain.horovod.controller`), so
    that ranks with fewer batches need not stop the job. Blocks until every rank joined; returns the rank that
    joined last. ``device`` (Horovod's device for its zero tensors) must be -1: CPU.

    Raises:
        HorovodInternalError: a rank that has not joined asked for an allgather, broadcast, reducescatter,
            alltoall or barrier meanwhile (only allreduce works with joined ranks, as in Horovod).
    """
    if device != -1:
        raise ValueError(f"join(device={device}): paratrain.horovod runs on CPU tensors (device=-1)")
    return int(wait(submit(Request(_auto_name("join", None), "join"), wake=False)))


def _whole_job(process_set: object) -> None:
    if process_set is not None:
        raise ValueError("paratrain.horovod runs on the whole job: process_set= is not supported")


def reducescatter(  # noqa: PLR0917 (Horovod's positional signature)
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's part of the reduced tensor, split on the first dimension as Horovod splits it (the first
    ``len % size`` ranks get one row more); ``op`` is Average (Horovod's default here) or Sum."""
    _whole_job(process_set)
    if op not in (Average, Sum):
        raise ValueError("reducescatter supports op=hvd.Average or hvd.Sum")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension (it splits the first)")
    compressed, state = compression.compress(tensor)
    t = compressed.detach().clone().contiguous()

    def call(g: Group) -> torch.Tensor:
        out = torch.as_tensor(g.reduce_scatter(scale(t, prescale_factor), "sum"))
        if op == Average:
            out = average_divide(out, g.world_size)
        return scale(out, postscale_factor)

    request = Request(
        _auto_name("reducescatter", name), "reducescatter", t, op, 0, prescale_factor, postscale_factor, call
    )
    return compression.decompress(synchronize(_register(submit(request, wake=False), None, name)), state)


def alltoall(
    tensor: torch.Tensor, splits: torch.Tensor | None = None, name: str | None = None, process_set: object = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sends ``splits[q]`` consecutive rows of ``tensor`` to rank q (equal parts if ``splits`` is None) and
    returns the rows received, in rank order; with ``splits``, also how many rows came from each rank (as
    Horovod returns them). The direct all-to-all (:meth:`~paratrain.collectives.api.Collectives.alltoall`): each
    row travels once, to its destination.

    Raises:
        ValueError: ``splits`` of the wrong length, negative, or not summing to the first dimension; no splits
            and a first dimension the ranks do not divide.
    """
    _whole_job(process_set)
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    n = size()
    given = splits is not None
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"the first dimension {tensor.shape[0]} is not divisible by the {n} ranks; pass splits")
        splits = torch.full((n,), tensor.shape[0] // n, dtype=torch.int64)
    splits = torch.as_tensor(splits, dtype=torch.int64).reshape(-1)
    if len(splits) != n or bool((splits < 0).any()) or int(splits.sum()) != tensor.shape[0]:
        raise ValueError(f"splits must be {n} non-negative counts summing to {tensor.shape[0]}, got {splits.tolist()}")
    t = tensor.detach().clone().contiguous()

    def call(g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        sent = splits.tolist()
        received = torch.as_tensor(g.alltoall(splits))  # one count from each rank: the rows it sends here
        return torch.as_tensor(g.alltoall(t, counts=sent)), received

    out, received = wait(submit(Request(_auto_name("alltoall", name), "alltoall", t, run=call), wake=False))
    return (out, received) if given else out
