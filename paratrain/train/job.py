"""A training job as one description: every option of ``paratrain train``, its default and its help, in one place.

:class:`TrainJob` is a frozen dataclass. The command line is derived from it (:func:`add_job_options`: each flag
declared once, by its field), the checks across options take it whole (:func:`paratrain.train.checks.validate`),
the run writes it into the run directory as JSON and every rank reads it back from there
(:meth:`TrainJob.to_json`, :meth:`TrainJob.from_json`); benchmarks and ``paratrain plan`` build jobs directly.
Nothing re-serialises a job as flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.launch.kills import HELP as KILL_HELP
from paratrain.strategy import parse_strategy
from paratrain.train import stragglers
from paratrain.train.data import DATASETS
from paratrain.train.models import MODELS

__all__ = [
    "JOB_FILE",
    "PROBE_EXAMPLES",
    "TrainJob",
    "add_job_options",
    "epoch_steps",
    "parse_byte_size",
    "read_job",
    "run_dir_of",
    "worker_job",
    "write_job",
]

#: The job's description in its run directory, which every rank reads.
JOB_FILE = "job.json"

#: Test examples a ``--eval-every`` probe evaluates (a fixed prefix of the test set: the same for every run).
PROBE_EXAMPLES = 2000

_BOTH = ("train", "compare")  # the commands whose flags a field is
_TRAIN = ("train",)


def parse_byte_size(text: str) -> int:
    """``"4MiB"``, ``"512KiB"``, ``"1MB"``, ``"262144"`` -> bytes (for ``--bucket-bytes``).

    Example:
        >>> parse_byte_size("4MiB"), parse_byte_size("262144")
        (4194304, 262144)
    """
    units = {"": 1, "b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2, "gb": 1000**3, "gib": 1024**3}
    value = text.strip().lower()
    number = value.rstrip("abgikm")
    try:
        size = int(float(number) * units[value[len(number) :]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4MiB, 512KiB or 262144") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {text!r}")
    return size


def _option(default: Any, help: str, *, commands: tuple[str, ...] = _BOTH, **argparse_options: Any) -> Any:
    """A job field and its flag: ``--name-with-dashes``, ``help``, and argparse's other options (``type`` is
    read off the field's annotation where not given)."""
    return field(default=default, metadata={"help": help, "commands": commands, "argparse": argparse_options})


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """One local training job: what ``paratrain train`` runs, with every option's default.

    Options that :func:`~paratrain.train.checks.validate` fills in (``workers``; ``stages`` for a pipeline) are
    None until then. The order of the fields is the order of ``paratrain train --help``.

    Example:
        >>> job = TrainJob(model="lenet", epochs=2)
        >>> TrainJob.from_json(job.to_json()) == job
        True
    """

    model: str = _option("mlp", f"{', '.join(MODELS)} (default mlp; transformer is for text: fortunes)")
    dataset: str = _option(
        "digits", f"{', '.join(DATASETS)} (default digits, bundled; fashion-mnist and fortunes are Debian packages)"
    )
    data_dir: str | None = _option(None, "directory of the Fashion-MNIST IDX files or of the fortunes files")
    strategy: str = _option(
        "allreduce",
        "allreduce, bsp, ssp:S, asp, gossip:TOPOLOGY, pipeline:gpipe|1f1b|pipedream[-vsync], poseidon[:allreduce], "
        "sfb, tp:N or soap:FILE (default allreduce)",
        commands=_TRAIN,  # compare takes --strategies
    )
    epochs: int = _option(10, "passes over the training set (default 10)")
    batch_size: int = _option(
        64, "examples per worker (a pipeline: per pipeline; split layers: per tensor group) per step (default 64)"
    )
    steps_per_epoch: int = _option(
        0,
        "cut each epoch to its first N steps (a fresh shuffle each epoch), for slow networks and wide models: "
        "test accuracy is measured every N steps (default 0: whole epochs)",
        metavar="N",
    )
    device: str = _option(
        "cpu",
        "where each worker trains (default cpu); cuda: worker LOCAL_RANK on GPU LOCAL_RANK modulo the GPUs "
        "there are (workers share a GPU where there are fewer); not for pipelines (Pipe(device=...) places stages)",
        choices=("cpu", "cuda"),
    )
    lr: float = _option(0.05, "learning rate of SGD with momentum 0.9 (0.05)")
    seed: int = _option(0, "seed of initialisation and shuffling (default 0)")
    eval_every: int = _option(
        0,
        f"also probe test accuracy every K steps on the first {PROBE_EXAMPLES:,} test examples, for "
        "time-to-accuracy at a finer grain than epochs; probe time is excluded from training time (default 0: off)",
        metavar="K",
    )
    no_overlap: bool = _option(
        False,
        "no wait-free backprop: send gradients in step() after backward (gossip: a step's parameters in the "
        "next step()), to measure what overlap saves",
    )
    bucket_bytes: int | None = _option(
        None,
        "fusion size of the gradient buckets, e.g. 1MiB or 262144 (default 4MiB; `paratrain plan` predicts the "
        "best for a model and network)",
        type=parse_byte_size,
        metavar="SIZE",
    )
    compression: str | None = _option(
        None,
        "compress the gradients allreduce or the parameter servers carry: fp16, bf16, topk:R (a ratio, with "
        "error feedback), dgc:R (top-k with DGC's momentum correction, allreduce only) or powersgd:R (a rank, "
        "allreduce only) (default: none)",
        metavar="SCHEME",
    )
    layer_scheme: tuple[str, ...] | None = _option(
        None,
        "poseidon, poseidon:allreduce and sfb: send this layer by sfb or dense (ps/allreduce) instead of what "
        "the cost model picks, e.g. --layer-scheme 1=sfb (repeatable; layer names as in model.named_modules())",
        action="append",
        metavar="LAYER=SCHEME",
    )
    workers: int | None = _option(
        None, "worker processes (default 2; for pipelines stages x replicas; tp:N: N, or a multiple of it)"
    )
    servers: int | None = _option(None, "parameter servers for bsp/ssp/asp (default 1)")
    straggler: str | None = _option(None, stragglers.HELP)
    faults: str | None = _option(None, "emulated network and faults, e.g. latency=2ms,bandwidth=100Mbit,drop=0.01")
    latency: str | None = _option(None, "emulated one-way latency of every message, e.g. 2ms")
    bandwidth: str | None = _option(None, "emulated link of every process (in and out), e.g. 100Mbit")
    stages: int | None = _option(None, "pipelines: K stages, one process each (default: workers / replicas)")
    microbatches: int = _option(4, "pipelines: M micro-batches per mini-batch (default 4)")
    replicas: int = _option(
        1,
        "pipelines: R pipelines side by side, each stage's copies summing gradients; bsp/ssp/asp: R servers "
        "hold each parameter chunk (primary-backup), so the job survives R - 1 server deaths (default 1)",
    )
    balance: str = _option(
        "auto", "pipelines: layers per stage, e.g. 3,3 or 'auto' (profile every layer, split evenly; default auto)"
    )
    checkpoint: bool = _option(
        False, "pipelines: re-materialisation: keep only each stage's inputs, recompute in the backward"
    )
    kill: str | None = _option(None, KILL_HELP.replace("--kill-seed", "--seed"), metavar="SCHEDULE")
    run_dir: str | None = _option(None, "where to write the run (default runs/<time>-<strategy>)", commands=_TRAIN)
    json: str | None = _option(None, "also write the summary to this JSON file", commands=_TRAIN)
    max_restarts: int = _option(
        0,
        "allreduce: restart a crashed worker (up to R times in all); it recovers the model from the others' "
        "memory and replays, the others go on, and the result equals the fault-free run's to the bit. bsp/ssp/asp: "
        "restart a crashed worker, which rejoins the servers at its clock (bsp: bitwise the fault-free run); with "
        "--replicas 2, restart a dead parameter server too, which catches up from its chunks' other replicas. "
        "gossip: restart a crashed worker, which receives its state from its buddy's memory; every worker rolls "
        "back to the newest checkpoint all hold (bitwise the fault-free run). pipelines: the same for a stage, whose "
        "state the next stage (or its twin with --replicas) keeps (default 0)",
        commands=_TRAIN,
        metavar="R",
    )
    checkpoint_every: int = _option(
        10,
        "with --max-restarts, --min-workers or --checkpoint-dir: steps between checkpoints (in memory, and "
        "on disk with --checkpoint-dir), where joiners are admitted too (default 10)",
        commands=_TRAIN,
        metavar="K",
    )
    checkpoint_dir: str | None = _option(
        None,
        "allreduce: also write every checkpoint to DIR/checkpoint.npz; the same command run again after "
        "the whole job died resumes from it (the final model is the uninterrupted run's)",
        commands=_TRAIN,
        metavar="DIR",
    )
    no_spare: bool = _option(
        False,
        "with --max-restarts: start a restarted worker cold instead of from a warm spare process",
        commands=_TRAIN,
    )
    min_workers: int = _option(
        0,
        "allreduce, elastic: a worker that dies with no warm spare ready is dropped and the others go on "
        "while M remain, each taking more of every step's examples (the global batch stays the launched one); "
        "with --max-restarts its cold replacement joins at the next checkpoint (default 0: not elastic)",
        commands=_TRAIN,
        metavar="M",
    )

    # -- derived

    def reporting_rank(self) -> int:
        """The rank whose metrics are the job's loss and accuracy: rank 0, or for a pipeline the last stage of
        pipeline 0 (the stage that computes the loss and holds the outputs)."""
        return (self.stages or 1) - 1 if parse_strategy(self.strategy).pipelined else 0

    def network(self) -> str | None:
        """The fault spec every rank gets: ``--faults`` plus ``--latency`` and ``--bandwidth`` (None: real network).

        Raises:
            ConfigError: a key given twice (``--latency`` and ``--faults latency=...``), or a bad value.
        """
        from paratrain.transport.faults import FaultSpec

        parts = [p.strip() for p in (self.faults or "").split(",") if p.strip()]
        given = {p.partition("=")[0].strip() for p in parts}
        for key in ("latency", "bandwidth"):
            value = getattr(self, key)
            if value is None:
                continue
            if key in given:
                raise ConfigError(f"--{key} and --faults {key}=... both given; keep one")
            parts.append(f"{key}={value}")
        if not parts:
            return None
        spec = ",".join(parts)
        FaultSpec.parse(spec)
        return spec

    def replace(self, **changes: Any) -> TrainJob:
        """A copy with ``changes`` (field names) applied."""
        return dataclasses.replace(self, **changes)

    # -- in and out

    def to_json(self) -> str:
        """The job as a JSON object of every field (what a run directory's ``job.json`` holds)."""
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainJob:
        """The job a :meth:`to_json` text describes.

        Raises:
            ConfigError: not a JSON object, or a key that is no option of the job.
        """
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"a job description must be JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ConfigError("a job description is a JSON object of its options")
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TrainJob:
        """The job of ``values`` (option name -> value; the others keep their defaults).

        Raises:
            ConfigError: a name that is no option of the job.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"no training option is called {', '.join(unknown)}")
        given = dict(values)
        if given.get("layer_scheme") is not None:
            given["layer_scheme"] = tuple(given["layer_scheme"])
        return cls(**given)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainJob:
        """The job of parsed command-line options (those of :func:`add_job_options`; other attributes ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls.from_mapping({k: v for k, v in vars(args).items() if k in names})


def _type_of(annotation: str) -> Callable[[str], Any] | None:
    """argparse's ``type`` for a field annotated ``annotation`` (a string: annotations are postponed)."""
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return None


def add_job_options(parser: argparse.ArgumentParser, command: str = "train") -> None:
    """Adds the flags of ``command`` (``train`` or ``compare``) that set a :class:`TrainJob`'s fields, in field
    order: ``--batch-size`` for ``batch_size``, a switch for a bool, a repeatable flag for a tuple."""
    for f in dataclasses.fields(TrainJob):
        meta = f.metadata
        if command not in meta["commands"]:
            continue
        options: dict[str, Any] = {"default": f.default, "help": meta["help"], **meta["argparse"]}
        if isinstance(f.default, bool):
            options["action"] = "store_true"
        elif "type" not in options and "action" not in options and (kind := _type_of(str(f.type))) is not None:
            options["type"] = kind
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, **options)


