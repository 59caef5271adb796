"""The models of ``paratrain train`` and their shared loss and accuracy (``paratrain.train.tasks``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.train import tasks
from paratrain.train.data import DATASETS
from paratrain.train.models import MODEL_KINDS, MODELS, build_model, check_model_dataset

torch = pytest.importorskip("torch")
nn = torch.nn


def _input(name: str, side: int, n: int = 3) -> torch.Tensor:
    if MODEL_KINDS[name] == "text":
        return torch.randint(0, 10, (n, side), generator=torch.Generator().manual_seed(0))
    return torch.rand(n, 1, side, side, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", MODELS)
def test_every_model_is_a_flat_sequential_with_the_right_output(name: str) -> None:
    sides = (16,) if MODEL_KINDS[name] == "text" else (8, 28)  # digits and Fashion-MNIST
    for side in sides:
        torch.manual_seed(0)
        model = build_model(name, side=side, classes=10)
        assert isinstance(model, nn.Sequential)
        assert not any(isinstance(layer, nn.Sequential) for layer in model), "a pipeline could not cut inside"
        assert not any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.Dropout)) for m in model.modules())
        out = model(_input(name, side))
        assert out.shape == ((3, side, 10) if MODEL_KINDS[name] == "text" else (3, 10))


def test_flat_lenet_has_the_parameters_the_nested_one_had() -> None:
    """LeNet used to keep its convolutions in a nested Sequential; flattening it must not change one number."""
    for side in (8, 28):
        torch.manual_seed(3)
        features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=0 if side >= 28 else 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = int(features(torch.zeros(1, 1, side, side)).numel())
        nested = nn.Sequential(
            features, nn.Flatten(), nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10)
        )
        torch.manual_seed(3)
        model = build_model("lenet", side=side, classes=10)
        old, new = list(nested.parameters()), list(model.parameters())
        assert len(old) == len(new)
        for a, b in zip(old, new, strict=True):
            assert torch.equal(a, b)
        x = _input("lenet", side)
        assert torch.equal(nested(x), model(x))


def test_transformer_is_causal() -> None:
    """Changing token t changes the outputs at t and after, never before."""
    torch.manual_seed(0)
    model = build_model("transformer", side=16, classes=20)
    x = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(x)
        for t in (0, 5, 15):
            changed = x.clone()
            changed[:, t] = (changed[:, t] + 7) % 20
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-3  # the change is seen where it happens
        # shorter windows than the context work (positions 0..t-1), longer ones are refused
        torch.testing.assert_close(model(x[:, :7]), base[:, :7], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="longer than the model's context"):
            model(torch.zeros(1, 17, dtype=torch.long))


def test_loss_is_cross_entropy_per_target() -> None:
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])  # [N=1, T=2, V=3]
    target = torch.tensor([[0, 2]])
    by_hand = [-(2 - math.log(math.exp(2) + 2)), -(0 - math.log(math.e + 2))]
    assert float(tasks.loss(logits, target)) == pytest.approx(sum(by_hand) / 2, rel=1e-6)
    assert float(tasks.loss(logits, target, reduction="sum")) == pytest.approx(sum(by_hand), rel=1e-6)
    images = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # [N=2, V=3]: the same numbers as images
    assert float(tasks.loss(images, torch.tensor([0, 2]))) == pytest.approx(sum(by_hand) / 2, rel=1e-6)


def test_evaluate_counts_tokens_and_restores_train_mode() -> None:
    vocab = 5
    # a "model" that predicts token (x + 1) mod 5 with certainty: right wherever y = x + 1
    x = np.array([[0, 1, 2, 3], [4, 0, 1, 2], [3, 3, 3, 3]], dtype=np.int64)
    y = np.array([[1, 2, 3, 0], [0, 1, 2, 3], [4, 4, 4, 4]], dtype=np.int64)  # 3 + 4 + 4 right of 12

    def predict(xb: torch.Tensor) -> torch.Tensor:
        return 50.0 * nn.functional.one_hot((xb + 1) % vocab, vocab).float()

    accuracy, loss = tasks.evaluate(predict, x, y, batch=2)  # batches of 2 and 1: counted per token
    assert accuracy == pytest.approx(11 / 12)
    assert loss == pytest.approx(50.0 / 12, rel=1e-3)  # the one miss costs about 50 nats, the hits nothing
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    accuracy, _ = tasks.evaluate(model, np.zeros((5, 1, 2, 2), np.float32), np.zeros(5, np.int64))
    assert model.training and accuracy in (0.0, 1.0)


def test_model_and_dataset_must_fit() -> None:
    for model in MODELS:
        for dataset in DATASETS:
            fits = (model == "transformer") == (dataset == "fortunes")
            if fits:
                check_model_dataset(model, dataset)
            else:
                with pytest.raises(ConfigError, match="use --model"):
                    check_model_dataset(model, dataset)
    with pytest.raises(ConfigError, match="choose one of"):
        check_model_dataset("resnet", "digits")
    with pytest.raises(ConfigError, match="choose one of"):
        check_model_dataset("mlp", "imagenet")


@pytest.mark.parametrize("module", ["paratrain.train.data", "paratrain.train.tasks", "paratrain.train.transformer"])
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("name", ["cnn", "deepmlp"])
def test_deep_models_are_he_initialised_where_a_relu_follows(name: str) -> None:
    """Without normalisation layers the default initialisation left these models at a uniform guess's loss for
    hundreds of steps; He's variance 2 / fan_in (biases zero) before every ReLU, the output layer untouched."""
    torch.manual_seed(0)
    layers = list(build_model(name, side=28, classes=10))
    checked = 0
    for layer, after in zip(layers, [*layers[1:], None], strict=True):
        if not isinstance(layer, nn.Conv2d | nn.Linear):
            continue
        fan_in = layer.weight[0].numel()
        if isinstance(after, nn.ReLU):
            assert float(layer.weight.detach().std()) == pytest.approx((2 / fan_in) ** 0.5, rel=0.1)
            assert not layer.bias.any()
            checked += 1
        else:  # the output layer keeps torch's default (uniform within 1 / sqrt(fan_in))
            assert float(layer.weight.detach().abs().max()) <= fan_in**-0.5
    assert checked == (7 if name == "cnn" else 8)
