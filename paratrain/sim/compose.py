"""The simulator's composers, one per strategy unit (:mod:`paratrain.strategy.builtin` names them): how a
strategy's step turns into lanes of the runtime's own plan actions (:mod:`paratrain.sim.step`,
:mod:`paratrain.sim.pipe`), replayed on the profiled machine, and the textbook alpha-beta formula beside it
(:func:`~paratrain.sim.predict.alpha_beta_step` lists them)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.plan.ir import Plan
from paratrain.sim.machine import ModelProfile
from paratrain.sim.predict import (
    PS_STEPS,
    SYMMETRIC_FROM,
    JobRequest,
    Prediction,
    hybrid_layers,
    link_trees,
    network_for,
    shared_cores,
)
from paratrain.sim.replay import Cores, Network, Replay, replay
from paratrain.sim.step import STRATEGIES, StepJob, gossip_steps, repeat_steps, stale_bound, step_plan, symmetric_step
from paratrain.sim.tensor import TensorJob, data_average_s, profile_splits, scaled, tensor_step
from paratrain.soap import Mesh, Move, SoapConfig

__all__ = ["ALLREDUCE", "GOSSIP", "HYBRID", "PARAMETER_SERVER", "PIPELINE", "TENSOR"]


@dataclass
class _Setting:
    """The network of a data-parallel job and the allreduce policy, recording the algorithms it picks."""

    model: ModelProfile
    network: Network
    choose: Callable[[int, int], str]
    used: list[str]
    world: int = 1

    def recorded(self, nbytes: int, n: int) -> str:
        name = self.choose(nbytes, n)
        self.used.append(name)
        return name


def _setting(request: JobRequest) -> _Setting:
    model = request.model_profile()
    world = request.workers + (request.servers if request.spec.uses_servers else 0)
    network, choose = network_for(
        request.profile,
        world_size=world,
        bandwidth=request.bandwidth,
        latency=request.latency,
        hosts=request.hosts,
        concurrency=request.workers,
        links=request.links,
    )
    if request.algorithm != "auto":
        fixed = request.algorithm
        choose = lambda nbytes, n: fixed  # noqa: E731
    return _Setting(model, network, choose, [], world)


def _step_job(request: JobRequest, setting: _Setting, strategy: str, **extra: object) -> StepJob:
    return StepJob(
        setting.model,
        workers=request.workers,
        strategy=strategy,
        servers=request.servers,
        bucket_bytes=request.bucket_bytes,
        overlap=request.overlap,
        choose=setting.recorded,
        batch_size=request.batch_size,
        compression=request.compression,
        trees=link_trees(setting.world, request.bandwidth, request.links),
        **extra,  # type: ignore[arg-type]
    )


def _synchronous(request: JobRequest, setting: _Setting, job: StepJob) -> Prediction:
    """Every worker waits for every other at the step's end: one step is the steady state."""
    model, workers = setting.model, request.workers
    world = job.world_size
    cores = shared_cores(model, world_size=world, hosts=request.hosts)
    rank0 = None
    if workers > SYMMETRIC_FROM and request.slowdown is None and (request.bandwidth is not None or request.latency > 0):
        rank0 = symmetric_step(job, pad=True)  # every rank's link alike: one rank's replay stands for all
    profile = request.profile
    if rank0 is not None:  # every rank computes at once, as profiled: no sharing to replay
        out = replay(
            rank0, setting.network, gamma=profile.gamma, copy=profile.copy, trace=request.trace, symmetric=workers
        )
        return Prediction(step_s=out.finish[0], compute_s=model.compute_s, replay=out, job=job, algorithms=setting.used)
    out = _replay(request, setting.network, step_plan(job), cores=cores)
    step = max(out.finish[:workers])
    return Prediction(step_s=step, compute_s=model.compute_s, replay=out, job=job, algorithms=setting.used)


