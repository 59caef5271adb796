"""The options a strategy is combined with, as every front end gives them (``paratrain train``'s flags,
``DistributedOptimizer``'s arguments): what :func:`paratrain.strategy.checks.check_options` judges, in one
vocabulary, so that each rule across options is written once. Torch-free and without imports of the algorithms:
a compressor enters through the traits it declares (:class:`CompressionTraits`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["CompressionTraits", "StrategyOptions"]


class CompressionTraits(Protocol):
    """What a rule needs to know of a gradient compressor (:class:`paratrain.compression.Compressor` has it)."""

    @property
    def name(self) -> str:
        """The compressor as the user wrote it (``"powersgd:2"``)."""
        ...

    @property
    def aggregation_rounds(self) -> int:
        """Rounds of aggregation one step needs (PowerSGD: two, P then Q)."""
        ...

    @property
    def moves_momentum(self) -> bool:
        """True when the compressor keeps SGD's momentum on the workers (DGC)."""
        ...


@dataclass(frozen=True)
class StrategyOptions:
    """The options beside a strategy name.

    Attributes:
        front: how refusals name the options: ``"cli"`` (``--compression``) or ``"python"`` (``compression=``).
        workers: the data-parallel workers (None: not known yet).
        servers: ``--servers`` as given (None: not given).
        replicas: copies of each parameter-server chunk, or a pipeline's replicas.
        compression: the gradient compressor (None: none).
        max_restarts: restarts of dead ranks the job allows.
        min_workers: an elastic job's least workers (0: not elastic).
        checkpoint: checkpoints to disk asked for.
        reliable: reliable (recovering) collectives asked for (``reliable=``).
        layer_schemes: per-layer scheme choices given (``--layer-scheme``, ``batch_size=``, ``layer_schemes=``).
        device: where the model trains (``"cpu"`` or ``"cuda"``).
        overlap: wait-free backprop on (buckets start during backward).
        staleness_lr: stale gradients scaled on the servers.
    """

    front: Literal["cli", "python"] = "python"
    workers: int | None = None
    servers: int | None = None
    replicas: int = 1
    compression: CompressionTraits | None = None
    max_restarts: int = 0
    min_workers: int = 0
    checkpoint: bool = False
    reliable: bool = False
    layer_schemes: bool = False
    device: str = "cpu"
    overlap: bool = True
    staleness_lr: bool = False

    def flag(self, name: str) -> str:
        """How the front end spells option ``name`` (a field name): ``--max-restarts`` or ``max_restarts=``.

        Example:
            >>> StrategyOptions(front="cli").flag("max_restarts"), StrategyOptions().flag("max_restarts")
            ('--max-restarts', 'max_restarts=')
        """
        return f"--{name.replace('_', '-')}" if self.front == "cli" else f"{name}="
