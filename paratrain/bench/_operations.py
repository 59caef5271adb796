"""The collectives ``paratrain bench allreduce --op`` times besides allreduce: what each rank passes, and the check.

A size is the bytes of one rank's block: what each rank contributes (allreduce, reduce, gather), receives
(scatter) or sends to each rank (alltoall: ``world`` blocks in, ``world`` out), as the OSU micro-benchmarks
count them. Every engine fills the same buffers and its first call is checked against them before anything is
timed, so a wrong result is never reported as a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["OPERATIONS", "check_result", "send_buffer"]

#: The operations ``--op`` takes; the root of the rooted ones is rank 0.
OPERATIONS = ("allreduce", "reduce", "gather", "scatter", "alltoall")


def send_buffer(op: str, nbytes: int, rank: int, world: int) -> npt.NDArray[np.float32]:
    """What ``rank`` passes to ``op`` for blocks of ``nbytes``: float32, block q of rank r filled with ``r + 1``
    (alltoall: ``r * world + q + 1``; scatter: the root's ``world`` blocks, zeros elsewhere)."""
    block = nbytes // 4
    if op in ("allreduce", "reduce", "gather"):
        return np.full(block, rank + 1, dtype=np.float32)
    if op == "scatter":  # (a non-root's rows are not read; its buffer is the root's size, for the engines' arithmetic)
        if rank != 0:
            return np.zeros(world * block, dtype=np.float32)
        return np.repeat(np.arange(1, world + 1, dtype=np.float32), block)
    if op == "alltoall":
        return np.repeat(np.arange(world, dtype=np.float32) + rank * world + 1, block)
    raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPERATIONS)}")


def check_result(op: str, result: Any, sent: npt.NDArray[np.float32], *, rank: int, world: int, nbytes: int) -> None:
    """Raises RuntimeError unless ``result`` (what the call returned; allreduce: None, ``sent`` reduced in
    place) is what ``op`` must give ``rank``."""
    block = nbytes // 4
    got: Any
    want: npt.NDArray[np.float32] | None
    if op == "allreduce":
        got, want = sent, np.full(block, world * (world + 1) / 2, dtype=np.float32)
    elif op == "reduce":
        got, want = result, (np.full(block, world * (world + 1) / 2, dtype=np.float32) if rank == 0 else None)
    elif op == "gather":
        got, want = result, (np.repeat(np.arange(1, world + 1, dtype=np.float32), block) if rank == 0 else None)
    elif op == "scatter":
        got, want = result, np.full(block, rank + 1, dtype=np.float32)
    else:
        got, want = result, np.repeat(np.arange(world, dtype=np.float32) * world + rank + 1, block)
    if want is None:
        return  # (a non-root's result is not defined: the engines return None or an empty array there)
    if got is None or not np.array_equal(np.asarray(got).reshape(-1), want):
        shown = None if got is None else np.asarray(got).reshape(-1)[:4]
        raise RuntimeError(f"wrong {op} result for {nbytes} bytes on rank {rank}: got {shown}..., expected {want[:4]}")
