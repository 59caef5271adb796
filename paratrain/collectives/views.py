"""The arrays a collective works on: host views of numpy arrays and torch tensors in, the caller's type out.

A device (CUDA) tensor is staged: copied to pinned host memory when the call takes it, and the result copied back
to its device (:mod:`paratrain.device`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain._arrays import is_torch_tensor
from paratrain.device import DEVICE_TIMEOUT, copy_to_device_, host_view, on_device, to_device

__all__ = ["as_array", "nbytes", "shares_memory", "wrap", "write_back"]


def as_array(x: Any, timeout: float = DEVICE_TIMEOUT) -> tuple[npt.NDArray[Any], str]:
    """The host view a collective works on: ``x``'s own memory where it can be, a staged host copy of a device
    (CUDA) tensor (:mod:`paratrain.device`)."""
    if not (isinstance(x, np.ndarray) or is_torch_tensor(x)):
        raise TypeError(f"collectives take numpy arrays or torch tensors, not {type(x).__name__}")
    return host_view(x, timeout)


def _host_tensor(arr: npt.NDArray[Any], dtype_name: str) -> Any:
    """``arr`` as a CPU torch tensor sharing its memory (bfloat16 travels as its 16-bit pattern)."""
    import torch

    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def wrap(like: Any, arr: npt.NDArray[Any], dtype_name: str, timeout: float = DEVICE_TIMEOUT) -> Any:
    """``arr`` as the caller's type: a torch tensor (sharing memory; on the caller's device for a device tensor)
    for torch input, else the array itself."""
    if not is_torch_tensor(like):
        return arr
    tensor = _host_tensor(arr, dtype_name)
    return to_device(tensor, like, timeout) if on_device(like) else tensor


def shares_memory(x: Any, view: npt.NDArray[Any]) -> bool:
    """True if ``view`` (from :func:`as_array`) is ``x``'s own memory rather than a contiguous or host copy."""
    if isinstance(x, np.ndarray):
        return bool(x.flags.c_contiguous)
    return not on_device(x) and bool(x.is_contiguous())


def write_back(x: Any, result: npt.NDArray[Any], dtype_name: str, timeout: float = DEVICE_TIMEOUT) -> None:
    """Copies ``result`` into ``x`` (in its shape, on its device): an in-place call whose view was a copy."""
    if isinstance(x, np.ndarray):
        x[...] = result.reshape(x.shape)
    elif on_device(x):
        copy_to_device_(x.detach(), _host_tensor(result, dtype_name), timeout)
    else:
        x.detach().copy_(_host_tensor(result, dtype_name).reshape(x.shape))


def nbytes(x: object) -> int:
    """Bytes of an array or tensor (0 for anything else), for the timeline."""
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    if is_torch_tensor(x):
        return int(x.numel() * x.element_size())  # type: ignore[attr-defined]
    return 0
