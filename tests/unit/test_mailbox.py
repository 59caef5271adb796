"""The mailbox's rule for receives from any source: they fail once every peer is lost (nothing can arrive), unless
lost peers may come back (a parameter server holding a dead worker's place), where they wait for the newcomer."""

from __future__ import annotations

import pytest

from paratrain.errors import PeerLostError
from paratrain.transport.base import ANY_SOURCE
from paratrain.transport.matching import Mailbox
from paratrain.transport.wire import Message


def _lose_all(box: Mailbox) -> None:
    for peer in (0, 1):
        box.peer_lost(peer, PeerLostError(f"rank {peer} is gone", peer=peer))


def test_a_receive_from_any_source_fails_once_every_peer_is_lost() -> None:
    box = Mailbox(rank=2, world_size=3)
    waiting = box.post(ANY_SOURCE, 5)
    _lose_all(box)
    with pytest.raises(PeerLostError, match="every peer is gone"):
        waiting.wait(1)
    with pytest.raises(PeerLostError, match="every peer is gone"):
        box.post(ANY_SOURCE, 5).wait(1)


def test_where_peers_return_it_waits_and_takes_the_newcomers_message() -> None:
    box = Mailbox(rank=2, world_size=3, peers_return=True)
    waiting = box.post(ANY_SOURCE, 5)
    _lose_all(box)
    assert not waiting.done()
    box.peer_back(1)
    box.deliver(Message(src=1, tag=5, meta={"op": "rejoin"}))
    assert waiting.wait(1).meta == {"op": "rejoin"}
    with pytest.raises(PeerLostError, match="rank 0 is gone"):
        box.post(0, 5).wait(1)  # a receive from one lost peer still fails
