"""Horovod's elastic API (``hvd.elastic``) over paratrain's elastic jobs: ``run``, ``State``, ``ObjectState``,
``TorchState`` and ``HostsUpdatedInterrupt``, so that a Horovod elastic script runs by changing its import.

Run the script under ``paratrain launch --min-workers M`` (and ``--max-restarts R`` for replacements), as Horovod's
runs under ``horovodrun --min-np``. The training function, decorated by :func:`run`, takes a state object and
commits it now and then; what happens then is Horovod's protocol:

- a worker dies: the survivors' collectives fail (:class:`~paratrain.horovod.basics.HorovodInternalError`); each
  restores the state of its last ``commit()``, the job re-forms without the dead worker at the launcher's
  rendezvous (:func:`paratrain.runtime.context.reform`: ranks renumbered, a smaller world), every rank gets rank
  0's state (``sync``) and the function is called again;
- a worker waits to join (a replacement started by ``--max-restarts``): at the next ``commit()`` every rank agrees
  so (one small allreduce) and raises :class:`HostsUpdatedInterrupt`; the job re-forms with it, it receives rank
  0's state, and everyone goes on from the commit.

The reset callbacks (``state.register_reset_callbacks``) run after each re-forming, before ``sync``: where a
script rescales its learning rate to ``hvd.size()``. A job that is not elastic has no rendezvous to re-form at:
there, and after more re-formings than the job can have (its restarts plus its workers), the error is raised.

:class:`ElasticSampler` shards a dataset over the ranks there are and remembers what the job has processed this
epoch (``record_batch``), so that after a re-forming the rest of the epoch is shared among the new ranks and
nothing is seen twice; a ``TorchState`` holding it keeps it with the commits and merges every rank's record.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from paratrain.horovod import basics
from paratrain.horovod.basics import HorovodInternalError
from paratrain.horovod.functions import broadcast_optimizer_state, broadcast_parameters
from paratrain.horovod.objects import allgather_object, broadcast_object
from paratrain.launch.restarts import read_join_round

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]

log = logging.getLogger("paratrain.horovod")

T = TypeVar("T")


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 (Horovod's name)
    """Raised on every rank at a ``commit()`` when a worker waits to join: the job re-forms with it.

    Attributes:
        skip_sync: the state need not be broadcast after re-forming (Horovod's flag; a joiner always needs it
            here, so it is False).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("a worker waits to join the job")
        self.skip_sync = skip_sync


class State:
    """What survives a re-forming: saved at ``commit()``, restored after a failure, broadcast from rank 0 after a
    re-forming. Subclasses say what (``save``, ``restore``, ``sync``)."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called after every re-forming of the job (before the state is synchronised)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs the reset callbacks."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state, then checks whether a worker waits to join (raises :class:`HostsUpdatedInterrupt` on
        every rank if one does). Collective: every rank commits at the same points."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises :class:`HostsUpdatedInterrupt` on every rank if any rank sees a joiner waiting for a round after
        this job's (one small allreduce; made in elastic jobs only)."""
        ctx = basics.context()
        if not ctx.settings.elastic:
            return
        wanted = np.array([read_join_round(ctx.settings.scratch_dir)], dtype=np.int64)
        agreed = np.asarray(basics.run(lambda group: group.allreduce(wanted, op="max")).result())
        if int(agreed[0]) > ctx.transport.round:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Keeps a copy of the state (what :meth:`restore` returns to)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Returns the state to the last :meth:`save`."""
        raise NotImplementedError

    def sync(self) -> None:
        """Gives every rank rank 0's state. Collective."""
        raise NotImplementedError


