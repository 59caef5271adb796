"""The checks across a training job's options, made once before anything starts (strategy x servers x
compression x restarts x pipelines...): every refusal says what to do. :func:`validate` also fills in what follows
from the options (the workers; a pipeline's stages)."""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.strategy import UnknownStrategyError, parse_layer_schemes, parse_strategy, strategies_help
from paratrain.train.job import TrainJob

__all__ = ["servers_of", "validate"]


def validate(job: TrainJob) -> TrainJob:
    """Refuses bad options before anything starts, with messages that say what to do; returns the job with what
    follows from its options filled in (``workers``, and for a pipeline ``stages``)."""
    from paratrain.ps.consistency import Policy
    from paratrain.train.data import DATASETS, check_available
    from paratrain.train.models import MODELS, check_model_dataset

    if job.model not in MODELS:
        raise ConfigError(f"unknown --model {job.model!r}; choose one of {', '.join(MODELS)}")
    if job.dataset not in DATASETS:
        raise ConfigError(f"unknown --dataset {job.dataset!r}; choose one of {', '.join(DATASETS)}")
    check_model_dataset(job.model, job.dataset)
    for name in ("epochs", "batch_size", "workers"):
        if getattr(job, name) is not None and getattr(job, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(job, name)}")
    if job.steps_per_epoch < 0:
        raise ConfigError(f"--steps-per-epoch must be 0 (whole epochs) or a number of steps, got {job.steps_per_epoch}")
    if job.eval_every < 0:
        raise ConfigError(f"--eval-every must be 0 (off) or a number of steps, got {job.eval_every}")
    if not job.lr > 0:
        raise ConfigError(f"--lr must be positive, got {job.lr}")
    try:
        spec = parse_strategy(job.strategy)
    except UnknownStrategyError:
        raise ConfigError(f"unknown --strategy {job.strategy!r}; choose one of: {strategies_help()}") from None
    except ConfigError as exc:
        raise ConfigError(f"--strategy {job.strategy!r}: {exc} (the forms: {strategies_help()})") from None
    if spec.family == "pipeline":
        job = _resolve_pipeline(job)
    elif job.workers is None:
        job = job.replace(workers=2)
    assert job.workers is not None
    if job.servers and not spec.uses_servers:
        raise ConfigError(f"--servers is for the parameter-server strategies (bsp, ssp:S, asp), not {spec.kind}")
    if spec.kind == "gossip":
        from paratrain.gossip.mixing import resolve_mixing

        resolve_mixing(spec.topology, job.workers)
    if job.layer_scheme and not spec.hybrid:
        raise ConfigError(f"--layer-scheme is for poseidon, poseidon:allreduce and sfb, not {job.strategy!r}")
    parse_layer_schemes(job.layer_scheme)
    if job.compression is not None:
        from paratrain.compression import LowRank, TopK, parse_compression

        compressor = parse_compression(job.compression)
        if compressor is not None and spec.family not in ("collective", "parameter-server"):
            raise ConfigError(f"--compression is for allreduce and the parameter servers, not {job.strategy!r}")
        if (
            compressor is not None
            and (job.max_restarts or job.min_workers or job.checkpoint_dir)
            and not spec.uses_servers
        ):
            raise ConfigError("--compression does not combine with --max-restarts, --min-workers or --checkpoint-dir")
        if isinstance(compressor, TopK) and compressor.momentum_correction and spec.uses_servers:
            raise ConfigError(
                f"--compression {job.compression}: DGC moves SGD's momentum to the workers, but the parameter "
                "servers step the optimizer; use it with --strategy allreduce (or topk:R with the servers)"
            )
        if isinstance(compressor, LowRank) and spec.uses_servers:
            raise ConfigError(
                f"--compression {job.compression}: PowerSGD needs two allreduce rounds per step; use it with "
                "--strategy allreduce (or fp16, bf16, topk:R with the parameter servers)"
            )
    if spec.uses_servers:
        if not spec.hybrid:
            Policy.parse(spec.kind, spec.staleness)
        servers = servers_of(job, True)
        if not 1 <= job.replicas <= servers:
            raise ConfigError(
                f"--replicas {job.replicas}: each parameter-server chunk needs that many distinct servers; "
                f"give --servers {max(job.replicas, 2)} or more (now {servers})"
            )
    elif spec.family != "pipeline" and job.replicas != 1:
        raise ConfigError("--replicas is for pipelines (R pipelines) and parameter servers (R copies of each chunk)")
    job.network()
    if job.device == "cuda":
        if spec.family == "pipeline":
            raise ConfigError(
                "--device cuda is for the data-parallel strategies; a pipeline places its stages itself "
                "(paratrain.torch.Pipe(device=...))"
            )
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but torch sees no CUDA device here (torch.cuda.is_available() is False)")
    if job.no_overlap and spec.family == "pipeline":
        raise ConfigError("--no-overlap is for the data-parallel strategies; a pipeline overlaps by its schedule")
    if job.straggler:
        from paratrain.train import stragglers

        stragglers.parse(job.straggler, seed=job.seed).check_workers(job.workers)
    check_available(job.dataset, data_dir=job.data_dir)
    if job.max_restarts < 0 or job.checkpoint_every < 1:
        raise ConfigError("--max-restarts must be >= 0 and --checkpoint-every >= 1")
    if job.max_restarts and spec.kind != "allreduce" and not (spec.uses_servers and job.replicas >= 2):
        raise ConfigError(
            f"--max-restarts recovers allreduce training (Rabit's model) and restarts dead parameter servers that "
            f"have replicas (--servers S --replicas 2); {job.strategy!r} with --replicas {job.replicas} does not "
            "support it"
        )
    if job.checkpoint_dir and spec.kind != "allreduce":
        raise ConfigError(f"--checkpoint-dir checkpoints allreduce training; {job.strategy!r} does not support it yet")
    if job.min_workers and (spec.kind != "allreduce" or not 0 < job.min_workers <= (job.workers or 0)):
        raise ConfigError(
            f"--min-workers needs the allreduce strategy and 1..{job.workers} (the workers); got "
            f"{job.min_workers} with {job.strategy!r}"
        )
    if job.kill:
        from paratrain.launch.kills import parse_kills

        parse_kills(job.kill, nproc=job.workers, servers=servers_of(job, spec.uses_servers), seed=job.seed)
    return job


