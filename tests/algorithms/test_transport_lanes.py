"""Shared-memory lanes under the ZeroMQ transport: bulk messages between ranks of one host go through them and
arrive exactly as sent and in order, whatever the receiver holds on to; other messages, other hosts and a lane
of size 0 use the socket; a lane the receiver cannot read fails its sender loudly; nothing stays in /dev/shm."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from paratrain.errors import PeerLostError
from paratrain.transport.lane import LANE_THRESHOLD, lanes_supported, segment_dir
from paratrain.transport.registry import zmq_transports
from paratrain.transport.zmq import ZmqTransport

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not lanes_supported(), reason="lanes run on x86-64 with /dev/shm only"),
]


def _close(transports: list) -> None:
    for t in transports:
        t.close()


def _lane_files(transports: list) -> list[str]:
    names = [w.name for t in transports for w in t._lane_writers.values() if w is not None]
    return [n for n in names if os.path.exists(os.path.join(segment_dir(), n))]


def test_bulk_messages_take_the_lane_and_small_ones_the_socket() -> None:
    transports = zmq_transports(2)
    a, b = transports
    try:
        assert a.memory_prefix(1) == "paratrain-test-"
        big = np.arange(LANE_THRESHOLD // 4, dtype=np.float32)
        small = np.arange(16, dtype=np.int64)
        for i in range(5):
            a.send(1, 3, [big * i, small], {"i": i})
            a.send(1, 4, [small + i])
        for i in range(5):
            m = b.recv(0, 3, timeout=10)
            assert m.meta == {"i": i} and m.dtypes == ("float32", "int64")
            np.testing.assert_array_equal(m.arrays[0], big * i)
            np.testing.assert_array_equal(m.arrays[1], small)
            assert not m.arrays[0].flags.writeable
            np.testing.assert_array_equal(b.recv(0, 4, timeout=10).arrays[0], small + i)
        del m
        gc.collect()
        assert a.stats.lane_messages == 5 and a.stats.lane_full == 0
        assert a._lane_writers[1] is not None and a._lane_writers[1].in_use() == 0
    finally:
        _close(transports)
    assert _lane_files(transports) == []


def test_a_receiver_that_holds_messages_gets_the_rest_through_the_socket_in_order() -> None:
    a = b = None
    transports = zmq_transports(2)
    a, b = transports
    a._lane_bytes = 4 * (LANE_THRESHOLD + 64)  # room for four records
    try:
        sent = [np.full(LANE_THRESHOLD // 8, i, dtype=np.float64) for i in range(10)]
        for i, arr in enumerate(sent):
            a.send(1, 7, [arr], {"i": i})
        held = [b.recv(0, 7, timeout=10) for _ in sent]  # all kept: the lane fills after four
        assert [m.meta["i"] for m in held] == list(range(10))
        for m, arr in zip(held, sent, strict=True):
            np.testing.assert_array_equal(m.arrays[0], arr)
        assert a.stats.lane_messages == 4 and a.stats.lane_full == 6
        del held, m
        gc.collect()
        a.send(1, 7, [sent[0]])
        np.testing.assert_array_equal(b.recv(0, 7, timeout=10).arrays[0], sent[0])
        assert a.stats.lane_messages == 5  # released: the lane carries again
    finally:
        _close(transports)


def test_other_hosts_and_a_zero_lane_use_the_socket() -> None:
    transports = zmq_transports(3, host_ids=["h0", "h0", "h1"])
    try:
        t0 = transports[0]
        assert isinstance(t0, ZmqTransport)
        assert t0.memory_prefix(1) is not None and t0.memory_prefix(2) is None
        data = np.ones(LANE_THRESHOLD, dtype=np.uint8)
        t0.send(2, 1, [data])
        np.testing.assert_array_equal(transports[2].recv(0, 1, timeout=10).arrays[0], data)
        assert t0.stats.lane_messages == 0
        t0._lane_bytes = 0
        assert t0.memory_prefix(1) is None
        t0.send(1, 1, [data])
        np.testing.assert_array_equal(transports[1].recv(0, 1, timeout=10).arrays[0], data)
        assert t0.stats.lane_messages == 0
    finally:
        _close(transports)


def test_a_lane_the_receiver_cannot_read_fails_the_sender_instead_of_hanging() -> None:
    transports = zmq_transports(2)
    a, b = transports
    try:
        a.send(1, 1, [np.zeros(LANE_THRESHOLD, dtype=np.uint8)])
        b.recv(0, 1, timeout=10)
        writer = a._lane_writers[1]
        assert writer is not None
        good = writer.name
        writer.name = "paratrain-test-lane-0-1-forged"  # a name that is no file of the sender's
        waiting = b.irecv(0, 2)
        a.send(1, 2, [np.zeros(LANE_THRESHOLD, dtype=np.uint8)])
        with pytest.raises(PeerLostError, match="cannot read"):
            waiting.wait(10)
        assert b.stats.dropped_malformed == 1
        writer.name = good
    finally:
        _close(transports)
