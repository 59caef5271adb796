"""Per-layer tensor parallelism (paratrain.soap's plans, paratrain.torch.soap's layers): any configuration of
column, row and replicated linear layers and convolutions, data parallel across tensor groups, computes what one
process computes (forward outputs, gradients, parameters after momentum steps, float64 to 1e-12); bad
configurations are refused before anything runs, saying what to change."""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402, N812

from paratrain.soap import Mesh, SoapConfigError  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402
from paratrain.torch.soap import parallelize  # noqa: E402
from paratrain.train.models import build_model  # noqa: E402

pytestmark = pytest.mark.timeout(120)

_BATCH, _STEPS = 8, 3


_MODELS: dict[str, nn.Sequential] = {}


def _model(name: str) -> nn.Sequential:
    """A fresh copy of the model (built once: torch's seed is global, and the ranks are threads)."""
    if name not in _MODELS:
        torch.manual_seed(0)
        _MODELS[name] = build_model(name, side=8, classes=12).double()
    return copy.deepcopy(_MODELS[name])


def _data() -> tuple[Any, Any]:
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((_STEPS, _BATCH, 1, 8, 8)))
    y = torch.from_numpy(rng.integers(0, 12, size=(_STEPS, _BATCH)))
    return x, y


def _one_process(name: str) -> tuple[Any, dict[str, np.ndarray], dict[str, np.ndarray]]:
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()
    first, grads = None, {}
    for step in range(_STEPS):
        out = model(x[step])
        opt.zero_grad()
        F.cross_entropy(out, y[step]).backward()
        if step == 0:
            first = out.detach().numpy().copy()
            grads = {k: p.grad.numpy().copy() for k, p in model.named_parameters()}
        opt.step()
    return first, grads, {k: p.detach().numpy().copy() for k, p in model.named_parameters()}


def _split_run(name: str, splits: dict[str, str], tensor: int, workers: int) -> list[Any]:
    whole = _model(name)

    def rank(ctx: Any) -> Any:
        try:
            model = parallelize(copy.deepcopy(whole), splits, ctx, Mesh.for_workers(ctx.world_size, tensor))
        except SoapConfigError as exc:  # every rank's, returned: one rank's raise would tear the others down
            return str(exc)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        x, y = _data()
        rows = model.rows(_BATCH)
        first, grads = None, {}
        for step in range(_STEPS):
            out = model(x[step][rows])
            opt.zero_grad()
            F.cross_entropy(out, y[step][rows]).backward()
            model.average_gradients()
            if step == 0:
                first = (rows, out.detach().numpy().copy())
                grads = model.full_state(grads=True)
            opt.step()
        return first, grads, model.full_state()

    return run_ranks(workers, rank, timeout=90)


def _configs() -> list[tuple[str, dict[str, str], int, int]]:
    """Random configurations (seeded): every linear layer column, row or replicated, on 2-4 workers."""
    rng = np.random.default_rng(41)
    layers = {
        "mlp": ["1", "3", "5"],
        "widemlp": ["1", "3", "5"],
        "lenet": ["0", "3", "7", "9", "11"],
        "cnn": ["0", "2", "5", "7", "10", "12", "16", "18"],
    }
    found = [
        ("mlp", {"1": "column", "3": "row"}, 2, 2),  # Megatron's pair
        ("mlp", {"1": "column", "3": "row"}, 2, 4),  # ... 2-way tensor x 2-way data
        ("widemlp", {"1": "column", "3": "row", "5": "column"}, 2, 2),
        ("lenet", {"0": "column", "3": "row"}, 2, 2),  # the pair on convolutions: channels out, then in
        ("lenet", {"3": "column", "7": "row"}, 2, 4),  # channel shards flatten into the features' shards
        ("cnn", {"0": "column", "2": "row", "5": "column", "7": "column", "10": "row", "16": "column", "18": "row"},
         2, 2),
    ]  # fmt: skip
    for name in ("mlp", "mlp", "mlp", "widemlp", "lenet", "lenet", "cnn", "cnn"):
        tensor, workers = [(2, 2), (4, 4), (2, 4), (3, 3)][int(rng.integers(4))]
        splits = {layer: str(rng.choice(["column", "row", "replicated"])) for layer in layers[name]}
        found.append((name, splits, tensor, workers))
    return found


