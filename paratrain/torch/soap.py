"""Per-layer tensor parallelism for torch: a chain's linear layers and convolutions split over a tensor-parallel
group, data parallel across groups (FlexFlow's parameter and sample dimensions; Megatron-LM's column- and
row-parallel layers).

    mesh = Mesh.for_workers(ctx.world_size, tensor=2)
    model = parallelize(build_model("mlp", side=8, classes=10), {"1": "column", "3": "row"}, ctx, mesh)
    loss = loss_fn(model(x[model.rows(len(x))]), y[model.rows(len(y))])   # this data part's rows
    loss.backward()
    model.average_gradients()                                              # over the data-parallel group
    optimizer.step()

Each split layer keeps only its part of the weights (a column split: its output features' or channels' part; a
row split: its input features' or channels' part, and the bias on the group's first worker). Between layers the moves of
:func:`paratrain.soap.plan_chain` run as autograd functions: forward the move of the activation, backward the move
of its gradient, both over the tensor-parallel group's collectives. Any configuration computes what the unsplit
model computes, up to the order of float additions.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from paratrain.launch.kills import kill_point
from paratrain.runtime.context import Context
from paratrain.runtime.group import Group
from paratrain.soap import (
    BLOCK_SPLIT,
    SEQUENCE_SPLIT,
    VOCAB_SPLIT,
    ChainPlan,
    LayerShape,
    Mesh,
    OpSpec,
    SoapConfig,
    SoapConfigError,
    check_splits,
    megatron_splits,
    plan_chain,
)
from paratrain.torch.soap_blocks import SplitBlock, SplitEmbed, SplitHead, block_shape, vocab_shape
from paratrain.torch.soap_moves import _Boundary, _channels_first, _part

__all__ = ["SoapModel", "SplitLayer", "chain_layers", "check_configuration", "parallelize", "splits_of"]

#: Modules that act on each feature (or channel) alone: they may read a shard of the features or channels.
ELEMENTWISE = (
    nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.Identity, nn.MaxPool2d, nn.AvgPool2d,
)  # fmt: skip


def _per_channel(module: nn.Module) -> bool:
    """Whether ``module`` may read a shard of dimension 1: an element-wise or per-channel module, or a Flatten from
    dimension 1 (equal channel shards flatten into equal, consecutive feature shards)."""
    if isinstance(module, nn.Flatten):
        return module.start_dim == 1 and module.end_dim == -1
    return isinstance(module, ELEMENTWISE)


def _splittable(module: nn.Module) -> LayerShape | None:
    """The dimensions a split of ``module`` cuts (features, a convolution's channels, a transformer block's heads);
    None if it does not split (only linear layers, ungrouped 2-d convolutions and transformer blocks do)."""
    if isinstance(module, nn.Linear):
        return LayerShape(module.in_features, module.out_features)
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        return LayerShape(module.in_channels, module.out_channels)
    return block_shape(module) or vocab_shape(module)


class SplitLayer(nn.Module):
    """This worker's part of a linear layer or 2-d convolution split ``column`` (output features or channels),
    ``row`` (input features or channels) or kept ``replicated``, over ``parts`` workers of which it is ``index``.

    A weight is ``[out, in, ...]`` for both kinds, so a column part is a slice of its dimension 0, a row part of
    its dimension 1; a row part's bias is added once, by part 0, to the partial sums' total.
    """

    def __init__(self, layer: nn.Module, split: str, parts: int, index: int) -> None:
        super().__init__()
        if not isinstance(layer, nn.Linear | nn.Conv2d):
            raise TypeError(f"only linear layers and 2-d convolutions split, not {type(layer).__name__}")
        self.split, self.parts, self.index = split, parts, index
        self.has_bias = layer.bias is not None
        self._conv = (
            functools.partial(F.conv2d, stride=layer.stride, padding=layer.padding, dilation=layer.dilation)
            if isinstance(layer, nn.Conv2d)
            else None
        )
        weight = layer.weight.detach()
        bias: torch.Tensor | None = layer.bias.detach() if layer.bias is not None else None
        if split == "column":
            rows = _part(weight.shape[0], parts, index)
            weight, bias = weight[rows], bias[rows] if bias is not None else None
        elif split == "row":
            weight = weight[:, _part(weight.shape[1], parts, index)]
            bias = bias if index == 0 else None
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None
        self._shape = tuple(layer.weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._conv is not None:
            out: torch.Tensor = self._conv(x, self.weight, self.bias)
            return out
        return F.linear(x, self.weight, self.bias)

    def whole(self, group: Group, *, grads: bool = False) -> dict[str, np.ndarray[Any, Any]]:
        """The unsplit layer's ``weight`` and ``bias`` (or their gradients) from every part (collective over
        ``group``, the parts' tensor group)."""
        weight = self.weight.grad if grads else self.weight
        bias = self.bias.grad if grads and self.bias is not None else self.bias
        assert weight is not None, "no gradient yet"
        w = weight.detach()
        if self.split == "column":
            whole = {"weight": group.allgather(w.contiguous())}
            if bias is not None:
                whole["bias"] = group.allgather(bias.detach().contiguous())
        else:  # row: the weight's dimension 1 is split; the bias is the first part's
            whole = {"weight": _channels_first(group.allgather(_channels_first(w)))}
            if self.has_bias:
                mine = bias.detach() if bias is not None else torch.zeros(self._shape[0], dtype=w.dtype)
                whole["bias"] = group.broadcast(mine, root=0)
        return {k: v.contiguous().numpy().copy() for k, v in whole.items()}

    def extra_repr(self) -> str:
        return f"{list(self._shape)}, split={self.split}, part={self.index}/{self.parts}"


