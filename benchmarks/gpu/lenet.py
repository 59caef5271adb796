"""Two workers train LeNet-5 on Fashion-MNIST with allreduce and with bsp, on the CPU and on the GPU (issue 19).

Runs the job of ``paratrain train --model lenet`` four times (allreduce and ``bsp`` with one server, each on the CPU
and with ``--device cuda``), the same seed, data and steps, and prints every run's test accuracy per epoch side by side.
With one GPU the two workers share it: the allreduce stages gradients through pinned host memory (NCCL needs a GPU
per rank); with a GPU per worker the allreduce goes through NCCL. The question it answers: does training on the GPU
reach the accuracy the CPU run reaches? (Not bit for bit: cuDNN's kernels add in other orders.)

    python benchmarks/gpu/lenet.py OUT [--devices cpu,cuda] [--epochs 3] [--steps-per-epoch 150] [--data-dir D]

Writes OUT/lenet.json and the four run directories. Without Fashion-MNIST (``apt-get install dataset-fashion-mnist``,
or ``--data-dir`` with its four IDX files) it says so and stops.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paratrain.errors import ConfigError, JobFailedError
from paratrain.train.job import TrainJob
from paratrain.train.run import run_training


def main(argv: list[str] | None = None) -> int:
    """Runs the trainings, prints the table, writes lenet.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--devices", default="cpu,cuda")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=150)
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    args = parser.parse_args(argv)
    if not Path(args.data_dir, "train-images-idx3-ubyte.gz").exists():
        print(
            f"no Fashion-MNIST in {args.data_dir}: apt-get install dataset-fashion-mnist, or --data-dir",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, object]] = {}
    for strategy in ("allreduce", "bsp"):
        for device in args.devices.split(","):
            name = f"{strategy}-{device}"
            job = TrainJob(
                model="lenet",
                dataset="fashion-mnist",
                data_dir=args.data_dir,
                strategy=strategy,
                device=device,
                epochs=args.epochs,
                steps_per_epoch=args.steps_per_epoch,
                run_dir=str(out / name),
                servers=1 if strategy == "bsp" else None,
            )
            with (out / f"{name}.log").open("w") as log:
                try:
                    summary = run_training(job, quiet=True, output=log, deadline_s=1800)
                except (ConfigError, JobFailedError) as exc:
                    runs[name] = {"failed": str(exc)}
                    print(f"{name}: FAILED ({exc}); see {out / name}.log", flush=True)
                    continue
            runs[name] = {k: summary[k] for k in ("test_accuracy", "accuracy_by_epoch", "samples_per_sec")}
            epochs = " ".join(f"{a:.4f}" for a in summary["accuracy_by_epoch"])
            print(f"{name:<16} accuracy by epoch {epochs}  {summary['samples_per_sec']:10,.0f} samples/s", flush=True)
    (out / "lenet.json").write_text(json.dumps({"epochs": args.epochs, "runs": runs}, indent=2))
    return 1 if any("failed" in r for r in runs.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
