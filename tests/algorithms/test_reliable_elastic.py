"""Reliable collectives in an elastic job, in-process: a member dies and the two others re-form as a job of 2
(RegroupedError makes them recompute the interrupted step for the new size); then the dead member's replacement
joins at a checkpoint and the job is 3 again. Every step sums one vector per launched worker, whoever holds it, so
every rank's final state must equal the exact sum; no survivor rolls back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from paratrain.config import Settings
from paratrain.launch.restarts import JOIN_FILE
from paratrain.recovery import RegroupedError, Reliable
from paratrain.runtime.context import Context
from paratrain.transport.inproc import InprocFabric

pytestmark = pytest.mark.timeout(60)

SHARDS, STEPS, EVERY = 3, 16, 4
ROUNDS: dict[int, int] = {}  # fabric id -> the rendezvous round it stands for


def _ctx(fabric: InprocFabric, member: int, members: list[int], scratch: Path, *, joiner: bool = False) -> Context:
    """Member ``member``'s context in the job of ``members`` (its rank: its index there)."""
    rank = members.index(member)
    settings = Settings(
        rank=rank,
        world_size=len(members),
        transport="inproc",
        min_workers=2,
        member=member,
        launched_workers=SHARDS,
        restart_count=1 if joiner else 0,
        scratch_dir=str(scratch),
    )
    transport = fabric.transport(rank)
    transport.round = ROUNDS[id(fabric)]
    return Context(settings=settings, transport=transport)


def _value(step: int, shard: int) -> np.ndarray:
    return np.array([step + 1, shard + 1, (7 * step + 3 * shard) % 11], dtype=np.float64)


def _run(rel: Reliable, *, die_at: int | None = None, log: list[int] | None = None) -> tuple[np.ndarray, int]:
    """Sums every shard's value per step; returns the state and how many times a step was recomputed."""
    ckpt = rel.load_checkpoint()
    state = ckpt.arrays["state"].copy() if ckpt is not None else np.zeros(3)
    regroups = 0
    for step in range(int(ckpt.meta["step"]) if ckpt is not None else 0, STEPS):
        if step == die_at:
            rel.ctx.abort()  # a crash, as the transport sees it
            return state, regroups
        while True:
            rank, world = rel.ctx.rank, rel.ctx.world_size
            mine = sum((_value(step, v) for v in range(rank, SHARDS, world)), np.zeros(3))
            try:
                state = state + rel.allreduce(mine)
                break
            except RegroupedError:
                regroups += 1
        if log is not None:
            log.append(step)
        if (step + 1) % EVERY == 0:
            rel.checkpoint({"state": state}, {"step": step + 1})
    return state, regroups


def _reformer(
    member: int,
    rounds: list[tuple[InprocFabric, list[int]]],
    scratch: Path,
    on_shrink: Callable[[], None] = lambda: None,
) -> Callable[[Context], Context]:
    """What member ``member``'s recoveries meet in: the next of ``rounds`` (a fabric and its members) each time."""
    left = iter(rounds)

    def reform(old: Context) -> Context:
        old.abort()
        fabric, members = next(left)
        if len(members) < SHARDS:
            on_shrink()
        return _ctx(fabric, member, members, scratch)

    return reform


