"""Pipeline-parallel training of a sequence of layers, one process per stage, executing a pure schedule.

Each rank of a pipeline holds one stage: a contiguous run of the model's layers (``balance`` says how
many). With ``replicas=R`` the workers form R pipelines of K = N / R stages (worker ``r * K + s`` is stage s of
pipeline r), each training on its own mini-batch, and the R copies of a stage sum their gradients (an allreduce
among them) before every optimizer step: data parallelism inside each stage, PipeDream's replicated stages.

:meth:`Pipe.step` trains on one mini-batch: stage 0 cuts it into micro-batches, and every stage executes its actions
of the schedule's plan (:attr:`Pipe.plan`, :func:`~paratrain.pipeline.schedules.lower` of a
:mod:`paratrain.pipeline.schedules` schedule, the plan the simulator replays), in order, nothing else: ``F m``
receives micro-batch m's activation from the previous stage (stage 0 takes the input), runs its layers and sends the
output on; ``B m`` receives the gradient of that output (the last stage computes the loss instead), back-propagates
through its layers and sends the input's gradient back; ``S`` is the optimizer step. Gradients go back only as far
as the first stage with parameters to train (:func:`~paratrain.pipeline.schedules.gradient_from`): stages in front
of it (a Flatten) run no backward and receive no gradients, which saves a message per micro-batch per such hop; an
empty message at the step's end (:func:`~paratrain.pipeline.schedules.done_tag`) keeps them from running ahead of
the others.

Update rule. GPipe and 1F1B: gradients of all micro-batches' losses are summed (``loss_fn`` per micro-batch, as
torch's ``scale_grads=False``), then one optimizer step, so the parameters equal non-pipelined training on the whole
mini-batch with the summed loss (tests: per parameter tensor, float64, to 1e-12); with replicas, on the R mini-
batches together. PipeDream: each micro-batch is a mini-batch of its own; every stage steps after each backward, and
a micro-batch's backward uses the weights its forward used (weight stashing: the forward runs on a copy of the
parameters of that moment, :func:`torch.func.functional_call`, and its gradient is applied to the current ones). The
versions each forward and backward used are recorded (:attr:`Pipe.versions`) and equal the schedule's.

Messages travel through the group's transport with the plan's tags, offsets in the group's own space (one per
micro-batch and direction per step); sends never block, and a stage waits only for the message its next step needs.
Where every stage computes on a GPU of its own (``p2p=``, decided by all stages together), the bytes of activations
and gradients go device to device through two NCCL process groups instead, one per direction (each direction's sends
then arrive in the order they were made, which is the order the schedule receives them; one group for both would let
a stage's send wait behind its own receive); the transport still carries each tensor's shape and dtype under its
tag, so a lost or late stage is noticed there as before. CPU tests run that path with Gloo (``p2p="gloo"``). A stage
that fails makes the others fail too: its process exits (the launcher stops the job) or, in-process, the transport
is aborted; a receive never waits longer than the context's timeout.

``trace=`` receives a span for every step (``forward m``, ``backward m``, ``optimizer step``, and with checkpointing
``recompute m``: compute), every wait for a message (``wait activation m``, ``wait gradient m``, ``wait sends``:
waiting), every send (``send activation m``, ``send gradient m``: handing the message to the transport, which sends
it in the background) and every gradient allreduce among replicas (communication): ``paratrain train`` draws them as
the run's timeline, and the benchmark measures each stage's bubble from them.

The schedules, the partitioner and the simulator's replay live elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from paratrain.collectives.torch_engines import ENGINE_DTYPES, DeviceIdentity, TorchEngine, choose_link, gpu_name
from paratrain.device import on_device, to_device, to_host
from paratrain.errors import ConfigError, MessageError
from paratrain.launch.kills import kill_point
from paratrain.pipeline.schedules import DONE, Schedule, Step, done_tag, gradient_from, lower, schedule
from paratrain.plan.ir import Action, Plan
from paratrain.runtime.context import Context, current
from paratrain.runtime.group import Group
from paratrain.transport.base import Handle

__all__ = ["Pipe"]

log = logging.getLogger("paratrain.pipeline")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``trace(name, category, start, end)``: one span of a stage's work (times from ``time.time()``).
Trace = Callable[[str, str, float, float], None]


def _device_of(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters (or buffers) live; the CPU for a module with neither."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _array(tensor: torch.Tensor, timeout: float) -> np.ndarray[Any, Any]:
    """What a stage sends: the tensor's bytes in host memory (a device tensor staged there, :mod:`paratrain.device`,
    waiting at most ``timeout`` seconds for the copy)."""
    t = tensor.detach()
    return (to_host(t, timeout) if on_device(t) else t.contiguous()).numpy()


class Pipe:
    """This rank's stage of a pipeline over the workers of ``context`` (rank s = stage s; with ``replicas=R``,
    rank ``r * K + s`` is stage s of pipeline r).

    Args:
        layers: the whole model as a sequence of modules (an ``nn.Sequential`` or a list), built identically on
            every rank (same seed); each rank keeps only its stage's layers.
        balance: layers per stage (one entry per worker), e.g. from
            :func:`paratrain.pipeline.partition.partition`; or ``"auto"``: stage 0 profiles every layer on
            ``sample`` (:func:`paratrain.torch.profile.profile_layers`), splits them so that the slowest stage
            is fastest, and tells the others.
        sample: one micro-batch of inputs, for ``balance="auto"`` (needed on stage 0 only).
        checkpoint: re-materialisation (activation checkpointing): a forward keeps only its input, and the
            backward runs the forward again first. Memory per micro-batch in flight drops to its input, for
            about one more forward of compute; the parameters stay exactly the same.
        microbatches: M, micro-batches per mini-batch.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"pipedream"`` or ``"pipedream-vsync"`` (vertical sync).
        optimizer: builds the stage's optimizer from its parameters, e.g. ``lambda p: torch.optim.SGD(p, lr=0.1)``.
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, on the last stage (use ``reduction="sum"`` for
            gradients equal to the whole mini-batch's summed loss).
        context: the paratrain context (default: the current one).
        replicas: R pipelines side by side (N = R * K workers), each on its own mini-batch; the copies of a
            stage sum their gradients before each optimizer step.
        trace: called with every span of this stage's work (see the module's docstring).
        device: where this stage computes, one device for all or one per stage (``["cuda:0", "cuda:1"]``, or
            ``"cuda"`` for processes that each see one GPU); the stage's layers are moved there, and its inputs
            (stage 0) and targets (the last stage). Default: where the stage's layers already are.
        p2p: how stages pass activations and gradients: ``"auto"`` (NCCL, device to device, where every stage is on
            a GPU of its own and torch has NCCL; else through host memory), ``"staged"`` (always through host
            memory and paratrain's transport), ``"nccl"`` (insist), ``"gloo"`` (CPU stages through Gloo). Decided
            by every stage together when the pipe is built (logged by stage 0).
        rejoin: this process replaces a dead stage of a running job (``paratrain launch --max-restarts``,
            :mod:`paratrain.recovery.buddy`): it never profiles; it takes the balance the other stages hold, which
            they tell it as they :meth:`reopen` in the re-formed job.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> def stage(ctx):
        ...     torch.manual_seed(0)
        ...     layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)]
        ...     pipe = Pipe(layers, balance=[2, 1], microbatches=2, schedule="1f1b", context=ctx,
        ...                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        ...                 loss_fn=nn.MSELoss(reduction="sum"))
        ...     x, y = torch.ones(6, 4), torch.zeros(6, 1)
        ...     return pipe.step(x if ctx.rank == 0 else None, y if ctx.rank == 1 else None) is not None
        >>> run_ranks(2, stage)
        [False, True]
    """

    def __init__(
        self,
        layers: Sequence[nn.Module] | nn.Sequential,
        *,
        balance: Sequence[int] | str,
        microbatches: int,
        schedule: str = "1f1b",
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        loss_fn: LossFn | None = None,
        context: Context | None = None,
        sample: torch.Tensor | None = None,
        checkpoint: bool = False,
        replicas: int = 1,
        trace: Trace | None = None,
        device: str | torch.device | Sequence[str | torch.device] | None = None,
        p2p: str = "auto",
        rejoin: bool = False,
    ) -> None:
        self.context = context if context is not None else current()
        modules = list(layers)
        world = self.context.world_size
        if replicas < 1 or world % replicas:
            raise ConfigError(f"replicas={replicas} must divide the {world} workers (K stages x R replicas)")
        stages = world // replicas
        #: R, the pipelines side by side
        self.replicas = replicas
        #: layers per stage
        self.balance = self._agree_balance(balance, modules, sample, stages, profile=not rejoin)
        self.stage_index = self.context.rank % stages
        #: which of the R pipelines this rank belongs to
        self.replica = self.context.rank // stages
        self.num_stages = stages
        first = sum(self.balance[: self.stage_index])
        self.module = nn.Sequential(*modules[first : first + self.balance[self.stage_index]])
        if isinstance(device, Sequence) and not isinstance(device, str):
            if len(device) != stages:
                raise ConfigError(f"device= names {len(device)} devices for {stages} stages; give one per stage")
            device = device[self.stage_index]
        if device is not None:
            self.module.to(device)
        #: where this stage computes: ``device=`` (one, or one per stage), else where its layers' parameters are.
        #: Activations and gradients arrive in host memory and are moved here; what it sends is staged to the host.
        self.device = torch.device(device) if device is not None else _device_of(self.module)
        self.schedule: Schedule = _schedule(schedule, stages, microbatches)
        self.microbatches = microbatches
        params = list(self.module.parameters())
        bounds = np.cumsum([0, *self.balance])
        learns = [
            any(p.requires_grad for m in modules[bounds[k] : bounds[k + 1]] for p in m.parameters())
            for k in range(stages)
        ]
        #: the first stage with parameters to train: the stages before it (a Flatten in front) learn nothing, so
        #: no gradient goes back to them and they run no backward (see :func:`gradient_from`)
        self.gradient_from = gradient_from(learns)
        #: the schedule lowered (:func:`~paratrain.pipeline.schedules.lower`): :meth:`step` executes this rank's
        #: actions, sends and receives included; the simulator replays plans of the same function
        self.plan: Plan = lower(self.schedule, first_learner=self.gradient_from)
        self._planned = _planned(self.plan.ranks[self.stage_index], self.steps)  # with their steps, by label
        #: None for a stage without parameters (an activation alone), which has nothing to step.
        self.optimizer = optimizer(params) if params else None
        self.loss_fn = loss_fn
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == stages - 1
        if self.is_last and loss_fn is None:
            raise ConfigError("the last stage computes the loss: give loss_fn=")
        self._trace = trace
        self.version = 0
        self.checkpoint = bool(checkpoint)
        #: the most bytes held at once for backward by micro-batches in flight (their inputs and the tensors
        #: autograd saved in their forwards), over all steps so far: GPipe holds M micro-batches, 1F1B K - s.
        self.peak_held_bytes = 0
        #: (step, micro-batch, version used) for every F and B run, in order: the white-box record.
        self.versions: list[tuple[str, int, int]] = []
        self._timeout = self.context.settings.timeout
        self._steps = 0  # mini-batches begun: where a kill schedule's step kill fires
        self._p2p = p2p
        self._open_groups()

    def _open_groups(self) -> None:
        """The pipeline's groups and links in :attr:`context` (collective: every stage opens them together)."""
        stages = self.num_stages
        # the pipeline's own tag space: its messages never meet the world's collectives
        self.group: Group = self.context.split(lambda rank: rank // stages)
        #: the R copies of this stage (None without replicas), which sum their gradients
        self.stage_group: Group | None = self.context.split(lambda rank: rank % stages) if self.replicas > 1 else None
        #: the engines that carry activations (forward) and gradients (backward) between stages, one process group
        #: each so that each direction's sends arrive in order; None: paratrain's transport, through host memory
        self.links: tuple[TorchEngine, TorchEngine] | None = self._open_links(self._p2p)

    def reopen(self, context: Context) -> None:
        """Meets the other stages again in ``context``, a job re-formed after a death (:mod:`paratrain.recovery`):
        the balance (told to a replacement, built with ``rejoin=True``), the groups and the links, as the
        constructor met them. The stage's layers, optimizer and version stay as they are (the caller restores a
        checkpoint). Collective over the new context, in the order a replacement's constructor runs it."""
        self.close()
        if context.world_size != self.context.world_size:
            raise ConfigError(
                f"a pipeline of {self.context.world_size} workers cannot go on with {context.world_size}: its stages "
                "are fixed (restart dead stages with --max-restarts, not --min-workers)"
            )
        self.context = context
        self._timeout = context.settings.timeout
        self._agree_balance(self.balance, [], None, self.num_stages, profile=False)
        self._open_groups()

    def _open_links(self, p2p: str) -> tuple[TorchEngine, TorchEngine] | None:
        """Every stage says where it computes; :func:`choose_link` decides alike on all (collective)."""
        import torch.distributed as dist

        cuda = self.device.type == "cuda"
        nccl = cuda and dist.is_available() and dist.is_nccl_available()
        name = gpu_name(self.device) if cuda else f"cpu:{self.group.rank}"
        mine = DeviceIdentity(name, bool(nccl), p2p)
        rows = self.group.collectives.allgather(mine.encode().reshape(1, -1))
        choice = choose_link([DeviceIdentity.decode(row) for row in rows])
        if self.group.rank == 0 and self.num_stages > 1:
            log.info("pipeline stages pass activations %s (%s)", choice.backend or "through host memory", choice.reason)
        if choice.backend is None or self.num_stages == 1:
            return None
        kind = "cuda" if cuda else "cpu"
        collectives = self.group.collectives
        return collectives.open_torch_distributed(choice.backend, kind), collectives.open_torch_distributed(
            choice.backend, kind
        )

    def close(self) -> None:
        """Lets the stages' point-to-point process groups go (a no-op through host memory). Idempotent."""
        links, self.links = self.links, None
        for engine in links or ():
            engine.close()

    def _send(self, peer: int, tag: int, tensor: torch.Tensor, *, forward: bool) -> Any:
        """Starts sending an activation (``forward``) or a gradient to stage ``peer``; ``.wait(timeout)`` ends it.

        Through the links: the shape and dtype go through the transport under ``tag`` (so a lost peer or a
        timeout is noticed there, as without links), the bytes through the direction's process group."""
        transport = self.group.transport
        if self.links is None:
            return transport.isend(peer, tag, [_array(tensor, self._timeout)])
        data = tensor.detach().contiguous()
        dtype = str(data.dtype).removeprefix("torch.")
        if dtype not in ENGINE_DTYPES:
            raise ConfigError(
                f"stage {self.stage_index} sends {dtype} tensors, which {self.links[0].name} cannot carry"
            )
        meta = transport.isend(peer, tag, [], {"s": list(data.shape), "d": dtype})
        return _Both(meta, self.links[0 if forward else 1].isend(data, peer))

    def _recv(self, peer: int, tag: int, *, forward: bool) -> torch.Tensor:
        """The next activation (``forward``) or gradient from stage ``peer``, on this stage's device."""
        msg = self.group.transport.recv(peer, tag, timeout=self._timeout)
        if self.links is None:
            return self._received(msg.arrays[0])
        shape, dtype = msg.meta.get("s"), msg.meta.get("d")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and dtype in ENGINE_DTYPES):
            raise MessageError(f"stage {peer} announced a tensor of shape {shape!r} and dtype {dtype!r}")
        out = torch.empty(shape, dtype=getattr(torch, str(dtype)), device=self.device)
        self.links[0 if forward else 1].recv_(out, peer, self._timeout)
        return out

    def _agree_balance(
        self,
        given: Sequence[int] | str,
        modules: list[nn.Module],
        sample: torch.Tensor | None,
        stages: int,
        *,
        profile: bool,
    ) -> list[int]:
        """The layers per stage, the same on every worker (one allgather): ``given``, or for ``"auto"`` what stage
        0 profiled and partitioned (a replacement, ``profile=False``, takes what the others hold). Every worker
        that knows a balance must know the same; an error on rank 0 is raised on every rank."""
        from paratrain.pipeline.partition import partition
        from paratrain.torch.profile import profile_layers

        if isinstance(given, str) and given != "auto":
            raise ConfigError(f"balance must be a list of layer counts or 'auto', not {given!r}")
        layers = len(modules) if modules else sum(self.balance)
        if len(modules) and len(modules) < stages:
            raise ConfigError(f"{len(modules)} layers cannot fill {stages} stages")
        if not isinstance(given, str) and (len(given) != stages or any(b < 1 for b in given) or sum(given) != layers):
            raise ConfigError(
                f"balance {list(given)} must give each of the {stages} stages at least one of the {layers} layers, "
                "and all of them"
            )
        # -1: not known here (a replacement, or "auto" on a stage other than 0); -2: stage 0 failed to profile
        found = np.full(stages, -1, dtype=np.int64)
        problem: Exception | None = None
        if not isinstance(given, str):
            found[:] = list(given)
        elif profile and self.context.rank == 0:
            try:
                if sample is None:
                    raise ConfigError("balance='auto' needs sample= (one micro-batch of inputs) on stage 0")
                found[:] = partition(profile_layers(modules, sample), stages).balance
            except Exception as exc:  # told to every stage below, then raised here
                problem, found[:] = exc, -2
        rows = np.asarray(self.context.allgather(found.reshape(1, -1))).reshape(-1, stages).tolist()
        if problem is not None:
            raise problem
        if any(min(row) == -2 for row in rows):
            raise ConfigError("stage 0 could not profile the layers for balance='auto' (see its error)")
        known = [row for row in rows if min(row) >= 1]
        if not known and modules:  # stage 0 died before the others learnt its balance: its replacement profiles
            return self._agree_balance(given, modules, sample, stages, profile=True)
        if not known:
            raise ConfigError("no worker knows the pipeline's balance: the stages cannot meet again")
        if any(row != known[0] for row in known):
            raise ConfigError(f"the workers were given different balances: {sorted({tuple(r) for r in known})}")
        return [int(b) for b in known[0]]

    def _forward(
        self, inp: torch.Tensor, params: dict[str, torch.Tensor] | None, target: torch.Tensor | None
    ) -> torch.Tensor:
        """The stage's layers on ``inp`` (on the stashed ``params`` if given), then the loss on the last stage."""
        out: torch.Tensor = (
            self.module(inp) if params is None else torch.func.functional_call(self.module, params, (inp,))
        )
        if target is not None:
            assert self.loss_fn is not None
            out = self.loss_fn(out, target)
        return out

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the stage's parameters as they are now (a weight version, for vertical sync)."""
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def _apply_gradients(self, trace: Trace | None) -> None:
        """The ``S`` step: with replicas, the copies of this stage first sum their gradients (one allreduce of
        every gradient as one flat buffer); then the optimizer steps and the gradients are cleared."""
        if self.optimizer is None:
            return
        params = list(self.module.parameters())
        if self.stage_group is not None:
            t0 = time.time()
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            self.stage_group.allreduce_(flat, op="sum")
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            if trace is not None:
                _span(trace, "allreduce gradients", "communication", t0)
        t0 = time.time()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if trace is not None:
            _span(trace, "optimizer step", "compute", t0)

    @property
    def steps(self) -> tuple[Step, ...]:
        """This stage's steps of one mini-batch."""
        return self.schedule.stages[self.stage_index]

    def _received(self, arr: np.ndarray[Any, Any]) -> torch.Tensor:
        """A received activation or gradient (read-only host memory) as a tensor of its own on this stage's
        device (copied there with the context's deadline, :func:`~paratrain.device.to_device`)."""
        host = torch.from_numpy(arr.copy())
        return host if self.device.type == "cpu" else to_device(host, torch.empty(0, device=self.device), self._timeout)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """The whole model's output on ``inputs`` (given on stage 0), returned on the last stage (None
        elsewhere): forward only, micro-batch by micro-batch through the stages, so that stage s works on
        micro-batch m while stage s + 1 works on m - 1. No parameter changes. Collective over the stages; blocks.

        Raises:
            ConfigError: no inputs on stage 0.
            CommTimeoutError, PeerLostError: another stage failed or did not send in time.
        """
        if self.is_first and inputs is None:
            raise ConfigError("stage 0 needs the inputs to predict")
        m = self.microbatches
        base = self.group.reserve_tags(m)
        xs = list(torch.tensor_split(inputs.to(self.device), m)) if self.is_first and inputs is not None else []
        outs: list[torch.Tensor] = []
        sends: list[Any] = []
        for mb in range(m):
            inp = xs[mb] if self.is_first else self._recv(self.stage_index - 1, base - mb, forward=True)
            out = self.module(inp)
            if self.is_last:
                outs.append(out)
            else:
                sends.append(self._send(self.stage_index + 1, base - mb, out, forward=True))
        for handle in sends:
            handle.wait(self._timeout)
        return torch.cat(outs) if self.is_last else None

    def rewind(self, steps: int, version: int) -> None:
        """After a rollback (:mod:`paratrain.recovery`), the stage's layers and optimizer restored to a checkpoint:
        the mini-batches begun and the weight version go back to the checkpoint's, and what the interrupted
        mini-batch left (gradients) is dropped."""
        self._steps, self.version = steps, version
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> float | None:
        """Trains on one mini-batch; blocks until this stage's steps are done. Collective over the stages.

        Args:
            inputs: the mini-batch's inputs, on stage 0 (ignored elsewhere).
            targets: its targets, on the last stage (ignored elsewhere).

        Returns:
            The sum of the micro-batches' losses on the last stage, None elsewhere.

        Raises:
            ConfigError: inputs or targets missing where they are needed.
            CommTimeoutError, PeerLostError: another stage failed or did not send in time.
        """
        self._steps += 1
        kill_point(self._steps)  # paratrain launch --kill RANK@step=K: an injected failure, here and nowhere else
        if self.is_first and inputs is None:
            raise ConfigError("stage 0 needs the mini-batch's inputs")
        if self.is_last and targets is None:
            raise ConfigError("the last stage needs the mini-batch's targets")
        return _MiniBatch(self, inputs, targets).run()


