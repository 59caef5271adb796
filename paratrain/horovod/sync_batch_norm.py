"""Horovod's ``SyncBatchNorm``: batch normalisation whose statistics are those of the whole job's batch.

In training, each rank adds up its per-channel sums of x and x^2 and its element count; one allreduce (Sum) gives
the job's, hence the mean and the biased variance that normalise, and the unbiased variance that the running
statistics take (``running = (1 - momentum) running + momentum batch``, as torch's BatchNorm). The allreduce is
the differentiable one of :mod:`paratrain.horovod.ops`, whose gradient is the allreduce of the gradient: autograd
then carries every rank's share of the loss through the shared statistics, so the gradients equal those of one
BatchNorm over the concatenated batch. In evaluation it is torch's BatchNorm with the running statistics.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.horovod.basics import Sum
from paratrain.horovod.ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm1d/2d/3d`` with the job's batch statistics in training (see the module docstring);
    inputs of shape (N, C, ...), as torch's."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return super().forward(input)
        c = input.shape[1]
        dims = [0, *range(2, input.dim())]
        local = torch.cat(
            [
                input.sum(dim=dims),
                (input * input).sum(dim=dims),
                torch.full((1,), input.numel() / c, dtype=input.dtype, device=input.device),
            ]
        )
        total = allreduce(local, op=Sum, name="sync_batch_norm")
        count = total[-1]
        mean = total[:c] / count
        var = total[c : 2 * c] / count - mean * mean
        if self.training and self.track_running_stats:
            assert self.running_mean is not None and self.running_var is not None
            assert self.num_batches_tracked is not None
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else float(self.momentum)
                unbiased = var.detach() * count.detach() / max(float(count.detach()) - 1.0, 1.0)
                self.running_mean.mul_(1 - momentum).add_(momentum * mean.detach())
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased)
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out
