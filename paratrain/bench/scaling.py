"""Scale beyond this machine: one gradient exchange of N = 2 ... 1024 workers, simulated from the runtime's plans.

The seeds' claim (Baidu's ring allreduce): a tree or central aggregation of a 1.2 GB model takes 1.2 s on 2 GPUs
and 10.8 s on 10, while the ring stays flat. This replays, on a described cluster (one rank per host, each host
one full-duplex link of the given latency and bandwidth, :meth:`~paratrain.sim.replay.Network.uniform`), one
exchange of ``nbytes`` per worker for every N:

* ``ring``: :func:`~paratrain.collectives.lower.allreduce_parts` ``"ring"`` (replayed from rank 0 alone: the
  ring is the same on every rank up to a rotation, :func:`~paratrain.sim.replay.replay` ``symmetric=N``);
* ``tree``: the binomial tree allreduce (reduce, then broadcast), every rank replayed;
* ``central``: the parameter server with one server (:func:`~paratrain.ps.plans.round_plan`: every worker pushes
  its gradient and pulls the model back), the "central aggregation" of the claim;
* ``ps:N/8``: the parameter server with one server per 8 workers, the key cut into chunks over them;
* ``gossip``: one D-PSGD round on the ring graph (each worker exchanges its model with two neighbours),
  :func:`ring_gossip_plan`.

No compute and no agreement: the exchange alone, as the claim states it. The measured side
(:func:`check_scaling`, ``--check``) times ring and tree allreduces on this machine at N = 2..4 (real processes,
the fault injector's links) and sets them beside the same plans (with the call's agreement, as the runtime runs
them) replayed on this machine's profile, which is how far the figure can be trusted.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from paratrain.collectives.lower_allreduce import allreduce_parts, allreduce_plan
from paratrain.gossip.plan import round_actions
from paratrain.plan.ir import Plan
from paratrain.ps.plans import round_plan
from paratrain.ps.sharding import plan_chunks
from paratrain.sim.machine import LinkCost, MachineProfile, ModelProfile
from paratrain.sim.replay import Network, replay

if TYPE_CHECKING:
    from paratrain.sim.predict import Prediction

__all__ = [
    "SCHEMES",
    "check_scaling",
    "exchange_time",
    "render_check",
    "render_scaling",
    "ring_gossip_plan",
    "run_scaling",
    "training_step",
]

SCHEMES = ("ring", "tree", "central", "ps:N/8", "gossip")


def exchange_time(scheme: str, n: int, nbytes: int, link: LinkCost, *, gamma: float = 0.0) -> float:
    """Seconds of one exchange of ``nbytes`` per worker among ``n`` workers by ``scheme`` (see the module)."""
    net = Network.uniform(link)
    itemsize = 4
    count = max(n, nbytes // itemsize // n * n)  # a multiple of n: every ring chunk the same size
    if scheme == "ring":
        actions = allreduce_parts("ring", n, count, itemsize, agreement=False).rank(0)
        return replay(Plan("ring/rank0", (actions,)), net, gamma=gamma, symmetric=n, validate=False).time
    if scheme == "tree":
        return replay(allreduce_plan("tree", n, count, itemsize, agreement=False), net, gamma=gamma).time
    if scheme in ("central", "ps:N/8"):
        servers = 1 if scheme == "central" else max(1, n // 8)
        chunks = plan_chunks("grad", (count,), itemsize, servers, chunk_bytes=max(1 << 20, nbytes // (4 * servers)))
        return replay(round_plan(chunks, itemsize, num_workers=n, num_servers=servers), net, gamma=gamma).time
    if scheme == "gossip":
        return replay(ring_gossip_plan(n, count * itemsize), net, gamma=gamma, validate=False).time
    raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")


def ring_gossip_plan(n: int, nbytes: int) -> Plan:
    """One D-PSGD round on the ring graph: each rank's :func:`~paratrain.gossip.plan.round_actions` with its
    neighbours in the order the runtime takes them (by rank), which is :func:`~paratrain.gossip.plan.gossip_plan`
    of the ring's mixing matrix without building its N x N matrix (not rotation-symmetric: the order differs)."""
    return Plan(
        "gossip/ring",
        tuple(round_actions(tuple(sorted({(r - 1) % n, (r + 1) % n} - {r})), nbytes) for r in range(n)),
    )


