"""Allreduce with a compressed wire format: each bucket leaves as 16-bit floats, top-k pairs or PowerSGD factors.

The update rule is the ``"allreduce"`` strategy's (the mean gradient, then the wrapped optimizer on every worker)
with the mean replaced by its compressed estimate (:mod:`paratrain.compression`)::

    fp16 / bf16    allreduce_async(cast(buffer / P), sum)                      -> grads = float(sum)
    topk:R         (idx, val) of grads + residual; allgather_async(pairs)      -> grads = scatter-add / P
    dgc:R          the same of the local velocity + residual                  -> grads = scatter-add / P
                                                                                  - m * SGD's momentum buffer
    powersgd:R     allreduce_async([P of each matrix | vectors | flags], mean) -> in finish: orthonormalise P,
                   allreduce_async([Q of each matrix], mean)                   -> grads = P Q^T, vectors as reduced

Every worker decodes the same reduced data in the same way, so the replicas stay identical. The used-flags of
:class:`~paratrain.torch.fusion.FusedBucket` ride with the 16-bit cast and with PowerSGD's vectors; top-k sends
none, so under top-k every parameter counts as used (one that no worker used gets a zero gradient rather than
None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from paratrain.compression import Cast, Compressor, LowRank, TopK
from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.torch.fusion import FusedBucket
from paratrain.torch.strategies import AllreduceStrategy
from paratrain.transport.base import Handle

__all__ = ["CompressedAllreduceStrategy"]

_INDEX = {4: np.int32, 8: np.int64}  # an index travels in the bits of one value of the gradient's width


class CompressedAllreduceStrategy(AllreduceStrategy):
    """The ``"allreduce"`` strategy with ``compression=`` (see the module docstring).

    Args:
        context: this rank's context.
        buckets: the fusion buffers (with used-flags), in plan order.
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
        context: Context,
        buckets: Sequence[FusedBucket],
        compressor: Compressor,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        super().__init__(context, buckets)  # apply() (the wrapped optimizer) and close() are allreduce's
        self.compressor = compressor
        self._optimizer = optimizer
        #: per bucket, the momentum DGC corrects for (0: none, plain top-k)
        self._momentum = [0.0] * len(self.buckets)
        if isinstance(compressor, TopK) and compressor.momentum_correction:
            self._momentum = [_sgd_momentum(optimizer, b) for b in self.buckets]
        if isinstance(compressor, TopK):
            for bucket in self.buckets:
                if bucket.grads.element_size() not in _INDEX or not bucket.grads.is_floating_point():
                    raise ConfigError(
                        f"top-k compression sends float32 or float64 gradients, not {bucket.grads.dtype} "
                        f"(parameters {', '.join(bucket.names)})"
                    )
        self._matrices: list[list[int]] = []  # per bucket: which of its parameters PowerSGD compresses
        self._keep: list[Any] = []  # per bucket: indices of the buffer's elements that travel uncompressed
        if isinstance(compressor, LowRank):
            for b in self.buckets:
                matrices = [j for j, p in enumerate(b.params) if compressor.compressible(tuple(p.shape))]
                keep = np.ones(b.buffer.numel(), dtype=bool)
                for j in matrices:
                    keep[b.bucket.offsets[j] : b.bucket.offsets[j] + b.params[j].numel()] = False
                self._matrices.append(matrices)
                self._keep.append(np.flatnonzero(keep))  # indices: gathering a few of millions by mask is slow

    # -- launch: the first message of each bucket -------------------------------------------------------------

    def launch(self, k: int) -> None:
        """Starts bucket ``k``'s (first) collective with its compressed gradients. Does not block."""
        bucket, comp, ctx = self.buckets[k], self.compressor, self._context
        if isinstance(comp, Cast):
            wire = torch.bfloat16 if comp.dtype == "bfloat16" else torch.float16
            self._handles[k] = ctx.allreduce_async((bucket.buffer / ctx.world_size).to(wire), op="sum")
        elif isinstance(comp, TopK):
            grads = bucket.grads.numpy()
            idx, values = comp.compress(f"bucket{k}", grads, momentum=self._momentum[k])
            pairs = np.empty((idx.size, 2), dtype=grads.dtype)
            pairs[:, 0] = idx.astype(_INDEX[grads.itemsize]).view(grads.dtype)
            pairs[:, 1] = values
            self._handles[k] = ctx.allgather_async(pairs)
        elif isinstance(comp, LowRank):
            mats = [self._matrix(bucket, j) for j in self._matrices[k]]
            # the vectors, small matrices and used-flags travel uncompressed (gathered before first() writes g + e
            # into the matrices' part of the buffer)
            dense = bucket.buffer.numpy()[self._keep[k]]
            ps = comp.first(f"bucket{k}", mats, inplace=True)
            self._handles[k] = ctx.allreduce_async(np.concatenate([*(p.reshape(-1) for p in ps), dense]), op="mean")
        else:
            raise ConfigError(f"no allreduce path for compressor {comp!r}")

    def _matrix(self, bucket: FusedBucket, j: int) -> Any:
        view = bucket.buffer_views[j]
        return view.reshape(view.shape[0], -1).numpy()

    # -- finish: decode (PowerSGD's second round first) --------------------------------------------------------

    def finish(self) -> None:
        """Waits for every bucket and writes the decoded mean into ``param.grad``. Blocks."""
        handles, self._handles = self._handles, [None] * len(self.buckets)
        if any(h is None for h in handles):
            raise RuntimeError("internal error: a bucket was never launched before finish()")
        comp = self.compressor
        if isinstance(comp, LowRank):
            self._finish_low_rank(comp, handles)
            return
        for k, (bucket, handle) in enumerate(zip(self.buckets, handles, strict=True)):
            assert handle is not None
            reduced = handle.wait()
            if isinstance(comp, Cast):
                bucket.give(reduced.to(bucket.buffer.dtype))
            else:
                assert isinstance(comp, TopK)
                grads = bucket.grads.numpy()
                pairs = np.asarray(reduced).reshape(-1, 2)
                idx = pairs[:, 0].copy().view(_INDEX[grads.itemsize])
                TopK.decompress(
                    grads.size, idx, pairs[:, 1], scale=1.0 / self._context.world_size, dtype=grads.dtype, out=grads
                )
                bucket.flags.fill_(1)
                if self._momentum[k]:
                    self._replace_momentum(k)
                bucket.give(bucket.buffer)

    def _replace_momentum(self, k: int) -> None:
        """DGC: the mean ``s`` already holds the momentum; ``grad = s - m·buffer`` makes SGD's ``buffer = s``."""
        assert self._optimizer is not None
        bucket, m = self.buckets[k], self._momentum[k]
        for j, param in enumerate(bucket.params):
            buf = self._optimizer.state.get(param, {}).get("momentum_buffer")
            if buf is not None:  # none before the first step: SGD then starts its buffer at the gradient, s
                view = bucket.buffer_views[j]  # (host memory where the bucket is staged: before give() copies it)
                view.sub_(buf.reshape(view.shape).to(view.device), alpha=m)

    def _finish_low_rank(self, comp: LowRank, handles: Sequence[Handle[Any] | None]) -> None:
        seconds: list[tuple[list[Any], Any, Handle[Any] | None]] = []
        for k, handle in enumerate(handles):
            assert handle is not None
            reduced = np.asarray(handle.wait())
            bucket, pos, ps = self.buckets[k], 0, []
            for j in self._matrices[k]:
                m = self._matrix(bucket, j)
                r = min(comp.rank, *m.shape)
                ps.append(LowRank.orthonormal(reduced[pos : pos + m.shape[0] * r].reshape(m.shape[0], r)))
                pos += m.shape[0] * r
            dense = reduced[pos:]
            qs = comp.second(f"bucket{k}", ps) if ps else []
            second = (
                self._context.allreduce_async(np.concatenate([q.reshape(-1) for q in qs]), op="mean") if qs else None
            )
            seconds.append((ps, dense, second))
        for k, (ps, dense, second) in enumerate(seconds):
            bucket = self.buckets[k]
            buffer = bucket.buffer.numpy()
            if second is not None:
                flat, pos, qs = np.asarray(second.wait()), 0, []
                for p, j in zip(ps, self._matrices[k], strict=True):
                    cols = bucket.params[j].numel() // p.shape[0]
                    qs.append(flat[pos : pos + cols * p.shape[1]].reshape(cols, p.shape[1]))
                    pos += cols * p.shape[1]
                comp.finish(f"bucket{k}", qs)  # writes each approximation into its matrix's part of the buffer
            buffer[self._keep[k]] = dense
            bucket.give(bucket.buffer)


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
