"""Measures the message paths of a machine profile: one-way times per path and size, fitted by the Hockney model.

Every number is a median, so that one preempted repeat does not move it.

* **paths** (:func:`measure_paths`): one-way message times between two real processes started by the launch
  library (:func:`~paratrain.launch.run.run_launch`, as ``paratrain launch -n 2`` starts them), for each size of
  ``sizes``, fitted by :func:`fit_hockney`. ``"ipc"``, ``"tcp"`` and ``"emulated:<spec>"`` are ping-pongs over
  the job's transport: rank 0 sends a ``uint8`` array of ``n`` bytes, rank 1 sends back what it received, and
  half the round trip is the one-way time. ``"ipc"`` is the transport between ranks of one host; ``"tcp"`` the
  same ranks given different host ids (``PARATRAIN_HOST_ID``), so that they talk over loopback TCP as ranks of
  two hosts do, authenticated with CURVE as every job's TCP links are; ``"emulated:<spec>"`` the ranks of one
  host under the fault injector (``PARATRAIN_FAULTS``), so the emulated link plus the ipc transport under it and
  the injector's copy of every message, which is what ``paratrain train --faults`` runs on. ``"shm"`` is the
  collectives' shared-memory path (:class:`~paratrain.collectives.shm.ShmGroup`), timed as a ping-pong of
  broadcasts whose root alternates: a broadcast from rank 0 then one from rank 1 is a round trip in which each
  message is copied into the segment by its sender, signalled, and copied out by the receiver. Its alpha is
  therefore one call's bookkeeping plus a signal seen by the other process; its beta a byte copied in and out
  (arrays above the segment's 1 MiB block go through in blocks, the sender filling the next block while the
  receiver empties the last, so the copies of a long message partly overlap).
* **paths under load** (``concurrency`` N >= 2): a ping-pong between two processes of an idle machine is not
  what a job of N processes on shared cores sees: each rank's ZeroMQ and background threads then compete for
  the cores with N - 1 others, so a message costs more (on 2 cores, 4 processes: alpha about 1 ms instead of
  0.34 ms, and 5x the seconds per byte). ``"ipc@N"`` is therefore timed as the pattern the collectives
  produce: N processes, each sending to the next while it receives from the previous, steps chained without a
  barrier as a ring allreduce chains them; seconds per step, fitted as above. ``"injected@N"`` is the same
  under the fault injector with a link that limits nothing: ipc plus the injector's copy of every message and
  its scheduling thread, on which an emulated network's bandwidth and latency are then added.

The measuring processes run :func:`links_main` (``python -m paratrain.bench.profile links ...``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from paratrain.bench.profile_run import read_json, run_job, write_json
from paratrain.errors import ConfigError
from paratrain.sim.machine import LinkCost

if TYPE_CHECKING:
    from paratrain.runtime.context import Context
    from paratrain.transport.base import Transport

__all__ = [
    "DEFAULT_SIZES",
    "EMULATED_MESSAGE_S",
    "PATHS",
    "RING_MAX_BYTES",
    "UNLIMITED_LINK",
    "emulated_spec",
    "fit_hockney",
    "links_main",
    "measure_paths",
]

#: Message sizes of the paths' ping-pongs when none are given: latency-bound to bandwidth-bound.
DEFAULT_SIZES = (0, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
#: The paths :func:`measure_paths` knows besides ``"emulated:<spec>"``.
PATHS = ("ipc", "tcp", "shm")
#: The largest message of an emulated path takes about this long on its link: slow links finish in seconds.
EMULATED_MESSAGE_S = 0.02
_TAG = 0x5052  # the ping-pong's tag
#: The ring exchange's largest message: a ring step of the buckets this measures for is a fraction of a bucket.
RING_MAX_BYTES = 4 << 20
#: An emulated link that limits nothing, to time what the fault injector itself adds (its copies, its thread).
UNLIMITED_LINK = "bandwidth=1000Gbit"
_RING_STEPS = 8  # chained exchanges per timed run
_SETTLE = 100  # empty round trips before the first timed size
_TIME_FLOOR_S = 1e-9  # a relative fit weighs a measured time of 0 as 1 ns: no real message is faster


# -- the fit -----------------------------------------------------------------------------------------------------


def fit_hockney(sizes: Sequence[int], seconds: Sequence[float], *, relative: bool = True) -> LinkCost:
    """The Hockney model ``t = alpha + beta * n`` that fits measured one-way times best, with alpha, beta >= 0.

    Least squares; ``relative`` (the default) minimises relative rather than absolute errors (each residual
    divided by its measured time), because absolute errors of 16 MiB messages (milliseconds of noise) would
    otherwise swamp the microseconds of latency that the small messages measure. Where the fit gives a negative
    alpha (or beta), that one is set to 0 and the other fitted alone: a negative latency or bandwidth cost means
    noise, not physics.

    Args:
        sizes: message sizes in bytes (at least two distinct ones).
        seconds: the measured one-way time of each size.
        relative: minimise relative errors (True) or absolute ones.

    Raises:
        ValueError: lengths differ, a size or time is negative or not finite, or fewer than two distinct sizes.

    Example:
        >>> cost = fit_hockney([0, 1000, 2000], [10e-6, 20e-6, 30e-6])
        >>> round(cost.alpha * 1e6, 6), round(cost.beta * 1e9, 6)
        (10.0, 10.0)
    """
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"{len(sizes)} sizes but {len(seconds)} times; give one time per size")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t)) and np.all(n >= 0) and np.all(t >= 0)):
        raise ValueError("sizes and times must be finite and >= 0")
    if len(np.unique(n)) < 2:
        raise ValueError("a Hockney fit needs at least two distinct message sizes")
    w = 1.0 / np.maximum(t, _TIME_FLOOR_S) if relative else np.ones_like(t)  # each row's weight
    design = np.stack([w, n * w], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if alpha < 0:  # through the origin: beta = sum(w² n t) / sum(w² n²)
        alpha, beta = 0.0, float(np.sum(w * w * n * t) / np.sum(w * w * n * n))
    elif beta < 0:  # a constant: alpha = the weighted mean of t
        alpha, beta = float(np.sum(w * w * t) / np.sum(w * w)), 0.0
    return LinkCost(alpha=max(float(alpha), 0.0), beta=max(float(beta), 0.0))


# -- paths -------------------------------------------------------------------------------------------------------


def emulated_spec(text: str) -> str:
    """The fault spec of ``--emulate TEXT``: ``"100Mbit"`` is a bandwidth, ``"2ms"`` a latency, ``key=value``
    items (``latency=1ms,bandwidth=1Gbit``) pass as they are.

    Raises:
        ConfigError: not a link the fault injector can emulate, saying what is accepted.

    Example:
        >>> emulated_spec("100Mbit"), emulated_spec("latency=1ms, 1Gbit")
        ('bandwidth=100Mbit', 'latency=1ms,bandwidth=1Gbit')
    """
    from paratrain.config import parse_duration
    from paratrain.transport.faults import FaultSpec, parse_bandwidth

    items = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" not in item:
            for key, parse in (("bandwidth", parse_bandwidth), ("latency", parse_duration)):
                try:
                    parse(item)
                except ConfigError:
                    continue
                item = f"{key}={item}"
                break
            else:
                raise ConfigError(
                    f"--emulate {text!r}: {item!r} is neither a bandwidth (100Mbit, 1Gbit, 50MB) nor a latency "
                    "(2ms, 500us); or write key=value items: latency=1ms,bandwidth=1Gbit"
                )
        items.append(item)
    spec = ",".join(items)
    if not spec:
        raise ConfigError("--emulate needs a link, e.g. --emulate 100Mbit or --emulate latency=1ms,bandwidth=1Gbit")
    parsed = FaultSpec.parse(spec)
    if parsed.drop or parsed.crash_after is not None:
        raise ConfigError(f"--emulate {text!r}: a profile measures links, not faults; drop 'drop' and 'crash_after'")
    return spec


def _repeats(nbytes: int, quick: bool) -> int:
    """Timed round trips per size: many for latency-bound sizes (cheap), fewer as messages grow."""
    if nbytes <= 64 << 10:
        return 30 if quick else 200
    if nbytes <= 1 << 20:
        return 10 if quick else 50
    return 4 if quick else 20


def _ring_repeats(nbytes: int, quick: bool) -> int:
    """Timed runs of the ring exchange per size (each :data:`_RING_STEPS` steps)."""
    if nbytes <= 64 << 10:
        return 5 if quick else 15
    return 3 if quick else 7


def _emulated_plan(spec: str, sizes: Sequence[int], quick: bool) -> tuple[list[int], list[int]]:
    """Sizes and repeats for an emulated link: messages of at most :data:`EMULATED_MESSAGE_S` on it, and about
    half a second (0.2 s with ``quick``) of round trips per size."""
    from paratrain.transport.faults import FaultSpec

    link = FaultSpec.parse(spec)
    bandwidth = link.bandwidth or float("inf")
    kept = [n for n in sizes if n <= bandwidth * EMULATED_MESSAGE_S]
    if len(kept) < 2:
        kept = sorted(sizes)[:2]
    budget = 0.2 if quick else 0.5
    repeats = [max(3, min(_repeats(n, quick), int(budget / (2 * (link.latency + n / bandwidth) + 1e-4)))) for n in kept]
    return kept, repeats


def _link_job(
    kinds: Sequence[str],
    sizes: Sequence[int],
    repeats: Sequence[int],
    *,
    quick: bool,
    separate_hosts: bool = False,
    faults: str | None = None,
    nproc: int = 2,
    timeout: float,
    what: str,
) -> dict[str, list[tuple[int, float]]]:
    """One job of ``nproc`` processes timing ``kinds`` (``"p2p"``, ``"shm"``: ping-pongs of 2; ``"ring"``: the
    ring exchange of all); (size, seconds per message) per kind."""
    with tempfile.TemporaryDirectory(prefix="paratrain-profile-") as tmp:
        out = pathlib.Path(tmp) / "links.json"
        argv = ["links", "--out", str(out), "--kinds", ",".join(kinds)]
        argv += ["--sizes", ",".join(map(str, sizes)), "--repeats", ",".join(map(str, repeats))]
        argv += ["--warmup", "2" if quick else "5"] + (["--separate-hosts"] if separate_hosts else [])
        run_job(argv, nproc=nproc, faults=faults, timeout=timeout, what=what)
        data = read_json(out, what)
    return {kind: [(int(n), float(s)) for n, s in data[kind]] for kind in kinds}


def measure_paths(
    paths: Sequence[str] = PATHS,
    *,
    emulate: Sequence[str] = (),
    sizes: Sequence[int] = DEFAULT_SIZES,
    quick: bool = False,
    concurrency: int = 1,
    timeout: float = 300.0,
    say: Callable[[str], None] | None = None,
) -> dict[str, LinkCost]:
    """Hockney parameters of each path, measured between two processes of this machine (module docstring).

    Blocks for the jobs' time: a few seconds per path (``quick``: fewer repeats), each job stopped after
    ``timeout`` seconds. ``ipc`` and ``shm`` share one job, ``tcp`` and each emulated link have their own.
    With ``concurrency`` N >= 2 and ``ipc``, two more jobs of N processes time the ring exchange (every rank
    sends to the next while it receives from the previous, as a ring step does), plainly (``"ipc@N"``) and
    under the fault injector with an unlimited link (``"injected@N"``: what the injector adds, the base of
    every emulated network of N processes).

    Args:
        paths: any of :data:`PATHS`.
        emulate: links for the fault injector (:func:`emulated_spec`), measured as ``"emulated:<text>"``.
        sizes: message sizes in bytes; an emulated link keeps those that take at most
            :data:`EMULATED_MESSAGE_S` on it.
        quick: fewer round trips per size (a rough profile in seconds).
        timeout: seconds each job may run.
        say: progress lines.

    Raises:
        ConfigError: an unknown path, a bad emulated link, or shm where it is unsupported.
        ProfileError: a measuring process failed.
    """
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ConfigError(
            f"unknown path {', '.join(unknown)}; --paths takes {', '.join(PATHS)} (emulated links: --emulate SPEC)"
        )
    specs = {f"emulated:{text.strip()}": emulated_spec(text) for text in emulate}
    if "shm" in paths:
        from paratrain.collectives.shm import ShmGroup

        if not ShmGroup.supported():
            raise ConfigError(
                f"the shared-memory path is not supported on {platform.machine()}; leave shm out of --paths"
            )
    sizes = sorted(set(sizes))
    say = say or (lambda line: None)
    plain = [_repeats(n, quick) for n in sizes]
    samples: dict[str, list[tuple[int, float]]] = {}
    local = [p for p in ("ipc", "shm") if p in paths]
    if local:
        say(f"measuring {' and '.join(local)} (2 processes) ...")
        kinds = [{"ipc": "p2p", "shm": "shm"}[p] for p in local]
        got = _link_job(kinds, sizes, plain, quick=quick, timeout=timeout, what=" and ".join(local))
        samples |= {p: got[k] for p, k in zip(local, kinds, strict=True)}
    if "ipc" in paths and concurrency >= 2:
        ring_sizes = [n for n in sizes if n <= RING_MAX_BYTES]
        ring_repeats = [_ring_repeats(n, quick) for n in ring_sizes]
        for name, spec in ((f"ipc@{concurrency}", None), (f"injected@{concurrency}", UNLIMITED_LINK)):
            say(f"measuring {name} ({concurrency} processes in a ring{', fault injector' if spec else ''}) ...")
            got = _link_job(
                ["ring"],
                ring_sizes,
                ring_repeats,
                quick=quick,
                faults=spec,
                nproc=concurrency,
                timeout=timeout,
                what=name,
            )
            samples[name] = got["ring"]
    if "tcp" in paths:
        say("measuring tcp (2 processes, as two hosts on loopback) ...")
        tcp = _link_job(["p2p"], sizes, plain, quick=quick, separate_hosts=True, timeout=timeout, what="tcp")
        samples["tcp"] = tcp["p2p"]
    for name, spec in specs.items():
        kept, repeats = _emulated_plan(spec, sizes, quick)
        say(f"measuring {name} (2 processes, fault injector {spec}) ...")
        samples[name] = _link_job(["p2p"], kept, repeats, quick=quick, faults=spec, timeout=timeout, what=name)["p2p"]
    return {name: fit_hockney([n for n, _ in got], [s for _, s in got]) for name, got in samples.items()}


def _schedule(sizes: Sequence[int], repeats: Sequence[int], warmup: int) -> list[tuple[int, int, int]]:
    """(size, untimed, timed) round trips: first :data:`_SETTLE` empty ones, so that the first size reported meets
    a settled pair (the shared-memory path adapts its spin to the peer's pace; sockets warm their buffers)."""
    return [(0, _SETTLE, 0), *((n, warmup, count) for n, count in zip(sizes, repeats, strict=True))]


def _pingpong(transport: Transport, sizes: Sequence[int], repeats: Sequence[int], warmup: int) -> list[list[float]]:
    """Rank 0 sends, rank 1 echoes; rank 0's half round trips, median per size (rank 1 returns nothing)."""
    peer, first = 1 - transport.rank, transport.rank == 0
    result = []
    for n, untimed, timed in _schedule(sizes, repeats, warmup):
        buf = np.ones(n, dtype=np.uint8)
        times = []
        for _ in range(untimed + timed):
            if first:
                t0 = time.perf_counter()
                transport.send(peer, _TAG, [buf])
                transport.recv(peer, _TAG)
                times.append(time.perf_counter() - t0)
            else:
                transport.send(peer, _TAG, transport.recv(peer, _TAG).arrays)
        if first and timed:
            result.append([n, statistics.median(times[untimed:]) / 2])
    return result


def _ring(ctx: Context, sizes: Sequence[int], repeats: Sequence[int], warmup: int) -> list[list[float]]:
    """Every rank sends ``n`` bytes to the next while it receives from the previous, step after step with no
    barrier between steps (a ring allreduce's chain): rank 0's seconds per step, the median over ``repeats``
    runs of :data:`_RING_STEPS` steps, each run started together by a barrier."""
    transport, rank, size = ctx.transport, ctx.rank, ctx.world_size
    right, left = (rank + 1) % size, (rank - 1) % size
    result = []
    for n, untimed, timed in _schedule(sizes, repeats, warmup):
        buf = np.ones(n, dtype=np.uint8)
        runs = []
        for i in range(untimed + timed):
            ctx.barrier()
            t0 = time.perf_counter()
            for _ in range(_RING_STEPS):
                transport.isend(right, _TAG, [buf])
                transport.recv(left, _TAG)
            if i >= untimed:
                runs.append((time.perf_counter() - t0) / _RING_STEPS)
        if rank == 0 and timed:
            result.append([n, statistics.median(runs)])
    return result


def _shm_pingpong(ctx: Context, sizes: Sequence[int], repeats: Sequence[int], warmup: int) -> list[list[float]]:
    """A broadcast from rank 0 then one from rank 1 through a :class:`ShmGroup`: half of it, median per size."""
    from paratrain.collectives.shm import ShmGroup

    result = []
    with ShmGroup.from_context(ctx) as group:
        for n, untimed, timed in _schedule(sizes, repeats, warmup):
            buf = np.ones(n, dtype=np.uint8)
            times = []
            for _ in range(untimed + timed):
                t0 = time.perf_counter()
                group.broadcast_(buf, 0)
                group.broadcast_(buf, 1)
                times.append(time.perf_counter() - t0)
            if timed:
                result.append([n, statistics.median(times[untimed:]) / 2])
    return result


# -- the measuring process ---------------------------------------------------------------------------------------


def links_main(args: argparse.Namespace) -> None:
    """One rank of a links job (``--kinds``, ``--sizes``, ``--repeats``, ``--warmup``, ``--separate-hosts``,
    ``--out``): times each kind against its peers; rank 0 writes (size, seconds) per kind to ``--out``."""
    from paratrain.runtime.context import init

    env = dict(os.environ)
    if args.separate_hosts:  # as ranks of two hosts: TCP between them, no ipc, no shared memory
        env["PARATRAIN_HOST_ID"] = f"paratrain-profile-host{env.get('RANK', '0')}"
    sizes = [int(n) for n in args.sizes.split(",")]
    repeats = [int(n) for n in args.repeats.split(",")]
    ctx = init(env=env)
    try:
        result = {}
        for kind in args.kinds.split(","):
            if kind == "p2p":
                result[kind] = _pingpong(ctx.transport, sizes, repeats, args.warmup)
            elif kind == "ring":
                result[kind] = _ring(ctx, sizes, repeats, args.warmup)
            else:
                result[kind] = _shm_pingpong(ctx, sizes, repeats, args.warmup)
        if ctx.rank == 0:
            write_json(pathlib.Path(args.out), result)
    finally:
        ctx.shutdown()
