"""Restarting a failed child while the job goes on: the budget, the replacement's environment, warm spares,
and the rendezvous rounds a restarted job meets in."""

from __future__ import annotations

import io
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq

from paratrain.config import Settings
from paratrain.errors import RendezvousError
from paratrain.launch.failures import explain_failure
from paratrain.launch.procs import ProcSpec, Supervisor
from paratrain.launch.restarts import Restarts, spare_spec
from paratrain.transport.registry import _peer_lost_reporter
from paratrain.transport.rendezvous import RendezvousServer, meet, register

pytestmark = pytest.mark.timeout(60)

# fails on its first life, succeeds on the next; a spare first waits for its rank like paratrain.init() does
CHILD = """
import os, sys
if os.environ.get("PARATRAIN_SPARE") == "1":
    from paratrain.runtime.spare import await_assignment
    await_assignment()
count = os.environ.get("PARATRAIN_RESTART_COUNT", "0")
print(f"rank {os.environ['RANK']} life {count} kill={os.environ.get('PARATRAIN_KILL', '-')}", flush=True)
sys.exit(3 if count == "0" and os.environ["RANK"] == "1" else 0)
"""


def _spec(rank: int, **env: str) -> ProcSpec:
    base = {"RANK": str(rank), "PYTHONPATH": ":".join(sys.path), "PARATRAIN_KILL": "4:9:test"}
    return ProcSpec(f"rank {rank}", [sys.executable, "-c", CHILD], {**base, **env}, f"[rank{rank}]: ")


def test_a_replacement_counts_one_more_life_loses_the_kill_and_spends_the_budget() -> None:
    restarts = Restarts(budget=1)
    first = _spec(1)
    again = restarts.replacement(first)
    assert again is not None and restarts.left == 0
    assert again.env["PARATRAIN_RESTART_COUNT"] == "1" and "PARATRAIN_KILL" not in again.env
    assert again.name == first.name and again.kill_after is None
    assert restarts.replacement(again) is None  # spent
    spare = spare_spec(first, prefix=True)
    assert spare.spare and not spare.essential and spare.env["PARATRAIN_SPARE"] == "1" and spare.prefix == "[spare]: "
    assert Restarts(budget=3).replacement(spare) is None  # a spare is not restarted


