"""The harness every ``paratrain bench`` comparison shares: options, engines run under a deadline, rounds.

A comparison runs several engines (paratrain and its anchors) on the same sizes, one after the other so that
they never share the cores, and with ``--repeat R`` R times, interleaved, so that a slow period of the machine
hits every engine alike. Every engine's processes run through the launch library with one deadline; they write
one JSON file per rank (:func:`paratrain.bench._timing.write_result`), which the harness collects. A benchmark
module adds only what is its own: its engines' commands, its columns (``summarize``), and its table.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TextIO

from paratrain.errors import ConfigError
from paratrain.launch.procs import EXIT_TIMED_OUT, Outcome
from paratrain.launch.run import run_commands, run_launch

__all__ = [
    "GRACE_S",
    "EngineRun",
    "Rounds",
    "SizedOptions",
    "Step",
    "collect",
    "exit_code",
    "judge",
    "launch_job",
    "parse_size",
    "parse_sizes",
    "require_at_least_one",
    "run_job",
    "run_rounds",
    "worker_args",
]

#: Seconds a stopped engine gets between SIGTERM and SIGKILL; workers give up this long before ``--timeout``.
GRACE_S = 3.0

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")
_MAX_BYTES = 4 << 30
_STOP_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``1024``, ``4KiB``/``4K`` (x1024), ``16MB`` (x1000); case-insensitive.

    The size must be a positive multiple of 4 (float32 elements) of at most 4 GiB.

    Raises:
        ValueError: with a message saying what is accepted.

    Example:
        >>> parse_size("4KiB"), parse_size("16MB"), parse_size("1024")
        (4096, 16000000, 1024)
    """
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"bad size {text!r}: use a whole number with an optional unit, e.g. 1024, 4KiB, 4K, 1MiB, 16MB "
            "(K/KiB/M/MiB/G/GiB are powers of 1024; KB/MB/GB powers of 1000)"
        )
    nbytes = int(match.group(1)) * _UNITS[unit or ""]
    if nbytes <= 0 or nbytes % 4:
        raise ConfigError(f"bad size {text!r}: must be a positive multiple of 4 bytes (float32 elements)")
    if nbytes > _MAX_BYTES:
        raise ConfigError(f"bad size {text!r}: at most 4 GiB per buffer")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of :func:`parse_size` sizes, in the order given, duplicates removed.

    Example:
        >>> parse_sizes("4KiB, 1MiB")
        [4096, 1048576]
    """
    sizes: list[int] = []
    for part in text.split(","):
        if not part.strip():
            continue
        nbytes = parse_size(part)
        if nbytes not in sizes:
            sizes.append(nbytes)
    if not sizes:
        raise ConfigError("no sizes given; e.g. --sizes 4KiB,1MiB,16MiB")
    return sizes


def require_at_least_one(options: object, *names: str) -> None:
    """Refuses options whose named counts are below 1, naming the flag (``batch_size`` is ``--batch-size``).

    Raises:
        ConfigError: (a ``ValueError``) for the first such option; a count that is None (unset) passes.

    Example:
        >>> from types import SimpleNamespace
        >>> require_at_least_one(SimpleNamespace(batch_size=0), "batch_size")
        Traceback (most recent call last):
        paratrain.errors.ConfigError: --batch-size must be at least 1, got 0
    """
    for name in names:
        value = getattr(options, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SizedOptions:
    """What every size-sweeping benchmark takes; a benchmark's options add their own fields and checks.

    Attributes:
        sizes: message or key sizes in bytes.
        iters: timed iterations per size (None: :meth:`iters_for` picks, from ``SMALL_ITERS`` down to 10).
        warmup: untimed iterations per size.
        repeat: run every engine this many times, interleaved, and report the median run.
        timeout: seconds each engine's job may run before its processes are stopped.
    """

    #: Timed iterations of a size up to 64 KiB when ``--iters`` is not given (latency-bound: many are cheap).
    SMALL_ITERS: ClassVar[int] = 300

    sizes: tuple[int, ...]
    iters: int | None = None
    warmup: int = 3
    repeat: int = 1
    timeout: float = 300.0

    def __post_init__(self) -> None:
        require_at_least_one(self, "iters")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        require_at_least_one(self, "repeat")
        if self.timeout <= 0:
            raise ConfigError(f"--timeout must be positive, got {self.timeout}")

    def iters_for(self, nbytes: int) -> int:
        """Timed iterations for a size: ``iters``, or enough for a stable mean in about a second of work.

        Example:
            >>> SizedOptions(sizes=(4,)).iters_for(4), SizedOptions(sizes=(4,)).iters_for(64 << 20)
            (300, 10)
        """
        if self.iters is not None:
            return self.iters
        if nbytes <= 64 << 10:
            return self.SMALL_ITERS
        if nbytes <= 1 << 20:
            return 100
        if nbytes <= 16 << 20:
            return 30
        return 10

    def deadline_s(self) -> float:
        """How long an engine's job may run: ``timeout``, and time for its workers' own watchdogs to act first."""
        return self.timeout + 2 * GRACE_S


def worker_args(options: SizedOptions, out_dir: str) -> list[str]:
    """The arguments every benchmark worker takes (:func:`paratrain.bench._timing.add_worker_args`).

    The workers' own deadline is ``GRACE_S`` before ``--timeout``, so that a hung worker exits 124 and writes
    why before its job is stopped from outside.
    """
    return [
        "--sizes",
        ",".join(str(s) for s in options.sizes),
        "--iters",
        ",".join(str(options.iters_for(s)) for s in options.sizes),
        "--warmup",
        str(options.warmup),
        "--out",
        out_dir,
        "--deadline",
        str(max(options.timeout - GRACE_S, 1.0)),
    ]


@dataclass(slots=True)
class EngineRun:
    """What one engine's job gave: ``status`` ``"ok"``, ``"skipped"`` or ``"error"``, why, and the ranks' JSON."""

    status: str
    detail: str
    payloads: list[dict[str, Any]] = field(default_factory=list)


def collect(out_dir: str, engine: str, count: int, *, who: str = "rank") -> EngineRun:
    """Reads ``{engine}-rank{i}.json`` of ranks ``0..count-1``; an error if one is missing or says it failed."""
    payloads = []
    for rank in range(count):
        path = os.path.join(out_dir, f"{engine}-rank{rank}.json")
        try:
            with open(path, encoding="utf-8") as fh:
                payloads.append(json.load(fh))
        except (OSError, ValueError):
            why = "it failed, or ran past --timeout: see its output above"
            return EngineRun("error", f"{who} {rank} wrote no result ({why})")
    errors = [f"{who} {p['rank']}: {p.get('error', '?')}" for p in payloads if p.get("status") != "ok"]
    if errors:
        return EngineRun("error", "; ".join(errors))
    return EngineRun("ok", "", payloads)


def judge(runs: Mapping[str, EngineRun], problem: str | None) -> dict[str, EngineRun]:
    """The engines' runs of one job, given what went wrong with the job (None: it ended well).

    A failed engine's detail says what happened to the job too. An engine whose ranks all wrote results still
    fails when its job did not end well, unless another engine of the same job failed, which explains it (one
    job may time several engines, e.g. the allreduce API and the shared-memory path).
    """
    if problem is None:
        return dict(runs)
    explained = any(run.status != "ok" for run in runs.values())
    judged = {}
    for name, run in runs.items():
        if run.status != "ok":
            judged[name] = EngineRun(run.status, f"{problem}: {run.detail}")
        elif explained:
            judged[name] = run
        else:
            judged[name] = EngineRun("error", f"{problem} after every process wrote its result")
    return judged


def _stop_if_interrupted(code: int) -> None:
    """Ctrl-C (or SIGTERM) stopped the engine's processes: stop the whole benchmark too, with the shell's code."""
    if code in _STOP_CODES:
        raise SystemExit(code)


def _timed_out(timeout: float) -> str:
    return f"still running after {timeout:.0f}s (--timeout); stopped"


def run_job(
    commands: Sequence[tuple[Sequence[str], Mapping[str, str]]],
    *,
    timeout: float,
    deadline_s: float,
    stdout: TextIO | None = None,
) -> str | None:
    """Runs the commands as one job (:func:`~paratrain.launch.run.run_commands`); what went wrong, or None.

    ``timeout`` is the ``--timeout`` the user gave (for the message); ``deadline_s`` when the job is stopped.
    """
    outcome: Outcome = run_commands(commands, deadline_s=deadline_s, grace_s=GRACE_S, stdout=stdout)
    _stop_if_interrupted(outcome.exit_code)
    if outcome.timed_out:
        return _timed_out(timeout)
    if outcome.first_failure is not None:
        return f"{outcome.first_failure.name} {outcome.first_failure.cause}"
    return None if outcome.exit_code == 0 else f"the job exited {outcome.exit_code}"


def launch_job(
    cmd: Sequence[str],
    *,
    nproc: int,
    servers: int = 0,
    replicas: int = 1,
    timeout: float,
    deadline_s: float,
    stdout: TextIO | None = None,
) -> str | None:
    """Runs ``cmd`` under :func:`~paratrain.launch.run.run_launch` (ranks unprefixed); what went wrong, or None.

    ``timeout`` is also the ranks' ``PARATRAIN_TIMEOUT``, so that a blocking call gives up before the deadline.
    """
    try:
        code = run_launch(
            cmd,
            nproc=nproc,
            servers=servers,
            replicas=replicas,
            prefix=False,
            timeout=timeout,
            grace=GRACE_S,
            deadline_s=deadline_s,
            stdout=stdout,
        )
    except (ConfigError, OSError) as exc:
        return f"paratrain launch failed to start: {exc}"
    _stop_if_interrupted(code)
    if code == EXIT_TIMED_OUT:
        return _timed_out(timeout)
    return None if code == 0 else f"paratrain launch exited {code}"


@dataclass(frozen=True, slots=True)
class Step:
    """One engine job of a round.

    Attributes:
        labels: the result labels the job yields (one job may time several engines); if one of them failed in
            an earlier round, the job is not run again.
        describe: the progress line, e.g. ``"gloo: torch.distributed all_reduce, 2 processes"``.
        run: runs the job, writing its ranks' results under the given directory; returns runs by label.
    """

    labels: tuple[str, ...]
    describe: str
    run: Callable[[str], Mapping[str, EngineRun]]


@dataclass(slots=True)
class Rounds:
    """What the rounds gave: every label's status and detail, and per label one list of rows per good round."""

    engines: dict[str, dict[str, str]]
    rows: dict[str, list[list[dict[str, Any]]]]


