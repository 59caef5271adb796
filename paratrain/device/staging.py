"""Device tensors through host memory: the copy out before a collective sends them, the copy back after.

paratrain's transports and reductions work on host memory (numpy views), so a CUDA tensor is *staged*: copied to a
pinned (page-locked) host buffer, reduced or sent from there, and the result copied back to the caller's device.
Why pinned: the device copies it in one DMA at full bus speed, where pageable memory goes through a driver bounce
buffer. Why each copy is complete when the call returns: the bytes are read (or the result used) by another
thread, or by the caller's next kernel, right after; ordering is kept with an event on the device's current stream
(the stream the caller's kernels producing the tensor were queued on), never by synchronising the whole device,
and waited for with a deadline (:func:`~paratrain.device.events.wait_event`).

torch is imported only inside these functions: nothing here runs unless a device tensor was passed in.
"""

from __future__ import annotations

from typing import Any, cast

import numpy.typing as npt

from paratrain._arrays import as_numpy_view, is_torch_tensor
from paratrain.device.events import DEVICE_TIMEOUT, wait_event

__all__ = ["copy_to_device_", "host_view", "on_device", "to_device", "to_host"]


def on_device(x: object) -> bool:
    """True for a torch tensor whose memory is not host memory (a CUDA tensor, say).

    Example:
        >>> import numpy as np
        >>> on_device(np.zeros(2))
        False
    """
    return is_torch_tensor(x) and bool(cast(Any, x).device.type != "cpu")


def to_host(x: Any, timeout: float = DEVICE_TIMEOUT) -> Any:
    """A contiguous host copy of device tensor ``x`` (detached), finished when this returns.

    CUDA: into pinned memory from torch's caching host allocator (no page-locking per call), queued on the
    device's current stream after the caller's kernels, then waited for by an event recorded behind it, at most
    ``timeout`` seconds (:class:`~paratrain.errors.DeviceTimeoutError`). Other device types: torch's blocking copy.
    """
    import torch

    t = x.detach()
    if t.device.type != "cuda":
        return t.to("cpu").contiguous()
    host = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(t.device)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
    copied.record(stream)
    wait_event(copied, timeout, "a device-to-host copy")
    return host


def host_view(x: Any, timeout: float = DEVICE_TIMEOUT) -> tuple[npt.NDArray[Any], str]:
    """:func:`~paratrain._arrays.as_numpy_view` of ``x``, a device tensor staged to host memory first (a copy, as a
    non-contiguous input's is): what a transport sends, a parameter server receives, a reduction reads.

    Example:
        >>> import numpy as np
        >>> host_view(np.arange(3))[1]
        'int64'
    """
    return as_numpy_view(to_host(x, timeout) if on_device(x) else x)


def to_device(host: Any, like: Any, timeout: float = DEVICE_TIMEOUT) -> Any:
    """Host tensor ``host`` as a new tensor on ``like``'s device, finished when this returns (see
    :func:`copy_to_device_`)."""
    import torch

    if like.device.type != "cuda":
        return host.to(like.device)
    out = torch.empty(tuple(host.shape), dtype=host.dtype, device=like.device)
    copy_to_device_(out, host, timeout)
    return out


def copy_to_device_(dst: Any, host: Any, timeout: float = DEVICE_TIMEOUT) -> None:
    """Copies host tensor ``host`` into device tensor ``dst`` (same number of elements), finished when this returns.

    CUDA: through pinned memory, on the device's current stream, waited for by an event at most ``timeout``
    seconds (torch's blocking copy from pageable memory would synchronise the stream with no deadline). Other
    device types: torch's blocking copy.
    """
    import torch

    if dst.device.type != "cuda":
        dst.copy_(host.reshape(dst.shape))
        return
    pinned = host if host.is_pinned() else torch.empty(tuple(host.shape), dtype=host.dtype, pin_memory=True)
    if pinned is not host:
        pinned.copy_(host)
    dst.copy_(pinned.reshape(dst.shape), non_blocking=True)
    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
    copied.record(torch.cuda.current_stream(dst.device))
    wait_event(copied, timeout, "a host-to-device copy")