def run_scaling(
    *,
    nbytes: int,
    link: LinkCost,
    workers: Sequence[int],
    schemes: Sequence[str] = SCHEMES,
    gamma: float = 0.0,
) -> dict[str, Any]:
    """Simulates every scheme at every N; returns the report (seconds per exchange and seconds to simulate)."""
    rows = []
    for n in workers:
        for scheme in schemes:
            if n < 2:
                continue
            t0 = time.perf_counter()
            seconds = exchange_time(scheme, n, nbytes, link, gamma=gamma)
            rows.append(
                {"scheme": scheme, "workers": n, "seconds": seconds, "simulated_in_s": time.perf_counter() - t0}
            )
    return {
        "benchmark": "scaling",
        "nbytes": nbytes,
        "alpha": link.alpha,
        "beta": link.beta,
        "gamma": gamma,
        "rows": rows,
    }


def render_scaling(report: dict[str, Any]) -> str:
    """The report as a Markdown table: one row per N, one column per scheme (seconds per exchange)."""
    schemes = list(dict.fromkeys(r["scheme"] for r in report["rows"]))
    by = {(r["scheme"], r["workers"]): r for r in report["rows"]}
    ns = sorted({r["workers"] for r in report["rows"]})
    lines = ["| N | " + " | ".join(schemes) + " | slowest to simulate |", "|---:|" + "---:|" * (len(schemes) + 1)]
    for n in ns:
        cells = [f"{by[(s, n)]['seconds']:.3f} s" if (s, n) in by else "-" for s in schemes]
        slowest = max(by[(s, n)]["simulated_in_s"] for s in schemes if (s, n) in by)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {slowest:.2f} s |")
    return "\n".join(lines)