def run_rounds(
    steps: Sequence[Step],
    *,
    repeat: int,
    summarize: Callable[[str, list[dict[str, Any]]], list[dict[str, Any]]],
    say: Callable[[str], None],
    tmp_prefix: str = "paratrain-bench-",
) -> Rounds:
    """Runs every step ``repeat`` times, interleaved (round 1 runs every step once, then round 2, ...).

    Blocks for as long as the jobs take (each is bounded by its own deadline). Progress goes to ``say``:
    ``[run r/R] [i/n] <describe>`` before each job, and a line for each engine that failed or was skipped.
    """
    engines: dict[str, dict[str, str]] = {}
    rows: dict[str, list[list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as root:
        for rep in range(repeat):
            out_dir = os.path.join(root, f"run{rep}")
            os.mkdir(out_dir)
            prefix = f"[run {rep + 1}/{repeat}] " if repeat > 1 else ""
            for index, step in enumerate(steps, 1):
                if any(engines.get(label, {}).get("status") == "error" for label in step.labels):
                    continue  # failed in an earlier run: do not try again
                say(f"{prefix}[{index}/{len(steps)}] {step.describe}")
                for label, run in step.run(out_dir).items():
                    engines[label] = {"status": run.status, "detail": run.detail}
                    if run.status == "ok":
                        rows.setdefault(label, []).append(summarize(label, run.payloads))
                    else:
                        say(f"    {label}: {run.status}: {run.detail}")
    return Rounds(engines, rows)


def exit_code(engines: Mapping[str, Mapping[str, str]]) -> int:
    """1 if an engine failed (a skipped anchor is not a failure), else 0."""
    return 1 if any(info["status"] == "error" for info in engines.values()) else 0
