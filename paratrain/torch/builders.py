"""The torch builders and decorators the strategy units name (:mod:`paratrain.strategy.builtin`).

A kind's builder turns what :class:`~paratrain.torch.optimizer.DistributedOptimizer` planned (the buckets, a
hybrid's SFB layers) into the fused buffers and the base strategy that sends them; each wrapper the options ask
for (``compression=``, ``reliable=``) then decorates that base (:func:`build`). A job of one worker sends
nothing (:func:`alone`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.compression import Compressor
from paratrain.fusion.buckets import Bucket
from paratrain.recovery.buddy import BuddyRecovery
from paratrain.recovery.reliable import Reliable
from paratrain.runtime.context import Context
from paratrain.strategy import StrategyOptions, StrategySpec, WrapperUnit, parse_strategy, resolve, wrappers_given
from paratrain.torch.broadcast import broadcast_parameters
from paratrain.torch.bucket_strategy import Strategy
from paratrain.torch.fusion import FusedBucket
from paratrain.torch.hybrid import HybridStrategy
from paratrain.torch.resilient import ReliableAllreduceStrategy
from paratrain.torch.sfb import SfbLayer, own_params
from paratrain.torch.strategies import AllreduceStrategy, GossipStrategy, ParameterServerStrategy

__all__ = [
    "BuildRequest",
    "Built",
    "allreduce",
    "alone",
    "build",
    "compressed",
    "device_engines",
    "gossip",
    "hybrid",
    "parameter_server",
    "reliable",
]


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
        reliable: reliable collectives (allreduce, sfb, poseidon:allreduce).
        recovery: gossip's checkpoints kept by buddies, and the rollback after a death.
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
    recovery: BuddyRecovery | None = None
    compressor: Compressor | None = None

    @property
    def wrappers(self) -> tuple[WrapperUnit, ...]:
        """The wrappers this request's options ask for, in decoration order."""
        options = StrategyOptions(compression=self.compressor, reliable=self.reliable is not None)
        return wrappers_given(options)

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


def build(request: BuildRequest) -> Built:
    """The kind's base strategy (its unit's builder), decorated by each wrapper the options ask for, in order."""
    built: Built = resolve(request.spec.info.builder)(request)
    for wrapper in request.wrappers:
        built = resolve(wrapper.decorator)(request, built)
    return built


def alone(request: BuildRequest) -> Built:
    """One worker and a gradient strategy: the mean of one gradient is itself, so nothing is copied or sent."""
    return Built(AllreduceStrategy(request.context, []), [])


def allreduce(request: BuildRequest) -> Built:
    """Gradients averaged by allreduce. A device's buckets stay there when an engine (NCCL) reduces device
    memory, unless a wrapper reads them on the host."""
    engines = device_engines(request.context, request.params)
    on_device = (
        bool(engines)
        and all(e is not None for e in engines.values())
        and not any(w.host_buckets for w in request.wrappers)
    )
    buckets = [request.fused(b, flags=True, on_device=on_device) for b in request.plan]
    return Built(AllreduceStrategy(request.context, buckets), list(buckets))


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
    )
    return Built(strategy, list(buckets))


def gossip(request: BuildRequest) -> Built:
    """Parameters mixed with the graph's neighbours (D-PSGD); the buckets are the parameters' layout."""
    buckets = [request.fused(b, flags=False) for b in request.plan]
    graph = request.topology if request.topology is not None else request.spec.topology
    strategy = GossipStrategy(
        request.context, buckets, topology=graph, overlap=request.overlap, recovery=request.recovery
    )
    return Built(strategy, list(buckets))


def hybrid(request: BuildRequest) -> Built:
    """Poseidon's units: an :class:`SfbLayer` per SFB layer, fused buckets for the rest, sent by the dense scheme
    (the bulk-synchronous parameter servers or allreduce; ``compression=`` decorates the hybrid's dense part)."""
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
    if fused:  # the base: bulk-synchronous servers or allreduce (compression= decorates it as a whole)
        if uses_servers:
            bsp = parse_strategy("bsp")
            dense = ParameterServerStrategy(request.context, fused, spec=bsp, optimizer=request.optimizer)
        else:
            dense = AllreduceStrategy(request.context, fused)
    return Built(HybridStrategy(units, dense), [u if isinstance(u, FusedBucket) else None for u in units])


# -- the wrappers' decorators (each wrapper unit's ``decorator``) -------------------------------------------------


def compressed(request: BuildRequest, base: Built) -> Built:
    """``compression=``: the base sending its buckets compressed (:meth:`Strategy.compressed`)."""
    assert request.compressor is not None
    return Built(base.strategy.compressed(request.compressor, request.optimizer), base.buckets)


def reliable(request: BuildRequest, base: Built) -> Built:
    """``reliable=``: the base's buckets each averaged by one numbered reliable allreduce in ``step()`` (a
    hybrid's SFB layers each gathered by one reliable allgather)."""
    assert request.reliable is not None
    return Built(ReliableAllreduceStrategy(base.strategy, request.reliable), base.buckets)
