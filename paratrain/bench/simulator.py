"""The simulator checked against real runs: predicted vs measured step time over strategies x models x networks.

For every configuration this trains the model for a few steps with ``paratrain train`` (real processes, the
emulated network of the fault injector) and reads each step's wall time from the run's metrics (rank 0's
interval between consecutive steps, median over the steps after the first two), and predicts the same step
from the machine profile (:func:`paratrain.sim.predict.predict`) and from the plain alpha-beta formula
(:func:`~paratrain.sim.predict.alpha_beta_step`). The report has both errors per configuration, their median
and worst, and the Spearman correlation of each prediction's ranking with the measured one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paratrain.sim.machine import MachineProfile
from paratrain.strategy import parse_strategy

__all__ = ["ValidationRow", "render_validation", "run_validation", "spearman", "split_strategy"]


@dataclasses.dataclass(frozen=True)
class ValidationRow:
    """One configuration: measured and predicted step seconds."""

    model: str
    strategy: str
    network: str
    workers: int
    measured: list[float]
    predicted: float
    formula: float

    @property
    def measured_median(self) -> float:
        """Median over rounds of each round's median step."""
        return statistics.median(self.measured)

    @property
    def error(self) -> float:
        """Relative error of the replay's prediction."""
        return self.predicted / self.measured_median - 1.0

    @property
    def formula_error(self) -> float:
        """Relative error of the alpha-beta formula."""
        return self.formula / self.measured_median - 1.0


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties).

    Example:
        >>> round(spearman([1, 2, 3, 4], [10, 20, 40, 30]), 6)
        0.8
    """
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two sequences of the same length >= 2")

    def ranks(xs: Sequence[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else 0.0


def split_strategy(text: str) -> tuple[str, str | None]:
    """A configuration's strategy and compression: ``"allreduce+fp16"`` is ``--strategy allreduce --compression
    fp16``.

    Example:
        >>> split_strategy("allreduce+fp16"), split_strategy("bsp")
        (('allreduce', 'fp16'), ('bsp', None))
    """
    strategy, _, compression = text.partition("+")
    return strategy, compression or None


def measured_step(records: list[dict[str, Any]], *, skip: int = 2) -> float:
    """Median wall seconds between rank 0's consecutive steps, leaving out the first ``skip`` steps."""
    times = sorted((r["step"], r["time"]) for r in records if r.get("kind") == "step" and r.get("rank") == 0)
    gaps = [t1 - t0 for (s0, t0), (s1, t1) in itertools.pairwise(times) if s0 >= skip and s1 == s0 + 1]
    if not gaps:
        raise ValueError("too few steps recorded to measure a step (run more --steps)")
    return float(statistics.median(gaps))


def _train(
    model: str,
    strategy: str,
    network: str | None,
    *,
    workers: int,
    steps: int,
    batch: int,
    dataset: str,
    run_dir: Path,
    bucket_bytes: int | None = None,
    extra: Mapping[str, Any] | None = None,
    timeout: float = 3600.0,
) -> float:
    """Trains one configuration for ``steps`` steps (``paratrain train``'s job, run here, its progress on stderr)
    and returns its measured seconds per step.

    Raises:
        JobFailedError: the job failed or ran past ``timeout``.
    """
    from paratrain.train.job import TrainJob
    from paratrain.train.record import merge_run
    from paratrain.train.run import run_training

    strategy, compression = split_strategy(strategy)
    job = TrainJob(
        model=model,
        dataset=dataset,
        strategy=strategy,
        compression=compression,
        workers=workers,
        epochs=1,
        steps_per_epoch=steps,
        batch_size=batch,
        run_dir=str(run_dir),
        bandwidth=network or None,
        bucket_bytes=bucket_bytes,
    ).replace(**(extra or {}))
    run_training(job, deadline_s=timeout)
    return measured_step(merge_run(run_dir))


