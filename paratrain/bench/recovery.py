"""``paratrain bench recovery``: kill workers on a schedule, check the result is bitwise the fault-free one, and
time the recovery against torchrun's restart of the same job.

Each schedule is one ``paratrain train --max-restarts`` run of the digits MLP with ``--kill``; its final model's
SHA-256 must equal the fault-free run's (same workers, same seed), and the survivors must record every step once,
in order (no rollback). The recovery is timed from the ranks' own records (``time.time()`` on one host):

- *death*: the killed rank's last record (it dies a few milliseconds later, as its next step's optimizer step
  begins; so every figure below is slightly generous to nobody but over-counts by that much);
- *detected*: the first survivor's ``failed_at`` (its broken collective raised);
- *re-formed*: the job met again with the replacement (the rendezvous round completed);
- *transferred*: every rank had its checkpoint and results (the last ``done_at``);
- *back*: a survivor recorded the step that the failure interrupted, i.e. training is back where it was.

The anchor is the same job under ``torchrun --max-restarts 1`` with a disk checkpoint every K steps
(:mod:`._torchrun_recovery_worker`): death -> the restarted workers running, and death -> back at the failed step
(they redo the steps since the checkpoint). Runs are interleaved (``--repeat``) and reported as median and range.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.bench.stats import ms_spread
from paratrain.launch.plan import free_port
from paratrain.train.record import read_records

__all__ = ["COLD_SCHEDULES", "DEFAULT_SCHEDULES", "Schedule", "render", "run_bench", "torchrun_anchor"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """One kill schedule: workers, epochs and the ``--kill`` text, and what it exercises."""

    workers: int
    kill: str
    what: str
    epochs: int = 2
    spare: bool = True


#: The matrix: steps before, at, during and after a checkpoint (every 5 steps), either rank, a seeded random step,
#: SIGTERM, three workers with one death, two at once, and two in a row.
DEFAULT_SCHEDULES: tuple[Schedule, ...] = (
    Schedule(2, "1@step=3", "before the first checkpoint"),
    Schedule(2, "1@step=5", "at a checkpoint's step, before it is taken"),
    Schedule(2, "1@step=6", "just after a checkpoint"),
    Schedule(2, "0@step=9", "the reporting rank, mid-interval"),
    Schedule(2, "0@step=11", "the reporting rank, just after a checkpoint"),
    Schedule(2, "1@step=20", "late, second epoch"),
    Schedule(2, "random@step=2-21", "a seeded random rank and step"),
    Schedule(2, "1@step=12:SIGTERM", "SIGTERM rather than SIGKILL"),
    Schedule(2, "1@checkpoint=2", "during a checkpoint: state copied, not yet kept"),
    Schedule(2, "0@checkpoint=3", "the reporting rank, during a checkpoint"),
    Schedule(3, "2@step=7", "3 workers, the last rank", epochs=3),
    Schedule(3, "1@step=4", "3 workers, a middle rank", epochs=3),
    Schedule(3, "1@step=4,2@step=4", "3 workers, two at once", epochs=3),
    Schedule(3, "1@step=4,0@step=13", "3 workers, two in a row", epochs=3),
)

#: The same kill restarted cold (no warm spare): what a restart costs when it must import torch and load the data,
#: as every torchrun restart does.
COLD_SCHEDULES: tuple[Schedule, ...] = (
    Schedule(2, "1@step=9", "cold restart (--no-spare)", spare=False),
    Schedule(2, "0@step=9", "cold restart (--no-spare), the reporting rank", spare=False),
)


def _deaths(kill: str) -> int:
    """How many processes a ``--kill`` schedule kills."""
    return kill.count(",") + 1


def _train(
    out: Path,
    *,
    workers: int,
    epochs: int,
    kill: str | None,
    restarts: int,
    every: int,
    seed: int,
    deadline: float,
    spare: bool = True,
) -> tuple[int, list[dict[str, Any]], dict[str, Any], str]:
    """One ``paratrain train`` job run here: exit status, records, summary (empty if it failed), output's tail."""
    from paratrain.errors import JobFailedError
    from paratrain.train.job import TrainJob
    from paratrain.train.run import run_training

    run_dir = out / "run"
    job = TrainJob(workers=workers, epochs=epochs, seed=seed, run_dir=str(run_dir), kill=kill, no_spare=not spare)
    if restarts:
        job = job.replace(max_restarts=restarts, checkpoint_every=every)
    output = io.StringIO()
    summary: dict[str, Any] = {}
    try:
        summary = run_training(job, quiet=True, output=output, deadline_s=deadline)
        code = 0
    except JobFailedError as exc:
        code = exc.exit_code
    return code, read_records(run_dir), summary, output.getvalue()[-2000:]


