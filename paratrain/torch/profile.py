"""Measuring each layer on this machine, as the pipeline partitioner needs it: time, activation and parameter bytes.

torchgpipe's ``balance_by_time`` and PipeDream's profiler do the same: run the layers in sequence on a sample
micro-batch, time every layer's forward and backward (the median of a few repeats, after a warm-up, since the
first call pays for allocation), and note the bytes of its output (what a stage boundary there would send) and
of its parameters (what replicas of its stage would allreduce).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from paratrain.pipeline.partition import LayerCost

__all__ = ["profile_layers"]


def profile_layers(layers: Sequence[nn.Module], sample: torch.Tensor, *, repeat: int = 5) -> list[LayerCost]:
    """The cost of every layer on ``sample`` (one micro-batch), measured here. Does not change the layers'
    parameters (gradients are computed on copies of the inputs and thrown away).

    Example:
        >>> costs = profile_layers([nn.Linear(8, 16), nn.ReLU()], torch.ones(4, 8), repeat=1)
        >>> [c.activation_bytes for c in costs], costs[0].param_bytes
        ([256, 256], 576)
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    costs: list[LayerCost] = []
    x = sample.detach()
    for layer in layers:
        times: list[float] = []
        out = x
        for i in range(repeat + 1):  # the first run warms up and is not counted
            inp = x.detach().clone().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                torch.autograd.backward(out, torch.ones_like(out))
            if i:
                times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        costs.append(LayerCost(statistics.median(times), out.numel() * out.element_size(), params))
        x = out.detach()
    return costs
