"""Two emulated hosts for a benchmark: network namespaces joined by a veth pair, and the commands of a job placed
on them.

Why: on one machine every rank of a job shares the host, so its traffic takes the host's fastest path (ipc and
shared memory); what a job would do between machines needs ranks that cannot reach each other any other way than
over a network. Two network namespaces joined by a veth pair are that, with real TCP between them (the kernel's
full stack, as between hosts, though with no wire: the bound is the CPU, as for loopback). Each rank gets its
host's ``PARATRAIN_HOST_ID`` and reaches the others as a torchrun-started rank would (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` of rank 0's host, ``PARATRAIN_SERVERS`` for parameter servers), so no ipc or shared memory can be
taken between the hosts. Needs root and iproute2; :func:`unavailable` says why not, before anything is created.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

__all__ = ["TwoHosts", "placed_commands", "two_hosts", "unavailable"]


class TwoHosts(NamedTuple):
    """The namespaces of host 0 and host 1 and their addresses on the link between them."""

    namespaces: tuple[str, str]
    addresses: tuple[str, str]


def unavailable() -> str | None:
    """Why two emulated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "emulating two hosts needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "emulating two hosts needs iproute2's 'ip' (apt-get install iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Creates the two namespaces and their veth link (unshaped), and removes them on every way out.

    Raises:
        RuntimeError: they could not be created (the reason from ``ip``).
    """
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    tag = secrets.token_hex(3)
    names = (f"ptb{tag}0", f"ptb{tag}1")
    subnet = f"10.232.{int(tag[:2], 16)}"
    addresses = (f"{subnet}.1", f"{subnet}.2")
    try:
        try:
            for ns in names:
                _ip("netns", "add", ns)
            _ip("link", "add", f"vb{tag}0", "type", "veth", "peer", "name", f"vb{tag}1")
            for side, (ns, address) in enumerate(zip(names, addresses, strict=True)):
                _ip("link", "set", f"vb{tag}{side}", "netns", ns)
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", f"vb{tag}{side}")
                _ip("-n", ns, "link", "set", f"vb{tag}{side}", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            raise RuntimeError(f"cannot emulate two hosts: {exc} {detail.decode(errors='replace').strip()}") from None
        yield TwoHosts(names, addresses)
    finally:
        for ns in names:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=10)


def placed_commands(
    hosts: TwoHosts,
    argv: Sequence[str],
    placement: Sequence[int],
    *,
    servers: int = 0,
    env: Mapping[str, str] | None = None,
) -> list[tuple[list[str], dict[str, str]]]:
    """One ``(argv, env)`` per rank, rank ``r`` running ``argv`` on host ``placement[r]`` (0 or 1).

    ``argv[0] == "python"`` means this interpreter. ``servers``: the last ranks are parameter servers
    (``PARATRAIN_SERVERS``; their ``paratrain.init()`` serves instead of returning). Rank 0 hosts the rendezvous.
    """
    base = dict(os.environ if env is None else env)
    base.pop("PARATRAIN_NUM_SERVERS", None)
    port = 20000 + secrets.randbelow(20000)
    base.update(
        WORLD_SIZE=str(len(placement)),
        MASTER_ADDR=hosts.addresses[placement[0]],
        MASTER_PORT=str(port),
        PARATRAIN_SECRET=base.get("PARATRAIN_SECRET") or secrets.token_hex(32),
        PARATRAIN_RUN_ID=f"netns-{secrets.token_hex(4)}",
        PYTHONUNBUFFERED="1",
    )
    if servers:
        base["PARATRAIN_SERVERS"] = str(servers)
    else:
        base.pop("PARATRAIN_SERVERS", None)
    ip = shutil.which("ip") or "ip"
    program = [sys.executable, *argv[1:]] if argv and argv[0] == "python" else list(argv)
    commands = []
    for rank, host in enumerate(placement):
        local = [r for r, h in enumerate(placement) if h == host]
        rank_env = dict(
            base,
            RANK=str(rank),
            LOCAL_RANK=str(local.index(rank)),
            LOCAL_WORLD_SIZE=str(len(local)),
            PARATRAIN_HOST_ID=f"emulated-host-{host}",
            PARATRAIN_ADDR=hosts.addresses[host],
        )
        commands.append(([ip, "netns", "exec", hosts.namespaces[host], *program], rank_env))
    return commands
