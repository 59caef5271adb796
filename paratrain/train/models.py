"""The models of ``paratrain train``: an MLP and LeNet-5, sized from the dataset's image side."""

from __future__ import annotations

from typing import Any

from paratrain.errors import ConfigError

__all__ = ["MODELS", "build_model"]

MODELS = ("mlp", "lenet")


def build_model(name: str, *, side: int, classes: int) -> Any:
    """A fresh ``torch.nn.Module``: ``mlp`` (side²-512-512-classes, ReLU) or ``lenet`` (LeNet-5 with ReLU/max-pool).

    LeNet's first convolution pads so that 8x8 digits and 28x28 Fashion-MNIST both fit; the linear layers are
    sized from the image side.
    """
    import torch
    from torch import nn

    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(side * side, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, classes),
        )
    if name == "lenet":
        features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=0 if side >= 28 else 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        with torch.no_grad():
            flat = int(features(torch.zeros(1, 1, side, side)).numel())
        return nn.Sequential(
            features,
            nn.Flatten(),
            nn.Linear(flat, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, classes),
        )
    raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
