"""The SFB cost model: exact byte counts per scheme (the formulas of paratrain.sfb.cost) and the per-layer choice."""

from __future__ import annotations

import pytest

from paratrain.sfb import LayerShape, choose_schemes, scheme_traffic

FC = LayerShape.linear("fc", 2048, 784)  # 1,607,680 parameters, float32
OUT = LayerShape.linear("out", 10, 2048)  # 20,490
CONV = LayerShape("conv", 2416)


@pytest.mark.parametrize(
    ("scheme", "kwargs", "sent", "received", "server"),
    [
        ("allreduce", {}, 1.5 * 1_607_680 * 4, 1.5 * 1_607_680 * 4, 0),
        ("allreduce", {"algorithm": "direct"}, 3 * 1_607_680 * 4, 3 * 1_607_680 * 4, 0),
        ("ps", {"servers": 1}, 1_607_680 * 4, 1_607_680 * 4, 4 * 1_607_680 * 4),
        ("ps", {"servers": 2}, 1_607_680 * 4, 1_607_680 * 4, 2 * 1_607_680 * 4),
        ("sfb", {"batch": 64}, 3 * 64 * (2048 + 784) * 4, 3 * 64 * (2048 + 784) * 4, 0),
        ("allreduce", {"compression": "fp16"}, 1.5 * 1_607_680 * 2, 1.5 * 1_607_680 * 2, 0),
        ("allreduce", {"compression": "topk:0.01"}, 3 * 16_077 * 8, 3 * 16_077 * 8, 0),
        ("allreduce", {"compression": "powersgd:4"}, 1.5 * (4 * 2832 + 2048) * 4, 1.5 * (4 * 2832 + 2048) * 4, 0),
        ("ps", {"servers": 1, "compression": "fp16"}, 1_607_680 * 2, 1_607_680 * 4, 4 * 1_607_680 * 4),
        ("ps", {"servers": 1, "compression": "topk:0.01"}, 16_077 * 12, 1_607_680 * 4, 4 * 1_607_680 * 4),
    ],
)
def test_bytes_per_worker_and_step(
    scheme: str, kwargs: dict[str, object], sent: float, received: float, server: float
) -> None:
    t = scheme_traffic(FC, scheme, workers=4, **kwargs)  # type: ignore[arg-type]
    assert (t.worker_sent, t.worker_received, t.server_sent) == (sent, received, server)


def test_what_cannot_be_counted_is_refused() -> None:
    with pytest.raises(ValueError, match="not fully connected"):
        scheme_traffic(CONV, "sfb", workers=4, batch=8)
    with pytest.raises(ValueError, match="servers >= 1"):
        scheme_traffic(FC, "ps", workers=4)
    with pytest.raises(ValueError, match="parameter servers"):
        scheme_traffic(FC, "ps", workers=4, servers=1, compression="powersgd:2")
    with pytest.raises(ValueError, match="1607680 parameters, not 5"):
        LayerShape("x", 5, 2048, 784, bias=True)


def test_choice_per_layer_busiest_link_and_overrides() -> None:
    layers = [FC, OUT, CONV]
    # one server carries every worker's push: SFB wins the wide layer, the server keeps the narrow output
    plan = choose_schemes(layers, workers=4, batch=64, servers=1)
    assert [c.scheme for c in plan.choices] == ["sfb", "ps", "ps"]
    assert plan.sfb_layers == ("fc",)
    assert plan.worker_bytes() == (3 * 64 * 2832 * 4 + 20_490 * 4 + 2416 * 4,) * 2
    # a batch so large that the factors outweigh the matrix: the servers keep it
    assert choose_schemes([FC], workers=4, batch=2048, servers=4).choices[0].scheme == "ps"
    # a user's override wins and is marked
    forced = choose_schemes(layers, workers=4, batch=64, servers=1, overrides={"fc": "dense", "out": "sfb"})
    assert [(c.scheme, c.forced) for c in forced.choices] == [("ps", True), ("sfb", True), ("ps", False)]
    with pytest.raises(ValueError, match="no layer named 'nope'"):
        choose_schemes(layers, workers=4, batch=64, servers=1, overrides={"nope": "sfb"})
    # PowerSGD on the dense side: rank 4 beats the factors of 64 rows
    low = choose_schemes([FC], workers=4, batch=64, dense="allreduce", compression="powersgd:4")
    assert low.choices[0].scheme == "allreduce" and "powersgd:4" in low.table()


def test_latency_can_tip_the_choice() -> None:
    """SFB needs P - 1 messages in a row (the ring allgather), push and pull 2: with few bytes either way, the
    scheme that sends fewer bytes loses once each message costs a latency."""
    layer = LayerShape.linear("small", 64, 64)  # 4,160 parameters
    # 8 workers, 8 servers, batch 4: SFB 7 x 4 x 128 x 4 = 14,336 B against the servers' 16,640 B
    by_bytes = choose_schemes([layer], workers=8, batch=4, servers=8)
    assert by_bytes.choices[0].scheme == "sfb"
    # at 1 ms per message: 7 ms + 14 us against 2 ms + 17 us
    by_time = choose_schemes([layer], workers=8, batch=4, servers=8, latency=1e-3, bandwidth=1e9)
    assert by_time.choices[0].scheme == "ps"


def test_any_allreduce_the_policy_names_is_costed() -> None:
    """The collectives' auto policy also names "shm" (one host) and "hierarchical": costed as the ring."""
    for name in ("shm", "hierarchical", "ring"):
        plan = choose_schemes([FC], workers=4, batch=64, dense="allreduce", allreduce_algorithm=lambda n, p, a=name: a)
        assert plan.choices[0].candidates["allreduce"].worker_sent == 1.5 * 1_607_680 * 4
