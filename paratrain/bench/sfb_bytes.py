"""Bytes per step of each scheme, measured on the wire, against the cost model's formulas (:mod:`paratrain.sfb.cost`).

Each row trains a model for a few steps with P workers (threads with real ZeroMQ sockets on loopback, the
shared-memory path off, as on a network) and reads the transport's byte counters of every worker around the
timed steps: what one worker sends and receives per step, averaged over the workers and steps. The prediction is
:func:`~paratrain.sfb.scheme_traffic` for one layer, or a whole model's :class:`~paratrain.sfb.HybridPlan`.
The counters are the transport's: the bytes of the arrays each message carries (its header, a few hundred bytes
of metadata, is not counted). The allreduce rows add the used-flags of fused buckets (4 bytes per parameter
tensor, sent with the gradients); ``algorithm="auto"`` sends small arrays by ``"direct"``, which the prediction
follows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paratrain.bench.machine import MachineSample, machine_report

__all__ = ["BytesRow", "render_bytes", "run_bytes_bench"]

#: (label, out_features, in_features) of the fully-connected layers measured one by one: the FC-heavy MLP's and
#: LeNet-5's on 28x28 inputs
LAYERS = (
    ("widemlp fc1", 2048, 784),
    ("widemlp fc2", 2048, 2048),
    ("widemlp out", 10, 2048),
    ("lenet fc1", 120, 400),
    ("lenet fc2", 84, 120),
)


@dataclasses.dataclass(frozen=True)
class BytesRow:
    """One measured configuration: predicted and measured bytes per worker and step."""

    label: str
    scheme: str
    workers: int
    batch: int
    predicted_sent: float
    measured_sent: float
    predicted_received: float
    measured_received: float

    @property
    def error(self) -> float:
        """Relative difference of the bytes sent, measured vs predicted."""
        return (self.measured_sent - self.predicted_sent) / self.predicted_sent if self.predicted_sent else 0.0


def _measure(model_fn: Any, strategy: str, *, workers: int, batch: int, servers: int, steps: int, **kwargs: Any) -> Any:
    import torch

    import paratrain.torch as ptt
    from paratrain.testing import run_ranks

    def worker(ctx: Any) -> Any:
        torch.set_num_threads(1)
        model = model_fn()
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), model=model, strategy=strategy, context=ctx, **kwargs
        )
        width = next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).in_features
        gen = torch.Generator().manual_seed(ctx.rank)
        x = torch.randn(batch, width, generator=gen)

        def step() -> None:
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()

        step()  # the first step: connections, agreements, a parameter server's first rounds
        stats = ctx.transport.stats
        sent, received = stats.bytes_sent, stats.bytes_received
        for _ in range(steps):
            step()
        out = ((stats.bytes_sent - sent) / steps, (stats.bytes_received - received) / steps, opt.hybrid_plan)
        opt.close()
        return out

    results = run_ranks(workers, worker, transport="zmq", faults="latency=0s", servers=servers, timeout=600)
    sent = sum(r[0] for r in results) / workers
    received = sum(r[1] for r in results) / workers
    return sent, received, results[0][2]


def run_bytes_bench(*, workers: int = 4, batch: int = 64, servers: int = 1, steps: int = 3) -> dict[str, Any]:
    """Every layer of :data:`LAYERS` under allreduce, the parameter server and SFB, then the whole FC-heavy MLP
    under ``poseidon``; returns the report (rows and the machine)."""
    import torch

    from paratrain.collectives.policy import default_allreduce_choice
    from paratrain.sfb import LayerShape, scheme_traffic

    before = MachineSample.take()
    rows: list[BytesRow] = []
    for label, out_f, in_f in LAYERS:
        shape = LayerShape.linear(label, out_f, in_f)
        for scheme, strategy, nservers in (("allreduce", "allreduce", 0), ("ps", "bsp", servers), ("sfb", "sfb", 0)):
            # a one-layer model is one bucket: its weight, bias and 2 used-flags, as the auto policy sees it
            algorithm = default_allreduce_choice((shape.numel + 2) * 4, workers)
            want = scheme_traffic(shape, scheme, workers=workers, batch=batch, servers=nservers, algorithm=algorithm)
            sent, received, _ = _measure(
                lambda i=in_f, o=out_f: torch.nn.Sequential(torch.nn.Linear(i, o)),
                strategy,
                workers=workers,
                batch=batch,
                servers=nservers,
                steps=steps,
            )
            rows.append(BytesRow(label, scheme, workers, batch, want.worker_sent, sent, want.worker_received, received))

    def widemlp() -> Any:
        from paratrain.train.models import build_model

        return build_model("widemlp", side=28, classes=10)[1:]  # without the Flatten: inputs come flat

    sent, received, plan = _measure(
        widemlp, "poseidon", workers=workers, batch=batch, servers=servers, steps=steps, batch_size=batch
    )
    want_sent, want_received = plan.worker_bytes()
    schemes = "+".join(f"{c.layer.name}:{c.scheme}" for c in plan.choices)
    rows.append(
        BytesRow(f"widemlp, poseidon ({schemes})", "hybrid", workers, batch, want_sent, sent, want_received, received)
    )
    return {
        "benchmark": "sfb-bytes",
        "workers": workers,
        "batch": batch,
        "servers": servers,
        "steps": steps,
        "machine": machine_report(before),
        "rows": [{**dataclasses.asdict(r), "error": r.error} for r in rows],
    }


def render_bytes(report: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    lines = [
        f"bytes per worker and step, {report['workers']} workers, batch {report['batch']}, "
        f"{report['servers']} server(s) for ps; predicted by paratrain.sfb.cost, measured on the sockets",
        "",
        "| layer | scheme | sent: predicted | sent: measured | diff | received: predicted | received: measured |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['label']} | {r['scheme']} | {r['predicted_sent']:,.0f} | {r['measured_sent']:,.0f} | "
            f"{100 * r['error']:+.2f} % | {r['predicted_received']:,.0f} | {r['measured_received']:,.0f} |"
        )
    return "\n".join(lines)
