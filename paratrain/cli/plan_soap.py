"""``paratrain plan --search soap``: search which layers to split over how many workers (FlexFlow's per-operator
configurations, :mod:`paratrain.sim.soap_search`), print the pick layer by layer against data parallelism and the
best whole-model strategy, write it as the JSON ``paratrain train --strategy soap:FILE`` takes, and with ``--run``
train both to confirm."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

__all__ = ["plan_soap"]


def plan_soap(args: argparse.Namespace, *, bandwidth: float | None, latency: float) -> int:
    """Runs the search for ``plan``'s job (its --model, --workers, --batch-size, --machine, network)."""
    from paratrain.config import parse_duration
    from paratrain.sim.machine import MachineProfile
    from paratrain.sim.search import SEARCHED, candidates, search
    from paratrain.sim.soap_search import search_soap, soap_cost, splittable

    budget = parse_duration(args.budget)
    if budget <= 0 and args.proposals <= 0:
        raise ConfigError("--budget must be positive (or give --proposals)")
    profile = MachineProfile.load(args.machine)
    model = profile.model(args.model, args.batch_size, args.workers)
    job = {"workers": args.workers, "batch_size": args.batch_size, "bandwidth": bandwidth, "latency": latency}
    found = search_soap(
        soap_cost(profile, model, hosts=args.hosts, **job), model, args.workers, budget_s=budget,
        proposals=args.proposals, alpha=args.alpha, seed=args.seed,
    )  # fmt: skip
    whole = [s for s in SEARCHED if not s.startswith(("tp:", "soap:"))]
    space = candidates(model, strategies=whole, workers=args.workers, batch_size=args.batch_size)
    ranked = search(profile, model, space=space, hosts=args.hosts, **job)
    rival = ranked[0]
    network = f", {args.bandwidth} links" if args.bandwidth else ""
    how = (
        f"{found.proposals} of {found.size} configurations simulated (all of them)"
        if found.exhaustive
        else f"{found.proposals} proposals over {found.size} configurations (Metropolis-Hastings, alpha {args.alpha}, "
        f"{found.accepted} accepted)"
    )
    print(
        f"{args.model}, {args.workers} workers x batch {args.batch_size}{network} on {profile.name!r}: {how} in "
        f"{found.seconds:.1f} s"
    )
    splits = dict(found.best.splits)
    print("| layer | shape | split |")
    print("|---|---|---|")
    for name, shape in splittable(model).items():
        print(f"| {name} | {shape.in_features} -> {shape.out_features} | {splits.get(name, 'replicated')} |")
    t = found.best.tensor
    print(
        f"pick: {t}-way tensor x {args.workers // t} data, {t * args.batch_size} examples per tensor group: "
        f"predicted step {found.best_s:.4f} s; data parallelism (where the search starts) {found.start_s:.4f} s "
        f"({found.start_s / found.best_s:.2f}x); the best whole-model strategy ({rival.candidate.label}) "
        f"{rival.step_s:.4f} s ({rival.step_s / found.best_s:.2f}x)"
    )
    out = Path(args.soap_out or f"runs/soap-{args.model}-w{args.workers}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    found.best.config(args.workers, args.model).write(out)
    flags = f"--strategy soap:{out} --batch-size {t * args.batch_size}"
    print(f"wrote {out}; run it: paratrain train --model {args.model} --workers {args.workers} {flags}")
    result: dict[str, Any] = {
        "model": args.model,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "bandwidth": args.bandwidth,
        "machine": profile.name,
        "pick": {"tensor": t, "splits": splits, "step_s": found.best_s, "file": str(out)},
        "data_parallel_s": found.start_s,
        "whole_model": {"configuration": rival.candidate.label, "flags": rival.train_flags(), "step_s": rival.step_s},
        "proposals": found.proposals,
        "space": found.size,
        "exhaustive": found.exhaustive,
        "seconds": found.seconds,
    }
    if args.run:
        settings = {"strategy": f"soap:{out}", "batch_size": t * args.batch_size}
        result["confirmed"] = _confirm(args, [("pick", settings, found.best_s), (
            rival.candidate.label, rival.train_settings(), rival.step_s)])  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def _confirm(args: argparse.Namespace, runs: list[tuple[str, dict[str, Any], float]]) -> list[dict[str, Any]]:
    """Trains each configuration for ``--steps`` steps; prints predicted and measured steps and the final loss."""
    import tempfile

    from paratrain.bench.simulator import measured_step
    from paratrain.train.job import TrainJob
    from paratrain.train.record import merge_run, reporting_rank
    from paratrain.train.run import run_training

    root = Path(tempfile.mkdtemp(prefix="paratrain-plan-soap-"))
    rows = []
    for i, (label, settings, predicted) in enumerate(runs):
        job = TrainJob(
            model=args.model, dataset=args.dataset, workers=args.workers, batch_size=args.batch_size, epochs=1,
            steps_per_epoch=args.steps, run_dir=str(root / f"run{i}"), bandwidth=args.bandwidth or None,
            latency=args.latency or None,
        ).replace(**settings)  # fmt: skip
        print(f"paratrain plan: running {label} for {args.steps} steps ...", file=sys.stderr, flush=True)
        summary = run_training(job)
        records = merge_run(summary["run_dir"])
        reporting = reporting_rank(records)  # a pipeline's loss is its last stage's
        losses = [r["loss"] for r in records if r.get("kind") == "step" and r.get("rank") == reporting]
        rows.append({"configuration": label, "predicted_s": predicted, "measured_s": measured_step(records),
                     "last_loss": losses[-1], "test_accuracy": summary["test_accuracy"]})  # fmt: skip
    print("| configuration | predicted step (s) | measured step (s) | error | last loss | test accuracy |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['configuration']} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | "
            f"{r['predicted_s'] / r['measured_s'] - 1:+.1%} | {r['last_loss']:.4f} | "
            f"{'-' if r['test_accuracy'] is None else format(r['test_accuracy'], '.4f')} |"
        )
    return rows
