"""Predicting a job's step time from a machine profile: the network and policies the runtime would use, the step
plan, the replay; and the plain alpha-beta formula, to show what the replay adds.

:func:`predict` mirrors the runtime's choices for a job on the profiled machine (what
:mod:`paratrain.runtime.group` decides): on one host without an emulated network, allreduce goes through
shared memory; with one (``bandwidth``/``latency``, the fault injector), every rank is a node with a link of
its own and ``auto`` picks by the alpha-beta model of that link; across hosts, ranks share their host's NIC.
The compute is the model profile measured with as many processes at once as the job has workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from paratrain.collectives.plans_blink import PackedTree
from paratrain.collectives.policy import (
    LOOPBACK_BYTES_PER_SECOND,
    MESSAGE_SECONDS,
    default_allreduce_choice,
    link_allreduce_choice,
    network_allreduce_choice,
)
from paratrain.fusion.buckets import DEFAULT_BUCKET_BYTES
from paratrain.sim.machine import LinkCost, MachineProfile, ModelProfile
from paratrain.sim.replay import Cores, Network, Replay
from paratrain.sim.step import StepJob
from paratrain.strategy import StrategySpec, parse_strategy, resolve
from paratrain.transport.faults import Link

#: Above this many workers a ring step on uniform links is replayed from rank 0 alone (:func:`symmetric_step`
#: with padding); below, every rank is replayed exactly.
SYMMETRIC_FROM = 64
#: Steps a parameter-server job is replayed for; its step is the period over the last ones (see
#: :func:`~paratrain.sim.step.repeat_steps`).
PS_STEPS = 4

__all__ = [
    "Composer",
    "JobRequest",
    "Prediction",
    "alpha_beta_step",
    "hybrid_layers",
    "link_trees",
    "network_for",
    "predict",
    "shared_cores",
]


@dataclass
class Prediction:
    """A predicted step.

    Attributes:
        step_s: seconds of one step (the slowest worker's; under ASP, where nobody waits for anybody, W over the
            sum of the workers' own step rates: the synchronous step of the same throughput).
        compute_s: the model's compute per step with no communication.
        replay: the replay (per-rank busy and waiting time, bytes, trace spans).
        job: what was simulated.
        algorithms: the allreduce algorithm each bucket used (allreduce jobs).
        steps: steps the replay covers (a parameter server's are chained, see :func:`predict`).
        settings: training options the prediction assumed beyond the job's own (a pipeline's ``balance``).
    """

    step_s: float
    compute_s: float
    replay: Replay
    job: StepJob
    algorithms: list[str] = field(default_factory=list)
    steps: int = 1
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def comm_wait_s(self) -> float:
        """Seconds per step the slowest worker's training loop stood waiting."""
        return max(self.replay.waiting[: self.job.workers], default=0.0) / self.steps

    @property
    def sent_per_step(self) -> int:
        """Bytes per step the busiest worker sent."""
        return max(self.replay.bytes_out[: self.job.workers], default=0) // self.steps


@dataclass(frozen=True)
class JobRequest:
    """A job to predict, as :func:`predict` takes it (its arguments' meanings there); what a strategy unit's
    composer (:mod:`paratrain.sim.compose`) turns into lanes of plan actions."""

    profile: MachineProfile
    model: str | ModelProfile
    spec: StrategySpec
    workers: int
    servers: int = 1
    batch_size: int = 64
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap: bool = True
    bandwidth: float | None = None
    latency: float = 0.0
    hosts: int = 1
    algorithm: str = "auto"
    slowdown: list[float] | None = None
    trace: bool = False
    compression: str | None = None
    microbatches: int = 0
    links: tuple[Link, ...] = ()

    def model_profile(self) -> ModelProfile:
        """The profiled model at the job's batch size with ``workers`` processes at once."""
        if isinstance(self.model, str):
            return self.profile.model(self.model, self.batch_size, self.workers)
        return self.model


class Composer(Protocol):
    """A strategy unit's simulator composer: its step as a replayed plan, and the textbook formula."""

    def predict(self, request: JobRequest) -> Prediction:
        """The predicted step (the plan of the runtime's own plans, replayed)."""
        ...

    def estimate(self, request: JobRequest, alpha: float, beta: float) -> float:
        """The plain alpha-beta formula's step (see :func:`alpha_beta_step`), over a link of (alpha, beta)."""
        ...


def link_trees(world_size: int, bandwidth: float | None, links: Sequence[Link]) -> tuple[PackedTree, ...] | None:
    """The trees ``"blink"`` packs over the emulated ``links`` among ``world_size`` ranks (the others sharing
    nodes' links of ``bandwidth``), as every rank of such a job packs them; None without links."""
    if not links:
        return None
    return _link_policy(world_size, bandwidth, 0.0, links)[0]


def _link_policy(
    world_size: int, bandwidth: float | None, latency: float, links: Sequence[Link]
) -> tuple[tuple[PackedTree, ...], Callable[[int, int], str]]:
    """The trees and the policy of a job under ``links`` (:func:`link_allreduce_choice`, as the runtime builds
    them: every message costs :data:`MESSAGE_SECONDS` on top of the emulated latency)."""
    own = {
        (p.a, p.b): (p.latency + MESSAGE_SECONDS, p.bandwidth or LOOPBACK_BYTES_PER_SECOND)
        for p in links
        if max(p.a, p.b) < world_size
    }
    return link_allreduce_choice(world_size, own, latency=latency + MESSAGE_SECONDS, bandwidth=bandwidth)


def network_for(
    profile: MachineProfile,
    *,
    world_size: int,
    bandwidth: float | None = None,
    latency: float = 0.0,
    hosts: int = 1,
    concurrency: int = 1,
    links: Sequence[Link] = (),
) -> tuple[Network, Callable[[int, int], str]]:
    """The network and the allreduce policy the runtime would have for this job (see the module docstring).

    Args:
        profile: the machine (its ``ipc``, ``tcp``, ``shm`` paths).
        world_size: ranks of the job (workers and servers).
        bandwidth: the fault injector's per-node bandwidth in bytes/s (None: not emulated).
        latency: the fault injector's one-way latency in seconds.
        hosts: hosts the ranks are spread over (block placement).
        concurrency: processes sharing this host's cores (the job's workers): the paths measured under that
            load (``"ipc@N"``, ``"injected@N"``) are used where the profile has them.
        links: the fault injector's pairs with a link of their own (``links=FILE``): their messages queue on it,
            at its bandwidth and latency, on top of the measured path.

    Raises:
        ConfigError: the profile lacks a path the job needs.
    """
    shm_alpha = profile.paths["shm"].alpha if "shm" in profile.paths else 0.0
    emulated = bandwidth is not None or latency > 0 or bool(links)
    if emulated:
        base = profile.link("injected", concurrency, fallback="ipc") if hosts == 1 else profile.path("tcp")
        wire = 1.0 / bandwidth if bandwidth else 0.0  # the injector's queues: the sender's, then the receiver's
        link = LinkCost(base.alpha + latency, base.beta + wire, ingress_beta=max(base.beta, wire))
        if not links:  # (the policy the runtime runs: MESSAGE_SECONDS, not this profile's alpha)
            choose = network_allreduce_choice(latency + MESSAGE_SECONDS, bandwidth)
            return Network.uniform(link, shm_alpha=shm_alpha), choose
        own = {}
        for pair in links:
            cost = LinkCost(base.alpha + pair.latency, base.beta + (1.0 / pair.bandwidth if pair.bandwidth else 0.0))
            own[(pair.a, pair.b)] = own[(pair.b, pair.a)] = cost

        def route(s: int, d: int) -> tuple[LinkCost, Any, Any]:
            cost = own.get((s, d))
            return (link, ("out", s), ("in", d)) if cost is None else (cost, ("own", s, d), ("own-in", s, d))

        return Network(route, shm_alpha=shm_alpha), _link_policy(world_size, bandwidth, latency, links)[1]
    if hosts == 1:
        link = profile.link("ipc", concurrency)
        return Network.uniform(link, shm_alpha=shm_alpha), lambda nbytes, n: "shm"
    per_host = -(-world_size // hosts)
    network = Network.hosts(
        lambda r: r // per_host,
        profile.path(profile.cluster.intra),
        profile.path(profile.cluster.inter),
        shm_alpha=shm_alpha,
    )
    return network, default_allreduce_choice


def predict(
    profile: MachineProfile,
    model: str | ModelProfile,
    *,
    workers: int,
    strategy: str = "allreduce",
    servers: int = 1,
    batch_size: int = 64,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    overlap: bool = True,
    bandwidth: float | None = None,
    latency: float = 0.0,
    hosts: int = 1,
    algorithm: str = "auto",
    slowdown: list[float] | None = None,
    trace: bool = False,
    compression: str | None = None,
    microbatches: int = 0,
    links: tuple[Link, ...] = (),
) -> Prediction:
    """Predicts one step of a data-parallel job on the profiled machine.

    Args:
        profile: the machine profile (``paratrain profile``).
        model: a profiled model's name (looked up at ``batch_size`` with ``workers`` processes at once) or a
            model profile.
        workers, strategy, servers, bucket_bytes, overlap: the job (as ``paratrain train`` takes them).
        bandwidth, latency: the emulated network (bytes/s, seconds), as ``--bandwidth``/``--latency``.
        hosts: hosts the ranks are spread over.
        links: the emulated pairs with links of their own (``--faults links=FILE``, :func:`read_links`).
        algorithm: ``"auto"`` (the runtime's policy) or one allreduce algorithm for every bucket.
        slowdown: per rank, how much slower its compute runs (stragglers).
        trace: keep the replay's Chrome-trace spans.
        compression: ``"fp16"`` or ``"bf16"`` with allreduce (``--compression``), or None.
        microbatches: a pipeline's (``strategy`` ``"pipeline:gpipe"`` or ``"pipeline:1f1b"``, one stage per
            worker, ``batch_size`` examples per pipeline and step, as ``paratrain train`` takes them); 0: as
            many as stages.

    Raises:
        ConfigError: the profile lacks the model or a path.
    """
    request = JobRequest(
        profile,
        model,
        parse_strategy(strategy),  # the names train takes, parsed as train parses them
        workers=workers,
        servers=servers,
        batch_size=batch_size,
        bucket_bytes=bucket_bytes,
        overlap=overlap,
        bandwidth=bandwidth,
        latency=latency,
        hosts=hosts,
        algorithm=algorithm,
        slowdown=slowdown,
        trace=trace,
        compression=compression,
        microbatches=microbatches,
        links=links,
    )
    composer: Composer = resolve(request.spec.info.composer)
    return composer.predict(request)


def shared_cores(model: ModelProfile, *, world_size: int, hosts: int) -> Cores | None:
    """How the job's ranks share their hosts' cores, from how the model's profile saw them shared
    (:meth:`ModelProfile.cores`); None where the profile does not say (one process, or no step alone measured):
    then every compute takes its profiled time."""
    shares = model.cores()
    if shares is None:
        return None
    per_host = -(-world_size // max(1, hosts))
    return Cores(capacity=shares[0], alone=shares[1], host_of=None if hosts <= 1 else (lambda r: r // per_host))


def hybrid_layers(
    model: ModelProfile,
    strategy: str | StrategySpec,
    *,
    workers: int,
    batch_size: int,
    bandwidth: float | None,
    latency: float,
    choose: Callable[[int, int], str],
) -> tuple[str, ...]:
    """The layers a hybrid strategy sends by SFB: every fully-connected one for ``sfb``; for ``poseidon:allreduce``
    those :func:`paratrain.sfb.choose_schemes` picks with the job's numbers, as the optimizer asks it."""
    from paratrain.sfb.cost import LayerShape, choose_schemes

    linear = [layer for layer in model.layers if layer.out_features]
    if not (strategy if isinstance(strategy, StrategySpec) else parse_strategy(strategy)).chooses_layers:
        return tuple(layer.name for layer in linear)
    shapes = [
        LayerShape.linear(layer.name, layer.out_features, layer.in_features, bias=len(layer.param_bytes) > 1)
        if layer.out_features
        else LayerShape(layer.name, max(1, sum(layer.param_bytes) // 4))
        for layer in model.layers
    ]
    plan = choose_schemes(
        shapes,
        workers=workers,
        batch=batch_size,
        dense="allreduce",
        latency=latency,
        bandwidth=bandwidth,
        allreduce_algorithm=choose,
    )
    return tuple(c.layer.name for c in plan.choices if c.scheme == "sfb")


def alpha_beta_step(
    profile: MachineProfile,
    model: ModelProfile,
    *,
    workers: int,
    strategy: str = "allreduce",
    servers: int = 1,
    bandwidth: float | None = None,
    latency: float = 0.0,
    batch_size: int = 64,
    compression: str | None = None,
    microbatches: int = 0,
) -> float:
    """The plain formula a back-of-the-envelope estimate uses: compute, plus the model's bytes through the
    textbook cost with no overlap, no buckets, no contention model beyond the obvious, no agreement::

        allreduce (ring)   compute + 2 (W-1) (alpha + n / (W b))   (n halved by fp16 or bf16 compression)
        parameter server   compute + 2 (alpha + W n / (S b))     (bsp, ssp, asp: every worker's n through S links)
        gossip             compute + alpha + d n / b              (the model to each of d neighbours, one link)
        pipeline           (M + K - 1) / M x compute / K + 2 (K - 1) (alpha + a / b)
                           (K = W stages, balanced; M micro-batches; a the largest layer output of one)
        sfb, poseidon:allreduce   compute + the ring for the dense layers' bytes
                                  + (W-1) (alpha + K (M + N) / b) per SFB layer (its rows, allgathered)

    with ``n`` the model's bytes and (alpha, 1/b) the link's; the SFB layers are those :func:`predict` takes.
    What :func:`predict` improves on (it adds the buckets' overlap with backward, every call's agreement, the
    queues of shared links, and SFB's rebuild).
    """
    if bandwidth is not None or latency > 0:
        base = profile.link("injected", workers, fallback="ipc")
        alpha = base.alpha + latency
        beta = base.beta + (1.0 / bandwidth if bandwidth else 0.0)
    else:
        link = profile.path("shm" if "shm" in profile.paths else "ipc")
        alpha, beta = link.alpha, link.beta
    request = JobRequest(
        profile,
        model,
        parse_strategy(strategy),
        workers=workers,
        servers=servers,
        batch_size=batch_size,
        bandwidth=bandwidth,
        latency=latency,
        compression=compression,
        microbatches=microbatches,
    )
    composer: Composer = resolve(request.spec.info.composer)
    return composer.estimate(request, alpha, beta)
