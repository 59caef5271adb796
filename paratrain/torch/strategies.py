"""How a step's fused gradients become new parameters: allreduce, a parameter server, or gossip (D-PSGD).

Each is a thin adapter over its own algorithm package (collectives, ps, gossip); the hybrid strategy builds on
them in :mod:`.hybrid`, and :meth:`~Strategy.compressed` decorates allreduce with :mod:`.compressed`.

Each follows the call order of :class:`~paratrain.torch.bucket_strategy.Strategy` (launch during backward,
finish and apply in ``step()``):

- ``"allreduce"`` (:class:`AllreduceStrategy`): each bucket is averaged over the workers with
  ``allreduce_async(buffer, op="mean")``; ``finish`` writes the means into ``param.grad``; ``apply`` runs the
  wrapped torch optimizer locally, identically on every rank (DDP, Horovod).
- ``"bsp"``, ``"ssp:S"``, ``"asp"`` (:class:`ParameterServerStrategy`): each bucket is one key of a
  :class:`~paratrain.ps.KVStore`; ``launch`` pushes its gradients, ``apply`` ends the clock and pulls the
  parameters the servers computed with their own copy of the optimizer (Li et al. OSDI'14, Petuum).
- ``"gossip:TOPOLOGY"`` (:class:`GossipStrategy`): decentralised D-PSGD (Lian et al. NeurIPS'17). Gradients
  stay local; each step's parameters leave for the graph neighbours as the step ends and travel during the
  next forward and backward; ``apply`` adds the Metropolis-Hastings weighted mix of them to the local step.

Threading: ``launch`` runs on the thread that runs backward, the others on the caller's; the optimizer holds
a lock around every call. Asynchronous collectives run in call order on the context's one background thread,
so issuing buckets in plan order is what keeps the ranks' messages matched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from paratrain.compression import Compressor
from paratrain.errors import ConfigError
from paratrain.gossip.exchange import ShmExchange, SocketExchange, open_exchange
from paratrain.gossip.mixing import neighbors, resolve_mixing
from paratrain.ps.client import KVStore
from paratrain.recovery.buddy import BuddyRecovery
from paratrain.runtime.context import Context
from paratrain.strategy import STRATEGIES, StrategyOptions, StrategySpec, check_options, parse_strategy
from paratrain.torch.bucket_strategy import Strategy
from paratrain.torch.compressed import CompressedAllreduceStrategy
from paratrain.torch.fusion import FusedBucket
from paratrain.transport.base import Handle

__all__ = [
    "STRATEGIES",
    "AllreduceStrategy",
    "GossipStrategy",
    "ParameterServerStrategy",
    "Strategy",
    "StrategySpec",
    "parse_strategy",
    "server_optimizer_spec",
]

_T = TypeVar("_T")


class AllreduceStrategy(Strategy):
    """Synchronous data parallelism: gradients averaged over the workers, then the same local step everywhere.

    Args:
        context: this rank's context.
        buckets: the fusion buffers, in plan order.
    """

    waits_for_staging = True

    def __init__(self, context: Context, buckets: Sequence[FusedBucket]) -> None:
        super().__init__(buckets)
        self.context = context
        self._handles: list[Handle[Any] | None] = [None] * len(self.buckets)

    def launch(self, k: int) -> None:
        """Starts the mean allreduce of bucket ``k`` in its buffer (nothing copied; nobody touches the buffer
        until :meth:`finish`: the bucket's gradients are complete, and a second backward before ``step()``
        raises); returns at once. A CUDA bucket's copies into the buffer may still run: the allreduce's thread
        waits for them (``ready=``), not the hook."""
        bucket = self.buckets[k]
        self._handles[k] = self.context.allreduce_async_(bucket.buffer, op="mean", ready=bucket.staged())

    def finish(self) -> None:
        """Waits for every bucket, in order, and writes the means into ``param.grad``."""
        handles, self._handles = self._handles, [None] * len(self.buckets)
        for bucket, handle in zip(self.buckets, handles, strict=True):
            if handle is None:
                raise RuntimeError("internal error: a bucket was never launched before finish()")
            bucket.give(handle.wait())

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Runs the wrapped optimizer on the averaged gradients (identically on every rank)."""
        optimizer.step()

    def close(self) -> None:
        """Waits for collectives still in flight, so that no rank leaves one half-done."""
        for handle in self._handles:
            if handle is not None:
                handle.wait()
        self._handles = [None] * len(self.buckets)

    def compressed(self, compressor: Compressor, optimizer: torch.optim.Optimizer) -> Strategy:
        """This allreduce with each bucket's mean replaced by its compressed estimate
        (:class:`~paratrain.torch.compressed.CompressedAllreduceStrategy` decorating it)."""
        return CompressedAllreduceStrategy(self, self.context, compressor, optimizer)


