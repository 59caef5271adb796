"""A process without the job's secret (or with another job's) is refused by the rendezvous, a worker and a parameter
server, on TCP and on ipc: nothing it sends is delivered, the refusal is counted and logged, and the job goes on.
A flood of 10**5 messages and raw connections from such processes changes nothing and crashes nothing."""

from __future__ import annotations

import logging
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from paratrain.config import Settings
from paratrain.errors import RendezvousError
from paratrain.ps import KVStore
from paratrain.ps.protocol import REQUEST_TAG
from paratrain.ps.server import ParameterServer
from paratrain.runtime.context import Context
from paratrain.testing import zmq_transports
from paratrain.transport.auth import JobKeys, new_secret
from paratrain.transport.rendezvous import RendezvousServer, register
from paratrain.transport.wire import MAGIC, VERSION, encode
from paratrain.transport.zmq import ZmqTransport

pytestmark = pytest.mark.timeout(120)

AUTH_LOG = "paratrain.transport.auth"
Configure = Callable[[zmq.Socket[bytes], str], None]


def _await(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Polls observable state until ``condition`` holds (not a guess at timing); fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.005)


def _intruders(secret: bytes, address: str) -> dict[str, Configure]:
    """Every way to lack the job's credentials for ``address``, by name."""
    wrong = JobKeys.derive(new_secret())
    right = JobKeys.derive(secret)

    def nothing(sock: zmq.Socket[bytes], addr: str) -> None:
        pass

    def another_job(sock: zmq.Socket[bytes], addr: str) -> None:
        wrong.authenticate_client(sock, addr)

    ways: dict[str, Configure] = {"no secret": nothing, "another job's secret": another_job}
    if address.startswith("tcp://"):

        def leaked_server_key(sock: zmq.Socket[bytes], addr: str) -> None:
            # knows the server's public key (it is public in principle), not the job's client key: the ZAP check
            # is what refuses it
            public, private = zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, right.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, private)

        ways["the server's public key only"] = leaked_server_key
    else:

        def other_endpoint(sock: zmq.Socket[bytes], addr: str) -> None:
            # the password of another endpoint of this very job (what an impostor could have collected)
            sock.setsockopt(zmq.PLAIN_USERNAME, b"paratrain")
            sock.setsockopt(zmq.PLAIN_PASSWORD, right.ipc_password(addr + "-other"))

        def curve(sock: zmq.Socket[bytes], addr: str) -> None:
            right.authenticate_client(sock, "tcp://x")  # CURVE with the right keys, but ipc speaks PLAIN

        ways["another endpoint's password"] = other_endpoint
        ways["CURVE on ipc"] = curve
    return ways


def _intrude(
    ctx: zmq.Context[zmq.Socket[bytes]], address: str, configure: Configure, messages: list[list[bytes]]
) -> zmq.Socket[bytes]:
    """A PUSH socket at ``address`` configured by ``configure``, with ``messages`` queued (never blocks).

    Once the server refuses its handshake, ZeroMQ gives up the connection for good (no reconnect after a protocol
    error) and refuses further sends (``Again``): those messages are dropped here, as the client's own ZeroMQ would.
    """
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    configure(sock, address)
    sock.connect(address)
    for message in messages:
        try:
            sock.send_multipart(message, flags=zmq.NOBLOCK)
        except zmq.Again:
            break
    return sock


