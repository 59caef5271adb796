"""Running a training job end to end: the cluster started, progress drawn, the ranks' records merged.

:func:`run_training` (``paratrain train``, ``compare``, the benchmarks, ``plan --run``) checks the job, writes it
into its run directory as JSON (every rank reads it there), starts N workers plus parameter servers for the PS
strategies through the launch library, follows rank 0's metrics file to draw a progress bar, and when the job
ends merges the ranks' records into ``metrics.jsonl`` and ``timeline.json``, draws ``loss.png`` and
``accuracy.png``, and writes ``summary.json``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from paratrain.errors import JobFailedError
from paratrain.strategy import parse_strategy, servers_of
from paratrain.train.checks import validate
from paratrain.train.job import TrainJob, write_job
from paratrain.train.summary import summarise

__all__ = ["follow_progress", "run_training"]


def follow_progress(path: Path, stop: threading.Event, total_holder: list[int], desc: str) -> None:
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


def run_training(
    job: TrainJob, *, quiet: bool = False, output: TextIO | None = None, deadline_s: float | None = None
) -> dict[str, Any]:
    """Runs one job end to end and returns its summary (also written to ``<run_dir>/summary.json``).

    Args:
        job: the job (checked here first).
        quiet: no progress bar.
        output: where the ranks' output (stdout and stderr) goes; the terminal's streams if None.
        deadline_s: stop the job if it still runs this many seconds after it started (None: no limit).

    Raises:
        ConfigError: the job's options cannot work together (before anything starts).
        JobFailedError: a rank failed (the job is stopped; what the ranks recorded stays in the run directory).
    """
    from paratrain.launch.run import run_launch
    from paratrain.train.record import merge_run, plot_run

    job = validate(job)
    spec = parse_strategy(job.strategy)
    servers = servers_of(job.servers, spec)
    named = job.strategy.replace(":", "").replace("/", "-")  # soap:FILE names a path
    run_dir = Path(job.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{named}")
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.*"):
        old.unlink()
    # every rank reads the whole job from the run directory (a restarted rank, a warm spare, one started again)
    checkpoints = str(Path(job.checkpoint_dir).resolve()) if job.checkpoint_dir else None
    job = job.replace(run_dir=str(run_dir), checkpoint_dir=checkpoints)
    argv = ["python", "-m", spec.info.worker, "--job", str(write_job(job, run_dir)), "--quiet"]
    stop = threading.Event()
    total = [0]
    follower = None
    reporting = job.reporting_rank()
    if not quiet:
        follower = threading.Thread(
            target=follow_progress,
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
            stdout=output,
            stderr=output,
            deadline_s=deadline_s,
        )
    finally:
        stop.set()
        if follower is not None:
            follower.join(5)
    wall = time.time() - started
    if code != 0:
        raise JobFailedError(code)
    records = merge_run(run_dir)
    title = f"{job.model} on {job.dataset}, {job.workers} worker{'s' if job.workers != 1 else ''}, {job.strategy}"
    if spec.pipelined:
        title += f" ({job.stages} stages x {job.replicas}, {job.microbatches} micro-batches)"
    plots = plot_run(records, run_dir, title=title)
    summary = summarise(records, job=job, servers=servers, wall=wall, run_dir=run_dir)
    summary["plots"] = [str(p) for p in plots]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if job.json:
        Path(job.json).write_text(json.dumps(summary, indent=2))
    return summary
