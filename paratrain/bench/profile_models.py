"""Measures the models of a machine profile: each layer's forward and backward time inside real training steps.

Every number is a median, so that one preempted repeat does not move it.

* **models** (:func:`profile_model`): every layer (a module with trained parameters of its own, as
  :func:`paratrain.torch.layers.model_layers` defines it) timed inside real training steps of the model on a
  batch of its ``paratrain train`` dataset (SGD with momentum 0.9, as the training workers). Forward: from the
  module's forward pre-hook to its forward hook. Backward: from the moment the gradient of its output is
  computed (a tensor hook on the output) to the last of its own parameters' gradient accumulations and its
  input's gradient (post-accumulate-grad and tensor hooks). A layer that contains other layers (the
  transformer's embedding) is charged only its own time. Parameterless modules between layers (ReLU, pooling),
  the loss and autograd's bookkeeping fall in ``overhead_s``: the whole step less the layers and the optimizer.
  Fully-connected layers also record their shape (``out_features``, ``in_features``), which SFB's cost needs.
  ``concurrency`` N runs the profile in N processes at once under the launch library, started together by a
  barrier, with the intra-op threads a job of N workers gets (``OMP_NUM_THREADS``, cores / N): they share the
  cores as the N workers of a job on this machine do. Each layer's time is the median over the processes. One
  process alone with the same threads is timed first (``alone_s``): the two say how the cores are shared, so
  that the simulator can speed up a process that computes while the others wait (a pipeline's stages).

The measuring processes run :func:`model_main` (``python -m paratrain.bench.profile model ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from paratrain.bench.profile_run import read_json, run_job, write_json
from paratrain.errors import ConfigError
from paratrain.sim.machine import LayerCost, ModelProfile

if TYPE_CHECKING:
    import torch

__all__ = ["check_model", "default_dataset", "expected_max", "model_main", "profile_model"]


def default_dataset(model: str) -> str:
    """The dataset ``paratrain train --model MODEL`` reads unless told otherwise (digits, or fortunes for text)."""
    from paratrain.train.models import MODEL_KINDS

    return "fortunes" if MODEL_KINDS.get(model) == "text" else "digits"


def check_model(model: str, dataset: str, data_dir: str | None) -> None:
    """Refuses, before anything runs, a model or dataset that cannot be profiled here (with what to do)."""
    from paratrain.train.data import check_available
    from paratrain.train.extra import missing_train_extra
    from paratrain.train.models import check_model_dataset

    missing = missing_train_extra()
    if missing:
        raise ConfigError(f"profiling a model needs the 'train' extra: pip install 'paratrain[train]' ({missing})")
    check_model_dataset(model, dataset)
    check_available(dataset, data_dir=data_dir)


def _nested(names: Sequence[str]) -> dict[str, list[str]]:
    """Each layer's outermost layers inside it (the transformer's embedding holds the token embedding)."""

    def inside(inner: str, outer: str) -> bool:
        return inner != outer and (outer == "(root)" or inner.startswith(outer + "."))

    return {
        outer: [n for n in names if inside(n, outer) and not any(inside(n, m) and inside(m, outer) for m in names)]
        for outer in names
    }


class _Clock:
    """The hooks that time every layer within one step: inclusive windows, made exclusive by :meth:`step`."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str], params: Mapping[str, Sequence[Any]]) -> None:
        import functools

        modules = dict(model.named_modules())
        self.names, self.nested = list(names), _nested(names)
        self.output_bytes = dict.fromkeys(names, 0)
        self._fwd: dict[str, float] = {}
        self._open: dict[str, float] = {}
        self._bwd_start: dict[str, float] = {}
        self._bwd_end: dict[str, float] = {}
        self._handles: list[Any] = []
        for name in names:
            module = model if name == "(root)" else modules[name]
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._leave, name)))
            for p in params[name]:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._done, name)))

    @staticmethod
    def _tensors(value: Any) -> list[torch.Tensor]:
        import torch

        items = value if isinstance(value, tuple | list) else (value,)
        return [t for t in items if isinstance(t, torch.Tensor)]

    def _enter(self, name: str, module: Any, args: Any) -> None:
        self._open[name] = time.perf_counter()

    def _leave(self, name: str, module: Any, args: Any, output: Any) -> None:
        import functools

        self._fwd[name] = self._fwd.get(name, 0.0) + time.perf_counter() - self._open.pop(name)
        outputs = self._tensors(output)
        self.output_bytes[name] = sum(t.numel() * t.element_size() for t in outputs)
        for t in outputs:
            if t.requires_grad:
                t.register_hook(functools.partial(self._backward_starts, name))  # type: ignore[no-untyped-call]
        for t in self._tensors(args):
            if t.requires_grad:
                t.register_hook(functools.partial(self._done, name))  # type: ignore[no-untyped-call]

    def _backward_starts(self, name: str, grad: Any) -> None:
        self._bwd_start.setdefault(name, time.perf_counter())

    def _done(self, name: str, _: Any) -> None:
        self._bwd_end[name] = time.perf_counter()

    def step(self) -> dict[str, tuple[float, float]]:
        """Each layer's exclusive (forward, backward) seconds of the step just run; resets for the next."""
        fwd = dict(self._fwd)
        start, end = dict(self._bwd_start), dict(self._bwd_end)
        for name in reversed(self.names):  # inner layers come after their outer one: done first
            inner_ends = [end[n] for n in self.nested[name] if n in end]
            if inner_ends:
                end[name] = max([end.get(name, 0.0), *inner_ends])
        bwd = {n: end[n] - start[n] if n in start and n in end else 0.0 for n in self.names}
        times = {}
        for name in self.names:
            inner = self.nested[name]
            times[name] = (
                max(0.0, fwd.get(name, 0.0) - sum(fwd.get(n, 0.0) for n in inner)),
                max(0.0, bwd[name] - sum(bwd[n] for n in inner)),
            )
        self._fwd.clear()
        self._bwd_start.clear()
        self._bwd_end.clear()
        return times

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _profile_here(
    model_name: str,
    batch_size: int,
    *,
    dataset: str,
    data_dir: str | None,
    steps: int,
    warmup: int,
    barrier: Callable[[], None] | None = None,
    splits: bool = False,
) -> dict[str, Any]:
    """Times ``steps`` training steps after ``warmup`` in this process (threads as they are); medians, as JSON."""
    import torch

    from paratrain.torch.layers import model_layers
    from paratrain.train import tasks
    from paratrain.train.data import load_dataset
    from paratrain.train.models import build_model
    from paratrain.train.pipeline_worker import flat_layers

    data = load_dataset(dataset, data_dir=data_dir)
    index = np.arange(batch_size) % len(data.y_train)
    x, y = torch.from_numpy(data.x_train[index]), torch.from_numpy(data.y_train[index])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(model_name, side=data.side, classes=data.classes)
    shapes, linear = model_layers(model)  # linear: the fully-connected layers SFB can carry, by name
    names = [shape.name for shape in shapes]
    flat = {id(m): i for i, m in enumerate(flat_layers(model))}  # where a pipeline can cut, in order
    module_of = {n: _place(model, n, flat) for n in names}
    qualified = [(q, p) for q, p in model.named_parameters() if p.requires_grad]
    owner = {q: (q.rpartition(".")[0] or "(root)") for q, _ in qualified}
    params = {name: [(q, p) for q, p in qualified if owner[q] == name] for name in names}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # as the training workers
    clock = _Clock(model, names, {n: [p for _, p in params[n]] for n in names})
    layer_times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    step_s, optimizer_s = [], []
    try:
        for i in range(warmup + steps):
            if i == warmup and barrier is not None:
                barrier()  # every process starts timing together: they share the cores from here on
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            tasks.loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            t1 = time.perf_counter()
            optimizer.step()
            t2 = time.perf_counter()
            times = clock.step()
            if i >= warmup:
                step_s.append(t2 - t0)
                optimizer_s.append(t2 - t1)
                for name in names:
                    layer_times[name].append(times[name])
    finally:
        clock.remove()
    from paratrain.bench.profile_splits import split_ratios

    ratios = split_ratios(model, x, repeats=max(steps, 10)) if splits else {}
    layers = [
        {
            "name": name,
            "forward_s": statistics.median(f for f, _ in layer_times[name]),
            "backward_s": statistics.median(b for _, b in layer_times[name]),
            "params": [q for q, _ in params[name]],
            "param_bytes": [p.numel() * p.element_size() for _, p in params[name]],
            "output_bytes": clock.output_bytes[name],
            "out_features": linear[name].out_features if name in linear else 0,
            "in_features": linear[name].in_features if name in linear else 0,
            "module": module_of[name],
            "channels": _channels(model.get_submodule(name)) if name != "(root)" else (0, 0),
            "split_ratios": ratios.get(name, {}),
            "heads": _heads(model, name, flat),
        }
        for name in names
    ]
    return {
        "layers": layers,
        "optimizer_s": statistics.median(optimizer_s),
        "step_s": statistics.median(step_s),
        "step_samples": step_s,
        "modules": len(flat),
        "input_bytes": x.numel() * x.element_size(),
        "threads": torch.get_num_threads(),
    }


