"""BSP/SSP/ASP rules checked exhaustively against the guarantee restated as sets of applied pushes."""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Iterator

import pytest

from paratrain.errors import ConfigError
from paratrain.ps.consistency import Policy, min_done

DONE_VALUES = range(5)  # clock messages a server has received from a worker
PULL_CLOCKS = range(6)
STALENESS = range(4)


def done_tables() -> Iterator[dict[int, int]]:
    """Every ``done`` table of 1 to 3 workers with 0..4 completed clocks each (155 tables)."""
    for n in (1, 2, 3):
        for values in itertools.product(DONE_VALUES, repeat=n):
            yield dict(enumerate(values))


# The guarantee, restated without the policy's arithmetic. A push is a pair (worker, clock at which it was made).


def applied(done: dict[int, int]) -> set[tuple[int, int]]:
    """Pushes the server is known to have applied: all of w's pushes at clocks before its done[w]-th clock()."""
    return {(w, k) for w, d in done.items() for k in range(d)}


def must_see(workers: list[int], clock: int, staleness: int) -> set[tuple[int, int]]:
    """Pushes SSP(s) promises a reader at ``clock``: every worker's, at every clock k with k < clock - s."""
    return {(w, k) for w in workers for k in range(max(DONE_VALUES) + 1) if k < clock - staleness}


def test_tables_cover_the_intended_space() -> None:
    assert sum(1 for _ in done_tables()) == 5 + 25 + 125


@pytest.mark.parametrize("s", STALENESS)
def test_ssp_pull_ready_iff_every_promised_push_is_applied(s: int) -> None:
    policy = Policy.parse("ssp", s)
    for done in done_tables():
        for c in PULL_CLOCKS:
            expected = must_see(list(done), c, s) <= applied(done)
            assert policy.pull_ready(c, done) is expected, (done, c, s)


@pytest.mark.parametrize("s", STALENESS)
def test_ssp_may_run_iff_at_most_s_clocks_ahead_of_every_worker_and_its_reads_can_be_answered(s: int) -> None:
    policy = Policy.parse("ssp", s)
    for done in done_tables():
        slowest = min_done(done, done)
        for c in PULL_CLOCKS:
            ahead_of_none_by_more_than_s = all(c - d <= s for d in done.values())
            assert policy.may_run(c, slowest) is ahead_of_none_by_more_than_s, (done, c, s)
            # a worker allowed to run at clock c can read at clock c, and only then
            assert policy.may_run(c, slowest) is (must_see(list(done), c, s) <= applied(done))


@pytest.mark.parametrize("s", STALENESS)
def test_ssp_cache_fresh_iff_the_cached_copy_holds_every_promised_push(s: int) -> None:
    policy = Policy.parse("ssp", s)
    for workers in ([0], [0, 1], [0, 1, 2]):
        for cached_done in DONE_VALUES:
            # the copy was sent when every worker had completed at least cached_done clocks
            reflected = applied(dict.fromkeys(workers, cached_done))
            for c in PULL_CLOCKS:
                expected = must_see(workers, c, s) <= reflected
                assert policy.cache_fresh(cached_done, c) is expected, (workers, cached_done, c, s)


@pytest.mark.parametrize("s", STALENESS)
def test_required_done_is_the_threshold_of_pull_ready(s: int) -> None:
    policy = Policy.parse("ssp", s)
    for done in done_tables():
        for c in PULL_CLOCKS:
            required = policy.required_done(c)
            assert required is not None and required >= 0
            assert policy.pull_ready(c, done) is (min(done.values()) >= required)
            assert policy.cache_fresh(min(done.values()), c) is policy.pull_ready(c, done)


def test_more_staleness_never_makes_a_pull_wait_longer() -> None:
    for done in done_tables():
        for c in PULL_CLOCKS:
            ready = [Policy.parse("ssp", s).pull_ready(c, done) for s in STALENESS]
            assert ready == sorted(ready)  # False... then True...


def test_bsp_table() -> None:
    bsp = Policy.parse("bsp")
    # two workers; a pull at clock c needs both to have completed c clocks
    assert [bsp.pull_ready(c, {0: 2, 1: 1}) for c in range(4)] == [True, True, False, False]
    assert [bsp.may_run(c, 1) for c in range(4)] == [True, True, False, False]
    assert [bsp.cache_fresh(2, c) for c in range(4)] == [True, True, True, False]
    assert [bsp.required_done(c) for c in range(4)] == [0, 1, 2, 3]


def test_ssp2_table() -> None:
    ssp = Policy.parse("ssp", 2)
    assert [ssp.pull_ready(c, {0: 2, 1: 1, 2: 4}) for c in range(6)] == [True, True, True, True, False, False]
    assert [ssp.required_done(c) for c in range(6)] == [0, 0, 0, 1, 2, 3]