def run_validation(
    profile: MachineProfile,
    *,
    models: Sequence[str],
    strategies: Sequence[str],
    networks: Sequence[str | None],
    workers: int = 4,
    steps: int = 8,
    batch: int = 64,
    repeat: int = 1,
    dataset: str = "fashion-mnist",
    out_dir: str | None = None,
) -> dict[str, Any]:
    """Measures and predicts every configuration (rounds interleaved); returns the report.

    Args:
        profile: the machine profile, with every model profiled at ``batch`` with ``workers`` processes.
        models, strategies, networks: the grid (a network is a ``--bandwidth`` value, None for none).
        workers, steps, batch: each run's size (the first two steps are left out of the measurement).
        repeat: rounds of the whole grid.
        dataset: what the runs train on (the profile's models must have been measured on its input shape).
        out_dir: where the runs go (default a temporary directory).
    """
    root = Path(out_dir or tempfile.mkdtemp(prefix="paratrain-simcheck-"))
    grid = [(m, s, n) for m in models for n in networks for s in strategies]
    measured: dict[tuple[str, str, str | None], list[float]] = {key: [] for key in grid}
    extra = {key: _job(profile, *key, workers=workers, batch=batch)[1] for key in grid}  # checks them all first
    for r in range(repeat):
        for model, strategy, network in grid:
            run_dir = root / f"{model}-{strategy}-{network or 'local'}-round{r + 1}"
            measured[(model, strategy, network)].append(
                _train(
                    model,
                    strategy,
                    network,
                    workers=workers,
                    steps=steps,
                    batch=batch,
                    dataset=dataset,
                    run_dir=run_dir,
                    extra=extra[(model, strategy, network)],
                )
            )
    return predict_rows(profile, measured, workers=workers, batch=batch)


