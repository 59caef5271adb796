"""Comparing training runs: accuracy against wall time without evaluation, time to a target, the table.

Shared by ``paratrain compare`` and ``paratrain bench consistency``, which read the same metrics records.
"""

from __future__ import annotations

from typing import Any

__all__ = ["accuracy_curve", "format_table", "time_to_accuracy"]


def accuracy_curve(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The reporting rank's (training time, test accuracy) points, from its probes (``--eval-every``) or else its
    epochs (rank 0; for a pipeline its last stage, :func:`~paratrain.train.record.reporting_rank`).

    Training time runs from the job's first step and leaves out the time rank 0 spent evaluating up to that
    point, so that evaluating more often does not make a strategy look slower.
    """
    steps = [r for r in records if r.get("kind") == "step"]
    if not steps:
        return []
    from paratrain.train.record import reporting_rank

    rank = reporting_rank(records)
    start = min(r["time"] - r["compute_s"] - r["wait_s"] for r in steps)
    probes = [r for r in records if r.get("kind") == "probe" and r.get("rank") == rank]
    points = probes or [r for r in records if r.get("kind") == "eval" and r.get("rank") == rank]
    return [
        (float(r["time"] - r.get("eval_s", 0.0) - r.get("eval_before_s", 0.0) - start), float(r["test_accuracy"]))
        for r in points
    ]


def time_to_accuracy(records: list[dict[str, Any]], target: float) -> float | None:
    """Training time until rank 0's test accuracy first reached ``target`` (None if never): see accuracy_curve."""
    for when, accuracy in accuracy_curve(records):
        if accuracy >= target:
            return when
    return None


def format_table(rows: list[dict[str, Any]], target: float) -> str:
    """The comparison as a Markdown table (it reads as plain text too, and pastes into a README).

    Columns: rank 0's final test accuracy, the workers' average model's (gossip only: the others' workers are
    identical), throughput (with ``--repeat``: the median round's, and the min-max over rounds), the share of
    step time spent waiting for communication (mean over ranks), the wall time of the whole job and the
    training time until rank 0 first reached ``target``.
    """
    lines = [
        f"| strategy | test acc | avg-model acc | samples/s | comm wait | wall s | time to {target} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        tta = row["time_to_accuracy_s"]
        reached = f"{tta:.1f} s" if tta is not None else "not reached"
        consensus = row.get("consensus_accuracy")
        ranks = list(row["per_rank"].values())
        total = sum(r["compute_s"] + r["wait_s"] for r in ranks)
        wait = sum(r["wait_s"] for r in ranks) / total if total else 0.0
        rounds = [x for x in row.get("samples_per_sec_rounds", []) if x is not None]
        spread = f" ({min(rounds):,.0f}-{max(rounds):,.0f})" if len(rounds) > 1 else ""
        lines.append(
            f"| {row['strategy']} | {row['test_accuracy']:.4f} | "
            + (f"{consensus:.4f}" if consensus is not None else "-")
            + f" | {row['samples_per_sec']:,.0f}{spread} | {wait:.0%} | {row['wall_time_s']:.1f} | {reached} |"
        )
    return "\n".join(lines)
