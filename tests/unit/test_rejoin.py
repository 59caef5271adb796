"""A lost rank rejoining as a new process: the rendezvous answers a restarted rank at once with the job's table,
the transport takes the newcomer back (``hello``) and counts its incarnation, and the launcher restarts dead
parameter servers only when they have replicas to catch up from."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from paratrain.errors import PeerLostError, RendezvousError
from paratrain.launch.plan import LaunchPlan
from paratrain.launch.run import _proc_specs
from paratrain.transport.auth import new_secret
from paratrain.transport.inproc import InprocFabric
from paratrain.transport.rendezvous import RendezvousServer, register, rejoin
from paratrain.transport.wire import encode
from paratrain.transport.zmq import TAG_CONTROL, ZmqTransport

pytestmark = pytest.mark.timeout(60)


def _zmq(rank: int, world: int, secret: bytes) -> ZmqTransport:
    return ZmqTransport(rank=rank, world_size=world, host_id="local", timeout=10, run_id="rejoin", secret=secret)


def _until(condition: Callable[[], bool]) -> None:
    """Waits (up to 10 s) for something another thread does, e.g. the receiver thread taking a peer back."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        threading.Event().wait(0.01)


def _await_lost(t: ZmqTransport, peer: int) -> None:
    handle = t.irecv(peer, 5)  # fails once the peer is declared lost
    with pytest.raises(PeerLostError):
        handle.wait(10)


def test_a_restarted_rank_is_taken_back_and_talks_to_everyone_again() -> None:
    secret = new_secret()
    ts = [_zmq(r, 3, secret) for r in range(3)]
    table = [t.endpoints() for t in ts]
    for t in ts:
        t.connect(table)
    try:
        ts[0].send(2, 1, [np.arange(3)])
        assert ts[2].recv(0, 1).arrays[0].tolist() == [0, 1, 2]
        ts[2].abort()  # killed
        for t in ts[:2]:
            _await_lost(t, 2)
            assert 2 in t.lost_peers()
        ts[2] = _zmq(2, 3, secret)
        ts[2].connect(table, rejoin=True)  # the old table: its own entry is ignored
        ts[2].send(0, 7, meta={"after": "hello"})  # behind the hello on the same link
        _until(lambda: ts[0].incarnations() == {2: 1})  # (a receive posted while the peer is lost fails at once)
        assert ts[0].recv(2, 7).meta == {"after": "hello"}
        assert 2 not in ts[0].lost_peers()
        _until(lambda: ts[1].incarnations() == {2: 1})
        for peer in (0, 1):
            ts[peer].send(2, 3, [np.full(4, peer)])  # the others reach the newcomer's new endpoints
            assert ts[2].recv(peer, 3).arrays[0].tolist() == [peer] * 4
    finally:
        for t in ts:
            t.close()


def test_a_malformed_hello_is_dropped_and_changes_nothing() -> None:
    secret = new_secret()
    a, b = _zmq(0, 2, secret), _zmq(1, 2, secret)
    table = [a.endpoints(), b.endpoints()]
    a.connect(table)
    b.connect(table)
    try:
        bogus = encode(1, TAG_CONTROL, (), {"ctl": "hello", "tcp": "http://evil", "ipc": 3, "host": "x", "pid": "1"})
        with b._push_locks[0]:
            b._push[0].send_multipart(bogus[0])
        b.send(0, 9, meta={"next": True})  # processed after the hello: the link still works
        assert a.recv(1, 9).meta == {"next": True}
        assert a.incarnations() == {} and a.stats.dropped_malformed == 1
    finally:
        a.close()
        b.close()


def test_an_inproc_rank_rejoins_with_an_empty_mailbox() -> None:
    fabric = InprocFabric(2, timeout=5)
    a, b = fabric.transport(0), fabric.transport(1)
    b.send(0, 1, meta={"old": True})
    b.abort()
    assert 1 in a.lost_peers()
    with pytest.raises(ValueError, match="has not left"):
        fabric.rejoin(0)
    b = fabric.rejoin(1)
    assert a.incarnations() == {1: 1} and 1 not in a.lost_peers()
    b.send(0, 1, meta={"new": True})
    assert a.recv(1, 1).meta == {"new": True}  # the predecessor's unclaimed message is gone
    a.send(1, 2)
    assert b.recv(0, 2).tag == 2


def test_the_rendezvous_answers_a_restarted_rank_at_once_and_refuses_a_late_first_registration() -> None:
    server = RendezvousServer(world_size=2, bind_addr="127.0.0.1", port=0, timeout=10, rejoins=True)
    server.start()
    try:
        tables: list[list[dict[str, object]]] = []
        threads = [
            threading.Thread(
                target=lambda r=r: tables.append(
                    register("127.0.0.1", server.port, rank=r, world_size=2, info={"who": r}, timeout=10)
                )
            )
            for r in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert tables == [[{"who": 0}, {"who": 1}]] * 2
        again = rejoin("127.0.0.1", server.port, rank=1, world_size=2, info={"who": "1b"}, timeout=5)
        assert again == ([{"who": 0}, {"who": "1b"}], True)
        with pytest.raises(RendezvousError, match="only a restarted rank may rejoin"):
            register("127.0.0.1", server.port, rank=0, world_size=2, info={"who": "0b"}, timeout=5)
    finally:
        server.close()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_parameter_server_job_restarts_its_workers_or_its_replicated_servers(replicas: int) -> None:
    """The workers are restarted (they rejoin the servers, which hold their places); unreplicated, a server's death
    ends the job (its chunks die with it); replicated, the servers are restarted too (they catch up)."""
    plan = LaunchPlan(
        nproc=2, argv=["python", "-c", "pass"], run_id="t", master_port=1, rdzv_port=2, scratch_dir="/tmp",
        faults=None, timeout=None, servers=2, secret="00",
    )  # fmt: skip
    specs = _proc_specs(plan, [], prefix=False, replicas=replicas, max_restarts=1, min_workers=0, keep_going=False)
    workers, servers = specs[:2], specs[2:]
    assert [s.restartable for s in workers] == [None] * 2
    assert [s.essential for s in workers] == [True, True]
    assert [(s.restartable, s.essential) for s in servers] == [(replicas > 1, replicas == 1)] * 2
    held = {s.env.get("PARATRAIN_PS_WORKER_RESTARTS") for s in specs}
    assert held == {"1"}
    assert all("PARATRAIN_MAX_RESTARTS" not in s.env for s in specs)  # nobody re-forms: transports stay plain
