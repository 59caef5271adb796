"""``paratrain bench recovery --elastic``: what an elastic job (``--min-workers``) pays to shrink and to grow back.

Each run is ``paratrain train --workers 3 --min-workers 2`` on the digits MLP with one worker SIGKILLed at a step:

- *shrink* (no restart): the survivors re-form as 2 and go on. Timed from the ranks' records (``time.time()``
  on one host) as death (the killed rank's last record) -> detected (a survivor's broken collective) ->
  re-formed (the 2-rank job met) -> back (a survivor completed the interrupted step, recomputed for 2). The
  final model is compared with the fault-free run's: the same global batches, summed in another order, so the
  largest parameter difference should be float rounding and the test accuracy equal;
- *shrink and join* (``--max-restarts 1 --no-spare``): the same, and the replacement, started cold, joins at
  a checkpoint. Timed: death -> the joiner admitted, and how long the survivors paused to admit it (the
  checkpoint's re-forming and its transfer). All three final models must be equal.

Beside them the fault-free elastic run and the fault-free ``--max-restarts 1`` run: their final models must be
bitwise equal (an elastic job at its launched size computes exactly what a fixed-size one does). Runs are
interleaved over ``--repeat`` and reported as median and range.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paratrain.bench.stats import ms_spread
from paratrain.train.record import read_records

__all__ = ["KILL_STEPS", "render", "run_elastic_bench"]

#: Steps a worker is killed at (checkpoints every 5): before the first, at one's step, just after one, mid-interval.
KILL_STEPS: tuple[int, ...] = (3, 5, 6, 12)


def _train(out: Path, *, epochs: int, deadline: float, **settings: Any) -> dict[str, Any]:
    """One ``paratrain train`` job of three workers (checkpoints every 5 steps) with ``settings``, run here; its
    ranks' output kept (the tail is the error of a failed run)."""
    from paratrain.errors import JobFailedError
    from paratrain.train.job import TrainJob
    from paratrain.train.run import run_training

    run_dir = out / "run"
    job = TrainJob(workers=3, epochs=epochs, checkpoint_every=5, run_dir=str(run_dir), **settings)
    output = io.StringIO()
    try:
        run_training(job, quiet=True, output=output, deadline_s=deadline)
        code = 0
    except JobFailedError as exc:
        code = exc.exit_code
    records = read_records(run_dir)
    return {"exit": code, "records": records, "model": run_dir / "model.pt", "error": output.getvalue()[-1500:]}


def _digests(records: list[dict[str, Any]]) -> dict[int, str]:
    return {int(r["rank"]): str(r["parameters_sha256"]) for r in records if r["kind"] == "final"}


def _accuracy(records: list[dict[str, Any]]) -> float | None:
    evals = [r for r in records if r["kind"] == "eval"]
    return float(max(evals, key=lambda r: (r["epoch"], -r["rank"]))["test_accuracy"]) if evals else None


def _max_difference(a: Path, b: Path) -> float | None:
    import torch

    if not a.exists() or not b.exists():
        return None
    x, y = torch.load(a), torch.load(b)
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def _shrink_timing(records: list[dict[str, Any]], killed: int) -> dict[str, float]:
    """Death -> detected -> re-formed -> back for the shrink (the first recovery without the killed member)."""
    shrinks = [r for r in records if r["kind"] == "recovery" and killed not in r["members"]]
    if not shrinks:
        return {}
    first = min(shrinks, key=lambda r: r["failed_at"])
    death = _death(records, killed)
    survivors = {r["rank"] for r in shrinks}
    back = min(
        r["time"] for r in records if r["kind"] == "step" and r["rank"] in survivors and r["step"] == first["step"]
    )
    return {
        "detect_s": first["failed_at"] - death,
        "reform_s": max(r["reformed_at"] for r in shrinks) - first["failed_at"],
        "total_s": back - death,
    }


def _join_timing(records: list[dict[str, Any]], killed: int, death: float) -> dict[str, float]:
    """Death -> the joiner admitted, and the survivors' pause to admit it."""
    joined = [r for r in records if r["kind"] == "recovery" and r["restarted"] and r["rank"] == killed]
    admitting = [
        r for r in records if r["kind"] == "recovery" and not r["restarted"] and killed in r["members"] and r["step"]
    ]
    if not joined or not admitting:
        return {}
    return {
        "joined_after_s": joined[0]["done_at"] - death,
        "pause_s": max(r["done_at"] - r["failed_at"] for r in admitting),
        "join_bytes": float(joined[0]["bytes_received"]),
    }


