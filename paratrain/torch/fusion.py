"""Fusion buffers: one preallocated flat tensor per bucket, with the parameters' gradients living inside it.

A :class:`FusedBucket` owns a 1-D CPU buffer laid out by its :class:`~paratrain.fusion.buckets.Bucket`::

    buffer   | grad p5 (flat) | grad p4 (flat) | ... | used p5 | used p4 | ... |
             '------------- bucket.numel --------------'---- one flag each ---'

For parameters on the CPU, ``param.grad`` is made a *view* of its slice (DDP's ``gradient_as_bucket_view``):
autograd then accumulates straight into the buffer, and writing the averaged result into the buffer updates
every gradient at once, with no per-parameter copies. ``zero_grad(set_to_none=True)`` (torch's default) drops
the views; the next gradient is then copied in once and the view is restored, so both settings are correct and
``set_to_none=False`` saves that copy. Parameters on other devices are copied to and from the CPU buffer.

The *used* flags solve DDP's unused-parameter problem without a second message: a rank sets a parameter's flag
to 1 when it has a gradient for it. After a ``mean`` allreduce a flag is 0 exactly when no rank had a gradient;
such a parameter keeps ``grad = None`` (and the optimizer skips it, as it would in one process), while a
parameter that some ranks did not use gets the mean with zeros from those ranks, which is the gradient of the
mean loss over everybody's samples. The buffer is allocated once; a step allocates nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paratrain.fusion.buckets import Bucket

__all__ = ["FusedBucket"]


class FusedBucket:
    """The flat buffer of one bucket and the bookkeeping of which gradients it holds this step.

    Args:
        bucket: the plan entry.
        params: every managed parameter in registration order (the bucket picks its own by index).
        names: their names, for error messages.
        flags: append the *used* flags (needed by allreduce, not by the parameter server).

    Not thread-safe; the strategy serialises calls.
    """

    def __init__(
        self, bucket: Bucket, params: Sequence[torch.Tensor], names: Sequence[str], *, flags: bool = True
    ) -> None:
        self.bucket = bucket
        self.params = [params[i] for i in bucket.params]
        self.names = [names[i] for i in bucket.params]
        dtype = self.params[0].dtype
        extra = len(self.params) if flags else 0
        self.buffer = torch.zeros(bucket.numel + extra, dtype=dtype)
        self.grads = self.buffer[: bucket.numel]  # what a parameter server receives
        self.flags = self.buffer[bucket.numel :]
        self.views = [
            self.buffer[off : off + p.numel()].view(p.shape) for off, p in zip(bucket.offsets, self.params, strict=True)
        ]
        self._on_cpu = [p.device.type == "cpu" for p in self.params]
        self._taken = [False] * len(self.params)

    def _is_view(self, j: int) -> bool:
        grad = self.params[j].grad
        return grad is not None and self._on_cpu[j] and grad.data_ptr() == self.views[j].data_ptr()

    def take(self, j: int) -> None:
        """Moves parameter ``j``'s gradient into the buffer (a no-op when it already lives there).

        Raises:
            RuntimeError: the gradient is sparse or has another dtype than the parameter.
        """
        param = self.params[j]
        grad = param.grad
        self._taken[j] = True
        if self.flags.numel():
            self.flags[j] = 0 if grad is None else 1
        if grad is None:
            self.views[j].zero_()
            return
        if grad.is_sparse:
            raise RuntimeError(
                f"parameter {self.names[j]!r} has a sparse gradient, which the fused strategies do not support; "
                "use a dense embedding (sparse=False)"
            )
        if self._is_view(j):
            return
        self.views[j].copy_(grad.reshape(self.views[j].shape))
        if self._on_cpu[j]:
            param.grad = self.views[j]  # from now on autograd accumulates into the buffer

    def take_rest(self) -> None:
        """Takes every parameter not taken yet this step (those whose hook did not fire: unused, or no backward)."""
        for j, taken in enumerate(self._taken):
            if not taken:
                self.take(j)

    def give(self, reduced: torch.Tensor) -> None:
        """Writes the reduced buffer back into the gradients; a parameter no rank had a gradient for stays None."""
        if reduced.data_ptr() != self.buffer.data_ptr():  # an in-place allreduce left it in the buffer already
            self.buffer.copy_(reduced)
        used = self.flags.tolist() if self.flags.numel() else [1.0] * len(self.params)
        for j, param in enumerate(self.params):
            if used[j] == 0.0:
                continue  # no rank had a gradient: leave grad as it was (None on every rank)
            if self._on_cpu[j]:
                if not self._is_view(j):
                    param.grad = self.views[j]
            elif param.grad is None:
                param.grad = self.views[j].to(param.device)
            else:
                param.grad.copy_(self.views[j])
        self._taken = [False] * len(self.params)

    def reset(self) -> None:
        """Forgets which gradients were taken (the step ended without :meth:`give`)."""
        self._taken = [False] * len(self.params)

    def read_params(self) -> torch.Tensor:
        """The parameters' current values, flattened in bucket order (a new CPU tensor)."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.params])

    @torch.no_grad()
    def write_params(self, flat: torch.Tensor) -> None:
        """Copies a flat vector laid out like the bucket into the parameters, in place."""
        for off, param in zip(self.bucket.offsets, self.params, strict=True):
            param.copy_(flat[off : off + param.numel()].view(param.shape))
