"""A stranger's side of a listener, in raw bytes: what the limits of :mod:`paratrain.transport.auth` are tested and
measured against (tests/integration/test_strangers.py, benchmarks/recovery/stranger.py and flood.py). Nothing in
a job uses it."""

from __future__ import annotations

import socket
import struct

__all__ = ["connect_raw", "declared_frame", "greeting"]


def greeting(mechanism: bytes) -> bytes:
    """ZMTP 3.0's greeting as a client naming ``mechanism`` (``b"CURVE"``, ``b"PLAIN"``), so that the listener
    starts that handshake.

    Example:
        >>> len(greeting(b"CURVE")), greeting(b"CURVE")[12:17]
        (64, b'CURVE')
    """
    return b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0") + b"\0" + b"\0" * 31


def declared_frame(nbytes: int) -> bytes:
    """The header of one ZMTP command frame that says it carries ``nbytes`` (the bytes themselves are not sent)."""
    return bytes([0x06]) + struct.pack(">Q", nbytes)


def connect_raw(endpoint: str, timeout: float = 5.0) -> socket.socket:
    """A plain stream socket connected to a ZeroMQ ``tcp://HOST:PORT`` or abstract ``ipc://@NAME`` endpoint."""
    if endpoint.startswith("ipc://@"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect("\0" + endpoint.removeprefix("ipc://@"))
        return sock
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)
