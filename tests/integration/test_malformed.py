"""Garbage on the wire — from a stray program or a hostile peer — is dropped and logged; service goes on."""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest
import zmq

from paratrain.errors import RendezvousError
from paratrain.testing import zmq_transports
from paratrain.transport.auth import JobKeys, new_secret
from paratrain.transport.rendezvous import RendezvousServer, register
from paratrain.transport.wire import MAGIC, VERSION, encode

pytestmark = pytest.mark.timeout(60)


def test_receiver_drops_garbage_and_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    # the stray holds the job's secret (a buggy or compromised peer): authentication lets it in, validation
    # must still stop it (tests/integration/test_auth.py: a stray without the secret never gets this far)
    secret = new_secret()
    a, b = zmq_transports(2, timeout=10, secret=secret)
    ctx = zmq.Context()
    stray = ctx.socket(zmq.PUSH)
    stray.setsockopt(zmq.LINGER, 0)
    address = b.endpoints()["tcp"]  # type: ignore[attr-defined]
    JobKeys.derive(secret).authenticate_client(stray, address, rank=0)
    stray.connect(address)
    try:
        valid, _ = encode(0, 1, [np.arange(4)])
        forged_src, _ = encode(1, 1, [np.arange(4)])  # claims to come from b itself
        garbage = [
            [b"GET / HTTP/1.1\r\n\r\n"],
            [MAGIC + bytes([VERSION + 1]) + b"\x90"],
            [MAGIC + bytes([VERSION]) + msgpack.packb([0, 1, {}, [["float32", [4]]]]), b"\x00" * 3],
            [MAGIC + bytes([VERSION]) + msgpack.packb([0, 1, {}, [["object", [1]]]]), b"\x00" * 8],
            [bytes(f) for f in forged_src],
            [bytes(valid[0])],  # descriptor announces a buffer that is missing
        ]
        with caplog.at_level(logging.ERROR, logger="paratrain.transport.zmq"):
            for frames in garbage:
                stray.send_multipart(frames)
            a.send(1, 1, [np.arange(4)], meta={"real": True})
            msg = b.recv(0, 1, timeout=10)
        assert msg.meta == {"real": True}
        np.testing.assert_array_equal(msg.arrays[0], np.arange(4))
        # every garbage message was counted and logged, none was delivered (ZeroMQ keeps per-connection
        # order, but the stray and the real peer are two connections: wait until all garbage was seen)
        for _ in range(100):
            if b.stats.dropped_malformed == len(garbage):
                break
            a.send(1, 2)
            b.recv(0, 2, timeout=10)
        assert b.stats.dropped_malformed == len(garbage)
        assert "dropped a malformed message" in caplog.text
    finally:
        stray.close()
        ctx.term()
        a.close()
        b.close()


def test_rendezvous_refuses_bad_registrations() -> None:
    server = RendezvousServer(world_size=2, bind_addr="127.0.0.1", port=0, timeout=30)
    server.start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://127.0.0.1:{server.port}")
        raw.send_multipart([b"", b"\xc1 not msgpack"])
        assert raw.poll(10_000)
        assert "malformed" in msgpack.unpackb(raw.recv_multipart()[-1])["error"]
        with pytest.raises(RendezvousError, match="world size is 3"):
            register("127.0.0.1", server.port, rank=0, world_size=3, info={"pid": 1}, timeout=10)
        with pytest.raises(RendezvousError, match="outside"):
            register("127.0.0.1", server.port, rank=7, world_size=2, info={"pid": 1}, timeout=10)
    finally:
        raw.close()
        ctx.term()
        server.close()


def test_rendezvous_names_missing_ranks() -> None:
    server = RendezvousServer(world_size=3, bind_addr="127.0.0.1", port=0, timeout=0.5)
    server.start()
    try:
        with pytest.raises(RendezvousError, match=r"ranks \[1, 2\] never registered"):
            register("127.0.0.1", server.port, rank=0, world_size=3, info={"pid": 1}, timeout=10)
    finally:
        server.close()


def test_nobody_listening_times_out_with_advice() -> None:
    with pytest.raises(RendezvousError, match="no answer from the rendezvous"):
        register("127.0.0.1", 1, rank=0, world_size=2, info={}, timeout=0.3)