#: What a micro-batch keeps from its forward for its backward: the input, the output (None with checkpointing),
#: the stashed parameters it ran on (None: the live ones), its weight version, and the bytes it holds.
_Held = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None, int, int]


class _Planned(NamedTuple):
    """One action of a stage's plan and the schedule's step it is part of (found by its label, once per pipe).

    Attributes:
        action: the action.
        does: ``"recv"``, ``"send"``, ``"release"``, or the kind of the step a compute runs (``"F"``, ``"B"``, ``"S"``).
        position: the step's place among the stage's steps (-1: the empty message that ends a step).
        microbatch, version: the step's.
    """

    action: Action
    does: str
    position: int
    microbatch: int
    version: int


def _planned(actions: Sequence[Action], steps: Sequence[Step]) -> tuple[_Planned, ...]:
    """``actions`` with their steps (an action's label is ``str(step)``; a step's end message has none)."""
    position = {str(st): i for i, st in enumerate(steps)}
    out = []
    for a in actions:
        at = position.get(a.label, -1)
        step = steps[at] if at >= 0 else Step("S", -1, 0)
        out.append(_Planned(a, step.kind if a.kind == "compute" else a.kind, at, step.microbatch, step.version))
    return tuple(out)


class _MiniBatch:
    """One mini-batch on one stage: the stage's actions of :attr:`Pipe.plan` executed in order, one method per
    kind (forward, backward, release, optimizer step, send; a receive is posted and taken by what depends on it).

    Values pass between actions by number, as in the plan IR: the compute that depends on a receive waits for it,
    and what a compute makes for the send that depends on it (the activation of ``F m``, the input's gradient of
    ``B m``) waits in :attr:`produced` until then. The plan's tags are offsets below the step's first tag.
    """

    def __init__(self, pipe: Pipe, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        self.pipe = pipe
        m = pipe.microbatches
        self.inputs, self.targets = inputs, targets
        self.xs = list(torch.tensor_split(inputs.to(pipe.device), m)) if pipe.is_first and inputs is not None else []
        self.ys = list(torch.tensor_split(targets.to(pipe.device), m)) if pipe.is_last and targets is not None else []
        self.base = pipe.group.reserve_tags(done_tag(m) + 1)  # one per micro-batch and direction, and the step's end
        #: receives posted and not yet taken, by action number
        self.posted: dict[int, _Planned] = {}
        #: what a compute made for the send that depends on it, by the compute's number
        self.produced: dict[int, torch.Tensor] = {}
        self.sends: list[Any] = []
        self.held: dict[int, _Held] = {}
        self.holding = 0
        self.total: float | None = 0.0 if pipe.is_last else None
        self.stash = pipe.schedule.name.startswith("pipedream")
        # vertical sync: micro-batch m runs on every stage with the version stage 0 gave it, which a later stage
        # has already stepped past: it keeps the versions that planned forwards still need
        self.history = {pipe.version: pipe._snapshot()} if pipe.schedule.name == "pipedream-vsync" else None
        self.first_version = pipe.version  # the plan's versions count from this mini-batch's start
        self.trace = pipe._trace
        self.t0 = time.time()  # where the next span of the trace starts

    def run(self) -> float | None:
        """Executes the stage's actions, then waits for its sends; returns the summed loss on the last stage."""
        handlers: dict[str, Callable[[int, _Planned], None]] = {
            "recv": self.posted.__setitem__,
            "send": self._send,
            "release": self._release,
            "F": self._forward,
            "B": self._backward,
            "S": self._optimizer_step,
        }
        for index, planned in enumerate(self.pipe._planned):
            handlers[planned.does](index, planned)
        for index in list(self.posted):  # the end of the next stage's step, which no send here waited for
            self._end(index)
        t0 = time.time()
        for handle in self.sends:
            handle.wait(self.pipe._timeout)
        if self.trace is not None and self.sends:
            _span(self.trace, "wait sends", "waiting", t0)
        return self.total

    def _span(self, what: str, category: str, microbatch: int = -1) -> None:
        """Reports ``what`` (of micro-batch ``microbatch``) from :attr:`t0` to now, where the next span starts."""
        if self.trace is not None:
            name = what if microbatch < 0 else f"{what} {microbatch}"
            self.t0 = _span(self.trace, name, category, self.t0)

    def _received(self, index: int) -> torch.Tensor:
        """Takes receive ``index``: an activation from the previous stage or a gradient from the next."""
        planned = self.posted.pop(index)
        action = planned.action
        forward = action.peer < self.pipe.stage_index
        tensor = self.pipe._recv(action.peer, self.base - action.tag, forward=forward)
        self._span("wait activation" if forward else "wait gradient", "waiting", planned.microbatch)
        return tensor

    def _end(self, index: int) -> None:
        """Takes receive ``index``: the empty message that ends this stage's step (:data:`DONE`)."""
        action = self.posted.pop(index).action
        self.t0 = time.time()
        self.pipe.group.transport.recv(action.peer, self.base - action.tag, timeout=self.pipe._timeout)
        self._span("wait next stage", "waiting")

    def _forward(self, index: int, planned: _Planned) -> None:
        """``F m``: the micro-batch (stage 0's own, or the activation received) through the stage's layers on the
        weight version the plan names, and the loss on the last stage; keeps what the backward needs."""
        pipe = self.pipe
        self.t0 = time.time()
        mb, deps = planned.microbatch, planned.action.deps
        wants_grad = pipe.stage_index > pipe.gradient_from  # the input's gradient only where a stage before learns
        inp = self._received(deps[0]).requires_grad_(wants_grad) if deps else self.xs[mb]
        params: dict[str, torch.Tensor] | None = None
        wanted = self.first_version + planned.version
        if self.history is not None:  # the version the plan names, kept since stage 0 used it
            params = {n: t.clone().requires_grad_(True) for n, t in self.history[wanted].items()}
        elif self.stash:  # weight stashing: this micro-batch runs, forward and backward, on today's weights
            if wanted != pipe.version:
                raise RuntimeError(
                    f"stage {pipe.stage_index}: the plan says version {wanted} for F{mb}, "
                    f"the stage holds {pipe.version}"
                )
            params = {n: p.detach().clone().requires_grad_(True) for n, p in pipe.module.named_parameters()}
        target = self.ys[mb] if pipe.is_last else None
        saved = [inp.numel() * inp.element_size()]  # what this micro-batch holds until its backward
        if pipe.checkpoint:  # re-materialisation: keep the input only, recompute in the backward
            with torch.no_grad():
                out = pipe._forward(inp, params, target)
        else:
            counted = {_storage(inp), *(_storage(p) for p in pipe.module.parameters())}
            counted.update(_storage(t) for t in (self.inputs, self.targets) if t is not None)
            with torch.autograd.graph.saved_tensors_hooks(_counting(saved, counted), lambda t: t):
                out = pipe._forward(inp, params, target)
        version = wanted if self.stash else pipe.version
        pipe.versions.append(("F", mb, version))
        if self.total is not None:
            self.total += float(out.detach())
        self._span("forward", "compute", mb)
        if not pipe.is_last:
            self.produced[index] = out
        self.held[mb] = (inp, None if pipe.checkpoint else out, params, version, sum(saved))
        self.holding += sum(saved)
        pipe.peak_held_bytes = max(pipe.peak_held_bytes, self.holding)

    def _backward(self, index: int, planned: _Planned) -> None:
        """``B m``: back-propagates the loss (last stage) or the gradient received through what the forward kept
        (recomputing it first with checkpointing); a stashed copy's gradient goes to the live parameters."""
        pipe = self.pipe
        self.t0 = time.time()
        mb, deps = planned.microbatch, planned.action.deps
        inp, kept, params, version, nbytes = self.held.pop(mb)
        self.holding -= nbytes
        if kept is not None:
            out = kept
        else:  # re-materialisation: the forward again, this time keeping what backward needs
            out = pipe._forward(inp, params, self.ys[mb] if pipe.is_last else None)
            self._span("recompute", "compute", mb)
        if deps:
            torch.autograd.backward(out, self._received(deps[0]))
        else:  # the last stage: the loss
            torch.autograd.backward(out)
        if params is not None:  # the stashed copy's gradient goes to the live parameters
            for name, p in pipe.module.named_parameters():
                grad = params[name].grad
                p.grad = grad if p.grad is None or grad is None else p.grad + grad
        pipe.versions.append(("B", mb, version))
        self._span("backward", "compute", mb)
        if inp.grad is not None:
            self.produced[index] = inp.grad

    def _release(self, index: int, planned: _Planned) -> None:
        """``B m`` on a stage in front of the first learner: no gradient comes and nothing runs; the micro-batch
        lets go of what its forward kept."""
        _, _, _, version, nbytes = self.held.pop(planned.microbatch)
        self.holding -= nbytes
        self.pipe.versions.append(("B", planned.microbatch, version))

    def _optimizer_step(self, index: int, planned: _Planned) -> None:
        """``S v``: the optimizer step (:meth:`Pipe._apply_gradients`) that makes the next weight version; with
        vertical sync, the versions no planned forward needs any more are dropped."""
        pipe = self.pipe
        pipe._apply_gradients(self.trace)
        pipe.version += 1
        if self.history is not None:
            later = [self.first_version + st.version for st in pipe.steps[planned.position :] if st.kind == "F"]
            self.history[pipe.version] = pipe._snapshot()
            for old in [v for v in self.history if not later or v < min(later)]:
                del self.history[old]

    def _send(self, index: int, planned: _Planned) -> None:
        """Hands the transport an activation (to the next stage) or a gradient (to the previous one) that the
        compute before made, or the empty message that ends the previous stage's step."""
        pipe, action = self.pipe, planned.action
        tag = self.base - action.tag
        if action.label == DONE:
            for dep in action.deps:
                if dep in self.posted:  # this stage's own end came first
                    self._end(dep)
            self.sends.append(pipe.group.transport.isend(action.peer, tag, []))
            return
        value = self.produced.pop(action.deps[0], None)
        if value is None:
            raise RuntimeError(f"stage {pipe.stage_index}: {action!r} has nothing to send")
        forward = action.peer > pipe.stage_index
        self.sends.append(pipe._send(action.peer, tag, value, forward=forward))
        self._span("send activation" if forward else "send gradient", "communication", planned.microbatch)


def _span(trace: Trace, name: str, category: str, start: float) -> float:
    """Reports the span from ``start`` to now; returns now (where the next span starts)."""
    now = time.time()
    trace(name, category, start, now)
    return now


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _counting(saved: list[int], counted: set[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A saved-tensors pack hook that adds to ``saved`` the bytes of each tensor autograd keeps whose memory is
    not counted yet: not the micro-batch's input, not the stage's parameters (views of them included), not the
    caller's inputs and targets, each buffer once. Stashed parameter copies do count: they are per micro-batch."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        where = _storage(tensor)
        if where not in counted:
            counted.add(where)
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    return pack


def _schedule(name: str, stages: int, microbatches: int) -> Schedule:
    try:
        return schedule(name, stages, microbatches)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class _Both:
    """A send through a link: the announcement through the transport and the bytes through the process group."""

    def __init__(self, meta: Handle[None], data: Any) -> None:
        self.meta, self.data = meta, data

    def wait(self, timeout: float) -> None:
        self.meta.wait(timeout)
        self.data.wait(timeout)
