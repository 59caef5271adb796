"""Straggler models: how much slower each worker's compute is at each step (pure, seeded, no timing).

``paratrain train`` and ``compare`` emulate a slower machine by sleeping after backward for
``compute_time * (factor - 1)``, so that the step's compute takes ``factor`` times as long. A model says what
the factor is for every ``(rank, step)``; three are offered, from the kinds of stragglers the literature
describes:

========================  ==============================================================================
spec                      each step, each worker's factor
========================  ==============================================================================
``RANK:FACTOR``           persistent: worker RANK is always FACTOR times slower, the others never (a slower
                          machine; the only model paratrain had before)
``random:P:FACTOR``       transient: every worker, independently, is FACTOR times slower with probability P
                          (Cipar et al., "Solving the Straggler Problem with Bounded Staleness", HotOS 2013:
                          BSP suffers because "every transient slowdown of any given thread can delay all
                          other threads" -- the case SSP is designed for)
``pareto:ALPHA[:SCALE]``  heavy-tailed: ``1 + SCALE * L`` with ``L ~ Lomax(ALPHA)`` (Pareto type II,
                          numpy's ``Generator.pareto``; ``1 + L`` is the classical Pareto with minimum 1);
                          SCALE defaults to 1
========================  ==============================================================================

Why a Pareto: Dean and Barroso ("The Tail at Scale", CACM 2013) show that the latency of one component is
usually short but has a long tail, and that a parallel step which waits for all of N components sees that tail
N times over; a power law is the simplest tail with that shape, and straggler analyses use it next to the
shifted exponential (e.g. Wang, Joshi and Wornell, "Efficient Straggler Replication in Large-scale Parallel
Computing", 2015). ``P(factor > 1 + SCALE * t) = (1 + t) ** -ALPHA``; the mean factor is
``1 + SCALE / (ALPHA - 1)``. ALPHA must exceed 1: at or below 1 the mean slowdown is infinite and one draw
decides how long a run takes. Even above 1 single steps can be long: over ``n`` draws the largest factor is
about ``1 + SCALE * (n ** (1 / ALPHA) - 1)`` (ALPHA 1.5, 10,000 draws: about 460 times one step's compute).

Determinism: the factor of ``(rank, step)`` comes from a numpy generator seeded by ``(seed, rank)`` with the
step as its child stream (``SeedSequence(seed, spawn_key=(rank, step))``), so it depends on nothing else: not
on timing, not on which steps were drawn before, not on the other ranks. The same ``--seed`` gives the same
slowdowns, step for step, on every run.

Example:
    >>> model = parse("random:0.25:4", seed=0)
    >>> model.factor(rank=1, step=10) in (1.0, 4.0)
    True
    >>> parse("1:3").factor(rank=1, step=0), parse("1:3").factor(rank=0, step=0)
    (3.0, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paratrain.errors import ConfigError

__all__ = ["FORMS", "HELP", "Model", "ParetoStraggler", "PersistentStraggler", "RandomStraggler", "parse"]

FORMS = "RANK:FACTOR (persistent), random:P:FACTOR (transient), pareto:ALPHA[:SCALE] (heavy-tailed)"

HELP = (
    "emulated stragglers (compute slowed by sleeping after backward), drawn per worker per step from --seed: "
    "RANK:FACTOR makes worker RANK's every step FACTOR times slower; random:P:FACTOR makes each worker's step "
    "FACTOR times slower with probability P; pareto:ALPHA[:SCALE] stretches each worker's step by "
    "1 + SCALE*L, L ~ Lomax(ALPHA) (heavy-tailed, mean 1 + SCALE/(ALPHA-1), ALPHA > 1, SCALE default 1)"
)


def _rng(seed: int, rank: int, step: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(rank, step)))


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistentStraggler:
    """Worker ``rank`` is always ``slowdown`` times slower; the others run at full speed."""

    rank: int
    slowdown: float

    def factor(self, rank: int, step: int) -> float:
        """The compute slowdown of ``rank`` at ``step`` (>= 1)."""
        return self.slowdown if rank == self.rank else 1.0

    def check_workers(self, workers: int) -> None:
        """Raises :class:`ConfigError` if the straggling rank is not one of ``workers``."""
        if not 0 <= self.rank < workers:
            raise ConfigError(
                f"--straggler {self.rank}:{self.slowdown:g}: RANK:FACTOR needs 0 <= RANK < {workers} (the workers)"
            )

    def mean(self) -> float:
        """The mean factor of the straggling rank (the others': 1)."""
        return self.slowdown


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomStraggler:
    """Each step, every worker independently is ``slowdown`` times slower with probability ``probability``."""

    probability: float
    slowdown: float
    seed: int = 0

    def factor(self, rank: int, step: int) -> float:
        """The compute slowdown of ``rank`` at ``step``: ``slowdown`` or 1, from the generator of (seed, rank)."""
        return self.slowdown if _rng(self.seed, rank, step).random() < self.probability else 1.0

    def check_workers(self, workers: int) -> None:
        """Every worker may straggle: nothing to check."""

    def mean(self) -> float:
        """The mean factor of every worker: ``1 + P * (FACTOR - 1)``."""
        return 1.0 + self.probability * (self.slowdown - 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParetoStraggler:
    """Each step, every worker's compute is stretched by ``1 + scale * L``, ``L ~ Lomax(alpha)`` (heavy-tailed)."""

    alpha: float
    scale: float = 1.0
    seed: int = 0

    def factor(self, rank: int, step: int) -> float:
        """The compute slowdown of ``rank`` at ``step`` (>= 1), from the generator of (seed, rank)."""
        return 1.0 + self.scale * float(_rng(self.seed, rank, step).pareto(self.alpha))

    def check_workers(self, workers: int) -> None:
        """Every worker may straggle: nothing to check."""

    def mean(self) -> float:
        """The mean factor of every worker: ``1 + SCALE / (ALPHA - 1)``."""
        return 1.0 + self.scale / (self.alpha - 1.0)


Model = PersistentStraggler | RandomStraggler | ParetoStraggler


def _number(text: str, what: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--straggler {spec!r}: {what} {text!r} is not a number; write one of {FORMS}") from None
    if not math.isfinite(value):
        raise ConfigError(f"--straggler {spec!r}: {what} must be finite; write one of {FORMS}")
    return value


def parse(spec: str, *, seed: int = 0) -> Model:
    """The straggler model of a ``--straggler`` spec; ``seed`` (the job's ``--seed``) seeds the random ones.

    Raises:
        ConfigError: a spec in none of the forms in :data:`FORMS`, or a value out of range (FACTOR < 1,
            P outside [0, 1], ALPHA <= 1, SCALE < 0, a negative seed); the message lists the accepted forms.

    Example:
        >>> parse("pareto:2", seed=7)
        ParetoStraggler(alpha=2.0, scale=1.0, seed=7)
    """
    text = spec.strip()
    parts = [p.strip() for p in text.split(":")]
    kind = parts[0].lower()
    if seed < 0:
        raise ConfigError(f"--straggler {spec!r}: the seed must be >= 0, got {seed}")
    if kind == "random":
        if len(parts) != 3:
            raise ConfigError(f"--straggler {spec!r}: write random:P:FACTOR, e.g. random:0.1:4 (forms: {FORMS})")
        probability = _number(parts[1], "P", spec)
        slowdown = _number(parts[2], "FACTOR", spec)
        if not 0.0 <= probability <= 1.0:
            raise ConfigError(f"--straggler {spec!r}: P is a probability in [0, 1], got {probability:g}")
        if slowdown < 1.0:
            raise ConfigError(f"--straggler {spec!r}: FACTOR must be >= 1 (a slowdown), got {slowdown:g}")
        return RandomStraggler(probability=probability, slowdown=slowdown, seed=seed)
    if kind == "pareto":
        if len(parts) not in (2, 3):
            raise ConfigError(f"--straggler {spec!r}: write pareto:ALPHA or pareto:ALPHA:SCALE (forms: {FORMS})")
        alpha = _number(parts[1], "ALPHA", spec)
        scale = _number(parts[2], "SCALE", spec) if len(parts) == 3 else 1.0
        if alpha <= 1.0:
            raise ConfigError(
                f"--straggler {spec!r}: ALPHA must be > 1 (at or below 1 the mean slowdown is infinite), got {alpha:g}"
            )
        if scale < 0.0:
            raise ConfigError(f"--straggler {spec!r}: SCALE must be >= 0, got {scale:g}")
        return ParetoStraggler(alpha=alpha, scale=scale, seed=seed)
    if len(parts) == 2 and parts[0].isascii() and parts[0].isdigit():
        slowdown = _number(parts[1], "FACTOR", spec)
        if slowdown < 1.0:
            raise ConfigError(f"--straggler {spec!r}: FACTOR must be >= 1 (a slowdown), got {slowdown:g}")
        return PersistentStraggler(rank=int(parts[0]), slowdown=slowdown)
    raise ConfigError(f"--straggler {spec!r} is not a straggler model; write one of {FORMS}")
