"""Strategy names, parsed once: the registry of synchronisation strategies and the spec every user reads.

A strategy is named by a string such as ``"allreduce"``, ``"ssp:3"`` or ``"gossip:ring"`` on the command line,
in ``DistributedOptimizer(strategy=...)``, in benchmark options and in run records. This module is the only
place that reads those strings: :func:`parse_strategy` turns one into a :class:`StrategySpec`, whose fields
(``kind``, ``family``, ``staleness``, ``topology``) and capabilities (``uses_servers``...) are what the CLI,
the training worker, the benchmarks and the torch front end ask, instead of splitting strings themselves.

Kinds are registered as units (:class:`StrategyUnit`, :func:`register_kind`), as ps-lite creates its transports by
name: a new system adds its kind, argument syntax, checks, update rule, builder, worker and composer, without
touching the parsers of the others. Torch-free, so that the CLI can check a name before torch is imported.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from paratrain.errors import ConfigError
from paratrain.strategy.options import StrategyOptions

__all__ = [
    "FAMILIES",
    "GOSSIP_TOPOLOGIES",
    "Family",
    "StrategySpec",
    "StrategyUnit",
    "UnknownStrategyError",
    "complete",
    "kinds",
    "parse_layer_schemes",
    "parse_strategy",
    "register_kind",
    "resolve",
    "strategies_help",
]

#: How a strategy keeps workers in step: a collective among replicas, parameter servers, neighbour averaging,
#: or (for model parallelism) stages that are not replicas at all, or layers split over workers ("tensor").
Family = Literal["collective", "parameter-server", "decentralised", "pipeline", "tensor"]
FAMILIES: tuple[Family, ...] = ("collective", "parameter-server", "decentralised", "pipeline", "tensor")

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
    def info(self) -> StrategyUnit:
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
    def chooses_layers(self) -> bool:
        """True for a hybrid that chooses each layer's scheme by Poseidon's cost model (``poseidon``); ``sfb``
        sends every fully-connected layer by its sufficient factors."""
        return self.hybrid and self.kind == "poseidon"

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
    def synchronous(self) -> bool:
        """True when every worker waits for every other at each step (not ASP, not SSP with s > 0)."""
        return self.info.synchronous or self.staleness == 0

    @property
    def reduces_gradients(self) -> bool:
        """True when a collective among the replicas averages the gradients (allreduce, sfb, poseidon:allreduce)."""
        return self.family == "collective"

    @property
    def pipelined(self) -> bool:
        """True for the pipelines: stages that are not replicas of one model."""
        return self.family == "pipeline"

    @property
    def splits_layers(self) -> bool:
        """True for per-operator parallelism (``tp:N``, ``soap:FILE``): single layers split over workers."""
        return self.family == "tensor"

    @property
    def exchanges_parameters(self) -> bool:
        """True when workers exchange parameters rather than gradients (gossip): their replicas differ."""
        return self.family == "decentralised"

    def __str__(self) -> str:
        if self.kind == "poseidon" and self.dense == "allreduce":
            return "poseidon:allreduce"
        for argument in ("schedule", "tensor", "file"):
            if argument in self.options:
                return f"{self.kind}:{self.options[argument]}"
        if self.staleness is not None:
            return f"{self.kind}:{self.staleness}"
        if self.topology is not None:
            return f"{self.kind}:{self.topology}"
        return self.kind


@dataclass(frozen=True, slots=True)
class StrategyUnit:
    """A registered strategy kind: everything that knows the kind, in one place.

    The builder, worker and composer are ``"module:name"`` references, resolved when used (:func:`resolve`), so
    that the registry stays torch-free and below the front ends it points to.

    Attributes:
        kind: the name before the colon.
        syntax: how it is written, for help texts (``"ssp:S"``).
        family: see :data:`Family`.
        help: one line for ``--help``.
        parse: ``parse(name, argument)`` -> the spec; ``argument`` is what follows the colon (None without one).
            Raises ConfigError saying what is accepted.
        update_rule: what one step computes: the one place the kind's update rule is written.
        checks: ``checks(spec, options)`` raises ConfigError for options that do not go with the kind
            (:mod:`paratrain.strategy.checks`).
        builder: the torch front end's builder: ``builder(request) -> Strategy`` (a pipeline's is its front end).
        worker: the module ``paratrain train`` runs as each rank (``python -m MODULE --job FILE``).
        composer: the simulator's composer: an object whose ``predict`` and ``estimate`` turn the kind into lanes
            of plan actions and a textbook formula (:mod:`paratrain.sim.compose`).
        synchronous: every worker waits for every other at each step (ASP and SSP(s > 0) do not).
        recovery: what recovery the kind supports: ``"restarts"`` (ranks restarted, Rabit's model), ``"replicas"``
            (restarts of dead servers that have replicas), ``"checkpoint"`` (to disk), ``"elastic"``
            (``min_workers``), ``"reliable"`` (reliable collectives).
        compressible: gradients may be compressed on the way (``compression=``).
    """

    kind: str
    syntax: str
    family: Family
    help: str
    parse: Callable[[str, str | None], StrategySpec]
    update_rule: str
    checks: Callable[[StrategySpec, StrategyOptions], None]
    builder: str
    worker: str
    composer: str
    synchronous: bool = True
    recovery: frozenset[str] = frozenset()
    compressible: bool = False


_KINDS: dict[str, StrategyUnit] = {}


def register_kind(info: StrategyUnit) -> None:
    """Adds a strategy kind (a new kind's name must be new, lowercase, without a colon), with every part a kind
    needs: its checks, update rule, builder, worker and composer.

    Raises:
        ValueError: the name is taken or malformed, or a part is missing.
    """
    if info.kind in _KINDS or not re.fullmatch(r"[a-z][a-z0-9_-]*", info.kind):
        raise ValueError(f"cannot register strategy kind {info.kind!r}: taken or not a lowercase word")
    if info.family not in FAMILIES:
        raise ValueError(f"strategy kind {info.kind!r}: unknown family {info.family!r}")
    if not callable(info.checks) or not info.update_rule.strip():
        raise ValueError(f"strategy kind {info.kind!r} registers no checks or no update rule")
    for part in ("builder", "worker", "composer"):
        if not re.fullmatch(r"[a-z_][\w.]*(:[A-Za-z_]\w*)?", getattr(info, part)):
            raise ValueError(f"strategy kind {info.kind!r} registers no {part} ('package.module:name')")
    _KINDS[info.kind] = info


def resolve(reference: str) -> Any:
    """The object a unit's ``"module:name"`` reference names (the module itself without ``:name``).

    Example:
        >>> resolve("paratrain.strategy.spec:parse_strategy") is parse_strategy
        True
    """
    module, _, name = reference.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, name) if name else loaded


def kinds() -> Mapping[str, StrategyUnit]:
    """The registered kinds, in registration order."""
    return MappingProxyType(_KINDS)


def strategies_help() -> str:
    """The accepted names, for ``--help`` and error messages: ``allreduce, bsp, ssp:S, ...``."""
    return ", ".join(info.syntax for info in _KINDS.values())


def complete(name: str, *, staleness: int = 1, topology: str = "ring", schedule: str = "gpipe") -> StrategySpec:
    """Parses ``name``, giving a kind that needs an argument and has none the one given here (SSP's bound, a
    gossip graph, a pipeline's schedule): how the simulator takes ``strategy="ssp"`` with ``staleness=2``.

    Example:
        >>> str(complete("ssp", staleness=2)), str(complete("gossip", topology="torus")), str(complete("pipeline"))
        ('ssp:2', 'gossip:torus', 'pipeline:gpipe')
        >>> str(complete("ssp:3", staleness=2))
        'ssp:3'
    """
    head = name.strip().partition(":")
    if head[1]:
        return parse_strategy(name)
    argument = {"ssp": str(staleness), "gossip": topology, "pipeline": schedule}.get(head[0].strip().lower())
    return parse_strategy(f"{name}:{argument}" if argument is not None else name)


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