def _run_threads(
    jobs: list[tuple[str, Callable[[], tuple[np.ndarray, int]]]], fabrics: list[InprocFabric]
) -> dict[str, tuple[np.ndarray, int]]:
    """Runs each job on a thread; the first error wakes every fabric and is raised."""
    results: dict[str, tuple[np.ndarray, int]] = {}
    errors: list[BaseException] = []

    def guarded(name: str, fn: Callable[[], tuple[np.ndarray, int]]) -> None:
        try:
            results[name] = fn()
        except BaseException as exc:  # reported below
            errors.append(exc)
            for fabric in fabrics:
                fabric.fail_all(exc)

    threads = [threading.Thread(target=guarded, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors
    return results


def test_an_elastic_job_shrinks_recomputes_the_step_and_takes_a_joiner_back(tmp_path: Path) -> None:
    first, shrunk, whole = InprocFabric(3, timeout=30), InprocFabric(2, timeout=30), InprocFabric(3, timeout=30)
    ROUNDS.update({id(first): 1, id(shrunk): 2, id(whole): 3})
    died = threading.Event()
    logs: dict[int, list[int]] = {0: [], 2: []}

    def announce_joiner() -> None:  # the launcher started a replacement; it waits to join
        (tmp_path / JOIN_FILE).write_text("3\n")

    def survivor(member: int) -> Callable[[], tuple[np.ndarray, int]]:
        rounds = [(shrunk, [0, 2]), (whole, [0, 1, 2])]
        reform = _reformer(member, rounds, tmp_path, announce_joiner)
        return lambda: _run(Reliable(_ctx(first, member, [0, 1, 2], tmp_path), reform=reform), log=logs[member])

    def doomed() -> tuple[np.ndarray, int]:
        try:
            return _run(Reliable(_ctx(first, 1, [0, 1, 2], tmp_path)), die_at=6)
        finally:
            died.set()

    def joiner() -> tuple[np.ndarray, int]:
        died.wait(30)
        rel = Reliable(_ctx(whole, 1, [0, 1, 2], tmp_path, joiner=True))  # admitted at the survivors' checkpoint
        (joined,) = rel.recoveries
        assert joined.restarted and joined.members == (0, 1, 2) and joined.replayed == 0
        return _run(rel)

    jobs = [("m0", survivor(0)), ("m2", survivor(2)), ("doomed", doomed), ("joiner", joiner)]
    results = _run_threads(jobs, [first, shrunk, whole])
    exact = sum((_value(t, v) for t in range(STEPS) for v in range(SHARDS)), np.zeros(3))
    for name in ("m0", "m2", "joiner"):
        assert results[name][0].tobytes() == exact.tobytes(), name
    assert results["m0"][1] == results["m2"][1] == 1  # step 6 recomputed once, for 2 workers
    assert logs[0] == logs[2] == list(range(STEPS))  # every step once, in order: no rollback


def test_a_joiner_waiting_when_another_member_dies_is_admitted_by_that_recovery_and_replays(tmp_path: Path) -> None:
    """Member 1 dies (the job shrinks to 0 and 2); its replacement is still waiting when member 2 dies between
    checkpoints: the recovery that follows admits the replacement, which loads the last checkpoint and replays the
    results since it, while member 0 recomputes the interrupted step for the job of 0 and 1."""
    first, shrunk, mixed = InprocFabric(3, timeout=30), InprocFabric(2, timeout=30), InprocFabric(2, timeout=30)
    ROUNDS.update({id(first): 1, id(shrunk): 2, id(mixed): 3})
    second_death = threading.Event()
    log0: list[int] = []

    def member0() -> tuple[np.ndarray, int]:
        rel = Reliable(
            _ctx(first, 0, [0, 1, 2], tmp_path), reform=_reformer(0, [(shrunk, [0, 2]), (mixed, [0, 1])], tmp_path)
        )
        return _run(rel, log=log0)

    def member1() -> tuple[np.ndarray, int]:
        return _run(Reliable(_ctx(first, 1, [0, 1, 2], tmp_path)), die_at=6)

    def member2() -> tuple[np.ndarray, int]:
        try:
            rel = Reliable(_ctx(first, 2, [0, 1, 2], tmp_path), reform=_reformer(2, [(shrunk, [0, 2])], tmp_path))
            return _run(rel, die_at=10)
        finally:
            second_death.set()

    def joiner() -> tuple[np.ndarray, int]:
        second_death.wait(30)
        rel = Reliable(_ctx(mixed, 1, [0, 1], tmp_path, joiner=True))
        (joined,) = rel.recoveries
        assert joined.restarted and joined.members == (0, 1) and joined.replayed > 0
        return _run(rel)

    jobs = [("m0", member0), ("m1", member1), ("m2", member2), ("joiner", joiner)]
    results = _run_threads(jobs, [first, shrunk, mixed])
    exact = sum((_value(t, v) for t in range(STEPS) for v in range(SHARDS)), np.zeros(3))
    assert results["m0"][0].tobytes() == results["joiner"][0].tobytes() == exact.tobytes()
    assert results["m0"][1] == 2  # step 6 recomputed for 0 and 2, step 10 for 0 and 1
    assert log0 == list(range(STEPS))
