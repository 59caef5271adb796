"""A machine profile: what the simulator needs to know about a machine or a cluster, as JSON.

Measured by ``paratrain profile`` on the user's machine, or written by hand for a cluster they do not have. Three
parts:

* **paths**: for each way a message can travel, the latency ``alpha`` (seconds per message) and the inverse
  bandwidth ``beta`` (seconds per byte) of the Hockney model ``t(n) = alpha + beta n``, fitted from measured
  one-way times. The names the simulator knows: ``"shm"`` (the collectives' shared-memory path inside a host:
  alpha is a signal seen by another process, beta a copy through the segment), ``"ipc"`` (ZeroMQ between
  processes of one host), ``"tcp"`` (ZeroMQ between hosts, or on loopback), and ``"emulated"`` paths named by
  the fault injector's spec (``"emulated:100Mbit"``: the injector's link plus the transport under it). A
  path measured with N processes at once, as a job of N ranks loads the machine, is named ``"ipc@N"``;
  ``"injected@N"`` is the fault injector's own cost on top of ipc with N processes (see :meth:`MachineProfile.link`).
* **gamma**: seconds per byte of an elementwise reduce (``out = a + b``) on one core, and ``copy`` per byte of
  a copy; what a ring's reduce steps and a parameter server's adds cost.
* **models**: per model and batch size, each layer's forward and backward seconds and its parameters' bytes, the
  optimizer step, and how many processes ran at once on the machine while it was measured (``concurrency``):
  a layer measured with 4 processes on 2 cores already includes the sharing of the cores, which is what a
  4-worker job on this machine sees.

A **cluster** (``hosts`` x ``ranks_per_host``) says where ranks live: ranks on one host talk through ``intra``
(``"shm"`` or ``"ipc"``), ranks on different hosts through ``inter`` (``"tcp"`` or an emulated path). The
simulator reads only this file: a cluster that does not exist is described by writing its paths and its layers'
times (measured on its GPUs, say) by hand.

Pure data and JSON, no measuring here (:mod:`paratrain.bench.profile` measures).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from paratrain.errors import ConfigError

__all__ = ["Cluster", "LayerCost", "LinkCost", "MachineProfile", "ModelProfile"]

#: Version of the JSON format; a file of another version is refused with what to do.
FORMAT = 1


@dataclass(frozen=True, slots=True)
class LinkCost:
    """One path's Hockney parameters: a message of ``n`` bytes takes ``alpha + beta * n`` seconds.

    ``ingress_beta`` is how long a byte holds the receiving node's queue when it differs from ``beta``: under
    the fault injector, a message's CPU cost (its copies, the transport) is paid by its sender while the
    receiver's queue drains at the emulated link's rate, so many senders into one node share that rate, not
    their CPU time. None (a real path): ``beta``.

    Example:
        >>> LinkCost(alpha=50e-6, beta=1 / 12.5e6).time(1_250_000)
        0.10005
    """

    alpha: float
    beta: float
    ingress_beta: float | None = None

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0 or (self.ingress_beta or 0.0) < 0:
            raise ConfigError(f"a link's alpha and betas must be >= 0, got alpha={self.alpha}, beta={self.beta}")

    @property
    def receive_beta(self) -> float:
        """Seconds per byte a message holds the receiver's ingress queue."""
        return self.beta if self.ingress_beta is None else self.ingress_beta

    def time(self, nbytes: int) -> float:
        """Seconds for one message of ``nbytes``."""
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer (a module with parameters of its own) of a profiled model.

    Attributes:
        name: the module's qualified name in the model (``"fc1"``, ``"features.0"``).
        forward_s: seconds of its forward for one batch.
        backward_s: seconds of its backward for one batch (input and weight gradients).
        params: its parameters' qualified names, in ``model.parameters()`` order.
        param_bytes: bytes of each of those parameters.
        output_bytes: bytes of its output activation (what a pipeline cut after it would send).
        out_features: M of a fully-connected layer (``nn.Linear``), 0 for any other kind; with ``in_features``
            it lets the simulator cost sufficient-factor broadcasting (:mod:`paratrain.sfb`).
        in_features: N of a fully-connected layer, 0 otherwise.
        module: its position in the model's flat list of modules (nested ``nn.Sequential`` opened up, as a
            pipeline cuts the model), -1 where unknown; with :attr:`ModelProfile.modules` it places pipeline
            stage boundaries.
        channels: (in, out) channels of a 2-d convolution, (0, 0) for any other kind: what a split of it cuts
            (:mod:`paratrain.sim.tensor`).
        split_s: (forward, backward) seconds of a worker's part of the layer split ``"column/2"``, ``"row/4"``...
            (:mod:`paratrain.bench.profile_splits`); a split not measured is costed at 1/N of the layer.
        heads: the attention heads of the transformer block whose part this layer is (``module`` is then the
            block's place), 0 for a layer outside a block.
    """

    name: str
    forward_s: float
    backward_s: float
    params: tuple[str, ...] = ()
    param_bytes: tuple[int, ...] = ()
    output_bytes: int = 0
    out_features: int = 0
    in_features: int = 0
    module: int = -1
    channels: tuple[int, int] = (0, 0)
    split_s: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    heads: int = 0

    def __post_init__(self) -> None:
        if len(self.params) != len(self.param_bytes):
            raise ConfigError(f"layer {self.name!r}: {len(self.params)} params but {len(self.param_bytes)} sizes")
        if self.forward_s < 0 or self.backward_s < 0:
            raise ConfigError(f"layer {self.name!r}: times must be >= 0")


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A model's layers in forward order, measured at one batch size.

    Attributes:
        model: the model's name (a ``paratrain train --model`` name, or the user's).
        batch_size: examples per worker per step the times are for.
        layers: in forward order (backward runs them in reverse).
        optimizer_s: seconds of one optimizer step over all parameters.
        concurrency: processes that ran the model at once while it was measured (see the module docstring).
        overhead_s: seconds per step outside the layers (data loading, the loss, autograd's bookkeeping).
        straggle_s: how much longer than the median step the slowest of ``concurrency`` processes' steps is
            expected to be (from the measured steps' spread): what a synchronous step waits for beyond the
            median worker, as processes sharing cores are preempted at different times. 0 where not measured.
        modules: how many modules the model's flat list has (see :attr:`LayerCost.module`), 0 where unknown.
        alone_s: the median step of one process alone on the machine with the threads each of ``concurrency``
            processes gets (no sharing), 0 where not measured. With the shared step (:attr:`compute_s`) it
            says how the processes share the cores (:meth:`cores`).
        input_bytes: bytes of one batch's input, 0 where not recorded: what a pipeline's first stage sends on
            when its modules keep the size (a Flatten).
        call_s: seconds of one collective call on a torch tensor through the public API among ``concurrency``
            processes, a one-element allreduce (its checks and agreement; what split layers pay per move), 0
            where not measured.
    """

    model: str
    batch_size: int
    layers: tuple[LayerCost, ...]
    optimizer_s: float = 0.0
    concurrency: int = 1
    overhead_s: float = 0.0
    straggle_s: float = 0.0
    modules: int = 0
    alone_s: float = 0.0
    input_bytes: int = 0
    call_s: float = 0.0

    @property
    def param_bytes(self) -> int:
        """Bytes of all parameters."""
        return sum(sum(layer.param_bytes) for layer in self.layers)

    @property
    def compute_s(self) -> float:
        """Seconds of one step's computation with no communication at all."""
        return sum(layer.forward_s + layer.backward_s for layer in self.layers) + self.optimizer_s + self.overhead_s

    def cores(self) -> tuple[float, float] | None:
        """How the measuring processes shared the cores: (capacity, alone) for :class:`paratrain.sim.replay.Cores`,
        or None where one process was measured or the step alone was not.

        ``concurrency`` processes at once each ran a step in :attr:`compute_s`, one alone in :attr:`alone_s`: the
        host did ``concurrency`` steps' work at the rate of ``concurrency * alone_s / compute_s`` processes alone
        (its capacity, in cores' worth), and a profiled second of compute is ``alone_s / compute_s`` alone
        (capped at 1: a sharing that measured faster than alone is noise).

        Example:
            >>> layer = LayerCost("fc", 0.01, 0.02)
            >>> ModelProfile("m", 64, (layer,), optimizer_s=0.01, concurrency=4, alone_s=0.02).cores()
            (2.0, 0.5)
        """
        shared = self.compute_s
        if self.concurrency < 2 or self.alone_s <= 0 or shared <= 0:
            return None
        alone = min(1.0, self.alone_s / shared)
        return self.concurrency * alone, alone


@dataclass(frozen=True, slots=True)
class Cluster:
    """Where ranks live: ``hosts`` hosts of ``ranks_per_host`` ranks each (rank r on host r // ranks_per_host).

    Attributes:
        hosts: number of hosts.
        ranks_per_host: ranks per host.
        intra: path name between ranks of one host.
        inter: path name between hosts.
        cores_per_host: cores of a host (for the record; compute times come from the model profile).
    """

    hosts: int = 1
    ranks_per_host: int = 1
    intra: str = "ipc"
    inter: str = "tcp"
    cores_per_host: int = 1

    def host_of(self, rank: int) -> int:
        """The host of ``rank``."""
        return rank // self.ranks_per_host


@dataclass(frozen=True, slots=True)
class MachineProfile:
    """Everything the simulator needs; see the module docstring.

    Attributes:
        name: where it was measured or what it describes.
        paths: Hockney parameters per path name.
        gamma: seconds per byte of a reduce.
        copy: seconds per byte of a copy.
        models: model profiles by ``f"{model}@{batch_size}"`` (see :meth:`key`).
        cluster: the default placement of ranks.
        notes: free text (how it was measured).
    """

    name: str
    paths: Mapping[str, LinkCost]
    gamma: float = 0.0
    copy: float = 0.0
    models: Mapping[str, ModelProfile] = field(default_factory=dict)
    cluster: Cluster = field(default_factory=Cluster)
    notes: str = ""

    @staticmethod
    def key(model: str, batch_size: int, concurrency: int = 1) -> str:
        """The key of a model profile: ``"widemlp@64x4"`` (model, batch size, processes at once)."""
        return f"{model}@{batch_size}x{concurrency}"

    def path(self, name: str) -> LinkCost:
        """The parameters of path ``name``.

        Raises:
            ConfigError: the profile has no such path, listing those it has.
        """
        try:
            return self.paths[name]
        except KeyError:
            raise ConfigError(
                f"the machine profile {self.name!r} has no path {name!r} (it has {', '.join(sorted(self.paths))}); "
                "run 'paratrain profile' with that path, or add it to the JSON by hand"
            ) from None

    def link(self, name: str, concurrency: int = 1, *, fallback: str | None = None) -> LinkCost:
        """Path ``name`` as ``concurrency`` processes at once see it: ``"name@N"`` where measured, else the
        ``"name@M"`` measured with the nearest M >= 2 (the load of several processes, of another size), else the
        same for ``fallback``, else ``name`` (an idle machine's ping-pong, or a described cluster's path), else
        ``fallback``. One process (``concurrency`` 1) takes the idle path.

        Raises:
            ConfigError: none of them is in the profile.

        Example:
            >>> m = MachineProfile("m", {"ipc": LinkCost(1e-4, 1e-9), "ipc@4": LinkCost(1e-3, 2e-9)})
            >>> [m.link("ipc", n).alpha for n in (1, 2, 4, 64)], m.link("injected", 4, fallback="ipc").alpha
            ([0.0001, 0.001, 0.001, 0.001], 0.001)
        """
        for base in (name, fallback):
            if base is None or concurrency < 2:
                continue
            measured = [int(n) for b, _, n in (k.rpartition("@") for k in self.paths) if b == base and n.isdigit()]
            usable = [m for m in measured if m >= 2]
            if usable:
                nearest = min(usable, key=lambda m: (abs(m - concurrency), m))
                return self.paths[f"{base}@{nearest}"]
        return self.path(name if name in self.paths or fallback is None else fallback)

    def model(self, model: str, batch_size: int, concurrency: int = 1) -> ModelProfile:
        """The profile of ``model`` at ``batch_size`` measured with ``concurrency`` processes.

        Raises:
            ConfigError: not profiled, with the command that profiles it.
        """
        found = self.models.get(self.key(model, batch_size, concurrency))
        if found is None:
            raise ConfigError(
                f"the machine profile {self.name!r} has no profile of model {model!r} at batch {batch_size} with "
                f"{concurrency} processes at once (it has {', '.join(sorted(self.models)) or 'none'}); run "
                f"'paratrain profile --model {model} --batch-size {batch_size} --workers {concurrency}'"
            )
        return found

    def with_model(self, profile: ModelProfile) -> MachineProfile:
        """A copy with ``profile`` added (or replaced)."""
        models = dict(self.models)
        models[self.key(profile.model, profile.batch_size, profile.concurrency)] = profile
        return MachineProfile(self.name, self.paths, self.gamma, self.copy, models, self.cluster, self.notes)

    # -- JSON ----------------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_json`)."""
        return {
            "format": FORMAT,
            "name": self.name,
            "paths": {k: {f: x for f, x in asdict(v).items() if x is not None} for k, v in sorted(self.paths.items())},
            "gamma": self.gamma,
            "copy": self.copy,
            "models": {k: asdict(v) for k, v in sorted(self.models.items())},
            "cluster": asdict(self.cluster),
            "notes": self.notes,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> MachineProfile:
        """Reads :meth:`to_json`'s format.

        Raises:
            ConfigError: another format version or a malformed field, saying which.
        """
        if data.get("format") != FORMAT:
            raise ConfigError(
                f"machine profile format {data.get('format')!r} is not {FORMAT}; measure it again with 'paratrain "
                "profile'"
            )
        try:
            paths = {k: LinkCost(**v) for k, v in data["paths"].items()}  # ingress_beta: optional
            models = {}
            for k, v in data.get("models", {}).items():
                layers = tuple(
                    LayerCost(
                        name=layer["name"],
                        forward_s=layer["forward_s"],
                        backward_s=layer["backward_s"],
                        params=tuple(layer.get("params", ())),
                        param_bytes=tuple(layer.get("param_bytes", ())),
                        output_bytes=layer.get("output_bytes", 0),
                        out_features=layer.get("out_features", 0),
                        in_features=layer.get("in_features", 0),
                        module=layer.get("module", -1),
                        channels=tuple(layer.get("channels", (0, 0))),
                        split_s={k: (float(f), float(b)) for k, (f, b) in layer.get("split_s", {}).items()},
                        heads=layer.get("heads", 0),
                    )
                    for layer in v["layers"]
                )
                models[k] = ModelProfile(
                    model=v["model"],
                    batch_size=v["batch_size"],
                    layers=layers,
                    optimizer_s=v.get("optimizer_s", 0.0),
                    concurrency=v.get("concurrency", 1),
                    overhead_s=v.get("overhead_s", 0.0),
                    straggle_s=v.get("straggle_s", 0.0),
                    modules=v.get("modules", 0),
                    alone_s=v.get("alone_s", 0.0),
                    input_bytes=v.get("input_bytes", 0),
                    call_s=v.get("call_s", 0.0),
                )
            return MachineProfile(
                name=data["name"],
                paths=paths,
                gamma=data.get("gamma", 0.0),
                copy=data.get("copy", 0.0),
                models=models,
                cluster=Cluster(**data.get("cluster", {})),
                notes=data.get("notes", ""),
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed machine profile: {exc!r}") from None

    def save(self, path: str | pathlib.Path) -> None:
        """Writes the profile as JSON."""
        pathlib.Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def load(path: str | pathlib.Path) -> MachineProfile:
        """Reads a profile written by :meth:`save` (or by hand).

        Raises:
            ConfigError: the file is missing or malformed, saying what to do.
        """
        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError(f"no machine profile at {str(p)!r}; make one with 'paratrain profile --out {p}'")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{str(p)!r} is not JSON: {exc}") from None
        return MachineProfile.from_json(data)
