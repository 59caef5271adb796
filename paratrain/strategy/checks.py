"""Every rule across a strategy and its options, written once for every front end: :func:`check_options` is what
``paratrain train`` and ``DistributedOptimizer`` call before anything starts. The rules that follow from a unit's
declared capabilities (compression, recovery, servers, per-layer schemes) are common; a kind's own rules are its
unit's ``checks`` (the functions below, registered in :mod:`paratrain.strategy.builtin`). Each refusal names the
options as the front end spells them and says what to do instead."""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.strategy.options import StrategyOptions
from paratrain.strategy.spec import StrategySpec, kinds
from paratrain.strategy.wrappers import wrappers_given

__all__ = [
    "check_options",
    "compression_checks",
    "hybrid_checks",
    "no_more_checks",
    "parameter_server_checks",
    "pipeline_checks",
    "reliable_checks",
    "servers_of",
    "tensor_checks",
]


def check_options(spec: StrategySpec, options: StrategyOptions) -> None:
    """Refuses the options that do not go with ``spec`` (the common rules, the wrappers' asked for, then the
    kind's own).

    Raises:
        ConfigError: the first rule broken, saying what to do.

    Example:
        >>> from paratrain.strategy import parse_strategy
        >>> check_options(parse_strategy("allreduce"), StrategyOptions(max_restarts=2))
        >>> try:
        ...     check_options(parse_strategy("gossip:ring"), StrategyOptions(front="cli", servers=2))
        ... except ConfigError as e:
        ...     print(e)
        --servers is for the parameter-server strategies (bsp, ssp:S, asp), not gossip
    """
    flag, name = options.flag, _name(spec)
    if options.servers and not spec.uses_servers:
        raise ConfigError(
            f"{flag('servers')} is for the parameter-server strategies (bsp, ssp:S, asp), not {spec.kind}"
        )
    if options.layer_schemes and not spec.hybrid:
        what = "--layer-scheme is" if options.front == "cli" else "batch_size= and layer_schemes= are"
        raise ConfigError(
            f"{what} for poseidon, poseidon:allreduce and sfb (they choose how each layer travels); strategy "
            f"{name!r} sends every layer the same way"
        )
    if options.staleness_lr and not spec.uses_servers:
        raise ConfigError(
            f"{flag('staleness_lr')} scales stale gradients on the parameter servers: use it with strategy 'ssp:S' "
            f"or 'asp', not {name!r}"
        )
    _check_recovery(spec, options, name)
    for wrapper in wrappers_given(options):
        wrapper.checks(spec, options)
    spec.info.checks(spec, options)


def servers_of(servers: int | None, spec: StrategySpec) -> int:
    """The parameter-server processes a job starts: ``servers`` as given, or 1 for a PS strategy, else none."""
    return servers if servers is not None else (1 if spec.uses_servers else 0)


def _supporting(capability: str) -> str:
    """The kinds whose units declare ``capability`` among their recovery, for messages: ``"allreduce"``."""
    return " or ".join(unit.kind for unit in kinds().values() if capability in unit.recovery)


def _check_recovery(spec: StrategySpec, options: StrategyOptions, name: str) -> None:
    recovery, flag = spec.info.recovery, options.flag
    restartable = "restarts" in recovery or ("replicas" in recovery and options.replicas >= 2)
    if options.max_restarts and not restartable:
        raise ConfigError(
            f"{flag('max_restarts')} restarts the dead workers of {_supporting('restarts')} training (and dead "
            f"parameter servers that have replicas, --servers S --replicas 2); {name!r} does not support it"
        )
    if options.checkpoint and "checkpoint" not in recovery:
        raise ConfigError(
            f"{flag('checkpoint_dir')} checkpoints {_supporting('checkpoint')} training; {name!r} does not support it "
            "yet"
        )
    if options.min_workers and ("elastic" not in recovery or not 0 < options.min_workers <= (options.workers or 0)):
        raise ConfigError(
            f"{flag('min_workers')} needs the {_supporting('elastic')} strategy and 1..{options.workers} (the "
            f"workers); got {options.min_workers} with {name!r}"
        )


# -- the wrappers' checks (each wrapper unit's ``checks``) -----------------------------------------------------


def _name(spec: StrategySpec) -> str:
    return str(spec) if spec.topology != "<given>" else spec.kind


def reliable_checks(spec: StrategySpec, options: StrategyOptions) -> None:
    """``reliable=`` wraps the kinds that declare ``"reliable"`` recovery (synchronous allreduce)."""
    if "reliable" not in spec.info.recovery:
        raise ConfigError(
            f"reliable= recovers synchronous {_supporting('reliable')} training; strategy {_name(spec)!r} is not "
            "(replicate the parameter servers for bsp/ssp/asp instead)"
        )
    if not options.overlap:
        raise ConfigError("overlap=False does not apply with reliable=: reliable steps never overlap backward")


