"""A stranger against a job's listeners (a rank's TCP and ipc endpoints, the rendezvous): one handshake frame
declaring 1 GiB followed by up to 1 GiB of it, and a handshake that stalls after its greeting. Prints, as JSON, what
this process's memory grew by, how much the stranger got to send, and when each listener dropped it.

    python benchmarks/recovery/stranger.py > out.json     (run from the checkout to measure)
"""

from __future__ import annotations

import json
import sys
import time

from paratrain.testing import zmq_transports
from paratrain.transport.auth import new_secret
from paratrain.transport.probe import connect_raw, declared_frame, greeting
from paratrain.transport.rendezvous import RendezvousServer


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))


def oversized(endpoint: str, mechanism: bytes, limit_s: float = 60.0) -> dict[str, float]:
    before, peak, sent, start = rss_mib(), 0.0, 0, time.monotonic()
    sock = connect_raw(endpoint)
    sock.settimeout(5.0)
    chunk = bytes(1 << 20)
    outcome = "sent all"
    try:
        sock.sendall(greeting(mechanism) + declared_frame(1 << 30))
        while sent < 1024 and time.monotonic() - start < limit_s:
            sock.sendall(chunk)
            sent += 1
            peak = max(peak, rss_mib() - before)
    except OSError as exc:
        outcome = type(exc).__name__
    elapsed = time.monotonic() - start
    peak = max(peak, rss_mib() - before)
    sock.close()
    return {"sent_mib": sent, "rss_growth_mib": round(peak, 1), "seconds": round(elapsed, 2), "outcome": outcome}


def stalled(endpoint: str, mechanism: bytes) -> float:
    sock = connect_raw(endpoint)
    sock.sendall(greeting(mechanism))
    sock.settimeout(60.0)
    start = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
    sock.close()
    return round(time.monotonic() - start, 2)


def main() -> None:
    secret = new_secret()
    a, b = zmq_transports(2, timeout=60, secret=secret)
    server = RendezvousServer(world_size=1, bind_addr="127.0.0.1", port=0, timeout=600, secret=secret)
    server.start()
    ends = b.endpoints()
    listeners = {
        "rank tcp": (ends["tcp"], b"CURVE"),
        "rank ipc": (ends["ipc"], b"PLAIN"),
        "rendezvous": (f"tcp://127.0.0.1:{server.port}", b"CURVE"),
    }
    report = {}
    try:
        for name, (endpoint, mechanism) in listeners.items():
            report[name] = {
                "oversized": oversized(endpoint, mechanism),
                "stalled_dropped_after_s": stalled(endpoint, mechanism),
            }
    finally:
        server.close()
        a.close()
        b.close()
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
