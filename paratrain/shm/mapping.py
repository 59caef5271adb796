"""The segment's file: where every word lives in it, and how the lowest rank creates it and the others map it.

Layout (all offsets 8-byte aligned; one 128-byte control line per rank, so that a rank's writes never share a
cache line with another rank's)::

    [ header 4 KiB | control line of rank 0 .. N-1 | descriptor (rank 0, pos 0), (0, 1), (1, 0), ...
      | slot (rank 0, pos 0), (0, 1), (1, 0), ... ]
    header: magic | version | ranks | capacity | abort | abort why | abort lost | extra | descriptor bytes
    control line of rank r: counter | sleeping-on | pid | left
    descriptor: what the rank's data at that position is, in the protocol's encoding (compared bytewise)
    slot: data area (capacity bytes) | extra area (the protocol's own, e.g. the collectives' results)

Each rank owns two positions (0 and 1), for alternate steps: a rank fills the next one while slower peers
still read the previous one. A rank writes only its own control line, descriptors and slots; the abort words
of the header are written once, by the first rank that fails (see :class:`~paratrain.shm.segment.Segment`).

Creation: the lowest rank creates ``paratrain-{run_id}-shm-*`` in ``/dev/shm``, writes the header, and sends the
name to the others over the transport; each maps the file, writes its pid and confirms; the creator unlinks the
name once all have answered, so nothing is left on disk even if a process crashes later (until then the
launcher's sweep removes the prefix), and tells everyone whether all succeeded.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import tempfile
import time
from typing import NamedTuple

from paratrain.errors import TransportError
from paratrain.transport.base import Transport

__all__ = [
    "CONTROL_COUNTER",
    "CONTROL_LEFT",
    "CONTROL_PID",
    "CONTROL_SLEEP",
    "HEADER",
    "LINE",
    "MAGIC",
    "VERSION",
    "W_ABORT",
    "W_ABORT_LOST",
    "W_ABORT_WHY",
    "W_CAPACITY",
    "W_DESCRIPTOR",
    "W_EXTRA",
    "W_MAGIC",
    "W_NRANKS",
    "W_VERSION",
    "Layout",
    "create_file",
    "data_offset",
    "descriptors_offset",
    "join_file",
]

MAGIC = 0x3130304D48535450  # b"PTSHM001" little-endian
VERSION = 3  # 3: the extra area and the descriptor size are in the header, set by the protocol
HEADER = 4096
LINE = 128
#: Words (uint64) of the header.
W_MAGIC, W_VERSION, W_NRANKS, W_CAPACITY, W_ABORT, W_ABORT_WHY, W_ABORT_LOST, W_EXTRA, W_DESCRIPTOR = range(9)
#: Words of a control line, relative to its first word.
CONTROL_COUNTER, CONTROL_SLEEP, CONTROL_PID, CONTROL_LEFT = 0, 1, 2, 3


class Layout(NamedTuple):
    """The sizes a protocol chooses: the creator's win, and the members read them from the header."""

    capacity: int  # bytes of a slot's data area
    extra: int  # bytes after it, for the protocol's own use
    descriptor_bytes: int  # bytes of each descriptor


def _segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pages(nbytes: int) -> int:
    return (nbytes + 4095) // 4096 * 4096


def descriptors_offset(nranks: int) -> int:
    """Offset of the first descriptor."""
    return HEADER + _pages(nranks * LINE)


def data_offset(nranks: int, descriptor_bytes: int) -> int:
    """Offset of the first slot."""
    return descriptors_offset(nranks) + _pages(nranks * 2 * descriptor_bytes)


def _segment_bytes(nranks: int, layout: Layout) -> int:
    return data_offset(nranks, layout.descriptor_bytes) + nranks * 2 * (layout.capacity + layout.extra)


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def create_file(
    transport: Transport, members: list[int], *, run_id: str, layout: Layout, tag: int, deadline: float
) -> mmap.mmap:
    """The creator's side (``members[0]``): creates, maps and offers the file, and unlinks it. Blocks.

    Raises:
        TransportError: the file could not be created, or some member could not map it (every member raises).
        PeerLostError, CommTimeoutError: a member died or did not answer before ``deadline``.
    """
    size = _segment_bytes(len(members), layout)
    name = f"paratrain-{run_id}-shm-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(_segment_dir(), name)
    others = members[1:]
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        for q in others:
            transport.send(q, tag, meta={"error": f"creating {path} failed: {exc}"}, timeout=_remaining(deadline))
        raise TransportError(f"cannot create the shared-memory segment {path}: {exc}") from None
    errors: list[str] = []
    mm: mmap.mmap | None = None
    try:
        try:
            os.ftruncate(fd, size)
            mm = _map(fd, size)
        finally:
            os.close(fd)
        words = memoryview(mm).cast("Q")
        words[W_CAPACITY], words[W_EXTRA], words[W_DESCRIPTOR] = layout
        words[W_NRANKS], words[W_VERSION] = len(members), VERSION
        words[W_MAGIC] = MAGIC
        words.release()
        _write_pid(mm, 0)
        for q in others:
            transport.send(q, tag, meta={"path": path, "size": size}, timeout=_remaining(deadline))
        for q in others:
            reply = transport.recv(q, tag, timeout=_remaining(deadline))
            if "error" in reply.meta:
                errors.append(f"rank {q}: {reply.meta['error']}")
    except BaseException:
        if mm is not None:
            mm.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for q in others:
        transport.send(q, tag, meta={"ok": not errors}, timeout=_remaining(deadline))
    if errors:
        mm.close()
        raise TransportError("shared-memory group creation failed: " + "; ".join(errors))
    return mm


def _write_pid(mm: mmap.mmap, index: int) -> None:
    words = memoryview(mm).cast("Q")
    words[(HEADER + index * LINE) // 8 + CONTROL_PID] = os.getpid()
    words.release()


def join_file(transport: Transport, leader: int, index: int, tag: int, deadline: float) -> mmap.mmap:
    """A member's side: maps the file that ``leader`` offers, as member ``index``, and confirms. Blocks.

    Only a ``paratrain-*`` file in the segment directory is mapped: the name comes from another process.

    Raises:
        TransportError: the leader could not create the file, or this or another member could not map it.
        PeerLostError, CommTimeoutError: the leader died or did not answer before ``deadline``.
    """
    offer = transport.recv(leader, tag, timeout=_remaining(deadline))
    if "error" in offer.meta:
        raise TransportError(f"rank {leader} could not create the shared-memory segment: {offer.meta['error']}")
    path, size = str(offer.meta["path"]), int(offer.meta["size"])
    mm: mmap.mmap | None = None
    error = None
    if os.path.basename(path).startswith("paratrain-") and os.path.dirname(path) == _segment_dir():
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                if os.fstat(fd).st_size != size:
                    raise OSError(f"size {os.fstat(fd).st_size} != {size}")
                mm = _map(fd, size)
            finally:
                os.close(fd)
            _write_pid(mm, index)
        except OSError as exc:
            error = f"mapping {path} failed: {exc}"
    else:
        error = f"refusing segment path {path!r} outside {_segment_dir()}"
    transport.send(leader, tag, meta={"error": error} if error else {"ok": True}, timeout=_remaining(deadline))
    verdict = transport.recv(leader, tag, timeout=_remaining(deadline))
    if error or not verdict.meta.get("ok"):
        if mm is not None:
            mm.close()
        raise TransportError(error or "shared-memory group creation failed on another rank; see its error")
    assert mm is not None
    return mm
