"""The interface of what a step does with its fused gradients (:class:`Strategy`), apart from the strategies.

Every strategy sees the same three calls from :class:`~paratrain.torch.DistributedOptimizer`, always in this
order on every rank::

    launch(0) launch(1) ... launch(B-1)     during backward, from the hooks (bucket order, never hook order)
    finish()                                 in step(): wait for what was launched
    apply(optimizer)                         in step(): update the parameters

A wrapper (:mod:`paratrain.strategy.wrappers`) decorates a built strategy: :meth:`Strategy.compressed` gives
the strategy that sends the same buckets compressed; ``reliable=`` (:mod:`.resilient`) takes any strategy whose
update follows an averaged gradient. Their own module, so that the decorators and the strategies import it and
not each other.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from paratrain.compression import Compressor
from paratrain.errors import ConfigError
from paratrain.torch.fusion import FusedBucket

__all__ = ["Strategy"]


class Strategy(abc.ABC):
    """What the optimizer does with the buckets of a step (see the module docstring for the call order)."""

    #: :meth:`launch` leaves the bucket's buffer unread on the caller's thread and has its communication wait for
    #: the bucket's CUDA copies (:meth:`FusedBucket.staged`) itself; otherwise the optimizer waits for them first
    waits_for_staging = False

    def __init__(self, buckets: Sequence[FusedBucket]) -> None:
        self.buckets = list(buckets)

    @abc.abstractmethod
    def launch(self, k: int) -> None:
        """Starts sending bucket ``k``, whose gradients are all taken. Must not block on the network."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Waits until every launched bucket is sent (and, for allreduce, writes the results into the grads)."""

    @abc.abstractmethod
    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Updates the parameters after :meth:`finish`."""

    def close(self) -> None:  # noqa: B027 (a hook, empty by default)
        """Releases what the strategy holds; the default has nothing to release."""

    @property
    def resumed_step(self) -> int:
        """The steps a restarted worker's predecessor completed, where this process goes on (0: a first process;
        parameter servers, :mod:`paratrain.ps.rejoin`)."""
        return 0

    def compressed(self, compressor: Compressor, optimizer: torch.optim.Optimizer) -> Strategy:
        """This strategy sending its buckets compressed (``compression=``), before any bucket was launched.

        Raises:
            ConfigError: the strategy sends nothing a compressor could compress (the default).
        """
        raise ConfigError(f"{type(self).__name__} sends no gradients; compression {compressor.name!r} cannot apply")
