"""The shared-memory lane: bulk data between two processes of one host without the kernel copying it.

Why: inside a host the ZeroMQ transport speaks ipc sockets, which copy every byte into the kernel and out again
in socket-buffer-sized pieces and wake the receiver for each: measured here, 16 MiB of parameter-server traffic
moved at 3-5 % of memory-copy speed. A lane carries a message's arrays through a file in ``/dev/shm`` that both
sides map: the sender copies them in once, the ipc socket carries only the header (which says where they lie),
and the receiver's arrays are views of the mapped memory, read where they lie. One copy per byte instead of two
plus the kernel's, and the header keeps the socket's ordering, failure detection and authentication unchanged.

The memory is a ring the sender owns (one per destination, created at its first bulk message), cut into
*records*, one per message: a 64-byte head (a state word, the record's length) and the arrays, each aligned to
64 bytes. The sender writes ``BUSY`` into the state word, the data, and then sends the header; the receiver's
arrays share one buffer object, and when the last of them is garbage collected the receiver writes ``FREE``
into the state word. The sender reclaims records in the order it made them, as their words turn ``FREE``. A
receiver that keeps a message (a queued request, say) holds its record and the records after it; when the ring
has no room the sender sends that message through the socket as before, so a lane never blocks and never
deadlocks, it only stops helping. (x86-64 orders a receiver's loads of the data before its later store of
``FREE``, and the sender's load of ``FREE`` before its later stores of new data; elsewhere lanes are off.)

Trust: the file's name comes from a peer, so the receiver maps only ``paratrain-<run>-lane-<src>-<dst>-*`` in
the segment directory, checks every offset and length against the file's size, and unlinks the name once it
has mapped it (the sender unlinks it too at close; the launcher sweeps ``paratrain-<run>*`` after a crash).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import tempfile
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.errors import MessageError

__all__ = ["LANE_THRESHOLD", "LaneReader", "LaneWriter", "lane_prefix", "lanes_supported", "safe_run_id", "segment_dir"]

#: Messages with at least this many data bytes go through a lane (below it the socket's copy is cheap).
LANE_THRESHOLD = 1 << 16
_HEAD = 64
_ALIGN = 64
_BUSY, _FREE = 1, 0


def lanes_supported() -> bool:
    """Lanes rely on x86-64's store ordering and on ``/dev/shm`` (see the module docstring)."""
    return platform.machine().lower() in {"x86_64", "amd64"} and os.path.isdir(segment_dir())


def segment_dir() -> str:
    """Where shared-memory files live: ``/dev/shm`` (a temporary directory where there is none)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def safe_run_id(run_id: str) -> str:
    """``run_id`` as it appears in file names (``paratrain-<it>-...``, which the launcher sweeps)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id)[:48]


def lane_prefix(run_id: str, src: int, dst: int) -> str:
    """The file-name prefix of the lane from ``src`` to ``dst`` (the receiver maps nothing else)."""
    return f"paratrain-{safe_run_id(run_id)}-lane-{src}-{dst}-"


