"""Autograd hooks that report each parameter's gradient the moment it is final (wait-free backprop).

``Tensor.register_post_accumulate_grad_hook`` runs after autograd has accumulated a parameter's gradient into
``param.grad`` for this backward pass: at that point the gradient is final, and its bucket may be sent while
backward goes on computing the gradients of earlier layers (Poseidon's wait-free backprop).

Hooks run on the thread that executes backward: the caller's thread for CPU tensors, an autograd device thread
for accelerators. They hold the receiver only weakly, so a forgotten :class:`~paratrain.torch.DistributedOptimizer`
does not keep reducing gradients: once it is garbage, its hooks remove themselves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["GradientHooks"]


class GradientHooks:
    """Calls ``on_ready(index)`` whenever the gradient of ``params[index]`` has been accumulated.

    Args:
        params: the parameters to watch (each must require grad).
        owner: the object the callback belongs to, held weakly; when it is collected the hooks do nothing.
        on_ready: ``on_ready(owner, index)``; exceptions propagate out of ``backward()``.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> class Recorder:
        ...     def __init__(self):
        ...         self.seen = []
        >>> rec = Recorder()
        >>> hooks = GradientHooks([w], owner=rec, on_ready=lambda owner, i: owner.seen.append(i))
        >>> (w * 3).sum().backward()
        >>> rec.seen
        [0]
        >>> hooks.remove()
    """

    def __init__(self, params: Sequence[torch.Tensor], *, owner: Any, on_ready: Callable[[Any, int], None]) -> None:
        ref = weakref.ref(owner)
        self.enabled = True
        self._handles: list[Any] = []
        this = weakref.ref(self)

        def make(index: int) -> Callable[[torch.Tensor], None]:
            def hook(_: torch.Tensor) -> None:
                target, me = ref(), this()
                if target is not None and me is not None and me.enabled:
                    on_ready(target, index)

            return hook

        for index, param in enumerate(params):
            self._handles.append(param.register_post_accumulate_grad_hook(make(index)))  # type: ignore[no-untyped-call]
        # when the owner goes away, the hooks go too
        self._finalizer = weakref.finalize(owner, _remove_all, self._handles)

    def remove(self) -> None:
        """Unregisters every hook. Idempotent."""
        self._finalizer()


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
