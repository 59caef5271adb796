"""The checks across a training job's options, made once before anything starts (strategy x servers x
compression x restarts x pipelines...): every refusal says what to do. :func:`validate` also fills in what follows
from the options (the workers; a pipeline's stages)."""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.strategy import (
    CompressionTraits,
    StrategyOptions,
    UnknownStrategyError,
    check_options,
    parse_layer_schemes,
    parse_strategy,
    servers_of,
    strategies_help,
)
from paratrain.train.job import TrainJob

__all__ = ["options_of", "validate"]


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
    if spec.pipelined:
        job = _resolve_pipeline(job)
    elif spec.splits_layers:
        job = _resolve_tensor(job)
    elif job.workers is None:
        job = job.replace(workers=2)
    assert job.workers is not None
    if spec.topology is not None:
        from paratrain.gossip.mixing import resolve_mixing

        resolve_mixing(spec.topology, job.workers)
    parse_layer_schemes(job.layer_scheme)
    compressor = None
    if job.compression is not None:
        from paratrain.compression import parse_compression

        compressor = parse_compression(job.compression)
    if spec.uses_servers and not spec.hybrid:
        Policy.parse(spec.kind, spec.staleness)
    if job.max_restarts < 0 or job.checkpoint_every < 1:
        raise ConfigError("--max-restarts must be >= 0 and --checkpoint-every >= 1")
    check_options(spec, options_of(job, compressor))
    job.network()
    if job.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but torch sees no CUDA device here (torch.cuda.is_available() is False)")
    if job.straggler:
        from paratrain.train import stragglers

        stragglers.parse(job.straggler, seed=job.seed).check_workers(job.workers)
    check_available(job.dataset, data_dir=job.data_dir)
    if job.kill:
        from paratrain.launch.kills import parse_kills

        parse_kills(job.kill, nproc=job.workers, servers=servers_of(job.servers, spec), seed=job.seed)
    return job


def options_of(job: TrainJob, compressor: CompressionTraits | None = None) -> StrategyOptions:
    """The job's options as the strategy's rules take them (:func:`paratrain.strategy.check_options`)."""
    return StrategyOptions(
        front="cli",
        workers=job.workers,
        servers=job.servers,
        replicas=job.replicas,
        compression=compressor,
        max_restarts=job.max_restarts,
        min_workers=job.min_workers,
        checkpoint=bool(job.checkpoint_dir),
        layer_schemes=bool(job.layer_scheme),
        device=job.device,
        overlap=not job.no_overlap,
    )


def _resolve_tensor(job: TrainJob) -> TrainJob:
    """Fills in ``--workers`` (one tensor group, or the ``tensor x data`` a configuration file fixes) and checks
    the per-layer configuration against the model: every layer it names exists and splits, every degree divides
    what it splits."""
    from paratrain.soap import SoapConfigError
    from paratrain.torch.soap import check_configuration, splits_of
    from paratrain.train.models import build_model
    from paratrain.train.tensor_worker import configuration

    try:
        config = configuration(job)
        if config.model is not None and config.model != job.model:
            raise SoapConfigError(
                f"the configuration was made for --model {config.model}, not {job.model}: give --model {config.model}"
                " or make one for this model (paratrain plan --search soap)"
            )
        if job.workers is None:
            job = job.replace(workers=config.tensor * (config.data or 1))
        assert job.workers is not None
        config = config.workers(job.workers)
        side = {"fashion-mnist": 28, "digits": 8}.get(job.dataset, 16)  # only the layers' widths matter here
        model = build_model(job.model, side=side, classes=10 if job.model != "transformer" else 96)
        splits = splits_of(model, config)
        check_configuration(model, splits, config.tensor)
    except SoapConfigError as exc:
        raise ConfigError(f"--strategy {job.strategy}: {exc}") from None
    if config.tensor > 1 and not any(split != "replicated" for split in splits.values()):
        raise ConfigError(
            f"--strategy {job.strategy} splits no layer of --model {job.model}: no linear layer, convolution or "
            f"transformer block in its top-level chain has widths (or heads) that divide by {config.tensor}; use "
            "another degree, or a data-parallel strategy or pipeline"
        )
    if job.straggler or job.servers:
        raise ConfigError(f"--straggler and --servers are not for split layers ({job.strategy})")
    if job.bucket_bytes is not None:
        raise ConfigError(
            f"--bucket-bytes sizes the data-parallel strategies' gradient buckets; split layers ({job.strategy}) "
            "average all their gradients over the data groups in one allreduce after backward"
        )
    return job


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