def test_ssp0_is_bsp_on_every_table() -> None:
    bsp, ssp0 = Policy.parse("bsp"), Policy.parse("ssp", 0)
    for done in done_tables():
        slowest = min(done.values())
        for c in PULL_CLOCKS:
            assert bsp.pull_ready(c, done) is ssp0.pull_ready(c, done)
            assert bsp.may_run(c, slowest) is ssp0.may_run(c, slowest)
            assert bsp.cache_fresh(slowest, c) is ssp0.cache_fresh(slowest, c)
            assert bsp.required_done(c) == ssp0.required_done(c)


def test_asp_is_always_ready_never_blocks_and_never_serves_from_cache() -> None:
    asp = Policy.parse("asp")
    for done in done_tables():
        slowest = min(done.values())
        for c in PULL_CLOCKS:
            assert asp.pull_ready(c, done)
            assert asp.may_run(c, slowest)
            assert not asp.cache_fresh(slowest, c)
            assert asp.required_done(c) is None
    assert asp.pull_ready(10**9, {0: 0})


@pytest.mark.parametrize("policy", [Policy.parse("bsp"), Policy.parse("ssp", 1), Policy.parse("asp")])
def test_no_live_workers_means_nothing_to_wait_for(policy: Policy) -> None:
    assert policy.pull_ready(5, {})
    assert policy.may_run(5, None)
    assert policy.may_run(5, min_done({}, []))


def test_min_done() -> None:
    assert min_done({0: 3, 1: 5, 2: 1}, live=[0, 1]) == 3
    assert min_done({0: 3, 1: 5, 2: 1}, live=range(3)) == 1
    assert min_done({0: 3}, live=[0, 1]) == 0  # worker 1 has not sent a clock message yet
    assert min_done({0: 3}, live=[]) is None
    assert min_done({}, live=iter([2])) == 0


def test_negative_clocks_are_refused() -> None:
    policy = Policy.parse("ssp", 1)
    with pytest.raises(ValueError, match="pull_clock"):
        policy.pull_ready(-1, {0: 0})
    with pytest.raises(ValueError, match="clock"):
        policy.may_run(-1, 0)
    with pytest.raises(ValueError, match="cached_done"):
        policy.cache_fresh(-1, 0)


# -- parsing ----------------------------------------------------------------------------------------------------


def test_parse_normal_forms() -> None:
    assert Policy.parse("bsp") == Policy(kind="bsp", staleness=0)
    assert Policy.parse("bsp", 0) == Policy(kind="bsp", staleness=0)
    assert Policy.parse(" BSP ") == Policy(kind="bsp", staleness=0)
    assert Policy.parse("ssp", 3) == Policy(kind="ssp", staleness=3)
    assert Policy.parse("SSP", 0) == Policy(kind="ssp", staleness=0)
    assert Policy.parse("asp") == Policy(kind="asp", staleness=-1)


def test_parse_unknown_kind_lists_the_choices() -> None:
    with pytest.raises(ConfigError, match="bsp, ssp, asp"):
        Policy.parse("sync")
    with pytest.raises(ConfigError, match="bsp, ssp, asp"):
        Policy.parse(None)  # type: ignore[arg-type]


def test_parse_ssp_needs_a_non_negative_staleness() -> None:
    with pytest.raises(ConfigError, match="staleness=s"):
        Policy.parse("ssp")
    with pytest.raises(ConfigError, match=">= 0"):
        Policy.parse("ssp", -1)
    with pytest.raises(ConfigError, match="int"):
        Policy.parse("ssp", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="int"):
        Policy.parse("ssp", True)


def test_parse_bsp_with_a_staleness_points_to_ssp() -> None:
    with pytest.raises(ConfigError, match="consistency='ssp'"):
        Policy.parse("bsp", 2)


def test_parse_asp_warns_that_a_staleness_is_ignored() -> None:
    with pytest.warns(UserWarning, match="ignored"):
        assert Policy.parse("asp", 3) == Policy(kind="asp", staleness=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Policy.parse("asp")


def test_constructor_is_keyword_only_validated_and_frozen() -> None:
    with pytest.raises(TypeError):
        Policy("bsp", 0)  # type: ignore[call-arg]
    for kind, staleness in [("bsp", 1), ("ssp", -1), ("asp", 0), ("ssp", True), ("bulk", 0)]:
        with pytest.raises(ConfigError):
            Policy(kind=kind, staleness=staleness)  # type: ignore[arg-type]
    policy = Policy.parse("ssp", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.staleness = 2  # type: ignore[misc]
