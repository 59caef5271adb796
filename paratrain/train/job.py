"""A whole local training job as a library: its options, their checks, the run, its summary.

``paratrain train`` and ``paratrain compare`` (the CLI) and ``paratrain bench consistency`` (the benchmarks) all
run jobs through :func:`run_training`: it starts the cluster (N workers, plus parameter servers for the PS
strategies) through the launch library, follows rank 0's metrics file to draw a progress bar, and when the job
ends merges the ranks' records into ``metrics.jsonl`` and ``timeline.json``, draws ``loss.png`` and
``accuracy.png``, and writes ``summary.json``.

One module (about 530 lines) because a job's options, their checks across options (strategy x servers x
compression x restarts...) and the run that forwards them to every rank are one contract: a flag added here is
checked and forwarded in the same place.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.strategy import UnknownStrategyError, parse_layer_schemes, parse_strategy, strategies_help

__all__ = [
    "TRAIN_EXTRA",
    "TrainJob",
    "missing_train_extra",
    "print_summary",
    "require_train_extra",
    "run_training",
    "summarise",
    "validate",
]


# what the 'train' extra of pyproject.toml installs: import name -> distribution name
TRAIN_EXTRA = {"torch": "torch", "sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}


def missing_train_extra() -> list[str]:
    """The distributions of the ``train`` extra that cannot be imported here (found, not imported: cheap)."""
    import importlib.util

    missing = []
    for module, distribution in TRAIN_EXTRA.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: in sys.modules without a spec, i.e. importable
            found = module in sys.modules
        if not found:
            missing.append(distribution)
    return missing


def require_train_extra(command: str) -> bool:
    """Says once, before any worker starts, which part of the ``train`` extra is missing; False if any is."""
    missing = missing_train_extra()
    if missing:
        print(
            f"paratrain {command} needs the 'train' extra: pip install 'paratrain[train]' "
            f"(missing: {', '.join(missing)})",
            file=sys.stderr,
        )
    return not missing


class TrainJob(argparse.Namespace):
    """Typed view of the parsed training options."""

    model: str
    dataset: str
    data_dir: str | None
    strategy: str
    epochs: int
    batch_size: int
    lr: float
    seed: int
    workers: int | None  # None until validate(): 2, or for a pipeline stages x replicas
    servers: int | None
    run_dir: str | None
    json: str | None
    straggler: str | None
    eval_every: int
    faults: str | None
    latency: str | None
    bandwidth: str | None
    no_overlap: bool
    # pipelines (class defaults: jobs built without them, by other commands, are not pipelines)
    stages: int | None = None
    microbatches: int = 4
    replicas: int = 1
    balance: str = "auto"
    checkpoint: bool = False
    kill: str | None = None  # a kill schedule (paratrain.launch.kills), its random items seeded by --seed
    max_restarts: int = 0  # restart a failed worker while the others go on (paratrain.recovery)
    checkpoint_every: int = 10  # steps between in-memory checkpoints under max_restarts
    no_spare: bool = False  # under max_restarts: restart cold, without a warm spare
    min_workers: int = 0  # elastic: go on without a failed worker while this many remain
    checkpoint_dir: str | None = None  # also keep checkpoints on disk; a job started again resumes from there
    layer_scheme: list[str] | None = None  # hybrid strategies: LAYER=SCHEME overrides of the cost model
    compression: str | None = None  # gradient compression of allreduce / the parameter servers
    steps_per_epoch: int = 0  # cut epochs to this many steps (0: whole epochs)
    bucket_bytes: int | None = None  # fusion size of DistributedOptimizer's buckets (None: its default)

    def reporting_rank(self) -> int:
        """The rank whose metrics are the job's loss and accuracy: rank 0, or for a pipeline the last stage of
        pipeline 0 (the stage that computes the loss and holds the outputs)."""
        return (self.stages or 1) - 1 if parse_strategy(self.strategy).family == "pipeline" else 0

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


def validate(job: TrainJob) -> None:
    """Refuses bad flags before anything starts, with messages that say what to do."""
    from paratrain.ps.consistency import Policy
    from paratrain.train.data import DATASETS, check_available
    from paratrain.train.models import MODELS, check_model_dataset

    if job.model not in MODELS:
        raise ConfigError(f"unknown --model {job.model!r}; choose one of {', '.join(MODELS)}")
    if job.dataset not in DATASETS:
        raise ConfigError(f"unknown --dataset {job.dataset!r}; choose one of {', '.join(DATASETS)}")
    check_model_dataset(job.model, job.dataset)
    for name in ("epochs", "batch_size", "workers"):
        if getattr(job, name) is not None and getattr(job, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(job, name)}")
    if job.steps_per_epoch < 0:
        raise ConfigError(f"--steps-per-epoch must be 0 (whole epochs) or a number of steps, got {job.steps_per_epoch}")
    if job.eval_every < 0:
        raise ConfigError(f"--eval-every must be 0 (off) or a number of steps, got {job.eval_every}")
    if not job.lr > 0:
        raise ConfigError(f"--lr must be positive, got {job.lr}")
    try:
        spec = parse_strategy(job.strategy)
    except UnknownStrategyError:
        raise ConfigError(f"unknown --strategy {job.strategy!r}; choose one of: {strategies_help()}") from None
    except ConfigError as exc:
        raise ConfigError(f"--strategy {job.strategy!r}: {exc} (the forms: {strategies_help()})") from None
    if spec.family == "pipeline":
        _resolve_pipeline(job)
    elif job.workers is None:
        job.workers = 2
    assert job.workers is not None
    if job.servers and not spec.uses_servers:
        raise ConfigError(f"--servers is for the parameter-server strategies (bsp, ssp:S, asp), not {spec.kind}")
    if spec.kind == "gossip":
        from paratrain.gossip.mixing import resolve_mixing

        resolve_mixing(spec.topology, job.workers)
    if job.layer_scheme and not spec.hybrid:
        raise ConfigError(f"--layer-scheme is for poseidon, poseidon:allreduce and sfb, not {job.strategy!r}")
    parse_layer_schemes(job.layer_scheme)
    if job.compression is not None:
        from paratrain.compression import LowRank, TopK, parse_compression

        compressor = parse_compression(job.compression)
        if compressor is not None and spec.family not in ("collective", "parameter-server"):
            raise ConfigError(f"--compression is for allreduce and the parameter servers, not {job.strategy!r}")
        if (
            compressor is not None
            and (job.max_restarts or job.min_workers or job.checkpoint_dir)
            and not spec.uses_servers
        ):
            raise ConfigError("--compression does not combine with --max-restarts, --min-workers or --checkpoint-dir")
        if isinstance(compressor, TopK) and compressor.momentum_correction and spec.uses_servers:
            raise ConfigError(
                f"--compression {job.compression}: DGC moves SGD's momentum to the workers, but the parameter "
                "servers step the optimizer; use it with --strategy allreduce (or topk:R with the servers)"
            )
        if isinstance(compressor, LowRank) and spec.uses_servers:
            raise ConfigError(
                f"--compression {job.compression}: PowerSGD needs two allreduce rounds per step; use it with "
                "--strategy allreduce (or fp16, bf16, topk:R with the parameter servers)"
            )
    if spec.uses_servers:
        if not spec.hybrid:
            Policy.parse(spec.kind, spec.staleness)
        servers = _servers(job, True)
        if not 1 <= job.replicas <= servers:
            raise ConfigError(
                f"--replicas {job.replicas}: each parameter-server chunk needs that many distinct servers; "
                f"give --servers {max(job.replicas, 2)} or more (now {servers})"
            )
    elif spec.family != "pipeline" and job.replicas != 1:
        raise ConfigError("--replicas is for pipelines (R pipelines) and parameter servers (R copies of each chunk)")
    job.network()
    if getattr(job, "device", "cpu") == "cuda":
        if spec.family == "pipeline":
            raise ConfigError(
                "--device cuda is for the data-parallel strategies; a pipeline places its stages itself "
                "(paratrain.torch.Pipe(device=...))"
            )
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but torch sees no CUDA device here (torch.cuda.is_available() is False)")
    if job.no_overlap and spec.family == "pipeline":
        raise ConfigError("--no-overlap is for the data-parallel strategies; a pipeline overlaps by its schedule")
    if job.straggler:
        from paratrain.train import stragglers

        stragglers.parse(job.straggler, seed=job.seed).check_workers(job.workers)
    check_available(job.dataset, data_dir=job.data_dir)
    if job.max_restarts < 0 or job.checkpoint_every < 1:
        raise ConfigError("--max-restarts must be >= 0 and --checkpoint-every >= 1")
    if job.max_restarts and spec.kind != "allreduce" and not (spec.uses_servers and job.replicas >= 2):
        raise ConfigError(
            f"--max-restarts recovers allreduce training (Rabit's model) and restarts dead parameter servers that "
            f"have replicas (--servers S --replicas 2); {job.strategy!r} with --replicas {job.replicas} does not "
            "support it"
        )
    if job.checkpoint_dir and spec.kind != "allreduce":
        raise ConfigError(f"--checkpoint-dir checkpoints allreduce training; {job.strategy!r} does not support it yet")
    if job.min_workers and (spec.kind != "allreduce" or not 0 < job.min_workers <= (job.workers or 0)):
        raise ConfigError(
            f"--min-workers needs the allreduce strategy and 1..{job.workers} (the workers); got "
            f"{job.min_workers} with {job.strategy!r}"
        )
    if job.kill:
        from paratrain.launch.kills import parse_kills

        parse_kills(job.kill, nproc=job.workers, servers=_servers(job, spec.uses_servers), seed=job.seed)


def _servers(job: TrainJob, uses_servers: bool) -> int:
    """The parameter-server processes the job starts: ``--servers``, or 1 for a PS strategy, else none."""
    return job.servers if job.servers is not None else (1 if uses_servers else 0)


def _resolve_pipeline(job: TrainJob) -> None:
    """Fills in ``--stages`` or ``--workers`` (N = K stages x R replicas) and checks the pipeline's flags."""
    from paratrain.train.models import build_model
    from paratrain.train.pipeline_worker import flat_layers

    for name in ("microbatches", "replicas"):
        if getattr(job, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(job, name)}")
    if job.stages is not None and job.stages < 1:
        raise ConfigError(f"--stages must be at least 1, got {job.stages}")
    if job.stages is None:
        workers = job.workers if job.workers is not None else 2 * job.replicas
        if workers % job.replicas:
            raise ConfigError(f"--workers {workers} is not a multiple of --replicas {job.replicas}")
        job.stages = workers // job.replicas
    if job.workers is None:
        job.workers = job.stages * job.replicas
    if job.workers != job.stages * job.replicas:
        raise ConfigError(
            f"--workers {job.workers} but --stages {job.stages} x --replicas {job.replicas} = "
            f"{job.stages * job.replicas}; give two of them (a pipeline runs one process per stage per replica)"
        )
    if job.batch_size < job.microbatches:
        raise ConfigError(f"--batch-size {job.batch_size} cannot be cut into --microbatches {job.microbatches}")
    if job.straggler or job.servers:
        raise ConfigError("--straggler and --servers are not for pipelines")
    side = {"fashion-mnist": 28, "digits": 8}.get(job.dataset, 16)  # the layers, not their sizes, matter here
    layers = len(flat_layers(build_model(job.model, side=side, classes=10)))
    if job.balance != "auto":
        try:
            balance = [int(b) for b in job.balance.split(",")]
        except ValueError:
            raise ConfigError(f"--balance {job.balance!r}: give layers per stage, e.g. 3,3, or 'auto'") from None
        if len(balance) != job.stages or min(balance) < 1 or sum(balance) != layers:
            raise ConfigError(
                f"--balance {job.balance}: {job.model} has {layers} layers; give {job.stages} counts of at least 1 "
                "that add up to them, or 'auto'"
            )
    elif layers < job.stages:
        raise ConfigError(f"--model {job.model} has {layers} layers, too few for {job.stages} stages")