def _digest(records: list[dict[str, Any]]) -> str | None:
    digests = {r["parameters_sha256"] for r in records if r["kind"] == "final"}
    return next(iter(digests)) if len(digests) == 1 else None


def _timing(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Death -> detected -> re-formed -> transferred -> back, in seconds, for the first failure of a run."""
    recoveries = [r for r in records if r["kind"] == "recovery"]
    replacements = {r["rank"] for r in recoveries if r["restarted"]}
    survivors = sorted({r["rank"] for r in recoveries if not r["restarted"]} - replacements)
    if not survivors or not replacements:
        return {}
    first = min((r for r in recoveries if r["rank"] in survivors), key=lambda r: r["failed_at"])
    frontier_step = int(first["step"])  # the step the survivor logged the recovery at: the interrupted one
    killed = [
        r for r in records if r["kind"] == "step" and r["rank"] in replacements and r["time"] < first["failed_at"]
    ]
    death = max(r["time"] for r in killed) if killed else first["failed_at"]
    # the records of this recovery (a later death in the same run has its own, seconds later): the survivors
    # that broke with the first, and the replacements that finished catching up when those survivors did
    held = [r for r in recoveries if not r["restarted"] and r["frontier"] == first["frontier"]]
    joined = [r for r in recoveries if r["restarted"] and r["frontier"] == first["frontier"]]
    back = min(
        r["time"] for r in records if r["kind"] == "step" and r["rank"] in survivors and r["step"] == frontier_step
    )
    return {
        "detect_s": first["failed_at"] - death,
        "reform_s": max(r["reformed_at"] for r in held) - first["failed_at"],
        "transfer_s": max(r["done_at"] for r in held + joined) - max(r["reformed_at"] for r in held + joined),
        "total_s": back - death,
        "replayed": max((r["replayed"] for r in joined), default=0),
        "bytes": max((r["bytes_received"] for r in joined), default=0),
    }


def _no_rollback(records: list[dict[str, Any]], workers: int, steps: int) -> bool:
    """Every rank's step records (replayed ones are not recorded twice) run 1..steps once each, in order."""
    for rank in range(workers):
        mine = [r["step"] for r in records if r["kind"] == "step" and r["rank"] == rank]
        if mine != list(range(1, steps + 1)):
            return False
    return True


def torchrun_anchor(out: Path, *, kill_step: int, every: int, deadline: float) -> dict[str, Any]:
    """One torchrun --max-restarts 1 run of the same job; death -> restarted workers -> back at the failed step."""
    port = free_port()
    # lazy Gloo connections: without them the restarted workers' connectFullMesh gave up ("Connection refused",
    # 3 retries) in 3 of 3 runs here when one worker took longer to import torch than the other
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["TORCH_GLOO_LAZY_INIT"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    cmd += ["--monitor-interval", "0.1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    cmd += ["-m", "paratrain.bench._torchrun_recovery_worker", "--out", str(out), "--kill-step", str(kill_step)]
    cmd += ["--checkpoint-every", str(every)]
    # its own session, output to a file: on a hang the whole group (torchrun, its workers) is killed and the run
    # recorded as failed; a pipe would keep waiting for a surviving grandchild, and an exception lose the report
    with (out / "torchrun.log").open("w+", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_tree(proc.pid)  # torchrun starts its workers in sessions of their own: the group is not enough
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        if code != 0:
            output = log.read()
            cause = f"hung: still running after {deadline:g} s" if code is None else f"exit {code}"
            errors = [line.split("RuntimeError:", 1)[1] for line in output.splitlines() if "RuntimeError:" in line]
            if errors:  # the workers' last error, without gloo's source path: "timed out connecting: ..."
                cause += ": " + errors[-1].rsplit("] ", 1)[-1].strip()[:80]
            return {"error": cause, "output": output[-1500:]}
    events = []
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        events += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines() if line.strip()]
    death = max(e["time"] for e in events if e["kind"] == "step" and e["rank"] == 1 and e["life"] == 0)
    started = min(e["time"] for e in events if e["kind"] == "started" and e["life"] == 1)
    ready = max(e["time"] for e in events if e["kind"] == "ready" and e["life"] == 1)
    back = min(e["time"] for e in events if e["kind"] == "step" and e["life"] == 1 and e["step"] == kill_step)
    return {"spawned_s": started - death, "restarted_s": ready - death, "total_s": back - death}


def _kill_tree(pid: int) -> None:
    """SIGKILLs every descendant of ``pid`` (found by their parents in ``/proc``; none where it cannot be read)."""
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = Path(f"/proc/{entry}/stat").read_bytes()
                    parents[int(entry)] = int(stat.rpartition(b")")[2].split()[1])
    tree, grew = {pid}, True
    while grew:
        found = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= found
        grew = bool(found)
    for child in tree - {pid}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def run_bench(
    schedules: Sequence[Schedule] = DEFAULT_SCHEDULES,
    *,
    every: int = 5,
    seed: int = 0,
    torchrun_repeat: int = 3,
    torchrun_kill_step: int = 9,
    deadline: float = 300.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Runs the references, every schedule, and the torchrun anchor; returns the report (see :func:`render`)."""
    report: dict[str, Any] = {"every": every, "seed": seed, "schedules": [], "torchrun": [], "reference": {}}
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-recovery-") as tmp:
        root = Path(tmp)
        for workers, epochs in sorted({(s.workers, s.epochs) for s in schedules}):
            for restarts in (0, 2):
                where = root / f"ref-{workers}-{restarts}"
                where.mkdir()
                code, records, summary, err = _train(
                    where,
                    workers=workers,
                    epochs=epochs,
                    kill=None,
                    restarts=restarts,
                    every=every,
                    seed=seed,
                    deadline=deadline,
                )
                key = f"{workers}x{epochs}" + ("-reliable" if restarts else "")
                report["reference"][key] = {
                    "exit": code,
                    "digest": _digest(records),
                    "samples_per_s": summary.get("samples_per_sec"),
                    "steps": max((r["step"] for r in records if r["kind"] == "step"), default=0),
                    "error": err if code else None,
                }
                if progress:
                    print(f"reference {key}: exit {code}, {summary.get('samples_per_sec')} samples/s", file=sys.stderr)
        for index, schedule in enumerate(schedules):
            ref = report["reference"][f"{schedule.workers}x{schedule.epochs}-reliable"]
            where = root / f"kill-{index}"
            where.mkdir()
            started = time.time()
            code, records, _, err = _train(
                where,
                workers=schedule.workers,
                epochs=schedule.epochs,
                kill=schedule.kill,
                restarts=_deaths(schedule.kill),
                every=every,
                seed=seed,
                deadline=deadline,
                spare=schedule.spare,
            )
            row = {
                "spare": schedule.spare,
                "workers": schedule.workers,
                "kill": schedule.kill,
                "what": schedule.what,
                "exit": code,
                "bitwise_equal": code == 0 and _digest(records) == ref["digest"],
                "no_rollback": code == 0 and _no_rollback(records, schedule.workers, ref["steps"]),
                "wall_s": time.time() - started,
                **(_timing(records) if code == 0 else {"error": err}),
            }
            report["schedules"].append(row)
            if progress:
                print(f"{schedule.kill}: {json.dumps(row)}", file=sys.stderr)
            if (
                index % max(1, len(schedules) // max(1, torchrun_repeat)) == 0
                and len(report["torchrun"]) < torchrun_repeat
            ):
                anchor = root / f"torchrun-{index}"
                anchor.mkdir()
                report["torchrun"].append(
                    torchrun_anchor(anchor, kill_step=torchrun_kill_step, every=every, deadline=deadline)
                )
                if progress:
                    print(f"torchrun: {report['torchrun'][-1]}", file=sys.stderr)
    theirs = [r["total_s"] for r in report["torchrun"] if "total_s" in r]
    for key, spare in (("ratio_total", True), ("ratio_total_cold", False)):
        ours = _one_death_totals(report, spare=spare)
        if ours and theirs:
            report[key] = statistics.median(ours) / statistics.median(theirs)
    return report


def _one_death_totals(report: dict[str, Any], *, spare: bool) -> list[float]:
    """Death -> back at the failed step, in seconds, of the schedules that kill one process, warm or cold."""
    return [
        r["total_s"]
        for r in report["schedules"]
        if "total_s" in r and _deaths(str(r["kill"])) == 1 and r["spare"] == spare
    ]


def _ms(value: Any) -> str:
    return f"{value * 1000:.0f}" if isinstance(value, float) else "-"


def render(report: dict[str, Any]) -> str:
    """The report as text tables."""
    lines = [
        f"paratrain train --max-restarts, digits MLP, checkpoint every {report['every']} steps, seed {report['seed']}",
        "",
        f"{'workers':>7}  {'kill':<22} {'bitwise':>7} {'no rollback':>11} {'detect':>7} {'re-form':>7} "
        f"{'transfer':>8} {'back':>6} {'replayed':>8}  what",
    ]
    for r in report["schedules"]:
        lines.append(
            f"{r['workers']:>7}  {r['kill']:<22} {'yes' if r['bitwise_equal'] else 'NO':>7} "
            f"{'yes' if r['no_rollback'] else 'NO':>11} {_ms(r.get('detect_s')):>7} {_ms(r.get('reform_s')):>7} "
            f"{_ms(r.get('transfer_s')):>8} {_ms(r.get('total_s')):>6} {r.get('replayed', '-'):>8}  {r['what']}"
        )
    equal = sum(1 for r in report["schedules"] if r["bitwise_equal"])
    lines += ["", f"bitwise equal to the fault-free run: {equal} of {len(report['schedules'])} schedules (times in ms)"]
    for spare, how in ((True, "from a warm spare"), (False, "cold")):
        ours = _one_death_totals(report, spare=spare)
        if ours:
            lines.append(f"paratrain, one death, restarted {how} -> back at the failed step: {ms_spread(ours)}")
    theirs = [r for r in report["torchrun"] if "total_s" in r]
    lines.append(
        "torchrun --max-restarts 1, death -> new worker processes started: "
        + ms_spread([r["spawned_s"] for r in theirs])
    )
    lines.append(
        "torchrun --max-restarts 1, death -> restarted workers ready (torch imported, process group, data, model, "
        "checkpoint loaded): " + ms_spread([r["restarted_s"] for r in theirs])
    )
    lines.append(
        "torchrun --max-restarts 1, death -> back at the failed step: " + ms_spread([r["total_s"] for r in theirs])
    )
    failed = sum(1 for r in report["torchrun"] if "error" in r)
    if failed:
        lines.append(f"torchrun runs that failed to recover: {failed} of {len(report['torchrun'])}")
    for key, how in (("ratio_total", "warm spare"), ("ratio_total_cold", "cold")):
        if key in report:
            lines.append(f"ratio of medians, paratrain ({how}) / torchrun: {report[key]:.2f}")
    refs = report["reference"]
    for key, ref in refs.items():
        if key.endswith("-reliable") and refs.get(key[: -len("-reliable")], {}).get("samples_per_s"):
            plain = refs[key[: -len("-reliable")]]
            same = ref["digest"] == plain["digest"]
            lines.append(
                f"fault-free {key[:-9]}: reliable {ref['samples_per_s']:.0f} samples/s vs plain allreduce "
                f"{plain['samples_per_s']:.0f} ({ref['samples_per_s'] / plain['samples_per_s']:.2f}x); "
                f"final models equal: {same}"
            )
    return "\n".join(lines)
