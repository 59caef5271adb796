"""A stand-in for the two torchvision names MNIST examples use, ``datasets.MNIST`` and ``transforms``, backed by
data that needs no download: Debian's Fashion-MNIST (``dataset-fashion-mnist``; 28 x 28 grey images in 10
classes, the shape and size of MNIST).

So a training script written for MNIST, such as Horovod's PyTorch example, swaps its dataset by one import line::

    from paratrain.examples.bundled_vision import datasets, transforms   # was: from torchvision import ...

``transforms`` has what those scripts compose: ``Compose``, ``ToTensor`` (uint8 H x W -> float 1 x H x W in
[0, 1]) and ``Normalize``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

__all__ = ["datasets", "transforms"]


class _Compose:
    def __init__(self, steps: Sequence[Callable[[Any], Any]]) -> None:
        self.steps = list(steps)

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x


class _ToTensor:
    def __call__(self, image: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).unsqueeze(0)


class _Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).reshape(-1, 1, 1)
        self.std = torch.tensor(std).reshape(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class _MNIST(torch.utils.data.Dataset[tuple[Any, int]]):
    """Fashion-MNIST's training (60000) or test (10000) images with their labels, in torchvision's MNIST form:
    ``MNIST(root, train=True, download=False, transform=None, target_transform=None)``. Nothing is downloaded:
    the IDX files come from ``root`` if it holds them, else from Debian's package."""

    def __init__(
        self,
        root: str | None = None,
        train: bool = True,
        download: bool = False,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
    ) -> None:
        from pathlib import Path

        from paratrain.train.data import load_dataset

        here = root is not None and any(Path(root).glob("train-images-idx3-ubyte*"))
        data = load_dataset("fashion-mnist", data_dir=str(root) if here else None)
        images = data.x_train if train else data.x_test
        labels = data.y_train if train else data.y_test
        self.images = np.asarray(images).reshape(len(images), 28, 28)
        if self.images.dtype != np.uint8:  # the loader's floats in [0, 1]: back to bytes, as torchvision has them
            self.images = np.round(self.images * 255).astype(np.uint8)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        image: Any = self.images[i]
        label: Any = int(self.labels[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label


datasets = SimpleNamespace(MNIST=_MNIST)
transforms = SimpleNamespace(Compose=_Compose, ToTensor=_ToTensor, Normalize=_Normalize)