def compression_checks(spec: StrategySpec, options: StrategyOptions) -> None:
    """``compression=`` wraps the compressible kinds, and not together with the recovery of allreduce."""
    flag = options.flag
    if not spec.info.compressible:
        raise ConfigError(
            f"{flag('compression')} compresses gradients sent by allreduce or to the parameter servers; strategy "
            f"{_name(spec)!r} does not support it"
        )
    recovering = [
        flag(option)
        for option, given in (
            ("max_restarts", options.max_restarts),
            ("min_workers", options.min_workers),
            ("checkpoint_dir", options.checkpoint),
            ("reliable", options.reliable),
        )
        if given
    ]
    if recovering and not spec.uses_servers:
        raise ConfigError(f"{flag('compression')} does not combine with {', '.join(recovering)}")


# -- the kinds' own checks (each unit's ``checks``) ------------------------------------------------------------


def no_more_checks(spec: StrategySpec, options: StrategyOptions) -> None:
    """A kind whose options the common rules cover (allreduce, gossip, sfb)."""
    if options.replicas != 1:
        raise ConfigError(
            f"{options.flag('replicas')} is for pipelines (R pipelines) and parameter servers (R copies of each chunk)"
        )


def parameter_server_checks(spec: StrategySpec, options: StrategyOptions) -> None:
    """The parameter servers step the optimizer, once per round: no compressor that needs the momentum on the
    workers or a second aggregation round; each chunk's replicas on distinct servers."""
    compressor = options.compression
    if compressor is not None and compressor.moves_momentum:
        raise ConfigError(
            f"compression {compressor.name!r}: DGC moves SGD's momentum to the workers, but the parameter servers "
            "step the optimizer (and its momentum); use topk:R with the servers, or DGC with strategy 'allreduce'"
        )
    if compressor is not None and compressor.aggregation_rounds > 1:
        raise ConfigError(
            f"compression {compressor.name!r}: PowerSGD needs two allreduce rounds per step (P, then Q), but the "
            "parameter servers aggregate once, by stepping their optimizer (two aggregation rounds cannot run there); "
            "use fp16, bf16 or topk:R with the parameter servers, or PowerSGD with strategy 'allreduce'"
        )
    servers = servers_of(options.servers, spec)
    if not 1 <= options.replicas <= servers:
        raise ConfigError(
            f"{options.flag('replicas')} {options.replicas}: each parameter-server chunk needs that many distinct "
            f"servers; give --servers {max(options.replicas, 2)} or more (now {servers})"
        )


def hybrid_checks(spec: StrategySpec, options: StrategyOptions) -> None:
    """Poseidon's dense layers go by the parameter servers (their rules; no restarts of workers) or by allreduce
    (no more rules)."""
    if spec.uses_servers:
        recovering = [n for n, v in (("max_restarts", options.max_restarts), ("checkpoint_dir", options.checkpoint),
                                     ("reliable", options.reliable)) if v]  # fmt: skip
        if recovering:
            raise ConfigError(
                f"{options.flag(recovering[0])} recovers {_name(spec)!r} when its dense layers go by allreduce: use "
                "poseidon:allreduce or sfb (the parameter servers do not restart workers yet)"
            )
    (parameter_server_checks if spec.uses_servers else no_more_checks)(spec, options)


def pipeline_checks(spec: StrategySpec, options: StrategyOptions) -> None:
    """A pipeline places its stages itself and overlaps by its schedule."""
    if options.device == "cuda":
        raise ConfigError(
            "--device cuda is for the data-parallel strategies; a pipeline places its stages itself "
            "(paratrain.torch.Pipe(device=...))"
        )
    if not options.overlap:
        raise ConfigError(
            f"{options.flag('no_overlap') if options.front == 'cli' else 'overlap=False'} is for the data-parallel "
            "strategies; a pipeline overlaps by its schedule"
        )


def tensor_checks(spec: StrategySpec, options: StrategyOptions) -> None:
    """Split layers run on the CPU, exchange activations during forward and backward (no gradient buckets to
    overlap) and need whole tensor groups of workers."""
    no_more_checks(spec, options)
    if options.device == "cuda":
        raise ConfigError(
            f"--device cuda is not yet for split layers ({_name(spec)!r}); train on the CPU, or use a data-parallel "
            "strategy on GPUs"
        )
    if not options.overlap:
        raise ConfigError(
            f"{options.flag('no_overlap') if options.front == 'cli' else 'overlap=False'} is for the data-parallel "
            f"strategies; {_name(spec)!r} moves activations between split layers inside forward and backward"
        )
    tensor = spec.options.get("tensor")
    if tensor is not None and options.workers is not None and options.workers % int(tensor):
        raise ConfigError(
            f"{_name(spec)!r} splits layers over groups of {tensor} workers; give {options.flag('workers')} a "
            f"multiple of {tensor} (now {options.workers}; the groups train data parallel)"
        )
