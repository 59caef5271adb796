"""The parts every benchmark table shares: the machine it ran on, the engines that failed, a noise warning.

A table is read without the JSON beside it, so it must say where it was measured and how trustworthy that
was; these helpers keep the wording the same in every ``paratrain bench`` command.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["cpus", "footer", "load", "noise_note", "rounds_note"]

# The table's only row when no engine produced results.
_NO_RESULTS = f"{'':>9}  (no engine produced results; see the errors below)"

# Above this share of the CPUs taken by others, a table says that its timings are noisy.
_NOISY = 0.2


def cpus(machine: Mapping[str, Any]) -> str:
    """E.g. ``"2 CPUs (AMD EPYC 7B13)"``."""
    return f"{machine['cpus']} CPUs ({machine['processor']})"


def load(machine: Mapping[str, Any]) -> str:
    """E.g. ``"load average 0.52 before, 1.97 after"``."""
    return f"load average {machine['load_before'][0]:.2f} before, {machine['load_after'][0]:.2f} after"


def rounds_note(repeat: int) -> str:
    """How a time column was reduced over runs: the end of its definition line.

    Example:
        >>> rounds_note(1), rounds_note(3)
        (';', ', median of 3 interleaved runs;')
    """
    return f", median of {repeat} interleaved runs;" if repeat > 1 else ";"


def _failure_lines(engines: Mapping[str, Mapping[str, str]]) -> list[str]:
    """One line per engine that did not run well: ``"<name>: <status>: <detail>"``."""
    return [f"{name}: {info['status']}: {info['detail']}" for name, info in engines.items() if info["status"] != "ok"]


def noise_note(busy: float | None, when: str) -> list[str]:
    """A warning line if others kept the CPUs busy ``when`` (e.g. ``"just before the run"``); else none.

    Example:
        >>> noise_note(0.1, "around the run")
        []
    """
    if busy is None or busy <= _NOISY:
        return []
    return [
        f"note: other processes kept the CPUs {busy:.0%} busy {when}; timings are noisy — re-run on an idle machine."
    ]


def footer(report: Mapping[str, Any], definitions: list[str], *, busy: float | None, when: str) -> list[str]:
    """The lines under a table's rows: a word if there were none, the column definitions, what failed, noise.

    ``busy`` is the share of the CPUs others took ``when`` (see :func:`noise_note`).
    """
    empty = [_NO_RESULTS] if not report["results"] else []
    return [*empty, "", *definitions, *_failure_lines(report["engines"]), *noise_note(busy, when)]
