"""FlexFlow's search over per-operator configurations: which layers to split, and how, on how many workers.

A point of the space is a tensor-parallel degree T (a divisor of the workers; T = 1 is data parallelism) and,
for every layer that splits, ``replicated``, ``column`` (its outputs divide by T) or ``row`` (its inputs do), and
for a transformer block ``heads`` or ``sequence`` (its heads divide by T); at
T > 1 at least one layer splits (a tensor group that splits nothing repeats one worker's work T times: the job
with fewer workers, which is not a strategy of this job).
The cost of a point is the simulator's step (:class:`paratrain.sim.compose` replays the runtime's own moves), given
by the caller. Where the space is small it is enumerated; otherwise a Markov chain explores it as FlexFlow's
does (Jia et al., SysML'19): it starts from data parallelism, each proposal changes one layer's split (or, one
time in ten, the degree, keeping the splits that still divide), and a proposal costing ``c'`` against the current
``c`` is accepted with probability ``min(1, exp(-alpha (c' - c) / c))`` (Metropolis-Hastings; relative, so that
``alpha`` does not depend on the model's scale), until a budget of seconds or proposals is spent. Each proposal
is simulated whole (the plans are small: a few milliseconds each), not re-simulated incrementally.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from paratrain.errors import ConfigError
from paratrain.sim.machine import MachineProfile, ModelProfile
from paratrain.soap import BLOCK_SPLIT, SEQUENCE_SPLIT, LayerShape, SoapConfig

__all__ = ["SoapPoint", "SoapSearch", "search_soap", "soap_cost", "split_options", "splittable"]


@dataclass(frozen=True, order=True)
class SoapPoint:
    """A configuration: the degree and the layers split (the others replicated), sorted by name."""

    tensor: int
    splits: tuple[tuple[str, str], ...] = ()

    def config(self, workers: int, model: str | None = None) -> SoapConfig:
        """As a job's configuration on ``workers`` workers."""
        return SoapConfig(self.tensor, dict(self.splits), workers // self.tensor, model)

    def with_split(self, layer: str, split: str) -> SoapPoint:
        """This point with ``layer`` split as ``split``."""
        rest = {**dict(self.splits), layer: split}
        return SoapPoint(self.tensor, tuple(sorted((n, s) for n, s in rest.items() if s != "replicated")))


@dataclass
class SoapSearch:
    """What a search found.

    Attributes:
        best: the fastest point simulated; ``best_s`` its step.
        start_s: data parallelism's step (where the chain starts).
        proposals: points simulated; ``accepted``: moves of the chain (the enumeration's: all).
        seconds: the search's wall time.
        exhaustive: every point of the space was simulated.
        size: points in the space.
        history: the best step after each proposal.
    """

    best: SoapPoint
    best_s: float
    start_s: float
    proposals: int
    accepted: int
    seconds: float
    exhaustive: bool
    size: int
    history: list[float] = field(default_factory=list)


def split_options(layers: Mapping[str, LayerShape], tensor: int) -> dict[str, tuple[str, ...]]:
    """Each layer's splits at degree ``tensor``: always ``replicated``; ``column`` where its outputs divide by it,
    ``row`` where its inputs do.

    Example:
        >>> split_options({"1": LayerShape(784, 512), "5": LayerShape(512, 10)}, 4)
        {'1': ('replicated', 'column', 'row'), '5': ('replicated', 'row')}
    """
    if tensor == 1:
        return {name: ("replicated",) for name in layers}
    found: dict[str, tuple[str, ...]] = {}
    for name, shape in layers.items():
        if shape.kind == "block":
            divides = shape.in_features % tensor == 0 and shape.out_features % tensor == 0
            found[name] = ("replicated", BLOCK_SPLIT, SEQUENCE_SPLIT) if divides else ("replicated",)
            continue
        found[name] = (
            ("replicated",)
            + (("column",) if shape.out_features % tensor == 0 else ())
            + (("row",) if shape.in_features % tensor == 0 else ())
        )
    return found


def splittable(model: ModelProfile) -> dict[str, LayerShape]:
    """The profiled model's modules that split (linear layers, convolutions, transformer blocks), by name, with
    what a split cuts."""
    from paratrain.sim.tensor import steps_of

    return {step.name: shape for step in steps_of(model) if (shape := step.shape) is not None}


def _space(layers: Mapping[str, LayerShape], degrees: tuple[int, ...]) -> int:
    """Points in the space: at T > 1 every combination but all-replicated (the module docstring says why)."""
    return sum(math.prod(len(o) for o in split_options(layers, t).values()) - (t > 1) for t in degrees)


def _every(layers: Mapping[str, LayerShape], degrees: tuple[int, ...]) -> list[SoapPoint]:
    points = []
    for t in degrees:
        combos: list[SoapPoint] = [SoapPoint(t)]
        for name, options in split_options(layers, t).items():
            combos = [p.with_split(name, o) for p in combos for o in options]
        points += [p for p in combos if t == 1 or p.splits]
    return points


def search_soap(
    cost: Callable[[SoapPoint], float],
    model: ModelProfile,
    workers: int,
    *,
    budget_s: float = 30.0,
    proposals: int = 0,
    alpha: float = 20.0,
    seed: int = 0,
    exhaustive_up_to: int = 100_000,
) -> SoapSearch:
    """The fastest configuration of ``model`` on ``workers`` workers that the budget finds (module docstring).

    Args:
        cost: a point's predicted step in seconds.
        budget_s: stop after this many seconds (the enumeration too).
        proposals: stop after this many proposals (0: only the time budget).
        alpha: how reluctantly the chain moves to a slower point.
        seed: the chain's random numbers.
        exhaustive_up_to: enumerate spaces of at most this many points, when the budget allows it (the first
            point's time, times the space's size, within the seconds of ``budget_s``); else the chain.

    Raises:
        ConfigError: the profile places no layer that splits, or a bad budget.
    """
    if budget_s <= 0 and proposals <= 0:
        raise ConfigError("give the search a budget: seconds > 0 or proposals > 0")
    layers = splittable(model)
    if not layers:
        raise ConfigError(f"the profile of {model.model!r} has no layer that splits (linear layers, convolutions)")
    degrees = tuple(t for t in range(1, workers + 1) if workers % t == 0)
    size = _space(layers, degrees)
    started = time.perf_counter()
    start = SoapPoint(1)
    start_s = cost(start)
    per_point = time.perf_counter() - started
    best, best_s, history, tried, accepted = start, start_s, [start_s], 1, 0

    def spent() -> bool:
        return (budget_s > 0 and time.perf_counter() - started >= budget_s) or (0 < proposals <= tried)

    affordable = budget_s <= 0 or size * per_point * 1.5 <= budget_s
    if size <= exhaustive_up_to and affordable and (proposals <= 0 or proposals >= size):
        for point in _every(layers, degrees):
            if point == start:
                continue
            if spent():
                break
            step = cost(point)
            tried, accepted = tried + 1, accepted + 1
            if step < best_s:
                best, best_s = point, step
            history.append(best_s)
        exhaustive = tried == size
    else:
        rng = random.Random(seed)
        current, current_s = start, start_s
        while not spent():
            proposal = _propose(rng, current, layers, degrees)
            step = cost(proposal)
            tried += 1
            if step <= current_s or rng.random() < math.exp(-alpha * (step - current_s) / current_s):
                current, current_s, accepted = proposal, step, accepted + 1
            if step < best_s:
                best, best_s = proposal, step
            history.append(best_s)
        exhaustive = False
    return SoapSearch(best, best_s, start_s, tried, accepted, time.perf_counter() - started, exhaustive, size, history)


def _propose(
    rng: random.Random, point: SoapPoint, layers: Mapping[str, LayerShape], degrees: tuple[int, ...]
) -> SoapPoint:
    """One layer's split changed, or (one time in ten, or when no layer can change) the degree."""
    options = split_options(layers, point.tensor)
    changeable = [name for name, o in options.items() if len(o) > 1]
    if len(degrees) > 1 and (not changeable or rng.random() < 0.1):
        tensor = rng.choice([t for t in degrees if t != point.tensor])
        kept = split_options(layers, tensor)
        moved = SoapPoint(tensor, tuple((n, s) for n, s in point.splits if s in kept[n]))
        splits = [n for n, o in kept.items() if len(o) > 1]
        if tensor > 1 and not moved.splits and splits:  # a group that splits nothing only repeats its work
            name = rng.choice(splits)
            moved = moved.with_split(name, rng.choice(kept[name][1:]))
        return moved
    if not changeable:
        return point
    name = rng.choice(changeable)
    now = dict(point.splits).get(name, "replicated")
    return point.with_split(name, rng.choice([o for o in options[name] if o != now]))


def soap_cost(
    profile: MachineProfile,
    model: ModelProfile,
    *,
    workers: int,
    batch_size: int,
    bandwidth: float | None = None,
    latency: float = 0.0,
    hosts: int = 1,
) -> Callable[[SoapPoint], float]:
    """A point's predicted step for a job of ``workers`` workers of ``batch_size`` examples each (a tensor group of
    T workers trains on T x ``batch_size``, so that every point trains on as many examples per step), by the
    ``soap`` unit's composer."""
    from paratrain.sim.compose import TENSOR
    from paratrain.sim.predict import JobRequest
    from paratrain.strategy import parse_strategy

    spec = parse_strategy("soap:searched")

    def cost(point: SoapPoint) -> float:
        request = JobRequest(
            profile, model, spec, workers, batch_size=point.tensor * batch_size, bandwidth=bandwidth, latency=latency,
            hosts=hosts,
        )  # fmt: skip
        return TENSOR.predict_config(request, point.config(workers)).step_s

    return cost
