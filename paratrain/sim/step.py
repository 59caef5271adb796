"""One training step of a data-parallel job as a plan: the model's layers as compute, the strategy's own plans as
communication, on the lanes where the runtime runs them.

The composition follows what :class:`~paratrain.torch.optimizer.DistributedOptimizer` does, calling the same
pure functions, so a change to bucketing, an allreduce schedule or key sharding changes the prediction too::

    lane 0 (training loop)  overhead [slowest] F(layer 1) .. F(layer L) B(layer L) .. B(layer 1) [wait] optimizer
    lane 1 (background)                                             bucket 0's collective | bucket 1's | ...
                                                                    ^ starts after the B that completes it

* ``[slowest]``: the profile's ``straggle_s``, how much longer the slowest of the job's processes' step is
  expected to be than the median (synchronous strategies wait for it at every step);
* buckets: :func:`~paratrain.fusion.buckets.plan_buckets` over the profiled parameters (registration order =
  the layers' forward order), started in :class:`~paratrain.fusion.buckets.LaunchOrder` as backward produces
  them (or all after backward with ``overlap=False``);
* ``allreduce``: each bucket (gradients + one used-flag per parameter) by
  :func:`~paratrain.collectives.lower.allreduce_plan` with the algorithm the runtime's ``auto`` policy picks
  (shared memory on one host without an emulated network, the alpha-beta choice with one, the measured
  crossovers otherwise);
* ``sfb_layers`` (strategies ``sfb`` and ``poseidon:allreduce``): those fully-connected layers are units of
  their own (``plan_buckets(..., separate=...)``, as the optimizer plans them), each sent as its sufficient
  factors by :func:`~paratrain.collectives.lower.allgather_plan` (every worker's ``K (M + N)`` rows), and
  rebuilt on lane 0 at the step by a GEMM over the ``P K`` gathered rows, costed at P times the layer's forward
  (the same GEMM shape with P times the rows);
* ``bsp``: each bucket pushed by :func:`~paratrain.ps.plans.push_actions` over the chunks
  :func:`~paratrain.ps.sharding.plan_chunks` cuts (servers are ranks ``W..W+S-1``); after backward, the push
  acknowledgements, :func:`~paratrain.ps.plans.clock_actions`, then one blocking pull per bucket
  (:func:`~paratrain.ps.plans.pull_actions`), as the strategy's ``apply`` does. A server answers a worker on a
  lane of its own per worker, adds each push (``gamma`` per byte), and updates a chunk once every worker pushed
  it (its share of the optimizer time); the reply to a chunk's pull waits for that chunk's update only;
* ``asp`` and ``ssp`` (``staleness`` s >= 1): the same messages, but the server answers a pull at once
  (:mod:`paratrain.ps.rounds`: a preview of the open round, the worker's own push in it, costing a step on the
  chunk), so nobody waits for anybody, and the expected wait for the slowest worker (``straggle_s``) does not
  apply; under SSP a pull at step j also waits until the server has every worker's clock of step j - s
  (:func:`stale_bound`, across chained steps);
* ``gossip`` (:func:`gossip_steps`): D-PSGD on a graph, each step's model sent to the neighbours as it ends;
* ``compression`` (``fp16``, ``bf16``, with allreduce): each bucket divided by P and cast to 16 bits (two passes,
  ``copy`` per byte, on the background lane) before a collective of 2-byte items, and cast back on lane 0 at
  the step, as :class:`~paratrain.compression.Cast` runs.

Tags are offset per call (:data:`TAG_STRIDE`), as the runtime gives every call tags of its own.

Pipelines, whose step is a schedule's plan, live in :mod:`paratrain.sim.pipe`.

One step is not always the steady state: with a parameter server, the worker whose pulls the server answers
first starts its next step and pushes while the server still sends to the others, so one step's pulls overlap
the next one's pushes. :func:`repeat_steps` chains K copies of a step; a run's steady step is the period of the
last copies (what a measurement that leaves out the first steps sees).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from paratrain.collectives.lower import allgather_parts
from paratrain.collectives.lower_allreduce import allreduce_parts
from paratrain.collectives.plans_blink import PackedTree
from paratrain.collectives.shm import plan_args as shm_plan_args
from paratrain.errors import ConfigError
from paratrain.fusion.buckets import DEFAULT_BUCKET_BYTES, Bucket, LaunchOrder, ParamInfo, plan_buckets
from paratrain.plan.ir import Action, Plan
from paratrain.ps.plans import (
    batches,
    clock_actions,
    pull_actions,
    push_actions,
    serve_clock_action,
    serve_pull_actions,
    serve_push_actions,
)
from paratrain.ps.sharding import DEFAULT_CHUNK_BYTES, Chunk, plan_chunks
from paratrain.sim.machine import LayerCost, ModelProfile
from paratrain.strategy import StrategySpec, complete

__all__ = [
    "STRATEGIES",
    "TAG_STRIDE",
    "StepJob",
    "gossip_steps",
    "repeat_steps",
    "stale_bound",
    "step_plan",
    "symmetric_step",
]

#: Tag space of one call inside a composed step (a call's plan uses small tag offsets).
TAG_STRIDE = 1 << 12

#: Strategies :func:`step_plan` composes (``"gossip"`` through :func:`gossip_steps`).
STRATEGIES = ("allreduce", "bsp", "asp", "ssp", "gossip", "pipeline")
#: The tag of gossip's model messages (one per neighbour per step, in order).
GOSSIP_TAG = 7
#: Gradient compressions the allreduce step composes (a cast to 16 bits), by name as ``--compression`` takes them.
CASTS = {"fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class StepJob:
    """A data-parallel training job, as far as one step's timing depends on it.

    Attributes:
        model: the profiled model (per-layer times at the job's batch size).
        workers: W.
        strategy: ``"allreduce"``, ``"bsp"``, ``"ssp"``, ``"asp"`` (the parameter server) or ``"gossip"``.
        servers: S, for the parameter server.
        bucket_bytes: the fusion size (DistributedOptimizer's ``bucket_bytes``).
        chunk_bytes: the parameter server's key chunk size.
        overlap: wait-free backprop (buckets start during backward) or not.
        choose: the allreduce policy, ``(nbytes, world_size) -> algorithm`` (what ``algorithm="auto"`` runs).
        trees: the trees ``"blink"`` sends over (links of their own, :func:`~paratrain.sim.predict.link_trees`).
        itemsize: bytes per gradient element.
        sfb_layers: names of the layers sent by their sufficient factors (allreduce only); the caller takes them
            from :func:`paratrain.sfb.choose_schemes`, as the optimizer does.
        batch_size: rows per worker and step through each layer (K, for SFB).
        compression: ``"fp16"`` or ``"bf16"`` (allreduce): each bucket is cast to 16 bits before its collective
            and back after it, as :class:`~paratrain.compression.Cast` does; None: none.
        topology: the graph of ``gossip`` (a name :func:`~paratrain.gossip.mixing.resolve_mixing` takes).
        staleness: s of ``ssp`` (s >= 1; SSP(0) is ``bsp``).
        microbatches, schedule: a ``pipeline``'s (composed by :func:`paratrain.sim.pipe.pipeline_step`); its
            ``workers`` are its stages and ``batch_size`` the examples per pipeline and step.
    """

    model: ModelProfile
    workers: int
    strategy: str = "allreduce"
    servers: int = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    overlap: bool = True
    choose: Callable[[int, int], str] = dataclasses.field(default=lambda nbytes, n: "ring")
    trees: tuple[PackedTree, ...] | None = None
    itemsize: int = 4
    sfb_layers: tuple[str, ...] = ()
    batch_size: int = 0
    compression: str | None = None
    topology: str = "ring"
    staleness: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    spec: StrategySpec = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spec = complete(self.strategy, staleness=self.staleness, topology=self.topology, schedule=self.schedule)
        object.__setattr__(self, "spec", spec)
        if spec.staleness == 0:
            raise ConfigError(f"ssp needs staleness >= 1 (SSP(0) is bsp), got {self.staleness}")
        if spec.hybrid:
            raise ConfigError(
                f"the simulator composes {', '.join(STRATEGIES)}, not {self.strategy!r} (a hybrid's SFB layers are "
                "sfb_layers beside allreduce)"
            )
        if self.compression is not None and (self.compression not in CASTS or not self.plain_allreduce):
            raise ConfigError(
                f"the simulator composes {', '.join(CASTS)} compression with allreduce, not {self.compression!r} "
                f"with {self.strategy!r}"
            )
        if self.compression is not None and self.sfb_layers:
            raise ConfigError("the simulator does not compose compression with SFB layers")
        if self.sfb_layers and not self.plain_allreduce:
            raise ConfigError("the simulator sends SFB layers beside allreduce only (poseidon:allreduce, sfb)")
        known = {layer.name: layer for layer in self.model.layers}
        for name in self.sfb_layers:
            if name not in known or not known[name].out_features:
                raise ConfigError(f"SFB needs a profiled fully-connected layer; {name!r} is not one")
        if self.sfb_layers and self.batch_size < 1:
            raise ConfigError("SFB layers need batch_size (rows per worker and step)")
        if self.workers < 1 or (self.uses_servers and self.servers < 1):
            raise ConfigError(f"need at least one worker (and one server for bsp), got {self.workers}/{self.servers}")

    @property
    def uses_servers(self) -> bool:
        """Whether the job has parameter servers."""
        return self.spec.uses_servers

    @property
    def plain_allreduce(self) -> bool:
        """Whether the gradients are averaged by allreduce (the casts and SFB layers compose with it only)."""
        return self.spec.reduces_gradients

    @property
    def wire_itemsize(self) -> int:
        """Bytes per gradient element on the wire (after compression)."""
        return CASTS.get(self.compression or "", self.itemsize)

    @property
    def world_size(self) -> int:
        """Ranks in the plan: the workers, then the servers."""
        return self.workers + (self.servers if self.uses_servers else 0)

    def buckets(self) -> list[Bucket]:
        """The fusion plan DistributedOptimizer makes for this model."""
        infos = [
            ParamInfo(numel=nbytes // self.itemsize, itemsize=self.itemsize, kind="float32@cpu")
            for layer in self.model.layers
            for nbytes in layer.param_bytes
        ]
        separate, index = [], 0
        for layer in self.model.layers:
            if layer.name in self.sfb_layers:
                separate.append(tuple(range(index, index + len(layer.param_bytes))))
            index += len(layer.param_bytes)
        return plan_buckets(infos, self.bucket_bytes, separate=separate)

    def sfb_layer(self, bucket: Bucket) -> LayerCost:
        """The layer an SFB unit carries."""
        names = [layer.name for layer in self.model.layers if layer.name in self.sfb_layers]
        return next(layer for layer in self.model.layers if layer.name == names[bucket.group])


class _Rank:
    """One rank's actions being composed: parts appended with their dependencies renumbered."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    def add(self, action: Action) -> int:
        self.actions.append(action)
        return len(self.actions) - 1

    def part(self, part: Sequence[Action], *, lane: int, tag: int, after: Sequence[int] = ()) -> list[int]:
        """Appends a call's actions on ``lane`` with tags offset by ``tag``; its first action also waits for
        ``after``. Returns the new numbers of the part's actions."""
        base = len(self.actions)
        for j, a in enumerate(part):
            deps = tuple(base + d for d in a.deps)
            if j == 0 and after:
                deps = tuple(sorted(set(deps).union(after)))
            self.actions.append(dataclasses.replace(a, deps=deps, lane=lane, tag=a.tag + tag))
        return list(range(base, base + len(part)))


def _backward(rank: _Rank, job: StepJob) -> dict[int, int]:
    """Forward and backward compute on lane 0; returns bucket -> the action after which it may start."""
    model = job.model
    if model.overhead_s:
        rank.add(Action("compute", seconds=model.overhead_s, label="overhead"))
    if model.straggle_s and job.workers > 1 and job.spec.synchronous:  # all wait for the slowest
        rank.add(Action("compute", seconds=model.straggle_s, label="the slowest worker (expected)"))
    for layer in model.layers:
        rank.add(Action("compute", seconds=layer.forward_s, label=f"F {layer.name}"))
    buckets = job.buckets()
    order = LaunchOrder([b.params for b in buckets])
    first_param, index = [], 0
    for layer in model.layers:
        first_param.append(index)
        index += len(layer.param_bytes)
    launch: dict[int, int] = {}
    for li in reversed(range(len(model.layers))):
        layer = model.layers[li]
        done = rank.add(Action("compute", seconds=layer.backward_s, label=f"B {layer.name}"))
        for p in reversed(range(first_param[li], first_param[li] + len(layer.param_bytes))):
            for k in order.ready(p):
                launch[k] = done
    last = len(rank.actions) - 1
    for k in order.rest():
        launch[k] = last
    if not job.overlap:
        launch = {k: last for k in launch}
    return launch


def _allreduce_ranks(job: StepJob, which: Sequence[int], *, pad: bool = False) -> list[_Rank]:
    n, buckets = job.workers, job.buckets()
    ranks = [_Rank() for _ in which]
    ends: list[list[int]] = [[] for _ in which]
    launches = [_backward(rank, job) for rank in ranks]
    rebuild: list[list[tuple[int, float, str]]] = [[] for _ in range(n)]  # SFB: (allgather's end, GEMM s, name)
    for k, bucket in enumerate(buckets):
        if bucket.group >= 0:  # an SFB unit: every worker's rows, gathered
            layer = job.sfb_layer(bucket)
            rows = job.batch_size * (layer.out_features + layer.in_features)
            gather = allgather_parts(n, tuple((r * rows, (r + 1) * rows) for r in range(n)), job.itemsize)
            for j, r in enumerate(which):
                part = ranks[j].part(gather.rank(r), lane=1, tag=k * TAG_STRIDE, after=[launches[j][k]])
                ends[j] += part
                rebuild[j].append((part[-1], layer.forward_s * n, layer.name))
            continue
        count = bucket.numel + len(bucket.params)  # the gradients and one used-flag per parameter
        wire = job.wire_itemsize
        algorithm = job.choose(count * wire, n) if n > 1 else "none"
        if pad:
            count = -(-count // n) * n  # every ring chunk the size of the largest (see symmetric_step)
        if algorithm == "none":
            continue
        call = allreduce_parts(
            algorithm,
            n,
            count,
            wire,
            aliased=True,
            shm=shm_plan_args(n, wire) if algorithm == "shm" else None,
            trees=job.trees if algorithm == "blink" else None,
        )
        for j, r in enumerate(which):
            after = launches[j][k]
            if job.compression:  # g / P, then the cast: two passes over the bucket before it leaves
                cast = Action("copy", nbytes=2 * count * job.itemsize, label=f"cast bucket {k}", deps=(after,))
                after = ranks[j].add(dataclasses.replace(cast, lane=1))
            ends[j] += ranks[j].part(call.rank(r), lane=1, tag=k * TAG_STRIDE, after=[after])
    for r, rank in enumerate(ranks):
        last = len(rank.actions) - 1
        rank.add(Action("compute", seconds=0.0, label="synchronize", deps=tuple(sorted({last, *ends[r]}))))
        if job.compression:  # each bucket cast back to 32 bits as the step takes it
            for k, bucket in enumerate(buckets):
                if bucket.group < 0:
                    nbytes = (bucket.numel + len(bucket.params)) * job.itemsize
                    rank.add(Action("copy", nbytes=nbytes, label=f"cast back bucket {k}"))
        for _, seconds, name in rebuild[r]:
            rank.add(Action("compute", seconds=seconds, label=f"SFB rebuild {name}"))
        rank.add(Action("compute", seconds=job.model.optimizer_s, label="optimizer"))
    return ranks


def _ps_ranks(job: StepJob) -> list[_Rank]:
    w, s, buckets = job.workers, job.servers, job.buckets()
    servers = [w + j for j in range(s)]
    chunks: list[list[Chunk]] = [
        plan_chunks(f"paratrain.torch/bucket{k}", (b.numel,), job.itemsize, s, chunk_bytes=job.chunk_bytes)
        for k, b in enumerate(buckets)
    ]
    total = sum(b.numel for b in buckets) or 1
    workers = [_Rank() for _ in range(w)]
    for rank in workers:
        launch = _backward(rank, job)
        pushes: list[int] = []
        for k in range(len(buckets)):
            pushes += rank.part(push_actions(chunks[k], job.itemsize, servers), lane=1, tag=0, after=[launch[k]])
        last = len(rank.actions) - 1
        rank.add(Action("compute", seconds=0.0, label="push acks", deps=tuple(sorted({last, *pushes}))))
        rank.part(clock_actions(servers), lane=0, tag=0)
        for k in range(len(buckets)):
            previous = len(rank.actions) - 1
            rank.part(pull_actions(chunks[k], job.itemsize, servers), lane=0, tag=0, after=[previous])
    ranks = list(workers)
    for j in range(s):
        server = _Rank()
        pushed: dict[tuple[int, int], list[int]] = {}
        # each worker's messages on a lane of its own, in the order that worker sends them
        per_worker_pulls: list[list[tuple[int, list[Chunk]]]] = []
        mine = [
            [batch for batch in batches(chunks[k], job.itemsize) if batch[0].server == j] for k in range(len(buckets))
        ]
        for wk in range(w):
            lane = 1 + wk
            for k in range(len(buckets)):
                for batch in mine[k]:  # one message per batch, each chunk added as it is handled
                    received, ack = serve_push_actions(batch, job.itemsize, wk)
                    got = server.add(dataclasses.replace(received, lane=lane))
                    for c in batch:
                        size = c.num_rows * job.itemsize
                        add = server.add(Action("reduce", nbytes=size, items=c.num_rows, deps=(got,), lane=lane))
                        pushed.setdefault((k, c.index), []).append(add)
                    server.add(dataclasses.replace(ack, deps=(got,), lane=lane))
            server.add(dataclasses.replace(serve_clock_action(wk), lane=lane))
            per_worker_pulls.append([(k, batch) for k in range(len(buckets)) for batch in mine[k]])
        # a chunk is updated once every worker pushed it (the server's round is per chunk), so the replies to
        # pulls of chunks that are complete leave while later chunks still arrive
        updated: dict[tuple[int, int], int] = {}
        for k in range(len(buckets)):
            for c in chunks[k]:
                if c.server != j:
                    continue
                updated[(k, c.index)] = server.add(
                    Action(
                        "compute",
                        seconds=job.model.optimizer_s * c.num_rows / total,
                        label=f"update bucket {k} chunk {c.index}",
                        deps=tuple(pushed.get((k, c.index), ())),
                    )
                )
        for wk in range(w):
            lane = 1 + wk
            for k, batch in per_worker_pulls[wk]:
                asked, reply = serve_pull_actions(batch, job.itemsize, wk)
                request = server.add(dataclasses.replace(asked, lane=lane))
                ready: list[int] = []
                for c in batch:
                    if not job.spec.synchronous:  # at once: a preview of the open round, this worker's push in it
                        ready.append(
                            server.add(
                                Action(
                                    "compute",
                                    seconds=job.model.optimizer_s * c.num_rows / total,
                                    label=f"preview bucket {k} chunk {c.index}",
                                    deps=(request, pushed[(k, c.index)][wk]),
                                    lane=lane,
                                )
                            )
                        )
                    else:
                        ready.append(updated[(k, c.index)])
                server.add(dataclasses.replace(reply, deps=(request, *ready), lane=lane))
        ranks.append(server)
    return ranks


def step_plan(job: StepJob) -> Plan:
    """One training step of ``job`` as a plan (see the module docstring).

    Example:
        >>> from paratrain.sim.machine import LayerCost, ModelProfile
        >>> model = ModelProfile("tiny", 8, (LayerCost("fc", 0.001, 0.002, ("fc.weight",), (4096,)),))
        >>> plan = step_plan(StepJob(model, workers=2, choose=lambda nbytes, n: "ring"))
        >>> [a.label or a.kind for a in plan.ranks[0] if a.lane == 0]
        ['F fc', 'B fc', 'synchronize', 'optimizer']
        >>> plan.bytes_sent()
        [4100, 4100]
    """
    if job.spec.exchanges_parameters:
        raise ConfigError("a gossip step depends on the one before it (its messages left then): use gossip_steps")
    if job.spec.pipelined:
        raise ConfigError("a pipeline step is its schedule's plan: use paratrain.sim.pipe.pipeline_step")
    ranks = _ps_ranks(job) if job.uses_servers else _allreduce_ranks(job, range(job.workers))
    return Plan(f"step/{job.strategy}", tuple(tuple(r.actions) for r in ranks))


def gossip_steps(job: StepJob, k: int) -> tuple[Plan, list[int]]:
    """``k`` steps of D-PSGD as :class:`~paratrain.torch.strategies.GossipStrategy` runs them with overlap: a
    step's parameters leave for the graph's neighbours as the step ends and travel during the next forward and
    backward; the next step then waits for the neighbours' messages, mixes them (a reduce per neighbour, and the
    correction: a copy and two passes over the model), steps the optimizer and sends the new parameters. Each
    rank starts with the first step's sends (the runtime posts them in the first ``step()``); the last step's
    sends stay unreceived. Returns the plan and, per rank, how many actions precede the first step (step j of
    rank r is then the next ``j``-th equal block of its actions).

    Example:
        >>> from paratrain.sim.machine import LayerCost, ModelProfile
        >>> model = ModelProfile("tiny", 8, (LayerCost("fc", 0.001, 0.002, ("fc.weight",), (4096,)),))
        >>> plan, first = gossip_steps(StepJob(model, workers=4, strategy="gossip"), 2)
        >>> first, plan.bytes_sent()[0] == 3 * 2 * 4096
        ([2, 2, 2, 2], True)
    """
    from paratrain.gossip.mixing import neighbors, resolve_mixing
    from paratrain.gossip.plan import round_actions

    if not job.spec.exchanges_parameters or k < 1:
        raise ConfigError(f"gossip_steps composes gossip for k >= 1 steps, not {job.strategy!r} x {k}")
    mixing, _ = resolve_mixing(job.topology, job.workers)
    nbytes = job.model.param_bytes
    ranks, first = [], []
    for r in range(job.workers):
        # the exchange's round (what SocketExchange iterates): its sends leave as a step ends, its receives and
        # mixing come in the next step; the labels name them in the replay's trace
        round_ = round_actions(tuple(p for p, _ in neighbors(mixing, r)), nbytes)
        sends = [dataclasses.replace(a, label="model") for a in round_ if a.kind == "send"]
        recvs = [a for a in round_ if a.kind == "recv"]
        mixes = [a for a in round_ if a.kind == "reduce"]
        rank = _Rank()
        rank.part(sends, lane=0, tag=GOSSIP_TAG)
        first.append(len(rank.actions))
        for _ in range(k):
            _backward(rank, job)
            got = rank.part(recvs, lane=0, tag=GOSSIP_TAG)
            rank.add(Action("copy", nbytes=nbytes, label="x_i(k)", deps=tuple(got)))
            for a in mixes:  # each after its receive (the copy above waited for all of them)
                rank.add(dataclasses.replace(a, label="mix", deps=tuple(got[d] for d in a.deps)))
            rank.add(Action("compute", seconds=job.model.optimizer_s, label="optimizer"))
            rank.add(Action("reduce", nbytes=2 * nbytes, label="correction"))
            rank.part(sends, lane=0, tag=GOSSIP_TAG)
        ranks.append(tuple(rank.actions))
    return Plan(f"step/gossip:{job.topology}x{k}", tuple(ranks)), first


def repeat_steps(plan: Plan, k: int) -> Plan:
    """``k`` copies of a step plan, one after the other on every lane of every rank (each lane runs its actions
    in order, so copy j + 1 starts on a lane when copy j is done there and its own dependencies are met; a
    message matches the receive of the same copy, as sends and receives keep their order). Copy j of rank r is
    actions ``j n_r .. (j + 1) n_r - 1``, with ``n_r`` the step's actions of rank r.

    Example:
        >>> from paratrain.sim.machine import LayerCost, ModelProfile
        >>> model = ModelProfile("tiny", 8, (LayerCost("fc", 0.001, 0.002, ("fc.weight",), (4096,)),))
        >>> one = step_plan(StepJob(model, workers=2, choose=lambda b, n: "ring"))
        >>> three = repeat_steps(one, 3)
        >>> [len(a) for a in three.ranks] == [3 * len(a) for a in one.ranks], three.bytes_sent() == [
        ...     3 * b for b in one.bytes_sent()]
        (True, True)
    """
    if k < 1:
        raise ConfigError(f"repeat_steps needs at least one copy, got {k}")
    ranks = []
    for actions in plan.ranks:
        n = len(actions)
        ranks.append(
            tuple(
                dataclasses.replace(a, deps=tuple(d + j * n for d in a.deps)) if j else a
                for j in range(k)
                for a in actions
            )
        )
    return Plan(f"{plan.name}x{k}", tuple(ranks))


def stale_bound(plan: Plan, workers: int, staleness: int, k: int) -> Plan:
    """SSP's bound on ``k`` chained copies (:func:`repeat_steps`) of an ``ssp`` step plan: on every server, each
    pull reply of copy j also waits for every worker's clock message of copy j - ``staleness`` (the server
    answers a read at clock c once ``min(done) >= c - s``, :mod:`paratrain.ps.consistency`; a worker's pull
    in step j reads at clock j + 1, and the clock of step i makes ``done`` i + 1). Copies before
    ``staleness`` are not held.

    Example:
        >>> from paratrain.sim.machine import LayerCost, ModelProfile
        >>> model = ModelProfile("tiny", 8, (LayerCost("fc", 0.001, 0.002, ("fc.weight",), (4096,)),))
        >>> one = step_plan(StepJob(model, workers=2, strategy="ssp", servers=1))
        >>> held = stale_bound(repeat_steps(one, 3), 2, 1, 3).ranks[2]
        >>> n = len(one.ranks[2])
        >>> [len(a.deps) for a in held[2 * n :] if a.kind == "send" and a.nbytes]  # request, push, 2 clocks
        [4, 4]
    """
    if staleness < 0 or k < 1:
        raise ConfigError(f"stale_bound needs staleness >= 0 and k >= 1, got {staleness} and {k}")
    ranks = list(plan.ranks[:workers])
    for actions in plan.ranks[workers:]:
        n = len(actions) // k
        clocks = [i for i in range(n) if actions[i].kind == "recv" and actions[i].label == "clock"]
        replies = {i for i in range(n) if actions[i].kind == "send" and actions[i].nbytes > 0}
        out = list(actions)
        for j in range(staleness, k):
            held = tuple((j - staleness) * n + c for c in clocks)
            for i in replies:
                a = out[j * n + i]
                out[j * n + i] = dataclasses.replace(a, deps=tuple(sorted({*a.deps, *held})))
        ranks.append(tuple(out))
    return Plan(f"{plan.name}/ssp{staleness}", tuple(ranks))


def symmetric_step(job: StepJob, *, pad: bool = False) -> Plan | None:
    """Rank 0's step alone, for :func:`~paratrain.sim.replay.replay` with ``symmetric=job.workers``, when the
    step is the same on every worker up to a rotation of ranks: allreduce whose every bucket goes by the ring
    (and SFB's ring allgathers) with chunks of equal size. None otherwise (the tree, shared memory,
    uneven chunks, the parameter server): replay :func:`step_plan` then.

    With ``pad``, a bucket whose items do not divide into N equal chunks is costed as if padded to the next
    multiple of N (at most N - 1 items more, each chunk the size of the largest: an upper bound within
    N x itemsize bytes of the exact plan), so that a ring step of a thousand workers replays in a fraction of a
    second instead of building N times its actions."""
    if not job.plain_allreduce:
        return None
    n = job.workers
    for bucket in job.buckets():
        if bucket.group >= 0:
            continue
        count = bucket.numel + len(bucket.params)
        algorithm = job.choose(count * job.itemsize, n)
        if algorithm != "ring" or (count % n and not pad):  # "direct" is not: ranks >= 2 copy their array first
            return None
    ranks = _allreduce_ranks(job, [0], pad=pad)
    return Plan(f"step/{job.strategy}/rank0", (tuple(ranks[0].actions),))
