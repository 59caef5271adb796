"""The shared-memory lane's ring and its checks, in one process: where records go, when they come back, and what a
receiver refuses (the lane's name and offsets come from a peer)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from paratrain.errors import MessageError
from paratrain.transport.lane import LaneReader, LaneWriter, lane_prefix, lanes_supported, segment_dir
from paratrain.transport.wire import decode, encode_header

pytestmark = pytest.mark.skipif(not lanes_supported(), reason="lanes run on x86-64 with /dev/shm only")

F32 = np.dtype(np.float32)


def _pair(capacity: int) -> tuple[LaneWriter, LaneReader]:
    writer = LaneWriter(run_id="unit", src=0, dst=1, capacity=capacity)
    return writer, LaneReader(run_id="unit", src=0, dst=1, name=writer.name)


def _read(reader: LaneReader, offset: int, *sizes: int) -> list[np.ndarray]:
    return reader.arrays(offset, [(F32, [n], 4 * n) for n in sizes])


def test_records_round_trip_and_come_back_when_their_arrays_are_gone() -> None:
    writer, reader = _pair(1 << 16)
    try:
        assert not os.path.exists(os.path.join(segment_dir(), writer.name))  # the reader unlinked it
        a, b = np.arange(100, dtype=np.float32), np.arange(7, dtype=np.float32) * 2
        off = writer.put([a, b])
        assert off == 0
        got_a, got_b = _read(reader, off, 100, 7)
        np.testing.assert_array_equal(got_a, a)
        np.testing.assert_array_equal(got_b, b)
        assert not got_a.flags.writeable
        view = got_a[10:20]  # a view keeps the record as long as the arrays do
        del got_a, got_b
        gc.collect()
        assert writer.in_use() == 1
        del view
        gc.collect()
        assert writer.in_use() == 0
    finally:
        writer.close()


def test_the_ring_wraps_refuses_when_full_and_frees_in_order() -> None:
    writer, reader = _pair(4096)
    try:
        block = np.zeros(256, dtype=np.float32)  # 1 KiB: a record is 64 + 1024 bytes
        offsets = [writer.put([block]) for _ in range(3)]
        assert offsets == [0, 1088, 2176]
        assert writer.put([block]) is None  # 3264 + 1088 > 4096, and the start is taken
        held = [_read(reader, o, 256) for o in offsets]
        del held[1]  # released out of order: the ring frees from its oldest record only
        gc.collect()
        assert writer.put([block]) is None
        del held[0]
        gc.collect()
        assert writer.put([block]) == 0  # the first two are free: the next record wraps to the start
        assert writer.put([block]) == 1088  # and the one after it fills the gap up to the oldest record
        assert writer.put([block]) is None
        del held[0]
        gc.collect()
        assert writer.in_use() == 2  # the oldest went; the two wrapped ones were never read
        assert writer.put([np.zeros(4096, dtype=np.uint8)]) is None  # larger than the ring: never
    finally:
        writer.close()


def test_a_receiver_refuses_what_does_not_fit_its_lane() -> None:
    writer, reader = _pair(4096)
    try:
        off = writer.put([np.ones(16, dtype=np.float32)])
        assert off is not None
        with pytest.raises(MessageError, match="does not fit"):
            _read(reader, 8, 16)  # unaligned
        with pytest.raises(MessageError, match="does not fit"):
            _read(reader, 4032, 64)  # past the end
        with pytest.raises(MessageError, match="not a busy record"):
            _read(reader, off, 17)  # another length than the record's
        with pytest.raises(MessageError, match="not a busy record"):
            _read(reader, 1024, 16)  # nothing there
        with pytest.raises(MessageError, match="outside this job's lanes"):
            LaneReader(run_id="unit", src=2, dst=1, name=writer.name)  # rank 2 naming rank 0's lane
        with pytest.raises(MessageError, match="outside this job's lanes"):
            LaneReader(run_id="unit", src=0, dst=1, name=lane_prefix("unit", 0, 1) + "../../etc/passwd")
    finally:
        writer.close()


def test_a_lane_header_needs_a_transport_with_lanes() -> None:
    header = encode_header(0, 5, {}, [["float32", [4]]], ["paratrain-unit-lane-0-1-x", 0])
    with pytest.raises(MessageError, match="without lanes"):
        decode([header])
    seen = []

    def resolve(src: int, lane: object, specs: list[tuple[np.dtype, list[int], int]]) -> list[np.ndarray]:
        seen.append((src, lane, [(str(d), s, n) for d, s, n in specs]))
        return [np.zeros(4, dtype=np.float32)]

    msg = decode([header], resolve)
    assert seen == [(0, ["paratrain-unit-lane-0-1-x", 0], [("float32", [4], 16)])]
    assert msg.dtypes == ("float32",) and msg.arrays[0].shape == (4,)
    with pytest.raises(MessageError, match="frames arrived"):
        decode([header, b"\0" * 16], resolve)  # a lane message carries no data frames
