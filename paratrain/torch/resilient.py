"""Data parallelism that survives a crashed worker: gradients through :class:`~paratrain.recovery.Reliable`.

A decorator of a built allreduce strategy, or of a hybrid one whose dense part is allreduce (``sfb``,
``poseidon:allreduce``): ``reliable=``'s wrapper, :mod:`paratrain.strategy.wrappers`. Update rule: exactly the
base's (each bucket's gradients averaged over the workers, an SFB layer's rebuilt from every worker's factors,
then the wrapped optimizer's step on every rank), so a run with ``reliable=`` computes the same parameters as one
without, to the bit, as long as the same allreduce algorithm runs. What differs is *when* the buckets travel: a reliable
operation must be replayable, so each is one synchronous, numbered call made in ``step()``, after backward,
instead of an asynchronous one started by backward's hooks. The price is the overlap of communication with
backward (on a small model like the digits MLP, a few per cent of a step; measured in ``benchmarks/recovery``).

Also here: the model and optimizer state as named arrays (:func:`training_state`) and back
(:func:`restore_training_state`), which is what :meth:`Reliable.checkpoint` keeps and a restarted rank loads;
and the reliable twin of ``broadcast_parameters``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from paratrain.recovery.reliable import Checkpoint, Reliable
from paratrain.torch.bucket_strategy import Strategy
from paratrain.torch.fusion import FusedBucket
from paratrain.torch.hybrid import HybridStrategy
from paratrain.torch.sfb import SfbLayer

__all__ = [
    "ReliableAllreduceStrategy",
    "parameters_digest",
    "reliable_broadcast_parameters",
    "restore_training_state",
    "training_state",
]


class ReliableAllreduceStrategy(Strategy):
    """The allreduce strategy ``base`` whose buckets go through a :class:`Reliable` (see the module docstring).

    Args:
        base: the strategy decorated: its buckets (in plan order) are averaged here, a hybrid's SFB layers'
            factors gathered here (its units in plan order), its ``apply`` and ``close`` are kept (it never
            launches anything itself).
        reliable: the reliable collectives (they replace the context after a failure).
    """

    def __init__(self, base: Strategy, reliable: Reliable) -> None:
        super().__init__(base.buckets)
        self.base = base
        self.reliable = reliable
        self.units: list[FusedBucket | SfbLayer] = (
            list(base.units) if isinstance(base, HybridStrategy) else list(base.buckets)
        )
        self._done: list[torch.Tensor] = []  # this step's results (means, gathered rows), kept across a regroup

    def launch(self, k: int) -> None:
        """Nothing starts during backward: every unit is one numbered operation, made in :meth:`finish`."""

    def finish(self) -> None:
        """Averages every bucket and rebuilds every SFB layer's gradient from the gathered factors, in plan
        order, into ``param.grad``.

        In an elastic job whose members change during unit k, :class:`~paratrain.recovery.RegroupedError`
        leaves here; the units before k keep their results (they are complete: every rank of the old job
        took part), and the call after the program recomputed its gradients for the new job resumes at k.
        """
        for k, unit in enumerate(self.units):
            if k < len(self._done):
                done = self._done[k]
            elif isinstance(unit, SfbLayer):
                done = torch.from_numpy(self.reliable.allgather(unit.take_rows().cpu().numpy()))
                self._done.append(done)
            else:
                done = torch.from_numpy(self.reliable.allreduce(unit.buffer.numpy(), op="mean"))
                self._done.append(done)
            if isinstance(unit, SfbLayer):
                unit.rebuild(done, self.reliable.ctx.world_size)
            else:
                unit.give(done)
        self._done = []

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """The base's update: the wrapped optimizer on the averaged gradients (identically on every rank)."""
        self.base.apply(optimizer)

    def close(self) -> None:
        """Closes the base."""
        self.base.close()


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, npt.NDArray[Any]]:
    """The model's parameters and buffers and the optimizer's per-parameter tensors, as named numpy arrays.

    Names: ``model.<name>`` and ``optim.<index>.<key>`` (the index in the optimizer's ``state_dict``). Scalars
    of the optimizer state that are not tensors (none for SGD or Adam in torch 2) are not kept. ``optimizer``
    None: a model with nothing to train (a pipeline stage of activations alone).
    """
    state = {f"model.{name}": t.detach().cpu().numpy() for name, t in _tensors(model)}
    if optimizer is None:
        return state
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                state[f"optim.{index}.{key}"] = value.detach().cpu().numpy()
    return state


@torch.no_grad()
def restore_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ckpt: Checkpoint) -> None:
    """Loads what :func:`training_state` saved into ``model`` and ``optimizer``, in place.

    Raises:
        KeyError: the checkpoint lacks a tensor of the model (another model was checkpointed).
    """
    arrays = ckpt.arrays
    for name, t in _tensors(model):
        t.copy_(torch.from_numpy(np.asarray(arrays[f"model.{name}"])))
    if optimizer is None:
        return
    saved = optimizer.state_dict()
    per_param: dict[int, dict[str, Any]] = {}
    for name, value in arrays.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            per_param.setdefault(int(index), {})[key] = torch.from_numpy(np.array(value, copy=True))
    saved["state"] = per_param
    optimizer.load_state_dict(saved)


@torch.no_grad()
def reliable_broadcast_parameters(model: torch.nn.Module, reliable: Reliable, root: int = 0) -> None:
    """Every rank's parameters and buffers become ``root``'s, one reliable broadcast per dtype (replayable)."""
    tensors = [t for _, t in _tensors(model)]
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in group])
        got = torch.from_numpy(reliable.broadcast(flat.numpy(), root=root))
        offset = 0
        for t in group:
            t.copy_(got[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()


def parameters_digest(state: Mapping[str, npt.NDArray[Any]] | torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes in name order: equal digests mean bitwise-equal models."""
    arrays = (
        {name: t.detach().cpu().numpy() for name, t in _tensors(state)}
        if isinstance(state, torch.nn.Module)
        else dict(state)
    )
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()
