"""The executor of data plans: iterates one rank's actions (:mod:`paratrain.plan.ir`) over an :class:`.Exchange`.

Every socket collective's data phase runs here, so what a rank sends is exactly its plan: the ring, chain,
tree, direct and hierarchical schedules differ only in the actions :mod:`.lower` gives them. Sends borrow
slices of the caller's arrays (zero-copy); a slice is written again only after the sends reading it released
it (the plan's dependencies say which); received frames are read-only views, reduced or copied straight into
the destination, or forwarded as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.collectives.exchange import Exchange
from paratrain.collectives.ops import Reducer
from paratrain.plan.ir import Action, Operand, Received, Slice
from paratrain.transport.base import Handle
from paratrain.transport.wire import Message

__all__ = ["Buffers", "run_actions"]

#: Arrays by buffer name (``"src"``, ``"dst"``, ``"own"``), or lists of arrays (``"gathered"``).
Buffers = Mapping[str, "npt.NDArray[Any] | Sequence[npt.NDArray[Any] | None]"]


def run_actions(
    ex: Exchange,
    actions: Sequence[Action],
    buffers: Buffers,
    reducer: Reducer | None,
    dtype: np.dtype[Any],
    *,
    start: int = 0,
) -> None:
    """Executes ``actions[start:]`` in order, then waits until no send reads a buffer. Blocks.

    ``start`` skips a prefix another executor ran (the agreement); dependencies on it are taken as met.

    Raises:
        CommTimeoutError, PeerLostError, MessageError: as :class:`.Exchange`'s calls.
    """
    posted: dict[int, tuple[Handle[Message], int, int]] = {}  # recv action -> (handle, peer, items)
    received: dict[int, npt.NDArray[Any]] = {}
    sending: dict[int, Handle[None]] = {}

    def operand(op: Operand | None) -> npt.NDArray[Any]:
        if isinstance(op, Received):
            return received[op.action]
        assert isinstance(op, Slice)
        buf = buffers[op.buffer]
        if isinstance(buf, np.ndarray):
            return buf[op.start : op.stop]
        block = buf[op.index]
        assert block is not None
        return block[op.start : op.stop]

    for i in range(start, len(actions)):
        a = actions[i]
        for d in a.deps:
            if d in sending:
                ex.wait_sent(sending.pop(d))
            elif d in posted:
                handle, peer, items = posted.pop(d)
                received[d] = ex.recv_array(handle, peer, items, dtype)
        kind = a.kind
        if kind == "send":
            sending[i] = ex.send(a.peer, [operand(a.data)])
        elif kind == "recv":
            posted[i] = (ex.post(a.peer), a.peer, a.items)
        elif kind == "reduce":
            assert reducer is not None and a.out is not None
            reducer.combine(operand(a.data), operand(a.other), operand(a.out))
        elif kind == "copy":
            assert a.out is not None
            np.copyto(operand(a.out), operand(a.data))
        else:
            assert reducer is not None and a.out is not None
            reducer.finish(operand(a.out), a.divide_by)
    ex.finish()
