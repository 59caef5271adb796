"""The frame of a shared-memory collective call: its arguments checked, its signature encoded, its errors sorted.

Before any data moves, a call of :class:`~paratrain.collectives.shm.ShmGroup` holds the segment for one thread
(:class:`CallFrame`), checks its array (:func:`check_array`) and encodes what the members compare in the
agreement step (:class:`Descriptors`). An error every member accounted for in that step (:class:`SettledError`)
leaves the group usable; any other breaks it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from paratrain._arrays import dtype_name as _wire_dtype_name
from paratrain.collectives.signature import Signature

if TYPE_CHECKING:
    from types import TracebackType

    from paratrain.shm.segment import Segment

__all__ = ["ALGORITHM", "CallFrame", "Descriptors", "SettledError", "check_array"]

_DESC_CACHE = 64  # encoded signatures kept per group (encoding costs ~1 µs, a lookup ~0.1 µs)
#: The algorithm name in the signatures of the group's own calls (the API passes its own signatures instead).
ALGORITHM = "shm"
_NAMES: dict[np.dtype[Any], str] = {}  # dtype -> wire name (computing it costs ~4 µs, a fifth of a small call)

_Array = npt.NDArray[Any]


def check_array(arr: _Array, dtype_name: str | None) -> tuple[_Array, str]:
    """``arr`` as the flat array a call works on, and its wire dtype name (``dtype_name`` where it says bfloat16).

    Raises:
        TypeError: not a numpy array, or ``dtype_name`` does not describe it. ValueError: not C-contiguous and
            writeable.
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"ShmGroup collectives take numpy arrays, got {type(arr).__name__}")
    flags = arr.flags
    if not flags.c_contiguous or not flags.writeable:
        raise ValueError("the array must be C-contiguous and writeable (it is updated in place)")
    name = _NAMES.get(arr.dtype)
    if name is None:
        name = _NAMES[arr.dtype] = _wire_dtype_name(arr.dtype)
    if dtype_name is not None and dtype_name != name:
        if not (dtype_name == "bfloat16" and name == "uint16"):
            raise TypeError(f"dtype_name {dtype_name!r} does not describe an array of dtype {arr.dtype}")
        name = dtype_name
    return (arr if arr.ndim == 1 else arr.reshape(-1)), name


class Descriptors:
    """A group's encoded signatures, cached (encoding costs ~1 µs, a lookup ~0.1 µs)."""

    def __init__(self) -> None:
        self._descs: dict[tuple[Any, ...], bytes] = {}  # signature (or its key) -> encoded descriptor

    def encode(self, signature: Signature, dtype: str = "", size: int = -1) -> bytes:
        """``signature`` encoded, as the members compare it.

        Raises:
            ValueError: with ``dtype``: ``signature`` does not describe an array of ``size`` items of ``dtype``.
        """
        if dtype and (signature.dtype != dtype or math.prod(signature.shape) != size):
            raise ValueError(f"signature {signature} does not describe the array ({size} items of {dtype})")
        desc = self._descs.get(signature)
        if desc is None:
            desc = self._cache(signature, signature)
        return desc

    def own(self, kind: str, op: str | None, dtype: str, shape: tuple[int, ...], root: int | None) -> bytes:
        """The encoded signature of this group's own call (algorithm ``"shm"``); cached by a cheaper key."""
        key = (kind, op, dtype, shape, root)
        desc = self._descs.get(key)
        if desc is None:
            desc = self._cache(key, Signature(kind, op, dtype, shape, ALGORITHM, ALGORITHM, root))
        return desc

    def _cache(self, key: tuple[Any, ...], signature: Signature) -> bytes:
        if len(self._descs) >= _DESC_CACHE:
            self._descs.clear()
        desc = self._descs[key] = signature.encode()
        return desc


class CallFrame:
    """The frame of every public collective: one thread at a time, on a usable segment that carries collectives;
    a settled error (a mismatch, or arguments one member rejected) raised as itself with the group intact; any
    other error breaks the group and wakes the peers (:meth:`Segment.fail <paratrain.shm.segment.Segment.fail>`).

    A class rather than ``contextlib.contextmanager``: it is entered once per collective, and a generator-based
    manager costs about a microsecond more, a tenth of a small allreduce.
    """

    __slots__ = ("_segment",)

    def __init__(self, segment: Segment) -> None:
        self._segment = segment

    def __enter__(self) -> None:
        segment = self._segment
        segment.enter()
        try:
            segment.check_usable()
            segment.claim("collectives")
        except BaseException as exc:
            segment.fail(exc)
            segment.leave()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if isinstance(exc, SettledError):
                raise exc.error from None
            if exc is not None:
                self._segment.fail(exc)
        finally:
            self._segment.leave()


class SettledError(Exception):
    """Carries an error that every member accounted for in the agreement step (a mismatch, or arguments one member
    rejected): the public method raises ``error`` without breaking the group."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error