class ObjectState(State):
    """Named values (``epoch=0, batch=0``) as attributes, saved by deep copy and synchronised as JSON
    (:func:`~paratrain.horovod.objects.broadcast_object`: numbers, strings, lists, dicts with string keys).

    Example:
        >>> s = ObjectState(epoch=0, batch=0)
        >>> s.epoch = 3
        >>> s.restore()
        >>> s.epoch
        0
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: object = None, **kwargs: Any) -> None:
        super().__init__()
        self._bcast = bcast_object if bcast_object is not None else broadcast_object
        self._names = list(kwargs)
        self._saved: dict[str, Any] = {}
        for name, value in kwargs.items():
            setattr(self, name, value)
        ObjectState.save(self)

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:  # the named values, set as attributes
            ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}

    def restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        if self._names:
            values = self._bcast({name: getattr(self, name) for name in self._names}, 0)
            for name in self._names:
                setattr(self, name, values[name])
        ObjectState.save(self)


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's elastic sampler: this rank's share of the examples the job has not processed yet this epoch.

    The unprocessed indices (shuffled by ``seed + epoch`` if ``shuffle``) are padded to a multiple of the ranks
    and dealt out, rank ``r`` taking every ``size``-th from ``r``. ``record_batch(i, n)`` marks this rank's
    batch ``i`` of ``n`` as processed; ``set_epoch`` starts an epoch afresh; after a re-forming,
    :meth:`TorchState.sync` merges every rank's record and :meth:`reset` deals the rest out again.

    Example:
        >>> s = ElasticSampler(range(10), shuffle=False, world=(0, 2))
        >>> list(s), len(s)
        ([0, 2, 4, 6, 8], 5)
        >>> s.record_batch(0, 2)
        >>> s.reset(world=(1, 3))
        >>> list(s)
        [3, 6, 9]
    """

    def __init__(
        self, dataset: Sized, shuffle: bool = True, seed: int = 0, *, world: tuple[int, int] | None = None
    ) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.rank: int = 0
        self.num_replicas: int = 0  # (0 until the first deal)
        self.num_samples: int = 0
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.reset(world=world)

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: nothing processed, a fresh order."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks this rank's batch ``batch_idx`` (of ``batch_size`` examples) as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Marks these examples as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The indices of this rank's batch ``batch_idx`` of ``batch_size``."""
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the processed indices (sorted: JSON carries it between ranks)."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Takes a :meth:`state_dict` and deals the rest of the epoch out again."""
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        self.reset()

    def reset(self, *, world: tuple[int, int] | None = None) -> None:
        """Deals the unprocessed indices out over the ranks there are now: the job's, or ``world`` = (rank, size)
        (outside a job: the last one given)."""
        if world is None:
            known = self.num_replicas > 0 and not basics.is_initialized()
            world = (self.rank, self.num_replicas) if known else (basics.rank(), basics.size())
        self.rank, self.num_replicas = world
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        padded = remaining + remaining[: self.num_samples * self.num_replicas - len(remaining)]
        self.indices = padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples


class TorchState(ObjectState):
    """A model's and an optimizer's state (by their ``state_dict``), :class:`ElasticSampler` values by theirs (the
    ranks' records merged at ``sync``), and other named values as :class:`ObjectState`: Horovod's
    ``hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0)``."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self._model_saved: dict[str, Any] | None = None
        self._optimizer_saved: dict[str, Any] | None = None
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        self._samplers_saved: dict[str, dict[str, Any]] = {}
        for name, sampler in self._samplers.items():
            object.__setattr__(self, name, sampler)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._samplers})
        self._save_torch()

    def _save_torch(self) -> None:
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())
        self._samplers_saved = {name: sampler.state_dict() for name, sampler in self._samplers.items()}

    def save(self) -> None:
        self._save_torch()
        super().save()

    def restore(self) -> None:
        if self.model is not None and self._model_saved is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None and self._optimizer_saved is not None:
            self.optimizer.load_state_dict(self._optimizer_saved)
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._samplers_saved[name])
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for sampler in self._samplers.values():  # what any rank processed is processed; rank 0's epoch
            merged = sorted(set().union(*(set(r) for r in allgather_object(sorted(sampler.processed_indices)))))
            sampler.load_state_dict(broadcast_object({"epoch": sampler.epoch, "processed_indices": merged}, 0))
        super().sync()
        self._save_torch()


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorates a training function ``func(state, ...)`` with Horovod's elastic loop (see the module docstring):
    the state synchronised first, the function called again after each re-forming of the job."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        resets, skip_sync = 0, False
        while True:
            if resets:
                _reform()
                state.on_reset()
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                if not _may_reform(resets, exc):
                    raise
                log.warning("rank %d: %s; restoring the last commit and re-forming the job", basics.rank(), exc)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            resets += 1

    return wrapper


def _may_reform(resets: int, exc: BaseException) -> bool:
    """Whether a failed collective is met by re-forming: in an elastic or restarting job, at most as many times
    as it can lose and regain workers (a mismatch that fails every time ends after that)."""
    settings = basics.context().settings
    if not settings.resilient:
        log.error("rank %d: %s (not an elastic job: start it with paratrain launch --min-workers)", basics.rank(), exc)
        return False
    return resets < settings.max_restarts + settings.job_workers + 1


def _reform() -> None:
    """The job re-formed at the launcher's rendezvous with whoever is alive and waiting, and Horovod's engine
    started again on it (:func:`paratrain.horovod.basics.reform`)."""
    basics.reform()