class SoapModel(nn.Module):
    """A chain of modules with its linear layers split, and the moves between them (see the module docstring).

    Attributes:
        plan: the chain's layouts and moves (:func:`paratrain.soap.plan_chain`).
        mesh: the workers' grid; ``tensor_group`` and ``data_group`` are this worker's groups on it.
    """

    def __init__(self, steps: Sequence[nn.Module], plan: ChainPlan, mesh: Mesh, tensor: Group, data: Group) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.plan, self.mesh = plan, mesh
        self.tensor_group, self.data_group = tensor, data
        self._boundaries = [
            _Boundary(f, b, tensor, tensor.rank) for f, b in zip(plan.forward, plan.backward, strict=True)
        ]
        self._steps = 0

    def plan_splits(self) -> dict[str, str]:
        """The layers split over the tensor group, by name, and how (``column`` or ``row``)."""
        return {
            name: step.split
            for name, step in zip(self.plan.names(), self.steps, strict=True)
            if isinstance(step, SplitLayer) and step.split != "replicated"
        } | {
            name: (SEQUENCE_SPLIT if step.sequence else BLOCK_SPLIT) if isinstance(step, SplitBlock) else VOCAB_SPLIT
            for name, step in zip(self.plan.names(), self.steps, strict=True)
            if isinstance(step, SplitBlock | SplitEmbed | SplitHead)
        }

    def rows(self, batch: int) -> slice:
        """The rows of a global batch of ``batch`` examples that this worker's data part computes."""
        if batch % self.mesh.data:
            raise SoapConfigError(f"a batch of {batch} does not split into {self.mesh.data} equal data parts")
        return _part(batch, self.mesh.data, self.data_group.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for boundary, step in zip(self._boundaries, self.steps, strict=False):
            x = step(boundary.cross(x))
        return self._boundaries[-1].cross(x)

    def average_gradients(self) -> None:
        """Sums the gradients that are shares of the whole over the tensor group (the layer norms of blocks split
        along the sequence), then averages every parameter's gradient over the data-parallel group (after
        ``backward``, once a step: ``paratrain launch --kill RANK@step=K`` fires here)."""
        self._steps += 1
        kill_point(self._steps)  # paratrain launch --kill RANK@step=K: an injected failure, at each step's end
        shares = [g for step in self.steps if isinstance(step, SplitBlock) for g in step.partial_gradients()]
        if shares:
            total = self.tensor_group.allreduce(torch.cat([g.reshape(-1) for g in shares]))
            offset = 0
            for g in shares:
                g.copy_(total[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if self.data_group.world_size == 1 or not grads:
            return
        mean = self.data_group.allreduce(torch.cat([g.reshape(-1) for g in grads]), op="mean")  # one call
        offset = 0
        for g in grads:
            g.copy_(mean[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def full_state(self, *, grads: bool = False) -> dict[str, np.ndarray[Any, Any]]:
        """Every parameter of the unsplit model (or its gradient, ``grads``), by its name there (its
        ``state_dict``'s keys). Collective over the tensor group."""
        group = self.tensor_group
        found: dict[str, np.ndarray[Any, Any]] = {}
        for where, step in zip(self.plan.names(), self.steps, strict=True):
            if isinstance(step, SplitBlock | SplitEmbed | SplitHead):
                found.update({f"{where}.{k}": v for k, v in step.whole(grads=grads).items()})
                continue
            for name, param in step.named_parameters():
                value = param.grad if grads else param
                assert value is not None, f"{where}.{name} has no gradient"
                found[f"{where}.{name}"] = value.detach().numpy().copy()
            if isinstance(step, SplitLayer) and step.split != "replicated":
                found.update({f"{where}.{k}": v for k, v in step.whole(group, grads=grads).items()})
        return found


def _layout_split(split: str, shape: LayerShape) -> str:
    """How a step lies in the chain's layouts: a transformer block, split or not, reads and writes the whole
    activation (its moves are inside it) and a whole block's input must be whole, as a replicated layer's."""
    return "replicated" if shape.kind != "layer" else split


def _chain(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The modules of nested ``nn.Sequential``s in the order they run, by qualified name (``"features.0"``)."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential):
            found += _chain(child, f"{prefix}{name}.")
        else:
            found.append((f"{prefix}{name}", child))
    return found


def chain_layers(model: nn.Module) -> list[tuple[str, LayerShape | None]]:
    """The steps of ``model`` in the order they run (nested ``nn.Sequential``s flattened), each with the shape a
    split cuts, or None for a step that does not split: what :func:`paratrain.soap.megatron_splits` takes."""
    return [(name, _splittable(module)) for name, module in _chain(model)]


def splits_of(model: nn.Module, config: SoapConfig) -> dict[str, str]:
    """The splits ``config`` gives ``model``: its own, or Megatron's pairs (``tp:N``)."""
    if config.splits is not None:
        return dict(config.splits)
    return megatron_splits(chain_layers(model), config.tensor)


def check_configuration(model: nn.Module, splits: Mapping[str, str], tensor: int) -> ChainPlan:
    """The chain's plan of ``model`` split as ``splits`` says over ``tensor`` workers, or
    :class:`SoapConfigError` saying what cannot run (what :func:`parallelize` checks, without workers: for the
    CLI before anything starts).

    Raises:
        SoapConfigError: a named layer is missing or does not split, a degree does not divide the dimension it
            splits, or a module that mixes features would read a split activation.
    """
    modules = dict(_chain(model))
    layers = {n: shape for n, m in modules.items() if (shape := _splittable(m)) is not None}
    for name in splits:
        if name in modules and name not in layers:
            raise SoapConfigError(
                f"layer {name} is a {type(modules[name]).__name__}; only linear layers, 2-d convolutions, "
                "transformer blocks, embeddings and output heads split"
            )
    check_splits(layers, splits, tensor)
    ops = [OpSpec(n, _layout_split(splits.get(n, "replicated"), layers[n]) if n in layers else None) for n in modules]
    plan = plan_chain(ops)
    for op, read in zip(ops, plan.layouts, strict=True):
        module = modules[op.name]
        if op.split is None and read.value != "replicated" and not _per_channel(module):
            raise SoapConfigError(
                f"layer {op.name} ({type(module).__name__}) mixes features but would read a {read.value} "
                "activation; keep the layer before it whole (replicated) or row-split the one after"
            )
    return plan


def _agree(ctx: Context, mesh: Mesh, splits: Mapping[str, str], layers: Mapping[str, LayerShape], problem: str) -> None:
    """Raises on every rank when any rank refused the configuration or the ranks were given different ones (a bad
    argument on some ranks is an error on all, never a wait for the others)."""
    described = json.dumps(
        [sorted(splits.items()), [mesh.tensor, mesh.data], sorted((n, s.in_features, s.out_features) for n, s in
         layers.items())]
    )  # fmt: skip
    digest = int.from_bytes(hashlib.blake2b(described.encode(), digest_size=7).digest(), "little")
    seen = np.asarray(ctx.allgather(np.array([[digest, int(bool(problem))]], dtype=np.int64)))
    if problem:
        raise SoapConfigError(problem)
    refused = [r for r in range(len(seen)) if seen[r, 1]]
    if refused:
        raise SoapConfigError(f"ranks {refused} refused this configuration (their errors say why)")
    if len(set(seen[:, 0].tolist())) > 1:
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(seen[:, 0].tolist()):
            groups.setdefault(d, []).append(r)
        raise SoapConfigError(
            f"the ranks were given different configurations or models (ranks {sorted(groups.values())} agree "
            "among themselves); give every rank the same model and splits"
        )


def _part_of(module: nn.Module, split: str, shape: LayerShape | None, group: Group) -> nn.Module:
    """This worker's step for ``module`` (its part over ``group``), or the module itself where it does not split."""
    if shape is None:
        return module
    if shape.kind == "block":
        return SplitBlock(module, group, sequence=split == SEQUENCE_SPLIT) if split != "replicated" else module
    if shape.kind == "vocab":
        if split != VOCAB_SPLIT:
            return module
        return SplitEmbed(module, group) if isinstance(getattr(module, "token", None), nn.Module) else SplitHead(
            module, group)  # fmt: skip
    return SplitLayer(module, split, group.world_size, group.rank)


def parallelize(model: nn.Sequential, splits: Mapping[str, str], ctx: Context, mesh: Mesh) -> SoapModel:
    """``model`` split as ``splits`` says (the qualified name of a linear layer or 2-d convolution, as
    ``named_modules`` gives it, ``"features.0"`` inside nested ``nn.Sequential`` modules -> ``column``, ``row`` or
    ``replicated``; unnamed layers stay replicated) over ``mesh``. Collective over the workers: every
    worker calls it with the same model (the same initial parameters) and configuration.

    Raises:
        SoapConfigError: on every rank: the mesh is not the job's size, a named layer is missing or does not
            split, a degree does not divide the dimension it splits, a module that mixes features reads a split
            activation, or the ranks were given different models or configurations.
    """
    modules = dict(_chain(model))
    layers = {n: shape for n, m in modules.items() if (shape := _splittable(m)) is not None}
    plan: ChainPlan | None = None
    try:
        if mesh.workers != ctx.world_size:
            raise SoapConfigError(
                f"a {mesh.tensor} x {mesh.data} grid needs {mesh.workers} workers; the job has {ctx.world_size}"
            )
        plan = check_configuration(model, splits, mesh.tensor)
    except SoapConfigError as exc:
        problem = str(exc)
    else:
        problem = ""
    _agree(ctx, mesh, splits, layers, problem)
    assert plan is not None  # else _agree raised
    tensor = ctx.split(lambda r: mesh.coordinates(r)[1])
    data = ctx.split(lambda r: mesh.coordinates(r)[0])
    steps = [_part_of(m, splits.get(n, "replicated"), layers.get(n), tensor) for n, m in modules.items()]
    for before, after in itertools.pairwise(steps):  # consecutive blocks split along the sequence pass shards
        if isinstance(before, SplitBlock) and isinstance(after, SplitBlock) and before.sequence and after.sequence:
            before.sharded_out = after.sharded_in = True
    return SoapModel(steps, plan, mesh, tensor, data)