def _divides(name: str, splits: dict[str, str], tensor: int) -> bool:
    children = dict(_model(name).named_children())

    def dims(n: str) -> tuple[int, int]:
        m = children[n]
        return (m.in_channels, m.out_channels) if isinstance(m, nn.Conv2d) else (m.in_features, m.out_features)

    return all(dims(n)[1 if s == "column" else 0] % tensor == 0 for n, s in splits.items() if s != "replicated")


def _id(config: tuple[str, dict[str, str], int, int]) -> str:
    name, splits, tensor, workers = config
    return "-".join([name, *(f"{k}{v[:3]}" for k, v in splits.items()), f"t{tensor}", f"w{workers}"])


@pytest.mark.parametrize(("name", "splits", "tensor", "workers"), _configs(), ids=[_id(c) for c in _configs()])
def test_any_configuration_computes_what_one_process_computes(
    name: str, splits: dict[str, str], tensor: int, workers: int
) -> None:
    if not _divides(name, splits, tensor):  # refused on every rank, before anything runs
        refusals = _split_run(name, splits, tensor, workers)
        assert all(isinstance(r, str) and "to divide by" in r for r in refusals), refusals
        return
    reference = _one_process(name)
    for (rows, out), got_grads, got_params in _split_run(name, splits, tensor, workers):
        _assert_as_one_process(reference, rows, (out, got_grads, got_params))


def _assert_as_one_process(reference: tuple[Any, Any, Any], rows: Any, got: tuple[Any, Any, Any]) -> None:
    """A worker's first output (its rows), first gradients and last parameters equal one process's to 1e-12."""
    (first, grads, params), (out, got_grads, got_params) = reference, got
    np.testing.assert_allclose(out, first[rows], rtol=0, atol=1e-12)
    assert got_grads.keys() == grads.keys() and got_params.keys() == params.keys()
    for key in grads:
        np.testing.assert_allclose(got_grads[key], grads[key], rtol=0, atol=1e-12, err_msg=key)
        np.testing.assert_allclose(got_params[key], params[key], rtol=0, atol=1e-12, err_msg=key)


def test_layers_inside_nested_sequentials_are_named_as_the_model_names_them() -> None:
    torch.manual_seed(0)
    nested = nn.Sequential(
        OrderedDict(
            features=nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU()),
            head=nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 12)),
        )
    ).double()
    x, y = _data()

    def rank(ctx: Any) -> Any:
        model = parallelize(copy.deepcopy(nested), {"features.1": "column", "head.0": "row"}, ctx, Mesh(tensor=2))
        F.cross_entropy(model(x[0]), y[0]).backward()
        return model.full_state(grads=True)

    whole = copy.deepcopy(nested)
    F.cross_entropy(whole(x[0]), y[0]).backward()
    for grads in run_ranks(2, rank):
        assert grads.keys() == dict(whole.named_parameters()).keys()
        for key, p in whole.named_parameters():
            np.testing.assert_allclose(grads[key], p.grad.numpy(), rtol=0, atol=1e-12, err_msg=key)


