"""The figures of ``paratrain sched``: each application's convergence against its work (updates, picks, sweeps) and
against wall time, side by side, with the single-process anchors drawn in (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

__all__ = ["plot_lasso", "plot_mf", "plot_pagerank"]


def _two_panels() -> tuple[Any, Any, Any]:
    """A figure of two log-scale panels side by side: (figure, by work, by wall time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_work, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    return fig, by_work, by_time


def _save(fig: Any, axes: tuple[tuple[Any, str], ...], ylabel: str, path: Path) -> None:
    """Labels each (panel, x label) of ``axes`` (log y, a grid, a legend) and writes the figure to ``path``."""
    import matplotlib.pyplot as plt

    for ax, xlabel in axes:
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lasso(runs: dict[str, Any], optimum: float, sklearn_s: float, gap: float, path: Path) -> None:
    """Each scheduler's objective above the optimum against coordinate updates and wall time; scikit-learn's time
    to within ``gap`` as a line."""
    fig, by_updates, by_time = _two_panels()
    for name, run in runs.items():
        above = [max(o / optimum - 1, 1e-12) for o in run["objectives"]]
        by_updates.plot(run["updates"], above, label=name)
        by_time.plot(run["seconds"], above, label=name)
    by_time.axvline(sklearn_s, color="gray", linestyle="--", label=f"scikit-learn within {gap:g} (1 process)")
    by_updates.set_xscale("log")  # a diverging run ends within its first rounds: visible on a log axis
    axes = ((by_updates, "coordinate updates"), (by_time, "wall time (s)"))
    _save(fig, axes, "objective / optimum - 1", path)


def plot_mf(runs: dict[str, Any], optimum: float | None, path: Path) -> None:
    """Each order's objective (above the optimum where there is one) against rank-1 picks and wall time."""
    fig, by_picks, by_time = _two_panels()
    for name, run in runs.items():
        values = [o / optimum - 1 if optimum else o for o in run["objectives"]]
        by_picks.plot(range(1, len(values) + 1), values, label=name)
        by_time.plot(run["seconds"], values, label=name)
    axes = ((by_picks, "rank-1 picks"), (by_time, "wall time (s)"))
    _save(fig, axes, "objective / optimum - 1" if optimum else "objective", path)


def plot_pagerank(
    run: dict[str, Any], power: tuple[list[float], list[float]], networkx_s: float, n: int, path: Path
) -> None:
    """Each sweep's L1 change against sweeps and against wall time: the engine beside the scipy power iteration,
    networkx's whole run as a line."""
    fig, by_sweeps, by_time = _two_panels()
    engine_times = list(itertools.accumulate(run["sweep_s"]))[: len(run["changes"])]
    label = f"chromatic engine, {run['workers']} workers"
    by_sweeps.plot(range(1, len(run["changes"]) + 1), run["changes"], label=label)
    by_sweeps.plot(range(1, len(power[0]) + 1), power[0], label="scipy power iteration")
    by_time.plot(engine_times, run["changes"], label=label)
    by_time.plot(power[1], power[0], label="scipy power iteration")
    by_time.axvline(networkx_s, color="gray", linestyle="--", label="networkx pagerank (whole run)")
    axes = ((by_sweeps, "sweeps / power steps"), (by_time, "wall time (s)"))
    for ax, _ in axes:
        ax.axhline(n * 1e-10, color="black", linewidth=0.6, label="stop: n x 1e-10")
    _save(fig, axes, "L1 change of the ranks", path)
