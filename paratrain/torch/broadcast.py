"""``broadcast_parameters``: make every rank's model equal to the root's, in place, one message per dtype.

Data-parallel training with ``"allreduce"`` keeps the workers identical only if they start identical: each
process initialises its model with its own random numbers, so rank 0's values are sent to everybody before the
first step (Horovod's ``broadcast_parameters``, DDP does it in its constructor).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from paratrain.device import copy_to_device_, on_device, to_host
from paratrain.runtime.context import Context, current

__all__ = ["broadcast_parameters"]


Tensors = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[torch.Tensor]


def _tensors(model_or_state: Tensors) -> list[torch.Tensor]:
    if isinstance(model_or_state, torch.nn.Module):
        found = [*model_or_state.parameters(), *model_or_state.buffers()]
    elif isinstance(model_or_state, Mapping):
        found = [v for v in model_or_state.values() if isinstance(v, torch.Tensor)]
    elif isinstance(model_or_state, torch.Tensor):
        found = [model_or_state]
    else:
        found = list(model_or_state)
        for t in found:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"broadcast_parameters takes tensors, got a {type(t).__name__}")
    seen: set[int] = set()
    unique = []
    for t in found:  # shared (tied) tensors are sent once
        key = id(t)
        if key not in seen:
            seen.add(key)
            unique.append(t)
    return unique


@torch.no_grad()
def broadcast_parameters(
    model_or_state: Tensors,
    root: int = 0,
    *,
    context: Context | None = None,
) -> None:
    """Overwrites the parameters and buffers of every rank with those of rank ``root``, in place.

    Tensors are grouped by dtype and each group travels as one flat message (a model of 160 tensors costs one
    or two broadcasts, not 160). Every rank must pass the same structure (same tensors, shapes and dtypes, in
    the same order); a different shape or dtype raises ``CollectiveMismatchError`` on every rank. Blocks.

    Args:
        model_or_state: a module (its parameters and buffers), a ``state_dict()`` (its tensors share memory
            with the module, so the module changes too), or an iterable of tensors.
        root: the rank whose values win.
        context: the paratrain context (default: the current one).

    Raises:
        ValueError: ``root`` is not a rank. TypeError: something that is not a tensor.

    Example:
        >>> import torch, paratrain.torch as ptt
        >>> from paratrain.testing import run_ranks
        >>> def worker(ctx):
        ...     model = torch.nn.Linear(3, 1)          # a different random init on each rank
        ...     ptt.broadcast_parameters(model, root=0, context=ctx)
        ...     return model.weight.detach().clone()
        >>> a, b = run_ranks(2, worker)
        >>> torch.equal(a, b)
        True
    """
    ctx = context if context is not None else current()
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in _tensors(model_or_state):
        groups.setdefault(t.dtype, []).append(t)
    timeout = ctx.settings.timeout  # (of the copies to and from a GPU)
    for tensors in groups.values():  # insertion order: the same on every rank for the same model
        flat = torch.cat([(to_host(t, timeout) if on_device(t) else t.detach()).reshape(-1) for t in tensors])
        result = ctx.broadcast(flat, root)
        offset = 0
        for t in tensors:
            n = t.numel()
            part = result[offset : offset + n].view(t.shape)
            if on_device(t):
                copy_to_device_(t.detach(), part, timeout)
            else:
                t.copy_(part)
            offset += n
