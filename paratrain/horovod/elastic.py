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
Not here: Horovod's ``ElasticSampler`` (shard the data by ``hvd.rank()``/``hvd.size()`` after each reset).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from paratrain.horovod import basics
from paratrain.horovod.basics import HorovodInternalError
from paratrain.horovod.functions import broadcast_optimizer_state, broadcast_parameters
from paratrain.horovod.objects import broadcast_object
from paratrain.launch.restarts import read_join_round

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]

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


class TorchState(ObjectState):
    """A model's and an optimizer's state (by their ``state_dict``), and named values as :class:`ObjectState`:
    Horovod's ``hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)``."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self._model_saved: dict[str, Any] | None = None
        self._optimizer_saved: dict[str, Any] | None = None
        super().__init__(**kwargs)
        self._save_torch()

    def _save_torch(self) -> None:
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())

    def save(self) -> None:
        self._save_torch()
        super().save()

    def restore(self) -> None:
        if self.model is not None and self._model_saved is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None and self._optimizer_saved is not None:
            self.optimizer.load_state_dict(self._optimizer_saved)
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
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
