"""Exceptions of paratrain, classified by the recovery they call for.

Every message says what happened and what to do next. The classes form a small tree so that callers can
catch by recovery:

- ``ConfigError``: the job is set up wrongly (bad flag, missing variable); fix the setup and start again.
- ``TransportError`` and its children: the network failed. ``PeerLostError`` means a peer is gone for good
  (restart the job or, for elastic strategies, continue without it); ``CommTimeoutError`` means a peer did not
  answer in time (it may be slow: raise the timeout, or look for a straggler or a hang); its child
  ``DeviceTimeoutError`` means work on this rank's own GPU did not finish in time.
- ``MessageError``: a peer sent something malformed; the receiver drops it and keeps serving.
- ``RendezvousError``: the ranks could not find each other at start-up.
- ``JobFailedError``: a whole job (``paratrain train``) ended with a failed process.
- ``CollectiveMismatchError``: ranks called a collective with different shapes, dtypes or operations.
- ``NotInitializedError``: ``paratrain.init()`` was not called (or ``shutdown()`` already was).
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CommTimeoutError",
    "ConfigError",
    "DeviceTimeoutError",
    "JobFailedError",
    "JobOverError",
    "MessageError",
    "NotInitializedError",
    "ParatrainError",
    "PeerLostError",
    "RendezvousError",
    "TransportClosedError",
    "TransportError",
    "WorkDoneError",
]


class ParatrainError(Exception):
    """Base class of every error paratrain raises on purpose."""


class ConfigError(ParatrainError, ValueError):
    """A setting, flag or environment variable is missing or invalid. Fix it and start again."""


class NotInitializedError(ParatrainError, RuntimeError):
    """A call needs a running paratrain context; call ``paratrain.init()`` first."""


class TransportError(ParatrainError, RuntimeError):
    """Communication failed."""


class TransportClosedError(TransportError):
    """The local transport was closed (``shutdown()``) or crashed; no further communication is possible."""


class PeerLostError(TransportError):
    """A peer process died, crashed, or shut down while others still expected messages from it.

    Attributes:
        peer: the rank that was lost.
    """

    def __init__(self, message: str, *, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class CommTimeoutError(TransportError, TimeoutError):
    """A blocking call did not complete within its timeout.

    The peer may be slow rather than dead: raise the timeout (``PARATRAIN_TIMEOUT`` or the ``timeout=``
    argument), or look for a straggler or a rank stuck elsewhere.
    """


class DeviceTimeoutError(CommTimeoutError):
    """Work queued on an accelerator (a kernel, a copy) did not complete within the call's timeout.

    A wait on the device, not on a peer: the GPU is stuck or shared with something slow. Collectives report it
    to the other ranks as a rejected call, so every rank fails at once.
    """


class JobFailedError(ParatrainError, RuntimeError):
    """A job's processes ended with an error (their own output says why).

    Attributes:
        exit_code: the job's exit status, as the launcher reports it.
    """

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"the job failed (exit {exit_code}); see the ranks' output above")
        self.exit_code = exit_code


class WorkDoneError(ParatrainError, RuntimeError):
    """This process replaces one whose work was done when it died (it had left the parameter servers, or the others
    had finished): there is nothing left to do, and the work stands. A program may exit 0 on it."""


class MessageError(ParatrainError, ValueError):
    """A received message is malformed (bad magic, version, header or sizes). It is dropped, never executed."""


class RendezvousError(TransportError):
    """The ranks could not discover each other at start-up."""


class JobOverError(RendezvousError, WorkDoneError):
    """A restarted rank came to meet the others after one of them had finished: the job is over (its results
    stand), nothing is left to rejoin."""


class CollectiveMismatchError(ParatrainError, ValueError):
    """Ranks entered the same collective with different shapes, dtypes, roots or operations."""
