"""The built-in strategy kinds, each registered once as a unit (:class:`~paratrain.strategy.spec.StrategyUnit`):
its name's syntax, its update rule, its checks, and where its torch builder, training worker and simulator
composer live. Importing :mod:`paratrain.strategy` registers them."""

from __future__ import annotations

import re
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from paratrain.errors import ConfigError
from paratrain.strategy.checks import (
    compression_checks,
    hybrid_checks,
    no_more_checks,
    parameter_server_checks,
    pipeline_checks,
    reliable_checks,
    tensor_checks,
)
from paratrain.strategy.options import StrategyOptions
from paratrain.strategy.spec import GOSSIP_TOPOLOGIES, Family, StrategySpec, StrategyUnit, kinds, register_kind
from paratrain.strategy.wrappers import WrapperUnit, register_wrapper

__all__ = ["PIPELINE_SCHEDULES", "STRATEGIES"]


def _plain(kind: str) -> Callable[[str, str | None], StrategySpec]:
    def parse(name: str, argument: str | None) -> StrategySpec:
        if argument is not None:
            raise ConfigError(f"strategy {name!r}: {kind} takes no argument; write {kind!r}")
        return StrategySpec(kind=kind)

    return parse


def _parse_ssp(name: str, argument: str | None) -> StrategySpec:
    if argument is None or not re.fullmatch(r"\d+", argument):
        raise ConfigError(
            f"strategy {name!r}: SSP needs its staleness bound as an int >= 0, e.g. 'ssp:2' (0 behaves as 'bsp')"
        )
    return StrategySpec(kind="ssp", staleness=int(argument))


#: The pipeline schedules (see :mod:`paratrain.pipeline.schedules`; kept here as names, so parsing needs no import).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "pipedream", "pipedream-vsync")


def _parse_pipeline(name: str, argument: str | None) -> StrategySpec:
    schedule = (argument or "").lower()
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"strategy {name!r}: write pipeline:SCHEDULE with one of {', '.join(PIPELINE_SCHEDULES)}")
    return StrategySpec(kind="pipeline", options=MappingProxyType({"schedule": schedule}))


def _parse_gossip(name: str, argument: str | None) -> StrategySpec:
    if not argument:
        raise ConfigError(
            f"strategy {name!r}: gossip needs its graph, e.g. 'gossip:ring'; use one of "
            f"{', '.join(GOSSIP_TOPOLOGIES)} or a graph file ('gossip:path/to/edges.txt')"
        )
    topology = argument.lower() if argument.lower() in GOSSIP_TOPOLOGIES else argument
    return StrategySpec(kind="gossip", topology=topology)


def _parse_poseidon(name: str, argument: str | None) -> StrategySpec:
    dense = {None: "ps", "ps": "ps", "bsp": "ps", "allreduce": "allreduce"}.get(argument.lower() if argument else None)
    if dense is None:
        raise ConfigError(
            f"strategy {name!r}: write 'poseidon' (layers by SFB or bulk-synchronous parameter servers) or "
            "'poseidon:allreduce' (by SFB or allreduce)"
        )
    return StrategySpec(kind="poseidon", options=MappingProxyType({"dense": dense}))


def _parse_sfb(name: str, argument: str | None) -> StrategySpec:
    if argument is not None:
        raise ConfigError(f"strategy {name!r}: sfb takes no argument; write 'sfb'")
    return StrategySpec(kind="sfb", options=MappingProxyType({"dense": "allreduce"}))


def _parse_tp(name: str, argument: str | None) -> StrategySpec:
    if argument is None or not re.fullmatch(r"\d+", argument) or int(argument) < 1:
        raise ConfigError(
            f"strategy {name!r}: tp needs its tensor-parallel degree N >= 1, e.g. 'tp:2' (every pair of linear "
            "layers split N-ways, Megatron-style; data parallel across the other workers)"
        )
    return StrategySpec(kind="tp", options=MappingProxyType({"tensor": str(int(argument))}))


def _parse_soap(name: str, argument: str | None) -> StrategySpec:
    if not argument:
        raise ConfigError(
            f"strategy {name!r}: soap needs the per-layer configuration's file, e.g. 'soap:best.json' (what "
            "`paratrain plan --search soap` writes)"
        )
    return StrategySpec(kind="soap", options=MappingProxyType({"file": argument}))


