"""One training step of split layers (``tp:N``, ``soap:FILE``) as a plan of the runtime's own collectives, for the
simulator to replay.

The chain's moves come from the plan the torch front end executes (:func:`paratrain.soap.plan_chain`), each
lowered to the collective the runtime runs over the tensor group (an allreduce by the job's policy, a ring
allgather or reduce-scatter), its peers renumbered to the group's ranks; a split layer computes its part's
profiled time (:attr:`~paratrain.sim.machine.LayerCost.split_s`; 1/tensor of the layer where not measured); after
backward one allreduce of every gradient a worker holds runs over its data group, then the optimizer over its
share of the parameters (:meth:`paratrain.torch.soap.SoapModel.average_gradients`). Each call first costs the
profile's measured call (:attr:`~paratrain.sim.machine.ModelProfile.call_s`: checks, agreement and the API's
handling of a torch tensor, which split layers pay per move) and then its messages; without a measured call, the
agreement's messages are replayed instead.

The profile names only layers with parameters (and their places in the model's flat list of modules): the
modules between two of them are element-wise steps, as the bundled chains have (ReLU, pooling, Flatten). An
activation's size at a boundary is what the next linear layer reads (``batch x in_features``) or, before any
other step, what the last profiled layer wrote.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from paratrain.collectives.lower import PlanParts, allgather_parts, reduce_scatter_parts
from paratrain.collectives.lower_allreduce import allreduce_parts
from paratrain.collectives.plans import chunk_bounds
from paratrain.collectives.shm import plan_args as shm_plan_args
from paratrain.errors import ConfigError
from paratrain.plan.ir import Action, Plan
from paratrain.sim.machine import LayerCost, LinkCost, ModelProfile
from paratrain.sim.replay import Network, replay
from paratrain.sim.step import TAG_STRIDE
from paratrain.soap import (
    BLOCK_SPLIT,
    SEQUENCE_SPLIT,
    VOCAB_SPLIT,
    ChainPlan,
    LayerShape,
    Mesh,
    Move,
    OpSpec,
    SoapConfig,
    megatron_splits,
    plan_chain,
)

__all__ = ["Step", "TensorJob", "data_average_s", "profile_splits", "scaled", "steps_of", "tensor_step"]


def scaled(model: ModelProfile, batch_size: int) -> ModelProfile:
    """``model`` at another batch size: every layer's times (whole and split) and activation bytes, the input and
    the overhead in proportion to the examples; the optimizer's time unchanged (it steps the same parameters).
    What the planner uses when a tensor group trains on ``tensor`` times a data-parallel worker's examples.

    Example:
        >>> m = ModelProfile("m", 64, (LayerCost("0", 0.01, 0.02, output_bytes=256),), optimizer_s=0.005)
        >>> s = scaled(m, 128)
        >>> s.layers[0].forward_s, s.layers[0].output_bytes, s.optimizer_s, s.batch_size
        (0.02, 512, 0.005, 128)
    """
    if batch_size == model.batch_size:
        return model
    k = batch_size / model.batch_size
    layers = tuple(
        dataclasses.replace(
            layer,
            forward_s=layer.forward_s * k,
            backward_s=layer.backward_s * k,
            output_bytes=round(layer.output_bytes * k),
            split_s={key: (f * k, b * k) for key, (f, b) in layer.split_s.items()},
        )
        for layer in model.layers
    )
    return dataclasses.replace(
        model,
        batch_size=batch_size,
        layers=layers,
        overhead_s=model.overhead_s * k,
        input_bytes=round(model.input_bytes * k),
    )


@dataclass(frozen=True)
class Step:
    """A module of the model's flat list as the profile saw it: its layers (none: an element-wise step such as a
    ReLU; several: a module that holds layers, such as a transformer block or an embedding).

    Attributes:
        name: the module's name in the model (``"3"``).
        layers: its profiled layers, in forward order.
    """

    name: str
    layers: tuple[LayerCost, ...] = ()

    @property
    def heads(self) -> int:
        """A transformer block's heads (0 for any other module)."""
        return max((layer.heads for layer in self.layers), default=0)

    @property
    def shape(self) -> LayerShape | None:
        """What a split of it cuts (None: it does not split): a linear layer's features, a convolution's
        channels, a block's heads and MLP width."""
        if self.heads:
            fc1 = next((la for la in self.layers if la.name.endswith(".fc1")), None)
            return LayerShape(self.heads, fc1.out_features if fc1 else 0, kind="block")
        if len(self.layers) != 1 or self.layers[0].name != self.name:
            return None
        layer = self.layers[0]
        if layer.out_features:
            return LayerShape(layer.in_features, layer.out_features)
        if layer.channels[1]:
            return LayerShape(*layer.channels)
        return None

    def part(self, layer: LayerCost) -> str:
        """Which part of a block ``layer`` is (``"qkv"``, ``"ln1"``...), or its name outside a block."""
        return layer.name.rpartition(".")[2] if self.heads else layer.name


