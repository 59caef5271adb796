"""A model's layers as the SFB cost model sees them, and this job's hybrid plan (torch side of :mod:`.sfb`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.sfb.cost import HybridPlan, LayerShape, choose_schemes
from paratrain.strategy.spec import StrategySpec
from paratrain.torch.sfb import linear_layers

__all__ = ["model_layers", "plan_layers"]


def model_layers(model: torch.nn.Module) -> tuple[list[LayerShape], dict[str, torch.nn.Linear]]:
    """Every module that owns trained parameters, as a :class:`LayerShape` (fully connected where SFB can carry
    it, see :func:`~paratrain.torch.sfb.linear_layers`), in the model's order; and those Linear modules by name.
    The root module's own parameters are called ``"(root)"``."""
    linear = dict(linear_layers(model))
    shapes: list[LayerShape] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if not own:
            continue
        label = name or "(root)"
        itemsize = own[0].element_size()
        if name in linear:
            fc = linear[name]
            shapes.append(
                LayerShape.linear(label, fc.out_features, fc.in_features, bias=fc.bias is not None, itemsize=itemsize)
            )
        else:
            shapes.append(LayerShape(label, sum(p.numel() for p in own), itemsize=itemsize))
    return shapes, linear


def plan_layers(
    model: torch.nn.Module,
    spec: StrategySpec,
    context: Context,
    *,
    batch_size: int | None,
    overrides: Mapping[str, str] | None,
    compression: str | None = None,
) -> tuple[HybridPlan, list[tuple[str, torch.nn.Linear]]]:
    """The hybrid plan of ``spec`` for ``model`` in this job, and the Linear modules it sends by SFB.

    ``poseidon[:allreduce]`` asks the cost model (:func:`~paratrain.sfb.choose_schemes`) with this job's workers,
    servers and, under the fault injector, its emulated latency and bandwidth; ``sfb`` sends every Linear layer
    it can by SFB. ``overrides`` (layer name -> ``"sfb"``, ``"ps"``, ``"allreduce"`` or ``"dense"``) wins.

    Raises:
        ConfigError: ``poseidon`` without a batch size, an override that names no layer or asks for a scheme the
            layer cannot take.
    """
    dense = spec.dense or "allreduce"
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"batch_size must be a positive int (a worker's samples per step), got {batch_size!r}")
    if spec.chooses_layers and batch_size is None:
        raise ConfigError(
            "strategy 'poseidon' chooses each layer's scheme from the batch size: pass batch_size= (samples per "
            "worker and step; rows through each Linear layer)"
        )
    shapes, linear = model_layers(model)
    forced = {} if spec.chooses_layers else dict.fromkeys(linear, "sfb")
    names = [shape.name for shape in shapes]
    for name, scheme in (overrides or {}).items():
        if name not in names:
            raise ConfigError(f"no layer named {name!r} has trained parameters; layers: {', '.join(names)}")
        if scheme not in ("sfb", "ps", "allreduce", "dense"):
            raise ConfigError(f"layer {name!r}: scheme {scheme!r} is not one of sfb, ps, allreduce, dense")
        if scheme not in ("sfb", "dense") and scheme != dense:
            raise ConfigError(
                f"layer {name!r}: scheme {scheme!r} is not available under {str(spec)!r}, whose dense scheme is "
                f"{dense!r}; write 'sfb' or 'dense'"
            )
        if scheme == "sfb" and name not in linear:
            raise ConfigError(
                f"layer {name!r} cannot travel by SFB: only torch.nn.Linear layers with their own trained weight "
                f"can ({', '.join(linear) or 'this model has none'})"
            )
        forced[name] = scheme
    latency, bandwidth = 0.0, None
    faults = context.settings.faults
    if faults:
        from paratrain.transport.faults import FaultSpec

        network = FaultSpec.parse(faults)
        latency, bandwidth = network.latency, network.bandwidth
    try:
        plan = choose_schemes(
            shapes,
            workers=context.world_size,
            batch=batch_size or 0,
            dense=dense,
            servers=context.settings.num_servers if dense == "ps" else 0,
            overrides=forced,
            latency=latency,
            bandwidth=bandwidth,
            allreduce_algorithm=context.collectives.choose_allreduce,
            compression=compression,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    chosen = [(c.layer.name, linear[c.layer.name]) for c in plan.choices if c.scheme == "sfb"]
    return plan, chosen
