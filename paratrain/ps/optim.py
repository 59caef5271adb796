"""Server-side update rules (SGD, Adam, Adagrad) over numpy arrays, in place, with torch.optim's exact math.

In a parameter server the workers push gradients and the *server* applies the optimizer to the parameters it
holds (Li et al., OSDI'14): the optimizer state (momentum, Adam's moments) lives with the shard it belongs to and
never crosses the network. A worker chooses the optimizer and sends its :meth:`ServerOptimizer.spec` (a small
dict, msgpack-able: never a pickle, which would let a peer run code on the server); every server rebuilds it with
:func:`make_optimizer`.

Numerics: every array (the parameter, the state, the temporaries) stays in the parameter's dtype, and the
operations follow torch.optim's single-tensor code in the same order, so each step agrees with torch to an ulp
or two (torch fuses some multiply-adds, which numpy cannot; the tests allow 1e-12 relative error in float64
and 1e-5 in float32 after 20 steps). Gradients of another float dtype are cast on the fly. A step
allocates at most two temporaries of the parameter's shape; the server steps one chunk (about
:data:`~paratrain.ps.sharding.DEFAULT_CHUNK_BYTES`) at a time, so they stay small. The step
counter is an int64 array of one element in the state, so that the state is all arrays (it can be checkpointed
and replicated like the parameter).

Sparse rows (embeddings): :meth:`ServerOptimizer.step_rows` updates only the rows that received gradients,
*lazily* like ``torch.optim.SparseAdam`` and torch's sparse Adagrad: untouched rows keep their parameters and
their state (their momentum does not decay), and the step counter is one per key.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from paratrain.errors import ConfigError

__all__ = ["SGD", "Adagrad", "Adam", "ServerOptimizer", "make_optimizer"]

Array = npt.NDArray[Any]
State = dict[str, Array]


def _number(owner: str, name: str, value: object, *, low: float = 0.0, below: float | None = None) -> float:
    """``value`` as a finite float in ``[low, below)`` (``[low, inf)`` without ``below``), or a ConfigError."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{owner}: {name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < low or (below is not None and v >= below):
        bound = f"in [{low}, {below})" if below is not None else f">= {low}"
        raise ConfigError(f"{owner}: {name} must be {bound}, got {value!r}")
    return v


