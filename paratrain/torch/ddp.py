"""A model wrapper with torch's ``DistributedDataParallel`` interface, and torch's ``DistributedSampler`` with its
ranks taken from the paratrain job: a DDP script moves to paratrain by its imports and ``init`` line.

The update rule (DDP's): when backward has produced a parameter's gradient on every rank, the gradient becomes
the mean over the ranks, ``SUM_r(g_r / N)``, before backward returns; inside ``no_sync()`` backward only
accumulates locally, and the first backward outside it reduces what accumulated. Each gradient's allreduce
starts from its hook while backward still runs (paratrain's collectives run in call order on a background
thread; hooks fire in the same order on every rank for the same model), and a callback at the end of backward
waits for them. Parameters and buffers start from rank 0's (broadcast at construction), and with
``broadcast_buffers`` (DDP's default) rank 0's buffers are broadcast before every forward, as DDP does.

Any paratrain strategy instead of DDP's rule: ``DistributedDataParallel(model, strategy="ssp:2",
optimizer=opt)`` (or ``"bsp"``, ``"asp"``, ``"gossip:ring"``, ``"poseidon"``, or ``"allreduce"`` in fused
buckets; ``compression=`` and the other options of :class:`~paratrain.torch.DistributedOptimizer` as
keywords). The gradients then travel as that strategy sends them, and the script's own ``opt.step()`` becomes
the strategy's step (the optimizer's ``step`` is rebound on the instance, so the loop stays DDP's: backward,
``opt.step()``, ``opt.zero_grad()``). Each strategy's update rule is documented with
:class:`~paratrain.torch.DistributedOptimizer`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler as _TorchSampler

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context, current
from paratrain.strategy import parse_strategy
from paratrain.torch.optimizer import DistributedOptimizer
from paratrain.transport.base import Handle

__all__ = ["DistributedDataParallel", "DistributedSampler"]


class DistributedSampler(_TorchSampler):  # type: ignore[type-arg]
    """torch's ``DistributedSampler`` (the same indices in the same order for the same seed and epoch), with
    ``num_replicas`` and ``rank`` defaulting to the paratrain job's size and this rank instead of
    torch.distributed's."""

    def __init__(  # noqa: PLR0917 (torch's positional signature)
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        ctx = current() if num_replicas is None or rank is None else None
        super().__init__(
            dataset,
            num_replicas=num_replicas if num_replicas is not None else ctx.world_size,  # type: ignore[union-attr]
            rank=rank if rank is not None else ctx.rank,  # type: ignore[union-attr]
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )


#: DDP's own rule, what the wrapper runs without an optimizer: gradients averaged by allreduce.
DDP_RULE = parse_strategy("allreduce")


class DistributedDataParallel(torch.nn.Module):
    """``module`` replicated on every rank, its gradients averaged over the job in backward (see the module
    docstring). The arguments of torch's wrapper that concern devices and process groups are accepted for
    compatibility; ``context`` is the paratrain job (default: the current one).

    Args:
        strategy: DDP's rule (``"allreduce"``, the default, without ``optimizer``) or any paratrain strategy,
            which then needs ``optimizer``.
        optimizer: the script's torch optimizer: its ``step()`` becomes the strategy's (see the module
            docstring). With ``strategy="allreduce"`` it sends the gradients in fused buckets of
            ``bucket_cap_mb`` (DDP's 25 MB by default) instead of one message per parameter.
        options: more keywords of :class:`~paratrain.torch.DistributedOptimizer` (``compression``,
            ``topology``, ``staleness_lr``, ``overlap``...).

    Attributes:
        module: the wrapped model (``ddp.module``, as DDP's).
        distributed_optimizer: the :class:`~paratrain.torch.DistributedOptimizer` behind ``optimizer``, or
            None under DDP's rule.

    Raises:
        ConfigError: a strategy other than ``"allreduce"`` without ``optimizer``, or ``options`` without it.
    """

    def __init__(  # noqa: PLR0917 (DDP's positional signature)
        self,
        module: torch.nn.Module,
        device_ids: Any = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        *,
        context: Context | None = None,
        strategy: str = "allreduce",
        optimizer: torch.optim.Optimizer | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if optimizer is None and (parse_strategy(strategy) != DDP_RULE or options):
            raise ConfigError(
                f"strategy {strategy!r}{' with ' + ', '.join(options) if options else ''} needs the optimizer: "
                "DistributedDataParallel(model, strategy=..., optimizer=opt), then call opt.step() as before"
            )
        if process_group is not None:
            raise ValueError(
                "paratrain's DistributedDataParallel runs on the whole job: process_group= is not supported"
            )
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self._ctx = context if context is not None else current()
        self._sync = True
        self._pending: dict[int, tuple[torch.Tensor, Handle[torch.Tensor]]] = {}
        self._finishing = False
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                t.copy_(torch.as_tensor(self._ctx.broadcast(t.detach().contiguous(), 0)))
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.distributed_optimizer: DistributedOptimizer | None = None
        if optimizer is not None:
            if bucket_cap_mb is not None:
                options.setdefault("bucket_bytes", int(bucket_cap_mb * 2**20))
            self.distributed_optimizer = DistributedOptimizer(
                optimizer, model=module, strategy=strategy, context=self._ctx, **options
            )
            _rebind_step(optimizer, self.distributed_optimizer)
            self._hooks = []
            return
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._ready)  # type: ignore[no-untyped-call]
            for p in self._params
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, after rank 0's buffers are broadcast (with ``broadcast_buffers``)."""
        if self.broadcast_buffers and torch.is_grad_enabled():
            with torch.no_grad():
                for b in self.module.buffers():
                    b.copy_(torch.as_tensor(self._ctx.broadcast(b.detach().contiguous(), 0)))
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside reduces them."""
        if self.distributed_optimizer is not None:
            with self.distributed_optimizer.no_sync():
                yield
            return
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _ready(self, p: torch.Tensor) -> None:
        if not self._sync or p.grad is None:
            return
        n = self._ctx.world_size
        self._pending[id(p)] = (p, self._ctx.allreduce_async(p.grad.detach() / n, "sum"))
        if not self._finishing:
            self._finishing = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)  # runs when backward ends

    def _finish(self) -> None:
        """End of backward: every gradient reduced (unused parameters too, as zeros, so that ranks stay matched
        when ``find_unused_parameters`` is set)."""
        self._finishing = False
        if self.find_unused_parameters:
            n = self._ctx.world_size
            for q in self._params:
                if id(q) not in self._pending:
                    zeros = torch.zeros_like(q) if q.grad is None else q.grad.detach() / n
                    self._pending[id(q)] = (q, self._ctx.allreduce_async(zeros, "sum"))
        for p, handle in self._pending.values():
            reduced = torch.as_tensor(handle.wait())
            if p.grad is None:
                p.grad = reduced
            else:
                p.grad.copy_(reduced)
        self._pending.clear()


def _rebind_step(optimizer: torch.optim.Optimizer, distributed: DistributedOptimizer) -> None:
    """Makes ``optimizer.step()`` run ``distributed.step()``, whose strategy calls the optimizer's own step
    (that call, made from inside, reaches the original). A bound method, as torch's LR schedulers expect when
    they wrap ``step``."""
    original: Callable[..., Any] = optimizer.step
    inside = False

    def step(self: torch.optim.Optimizer, closure: Callable[[], float] | None = None) -> float | None:
        nonlocal inside
        if inside:
            return original() if closure is None else original(closure)  # type: ignore[no-any-return]
        inside = True
        try:
            return distributed.step(closure)
        finally:
            inside = False

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
