"""Strategy names, parsed once: the registry of synchronisation strategies and the spec every user reads.

A strategy is named by a string such as ``"allreduce"``, ``"ssp:3"`` or ``"gossip:ring"`` on the command line,
in ``DistributedOptimizer(strategy=...)``, in benchmark options and in run records. This module is the only
place that reads those strings: :func:`parse_strategy` turns one into a :class:`StrategySpec`, whose fields
(``kind``, ``family``, ``staleness``, ``topology``) and capabilities (``uses_servers``...) are what the CLI,
the training worker, the benchmarks and the torch front end ask, instead of splitting strings themselves.

Kinds are registered (:func:`register_kind`), as ps-lite creates its transports by name: a new system (the
pipelines, for example) adds its kind and argument syntax here and its runtime where it lives, without
touching the parsers of the others. Torch-free, so that the CLI can check a name before torch is imported.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from paratrain.errors import ConfigError

__all__ = [
    "FAMILIES",
    "GOSSIP_TOPOLOGIES",
    "STRATEGIES",
    "Family",
    "KindInfo",
    "StrategySpec",
    "UnknownStrategyError",
    "kinds",
    "parse_layer_schemes",
    "parse_strategy",
    "register_kind",
    "strategies_help",
]

#: How a strategy keeps workers in step: a collective among replicas, parameter servers, neighbour averaging,
#: or (for model parallelism) stages that are not replicas at all.
Family = Literal["collective", "parameter-server", "decentralised", "pipeline"]
FAMILIES: tuple[Family, ...] = ("collective", "parameter-server", "decentralised", "pipeline")

#: The named gossip graphs (any other argument is a graph file's path); see :mod:`paratrain.gossip.topology`.
GOSSIP_TOPOLOGIES = ("ring", "torus", "exponential", "complete")


class UnknownStrategyError(ConfigError):
    """A strategy name whose kind is not registered (as opposed to a known kind with a bad argument)."""


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """A parsed strategy name.

    Attributes:
        kind: the registered kind (``"allreduce"``, ``"bsp"``, ``"ssp"``, ``"asp"``, ``"gossip"``...).
        staleness: SSP's bound s (None for the others).
        topology: gossip's graph: a name from :data:`GOSSIP_TOPOLOGIES` or a file path (None for the others).
        options: arguments of kinds registered later, by name.

    Example:
        >>> spec = parse_strategy("ssp:2")
        >>> spec.kind, spec.staleness, spec.family, spec.uses_servers, str(spec)
        ('ssp', 2, 'parameter-server', True, 'ssp:2')
    """

    kind: str
    staleness: int | None = None
    topology: str | None = None
    options: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)

    @property
    def info(self) -> KindInfo:
        """The registry's entry for this kind."""
        return _KINDS[self.kind]

    @property
    def family(self) -> Family:
        """How this strategy keeps workers in step (see :data:`Family`); a hybrid's is its dense part's."""
        if self.dense is not None:
            return "parameter-server" if self.dense == "ps" else "collective"
        return self.info.family

    @property
    def hybrid(self) -> bool:
        """True for the strategies that send some layers by sufficient factors (``poseidon``, ``sfb``)."""
        return "dense" in self.options

    @property
    def dense(self) -> str | None:
        """A hybrid's scheme for the layers SFB does not carry: ``"ps"`` or ``"allreduce"`` (None otherwise)."""
        return self.options.get("dense")

    @property
    def uses_servers(self) -> bool:
        """True for the parameter-server strategies (the job needs ``--servers``)."""
        return self.family == "parameter-server"

    @property
    def consistency(self) -> str | None:
        """The parameter servers' consistency model as :class:`~paratrain.ps.KVStore` takes it (``"ssp:2"``)."""
        if not self.uses_servers:
            return None
        return "bsp" if self.hybrid else str(self)

    @property
    def exchanges_parameters(self) -> bool:
        """True when workers exchange parameters rather than gradients (gossip): their replicas differ."""
        return self.family == "decentralised"

    def __str__(self) -> str:
        if self.kind == "poseidon" and self.dense == "allreduce":
            return "poseidon:allreduce"
        if "schedule" in self.options:
            return f"{self.kind}:{self.options['schedule']}"
        if self.staleness is not None:
            return f"{self.kind}:{self.staleness}"
        if self.topology is not None:
            return f"{self.kind}:{self.topology}"
        return self.kind


@dataclass(frozen=True, slots=True)
class KindInfo:
    """A registered strategy kind.

    Attributes:
        kind: the name before the colon.
        syntax: how it is written, for help texts (``"ssp:S"``).
        family: see :data:`Family`.
        help: one line for ``--help``.
        parse: ``parse(name, argument)`` -> the spec; ``argument`` is what follows the colon (None without one).
            Raises ConfigError saying what is accepted.
    """

    kind: str
    syntax: str
    family: Family
    help: str
    parse: Callable[[str, str | None], StrategySpec]