class LaneWriter:
    """The sender's side of the lane to one peer: a ring of records in a file it creates. Not thread-safe (the
    transport calls it under the peer's send lock)."""

    def __init__(self, *, run_id: str, src: int, dst: int, capacity: int) -> None:
        self.name = lane_prefix(run_id, src, dst) + f"{os.getpid()}-{secrets.token_hex(6)}"
        self._path = os.path.join(segment_dir(), self.name)
        self.capacity = capacity // _ALIGN * _ALIGN
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.capacity)
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.capacity, flags=mmap.MAP_SHARED)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self._words = np.frombuffer(self._mm, dtype=np.uint64)
        self._records: deque[tuple[int, int]] = deque()  # (offset, size) in the order made: the ring's contents

    def _reclaim(self) -> None:
        words, records = self._words, self._records
        while records and words[records[0][0] // 8] == _FREE:
            records.popleft()

    def _place(self, size: int) -> int | None:
        """Where a record of ``size`` bytes fits, or None when the ring has no room for it now."""
        self._reclaim()
        records = self._records
        if not records:
            return 0 if size <= self.capacity else None
        tail = records[0][0]
        last_off, last_size = records[-1]
        head = last_off + last_size
        if last_off >= tail:  # not wrapped: free space after head, and before tail
            if head + size <= self.capacity:
                return head
            return 0 if size <= tail else None
        return head if head + size <= tail else None

    def put(self, views: Sequence[npt.NDArray[Any]]) -> int | None:
        """Copies the (C-contiguous) arrays into a new record; its offset, or None if the ring is full now."""
        size = _HEAD + sum(_up(v.nbytes) for v in views)
        off = self._place(size)
        if off is None:
            return None
        self._records.append((off, size))
        self._words[off // 8] = _BUSY
        self._words[off // 8 + 1] = size
        at = off + _HEAD
        for v in views:
            n = v.nbytes
            if n:
                np.copyto(self._bytes[at : at + n], v.reshape(-1).view(np.uint8))
            at += _up(n)
        return off

    def in_use(self) -> int:
        """Records not yet released by the receiver (for tests and statistics)."""
        self._reclaim()
        return len(self._records)

    def close(self) -> None:
        """Unmaps and unlinks (the receiver's mapping, and its arrays, stay valid)."""
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        self._bytes = np.empty(0, dtype=np.uint8)
        self._words = np.empty(0, dtype=np.uint64)
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


def _release(words: npt.NDArray[np.uint64], index: int) -> None:
    words[index] = _FREE


class LaneReader:
    """The receiver's side of one peer's lane: maps the file the peer named, and wraps records as arrays."""

    def __init__(self, *, run_id: str, src: int, dst: int, name: str) -> None:
        if not (isinstance(name, str) and name.startswith(lane_prefix(run_id, src, dst)) and "/" not in name):
            raise MessageError(f"rank {src} named a lane {name!r} outside this job's lanes to rank {dst}")
        self.name = name
        path = os.path.join(segment_dir(), name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise MessageError(f"cannot open rank {src}'s lane {path}: {exc}") from None
        try:
            self.size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except (OSError, ValueError) as exc:
            raise MessageError(f"cannot map rank {src}'s lane {path}: {exc}") from None
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)  # mapped: nothing of it needs a name any more
        self._words = np.frombuffer(self._mm, dtype=np.uint64)

    def arrays(self, offset: Any, specs: Sequence[tuple[np.dtype[Any], list[int], int]]) -> list[npt.NDArray[Any]]:
        """Read-only arrays over the record at ``offset``, one per ``(storage dtype, shape, nbytes)``; the record
        is released when the last of them (and of their views) is gone.

        Raises:
            MessageError: the offset or the lengths do not fit the lane, or the record is not marked busy.
        """
        size = _HEAD + sum(_up(n) for _, _, n in specs)
        if type(offset) is not int or offset < 0 or offset % _ALIGN or offset + size > self.size:
            raise MessageError(f"lane record at {offset!r} of {size} bytes does not fit a lane of {self.size}")
        index = offset // 8
        if self._words[index] != _BUSY or int(self._words[index + 1]) != size:
            raise MessageError(f"lane record at {offset} is not a busy record of {size} bytes")
        record = (ctypes.c_char * (size - _HEAD)).from_buffer(self._mm, offset + _HEAD)
        weakref.finalize(record, _release, self._words, index)
        raw = np.frombuffer(memoryview(record).cast("B"), dtype=np.uint8)
        del record  # the arrays below hold it through ``raw``
        out: list[npt.NDArray[Any]] = []
        at = 0
        for storage, shape, n in specs:
            arr = raw[at : at + n].view(storage).reshape(shape) if n else np.empty(shape, dtype=storage)
            arr.flags.writeable = False
            out.append(arr)
            at += _up(n)
        return out
