"""Compressors (pure numpy): what they send, and error feedback that loses nothing, only delays it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from paratrain.compression import BucketLayout, Cast, Compressor, LowRank, Message, TopK, parse_compression
from paratrain.errors import ConfigError


def test_parse_forms_and_errors() -> None:
    assert parse_compression(None) is None and parse_compression("none") is None
    fp16, bf16 = parse_compression("fp16"), parse_compression("BF16")
    assert isinstance(fp16, Cast) and fp16.dtype == "float16"
    assert isinstance(bf16, Cast) and bf16.dtype == "bfloat16"
    top = parse_compression("topk:0.01")
    assert isinstance(top, TopK) and top.ratio == 0.01 and not top.linear
    dgc = parse_compression("dgc:0.01")
    assert isinstance(dgc, TopK) and dgc.momentum_correction and dgc.spec == "dgc:0.01"
    assert not top.momentum_correction and top.spec == "topk:0.01"
    low = parse_compression("powersgd:4")
    assert isinstance(low, LowRank) and low.rank == 4 and low.linear
    for bad in ("zip", "topk:0", "topk:2", "powersgd:1.5", "powersgd:0", "topk"):
        with pytest.raises(ConfigError, match="compression"):
            parse_compression(bad)


def test_a_reducing_ring_refuses_top_k_and_says_why() -> None:
    top = TopK(ratio=0.1, name="topk:0.1")
    for algorithm in ("ring", "tree", "auto"):
        with pytest.raises(ConfigError, match=r"not linear.*allgather"):
            top.check_ring(algorithm)
    top.check_ring("allgather")
    Cast().check_ring("ring")
    LowRank().check_ring("ring")


def test_top_k_sends_the_largest_and_keeps_the_rest() -> None:
    top = TopK(ratio=0.25)
    grad = np.array([0.5, -4.0, 1.0, 3.0, -0.25, 2.0, 0.0, -1.5])
    idx, val = top.compress("b", grad)
    assert idx.dtype == np.int32 and idx.tolist() == [1, 3] and val.tolist() == [-4.0, 3.0]
    assert top.residual("b").tolist() == [0.5, 0.0, 1.0, 0.0, -0.25, 2.0, 0.0, -1.5]
    # next step: the residual is added first, so 2.0 (old) + 0.5 (new) wins a place, and so does the old 1.0
    # against the new 2.0 that the old -1.5 cancels down to 0.5
    idx, val = top.compress("b", np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 2.0]))
    assert idx.tolist() == [2, 5] and val.tolist() == [1.0, 2.5]
    assert top.k_of(0) == 0 and top.k_of(1) == 1 and top.k_of(9) == 3
    full = TopK(ratio=1.0)
    idx, val = full.compress("b", grad)
    assert idx.tolist() == list(range(8)) and val.tolist() == grad.tolist()
    assert not full.residual("b").any()


def test_top_k_error_feedback_loses_nothing() -> None:
    """Over any number of steps: everything sent + the residual left = every gradient given (float64, exact
    up to the rounding of the additions)."""
    rng = np.random.default_rng(0)
    top = TopK(ratio=0.05)
    given, sent = np.zeros(200), np.zeros(200)
    for _ in range(30):
        grad = rng.standard_normal(200)
        given += grad
        idx, val = top.compress("b", grad)
        sent += TopK.decompress(200, idx, val, scale=1.0, dtype=np.dtype(np.float64))
    np.testing.assert_allclose(sent + top.residual("b"), given, rtol=0, atol=1e-12)


def test_dgc_accumulates_the_velocity_and_masks_what_it_sent() -> None:
    """DGC by hand (Lin et al. 2018, Algorithm 1 with momentum-factor masking), float64, 12 steps: u <- m u + g,
    v <- v + u, send top-k of v, zero u and v there. Without momentum it is plain top-k."""
    rng = np.random.default_rng(1)
    dgc, m = TopK(ratio=0.1, momentum_correction=True), 0.9
    u, v = np.zeros(50), np.zeros(50)
    for _ in range(12):
        grad = rng.standard_normal(50)
        u = m * u + grad
        v = v + u
        want = np.sort(np.argsort(-np.abs(v), kind="stable")[:5])
        idx, val = dgc.compress("b", grad, momentum=m)
        assert idx.tolist() == want.tolist()
        np.testing.assert_allclose(val, v[want], rtol=0, atol=1e-12)
        u[want] = 0
        v[want] = 0
        np.testing.assert_allclose(dgc.velocity("b"), u, rtol=0, atol=1e-12)
        np.testing.assert_allclose(dgc.residual("b"), v, rtol=0, atol=1e-12)
    plain, corrected = TopK(ratio=0.1), TopK(ratio=0.1, momentum_correction=True)
    for _ in range(3):
        grad = rng.standard_normal(50)
        a, b = plain.compress("b", grad), corrected.compress("b", grad, momentum=0.0)
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


def test_low_rank_residual_is_what_the_approximation_missed() -> None:
    rng = np.random.default_rng(1)
    low = LowRank(rank=2, seed=3)
    m = rng.standard_normal((12, 9))
    total_given, total_sent = np.zeros_like(m), np.zeros_like(m)
    for _ in range(5):
        grad = rng.standard_normal((12, 9))
        before = low.residual("b", 0).copy() if "b" in low._state else np.zeros_like(m)
        (p,) = low.first("b", [grad])
        (q,) = low.second("b", [LowRank.orthonormal(p)])
        (approx,) = low.finish("b", [q])
        # e_new = (g + e_old) - approx, exactly as computed
        np.testing.assert_allclose(low.residual("b", 0), grad + before - approx, rtol=0, atol=1e-12)
        total_given += grad
        total_sent += approx
    np.testing.assert_allclose(total_sent + low.residual("b", 0), total_given, rtol=0, atol=1e-10)


def test_low_rank_of_full_rank_is_exact_and_the_rule_for_what_is_compressed() -> None:
    rng = np.random.default_rng(2)
    low = LowRank(rank=6, seed=0)
    m = rng.standard_normal((6, 4))
    (p,) = low.first("b", [m])
    (q,) = low.second("b", [LowRank.orthonormal(p)])
    (approx,) = low.finish("b", [q])
    np.testing.assert_allclose(approx, m, atol=1e-12)
    rank4 = LowRank(rank=4)
    assert rank4.compressible((512, 784)) and rank4.compressible((64, 3, 5, 5))
    assert not rank4.compressible((512,)) and not rank4.compressible((8, 8))  # (8 + 8) 4 = 64, not < 64
    assert rank4.compressible((10, 8))  # (10 + 8) 4 = 72 < 80


#: buckets of parameters: a vector, a matrix, a layer with bias, a convolution with others
BUCKETS = [[(7,)], [(12, 9)], [(12, 9), (12,)], [(6, 3, 4, 4), (5,), (8, 8)]]


def _layout(shapes: list[tuple[int, ...]], dtype: Any, flags: int = 0) -> BucketLayout:
    sizes = [math.prod(shape) for shape in shapes]
    offsets = tuple(sum(sizes[:j]) for j in range(len(sizes)))
    names = tuple(f"p{j}" for j in range(len(shapes)))
    return BucketLayout(names, offsets, tuple(shapes), sum(sizes) + flags, np.dtype(dtype).name)


def _aggregate(messages: list[Message]) -> Any:
    """What the workers' collective gives back: the sum or mean of their arrays, or all of them gathered."""
    arrays = [m.array for m in messages]
    if messages[0].op == "gather":
        return np.concatenate(arrays)
    total = arrays[0].copy()
    for array in arrays[1:]:
        total += array
    return total / len(arrays) if messages[0].op == "mean" else total


