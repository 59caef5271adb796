"""Two emulated hosts (network namespaces joined by a veth pair): ranks find each other and talk over real TCP.

The link gets 2 ms of delay each way where the kernel has netem (this one does not: the qdisc is optional).
Skipped cleanly where creating network namespaces is not permitted (not root, or no iproute2).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str, str]]:
    """Namespaces (a, b) with addresses on one /24 link, shaped to 2 ms delay each way when netem exists."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = secrets.token_hex(3)
    ns_a, ns_b = f"pt{tag}a", f"pt{tag}b"
    subnet = f"10.231.{int(tag[:2], 16)}"
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
    except (subprocess.CalledProcessError, OSError) as exc:
        subprocess.run(["ip", "netns", "del", ns_a], capture_output=True, check=False)
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        _ip("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        for ns, side, host in ((ns_a, "a", 1), (ns_b, "b", 2)):
            _ip("link", "set", f"v{tag}{side}", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", f"v{tag}{side}")
            _ip("-n", ns, "link", "set", f"v{tag}{side}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # netem needs the kernel's sch_netem; where it is missing the link is unshaped (paratrain's own
            # fault injector emulates latency and bandwidth independently of the kernel)
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"v{tag}{side}", "root", "netem",
                 "delay", "2ms"],
                check=False, capture_output=True, timeout=10,
            )  # fmt: skip
        yield ns_a, ns_b, f"{subnet}.1", f"{subnet}.2"
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=10)


def test_two_hosts_over_tcp_with_latency(tmp_path: Path, two_hosts: tuple[str, str, str, str]) -> None:
    ns_a, ns_b, addr_a, _ = two_hosts
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import time
        import numpy as np
        import paratrain as pt
        ctx = pt.init(timeout=30)
        t = ctx.transport
        peer = 1 - ctx.rank
        t0 = time.perf_counter()
        for _ in range(5):
            ctx.barrier()
        barrier_ms = (time.perf_counter() - t0) / 5 * 1e3
        data = np.arange(1 << 18, dtype=np.float32) * (ctx.rank + 1)
        t.send(peer, 1, [data])
        got = t.recv(peer, 1).arrays[0]
        assert np.array_equal(got, np.arange(1 << 18, dtype=np.float32) * (peer + 1))
        info = t._peer_info[peer]
        print(f"rank {ctx.rank}: peer at {info['tcp']} barrier {barrier_ms:.1f} ms ok", flush=True)
        pt.shutdown()
    """)
    )
    env = dict(
        os.environ, WORLD_SIZE="2", MASTER_ADDR=addr_a, MASTER_PORT="29400", PARATRAIN_SECRET=secrets.token_hex(32)
    )
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(script)],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, ns in enumerate((ns_a, ns_b))
    ]
    try:
        outs = [p.communicate(timeout=45) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert "ok" in out
    # each rank reached the other over TCP on the emulated link, not over ipc
    assert "tcp://10.231." in outs[0][0] and "tcp://10.231." in outs[1][0]
    print(outs[0][0], outs[1][0])
