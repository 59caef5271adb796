"""Horovod's ``DistributedOptimizer``: the wrapped optimizer's own class, with every gradient allreduced as soon
as backward produces it.

The update rule (Horovod's): after ``backward_passes_per_step`` backward passes have accumulated a parameter's
gradient g_r on each rank, the gradient becomes ``REDUCE_r(g_r / f) * f / size`` for ``op=Average`` with the
gradient predivide factor f (1 by default: the mean), ``SUM_r(g_r)`` for ``op=Sum``; then ``step()`` applies
the wrapped optimizer's rule to the reduced gradients, identically on every rank. Reductions start from the
gradient hooks while backward still runs (each is queued on the Horovod thread in the order backward produces
them, the same on every rank for the same model), and ``step()`` (or ``synchronize()``) waits for them.
``skip_synchronize()`` lets a script synchronize first (to unscale or clip the gradients) and step after.

With ``op=Adasum`` (Maleki et al., as Horovod's Adasum optimizer): each rank takes the wrapped optimizer's step on
its own gradients (its optimizer state stays its own), and each parameter becomes its value before the step plus
the Adasum of the ranks' changes (:func:`~paratrain.horovod.ops.adasum_tree`). As in Horovod, the learning rate
is not scaled by the number of ranks for Adasum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from paratrain.horovod.basics import Adasum, Average, Sum, size
from paratrain.horovod.compression import Compression, Compressor
from paratrain.horovod.ops import allreduce_async_, synchronize
from paratrain.launch.kills import kill_point

__all__ = ["DistributedOptimizer"]


class _Distributed:
    """Mixed into the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def _hvd_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
    ) -> None:
        opt: Any = self
        params = [p for group in opt.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if not all(isinstance(n, tuple) and len(n) == 2 for n in named):
                raise ValueError(
                    "named_parameters should be a sequence of tuples (name, parameter), usually "
                    "produced by model.named_parameters()"
                )
            names = [n for n, _ in named]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {dups}")
            by_id = {id(p): n for n, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in by_id]
            if missing:
                raise ValueError(
                    f"named_parameters was specified, but one or more model parameters were not named "
                    f"(positions {missing} in the optimizer's groups)"
                )
        else:
            by_id = {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if op not in (Average, Sum, Adasum):
            raise ValueError("the DistributedOptimizer's op must be hvd.Average, hvd.Sum or hvd.Adasum")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self._hvd_names = by_id
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_op = op
        self._hvd_predivide = gradient_predivide_factor
        self._hvd_delay = {id(p): backward_passes_per_step for p in params}
        self._hvd_handles: dict[int, tuple[torch.Tensor, int, Any]] = {}
        self._hvd_synchronized = False
        self._hvd_skip = False
        self._hvd_steps = 0
        hooked = [p for p in params if p.requires_grad] if op != Adasum else []  # Adasum reduces in step()
        self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_hook) for p in hooked]

    def _hvd_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._hvd_handles and self._hvd_delay[key] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally."
            )
        self._hvd_delay[key] -= 1
        if self._hvd_delay[key] == 0:
            self._hvd_handles[key] = self._hvd_start(p)

    def _hvd_start(self, p: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
        grad = p.grad
        assert grad is not None
        compressed, ctx = self._hvd_compression.compress(grad)
        if self._hvd_op == Average:
            pre, post = 1.0 / self._hvd_predivide, self._hvd_predivide / size()
            handle = allreduce_async_(
                compressed, name=self._hvd_names[id(p)], op=Sum, prescale_factor=pre, postscale_factor=post
            )
        else:
            handle = allreduce_async_(compressed, name=self._hvd_names[id(p)], op=Sum)
        return compressed, handle, (p, ctx)

    def synchronize(self) -> None:
        """Waits for every gradient's reduction and writes the results into the gradients.

        A parameter whose hook has not fired (unused in this step's graph on this rank, or still accumulating) is
        reduced now, as Horovod does: another rank may have produced its gradient (a model whose branches differ
        by rank), and that rank waits for this one's part. Without a gradient, this rank's part is zeros.
        """
        opt: Any = self
        for group in opt.param_groups if self._hvd_op != Adasum else ():  # Adasum combines in step()
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._hvd_handles:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    self._hvd_handles[id(p)] = self._hvd_start(p)
        try:
            for key, (_, handle, (p, ctx)) in list(self._hvd_handles.items()):
                out = synchronize(handle)
                with torch.no_grad():
                    p.grad.copy_(self._hvd_compression.decompress(out, ctx))
                self._hvd_delay[key] = self._hvd_passes
        except BaseException:
            # the step's reductions failed (a lost peer: hvd.elastic restores the last commit and re-forms the
            # job): forget them all, so that the next step starts afresh
            self._hvd_delay = dict.fromkeys(self._hvd_delay, self._hvd_passes)
            raise
        finally:
            self._hvd_handles.clear()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside it, ``step()`` does not synchronize: call ``synchronize()`` yourself before it."""
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure: Any = None) -> Any:
        """Synchronizes (unless inside ``skip_synchronize()``), then the wrapped optimizer's step; with Adasum,
        the local step, then the parameters' changes combined by Adasum (see the module docstring)."""
        if self._hvd_op == Adasum:
            result = self._hvd_adasum_step(closure)
        else:
            if not self._hvd_skip and not self._hvd_synchronized:
                self.synchronize()
            self._hvd_synchronized = False
            result = super().step(closure)  # type: ignore[misc]
        self._hvd_steps += 1
        kill_point(self._hvd_steps)  # paratrain launch --kill RANK@step=K, as paratrain's own optimizer
        return result

    def _hvd_adasum_step(self, closure: Any) -> Any:
        opt: Any = self
        params = [p for group in opt.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        result = super().step(closure)  # type: ignore[misc]
        handles = [
            allreduce_async_(p.detach() - b, name=self._hvd_names[id(p)], op=Adasum)
            for p, b in zip(params, before, strict=True)
        ]
        with torch.no_grad():
            for p, b, h in zip(params, before, handles, strict=True):
                p.copy_(b + synchronize(h))
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's, refused while reductions are still in flight (their results would land in
        the cleared gradients)."""
        if self._hvd_handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(  # noqa: N802, PLR0917 (Horovod's name and positional signature)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    process_set: object = None,
) -> torch.optim.Optimizer:
    """``optimizer`` as an instance of a subclass of its own class that reduces gradients over the job (see
    the module docstring); its state and groups are the same objects.

    Raises:
        ValueError: bad ``named_parameters``, ``backward_passes_per_step`` < 1, an op other than Average or Sum,
            a predivide factor without Average, a process set.
    """
    if process_set is not None:
        raise ValueError("paratrain.horovod runs on the whole job: process_set= is not supported")
    cls = type(optimizer.__class__.__name__, (_Distributed, optimizer.__class__), {})
    wrapped: Any = object.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param_groups, state, defaults and hooks
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor)
    result: torch.optim.Optimizer = wrapped
    return result