_WORKER = "paratrain.train.worker"

#: What one step of each kind computes, with w the parameters, g_i worker i's gradient of this step, N the
#: workers, eta the optimizer's step (SGD shown; any torch optimizer steps the same way on the same gradient).
_ALLREDUCE = "w <- w - eta * (1/N) sum_i g_i(w): synchronous SGD on the mean gradient, every replica identical"
_BSP = (
    "servers hold w; each step every worker pushes g_i and the servers apply w <- w - eta * (1/N) sum_i g_i once "
    "all N pushes of the clock arrived; the pull returns that w (synchronous SGD, as allreduce)"
)
_SSP = (
    "as bsp, but a pull at clock c returns once every worker finished clock c - s: the w read may miss the last "
    "s rounds of the others' updates (each round still applies the mean of N pushes); s = 0 is bsp"
)
_ASP = (
    "servers apply each round of N pushes as they arrive; a pull returns whatever w the servers hold (a preview "
    "of the open round with this worker's push in it): no worker ever waits for another"
)
_GOSSIP = (
    "D-PSGD: w_i <- sum_j W_ij w_j - eta * g_i(w_i), W the graph's doubly stochastic mixing matrix; replicas "
    "differ and converge to their average"
)
_PIPELINE = (
    "one model cut into stages over workers; each micro-batch's gradient accumulates and the optimizer steps by "
    "the schedule (gpipe, 1f1b: the whole batch's gradient, as one process; pipedream: weight versions per "
    "micro-batch; pipedream-vsync: versions kept in step)"
)
_POSEIDON = (
    "as bsp (or allreduce) on the mean gradient, each layer sent by the cheaper of its sufficient factors "
    "(u_i v_i^T rebuilt by every worker, then summed) or the dense parameter servers; the same w as bsp"
)
_TENSOR = (
    "as allreduce on the mean gradient of the global batch (the data groups' batches), with each split layer "
    "held in parts over its tensor group: a column part computes its output features, a row part its input "
    "features' partial sums (reduced before the next non-linear step); the activations' moves between layers "
    "make every step compute what the unsplit layer computes, so w is allreduce's up to the order of float sums"
)
_SFB = (
    "as allreduce on the mean gradient; each Linear layer's gradient sent as its sufficient factors and rebuilt "
    "by every worker (sum_i u_i v_i^T / N), the rest by allreduce: the same w as allreduce"
)


def _unit(  # noqa: PLR0917 (a row of the table below)
    kind: str,
    syntax: str,
    family: Family,
    line: str,
    parse: Callable[[str, str | None], StrategySpec],
    rule: str,
    checks: Callable[[StrategySpec, StrategyOptions], None],
    parts: tuple[str, str],
    **capabilities: Any,
) -> StrategyUnit:
    """A unit whose builder and composer are ``parts`` = (builder in :mod:`paratrain.torch.builders`, composer
    in :mod:`paratrain.sim.compose`), or full references where they contain a colon."""
    builder, composer = (part if ":" in part else f"{home}:{part}" for part, home in zip(parts, _HOMES, strict=True))
    capabilities.setdefault("worker", _WORKER)
    return StrategyUnit(
        kind, syntax, family, line, parse, update_rule=rule, checks=checks, builder=builder, composer=composer,
        **capabilities,
    )  # fmt: skip


_HOMES = ("paratrain.torch.builders", "paratrain.sim.compose")
_PS = ("parameter_server", "PARAMETER_SERVER")
#: dead workers restarted (they rejoin the servers, paratrain.ps.rejoin); dead servers restarted when replicated
_SERVERS = {"recovery": frozenset({"restarts", "replicas"}), "compressible": True}
_TP = ("paratrain.torch.soap:parallelize", "TENSOR")
_SPLIT = {"worker": "paratrain.train.tensor_worker"}
_ALLREDUCE_RECOVERY = frozenset({"restarts", "checkpoint", "elastic", "reliable"})
#: SFB's factors and the dense allreduce, each a numbered reliable operation (not elastic: a factor's mean is over
#: the job's workers as they were)
_HYBRID_RECOVERY = frozenset({"restarts", "checkpoint", "reliable"})