def _steady(request: JobRequest, setting: _Setting, job: StepJob, cores: Cores | None = None) -> Prediction:
    """A job whose steps overlap each other (the parameter server, gossip): :data:`PS_STEPS` steps chained and
    replayed, the step the period of the last ones."""
    if job.spec.exchanges_parameters:
        runs, first = gossip_steps(job, PS_STEPS)
        sizes = [(len(actions) - f) // PS_STEPS for actions, f in zip(runs.ranks, first, strict=True)]
    else:
        plan = step_plan(job)
        runs, first, sizes = repeat_steps(plan, PS_STEPS), [0] * plan.world_size, [len(a) for a in plan.ranks]
        if job.spec.staleness:
            runs = stale_bound(runs, job.workers, job.staleness, PS_STEPS)
    out = _replay(request, setting.network, runs, cores=cores)
    ends = [
        [max(out.done[r][first[r] + j * sizes[r] : first[r] + (j + 1) * sizes[r]]) for j in range(PS_STEPS)]
        for r in range(job.workers)
    ]
    if not job.spec.synchronous:  # nobody waits (or s steps later): the sum of the workers' own rates
        step = job.workers / sum((PS_STEPS - 1) / (e[-1] - e[0]) for e in ends)
    else:  # the workers wait for each other: the period of the job's slowest step end
        last = [max(e[j] for e in ends) for j in range(PS_STEPS)]
        step = (last[-1] - last[0]) / (PS_STEPS - 1)
    compute_s = setting.model.compute_s
    return Prediction(step_s=step, compute_s=compute_s, replay=out, job=job, algorithms=setting.used, steps=PS_STEPS)


def _replay(request: JobRequest, network: Network, plan: Plan, *, cores: Cores | None) -> Replay:
    """The plan replayed on the profiled machine, with the request's stragglers (every other rank at speed 1)."""
    given, profile = request.slowdown, request.profile
    slow = None if given is None else list(given) + [1.0] * (plan.world_size - len(given))
    return replay(
        plan,
        network,
        gamma=profile.gamma,
        copy=profile.copy,
        slowdown=slow,
        trace=request.trace,
        validate=False,
        cores=cores,
    )


def _ring(request: JobRequest, n: float, alpha: float, beta: float) -> float:
    workers = request.workers
    return 2 * (workers - 1) * (alpha + n * beta / workers) if workers > 1 and n > 0 else 0.0


def _wire_bytes(request: JobRequest, model: ModelProfile) -> int:
    return model.param_bytes // 2 if request.compression else model.param_bytes


def _model(request: JobRequest) -> ModelProfile:
    assert not isinstance(request.model, str), "alpha_beta_step takes a model profile"
    return request.model


class _Allreduce:
    """Allreduce: every bucket by the runtime's allreduce plan on a background lane (cast to 16 bits first with
    fp16/bf16 compression)."""

    def predict(self, request: JobRequest) -> Prediction:
        setting = _setting(request)
        return _synchronous(request, setting, _step_job(request, setting, "allreduce"))

    def estimate(self, request: JobRequest, alpha: float, beta: float) -> float:
        model = _model(request)
        return model.compute_s + _ring(request, _wire_bytes(request, model), alpha, beta)


class _ParameterServer:
    """BSP, SSP and ASP: each bucket pushed to and pulled from the servers by the parameter server's plans,
    the servers' lanes included; steps chained, since one step's pulls overlap the next one's pushes."""

    def predict(self, request: JobRequest) -> Prediction:
        setting, spec = _setting(request), request.spec
        strategy = "bsp" if spec.synchronous else spec.kind  # SSP(0) is BSP by construction
        job = _step_job(request, setting, strategy, staleness=spec.staleness or 1)
        return _steady(
            request, setting, job, shared_cores(setting.model, world_size=job.world_size, hosts=request.hosts)
        )

    def estimate(self, request: JobRequest, alpha: float, beta: float) -> float:
        model = _model(request)
        n = _wire_bytes(request, model)
        return model.compute_s + 2 * (alpha + request.workers * n * beta / request.servers)


class _Hybrid:
    """SFB and Poseidon over allreduce: the SFB layers' factors allgathered and rebuilt, the rest by allreduce
    (Poseidon's choice of layers by its cost model, as the optimizer asks it)."""

    def _layers(self, request: JobRequest, model: ModelProfile, choose: Callable[[int, int], str]) -> tuple[str, ...]:
        if request.spec.uses_servers:
            raise ConfigError(
                f"the simulator composes {', '.join(STRATEGIES)}, sfb and poseidon:allreduce, not {str(request.spec)!r}"
            )
        return hybrid_layers(
            model,
            request.spec,
            workers=request.workers,
            batch_size=request.batch_size,
            bandwidth=request.bandwidth,
            latency=request.latency,
            choose=choose,
        )

    def predict(self, request: JobRequest) -> Prediction:
        setting = _setting(request)
        sfb_layers = self._layers(request, setting.model, setting.choose)
        return _synchronous(request, setting, _step_job(request, setting, "allreduce", sfb_layers=sfb_layers))

    def estimate(self, request: JobRequest, alpha: float, beta: float) -> float:
        if request.spec.uses_servers:
            return PARAMETER_SERVER.estimate(request, alpha, beta)
        model, workers, comm = _model(request), request.workers, 0.0
        n = model.param_bytes
        if workers > 1:
            latency, bandwidth = request.latency, request.bandwidth
            choose = network_for(
                request.profile, world_size=workers, bandwidth=bandwidth, latency=latency, links=request.links
            )[1]
            sfb = set(self._layers(request, model, choose))
            for layer in model.layers:
                if layer.name in sfb:
                    rows = request.batch_size * (layer.out_features + layer.in_features) * 4
                    comm += (workers - 1) * (alpha + rows * beta)
                    n -= sum(layer.param_bytes)
        if request.compression:
            n //= 2
        return model.compute_s + (comm + _ring(request, n, alpha, beta))


class _Gossip:
    """D-PSGD: each step's model to the graph's neighbours by the exchange's round plan, during the next step;
    steps chained, since each depends on the messages of the one before."""

    def predict(self, request: JobRequest) -> Prediction:
        setting, spec = _setting(request), request.spec
        emulated = request.bandwidth is not None or request.latency > 0
        if not emulated and request.hosts == 1 and "shm" in request.profile.paths:
            setting.network = Network.uniform(request.profile.paths["shm"])  # the workers' shared-memory slots
        job = _step_job(request, setting, "gossip", topology=spec.topology or "ring")
        return _steady(request, setting, job)

    def estimate(self, request: JobRequest, alpha: float, beta: float) -> float:
        from paratrain.gossip.mixing import neighbors, resolve_mixing

        model, workers = _model(request), request.workers
        if workers < 2:
            return model.compute_s
        mixing, _ = resolve_mixing(request.spec.topology, workers)
        degree = max(len(neighbors(mixing, r)) for r in range(workers))
        return model.compute_s + alpha + degree * _wire_bytes(request, model) * beta


class _Pipeline:
    """A pipeline: ``workers`` stages, one process each, the step its schedule's lowered plan
    (:mod:`paratrain.sim.pipe`)."""

    def predict(self, request: JobRequest) -> Prediction:
        from paratrain.sim.pipe import pipeline_step

        profile, workers, batch_size = request.profile, request.workers, request.batch_size
        model = request.model
        if isinstance(model, str):  # any profile of the model with this many processes: it scales to the micro-batch
            found = [m for m in profile.models.values() if m.model == model and m.concurrency == workers]
            model = found[0] if found else profile.model(model, batch_size, workers)
        m = request.microbatches or workers
        network, _ = network_for(
            profile,
            world_size=workers,
            bandwidth=request.bandwidth,
            latency=request.latency,
            concurrency=workers,
            links=request.links,
        )
        link = network.route(0, 1 % workers)[0]
        step = pipeline_step(
            model,
            stages=workers,
            microbatches=m,
            batch_size=batch_size,
            schedule_name=str(request.spec.options["schedule"]),
            bandwidth=1.0 / link.beta if link.beta > 0 else math.inf,
        )
        cores = shared_cores(model, world_size=workers, hosts=1)
        out = replay(
            step.plan,
            network,
            gamma=profile.gamma,
            copy=profile.copy,
            slowdown=request.slowdown,
            trace=request.trace,
            cores=cores,
        )
        job = StepJob(model, workers=workers, strategy=request.spec.kind, batch_size=batch_size, microbatches=m)
        return Prediction(
            step_s=out.time,
            compute_s=model.compute_s * batch_size / model.batch_size / workers,
            replay=out,
            job=job,
            settings={"balance": ",".join(map(str, step.balance))},
        )

    def estimate(self, request: JobRequest, alpha: float, beta: float) -> float:
        model, workers = _model(request), request.workers
        m = request.microbatches or workers
        scale = request.batch_size / model.batch_size  # batch_size is the pipeline's, the profile's per its batch
        a = max((layer.output_bytes for layer in model.layers), default=0) * scale / m
        return (m + workers - 1) / m * model.compute_s * scale / workers + 2 * (workers - 1) * (alpha + a * beta)


class _Tensor:
    """Split layers (``tp:N``, ``soap:FILE``): the chain's moves over each tensor group, split layers' compute
    divided, and the data groups' allreduce of what each worker holds (:mod:`paratrain.sim.tensor`)."""

    def _job(
        self,
        request: JobRequest,
        model: ModelProfile,
        choose: Callable[[int, int], str],
        config: SoapConfig | None = None,
    ) -> TensorJob:
        given = config if config is not None else SoapConfig.named(request.spec.options)
        given = given.workers(request.workers)
        model = scaled(model, request.batch_size)  # a tensor group's examples (the planner gives it T x a worker's)
        splits = profile_splits(model, given)
        return TensorJob(model, Mesh.for_workers(request.workers, given.tensor), splits, request.batch_size, choose)

    def predict(self, request: JobRequest) -> Prediction:
        return self.predict_config(request, None)

    def predict_config(self, request: JobRequest, config: SoapConfig | None) -> Prediction:
        """The step of ``config`` (None: the one the request's strategy names), as :meth:`predict`."""
        setting = _setting(request)
        job = self._job(request, setting.model, setting.recorded, config)
        if request.workers > SYMMETRIC_FROM and job.mesh.data > 1 and request.slowdown is None:
            # every group alike: one tensor group replayed, its data-group averages as a ring replayed apart
            link = setting.network.route(0, job.mesh.tensor)[0]
            data_s = data_average_s(job, link, gamma=request.profile.gamma, copy=request.profile.copy)
            out = _replay(request, setting.network, tensor_step(job, data_s=data_s), cores=None)
        else:
            cores = shared_cores(setting.model, world_size=request.workers, hosts=request.hosts)
            out = _replay(request, setting.network, tensor_step(job), cores=cores)
        step_job = StepJob(job.model, workers=request.workers, strategy=str(request.spec))
        settings = {"splits": ",".join(f"{n}={s}" for n, s in job.splits.items() if s != "replicated") or "none"}
        return Prediction(
            step_s=max(out.finish), compute_s=job.compute_s(), replay=out, job=step_job, algorithms=setting.used,
            settings=settings,
        )  # fmt: skip

    def estimate(self, request: JobRequest, alpha: float, beta: float) -> float:
        model = _model(request)
        job = self._job(request, model, lambda nbytes, n: "ring")
        t, d = job.mesh.tensor, job.mesh.data
        comm = 0.0
        for kind, items in job.moves():
            rounds = 2 * (t - 1) if kind is Move.ALLREDUCE else t - 1
            comm += rounds * (alpha + items * job.itemsize * beta / t)
        held = job.held_items(0) * job.itemsize
        comm += 2 * (d - 1) * (alpha + held * beta / d) if d > 1 else 0.0
        return job.compute_s() + comm


#: The composers the strategy units name.
ALLREDUCE = _Allreduce()
PARAMETER_SERVER = _ParameterServer()
HYBRID = _Hybrid()
GOSSIP = _Gossip()
PIPELINE = _Pipeline()
TENSOR = _Tensor()
