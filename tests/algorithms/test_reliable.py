"""Reliable collectives in-process: a rank "crashes" mid-run, its replacement joins a re-formed fabric, and the
final states equal the fault-free run's bit for bit; the survivor never rolls back. Also the refusals."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

import paratrain as pt
from paratrain.errors import PeerLostError
from paratrain.recovery import RecoveryError, Reliable
from paratrain.runtime.context import Context
from paratrain.testing import run_ranks
from paratrain.transport.inproc import InprocFabric

pytestmark = pytest.mark.timeout(60)

STEPS = 12
EVERY = 4


def _ctx(fabric: InprocFabric, rank: int, *, restarted: bool = False) -> Context:
    env = {"PARATRAIN_MAX_RESTARTS": "1", "PARATRAIN_RESTART_COUNT": "1" if restarted else "0"}
    return pt.init(transport="inproc", fabric=fabric, rank=rank, world_size=2, env=env, make_current=False)


def _gradient(step: int, rank: int) -> np.ndarray:
    return np.random.default_rng([step, rank]).standard_normal(1000)


def _train(rel: Reliable, rank: int, *, die_at: int | None = None, log: list[int] | None = None) -> np.ndarray:
    """SGD with momentum on a fixed gradient stream, checkpointing every EVERY steps; returns the weights."""
    ckpt = rel.load_checkpoint()
    if ckpt is None:
        w = rel.broadcast(np.full(1000, float(rank)), root=0)  # rank 0's start wins
        v = np.zeros(1000)
        start = 0
    else:
        w, v, start = ckpt.arrays["w"].copy(), ckpt.arrays["v"].copy(), int(ckpt.meta["step"])
    for step in range(start, STEPS):
        if step == die_at:
            rel.ctx.abort()  # a crash, as the transport sees it
            return w
        g = rel.allreduce(_gradient(step, rank), op="mean")
        v = 0.9 * v + g
        w = w - 0.1 * v
        if log is not None:
            log.append(step)
        if (step + 1) % EVERY == 0:
            rel.checkpoint({"w": w, "v": v}, {"step": step + 1})
    return w


def _fault_free() -> list[np.ndarray]:
    return run_ranks(2, lambda ctx: _train(Reliable(ctx), ctx.rank))


@pytest.mark.parametrize("die_at", [0, 2, 4, 5, 11])
def test_a_replacement_replays_from_the_survivor_and_ends_bitwise_equal(die_at: int) -> None:
    expected = _fault_free()
    first, second = InprocFabric(2, timeout=30), InprocFabric(2, timeout=30)
    died = threading.Event()
    results: dict[str, np.ndarray] = {}
    survivor_steps: list[int] = []
    errors: list[BaseException] = []

    def reform(old: Context) -> Context:
        old.abort()
        return _ctx(second, 0)

    def guarded(name: str, fn: Callable[[], np.ndarray]) -> None:
        try:
            results[name] = fn()
        except BaseException as exc:  # reported below
            errors.append(exc)
            first.fail_all(exc)
            second.fail_all(exc)

    def survivor() -> np.ndarray:
        return _train(Reliable(_ctx(first, 0), reform=reform), 0, log=survivor_steps)

    def doomed() -> np.ndarray:
        try:
            return _train(Reliable(_ctx(first, 1)), 1, die_at=die_at)
        finally:
            died.set()

    def replacement() -> np.ndarray:
        died.wait(30)
        rel = Reliable(_ctx(second, 1, restarted=True))  # joins the survivor's recovery here
        (joined,) = rel.recoveries
        assert joined.restarted and joined.frontier == 1 + die_at
        return _train(rel, 1)

    threads = [
        threading.Thread(target=guarded, args=(name, fn))
        for name, fn in (("survivor", survivor), ("doomed", doomed), ("replacement", replacement))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors
    assert survivor_steps == list(range(STEPS))  # every step once, in order: no rollback
    assert results["survivor"].tobytes() == expected[0].tobytes()
    assert results["replacement"].tobytes() == expected[1].tobytes() == expected[0].tobytes()


def test_a_replacement_that_dies_during_the_recovery_is_replaced_again() -> None:
    """The survivor re-forms, the first replacement crashes before the exchange completes, the survivor re-forms
    once more with a second replacement: still bitwise the fault-free result, still no rollback."""
    expected = _fault_free()
    fabrics = [InprocFabric(2, timeout=30) for _ in range(3)]
    rounds = iter(fabrics[1:])
    died = [threading.Event(), threading.Event()]
    results: dict[str, np.ndarray] = {}
    survivor_steps: list[int] = []
    errors: list[BaseException] = []

    def reform(old: Context) -> Context:
        old.abort()
        return _ctx(next(rounds), 0)

    def run(name: str, fn: Callable[[], np.ndarray | None]) -> None:
        try:
            out = fn()
            if out is not None:
                results[name] = out
        except BaseException as exc:  # reported below
            errors.append(exc)
            for fabric in fabrics:
                fabric.fail_all(exc)

    def survivor() -> np.ndarray:
        return _train(Reliable(_ctx(fabrics[0], 0), reform=reform), 0, log=survivor_steps)

    def doomed() -> None:
        try:
            _train(Reliable(_ctx(fabrics[0], 1)), 1, die_at=5)
        finally:
            died[0].set()

    def first_replacement() -> None:
        died[0].wait(30)
        try:
            _ctx(fabrics[1], 1, restarted=True).abort()  # it joins the round, then crashes before catching up
        finally:
            died[1].set()

    def second_replacement() -> np.ndarray:
        died[1].wait(30)
        return _train(Reliable(_ctx(fabrics[2], 1, restarted=True)), 1)

    threads = [
        threading.Thread(target=run, args=(name, fn))
        for name, fn in (
            ("survivor", survivor),
            ("doomed", doomed),
            ("first", first_replacement),
            ("replacement", second_replacement),
        )
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors
    assert survivor_steps == list(range(STEPS))
    assert results["survivor"].tobytes() == results["replacement"].tobytes() == expected[0].tobytes()


def test_without_restarts_a_lost_peer_is_raised_as_before() -> None:
    fabric = InprocFabric(2, timeout=10)

    def rank(r: int) -> None:
        ctx = pt.init(transport="inproc", fabric=fabric, rank=r, world_size=2, make_current=False)
        rel = Reliable(ctx)
        assert not rel.resilient
        if r == 1:
            ctx.abort()
            return
        with pytest.raises(PeerLostError):
            rel.allreduce(np.ones(3))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)


def test_the_cache_keeps_results_from_one_before_the_checkpoint_and_replays_check_their_shape() -> None:
    def fn(ctx: Context) -> None:
        rel = Reliable(ctx)
        for _ in range(5):
            rel.allreduce(np.ones(4))
        rel.checkpoint({"x": np.zeros(2)}, {"step": 5})
        assert sorted(rel._cache) == [4] and rel.seq == 5
        rel._replay[5] = ("allreduce", np.zeros(3))  # a recorded result of another shape
        with pytest.raises(RecoveryError, match="same reliable calls in the same order"):
            rel.allreduce(np.ones(4))

    run_ranks(1, fn)


def test_a_restarted_rank_in_the_jobs_first_meeting_starts_afresh_with_the_others() -> None:
    """A rank that died before the job first met is replaced in that same meeting (round 1): nobody holds state
    to catch up from, so its Reliable starts afresh, as the others' do, instead of asking for a recovery they are
    not in (before: its recovery's allgather met rank 0's first broadcast, a CollectiveMismatchError on both)."""
    expected = _fault_free()
    fabric = InprocFabric(2, timeout=30)
    results: dict[int, tuple[np.ndarray, int, bool]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            ctx = _ctx(fabric, r, restarted=r == 1)
            ctx.transport.round = 1  # what paratrain launch's rendezvous answers in the job's first meeting
            rel = Reliable(ctx)
            results[r] = (_train(rel, r), len(rel.recoveries), rel.load_checkpoint() is None)
        except BaseException as exc:  # reported below
            errors.append(exc)
            fabric.fail_all(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors
    for r in range(2):
        w, recoveries, fresh = results[r]
        assert w.tobytes() == expected[r].tobytes()
        assert recoveries == 0 and fresh