def _follow_progress(path: Path, stop: threading.Event, total_holder: list[int], desc: str) -> None:
    """Draws a progress bar from rank 0's metrics file while the job runs (the ranks' output passes through).

    Rank 0's line per epoch is printed from here, through the bar (``tqdm.write``: the bar is cleared, the line
    goes to stdout, the bar is redrawn below it); printed by the rank itself it would cut the bar in two. After
    ``stop`` the file is read once more, so that the last epoch's line is not lost.
    """
    from tqdm import tqdm

    from paratrain.train.worker import epoch_line

    bar: Any = None
    offset = 0
    try:
        while True:
            stopped = stop.wait(0.3)
            if not path.exists():
                if stopped:
                    break
                continue
            with path.open(encoding="utf-8") as fh:
                fh.seek(offset)
                chunk = fh.read()
            lines = chunk.split("\n")
            offset += len(chunk) - len(lines[-1])
            for line in lines[:-1]:
                record = json.loads(line)
                if record.get("kind") == "start":
                    total_holder[0] = int(record["epochs"]) * int(record["steps_per_epoch"])
                    bar = tqdm(total=total_holder[0], unit="step", desc=desc, file=sys.stderr)
                elif record.get("kind") == "step" and bar is not None:
                    bar.update(int(record["step"]) - bar.n)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", epoch=record["epoch"], refresh=False)
                elif record.get("kind") == "eval" and "train_loss" in record:
                    text = epoch_line(
                        record["epoch"],
                        record["epochs"],
                        record["train_loss"],
                        record["test_accuracy"],
                        record["test_loss"],
                    )
                    tqdm.write(text, file=sys.stdout)
            if stopped:
                break
    finally:
        if bar is not None:
            bar.close()


