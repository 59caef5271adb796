"""Measures a machine profile on this machine: message times per path, reduce and copy speed, layers of models.

What is measured, and how (every number is a median, so that one preempted repeat does not move it):

* **paths** and **paths under load** (:func:`~paratrain.bench.profile_links.measure_paths`): ping-pongs and ring
  exchanges between real processes, fitted by the Hockney model (:mod:`paratrain.bench.profile_links`).
* **gamma** and **copy** (:func:`measure_reduce_copy`): ``np.add(a, b, out=c)`` and ``np.copyto`` on float32
  arrays of 4 MiB in this process, seconds per byte of one array.
* **models** (:func:`~paratrain.bench.profile_models.profile_model`): every layer's forward and backward time
  inside real training steps (:mod:`paratrain.bench.profile_models`).

Run it through ``paratrain profile`` (:mod:`paratrain.cli.profile`); this module is also the worker the measuring
processes run (``python -m paratrain.bench.profile links|model ...``, started by
:mod:`paratrain.bench.profile_run`).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from paratrain._exit import exit_with
from paratrain.bench.profile_links import DEFAULT_SIZES, PATHS, emulated_spec, fit_hockney, links_main, measure_paths
from paratrain.bench.profile_models import check_model, default_dataset, expected_max, model_main, profile_model
from paratrain.bench.profile_run import WORKER_MODULE, ProfileError
from paratrain.sim.machine import Cluster, MachineProfile

__all__ = [
    "DEFAULT_SIZES",
    "PATHS",
    "ProfileError",
    "emulated_spec",
    "expected_max",
    "fit_hockney",
    "measure_machine",
    "measure_paths",
    "measure_reduce_copy",
    "profile_model",
]


def measure_reduce_copy(*, nbytes: int = 4 << 20, repeats: int = 20) -> tuple[float, float]:
    """Seconds per byte of ``np.add(a, b, out=c)`` (gamma) and of ``np.copyto(c, a)`` (copy), in this process.

    Float32 arrays of ``nbytes`` (4 MiB: larger than a core's L2, as a gradient bucket is); a byte is a byte of one
    array. Blocks for about ``2 * repeats`` passes over the arrays (milliseconds).
    """
    a, b, c = (np.full(nbytes // 4, v, dtype=np.float32) for v in (1.0, 2.0, 0.0))
    np.add(a, b, out=c)  # first touch of c's pages is not what a reduce costs
    adds, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.add(a, b, out=c)
        t1 = time.perf_counter()
        np.copyto(c, a)
        copies.append(time.perf_counter() - t1)
        adds.append(t1 - t0)
    return statistics.median(adds) / c.nbytes, statistics.median(copies) / c.nbytes


# -- everything ----------------------------------------------------------------------------------------------------


def measure_machine(
    *,
    paths: Sequence[str] = PATHS,
    emulate: Sequence[str] = (),
    models: Sequence[str] = (),
    batch_size: int = 64,
    concurrency: int = 1,
    dataset: str | None = None,
    data_dir: str | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    quick: bool = False,
    timeout: float = 300.0,
    say: Callable[[str], None] | None = None,
) -> MachineProfile:
    """A profile of this machine: the paths, gamma and copy, and each model at ``batch_size`` with ``concurrency``
    processes at once. Checks every model before measuring anything; arguments as in :func:`measure_paths` and
    :func:`profile_model`. Blocks for the measurements (seconds to a minute; ``quick``: a few seconds each).

    Raises:
        ConfigError: a bad argument (what to change). ProfileError: a measuring process failed.
    """
    say = say or (lambda line: None)
    datasets = {m: dataset or default_dataset(m) for m in models}
    for model in models:
        check_model(model, datasets[model], data_dir)
    links = measure_paths(
        paths, emulate=emulate, sizes=sizes, quick=quick, concurrency=concurrency, timeout=timeout, say=say
    )
    gamma, copy = measure_reduce_copy()
    profiles = []
    for model in models:
        say(f"profiling {model} at batch {batch_size} in {concurrency} process{'es' if concurrency > 1 else ''} ...")
        profiles.append(
            profile_model(
                model,
                batch_size,
                concurrency,
                dataset=datasets[model],
                data_dir=data_dir,
                quick=quick,
                timeout=timeout,
            )
        )
    cores = os.cpu_count() or 1
    inputs = ", ".join(f"{m} on {d}" for m, d in datasets.items())
    notes = f"paratrain profile{' --quick' if quick else ''} on {time.strftime('%Y-%m-%d %H:%M')}, {cores} cores" + (
        f"; models: {inputs}, threads per process as a job of {concurrency} workers" if models else ""
    )
    cluster = Cluster(cores_per_host=cores)
    machine = MachineProfile(socket.gethostname(), links, gamma, copy, cluster=cluster, notes=notes)
    for profile in profiles:
        machine = machine.with_model(profile)
    return machine


# -- the measuring processes (run by run_job) ------------------------------------------------------------------------


def _worker_main(argv: Sequence[str] | None = None) -> int:
    """One measuring process (a rank under the launch library); what it measures goes to ``--out`` as JSON."""
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    links = sub.add_parser(
        "links", help="ping-pongs between 2 ranks or a ring exchange of all; rank 0 writes (size, s) per kind"
    )
    links.add_argument("--kinds", required=True, help="p2p (the transport), shm and/or ring, comma-separated")
    links.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    links.add_argument("--repeats", required=True, help="timed round trips per size, comma-separated")
    links.add_argument("--warmup", type=int, default=5, help="untimed round trips per size first")
    links.add_argument("--separate-hosts", action="store_true", help="give each rank its own host id (TCP)")
    links.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    model = sub.add_parser("model", help="time the layers of a model; each rank writes model-rank<r>.json")
    model.add_argument("--model", required=True, help="a paratrain train model")
    model.add_argument("--batch-size", type=int, required=True, help="examples per step")
    model.add_argument("--dataset", required=True, help="the dataset whose input the model reads")
    model.add_argument("--data-dir", default=None, help="where the dataset's files are")
    model.add_argument("--steps", type=int, required=True, help="timed steps")
    model.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    model.add_argument("--out", required=True, help="the directory of the result files")
    args = parser.parse_args(argv)
    (links_main if args.what == "links" else model_main)(args)
    return 0


if __name__ == "__main__":
    exit_with(_worker_main)