def steps_of(model: ModelProfile) -> list[Step]:
    """The model's flat modules with their profiled layers (see :class:`Step`).

    Raises:
        ConfigError: the profile does not place its layers among the model's modules.
    """
    if model.modules <= 0 or any(layer.module < 0 for layer in model.layers):
        raise ConfigError(
            f"the profile of {model.model!r} does not place its layers among the model's modules (profiled before "
            "paratrain recorded them): profile it again"
        )
    held: dict[int, list[LayerCost]] = {}
    for layer in model.layers:
        held.setdefault(layer.module, []).append(layer)
    steps = []
    for i in range(model.modules):
        layers = held.get(i, [])
        name = layers[0].name.partition(".")[0] if layers and "." in layers[0].name else None
        steps.append(Step(name or (layers[0].name if layers else f"#{i}"), tuple(layers)))
    return steps


def profile_splits(model: ModelProfile, config: SoapConfig) -> dict[str, str]:
    """The splits ``config`` gives the profiled ``model``: its own, or Megatron's over the profiled linear layers,
    convolutions and transformer blocks (the rule the runtime applies to the model itself, :func:`megatron_splits`).
    """
    if config.splits is not None:
        return dict(config.splits)
    return megatron_splits([(step.name, step.shape) for step in steps_of(model)], config.tensor)