class ServerOptimizer(abc.ABC):
    """An update rule a server applies to the parameters it holds, in place.

    Subclasses are frozen dataclasses of their hyperparameters (keyword-only, validated at construction), so
    two optimizers with equal hyperparameters compare equal, and ``make_optimizer(opt.spec()) == opt``.

    The state from :meth:`init_state` holds arrays of the parameter's shape (per element: slice them with the
    parameter), plus the entries named in ``per_key_state`` (one per key, e.g. Adam's step counter).
    """

    __slots__ = ()

    #: The name :func:`make_optimizer` knows this rule by.
    name: ClassVar[str]
    #: State entries that are one per key rather than one per element (never sliced by rows).
    per_key_state: ClassVar[frozenset[str]] = frozenset()

    @abc.abstractmethod
    def init_state(self, param: Array) -> State:
        """Fresh state for one parameter (or one chunk of one): zeros as torch would create them."""

    @abc.abstractmethod
    def _update(self, param: Array, grad: Array, state: State) -> None:
        """The rule itself, on checked arguments."""

    def step(self, param: Array, grad: Array, state: State) -> None:
        """Applies one update to ``param`` in place, from ``grad``, advancing ``state`` in place.

        Not thread-safe for the same ``param``: a server applies the pushes to one chunk one at a time.

        Raises:
            TypeError: ``param`` is not a floating-point numpy array, or ``grad`` is not floating point.
            ValueError: ``grad``'s shape differs from ``param``'s.
        """
        _check_param(param)
        grad = np.asarray(grad)
        if grad.dtype.kind != "f":
            raise TypeError(f"gradient must be floating point, got dtype {grad.dtype}")
        if grad.shape != param.shape:
            raise ValueError(f"gradient shape {grad.shape} differs from the parameter's {param.shape}")
        self._update(param, grad, state)

    def step_rows(self, param: Array, grad: Array, rows: npt.ArrayLike, state: State) -> None:
        """Applies one update to the rows ``rows`` of ``param`` only (a sparse push), in place.

        ``grad[i]`` is the gradient of row ``rows[i]``; a row that appears several times gets the sum of its
        gradients (the update is not linear, so duplicates must be combined first, as torch coalesces sparse
        gradients). Rows not listed keep their values and their state. Per-key state (the step counter)
        advances once per call that lists any row; an empty ``rows`` changes nothing.

        Raises:
            TypeError: non-integer row ids, or float checks as in :meth:`step`.
            IndexError: a row id outside ``[0, param.shape[0])``.
            ValueError: a 0-d parameter, or ``grad`` not shaped ``(len(rows),) + param.shape[1:]``.

        Example:
            >>> opt, w = SGD(lr=0.5), np.zeros((4, 2))
            >>> opt.step_rows(w, np.ones((3, 2)), np.array([3, 1, 3]), opt.init_state(w))
            >>> w.tolist()
            [[0.0, 0.0], [-0.5, -0.5], [0.0, 0.0], [-1.0, -1.0]]
        """
        _check_param(param)
        if param.ndim == 0:
            raise ValueError("step_rows needs a parameter with rows (ndim >= 1); use step() for a 0-d parameter")
        ids = np.asarray(rows)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"row ids must be integers, got dtype {ids.dtype}")
        grad = np.asarray(grad)
        if ids.ndim != 1 or grad.shape != ids.shape + param.shape[1:]:
            raise ValueError(
                f"gradient shape {grad.shape} does not fit {ids.shape} row ids of rows shaped {param.shape[1:]}"
            )
        if ids.size == 0:
            return
        if ids.min() < 0 or ids.max() >= param.shape[0]:
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise IndexError(f"row id {int(bad)} is outside [0, {param.shape[0]})")
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        first = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
        unique = sorted_ids[first]
        combined = grad[order] if len(unique) == len(ids) else np.add.reduceat(grad[order], first, axis=0)
        sub = param[unique]
        sub_state = {k: v if k in self.per_key_state else v[unique] for k, v in state.items()}
        self.step(sub, combined, sub_state)
        param[unique] = sub
        for k, v in sub_state.items():
            if k not in self.per_key_state:
                state[k][unique] = v

    def spec(self) -> dict[str, Any]:
        """``{"name": ..., **hyperparameters}`` of plain floats and bools, to send to the servers (msgpack).

        Example:
            >>> Adam(lr=0.01).spec()
            {'name': 'adam', 'lr': 0.01, 'betas': [0.9, 0.999], 'eps': 1e-08, 'weight_decay': 0.0}
        """
        out: dict[str, Any] = {"name": self.name}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def _check_param(param: object) -> None:
    if not isinstance(param, np.ndarray):
        raise TypeError(f"parameter must be a numpy array, got {type(param).__name__}")
    if param.dtype.kind != "f":
        raise TypeError(f"parameter must be floating point, got dtype {param.dtype}")


