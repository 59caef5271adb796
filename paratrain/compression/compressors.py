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

Every compressor answers the same calls (:class:`Compressor`), so the front ends and the cost model never ask which
one they hold: :meth:`~Compressor.encode` a bucket's buffer into the :class:`Message` the workers aggregate,
:meth:`~Compressor.next_round` for each further round (PowerSGD's Q), :meth:`~Compressor.decode` the last aggregate
back into the buffer; :meth:`~Compressor.encode_push` for the parameter servers; :meth:`~Compressor.wire_bytes` what
one rank sends. A buffer is a numpy array or a torch CPU tensor (the casts keep a tensor a tensor: numpy has no
bfloat16); the others work on its numpy view.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

from paratrain.errors import ConfigError

__all__ = [
    "COMPRESSIONS",
    "BucketLayout",
    "Cast",
    "Compressor",
    "LowRank",
    "Message",
    "Push",
    "TopK",
    "parse_compression",
]

#: The accepted ``compression=`` names (``R`` a ratio in (0, 1] for top-k, an int rank for PowerSGD).
COMPRESSIONS = ("none", "fp16", "bf16", "topk:R", "dgc:R", "powersgd:R")

Array = npt.NDArray[Any]

_INDEX = {4: np.int32, 8: np.int64}  # a top-k index travels in the bits of one value of the gradient's width


class Message(NamedTuple):
    """One round of one bucket among the workers: the array each contributes and how they are combined."""

    array: Any
    #: ``"sum"`` or ``"mean"``: an allreduce with that op; ``"gather"``: an allgather (every worker's array)
    op: str


class Push(NamedTuple):
    """A bucket's gradient as pushed to the parameter servers: dense ``values``, or ``values`` at ``indices``
    (int64: a dense gradient, zero elsewhere)."""

    values: Any
    indices: Array | None = None


class BucketLayout(NamedTuple):
    """What a compressor learns of a bucket before its first step (:meth:`Compressor.prepare`)."""

    #: the parameters' names (for messages)
    names: tuple[str, ...]
    #: where each parameter's gradient starts in the buffer
    offsets: tuple[int, ...]
    #: each parameter's shape
    shapes: tuple[tuple[int, ...], ...]
    #: entries of the buffer: the gradient, then what rides with it (used-flags)
    size: int
    #: the gradient's dtype as the front end prints it (``"torch.float32"``)
    dtype: str


class Compressor(abc.ABC):
    """A compression scheme (stateless description + per-bucket error-feedback state where it has one).

    A step of bucket ``key`` among P workers: ``encode`` -> aggregate -> (``next_round`` -> aggregate) x
    (``aggregation_rounds`` - 1) -> ``decode``; with parameter servers, ``encode_push``. The buffer given to each
    call is the bucket's flat buffer: its gradient in the first ``numel`` entries, then what rides with it.
    """

    #: the name it was parsed from (``"topk:0.01"``)
    name: str
    #: True when the sum of compressed gradients is the compressed sum: a reducing collective can carry it
    linear: bool = True
    #: aggregations per step: 1, or 2 for PowerSGD (P, then Q); the parameter servers aggregate once
    aggregation_rounds: ClassVar[int] = 1

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """The canonical name, which :func:`parse_compression` turns back into an equal compressor."""

    @property
    def moves_momentum(self) -> bool:
        """True when the workers keep the optimizer's momentum (DGC): the mean replaces SGD's momentum buffer."""
        return False

    @abc.abstractmethod
    def wire_bytes(
        self, numel: int, itemsize: int, *, shapes: Sequence[Sequence[int]] | None = None, push: bool = False
    ) -> int:
        """Bytes one rank sends for a gradient of ``numel`` items of ``itemsize`` bytes, every round together: its
        message among the workers, or with ``push`` its push to the parameter servers.

        Args:
            numel: items of the gradient.
            itemsize: bytes of one.
            shapes: the parameters it holds (their items sum to ``numel``); None: one vector.
            push: the push to the servers rather than the message among the workers.

        Raises:
            ValueError: ``shapes`` do not hold ``numel`` items; ``push`` for a scheme the servers cannot aggregate.
        """

    def rounds_of(self, shapes: Sequence[Sequence[int]]) -> int:
        """Aggregations a bucket of parameters of ``shapes`` takes per step (at most :attr:`aggregation_rounds`)."""
        return self.aggregation_rounds

    def prepare(self, key: str, layout: BucketLayout) -> None:
        """Learns the layout of bucket ``key`` before its first :meth:`encode` (nothing to learn by default).

        Raises:
            ConfigError: a bucket this scheme cannot send.
        """
        return None  # nothing to learn by default

    @abc.abstractmethod
    def encode(self, key: str, buffer: Any, *, numel: int, workers: int, momentum: float = 0.0) -> Message:
        """The first round's message of bucket ``key`` among ``workers`` workers (keeps the error feedback).

        Args:
            key: the bucket.
            buffer: its flat buffer (the gradient, then what rides with it).
            numel: items of the gradient.
            workers: P.
            momentum: the wrapped SGD's momentum when :attr:`moves_momentum` (0: none).
        """

    def next_round(self, key: str, reduced: Any) -> Message | None:
        """The next round's message of bucket ``key`` from the last round's aggregate (None: it sends nothing).

        Raises:
            RuntimeError: a scheme of one round.
        """
        raise RuntimeError(f"compression {self.name!r} aggregates once per step")

    @abc.abstractmethod
    def decode(self, key: str, reduced: Any, buffer: Any, *, numel: int, workers: int) -> Any:
        """The mean gradient from the last round's aggregate ``reduced`` (None if it sent nothing): ``buffer``
        (rewritten, with what rides with it) or a new array of its dtype."""

    def encode_push(self, key: str, grads: Any) -> Push:
        """What a worker pushes of bucket ``key``'s gradient ``grads`` to the parameter servers.

        Raises:
            ConfigError: a scheme of more than one aggregation: the servers aggregate once, by stepping.
        """
        raise ConfigError(
            f"compression {self.name!r} needs {self.aggregation_rounds} aggregation rounds per step; the parameter "
            "servers aggregate once, by stepping their optimizer"
        )

    def check_ring(self, algorithm: str) -> None:
        """Refuses a reducing collective for a scheme that is not linear.

        Raises:
            ConfigError: the scheme cannot be summed on the way (top-k), with what to use instead.
        """
        reducing = ("auto", "ring", "tree", "direct", "halving_doubling", "torus", "double_tree", "hierarchical", "shm")
        if not self.linear and algorithm in reducing:
            raise ConfigError(
                f"compression {self.name!r} is not linear: the sum of sparse top-k vectors is not sparse in the "
                f"same places, so a reducing allreduce ({algorithm!r}) cannot carry it; it needs an allgather of "
                "every worker's (index, value) pairs (DistributedOptimizer does that for 'allreduce')"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _shapes(numel: int, shapes: Sequence[Sequence[int]] | None) -> Sequence[Sequence[int]]:
    """``shapes``, checked to hold ``numel`` items, or one vector of ``numel``."""
    if shapes is None:
        return ((numel,),)
    if sum(math.prod(shape) for shape in shapes) != numel:
        raise ValueError(f"parameters of shapes {[tuple(s) for s in shapes]} do not hold {numel} items")
    return shapes


def _host(buffer: Any) -> Array:
    """A numpy view of ``buffer`` (a numpy array, or a torch CPU tensor's memory)."""
    return buffer if isinstance(buffer, np.ndarray) else buffer.numpy()


def _to(array: Any, dtype: Any) -> Any:
    """``array`` converted to ``dtype`` (a name, or a dtype of the array's kind): numpy's ``astype``, or torch's
    ``to`` for a tensor (torch is loaded already when a tensor is given; numpy has no bfloat16)."""
    if isinstance(array, np.ndarray):
        return array.astype(dtype)
    if isinstance(dtype, str):
        dtype = _TORCH_DTYPES.get(dtype) or _torch_dtype(dtype)
    return array.to(dtype)


_TORCH_DTYPES: dict[str, Any] = {}


def _torch_dtype(name: str) -> Any:
    import torch

    _TORCH_DTYPES[name] = dtype = getattr(torch, name)
    return dtype


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

    def wire_bytes(
        self, numel: int, itemsize: int, *, shapes: Sequence[Sequence[int]] | None = None, push: bool = False
    ) -> int:
        """Two bytes an item, among the workers and to the servers alike."""
        _shapes(numel, shapes)
        return numel * 2

    def encode(self, key: str, buffer: Any, *, numel: int, workers: int, momentum: float = 0.0) -> Message:
        """``cast(buffer / P)``, the used-flags too, summed by the allreduce (divided first: the sum cannot
        overflow)."""
        return Message(_to(buffer / workers, self.dtype), "sum")

    def decode(self, key: str, reduced: Any, buffer: Any, *, numel: int, workers: int) -> Any:
        """The summed casts back at the buffer's width, as a new array."""
        return _to(reduced, buffer.dtype)

    def encode_push(self, key: str, grads: Any) -> Push:
        """The gradient cast (the servers add it at the key's width)."""
        return Push(_to(grads, self.dtype))


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

    @property
    def moves_momentum(self) -> bool:
        """True for DGC (:attr:`momentum_correction`)."""
        return self.momentum_correction

    def wire_bytes(
        self, numel: int, itemsize: int, *, shapes: Sequence[Sequence[int]] | None = None, push: bool = False
    ) -> int:
        """``k`` (index, value) pairs: the index in the gradient's width among the workers, int64 to the servers."""
        _shapes(numel, shapes)
        k = self.k_of(numel)
        return k * (8 + itemsize) if push else k * 2 * itemsize

    def prepare(self, key: str, layout: BucketLayout) -> None:
        """Refuses a gradient that is not float32 or float64: an index travels in the bits of one value."""
        if layout.dtype.rpartition(".")[2] not in ("float32", "float64"):
            raise ConfigError(
                f"top-k compression sends float32 or float64 gradients, not {layout.dtype} "
                f"(parameters {', '.join(layout.names)})"
            )

    def encode(self, key: str, buffer: Any, *, numel: int, workers: int, momentum: float = 0.0) -> Message:
        """The gradient's top-k as (index, value) rows of its dtype, to be gathered (no used-flags)."""
        grads = _host(buffer)[:numel]
        idx, values = self.compress(key, grads, momentum=momentum)
        pairs = np.empty((idx.size, 2), dtype=grads.dtype)
        pairs[:, 0] = idx.astype(_INDEX[grads.itemsize]).view(grads.dtype)
        pairs[:, 1] = values
        return Message(pairs, "gather")

    def decode(self, key: str, reduced: Any, buffer: Any, *, numel: int, workers: int) -> Any:
        """Every worker's pairs scatter-added into the gradient and divided by P; what rides with it (used-flags,
        which top-k does not send) set to 1: every parameter counts as used. Returns ``buffer``."""
        host = _host(buffer)
        grads = host[:numel]
        pairs = np.asarray(reduced).reshape(-1, 2)
        idx = pairs[:, 0].copy().view(_INDEX[grads.itemsize])
        TopK.decompress(grads.size, idx, pairs[:, 1], scale=1.0 / workers, dtype=grads.dtype, out=grads)
        host[numel:] = 1
        return buffer

    def encode_push(self, key: str, grads: Any) -> Push:
        """The top-k entries of the gradient (plus residual), int64 indices (no momentum correction: the servers
        keep the momentum)."""
        idx, values = self.compress(key, _host(grads))
        return Push(values, idx.astype(np.int64))

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

    Per bucket, the two rounds of the interface: :meth:`encode` sends the P of each compressed matrix (from
    :meth:`first`) with the rest of the buffer whole, :meth:`next_round` the Q (:meth:`second`) from the reduced,
    orthonormalised P, :meth:`decode` writes the approximations (:meth:`finish`) and the reduced rest into the buffer.

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
    aggregation_rounds: ClassVar[int] = 2
    _state: dict[str, list[_LowRankState]] = field(default_factory=dict)
    _pending: dict[str, tuple[list[Array], list[Array]]] = field(default_factory=dict)
    _inplace: dict[str, bool] = field(default_factory=dict)
    # per bucket: (offset, rows, items) of each compressed matrix, and the indices of the entries that travel whole
    _layouts: dict[str, tuple[list[tuple[int, int, int]], Array]] = field(default_factory=dict)
    _dense: dict[str, Array] = field(default_factory=dict)  # per bucket: the reduced whole entries, until decode

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

    def wire_bytes(
        self, numel: int, itemsize: int, *, shapes: Sequence[Sequence[int]] | None = None, push: bool = False
    ) -> int:
        """P and Q of each compressed mxn matrix, ``min(rank, m, n)·(m + n)`` items; the other parameters whole."""
        if push:
            raise ValueError(
                f"compression {self.name!r} needs two aggregation rounds; the parameter servers aggregate once"
            )
        items = 0
        for shape in _shapes(numel, shapes):
            if self.compressible(shape):
                m, n = shape[0], math.prod(shape[1:])
                items += min(self.rank, m, n) * (m + n)
            else:
                items += math.prod(shape)
        return items * itemsize

    def rounds_of(self, shapes: Sequence[Sequence[int]]) -> int:
        """2, or 1 when no parameter is compressed (the second round carries only Q)."""
        return 2 if any(self.compressible(shape) for shape in shapes) else 1

    def prepare(self, key: str, layout: BucketLayout) -> None:
        """Which parameters of bucket ``key`` are compressed, and which entries of its buffer travel whole (kept as
        indices: gathering a few of millions by mask is slow)."""
        matrices = [j for j, shape in enumerate(layout.shapes) if self.compressible(shape)]
        keep = np.ones(layout.size, dtype=bool)
        for j in matrices:
            keep[layout.offsets[j] : layout.offsets[j] + math.prod(layout.shapes[j])] = False
        spans = [(layout.offsets[j], layout.shapes[j][0], math.prod(layout.shapes[j])) for j in matrices]
        self._layouts[key] = (spans, np.flatnonzero(keep))

    def _layout(self, key: str) -> tuple[list[tuple[int, int, int]], Array]:
        layout = self._layouts.get(key)
        if layout is None:
            raise RuntimeError(f"PowerSGD: prepare({key!r}, layout) must come before the bucket's first step")
        return layout

    def encode(self, key: str, buffer: Any, *, numel: int, workers: int, momentum: float = 0.0) -> Message:
        """``[P of each matrix | the entries that travel whole (vectors, small matrices, used-flags)]``, to be
        averaged. The matrices' part of ``buffer`` becomes ``g + e`` (:meth:`first` in place)."""
        spans, keep = self._layout(key)
        host = _host(buffer)
        mats = [host[offset : offset + items].reshape(rows, -1) for offset, rows, items in spans]
        dense = host[keep]  # gathered before first() writes g + e into the matrices' part
        ps = self.first(key, mats, inplace=True)
        return Message(np.concatenate([*(p.reshape(-1) for p in ps), dense]), "mean")

    def next_round(self, key: str, reduced: Any) -> Message | None:
        """``[Q of each matrix]`` from the averaged P (orthonormalised), to be averaged; None without matrices."""
        spans, _ = self._layout(key)
        reduced = np.asarray(reduced)
        pos, ps = 0, []
        for _, rows, items in spans:
            r = min(self.rank, rows, items // rows)
            ps.append(LowRank.orthonormal(reduced[pos : pos + rows * r].reshape(rows, r)))
            pos += rows * r
        self._dense[key] = reduced[pos:]
        qs = self.second(key, ps) if ps else []
        return Message(np.concatenate([q.reshape(-1) for q in qs]), "mean") if qs else None

    def decode(self, key: str, reduced: Any, buffer: Any, *, numel: int, workers: int) -> Any:
        """The approximations ``P Q^T`` from the averaged Q into the matrices' part of ``buffer``, the averaged
        whole entries into the rest. Returns ``buffer``."""
        spans, keep = self._layout(key)
        host = _host(buffer)
        if reduced is not None:
            _, ps = self._pending[key]
            flat, pos, qs = np.asarray(reduced), 0, []
            for p, (_, _, items) in zip(ps, spans, strict=True):
                cols = items // p.shape[0]
                qs.append(flat[pos : pos + cols * p.shape[1]].reshape(cols, p.shape[1]))
                pos += cols * p.shape[1]
            self.finish(key, qs)  # writes each approximation into its matrix's part of the buffer
        host[keep] = self._dense.pop(key)
        return buffer

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