def run_dir_of(job: TrainJob) -> str:
    """The job's run directory (a rank's records go there).

    Raises:
        ConfigError: the job names none (``paratrain train`` always writes one into the job it starts).
    """
    if job.run_dir is None:
        raise ConfigError("this job names no run directory; start it with paratrain train (or set run_dir)")
    return job.run_dir


def write_job(job: TrainJob, run_dir: str | Path) -> Path:
    """Writes ``job`` into ``run_dir`` as :data:`JOB_FILE`, where every rank reads it; returns its path."""
    path = Path(run_dir) / JOB_FILE
    path.write_text(job.to_json(), encoding="utf-8")
    return path


def read_job(path: str | Path) -> TrainJob:
    """The job :func:`write_job` wrote at ``path`` (what a rank starts from).

    Raises:
        ConfigError: the file is missing or holds no job.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the job's description {str(path)!r}: {exc.strerror or exc}") from None
    return TrainJob.from_json(text)


def worker_job(argv: list[str] | None, description: str | None) -> tuple[TrainJob, bool]:
    """A worker's command line (``--job FILE [--quiet]``, as :mod:`paratrain.train.run` starts every worker kind):
    the job it reads, and whether it keeps quiet (``paratrain train`` prints the epochs' lines itself)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--job", required=True, help=f"the job's description ({JOB_FILE} in its run directory)")
    parser.add_argument("--quiet", action="store_true", help="no line per epoch (paratrain train prints them itself)")
    args = parser.parse_args(argv)
    return read_job(args.job), bool(args.quiet)


def epoch_steps(job: TrainJob, share: int, holder: str) -> int:
    """Steps of an epoch for ``share`` training examples (a worker's, a data group's or a pipeline's, named by
    ``holder`` in the error) in batches of ``job.batch_size``, at most ``--steps-per-epoch``.

    Raises:
        SystemExit: the share holds not one batch (what to lower is said).
    """
    steps = share // job.batch_size
    if steps == 0:
        raise SystemExit(f"batch size {job.batch_size} is larger than {holder}'s {share} examples; lower --batch-size")
    return min(steps, job.steps_per_epoch) if job.steps_per_epoch > 0 else steps
