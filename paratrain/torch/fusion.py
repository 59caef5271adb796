"""Fusion buffers: one preallocated flat tensor per bucket, with the parameters' gradients living inside it.

A :class:`FusedBucket` owns a 1-D buffer laid out by its :class:`~paratrain.fusion.buckets.Bucket`::

    buffer   | grad p5 (flat) | grad p4 (flat) | ... | used p5 | used p4 | ... |
             '------------- bucket.numel --------------'---- one flag each ---'

``param.grad`` is made a *view* of its slice of the bucket's *home* buffer, on the parameters' own device (DDP's
``gradient_as_bucket_view``): autograd then accumulates straight into it, and writing the averaged result into
the buffer updates every gradient at once, with no per-parameter copies. ``zero_grad(set_to_none=True)`` (torch's
default) drops the views; the next gradient is then copied in once (on the device that computed it) and the view
is restored, so both settings are correct and ``set_to_none=False`` saves that copy.

What the communication reads (:attr:`FusedBucket.buffer`) is the home buffer itself for CPU parameters, and for
CUDA parameters where a collective engine reduces device memory (NCCL, :mod:`paratrain.collectives.torch_engines`).
Otherwise a CUDA bucket is *staged*: the communication reads a pinned host mirror of the home buffer, filled by
one device-to-host copy of the whole bucket when it is complete (:meth:`FusedBucket.staged`, queued on a stream of
the bucket's own after the kernels that produced the gradients, so the hook returns at once and the copy overlaps
the rest of backward: Poseidon's GPU/CPU pipeline), and the results go back by one host-to-device copy on the
caller's stream, ordered before the optimizer's kernels. One copy each way per bucket, whatever its number of
parameters: each copy costs a launch and a DMA set-up, which dominate for small gradients.

The *used* flags solve DDP's unused-parameter problem without a second message: a rank's flag for a parameter is
1 when it has a gradient for it, written when the bucket leaves (one fill, plus a zero per unused parameter).
After a ``mean`` allreduce a flag is 0 exactly when no rank had a gradient (read back only on a rank that lacked
one itself: every other flag is at least 1 / world size); such a parameter keeps ``grad = None`` (and the
optimizer skips it, as it would in one process), while a parameter that some ranks did not use gets the mean with
zeros from those ranks, which is the gradient of the mean loss over everybody's samples. The buffers are
allocated once; a step allocates nothing here. Every host wait on the device has a deadline
(:func:`~paratrain.device.wait_event`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paratrain.device import DEVICE_TIMEOUT, to_device, to_host, wait_event
from paratrain.fusion.buckets import Bucket

__all__ = ["FusedBucket"]


class FusedBucket:
    """The flat buffer of one bucket and the bookkeeping of which gradients it holds this step.

    Args:
        bucket: the plan entry.
        params: every managed parameter in registration order (the bucket picks its own by index).
        names: their names, for error messages.
        flags: append the *used* flags (needed by allreduce, not by the parameter server).
        on_device: a collective engine reduces a CUDA bucket's device memory itself (NCCL): the communication
            reads the home buffer, with no host mirror.
        timeout: seconds a host wait on the device may take.

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
        timeout: float = DEVICE_TIMEOUT,
    ) -> None:
        self.bucket = bucket
        self.params = [params[i] for i in bucket.params]
        self.names = [names[i] for i in bucket.params]
        self.timeout = timeout
        dtype = self.params[0].dtype
        extra = len(self.params) if flags else 0
        devices = {p.device for p in self.params if p.device.type == "cuda"}
        home_device = next(iter(devices)) if devices else torch.device("cpu")
        home = torch.zeros(bucket.numel + extra, dtype=dtype, device=home_device)
        #: the buffer the parameters' gradients are views of (on their device)
        self.home = home
        mirrored = home_device.type == "cuda" and not on_device
        # staged: a pinned host mirror (what the communication reads) and a stream of the bucket's own for the copy
        self._stream = torch.cuda.Stream(home_device) if mirrored else None  # type: ignore[no-untyped-call]
        #: what the communication reads and the results are written into
        self.buffer = torch.zeros(bucket.numel + extra, dtype=dtype, pin_memory=True) if mirrored else home
        self.grads = self.buffer[: bucket.numel]  # what a parameter server receives
        self.flags = self.buffer[bucket.numel :]
        self._home_grads = home[: bucket.numel]
        self.views = self._views_of(home)
        #: views of :attr:`buffer` (host memory when staged) in the layout of :attr:`views`
        self.buffer_views = self._views_of(self.buffer) if mirrored else self.views
        self._at_home = [p.device == home.device for p in self.params]  # at home: gradients are views
        self._taken = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._staged: torch.cuda.Event | None = None  # behind this step's device-to-host copy (staged buckets)
        self._sealed = False  # this step's flags written (and the staged copy queued)
        self._given: torch.cuda.Event | None = None  # behind the last give()'s host-to-device copy

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[off : off + p.numel()].view(p.shape) for off, p in zip(self.bucket.offsets, self.params, strict=True)
        ]

    def _is_view(self, j: int) -> bool:
        grad = self.params[j].grad
        return grad is not None and self._at_home[j] and grad.data_ptr() == self.views[j].data_ptr()

    def take(self, j: int) -> None:
        """Moves parameter ``j``'s gradient into the bucket (a no-op when it already lives there).

        Raises:
            RuntimeError: the gradient is sparse or has another dtype than the parameter.
        """
        param = self.params[j]
        grad = param.grad
        self._taken[j] = True
        self._used[j] = grad is not None
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
        if self._at_home[j]:
            param.grad = self.views[j]  # from now on autograd accumulates into the buffer

    def staged(self) -> torch.cuda.Event | None:
        """Seals this step's bucket: writes the used flags, and for a staged bucket queues the one device-to-host
        copy of the gradients into the host mirror. Returns a CUDA event behind that copy (the buffer holds this
        step's gradients once it completed), or None where the buffer is ready now. Idempotent within a step."""
        if self._sealed:
            return self._staged
        self._sealed = True
        if self.flags.numel():  # one fill, then a zero per unused parameter (rare): no host data to copy over
            self.flags.fill_(1)
            for j, used in enumerate(self._used):
                if not used:
                    self.flags[j] = 0
        if self._stream is None:
            return None
        stream, home = self._stream, self.home
        stream.wait_stream(torch.cuda.current_stream(home.device))  # after the kernels that made the gradients
        if self._given is not None:  # and after the last step's results left the mirror
            stream.wait_event(self._given)
            self._given = None
        with torch.cuda.stream(stream):
            self.grads.copy_(self._home_grads, non_blocking=True)
        self._staged = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._staged.record(stream)
        return self._staged

    def wait_staged(self) -> None:
        """Seals the bucket (:meth:`staged`) and blocks until :attr:`buffer` holds its gradients (for strategies
        that read it at once).

        Raises:
            DeviceTimeoutError: the copy did not complete within the bucket's timeout.
        """
        event = self.staged()
        if event is not None:
            wait_event(event, self.timeout, "the copy of a gradient bucket to host memory")

    def take_rest(self) -> None:
        """Takes every parameter not taken yet this step (those whose hook did not fire: unused, or no backward)."""
        for j, taken in enumerate(self._taken):
            if not taken:
                self.take(j)

    def give(self, reduced: torch.Tensor) -> None:
        """Writes the reduced buffer back into the gradients; a parameter no rank had a gradient for stays None."""
        if reduced.data_ptr() != self.buffer.data_ptr():  # an in-place allreduce left it in the buffer already
            self.buffer.copy_(reduced)
        # a parameter this rank used has a flag >= 1 / world size after the mean: only the others need reading (a
        # device-to-host copy and a wait where the flags live on a GPU)
        everywhere = not self.flags.numel() or all(self._used)
        used = [1.0] * len(self.params) if everywhere else to_host(self.flags, self.timeout).tolist()
        if self._stream is not None:  # staged: one copy back, on the caller's stream (before the optimizer's)
            stream = torch.cuda.current_stream(self.home.device)
            self._home_grads.copy_(self.grads, non_blocking=True)
            self._given = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._given.record(stream)
        for j, param in enumerate(self.params):
            if used[j] == 0.0:
                continue  # no rank had a gradient: leave grad as it was (None on every rank)
            if self._at_home[j]:
                if not self._is_view(j):
                    param.grad = self.views[j]
            elif param.grad is None:
                param.grad = self.views[j].to(param.device)
            else:
                param.grad.copy_(self.views[j])
        self.reset()

    def reset(self) -> None:
        """Forgets which gradients were taken (the step ended, with or without :meth:`give`)."""
        self._taken = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._sealed = False
        self._staged = None

    def read_params(self) -> torch.Tensor:
        """The parameters' current values, flattened in bucket order (a new CPU tensor; from a GPU, one copy)."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        return to_host(flat, self.timeout) if flat.is_cuda else flat

    @torch.no_grad()
    def write_params(self, flat: torch.Tensor) -> None:
        """Copies a flat vector laid out like the bucket into the parameters, in place (to a GPU: one copy there,
        then the parameters' own)."""
        if self.home.is_cuda and not flat.is_cuda:
            flat = to_device(flat, self.home, self.timeout)
        for off, param in zip(self.bucket.offsets, self.params, strict=True):
            param.copy_(flat[off : off + param.numel()].view(param.shape))
