"""Horovod's PyTorch API on paratrain: ``import paratrain.horovod as hvd`` in a script written for
``horovod.torch`` and run it under ``paratrain launch`` (or torchrun, or SLURM).

The same names, signatures and defaults as Horovod's (``allreduce`` averages by default), and Horovod's error
type, :class:`HorovodInternalError`, for mismatched calls and lost peers. What is here so far: the process API
(:mod:`.basics`), the tensor collectives with handles and autograd (:mod:`.ops`), compression (:mod:`.compression`),
the broadcast helpers (:mod:`.functions`, :mod:`.objects`) and the DistributedOptimizer (:mod:`.optimizer`). Also
``SyncBatchNorm`` (:mod:`.sync_batch_norm`) and the elastic API (``hvd.elastic``: :mod:`.elastic`). Every
collective goes through :mod:`.controller`: requests matched by name across ranks, tensor fusion, ``join``, and
the timeline (``PARATRAIN_TIMELINE=file.json``).
"""

from __future__ import annotations

from paratrain.horovod import elastic
from paratrain.horovod.basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    cross_rank,
    cross_size,
    cuda_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from paratrain.horovod.compression import Compression
from paratrain.horovod.functions import broadcast_optimizer_state, broadcast_parameters
from paratrain.horovod.objects import allgather_object, broadcast_object
from paratrain.horovod.ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_async,
    join,
    poll,
    reducescatter,
    synchronize,
)
from paratrain.horovod.optimizer import DistributedOptimizer
from paratrain.horovod.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "allgather",
    "allgather_async",
    "allgather_object",
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
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "elastic",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]