def _run(restarts: Restarts | None, specs: list[ProcSpec]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    outcome = Supervisor(specs, grace_s=1, deadline_s=30, stdout=out, stderr=err, restarts=restarts).run()
    return outcome.exit_code, out.getvalue(), err.getvalue()


def test_a_failed_rank_is_restarted_cold_and_the_job_succeeds() -> None:
    code, out, err = _run(Restarts(budget=1), [_spec(0), _spec(1)])
    assert code == 0, err
    assert "[rank1]: rank 1 life 0 kill=4:9:test" in out and "[rank1]: rank 1 life 1 kill=-" in out
    assert "rank 1 (pid" in err and "exited with code 3; restarting it cold (no spare was ready): restart 1 of 1" in err


def test_a_warm_spare_becomes_the_failed_rank_and_unused_spares_exit_quietly() -> None:
    restarts = Restarts(budget=2, spare=spare_spec(_spec(0), prefix=True))
    code, out, err = _run(restarts, [_spec(0), _spec(1), restarts.spare])  # type: ignore[list-item]
    assert code == 0, err
    assert "restarting it from the warm spare (pid" in err and "restart 1 of 2" in err
    # the spare's output carries the rank's prefix once it is that rank
    assert "[rank1]: rank 1 life 1 kill=-" in out and "[spare]" not in out
    assert restarts.used == 1


def test_without_budget_the_failure_stops_the_job_as_before() -> None:
    code, _, err = _run(Restarts(budget=0), [_spec(0), _spec(1)])
    assert code == 1 and "restarting" not in err and "exited with code 3" in err


def test_the_rendezvous_serves_rounds_and_a_newer_registration_replaces_an_older_one() -> None:
    server = RendezvousServer(world_size=2, bind_addr="127.0.0.1", port=0, timeout=20, rounds=True)
    server.start()
    try:
        tables: dict[str, list[dict[str, object]]] = {}

        def join(name: str, rank: int) -> None:
            tables[name] = register("127.0.0.1", server.port, rank=rank, world_size=2, info={"who": name}, timeout=20)

        for round_number, names in ((1, ("a0", "a1")), (2, ("b0", "b1"))):
            threads = [threading.Thread(target=join, args=(n, r)) for r, n in enumerate(names)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(25)
            assert server.round == round_number
            assert tables[names[0]] == tables[names[1]] == [{"who": names[0]}, {"who": names[1]}]
        # a rank registers and "dies" (nobody reads the answer); its replacement registers again and takes part
        ctx = zmq.Context()
        stale = ctx.socket(zmq.DEALER)
        stale.setsockopt(zmq.LINGER, 0)
        stale.connect(f"tcp://127.0.0.1:{server.port}")
        request = {"v": 1, "rank": 1, "world_size": 2, "info": {"who": "stale"}}
        stale.send_multipart([b"", msgpack.packb(request)])
        _await(lambda: server.waiting == {1})
        newer = threading.Thread(target=join, args=("c1", 1))
        newer.start()
        _await(lambda: server.accepted == 6)  # 4 in the first two rounds, the stale one, the newer one
        other = threading.Thread(target=join, args=("c0", 0))
        other.start()
        for t in (newer, other):
            t.join(25)
        assert server.round == 3 and tables["c0"] == tables["c1"] == [{"who": "c0"}, {"who": "c1"}]
        stale.close()
        ctx.term()
    finally:
        server.close()


def test_meet_gives_the_round_and_a_fixed_size_job_with_a_finished_member_is_over() -> None:
    """A restarted worker learns which round it met in (round 1: the job's first meeting, so it starts afresh
    rather than catch up); once a member of a fixed-size job finished, the job can never meet again, so a rank
    registering then (restarted after the others' last collective) is told at once, not after its timeout."""
    server = RendezvousServer(world_size=2, bind_addr="127.0.0.1", port=0, timeout=20, rounds=True)
    server.start()
    try:
        rounds: dict[int, int] = {}

        def join(rank: int) -> None:
            rounds[rank] = meet("127.0.0.1", server.port, rank=rank, world_size=2, info={}, timeout=20)[1]

        for expected in (1, 2):
            threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(25)
            assert rounds == {0: expected, 1: expected}
        # rank 1 registers for a third round; rank 0 finishes instead: rank 1 is told the job is over
        errors: list[BaseException] = []

        def rejoin() -> None:
            try:
                meet("127.0.0.1", server.port, rank=1, world_size=2, info={}, timeout=20)
            except RendezvousError as exc:
                errors.append(exc)

        waiting = threading.Thread(target=rejoin)
        waiting.start()
        _await(lambda: server.waiting == {1})
        server.finish(0)
        waiting.join(25)
        assert len(errors) == 1 and "the job is over" in str(errors[0])
        with pytest.raises(RendezvousError, match="the job is over"):  # and so is a later registration
            meet("127.0.0.1", server.port, rank=1, world_size=2, info={}, timeout=20)
        assert server.round == 2
    finally:
        server.close()


def _await(condition: Callable[[], bool]) -> None:
    """Polls the server's state (not a guess at timing) until ``condition`` holds."""
    deadline = time.monotonic() + 20
    while not condition() and time.monotonic() < deadline:
        threading.Event().wait(0.005)
    assert condition()


def test_a_restarted_rank_starts_its_own_record_of_lost_peers(tmp_path: Path) -> None:
    """The launcher names the peer whose loss made a rank fail (``explain_failure``) from what the rank recorded;
    a restarted process must not inherit its predecessor's record (the predecessor saw a peer finish, say: the
    replacement's own failure would be blamed on it)."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "PARATRAIN_SCRATCH_DIR": str(tmp_path)}
    first = _peer_lost_reporter(Settings.from_env(env))
    assert first is not None
    first(1, "has shut down")
    assert explain_failure("rank 0", str(tmp_path)) is not None  # rank 0's first life lost rank 1
    restarted = _peer_lost_reporter(Settings.from_env({**env, "PARATRAIN_RESTART_COUNT": "1"}))
    assert restarted is not None
    assert explain_failure("rank 0", str(tmp_path)) is None
    restarted(1, "closed its connection without saying goodbye")
    assert explain_failure("rank 0", str(tmp_path)) is not None  # its own losses still count
