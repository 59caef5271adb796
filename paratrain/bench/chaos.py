"""``paratrain bench chaos``: kill schedules drawn at random over every strategy, each run classified.

Each run is one ``paratrain train`` job of two epochs on the digits MLP (a :class:`~paratrain.train.job.TrainJob`)
with a ``--kill`` drawn at random (:func:`draw_cases`): one worker at a step or at a time, two workers at two
steps, or (parameter-server strategies, their two servers replicated) a server at a time, alone or with a worker
killed within 0.3 s of it. The strategies that
recover from a worker's death (their units declare ``restarts``) run with ``--max-restarts`` as many as the deaths,
a quarter of them without a warm spare (``--no-spare``: the replacement starts cold); the others as users run them.
Every run ends in one of:

- ``bitwise``: the kill fired, the job finished, and its final model is bitwise the fault-free run's;
- ``accurate``: an asynchronous strategy (SSP, ASP) finished with another model, its test accuracy (the worker that
  finished last: the servers' final model) at most :data:`ACCURACY_SLACK` below the lowest of its fault-free runs'
  (their updates depend on timing: no two runs agree bitwise, and two fault-free ASP runs of this short job end up
  to 0.08 apart);
- ``differs``: the kill fired and the job finished with another model (wrong for a synchronous strategy, or
  an asynchronous one less accurate);
- ``failed fast``: the job stopped with an error, in the seconds given (the cause is the ranks' last line);
- ``hung``: still running at the deadline (stopped there);
- ``no death``: the job ended before its kill came (a time kill after the last step).

The fault-free model of each strategy is one more run per strategy, without a kill (with the restarts its cases
have: a parameter-server job that restarts workers sums each round in worker order); an asynchronous strategy gets
:data:`ASYNC_REFERENCES` of them. A run whose replacement
rejoined after a step kill also says how long the worker was gone: from its predecessor's last record to the
replacement's ``rejoined`` record, about to compute (a parameter-server worker: from the loss of the step it was
killed in, written as that step's synchronisation began, to its parameters pulled; a gossip worker or a pipeline
stage: from its last step's record to its state received and every rank rolled back).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paratrain.strategy import parse_strategy

__all__ = ["ACCURACY_SLACK", "ASYNC_REFERENCES", "STRATEGIES", "Case", "classify", "draw_cases", "render", "run_chaos"]

#: How far below the lowest test accuracy of its fault-free runs a recovered asynchronous run may end and count as
#: ``accurate``; and how many fault-free runs an asynchronous strategy gets (a synchronous one: 1, its model is exact).
ACCURACY_SLACK = 0.05
ASYNC_REFERENCES = 5

#: Every strategy kind, as ``paratrain train`` takes it (gossip on 3 workers: a ring of 2 is a pair).
STRATEGIES = (
    "allreduce",
    "sfb",
    "poseidon:allreduce",
    "bsp",
    "ssp:1",
    "asp",
    "poseidon",
    "gossip:ring",
    "pipeline:gpipe",
    "pipeline:1f1b",
    "pipeline:pipedream",
    "tp:2",
)


@dataclass(frozen=True)
class Case:
    """One chaos run: the strategy, its workers, the kill schedule, the restarts allowed, whether a warm spare
    waits, the parameter servers' replicas (2 where a server is killed), and what is killed (``worker step``,
    ``worker time``, ``two workers``, ``server``, ``worker+server``)."""

    strategy: str
    workers: int
    kill: str
    restarts: int
    spare: bool = True
    replicas: int = 1
    what: str = "worker step"


def draw_cases(strategies: tuple[str, ...], runs: int, *, seed: int, steps: int) -> list[Case]:
    """``runs`` cases, the strategies in turn, each drawn by a seeded generator: a parameter-server strategy's
    server at a time in 1.5..3.0 s after the start (3/8 of theirs: its servers replicated, the server restarted
    once), in two of three of them with a worker killed within 0.3 s of it (``worker+server``); else two workers at
    two steps (a sixth), or one worker at a step in 2..``steps`` - 1 or at a time in 1.5..3.0 s (half each).
    Recovering strategies restart each death, from a warm spare or (a quarter) cold.

    Example:
        >>> [(c.kill, c.what) for c in draw_cases(("allreduce", "bsp"), 3, seed=1, steps=10)]
        [('0@step=3,1@step=4', 'two workers'), ('server1@2.21s', 'server'), ('0@2.08s', 'worker time')]
    """
    rng = random.Random(seed)
    cases = []
    for i in range(runs):
        strategy = strategies[i % len(strategies)]
        spec = parse_strategy(strategy)
        workers = 3 if spec.exchanges_parameters else 2
        restarts, draw = _restarts(strategy), rng.random()
        spare = rng.random() >= 0.25
        if spec.uses_servers and not spec.hybrid and draw < 0.375:
            at = rng.uniform(1.5, 3.0)
            server = f"server{rng.randrange(2)}@{at:.2f}s"
            if draw < 0.125:
                cases.append(Case(strategy, workers, server, 1, spare=spare, replicas=2, what="server"))
            else:  # a worker too, up to 0.3 s before or after: its recovery overlaps the server's
                worker = f"{rng.randrange(workers)}@{max(at + rng.uniform(-0.3, 0.3), 1.5):.2f}s"
                kill = f"{worker},{server}"
                cases.append(Case(strategy, workers, kill, 1 + restarts, spare=spare, replicas=2, what="worker+server"))
            continue
        if (draw - 0.375) / 0.625 < 1 / 6 if spec.uses_servers and not spec.hybrid else draw < 1 / 6:
            first, second = sorted(rng.sample(range(2, steps), 2))
            kill = f"0@step={first},{workers - 1}@step={second}"
            cases.append(Case(strategy, workers, kill, 2 * restarts, spare=spare, what="two workers"))
            continue
        rank = rng.randrange(workers)
        if rng.random() < 0.5:
            kill, what = f"{rank}@step={rng.randint(2, steps - 1)}", "worker step"
        else:
            kill, what = f"{rank}@{rng.uniform(1.5, 3.0):.2f}s", "worker time"
        cases.append(Case(strategy, workers, kill, restarts, spare=spare, what=what))
    return cases


def _restarts(strategy: str) -> int:
    """1 where the unit recovers a dead worker (Poseidon with parameter servers does not), else 0."""
    spec = parse_strategy(strategy)
    return 1 if "restarts" in spec.info.recovery and not (spec.uses_servers and spec.hybrid) else 0


def classify(code: int, fired: bool, digest: str | None, reference: str | None, *, accurate: bool = False) -> str:
    """A run's outcome (see the module docstring) from its exit status (124: stopped at the deadline), whether its
    kill fired, its final model's digest against the fault-free one, and (``accurate``) whether an asynchronous
    strategy ended within :data:`ACCURACY_SLACK` of the fault-free accuracy.

    Example:
        >>> classify(0, True, "ab", "ab"), classify(1, True, None, "ab"), classify(124, True, None, "ab")
        ('bitwise', 'failed fast', 'hung')
        >>> classify(0, True, "cd", "ab", accurate=True), classify(0, True, "cd", "ab")
        ('accurate', 'differs')
    """
    if code == 124:
        return "hung"
    if code != 0:
        return "failed fast"
    if not fired:
        return "no death"
    if digest is not None and digest == reference:
        return "bitwise"
    return "accurate" if accurate else "differs"


def _train(case: Case | None, strategy: str, workers: int, out: Path, *, deadline: float) -> dict[str, Any]:
    """One job: its exit status, whether its kill fired, its digest, seconds and the ranks' last line."""
    from paratrain.errors import JobFailedError
    from paratrain.train.job import TrainJob
    from paratrain.train.record import read_records
    from paratrain.train.run import run_training

    spec = parse_strategy(strategy)
    servers = 2 if spec.uses_servers else None  # as many as a killed server's job has
    job = TrainJob(
        workers=workers,
        epochs=2,
        strategy=strategy,
        run_dir=str(out),
        servers=servers,
        max_restarts=_restarts(strategy),
        # a pipeline's stages hold the MLP's 6 layers split evenly, the same in every run, so that each stage's
        # weights compare with the fault-free run's ("auto" profiles, and timing may move a layer)
        balance=",".join([str(6 // workers)] * workers) if spec.pipelined else "auto",
    )
    if case is not None:
        job = job.replace(kill=case.kill, max_restarts=case.restarts, no_spare=not case.spare, replicas=case.replicas)
    output = io.StringIO()
    started = time.perf_counter()
    try:
        run_training(job, quiet=True, output=output, deadline_s=deadline)
        code = 0
    except JobFailedError as exc:
        code = exc.exit_code
    seconds = time.perf_counter() - started
    text = output.getvalue()
    records = read_records(out)
    lines = [line for line in text.splitlines() if line.strip()]
    # the model of the worker that finished last: the servers' final one under ASP, where one finishing early holds
    # an older model; any worker's (they agree) for the synchronous strategies
    finals = [r for r in records if r["kind"] == "final"]
    last = max(finals, key=lambda r: r["time"])["rank"] if finals else 0
    evals = [r for r in records if r["kind"] == "eval" and r["rank"] == last]
    return {
        "exit": code,
        "fired": "injected fault" in text,
        "digest": models_digest(finals) if code == 0 else None,
        "accuracy": max(evals, key=lambda r: r["epoch"])["test_accuracy"] if evals and code == 0 else None,
        "gone_s": _gone_s(records) if case is not None and "@step=" in case.kill else None,
        "seconds": round(seconds, 2),
        "last": lines[-1][-300:] if lines else "",
    }


def models_digest(finals: list[dict[str, Any]]) -> str | None:
    """The job's final models as one digest, from the ranks' ``final`` records: the model's where every rank holds
    the same one (synchronous strategies), else one over each rank's (gossip's workers differ); None without any.

    Example:
        >>> models_digest([{"rank": 0, "parameters_sha256": "ab"}, {"rank": 1, "parameters_sha256": "ab"}])
        'ab'
        >>> models_digest([{"rank": 1, "parameters_sha256": "cd"}, {"rank": 0, "parameters_sha256": "ab"}])[:12]
        '81505ab4389f'
    """
    per_rank = {int(r["rank"]): str(r["parameters_sha256"]) for r in finals}
    if len(set(per_rank.values())) == 1:
        return next(iter(per_rank.values()))
    if not per_rank:
        return None
    return hashlib.sha256(json.dumps(sorted(per_rank.items())).encode()).hexdigest()


def _gone_s(records: list[dict[str, Any]]) -> float | None:
    """Seconds from a killed worker's last record to its replacement's ``rejoined`` (None: no replacement says it
    rejoined: a parameter-server worker rejoins the servers, a gossip worker or a pipeline stage the others with
    its state)."""
    rejoined = next((r for r in records if r["kind"] == "rejoined"), None)
    if rejoined is None:
        return None
    before = [r["time"] for r in records if r["rank"] == rejoined["rank"] and r["time"] < rejoined["time"]]
    return round(rejoined["time"] - max(before), 4) if before else None


def run_chaos(
    out_dir: str | Path,
    *,
    runs: int = 22,
    seed: int = 0,
    strategies: tuple[str, ...] = STRATEGIES,
    deadline: float = 120.0,
    torchrun: int = 5,
    say: Any = None,
) -> dict[str, Any]:
    """The fault-free run of each strategy, then ``runs`` chaos runs, then ``torchrun`` runs of the anchor
    (:func:`~paratrain.bench.recovery.torchrun_anchor`: the digits MLP under ``torchrun --max-restarts 1`` with a
    disk checkpoint every 5 steps, rank 1 killed as step 9 begins); the report (every run, the outcomes per
    strategy, the anchor's times)."""
    out = Path(out_dir)
    cases = draw_cases(strategies, runs, seed=seed, steps=22)  # 2 epochs of the digits MLP: 22 steps on 2 workers
    references: dict[str, dict[str, Any]] = {}
    for strategy in dict.fromkeys(c.strategy for c in cases):
        workers = next(c for c in cases if c.strategy == strategy).workers
        # an asynchronous strategy's accuracy varies from run to run: its fault-free runs give the spread
        repeats = 1 if parse_strategy(strategy).synchronous else ASYNC_REFERENCES
        refs = [
            _train(None, strategy, workers, out / f"ref-{len(references)}-{k}", deadline=deadline)
            for k in range(repeats)
        ]
        accuracies = [r["accuracy"] for r in refs if r["accuracy"] is not None]
        references[strategy] = {"digest": refs[0]["digest"], "accuracies": accuracies}
    results = []
    for i, case in enumerate(cases):
        got = _train(case, case.strategy, case.workers, out / f"run-{i}", deadline=deadline)
        ref = references[case.strategy]
        accurate = (
            not parse_strategy(case.strategy).synchronous
            and got["accuracy"] is not None
            and bool(ref["accuracies"])
            and got["accuracy"] >= min(ref["accuracies"]) - ACCURACY_SLACK
        )
        outcome = classify(got["exit"], got["fired"], got["digest"], ref["digest"], accurate=accurate)
        results.append({**asdict(case), **got, "outcome": outcome})
        if say is not None:
            say(f"{i + 1}/{len(cases)} {case.strategy} --kill {case.kill}: {outcome} ({got['seconds']:.1f} s)")
    from paratrain.bench.recovery import torchrun_anchor

    anchor = []
    for k in range(torchrun):
        (out / f"torchrun-{k}").mkdir(parents=True)
        anchor.append(torchrun_anchor(out / f"torchrun-{k}", kill_step=9, every=5, deadline=deadline))
    table: dict[str, Counter[str]] = {}
    for r in results:
        table.setdefault(r["strategy"], Counter())[r["outcome"]] += 1
    return {
        "runs": results,
        "references": references,
        "torchrun": anchor,
        "outcomes": {s: dict(c) for s, c in table.items()},
        "seed": seed,
    }


_OUTCOMES = ("bitwise", "accurate", "differs", "failed fast", "hung", "no death")


def _row(name: str, runs: list[dict[str, Any]]) -> str:
    counts = Counter(r["outcome"] for r in runs)
    cells = " | ".join(str(counts.get(k, 0)) for k in _OUTCOMES)
    return f"| {name} | {len(runs)} | {cells} | {max(r['seconds'] for r in runs):.1f} |"


def render(report: dict[str, Any]) -> str:
    """The outcomes per strategy, then per kind of kill (recovering runs without a spare apart), as markdown
    tables with the slowest run's seconds."""
    head = " | ".join(_OUTCOMES) + " | slowest end (s) |"
    rule = "|---|---:|" + "---:|" * len(_OUTCOMES) + "---:|"
    lines = ["| strategy | runs | " + head, rule]
    runs = report["runs"]
    for strategy in report["outcomes"]:
        lines.append(_row(strategy, [r for r in runs if r["strategy"] == strategy]))
    lines += ["", "| killed | runs | " + head, rule]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        cold = r["restarts"] and not r.get("spare", True)
        groups.setdefault(r.get("what", "worker step") + (", restarted cold" if cold else ""), []).append(r)
    lines += [_row(name, mine) for name, mine in sorted(groups.items())]
    lines.append("")
    gone: dict[str, list[float]] = {}  # by family: parameter-server workers, pipeline stages
    for r in runs:
        if r.get("gone_s") is not None and r.get("spare", True):
            gone.setdefault(parse_strategy(r["strategy"]).family, []).append(r["gone_s"])
    for family, seconds in sorted(gone.items()):
        lines.append(
            f"{family} worker, death -> its replacement rejoined (warm spare): {_spread(sorted(seconds))} "
            f"({len(seconds)} step kills)"
        )
    anchor = report.get("torchrun", [])
    back = sorted(r["total_s"] for r in anchor if "total_s" in r)
    if back:
        causes = Counter(r["error"] for r in anchor if "error" in r)
        failed = "".join(f"; {n} failed ({cause})" for cause, n in sorted(causes.items()))
        lines.append(
            f"torchrun --max-restarts 1, disk checkpoint every 5 steps, death -> back at the failed step: "
            f"{_spread(back)} ({len(back)} runs{failed})"
        )
    return "\n".join(lines).rstrip()


def _spread(values: list[float]) -> str:
    """``median s (min-max)`` of sorted ``values``."""
    return f"{statistics.median(values):.3f} s ({values[0]:.3f}-{values[-1]:.3f})"
