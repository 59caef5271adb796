"""Elastic membership: the rendezvous that drops and admits members, the launcher's policy of shrinking rather
than waiting, and each worker's share of a step's examples whatever the job's size."""

from __future__ import annotations

import io
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from paratrain.errors import PeerLostError
from paratrain.launch.procs import ProcSpec, Supervisor
from paratrain.launch.restarts import Membership, Restarts, spare_spec
from paratrain.train.shards import step_share
from paratrain.transport.rendezvous import Admission, RendezvousServer, admit

pytestmark = pytest.mark.timeout(60)


# -- each worker's share of a step ------------------------------------------------------------------------


def test_a_step_covers_the_same_examples_at_every_size_and_the_scales_make_the_mean() -> None:
    order = np.random.default_rng(7).permutation(1000)
    shards, batch = 4, 16
    per_shard = len(order) // shards
    for step in (0, 3, per_shard // batch - 1):
        whole = np.sort(np.concatenate([order[v * per_shard + step * batch :][:batch] for v in range(shards)]))
        for world in range(1, shards + 1):
            shares = [step_share(order, shards=4, batch=16, step=step, world_size=world, rank=r) for r in range(world)]
            assert np.array_equal(np.sort(np.concatenate([s.indices for s in shares])), whole)
            assert sorted(v for s in shares for v in s.shards) == list(range(shards))
            # mean over ranks of (scale x mean over the rank's examples) = mean over the global batch
            values = np.arange(1000, dtype=np.float64) ** 1.5
            got = np.mean([s.scale * values[s.indices].mean() for s in shares])
            assert got == pytest.approx(values[whole].mean(), rel=1e-12)


def test_at_the_launched_size_a_worker_has_its_own_shard_and_scale_exactly_one() -> None:
    order = np.random.default_rng(1).permutation(300)
    for rank in range(3):
        share = step_share(order, shards=3, batch=10, step=2, world_size=3, rank=rank)
        assert share.shards == (rank,) and share.scale == 1.0
        assert np.array_equal(share.indices, np.sort(order[rank * 100 + 20 : rank * 100 + 30]))
    # shrunk to 2 of 3: worker 0 takes shards 0 and 2, worker 1 shard 1; the scales are 4/3 and 2/3
    shares = [step_share(order, shards=3, batch=10, step=2, world_size=2, rank=r) for r in range(2)]
    assert [s.shards for s in shares] == [(0, 2), (1,)]
    assert [s.scale for s in shares] == [pytest.approx(4 / 3), pytest.approx(2 / 3)]


@pytest.mark.parametrize(("world", "rank", "step"), [(4, 0, 0), (2, 2, 0), (2, 0, 10)])
def test_a_share_outside_the_job_or_the_epoch_is_refused(world: int, rank: int, step: int) -> None:
    with pytest.raises(ValueError):
        step_share(np.arange(300), shards=3, batch=10, step=step, world_size=world, rank=rank)


# -- the rendezvous -----------------------------------------------------------------------------------------


class _Members:
    """Runs admit() calls on threads and keeps what each got."""

    def __init__(self, server: RendezvousServer) -> None:
        self.server = server
        self.got: dict[str, Admission | None] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, member: int) -> None:
        def run() -> None:
            self.got[name] = admit(
                "127.0.0.1", self.server.port, member=member, world_size=3, info={"who": name}, timeout=20
            )

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(25)
        self.threads = []


def _await(condition: Callable[[], bool]) -> None:
    """Polls the server's state (not a guess at timing) until ``condition`` holds."""
    deadline = time.monotonic() + 20
    while not condition() and time.monotonic() < deadline:
        threading.Event().wait(0.005)
    assert condition()