def test_a_split_layer_holds_its_part_of_the_weights_only() -> None:
    mlp = _model("mlp")

    def rank(ctx: Any) -> list[int]:
        model = parallelize(copy.deepcopy(mlp), {"1": "column", "3": "row"}, ctx, Mesh(tensor=2))
        return [p.numel() for p in model.parameters()]

    whole = [p.numel() for p in _model("mlp").parameters()]
    sizes = run_ranks(2, rank)
    # layer 1 (64x512 + 512) halves; layer 3 (512x512) halves its weight, and its bias lives on part 0 only
    assert sizes[0] == [whole[0] // 2, whole[1] // 2, whole[2] // 2, whole[3], whole[4], whole[5]]
    assert sizes[1] == [whole[0] // 2, whole[1] // 2, whole[2] // 2, whole[4], whole[5]]


@pytest.mark.parametrize(
    ("model", "splits", "mesh", "message"),
    [
        ("odd", {"0": "column"}, Mesh(tensor=2), "its 9 outputs \\(features or channels\\) to divide by 2"),
        ("mlp", {"9": "row"}, Mesh(tensor=2), "no layer '9' to split"),
        (
            "mlp",
            {"2": "row"},
            Mesh(tensor=2),
            "layer 2 is a ReLU; only linear layers, 2-d convolutions, transformer blocks",
        ),
        ("mlp", {"1": "diagonal"}, Mesh(tensor=2), "unknown split 'diagonal'"),
        ("mlp", {"1": "column"}, Mesh(tensor=2, data=2), "needs 4 workers; the job has 2"),
        ("norm", {"0": "column"}, Mesh(tensor=2), "LayerNorm\\) mixes features but would read a sharded"),
    ],
)
def test_a_bad_configuration_is_refused_saying_what_to_change(
    model: str, splits: dict[str, str], mesh: Mesh, message: str
) -> None:
    chains = {
        "odd": nn.Sequential(nn.Linear(8, 9), nn.ReLU(), nn.Linear(9, 4)),
        "norm": nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)),
    }
    whole = chains[model] if model in chains else _model(model)

    def rank(ctx: Any) -> str:
        try:
            parallelize(copy.deepcopy(whole), splits, ctx, mesh)
        except SoapConfigError as exc:
            return str(exc)
        return "accepted"

    for refusal in run_ranks(2, rank):
        assert re.search(message, refusal), refusal


@pytest.mark.parametrize(
    ("rank1", "messages"),
    [
        ({"1": "row"}, ["given different configurations", "given different configurations"]),
        ({"2": "row"}, ["ranks [1] refused this configuration", "layer 2 is a ReLU"]),
    ],
)
def test_ranks_given_different_or_bad_configurations_all_fail_at_once(
    rank1: dict[str, str], messages: list[str]
) -> None:
    mlp = _model("mlp")

    def rank(ctx: Any) -> str:
        splits = {"1": "column"} if ctx.rank == 0 else rank1
        try:
            parallelize(copy.deepcopy(mlp), splits, ctx, Mesh(tensor=2))
        except SoapConfigError as exc:
            return str(exc)
        return "accepted"

    got = run_ranks(2, rank, timeout=30)
    assert all(want in message for want, message in zip(messages, got, strict=True)), got


def test_workers_that_do_not_form_tensor_groups_are_refused() -> None:
    with pytest.raises(SoapConfigError, match="tensor degree that divides"):
        Mesh.for_workers(6, tensor=4)


def _tiny_transformer() -> nn.Sequential:
    from paratrain.train.transformer import transformer

    torch.manual_seed(0)
    return transformer(vocab=12, context=8, width=16, heads=4, depth=3).double()


