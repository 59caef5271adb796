"""Splitting a sequence of layers into pipeline stages: the slowest stage, communication included, as fast as possible.

Pure. Each layer has a measured cost (:class:`LayerCost`: forward + backward seconds, output activation bytes,
parameter bytes). A pipeline runs at the pace of its slowest stage, so a split into contiguous stages should
minimise ``max_s stage_time(s)``, where a stage's time is its layers' compute plus, for every stage but the last,
sending its output activation forward and receiving its gradient back (``2 * activation / bandwidth``).

:func:`partition` solves that exactly by dynamic programming over prefixes (``best[j][k]``: the best slowest
stage for the first j layers on k stages), O(L^2 K); it never leaves a stage empty. :func:`partition_replicated`
is PipeDream's planner (Narayanan et al., SOSP 2019): with W workers, a stage may be replicated r times (data
parallelism inside the stage): its compute divides by r, and its replicas then allreduce their parameters,
``2 (r - 1) / r * params / bandwidth`` per mini-batch under the ring's cost. Both are tested against brute force.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LayerCost", "Split", "partition", "partition_replicated", "stage_time"]


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer, as profiled on the machine that will run it.

    Attributes:
        seconds: forward plus backward time of one micro-batch.
        activation_bytes: bytes of its output for one micro-batch (what goes to the next stage).
        param_bytes: bytes of its parameters (what replicas of its stage allreduce).
    """

    seconds: float
    activation_bytes: int = 0
    param_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Split:
    """A split: ``bounds[s] = (first, stop)`` layers of stage s, ``replicas[s]`` workers for it, ``times[s]`` its
    time per micro-batch (communication included), and the slowest of them."""

    bounds: tuple[tuple[int, int], ...]
    replicas: tuple[int, ...]
    times: tuple[float, ...]

    @property
    def slowest(self) -> float:
        """The pipeline's time per micro-batch in steady state."""
        return max(self.times)

    @property
    def balance(self) -> tuple[int, ...]:
        """Layers per stage, as torchgpipe's ``balance=`` takes it."""
        return tuple(stop - first for first, stop in self.bounds)


def stage_time(
    layers: Sequence[LayerCost], first: int, stop: int, *, bandwidth: float, last: bool, replicas: int = 1
) -> float:
    """Seconds per micro-batch of a stage holding layers ``[first, stop)``: compute divided over its replicas,
    plus its boundary activation there and back unless it is the last stage, plus its replicas' parameter
    allreduce (ring: ``2 (r - 1) / r`` of the parameters)."""
    compute = sum(layer.seconds for layer in layers[first:stop]) / replicas
    boundary = 0.0 if last else 2 * layers[stop - 1].activation_bytes / bandwidth
    params = sum(layer.param_bytes for layer in layers[first:stop])
    sync = 2 * (replicas - 1) / replicas * params / bandwidth
    return compute + boundary + sync


def partition(layers: Sequence[LayerCost], stages: int, *, bandwidth: float = math.inf) -> Split:
    """The contiguous split of ``layers`` into ``stages`` non-empty stages whose slowest stage is fastest.

    Raises:
        ValueError: fewer layers than stages, or fewer than one stage.

    Example:
        >>> costs = [LayerCost(s) for s in (4.0, 1.0, 1.0, 1.0, 1.0, 4.0)]
        >>> partition(costs, 3).balance
        (1, 4, 1)
    """
    n = len(layers)
    if stages < 1 or n < stages:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    return _solve(tuple(layers), stages, bandwidth, replicate=False)


def partition_replicated(layers: Sequence[LayerCost], workers: int, *, bandwidth: float) -> Split:
    """PipeDream's split: stages and replica counts using at most ``workers`` workers, slowest stage fastest.

    A single stage replicated ``workers`` times is plain data parallelism; one replica per stage is a plain
    pipeline; the solver picks between them and everything in between.

    Example:
        >>> compute_bound = [LayerCost(1.0, activation_bytes=10**9, param_bytes=1) for _ in range(4)]
        >>> partition_replicated(compute_bound, 4, bandwidth=1e9).replicas  # activations are dear: replicate
        (4,)
    """
    if workers < 1 or not layers:
        raise ValueError(f"need at least one worker and one layer, got {workers} and {len(layers)}")
    return _solve(tuple(layers), workers, bandwidth, replicate=True)


def _solve(layers: tuple[LayerCost, ...], budget: int, bandwidth: float, *, replicate: bool) -> Split:
    n = len(layers)

    @functools.cache
    def best(stop: int, left: int) -> tuple[float, tuple[tuple[int, int, int], ...]]:
        """Best slowest stage for layers [0, stop) as the *first* stages of the pipeline, with ``left`` workers
        (exactly ``left`` stages when not replicating); returns (time, ((first, stop, replicas), ...))."""
        options: list[tuple[float, tuple[tuple[int, int, int], ...]]] = []
        for r in range(1, left + 1) if replicate else (1,):
            rest = left - r
            if rest == 0:
                options.append((_time(0, stop, r, last=stop == n), ((0, stop, r),)))
                continue
            for first in range(1, stop):
                if not replicate and first < rest:
                    continue  # each earlier stage needs a layer
                head_time, head = best(first, rest)
                if head_time == math.inf:
                    continue
                tail = _time(first, stop, r, last=stop == n)
                options.append((max(head_time, tail), (*head, (first, stop, r))))
        if not replicate and left > stop:
            return math.inf, ()
        return min(options, default=(math.inf, ()), key=lambda option: option[0])

    def _time(first: int, stop: int, replicas: int, *, last: bool) -> float:
        return stage_time(layers, first, stop, bandwidth=bandwidth, last=last, replicas=replicas)

    if replicate:
        time, stages = min((best(n, w) for w in range(1, budget + 1)), key=lambda option: option[0])
    else:
        time, stages = best(n, budget)
    if time == math.inf:
        raise ValueError("no split exists")  # unreachable after the argument checks
    return Split(
        bounds=tuple((first, stop) for first, stop, _ in stages),
        replicas=tuple(r for _, _, r in stages),
        times=tuple(_time(first, stop, r, last=stop == n) for first, stop, r in stages),
    )