def _ancestor(model: Any, name: str, flat: Mapping[int, int]) -> str | None:
    """The module of the model's flat list that holds layer ``name`` (itself, or the block it sits in)."""
    if name == "(root)":
        return None
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if id(model.get_submodule(prefix)) in flat:
            return prefix
    return None


def _place(model: Any, name: str, flat: Mapping[int, int]) -> int:
    """Layer ``name``'s place in the flat list of modules: its own, or that of the block it sits in (-1: none)."""
    holder = _ancestor(model, name, flat)
    return flat[id(model.get_submodule(holder))] if holder is not None else -1


def _heads(model: Any, name: str, flat: Mapping[int, int]) -> int:
    """The heads of the transformer block that holds layer ``name`` (0 outside a block)."""
    from paratrain.torch.soap_blocks import block_shape

    holder = _ancestor(model, name, flat)
    shape = block_shape(model.get_submodule(holder)) if holder is not None and holder != name else None
    return shape.in_features if shape is not None else 0


def _channels(module: Any) -> tuple[int, int]:
    """(in, out) channels of an ungrouped 2-d convolution (what a split cuts), (0, 0) for anything else."""
    from torch import nn

    if isinstance(module, nn.Conv2d) and module.groups == 1:
        return module.in_channels, module.out_channels
    return 0, 0


