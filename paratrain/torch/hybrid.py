"""The hybrid strategy (Poseidon's HybComm): some layers by sufficient factors, the rest by a dense strategy.

The plan (:func:`paratrain.sfb.choose_schemes`) says which ``nn.Linear`` layers travel as sufficient factors
(:class:`~paratrain.torch.sfb.SfbLayer`); every other parameter is fused into buckets as usual and handed to the
dense strategy, allreduce or the parameter server. One launch order covers both kinds of unit
(:func:`~paratrain.fusion.buckets.plan_buckets` with ``separate=``), so every rank starts them in the same order
while backward runs (wait-free backprop for both).

Update rule, in one place:

- ``poseidon:allreduce`` / ``sfb``: every gradient is the mean over the workers (SFB layers rebuilt from the
  gathered factors, the rest averaged by allreduce); the wrapped torch optimizer then steps every parameter on
  every worker, identically. The same update as ``"allreduce"`` up to float rounding.
- ``poseidon`` (dense part on parameter servers, as in the paper): the SFB layers are stepped locally by the
  wrapped optimizer on the rebuilt mean gradient, identically on every worker; the other layers are pushed to
  the servers, which step them with their own copy of the optimizer (BSP), and pulled back. Under BSP both
  halves see the same mean gradient, so this too is synchronous SGD (or Adam...) on the whole model. The SFB
  layers start from rank 0's values (broadcast at construction), as the servers' keys do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paratrain.compression import Compressor
from paratrain.torch.bucket_strategy import Strategy
from paratrain.torch.fusion import FusedBucket
from paratrain.torch.sfb import SfbLayer
from paratrain.torch.strategies import ParameterServerStrategy

__all__ = ["HybridStrategy"]


class HybridStrategy(Strategy):
    """Units of one plan: :class:`SfbLayer` ones sent by their factors, fused buckets by ``dense``.

    Args:
        units: the plan's units in launch order: a fused bucket or an SFB layer each.
        dense: the strategy for the fused buckets (built over them in their relative order); None when every
            parameter travels by SFB.
    """

    def __init__(self, units: Sequence[FusedBucket | SfbLayer], dense: Strategy | None) -> None:
        super().__init__([u for u in units if isinstance(u, FusedBucket)])
        self.units = list(units)
        self.dense = dense
        self.sfb = [u for u in units if isinstance(u, SfbLayer)]
        self._dense_index: dict[int, int] = {}
        for k, unit in enumerate(units):
            if isinstance(unit, FusedBucket):
                self._dense_index[k] = len(self._dense_index)
        if self._dense_index and dense is None:
            raise ValueError("internal error: fused buckets without a dense strategy")
        self._dense_params = [p for bucket in self.buckets for p in bucket.params]

    def compressed(self, compressor: Compressor, optimizer: torch.optim.Optimizer) -> Strategy:
        """This hybrid with its dense part compressed (the SFB layers' factors travel as they are)."""
        if self.dense is not None:
            self.dense = self.dense.compressed(compressor, optimizer)
        return self

    def launch(self, k: int) -> None:
        """Starts unit ``k``: the allgather of an SFB layer's factors, or the dense strategy's bucket."""
        unit = self.units[k]
        if isinstance(unit, SfbLayer):
            unit.launch()
        elif self.dense is not None:
            self.dense.launch(self._dense_index[k])

    def finish(self) -> None:
        """Waits for the dense buckets, then rebuilds each SFB layer's gradient from the gathered factors."""
        try:
            if self.dense is not None:
                self.dense.finish()
        finally:
            errors = []
            for layer in self.sfb:
                try:
                    layer.finish()
                except Exception as exc:  # every handle is waited for; the first error is raised
                    errors.append(exc)
            if errors:
                raise errors[0]

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Steps the parameters (see the module docstring for the update rule)."""
        if not isinstance(self.dense, ParameterServerStrategy):
            optimizer.step()
            return
        if self.sfb:
            # the servers own the dense parameters: the local optimizer must not see their gradients
            hidden = [p.grad for p in self._dense_params]
            for p in self._dense_params:
                p.grad = None
            try:
                optimizer.step()
            finally:
                for p, grad in zip(self._dense_params, hidden, strict=True):
                    p.grad = grad
        self.dense.apply(optimizer)

    def close(self) -> None:
        """Closes the dense strategy and the SFB layers (waiting for what is in flight)."""
        try:
            if self.dense is not None:
                self.dense.close()
        finally:
            for layer in self.sfb:
                layer.close()
