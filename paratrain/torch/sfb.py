"""Sufficient-factor broadcasting for ``torch.nn.Linear``: capture the factors, allgather them, rebuild the gradient.

For ``y = x Wᵀ + b`` and a batch of K rows, autograd computes ``∇W = Uᵀ V`` and ``∇b = Σ_k U_k`` from
``U = ∂L/∂y`` (KxM) and ``V = x`` (KxN). So a worker needs to send only ``[U | V]``, K(M+N) numbers, instead of
the M·N of ``∇W``: every worker gathers every worker's rows and computes the mean gradient of the job itself::

    forward hook      V = x                          (kept by the hook on y, no copy)
    hook on y.grad    rows += [U | V]                 (K x (M+N); several uses or micro-batches append rows)
    launch            allgather_async(rows)           (ring: each worker sends (P-1)·K·(M+N) numbers)
    finish            R = gathered rows (ΣK x (M+N));  ∇W = R[:, :M]ᵀ R[:, M:] / P,  ∇b = Σ R[:, :M] / P

Every worker runs the same GEMM on the same gathered rows in the same (rank) order, so all of them get the
identical gradient, bit for bit, and then the identical update from any torch optimizer: SFB is exact (it is the
mean of the dense gradients up to float rounding), unlike Poseidon's open code, which applies each received
factor asynchronously. The price is compute: the rebuild is a GEMM over P·K rows on every worker, on top of the
local ``∇W`` autograd already computed (it is overwritten). Rows accumulate until the step, so gradient
accumulation (``no_sync``), a layer applied several times and inputs with extra leading dimensions (a sequence:
K = batch x length) are all exact. A layer no worker used this step keeps ``grad = None``; one used by some
workers gets the mean with zeros from the others, as with allreduce.

Not covered: activation checkpointing that re-runs a layer's forward inside backward would capture its input
twice (the gradient would double); such layers should travel densely.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from paratrain.runtime.context import Context
from paratrain.transport.base import Handle

__all__ = ["SfbLayer", "linear_layers", "own_params"]


def own_params(module: torch.nn.Linear) -> list[torch.Tensor]:
    """The layer's weight and, if it has one, its bias (the parameters SFB carries)."""
    return [module.weight] + ([module.bias] if module.bias is not None else [])


def linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The ``nn.Linear`` modules whose own parameters are trained and belong to no other module (no tied weights).

    A weight shared with another module (an embedding tied to the output layer) gets gradients from both, and
    only the Linear's part has sufficient factors; such layers are left to the dense scheme.
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or isinstance(module, torch.nn.modules.lazy.LazyModuleMixin):
            continue
        if all(p.requires_grad and owners[id(p)] == 1 for p in own_params(module)):
            found.append((name, module))
    return found


class SfbLayer:
    """One ``nn.Linear`` whose gradient travels as sufficient factors (see the module docstring).

    Args:
        name: the module's name (for errors and the plan).
        module: the layer.
        context: the workers' context (the factors are allgathered among its ranks).

    Thread model: the hooks run on the thread that runs backward, :meth:`launch` under the optimizer's lock,
    :meth:`finish` on the caller's thread. Not for concurrent steps.
    """

    def __init__(self, name: str, module: torch.nn.Linear, context: Context) -> None:
        self.name = name
        self.module = module
        self.context = context
        self.out_features = module.out_features
        self.in_features = module.in_features
        self.params = own_params(module)
        self._rows: list[torch.Tensor] = []
        self._handle: Handle[torch.Tensor] | None = None
        self.rows_sent = 0  # rows of this worker's last launch (what the byte count is made of)
        me = weakref.ref(self)

        def forward_hook(_: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            layer = me()
            if layer is None or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return
            if not output.requires_grad or not inputs or not isinstance(inputs[0], torch.Tensor):
                return
            layer._watch(inputs[0], output)

        self._forward_handle = module.register_forward_hook(forward_hook)

    def _watch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        v = x.detach().reshape(-1, self.in_features)
        me = weakref.ref(self)

        def on_grad(grad: torch.Tensor) -> None:
            layer = me()
            if layer is not None:
                u = grad.detach().reshape(-1, layer.out_features)
                layer._rows.append(torch.cat([u, v.to(u.dtype)], dim=1))

        y.register_hook(on_grad)  # type: ignore[no-untyped-call]

    def take_rows(self) -> torch.Tensor:
        """This step's rows (``[u | v]``, one per example that reached the layer; none if this rank did not use it),
        forgotten here: what :meth:`launch` gathers, and a reliable step gathers itself."""
        width = self.out_features + self.in_features
        if not self._rows:  # on the weight's device, as the other ranks' rows: one path for every rank's part
            rows = torch.zeros((0, width), dtype=self.module.weight.dtype, device=self.module.weight.device)
        elif len(self._rows) == 1:
            rows = self._rows[0]
        else:
            rows = torch.cat(self._rows)
        self._rows = []
        self.rows_sent = int(rows.shape[0])
        return rows.contiguous()

    def launch(self) -> None:
        """Starts the allgather of this step's rows (asynchronous; the rows are copied). Must be called on every
        rank, in plan order, whether or not this rank used the layer (it then sends no rows)."""
        # on the device: the collectives stage a CUDA tensor (or hand it to an engine) and return the rows there,
        # where the weight's gradient is rebuilt
        self._handle = self.context.allgather_async(self.take_rows())

    def finish(self) -> None:
        """Waits for the rows and writes the mean gradient of all workers into the weight and bias. Blocks."""
        handle, self._handle = self._handle, None
        if handle is None:
            raise RuntimeError(f"internal error: SFB layer {self.name!r} was never launched before finish()")
        self.rebuild(handle.wait(), self.context.world_size)

    @torch.no_grad()
    def rebuild(self, rows: torch.Tensor, workers: int) -> None:
        """Writes the mean over ``workers`` of the gradients that every worker's ``rows`` (gathered, in rank order)
        make into the weight and bias: ``(1/workers) sum u^T v`` and ``(1/workers) sum u``."""
        if rows.shape[0] == 0:
            return  # no worker used the layer: its gradients stay as they are (None), as in one process
        scale = 1.0 / workers
        u, v = rows[:, : self.out_features], rows[:, self.out_features :]
        weight = self.module.weight
        grad_w = torch.mm(u.t(), v).mul_(scale)
        _set_grad(weight, grad_w)
        if self.module.bias is not None:
            _set_grad(self.module.bias, u.sum(dim=0).mul_(scale))

    def discard(self) -> None:
        """Forgets captured rows (a step that ended without launching, e.g. after an error)."""
        self._rows = []

    def close(self) -> None:
        """Waits for an allgather in flight and removes the forward hook. Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.wait()
        self._forward_handle.remove()
        self._rows = []


def _set_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    value = value.to(dtype=param.dtype, device=param.device)
    if param.grad is None or param.grad.shape != value.shape:
        param.grad = value
    else:
        param.grad.copy_(value)
