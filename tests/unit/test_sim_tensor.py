"""The simulator's step of split layers (tp:N, soap:FILE): the plan the runtime executes (the same moves, the
same Megatron pairs as the runtime applies to the model), lowered to collectives over the right groups; measured
part times and call costs used where the profile has them; the planner offers tp:N beside whole-model strategies."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from paratrain.sim.machine import LayerCost, LinkCost, MachineProfile, ModelProfile
from paratrain.sim.predict import alpha_beta_step, predict
from paratrain.sim.search import candidates, search
from paratrain.sim.tensor import TensorJob, profile_splits, tensor_step
from paratrain.soap import Mesh, Move, SoapConfig, plan_chain


def _fc(name: str, at: int, n: int, m: int, *, split_s: dict[str, tuple[float, float]] | None = None) -> LayerCost:
    return LayerCost(name, 0.002 * m / 512, 0.004 * m / 512, (f"{name}.weight", f"{name}.bias"), (4 * n * m, 4 * m),
                     4 * 64 * m, m, n, at, split_s=split_s or {})  # fmt: skip


def _mlp(**extra: object) -> ModelProfile:
    """The digits mlp as ``paratrain profile`` records it: Flatten, 1, ReLU, 3, ReLU, 5."""
    layers = (_fc("1", 1, 64, 512), _fc("3", 3, 512, 512), _fc("5", 5, 512, 10))
    return ModelProfile("mlp", 64, layers, optimizer_s=0.001, concurrency=4, modules=6, input_bytes=4 * 64 * 64,
                        **extra)  # type: ignore[arg-type]  # fmt: skip


def _machine(model: ModelProfile) -> MachineProfile:
    paths = {"ipc": LinkCost(300e-6, 0.3e-9), "shm": LinkCost(10e-6, 0.1e-9), "tcp": LinkCost(350e-6, 3e-9)}
    return MachineProfile("test", paths, gamma=1e-10, copy=5e-11).with_model(model)


def test_the_profile_gets_the_pairs_the_runtime_gives_the_model() -> None:
    torch = pytest.importorskip("torch")
    from paratrain.torch.soap import splits_of
    from paratrain.train.models import build_model

    for name in ("mlp", "lenet", "cnn", "deepmlp"):
        model = build_model(name, side=28, classes=10)
        steps = list(model)
        layers = tuple(
            LayerCost(str(i), 0.001, 0.002, (f"{i}.weight",), (4,), 4,
                      m.out_features if isinstance(m, torch.nn.Linear) else 0,
                      m.in_features if isinstance(m, torch.nn.Linear) else 0, i,
                      (m.in_channels, m.out_channels) if isinstance(m, torch.nn.Conv2d) else (0, 0))
            for i, m in enumerate(steps) if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)
        )  # fmt: skip
        profile = ModelProfile(name, 64, layers, modules=len(steps))
        for tensor in (2, 4):
            assert profile_splits(profile, SoapConfig(tensor)) == splits_of(model, SoapConfig(tensor)), (name, tensor)


def _collectives(plan_ranks: tuple[object, ...]) -> int:
    labels = Counter(a.label for a in plan_ranks if a.label == "collective done")  # type: ignore[attr-defined]
    return labels["collective done"]


@pytest.mark.parametrize(
    ("splits", "tensor", "data"),
    [({"1": "column", "3": "row"}, 2, 1), ({"1": "column", "3": "row"}, 2, 2), ({"1": "column", "3": "column"}, 4, 1),
     ({"3": "row"}, 2, 2), ({}, 1, 4)],
)  # fmt: skip
def test_the_step_runs_the_chains_moves_over_each_tensor_group_and_one_average_over_each_data_group(
    splits: dict[str, str], tensor: int, data: int
) -> None:
    model = _mlp()
    job = TensorJob(model, Mesh(tensor, data), splits, batch_size=64)
    plan = tensor_step(job)
    plan.validate()
    _, chain = job.chain()
    moves = chain.messages() if tensor > 1 else 0
    for worker in range(tensor * data):
        assert _collectives(plan.ranks[worker]) == moves + (data > 1)
        peers = {a.peer for a in plan.ranks[worker] if a.kind in ("send", "recv")}
        assert peers <= set(Mesh(tensor, data).tensor_group(worker)) | set(Mesh(tensor, data).data_group(worker))
    # Megatron's pair only allreduces; a column-column chain allgathers forward and reduce-scatters backward
    kinds = {m.value for m in [*chain.forward, *chain.backward]} - {"none", "slice"}
    pair, columns = splits == {"1": "column", "3": "row"}, splits == {"1": "column", "3": "column"}
    assert chain == plan_chain(chain.ops)
    if pair:
        assert kinds == {"allreduce"}
    if columns:
        assert kinds >= {"allgather", "reduce_scatter"}


def test_measured_part_times_and_the_call_cost_are_used() -> None:
    halves = {"column/2": (0.0009, 0.0018), "row/2": (0.0011, 0.0022)}
    plain = _mlp()
    layers = (plain.layers[0], _fc("3", 3, 512, 512, split_s=halves), plain.layers[2])
    measured = dataclasses.replace(plain, layers=layers, call_s=50e-6)
    splits = {"1": "column", "3": "row"}
    guessed = TensorJob(plain, Mesh(2), splits, 64).events(0)
    timed = TensorJob(measured, Mesh(2), splits, 64).events(0)
    seconds = {e.label: e.seconds for e in timed}
    assert seconds["F 3"] == 0.0011 and seconds["B 3"] == 0.0022  # the row part, as measured
    assert {e.label: e.seconds for e in guessed}["F 3"] == pytest.approx(0.002 / 2)  # not measured: 1/N
    calls = [a for a in tensor_step(TensorJob(measured, Mesh(2), splits, 64)).ranks[0] if a.label.endswith("the call")]
    assert len(calls) == 2 and all(a.seconds == 50e-6 for a in calls)  # the pair's allreduce, forward and backward


def test_predict_and_the_formula_take_tp_and_the_planner_offers_it() -> None:
    model = _mlp()
    machine = _machine(model)
    tp = predict(machine, "mlp", workers=4, strategy="tp:2")
    assert tp.settings == {"splits": "1=column,3=row"} and tp.step_s > 0
    assert alpha_beta_step(machine, model, workers=4, strategy="tp:2") > 0
    offered = [c for c in candidates(model, workers=4, batch_size=64) if c.spec.splits_layers]
    assert [(c.strategy, c.batch_size) for c in offered] == [("tp:2", 128), ("tp:4", 256)]
    assert offered[0].train_flags() == ["--strategy", "tp:2", "--batch-size", "128"]
    assert not [c for c in candidates(model, workers=3, batch_size=64) if c.spec.splits_layers]
    ranked = search(machine, model, workers=4, batch_size=64, space=offered)
    assert {s.candidate.strategy for s in ranked} == {"tp:2", "tp:4"}


def test_the_profile_times_each_split_part_of_the_layers_of_a_chain_and_skips_blocks() -> None:
    torch = pytest.importorskip("torch")
    from paratrain.bench.profile_splits import split_ratios
    from paratrain.train.models import build_model
    from paratrain.train.transformer import transformer

    torch.manual_seed(0)
    mlp = build_model("mlp", side=8, classes=10)
    ratios = split_ratios(mlp, torch.rand(64, 1, 8, 8), repeats=3)
    assert set(ratios) == {"1", "3", "5"}
    assert set(ratios["3"]) == {"column/2", "row/2", "column/4", "row/4"} and set(ratios["5"]) == {
        "column/2",
        "row/2",
        "row/4",
    }
    assert all(f > 0 and b > 0 for layer in ratios.values() for f, b in layer.values())
    blocks = split_ratios(transformer(vocab=12, context=8, width=16, heads=4, depth=1), torch.zeros(2, 8).long(), 3)
    assert blocks == {}  # blocks, the embedding and the head split inside themselves, with their group


def _transformer_profile() -> ModelProfile:
    """An embedding, two blocks of 4 heads (width 16) and a head, as ``paratrain profile`` places them."""
    d, batch, ctx = 16, 8, 8
    act = 4 * batch * ctx * d

    def part(block: int, name: str, n: int, m: int) -> LayerCost:
        sizes = (4 * n * m, 4 * m) if not name.startswith("ln") else (4 * d, 4 * d)
        return LayerCost(f"{block}.{name}", 1e-4, 2e-4, (f"{block}.{name}.weight", f"{block}.{name}.bias"), sizes,
                         4 * batch * ctx * m, m if not name.startswith("ln") else 0, n, block, heads=4)  # fmt: skip

    blocks = [
        part(b, name, n, m)
        for b in (1, 2)
        for name, n, m in (("ln1", d, d), ("qkv", d, 3 * d), ("proj", d, d), ("ln2", d, d), ("fc1", d, 4 * d),
                           ("fc2", 4 * d, d))
    ]  # fmt: skip
    embed = LayerCost("0", 1e-4, 1e-4, ("0.position",), (4 * ctx * d,), act, module=0)
    head = LayerCost("3.out", 1e-4, 2e-4, ("3.out.weight",), (4 * d * 12,), 4 * batch * ctx * 12, 12, d, 3)
    return ModelProfile("transformer", batch, (embed, *blocks, head), optimizer_s=1e-3, modules=4, input_bytes=512)


def test_a_transformer_block_split_by_heads_moves_its_output_twice_each_way() -> None:
    model = _transformer_profile()
    assert profile_splits(model, SoapConfig(2)) == {"1": "heads", "2": "heads"}
    assert profile_splits(model, SoapConfig(8)) == {}  # 4 heads do not split 8 ways
    job = TensorJob(model, Mesh(2), {"1": "heads"}, batch_size=8)
    events = job.events(0)
    labels = [e.label for e in events if e.move is not Move.NONE and not e.data_group]
    assert labels == ["g 1.proj", "g 1.fc2", "f 1.ln2", "f 1.ln1"]  # block 2 whole: no moves
    assert {e.items for e in events if e.label.startswith(("g", "f"))} == {8 * 8 * 16}
    seconds = {e.label: e.seconds for e in events}
    assert seconds["F 1.qkv"] == pytest.approx(0.5e-4) and seconds["F 1.ln1"] == 1e-4 and seconds["F 2.qkv"] == 1e-4
    plan = tensor_step(job)
    plan.validate()
    assert _collectives(plan.ranks[0]) == 4
    items = {la.name: [n // 4 for n in la.param_bytes] for la in model.layers}
    whole = sum(sum(sizes) for sizes in items.values())
    split = sum(items["1.qkv"]) + sum(items["1.fc1"]) + items["1.proj"][0] + items["1.fc2"][0]
    assert job.held_items(1) == whole - split // 2 - 2 * 16


def test_a_block_split_along_the_sequence_gathers_and_scatters_instead_of_allreducing() -> None:
    model = _transformer_profile()
    job = TensorJob(model, Mesh(2), {"1": "sequence"}, batch_size=8)
    events = job.events(0)
    moves = [(e.label, e.move.value) for e in events if e.move is not Move.NONE and not e.data_group]
    assert moves == [
        ("f 1.ln1", "allgather"), ("g 1.proj", "reduce_scatter"), ("f 1.ln2", "allgather"),
        ("g 1.fc2", "reduce_scatter"), ("gather 1", "allgather"),  # forward
        ("g 1.fc2", "allgather"), ("f 1.ln2", "reduce_scatter"), ("g 1.proj", "allgather"),
        ("f 1.ln1", "reduce_scatter"), ("gather 1 (backward)", "allgather"),  # backward
        ("sum the layer norms' gradients", "allreduce"),
    ]  # fmt: skip
    seconds = {e.label: e.seconds for e in events}
    assert seconds["F 1.ln1"] == pytest.approx(0.5e-4)  # the layer norm on half the positions
    plan = tensor_step(job)
    plan.validate()
    assert _collectives(plan.ranks[0]) == len(moves)


def test_consecutive_blocks_split_along_the_sequence_pass_their_shards_on() -> None:
    job = TensorJob(_transformer_profile(), Mesh(2), {"1": "sequence", "2": "sequence"}, batch_size=8)
    gathers = [e.label for e in job.events(0) if e.label.startswith("gather")]
    assert gathers == ["gather 2", "gather 1 (backward)"]  # out of the last block, and into the first's input
    tensor_step(job).validate()


def test_the_runtime_passes_shards_between_consecutive_sequence_blocks() -> None:
    pytest.importorskip("torch")
    from paratrain.testing import run_ranks
    from paratrain.torch.soap import parallelize
    from paratrain.train.transformer import transformer

    model = transformer(vocab=12, context=8, width=16, heads=4, depth=3)

    def rank(ctx: object) -> list[tuple[bool, bool]]:
        split = parallelize(model, {"1": "sequence", "2": "sequence", "3": "heads"}, ctx, Mesh(2))  # type: ignore[arg-type]
        return [(step.sharded_in, step.sharded_out) for step in list(split.steps)[1:4]]

    assert run_ranks(2, rank) == [[(False, True), (True, False), (False, False)]] * 2


def test_one_tensor_group_with_its_data_ring_replayed_apart_stands_for_the_whole_job() -> None:
    from paratrain.sim.replay import Network, replay
    from paratrain.sim.tensor import data_average_s

    link = LinkCost(20e-6, 1 / 10e9)  # a described cluster's link: every pair alike
    network = Network.uniform(link)
    for splits, tensor, data in (({"1": "column", "3": "row"}, 2, 8), ({"1": "column"}, 4, 4)):
        job = TensorJob(_mlp(), Mesh(tensor, data), splits, batch_size=64)
        whole = replay(tensor_step(job), network)
        reduced = replay(tensor_step(job, data_s=data_average_s(job, link)), network)
        assert len(reduced.finish) == tensor
        assert max(reduced.finish) == pytest.approx(max(whole.finish), rel=0.05), (splits, tensor, data)


def test_predict_replays_one_group_of_a_large_job_in_a_fraction_of_a_second() -> None:
    import time

    model = dataclasses.replace(_mlp(), concurrency=1024)
    paths = {"ipc": LinkCost(300e-6, 0.3e-9), "tcp": LinkCost(20e-6, 1 / 10e9)}
    machine = MachineProfile("cluster", paths).with_model(model)
    started = time.perf_counter()
    big = predict(machine, model, workers=1024, strategy="tp:4", hosts=128)
    assert time.perf_counter() - started < 5 and len(big.replay.finish) == 4
    assert big.step_s > predict(machine, model, workers=4, strategy="tp:4", hosts=1).step_s  # the 256-way average
