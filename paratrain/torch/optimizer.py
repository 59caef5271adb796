"""``DistributedOptimizer``: wraps a torch optimizer so that each step synchronises the workers.

The training loop stays the one a user already has::

    opt = pt.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()     # buckets leave as their gradients become ready
        opt.step()                          # waits for the last ones, then updates the parameters

What happens inside a step (see :mod:`.buckets`, :mod:`.fusion`, :mod:`.strategies`)::

    backward    [grad p5 p4]   [grad p3 p2]   [grad p1 p0]
    hooks            '-> launch(0)   '-> launch(1)  '-> launch(2)
    comm thread           |== bucket 0 ==|== bucket 1 ==|== bucket 2 ==|
    step()                                                         finish() apply()

Thread model. Hooks run on the thread that executes backward. Asynchronous collectives (and parameter-server
pushes) run in call order on one background thread per context, so the order in which buckets are *started*
is the order in which ranks match them. That order is fixed by the plan, never by the order hooks fire: when
bucket k is complete but bucket k-1 is not, bucket k waits. Buckets that never complete (a parameter got no
gradient in this backward) are started by ``step()``, in plan order, so every rank sends the same messages.

The strategies themselves live in :mod:`.strategies`, :mod:`.hybrid` and :mod:`.compressed`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch

from paratrain.compression import Compressor, parse_compression
from paratrain.errors import ConfigError
from paratrain.fusion.buckets import DEFAULT_BUCKET_BYTES, Bucket, LaunchOrder, ParamInfo, plan_buckets
from paratrain.launch.kills import kill_point
from paratrain.recovery.buddy import BuddyRecovery, RolledBackError
from paratrain.recovery.reliable import RegroupedError, Reliable
from paratrain.runtime.context import Context, current
from paratrain.sfb.cost import HybridPlan
from paratrain.strategy import StrategyOptions, StrategySpec, check_options, complete, parse_strategy
from paratrain.torch import builders
from paratrain.torch.builders import BuildRequest, Built
from paratrain.torch.fusion import FusedBucket
from paratrain.torch.hooks import GradientHooks
from paratrain.torch.layers import plan_layers
from paratrain.torch.sfb import own_params
from paratrain.torch.strategies import Strategy

__all__ = ["DistributedOptimizer"]

log = logging.getLogger(__name__)


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose steps are synchronised across the workers by a chosen strategy.

    It *is* a ``torch.optim.Optimizer`` (so LR schedulers accept it) that delegates ``param_groups``, ``state``,
    ``defaults``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` to the optimizer it wraps.

    Strategies:

    - ``"allreduce"`` (default): after backward every worker holds the mean of all workers' gradients, and runs
      the wrapped optimizer on it, so the workers stay identical, as with DDP or Horovod. With equal batches
      per worker this is one process training on the concatenated batches with the mean loss. Start from
      equal parameters: call :func:`~paratrain.torch.broadcast_parameters` first. Any torch optimizer works.
    - ``"bsp"``, ``"ssp:S"``, ``"asp"``: gradients are pushed to parameter servers, which run the optimizer
      (``torch.optim.SGD``, ``Adam`` or ``Adagrad``, translated with their hyperparameters) and the workers pull
      the new parameters. BSP waits for every worker each step; SSP lets a worker run up to S steps ahead of the
      slowest with parameters at most S steps stale; ASP never waits. The servers hold the parameters (rank
      0's initial values win) and the optimizer state; the wrapped optimizer is never stepped.
    - ``"gossip:TOPOLOGY"``: decentralised D-PSGD. Every worker runs the wrapped optimizer on its own gradients
      and mixes its parameters with its neighbours' in the graph (``ring``, ``torus``, ``exponential``,
      ``complete`` or a graph file) by the Metropolis-Hastings weights; no global communication, and the
      exchange of a step's parameters overlaps the next forward and backward. Workers are not identical but
      drift towards consensus; their mean follows SGD. See :class:`~paratrain.torch.strategies.GossipStrategy`.

    Gradients without a parameter: a parameter that no worker used this step keeps ``grad = None`` (so the
    optimizer skips it, as in one process); one that only some workers used gets the mean with zeros from the
    others. Under the parameter-server strategies, unused parameters push zeros.

    Gradient accumulation: run extra backward passes inside :meth:`no_sync`; the next backward outside it sends
    the accumulated gradients. Calling backward twice without ``step()`` otherwise raises.

    With one worker, ``"allreduce"`` copies and sends nothing: a step costs what plain torch costs, so the same
    script runs unchanged without a launcher.

    ``zero_grad(set_to_none=False)`` keeps each gradient as a view of its fusion buffer and saves one copy per
    parameter and step; the default ``set_to_none=True`` costs that copy and is equally correct.

    Args:
        optimizer: the torch optimizer to wrap; its parameters must all belong to ``model``.
        model: the module being trained; every parameter that requires grad is synchronised.
        strategy: ``"allreduce"``, ``"bsp"``, ``"ssp:S"``, ``"asp"`` or ``"gossip:TOPOLOGY"``.
        bucket_bytes: fusion threshold: gradients are sent in flat buckets of at most this many bytes (a larger
            parameter gets a bucket of its own). Smaller buckets start earlier and overlap more of backward but
            pay one message latency each; see :data:`~paratrain.fusion.buckets.DEFAULT_BUCKET_BYTES`.
        context: the paratrain context (default: the current one).
        topology: with ``strategy="gossip"``: the graph as an object rather than a name, i.e. a list of edges
            ``[(0, 1), (1, 2), ...]``, a networkx graph, or a NumPy mixing matrix ``W`` (validated).
        overlap: ``False`` turns wait-free backprop off: gradient buckets (and SFB layers) are sent in ``step()``
            once backward is over, not as soon as each is ready; under gossip a step's parameters leave in the
            next ``step()`` instead of during the next forward and backward. The same update either way, to
            measure what overlapping saves.
        staleness_lr: ``ssp:S`` and ``asp`` only: the servers scale each gradient by ``1 / max(1, τ)``, τ how many
            update rounds the parameters it was computed on were behind (Zhang et al. 2016). Off by default.
        reliable: ``"allreduce"``, ``"sfb"`` and ``"poseidon:allreduce"``: send the buckets (and the SFB layers'
            factors) through these reliable collectives, so that the job
            survives a crashed worker (``paratrain launch --max-restarts``; :mod:`paratrain.torch.resilient`).
            The same update, without overlapping communication with backward. In an elastic job
            (``--min-workers``) ``step()`` may raise :class:`~paratrain.recovery.RegroupedError`: the job lost or
            gained a worker mid-step; compute this step's gradients again for the new job (its rank and size are
            ``reliable.ctx``'s) and call ``step()`` again. ``"gossip"``: a
            :class:`~paratrain.recovery.buddy.BuddyRecovery` instead (each worker's checkpoints kept by a buddy);
            after a death ``step()`` (or ``close()``) raises :class:`~paratrain.recovery.buddy.RolledBackError`:
            restore its checkpoint and train on from its step.
        always_communicate: a benchmark switch: with one worker, fuse, hook and call the collectives (which then
            reduce over one rank) instead of copying and sending nothing, so that the cost of that machinery can be
            measured on one GPU. The same update either way.

    Raises:
        ConfigError: unknown strategy, bad ``bucket_bytes``, optimizer parameters outside ``model``, or (for
            the parameter-server strategies) an optimizer the servers cannot run or a job without servers, or
            (for gossip) an unknown topology or a graph invalid for the number of workers.
        TypeError: ``optimizer`` is not a torch optimizer or ``model`` not a module.

    Example:
        Two workers (threads here) average their gradients; both end with the same weights.

        >>> import torch, paratrain.torch as ptt
        >>> from paratrain.testing import run_ranks
        >>> def worker(ctx):
        ...     model = torch.nn.Linear(2, 1)
        ...     ptt.broadcast_parameters(model, context=ctx)      # same start everywhere
        ...     opt = ptt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, context=ctx)
        ...     model(torch.ones(4, 2) * ctx.rank).sum().backward()  # different data per worker
        ...     opt.step()
        ...     opt.close()
        ...     return model.weight.detach().clone()
        >>> a, b = run_ranks(2, worker)
        >>> torch.equal(a, b)
        True
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: torch.nn.Module,
        strategy: str = "allreduce",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        context: Context | None = None,
        topology: Any = None,
        overlap: bool = True,
        staleness_lr: bool = False,
        reliable: Reliable | BuddyRecovery | None = None,
        batch_size: int | None = None,
        layer_schemes: Mapping[str, str] | None = None,
        compression: str | Compressor | None = None,
        always_communicate: bool = False,
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called on purpose: param_groups and state are the wrapped
        # optimizer's (see the properties below), and anything else is looked up there (__getattr__).
        _check_types(optimizer, model)
        if topology is not None:
            strategy = _gossip_with_topology(strategy)
        self.spec: StrategySpec = parse_strategy(strategy)
        recovery = reliable if isinstance(reliable, BuddyRecovery) else None
        reliable = reliable if isinstance(reliable, Reliable) else None
        if recovery is not None and not self.spec.exchanges_parameters:
            raise ConfigError(f"a BuddyRecovery recovers gossip workers; strategy {strategy!r} takes a Reliable")
        self.compressor: Compressor | None = self._refuse(
            strategy,
            compression,
            bucket_bytes=bucket_bytes,
            overlap=overlap,
            staleness_lr=staleness_lr,
            reliable=reliable,
            hybrid_options=batch_size is not None or bool(layer_schemes),
        )
        # gradient strategies: False keeps every bucket until step() (no wait-free backprop), to measure it
        self._overlap = overlap or self.spec.exchanges_parameters
        self._deferred: list[int] = []
        self._inner = optimizer
        self.context: Context = context if context is not None else current()
        self.strategy_name = strategy
        self.bucket_bytes = bucket_bytes
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        _check_params(optimizer, model, named, servers=self.spec.uses_servers)
        self._names = [name for name, _ in named]
        params = [p for _, p in named]
        sfb_modules = self._plan(model, params, batch_size=batch_size, layer_schemes=layer_schemes)
        self._lock = threading.Lock()
        self._synchronized = False
        self._steps = 0  # optimizer steps begun: where a kill schedule's step kill fires
        self._closed = False
        # one worker and "allreduce": the mean of one gradient is itself, so nothing is copied or sent and a step
        # costs what plain torch costs (the same script runs unchanged without a launcher). Gossip never sends
        # gradients either (the hooks only track the launch order); its buckets serve as the parameter layout
        alone = not self.spec.uses_servers and self.context.world_size == 1 and not always_communicate
        self._local = self.spec.exchanges_parameters or alone
        self._timeout = self.context.settings.timeout
        self._buckets: list[FusedBucket | None] = []  # None: a unit that is no fused bucket (an SFB layer)
        self._strategy: Strategy = self._build(
            optimizer,
            params,
            sfb_modules,
            topology=topology,
            overlap=overlap,
            staleness_lr=staleness_lr,
            reliable=reliable,
            recovery=recovery,
        )
        self._hooks = GradientHooks(params, owner=self, on_ready=DistributedOptimizer._on_grad_ready)
        self._steps = self._strategy.resumed_step

    def _refuse(
        self,
        strategy: str,
        compression: str | Compressor | None,
        *,
        bucket_bytes: int,
        overlap: bool,
        staleness_lr: bool,
        reliable: Reliable | None,
        hybrid_options: bool,
    ) -> Compressor | None:
        """Refuses the options that do not go with this strategy (:func:`paratrain.strategy.check_options`: each
        refusal says what to do); returns the compressor of ``compression``."""
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be a positive int (bytes), got {bucket_bytes!r}")
        compressor = compression if isinstance(compression, Compressor) else parse_compression(compression)
        options = StrategyOptions(
            compression=compressor,
            reliable=reliable is not None,
            layer_schemes=hybrid_options,
            overlap=overlap,
            staleness_lr=staleness_lr,
        )
        check_options(self.spec, options)
        return compressor

    def _plan(
        self,
        model: torch.nn.Module,
        params: Sequence[torch.nn.Parameter],
        *,
        batch_size: int | None,
        layer_schemes: Mapping[str, str] | None,
    ) -> list[tuple[str, torch.nn.Linear]]:
        """The buckets (a hybrid strategy's SFB layers each a unit of its own) and the launch order; returns the
        SFB layers."""
        infos = [ParamInfo(p.numel(), p.element_size(), f"{p.dtype}@{p.device}") for p in params]
        #: the per-layer schemes of a hybrid strategy (None for the others); ``hybrid_plan.table()`` prints it
        self.hybrid_plan: HybridPlan | None = None
        sfb_modules: list[tuple[str, torch.nn.Linear]] = []
        if self.spec.hybrid:
            self.hybrid_plan, sfb_modules = plan_layers(
                model,
                self.spec,
                self.context,
                batch_size=batch_size,
                overrides=layer_schemes,
                compression=self.compressor.spec if self.compressor is not None else None,
            )
            if self.context.rank == 0:
                log.info("%s", self.hybrid_plan.table())
        position = {id(p): i for i, p in enumerate(params)}
        separate = [tuple(position[id(p)] for p in own_params(m)) for _, m in sfb_modules]
        self.plan: list[Bucket] = plan_buckets(infos, self.bucket_bytes, separate=separate)
        self._where: dict[int, tuple[int, int]] = {}  # param index -> (bucket, position in it)
        for k, bucket in enumerate(self.plan):
            for j, i in enumerate(bucket.params):
                self._where[i] = (k, j)
        self._order = LaunchOrder([b.params for b in self.plan])
        return sfb_modules

    def _build(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
        sfb_modules: Sequence[tuple[str, torch.nn.Linear]],
        *,
        topology: Any,
        overlap: bool,
        staleness_lr: bool,
        reliable: Reliable | None,
        recovery: BuddyRecovery | None,
    ) -> Strategy:
        """The fused buckets and the strategy that sends them, by the strategy unit's builder."""
        request = BuildRequest(
            self.spec,
            self.context,
            optimizer,
            params,
            self._names,
            self.plan,
            sfb_modules,
            timeout=self._timeout,
            topology=topology,
            overlap=overlap,
            staleness_lr=staleness_lr,
            reliable=reliable,
            recovery=recovery,
            compressor=self.compressor,
        )
        alone = self._local and not self.spec.exchanges_parameters
        built: Built = (builders.alone if alone else builders.build)(request)
        self._buckets = built.buckets
        return built.strategy

    # -- the hook side -----------------------------------------------------------------------------------------

    def _on_grad_ready(self, index: int) -> None:
        """Hook: parameter ``index``'s gradient is final. Takes it into its bucket and starts what may start."""
        with self._lock:
            if self._closed:
                return
            self._synchronized = False
            k, j = self._where[index]
            try:
                launch = self._order.ready(index)
            except ValueError:
                raise RuntimeError(
                    f"parameter {self._names[index]!r} received a second gradient before step(): call step() (or "
                    "synchronize()) after each backward, or run the extra backward passes inside "
                    "`with opt.no_sync():` to accumulate gradients"
                ) from None
            if self._local:
                return
            bucket = self._buckets[k]
            if bucket is not None:
                bucket.take(j)
            if not self._overlap:
                self._deferred.extend(launch)
                return
            for b in launch:
                self._launch(b)

    def _launch(self, k: int) -> None:
        """Starts bucket ``k``'s communication; a strategy that reads the buffer at once first has the bucket's
        CUDA copies into it finished (:meth:`FusedBucket.wait_staged`)."""
        bucket = self._buckets[k]
        if bucket is not None and not self._strategy.waits_for_staging:
            bucket.wait_staged()
        self._strategy.launch(k)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating (DDP's ``no_sync``).

        Example::

            with opt.no_sync():
                loss_fn(model(x1), y1).backward()   # local only
            loss_fn(model(x2), y2).backward()       # sends the sum of both micro-batches' gradients
            opt.step()
        """
        self._hooks.enabled = False
        try:
            yield
        finally:
            self._hooks.enabled = True

    # -- the step ----------------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Finishes this step's communication without updating the parameters.

        With ``"allreduce"``, ``param.grad`` holds the averaged gradients afterwards, e.g. to clip them
        (``opt.synchronize(); clip_grad_norm_(...); opt.step()``); ``step()`` then does not communicate
        again. Every rank must call it. Blocks.
        """
        self._check_open()
        with self._lock:
            if self._synchronized:
                return
            deferred, self._deferred = self._deferred, []
            for k in deferred:
                if not self._local:
                    self._launch(k)
            for k in self._order.rest():
                if not self._local:
                    bucket = self._buckets[k]
                    if bucket is not None:
                        bucket.take_rest()
                    self._launch(k)
            try:
                self._strategy.finish()
            finally:
                self._order.reset()
            self._synchronized = True

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Synchronises this step's gradients and updates the parameters. Every rank must call it. Blocks.

        Args:
            closure: re-evaluates the model and returns the loss; it is called once, before synchronising (so
                optimizers that evaluate the closure several times, like LBFGS, are not supported).
        """
        self._steps += 1
        kill_point(self._steps)  # paratrain launch --kill RANK@step=K: an injected failure, here and nowhere else
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self.synchronize()
            with self._lock:
                self._synchronized = False
                self._strategy.apply(self._inner)
        except RegroupedError:
            self._steps -= 1  # the program computes this step again, for the re-formed job, and calls step() again
            raise
        except RolledBackError as exc:  # the program restores the state of that step and trains on from it
            self._steps = int(exc.checkpoint.meta["step"])
            raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad`` (``set_to_none=False`` keeps gradients in the fusion buffers)."""
        self._inner.zero_grad(set_to_none=set_to_none)

    @property
    def resumed_step(self) -> int:
        """The steps this process's predecessor completed when it replaced a dead worker of a parameter-server job
        (``paratrain launch --servers S --max-restarts R``, :mod:`paratrain.ps.rejoin`): the training loop goes on
        from there; 0 in a first process."""
        return self._strategy.resumed_step

    @property
    def launched(self) -> int:
        """How many buckets have started communicating in the current step (they start during backward)."""
        return self._order.launched - len(self._deferred)

    # -- delegation --------------------------------------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (change ``lr`` here or with an LR scheduler)."""
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (empty under the parameter-server strategies: it lives on the servers)."""
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` (identical on every rank under ``"allreduce"``)."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads into the wrapped optimizer (load the same state on every rank)."""
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the buckets are planned at construction; add groups before wrapping."""
        raise ConfigError(
            "parameters cannot be added to a DistributedOptimizer: add the group to the torch optimizer first, "
            "then wrap it"
        )

    def __getattr__(self, name: str) -> Any:
        # only called when normal lookup fails: torch.optim.Optimizer internals (hook registries...) are the
        # wrapped optimizer's, since Optimizer.__init__ never ran on this object
        if name.startswith("__") or name == "_inner" or "_inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistributedOptimizer holds hooks and connections and cannot be pickled; save state_dict()")

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer(strategy={self.strategy_name!r}, buckets={len(self.plan)}, "
            f"bucket_bytes={self.bucket_bytes}, optimizer={type(self._inner).__name__})"
        )

    # -- life cycle --------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this DistributedOptimizer was closed; create a new one")

    def close(self) -> None:
        """Removes the hooks, waits for communication in flight and leaves the servers. Idempotent.

        Every rank should call it (the parameter servers stop waiting for a worker once it has left).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._strategy.close()
        except RolledBackError:  # gossip: the program trains on from the rolled-back step, and closes again
            self._closed = False
            raise
        finally:
            if self._closed:
                self._hooks.remove()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` completed."""
        return self._closed

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _gossip_with_topology(strategy: str) -> str:
    """The strategy name for ``topology=`` given as an object: only a kind whose argument is a graph takes one,
    named without it (``"gossip"``).

    Raises:
        ConfigError: ``topology=`` with another strategy.
    """
    given = "<given>"
    named = isinstance(strategy, str) and ":" not in strategy
    if not named or complete(strategy, staleness=0, topology=given).topology != given:
        raise ConfigError(
            f"topology= is gossip's graph: use strategy='gossip' with it, not {strategy!r} (or write the "
            "graph into the name, 'gossip:ring', and leave topology out)"
        )
    return f"{strategy.strip()}:{given}"


def _check_types(optimizer: object, model: object) -> None:
    """Raises TypeError unless ``optimizer`` is a plain torch optimizer and ``model`` a module."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, DistributedOptimizer):
        raise TypeError("this optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _check_params(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    named: Sequence[tuple[str, torch.Tensor]],
    *,
    servers: bool,
) -> None:
    """Refuses an optimizer with parameters outside ``model``, a model with nothing to train, parameters a
    parameter server would update behind the optimizer's back (``servers``), and parameters on the meta device."""
    in_model = {id(p) for p in model.parameters()}
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = sum(1 for p in in_optimizer if id(p) not in in_model)
    if strangers:
        raise ConfigError(
            f"the optimizer holds {strangers} parameter(s) that are not in the model; their gradients would "
            "never be synchronised. Build the optimizer from model.parameters()"
        )
    if not named:
        raise ConfigError("the model has no parameter that requires grad: there is nothing to train")
    if servers:
        optimized = {id(p) for p in in_optimizer}
        outside = [name for name, p in named if id(p) not in optimized]
        if outside:
            raise ConfigError(
                f"parameter(s) {', '.join(outside)} require grad but are not in the optimizer; the parameter "
                "servers would update them anyway. Freeze them (requires_grad_(False)) or add them to the optimizer"
            )
    for name, p in named:
        if p.device.type == "meta":
            raise ConfigError(f"parameter {name!r} is on the meta device; materialise the model first")