def _with_weight_decay(param: Array, grad: Array, weight_decay: float) -> Array:
    """``grad + weight_decay * param`` in a new array (torch's L2 penalty), or ``grad`` itself when 0."""
    if weight_decay == 0.0:
        return grad
    out = np.empty_like(param)  # not np.multiply(param, wd): that gives a scalar, not an array, for 0-d
    np.multiply(param, weight_decay, out=out)
    np.add(grad, out, out=out)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SGD(ServerOptimizer):
    """Stochastic gradient descent with optional momentum, Nesterov momentum and L2 weight decay.

    Same math as ``torch.optim.SGD`` (with ``dampening=0``): ``g = grad + weight_decay * p``; with momentum
    ``b = momentum * b + g`` (``b = g`` at the first step, which the zero-initialised buffer gives exactly), then
    ``g = g + momentum * b`` (Nesterov) or ``g = b``; ``p -= lr * g``. ``lr`` has no default, as in torch: a
    good value depends on the model and the batch size (start near 0.1 for momentum SGD on a CNN, scaled
    linearly with the global batch).

    Example:
        >>> opt, w = SGD(lr=0.1, momentum=0.9), np.ones(2)
        >>> state = opt.init_state(w)
        >>> opt.step(w, np.ones(2), state); opt.step(w, np.ones(2), state)
        >>> w.round(6).tolist()
        [0.71, 0.71]
    """

    name: ClassVar[str] = "sgd"
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _number("sgd", "lr", self.lr))
        object.__setattr__(self, "momentum", _number("sgd", "momentum", self.momentum))
        object.__setattr__(self, "weight_decay", _number("sgd", "weight_decay", self.weight_decay))
        if not isinstance(self.nesterov, bool):
            raise ConfigError(f"sgd: nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and self.momentum == 0.0:
            raise ConfigError("sgd: nesterov=True needs momentum > 0")

    def init_state(self, param: Array) -> State:
        """``momentum_buffer`` (zeros) when momentum is used, else nothing."""
        return {"momentum_buffer": np.zeros_like(param)} if self.momentum != 0.0 else {}

    def _update(self, param: Array, grad: Array, state: State) -> None:
        g = _with_weight_decay(param, grad, self.weight_decay)
        if self.momentum != 0.0:
            buf = state["momentum_buffer"]
            np.multiply(buf, self.momentum, out=buf)  # buf.mul_(momentum).add_(g)
            np.add(buf, g, out=buf)
            if self.nesterov:  # g = g + momentum * buf
                nesterov = np.empty_like(param)
                np.multiply(buf, self.momentum, out=nesterov)
                np.add(g, nesterov, out=nesterov)
                g = nesterov
            else:
                g = buf
        # param.add_(g, alpha=-lr), through a temporary: never overwrite the caller's grad or the momentum
        scratch = g if g is not grad and g is not state.get("momentum_buffer") else np.empty_like(param)
        np.multiply(g, self.lr, out=scratch)
        np.subtract(param, scratch, out=param)


@dataclass(frozen=True, slots=True, kw_only=True)
class Adam(ServerOptimizer):
    """Adam (Kingma and Ba) with bias correction and optional L2 weight decay (not AdamW's decoupled decay).

    Same math as ``torch.optim.Adam`` (``amsgrad=False``): ``t += 1``; ``g = grad + weight_decay * p``;
    ``m += (1 - beta1) * (g - m)`` (torch's lerp); ``v = beta2 * v + (1 - beta2) * g * g``;
    ``p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``. The defaults are the paper's and
    torch's; lr is the one to tune (1e-3 for most models, lower for large or ASP-trained ones).

    Example:
        >>> opt, w = Adam(lr=0.1), np.zeros(2)
        >>> state = opt.init_state(w)
        >>> opt.step(w, np.array([3.0, -0.5]), state)
        >>> w.round(6).tolist(), state["step"].tolist()  # the first step moves every element by lr
        ([-0.1, 0.1], [1])
    """

    name: ClassVar[str] = "adam"
    per_key_state: ClassVar[frozenset[str]] = frozenset({"step"})
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _number("adam", "lr", self.lr))
        betas: object = self.betas
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ConfigError(f"adam: betas must be a pair (beta1, beta2), got {betas!r}")
        object.__setattr__(
            self, "betas", tuple(_number("adam", f"betas[{i}]", b, below=1.0) for i, b in enumerate(betas))
        )
        object.__setattr__(self, "eps", _number("adam", "eps", self.eps))
        object.__setattr__(self, "weight_decay", _number("adam", "weight_decay", self.weight_decay))

    def init_state(self, param: Array) -> State:
        """``step`` (int64, one element), ``exp_avg`` and ``exp_avg_sq`` (zeros like the parameter)."""
        return {
            "step": np.zeros(1, dtype=np.int64),
            "exp_avg": np.zeros_like(param),
            "exp_avg_sq": np.zeros_like(param),
        }

    def _update(self, param: Array, grad: Array, state: State) -> None:
        beta1, beta2 = self.betas
        step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
        step_t += 1
        step = float(step_t[0])
        g = _with_weight_decay(param, grad, self.weight_decay)
        tmp = np.empty_like(param)
        np.subtract(g, exp_avg, out=tmp)  # exp_avg.lerp_(g, 1 - beta1)
        np.multiply(tmp, 1 - beta1, out=tmp)
        np.add(exp_avg, tmp, out=exp_avg)
        np.multiply(exp_avg_sq, beta2, out=exp_avg_sq)  # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        np.multiply(g, 1 - beta2, out=tmp)
        np.multiply(tmp, g, out=tmp)
        np.add(exp_avg_sq, tmp, out=exp_avg_sq)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = self.lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        np.sqrt(exp_avg_sq, out=tmp)  # denom = sqrt(v) / bias_correction2_sqrt + eps
        np.divide(tmp, bias_correction2_sqrt, out=tmp)
        np.add(tmp, self.eps, out=tmp)
        np.divide(exp_avg, tmp, out=tmp)  # param.addcdiv_(exp_avg, denom, value=-step_size)
        np.multiply(tmp, step_size, out=tmp)
        np.subtract(param, tmp, out=param)


