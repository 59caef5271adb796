"""Measures a machine profile on this machine: message times per path, reduce and copy speed, layers of models.

What is measured, and how (every number is a median, so that one preempted repeat does not move it):

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
* **gamma** and **copy** (:func:`measure_reduce_copy`): ``np.add(a, b, out=c)`` and ``np.copyto`` on float32
  arrays of 4 MiB in this process, seconds per byte of one array.
* **models** (:func:`profile_model`): every layer (a module with trained parameters of its own, as
  :func:`paratrain.torch.layers.model_layers` defines it) timed inside real training steps of the model on a
  batch of its ``paratrain train`` dataset (SGD with momentum 0.9, as the training workers). Forward: from the
  module's forward pre-hook to its forward hook. Backward: from the moment the gradient of its output is
  computed (a tensor hook on the output) to the last of its own parameters' gradient accumulations and its
  input's gradient (post-accumulate-grad and tensor hooks). A layer that contains other layers (the
  transformer's embedding) is charged only its own time. Parameterless modules between layers (ReLU, pooling),
  the loss and autograd's bookkeeping fall in ``overhead_s``: the whole step less the layers and the optimizer.
  Fully-connected layers also record their shape (``out_features``, ``in_features``), which SFB's cost needs.
  ``concurrency`` N runs the profile in N processes at once under the launch library, started together by a
  barrier, with the intra-op threads a job of N workers gets (``OMP_NUM_THREADS``, cores / N): they share the
  cores as the N workers of a job on this machine do. Each layer's time is the median over the processes. One
  process alone with the same threads is timed first (``alone_s``): the two say how the cores are shared, so
  that the simulator can speed up a process that computes while the others wait (a pipeline's stages).

Run it through ``paratrain profile`` (:mod:`paratrain.cli.profile`); this module is also the worker the measuring
processes run (``python -m paratrain.bench.profile links|model ...``).

The measuring processes run this module itself (``python -m``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from paratrain.errors import ConfigError, ParatrainError
from paratrain.sim.machine import Cluster, LayerCost, LinkCost, MachineProfile, ModelProfile

if TYPE_CHECKING:
    import torch

    from paratrain.runtime.context import Context
    from paratrain.transport.base import Transport

__all__ = [
    "DEFAULT_SIZES",
    "PATHS",
    "ProfileError",
    "emulated_spec",
    "expected_max",
    "fit_hockney",
    "measure_machine",
    "measure_paths",
    "measure_reduce_copy",
    "profile_model",
]

#: Message sizes of the paths' ping-pongs when none are given: latency-bound to bandwidth-bound.
DEFAULT_SIZES = (0, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
#: The paths :func:`measure_paths` knows besides ``"emulated:<spec>"``.
PATHS = ("ipc", "tcp", "shm")
#: The largest message of an emulated path takes about this long on its link: slow links finish in seconds.
EMULATED_MESSAGE_S = 0.02
#: Seconds a rank's blocking call may wait for its peer before the measurement fails.
CALL_TIMEOUT_S = 60.0
#: What the measuring processes run (``python -m``): this module, wherever it lives.
_MODULE = __spec__.name if __spec__ is not None else __name__
_TAG = 0x5052  # the ping-pong's tag
#: The ring exchange's largest message: a ring step of the buckets this measures for is a fraction of a bucket.
RING_MAX_BYTES = 4 << 20
#: An emulated link that limits nothing, to time what the fault injector itself adds (its copies, its thread).
UNLIMITED_LINK = "bandwidth=1000Gbit"
_RING_STEPS = 8  # chained exchanges per timed run
_SETTLE = 100  # empty round trips before the first timed size
_TIME_FLOOR_S = 1e-9  # a relative fit weighs a measured time of 0 as 1 ns: no real message is faster


class ProfileError(ParatrainError, RuntimeError):
    """A measurement did not complete (a measuring process failed or ran past its deadline); its output says why."""


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


def _run_job(argv: list[str], *, nproc: int, faults: str | None, timeout: float, what: str) -> None:
    """Runs ``python -m paratrain.bench.profile ARGV`` in ``nproc`` ranks under the launch library; blocks.

    Raises:
        ProfileError: a rank failed or the job ran past ``timeout`` (the ranks' output, above, says why).
    """
    from paratrain.launch.procs import EXIT_TIMED_OUT
    from paratrain.launch.run import run_launch

    code = run_launch(
        ["python", "-m", _MODULE, *argv],
        nproc=nproc,
        faults=faults,
        timeout=min(CALL_TIMEOUT_S, timeout),
        deadline_s=timeout,
        stdout=sys.stderr,  # the ranks print only trouble; stdout is the table's
    )
    if code == EXIT_TIMED_OUT:
        raise ProfileError(f"measuring {what} took longer than {timeout:.0f}s and was stopped; try --quick")
    if code:
        raise ProfileError(f"measuring {what} failed (exit code {code}); the processes' errors are above")


def _read_json(path: pathlib.Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"measuring {what}: no result from the measuring process ({exc})") from None


def _write_json(path: pathlib.Path, data: Any) -> None:
    """Writes atomically: the parent never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


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
        _run_job(argv, nproc=nproc, faults=faults, timeout=timeout, what=what)
        data = _read_json(out, what)
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


# -- reduce and copy -----------------------------------------------------------------------------------------------


def measure_reduce_copy(*, nbytes: int = 4 << 20, repeats: int = 20) -> tuple[float, float]:
    """Seconds per byte of ``np.add(a, b, out=c)`` (gamma) and of ``np.copyto(c, a)`` (copy), in this process.

    Float32 arrays of ``nbytes`` (4 MiB: larger than a core's L2, as a gradient bucket is); a byte is a byte of one
    array. Blocks for about ``2 * repeats`` passes over the arrays (milliseconds).
    """
    a, b, c = (np.full(nbytes // 4, v, dtype=np.float32) for v in (1.0, 2.0, 0.0))
    np.add(a, b, out=c)  # first touch of c's pages is not what a reduce costs
    adds, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.add(a, b, out=c)
        t1 = time.perf_counter()
        np.copyto(c, a)
        copies.append(time.perf_counter() - t1)
        adds.append(t1 - t0)
    return statistics.median(adds) / c.nbytes, statistics.median(copies) / c.nbytes


# -- models ------------------------------------------------------------------------------------------------------


def _default_dataset(model: str) -> str:
    """The dataset ``paratrain train --model MODEL`` reads unless told otherwise (digits, or fortunes for text)."""
    from paratrain.train.models import MODEL_KINDS

    return "fortunes" if MODEL_KINDS.get(model) == "text" else "digits"


def _check_model(model: str, dataset: str, data_dir: str | None) -> None:
    """Refuses, before anything runs, a model or dataset that cannot be profiled here (with what to do)."""
    from paratrain.train.data import check_available
    from paratrain.train.extra import missing_train_extra
    from paratrain.train.models import check_model_dataset

    missing = missing_train_extra()
    if missing:
        raise ConfigError(f"profiling a model needs the 'train' extra: pip install 'paratrain[train]' ({missing})")
    check_model_dataset(model, dataset)
    check_available(dataset, data_dir=data_dir)


def _nested(names: Sequence[str]) -> dict[str, list[str]]:
    """Each layer's outermost layers inside it (the transformer's embedding holds the token embedding)."""

    def inside(inner: str, outer: str) -> bool:
        return inner != outer and (outer == "(root)" or inner.startswith(outer + "."))

    return {
        outer: [n for n in names if inside(n, outer) and not any(inside(n, m) and inside(m, outer) for m in names)]
        for outer in names
    }


class _Clock:
    """The hooks that time every layer within one step: inclusive windows, made exclusive by :meth:`step`."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str], params: Mapping[str, Sequence[Any]]) -> None:
        import functools

        modules = dict(model.named_modules())
        self.names, self.nested = list(names), _nested(names)
        self.output_bytes = dict.fromkeys(names, 0)
        self._fwd: dict[str, float] = {}
        self._open: dict[str, float] = {}
        self._bwd_start: dict[str, float] = {}
        self._bwd_end: dict[str, float] = {}
        self._handles: list[Any] = []
        for name in names:
            module = model if name == "(root)" else modules[name]
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._leave, name)))
            for p in params[name]:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._done, name)))

    @staticmethod
    def _tensors(value: Any) -> list[torch.Tensor]:
        import torch

        items = value if isinstance(value, tuple | list) else (value,)
        return [t for t in items if isinstance(t, torch.Tensor)]

    def _enter(self, name: str, module: Any, args: Any) -> None:
        self._open[name] = time.perf_counter()

    def _leave(self, name: str, module: Any, args: Any, output: Any) -> None:
        import functools

        self._fwd[name] = self._fwd.get(name, 0.0) + time.perf_counter() - self._open.pop(name)
        outputs = self._tensors(output)
        self.output_bytes[name] = sum(t.numel() * t.element_size() for t in outputs)
        for t in outputs:
            if t.requires_grad:
                t.register_hook(functools.partial(self._backward_starts, name))  # type: ignore[no-untyped-call]
        for t in self._tensors(args):
            if t.requires_grad:
                t.register_hook(functools.partial(self._done, name))  # type: ignore[no-untyped-call]

    def _backward_starts(self, name: str, grad: Any) -> None:
        self._bwd_start.setdefault(name, time.perf_counter())

    def _done(self, name: str, _: Any) -> None:
        self._bwd_end[name] = time.perf_counter()

    def step(self) -> dict[str, tuple[float, float]]:
        """Each layer's exclusive (forward, backward) seconds of the step just run; resets for the next."""
        fwd = dict(self._fwd)
        start, end = dict(self._bwd_start), dict(self._bwd_end)
        for name in reversed(self.names):  # inner layers come after their outer one: done first
            inner_ends = [end[n] for n in self.nested[name] if n in end]
            if inner_ends:
                end[name] = max([end.get(name, 0.0), *inner_ends])
        bwd = {n: end[n] - start[n] if n in start and n in end else 0.0 for n in self.names}
        times = {}
        for name in self.names:
            inner = self.nested[name]
            times[name] = (
                max(0.0, fwd.get(name, 0.0) - sum(fwd.get(n, 0.0) for n in inner)),
                max(0.0, bwd[name] - sum(bwd[n] for n in inner)),
            )
        self._fwd.clear()
        self._bwd_start.clear()
        self._bwd_end.clear()
        return times

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _profile_here(
    model_name: str,
    batch_size: int,
    *,
    dataset: str,
    data_dir: str | None,
    steps: int,
    warmup: int,
    barrier: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Times ``steps`` training steps after ``warmup`` in this process (threads as they are); medians, as JSON."""
    import torch

    from paratrain.torch.layers import model_layers
    from paratrain.train import tasks
    from paratrain.train.data import load_dataset
    from paratrain.train.models import build_model
    from paratrain.train.pipeline_worker import flat_layers

    data = load_dataset(dataset, data_dir=data_dir)
    index = np.arange(batch_size) % len(data.y_train)
    x, y = torch.from_numpy(data.x_train[index]), torch.from_numpy(data.y_train[index])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(model_name, side=data.side, classes=data.classes)
    shapes, linear = model_layers(model)  # linear: the fully-connected layers SFB can carry, by name
    names = [shape.name for shape in shapes]
    flat = {id(m): i for i, m in enumerate(flat_layers(model))}  # where a pipeline can cut, in order
    module_of = {n: flat.get(id(model.get_submodule(n)), -1) if n != "(root)" else -1 for n in names}
    qualified = [(q, p) for q, p in model.named_parameters() if p.requires_grad]
    owner = {q: (q.rpartition(".")[0] or "(root)") for q, _ in qualified}
    params = {name: [(q, p) for q, p in qualified if owner[q] == name] for name in names}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # as the training workers
    clock = _Clock(model, names, {n: [p for _, p in params[n]] for n in names})
    layer_times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    step_s, optimizer_s = [], []
    try:
        for i in range(warmup + steps):
            if i == warmup and barrier is not None:
                barrier()  # every process starts timing together: they share the cores from here on
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            tasks.loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            t1 = time.perf_counter()
            optimizer.step()
            t2 = time.perf_counter()
            times = clock.step()
            if i >= warmup:
                step_s.append(t2 - t0)
                optimizer_s.append(t2 - t1)
                for name in names:
                    layer_times[name].append(times[name])
    finally:
        clock.remove()
    layers = [
        {
            "name": name,
            "forward_s": statistics.median(f for f, _ in layer_times[name]),
            "backward_s": statistics.median(b for _, b in layer_times[name]),
            "params": [q for q, _ in params[name]],
            "param_bytes": [p.numel() * p.element_size() for _, p in params[name]],
            "output_bytes": clock.output_bytes[name],
            "out_features": linear[name].out_features if name in linear else 0,
            "in_features": linear[name].in_features if name in linear else 0,
            "module": module_of[name],
        }
        for name in names
    ]
    return {
        "layers": layers,
        "optimizer_s": statistics.median(optimizer_s),
        "step_s": statistics.median(step_s),
        "step_samples": step_s,
        "modules": len(flat),
        "input_bytes": x.numel() * x.element_size(),
        "threads": torch.get_num_threads(),
    }


def _combine(model: str, batch_size: int, runs: Sequence[Mapping[str, Any]]) -> ModelProfile:
    """One profile from every process's medians: the median over processes of each time."""

    def median(values: Sequence[float]) -> float:
        return float(statistics.median(values))

    layers = tuple(
        LayerCost(
            name=first["name"],
            forward_s=median([run["layers"][i]["forward_s"] for run in runs]),
            backward_s=median([run["layers"][i]["backward_s"] for run in runs]),
            params=tuple(first["params"]),
            param_bytes=tuple(int(b) for b in first["param_bytes"]),
            output_bytes=int(first["output_bytes"]),
            out_features=int(first.get("out_features", 0)),
            in_features=int(first.get("in_features", 0)),
            module=int(first.get("module", -1)),
        )
        for i, first in enumerate(runs[0]["layers"])
    )
    optimizer_s = median([run["optimizer_s"] for run in runs])
    layer_s = sum(layer.forward_s + layer.backward_s for layer in layers)
    overhead_s = max(0.0, median([run["step_s"] for run in runs]) - layer_s - optimizer_s)
    pooled = [float(x) for run in runs for x in run.get("step_samples", ())]
    straggle_s = expected_max(pooled, len(runs)) - median(pooled) if len(runs) > 1 and pooled else 0.0
    return ModelProfile(
        model=model,
        batch_size=batch_size,
        layers=layers,
        optimizer_s=optimizer_s,
        concurrency=len(runs),
        overhead_s=overhead_s,
        straggle_s=max(0.0, straggle_s),
        modules=int(runs[0].get("modules", 0)),
        input_bytes=int(runs[0].get("input_bytes", 0)),
    )


def expected_max(samples: Sequence[float], n: int) -> float:
    """The expected largest of ``n`` independent draws from the samples' empirical distribution: with the samples
    sorted, x_(i) is the largest with probability (i/m)^n - ((i-1)/m)^n. What a synchronous step of ``n``
    workers waits for, where each worker's step time is such a draw.

    Example:
        >>> expected_max([1.0, 2.0], 1), expected_max([1.0, 2.0], 2), expected_max([3.0] * 5, 4)
        (1.5, 1.75, 3.0)
    """
    if not samples or n < 1:
        raise ConfigError(f"expected_max needs samples and n >= 1, got {len(samples)} samples and n={n}")
    ordered, m = sorted(samples), len(samples)
    return sum(x * ((i / m) ** n - ((i - 1) / m) ** n) for i, x in enumerate(ordered, start=1))


def _steps(quick: bool) -> tuple[int, int]:
    """(warm-up, timed) steps of a model profile."""
    return (2, 5) if quick else (5, 30)


def profile_model(
    model_name: str,
    batch_size: int,
    concurrency: int = 1,
    *,
    dataset: str | None = None,
    data_dir: str | None = None,
    quick: bool = False,
    timeout: float = 600.0,
) -> ModelProfile:
    """Each layer's forward and backward time of a ``paratrain train`` model, measured here (module docstring).

    The steps run in this process first (its torch threads set for the time as each worker of a
    ``concurrency``-worker job gets them, then restored): with ``concurrency`` 1 that is the profile; above 1 it
    is the step alone (:attr:`ModelProfile.alone_s`), and then the layers are timed in that many processes at
    once, under the launch library, stopped after ``timeout`` seconds. Blocks for about 35 training steps (7 with
    ``quick``), twice above 1, plus the processes' start.

    Args:
        model_name: a ``paratrain train --model`` name.
        batch_size: examples per step (per worker).
        concurrency: processes measuring at once (the workers of the job the profile is for).
        dataset: the model's input (default: what ``paratrain train`` reads, digits or fortunes for text).
        data_dir: where the dataset's files are, as ``paratrain train --data-dir``.
        quick: fewer steps.
        timeout: seconds the processes may take (``concurrency`` > 1).

    Raises:
        ConfigError: unknown model, a model that cannot read the dataset, missing files or software, bad counts.
        ProfileError: a measuring process failed.
    """
    if batch_size < 1 or concurrency < 1:
        raise ConfigError(f"batch size and concurrency must be at least 1, got {batch_size} and {concurrency}")
    dataset = dataset or _default_dataset(model_name)
    _check_model(model_name, dataset, data_dir)
    warmup, steps = _steps(quick)
    alone = _profile_alone(
        model_name, batch_size, concurrency, dataset=dataset, data_dir=data_dir, steps=(warmup, steps)
    )
    if concurrency == 1:
        return _combine(model_name, batch_size, [alone])
    what = f"model {model_name} in {concurrency} processes"
    with tempfile.TemporaryDirectory(prefix="paratrain-profile-") as tmp:
        argv = ["model", "--model", model_name, "--batch-size", str(batch_size), "--dataset", dataset]
        argv += ["--steps", str(steps), "--warmup", str(warmup), "--out", tmp]
        argv += ["--data-dir", data_dir] if data_dir else []
        _run_job(argv, nproc=concurrency, faults=None, timeout=timeout, what=what)
        runs = [_read_json(pathlib.Path(tmp) / f"model-rank{r}.json", what) for r in range(concurrency)]
    return dataclasses.replace(_combine(model_name, batch_size, runs), alone_s=float(alone["step_s"]))


def _profile_alone(
    model_name: str, batch_size: int, concurrency: int, *, dataset: str, data_dir: str | None, steps: tuple[int, int]
) -> dict[str, Any]:
    """The model's steps in this process, alone on the machine, with the intra-op threads each process of a
    ``concurrency``-worker job gets (set for the time, then restored): the profile of a one-worker job, and,
    beside ``concurrency`` processes at once, how much the sharing of the cores slows each of them."""
    import torch

    from paratrain.launch.env import process_environment

    before = torch.get_num_threads()
    env = process_environment(os.environ, processes=concurrency)
    torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    try:
        warmup, timed = steps
        return _profile_here(model_name, batch_size, dataset=dataset, data_dir=data_dir, steps=timed, warmup=warmup)
    finally:
        torch.set_num_threads(before)


# -- everything ----------------------------------------------------------------------------------------------------


def measure_machine(
    *,
    paths: Sequence[str] = PATHS,
    emulate: Sequence[str] = (),
    models: Sequence[str] = (),
    batch_size: int = 64,
    concurrency: int = 1,
    dataset: str | None = None,
    data_dir: str | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    quick: bool = False,
    timeout: float = 300.0,
    say: Callable[[str], None] | None = None,
) -> MachineProfile:
    """A profile of this machine: the paths, gamma and copy, and each model at ``batch_size`` with ``concurrency``
    processes at once. Checks every model before measuring anything; arguments as in :func:`measure_paths` and
    :func:`profile_model`. Blocks for the measurements (seconds to a minute; ``quick``: a few seconds each).

    Raises:
        ConfigError: a bad argument (what to change). ProfileError: a measuring process failed.
    """
    say = say or (lambda line: None)
    datasets = {m: dataset or _default_dataset(m) for m in models}
    for model in models:
        _check_model(model, datasets[model], data_dir)
    links = measure_paths(
        paths, emulate=emulate, sizes=sizes, quick=quick, concurrency=concurrency, timeout=timeout, say=say
    )
    gamma, copy = measure_reduce_copy()
    profiles = []
    for model in models:
        say(f"profiling {model} at batch {batch_size} in {concurrency} process{'es' if concurrency > 1 else ''} ...")
        profiles.append(
            profile_model(
                model,
                batch_size,
                concurrency,
                dataset=datasets[model],
                data_dir=data_dir,
                quick=quick,
                timeout=timeout,
            )
        )
    cores = os.cpu_count() or 1
    inputs = ", ".join(f"{m} on {d}" for m, d in datasets.items())
    notes = f"paratrain profile{' --quick' if quick else ''} on {time.strftime('%Y-%m-%d %H:%M')}, {cores} cores" + (
        f"; models: {inputs}, threads per process as a job of {concurrency} workers" if models else ""
    )
    cluster = Cluster(cores_per_host=cores)
    machine = MachineProfile(socket.gethostname(), links, gamma, copy, cluster=cluster, notes=notes)
    for profile in profiles:
        machine = machine.with_model(profile)
    return machine


# -- the measuring processes (run by _run_job) -----------------------------------------------------------------------


def _links_main(args: argparse.Namespace) -> None:
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
            _write_json(pathlib.Path(args.out), result)
    finally:
        ctx.shutdown()


def _model_main(args: argparse.Namespace) -> None:
    import torch

    from paratrain.runtime.context import init

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))  # as paratrain.train.worker
    ctx = init()
    try:
        run = _profile_here(
            args.model,
            args.batch_size,
            dataset=args.dataset,
            data_dir=args.data_dir,
            steps=args.steps,
            warmup=args.warmup,
            barrier=ctx.barrier,
        )
        _write_json(pathlib.Path(args.out) / f"model-rank{ctx.rank}.json", run)
    finally:
        ctx.shutdown()


def _worker_main(argv: Sequence[str] | None = None) -> int:
    """One measuring process (a rank under the launch library); what it measures goes to ``--out`` as JSON."""
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    links = sub.add_parser(
        "links", help="ping-pongs between 2 ranks or a ring exchange of all; rank 0 writes (size, s) per kind"
    )
    links.add_argument("--kinds", required=True, help="p2p (the transport), shm and/or ring, comma-separated")
    links.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    links.add_argument("--repeats", required=True, help="timed round trips per size, comma-separated")
    links.add_argument("--warmup", type=int, default=5, help="untimed round trips per size first")
    links.add_argument("--separate-hosts", action="store_true", help="give each rank its own host id (TCP)")
    links.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    model = sub.add_parser("model", help="time the layers of a model; each rank writes model-rank<r>.json")
    model.add_argument("--model", required=True, help="a paratrain train model")
    model.add_argument("--batch-size", type=int, required=True, help="examples per step")
    model.add_argument("--dataset", required=True, help="the dataset whose input the model reads")
    model.add_argument("--data-dir", default=None, help="where the dataset's files are")
    model.add_argument("--steps", type=int, required=True, help="timed steps")
    model.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    model.add_argument("--out", required=True, help="the directory of the result files")
    args = parser.parse_args(argv)
    (_links_main if args.what == "links" else _model_main)(args)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
