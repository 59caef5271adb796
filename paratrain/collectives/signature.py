"""A collective call's signature (kind, op, dtype, shape, algorithm, root), how ranks compare them, and its encodings.

Before data moves, every rank of a collective learns every rank's signature (over sockets with
:func:`~paratrain.collectives.tree.agree`, inside a host through the shared-memory segment of
:class:`~paratrain.collectives.shm.ShmGroup`) and runs :func:`mismatch` on the same list. The function is pure,
so every rank computes the same verdict and the same message: either all ranks go on, or all raise the same
:class:`~paratrain.errors.CollectiveMismatchError`, leave the call at the same point, and stay usable.

Two encodings: :meth:`Signature.to_wire` (a msgpack-able list, for the socket agreement) and
:meth:`Signature.encode` (at most :data:`DESCRIPTOR_BYTES` bytes, written into a rank's descriptor slot in shared
memory). Equal signatures have equal bytes, so the shared-memory path compares bytes and decodes only on a
difference.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from paratrain._arrays import DTYPE_NAMES
from paratrain.collectives.ops import OPS
from paratrain.errors import CollectiveMismatchError, MessageError

__all__ = [
    "DESCRIPTOR_BYTES",
    "INVALID",
    "KINDS",
    "MAX_DIMS",
    "Signature",
    "mismatch",
    "mismatch_error",
]

#: The kinds of call a signature may name. ``"invalid"`` is the call of a rank that rejected its own arguments
#: (it raises its ValueError or TypeError; the others learn of it here instead of waiting for it in vain).
KINDS: tuple[str, ...] = (
    "allreduce",
    "broadcast",
    "allgather",
    "reduce_scatter",
    "barrier",
    "exchange",
    "invalid",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
)
#: The kinds whose ranks' first dimensions may differ (each rank's block is its own size).
_RAGGED = ("allgather", "gather", "scatter", "alltoall")
#: Most dimensions an encoded shape may have (numpy 2's limit).
MAX_DIMS = 64
_NAME_BYTES = 24
# kind, op, dtype, ndim, root (-1: none), requested algorithm, resolved algorithm; then ndim uint64 dimensions
_HEAD = struct.Struct(f"<BBBxiq{_NAME_BYTES}s{_NAME_BYTES}s")
#: Bytes of the longest encoding (a shape of :data:`MAX_DIMS` dimensions), rounded up to a cache line multiple.
DESCRIPTOR_BYTES = (_HEAD.size + 8 * MAX_DIMS + 63) // 64 * 64

_KIND_CODES = {name: i + 1 for i, name in enumerate(KINDS)}
_OP_CODES = {name: i + 1 for i, name in enumerate(OPS)}
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(sorted(DTYPE_NAMES))}
_KIND_BY_CODE = {code: name for name, code in _KIND_CODES.items()}
_OP_BY_CODE = {code: name for name, code in _OP_CODES.items()}
_DTYPE_BY_CODE = {code: name for name, code in _DTYPE_CODES.items()}
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_DIMS + 1)]


def _name_bytes(name: str) -> bytes:
    """An algorithm name in a fixed field: as is if it fits, else a prefix and a hash of the whole name."""
    raw = name.encode()
    if len(raw) <= _NAME_BYTES:
        return raw
    return raw[: _NAME_BYTES - 9] + b"~" + hashlib.blake2b(raw, digest_size=4).hexdigest().encode()


class Signature(NamedTuple):
    """What one rank passed to one collective call: the ranks must agree on all of it before data moves.

    Attributes:
        kind: one of :data:`KINDS`.
        op: the reduction (``"sum"``, ``"mean"``, ``"max"``, ``"min"``), or None for calls without one.
        dtype: the wire dtype name (``"bfloat16"``, ``"float32"``...), or ``""`` for calls without data.
        shape: the caller's shape (not the flat view the algorithms see).
        requested: the algorithm the caller asked for (``"auto"`` included).
        resolved: the algorithm that runs.
        root: the root rank of a broadcast, reduce, gather or scatter, else None.

    Example:
        >>> a = Signature("allreduce", "sum", "float32", (17, 1311), "auto", "shm")
        >>> b = Signature("allreduce", "sum", "float32", (17, 23, 57), "auto", "shm")
        >>> mismatch([a, b])
        'rank 0 has shape (17, 1311) float32 but rank 1 has (17, 23, 57) float32'
        >>> Signature.decode(b.encode()) == b
        True
    """

    kind: str
    op: str | None
    dtype: str
    shape: tuple[int, ...]
    requested: str
    resolved: str
    root: int | None = None

    # -- the socket agreement's form

    def to_wire(self) -> list[Any]:
        """``[kind, op, dtype, shape, requested, resolved, root]``, msgpack-able."""
        return [self.kind, self.op, self.dtype, list(self.shape), self.requested, self.resolved, self.root]

    @classmethod
    def from_wire(cls, obj: Any, rank: int) -> Signature:
        """The inverse of :meth:`to_wire`, for what ``rank`` sent.

        Raises:
            MessageError: ``obj`` is not a signature (another paratrain version, or a corrupted peer).
        """
        ok = (
            isinstance(obj, list)
            and len(obj) == 7
            and isinstance(obj[0], str)
            and (obj[1] is None or isinstance(obj[1], str))
            and isinstance(obj[2], str)
            and isinstance(obj[3], list)
            and all(type(d) is int for d in obj[3])
            and isinstance(obj[4], str)
            and isinstance(obj[5], str)
            and (obj[6] is None or type(obj[6]) is int)
        )
        if not ok:
            raise MessageError(f"rank {rank} sent a malformed call signature {obj!r}; do all ranks run one version?")
        return cls(obj[0], obj[1], obj[2], tuple(obj[3]), obj[4], obj[5], obj[6])

    # -- the shared-memory descriptor's form

    def encode(self) -> bytes:
        """At most :data:`DESCRIPTOR_BYTES` bytes; equal signatures give equal bytes (names over 24 bytes are
        shortened to a prefix and a hash of the whole name).

        Raises:
            ValueError: an unknown kind, op or dtype, more than :data:`MAX_DIMS` dimensions, or a negative root.
        """
        ndim = len(self.shape)
        try:
            kind = _KIND_CODES[self.kind]
            op = 0 if self.op is None else _OP_CODES[self.op]
            dtype = _DTYPE_CODES[self.dtype] if self.dtype else 0
        except KeyError as exc:
            raise ValueError(f"cannot encode {self!r}: unknown {exc.args[0]!r}") from None
        if ndim > MAX_DIMS or (self.root is not None and self.root < 0):
            raise ValueError(f"cannot encode {self!r}: at most {MAX_DIMS} dimensions and a root >= 0")
        root = -1 if self.root is None else self.root
        head = _HEAD.pack(kind, op, dtype, ndim, root, _name_bytes(self.requested), _name_bytes(self.resolved))
        return head + _DIMS[ndim].pack(*self.shape)

    @classmethod
    def decode(cls, data: bytes) -> Signature:
        """The inverse of :meth:`encode`; ``data`` may carry trailing bytes (a whole descriptor slot).

        Codes it does not know decode as ``"?"`` (a slot never written, or another version): comparing still
        works, and the message shows them.
        """
        kind, op, dtype, ndim, root, requested, resolved = _HEAD.unpack_from(data)
        ndim = min(max(ndim, 0), MAX_DIMS)
        shape = _DIMS[ndim].unpack_from(data, _HEAD.size)
        return cls(
            _KIND_BY_CODE.get(kind, "?"),
            None if op == 0 else _OP_BY_CODE.get(op, "?"),
            "" if dtype == 0 else _DTYPE_BY_CODE.get(dtype, "?"),
            tuple(shape),
            requested.rstrip(b"\0").decode(errors="replace"),
            resolved.rstrip(b"\0").decode(errors="replace"),
            None if root < 0 else root,
        )


#: The signature of a call whose rank rejected its own arguments (see :data:`KINDS`).
INVALID = Signature("invalid", None, "", (), "", "")


def _fmt(sig: Signature) -> str:
    return f"{sig.shape} {sig.dtype}"


def mismatch(sigs: Sequence[Signature]) -> str | None:
    """What differs between the ranks' signatures (``sigs[q]`` is rank q's), or None if they may go on.

    Pure: every rank computes the same answer from the same list. Differences that do not matter pass: the first
    dimension of an allgather, gather, scatter or all-to-all, and the requested algorithm when the resolved one is
    the same (``"auto"`` and an explicit name that it picks). An ``"auto"`` that resolves differently because the
    sizes differ is not reported besides the sizes.

    Example:
        >>> a = Signature("broadcast", None, "int64", (4,), "auto", "tree", root=0)
        >>> mismatch([a, Signature("broadcast", None, "int64", (4,), "auto", "tree", root=1)])
        'rank 0 has root 0 but rank 1 has root 1'
    """
    for j, sig in enumerate(sigs):
        if sig.kind == "invalid":
            return f"rank {j} rejected its own arguments (see the error it raised)"
    ref = sigs[0]
    for j, sig in enumerate(sigs[1:], start=1):
        if sig == ref:
            continue
        if sig.kind != ref.kind:
            return f"rank 0 called {ref.kind} but rank {j} called {sig.kind}"
        mine: list[str] = []
        theirs: list[str] = []
        if ref.kind in _RAGGED:
            shapes_differ = len(ref.shape) != len(sig.shape) or ref.shape[1:] != sig.shape[1:]
        else:
            shapes_differ = ref.shape != sig.shape
        data_differs = shapes_differ or sig.dtype != ref.dtype
        if data_differs:
            mine.append(f"shape {_fmt(ref)}")
            theirs.append(_fmt(sig))
        if sig.op != ref.op:
            mine.append(f"op {ref.op!r}")
            theirs.append(f"op {sig.op!r}")
        if sig.root != ref.root:
            mine.append(f"root {ref.root}")
            theirs.append(f"root {sig.root}")
        if sig.resolved != ref.resolved and not (data_differs and ref.requested == sig.requested == "auto"):
            mine.append(f"algorithm {ref.resolved!r}" + (" (auto)" if ref.requested == "auto" else ""))
            theirs.append(f"algorithm {sig.resolved!r}" + (" (auto)" if sig.requested == "auto" else ""))
        if not mine:
            continue  # only what may differ differs (an allgather's first dimension, the requested name)
        note = f" ({ref.kind} needs equal trailing dimensions)" if ref.kind in _RAGGED and shapes_differ else ""
        return f"rank 0 has {', '.join(mine)} but rank {j} has {', '.join(theirs)}{note}"
    return None


def mismatch_error(sigs: Sequence[Signature]) -> CollectiveMismatchError | None:
    """The error every rank raises for ``sigs`` (the same text on every rank), or None if they agree."""
    problem = mismatch(sigs)
    if problem is None:
        return None
    called = next((s.kind for s in sigs if s.kind != "invalid"), "a collective")
    return CollectiveMismatchError(
        f"{called} called with different arguments: {problem}. Every rank must call the same collectives in the "
        "same order with the same shapes, dtypes and options. No rank computed a result, and all remain usable"
    )
