"""The models of ``paratrain train``: image classifiers sized from the image side, and a character transformer.

Every model is one flat ``nn.Sequential``: a pipeline cuts the top-level list of layers into stages, so no
container hides layers from it, and the more evenly sized the top-level layers, the better the balance. No model
uses BatchNorm or dropout: a micro-batch's output then depends on its own examples only, and pipelined training
equals plain training.
"""

from __future__ import annotations

from typing import Any

from paratrain.errors import ConfigError

__all__ = ["MODELS", "MODEL_KINDS", "build_model", "check_model_dataset"]

MODELS = ("mlp", "widemlp", "lenet", "cnn", "deepmlp", "transformer")
#: The kind of dataset each model reads (:data:`paratrain.train.data.DATASET_KINDS`).
MODEL_KINDS = {
    "mlp": "image",
    "widemlp": "image",
    "lenet": "image",
    "cnn": "image",
    "deepmlp": "image",
    "transformer": "text",
}


def check_model_dataset(model: str, dataset: str) -> None:
    """Refuses a model that cannot read the dataset (an image model on text, the transformer on images).

    Raises:
        ConfigError: unknown model or dataset, or a mismatch; the message names the models that fit.
    """
    from paratrain.train.data import DATASET_KINDS, DATASETS

    if model not in MODEL_KINDS:
        raise ConfigError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    if dataset not in DATASET_KINDS:
        raise ConfigError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    kind = DATASET_KINDS[dataset]
    if MODEL_KINDS[model] != kind:
        fits = [m for m in MODELS if MODEL_KINDS[m] == kind]
        others = [d for d in DATASETS if DATASET_KINDS[d] == MODEL_KINDS[model]]
        raise ConfigError(
            f"--model {model} reads {MODEL_KINDS[model]}s but --dataset {dataset} is {kind}: use --model "
            f"{'|'.join(fits)} with {dataset}, or --dataset {'|'.join(others)} with {model}"
        )


def build_model(name: str, *, side: int, classes: int) -> Any:
    """A fresh flat ``torch.nn.Sequential``; ``side`` is the image side, or for text the window length.

    - ``mlp``: side²-512-512-classes, ReLU (0.67 M parameters on 28x28).
    - ``widemlp``: side²-2048-2048-classes, ReLU (5.8 M parameters on 28x28, 99.6 % of them in two wide
      fully-connected layers): the fully-connected-heavy model on which sufficient factors pay (Poseidon).
    - ``lenet``: LeNet-5 with ReLU and max-pool; the first convolution pads so that 8x8 digits and 28x28
      Fashion-MNIST both fit.
    - ``cnn``: six 3x3 convolutions (16, 16, 32, 32, 64, 64 channels, ReLU, a 2x2 max-pool after every second),
      then 256-unit and output linear layers: a deeper image model whose top-level layers a pipeline can balance.
      He-initialised, as ``deepmlp``, so that it learns from the first steps without normalisation layers.
    - ``deepmlp``: eight hidden layers of 1024 (ReLU): 8.1 M parameters on 28x28, mostly in equal 1024x1024
      layers, the easiest model to cut into equal stages.
    - ``transformer``: :func:`paratrain.train.transformer.transformer` with ``classes`` as the vocabulary and
      ``side`` as the context.

    The linear layers after convolutions are sized by running the convolutions once on a zero image (no random
    numbers drawn, so the parameters are the same as if the size were computed by hand).
    """
    import torch
    from torch import nn

    def flat_size(layers: list[nn.Module]) -> int:
        with torch.no_grad():
            return int(nn.Sequential(*layers)(torch.zeros(1, 1, side, side)).numel())

    if name in ("mlp", "widemlp"):  # two hidden layers of 512 or 2048
        width = 512 if name == "mlp" else 2048
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(side * side, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, classes),
        )
    if name == "lenet":
        features: list[nn.Module] = [
            nn.Conv2d(1, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=0 if side >= 28 else 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]
        flat = flat_size(features)
        return nn.Sequential(
            *features,
            nn.Flatten(),
            nn.Linear(flat, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, classes),
        )
    if name == "cnn":
        if side < 8:
            raise ConfigError(f"--model cnn pools three times and needs images of at least 8x8, not {side}x{side}")
        convs: list[nn.Module] = []
        channels = 1
        for i, width in enumerate((16, 16, 32, 32, 64, 64)):
            convs += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            channels = width
            if i % 2 == 1:
                convs.append(nn.MaxPool2d(2))
        flat = flat_size(convs)
        return _he_init(nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 256), nn.ReLU(), nn.Linear(256, classes)))
    if name == "deepmlp":
        hidden: list[nn.Module] = []
        for i in range(8):
            hidden += [nn.Linear(side * side if i == 0 else 1024, 1024), nn.ReLU()]
        return _he_init(nn.Sequential(nn.Flatten(), *hidden, nn.Linear(1024, classes)))
    if name == "transformer":
        from paratrain.train.transformer import transformer

        return transformer(vocab=classes, context=side)
    raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def _he_init(model: Any) -> Any:
    """He (Kaiming) initialisation of every convolution and linear layer that a ReLU follows, biases zero.

    Why: without normalisation layers (BatchNorm would make a pipeline's micro-batches see different statistics
    than the whole batch), torch's default initialisation shrinks the signal layer by layer, and the deep models
    sat at the loss of a uniform guess (2.30) for 200-300 steps of SGD at lr 0.05 before learning, or never left
    it in the first epoch (cnn, Fashion-MNIST, batch 128, measured). He's variance 2 / fan_in keeps the signal's
    scale through ReLUs: the cnn's mean loss over its first 30 steps is then 1.74, 0.38 after 300.
    """
    from torch import nn

    layers = list(model)
    for layer, after in zip(layers, [*layers[1:], None], strict=True):
        if isinstance(layer, nn.Conv2d | nn.Linear) and isinstance(after, nn.ReLU):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
    return model
