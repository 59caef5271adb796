"""``paratrain bench ddp-anchor``: torch DDP (Gloo) with its compression hooks, trained like ``paratrain train``.

The anchor for paratrain's compression and SFB results: the same model, data, shards, optimizer and seed, with
DDP's own ``fp16_compress_hook`` and ``powerSGD_hook``. With ``--rate``, every run is inside a fresh network
namespace (``unshare -n``, root) whose loopback is throttled by ``tc qdisc ... tbf rate RATE burst 512kb latency
100ms`` (this kernel has no netem; a smaller burst stalls Gloo). That is one link shared by all workers (a hub),
where paratrain's fault injector gives every worker a link of its own (a switch): with P workers the throttled
loopback carries the sum of their traffic, so the anchor is slowed more than paratrain's emulation would slow
it; the README says so next to the numbers.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from paratrain.bench.machine import MachineSample, machine_report
from paratrain.errors import ConfigError
from paratrain.launch.plan import free_port

__all__ = ["render_ddp_anchor", "run_ddp_anchor"]


def _script(hook: str, out: str, workers: int, rate: str | None, train_args: list[str]) -> str:
    port = free_port()
    lines = ["set -e"]
    if rate:
        lines += [
            "ip link set lo up",
            f"tc qdisc add dev lo root tbf rate {shlex.quote(rate)} burst 512kb latency 100ms",
        ]
    argv = [sys.executable, "-m", "paratrain.bench._ddp_train_worker", "--hook", hook, "--out", out, *train_args]
    for rank in range(workers):
        env = (
            f"RANK={rank} WORLD_SIZE={workers} MASTER_ADDR=127.0.0.1 MASTER_PORT={port} GLOO_SOCKET_IFNAME=lo "
            "OMP_NUM_THREADS=1"
        )
        lines.append(f"env {env} {' '.join(shlex.quote(a) for a in argv)} &")
    lines += ["fail=0", "for job in $(jobs -p); do wait $job || fail=1; done", "exit $fail"]
    return "\n".join(lines)


def run_ddp_anchor(
    *,
    hooks: list[str],
    workers: int,
    rate: str | None,
    train_args: list[str],
    repeat: int = 1,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """Runs every hook ``repeat`` times (interleaved); returns the records by hook.

    Raises:
        ConfigError: a run failed (its stderr says why) or ``--rate`` without the rights to make a namespace.
    """
    before = MachineSample.take()
    runs: dict[str, list[dict[str, Any]]] = {hook: [] for hook in hooks}
    for _ in range(repeat):
        for hook in hooks:
            with tempfile.TemporaryDirectory(prefix="paratrain-ddp-") as out:
                script = _script(hook, out, workers, rate, train_args)
                cmd = ["unshare", "-n", "bash", "-c", script] if rate else ["bash", "-c", script]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
                if done.returncode != 0:
                    raise ConfigError(f"the DDP anchor with hook {hook!r} failed:\n{done.stderr[-3000:]}")
                runs[hook].append(json.loads(Path(out, "ddp.json").read_text()))
    return {
        "benchmark": "ddp-anchor",
        "workers": workers,
        "rate": rate,
        "train_args": train_args,
        "repeat": repeat,
        "machine": machine_report(before),
        "runs": runs,
    }


def time_to_accuracy(record: dict[str, Any], target: float) -> float | None:
    """Training seconds until the first epoch whose test accuracy reached ``target`` (None if never)."""
    for epoch in record["epochs"]:
        if epoch["test_accuracy"] >= target:
            return float(epoch["train_s"])
    return None


def render_ddp_anchor(report: dict[str, Any], target: float) -> str:
    """Median samples/s (and spread), final accuracy and time to ``target`` per hook, as Markdown."""
    lines = [
        f"torch DDP over Gloo, {report['workers']} workers"
        + (f", loopback throttled to {report['rate']} (tbf, shared by all workers)" if report["rate"] else ""),
        "",
        f"| hook | samples/s (median, min-max) | median step s | final test acc | time to {target} |",
        "|---|---:|---:|---:|---:|",
    ]
    for hook, runs in report["runs"].items():
        speeds = sorted(r["samples_per_sec"] for r in runs)
        mid = sorted(runs, key=lambda r: r["samples_per_sec"])[(len(runs) - 1) // 2]
        reach = time_to_accuracy(mid, target)
        lines.append(
            f"| {hook} | {speeds[(len(speeds) - 1) // 2]:,.0f} ({speeds[0]:,.0f}-{speeds[-1]:,.0f}) | "
            f"{mid['step_s_median']:.3f} | {mid['epochs'][-1]['test_accuracy']:.4f} | "
            f"{'not reached' if reach is None else f'{reach:.1f} s'} |"
        )
    return "\n".join(lines)
