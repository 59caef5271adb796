"""What a model profile measures for split layers (``tp:N``, ``soap:FILE``): how long a layer's part takes, and
what one collective call on a torch tensor costs beyond its messages.

* **split layers** (:func:`split_ratios`): a worker's part of a split linear layer or convolution does not take
  1/N of the layer's time (a small convolution's part took 60-70 % of it at N = 2 here, a small linear layer's
  75-100 %: fixed costs per call do not shrink). Each layer that splits is timed alone on the input it sees in
  the model, whole and as part 0 of a column and a row split at degrees 2 and 4 where they divide
  (:class:`paratrain.torch.soap.SplitLayer`), forward and backward, medians of repeats, in the process that
  profiles the model alone (processes profiling at once end their steps at different times, so a part timed
  after the others stopped would look faster than the whole timed while they ran); the profile keeps the part's
  time over the whole's, and the layer's time in the training steps times that ratio is the part's
  (:attr:`paratrain.sim.machine.LayerCost.split_s`), so the in-step timing stays the one calibration.
* **a collective call** (:func:`call_seconds`): split layers exchange activations by many small collectives on
  torch tensors through the public API; each costs its checks, its agreement and the tensor's trip through the
  API besides the bytes, about 0.1 ms between two processes here, against the shared-memory path's 13 us per
  message. Timed as the median of one-element allreduces among the profiling processes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from paratrain.runtime.context import Context

__all__ = ["DEGREES", "call_seconds", "combined_split_s", "split_key", "split_ratios"]

#: The tensor-parallel degrees a profile times each split layer at.
DEGREES = (2, 4)


def split_key(split: str, degree: int) -> str:
    """How a profile names a split: ``"column/2"``."""
    return f"{split}/{degree}"


def _median_pass(run: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median (forward, backward) seconds of ``run`` (which returns its output) over ``repeats`` after warm-up."""
    forward, backward = [], []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        if i >= 3:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    return statistics.median(forward), statistics.median(backward)


def split_ratios(model: torch.nn.Module, x: torch.Tensor, repeats: int) -> dict[str, dict[str, list[float]]]:
    """For each layer of ``model``'s chain that splits: ``{"column/2": [forward ratio, backward ratio], ...}``,
    part 0's time over the whole layer's, on the input the layer sees when ``model`` runs ``x``."""
    import torch

    from paratrain.torch.soap import SplitLayer, chain_layers

    modules = dict(model.named_modules())
    inputs: dict[str, torch.Tensor] = {}
    handles = [
        modules[name].register_forward_pre_hook(lambda m, a, n=name: inputs.__setitem__(n, a[0].detach()))
        for name, shape in chain_layers(model)
        if shape is not None and shape.kind == "layer"
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    found: dict[str, dict[str, list[float]]] = {}
    for name, shape in chain_layers(model):
        if shape is None or shape.kind != "layer":  # a block or vocabulary part moves inside it: timed with its group
            continue
        layer, seen = modules[name], inputs[name]
        whole_in = seen.clone().requires_grad_(True)
        whole = _median_pass(lambda m=layer, i=whole_in: m(i), repeats)  # type: ignore[misc]
        ratios: dict[str, list[float]] = {}
        for degree in DEGREES:
            for split, dim in (("column", shape.out_features), ("row", shape.in_features)):
                if dim % degree:
                    continue
                part = SplitLayer(layer, split, degree, 0)
                fed = seen if split == "column" else seen[:, : seen.shape[1] // degree]
                fed = fed.contiguous().clone().requires_grad_(True)
                f, b = _median_pass(lambda p=part, i=fed: p(i), repeats)  # type: ignore[misc]
                ratios[split_key(split, degree)] = [
                    f / whole[0] if whole[0] else 1.0,
                    b / whole[1] if whole[1] else 1.0,
                ]
        found[name] = ratios
    return found


def call_seconds(ctx: Context, repeats: int) -> float:
    """The median seconds of a one-element allreduce of a torch tensor through the public API among the ranks of
    ``ctx`` (every rank calls it)."""
    import torch

    one = torch.zeros(1)
    times = []
    for i in range(repeats + 5):
        t0 = time.perf_counter()
        ctx.allreduce(one)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def combined_split_s(
    forward_s: float, backward_s: float, runs: list[Mapping[str, list[float]]]
) -> dict[str, tuple[float, float]]:
    """A layer's part times: its in-step times times the median over processes of each split's ratios."""
    keys = set(runs[0]) if runs else set()
    return {
        key: (
            forward_s * statistics.median(r[key][0] for r in runs),
            backward_s * statistics.median(r[key][1] for r in runs),
        )
        for key in sorted(keys)
        if all(key in r for r in runs)
    }
