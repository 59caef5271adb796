"""Straggler models (paratrain/train/stragglers.py): parsing, determinism, and the distributions they draw."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.train.stragglers import (
    FORMS,
    ParetoStraggler,
    PersistentStraggler,
    RandomStraggler,
    parse,
)


@pytest.mark.parametrize(
    ("spec", "model"),
    [
        ("1:3", PersistentStraggler(rank=1, slowdown=3.0)),
        (" 0:1.5 ", PersistentStraggler(rank=0, slowdown=1.5)),
        ("random:0.1:4", RandomStraggler(probability=0.1, slowdown=4.0, seed=5)),
        ("RANDOM:1:2", RandomStraggler(probability=1.0, slowdown=2.0, seed=5)),
        ("pareto:1.5", ParetoStraggler(alpha=1.5, scale=1.0, seed=5)),
        ("pareto:3:0.5", ParetoStraggler(alpha=3.0, scale=0.5, seed=5)),
    ],
)
def test_parse_accepts_the_three_forms(spec: str, model: object) -> None:
    assert parse(spec, seed=5) == model


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("slow", "is not a straggler model"),
        ("-1:2", "is not a straggler model"),
        ("1:2:3", "is not a straggler model"),
        ("1:fast", "FACTOR 'fast' is not a number"),
        ("1:0.5", "FACTOR must be >= 1"),
        ("random:0.1", "write random:P:FACTOR"),
        ("random:1.5:2", "P is a probability in [0, 1]"),
        ("random:0.1:0.5", "FACTOR must be >= 1"),
        ("random:nan:2", "P must be finite"),
        ("pareto", "write pareto:ALPHA or pareto:ALPHA:SCALE"),
        ("pareto:1", "ALPHA must be > 1"),
        ("pareto:0.5", "the mean slowdown is infinite"),
        ("pareto:2:-1", "SCALE must be >= 0"),
        ("pareto:inf", "ALPHA must be finite"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match="--straggler") as info:
        parse(spec)
    assert message in str(info.value)


def test_an_unknown_form_lists_the_accepted_ones() -> None:
    with pytest.raises(ConfigError) as info:
        parse("gamma:2")
    assert FORMS in str(info.value)
    for form in ("RANK:FACTOR", "random:P:FACTOR", "pareto:ALPHA[:SCALE]"):
        assert form in str(info.value)


def test_a_negative_seed_is_refused() -> None:
    with pytest.raises(ConfigError, match="seed must be >= 0"):
        parse("random:0.5:2", seed=-1)


def test_persistent_is_the_old_behaviour() -> None:
    """``RANK:FACTOR`` as before: that rank's every step FACTOR times slower, the others untouched, any seed."""
    for seed in (0, 9):
        model = parse("2:3.5", seed=seed)
        assert [model.factor(2, step) for step in range(50)] == [3.5] * 50
        assert {model.factor(rank, step) for rank in (0, 1, 3) for step in range(50)} == {1.0}


def test_persistent_rank_must_be_a_worker() -> None:
    parse("1:2").check_workers(2)
    with pytest.raises(ConfigError, match=r"RANK:FACTOR needs 0 <= RANK < 2"):
        parse("5:2").check_workers(2)
    parse("random:0.5:2").check_workers(1)  # every worker may straggle: nothing to check
    parse("pareto:2").check_workers(1)


@pytest.mark.parametrize("spec", ["random:0.3:4", "pareto:1.5:2"])
def test_same_seed_same_sequence_other_seed_or_rank_another(spec: str) -> None:
    def sequence(seed: int, rank: int) -> list[float]:
        model = parse(spec, seed=seed)
        return [model.factor(rank, step) for step in range(200)]

    assert sequence(7, 0) == sequence(7, 0)
    assert sequence(7, 0) != sequence(7, 1)  # ranks straggle independently
    assert sequence(7, 0) != sequence(8, 0)


def test_a_step_s_factor_does_not_depend_on_what_was_drawn_before() -> None:
    """Random access: a rank that skips or repeats steps (or draws them in any order) sees the same factors."""
    model = parse("pareto:2", seed=3)
    forward = [model.factor(1, step) for step in range(100)]
    backward = [model.factor(1, step) for step in reversed(range(100))]
    assert forward == backward[::-1]
    assert model.factor(1, 57) == forward[57]


def test_random_straggles_with_probability_p() -> None:
    model = parse("random:0.1:4", seed=0)
    draws = np.array([model.factor(rank, step) for rank in range(4) for step in range(2500)])
    assert set(np.unique(draws)) == {1.0, 4.0}
    assert abs(np.mean(draws == 4.0) - 0.1) < 0.01  # 10,000 Bernoulli(0.1): sd 0.003
    assert abs(draws.mean() - model.mean()) < 0.03  # mean 1 + 0.1 * 3 = 1.3
    assert parse("random:0:4").factor(0, 0) == 1.0 and parse("random:1:4").factor(0, 0) == 4.0


def test_pareto_has_the_stated_mean_and_tail() -> None:
    """ALPHA 3 (finite variance, so the sample mean settles): mean factor 1 + 1/(3-1) = 1.5, and
    ``P(factor > 1 + t) = (1 + t) ** -3`` (t = 1: 1/8)."""
    model = parse("pareto:3", seed=0)
    draws = np.array([model.factor(rank, step) for rank in range(4) for step in range(2500)])
    assert draws.min() >= 1.0
    assert model.mean() == pytest.approx(1.5)
    assert abs(draws.mean() - 1.5) < 0.03  # sd of the mean of 10,000: sqrt(3/4 / 10,000) = 0.009
    assert abs(np.mean(draws > 2.0) - 1 / 8) < 0.01
    scaled = parse("pareto:3:2", seed=0)
    assert scaled.factor(1, 5) - 1 == pytest.approx(2 * (model.factor(1, 5) - 1))  # SCALE stretches the extra