_KINDS: dict[str, KindInfo] = {}


def register_kind(info: KindInfo) -> None:
    """Adds a strategy kind (a new kind's name must be new, lowercase, without a colon).

    Raises:
        ValueError: the name is taken or malformed.
    """
    if info.kind in _KINDS or not re.fullmatch(r"[a-z][a-z0-9_-]*", info.kind):
        raise ValueError(f"cannot register strategy kind {info.kind!r}: taken or not a lowercase word")
    if info.family not in FAMILIES:
        raise ValueError(f"strategy kind {info.kind!r}: unknown family {info.family!r}")
    _KINDS[info.kind] = info


def kinds() -> Mapping[str, KindInfo]:
    """The registered kinds, in registration order."""
    return MappingProxyType(_KINDS)


def strategies_help() -> str:
    """The accepted names, for ``--help`` and error messages: ``allreduce, bsp, ssp:S, ...``."""
    return ", ".join(info.syntax for info in _KINDS.values())


def parse_strategy(name: str) -> StrategySpec:
    """Parses a strategy name (case and spaces ignored, except a graph file's path).

    Raises:
        ConfigError: unknown kind or a bad argument; the message lists what is accepted.

    Example:
        >>> parse_strategy("gossip:Ring")
        StrategySpec(kind='gossip', staleness=None, topology='ring')
        >>> parse_strategy(" BSP ").kind
        'bsp'
    """
    if not isinstance(name, str):
        raise ConfigError(f"strategy must be a string such as 'allreduce', got {type(name).__name__}")
    head, colon, argument = name.strip().partition(":")
    kind = head.strip().lower()
    info = _KINDS.get(kind)
    if info is None:
        for known in sorted(_KINDS.values(), key=lambda i: -len(i.kind)):
            if kind.startswith(known.kind):  # "gossipy:ring", "ssp2": the kind they meant says what it needs
                known.parse(name, None)
        valid = ", ".join(repr(info.syntax) for info in _KINDS.values())
        raise UnknownStrategyError(f"unknown strategy {name!r}; choose one of {valid}")
    return info.parse(name, argument.strip() if colon else None)


# -- the built-in kinds -----------------------------------------------------------------------------------------


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


for _info in (
    KindInfo("allreduce", "allreduce", "collective", "gradients averaged by allreduce every step", _plain("allreduce")),
    KindInfo("bsp", "bsp", "parameter-server", "parameter servers, bulk-synchronous", _plain("bsp")),
    KindInfo("ssp", "ssp:S", "parameter-server", "parameter servers, staleness bound S >= 0", _parse_ssp),
    KindInfo("asp", "asp", "parameter-server", "parameter servers, asynchronous", _plain("asp")),
    KindInfo(
        "gossip",
        "gossip:TOPOLOGY",
        "decentralised",
        "D-PSGD over ring|torus|exponential|complete|FILE",
        _parse_gossip,
    ),
    KindInfo(
        "pipeline",
        "pipeline:SCHEDULE",
        "pipeline",
        "stages over workers: gpipe|1f1b|pipedream|pipedream-vsync",
        _parse_pipeline,
    ),
    KindInfo(
        "poseidon",
        "poseidon[:allreduce]",
        "parameter-server",
        "per layer, sufficient factors or parameter servers (or allreduce) by Poseidon's cost model",
        _parse_poseidon,
    ),
    KindInfo("sfb", "sfb", "collective", "every Linear layer by sufficient factors, the rest by allreduce", _parse_sfb),
):
    register_kind(_info)

#: The strategy names :func:`parse_strategy` accepted at import (``S`` is SSP's staleness bound, an int >= 0;
#: ``TOPOLOGY`` is ``ring``, ``torus``, ``exponential``, ``complete`` or the path of a graph file).
STRATEGIES = tuple(info.syntax for info in _KINDS.values())


def parse_layer_schemes(items: Sequence[str] | None) -> dict[str, str]:
    """``["fc1=sfb", "out=dense"]`` -> ``{"fc1": "sfb", "out": "dense"}``.

    Raises:
        ConfigError: an item without ``=``.
    """
    schemes = {}
    for item in items or []:
        name, eq, scheme = item.partition("=")
        if not eq or not name.strip() or not scheme.strip():
            raise ConfigError(f"--layer-scheme {item!r}: write LAYER=SCHEME, e.g. 1=sfb or out=dense")
        schemes[name.strip()] = scheme.strip().lower()
    return schemes
