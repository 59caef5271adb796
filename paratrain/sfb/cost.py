"""Bytes each scheme moves per step for one layer, and Poseidon's per-layer choice between them (pure).

Notation (per layer and step): a fully-connected layer has an MxN weight (M outputs, N inputs) and maybe a bias of
M; ``n`` is its number of parameters; each of the P workers has a batch of K rows; there are S servers. Counted
in elements, times the item size, for paratrain's own messages (headers of a few hundred bytes per message are
left out, which is why the check in the benchmark allows 1 %)::

    scheme      a worker sends          a worker receives       a server sends / receives    one direction, busiest link
    allreduce   2 (P-1)/P n             2 (P-1)/P n             -                            2 (P-1)/P n
    ps          n (push)                n (pull)                P n / S each way              max(n, P n / S)
    sfb         (P-1) K (M+N)           (P-1) K (M+N)           -                            (P-1) K (M+N)

The ring allreduce sends each of its P chunks P-1 times while reducing and P-1 times while gathering. The
parameter server is the sharded, bulk-synchronous one of :mod:`paratrain.ps`: every worker pushes its gradient and
pulls the new parameters, and the S servers share the P pushes and pulls of every key. SFB is an allgather of each
worker's factors ``[U | V]`` (Kx(M+N)) around the ring: each worker forwards the P-1 blocks that are not its
successor's; the bias needs nothing more (its gradient is the column sum of U).

Which one is cheaper? Poseidon (Zhang et al. ATC'17, Table 1) counts a worker's bytes in both directions: SFB
2K(P1-1)(M+N) against the PS's 2MN (and 2MN·P1/P2 on a server). Both directions of a link run at once (full
duplex), and a step waits for the busiest link, so this module compares the busiest link in one direction:
``max(sent, received)`` over workers and servers. It is the same comparison as Poseidon's for the workers, plus
the servers' links, which decide when S < P (the hot spot the fault injector's per-node links emulate). With a
latency alpha and a bandwidth B the time of a scheme is ``rounds·alpha + bytes/B`` (rounds: the messages in a row on the
critical path: 2(P-1) for the ring, 2 for push then pull, P-1 for the allgather); without a bandwidth the
comparison is bytes alone. The rule ignores compute: rebuilding the gradient from PK rows costs a GEMM of
PK·M·N multiply-adds on every worker, which is why SFB only pays when the network is the bottleneck.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from paratrain.collectives.lower_allreduce import PLANNED_ALGORITHMS
from paratrain.collectives.plans_allreduce import torus_shape

__all__ = ["SCHEMES", "HybridPlan", "LayerChoice", "LayerShape", "Traffic", "choose_schemes", "scheme_traffic"]

#: The ways a layer's gradient can travel: ``allreduce`` (ring), ``ps`` (push to servers, pull parameters),
#: ``sfb`` (allgather of the sufficient factors; fully-connected layers only).
SCHEMES = ("allreduce", "ps", "sfb")


@dataclass(frozen=True, slots=True)
class LayerShape:
    """One layer's parameters as the cost model sees them.

    Attributes:
        name: the module's name in the model (``"fc1"``, ``"features.0"``).
        numel: parameters of the layer (weight and bias).
        out_features: M, for a fully-connected layer (None for any other layer, which SFB cannot carry).
        in_features: N, likewise.
        bias: whether the fully-connected layer has a bias.
        itemsize: bytes per element.
    """

    name: str
    numel: int
    out_features: int | None = None
    in_features: int | None = None
    bias: bool = False
    itemsize: int = 4

    def __post_init__(self) -> None:
        if self.numel <= 0 or self.itemsize <= 0:
            raise ValueError(f"layer {self.name!r}: numel and itemsize must be positive")
        if (self.out_features is None) != (self.in_features is None):
            raise ValueError(f"layer {self.name!r}: give both out_features and in_features, or neither")
        if self.out_features is not None and self.in_features is not None:
            expected = self.out_features * self.in_features + (self.out_features if self.bias else 0)
            if expected != self.numel:
                raise ValueError(
                    f"layer {self.name!r}: a {self.out_features}x{self.in_features} layer has "
                    f"{expected} parameters, not {self.numel}"
                )

    @property
    def factorable(self) -> bool:
        """True for a fully-connected layer (its gradient is a sum of outer products)."""
        return self.out_features is not None

    @classmethod
    def linear(
        cls, name: str, out_features: int, in_features: int, *, bias: bool = True, itemsize: int = 4
    ) -> LayerShape:
        """A fully-connected layer (``torch.nn.Linear(in_features, out_features, bias)``)."""
        numel = out_features * in_features + (out_features if bias else 0)
        return cls(name, numel, out_features, in_features, bias, itemsize)


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes of one layer per step under one scheme (a worker's, and one server's when there are servers).

    Attributes:
        scheme: the scheme.
        worker_sent: bytes a worker sends.
        worker_received: bytes a worker receives.
        server_sent: bytes one server sends (0 without servers).
        server_received: bytes one server receives.
        rounds: messages in a row on the critical path (what the latency multiplies).
    """

    scheme: str
    worker_sent: float
    worker_received: float
    server_sent: float = 0.0
    server_received: float = 0.0
    rounds: int = 0

    @property
    def busiest(self) -> float:
        """Bytes through the busiest link in one direction: what bounds the step at a given bandwidth."""
        return max(self.worker_sent, self.worker_received, self.server_sent, self.server_received)

    def seconds(self, *, latency: float = 0.0, bandwidth: float | None = None) -> float:
        """``rounds·latency + busiest/bandwidth`` (the busiest bytes alone when ``bandwidth`` is None)."""
        return self.rounds * latency + (self.busiest if bandwidth is None else self.busiest / bandwidth)


