"""The torch builders the strategy units name (:mod:`paratrain.strategy.builtin`): each turns what
:class:`~paratrain.torch.optimizer.DistributedOptimizer` planned (the buckets, a hybrid's SFB layers) into the
fused buffers and the strategy that sends them. The options that change how a strategy sends (``reliable=``,
``compression=``) wrap or replace its sending here; a job of one worker sends nothing (:func:`alone`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.compression import Compressor
from paratrain.fusion.buckets import Bucket
from paratrain.recovery.reliable import Reliable
from paratrain.runtime.context import Context
from paratrain.strategy import StrategySpec, parse_strategy
from paratrain.torch.broadcast import broadcast_parameters
from paratrain.torch.compressed import CompressedAllreduceStrategy
from paratrain.torch.fusion import FusedBucket
from paratrain.torch.hybrid import HybridStrategy
from paratrain.torch.resilient import ReliableAllreduceStrategy
from paratrain.torch.sfb import SfbLayer, own_params
from paratrain.torch.strategies import AllreduceStrategy, GossipStrategy, ParameterServerStrategy, Strategy

__all__ = ["BuildRequest", "Built", "allreduce", "alone", "device_engines", "gossip", "hybrid", "parameter_server"]


@dataclass(frozen=True)
class BuildRequest:
    """What a builder needs: the strategy, the planned buckets and the options that change its sending.

    Attributes:
        spec: the parsed strategy.
        context: this rank's context.
        optimizer: the wrapped torch optimizer.
        params, names: the trained parameters and their names, in registration order.
        plan: the fusion plan (a hybrid's SFB layers are buckets of their own, ``group >= 0``).
        sfb_modules: a hybrid's SFB layers, by group.
        timeout: the context's timeout for every wait on a bucket.
        topology: gossip's graph given as an object (None: the name's).
        overlap: wait-free backprop on.
        staleness_lr: stale gradients scaled on the servers.
        reliable: reliable collectives (allreduce only).
        compressor: the gradient compressor (None: none).
    """

    spec: StrategySpec
    context: Context
    optimizer: torch.optim.Optimizer
    params: Sequence[torch.nn.Parameter]
    names: Sequence[str]
    plan: Sequence[Bucket]
    sfb_modules: Sequence[tuple[str, torch.nn.Linear]] = ()
    timeout: float = 60.0
    topology: Any = None
    overlap: bool = True
    staleness_lr: bool = False
    reliable: Reliable | None = None
    compressor: Compressor | None = None

    def fused(self, bucket: Bucket, *, flags: bool, on_device: bool = False) -> FusedBucket:
        """The fusion buffer of one planned bucket (``flags``: one used-flag per parameter travels with it)."""
        return FusedBucket(bucket, self.params, self.names, flags=flags, on_device=on_device, timeout=self.timeout)


@dataclass(frozen=True)
class Built:
    """A builder's result: the strategy and, per planned bucket, its fusion buffer (None: an SFB layer)."""

    strategy: Strategy
    buckets: list[FusedBucket | None]


def device_engines(context: Context, params: Sequence[torch.nn.Parameter]) -> dict[torch.device, Any]:
    """The collective engine of each CUDA device the parameters are on (None: staged through host memory).

    The CUDA engine's choice is collective: made here, at the same point on every rank, if no collective on a
    CUDA tensor made it before, and never in a gradient hook (hooks of CUDA tensors run on autograd's one thread
    per device, shared by every rank that is a thread of this process: one rank waiting there for the others
    would block their backward passes for good)."""
    devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
    return {d: context.collectives.device_engine(d) for d in devices}


def alone(request: BuildRequest) -> Built:
    """One worker and a gradient strategy: the mean of one gradient is itself, so nothing is copied or sent."""
    return Built(AllreduceStrategy(request.context, []), [])


def allreduce(request: BuildRequest) -> Built:
    """Gradients averaged by allreduce; through reliable collectives with ``reliable=``, compressed with
    ``compression=``. Plain allreduce keeps a device's buckets there when an engine (NCCL) reduces device
    memory."""
    engines = device_engines(request.context, request.params)
    plain = request.reliable is None and request.compressor is None
    on_device = plain and bool(engines) and all(e is not None for e in engines.values())
    buckets = [request.fused(b, flags=True, on_device=on_device) for b in request.plan]
    strategy: Strategy
    if request.reliable is not None:
        strategy = ReliableAllreduceStrategy(request.reliable, buckets)
    elif request.compressor is not None:
        strategy = CompressedAllreduceStrategy(request.context, buckets, request.compressor, request.optimizer)
    else:
        strategy = AllreduceStrategy(request.context, buckets)
    return Built(strategy, list(buckets))


def parameter_server(request: BuildRequest) -> Built:
    """Gradients pushed to the parameter servers, which step the optimizer; parameters pulled back."""
    device_engines(request.context, request.params)
    buckets = [request.fused(b, flags=False) for b in request.plan]
    strategy = ParameterServerStrategy(
        request.context,
        buckets,
        spec=request.spec,
        optimizer=request.optimizer,
        staleness_lr=request.staleness_lr,
        compressor=request.compressor,
    )
    return Built(strategy, list(buckets))


def gossip(request: BuildRequest) -> Built:
    """Parameters mixed with the graph's neighbours (D-PSGD); the buckets are the parameters' layout."""
    buckets = [request.fused(b, flags=False) for b in request.plan]
    graph = request.topology if request.topology is not None else request.spec.topology
    return Built(GossipStrategy(request.context, buckets, topology=graph, overlap=request.overlap), list(buckets))


def hybrid(request: BuildRequest) -> Built:
    """Poseidon's units: an :class:`SfbLayer` per SFB layer, fused buckets for the rest, sent by the dense scheme
    (the bulk-synchronous parameter servers or allreduce, compressed with ``compression=``)."""
    device_engines(request.context, request.params)
    uses_servers = request.spec.uses_servers
    units: list[FusedBucket | SfbLayer] = []
    for bucket in request.plan:
        if bucket.group >= 0:
            name, module = request.sfb_modules[bucket.group]
            units.append(SfbLayer(name, module, request.context))
        else:
            units.append(request.fused(bucket, flags=not uses_servers))
    fused = [u for u in units if isinstance(u, FusedBucket)]
    if uses_servers and request.sfb_modules:
        # the servers' keys start from rank 0's values; so do the layers the workers step themselves
        params = [p for _, m in request.sfb_modules for p in own_params(m)]
        broadcast_parameters(params, context=request.context)
    dense: Strategy | None = None
    if fused:
        dense_spec = parse_strategy("bsp" if uses_servers else "allreduce")
        dense_request = BuildRequest(
            dense_spec,
            request.context,
            request.optimizer,
            request.params,
            request.names,
            (),
            timeout=request.timeout,
            compressor=request.compressor,
        )
        dense = _dense(dense_request, fused)
    return Built(HybridStrategy(units, dense), [u if isinstance(u, FusedBucket) else None for u in units])


def _dense(request: BuildRequest, buckets: Sequence[FusedBucket]) -> Strategy:
    """A hybrid's dense part over its fused buckets: the parameter servers or (compressed) allreduce."""
    if request.spec.uses_servers:
        return ParameterServerStrategy(
            request.context, buckets, spec=request.spec, optimizer=request.optimizer, compressor=request.compressor
        )
    if request.compressor is not None:
        return CompressedAllreduceStrategy(request.context, buckets, request.compressor, request.optimizer)
    return AllreduceStrategy(request.context, buckets)