def _combine(model: str, batch_size: int, runs: Sequence[Mapping[str, Any]]) -> ModelProfile:
    """One profile from every process's medians: the median over processes of each time."""

    def median(values: Sequence[float]) -> float:
        return float(statistics.median(values))

    from paratrain.bench.profile_splits import combined_split_s

    def timed(i: int, first: Mapping[str, Any]) -> dict[str, Any]:
        forward_s = median([run["layers"][i]["forward_s"] for run in runs])
        backward_s = median([run["layers"][i]["backward_s"] for run in runs])
        ratios = [run["layers"][i].get("split_ratios", {}) for run in runs]
        return {
            "forward_s": forward_s,
            "backward_s": backward_s,
            "split_s": combined_split_s(forward_s, backward_s, ratios),
        }

    layers = tuple(
        LayerCost(
            name=first["name"],
            **timed(i, first),
            params=tuple(first["params"]),
            param_bytes=tuple(int(b) for b in first["param_bytes"]),
            output_bytes=int(first["output_bytes"]),
            out_features=int(first.get("out_features", 0)),
            in_features=int(first.get("in_features", 0)),
            module=int(first.get("module", -1)),
            channels=(int(first.get("channels", (0, 0))[0]), int(first.get("channels", (0, 0))[1])),
            heads=int(first.get("heads", 0)),
        )
        for i, first in enumerate(runs[0]["layers"])
    )
    optimizer_s = median([run["optimizer_s"] for run in runs])
    layer_s = sum(layer.forward_s + layer.backward_s for layer in layers)
    overhead_s = max(0.0, median([run["step_s"] for run in runs]) - layer_s - optimizer_s)
    pooled = [float(x) for run in runs for x in run.get("step_samples", ())]
    straggle_s = expected_max(pooled, len(runs)) - median(pooled) if len(runs) > 1 and pooled else 0.0
    return ModelProfile(
        model=model,
        batch_size=batch_size,
        layers=layers,
        optimizer_s=optimizer_s,
        concurrency=len(runs),
        overhead_s=overhead_s,
        straggle_s=max(0.0, straggle_s),
        modules=int(runs[0].get("modules", 0)),
        input_bytes=int(runs[0].get("input_bytes", 0)),
        call_s=median([float(run["call_s"]) for run in runs]) if all("call_s" in run for run in runs) else 0.0,
    )


def expected_max(samples: Sequence[float], n: int) -> float:
    """The expected largest of ``n`` independent draws from the samples' empirical distribution: with the samples
    sorted, x_(i) is the largest with probability (i/m)^n - ((i-1)/m)^n. What a synchronous step of ``n``
    workers waits for, where each worker's step time is such a draw.

    Example:
        >>> expected_max([1.0, 2.0], 1), expected_max([1.0, 2.0], 2), expected_max([3.0] * 5, 4)
        (1.5, 1.75, 3.0)
    """
    if not samples or n < 1:
        raise ConfigError(f"expected_max needs samples and n >= 1, got {len(samples)} samples and n={n}")
    ordered, m = sorted(samples), len(samples)
    return sum(x * ((i / m) ** n - ((i - 1) / m) ** n) for i, x in enumerate(ordered, start=1))


def _steps(quick: bool) -> tuple[int, int]:
    """(warm-up, timed) steps of a model profile."""
    return (2, 5) if quick else (5, 30)


