"""What a training run leaves behind: per-rank metrics and timeline spans, merged into one run directory.

Each rank appends JSON lines (``rank{r}.metrics.jsonl``) and Chrome-trace spans (``rank{r}.trace.json``) to
the run directory; the ``paratrain train`` process merges them after the job into ``metrics.jsonl`` and
``timeline.json`` (open it in Perfetto or chrome://tracing: one process per rank, one track per category:
compute, communication, waiting) and draws the plots. Ranks never coordinate to write, so recording costs
a rank nothing but its own appends. Timestamps are wall-clock microseconds, so spans of ranks on one host
line up.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["Recorder", "merge_run", "plot_run", "rank_records", "reporting_rank", "run_outcome"]

_TRACKS = {"compute": 1, "communication": 2, "waiting": 3, "eval": 4}


class Recorder:
    """One rank's metrics and timeline writer.

    Example:
        >>> import tempfile
        >>> rec = Recorder(tempfile.mkdtemp(), rank=0)
        >>> with rec.span("forward", "compute"):
        ...     pass
        >>> rec.log(step=1, loss=0.5)
        >>> rec.close()
    """

    def __init__(self, run_dir: str | Path, *, rank: int) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._metrics = (self.dir / f"rank{rank}.metrics.jsonl").open("a", encoding="utf-8", buffering=1)
        self._events: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def span(self, name: str, category: str, **args: Any) -> Iterator[None]:
        """Records the enclosed code as one complete ("X") trace event."""
        start = time.time()
        try:
            yield
        finally:
            self.add_span(name, category, start, time.time(), **args)

    def add_span(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        """Records a span measured elsewhere (``start``/``end`` from ``time.time()``)."""
        self._events.append(
            {
                "name": name,
                "cat": category,
                "ph": "X",
                "ts": start * 1e6,
                "dur": max(0.0, (end - start) * 1e6),
                "pid": self.rank,
                "tid": _TRACKS.get(category, 9),
                **({"args": args} if args else {}),
            }
        )

    def log(self, **fields: Any) -> None:
        """Appends one metrics record (``rank`` and wall ``time`` are added)."""
        record = {"rank": self.rank, "time": time.time(), **fields}
        self._metrics.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Flushes the metrics and writes this rank's trace events."""
        self._metrics.close()
        (self.dir / f"rank{self.rank}.trace.json").write_text(json.dumps(self._events))


def reporting_rank(records: list[dict[str, Any]]) -> int:
    """The rank whose loss and accuracy stand for the run: the one whose ``start`` record says ``reports``
    (a pipeline's last stage of pipeline 0, which computes the loss), else the lowest that finished (rank 0,
    unless an elastic job went on without it), else rank 0."""
    for r in records:
        if r.get("kind") == "start" and r.get("reports"):
            return int(r["rank"])
    return min((int(r["rank"]) for r in records if r.get("kind") == "final"), default=0)


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every rank's metrics records of a run directory, file by file in rank order (nothing is written)."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(run_dir).glob("rank*.metrics.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                records.append(json.loads(line))
    return records


def rank_records(run_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    """The records rank ``rank`` wrote so far (a restarted worker of a parameter-server job reads its predecessor's,
    to report the interrupted epoch as the fault-free run does); a line cut short by a kill is skipped."""
    path = Path(run_dir) / f"rank{rank}.metrics.jsonl"
    records: list[dict[str, Any]] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:  # the line its process was killed in the middle of
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def merge_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """Merges every rank's files into ``metrics.jsonl`` and ``timeline.json``; returns the metrics records."""
    directory = Path(run_dir)
    records = read_records(directory)
    records.sort(key=lambda r: (r.get("time", 0.0), r.get("rank", 0)))
    with (directory / "metrics.jsonl").open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    events: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for path in sorted(directory.glob("rank*.trace.json")):
        rank_events = json.loads(path.read_text(encoding="utf-8"))
        events.extend(rank_events)
        ranks.update(e["pid"] for e in rank_events)
    for rank in sorted(ranks):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for track, tid in _TRACKS.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}})
    (directory / "timeline.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return records


def plot_run(records: list[dict[str, Any]], out_dir: str | Path, *, title: str) -> list[Path]:
    """Draws loss against steps and against wall time, and test accuracy per epoch (the view of the
    :func:`reporting_rank`: rank 0, or a pipeline's last stage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    rank = reporting_rank(records)
    steps = [r for r in records if r.get("kind") == "step" and r.get("rank") == rank]
    evals = [r for r in records if r.get("kind") == "eval" and r.get("rank") == rank]
    paths = []
    if steps:
        t0 = steps[0]["time"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        axes[0].plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8)
        axes[0].set_xlabel("step")
        axes[0].set_ylabel("training loss (rank 0)")
        axes[1].plot([r["time"] - t0 for r in steps], [r["loss"] for r in steps], lw=0.8)
        axes[1].set_xlabel("wall time (s)")
        fig.suptitle(title)
        fig.tight_layout()
        paths.append(out / "loss.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if evals:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        ax.plot([r["epoch"] for r in evals], [r["test_accuracy"] for r in evals], marker="o")
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_title(title)
        fig.tight_layout()
        paths.append(out / "accuracy.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def run_outcome(records: list[dict[str, Any]]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """What two runs of one job share when they computed the same thing (a run with a death recovered against the
    fault-free one): every rank's final parameters' digest and every epoch's train loss and test accuracy, by rank.
    """
    finals = sorted((r["rank"], r["parameters_sha256"]) for r in records if r["kind"] == "final")
    evals = sorted((r["rank"], r["epoch"], r["train_loss"], r["test_accuracy"]) for r in records if r["kind"] == "eval")
    return finals, evals