@dataclass(frozen=True)
class TensorJob:
    """A job of split layers, as far as one step's timing depends on it.

    Attributes:
        model: the profiled model at ``batch_size`` examples (per tensor group) and the job's processes at once.
        mesh: the workers' ``tensor x data`` grid.
        splits: layer name -> ``column``, ``row`` or ``replicated`` (unnamed layers stay whole).
        batch_size: examples per tensor group and step.
        choose: the allreduce policy, ``(nbytes, world_size) -> algorithm``.
        itemsize: bytes per activation and gradient element.
    """

    model: ModelProfile
    mesh: Mesh
    splits: Mapping[str, str]
    batch_size: int
    choose: Callable[[int, int], str] = dataclasses.field(default=lambda nbytes, n: "ring")
    itemsize: int = 4

    def __post_init__(self) -> None:
        by_vocab = sorted(name for name, split in self.splits.items() if split == VOCAB_SPLIT)
        if by_vocab:
            raise ConfigError(
                f"the simulator does not compose embeddings or heads split by vocabulary yet ({', '.join(by_vocab)})"
            )
        names = {step.name for step in self.steps if step.shape is not None}
        missing = sorted(set(self.splits) - names)
        if missing:
            raise ConfigError(f"the profile of {self.model.model!r} has no layer {', '.join(missing)} to split")

    @functools.cached_property
    def steps(self) -> tuple[Step, ...]:
        """The model's flat modules (:func:`steps_of`), worked out once per job (a search asks for them often)."""
        return tuple(steps_of(self.model))

    def chain(self) -> tuple[list[Step], ChainPlan]:
        """The model's flat modules and their moves (a block reads and writes whole activations: its moves are
        inside it)."""
        steps = list(self.steps)
        ops = []
        for step in steps:
            shape = step.shape
            if shape is None:
                ops.append(OpSpec(step.name, None))
            else:
                split = "replicated" if shape.kind == "block" else self.splits.get(step.name, "replicated")
                ops.append(OpSpec(step.name, split))
        return steps, plan_chain(ops)

    def boundary_items(self, steps: Sequence[Step]) -> list[int]:
        """Elements of the activation at each boundary (before step i; the last: the output), per tensor group."""
        items, written = [], self.model.input_bytes // self.itemsize
        for step in [*steps, None]:
            first = step.layers[0] if step is not None and step.layers else None
            if (
                step is not None
                and step.shape is not None
                and step.shape.kind != "block"
                and first
                and first.in_features
            ):
                items.append(self.batch_size * first.in_features)
            else:
                items.append(written)
            if step is not None and step.layers:
                written = step.layers[-1].output_bytes // self.itemsize
        return items

    def events(self, part: int) -> list[Event]:
        """What tensor part ``part`` does in one step, in order: the one schedule that :func:`tensor_step` lowers
        and the alpha-beta estimate sums."""
        model = self.model
        steps, plan = self.chain()
        items = self.boundary_items(steps)
        out = [Event("overhead", seconds=model.overhead_s)] if model.overhead_s else []

        def moved(label: str, move: Move, size: int) -> None:
            if move not in (Move.NONE, Move.SLICE):  # a slice is local
                out.append(Event(label, move=move, items=size))

        seq = [self._split_of(step) == SEQUENCE_SPLIT for step in steps]
        # consecutive blocks split along the sequence pass their shards on: no gather between them, either way
        joined = [
            (i > 0 and seq[i - 1] and seq[i], i + 1 < len(seq) and seq[i] and seq[i + 1]) for i in range(len(seq))
        ]
        for i, step in enumerate(steps):
            moved(f"move {i}", plan.forward[i], items[i])
            self._compute(step, out, items[i + 1], backward=False, gathers=not joined[i][1])
        moved("move output", plan.forward[-1], items[-1])
        moved("move output gradient", plan.backward[-1], items[-1])
        for i in reversed(range(len(steps))):
            self._compute(steps[i], out, items[i + 1], backward=True, gathers=not joined[i][0])
            moved(f"move gradient {i}", plan.backward[i], items[i])
        shared = sum(
            sum(layer.param_bytes) // self.itemsize
            for step in steps
            if self._split_of(step) == SEQUENCE_SPLIT
            for layer in step.layers
            if step.part(layer).startswith("ln")
        )
        if shared:  # layer norms split along the sequence: each worker's gradient is its positions' share
            out.append(Event("sum the layer norms' gradients", move=Move.ALLREDUCE, items=shared))
        out.append(Event("average gradients", move=Move.ALLREDUCE, items=self.held_items(part), data_group=True))
        out.append(Event("optimizer", seconds=model.optimizer_s * self.held_share()))
        return out

    def _split_of(self, step: Step) -> str:
        return self.splits.get(step.name, "replicated") if self.mesh.tensor > 1 else "replicated"

    def _compute(self, step: Step, out: list[Event], written: int, *, backward: bool, gathers: bool = True) -> None:
        """A step's compute (forward or backward) into ``out``. A block split by heads with Megatron's f and g of
        its output (``written`` elements): an allreduce forward after the attention's and the MLP's output
        projections, and backward before the layer norms; split along the sequence too, a reduce-scatter and an
        allgather in their places, its layer norms on 1/N of the positions, and the block's output gathered
        (an allgather forward, and its input's gradient backward) unless ``gathers`` is False (the next block
        forward, the one before backward, takes the shards as they are)."""
        tensor, split = self.mesh.tensor, self._split_of(step)
        seq = split == SEQUENCE_SPLIT
        heads = split == BLOCK_SPLIT or seq
        f_move, g_move = (Move.REDUCE_SCATTER, Move.ALLGATHER) if seq and backward else (Move.ALLREDUCE, Move.NONE)
        if not backward:
            f_move, g_move = (Move.ALLGATHER, Move.REDUCE_SCATTER) if seq else (Move.NONE, Move.ALLREDUCE)
        order = list(reversed(step.layers)) if backward else list(step.layers)

        def move(label: str, kind: Move) -> None:
            if kind is not Move.NONE:
                out.append(Event(label, move=kind, items=written))

        for layer in order:
            part = step.part(layer)
            whole = layer.backward_s if backward else layer.forward_s
            if split == "replicated" or (heads and part.startswith("ln") and not seq):
                seconds = whole
            elif heads:
                seconds = whole / tensor  # heads; with the sequence, the layer norms' positions too
            else:
                measured = layer.split_s.get(f"{split}/{tensor}")
                seconds = measured[backward] if measured is not None else whole / tensor
            if heads and backward and part in ("proj", "fc2"):
                move(f"g {layer.name}", g_move)
            if heads and backward and part in ("ln1", "ln2"):
                move(f"f {layer.name}", f_move)
            out.append(Event(f"{'B' if backward else 'F'} {layer.name}", seconds=seconds))
            if heads and not backward and part in ("ln1", "ln2"):
                move(f"f {layer.name}", f_move)
            if heads and not backward and part in ("proj", "fc2"):
                move(f"g {layer.name}", g_move)
        if seq and gathers:  # forward: the block's output from every position; backward: its input's gradient
            move(f"gather {step.name}{' (backward)' if backward else ''}", Move.ALLGATHER)

    def compute_s(self) -> float:
        """Seconds of one step's computation on tensor part 0."""
        return sum(e.seconds for e in self.events(0))

    def moves(self) -> list[tuple[Move, int]]:
        """The tensor group's collectives of one step: (move, elements of the activation)."""
        return [(e.move, e.items) for e in self.events(0) if e.move is not Move.NONE and not e.data_group]

    def held_items(self, part: int) -> int:
        """Gradient elements tensor part ``part`` holds (a row split's bias, and a block's output projections'
        biases, on part 0 only)."""
        total, tensor = 0, self.mesh.tensor
        for step in self.steps:
            split = self._split_of(step)
            for layer in step.layers:
                sizes = [b // self.itemsize for b in layer.param_bytes]
                kind = step.part(layer)
                if split in (BLOCK_SPLIT, SEQUENCE_SPLIT) and kind in ("qkv", "fc1"):
                    split_layer = "column"
                elif split in (BLOCK_SPLIT, SEQUENCE_SPLIT) and kind in ("proj", "fc2"):
                    split_layer = "row"
                elif split in (BLOCK_SPLIT, SEQUENCE_SPLIT):
                    split_layer = "replicated"
                else:
                    split_layer = split
                if split_layer == "column":
                    total += sum(size // tensor for size in sizes)
                elif split_layer == "row":
                    total += sizes[0] // tensor + (sum(sizes[1:]) if part == 0 else 0)
                else:
                    total += sum(sizes)
        return total

    def held_share(self) -> float:
        """The share of the parameters part 0 holds (what the optimizer steps)."""
        whole = sum(sum(layer.param_bytes) for layer in self.model.layers) // self.itemsize
        return self.held_items(0) / whole if whole else 1.0


@dataclass(frozen=True, slots=True)
class Event:
    """One thing a worker does in a step: compute for ``seconds``, or ``move`` an activation (or its gradient)
    of ``items`` elements over its tensor group (over its data group: ``data_group``)."""

    label: str
    seconds: float = 0.0
    move: Move = Move.NONE
    items: int = 0
    data_group: bool = False


def _call(
    move: Move, n: int, items: int, itemsize: int, choose: Callable[[int, int], str], *, agreement: bool
) -> PlanParts | None:
    """The runtime's collective for ``move`` of an activation of ``items`` elements over ``n`` workers (its
    agreement's messages too, unless the profile's measured call cost stands for them)."""
    if move in (Move.NONE, Move.SLICE) or n == 1:
        return None
    bounds = tuple(chunk_bounds(items, n))
    if move is Move.ALLGATHER:
        return allgather_parts(n, bounds, itemsize, agreement=agreement)
    if move is Move.REDUCE_SCATTER:
        return reduce_scatter_parts(n, bounds, itemsize, agreement=agreement)
    algorithm = choose(items * itemsize, n)
    shm = shm_plan_args(n, itemsize) if algorithm == "shm" else None
    return allreduce_parts(algorithm, n, items, itemsize, aliased=True, shm=shm, agreement=agreement)


class _Lane:
    """One rank's actions being composed: a call's actions appended in order after the rank's last one, their
    peers renumbered from the group's to the job's ranks and their tags offset."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    def compute(self, seconds: float, label: str) -> None:
        self.actions.append(Action("compute", seconds=seconds, label=label, deps=self._last()))

    def call(self, part: Sequence[Action], members: Sequence[int], tag: int) -> None:
        base, after = len(self.actions), self._last()
        for j, a in enumerate(part):
            deps = tuple(base + d for d in a.deps) + (after if j == 0 else ())
            peer = members[a.peer] if a.peer >= 0 else a.peer
            self.actions.append(dataclasses.replace(a, deps=tuple(sorted(set(deps))), peer=peer, tag=a.tag + tag))
        if part:  # the rank goes on when the whole call is done
            self.actions.append(Action("compute", label="collective done", deps=tuple(range(base, len(self.actions)))))

    def _last(self) -> tuple[int, ...]:
        return (len(self.actions) - 1,) if self.actions else ()


def data_average_s(job: TensorJob, link: LinkCost, *, gamma: float = 0.0, copy: float = 0.0) -> float:
    """Seconds of the data groups' gradient average alone: the ring allreduce plan of what tensor part 0 holds over
    the ``data`` workers of a group, every link ``link``, replayed for one rank (every rank of a ring lives the
    same timeline: :func:`~paratrain.sim.replay.replay`'s ``symmetric``)."""
    d = job.mesh.data
    if d == 1:
        return 0.0
    parts = allreduce_parts("ring", d, job.held_items(0), job.itemsize, aliased=True)
    out = replay(Plan("data average", (parts.rank(0),)), Network.uniform(link), gamma=gamma, copy=copy, symmetric=d)
    return out.finish[0] + job.model.call_s


def tensor_step(job: TensorJob, *, data_s: float | None = None) -> Plan:
    """Every worker's actions in one step of ``job`` (see the module docstring). With ``data_s``, the first
    tensor group's only, each of its data-group averages a ``data_s``-second wait (:func:`data_average_s`): every
    group of a large job lives the same step, so one group's replay stands for thousands of workers' (the
    tensor group's and the data ring's traffic are then not queued together).

    Example:
        >>> from paratrain.sim.machine import LayerCost, ModelProfile
        >>> fc = lambda name, i, n, o, at: LayerCost(name, 0.002, 0.004, (f"{name}.weight",), (4 * n * o,),
        ...                                          output_bytes=4 * 8 * o, out_features=o, in_features=n, module=at)
        >>> model = ModelProfile("m", 8, (fc("0", 0, 16, 32, 0), fc("2", 0, 32, 4, 2)), modules=3, input_bytes=512)
        >>> plan = tensor_step(TensorJob(model, Mesh(2), {"0": "column", "2": "row"}, batch_size=8))
        >>> [a.label for a in plan.ranks[0] if a.kind == "compute" and a.label != "collective done"]
        ['F 0', 'F 2', 'B 2', 'B 0', 'optimizer']
        >>> sum(m.nbytes for m in plan.sends(0)) >= 4 * 8 * 4 // 2  # the row layer's partial sums, allreduced
        True
    """
    mesh, ranks = job.mesh, []
    for worker in range(mesh.tensor if data_s is not None else mesh.workers):
        part, _ = mesh.coordinates(worker)
        lane, calls = _Lane(), 0
        for event in job.events(part):
            if event.move is Move.NONE or (event.data_group and data_s is not None):
                lane.compute(event.seconds if event.move is Move.NONE else data_s or 0.0, event.label)
                continue
            members = mesh.data_group(worker) if event.data_group else mesh.tensor_group(worker)
            measured = job.model.call_s
            call = _call(event.move, len(members), event.items, job.itemsize, job.choose, agreement=not measured)
            if call is not None:
                if measured:
                    lane.compute(measured, f"{event.label}: the call")
                lane.call(call.rank(members.index(worker)), members, calls * TAG_STRIDE)
                calls += 1
        ranks.append(tuple(lane.actions))
    return Plan(f"step/tensor{mesh.tensor}x{mesh.data}", tuple(ranks))
