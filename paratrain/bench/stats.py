"""The numbers every benchmark reports the same way: the slowest rank's time, medians over rounds, ratios.

Why the slowest rank: a collective (or a synchronous step) is done when its last rank is done, so the time a
user waits is the maximum over ranks, not their mean. Why medians over interleaved rounds: on a shared or
virtual machine a whole run can land in a slow period (a neighbour's load, a migrated vCPU); interleaving the
engines' rounds and taking the median keeps one bad period from deciding a comparison, and the spread (every
round's value, or min and max) is kept beside it so that nothing is hidden.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["combine_runs", "median_spread", "ms_spread", "quantile", "ratio", "slowest_rank"]


def slowest_rank(records: Sequence[dict[str, Any]]) -> tuple[float, list[float]]:
    """The slowest rank's mean time per iteration, and per iteration the slowest rank's time.

    ``records`` are the ranks' records of one size: ``total_s`` (the back-to-back loop), ``iters`` and
    ``times_s`` (each iteration timed alone), as :func:`paratrain.bench._timing.run_sizes` writes them.

    Example:
        >>> slowest_rank([{"total_s": 3.0, "iters": 3, "times_s": [1.0, 1.0, 1.0]},
        ...               {"total_s": 6.0, "iters": 3, "times_s": [1.0, 4.0, 1.0]}])
        (2.0, [1.0, 4.0, 1.0])
    """
    mean_s = max(r["total_s"] / max(r["iters"], 1) for r in records)
    count = min(len(r["times_s"]) for r in records)
    return mean_s, [max(r["times_s"][i] for r in records) for i in range(count)]


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by rank (no interpolation: a time that was measured), e.g. ``q=0.9`` for p90."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_spread(values: Sequence[float]) -> dict[str, float] | None:
    """``{"median", "min", "max"}`` of rounds' values; None when there are none.

    Example:
        >>> median_spread([3.0, 1.0, 2.0])
        {'median': 2.0, 'min': 1.0, 'max': 3.0}
    """
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ms_spread(seconds: Sequence[float], *, unit: str = " ms") -> str:
    """Times in seconds as ``"median<unit> (min-max)"`` in whole milliseconds; ``"-"`` when there are none.

    Example:
        >>> ms_spread([0.111, 0.094, 0.158]), ms_spread([0.02, 0.03], unit=""), ms_spread([])
        ('111 ms (94-158)', '25 (20-30)', '-')
    """
    if not seconds:
        return "-"
    return f"{statistics.median(seconds) * 1000:.0f}{unit} ({min(seconds) * 1000:.0f}-{max(seconds) * 1000:.0f})"


def combine_runs(
    runs: Sequence[Sequence[dict[str, Any]]],
    *,
    times: Sequence[str],
    rates: Sequence[str],
    runs_key: str,
    nested: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Rows of repeated runs of one engine merged: the median of every time, every run's main time kept.

    Args:
        runs: per run, the rows of that run (same sizes in the same order in every run).
        times: the time columns to take the median of; the first is the main one.
        rates: throughput columns, recomputed from the median main time (rate x first time / median time), so
            that a row's rate and time always agree.
        runs_key: where every run's main time is kept (the spread).
        nested: columns holding ``{name: time}`` dicts, merged name by name.

    Example:
        >>> rows = [[{"t": t, "gbps": 1.0}] for t in (3, 1, 2)]
        >>> combine_runs(rows, times=["t"], rates=["gbps"], runs_key="runs")
        [{'t': 2, 'gbps': 1.5, 'runs': [3, 1, 2]}]
    """
    main = times[0]
    merged = []
    for index, first in enumerate(runs[0]):
        same = [run[index] for run in runs]
        row = dict(first)
        for name in times:
            row[name] = statistics.median(r[name] for r in same)
        for name in nested:
            row[name] = {k: statistics.median(r[name][k] for r in same) for k in first[name]}
        row[runs_key] = [r[main] for r in same]
        if row[main] > 0 and first[main] > 0:
            scale = first[main] / row[main]
            for name in rates:
                row[name] = round(first[name] * scale, 4)
        merged.append(row)
    return merged


def ratio(numerator: float | None, denominator: float | None, *, scale: float = 1.0, digits: int = 3) -> float | None:
    """``scale x numerator / denominator`` rounded, or None when either is missing or the denominator is not > 0.

    Benchmarks put paratrain next to an anchor this way: "anchor's time / this time" (> 1: paratrain faster), or
    "100 x this throughput / the ceiling's" (a percentage).

    Example:
        >>> ratio(30.0, 20.0), ratio(1.0, 4.0, scale=100, digits=1), ratio(None, 2.0)
        (1.5, 25.0, None)
    """
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(scale * numerator / denominator, digits)
