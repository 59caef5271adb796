"""Where workers sit on a tensor x data grid, and whether a per-layer split fits a model's layers.

``W = tensor x data`` workers: worker ``w`` holds tensor part ``w % tensor`` of every split layer and data part
``w // tensor`` of every batch. Workers with the same data part form a tensor-parallel group (they exchange
activations, :mod:`.layout`); workers with the same tensor part form a data-parallel group (they average their
gradients). Consecutive ranks share a tensor group, so that on a cluster of multi-GPU nodes the chatty group stays
inside a node, as Megatron-LM places it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.soap.layout import SPLITS

__all__ = [
    "BLOCK_SPLIT",
    "KIND_SPLITS",
    "SEQUENCE_SPLIT",
    "VOCAB_SPLIT",
    "LayerShape",
    "Mesh",
    "SoapConfigError",
    "check_splits",
]

#: How a transformer block splits: its attention heads (the query, key and value projections by output, the
#: attention per head, the output projection by input) and its MLP (first layer by output, second by input), one
#: allreduce each forward (Megatron-LM's transformer layer).
BLOCK_SPLIT = "heads"
#: A transformer block split by heads whose layer norms and residuals also split along the sequence (the
#: attribute dimension; Megatron-LM's sequence parallelism): each worker normalises its N-th of the positions.
SEQUENCE_SPLIT = "sequence"
#: How a token embedding or an output head splits: by vocabulary (each worker holds its tokens' rows).
VOCAB_SPLIT = "vocab"
#: The splits each kind of module other than a layer takes (beside ``replicated``).
KIND_SPLITS = {"block": (BLOCK_SPLIT, SEQUENCE_SPLIT), "vocab": (VOCAB_SPLIT,)}


class SoapConfigError(ConfigError):
    """A per-layer configuration that cannot run on this model or these workers (raised before anything starts)."""


@dataclass(frozen=True, slots=True)
class Mesh:
    """A grid of ``tensor x data`` workers.

    Example:
        >>> m = Mesh(tensor=2, data=2)
        >>> [m.coordinates(w) for w in range(4)], m.tensor_group(3), m.data_group(3)
        ([(0, 0), (1, 0), (0, 1), (1, 1)], [2, 3], [1, 3])
    """

    tensor: int
    data: int = 1

    def __post_init__(self) -> None:
        if self.tensor < 1 or self.data < 1:
            raise SoapConfigError(f"tensor and data degrees must be at least 1 (got {self.tensor} x {self.data})")

    @classmethod
    def for_workers(cls, workers: int, tensor: int) -> Mesh:
        """The mesh of ``workers`` with ``tensor``-way splits, data parallel across the rest."""
        if tensor < 1 or workers % tensor:
            raise SoapConfigError(
                f"{workers} workers cannot form {tensor}-way tensor groups: give a tensor degree that divides the "
                "number of workers (the rest is data parallel)"
            )
        return cls(tensor=tensor, data=workers // tensor)

    @property
    def workers(self) -> int:
        """Workers on the grid."""
        return self.tensor * self.data

    def coordinates(self, worker: int) -> tuple[int, int]:
        """``(tensor part, data part)`` of ``worker``."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is not on a {self.tensor} x {self.data} grid")
        return worker % self.tensor, worker // self.tensor

    def tensor_group(self, worker: int) -> list[int]:
        """The workers that split layers with ``worker`` (same data part), ascending."""
        _, d = self.coordinates(worker)
        return [d * self.tensor + t for t in range(self.tensor)]

    def data_group(self, worker: int) -> list[int]:
        """The workers that hold the same parts as ``worker`` (same tensor part), ascending."""
        t, _ = self.coordinates(worker)
        return [d * self.tensor + t for d in range(self.data)]


@dataclass(frozen=True, slots=True)
class LayerShape:
    """The dimensions a split cuts: a linear layer's features, or a convolution's channels; for a transformer
    block (``kind="block"``), its attention heads (``in_features``) and its MLP's width (``out_features``)."""

    in_features: int
    out_features: int
    kind: str = "layer"


def check_splits(layers: Mapping[str, LayerShape], splits: Mapping[str, str], tensor: int) -> None:
    """Refuses a configuration that names a layer the model lacks, an unknown split, or a split degree that does
    not divide the dimension it splits.

    Raises:
        SoapConfigError: what is wrong and what to change.
    """
    for name, split in splits.items():
        if name not in layers:
            known = ", ".join(sorted(layers)) or "none"
            raise SoapConfigError(f"the model has no layer {name!r} to split (the layers that split: {known})")
        shape = layers[name]
        if shape.kind in KIND_SPLITS or any(split in own for own in KIND_SPLITS.values()):
            _check_kind(name, shape, split, tensor)
            continue
        if split not in SPLITS:
            raise SoapConfigError(f"layer {name}: unknown split {split!r}; give one of {', '.join(SPLITS)}")
        dim, what = (shape.out_features, "outputs") if split == "column" else (shape.in_features, "inputs")
        if split != "replicated" and dim % tensor:
            raise SoapConfigError(
                f"layer {name}: a {tensor}-way {split} split needs its {dim} {what} (features or channels) to divide "
                f"by {tensor}; choose another degree or leave this layer replicated"
            )


def _check_kind(name: str, shape: LayerShape, split: str, tensor: int) -> None:
    """A transformer block splits by heads, an embedding or head by vocabulary, or stays whole; nothing else
    splits their ways."""
    own = KIND_SPLITS.get(shape.kind)
    what = {"block": "a transformer block", "vocab": "an embedding or output head"}.get(shape.kind, "")
    if own is None:
        raise SoapConfigError(f"layer {name}: only transformer blocks split by {BLOCK_SPLIT!r} or "
                              f"{SEQUENCE_SPLIT!r} and embeddings or heads by {VOCAB_SPLIT!r}; give column, row or "
                              "replicated")  # fmt: skip
    if split not in ("replicated", *own):
        detail = (
            f"{BLOCK_SPLIT!r} (its attention heads and its MLP's width) or {SEQUENCE_SPLIT!r} (and its layer norms "
            "along the sequence)"
            if shape.kind == "block"
            else f"{VOCAB_SPLIT!r} (its tokens' rows)"
        )
        raise SoapConfigError(f"layer {name} is {what}: split it {detail} or leave it replicated")
    if split != "replicated" and (shape.in_features % tensor or shape.out_features % tensor):
        count = (
            f"{shape.in_features} heads (and its MLP's {shape.out_features} width)"
            if shape.kind == "block"
            else f"vocabulary of {shape.in_features}"
        )
        raise SoapConfigError(
            f"layer {name}: a {tensor}-way split by {split} needs its {count} to divide by {tensor}; choose another "
            "degree or leave it replicated"
        )