def scheme_traffic(
    layer: LayerShape,
    scheme: str,
    *,
    workers: int,
    batch: int = 0,
    servers: int = 0,
    algorithm: str = "ring",
    compression: str | None = None,
) -> Traffic:
    """The bytes ``layer`` costs per step under ``scheme`` (the table of the module docstring).

    Args:
        layer: the layer.
        scheme: one of :data:`SCHEMES`.
        workers: P (>= 1).
        batch: K, rows of a worker's batch through this layer (needed for ``sfb``; a layer applied to a
            sequence sees K = batch x sequence length rows).
        servers: S (needed for ``ps``).
        algorithm: the allreduce's algorithm: ``"ring"``; ``"tree"`` (reduce and broadcast along a binomial
            tree: the same 2(P-1)/P n per worker on average, more at the root); ``"direct"`` (every worker sends
            its whole array to every other: (P-1) n; what ``algorithm="auto"`` runs for small arrays).
        compression: the ``compression=`` of ``allreduce`` and ``ps`` (:mod:`paratrain.compression`):
            ``fp16``/``bf16`` halve what is sent (the pull stays full width); ``topk:R`` sends k = ceil(R n)
            pairs, by allgather ((P-1) k pairs of two values' width) or to the servers (an 8-byte index and a
            value each); ``powersgd:R`` (allreduce only) reduces R (M + N) numbers for a fully-connected
            layer, in two ring rounds, and its bias densely.

    Raises:
        ValueError: an unknown scheme, ``sfb`` for a layer that is not fully connected, or a bad count.

    Example:
        A 2048x2048 layer with bias, batch 32, 4 workers: SFB sends 3·32·4096 floats, the ring 1.5·n.

        >>> fc = LayerShape.linear("fc", 2048, 2048)
        >>> scheme_traffic(fc, "sfb", workers=4, batch=32).worker_sent / 4
        393216.0
        >>> scheme_traffic(fc, "allreduce", workers=4).worker_sent / 4 == 1.5 * fc.numel
        True
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    p, n, size = workers, layer.numel, layer.itemsize
    if compression is not None and scheme in ("allreduce", "ps"):
        return _compressed_traffic(layer, scheme, p, servers, compression)
    if scheme == "allreduce":
        if algorithm == "direct":
            return Traffic(scheme, (p - 1) * n * size, (p - 1) * n * size, rounds=1)
        log = max(1, (p - 1).bit_length())
        if algorithm == "tree":
            each = 2 * (p - 1) / p * n * size
            return Traffic(scheme, each, each, rounds=2 * log)
        if algorithm == "double_tree":  # an inner node of one tree: half up, both halves down; a leaf of the other
            return Traffic(scheme, 2 * n * size, 2 * n * size, rounds=2 * log)
        if algorithm == "halving_doubling":
            active = 1 << (p.bit_length() - 1)  # a world that is not a power of two folds in: a whole array
            each = 2 * (active - 1) / active * n * size + (n * size if active != p else 0)
            return Traffic(scheme, each, each, rounds=2 * (active.bit_length() - 1) + (2 if active != p else 0))
        if algorithm == "torus":
            rows, cols = torus_shape(p)
            each = 2 * (p - 1) / p * n * size
            return Traffic(scheme, each, each, rounds=2 * (rows + cols - 2))
        if algorithm != "ring":
            raise ValueError(
                f"unknown allreduce algorithm {algorithm!r}: ring, tree, direct, halving_doubling, torus or double_tree"
            )
        each = 2 * (p - 1) / p * n * size
        return Traffic(scheme, each, each, rounds=2 * (p - 1))
    if scheme == "ps":
        if servers < 1:
            raise ValueError(f"layer {layer.name!r}: the parameter server needs servers >= 1, got {servers}")
        load = p * n * size / servers
        return Traffic(scheme, n * size, n * size, load, load, rounds=2)
    if scheme == "sfb":
        if layer.out_features is None or layer.in_features is None:
            raise ValueError(f"layer {layer.name!r} is not fully connected: its gradient has no sufficient factors")
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        each = (p - 1) * batch * (layer.out_features + layer.in_features) * size
        return Traffic(scheme, each, each, rounds=p - 1)
    raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


def _compressed_traffic(layer: LayerShape, scheme: str, p: int, servers: int, compression: str) -> Traffic:
    from paratrain.compression import parse_compression

    comp = parse_compression(compression)
    n, size = layer.numel, layer.itemsize
    ring = 2 * (p - 1) / p
    if comp is None:
        return scheme_traffic(layer, scheme, workers=p, servers=servers)
    if scheme == "ps":
        if servers < 1:
            raise ValueError(f"layer {layer.name!r}: the parameter server needs servers >= 1, got {servers}")
        if comp.aggregation_rounds > 1:
            raise ValueError(f"compression {compression!r} does not run with the parameter servers")
        push = comp.wire_bytes(n, size, push=True)
        return Traffic(scheme, push, n * size, p * n * size / servers, p * push / servers, rounds=2)
    m, k = layer.out_features, layer.in_features
    shapes = [(n,)] if m is None or k is None else [(m, k), *([(m,)] if layer.bias else [])]
    sent = comp.wire_bytes(n, size, shapes=shapes)
    if not comp.linear:  # an allgather: each worker's message to every other
        each = (p - 1) * sent
        return Traffic(scheme, each, each, rounds=p - 1)
    return Traffic(scheme, ring * sent, ring * sent, rounds=2 * (p - 1) * comp.rounds_of(shapes))


@dataclass(frozen=True, slots=True)
class LayerChoice:
    """The scheme picked for one layer, with every candidate's traffic (what the start-up table prints).

    Attributes:
        layer: the layer.
        scheme: the scheme it travels by.
        candidates: traffic of each scheme considered, by name.
        forced: True when the user chose the scheme (an override), False when the cost model did.
    """

    layer: LayerShape
    scheme: str
    candidates: Mapping[str, Traffic]
    forced: bool = False

    @property
    def traffic(self) -> Traffic:
        """The chosen scheme's traffic."""
        return self.candidates[self.scheme]


