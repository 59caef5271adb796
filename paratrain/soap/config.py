"""A per-layer configuration as a job carries it: the tensor-parallel degree and each layer's split, what
``--strategy tp:N`` means and what a ``soap:FILE`` holds (the JSON ``paratrain plan --search soap`` writes).

``tp:N`` is Megatron-LM's rule applied to a chain (:func:`megatron_splits`): consecutive linear layers paired, the
first split by output features (column), the second by input features (row), so that one allreduce per pair
forward and one backward is all the tensor-parallel group exchanges. A file names every split itself::

    {"tensor": 2, "data": 2, "model": "widemlp", "splits": {"1": "column", "3": "row"}}

``data`` (optional) fixes the data-parallel degree, so the job needs ``tensor x data`` workers; ``model``
(optional) names the model the file was made for. Torch-free: the CLI checks a configuration before torch loads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from paratrain.soap.layout import SPLITS
from paratrain.soap.mesh import BLOCK_SPLIT, KIND_SPLITS, LayerShape, SoapConfigError

__all__ = ["SoapConfig", "megatron_splits"]


@dataclass(frozen=True)
class SoapConfig:
    """Degrees and splits of a per-layer configuration.

    Attributes:
        tensor: workers that split each layer (the tensor-parallel group's size).
        splits: layer name (as ``named_modules`` gives it) -> ``column``, ``row`` or ``replicated``; None: Megatron's
            pairs (:func:`megatron_splits`), what ``tp:N`` asks for.
        data: the data-parallel degree the configuration was made for (None: the job's workers / ``tensor``).
        model: the model it was made for (None: any).

    Example:
        >>> c = SoapConfig.from_json('{"tensor": 2, "splits": {"1": "column", "3": "row"}}')
        >>> c.tensor, dict(c.splits or {}), c.workers(4).data
        (2, {'1': 'column', '3': 'row'}, 2)
    """

    tensor: int
    splits: Mapping[str, str] | None = field(default=None)
    data: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.tensor < 1 or (self.data is not None and self.data < 1):
            raise SoapConfigError(f"the tensor and data degrees must be at least 1, got {self.tensor} and {self.data}")
        if self.splits is not None:
            for name, split in self.splits.items():
                others = [name for own in KIND_SPLITS.values() for name in own]
                if split not in (*SPLITS, *others):
                    known = ", ".join((*SPLITS, *others))
                    raise SoapConfigError(f"layer {name}: unknown split {split!r}; give one of {known}")
            object.__setattr__(self, "splits", MappingProxyType(dict(self.splits)))

    @classmethod
    def named(cls, options: Mapping[str, str]) -> SoapConfig:
        """The configuration a strategy's options name: ``tp:N``'s (``{"tensor": "N"}``: Megatron's pairs) or the
        file of ``soap:FILE`` (``{"file": PATH}``).

        Raises:
            SoapConfigError: the file cannot be read or holds no configuration.
        """
        if "tensor" in options:
            return cls(tensor=int(options["tensor"]))
        return cls.read(options["file"])

    def workers(self, workers: int) -> SoapConfig:
        """The configuration on a job of ``workers``: its data degree filled in.

        Raises:
            SoapConfigError: ``workers`` is not a multiple of the tensor degree, or not the ``tensor x data`` the
                configuration was made for (say which ``--workers`` to give).
        """
        if self.data is not None and workers != self.tensor * self.data:
            raise SoapConfigError(
                f"this configuration uses {self.tensor} x {self.data} = {self.tensor * self.data} workers (tensor x "
                f"data), the job has {workers}: give --workers {self.tensor * self.data}"
            )
        if workers % self.tensor:
            raise SoapConfigError(
                f"{workers} workers cannot form {self.tensor}-way tensor groups: give --workers a multiple of "
                f"{self.tensor} (the workers beyond one group train data parallel)"
            )
        return SoapConfig(self.tensor, self.splits, workers // self.tensor, self.model)

    def to_json(self) -> str:
        """The configuration as the JSON a ``soap:FILE`` holds."""
        out: dict[str, Any] = {"tensor": self.tensor}
        if self.data is not None:
            out["data"] = self.data
        if self.model is not None:
            out["model"] = self.model
        out["splits"] = dict(self.splits) if self.splits is not None else "megatron"
        return json.dumps(out, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "the configuration") -> SoapConfig:
        """The configuration of a :meth:`to_json` text.

        Raises:
            SoapConfigError: not JSON, or a field missing or of the wrong type (said where).
        """
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SoapConfigError(f"{where} is not JSON: {exc}") from None
        if not isinstance(values, dict) or not isinstance(values.get("tensor"), int):
            raise SoapConfigError(f'{where} needs an object with an int "tensor" and "splits", e.g. {_EXAMPLE}')
        unknown = sorted(set(values) - {"tensor", "data", "model", "splits"})
        if unknown:
            raise SoapConfigError(
                f"{where}: unknown field(s) {', '.join(unknown)}; the fields: tensor, data, model, splits"
            )
        splits = values.get("splits", "megatron")
        if splits != "megatron" and not (isinstance(splits, dict) and all(isinstance(v, str) for v in splits.values())):
            raise SoapConfigError(f'{where}: "splits" maps layer names to column, row or replicated (or is "megatron")')
        data, model = values.get("data"), values.get("model")
        if data is not None and not isinstance(data, int):
            raise SoapConfigError(f'{where}: "data" is the data-parallel degree, an int')
        return cls(values["tensor"], None if splits == "megatron" else splits, data, model)

    @classmethod
    def read(cls, path: str | Path) -> SoapConfig:
        """The configuration in the file at ``path``.

        Raises:
            SoapConfigError: the file cannot be read or holds no configuration.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise SoapConfigError(f"cannot read the configuration {str(path)!r}: {exc.strerror or exc}") from None
        return cls.from_json(text, where=str(path))

    def write(self, path: str | Path) -> Path:
        """Writes the configuration to ``path``; returns it."""
        target = Path(path)
        target.write_text(self.to_json() + "\n", encoding="utf-8")
        return target


_EXAMPLE = '{"tensor": 2, "splits": {"1": "column", "3": "row"}}'


def megatron_splits(layers: Sequence[tuple[str, LayerShape | None]], tensor: int) -> dict[str, str]:
    """Megatron-LM's splits of a chain (its steps in order, a splittable layer's shape or None): consecutive
    splittable layers paired, the first by output features (column), the second by input features (row). A
    layer whose split dimension does not divide by ``tensor`` (a classifier's 10 outputs) stays whole, and a
    pair is broken by it. A transformer block (``kind="block"``) is split by its heads where they divide.

    Example:
        >>> mlp = [("0", None), ("1", LayerShape(64, 512)), ("2", None), ("3", LayerShape(512, 512)),
        ...        ("4", None), ("5", LayerShape(512, 10))]
        >>> megatron_splits(mlp, 2)
        {'1': 'column', '3': 'row'}
    """
    splits: dict[str, str] = {}
    pending: str | None = None
    for name, shape in layers:
        if shape is None:
            continue
        if shape.kind != "layer":  # a block is a whole Megatron layer in itself; an embedding or head stays whole
            pending = None
            if shape.kind == "block" and shape.in_features % tensor == 0 and shape.out_features % tensor == 0:
                splits[name] = BLOCK_SPLIT
            continue
        if pending is None:
            pending = name if shape.out_features % tensor == 0 else None
        elif shape.in_features % tensor == 0:
            splits[pending], splits[name], pending = "column", "row", None
        else:
            pending = name if shape.out_features % tensor == 0 else None
    return splits
