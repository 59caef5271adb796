"""A peer whose process died after it registered but before this rank connected to it: the connection is refused
again and again, never dropped (it was never made), so only the heartbeats would notice, after 30 s. On the same
host the transport asks whether the peer's pid still runs, and declares it lost at the first refusal."""

from __future__ import annotations

import os
import subprocess

import pytest

from paratrain.errors import CommTimeoutError, PeerLostError
from paratrain.transport.zmq import ZmqTransport

pytestmark = pytest.mark.timeout(60)


def _pair(pid_of_peer: int) -> ZmqTransport:
    """Rank 0 connected to a rank 1 whose sockets are gone, published with ``pid_of_peer``."""
    ranks = [ZmqTransport(rank=r, world_size=2, host_id="h", timeout=20, run_id="dead") for r in range(2)]
    table = [t.endpoints() for t in ranks]
    ranks[1].abort()  # its endpoints close: every connection to them is refused
    table[1] = {**table[1], "pid": pid_of_peer}
    ranks[0].connect(table)
    return ranks[0]


def test_a_peer_dead_before_anyone_connected_is_lost_at_the_first_refusal() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: its pid names no process now
    t = _pair(gone.pid)
    try:
        with pytest.raises(PeerLostError, match="is not running"):
            t.recv(1, 5, timeout=15)  # well below the 30 s heartbeat timeout
    finally:
        t.abort()


def test_a_refused_peer_whose_process_runs_is_not_declared_lost_by_the_refusals() -> None:
    t = _pair(os.getpid())  # alive (this process): a refusal alone proves nothing, the heartbeats decide
    try:
        with pytest.raises(CommTimeoutError):
            t.recv(1, 5, timeout=1.5)  # several refusals (retries every 0.1-0.4 s) and no loss
        assert 1 not in t.lost_peers()
    finally:
        t.abort()
