"""Device tensors through host memory: the copy out before a collective sends them, the copy back after.

paratrain's transports and reductions work on host memory (numpy views), so a CUDA tensor is *staged*: copied to a
pinned (page-locked) host buffer, reduced or sent from there, and the result copied back to the caller's device.
Why pinned: the device copies it in one DMA at full bus speed, where pageable memory goes through a driver bounce
buffer. Why each copy is complete when the call returns: the bytes are read (or the result used) by another
thread, or by the caller's next kernel, right after; ordering is kept with an event on the device's current stream
(the stream the caller's kernels producing the tensor were queued on), never by synchronising the whole device.

torch is imported only inside these functions: nothing here runs unless a device tensor was passed in.
"""

from __future__ import annotations

from typing import Any, cast

import numpy.typing as npt

from paratrain._arrays import as_numpy_view, is_torch_tensor

__all__ = ["host_view", "on_device", "to_device", "to_host"]


def on_device(x: object) -> bool:
    """True for a torch tensor whose memory is not host memory (a CUDA tensor, say).

    Example:
        >>> import numpy as np
        >>> on_device(np.zeros(2))
        False
    """
    return is_torch_tensor(x) and bool(cast(Any, x).device.type != "cpu")


def to_host(x: Any) -> Any:
    """A contiguous host copy of device tensor ``x`` (detached), finished when this returns.

    CUDA: into pinned memory from torch's caching host allocator (no page-locking per call), queued on the
    device's current stream after the caller's kernels, then waited for by an event recorded behind it. Other
    device types: torch's blocking copy.
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
    copied.synchronize()
    return host


def host_view(x: Any) -> tuple[npt.NDArray[Any], str]:
    """:func:`~paratrain._arrays.as_numpy_view` of ``x``, a device tensor staged to host memory first (a copy, as a
    non-contiguous input's is): what a transport sends, a parameter server receives, a reduction reads.

    Example:
        >>> import numpy as np
        >>> host_view(np.arange(3))[1]
        'int64'
    """
    return as_numpy_view(to_host(x) if on_device(x) else x)


def to_device(host: Any, like: Any) -> Any:
    """Host tensor ``host`` as a new tensor on ``like``'s device, finished when this returns (torch's blocking copy
    synchronises the device's current stream after it, so the caller's next kernel sees the bytes)."""
    return host.to(like.device)