def run_elastic_bench(
    kill_steps: Sequence[int] = KILL_STEPS,
    *,
    repeat: int = 1,
    epochs: int = 3,
    join_epochs: int = 150,
    deadline: float = 300.0,
    progress: bool = True,
) -> dict[str, Any]:
    """The references, then every kill step with and without a joining replacement, ``repeat`` times, interleaved."""
    report: dict[str, Any] = {"epochs": epochs, "join_epochs": join_epochs, "runs": [], "reference": {}}
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-elastic-") as tmp:
        root = Path(tmp)
        refs: dict[str, dict[str, Any]] = {}
        references: tuple[tuple[str, dict[str, int], int], ...] = (
            ("elastic", {"min_workers": 2}, epochs),
            ("restarts", {"max_restarts": 1}, epochs),
            ("elastic-long", {"min_workers": 2}, join_epochs),
        )
        for key, ref_settings, n in references:
            (root / key).mkdir()
            refs[key] = _train(root / key, epochs=n, deadline=deadline, **ref_settings)
            distinct = set(_digests(refs[key]["records"]).values())
            report["reference"][key] = {
                "exit": refs[key]["exit"],
                "digest": next(iter(distinct)) if len(distinct) == 1 else None,
                "accuracy": _accuracy(refs[key]["records"]),
            }
            if progress:
                print(f"reference {key}: {report['reference'][key]}", file=sys.stderr)
        for round_number in range(repeat):
            for step in kill_steps:
                for join in (False, True):
                    where = root / f"r{round_number}-s{step}-{'join' if join else 'shrink'}"
                    where.mkdir()
                    settings: dict[str, Any] = {"min_workers": 2, "kill": f"1@step={step}"}
                    settings |= {"max_restarts": 1, "no_spare": True} if join else {}
                    ref = refs["elastic-long" if join else "elastic"]
                    run = _train(where, epochs=join_epochs if join else epochs, deadline=deadline, **settings)
                    records = run["records"]
                    timing = _shrink_timing(records, 1)
                    digests = _digests(records)
                    row: dict[str, Any] = {
                        "kill_step": step,
                        "join": join,
                        "exit": run["exit"],
                        "ranks_equal": len(set(digests.values())) == 1,
                        "finished": sorted(digests),
                        "max_difference": _max_difference(ref["model"], run["model"]),
                        "accuracy_equal": _accuracy(records) == _accuracy(ref["records"]),
                        **timing,
                    }
                    if join and timing:
                        row.update(_join_timing(records, 1, _death(records, 1)))
                    if run["exit"] != 0:
                        row["error"] = run["error"]
                    report["runs"].append(row)
                    if progress:
                        print(json.dumps(row), file=sys.stderr)
    ref = report["reference"]
    report["fault_free_bitwise_equal"] = ref["elastic"]["digest"] is not None and (
        ref["elastic"]["digest"] == ref["restarts"]["digest"]
    )
    return report


def _death(records: list[dict[str, Any]], killed: int) -> float:
    """When ``killed`` died: its last record before the survivors' shrink (it dies a few ms later)."""
    first = min(r["failed_at"] for r in records if r["kind"] == "recovery" and killed not in r["members"])
    steps = [r["time"] for r in records if r["kind"] == "step" and r["rank"] == killed and r["time"] < first]
    return float(max(steps)) if steps else float(first)


def render(report: dict[str, Any]) -> str:
    """The report as a text table and summary lines."""
    lines = [
        "paratrain train --workers 3 --min-workers 2, digits MLP, checkpoint every 5 steps; worker 1 SIGKILLed",
        "",
        f"{'kill':>8} {'joiner':>6} {'exit':>4} {'ranks =':>7} {'max |diff|':>10} {'acc =':>5} {'detect':>7} "
        f"{'re-form':>7} {'back':>6} {'joined':>7} {'pause':>6}",
    ]
    for r in report["runs"]:
        diff = r.get("max_difference")
        lines.append(
            f"{'step ' + str(r['kill_step']):>8} {'yes' if r['join'] else 'no':>6} {r['exit']:>4} "
            f"{'yes' if r['ranks_equal'] else 'NO':>7} {f'{diff:.1e}' if diff is not None else '-':>10} "
            f"{'yes' if r['accuracy_equal'] else 'NO':>5} {_ms(r.get('detect_s')):>7} {_ms(r.get('reform_s')):>7} "
            f"{_ms(r.get('total_s')):>6} {_ms(r.get('joined_after_s')):>7} {_ms(r.get('pause_s')):>6}"
        )
    runs = report["runs"]
    ok = [r for r in runs if r["exit"] == 0]
    lines += [
        "",
        f"completed: {len(ok)} of {len(runs)} runs; every rank's final model equal: "
        f"{sum(1 for r in ok if r['ranks_equal'])} of {len(ok)}; test accuracy equal to the fault-free run's: "
        f"{sum(1 for r in ok if r['accuracy_equal'])} of {len(ok)}",
        "largest parameter difference from the fault-free run: "
        + (f"{max(d):.1e}" if (d := [r["max_difference"] for r in ok if r.get("max_difference") is not None]) else "-"),
        "death -> survivors back at the interrupted step (shrunk to 2): "
        + ms_spread([r["total_s"] for r in ok if "total_s" in r]),
        "death -> the cold replacement admitted: "
        + ms_spread([r["joined_after_s"] for r in ok if "joined_after_s" in r]),
        "survivors' pause to admit it (at a checkpoint): " + ms_spread([r["pause_s"] for r in ok if "pause_s" in r]),
        "fault-free elastic run bitwise equal to the fault-free --max-restarts run: "
        + str(report["fault_free_bitwise_equal"]),
    ]
    return "\n".join(lines)


def _ms(value: Any) -> str:
    return f"{value * 1000:.0f}" if isinstance(value, float) else "-"
