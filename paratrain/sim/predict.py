"""Predicting a job's step time from a machine profile: the network and policies the runtime would use, the step
plan, the replay; and the plain alpha-beta formula, to show what the replay adds.

:func:`predict` mirrors the runtime's choices for a job on the profiled machine (what
:mod:`paratrain.runtime.group` decides): on one host without an emulated network, allreduce goes through
shared memory; with one (``bandwidth``/``latency``, the fault injector), every rank is a node with a link of
its own and ``auto`` picks by the alpha-beta model of that link; across hosts, ranks share their host's NIC.
The compute is the model profile measured with as many processes at once as the job has workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paratrain.collectives.policy import default_allreduce_choice, network_allreduce_choice
from paratrain.fusion.buckets import DEFAULT_BUCKET_BYTES
from paratrain.sim.machine import LinkCost, MachineProfile, ModelProfile
from paratrain.sim.replay import Cores, Network, Replay, replay
from paratrain.sim.step import StepJob, gossip_steps, repeat_steps, stale_bound, step_plan, symmetric_step
from paratrain.strategy import parse_strategy

#: Above this many workers a ring step on uniform links is replayed from rank 0 alone (:func:`symmetric_step`
#: with padding); below, every rank is replayed exactly.
SYMMETRIC_FROM = 64
#: Steps a parameter-server job is replayed for; its step is the period over the last ones (see
#: :func:`~paratrain.sim.step.repeat_steps`).
PS_STEPS = 4

__all__ = ["Prediction", "alpha_beta_step", "hybrid_layers", "network_for", "predict"]


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


def network_for(
    profile: MachineProfile,
    *,
    world_size: int,
    bandwidth: float | None = None,
    latency: float = 0.0,
    hosts: int = 1,
    concurrency: int = 1,
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

    Raises:
        ConfigError: the profile lacks a path the job needs.
    """
    shm_alpha = profile.paths["shm"].alpha if "shm" in profile.paths else 0.0
    emulated = bandwidth is not None or latency > 0
    if emulated:
        base = profile.link("injected", concurrency, fallback="ipc") if hosts == 1 else profile.path("tcp")
        wire = 1.0 / bandwidth if bandwidth else 0.0  # the injector's queues: the sender's, then the receiver's
        link = LinkCost(base.alpha + latency, base.beta + wire, ingress_beta=max(base.beta, wire))
        return Network.uniform(link, shm_alpha=shm_alpha), network_allreduce_choice(latency, bandwidth)
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
) -> Prediction:
    """Predicts one step of a data-parallel job on the profiled machine.

    Args:
        profile: the machine profile (``paratrain profile``).
        model: a profiled model's name (looked up at ``batch_size`` with ``workers`` processes at once) or a
            model profile.
        workers, strategy, servers, bucket_bytes, overlap: the job (as ``paratrain train`` takes them).
        bandwidth, latency: the emulated network (bytes/s, seconds), as ``--bandwidth``/``--latency``.
        hosts: hosts the ranks are spread over.
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
    spec = parse_strategy(strategy)  # the names train takes, parsed as train parses them
    if spec.family == "pipeline":
        return _pipeline(
            profile,
            model,
            workers=workers,
            strategy=strategy,
            batch_size=batch_size,
            microbatches=microbatches,
            bandwidth=bandwidth,
            latency=latency,
            slowdown=slowdown,
            trace=trace,
        )
    model_profile = profile.model(model, batch_size, workers) if isinstance(model, str) else model
    world = workers + (servers if spec.uses_servers else 0)
    network, choose = network_for(
        profile, world_size=world, bandwidth=bandwidth, latency=latency, hosts=hosts, concurrency=workers
    )
    if algorithm != "auto":
        fixed = algorithm
        choose = lambda nbytes, n: fixed  # noqa: E731
    sfb_layers: tuple[str, ...] = ()
    if strategy in ("sfb", "poseidon:allreduce"):
        sfb_layers = hybrid_layers(
            model_profile,
            strategy,
            workers=workers,
            batch_size=batch_size,
            bandwidth=bandwidth,
            latency=latency,
            choose=choose,
        )
        strategy = "allreduce"
    topology, staleness = spec.topology or "ring", spec.staleness or 1
    if spec.kind == "ssp":  # SSP(0) is BSP by construction
        strategy = "ssp" if spec.staleness else "bsp"
    if spec.kind == "gossip":
        strategy = "gossip"
        if not (bandwidth is not None or latency > 0) and hosts == 1 and "shm" in profile.paths:
            network = Network.uniform(profile.paths["shm"])  # the workers' shared-memory slots
    used: list[str] = []

    def recorded(nbytes: int, n: int) -> str:
        name = choose(nbytes, n)
        used.append(name)
        return name

    job = StepJob(
        model_profile,
        workers=workers,
        strategy=strategy,
        servers=servers,
        bucket_bytes=bucket_bytes,
        overlap=overlap,
        choose=recorded,
        sfb_layers=sfb_layers,
        batch_size=batch_size,
        compression=compression,
        topology=topology,
        staleness=staleness,
    )
    if strategy == "gossip":
        return _steady(job, model_profile, network=network, profile=profile, slowdown=slowdown, trace=trace, used=used)
    cores = shared_cores(model_profile, world_size=world, hosts=hosts)
    rank0 = None
    if workers > SYMMETRIC_FROM and slowdown is None and (bandwidth is not None or latency > 0):
        rank0 = symmetric_step(job, pad=True)  # every rank's link alike: one rank's replay stands for all
    if rank0 is not None:  # every rank computes at once, as profiled: no sharing to replay
        out = replay(rank0, network, gamma=profile.gamma, copy=profile.copy, trace=trace, symmetric=workers)
        return Prediction(step_s=out.finish[0], compute_s=model_profile.compute_s, replay=out, job=job, algorithms=used)
    plan = step_plan(job)
    slow = None if slowdown is None else list(slowdown) + [1.0] * (plan.world_size - len(slowdown))
    if not job.uses_servers:  # every worker waits for every other at the step's end: one step is the steady state
        out = replay(
            plan,
            network,
            gamma=profile.gamma,
            copy=profile.copy,
            slowdown=slow,
            trace=trace,
            validate=False,
            cores=cores,
        )
        step = max(out.finish[:workers])
        return Prediction(step_s=step, compute_s=model_profile.compute_s, replay=out, job=job, algorithms=used)
    # the server's pulls to one worker overlap the next step's pushes of another: the period of the last steps
    return _steady(
        job, model_profile, network=network, profile=profile, slowdown=slowdown, trace=trace, used=used, cores=cores
    )


def _pipeline(
    profile: MachineProfile,
    model: str | ModelProfile,
    *,
    workers: int,
    strategy: str,
    batch_size: int,
    microbatches: int,
    bandwidth: float | None,
    latency: float,
    slowdown: list[float] | None,
    trace: bool,
) -> Prediction:
    """A pipeline step (:mod:`paratrain.sim.pipe`): ``workers`` stages, one process each."""
    from paratrain.sim.pipe import pipeline_step

    if isinstance(model, str):  # any profile of the model with this many processes: it scales to the micro-batch
        found = [m for m in profile.models.values() if m.model == model and m.concurrency == workers]
        model = found[0] if found else profile.model(model, batch_size, workers)
    m = microbatches or workers
    network, _ = network_for(profile, world_size=workers, bandwidth=bandwidth, latency=latency, concurrency=workers)
    link = network.route(0, 1 % workers)[0]
    step = pipeline_step(
        model,
        stages=workers,
        microbatches=m,
        batch_size=batch_size,
        schedule_name=str(parse_strategy(strategy).options["schedule"]),
        bandwidth=1.0 / link.beta if link.beta > 0 else math.inf,
    )
    cores = shared_cores(model, world_size=workers, hosts=1)
    out = replay(
        step.plan, network, gamma=profile.gamma, copy=profile.copy, slowdown=slowdown, trace=trace, cores=cores
    )
    job = StepJob(model, workers=workers, strategy="pipeline", batch_size=batch_size, microbatches=m)
    return Prediction(
        step_s=out.time,
        compute_s=model.compute_s * batch_size / model.batch_size / workers,
        replay=out,
        job=job,
        settings={"balance": ",".join(map(str, step.balance))},
    )


def shared_cores(model: ModelProfile, *, world_size: int, hosts: int) -> Cores | None:
    """How the job's ranks share their hosts' cores, from how the model's profile saw them shared
    (:meth:`ModelProfile.cores`); None where the profile does not say (one process, or no step alone measured):
    then every compute takes its profiled time."""
    shares = model.cores()
    if shares is None:
        return None
    per_host = -(-world_size // max(1, hosts))
    return Cores(capacity=shares[0], alone=shares[1], host_of=None if hosts <= 1 else (lambda r: r // per_host))


def _steady(
    job: StepJob,
    model: ModelProfile,
    *,
    network: Network,
    profile: MachineProfile,
    slowdown: list[float] | None,
    trace: bool,
    used: list[str],
    cores: Cores | None = None,
) -> Prediction:
    """A job whose steps overlap each other (the parameter server, gossip): :data:`PS_STEPS` steps chained and
    replayed, the step the period of the last ones."""
    if job.strategy == "gossip":
        runs, first = gossip_steps(job, PS_STEPS)
        sizes = [(len(actions) - f) // PS_STEPS for actions, f in zip(runs.ranks, first, strict=True)]
    else:
        plan = step_plan(job)
        runs, first, sizes = repeat_steps(plan, PS_STEPS), [0] * plan.world_size, [len(a) for a in plan.ranks]
        if job.strategy == "ssp":
            runs = stale_bound(runs, job.workers, job.staleness, PS_STEPS)
    slow = None if slowdown is None else list(slowdown) + [1.0] * (runs.world_size - len(slowdown))
    out = replay(
        runs, network, gamma=profile.gamma, copy=profile.copy, slowdown=slow, trace=trace, validate=False, cores=cores
    )
    ends = [
        [max(out.done[r][first[r] + j * sizes[r] : first[r] + (j + 1) * sizes[r]]) for j in range(PS_STEPS)]
        for r in range(job.workers)
    ]
    if job.strategy in ("asp", "ssp"):  # nobody waits (or s steps later): the sum of the workers' own rates
        step = job.workers / sum((PS_STEPS - 1) / (e[-1] - e[0]) for e in ends)
    else:  # the workers wait for each other: the period of the job's slowest step end
        last = [max(e[j] for e in ends) for j in range(PS_STEPS)]
        step = (last[-1] - last[0]) / (PS_STEPS - 1)
    return Prediction(step_s=step, compute_s=model.compute_s, replay=out, job=job, algorithms=used, steps=PS_STEPS)


def hybrid_layers(
    model: ModelProfile,
    strategy: str,
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
    if strategy == "sfb":
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
    n = model.param_bytes
    comm = 0.0
    if strategy in ("sfb", "poseidon:allreduce") and workers > 1:
        choose = network_for(profile, world_size=workers, bandwidth=bandwidth, latency=latency)[1]
        sfb = set(
            hybrid_layers(
                model,
                strategy,
                workers=workers,
                batch_size=batch_size,
                bandwidth=bandwidth,
                latency=latency,
                choose=choose,
            )
        )
        for layer in model.layers:
            if layer.name in sfb:
                rows = batch_size * (layer.out_features + layer.in_features) * 4
                comm += (workers - 1) * (alpha + rows * beta)
                n -= sum(layer.param_bytes)
        strategy = "allreduce"
    if compression:
        n //= 2
    spec = parse_strategy(strategy)
    if spec.family == "pipeline":  # batch_size is the pipeline's, the profile's times are per its batch
        m = microbatches or workers
        scale = batch_size / model.batch_size
        a = max((layer.output_bytes for layer in model.layers), default=0) * scale / m
        return (m + workers - 1) / m * model.compute_s * scale / workers + 2 * (workers - 1) * (alpha + a * beta)
    if spec.kind == "gossip" and workers > 1:  # the model to every neighbour, over one link
        from paratrain.gossip.mixing import neighbors, resolve_mixing

        mixing, _ = resolve_mixing(spec.topology, workers)
        degree = max(len(neighbors(mixing, r)) for r in range(workers))
        return model.compute_s + alpha + degree * n * beta
    if spec.uses_servers:
        comm += 2 * (alpha + workers * n * beta / servers)
    elif workers > 1 and n > 0:
        comm += 2 * (workers - 1) * (alpha + n * beta / workers)
    return model.compute_s + comm
