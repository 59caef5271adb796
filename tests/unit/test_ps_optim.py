"""Server-side optimizers against torch.optim step by step; specs round-trip through msgpack; validation."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.ps.optim import SGD, Adagrad, Adam, ServerOptimizer, make_optimizer

SPECS: list[dict[str, Any]] = [
    {"name": "sgd", "lr": 0.1},
    {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    {"name": "sgd", "lr": 0.1, "momentum": 0.5, "weight_decay": 0.1},
    {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True},
    {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    {"name": "sgd", "lr": 0.2, "weight_decay": 0.3},
    {"name": "adam"},
    {"name": "adam", "lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 1e-2},
    {"name": "adam", "lr": 0.1, "betas": [0.3, 0.5]},
    {"name": "adagrad"},
    {"name": "adagrad", "lr": 0.1, "initial_accumulator_value": 0.1, "eps": 1e-6, "weight_decay": 1e-2},
]
SHAPES = [(7, 5), (13,), ()]
STEPS = 20

# state names: ours -> torch's
STATE_NAMES = {
    "sgd": {"momentum_buffer": "momentum_buffer"},
    "adam": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}
STATE_NAMES["adagrad"] = {"sum": "sum"}


def _torch_optimizer(torch: Any, param: Any, spec: dict[str, Any]) -> Any:
    hyper = {k: v for k, v in spec.items() if k != "name"}
    if "betas" in hyper:
        hyper["betas"] = tuple(hyper["betas"])
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}[spec["name"]]
    return cls([param], foreach=False, **hyper)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_matches_torch_optim_step_by_step(
    spec: dict[str, Any], dtype: type[np.floating], shape: tuple[int, ...]
) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(sum(map(ord, repr((spec, shape)))))
    rtol, atol = (1e-12, 1e-14) if dtype == np.float64 else (1e-5, 1e-6)
    param = np.asarray(rng.standard_normal(shape), dtype=dtype)
    theirs = torch.tensor(param.copy(), requires_grad=True)
    torch_opt = _torch_optimizer(torch, theirs, spec)
    opt = make_optimizer(spec)
    assert opt is not None
    state = opt.init_state(param)
    for step in range(STEPS):
        grad = np.asarray(rng.standard_normal(shape) * (0.01 if step % 7 == 3 else 1.0), dtype=dtype)
        grad_before = grad.copy()
        opt.step(param, grad, state)
        assert np.array_equal(grad, grad_before), "the pushed gradient must not be modified"
        theirs.grad = torch.from_numpy(grad.copy())
        torch_opt.step()
        np.testing.assert_allclose(param, theirs.detach().numpy(), rtol=rtol, atol=atol, err_msg=f"step {step}")
    torch_state = torch_opt.state[theirs]
    for ours_name, torch_name in STATE_NAMES[spec["name"]].items():
        if ours_name in state:
            assert state[ours_name].dtype == dtype
            expected = torch_state[torch_name].numpy()
            np.testing.assert_allclose(state[ours_name], expected, rtol=rtol, atol=atol)
    if spec["name"] == "adam":
        assert state["step"].tolist() == [STEPS] == [int(torch_state["step"])]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_spec_round_trips_through_msgpack_with_identical_behaviour(spec: dict[str, Any]) -> None:
    opt = make_optimizer(spec)
    assert opt is not None
    wire = msgpack.unpackb(msgpack.packb(opt.spec()))
    again = make_optimizer(wire)
    assert again == opt and type(again) is type(opt)
    assert again.spec() == opt.spec()
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 3))
    b = a.copy()
    state_a, state_b = opt.init_state(a), again.init_state(b)
    for _ in range(5):
        g = rng.standard_normal((4, 3))
        opt.step(a, g, state_a)
        again.step(b, g, state_b)
    assert np.array_equal(a, b)


def test_specs_are_plain_data() -> None:
    assert SGD(lr=1).spec() == {"name": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False}
    assert Adam().spec() == {"name": "adam", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert Adagrad().spec() == {
        "name": "adagrad",
        "lr": 1e-2,
        "eps": 1e-10,
        "initial_accumulator_value": 0.0,
        "weight_decay": 0.0,
    }
    assert isinstance(SGD(lr=1).lr, float)  # ints are normalised, so equal settings compare equal
    assert SGD(lr=1) == SGD(lr=1.0)
    assert Adam(betas=[0.5, 0.6]).betas == (0.5, 0.6)  # type: ignore[arg-type]


def test_make_optimizer_accepts_none_names_dicts_and_instances() -> None:
    assert make_optimizer(None) is None
    adam = Adam(lr=0.5)
    assert make_optimizer(adam) is adam
    assert make_optimizer("adam") == Adam()
    assert make_optimizer("Adagrad") == Adagrad()
    assert make_optimizer({"name": "ADAM", "lr": 0.5}) == adam


def test_sgd_needs_a_learning_rate() -> None:
    with pytest.raises(ConfigError, match=r"sgd has no default for lr.*'lr': 0\.1"):
        make_optimizer("sgd")
    with pytest.raises(ConfigError, match="no default for lr"):
        make_optimizer({"name": "sgd", "momentum": 0.9})
    with pytest.raises(TypeError):
        SGD()  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("rmsprop", "choose one of sgd, adam, adagrad"),
        ({"lr": 0.1}, "unknown optimizer None"),
        ({"name": 3}, "unknown optimizer 3"),
        ({"name": "adam", "momentum": 0.9}, "unknown hyperparameter.*momentum.*valid: lr, betas, eps, weight_decay"),
        ({"name": "sgd", "lr": 0.1, "dampening": 0.1}, "valid: lr, momentum, weight_decay, nesterov"),
        ({"name": "sgd", "lr": -0.1}, "lr must be >= 0"),
        ({"name": "sgd", "lr": float("nan")}, "lr"),
        ({"name": "sgd", "lr": float("inf")}, "lr"),
        ({"name": "sgd", "lr": "0.1"}, "lr must be a number"),
        ({"name": "sgd", "lr": True}, "lr must be a number"),
        ({"name": "sgd", "lr": 0.1, "momentum": -0.9}, "momentum"),
        ({"name": "sgd", "lr": 0.1, "weight_decay": -1}, "weight_decay"),
        ({"name": "sgd", "lr": 0.1, "nesterov": True}, "nesterov=True needs momentum > 0"),
        ({"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": 1}, "nesterov must be True or False"),
        ({"name": "adam", "betas": [0.9]}, "pair"),
        ({"name": "adam", "betas": 0.9}, "pair"),
        ({"name": "adam", "betas": [0.9, 1.0]}, r"betas\[1\] must be in \[0.0, 1.0\)"),
        ({"name": "adam", "betas": [-0.1, 0.9]}, r"betas\[0\]"),
        ({"name": "adam", "eps": -1e-8}, "eps"),
        ({"name": "adagrad", "initial_accumulator_value": -1}, "initial_accumulator_value"),
        ({"name": "adagrad", "lr": -1}, "lr"),
    ],
)
def test_make_optimizer_refuses_bad_specs_saying_what_is_valid(spec: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_optimizer(spec)


def test_make_optimizer_refuses_other_types() -> None:
    with pytest.raises(TypeError, match="spec dict"):
        make_optimizer(3)  # type: ignore[arg-type]


def test_constructors_are_keyword_only_validated_and_frozen() -> None:
    with pytest.raises(TypeError):
        SGD(0.1)  # type: ignore[call-arg]
    with pytest.raises(ConfigError):
        Adam(lr=-1.0)
    opt = Adagrad()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("opt", [SGD(lr=0.1, momentum=0.9), Adam(), Adagrad()])
def test_step_checks_its_arrays(opt: ServerOptimizer) -> None:
    param = np.zeros(3)
    state = opt.init_state(param)
    with pytest.raises(TypeError, match="floating point"):
        opt.step(np.zeros(3, dtype=np.int64), np.zeros(3), state)
    with pytest.raises(TypeError, match="numpy array"):
        opt.step([0.0, 0.0, 0.0], np.zeros(3), state)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gradient must be floating point"):
        opt.step(param, np.zeros(3, dtype=np.int32), state)
    with pytest.raises(ValueError, match="shape"):
        opt.step(param, np.zeros(4), state)


@pytest.mark.parametrize("opt", [SGD(lr=0.1, momentum=0.9, weight_decay=0.1), Adam(lr=0.1), Adagrad(lr=0.1)])
def test_step_is_in_place_on_param_and_state(opt: ServerOptimizer) -> None:
    param = np.ones((3, 2), dtype=np.float32)
    view = param[:, 1]  # a non-contiguous view is a chunk of a bigger array
    state = opt.init_state(view)
    arrays = {k: id(v) for k, v in state.items()}
    opt.step(view, np.ones(3, dtype=np.float32), state)
    assert (param[:, 1] != 1).all() and (param[:, 0] == 1).all()
    assert {k: id(v) for k, v in state.items()} == arrays
    assert param.dtype == np.float32 and all(v.dtype in (np.float32, np.int64) for v in state.values())


# -- sparse rows ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_step_rows_updates_listed_rows_as_a_dense_step_on_them_and_nothing_else(spec: dict[str, Any]) -> None:
    opt = make_optimizer(spec)
    assert opt is not None
    rng = np.random.default_rng(11)
    param = rng.standard_normal((8, 3))
    state = opt.init_state(param)
    sub = param[[1, 4, 6]].copy()
    sub_state = opt.init_state(sub)
    for _ in range(4):
        before = param.copy()
        grads = rng.standard_normal((5, 3))
        rows = np.array([6, 1, 4, 6, 1])  # rows 1 and 6 twice: their gradients are summed
        opt.step_rows(param, grads, rows, state)
        coalesced = np.stack([grads[1] + grads[4], grads[2], grads[0] + grads[3]])  # rows 1, 4, 6
        opt.step(sub, coalesced, sub_state)
        np.testing.assert_allclose(param[[1, 4, 6]], sub, rtol=1e-15, atol=1e-15)
        untouched = [0, 2, 3, 5, 7]
        assert np.array_equal(param[untouched], before[untouched])
        for name, value in state.items():
            if name == "step":
                assert np.array_equal(value, sub_state["step"])
            else:
                assert (value[untouched] == opt.init_state(param)[name][untouched]).all()
                np.testing.assert_allclose(value[[1, 4, 6]], sub_state[name], rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("opt", [SGD(lr=0.1, momentum=0.9), Adam(), Adagrad()])
def test_step_rows_with_every_row_once_is_a_dense_step(opt: ServerOptimizer) -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal((6, 2)).astype(np.float32)
    b = a.copy()
    state_a, state_b = opt.init_state(a), opt.init_state(b)
    for _ in range(3):
        g = rng.standard_normal((6, 2)).astype(np.float32)
        opt.step(a, g, state_a)
        order = rng.permutation(6)
        opt.step_rows(b, g[order], order, state_b)
    assert np.array_equal(a, b)
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a)


def test_step_rows_checks_its_arguments() -> None:
    opt = Adam()
    param = np.zeros((4, 2))
    state = opt.init_state(param)
    opt.step_rows(param, np.zeros((0, 2)), np.array([], dtype=np.int64), state)
    assert state["step"].tolist() == [0]  # an empty push changes nothing
    with pytest.raises(IndexError, match=r"row id 4 is outside \[0, 4\)"):
        opt.step_rows(param, np.zeros((1, 2)), np.array([4]), state)
    with pytest.raises(IndexError, match="row id -1"):
        opt.step_rows(param, np.zeros((1, 2)), np.array([-1]), state)
    with pytest.raises(TypeError, match="integers"):
        opt.step_rows(param, np.zeros((1, 2)), np.array([1.0]), state)
    with pytest.raises(ValueError, match="does not fit"):
        opt.step_rows(param, np.zeros((2, 2)), np.array([1]), state)
    with pytest.raises(ValueError, match="does not fit"):
        opt.step_rows(param, np.zeros((1, 3)), np.array([1]), state)
    with pytest.raises(ValueError, match="ndim"):
        opt.step_rows(np.zeros(()), np.zeros((1,)), np.array([0]), opt.init_state(np.zeros(())))