def profile_model(
    model_name: str,
    batch_size: int,
    concurrency: int = 1,
    *,
    dataset: str | None = None,
    data_dir: str | None = None,
    quick: bool = False,
    timeout: float = 600.0,
) -> ModelProfile:
    """Each layer's forward and backward time of a ``paratrain train`` model, measured here (module docstring).

    The steps run in this process first (its torch threads set for the time as each worker of a
    ``concurrency``-worker job gets them, then restored): with ``concurrency`` 1 that is the profile; above 1 it
    is the step alone (:attr:`ModelProfile.alone_s`), and then the layers are timed in that many processes at
    once, under the launch library, stopped after ``timeout`` seconds. Blocks for about 35 training steps (7 with
    ``quick``), twice above 1, plus the processes' start.

    Args:
        model_name: a ``paratrain train --model`` name.
        batch_size: examples per step (per worker).
        concurrency: processes measuring at once (the workers of the job the profile is for).
        dataset: the model's input (default: what ``paratrain train`` reads, digits or fortunes for text).
        data_dir: where the dataset's files are, as ``paratrain train --data-dir``.
        quick: fewer steps.
        timeout: seconds the processes may take (``concurrency`` > 1).

    Raises:
        ConfigError: unknown model, a model that cannot read the dataset, missing files or software, bad counts.
        ProfileError: a measuring process failed.
    """
    if batch_size < 1 or concurrency < 1:
        raise ConfigError(f"batch size and concurrency must be at least 1, got {batch_size} and {concurrency}")
    dataset = dataset or default_dataset(model_name)
    check_model(model_name, dataset, data_dir)
    warmup, steps = _steps(quick)
    alone = _profile_alone(
        model_name, batch_size, concurrency, dataset=dataset, data_dir=data_dir, steps=(warmup, steps)
    )
    if concurrency == 1:
        return _combine(model_name, batch_size, [alone])
    what = f"model {model_name} in {concurrency} processes"
    with tempfile.TemporaryDirectory(prefix="paratrain-profile-") as tmp:
        argv = ["model", "--model", model_name, "--batch-size", str(batch_size), "--dataset", dataset]
        argv += ["--steps", str(steps), "--warmup", str(warmup), "--out", tmp]
        argv += ["--data-dir", data_dir] if data_dir else []
        run_job(argv, nproc=concurrency, faults=None, timeout=timeout, what=what)
        runs = [read_json(pathlib.Path(tmp) / f"model-rank{r}.json", what) for r in range(concurrency)]
    for run in runs:  # the split layers' ratios as timed alone (the processes end their steps at different times)
        for layer, timed_alone in zip(run["layers"], alone["layers"], strict=True):
            layer["split_ratios"] = timed_alone["split_ratios"]
    return dataclasses.replace(_combine(model_name, batch_size, runs), alone_s=float(alone["step_s"]))


def _profile_alone(
    model_name: str, batch_size: int, concurrency: int, *, dataset: str, data_dir: str | None, steps: tuple[int, int]
) -> dict[str, Any]:
    """The model's steps in this process, alone on the machine, with the intra-op threads each process of a
    ``concurrency``-worker job gets (set for the time, then restored): the profile of a one-worker job, and,
    beside ``concurrency`` processes at once, how much the sharing of the cores slows each of them."""
    import torch

    from paratrain.launch.env import process_environment

    before = torch.get_num_threads()
    env = process_environment(os.environ, processes=concurrency)
    torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    try:
        warmup, timed = steps
        return _profile_here(
            model_name, batch_size, dataset=dataset, data_dir=data_dir, steps=timed, warmup=warmup, splits=True
        )
    finally:
        torch.set_num_threads(before)


# -- the measuring process ---------------------------------------------------------------------------------------


def model_main(args: argparse.Namespace) -> None:
    """One rank of a model job (``--model``, ``--batch-size``, ``--dataset``, ``--data-dir``, ``--steps``,
    ``--warmup``, ``--out``): times the steps together with the other ranks; writes ``model-rank<r>.json``."""
    import torch

    from paratrain.runtime.context import init

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))  # as paratrain.train.worker
    ctx = init()
    try:
        run = _profile_here(
            args.model,
            args.batch_size,
            dataset=args.dataset,
            data_dir=args.data_dir,
            steps=args.steps,
            warmup=args.warmup,
            barrier=ctx.barrier,
        )
        from paratrain.bench.profile_splits import call_seconds

        run["call_s"] = call_seconds(ctx, repeats=max(args.steps, 10) * 5)
        write_json(pathlib.Path(args.out) / f"model-rank{ctx.rank}.json", run)
    finally:
        ctx.shutdown()
