"""Allreduce with a compressed wire format: each bucket leaves as 16-bit floats, top-k pairs or PowerSGD factors.

A decorator of a built :class:`~paratrain.torch.strategies.AllreduceStrategy` (``compression=``'s wrapper,
:mod:`paratrain.strategy.wrappers`): the base's buckets and its update (``apply``) stay; what travels changes.

The update rule is the ``"allreduce"`` strategy's (the mean gradient, then the wrapped optimizer on every worker)
with the mean replaced by its compressed estimate (:mod:`paratrain.compression`)::

    fp16 / bf16    allreduce_async(cast(buffer / P), sum)                      -> grads = float(sum)
    topk:R         (idx, val) of grads + residual; allgather_async(pairs)      -> grads = scatter-add / P
    dgc:R          the same of the local velocity + residual                  -> grads = scatter-add / P
                                                                                  - m * SGD's momentum buffer
    powersgd:R     allreduce_async([P of each matrix | vectors | flags], mean) -> in finish: orthonormalise P,
                   allreduce_async([Q of each matrix], mean)                   -> grads = P Q^T, vectors as reduced

Each compressor encodes and decodes its own buckets (:class:`~paratrain.compression.Compressor`); this strategy
moves its messages, one collective a round, and keeps what is torch's: the buckets and the optimizer's momentum.
Every worker decodes the same reduced data in the same way, so the replicas stay identical. The used-flags of
:class:`~paratrain.torch.fusion.FusedBucket` ride with the 16-bit cast and with PowerSGD's vectors; top-k sends
none, so under top-k every parameter counts as used (one that no worker used gets a zero gradient rather than
None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from paratrain.compression import BucketLayout, Compressor, Message
from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.torch.bucket_strategy import Strategy
from paratrain.torch.fusion import FusedBucket
from paratrain.transport.base import Handle

__all__ = ["CompressedAllreduceStrategy"]


class CompressedAllreduceStrategy(Strategy):
    """The ``"allreduce"`` strategy ``base`` with ``compression=`` (see the module docstring).

    Args:
        base: the allreduce strategy decorated: its buckets (with used-flags, in plan order) are sent compressed,
            its ``apply`` (the wrapped optimizer) and ``close`` are kept.
        context: this rank's context.
        compressor: a :class:`~paratrain.compression.Compressor` (its error-feedback state lives here, per bucket).
        optimizer: the wrapped optimizer; ``dgc:R`` reads its momentum and momentum buffers.

    Raises:
        ConfigError: top-k for a bucket that is not float32 or float64 (its pairs travel in the gradient's width);
            ``dgc:R`` with an optimizer that is not SGD-like (momentum, no dampening, no Nesterov) or with two
            momenta in one bucket.
    """

    #: the compressors read the buffer in the hook (on the host): the optimizer has a CUDA bucket's copy finished
    waits_for_staging = False

    def __init__(
        self,
        base: Strategy,
        context: Context,
        compressor: Compressor,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        super().__init__(base.buckets)
        self.base = base
        self._context = context
        self._handles: list[Handle[Any] | None] = [None] * len(self.buckets)
        self.compressor = compressor
        self._optimizer = optimizer
        #: per bucket, the momentum DGC corrects for (0: none, plain top-k)
        self._momentum = [0.0] * len(self.buckets)
        if compressor.moves_momentum:
            self._momentum = [_sgd_momentum(optimizer, b) for b in self.buckets]
        self._keys = [f"bucket{k}" for k in range(len(self.buckets))]  # the compressor's state of each bucket
        for key, b in zip(self._keys, self.buckets, strict=True):
            layout = BucketLayout(
                names=tuple(b.names),
                offsets=tuple(b.bucket.offsets),
                shapes=tuple(tuple(p.shape) for p in b.params),
                size=b.buffer.numel(),
                dtype=str(b.grads.dtype),
            )
            compressor.prepare(key, layout)

    # -- launch: the first message of each bucket -------------------------------------------------------------

    def launch(self, k: int) -> None:
        """Starts bucket ``k``'s first collective with its compressed gradients. Does not block."""
        bucket = self.buckets[k]
        message = self.compressor.encode(
            self._keys[k],
            bucket.buffer,
            numel=bucket.bucket.numel,
            workers=self._context.world_size,
            momentum=self._momentum[k],
        )
        self._handles[k] = self._send(message)

    def _send(self, message: Message | None) -> Handle[Any] | None:
        """Starts the collective that aggregates ``message`` (None: nothing this round). Does not block."""
        if message is None:
            return None
        if message.op == "gather":
            return self._context.allgather_async(message.array)
        return self._context.allreduce_async(message.array, op=message.op)

    # -- finish: the further rounds of every bucket (PowerSGD's Q), then decode --------------------------------

    def finish(self) -> None:
        """Waits for every bucket and writes the decoded mean into ``param.grad``. Blocks."""
        handles: Sequence[Handle[Any] | None]
        handles, self._handles = self._handles, [None] * len(self.buckets)
        if any(h is None for h in handles):
            raise RuntimeError("internal error: a bucket was never launched before finish()")
        comp, workers = self.compressor, self._context.world_size
        for _ in range(1, comp.aggregation_rounds):  # every bucket's next round leaves before any is decoded
            handles = [
                self._send(comp.next_round(key, None if h is None else h.wait()))
                for key, h in zip(self._keys, handles, strict=True)
            ]
        for k, (bucket, handle) in enumerate(zip(self.buckets, handles, strict=True)):
            reduced = None if handle is None else handle.wait()
            decoded = comp.decode(self._keys[k], reduced, bucket.buffer, numel=bucket.bucket.numel, workers=workers)
            if self._momentum[k]:
                self._replace_momentum(k)
            bucket.give(decoded)

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """The base's update: the wrapped optimizer on the decoded means, identically on every rank."""
        self.base.apply(optimizer)

    def close(self) -> None:
        """Waits for the messages still in flight (no rank leaves a collective half-done), then closes the base."""
        handles, self._handles = self._handles, [None] * len(self.buckets)
        try:
            for handle in handles:
                if handle is not None:
                    handle.wait()
        finally:
            self.base.close()

    def _replace_momentum(self, k: int) -> None:
        """DGC: the mean ``s`` already holds the momentum; ``grad = s - m·buffer`` makes SGD's ``buffer = s``."""
        assert self._optimizer is not None
        bucket, m = self.buckets[k], self._momentum[k]
        for j, param in enumerate(bucket.params):
            buf = self._optimizer.state.get(param, {}).get("momentum_buffer")
            if buf is not None:  # none before the first step: SGD then starts its buffer at the gradient, s
                view = bucket.buffer_views[j]  # (host memory where the bucket is staged: before give() copies it)
                view.sub_(buf.reshape(view.shape).to(view.device), alpha=m)


def _sgd_momentum(optimizer: torch.optim.Optimizer | None, bucket: FusedBucket) -> float:
    """The momentum of the SGD groups that hold ``bucket``'s parameters (one value), for DGC's correction.

    Raises:
        ConfigError: no optimizer, one without SGD's momentum, dampening or Nesterov, or two momenta in one bucket.
    """
    if optimizer is None:
        raise ConfigError("compression 'dgc:R' corrects the optimizer's momentum: pass the optimizer")
    owners = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    momenta = set()
    for name, param in zip(bucket.names, bucket.params, strict=True):
        group = owners.get(id(param))
        if group is None:
            continue
        if "momentum" not in group or "dampening" not in group:
            raise ConfigError(
                f"compression 'dgc:R' moves SGD's momentum to the workers, but {type(optimizer).__name__} (parameter "
                f"{name!r}) has no SGD momentum; use topk:R"
            )
        if group["dampening"] or group.get("nesterov", False):
            raise ConfigError(
                f"compression 'dgc:R' supports SGD momentum without dampening or Nesterov (parameter {name!r} has "
                f"dampening={group['dampening']}, nesterov={group.get('nesterov', False)}); use topk:R"
            )
        momenta.add(float(group["momentum"]))
    if len(momenta) > 1:
        raise ConfigError(
            f"compression 'dgc:R': the parameters {', '.join(bucket.names)} share a fused bucket but have momenta "
            f"{sorted(momenta)}; give them one momentum or a bucket_bytes that separates them"
        )
    return momenta.pop() if momenta else 0.0