def _refuse_each(refused: Callable[[], int], secret: bytes, address: str, frames: list[list[bytes]]) -> list[str]:
    """Sends ``frames`` to ``address`` from every kind of intruder in turn, each until it was refused."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    names = []
    try:
        for name, configure in _intruders(secret, address).items():
            before = refused()
            sock = _intrude(ctx, address, configure, frames)
            try:
                _await(lambda before=before: refused() > before, f"{name} at {address} to be refused")
            finally:
                sock.close()
            names.append(name)
    finally:
        ctx.destroy(linger=0)
    return names


def _forged(src: int, tag: int, meta: dict[str, object] | None = None) -> list[bytes]:
    frames, _ = encode(src, tag, [np.arange(4, dtype=np.float32)], meta)
    return [bytes(f) for f in frames]


def test_a_worker_refuses_every_client_without_the_secret_on_tcp_and_ipc(caplog: pytest.LogCaptureFixture) -> None:
    secret = new_secret()
    a, b = zmq_transports(2, timeout=10, secret=secret)
    assert isinstance(b, ZmqTransport) and b.authenticated
    try:
        with caplog.at_level(logging.WARNING, logger=AUTH_LOG):
            refused = []
            for address in (b.endpoints()["tcp"], b.endpoints()["ipc"]):
                refused += _refuse_each(
                    lambda: b.stats.refused_connections, secret, address, [_forged(0, 1, {"forged": True})]
                )
            assert len(refused) == 7  # 3 ways on TCP, 4 on ipc
            a.send(1, 1, [np.arange(4)], meta={"real": True})
            msg = b.recv(0, 1, timeout=10)
            assert msg.meta == {"real": True}  # nothing forged was delivered before it, nothing reached decode
            assert b.stats.messages_received == 1 and b.stats.dropped_malformed == 0
            assert b.stats.refused_connections >= 7 and not b.lost_peers()
            assert a.stats.refused_connections == 0
            # the first refusal is logged at once, the rest within the interval are held back and counted ...
            lines = [r.getMessage() for r in caplog.records if r.name == AUTH_LOG]
            assert lines[0].startswith("rank 1: refused a connection to tcp://127.0.0.1:")
            assert "nothing it sent was delivered" in lines[0]
            b.close()
            # ... and reported when the guard closes
            lines = [r.getMessage() for r in caplog.records if r.name == AUTH_LOG]
            assert any(line.startswith("rank 1: ") and "more connections refused" in line for line in lines[1:])
    finally:
        a.close()
        b.close()


def test_a_parameter_server_refuses_clients_without_the_secret_and_serves_its_worker() -> None:
    secret = new_secret()
    worker_t, server_t = zmq_transports(2, timeout=20, secret=secret)
    assert isinstance(server_t, ZmqTransport)
    server = ParameterServer(server_t, num_workers=1, timeout=20)
    thread = threading.Thread(target=server.serve, name="ps", daemon=True)
    thread.start()
    settings = Settings(
        rank=0, world_size=2, local_world_size=2, transport="inproc", timeout=20, num_servers=1, role="worker"
    )
    ctx = Context(settings=settings, transport=worker_t)
    try:
        kv = KVStore("bsp", None, context=ctx)
        kv.init("w", np.zeros(4, dtype=np.float32))
        pushes = server.stats.pushes
        # requests that would add 1000 to w if they were delivered (a push claiming to come from the worker)
        forged = [_forged(0, REQUEST_TAG, {"op": "push", "key": "w", "clock": 0}) for _ in range(10)]
        for address in (server_t.endpoints()["tcp"], server_t.endpoints()["ipc"]):
            _refuse_each(lambda: server_t.stats.refused_connections, secret, address, forged)
        kv.push("w", np.ones(4, dtype=np.float32)).wait(10)
        kv.clock()
        np.testing.assert_array_equal(kv.pull("w"), np.ones(4, dtype=np.float32))
        assert server.stats.pushes == pushes + 1 and server.stats.rejected == 0
        assert server_t.stats.refused_connections >= 7 and server_t.stats.dropped_malformed == 0
        kv.close()
    finally:
        ctx.shutdown()
        thread.join(20)
        server_t.close()
    assert not thread.is_alive()


def test_the_rendezvous_refuses_ranks_without_the_secret_and_the_job_still_meets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = new_secret()
    server = RendezvousServer(world_size=2, bind_addr="127.0.0.1", port=0, timeout=30, secret=secret)
    server.start()
    raw_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger=AUTH_LOG):
            # register() says it was refused, at once, rather than waiting out its timeout for an answer
            for other in (None, new_secret()):
                with pytest.raises(RendezvousError, match="refused this rank") as info:
                    register(
                        "127.0.0.1", server.port, rank=0, world_size=2, info={"who": "x"}, timeout=60, secret=other
                    )
                assert "PARATRAIN_SECRET" in str(info.value)
            # raw clients that try to take rank 0's place, each until the server refused it
            request = msgpack.packb({"v": 1, "rank": 0, "world_size": 2, "info": {"who": "intruder"}})
            address = f"tcp://127.0.0.1:{server.port}"
            for name, configure in _intruders(secret, address).items():
                before = server.refused
                sock = raw_ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                configure(sock, address)
                sock.connect(address)
                sock.send_multipart([b"", request], flags=zmq.NOBLOCK)
                _await(lambda before=before: server.refused > before, f"{name} to be refused")
                assert not sock.poll(0)  # no answer, not even an error: nothing was read
                sock.close()
            assert server.accepted == 0 and server.waiting == frozenset()
            tables: dict[int, list[dict[str, object]]] = {}

            def join(rank: int) -> None:
                tables[rank] = register(
                    "127.0.0.1", server.port, rank=rank, world_size=2, info={"who": rank}, timeout=20, secret=secret
                )

            threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(25)
            assert tables == {0: [{"who": 0}, {"who": 1}], 1: [{"who": 0}, {"who": 1}]}
            assert server.refused >= 5
            assert "rendezvous: refused a connection to tcp://127.0.0.1:" in caplog.text
    finally:
        raw_ctx.destroy(linger=0)
        server.close()


# -- the flood ----------------------------------------------------------------------------------------------------


def _greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting (64 bytes): signature, version, mechanism, as-server, filler."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def _frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 2]) + len(body).to_bytes(8, "big") + body


def _raw_payloads(rng: random.Random, count: int) -> list[bytes]:
    """What a hand-written client sends: each a connection's bytes, ``count`` frames in all."""
    ready = _frame(b"\x05READY" + b"\x0bSocket-Type" + (4).to_bytes(4, "big") + b"PUSH", command=True)
    valid = b"".join(_frame(bytes(f), more=i == 0) for i, f in enumerate(_forged(0, 1)))
    payloads = []
    per = 50
    for i in range(count // per):
        kind = i % 5
        if kind == 0:  # noise
            payloads.append(rng.randbytes(rng.randrange(0, 4096)))
        elif kind == 1:  # a NULL session pushing valid-looking paratrain messages, as if no one checked
            payloads.append(_greeting(b"NULL") + ready + valid * (per // 2))
        elif kind == 2:  # a CURVE HELLO of random bytes, then frames
            hello = _frame(b"\x05HELLO" + rng.randbytes(194), command=True)
            payloads.append(_greeting(b"CURVE") + hello + valid * (per - 1))
        elif kind == 3:  # announces an oversized frame (2**62 bytes) and sends a little of it
            payloads.append(_greeting(b"NULL") + ready + b"\x02" + (1 << 62).to_bytes(8, "big") + rng.randbytes(9000))
        else:  # PLAIN HELLO with a made-up password, then random frames
            hello = _frame(b"\x05HELLO\x09paratrain\x20" + rng.randbytes(32), command=True)
            frames = b"".join(_frame(rng.randbytes(rng.randrange(0, 300))) for _ in range(per - 1))
            payloads.append(_greeting(b"PLAIN") + hello + frames)
    return payloads


def _blast(address: str, payloads: list[bytes]) -> None:
    """Opens one raw connection per payload, writes it, and closes (the server may hang up first)."""
    for payload in payloads:
        if address.startswith("tcp://"):
            host, port = address[len("tcp://") :].rsplit(":", 1)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target: object = (host, int(port))
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target = "\0" + address[len("ipc://@") :]
        sock.settimeout(5)
        try:
            sock.connect(target)
            sock.sendall(payload)
        except OSError:  # reset or refused mid-write: the server hung up, which is its right
            pass
        finally:
            sock.close()


def _random_messages(rng: random.Random, count: int) -> list[list[bytes]]:
    """Random frames, valid-looking paratrain messages (forged sources, every tag) and oversized frames."""
    messages: list[list[bytes]] = []
    for i in range(count):
        kind = i % 4
        if i % 10_000 == 0:
            messages.append([b"\x00" * (4 << 20)])  # oversized
        elif kind == 0:
            messages.append([rng.randbytes(rng.randrange(0, 256)) for _ in range(rng.randrange(1, 4))])
        elif kind == 1:
            messages.append(_forged(rng.randrange(-2, 3), rng.randrange(-(1 << 62), 1 << 62)))
        elif kind == 2:
            header = MAGIC + bytes([VERSION]) + msgpack.packb([0, 1, {}, [["float32", [1 << 40]]]])
            messages.append([header, rng.randbytes(64)])  # announces 4 TB of data
        else:
            messages.append([MAGIC + bytes([VERSION]) + rng.randbytes(rng.randrange(0, 64))])
    return messages


def test_a_flood_from_clients_without_the_secret_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    secret = new_secret()
    rng = random.Random(13)
    a, b = zmq_transports(2, timeout=20, secret=secret)
    assert isinstance(b, ZmqTransport)
    tcp, ipc = b.endpoints()["tcp"], b.endpoints()["ipc"]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    intruders = []  # kept open until the end: their ZeroMQ holds what it could not send
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger=AUTH_LOG):
            # ZeroMQ clients, in every way of lacking the credentials on both endpoints, send 80,000 messages in
            # batches of 1,000, a new connection per batch (a refused one is never retried by ZeroMQ) ...
            ways = [(address, c) for address in (tcp, ipc) for c in _intruders(secret, address).values()]
            messages = _random_messages(rng, 80_000)
            for batch in range(80):
                address, configure = ways[batch % len(ways)]
                intruders.append(_intrude(ctx, address, configure, messages[batch * 1000 : (batch + 1) * 1000]))
            _await(lambda: b.stats.refused_connections >= 80, "every ZeroMQ intruder to be refused")
            # ... and 400 raw connections write 20,000 frames of their own, past ZeroMQ's client side: noise,
            # NULL sessions pushing valid-looking paratrain messages, random CURVE and PLAIN hellos, a 2**62-byte frame
            payloads = _raw_payloads(rng, 20_000)
            _blast(tcp, payloads[::2])
            _blast(ipc, payloads[1::2])
            # the victim goes on: a message from its peer arrives, alone, on a link that never dropped
            for i in range(3):
                a.send(1, 7, [np.full(3, i)], meta={"i": i})
                assert b.recv(0, 7, timeout=10).meta == {"i": i}
            assert b.stats.messages_received == 3 and b.stats.dropped_malformed == 0 and not b.lost_peers()
            # a newcomer with the secret is still let in, on both endpoints (the guard answers after the flood)
            keys = JobKeys.derive(secret)
            for address in (tcp, ipc):
                late = _intrude(
                    ctx, address, partial(keys.authenticate_client, rank=0), [_forged(0, 8, {"late": address})]
                )
                assert b.recv(0, 8, timeout=10).meta == {"late": address}
                late.close()
            elapsed = time.monotonic() - started
            lines = [r for r in caplog.records if r.name == AUTH_LOG]
            # rate-limited: one line at once, then at most one per 10 s however many were refused
            assert 1 <= len(lines) <= 2 + int(elapsed / 10), [r.getMessage() for r in lines]
            assert elapsed < 60
    finally:
        ctx.destroy(linger=0)
        a.close()
        b.close()


# -- a real job ----------------------------------------------------------------------------------------------------

INTRUDER = """
import json, sys
import zmq
from paratrain.errors import RendezvousError
from paratrain.transport.auth import JobKeys, new_secret
from paratrain.transport.rendezvous import register

targets = json.loads(sys.argv[1])
try:
    register("127.0.0.1", targets["rdzv"], rank=0, world_size=2, info={}, timeout=30)
except RendezvousError as exc:
    print("register refused:", "refused this rank" in str(exc), flush=True)
ctx = zmq.Context()
wrong = JobKeys.derive(new_secret())
for name, address in (("server tcp", targets["tcp"]), ("server ipc", targets["ipc"]), ("rdzv", targets["rdzv_tcp"])):
    for kind in ("no secret", "wrong secret"):
        sock = ctx.socket(zmq.DEALER if name == "rdzv" else zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        # a name of our own: pyzmq's default names the monitor after the socket's fd, which the next socket of
        # this loop may reuse before the old monitor's endpoint is gone ("Address already in use")
        failed = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        monitor = sock.get_monitor_socket(
            failed | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            addr="inproc://intruder-" + (name + "-" + kind).replace(" ", "-"),
        )
        if kind == "wrong secret":
            wrong.authenticate_client(sock, address)
        sock.connect(address)
        sock.send_multipart([b"", b"x"] if name == "rdzv" else [b"PTRN\\x01", b"x"], flags=zmq.NOBLOCK)
        print(name, kind, "refused" if monitor.poll(20_000) else "NOT REFUSED", flush=True)
        monitor.close(0)
        sock.close()
ctx.term()
"""

JOB = """
import json, os, subprocess, sys
import numpy as np
import paratrain as pt

ctx = pt.init(timeout=60)
kv = pt.ps.KVStore()
kv.init("w", np.zeros(4))
server = ctx.transport.peer_endpoints(1)
port = int(os.environ["PARATRAIN_RDZV_PORT"])
targets = {"rdzv": port, "rdzv_tcp": f"tcp://127.0.0.1:{port}", "tcp": server["tcp"], "ipc": server["ipc"]}
env = {k: v for k, v in os.environ.items() if k != "PARATRAIN_SECRET"}
out = subprocess.run(
    [sys.executable, sys.argv[1], json.dumps(targets)], env=env, capture_output=True, text=True, timeout=90
)
print(out.stdout, out.stderr, flush=True)
kv.push("w", np.ones(4))
kv.clock()
print("value", kv.pull("w").tolist(), "refused here", ctx.transport.stats.refused_connections, flush=True)
kv.close()
pt.shutdown()
"""


def test_a_launched_job_refuses_an_intruder_at_its_rendezvous_and_server_and_finishes(tmp_path: Path) -> None:
    intruder, job = tmp_path / "intruder.py", tmp_path / "job.py"
    intruder.write_text(textwrap.dedent(INTRUDER))
    job.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if k not in ("PARATRAIN_SECRET", "PARATRAIN_INSECURE")}
    launch = [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "1", "--servers", "1", "--", "python"]
    out = subprocess.run(
        [*launch, str(job), str(intruder)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank0]: register refused: True" in out.stdout, out.stdout
    for name in ("server tcp", "server ipc", "rdzv"):
        for kind in ("no secret", "wrong secret"):
            assert f"[rank0]: {name} {kind} refused" in out.stdout, out.stdout
    assert "[rank0]: value [1.0, 1.0, 1.0, 1.0] refused here 0" in out.stdout, out.stdout
    # the server and the launcher's rendezvous said so (the server through the launcher's relay)
    assert "[server0]: rank 1: refused a connection to tcp://127.0.0.1:" in out.stderr, out.stderr
    assert "rendezvous: refused a connection to tcp://127.0.0.1:" in out.stderr, out.stderr


WRONG_SECRET_RANK = """
import time
import paratrain as pt
from paratrain.errors import RendezvousError

start = time.monotonic()
try:
    pt.init(timeout=30)
except RendezvousError as exc:
    print(f"failed after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    raise SystemExit(3) from None
print("joined", flush=True)
pt.shutdown()
"""


def test_a_wrong_secret_on_one_rank_fails_every_rank_at_once_naming_it(tmp_path: Path) -> None:
    """Three ranks started by hand (as under torchrun): rank 1 holds another secret. It is refused at once, and
    ranks 0 and 2 are told that rank 1 presented another secret, long before the rendezvous's timeout (60 s)."""
    script = tmp_path / "rank.py"
    script.write_text(WRONG_SECRET_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    secret, other = new_secret().hex(), new_secret().hex()
    procs = []
    for rank in range(3):
        env = dict(os.environ, WORLD_SIZE="3", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1))
        env.update(PARATRAIN_SECRET=other if rank == 1 else secret, PARATRAIN_RDZV_TIMEOUT="60")
        env.pop("PARATRAIN_INSECURE", None)
        procs.append(
            subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    try:
        outs = [p.communicate(timeout=30)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [3, 3, 3], outs
    assert "refused this rank" in outs[1], outs[1]
    for rank in (0, 2):
        assert "rank 1 presented another secret" in outs[rank], outs[rank]
        assert "2 of 3 did" in outs[rank], outs[rank]