for _registered in (
    _unit("allreduce", "allreduce", "collective", "gradients averaged by allreduce every step", _plain("allreduce"),
          _ALLREDUCE, no_more_checks, ("allreduce", "ALLREDUCE"), recovery=_ALLREDUCE_RECOVERY, compressible=True),
    _unit("bsp", "bsp", "parameter-server", "parameter servers, bulk-synchronous", _plain("bsp"), _BSP,
          parameter_server_checks, _PS, **_SERVERS),
    _unit("ssp", "ssp:S", "parameter-server", "parameter servers, staleness bound S >= 0", _parse_ssp, _SSP,
          parameter_server_checks, _PS, synchronous=False, **_SERVERS),
    _unit("asp", "asp", "parameter-server", "parameter servers, asynchronous", _plain("asp"), _ASP,
          parameter_server_checks, _PS, synchronous=False, **_SERVERS),
    _unit("gossip", "gossip:TOPOLOGY", "decentralised", "D-PSGD over ring|torus|exponential|complete|FILE",
          _parse_gossip, _GOSSIP, no_more_checks, ("gossip", "GOSSIP"), recovery=frozenset({"restarts"})),
    _unit("pipeline", "pipeline:SCHEDULE", "pipeline", "stages over workers: gpipe|1f1b|pipedream|pipedream-vsync",
          _parse_pipeline, _PIPELINE, pipeline_checks, ("paratrain.torch.pipeline:Pipe", "PIPELINE"),
          worker="paratrain.train.pipeline_worker", recovery=frozenset({"restarts"})),
    _unit("poseidon", "poseidon[:allreduce]", "parameter-server",
          "per layer, sufficient factors or parameter servers (or allreduce) by Poseidon's cost model",
          _parse_poseidon, _POSEIDON, hybrid_checks, ("hybrid", "HYBRID"), recovery=_HYBRID_RECOVERY,
          compressible=True),
    _unit("sfb", "sfb", "collective", "every Linear layer by sufficient factors, the rest by allreduce", _parse_sfb,
          _SFB, no_more_checks, ("hybrid", "HYBRID"), recovery=_HYBRID_RECOVERY, compressible=True),
    _unit("tp", "tp:N", "tensor", "Megatron-style: linear layers split N-ways in column/row pairs, data parallel "
          "across the rest", _parse_tp, _TENSOR, tensor_checks, _TP, **_SPLIT),
    _unit("soap", "soap:FILE", "tensor", "each layer split as a configuration file says (paratrain plan --search "
          "soap writes one)", _parse_soap, _TENSOR, tensor_checks, _TP, **_SPLIT),
):  # fmt: skip
    register_kind(_registered)

#: What each wrapper changes in its base's update rule (:mod:`paratrain.strategy.wrappers`).
_COMPRESSION = (
    "the base's mean gradient replaced by its compressed estimate: fp16/bf16 the mean of 16-bit casts; topk:R the "
    "mean of each worker's R largest entries of gradient + residual (dgc:R: of its momentum-corrected velocity), "
    "the rest kept as the next step's residual; powersgd:R the mean's rank-R factors P Q^T (two rounds). On the "
    "parameter servers the pushes are compressed and the servers step on what they decode"
)
_RELIABLE = (
    "the base's rule unchanged (the same w to the bit): each bucket averaged by one numbered, synchronous reliable "
    "allreduce in step() instead of during backward (each SFB layer's factors by one reliable allgather), so that a "
    "restarted rank replays the step (Rabit's model) and an elastic job (min_workers) regroups and resumes at the "
    "bucket it stopped at"
)

for _wrapper in (
    WrapperUnit("compression", "compression", _COMPRESSION, compression_checks, "paratrain.torch.builders:compressed"),
    WrapperUnit("reliable", "reliable", _RELIABLE, reliable_checks, "paratrain.torch.builders:reliable"),
):
    register_wrapper(_wrapper)

#: The strategy names :func:`~paratrain.strategy.spec.parse_strategy` accepted at import (``S`` is SSP's
#: staleness bound, an int >= 0; ``TOPOLOGY`` is ``ring``, ``torus``, ``exponential``, ``complete`` or the path
#: of a graph file).
STRATEGIES = tuple(unit.syntax for unit in kinds().values())
