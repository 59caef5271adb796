"""What a compressed gradient is, how it is made and undone, and the error feedback that keeps it unbiased over time.

Three families, each with the update rule it gives (``g`` a worker's gradient of a bucket, flat; P workers):

- :class:`Cast` (``fp16``, ``bf16``): each worker sends ``cast(g / P)`` and the sum of the casts is the mean,
  reduced by the ordinary allreduce in 16 bits (divided first so the sum cannot overflow, as DDP's
  ``fp16_compress_hook`` does). Half the bytes; the rounding is not fed back (it is unbiased enough, and that is
  what the anchor does). Linear: a reducing ring can carry it.
- :class:`TopK` (``topk:R``): each worker adds its residual ``e`` to ``g``, sends the ``k = ceil(R·n)`` entries of
  largest magnitude (int32 index, value) and keeps the rest as its new residual: ``e <- (g + e) - sparse``.
  The receivers scatter-add everybody's entries and divide by P. Not linear (the union of P supports is not
  the support of the sum), so it needs an allgather: a reducing ring refuses it (:meth:`Compressor.check_ring`).
  Error feedback (Stich et al. 2018) is what keeps it convergent: nothing is lost, only late.
- ``dgc:R``: top-k with Deep Gradient Compression's momentum correction and momentum-factor masking (Lin et
  al. 2018), for momentum SGD. Plain error feedback delays the *gradient*, and the optimizer's momentum then
  amplifies each late burst of it; DGC moves the momentum to the workers instead: ``u <- m u + g``,
  ``v <- v + u``, send the top-k of ``v`` and zero ``u`` and ``v`` where sent. The mean of the sparse ``v``'s
  is then already a momentum step, so it *replaces* the wrapped SGD's momentum buffer (the strategy sets the
  gradient to ``mean - m·buffer``, which torch's SGD turns into ``buffer = mean``: the replicas' buffers stay
  identical and no optimizer is edited). Without momentum (``m = 0``) it is ``topk:R``.
- :class:`LowRank` (``powersgd:R``, Vogels et al. 2019): per matrix-shaped parameter ``M = g + e`` (mxn, viewed
  as ``shape[0]`` x the rest), ``P = M Q`` → allreduce-mean → orthonormalise → ``Q = M^T P`` → allreduce-mean →
  ``M_hat = P Q^T``; ``e <- M - M_hat``; ``Q`` is kept for the next step (warm start, one power iteration per step).
  Vectors and matrices too small to gain, ``(m + n) r >= m n``, travel uncompressed in the same bucket's dense
  allreduce. Linear in ``M`` for a given ``Q`` (both rounds are allreduces). Every worker computes the same
  ``M_hat`` from the same reduced P and Q, so the replicas stay identical.

Error-feedback state is kept per bucket (``key``), on the worker; it starts at zero.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.errors import ConfigError

__all__ = ["COMPRESSIONS", "Cast", "Compressor", "LowRank", "TopK", "parse_compression"]

#: The accepted ``compression=`` names (``R`` a ratio in (0, 1] for top-k, an int rank for PowerSGD).
COMPRESSIONS = ("none", "fp16", "bf16", "topk:R", "dgc:R", "powersgd:R")

Array = npt.NDArray[Any]


class Compressor(abc.ABC):
    """A compression scheme (stateless description + per-bucket error-feedback state where it has one)."""

    #: the name it was parsed from (``"topk:0.01"``)
    name: str
    #: True when the sum of compressed gradients is the compressed sum: a reducing collective can carry it
    linear: bool = True

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """The canonical name, which :func:`parse_compression` turns back into an equal compressor."""

    def check_ring(self, algorithm: str) -> None:
        """Refuses a reducing collective for a scheme that is not linear.

        Raises:
            ConfigError: the scheme cannot be summed on the way (top-k), with what to use instead.
        """
        if not self.linear and algorithm in ("ring", "tree", "auto", "direct"):
            raise ConfigError(
                f"compression {self.name!r} is not linear: the sum of sparse top-k vectors is not sparse in the "
                f"same places, so a reducing allreduce ({algorithm!r}) cannot carry it; it needs an allgather of "
                "every worker's (index, value) pairs (DistributedOptimizer does that for 'allreduce')"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclass(repr=False)
class Cast(Compressor):
    """16-bit floats on the wire (``fp16`` or ``bf16``); see the module docstring."""

    dtype: str = "float16"
    name: str = "fp16"
    linear: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"Cast dtype must be float16 or bfloat16, got {self.dtype!r}")

    @property
    def spec(self) -> str:
        """``"fp16"`` or ``"bf16"``."""
        return "fp16" if self.dtype == "float16" else "bf16"


@dataclass(repr=False)
class TopK(Compressor):
    """Top-k sparsification with error feedback; see the module docstring.

    Example:
        >>> import numpy as np
        >>> top = TopK(ratio=0.5)
        >>> idx, val = top.compress("b0", np.array([0.1, -3.0, 2.0, 0.5], dtype=np.float32))
        >>> idx.tolist(), val.tolist()
        ([1, 2], [-3.0, 2.0])
        >>> top.residual("b0").tolist()          # what was not sent is sent later
        [0.10000000149011612, 0.0, 0.0, 0.5]
    """

    ratio: float = 0.01
    name: str = "topk"
    linear: bool = False
    #: DGC's momentum correction (``dgc:R``): the workers keep the momentum; see the module docstring
    momentum_correction: bool = False
    _residuals: dict[str, Array] = field(default_factory=dict)
    _velocities: dict[str, Array] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {self.ratio}")

    @property
    def spec(self) -> str:
        """``"topk:R"`` or ``"dgc:R"``."""
        return f"{'dgc' if self.momentum_correction else 'topk'}:{self.ratio:g}"

    def k_of(self, n: int) -> int:
        """Entries sent of a gradient of ``n``: ``ceil(ratio·n)``, at least 1 (0 for an empty one)."""
        return 0 if n == 0 else max(1, math.ceil(self.ratio * n))

    def compress(self, key: str, grad: Array, *, momentum: float = 0.0) -> tuple[npt.NDArray[np.int32], Array]:
        """The (indices, values) to send of ``grad + residual``; the rest becomes the new residual of ``key``.

        With :attr:`momentum_correction` and ``momentum`` m > 0 (the wrapped SGD's), ``grad`` first updates the
        velocity ``u <- m u + g`` and ``u`` takes its place; the velocity is zeroed where sent (DGC).
        """
        flat = grad.reshape(-1)
        velocity = None
        if self.momentum_correction and momentum:
            velocity = self._velocities.get(key)
            if velocity is None:
                velocity = flat.astype(flat.dtype, copy=True)
                self._velocities[key] = velocity
            else:
                velocity *= flat.dtype.type(momentum)
                velocity += flat
            flat = velocity
        residual = self._residuals.get(key)
        acc = flat.astype(flat.dtype, copy=True) if residual is None else flat + residual
        k = self.k_of(acc.size)
        if k >= acc.size:
            idx = np.arange(acc.size, dtype=np.int32)
        else:
            idx = np.argpartition(np.abs(acc), acc.size - k)[acc.size - k :].astype(np.int32)
            idx.sort()
        values = acc[idx].copy()
        acc[idx] = 0
        if velocity is not None:
            velocity[idx] = 0  # momentum-factor masking: what was sent stops pushing
        self._residuals[key] = acc
        return idx, values

    def residual(self, key: str) -> Array:
        """The error-feedback residual of ``key`` (zeros of the right size before the first step are not kept)."""
        return self._residuals[key]

    def velocity(self, key: str) -> Array:
        """DGC's local velocity of ``key`` (after masking)."""
        return self._velocities[key]

    @staticmethod
    def decompress(
        n: int, indices: Array, values: Array, *, scale: float, dtype: Any, out: Array | None = None
    ) -> Array:
        """The dense sum of gathered (index, value) pairs times ``scale`` (``1/P`` for the mean), into ``out`` (a
        flat array of ``n``, overwritten) or a new array."""
        if out is None:
            out = np.zeros(n, dtype=dtype)
        else:
            out.fill(0)
        np.add.at(out, indices.astype(np.int64), values)
        if scale != 1.0:
            out *= dtype.type(scale) if isinstance(dtype, np.dtype) else scale
        return out


@dataclass
class _LowRankState:
    q: Array
    residual: Array
    scratch: Array | None = None  # the approximation of an in-place step (allocated once)


@dataclass(repr=False)
class LowRank(Compressor):
    """PowerSGD: rank-``rank`` approximation with warm start and error feedback; see the module docstring.

    Use per bucket: :meth:`split` says which parameters are compressed, :meth:`first` gives the P matrices to
    allreduce, :meth:`second` the Q matrices from the reduced P, :meth:`finish` the approximations from the
    reduced Q (and keeps the new residuals).

    Example:
        One worker (the allreduces are identities): a rank-1 matrix is recovered after one power iteration.

        >>> import numpy as np
        >>> low = LowRank(rank=1, seed=0)
        >>> m = np.outer([1.0, 2.0, 3.0], [1.0, -1.0, 0.5, 2.0]).astype(np.float32)
        >>> ps = low.first("b0", [m])
        >>> qs = low.second("b0", [low.orthonormal(p) for p in ps])
        >>> approx = low.finish("b0", qs)[0]
        >>> bool(np.allclose(approx, m, atol=1e-5)), bool(np.abs(low.residual("b0", 0)).max() < 1e-5)
        (True, True)
    """

    rank: int = 4
    seed: int = 0
    name: str = "powersgd"
    linear: bool = True
    _state: dict[str, list[_LowRankState]] = field(default_factory=dict)
    _pending: dict[str, tuple[list[Array], list[Array]]] = field(default_factory=dict)
    _inplace: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {self.rank}")

    @property
    def spec(self) -> str:
        """``"powersgd:R"``."""
        return f"powersgd:{self.rank}"

    def compressible(self, shape: Sequence[int]) -> bool:
        """Whether a parameter of ``shape`` is compressed: a matrix (or more) with ``(m + n)·r < m·n``."""
        if len(shape) < 2:
            return False
        m, n = shape[0], math.prod(shape[1:])
        return (m + n) * self.rank < m * n

    def first(self, key: str, matrices: Sequence[Array], *, inplace: bool = False) -> list[Array]:
        """``P = (g + e) Q`` of each matrix (``Q`` seeded the same on every worker at the first step).

        With ``inplace`` the matrices are overwritten with ``g + e`` (the caller's gradient buffer, which
        :meth:`finish` then fills with the approximation): no 2·m·n-byte temporaries per step, which on a
        memory-bound CPU step are a visible share of PowerSGD's cost.
        """
        states = self._state.get(key)
        if states is None:
            rng = np.random.default_rng(self.seed)
            states = [
                _LowRankState(
                    rng.standard_normal((m.shape[1], min(self.rank, *m.shape))).astype(m.dtype),
                    np.zeros_like(m),
                )
                for m in matrices
            ]
            self._state[key] = states
        if inplace:
            summed = [np.add(m, s.residual, out=m) for m, s in zip(matrices, states, strict=True)]
        else:
            summed = [m + s.residual for m, s in zip(matrices, states, strict=True)]
        self._pending[key] = (summed, [])
        self._inplace[key] = inplace
        return [mat @ s.q for mat, s in zip(summed, states, strict=True)]

    @staticmethod
    def orthonormal(p: Array) -> Array:
        """Orthonormal columns spanning ``p`` (reduced QR; a zero column stays zero)."""
        if p.size == 0:
            return p
        q, _ = np.linalg.qr(p)
        return q.astype(p.dtype, copy=False)

    def second(self, key: str, ps: Sequence[Array]) -> list[Array]:
        """``Q = M^T P`` of each matrix, from the reduced and orthonormalised ``P``."""
        summed, _ = self._pending[key]
        self._pending[key] = (summed, list(ps))
        return [mat.T @ p for mat, p in zip(summed, ps, strict=True)]

    def finish(self, key: str, qs: Sequence[Array]) -> list[Array]:
        """The approximations ``P Q^T`` from the reduced ``Q``; keeps ``Q`` (warm start) and the residuals.

        After ``first(..., inplace=True)`` the approximations are written into those same matrices (and returned);
        the residual is updated in its own array, so a step allocates nothing of the matrices' size.
        """
        summed, ps = self._pending.pop(key)
        inplace = self._inplace.pop(key)
        out = []
        for mat, p, q, state in zip(summed, ps, qs, self._state[key], strict=True):
            if inplace:  # mat is the caller's: the approximation goes there, through a scratch kept per matrix
                if state.scratch is None:
                    state.scratch = np.empty_like(mat)
                np.matmul(p, q.T, out=state.scratch)
                np.subtract(mat, state.scratch, out=state.residual)
                mat[...] = state.scratch
                out.append(mat)
            else:  # mat is ours: the approximation lands in the old residual's array and the two swap roles
                approx = state.residual
                np.matmul(p, q.T, out=approx)
                np.subtract(mat, approx, out=mat)
                state.residual = mat
                out.append(approx)
            state.q = q.copy()
        return out

    def residual(self, key: str, index: int) -> Array:
        """The error-feedback residual of matrix ``index`` of ``key``."""
        return self._state[key][index].residual


def parse_compression(name: str | None) -> Compressor | None:
    """``"fp16"``, ``"bf16"``, ``"topk:0.01"``, ``"dgc:0.01"``, ``"powersgd:4"`` -> a fresh compressor; ``None`` or
    ``"none"`` -> None.

    Raises:
        ConfigError: an unknown name or a bad argument, listing the forms.

    Example:
        >>> parse_compression("topk:0.01").ratio, parse_compression("powersgd:2").rank, parse_compression("none")
        (0.01, 2, None)
    """
    if name is None:
        return None
    text = name.strip().lower()
    forms = ", ".join(COMPRESSIONS)
    if text in ("", "none"):
        return None
    if text == "fp16":
        return Cast("float16", name=text)
    if text == "bf16":
        return Cast("bfloat16", name=text)
    match = re.fullmatch(r"(topk|dgc|powersgd):([0-9.e-]+)", text)
    if match is None:
        raise ConfigError(f"unknown compression {name!r}; choose one of {forms}")
    kind, arg = match.groups()
    try:
        if kind in ("topk", "dgc"):
            return TopK(ratio=float(arg), name=text, momentum_correction=kind == "dgc")
        if not arg.isdigit():
            raise ValueError(f"the rank must be an int, got {arg!r}")
        return LowRank(rank=int(arg), name=text)
    except ValueError as exc:
        raise ConfigError(f"compression {name!r}: {exc} (forms: {forms})") from None