@dataclass(frozen=True, slots=True)
class HybridPlan:
    """Every layer's scheme: the plan the torch front end executes and the benchmark checks bytes against.

    Attributes:
        choices: one per layer, in the model's order.
        workers, batch, servers: what the costs were computed for.
        dense: the scheme of the layers SFB cannot carry (``allreduce`` or ``ps``).
    """

    choices: tuple[LayerChoice, ...]
    workers: int
    batch: int
    servers: int
    dense: str
    latency: float = 0.0
    bandwidth: float | None = None
    notes: tuple[str, ...] = field(default=())

    def scheme_of(self, name: str) -> str:
        """The scheme of layer ``name``.

        Raises:
            KeyError: no such layer.
        """
        for choice in self.choices:
            if choice.layer.name == name:
                return choice.scheme
        raise KeyError(name)

    @property
    def sfb_layers(self) -> tuple[str, ...]:
        """Names of the layers sent by SFB."""
        return tuple(c.layer.name for c in self.choices if c.scheme == "sfb")

    def worker_bytes(self) -> tuple[float, float]:
        """(sent, received) by one worker per step, summed over layers."""
        return (
            sum(c.traffic.worker_sent for c in self.choices),
            sum(c.traffic.worker_received for c in self.choices),
        )

    def table(self) -> str:
        """The plan as a table (bytes per worker and step each way; the busiest link of each candidate)."""
        lines = [
            f"per-layer schemes for {self.workers} workers, batch {self.batch} per worker"
            + (f", {self.servers} server{'s' if self.servers > 1 else ''}" if self.servers else "")
            + (f", {self.bandwidth * 8 / 1e6:g} Mbit/s links" if self.bandwidth else ""),
            f"{'layer':<20} {'shape':>13} {'scheme':>9} {'sent/worker':>12} {'recv/worker':>12}"
            "   busiest link per scheme",
        ]
        for c in self.choices:
            shape = f"{c.layer.out_features}x{c.layer.in_features}" if c.layer.factorable else f"{c.layer.numel}"
            others = ", ".join(f"{name} {_bytes(t.busiest)}" for name, t in c.candidates.items())
            mark = " (set)" if c.forced else ""
            lines.append(
                f"{c.layer.name:<20} {shape:>13} {c.scheme + mark:>9} {_bytes(c.traffic.worker_sent):>12} "
                f"{_bytes(c.traffic.worker_received):>12}   {others}"
            )
        sent, received = self.worker_bytes()
        lines.append(f"{'total':<20} {'':>13} {'':>9} {_bytes(sent):>12} {_bytes(received):>12}")
        lines.extend(self.notes)
        return "\n".join(lines)