def test_an_elastic_rendezvous_drops_a_member_renumbers_and_admits_a_joiner_at_the_next_round() -> None:
    joins: list[int] = []
    server = RendezvousServer(
        world_size=3, bind_addr="127.0.0.1", port=0, timeout=20, rounds=True, elastic=True, on_joiner=joins.append
    )
    server.start()
    try:
        m = _Members(server)
        for member in range(3):
            m.start(f"a{member}", member)
        m.join()
        assert server.round == 1 and [m.got[f"a{r}"].rank for r in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
        # member 1 dies for good: 0 and 2 meet without it as ranks 0 and 1 of 2 (the removal completes the round)
        m.start("b0", 0)
        m.start("b2", 2)
        _await(lambda: server.waiting == {0, 2})
        assert server.remove(1) and not server.remove(1)
        m.join()
        b0, b2 = m.got["b0"], m.got["b2"]
        assert b0 is not None and b2 is not None
        assert (b0.rank, b2.rank, b0.members, b0.round) == (0, 1, [0, 2], 2)
        assert b0.table == [{"who": "b0"}, {"who": "b2"}] and server.members == [0, 2]
        # its replacement registers as member 1: it waits (no round forms for a joiner alone) and is announced
        m.start("c1", 1)
        _await(lambda: joins == [3])
        assert server.round == 2
        m.start("c0", 0)
        m.start("c2", 2)
        m.join()
        got = [m.got[n] for n in ("c0", "c1", "c2")]
        assert [g.rank for g in got if g is not None] == [0, 1, 2] and server.members == [0, 1, 2]
        assert got[1] is not None and got[1].round == 3 and got[1].members == [0, 1, 2]
    finally:
        server.close()


def test_a_joiner_of_a_job_whose_members_all_finished_is_told_so() -> None:
    server = RendezvousServer(world_size=3, bind_addr="127.0.0.1", port=0, timeout=20, rounds=True, elastic=True)
    server.start()
    try:
        server.remove(2)
        m = _Members(server)
        m.start("late", 2)
        _await(lambda: server.waiting == {2})
        server.finish(0)
        assert not server.over
        server.finish(1)
        m.join()
        assert server.over and m.got == {"late": None}
        m.start("later", 2)  # and one that comes after the end
        m.join()
        assert m.got["later"] is None
    finally:
        server.close()


def test_a_fixed_size_rank_is_refused_by_an_elastic_rendezvous() -> None:
    from paratrain.errors import RendezvousError
    from paratrain.transport.rendezvous import register

    server = RendezvousServer(world_size=2, bind_addr="127.0.0.1", port=0, timeout=20, rounds=True, elastic=True)
    server.start()
    try:
        with pytest.raises(RendezvousError, match="elastic"):
            register("127.0.0.1", server.port, rank=0, world_size=2, info={}, timeout=10)
    finally:
        server.close()


def test_a_member_not_yet_renumbered_accepts_the_grown_jobs_ranks_and_none_beyond() -> None:
    """A job of 2 grows to 3: the new rank 2 may connect before member 0 has read its own admission (still rank 0
    of 2). Its listener must take rank 2's credentials then (refused, rank 2 would declare it lost: the job
    re-forms without the joiner), and after renumber() only the ranks of the job it now has."""
    from paratrain.transport.auth import new_secret
    from paratrain.transport.zmq import ZmqTransport

    secret = new_secret()
    early = ZmqTransport(rank=0, world_size=2, host_id="a", run_id="test", timeout=20, secret=secret, rank_bound=3)
    others = [ZmqTransport(rank=r, world_size=3, host_id="a", run_id="test", timeout=20, secret=secret) for r in (1, 2)]
    beyond = ZmqTransport(rank=3, world_size=4, host_id="a", run_id="test", timeout=20, secret=secret)
    try:
        table = [t.endpoints() for t in (early, *others)]
        for t in others:
            t.connect(table)
        others[1].wait_linked(10)  # rank 2's handshake with member 0 completed before member 0's renumber()
        early.renumber(0, 3)
        early.connect(table)
        early.wait_linked(10)
        others[1].send(0, 4, [np.arange(3.0)])
        assert early.recv(2, 4).arrays[0].tolist() == [0.0, 1.0, 2.0]
        assert not any(t.lost_peers() for t in (early, *others))
        # rank 3 is beyond the job of 3: refused, and the refusal counted
        beyond.connect([*table, beyond.endpoints()])
        with pytest.raises(PeerLostError, match="refused this rank's connection"):
            beyond.recv(0, 9, timeout=10)
    finally:
        for t in (early, *others, beyond):
            t.close()


# -- the launcher's policy -----------------------------------------------------------------------------------


class _Rendezvous:
    def __init__(self, members: list[int]) -> None:
        self.members = members
        self.done: list[int] = []

    def remove(self, member: int) -> bool:
        if member not in self.members:
            return False
        self.members.remove(member)
        return True

    def finish(self, member: int) -> None:
        self.done.append(member)


CHILD = """
import os, sys
print(f"member {os.environ['RANK']} life {os.environ.get('PARATRAIN_RESTART_COUNT', '0')}", flush=True)
sys.exit(3 if os.environ["RANK"] == "1" and os.environ.get("PARATRAIN_RESTART_COUNT", "0") == "0" else 0)
"""


def _spec(rank: int) -> ProcSpec:
    env = {"RANK": str(rank), "PYTHONPATH": ":".join(sys.path)}
    return ProcSpec(f"rank {rank}", [sys.executable, "-c", CHILD], env, f"[rank{rank}]: ")


def test_the_policy_shrinks_only_without_a_ready_spare_and_above_the_floor() -> None:
    rdzv = _Rendezvous([0, 1, 2])
    restarts = Restarts(1, spare_spec(_spec(0), prefix=False), membership=Membership(2, rdzv))
    assert restarts.shrink(_spec(1), spare_ready=True) is None  # a warm spare replaces in place
    assert rdzv.members == [0, 1, 2]
    assert restarts.shrink(_spec(1), spare_ready=False) == 2 and rdzv.members == [0, 2]
    assert restarts.shrink(_spec(2), spare_ready=False) is None  # one would be left, below --min-workers 2
    assert Restarts(1).shrink(_spec(1), spare_ready=False) is None  # not elastic: wait for the restart


@pytest.mark.parametrize("budget", [0, 1])
def test_an_elastic_job_goes_on_without_a_failed_worker_and_a_cold_replacement_starts(budget: int) -> None:
    rdzv = _Rendezvous([0, 1, 2])
    restarts = Restarts(budget, membership=Membership(2, rdzv))
    out, err = io.StringIO(), io.StringIO()
    outcome = Supervisor(
        [_spec(0), _spec(1), _spec(2)], grace_s=1, deadline_s=30, stdout=out, stderr=err, restarts=restarts
    ).run()
    assert outcome.exit_code == 0, err.getvalue()
    assert rdzv.members == [0, 2] and "the job goes on with 2 workers" in err.getvalue()
    assert ("member 1 life 1" in out.getvalue()) == (budget == 1)
    assert sorted(rdzv.done) == ([0, 1, 2] if budget else [0, 2])  # the replacement's clean exit is told too


def test_the_run_reports_the_lowest_member_that_finished() -> None:
    from paratrain.train.record import reporting_rank

    finals = [{"kind": "final", "rank": r} for r in (2, 1)]
    assert reporting_rank([{"kind": "eval", "rank": 0}, *finals]) == 1  # member 0 died and the job went on
    assert reporting_rank([{"kind": "start", "rank": 3, "reports": True}, *finals]) == 3  # a pipeline's last stage
    assert reporting_rank([]) == 0


# rank 1 fails on its first life once the spare (if the test gives one a scratch directory) says it is warm
WAITING_CHILD = """
import glob, os, sys, time
if os.environ.get("PARATRAIN_SPARE") == "1":
    from paratrain.runtime.spare import await_assignment
    await_assignment()
life = os.environ.get("PARATRAIN_RESTART_COUNT", "0")
print(f"member {os.environ['RANK']} life {life}", flush=True)
scratch = os.environ.get("PARATRAIN_SCRATCH_DIR")
if os.environ["RANK"] == "1" and life == "0":
    deadline = time.monotonic() + 20
    while scratch and not glob.glob(os.path.join(scratch, "spare-warm.*")) and time.monotonic() < deadline:
        time.sleep(0.01)  # polls for the spare's mark (an event, not a guess at timing)
    sys.exit(3)
"""


@pytest.mark.parametrize("warm", [False, True])
def test_an_elastic_job_uses_a_spare_only_once_it_is_warm(tmp_path: Path, warm: bool) -> None:
    env = {"PYTHONPATH": ":".join(sys.path), **({"PARATRAIN_SCRATCH_DIR": str(tmp_path)} if warm else {})}
    specs = [
        ProcSpec(f"rank {r}", [sys.executable, "-c", WAITING_CHILD], {"RANK": str(r), **env}, f"[rank{r}]: ")
        for r in range(3)
    ]
    rdzv = _Rendezvous([0, 1, 2])
    restarts = Restarts(1, spare_spec(specs[0], prefix=True), membership=Membership(2, rdzv))
    out, err = io.StringIO(), io.StringIO()
    outcome = Supervisor(
        [*specs, restarts.spare],  # type: ignore[list-item]
        grace_s=1,
        deadline_s=30,
        stdout=out,
        stderr=err,
        restarts=restarts,
    ).run()
    assert outcome.exit_code == 0, err.getvalue()
    if warm:  # replaced in place: the job never shrank
        assert "restarting it from the warm spare" in err.getvalue() and rdzv.members == [0, 1, 2]
    else:  # a spare that has not said it is warm is not waited for: the job goes on without member 1
        assert "the job goes on with 2 workers" in err.getvalue() and rdzv.members == [0, 2]
    assert "member 1 life 1" in out.getvalue()


def test_a_member_removed_after_registering_is_not_admitted_with_its_dead_registration() -> None:
    import msgpack
    import zmq

    server = RendezvousServer(world_size=3, bind_addr="127.0.0.1", port=0, timeout=20, rounds=True, elastic=True)
    server.start()
    ctx = zmq.Context()
    dead = ctx.socket(zmq.DEALER)  # member 1 registers, then its process dies (nobody reads the answer)
    dead.setsockopt(zmq.LINGER, 0)
    try:
        dead.connect(f"tcp://127.0.0.1:{server.port}")
        request = {"v": 1, "rank": 1, "world_size": 3, "info": {"who": "dead"}, "elastic": True}
        dead.send_multipart([b"", msgpack.packb(request)])
        _await(lambda: server.waiting == {1})
        assert server.remove(1)
        _await(lambda: server.waiting == frozenset())
        m = _Members(server)
        m.start("b0", 0)
        m.start("b2", 2)
        m.join()
        b0 = m.got["b0"]
        assert b0 is not None and b0.members == [0, 2] and b0.table == [{"who": "b0"}, {"who": "b2"}]
        assert server.members == [0, 2]
    finally:
        dead.close()
        ctx.term()
        server.close()
