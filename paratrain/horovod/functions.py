"""Horovod's helpers for starting every rank from the root's model and optimizer: ``broadcast_parameters`` and
``broadcast_optimizer_state``.

The optimizer's state is made of its groups' numeric options (learning rate, momentum, betas...) and its
per-parameter state (momentum buffers, Adam's moments and step counts). Before anything moves, every rank
contributes a digest of that structure (option names and types, state keys, shapes and dtypes). A rank whose
optimizer has no state yet (it has not stepped: a checkpoint loaded on the root only, a worker that joined an
elastic job) is given the root's structure first, as zeros, as Horovod does; any other difference makes every rank
raise the same :class:`~paratrain.horovod.basics.HorovodInternalError` instead of pairing the wrong tensors. Then
the options travel as one float64 vector and each state tensor in place.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from paratrain.horovod.basics import HorovodInternalError, rank, run
from paratrain.horovod.objects import broadcast_object
from paratrain.horovod.ops import broadcast_async_, synchronize

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]

Params = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def broadcast_parameters(params: Params, root_rank: int, process_set: object = None) -> None:
    """Overwrites every tensor of ``params`` (``model.state_dict()`` or ``model.named_parameters()``) with
    ``root_rank``'s, in place. A dict goes in sorted key order, as Horovod's.

    Raises:
        ValueError: ``params`` is neither a mapping nor (name, tensor) pairs.
    """
    if process_set is not None:
        raise ValueError("paratrain.horovod runs on the whole job: process_set= is not supported")
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = list(params)
        if not all(isinstance(p, tuple) and len(p) == 2 for p in items):
            raise ValueError(
                f"invalid params of type: {type(params).__name__}; pass state_dict() or named_parameters()"
            )
    handles = [broadcast_async_(t, root_rank, name) for name, t in items if isinstance(t, torch.Tensor)]
    for h in handles:
        synchronize(h)


def _options(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, type]]:
    """Every numeric option of every group, in group order and sorted name order (bools and ints included)."""
    out: list[tuple[int, str, type]] = []
    for g, group in enumerate(optimizer.param_groups):
        for key in sorted(group):
            value = group[key]
            if key != "params" and isinstance(value, (bool, int, float)):
                out.append((g, key, type(value)))
            elif key != "params" and isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
                out.extend((g, f"{key}[{i}]", float) for i in range(len(value)))
    return out


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(a name, tensor) for every tensor of the per-parameter state, in parameter order and sorted key order."""
    out = []
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append((f"state.{index}.{key}", value))
            index += 1
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, process_set: object = None) -> None:
    """Gives every rank ``root_rank``'s optimizer options and state (see the module docstring).

    Raises:
        HorovodInternalError: the ranks' optimizers differ in structure (on every rank, before any data moves).
        ValueError: an LBFGS optimizer (its state is not per-parameter tensors), or a process set.
    """
    if process_set is not None:
        raise ValueError("paratrain.horovod runs on the whole job: process_set= is not supported")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    inner: torch.optim.Optimizer = getattr(optimizer, "optimizer", optimizer)  # a DistributedOptimizer's own
    options, tensors = _agreed_structure(inner, root_rank)
    values = torch.tensor([_option(inner, g, k) for g, k, _ in options], dtype=torch.float64)
    values = synchronize(broadcast_async_(values, root_rank, "optimizer.options")) if len(options) else values
    for (g, key, kind), value in zip(options, values.tolist(), strict=True):
        _set_option(inner, g, key, kind, value)
    handles = [broadcast_async_(t, root_rank, name) for name, t in tensors]
    for h in handles:
        synchronize(h)


def _structure(options: list[tuple[int, str, type]], tensors: list[tuple[str, torch.Tensor]]) -> np.ndarray:
    """The digest of an optimizer's structure (32 bytes) and whether it has per-parameter state (1 byte)."""
    text = json.dumps(
        [[(g, k, t.__name__) for g, k, t in options], [(n, list(t.shape), str(t.dtype)) for n, t in tensors]]
    )
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8)
    return np.concatenate([digest, np.array([1 if tensors else 0], dtype=np.uint8)]).reshape(1, -1)


def _agreed_structure(
    optimizer: torch.optim.Optimizer, root_rank: int
) -> tuple[list[tuple[int, str, type]], list[tuple[str, torch.Tensor]]]:
    """The options and state tensors to broadcast, once every rank's optimizer has the root's structure: the
    ranks without state get the root's, as zeros; any other difference raises on every rank."""
    options, tensors = _options(optimizer), _state_tensors(optimizer)
    for attempt in range(2):
        rows = _allgather(_structure(options, tensors))
        differ = [r for r in range(len(rows)) if not np.array_equal(rows[r], rows[root_rank])]
        fillable = attempt == 0 and rows[root_rank, -1] == 1 and all(rows[r, -1] == 0 for r in differ)
        if not differ:
            return options, tensors
        if not fillable:
            raise HorovodInternalError(
                f"broadcast_optimizer_state: the optimizer on rank(s) {differ} differs from rank {root_rank}'s "
                f"(options, state keys, shapes or dtypes; this rank {rank()} has {len(options)} options and "
                f"{len(tensors)} state tensors): create the same optimizer everywhere (a rank that has not "
                "stepped yet is given the root's state)"
            )
        shapes = broadcast_object([(n, list(t.shape), str(t.dtype)) for n, t in tensors], root_rank)
        if rank() in differ:
            _fill_state(optimizer, shapes)
            tensors = _state_tensors(optimizer)
    raise AssertionError("unreachable")  # the second attempt returns or raises


def _allgather(row: np.ndarray) -> np.ndarray:
    """Every rank's ``row``, in rank order (on the Horovod engine's context)."""
    return np.asarray(run(lambda ctx: ctx.allgather(row)).result())


def _fill_state(optimizer: torch.optim.Optimizer, shapes: list[list[Any]]) -> None:
    """Creates the per-parameter state ``shapes`` describes (``[name, shape, dtype]``, names as
    :func:`_state_tensors` gives them) as zeros on each parameter's device."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, shape, dtype in shapes:
        _, index, key = str(name).split(".", 2)
        param = params[int(index)]
        kind = getattr(torch, str(dtype).removeprefix("torch."))
        optimizer.state[param][key] = torch.zeros(tuple(int(d) for d in shape), dtype=kind, device=param.device)


def _option(optimizer: torch.optim.Optimizer, g: int, key: str) -> float:
    if key.endswith("]"):
        name, i = key[:-1].split("[")
        return float(optimizer.param_groups[g][name][int(i)])
    return float(optimizer.param_groups[g][key])


def _set_option(optimizer: torch.optim.Optimizer, g: int, key: str, kind: type, value: float) -> None:
    group: dict[str, Any] = optimizer.param_groups[g]
    if key.endswith("]"):
        name, i = key[:-1].split("[")
        items = list(group[name])
        items[int(i)] = value
        group[name] = tuple(items)
    else:
        group[key] = kind(value)
