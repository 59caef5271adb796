"""Point-to-point semantics every transport must honour, checked on inproc and on real ZeroMQ sockets."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from paratrain.errors import CommTimeoutError, PeerLostError, TransportClosedError
from paratrain.testing import zmq_transports
from paratrain.transport.base import ANY_SOURCE, ANY_TAG, Transport
from paratrain.transport.inproc import InprocFabric

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["inproc", "zmq"])
def pair(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Two connected transports; closed (or aborted) afterwards."""
    if request.param == "inproc":
        fabric = InprocFabric(3, timeout=10)
        ts: list[Transport] = [fabric.transport(r) for r in range(3)]
    else:
        ts = zmq_transports(3, timeout=10)
    yield ts
    for t in ts:
        t.abort()


def test_send_recv_preserves_data_and_meta(pair: list[Transport]) -> None:
    a, b, _ = pair
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.send(1, 7, [data, np.array([1, 2], dtype=np.int64)], meta={"step": 3, "name": "grad"})
    data[:] = -1  # the sender may reuse its buffer once send returned
    msg = b.recv(0, 7, timeout=5)
    assert msg.src == 0 and msg.tag == 7
    assert msg.meta == {"step": 3, "name": "grad"}
    np.testing.assert_array_equal(msg.arrays[0], np.arange(12, dtype=np.float32).reshape(3, 4))
    np.testing.assert_array_equal(msg.arrays[1], [1, 2])


def test_large_array_zero_copy_path(pair: list[Transport]) -> None:
    a, b, _ = pair
    big = np.random.default_rng(0).standard_normal(1 << 18)  # 2 MiB: above the zero-copy threshold
    handle = a.isend(1, 1, [big])
    msg = b.recv(0, 1, timeout=10)
    handle.wait(10)
    np.testing.assert_array_equal(msg.arrays[0], big)


def test_per_sender_order_and_tag_matching(pair: list[Transport]) -> None:
    a, b, c = pair
    for i in range(50):
        a.send(1, 1, meta={"i": i})
        a.send(1, 2, meta={"i": 100 + i})
    c.send(1, 1, meta={"i": -1})
    # tag 2 first: messages of another tag wait in the queue
    assert [b.recv(0, 2, timeout=5).meta["i"] for _ in range(50)] == list(range(100, 150))
    assert [b.recv(0, 1, timeout=5).meta["i"] for _ in range(50)] == list(range(50))
    assert b.recv(ANY_SOURCE, ANY_TAG, timeout=5).src == 2


def test_irecv_posted_before_send(pair: list[Transport]) -> None:
    a, b, _ = pair
    handle = b.irecv(0, 9)
    assert not handle.done()
    a.send(1, 9, meta={"x": 1})
    assert handle.wait(5).meta == {"x": 1}


def test_recv_timeout_then_message_still_delivered(pair: list[Transport]) -> None:
    a, b, _ = pair
    with pytest.raises(CommTimeoutError, match="no message from rank 0"):
        b.recv(0, 4, timeout=0.05)
    a.send(1, 4, meta={"late": True})  # the timed-out receive was withdrawn: nothing is swallowed
    assert b.recv(0, 4, timeout=5).meta == {"late": True}


def test_send_to_self(pair: list[Transport]) -> None:
    a = pair[0]
    a.send(0, 3, [np.ones(3)])
    np.testing.assert_array_equal(a.recv(0, 3, timeout=5).arrays[0], np.ones(3))


def test_bad_peer_and_closed_transport(pair: list[Transport]) -> None:
    a = pair[0]
    with pytest.raises(ValueError, match="outside"):
        a.send(5, 1)
    a.close()
    with pytest.raises(TransportClosedError):
        a.send(1, 1)


def test_clean_shutdown_wakes_waiting_peer(pair: list[Transport]) -> None:
    a, b, _ = pair
    a.send(1, 5, meta={"last": True})
    waiting = b.irecv(0, 6)
    a.close()
    # what a sent before leaving is still delivered; a receive only a could satisfy fails
    assert b.recv(0, 5, timeout=5).meta == {"last": True}
    with pytest.raises(PeerLostError, match="shut down"):
        waiting.wait(10)


def test_crash_wakes_waiting_peer(pair: list[Transport]) -> None:
    a, b, c = pair
    woke = threading.Event()
    errors: list[BaseException] = []

    def wait_on_a() -> None:
        try:
            b.recv(0, 8, timeout=20)
        except BaseException as exc:
            errors.append(exc)
        woke.set()

    t = threading.Thread(target=wait_on_a)
    t.start()
    a.abort()
    assert woke.wait(15)
    t.join()
    assert isinstance(errors[0], PeerLostError) and errors[0].peer == 0
    # receives from other peers keep working
    c.send(1, 8, meta={"ok": 1})
    assert b.recv(2, 8, timeout=5).meta == {"ok": 1}


def test_zmq_close_drops_what_is_queued_for_a_peer_that_already_left() -> None:
    # Ranks close at about the same time: when a peer's goodbye still waits unread in this rank's socket, nothing
    # this rank queued for it can be delivered any more, and close() must not linger 2 s on it (it did in 3-4 of 10
    # four-rank jobs). Here the receiver thread is stopped first, so the goodbye stays unread, as in that race.
    a, b = zmq_transports(2)
    try:
        a._stop_thread()
        b.close()  # sends its goodbye to a (a is alive: delivered before close returns), then leaves
        assert a._pull.poll(10_000), "rank 1's goodbye never arrived"
        assert a._unread_goodbyes() == {1}
        assert a._unread_goodbyes() == set()  # read once: the socket is drained
    finally:
        a.abort()  # the goodbye is read already: close() would not know the peer left
        b.close()


def test_zmq_close_waits_for_the_goodbye_of_a_peer_closing_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks that finish together: each one's goodbye reaches the other after it has closed (the end of 3 in 5
    # two-rank jobs waited out the 2 s linger on it). A closing rank now waits for the goodbyes of the peers still
    # in the job first; the wait is stretched here so that the order, not the machine's speed, decides.
    import paratrain.transport.zmq as zmq_transport

    monkeypatch.setattr(zmq_transport, "_GOODBYE_WAIT_S", 30.0)
    a, b = zmq_transports(2)
    closing = threading.Thread(target=a.close)
    try:
        closing.start()
        deadline = threading.Event()
        while 0 not in b.departed_peers():  # a's goodbye has reached b: a is in its wait
            assert not deadline.wait(0.01) and closing.is_alive(), "rank 0 closed without waiting for rank 1"
        b.close()
        closing.join(20)
        assert not closing.is_alive() and a.departed_peers() == frozenset({1})
    finally:
        closing.join(20)
        a.abort()
        b.abort()