def _step(comps: list[Compressor], key: str, buffers: list[Any], numel: int) -> tuple[list[Any], list[int]]:
    """One step of every worker through the interface; each worker's decoded buffer and the bytes of each round."""
    workers = len(comps)
    messages: list[Message | None] = [
        c.encode(key, b, numel=numel, workers=workers, momentum=0.9 if c.moves_momentum else 0.0)
        for c, b in zip(comps, buffers, strict=True)
    ]
    sent = []
    for _ in range(1, comps[0].aggregation_rounds):
        if messages[0] is None:
            break
        sent.append(messages[0].array.nbytes)
        reduced = _aggregate([m for m in messages if m is not None])
        messages = [c.next_round(key, reduced) for c in comps]
    last = None
    if messages[0] is not None:
        sent.append(messages[0].array.nbytes)
        last = _aggregate([m for m in messages if m is not None])
    decoded = [c.decode(key, last, b, numel=numel, workers=workers) for c, b in zip(comps, buffers, strict=True)]
    return decoded, sent


@pytest.mark.parametrize("name", ["fp16", "topk:0.1", "dgc:0.1", "topk:1", "powersgd:2", "powersgd:1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_wire_bytes_is_what_encode_sends(name: str, dtype: Any) -> None:
    """Every round of one worker's step, and its push to the servers, weigh what wire_bytes says (the cost
    model's numbers), for buckets with and without compressible matrices."""
    rng = np.random.default_rng(0)
    itemsize = np.dtype(dtype).itemsize
    for shapes in BUCKETS:
        comp = parse_compression(name)
        assert comp is not None
        numel = sum(math.prod(shape) for shape in shapes)
        comp.prepare("b", _layout(shapes, dtype))
        for _ in range(2):  # the second step starts from the error feedback of the first
            buffer = rng.standard_normal(numel).astype(dtype)
            _, sent = _step([comp], "b", [buffer], numel)
            assert sum(sent) == comp.wire_bytes(numel, itemsize, shapes=shapes) > 0
            assert len(sent) == comp.rounds_of(shapes) <= comp.aggregation_rounds
        if comp.aggregation_rounds > 1:
            with pytest.raises(ValueError, match="parameter servers"):
                comp.wire_bytes(numel, itemsize, push=True)
            with pytest.raises(ConfigError, match="aggregation rounds"):
                comp.encode_push("push", buffer)
        else:
            push = comp.encode_push("push", rng.standard_normal(numel).astype(dtype))
            pushed = push.values.nbytes + (0 if push.indices is None else push.indices.nbytes)
            assert pushed == comp.wire_bytes(numel, itemsize, push=True) > 0
    with pytest.raises(ValueError, match="do not hold 10 items"):
        comp.wire_bytes(10, 4, shapes=[(3, 3)])


def test_rounds_and_momentum_of_each_scheme() -> None:
    """What the strategies' checks read: PowerSGD aggregates twice (once for a bucket of vectors), only DGC keeps
    the momentum on the workers."""
    schemes = {name: parse_compression(name) for name in ("fp16", "bf16", "topk:0.1", "dgc:0.1", "powersgd:4")}
    assert {n: c.aggregation_rounds for n, c in schemes.items() if c} == {
        "fp16": 1,
        "bf16": 1,
        "topk:0.1": 1,
        "dgc:0.1": 1,
        "powersgd:4": 2,
    }
    assert [n for n, c in schemes.items() if c and c.moves_momentum] == ["dgc:0.1"]
    low = LowRank(rank=4)
    assert low.rounds_of([(512, 784), (512,)]) == 2 and low.rounds_of([(512,), (8, 8)]) == 1
    with pytest.raises(RuntimeError, match="aggregates once"):
        Cast().next_round("b", np.zeros(3))
    with pytest.raises(RuntimeError, match="prepare"):
        low.encode("b", np.zeros(4), numel=4, workers=1)
    with pytest.raises(ConfigError, match=r"float32 or float64 gradients, not float16 \(parameters p0, p1\)"):
        TopK().prepare("b", _layout([(3, 2), (3,)], np.float16))


def test_a_step_through_the_interface_decodes_the_mean() -> None:
    """Three workers (their collectives done here by numpy): the 16-bit cast and top-k of everything give the
    mean, PowerSGD recovers a rank-1 matrix all workers share and averages the vectors exactly; the used-flags ride
    with the linear schemes (worker 0 did not use the last parameter) and top-k, which sends none, sets them all;
    every worker decodes the same bits."""
    rng = np.random.default_rng(4)
    shapes = [(10, 6), (10,), (4,)]
    numel, flags = 74, 3
    rank1 = np.outer(rng.standard_normal(10), rng.standard_normal(6)).reshape(-1)
    grads = [np.concatenate([rank1, rng.standard_normal(14)]) for _ in range(3)]
    mean = sum(grads) / 3
    for name, tolerance in (("fp16", 2e-2), ("topk:1", 1e-6), ("powersgd:1", 1e-5)):
        comps = [parse_compression(name) for _ in range(3)]
        buffers = [np.concatenate([g, [1, 1, w != 0]]).astype(np.float32) for w, g in enumerate(grads)]
        for c in comps:
            assert c is not None
            c.prepare("b", _layout(shapes, np.float32, flags))
        decoded, _ = _step([c for c in comps if c], "b", buffers, numel)
        for got in decoded:
            assert got.dtype == np.float32 and got.shape == (numel + flags,)
            np.testing.assert_allclose(got[:numel], mean, rtol=tolerance, atol=tolerance)
            np.testing.assert_allclose(got[numel:], [1, 1, 1 if name == "topk:1" else 2 / 3], rtol=1e-3)
            assert got.tobytes() == decoded[0].tobytes()
        if name == "powersgd:1":
            vectors = [g[60:].astype(np.float32) for g in grads]
            np.testing.assert_array_equal(decoded[0][60:numel], (vectors[0] + vectors[1] + vectors[2]) / 3)
