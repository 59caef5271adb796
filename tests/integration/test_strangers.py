"""What a stranger (a process without the job's secret) can cost a job's listeners before it authenticates: a frame
longer than the wire's longest is cut off at its header, and a handshake that stalls is dropped. Real sockets (a
rank's TCP and ipc endpoints, the rendezvous), raw bytes from the stranger's side, this process's memory read from
/proc."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from paratrain.testing import zmq_transports
from paratrain.transport.auth import HANDSHAKE_S, new_secret
from paratrain.transport.probe import connect_raw, declared_frame, greeting
from paratrain.transport.rendezvous import RendezvousServer, register

pytestmark = pytest.mark.timeout(120)

_DECLARED = 1 << 30  # what the stranger's one handshake frame says it carries
_SENDS = 64  # at most this many MiB are sent after it


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _oversized(endpoint: str, mechanism: bytes) -> tuple[int, float]:
    """A stranger's greeting, then one command frame declaring 1 GiB, then up to 64 MiB of it: the MiB it got to
    send before the listener cut it off, and the growth of this process's memory meanwhile (MiB)."""
    before, peak, sent = _rss_mib(), 0.0, 0
    sock = connect_raw(endpoint)
    sock.settimeout(2.0)
    chunk = bytes(1 << 20)
    try:
        sock.sendall(greeting(mechanism) + declared_frame(_DECLARED))
        for _ in range(_SENDS):
            sock.sendall(chunk)
            sent += 1
            peak = max(peak, _rss_mib() - before)
    except OSError:  # cut off (reset, broken pipe) or no longer read (timeout)
        pass
    finally:
        peak = max(peak, _rss_mib() - before)
        sock.close()
    return sent, peak


@contextmanager
def _listeners() -> Iterator[dict[str, tuple[str, bytes]]]:
    """A rank's TCP and ipc endpoints and a rendezvous, all guarded by one secret, as ``{name: (endpoint,
    mechanism)}``."""
    secret = new_secret()
    a, b = zmq_transports(2, timeout=30, secret=secret)
    server = RendezvousServer(world_size=1, bind_addr="127.0.0.1", port=0, timeout=60, secret=secret)
    server.start()
    try:
        ends = b.endpoints()
        yield {
            "rank tcp": (ends["tcp"], b"CURVE"),
            "rank ipc": (ends["ipc"], b"PLAIN"),
            "rendezvous": (f"tcp://127.0.0.1:{server.port}", b"CURVE"),
        }
        # the job is unharmed: a message still crosses, and the rendezvous still meets its rank
        a.send(1, 3, [np.arange(4.0)])
        assert b.recv(0, 3).arrays[0].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert register("127.0.0.1", server.port, rank=0, world_size=1, info={"r": 0}, timeout=20, secret=secret)
    finally:
        server.close()
        a.close()
        b.close()


def test_a_declared_gibibyte_frame_is_cut_off_at_its_header_on_every_listener() -> None:
    with _listeners() as listeners:
        for name, (endpoint, mechanism) in listeners.items():
            sent, grew = _oversized(endpoint, mechanism)
            # the listener stops reading at the frame's header: the stranger's bytes fill the kernel's socket
            # buffers at most, never the process's memory
            assert grew <= 16, f"{name}: this process grew by {grew:.0f} MiB while a stranger sent {sent} MiB"
            assert sent < _SENDS, f"{name}: all {_SENDS} MiB of a declared 1 GiB frame were read"


def test_a_stalled_handshake_is_dropped_after_the_handshake_interval() -> None:
    with _listeners() as listeners:
        socks = []
        for endpoint, mechanism in listeners.values():
            sock = connect_raw(endpoint)
            sock.sendall(greeting(mechanism))  # ... and nothing more
            sock.settimeout(HANDSHAKE_S + 10)
            socks.append(sock)
        start = time.monotonic()
        try:
            for sock in socks:
                while True:  # the listener's own greeting and handshake bytes, then EOF when it drops us
                    try:
                        if not sock.recv(4096):
                            break
                    except ConnectionResetError:
                        break
            assert time.monotonic() - start < HANDSHAKE_S + 10  # dropped, not left until our own timeout
        finally:
            for sock in socks:
                sock.close()


def test_a_sender_field_that_is_not_the_connections_rank_is_dropped_and_no_peer_is_declared_lost() -> None:
    """A process holding the secret connects as rank 2 and sends messages claiming to come from rank 1, one of them
    naming a shared-memory lane that does not exist (which, from rank 1, would fail rank 1): each is dropped and
    counted, and rank 1 stays a healthy peer whose messages still arrive."""
    from functools import partial

    import zmq

    from paratrain.transport.auth import JobKeys
    from paratrain.transport.wire import encode, encode_header

    secret = new_secret()
    a, b, c = zmq_transports(3, timeout=30, secret=secret)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        spoofs = [
            [bytes(f) for f in encode(1, 5, [np.arange(4.0)])[0]],
            [encode_header(1, 5, {}, [["float32", [4]]], ["paratrain-no-such-lane", 0])],
        ]
        for address in (a.endpoints()["tcp"], a.endpoints()["ipc"]):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            partial(JobKeys.derive(secret).authenticate_client, rank=2)(sock, address)
            sock.connect(address)
            for frames in spoofs:
                sock.send_multipart(frames)
            sock.close()
        deadline = time.monotonic() + 20
        while a.stats.spoofed_senders < 4:
            assert time.monotonic() < deadline, f"only {a.stats.spoofed_senders} of 4 spoofed messages were seen"
            b.send(0, 6)
            a.recv(1, 6, timeout=10)
        assert a.stats.spoofed_senders == 4 and not a.lost_peers()
        b.send(0, 5, [np.arange(3.0)])  # the real rank 1's message is the one tag 5 delivers
        assert a.recv(1, 5, timeout=10).arrays[0].tolist() == [0.0, 1.0, 2.0]
        c.send(0, 7)
        assert a.recv(2, 7, timeout=10).src == 2
    finally:
        ctx.destroy(linger=0)
        for t in (a, b, c):
            t.close()


def test_a_launched_job_flooded_by_500_strangers_computes_the_same_result() -> None:
    """benchmarks/recovery/flood.py, one round of a short job: alone, then under 500 concurrent strangers on rank 1's
    TCP and ipc endpoints; both runs finish and receive bitwise the same data (its timings are the benchmark's)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "recovery" / "flood.py"
    out = subprocess.run(
        [sys.executable, str(script), "--strangers", "500", "--rounds", "1", "--steps", "60"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout)["runs"]
    assert [r["strangers"] for r in runs] == [0, 500]
    assert runs[1]["connections"] > 0  # the strangers did connect while the job ran
    assert runs[0]["checksums"] == runs[1]["checksums"]
