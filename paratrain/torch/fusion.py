"""Fusion buffers: one preallocated flat tensor per bucket, with the parameters' gradients living inside it.

A :class:`FusedBucket` owns a 1-D CPU buffer laid out by its :class:`~paratrain.fusion.buckets.Bucket`::

    buffer   | grad p5 (flat) | grad p4 (flat) | ... | used p5 | used p4 | ... |
             '------------- bucket.numel --------------'---- one flag each ---'

For parameters on the CPU, ``param.grad`` is made a *view* of its slice (DDP's ``gradient_as_bucket_view``):
autograd then accumulates straight into the buffer, and writing the averaged result into the buffer updates
every gradient at once, with no per-parameter copies. ``zero_grad(set_to_none=True)`` (torch's default) drops
the views; the next gradient is then copied in once and the view is restored, so both settings are correct and
``set_to_none=False`` saves that copy. Parameters on other devices are copied to and from the CPU buffer.

CUDA parameters (a bucket holds one device's: the plan groups by dtype and device) are *staged in the background*,
Poseidon's GPU/CPU pipeline: the buffer is pinned host memory, and each gradient is copied into it from its hook
on a stream of the bucket's own, which first waits for the stream that produced the gradient, so the hook returns
at once and the copy overlaps the rest of backward; :meth:`FusedBucket.staged` is a CUDA event behind the step's
copies, which the communication waits on before it reads the buffer (``allreduce_async_(ready=...)``), on its own
thread. The results go back with asynchronous host-to-device copies on the caller's stream, ordered before the
optimizer's kernels; the next step's host writes into the buffer first wait for those copies (an event).

Where the collectives hand CUDA tensors to NCCL (:mod:`paratrain.collectives.engine`), staging would only add
two PCIe copies: such a bucket keeps its buffer on the device (``on_device=True``), and its parameters' gradients
become views of it exactly as on the CPU (DDP's layout); the allreduce then runs device memory to device memory.

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
        on_device: keep a CUDA bucket's buffer on its device, with the gradients as views of it, as on the
            CPU (for a collective engine that reduces device memory itself: NCCL), instead of staging it.

    Not thread-safe; the strategy serialises calls.
    """

    def __init__(
        self,
        bucket: Bucket,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        *,
        flags: bool = True,
        on_device: bool = False,
    ) -> None:
        self.bucket = bucket
        self.params = [params[i] for i in bucket.params]
        self.names = [names[i] for i in bucket.params]
        dtype = self.params[0].dtype
        extra = len(self.params) if flags else 0
        devices = {p.device for p in self.params if p.device.type == "cuda"}
        home = next(iter(devices)) if devices and on_device else torch.device("cpu")
        staged = bool(devices) and home.type == "cpu"
        # CUDA staged: a pinned buffer and a stream of the bucket's own for the copies into it (module docstring)
        self._stream = torch.cuda.Stream(next(iter(devices))) if staged else None  # type: ignore[no-untyped-call]
        self._copied = False  # device-to-host copies queued on _stream this step, not yet in an event
        self._given: torch.cuda.Event | None = None  # behind the last give()'s host-to-device copies
        self.buffer = torch.zeros(bucket.numel + extra, dtype=dtype, pin_memory=staged, device=home)
        self.grads = self.buffer[: bucket.numel]  # what a parameter server receives
        self.flags = self.buffer[bucket.numel :]
        self.views = [
            self.buffer[off : off + p.numel()].view(p.shape) for off, p in zip(bucket.offsets, self.params, strict=True)
        ]
        self._at_home = [p.device == self.buffer.device for p in self.params]  # at home: gradients are views
        self._taken = [False] * len(self.params)

    def _is_view(self, j: int) -> bool:
        grad = self.params[j].grad
        return grad is not None and self._at_home[j] and grad.data_ptr() == self.views[j].data_ptr()

    def take(self, j: int) -> None:
        """Moves parameter ``j``'s gradient into the buffer (a no-op when it already lives there).

        Raises:
            RuntimeError: the gradient is sparse or has another dtype than the parameter.
        """
        param = self.params[j]
        grad = param.grad
        if self._given is not None:  # the last step's results may still be on their way out of the buffer
            self._given.synchronize()
            self._given = None
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
        if self._stream is not None and grad.is_cuda:
            self._stream.wait_stream(torch.cuda.current_stream(grad.device))  # after the kernels that made grad
            with torch.cuda.stream(self._stream):
                self.views[j].copy_(grad.reshape(self.views[j].shape), non_blocking=True)
            grad.record_stream(self._stream)  # its memory is not reused before the copy is done
            self._copied = True
            return
        self.views[j].copy_(grad.reshape(self.views[j].shape))
        if self._at_home[j]:
            param.grad = self.views[j]  # from now on autograd accumulates into the buffer

    def staged(self) -> torch.cuda.Event | None:
        """A CUDA event behind the device-to-host copies :meth:`take` queued since the last call (None if it
        queued none): the buffer holds this step's gradients once it completed."""
        if not self._copied or self._stream is None:
            return None
        self._copied = False
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    def wait_staged(self) -> None:
        """Blocks until the buffer holds every gradient :meth:`take` queued (for strategies that read it at once)."""
        event = self.staged()
        if event is not None:
            event.synchronize()

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
        pinned = self._stream is not None  # then the copies to the device run asynchronously, on its stream
        for j, param in enumerate(self.params):
            if used[j] == 0.0:
                continue  # no rank had a gradient: leave grad as it was (None on every rank)
            if self._at_home[j]:
                if not self._is_view(j):
                    param.grad = self.views[j]
            elif param.grad is None:
                param.grad = self.views[j].to(param.device, non_blocking=pinned)
            else:
                param.grad.copy_(self.views[j], non_blocking=pinned)
        if pinned and self._stream is not None:
            self._given = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._given.record(torch.cuda.current_stream(self._stream.device))
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