def _number(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _group_spec(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    kind = type(optimizer)
    name = kind.__name__

    def refuse_unless(key: str, expected: object, why: str) -> None:
        if key in group and group[key] != expected:
            raise ConfigError(f"{name}({key}={group[key]!r}) has no server-side equivalent: {why}")

    refuse_unless("maximize", False, "negate the loss instead")
    if kind is torch.optim.SGD:
        refuse_unless("dampening", 0, "the server's SGD has no dampening")
        return {
            "name": "sgd",
            "lr": _number(group["lr"]),
            "momentum": _number(group.get("momentum", 0.0)),
            "weight_decay": _number(group.get("weight_decay", 0.0)),
            "nesterov": bool(group.get("nesterov", False)),
        }
    if kind is torch.optim.Adam:
        refuse_unless("amsgrad", False, "the server's Adam has no AMSGrad")
        refuse_unless("decoupled_weight_decay", False, "the server's Adam has L2 decay, not AdamW's decoupled one")
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        return {
            "name": "adam",
            "lr": _number(group["lr"]),
            "betas": (_number(beta1), _number(beta2)),
            "eps": _number(group.get("eps", 1e-8)),
            "weight_decay": _number(group.get("weight_decay", 0.0)),
        }
    if kind is torch.optim.Adagrad:
        refuse_unless("lr_decay", 0, "the server's Adagrad has no lr_decay")
        return {
            "name": "adagrad",
            "lr": _number(group["lr"]),
            "eps": _number(group.get("eps", 1e-10)),
            "initial_accumulator_value": _number(group.get("initial_accumulator_value", 0.0)),
            "weight_decay": _number(group.get("weight_decay", 0.0)),
        }
    raise ConfigError(
        f"the parameter-server strategies run the optimizer on the servers, which implement torch.optim.SGD, "
        f"Adam and Adagrad (exactly those classes); got {name}. Use one of them, or strategy='allreduce', which "
        "runs any torch optimizer locally"
    )


def server_optimizer_spec(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The :mod:`paratrain.ps.optim` spec that does on a server what ``optimizer`` does locally.

    ``torch.optim.SGD`` maps to ``sgd`` (lr, momentum, weight_decay, nesterov), ``Adam`` to ``adam`` (lr,
    betas, eps, weight_decay) and ``Adagrad`` to ``adagrad`` (lr, eps, initial_accumulator_value,
    weight_decay). The servers apply one rule to every key, so every param group must have the same values.

    Raises:
        ConfigError: another optimizer class, an option the servers lack (dampening, amsgrad, AdamW's
            decoupled decay, lr_decay, maximize), or param groups with different hyperparameters.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> server_optimizer_spec(torch.optim.SGD([w], lr=0.1, momentum=0.9))
        {'name': 'sgd', 'lr': 0.1, 'momentum': 0.9, 'weight_decay': 0.0, 'nesterov': False}
    """
    specs = [_group_spec(optimizer, group) for group in optimizer.param_groups]
    for i, spec in enumerate(specs[1:], start=1):
        if spec != specs[0]:
            raise ConfigError(
                f"param groups 0 and {i} have different hyperparameters ({specs[0]} vs {spec}), but the servers "
                "apply one update rule to every parameter; use one group, or strategy='allreduce'"
            )
    return specs[0]


class ParameterServerStrategy(Strategy):
    """Gradients pushed to parameter servers, which run the optimizer; fresh parameters pulled back.

    One key per bucket. At construction every worker initialises the keys with its parameters (rank 0's
    values win) and pulls them, so all workers start from rank 0's model without a broadcast. A step pushes each
    bucket as its hook completes it, then ``kv.clock()`` and pulls every key. The servers take one optimizer step
    per round of pushes, on their mean gradient (:mod:`paratrain.ps.rounds`): under BSP the pull waits until every
    worker's gradients of this clock are applied (synchronous SGD); under SSP it may return parameters up to ``s``
    rounds stale, and under ASP whatever the servers hold (rounds of N pushes as they arrive). Every step pulls
    (no worker-side cache): under SSP(s > 0) and ASP the servers answer with a preview of the open rounds, which is
    fresher than any cached copy, and fresher reads converge faster.

    The servers keep the hyperparameters of construction: later changes to ``param_groups`` (an LR scheduler)
    are not applied there (a warning says so once). The local optimizer is never stepped and its state stays
    empty; the real state (momentum, Adam moments) lives on the servers.

    Args:
        context: this rank's context (the job must have servers: ``run_ranks(..., servers=S)`` or
            ``paratrain launch --servers S``).
        buckets: the fusion buffers (without used-flags).
        spec: the parsed strategy (bsp, ssp or asp).
        optimizer: the wrapped torch optimizer, translated by :func:`server_optimizer_spec`.
        key_prefix: prefix of the keys on the servers.
        staleness_lr: scale stale gradients by ``1 / staleness`` on the servers (see :class:`KVStore`).
    """

    def __init__(
        self,
        context: Context,
        buckets: Sequence[FusedBucket],
        *,
        spec: StrategySpec,
        optimizer: torch.optim.Optimizer,
        key_prefix: str = "paratrain.torch/bucket",
        staleness_lr: bool = False,
    ) -> None:
        super().__init__(buckets)
        self.spec = spec
        self.compressor: Compressor | None = None  # compressed() sets one
        self._server_spec = server_optimizer_spec(optimizer)
        self._warned = False
        self._keys = [f"{key_prefix}{k}" for k in range(len(self.buckets))]
        self.kv = KVStore(
            spec.kind,
            spec.staleness,
            optimizer=self._server_spec,
            context=context,
            staleness_lr=staleness_lr,
            cache=False,
            servers=context.settings.server_ranks,
        )
        self._handles: list[Handle[None] | None] = [None] * len(self.buckets)
        self._after_clock = self.kv.replicas > 1 and self.kv.policy.clocked  # pushes are waited for in apply()
        self._pulled: dict[str, npt.NDArray[Any]] = {}
        try:
            for key, bucket in zip(self._keys, self.buckets, strict=True):
                self.kv.init(key, bucket.read_params())
            self._pull()
        except BaseException:
            self.kv.close()
            raise

    def compressed(self, compressor: Compressor, optimizer: torch.optim.Optimizer) -> Strategy:
        """These servers receiving each push compressed (:meth:`Compressor.encode_push`); they step on what they
        decode. Refuses, like :func:`~paratrain.strategy.check_options`, the compressors the servers cannot run."""
        check_options(self.spec, StrategyOptions(compression=compressor))
        self.compressor = compressor
        return self

    def _pull(self) -> None:
        for key, bucket in zip(self._keys, self.buckets, strict=True):
            # the previous pull's array is reused (write_params copied it out): no allocation per step
            self._pulled[key] = pulled = self.kv.pull(key, out=self._pulled.get(key))
            flat = torch.from_numpy(pulled)
            if flat.dtype != bucket.buffer.dtype:  # bfloat16 travels as its 16-bit pattern
                flat = flat.view(bucket.buffer.dtype)
            bucket.write_params(flat)

    def launch(self, k: int) -> None:
        """Pushes bucket ``k``'s gradients (asynchronous; the buffer is not touched until :meth:`finish`).

        With ``compression``: as 16-bit floats (the servers add them at the key's width), or as the top-k entries
        of gradient + residual (:meth:`~paratrain.ps.KVStore.push_sparse`: a dense gradient, zero elsewhere)."""
        key, grads = self._keys[k], self.buckets[k].grads
        if self.compressor is None:
            self._handles[k] = self.kv.push(key, grads)
            return
        push = self.compressor.encode_push(key, grads)
        if push.indices is None:
            self._handles[k] = self.kv.push(key, push.values)
        else:
            self._handles[k] = self.kv.push_sparse(key, push.indices, push.values)

    def finish(self) -> None:
        """Waits until the servers have every bucket of this step. Replicated under BSP/SSP, a push is acknowledged
        only once its round is complete (:class:`~paratrain.ps.KVStore`), so :meth:`apply` waits, after the clock
        (the buffers stay untouched until then: a push sent again after a server died reads them)."""
        if not self._after_clock:
            self._wait_pushes()
        for bucket in self.buckets:
            bucket.reset()

    def _wait_pushes(self) -> None:
        handles, self._handles = self._handles, [None] * len(self.buckets)
        for handle in handles:
            if handle is not None:
                handle.wait(self.kv.timeout)

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Ends this worker's clock and pulls the parameters the servers computed."""
        if not self._warned and server_optimizer_spec(optimizer) != self._server_spec:
            self._warned = True
            warnings.warn(
                "the optimizer's hyperparameters changed (an LR scheduler?), but the parameter servers keep those "
                f"of construction ({self._server_spec}); use strategy='allreduce' to schedule them",
                RuntimeWarning,
                stacklevel=3,
            )
        self.kv.clock()
        if self._after_clock:
            self._wait_pushes()
        self._pull()

    @property
    def resumed_step(self) -> int:
        """A restarted worker's clock (one step, one clock), as its servers counted it (:mod:`paratrain.ps.rejoin`)."""
        return self.kv.resumed_clock

    def close(self) -> None:
        """Leaves the servers (they stop waiting for this worker's clocks)."""
        for handle in self._handles:
            if handle is not None:
                handle.wait(self.kv.timeout)
        self.kv.close()


def _numpy(flat: torch.Tensor) -> npt.NDArray[Any]:
    """A flat CPU tensor as a numpy view of its memory (bfloat16, which numpy lacks, as its 16-bit pattern)."""
    return flat.view(torch.int16).numpy() if flat.dtype == torch.bfloat16 else flat.numpy()


def _tensor(array: npt.NDArray[Any], dtype: torch.dtype) -> torch.Tensor:
    """A neighbour's flat array as a tensor of ``dtype``: a view if the array is writeable (a shared-memory
    slot), else a copy (a received message's read-only buffer, which torch must not wrap)."""
    raw = array.view(np.uint8) if array.flags.writeable else array.copy().view(np.uint8)
    return torch.from_numpy(raw).view(dtype)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16- and 32-bit parameters, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


class GossipStrategy(Strategy):
    """Decentralised parallel SGD (D-PSGD, Lian et al. NeurIPS'17), with the exchange hidden behind compute.

    Worker ``i`` holds its own parameters ``x_i``. Step ``k`` is Lian's update

        x_i(k+1) = sum_j W_ij x_j(k)  +  u_i(k)

    where ``W`` is the mixing matrix (the topology's Metropolis-Hastings weights, or the user's; always symmetric
    and doubly stochastic, so the workers' mean moves exactly as SGD on the mean gradient would) and ``u_i(k)``
    is what the wrapped optimizer does to ``x_i(k)`` with worker ``i``'s own gradient at ``x_i(k)`` (``-lr * g``
    for plain SGD; momentum and Adam state stay local and are not mixed). No rank ever talks to a non-neighbour
    and there is no global barrier: on a ring a worker sends two messages per step whatever the number of
    workers. The price is that workers
    disagree by a consensus distance that shrinks with the spectral gap.

    Overlap. Both terms depend only on ``x(k)``, so the mixing need not wait for the gradient: at the end of
    every step the new parameters are posted to the neighbours at once (non-blocking sends and receives), and
    they travel while the next forward and backward run. ``step()`` then waits only for what has not yet
    arrived, runs the local optimizer step and adds the mixing correction ``sum_j W_ij x_j(k) - x_i(k)``. The
    very first step has nothing in flight, so its exchange starts in ``step()`` (after any
    ``broadcast_parameters``). Parameters changed outside ``step()`` between two steps reach the neighbours
    one step late.

    Communication (:mod:`paratrain.gossip.exchange`, which this class adapts to torch): when every worker runs
    on this host and no network is emulated (``context.workers_share_memory()``), a step's parameters go into
    this worker's slot of a shared-memory segment of its own (:class:`~paratrain.gossip.exchange.ShmExchange`)
    and the neighbours read them in place; a worker waits only for its neighbours' counters. Otherwise
    (:class:`~paratrain.gossip.exchange.SocketExchange`): one message per neighbour per step holding every
    bucket's flat parameters, tagged with ``context.next_collective_tag()`` (taken at the same point on every
    rank, so ranks stay matched without a handshake); receives and sends are posted together, so exchanges with
    different neighbours run concurrently and no pair of ranks can deadlock.

    Mixing is computed in float32 (float64 for float64 parameters; 16-bit parameters are widened) and cast
    back: float64 throughout cost about 1 ms per step for a 1.2 MB model on this machine.

    Args:
        context: this rank's context.
        buckets: the fusion buffers, used only for their parameter layout (gradients are not fused).
        topology: a topology name, a graph file, a JSON file with a user-given ``"mixing_matrix"``, a list of
            edges, a networkx graph or a NumPy matrix (see :func:`paratrain.gossip.mixing.resolve_mixing`); a
            graph gets Metropolis-Hastings weights.
        overlap: False posts each exchange in ``step()`` instead of at the end of the previous one: the same
            update, computed later, for measuring what the overlap saves.
        shared_memory: force the shared-memory path on (all workers must share this host) or off; None
            decides from the context.
        recovery: survive a worker's death (``paratrain launch --max-restarts``): each worker's checkpoints kept
            by a buddy, and a death rolls every worker back to the newest checkpoint all hold
            (:mod:`paratrain.recovery.buddy`; ``step()`` and ``close()`` then raise ``RolledBackError``). The
            exchanges then go as messages, not through shared memory. The same update.

    Raises:
        ConfigError: unknown topology, unreadable file, or a graph or matrix invalid for ``context.world_size``
            ranks.
    """

    def __init__(
        self,
        context: Context,
        buckets: Sequence[FusedBucket],
        *,
        topology: Any,
        overlap: bool = True,
        shared_memory: bool | None = None,
        recovery: BuddyRecovery | None = None,
    ) -> None:
        super().__init__(buckets)
        self.overlap = bool(overlap)
        n = context.world_size
        self.mixing, self.edges = resolve_mixing(topology, n)
        self.neighbors = neighbors(self.mixing, context.rank)
        self.self_weight = float(self.mixing[context.rank, context.rank])
        self._sent: list[torch.Tensor] | None = None  # x_i(k) as posted to the neighbours
        self.recovery = recovery
        if recovery is not None:  # messages: a re-formed job opens a new exchange (_reopen)
            shared_memory = False
            recovery.reformed.append(self._reopen)
        if shared_memory is None:
            shared_memory = n > 1 and ShmExchange.supported() and context.workers_share_memory()
        self.exchange = open_exchange(
            context.workers,
            neighbors=self.neighbors,
            next_tag=context.next_collective_tag,
            timeout=context.settings.timeout,
            shared_memory=shared_memory,
            run_id=context.settings.run_id,
            nbytes=sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets),
        )

    @property
    def resumed_step(self) -> int:
        """The step a replacement resumes at: its checkpoint's (``recovery``), else 0."""
        loaded = self.recovery.load_checkpoint() if self.recovery is not None else None
        return int(loaded.meta["step"]) if loaded is not None else 0

    def launch(self, k: int) -> None:
        """Nothing to send during backward: the parameters left at the end of the previous step."""

    def finish(self) -> None:
        """Starts this step's exchange if none is in flight (the first step)."""
        for bucket in self.buckets:
            bucket.reset()
        if self._sent is None:
            self._post()

    def _post(self) -> None:
        """Posts ``x_i`` to every neighbour and a receive from each; returns at once."""
        self._sent = [bucket.read_params() for bucket in self.buckets]
        self._unless_broken(lambda: self.exchange.post([_numpy(flat) for flat in self._sent or []]))

    def _reopen(self, context: Context) -> None:
        """The job re-formed (``recovery``): exchanges go through its new context, from a rolled-back state."""
        self._sent = None
        self.exchange = SocketExchange(
            context.workers, neighbors=self.neighbors, next_tag=context.next_collective_tag,
            timeout=context.settings.timeout,
        )  # fmt: skip

    def _unless_broken(self, call: Callable[[], _T]) -> _T:
        """``call()``; with ``recovery``, a death it meets rolls the job back (:meth:`BuddyRecovery.guarded`)."""
        return call() if self.recovery is None else self.recovery.guarded(call)

    def _mixed(self) -> list[torch.Tensor]:
        """``sum_j W_ij x_j(k)`` per bucket, in the accumulation dtype; waits for the neighbours' parameters."""
        mine = self._sent
        if mine is None:
            raise RuntimeError("internal error: gossip step without an exchange in flight")
        mixed = [flat.to(_accumulation_dtype(flat.dtype), copy=True).mul_(self.self_weight) for flat in mine]
        for _, weight, arrays in self._unless_broken(self.exchange.wait):
            for acc, flat, theirs in zip(mixed, mine, arrays, strict=True):
                acc.add_(_tensor(theirs, flat.dtype).to(acc.dtype), alpha=weight)
        return mixed

    @torch.no_grad()
    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Local optimizer step plus mixing correction, then posts the new parameters for the next step.

        Raises:
            CommTimeoutError, PeerLostError: a neighbour did not answer within the context's timeout.
        """
        mixed = self._mixed()
        sent, self._sent = self._sent, None
        assert sent is not None  # _mixed() checked it
        optimizer.step()
        for bucket, before, avg in zip(self.buckets, sent, mixed, strict=True):
            stepped = bucket.read_params()
            correction = avg.sub_(before.to(avg.dtype))  # sum_j W_ij x_j(k) - x_i(k)
            bucket.write_params(correction.add_(stepped.to(avg.dtype)).to(stepped.dtype))
        if self.overlap:
            self._post()

    def close(self) -> None:
        """Completes the exchange posted after the last step, whose result is not used (see
        :meth:`NeighbourExchange.close <paratrain.gossip.exchange.NeighbourExchange.close>`).

        Raises:
            CommTimeoutError, PeerLostError: a neighbour did not send its last parameters (it stopped early).
        """
        self._sent = None
        self._unless_broken(self.exchange.close)