def _bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def choose_schemes(
    layers: Sequence[LayerShape],
    *,
    workers: int,
    batch: int,
    dense: str = "ps",
    servers: int = 0,
    allow: Sequence[str] | None = None,
    overrides: Mapping[str, str] | None = None,
    latency: float = 0.0,
    bandwidth: float | None = None,
    allreduce_algorithm: Callable[[int, int], str] | None = None,
    compression: str | None = None,
) -> HybridPlan:
    """Picks each layer's scheme: the cheapest of ``allow`` by :meth:`Traffic.seconds`, unless overridden.

    A layer that is not fully connected always travels by ``dense``. A fully-connected layer takes the cheapest
    of ``dense`` and ``sfb`` (or of ``allow``); a tie keeps ``dense``.

    Args:
        layers: the model's layers with parameters, in order.
        workers: P.
        batch: K, a worker's rows per step.
        dense: the scheme for everything SFB does not carry: ``"ps"`` (Poseidon) or ``"allreduce"``.
        servers: S (for ``ps``).
        allow: the schemes a fully-connected layer may take (default: ``dense`` and ``"sfb"``).
        overrides: layer name -> scheme, to force a choice (``"dense"`` means ``dense``).
        latency: seconds per message (alpha), for the comparison.
        bandwidth: bytes per second of a link (None: compare bytes).
        allreduce_algorithm: ``(nbytes, workers) -> algorithm`` of an allreduce of one layer (the collectives'
            ``auto`` policy); default: the ring for every size. Algorithms other than ``"direct"`` and
            ``"tree"`` (shared memory inside a host, hierarchical across hosts) are costed as the ring.
        compression: the dense scheme's ``compression=`` (see :func:`scheme_traffic`): a layer then weighs SFB
            against the compressed dense scheme (low-rank, top-k or 16-bit), Poseidon's choice widened.

    Raises:
        ValueError: an override names no layer, or a scheme the layer cannot take.

    Example:
        Wide layers and a small batch: SFB carries the 2048-wide layers, the 10-way output stays with the servers.

        >>> layers = [LayerShape.linear("fc1", 2048, 784), LayerShape.linear("fc2", 2048, 2048),
        ...           LayerShape.linear("out", 10, 2048)]
        >>> plan = choose_schemes(layers, workers=4, batch=32, servers=1)
        >>> [c.scheme for c in plan.choices]
        ['sfb', 'sfb', 'ps']
    """
    if dense not in ("ps", "allreduce"):
        raise ValueError(f"dense must be 'ps' or 'allreduce', got {dense!r}")
    allowed = tuple(allow) if allow is not None else (dense, "sfb")
    for scheme in allowed:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; choose among {', '.join(SCHEMES)}")
    forced = {name: (dense if scheme == "dense" else scheme) for name, scheme in (overrides or {}).items()}
    names = {layer.name for layer in layers}
    unknown = sorted(set(forced) - names)
    if unknown:
        raise ValueError(f"no layer named {', '.join(map(repr, unknown))}; layers: {', '.join(sorted(names))}")
    choices = []
    for layer in layers:
        options = [s for s in allowed if layer.factorable or s != "sfb"] if layer.factorable else [dense]
        if dense not in options:
            options.insert(0, dense)
        want = forced.get(layer.name)
        if want is not None and want not in options:
            options.append(want)
        algorithm = allreduce_algorithm(layer.numel * layer.itemsize, workers) if allreduce_algorithm else "ring"
        if algorithm not in PLANNED_ALGORITHMS:
            algorithm = "ring"  # shared memory, hierarchical: a ring's bytes, through memory or between hosts
        candidates = {
            s: scheme_traffic(
                layer, s, workers=workers, batch=batch, servers=servers, algorithm=algorithm, compression=compression
            )
            for s in options
        }
        if want is not None:
            scheme = want
        else:
            scheme = min(
                options, key=lambda s: (candidates[s].seconds(latency=latency, bandwidth=bandwidth), s != dense)
            )
        choices.append(LayerChoice(layer, scheme, candidates, forced=want is not None))
    notes = (f"the {dense} layers are compressed: {compression}",) if compression else ()
    return HybridPlan(tuple(choices), workers, batch, servers, dense, latency, bandwidth, notes)