@dataclass(frozen=True, slots=True, kw_only=True)
class Adagrad(ServerOptimizer):
    """Adagrad (Duchi et al.): per-element learning rates from the sum of squared gradients.

    Same math as ``torch.optim.Adagrad`` without ``lr_decay``: ``g = grad + weight_decay * p``;
    ``s += g * g``; ``p -= lr * g / (sqrt(s) + eps)``. Suited to sparse features and embeddings (rare rows keep
    large steps); ``initial_accumulator_value`` > 0 damps the first, otherwise full-size, steps.

    Example:
        >>> opt, w = Adagrad(lr=0.1), np.zeros(2)
        >>> opt.step(w, np.array([3.0, -0.5]), opt.init_state(w))
        >>> w.round(6).tolist()
        [-0.1, 0.1]
    """

    name: ClassVar[str] = "adagrad"
    lr: float = 1e-2
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _number("adagrad", "lr", self.lr))
        object.__setattr__(self, "eps", _number("adagrad", "eps", self.eps))
        object.__setattr__(
            self,
            "initial_accumulator_value",
            _number("adagrad", "initial_accumulator_value", self.initial_accumulator_value),
        )
        object.__setattr__(self, "weight_decay", _number("adagrad", "weight_decay", self.weight_decay))

    def init_state(self, param: Array) -> State:
        """``sum``, filled with ``initial_accumulator_value``."""
        return {"sum": np.full_like(param, self.initial_accumulator_value)}

    def _update(self, param: Array, grad: Array, state: State) -> None:
        state_sum = state["sum"]
        g = _with_weight_decay(param, grad, self.weight_decay)
        tmp = np.empty_like(param)
        np.multiply(g, g, out=tmp)  # state_sum.addcmul_(g, g, value=1)
        np.add(state_sum, tmp, out=state_sum)
        np.sqrt(state_sum, out=tmp)  # std = sqrt(sum) + eps
        np.add(tmp, self.eps, out=tmp)
        np.divide(g, tmp, out=tmp)  # param.addcdiv_(g, std, value=-lr)
        np.multiply(tmp, self.lr, out=tmp)
        np.subtract(param, tmp, out=param)


_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {cls.name: cls for cls in (SGD, Adam, Adagrad)}


def make_optimizer(spec: str | Mapping[str, Any] | ServerOptimizer | None) -> ServerOptimizer | None:
    """The server optimizer a user or a peer asked for.

    Accepts ``None`` (no optimizer: the server stores what is pushed, or sums it, as the runtime decides), a
    name with the defaults (``"adam"``, ``"adagrad"``; ``"sgd"`` has no default learning rate), a spec dict
    ``{"name": ..., **hyperparameters}`` as :meth:`ServerOptimizer.spec` makes it, or an optimizer, returned
    as is. Specs are plain data, so a server can build an optimizer from a message without running any code
    the sender chose.

    Raises:
        ConfigError: an unknown name, an unknown, missing or invalid hyperparameter (the message lists the valid
            ones).
        TypeError: ``spec`` is none of the above.

    Example:
        >>> make_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9})
        SGD(lr=0.1, momentum=0.9, weight_decay=0.0, nesterov=False)
        >>> make_optimizer(SGD(lr=0.1).spec()) == SGD(lr=0.1)
        True
    """
    if spec is None or isinstance(spec, ServerOptimizer):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise TypeError(f"optimizer must be None, a name, a spec dict or a ServerOptimizer, got {type(spec).__name__}")
    params = dict(spec)
    name = params.pop("name", None)
    if not isinstance(name, str) or name.strip().lower() not in _OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(_OPTIMIZERS)}")
    cls = _OPTIMIZERS[name.strip().lower()]
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    valid = [f.name for f in fields]
    unknown = sorted(k for k in params if k not in valid)
    if unknown:
        raise ConfigError(
            f"{cls.name}: unknown hyperparameter(s) {', '.join(map(str, unknown))}; valid: {', '.join(valid)}"
        )
    missing = [
        f.name
        for f in fields
        if f.name not in params and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(
            f"{cls.name} has no default for {', '.join(missing)}: pass e.g. "
            f"{{'name': '{cls.name}', {', '.join(repr(m) + ': 0.1' for m in missing)}}}"
        )
    return cls(**params)