@pytest.mark.parametrize(
    ("splits", "tensor", "workers"),
    [
        ({"1": "heads", "2": "heads", "3": "heads"}, 2, 2),  # Megatron's transformer layers, 2-way
        ({"0": "vocab", "1": "heads", "4": "vocab"}, 2, 2),  # ... with the embedding and the head by vocabulary
        ({"0": "vocab", "2": "heads", "4": "vocab"}, 4, 4),
        ({"1": "sequence", "2": "heads", "3": "sequence"}, 2, 2),  # layer norms along the positions too
        ({"0": "vocab", "1": "sequence", "2": "sequence", "3": "sequence", "4": "vocab"}, 4, 4),
        ({"2": "sequence"}, 2, 4),
        ({"1": "heads", "3": "heads"}, 4, 4),  # one head per worker; block 2 whole
        ({"2": "heads"}, 2, 4),  # 2-way tensor x 2-way data
    ],
)
def test_transformer_blocks_split_by_heads_compute_what_one_process_computes(
    splits: dict[str, str], tensor: int, workers: int
) -> None:
    from paratrain.train import tasks

    whole = _tiny_transformer()
    rng = np.random.default_rng(2)
    tokens = torch.from_numpy(rng.integers(0, 12, size=(_STEPS, _BATCH, 8)))
    targets = torch.from_numpy(rng.integers(0, 12, size=(_STEPS, _BATCH, 8)))

    def train(model: Any, rows: Any, reduce: Any) -> tuple[Any, Any, Any]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        first = grads = None
        for step in range(_STEPS):
            out = model(tokens[step][rows])
            opt.zero_grad()
            tasks.loss(out, targets[step][rows]).backward()
            reduce(model)
            if step == 0:
                first = out.detach().numpy().copy()
                grads = _state(model, grads=True)
            opt.step()
        return first, grads, _state(model)

    def _state(model: Any, grads: bool = False) -> dict[str, np.ndarray]:
        if hasattr(model, "full_state"):
            return model.full_state(grads=grads)  # type: ignore[no-any-return]
        return {k: (p.grad if grads else p).detach().numpy().copy() for k, p in model.named_parameters()}

    def rank(ctx: Any) -> Any:
        model = parallelize(copy.deepcopy(whole), splits, ctx, Mesh.for_workers(ctx.world_size, tensor))
        rows = model.rows(_BATCH)
        return rows, model.plan_splits(), train(model, rows, lambda m: m.average_gradients())

    reference = train(copy.deepcopy(whole), slice(None), lambda m: None)
    for rows, applied, got in run_ranks(workers, rank, timeout=90):
        assert applied == splits
        _assert_as_one_process(reference, rows, got)


def test_a_split_block_holds_its_heads_only() -> None:
    whole = _tiny_transformer()

    def rank(ctx: Any) -> int:
        model = parallelize(copy.deepcopy(whole), {"1": "heads"}, ctx, Mesh(tensor=2))
        return sum(p.numel() for p in model.steps[1].parameters())

    block = sum(p.numel() for p in whole[1].parameters())
    d = 16
    ln, halved = 4 * d, 3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d  # layer norms; the split weights
    first, second = run_ranks(2, rank)
    assert first == ln + halved // 2 + 2 * d and second == ln + halved // 2  # the two output biases on part 0
    assert block == ln + halved + 2 * d


@pytest.mark.parametrize(
    ("splits", "tensor", "message"),
    [
        ({"1": "heads"}, 3, "needs its 4 heads (and its MLP's 64 width) to divide by 3"),
        ({"1": "column"}, 2, "layer 1 is a transformer block: split it 'heads'"),
        ({"0": "heads"}, 2, "layer 0 is an embedding or output head: split it 'vocab'"),
        ({"0": "vocab"}, 5, "a 5-way split by vocab needs its vocabulary of 12 to divide by 5"),
        ({"1": "vocab"}, 2, "layer 1 is a transformer block: split it 'heads'"),
        ({"1": "sequence"}, 3, "a 3-way split by sequence needs its 4 heads"),
        ({"5": "sequence"}, 2, "no layer '5' to split"),
    ],
)
def test_a_bad_block_configuration_is_refused(splits: dict[str, str], tensor: int, message: str) -> None:
    from paratrain.torch.soap import check_configuration

    with pytest.raises(SoapConfigError, match=re.escape(message)):
        check_configuration(_tiny_transformer(), splits, tensor)


def test_a_window_that_does_not_divide_along_the_sequence_is_refused_on_every_rank() -> None:
    whole = _tiny_transformer()

    def rank(ctx: Any) -> str:
        model = parallelize(copy.deepcopy(whole), {"1": "sequence"}, ctx, Mesh(tensor=2))
        try:
            model(torch.zeros(2, 7, dtype=torch.long))
        except ValueError as exc:
            return str(exc)
        return "accepted"

    assert (
        run_ranks(2, rank)
        == ["a block split by 2 along the sequence needs windows whose length divides by 2, got 7"] * 2
    )