def _job(
    profile: MachineProfile, model: str, strategy: str, network: str | None, *, workers: int, batch: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A configuration as :func:`~paratrain.sim.predict.predict`'s keywords, and the training job's options
    it needs beyond strategy, workers and batch: a pipeline (one stage per worker, as many micro-batches, and
    workers x batch examples per step, as many as the data-parallel runs train on) with the simulator's split."""
    from paratrain.sim.predict import predict
    from paratrain.transport.faults import parse_bandwidth

    strategy_, compression = split_strategy(strategy)
    job: dict[str, Any] = {
        "workers": workers,
        "strategy": strategy_,
        "bandwidth": parse_bandwidth(network) if network else None,
        "batch_size": batch,
        "compression": compression,
    }
    if not parse_strategy(strategy_).pipelined:
        return job, {}
    job |= {"batch_size": workers * batch, "microbatches": workers}
    settings = predict(profile, profile.model(model, batch, workers), **job).settings
    return job, {"microbatches": workers, "batch_size": workers * batch, **settings}


def predict_rows(
    profile: MachineProfile,
    measured: dict[tuple[str, str, str | None], list[float]],
    *,
    workers: int,
    batch: int,
) -> dict[str, Any]:
    """The report for measured configurations ``(model, strategy, network) -> step seconds per round``: each
    predicted by the simulator and by the formula. Also how ``--measured`` re-predicts an earlier report's
    measurements after a change to the simulator (the runs are not repeated)."""
    from paratrain.sim.predict import alpha_beta_step, predict

    rows = []
    for (model, strategy, network), steps in measured.items():
        mp = profile.model(model, batch, workers)
        job = _job(profile, model, strategy, network, workers=workers, batch=batch)[0]
        pred = predict(profile, mp, **job).step_s
        formula = alpha_beta_step(profile, mp, **job)
        rows.append(ValidationRow(model, strategy, network or "local", workers, steps, pred, formula))
    return summarise(rows, profile)


def run_bucket_grid(
    profile: MachineProfile,
    *,
    model: str,
    network: str | None,
    sizes: Sequence[int],
    workers: int = 4,
    steps: int = 8,
    batch: int = 64,
    repeat: int = 1,
    dataset: str = "fashion-mnist",
    out_dir: str | None = None,
) -> dict[str, Any]:
    """Allreduce with every fusion size of ``sizes``: measured (rounds interleaved) and predicted. The
    simulator's pick is the size it predicts fastest, chosen before any run (no warm-up steps); the report says
    how far the pick's measured step is from the best measured one."""
    from paratrain.sim.predict import predict
    from paratrain.transport.faults import parse_bandwidth

    root = Path(out_dir or tempfile.mkdtemp(prefix="paratrain-buckets-"))
    bandwidth = parse_bandwidth(network) if network else None
    mp = profile.model(model, batch, workers)
    predicted = {
        size: predict(profile, mp, workers=workers, bucket_bytes=size, bandwidth=bandwidth).step_s for size in sizes
    }
    measured: dict[int, list[float]] = {size: [] for size in sizes}
    for r in range(repeat):
        for size in sizes:
            measured[size].append(
                _train(
                    model,
                    "allreduce",
                    network,
                    workers=workers,
                    steps=steps,
                    batch=batch,
                    dataset=dataset,
                    run_dir=root / f"{size}-round{r + 1}",
                    bucket_bytes=size,
                )
            )
    pick = min(sizes, key=lambda size: predicted[size])
    medians = {size: statistics.median(v) for size, v in measured.items()}
    best = min(sizes, key=lambda size: medians[size])
    return {
        "benchmark": "bucket-grid",
        "model": model,
        "network": network or "local",
        "workers": workers,
        "rows": [{"bucket_bytes": size, "predicted": predicted[size], "measured": measured[size]} for size in sizes],
        "pick": pick,
        "best_measured": best,
        "pick_vs_best": medians[pick] / medians[best] - 1.0,
    }


def render_bucket_grid(report: dict[str, Any]) -> str:
    """The grid as a Markdown table and the verdict."""
    lines = ["| bucket | measured step (min-max) | simulated |", "|---:|---:|---:|"]
    for row in report["rows"]:
        m = row["measured"]
        mark = " (pick)" if row["bucket_bytes"] == report["pick"] else ""
        best = " (best measured)" if row["bucket_bytes"] == report["best_measured"] else ""
        lines.append(
            f"| {row['bucket_bytes'] >> 10} KiB{mark}{best} | {statistics.median(m):.3f} s ({min(m):.3f}-{max(m):.3f}) "
            f"| {row['predicted']:.3f} s |"
        )
    lines.append("")
    lines.append(f"the simulator's pick is {report['pick_vs_best']:+.1%} from the best measured size")
    return "\n".join(lines)


def measurements(report: dict[str, Any]) -> dict[tuple[str, str, str | None], list[float]]:
    """The measured steps of an earlier report (its ``rows``), keyed as :func:`predict_rows` takes them."""
    return {
        (r["model"], r["strategy"], None if r["network"] == "local" else r["network"]): list(r["measured"])
        for r in report["rows"]
    }


def summarise(rows: Sequence[ValidationRow], profile: MachineProfile) -> dict[str, Any]:
    """The report of :func:`run_validation` from its rows."""
    errors = [abs(r.error) for r in rows]
    formula_errors = [abs(r.formula_error) for r in rows]
    meas = [r.measured_median for r in rows]
    return {
        "benchmark": "simulator",
        "machine": profile.name,
        "rows": [dataclasses.asdict(r) | {"error": r.error, "formula_error": r.formula_error} for r in rows],
        "median_abs_error": statistics.median(errors) if errors else None,
        "worst_abs_error": max(errors, default=None),
        "formula_median_abs_error": statistics.median(formula_errors) if formula_errors else None,
        "formula_worst_abs_error": max(formula_errors, default=None),
        "spearman": spearman(meas, [r.predicted for r in rows]) if len(rows) > 1 else None,
        "formula_spearman": spearman(meas, [r.formula for r in rows]) if len(rows) > 1 else None,
    }


def render_validation(report: dict[str, Any]) -> str:
    """The report as a Markdown table and a summary."""
    lines = [
        "| model | strategy | network | measured step (min-max) | simulated | error | alpha-beta formula | error |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        m = row["measured"]
        med = statistics.median(m)
        spread = f" ({min(m):.3f}-{max(m):.3f})" if len(m) > 1 else ""
        lines.append(
            f"| {row['model']} | {row['strategy']} | {row['network']} | {med:.3f} s{spread} | {row['predicted']:.3f} s "
            f"| {row['error']:+.1%} | {row['formula']:.3f} s | {row['formula_error']:+.1%} |"
        )
    if report["rows"]:
        lines.append("")
        lines.append(
            f"simulator: median |error| {report['median_abs_error']:.1%}, worst {report['worst_abs_error']:.1%}, "
            f"Spearman {_fmt(report['spearman'])}; "
            f"alpha-beta formula: median |error| {report['formula_median_abs_error']:.1%}, worst "
            f"{report['formula_worst_abs_error']:.1%}, Spearman {_fmt(report['formula_spearman'])}"
        )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
