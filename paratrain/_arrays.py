"""Zero-copy views of numpy arrays and torch CPU tensors as flat buffers, without importing torch.

The communication core must start without torch (it takes seconds to import), yet accept torch tensors. A
tensor is recognised by its type's module, and turned into a numpy view that shares its memory. bfloat16 has
no numpy dtype: it travels as its raw 16-bit pattern with the dtype name ``"bfloat16"`` kept beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "DTYPE_NAMES",
    "WireArray",
    "as_numpy_view",
    "dtype_from_name",
    "dtype_name",
    "is_torch_tensor",
    "wire_array",
]

#: dtypes allowed on the wire. Object, string and structured dtypes never are: they could carry pointers.
DTYPE_NAMES: frozenset[str] = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bfloat16",
    }
)

_STORAGE_OF = {"bfloat16": np.dtype(np.uint16)}


# Per-call costs matter here (a small allreduce's whole budget is tens of microseconds): numpy's dtype.name takes
# about 5 us and a walk of the type's MRO about 2 us, so both answers are cached by type and dtype.
_TENSOR_TYPES: dict[type, bool] = {}
_NAMES: dict[np.dtype[Any], str] = {}


def is_torch_tensor(x: object) -> bool:
    """True for a ``torch.Tensor`` (checked by type name so that torch need not be imported)."""
    kind = type(x)
    known = _TENSOR_TYPES.get(kind)
    if known is None:
        known = _TENSOR_TYPES[kind] = any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in kind.__mro__)
    return known


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The wire name of a numpy dtype; raises ``TypeError`` for dtypes that may not travel."""
    name = _NAMES.get(dtype)
    if name is not None:
        return name
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and np.little_endian is False):
        raise TypeError(f"big-endian dtype {dtype} is not supported; convert with .astype('<{dtype.char}')")
    name = dtype.name
    if name not in DTYPE_NAMES:
        raise TypeError(f"dtype {dtype} cannot be sent; use a numeric or bool dtype")
    _NAMES[dtype] = name
    return name


def dtype_from_name(name: str) -> np.dtype[Any]:
    """The numpy dtype in which a buffer of wire dtype ``name`` is stored (uint16 for bfloat16)."""
    if name not in DTYPE_NAMES:
        raise TypeError(f"unknown dtype name {name!r}")
    return _STORAGE_OF[name] if name in _STORAGE_OF else np.dtype(name)


@dataclass(frozen=True)
class WireArray:
    """A numpy array to send under a wire dtype name that numpy lacks: ``bfloat16``, stored as its 16-bit
    pattern (uint16). A received bfloat16 array is such a uint16 array with the name beside it; sending it on as
    it is would call it uint16, so what forwards or slices one wraps it (the parameter server does).

    Example:
        >>> as_numpy_view(WireArray(np.zeros(2, dtype=np.uint16), "bfloat16"))[1]
        'bfloat16'
    """

    array: npt.NDArray[Any]
    name: str

    def __post_init__(self) -> None:
        if dtype_from_name(self.name) != self.array.dtype:
            raise TypeError(f"a {self.name} array is stored as {dtype_from_name(self.name)}, not {self.array.dtype}")


def wire_array(arr: npt.NDArray[Any], name: str) -> Any:
    """``arr`` as it must be sent to arrive as dtype ``name``: itself, or a :class:`WireArray` for bfloat16."""
    return WireArray(arr, name) if name == "bfloat16" else arr


def as_numpy_view(x: Any) -> tuple[npt.NDArray[Any], str]:
    """A C-contiguous numpy array sharing ``x``'s memory where possible, and its wire dtype name.

    numpy arrays and torch CPU tensors are supported. Non-contiguous inputs are copied once (there is no
    way to send them zero-copy). Tensors that require grad are detached (the data is what travels).

    Raises:
        TypeError: for GPU tensors, unsupported dtypes, or objects that are neither arrays nor tensors.
    """
    if isinstance(x, np.ndarray):
        arr = x if x.flags.c_contiguous else np.ascontiguousarray(x)  # ascontiguousarray makes 0-d into 1-d
        return arr, dtype_name(arr.dtype)
    if isinstance(x, WireArray):
        arr = x.array if x.array.flags.c_contiguous else np.ascontiguousarray(x.array)
        return arr, x.name
    if is_torch_tensor(x):
        if x.device.type != "cpu":
            raise TypeError(f"tensor on device {x.device} cannot be sent; move it to the CPU first (.cpu())")
        t = x.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        torch_dtype = str(t.dtype).removeprefix("torch.")
        if torch_dtype == "bfloat16":
            import torch

            return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        if torch_dtype == "bool":
            return t.numpy(), "bool"
        arr = t.numpy()
        return arr, dtype_name(arr.dtype)
    if isinstance(x, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(x, dtype=np.uint8)
        return arr, "uint8"
    raise TypeError(f"cannot send an object of type {type(x).__name__}; pass numpy arrays or torch CPU tensors")
