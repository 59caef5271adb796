"""paratrain.soap's pure plans against exact tables: the move between two layouts, the layouts and moves of a chain
of split layers (forward and backward), the worker grid, and the configuration checks."""

from __future__ import annotations

import pytest

from paratrain.soap import LayerShape, Layout, Mesh, Move, OpSpec, SoapConfigError, check_splits, move, plan_chain

R, S, P = Layout.REPLICATED, Layout.SHARDED, Layout.PARTIAL
N, AG, AR, RS, SL = Move.NONE, Move.ALLGATHER, Move.ALLREDUCE, Move.REDUCE_SCATTER, Move.SLICE


def test_the_move_table() -> None:
    assert {(a, b): move(a, b) for a in Layout for b in (R, S)} == {
        (R, R): N, (R, S): SL, (S, R): AG, (S, S): N, (P, R): AR, (P, S): RS,
    }  # fmt: skip
    for src in Layout:
        with pytest.raises(ValueError, match="no layer reads a partial"):
            move(src, P)


def _chain(*splits: str | None) -> list[OpSpec]:
    return [OpSpec(str(i), s) for i, s in enumerate(splits)]


@pytest.mark.parametrize(
    ("splits", "layouts", "forward", "backward", "messages"),
    [
        # Megatron's MLP: g (allreduce forward) at the end; the column layer's partial input gradient is not needed
        (["column", None, "row"], [R, S, S], [N, N, N, AR], [N, N, N, N], 1),
        # after a replicated layer, Megatron's f: the column layer's partial input gradient is allreduced
        (["replicated", None, "column", None, "row"], [R, R, R, S, S], [N, N, N, N, N, AR], [N, N, AR, N, N, N], 2),
        # two column layers: the shards are gathered forward, the partial gradient reduce-scattered backward
        (["column", None, "column"], [R, S, R], [N, N, AG, AG], [N, N, RS, SL], 3),
        # two row layers: the partial sum is reduce-scattered before the ReLU (the next reads shards)
        (["row", None, "row"], [S, S, S], [SL, RS, N, AR], [N, AG, N, N], 3),
        # a partial sum before a ReLU that ends the chain is made whole
        (["row", None], [S, R], [SL, AR, N], [N, N, N], 1),
        (["replicated", None, "replicated"], [R, R, R], [N, N, N, N], [N, N, N, N], 0),
        # a leading element-wise step (Flatten) reads the replicated input
        ([None, "row", None, "column"], [R, S, R, R], [N, SL, AR, N, AG], [N, AG, N, AR, SL], 4),
    ],
)
def test_the_chain_plans(
    splits: list[str | None], layouts: list[Layout], forward: list[Move], backward: list[Move], messages: int
) -> None:
    plan = plan_chain(_chain(*splits))
    assert (list(plan.layouts), list(plan.forward), list(plan.backward)) == (layouts, forward, backward)
    assert plan.messages() == messages


def test_an_unknown_split_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown split 'diagonal'"):
        plan_chain(_chain("diagonal"))


def test_the_grid() -> None:
    mesh = Mesh.for_workers(6, tensor=3)
    assert (mesh.tensor, mesh.data, mesh.workers) == (3, 2, 6)
    assert [mesh.coordinates(w) for w in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert [mesh.tensor_group(w) for w in (0, 4)] == [[0, 1, 2], [3, 4, 5]]
    assert [mesh.data_group(w) for w in (0, 4)] == [[0, 3], [1, 4]]
    with pytest.raises(ValueError, match="not on a 3 x 2 grid"):
        mesh.coordinates(6)
    with pytest.raises(SoapConfigError, match="at least 1"):
        Mesh(tensor=0)


def test_check_splits_says_what_to_change() -> None:
    layers = {"1": LayerShape(64, 512), "3": LayerShape(512, 10)}
    check_splits(layers, {"1": "column", "3": "row"}, 2)
    check_splits(layers, {"3": "replicated"}, 3)  # a replicated layer splits nothing
    with pytest.raises(SoapConfigError, match=r"its 10 outputs \(features or channels\) to divide by 4"):
        check_splits(layers, {"3": "column"}, 4)
    with pytest.raises(SoapConfigError, match=r"its 512 inputs \(features or channels\) to divide by 3"):
        check_splits(layers, {"3": "row"}, 3)
    with pytest.raises(SoapConfigError, match=r"no layer '2' to split \(the layers that split: 1, 3\)"):
        check_splits(layers, {"2": "row"}, 2)
