"""The planner's search: every runnable configuration of a job, predicted by the simulator, ranked.

The space is what ``paratrain train`` can run for a data-parallel job: the strategy (allreduce with the runtime's
``auto`` algorithm policy, with or without fp16 compression; the parameter server with 1, 2 or 4 servers, BSP,
SSP(2) or ASP; SFB for every fully-connected layer; Poseidon's per-layer hybrid of SFB and allreduce; D-PSGD
gossip on the ring or the exponential graph), the fusion size (``--bucket-bytes``, 256 KiB to 64 MiB) and
wait-free backprop on or off. Some change the update, not only its speed, and the ranking says so
(:attr:`Candidate.update`): fp16 rounds every gradient to 16 bits, ASP and SSP compute on parameters that may
miss other workers' latest gradients (SSP at most s steps of them), and gossip averages with the neighbours
only; every other candidate computes synchronous SGD's step exactly (SFB rebuilds the same gradient), so its
predicted speed is the whole comparison.

That is about 130 points, and a replay of one step takes milliseconds to a few tenths of a second, so the
search is exhaustive: no sampling error and no tuning of a random walk, which
FlexFlow's MCMC needs because its space (a parallelisation per operator) is exponential. Where paratrain's
space has such a part, the per-layer choice of SFB against the dense scheme, the layers' choices are
independent given the network, and Poseidon's cost model (:func:`paratrain.sfb.choose_schemes`, the same
the runtime asks) takes them layer by layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from paratrain.fusion.buckets import DEFAULT_BUCKET_BYTES
from paratrain.sim.machine import MachineProfile, ModelProfile
from paratrain.sim.predict import Prediction, predict
from paratrain.sim.tensor import profile_splits
from paratrain.soap import SoapConfig
from paratrain.strategy import StrategySpec, parse_strategy
from paratrain.transport.faults import Link

__all__ = ["BUCKET_SIZES", "COMPRESSIONS", "SEARCHED", "Candidate", "Scored", "candidates", "reason", "search"]

#: The fusion sizes the planner tries.
BUCKET_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)

#: Strategies the planner searches (those the step composer models).
SEARCHED = (
    "allreduce",
    "bsp",
    "ssp:2",
    "asp",
    "sfb",
    "poseidon:allreduce",
    "gossip:ring",
    "gossip:exponential",
    "pipeline:gpipe",
    "pipeline:1f1b",
    "tp:2",
    "tp:4",
)
#: Compressions the planner tries with allreduce ("" is none).
COMPRESSIONS = ("", "fp16")


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"


@dataclass(frozen=True)
class Candidate:
    """One configuration of the job.

    Attributes:
        strategy: ``paratrain train --strategy``.
        servers: parameter servers (``bsp``, ``asp``).
        bucket_bytes: ``--bucket-bytes``.
        overlap: wait-free backprop (``--no-overlap`` when False).
        compression: ``--compression`` (allreduce), "" for none.
        microbatches: a pipeline's ``--microbatches`` (one stage per worker).
        batch_size: a pipeline's examples per step (``--batch-size``: the data-parallel candidates' examples
            per step, workers x their batch, so that every candidate trains on as many examples per step); split
            layers' examples per tensor group (N x a data-parallel worker's batch, for ``tp:N``).
    """

    strategy: str = "allreduce"
    servers: int = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap: bool = True
    compression: str = ""
    microbatches: int = 0
    batch_size: int = 0

    @property
    def spec(self) -> StrategySpec:
        """The parsed strategy."""
        return parse_strategy(self.strategy)

    @property
    def uses_servers(self) -> bool:
        """Whether it runs parameter servers."""
        return self.spec.uses_servers

    @property
    def label(self) -> str:
        """A short name: ``"bsp x2, 16MiB"``, ``"allreduce+fp16, 4MiB"``, ``"gossip:ring"``."""
        if self.spec.exchanges_parameters:
            return self.strategy
        if self.spec.pipelined:
            return f"{self.strategy}, {self.microbatches} micro-batches of {self.batch_size // self.microbatches}"
        if self.spec.splits_layers:
            return f"{self.strategy}, {self.batch_size} examples per tensor group"
        servers = f" x{self.servers}" if self.uses_servers else ""
        compression = f"+{self.compression}" if self.compression else ""
        overlap = "" if self.overlap else ", no overlap"
        return f"{self.strategy}{compression}{servers}, {_size(self.bucket_bytes)}{overlap}"

    @property
    def update(self) -> str:
        """What its step computes, against synchronous SGD on the mean gradient (see the module docstring)."""
        if self.compression:
            return f"{self.compression}-rounded gradients"
        spec = self.spec
        if spec.exchanges_parameters:
            return "decentralised (neighbours' average)"
        if spec.staleness:
            return f"stale reads (at most {spec.staleness} steps)"
        return "exact" if spec.synchronous else "asynchronous (stale reads)"

    def train_settings(self) -> dict[str, Any]:
        """The training job's options that run it (:class:`~paratrain.train.job.TrainJob` field names)."""
        if self.spec.exchanges_parameters:
            return {"strategy": self.strategy}
        if self.spec.pipelined:
            return {"strategy": self.strategy, "microbatches": self.microbatches, "batch_size": self.batch_size}
        if self.spec.splits_layers:
            return {"strategy": self.strategy, "batch_size": self.batch_size}
        settings: dict[str, Any] = {"strategy": self.strategy, "bucket_bytes": self.bucket_bytes}
        if self.uses_servers:
            settings["servers"] = self.servers
        if self.compression:
            settings["compression"] = self.compression
        if not self.overlap:
            settings["no_overlap"] = True
        return settings

    def train_flags(self) -> list[str]:
        """The ``paratrain train`` flags that run it."""
        return flags_of(self.train_settings())


