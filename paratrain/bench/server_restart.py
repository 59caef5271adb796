"""``paratrain bench recovery --server``: what a parameter server's death costs when it is restarted and catches up.

Each run is ``paratrain launch -n 2 --servers 2 --replicas 2 --max-restarts 1`` of
:mod:`paratrain.bench._ps_restart_worker`: one float32 key of N elements under BSP with the servers' Adam (a
server holds value and two moments, 3 x 4 N bytes, all of which a restarted server must receive), worker 0
SIGKILLing server 0 at clock 10. Timed from the workers' records (``time.time()``, one host):

* *failover*: the death -> a worker's first push acknowledged by the backup (the job goes on with one copy);
* *back*: the death -> a worker sees the restarted server (the launcher noticed, started a new process, it
  rejoined the rendezvous and said hello);
* *pause*: how long a worker stood at its fence (its pushes drained, then the server's catch-up: every worker's
  fence, the donor's snapshot of 3 x 4 N bytes, the install); the job's pause is the longest of the workers'.

The anchor is the transport's own ceiling for the snapshot: the same 3 x 4 N bytes sent once, one way, between
two processes over ipc, zero-copy (``--ceiling`` of the same module), so ``pause / ceiling`` says what the fence
and the bookkeeping add to moving the bytes. Sizes are interleaved over ``--repeat`` rounds; the report gives the
median and the range.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paratrain.bench.stats import ms_spread

__all__ = ["SIZES", "render", "run_server_bench"]

#: Float32 elements of the key: 1 MiB, 16 MiB and 64 MiB of parameters (3 x that on each server, with Adam).
SIZES: tuple[int, ...] = (1 << 18, 1 << 22, 1 << 24)

_LAUNCH = [sys.executable, "-m", "paratrain.cli.main", "launch"]
_WORKER = ["python", "-m", "paratrain.bench._ps_restart_worker"]


def _run(out: Path, size: int, deadline: float) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*_LAUNCH, "-n", "2", "--servers", "2", "--replicas", "2", "--max-restarts", "1"]
    done = subprocess.run(
        [*cmd, "--", *_WORKER, "--out", str(out), "--size", str(size)],
        capture_output=True,
        text=True,
        timeout=deadline,
        check=False,
    )
    records = [json.loads(p.read_text()) for p in sorted(out.glob("restart-rank*.json"))]
    killed = next((r["killed"] for r in records if r["killed"] is not None), None)
    run: dict[str, Any] = {
        "size": size,
        "exit": done.returncode,
        "error": done.stderr[-1500:] if done.returncode else "",
    }
    if killed is None or len(records) != 2 or not all(r["fences"] for r in records):
        return {**run, "ok": False}
    failovers = [r["failover"] - killed for r in records if r["failover"] is not None]
    return {
        **run,
        "ok": done.returncode == 0,
        "failover_s": min(failovers) if failovers else None,
        "back_s": min(r["fences"][0][0] for r in records) - killed,
        "pause_s": max(r["fences"][0][1] for r in records),
        "clocks": [r["clocks"] for r in records],
    }


def _ceiling(out: Path, size: int, deadline: float) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    elements = 3 * size  # value and Adam's two moments
    subprocess.run(
        [*_LAUNCH, "-n", "2", "--", *_WORKER, "--out", str(out), "--size", str(elements), "--ceiling"],
        capture_output=True,
        text=True,
        timeout=deadline,
        check=False,
    )
    found = out / f"ceiling-{elements}.json"
    return json.loads(found.read_text()) if found.exists() else {}


def run_server_bench(
    sizes: Sequence[int] = SIZES, *, repeat: int = 3, deadline: float = 300.0, progress: bool = True
) -> dict[str, Any]:
    """Every size once per round, with its ceiling, ``repeat`` rounds."""
    report: dict[str, Any] = {"sizes": list(sizes), "runs": [], "ceilings": []}
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-server-") as tmp:
        root = Path(tmp)
        for round_number in range(repeat):
            for size in sizes:
                where = root / f"{round_number}-{size}"
                run = _run(where / "job", size, deadline)
                ceiling = _ceiling(where / "ceiling", size, deadline)
                report["runs"].append(run)
                report["ceilings"].append({"size": size, **ceiling})
                if progress:
                    print(f"round {round_number + 1}, {size} elements: {run} ceiling {ceiling}", file=sys.stderr)
    return report


def render(report: dict[str, Any]) -> str:
    """The report as a table: per size, the median and range of each time (ms) and the pause against the ceiling."""
    lines = [
        "paratrain launch -n 2 --servers 2 --replicas 2 --max-restarts 1, BSP, server-side Adam; server 0 SIGKILLed",
        "",
        f"{'params':>8} {'snapshot':>9} {'ok':>5} {'failover ms':>14} {'back ms':>16} {'pause ms':>14} "
        f"{'ceiling ms':>12} {'pause/ceiling':>14}",
    ]
    for size in report["sizes"]:
        runs = [r for r in report["runs"] if r["size"] == size]
        good = [r for r in runs if r["ok"]]
        ceilings = [c["seconds"] for c in report["ceilings"] if c["size"] == size and "seconds" in c]
        pauses = [r["pause_s"] for r in good]
        ratio = f"{statistics.median(pauses) / statistics.median(ceilings):.1f}x" if pauses and ceilings else "-"
        failover = ms_spread([r["failover_s"] for r in good if r["failover_s"] is not None], unit="")
        back = ms_spread([r["back_s"] for r in good], unit="")
        lines.append(
            f"{size * 4 / 2**20:>6.0f}Mi {size * 12 / 2**20:>7.0f}Mi {len(good):>2}/{len(runs):<2} {failover:>14} "
            f"{back:>16} {ms_spread(pauses, unit=''):>14} {ms_spread(ceilings, unit=''):>12} {ratio:>14}"
        )
    lines += [
        "",
        "failover: death -> first push acknowledged by the backup; back: death -> a worker sees the restarted "
        "server; pause: the longest fence (pushes drained + catch-up); ceiling: the snapshot's bytes sent once, "
        "one way, between two processes over ipc (median and range over rounds)",
    ]
    return "\n".join(lines)