def servers_of(job: TrainJob, uses_servers: bool) -> int:
    """The parameter-server processes the job starts: ``--servers``, or 1 for a PS strategy, else none."""
    return job.servers if job.servers is not None else (1 if uses_servers else 0)


def _resolve_pipeline(job: TrainJob) -> TrainJob:
    """Fills in ``--stages`` or ``--workers`` (N = K stages x R replicas) and checks the pipeline's flags."""
    from paratrain.train.models import build_model
    from paratrain.train.pipeline_worker import flat_layers

    for name in ("microbatches", "replicas"):
        if getattr(job, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(job, name)}")
    if job.stages is not None and job.stages < 1:
        raise ConfigError(f"--stages must be at least 1, got {job.stages}")
    if job.stages is None:
        workers = job.workers if job.workers is not None else 2 * job.replicas
        if workers % job.replicas:
            raise ConfigError(f"--workers {workers} is not a multiple of --replicas {job.replicas}")
        job = job.replace(stages=workers // job.replicas)
    stages = job.stages
    assert stages is not None
    if job.workers is None:
        job = job.replace(workers=stages * job.replicas)
    if job.workers != stages * job.replicas:
        raise ConfigError(
            f"--workers {job.workers} but --stages {stages} x --replicas {job.replicas} = "
            f"{stages * job.replicas}; give two of them (a pipeline runs one process per stage per replica)"
        )
    if job.batch_size < job.microbatches:
        raise ConfigError(f"--batch-size {job.batch_size} cannot be cut into --microbatches {job.microbatches}")
    if job.straggler or job.servers:
        raise ConfigError("--straggler and --servers are not for pipelines")
    side = {"fashion-mnist": 28, "digits": 8}.get(job.dataset, 16)  # the layers, not their sizes, matter here
    layers = len(flat_layers(build_model(job.model, side=side, classes=10)))
    if job.balance != "auto":
        try:
            balance = [int(b) for b in job.balance.split(",")]
        except ValueError:
            raise ConfigError(f"--balance {job.balance!r}: give layers per stage, e.g. 3,3, or 'auto'") from None
        if len(balance) != job.stages or min(balance) < 1 or sum(balance) != layers:
            raise ConfigError(
                f"--balance {job.balance}: {job.model} has {layers} layers; give {job.stages} counts of at least 1 "
                "that add up to them, or 'auto'"
            )
    elif layers < stages:
        raise ConfigError(f"--model {job.model} has {layers} layers, too few for {stages} stages")
    return job
