"""The 16-bit reducers: torch's kernels (the fast path) give numpy's values, bit for bit but for NaN payloads and
the sign of max/min(0, -0); a read-only received buffer is read, never written."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain.collectives.ops import Reducer, bf16_to_f32

pytest.importorskip("torch")


def _inputs(name: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name == "bfloat16":  # every bit pattern: normals, subnormals, infinities, NaNs
        return rng.integers(0, 1 << 16, 4099).astype(np.uint16), rng.integers(0, 1 << 16, 4099).astype(np.uint16)
    scale = rng.choice([1e-6, 1.0, 1e3, 6e4], size=(2, 4099))
    with np.errstate(over="ignore"):
        a, b = (rng.standard_normal((2, 4099)) * scale).astype(np.float16)
    a[:7], b[7:14], b[14:21] = np.nan, np.inf, -np.inf
    return a, b


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_torch_kernels_give_numpys_values(name: str, op: str) -> None:
    a, b = _inputs(name, 3)
    b.flags.writeable = False
    fast, slow = Reducer(op, name), Reducer(op, name)
    assert fast._torch is not None
    slow._torch = None  # the numpy path
    got, want = np.empty_like(a), np.empty_like(a)
    with np.errstate(all="ignore"):
        fast.combine(a, b, got)
        slow.combine(a, b, want)
        fast.finish(got, 3)
        slow.finish(want, 3)
    widen = bf16_to_f32 if name == "bfloat16" else (lambda x: x.astype(np.float32))
    g, w = widen(got), widen(want)
    assert np.array_equal(np.isnan(g), np.isnan(w))
    keep = ~np.isnan(g) & (g != 0)
    assert np.array_equal(got[keep].view(np.uint16), want[keep].view(np.uint16))
    assert np.array_equal(g[g == 0], w[g == 0])  # zeros equal as values (the sign of max(0, -0) may differ)


def test_the_result_may_be_written_over_the_first_input() -> None:
    a = np.array([1.5, -2.0, 3.0], dtype=np.float16)
    Reducer("sum", "float16").combine(a, np.array([0.5, 2.0, 1.0], dtype=np.float16), a)
    assert a.tolist() == [2.0, 0.0, 4.0]