def run_training(job: TrainJob, *, quiet: bool = False) -> dict[str, Any]:
    """Runs one job end to end and returns its summary (also written to ``<run_dir>/summary.json``)."""
    from paratrain.launch.run import run_launch
    from paratrain.train.record import merge_run, plot_run

    validate(job)
    servers = _servers(job, parse_strategy(job.strategy).uses_servers)
    run_dir = Path(job.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{job.strategy.replace(':', '')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.*"):
        old.unlink()
    pipeline = parse_strategy(job.strategy).family == "pipeline"
    module = "paratrain.train.pipeline_worker" if pipeline else "paratrain.train.worker"
    argv = ["python", "-m", module, "--run-dir", str(run_dir), "--quiet"]
    flags = ["model", "dataset", "strategy", "epochs", "batch_size", "lr", "seed"]
    if pipeline:
        flags += ["stages", "microbatches", "replicas", "balance"]
        argv += ["--checkpoint"] if job.checkpoint else []
    for flag in flags:
        argv += [f"--{flag.replace('_', '-')}", str(getattr(job, flag))]
    if job.data_dir:
        argv += ["--data-dir", job.data_dir]
    if job.straggler:
        argv += ["--straggler", job.straggler]
    if job.no_overlap:
        argv += ["--no-overlap"]
    for item in job.layer_scheme or []:
        argv += ["--layer-scheme", item]
    if job.compression:
        argv += ["--compression", job.compression]
    if getattr(job, "device", "cpu") != "cpu":
        argv += ["--device", job.device]
    if getattr(job, "bucket_bytes", None):
        argv += ["--bucket-bytes", str(job.bucket_bytes)]
    if job.steps_per_epoch:
        argv += ["--steps-per-epoch", str(job.steps_per_epoch)]
    if job.eval_every:
        argv += ["--eval-every", str(job.eval_every)]
    if job.max_restarts or job.min_workers or job.checkpoint_dir:
        argv += ["--checkpoint-every", str(job.checkpoint_every)]
    if job.checkpoint_dir:
        argv += ["--checkpoint-dir", str(Path(job.checkpoint_dir).resolve())]
    stop = threading.Event()
    total = [0]
    follower = None
    reporting = job.reporting_rank()
    if not quiet:
        follower = threading.Thread(
            target=_follow_progress,
            args=(run_dir / f"rank{reporting}.metrics.jsonl", stop, total, f"{job.strategy} (rank {reporting})"),
            daemon=True,
        )
        follower.start()
    started = time.time()
    try:
        assert job.workers is not None  # validate() filled it in
        code = run_launch(
            argv,
            nproc=job.workers,
            servers=servers,
            replicas=job.replicas if servers else 1,
            faults=job.network(),
            kills=job.kill,
            kill_seed=job.seed,
            max_restarts=job.max_restarts,
            spare=not job.no_spare,
            min_workers=job.min_workers,
        )
    finally:
        stop.set()
        if follower is not None:
            follower.join(5)
    wall = time.time() - started
    if code != 0:
        raise SystemExit(f"paratrain train: the job failed (exit {code}); see the ranks' output above")
    records = merge_run(run_dir)
    title = f"{job.model} on {job.dataset}, {job.workers} worker{'s' if job.workers != 1 else ''}, {job.strategy}"
    if pipeline:
        title += f" ({job.stages} stages x {job.replicas}, {job.microbatches} micro-batches)"
    plots = plot_run(records, run_dir, title=title)
    summary = summarise(records, job=job, servers=servers, wall=wall, run_dir=run_dir)
    summary["plots"] = [str(p) for p in plots]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if job.json:
        Path(job.json).write_text(json.dumps(summary, indent=2))
    return summary


def summarise(
    records: list[dict[str, Any]], *, job: TrainJob, servers: int, wall: float, run_dir: Path
) -> dict[str, Any]:
    """The summary of a run: accuracy, throughput, time split between compute and waiting, per rank."""
    steps = [r for r in records if r.get("kind") == "step"]
    from paratrain.train.record import reporting_rank

    reporting = reporting_rank(records)
    evals = [r for r in records if r.get("kind") == "eval" and r.get("rank") == reporting]
    if steps:
        first = min(r["time"] - r["compute_s"] - r["wait_s"] for r in steps)
        train_time = max(r["time"] for r in steps) - first
        samples = sum(int(r["samples"]) for r in steps)
    else:
        train_time, samples = 0.0, 0
    per_rank: dict[int, dict[str, float]] = {}
    for r in steps:
        entry = per_rank.setdefault(
            int(r["rank"]), {"compute_s": 0.0, "wait_s": 0.0, "bytes_sent": 0.0, "allreduce_bytes": 0.0}
        )
        entry["compute_s"] += r["compute_s"]
        entry["wait_s"] += r["wait_s"]
        entry["bytes_sent"] = max(entry["bytes_sent"], float(r["bytes_sent"]))
        entry["allreduce_bytes"] = max(entry["allreduce_bytes"], float(r.get("allreduce_bytes", 0)))
    summary: dict[str, Any] = {
        "strategy": job.strategy,
        "compression": job.compression,
        "workers": job.workers,
        "servers": servers,
        "model": job.model,
        "dataset": job.dataset,
        "epochs": job.epochs,
        "batch_size": job.batch_size,
        "lr": job.lr,
        "seed": job.seed,
        "overlap": not job.no_overlap,
        "network": job.network(),
        "test_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "accuracy_by_epoch": [e["test_accuracy"] for e in evals],
        "consensus_accuracy": evals[-1].get("consensus_accuracy") if evals else None,
        "consensus_distance": evals[-1].get("consensus_distance") if evals else None,
        "samples_per_sec": samples / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "wall_time_s": wall,
        "per_rank": {str(k): v for k, v in sorted(per_rank.items())},
        "run_dir": str(run_dir),
    }
    if parse_strategy(job.strategy).family == "pipeline":
        summary["pipeline"] = _pipeline_summary(records, job)
    return summary


def _pipeline_summary(records: list[dict[str, Any]], job: TrainJob) -> dict[str, Any]:
    """A pipeline's shape and, per stage (pipeline 0), its idle share next to GPipe's/1F1B's bubble formula."""
    starts = {int(r["rank"]): r for r in records if r.get("kind") == "start"}
    memory = {int(r["rank"]): int(r["peak_held_bytes"]) for r in records if r.get("kind") == "memory"}
    k, m = job.stages or 1, job.microbatches
    stages = []
    for rank in range(k):
        steps = [r for r in records if r.get("kind") == "step" and r.get("rank") == rank]
        compute = sum(r["compute_s"] for r in steps)
        idle = sum(r["wait_s"] for r in steps)
        stages.append(
            {
                "stage": rank,
                "layers": starts.get(rank, {}).get("layers"),
                "compute_s": compute,
                "idle_s": idle,
                "idle_share": idle / (compute + idle) if compute + idle > 0 else None,
                "peak_held_bytes": memory.get(rank),
            }
        )
    return {
        "schedule": parse_strategy(job.strategy).options["schedule"],
        "stages": k,
        "replicas": job.replicas,
        "microbatches": m,
        "balance": starts.get(0, {}).get("balance"),
        "checkpoint": job.checkpoint,
        "bubble_formula": (k - 1) / (m + k - 1),
        "per_stage": stages,
    }


def print_summary(summary: dict[str, Any]) -> None:
    """A short human-readable report of a run."""
    acc = summary["test_accuracy"]
    sps = summary["samples_per_sec"]
    workers = f"{summary['workers']} worker{'s' if summary['workers'] != 1 else ''}"
    print(
        f"paratrain train: {summary['model']} on {summary['dataset']}, {workers}, "
        f"{summary['strategy']}: test accuracy {acc:.4f}, {sps:,.0f} samples/s, wall time "
        f"{summary['wall_time_s']:.1f} s"
    )
    if summary.get("consensus_accuracy") is not None:
        print(
            f"  the workers' average model: test accuracy {summary['consensus_accuracy']:.4f} (consensus distance "
            f"{summary['consensus_distance']:.3g})"
        )
    pipe = summary.get("pipeline")
    if pipe is not None:
        print(
            f"  pipeline: {pipe['stages']} stages x {pipe['replicas']} replica{'s' if pipe['replicas'] != 1 else ''}, "
            f"{pipe['microbatches']} micro-batches, balance {pipe['balance']}; bubble formula (K-1)/(M+K-1) = "
            f"{pipe['bubble_formula']:.0%}"
        )
        for stage in pipe["per_stage"]:
            share = stage["idle_share"]
            held = stage["peak_held_bytes"]
            print(
                f"  stage {stage['stage']}: compute {stage['compute_s']:.2f} s, idle {stage['idle_s']:.2f} s "
                f"({'-' if share is None else f'{share:.0%}'}: bubble and waiting for activations/gradients), "
                f"peak activations held {'-' if held is None else f'{held / 1e6:.2f} MB'}"
            )
        print(f"  run directory: {summary['run_dir']} (metrics.jsonl, timeline.json, loss.png, accuracy.png)")
        return
    for rank, entry in summary["per_rank"].items():
        total = entry["compute_s"] + entry["wait_s"]
        share = entry["wait_s"] / total if total else 0.0
        print(
            f"  rank {rank}: compute {entry['compute_s']:.2f} s, waiting for communication {entry['wait_s']:.2f} s "
            f"({share:.0%}), {entry['bytes_sent'] / 1e6:.1f} MB sent over sockets, "
            f"{entry['allreduce_bytes'] / 1e6:.1f} MB allreduced"
        )
    print(f"  run directory: {summary['run_dir']} (metrics.jsonl, timeline.json, loss.png, accuracy.png, summary.json)")