def plot_scaling(report: dict[str, Any], path: str) -> None:
    """Seconds per exchange against N (log x), one line per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in dict.fromkeys(r["scheme"] for r in report["rows"]):
        pts = sorted((r["workers"], r["seconds"]) for r in report["rows"] if r["scheme"] == scheme)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=scheme)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("seconds per exchange (simulated)")
    gbit = 8 / report["beta"] / 1e9 if report["beta"] else float("inf")
    ax.set_title(f"{report['nbytes'] / 1e6:.0f} MB per worker, {gbit:g} Gbit/s links, {report['alpha'] * 1e6:g} us")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def training_step(profile: MachineProfile, model: ModelProfile, n: int, link: LinkCost) -> Prediction:
    """One training step of ``model`` (ring allreduce) by ``n`` workers on the described cluster: one rank per host,
    each with ``link``'s latency and bandwidth over this machine's transport, and each rank computing at the
    profiled speed.

    The profile's core sharing (:meth:`~paratrain.sim.machine.ModelProfile.cores`: how this machine's processes
    shared its cores while profiling) is left out: it describes the profiling host, not N hosts of one rank each.
    Kept, it had the full replay (N <= :data:`~paratrain.sim.predict.SYMMETRIC_FROM`) share one host's cores among
    all N ranks, 16 ranks per core's worth at N = 64, while the replay from rank 0 alone above that (which shares
    nothing) did not: the step came out slower at 64 workers than at 256.
    """
    from paratrain.sim.predict import predict

    alone = dataclasses.replace(model, alone_s=0.0)
    return predict(profile, alone, workers=n, bandwidth=1.0 / link.beta, latency=link.alpha, algorithm="ring")


#: The algorithms ``--check`` measures by default (the ones the runtime runs over the transport for any N).
CHECKED = ("ring", "tree", "halving_doubling", "torus", "double_tree")


def check_scaling(
    profile: MachineProfile,
    *,
    nbytes: int,
    workers: Sequence[int] = (2, 3, 4),
    spec: str,
    algorithms: Sequence[str] = CHECKED,
    links: str | None = None,
    iters: int = 10,
    repeat: int = 1,
    timeout: float = 300.0,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Times ``pt.allreduce_`` of ``nbytes`` per rank with each algorithm in ``N`` real processes under the fault
    injector (``spec``, e.g. ``"bandwidth=1Gbit"``; per call the slowest rank's time, median over calls), for
    every N, ``repeat`` times (N interleaved within each
    round); and replays the same call's plan (:func:`~paratrain.collectives.lower.allreduce_plan`, agreement
    included) on the network :func:`~paratrain.sim.predict.network_for` builds from ``profile`` for that job.
    Blocks for the runs (seconds each).

    Raises:
        RuntimeError: a measuring job failed or ran past ``timeout``.
    """
    from paratrain.launch.run import run_launch
    from paratrain.sim.predict import link_trees, network_for
    from paratrain.transport.faults import FaultSpec

    say = say or (lambda line: None)
    count = max(1, nbytes // 4)
    if links is not None:
        spec = f"{spec},links={links}"
    link = FaultSpec.parse(spec)
    bandwidth, latency = link.bandwidth, link.latency
    measured: dict[tuple[int, str], list[float]] = {}
    for round_ in range(repeat):
        for n in workers:
            say(f"round {round_ + 1}/{repeat}: {n} processes, {', '.join(algorithms)} ...")
            with tempfile.TemporaryDirectory(prefix="paratrain-scaling-") as tmp:
                argv = [sys.executable, "-m", "paratrain.bench._scaling_worker", "--count", str(count)]
                argv += ["--algorithms", ",".join(algorithms), "--iters", str(iters), "--out", tmp]
                argv += ["--deadline", str(timeout)]
                code = run_launch(argv, nproc=n, faults=spec, deadline_s=timeout, stdout=sys.stderr)
                if code:
                    raise RuntimeError(f"the measuring job of {n} processes failed (exit code {code}); see above")
                ranks = [
                    json.loads((pathlib.Path(tmp) / f"scaling-check-rank{r}.json").read_text())["times_s"]
                    for r in range(n)
                ]
            for algorithm in algorithms:  # per call the slowest rank, then the median over calls
                slowest = [max(calls) for calls in zip(*(rank[algorithm] for rank in ranks), strict=True)]
                measured.setdefault((n, algorithm), []).append(statistics.median(slowest))
    rows = []
    for n in workers:
        network, _ = network_for(
            profile, world_size=n, bandwidth=bandwidth, latency=latency, concurrency=n, links=link.links
        )
        trees = link_trees(n, bandwidth, link.links) if "blink" in algorithms else None
        for algorithm in algorithms:
            plan = allreduce_plan(algorithm, n, count, 4, aliased=True, trees=trees)
            simulated = replay(plan, network, gamma=profile.gamma, copy=profile.copy).time
            runs = measured[(n, algorithm)]
            median = statistics.median(runs)
            rows.append(
                {
                    "workers": n,
                    "scheme": algorithm,
                    "measured_s": median,
                    "measured_runs_s": runs,
                    "simulated_s": simulated,
                    "error": simulated / median - 1.0,
                }
            )
    return {
        "benchmark": "scaling-check",
        "nbytes": count * 4,
        "network": spec,
        "links": [[p.a, p.b, p.bandwidth, p.latency] for p in link.links],
        "bandwidth": bandwidth,
        "latency": latency,
        "machine": profile.name,
        "repeat": repeat,
        "rows": rows,
    }


def render_check(report: dict[str, Any]) -> str:
    """The check as a Markdown table: measured (median, min-max over rounds), simulated, error."""
    lines = ["| N | scheme | measured (min-max) | simulated | error |", "|---:|---|---:|---:|---:|"]
    for r in report["rows"]:
        runs = r["measured_runs_s"]
        lines.append(
            f"| {r['workers']} | {r['scheme']} | {r['measured_s'] * 1e3:.1f} ms ({min(runs) * 1e3:.1f}-"
            f"{max(runs) * 1e3:.1f}) | {r['simulated_s'] * 1e3:.1f} ms | {r['error']:+.1%} |"
        )
    errors = sorted(abs(r["error"]) for r in report["rows"])
    if errors:
        lines.append("")
        lines.append(f"median |error| {statistics.median(errors):.1%}, worst {errors[-1]:.1%}")
    return "\n".join(lines)
