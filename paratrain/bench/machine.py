"""What the machine was doing while a benchmark ran: its CPUs, how busy others kept them, the load average.

Why every report carries it: a number measured on a shared 2-core VM next to someone's test run is not the
number of an idle machine, and the reader must be able to tell which one they are looking at.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MachineSample", "OthersMeter", "cpu_busy", "cpu_model", "loadavg", "machine_report"]


def cpu_model() -> str:
    """The CPU's model name (for benchmark reports), or the platform's best guess."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages; zeros where the platform has none."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else [0.0, 0.0, 0.0]


def _cpu_ticks() -> list[int] | None:
    """user nice system idle iowait irq softirq steal, summed over CPUs (guest time is inside user)."""
    try:
        with open("/proc/stat", encoding="utf-8") as fh:
            return [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def cpu_busy(seconds: float) -> float | None:
    """The fraction of CPU time (all CPUs, steal included) that others used over ``seconds``; None off Linux.

    Why not the load average: it is a 1-minute average, so it still counts a benchmark run that just ended,
    while this sample shows what else is running right now.
    """
    first = _cpu_ticks()
    time.sleep(seconds)
    second = _cpu_ticks()
    if first is None or second is None:
        return None
    delta = [b - a for a, b in zip(first, second, strict=False)]
    total = sum(delta)
    idle = delta[3] + delta[4]
    return round(1 - idle / total, 3) if total > 0 else None


def _cpu_seconds() -> tuple[float, float] | None:
    """``(busy, total)`` CPU seconds of the whole machine since boot, steal included; None off Linux."""
    ticks = _cpu_ticks()
    if ticks is None:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped children (the job's ranks are direct children)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OthersMeter:
    """How busy the other processes on this machine kept the CPUs while we measured.

    Why: the load average counts our own ranks and lags by a minute, and a sample taken before the run misses
    a job that starts during it. The machine's busy time minus ours (and our reaped children's: the launcher's
    ranks) over the same interval is what others, or the hypervisor's steal, took from us.
    """

    def __init__(self) -> None:
        self._start = _cpu_seconds()
        self._own = _own_cpu_seconds()

    def fraction(self) -> float | None:
        """Others' share of all CPUs since construction (0..1), or None where it cannot be known."""
        end = _cpu_seconds()
        if self._start is None or end is None:
            return None
        busy = end[0] - self._start[0]
        total = end[1] - self._start[1]
        others = busy - (_own_cpu_seconds() - self._own)
        return round(min(max(others / total, 0.0), 1.0), 3) if total > 0 else None


@dataclass(frozen=True, slots=True)
class MachineSample:
    """The machine just before a benchmark: load average and how busy others kept the CPUs for half a second."""

    load: list[float]
    busy: float | None

    @classmethod
    def take(cls) -> MachineSample:
        """Samples now; blocks for half a second."""
        return cls(load=loadavg(), busy=cpu_busy(0.5))


def machine_report(before: MachineSample, during: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``machine`` block of a benchmark's JSON: CPUs, platform, Python, load and busy before, ``during``'s
    measurements, and the load average after (read now)."""
    return {
        "cpus": os.cpu_count() or 1,
        "platform": platform.platform(),
        "processor": cpu_model(),
        "python": platform.python_version(),
        "load_before": before.load,
        "busy_before": before.busy,
        **(during or {}),
        "load_after": loadavg(),
    }