@dataclass
class Scored:
    """A candidate and its prediction."""

    candidate: Candidate
    prediction: Prediction

    @property
    def step_s(self) -> float:
        """Predicted seconds per step."""
        return self.prediction.step_s

    def train_settings(self) -> dict[str, Any]:
        """The training job's options that run it as predicted (a pipeline's split included)."""
        return {**self.candidate.train_settings(), **self.prediction.settings}

    def train_flags(self) -> list[str]:
        """The ``paratrain train`` flags that run it as predicted."""
        return flags_of(self.train_settings())


def flags_of(settings: Mapping[str, Any]) -> list[str]:
    """Training options as ``paratrain train`` flags: ``{"bucket_bytes": 4096, "no_overlap": True}`` ->
    ``["--bucket-bytes", "4096", "--no-overlap"]``.

    Example:
        >>> flags_of({"strategy": "allreduce", "bucket_bytes": 4096, "no_overlap": True})
        ['--strategy', 'allreduce', '--bucket-bytes', '4096', '--no-overlap']
    """
    flags: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def candidates(
    model: ModelProfile,
    *,
    strategies: Sequence[str] = SEARCHED,
    servers: Sequence[int] = (1, 2, 4),
    bucket_sizes: Sequence[int] = BUCKET_SIZES,
    compressions: Sequence[str] = COMPRESSIONS,
    workers: int = 0,
    batch_size: int = 0,
) -> list[Candidate]:
    """Every point of the space (see the module docstring); SFB strategies only for a model with
    fully-connected layers, compression only with allreduce, pipelines (one stage per worker, ``workers`` and
    2 x ``workers`` micro-batches, ``workers x batch_size`` examples per step) only when ``workers`` >= 2 and the
    profile knows the model's modules; ``tp:N`` when N divides ``workers``, the profile knows the modules and
    Megatron's pairs split some layer of the model."""
    linear = any(layer.out_features for layer in model.layers)
    cuttable = model.modules >= workers >= 2 and all(layer.module >= 0 for layer in model.layers)
    out = []
    for strategy in strategies:
        spec = parse_strategy(strategy)
        if spec.hybrid and not linear:
            continue
        if spec.exchanges_parameters:  # no buckets on the wire (the whole model, as the step ends)
            out.append(Candidate(strategy))
            continue
        if spec.splits_layers:
            tensor = int(spec.options.get("tensor", "0"))
            placed = model.modules > 0 and all(layer.module >= 0 for layer in model.layers)
            if tensor >= 2 and workers % tensor == 0 and placed and profile_splits(model, SoapConfig(tensor)):
                out.append(Candidate(strategy, batch_size=tensor * batch_size))
            continue
        if spec.pipelined:
            if cuttable:
                examples = workers * batch_size
                out += [
                    Candidate(strategy, microbatches=m, batch_size=examples)
                    for m in (workers, 2 * workers)
                    if examples % m == 0
                ]
            continue
        plain_allreduce = spec.reduces_gradients and not spec.hybrid  # the simulator composes its casts only
        for count in servers if spec.uses_servers else (1,):
            for compression in compressions if plain_allreduce else ("",):
                for size in bucket_sizes:
                    for overlap in (True, False):
                        out.append(Candidate(strategy, count, size, overlap, compression))
    return out


def search(
    profile: MachineProfile,
    model: ModelProfile,
    *,
    workers: int,
    batch_size: int,
    bandwidth: float | None = None,
    latency: float = 0.0,
    hosts: int = 1,
    space: Sequence[Candidate] | None = None,
    slowdown: list[float] | None = None,
    links: tuple[Link, ...] = (),
) -> list[Scored]:
    """Predicts every candidate; returns them fastest first (a tie goes to the default bucket size, then to
    overlap on: the settings a user changes least). ``slowdown``: per worker, how much slower its compute runs
    (a persistent straggler); ``links``: the emulated pairs with links of their own."""
    scored = []
    for candidate in space if space is not None else candidates(model):
        prediction = predict(
            profile,
            model,
            workers=workers,
            strategy=candidate.strategy,
            servers=candidate.servers,
            batch_size=candidate.batch_size or batch_size,
            microbatches=candidate.microbatches,
            bucket_bytes=candidate.bucket_bytes,
            overlap=candidate.overlap,
            bandwidth=bandwidth,
            latency=latency,
            hosts=hosts,
            compression=candidate.compression or None,
            slowdown=slowdown,
            links=links,
        )
        scored.append(Scored(candidate, prediction))
    return sorted(
        scored,
        key=lambda s: (round(s.step_s, 9), s.candidate.bucket_bytes != DEFAULT_BUCKET_BYTES, not s.candidate.overlap),
    )


def reason(best: Scored, default: Scored) -> str:
    """Why the pick beats the default allreduce, in the simulator's terms (bytes, waiting, compute)."""
    b, d = best.prediction, default.prediction
    if best.candidate == default.candidate:
        return "the default allreduce is already the fastest configuration predicted"
    sent_b, sent_d = b.sent_per_step, d.sent_per_step
    parts = [f"{best.candidate.label} is predicted {d.step_s / b.step_s:.2f}x faster than the default allreduce"]
    if b.job.sfb_layers:
        parts.append(f"it sends {', '.join(b.job.sfb_layers)} as sufficient factors")
    if best.candidate.update != "exact":
        parts.append(f"its update is not synchronous SGD's ({best.candidate.update}): compare accuracy, not only speed")
    parts.append(
        f"a worker sends {sent_b / 1e6:.2f} MB per step instead of {sent_d / 1e6:.2f} MB and its training loop waits "
        f"{b.comm_wait_s:.3f} s instead of {d.comm_wait_s:.3f} s for communication"
    )
    return "; ".join(parts)
