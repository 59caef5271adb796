"""A zero-copy send's handle when its peer leaves before ZeroMQ releases the buffer."""

from __future__ import annotations

import pytest
import zmq

from paratrain.errors import PeerLostError
from paratrain.transport.zmq import _SendHandle


class _Tracker:
    """A ZeroMQ message tracker whose message is still held (as when the peer just disconnected)."""

    done = False

    def wait(self, timeout: float) -> None:
        raise zmq.NotDone


class _Transport:
    rank = 0

    def __init__(self, *, said_bye: bool) -> None:
        self._said_bye = {1} if said_bye else set()

    def _lost_error(self, peer: int) -> PeerLostError:
        return PeerLostError(f"peer rank {peer} is gone", peer=peer)


def test_a_peer_that_said_goodbye_completes_the_send() -> None:
    # the ring's last segment arrived, the peer finished and shut down cleanly: the send succeeded
    handle = _SendHandle(_Tracker(), _Transport(said_bye=True), 1)  # type: ignore[arg-type]
    assert handle.wait(1.0) is None
    assert handle.done()


def test_a_peer_that_crashed_fails_the_send() -> None:
    handle = _SendHandle(_Tracker(), _Transport(said_bye=False), 1)  # type: ignore[arg-type]
    with pytest.raises(PeerLostError, match="gone"):
        handle.wait(1.0)
