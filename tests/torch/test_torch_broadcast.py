"""broadcast_parameters: parameters and buffers of every dtype become the root's, in place."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.errors import CollectiveMismatchError  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def make_model(seed: int) -> Any:
    """float32 parameters, float32 and int64 buffers (BatchNorm), a float64 parameter."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)))
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.dtype.is_floating_point:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
            else:
                t.fill_(seed)
    return model


def snapshot(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("world_size", "root"), [(2, 0), (3, 2)])
@pytest.mark.parametrize("form", ["module", "state_dict", "tensors"])
def test_every_tensor_becomes_the_roots(world_size: int, root: int, form: str) -> None:
    def worker(ctx: Context) -> dict[str, Any]:
        model = make_model(seed=ctx.rank)
        weight = model[0].weight
        target = {"module": model, "state_dict": model.state_dict(), "tensors": list(model.state_dict().values())}
        ptt.broadcast_parameters(target[form], root=root, context=ctx)
        assert model[0].weight is weight  # in place: optimizers holding the parameters still see them
        return snapshot(model)

    results = run_ranks(world_size, worker)
    expected = snapshot(make_model(seed=root))
    assert expected["1.num_batches_tracked"].item() == root
    for result in results:
        assert result.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result[key], value), key


def test_one_message_per_dtype() -> None:
    def worker(ctx: Context) -> int:
        calls = []
        inner = ctx.broadcast

        def counting(x: Any, root: int = 0, **kw: Any) -> Any:
            calls.append(x.dtype)
            return inner(x, root, **kw)

        ctx.broadcast = counting  # type: ignore[method-assign]
        ptt.broadcast_parameters(make_model(seed=ctx.rank), context=ctx)
        return len(calls)

    assert run_ranks(2, worker) == [3, 3]  # float32, int64 (num_batches_tracked), float64


def test_different_models_fail_loudly_on_every_rank() -> None:
    def worker(ctx: Context) -> None:
        model = torch.nn.Linear(3, 2 + ctx.rank)
        ptt.broadcast_parameters(model, context=ctx)

    with pytest.raises(CollectiveMismatchError):
        run_ranks(2, worker)
