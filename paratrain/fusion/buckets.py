"""Tensor fusion as a pure plan: which parameters share a bucket (one message), and when a bucket may start.

Sending every gradient on its own pays one latency per tensor (a ResNet-50 has 161 of them); sending all of
them at once waits for the whole backward pass. Horovod's *tensor fusion* and DDP's buckets sit in between:
consecutive gradients are packed into flat buffers of at most ``bucket_bytes``, and a buffer is sent as soon
as all of its gradients exist, while backward computes the rest (Poseidon's wait-free backprop).

Backward produces gradients roughly in reverse registration order (the last layer first), so the plan walks
the parameters from the last to the first::

    registration order     p0 p1 p2 p3 p4 p5          (p5 is the output layer)
    gradients ready        p5 p4 p3 p2 p1 p0  --->  time
    buckets                [p5 p4] [p3 p2] [p1 p0]
    messages                     |==b0==|==b1==|==b2==|   b0 leaves while p3..p0 are still computed

Nothing here touches torch, a network or a clock: :func:`plan_buckets` maps sizes to buckets, and
:class:`LaunchOrder` turns "parameter i is ready" events into "start bucket k" decisions. Both are tested
against exact tables, and the runtime executes exactly what they decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "LaunchOrder", "ParamInfo", "plan_buckets"]

#: Default fusion size. One message costs a fixed latency (about 0.5 ms between processes of one host, see
#: :mod:`paratrain.collectives.api`) plus its bytes over the bandwidth, so buckets much smaller than
#: ~1 MiB are latency-bound; very large buckets leave nothing to overlap (the first one only leaves once most
#: of backward is over). 4 MiB is where the measured tree/ring allreduce crossover lies; DDP uses 25 MiB and
#: Horovod 64 MiB on fast networks. Tune it with the model: a handful of buckets per step is the goal.
DEFAULT_BUCKET_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """What the plan needs to know about one parameter.

    Attributes:
        numel: number of elements.
        itemsize: bytes per element.
        kind: a label; parameters of different kinds never share a bucket (a bucket is one flat buffer, so
            one dtype on one device: use e.g. ``"float32@cpu"``).
    """

    numel: int
    itemsize: int
    kind: str

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class Bucket:
    """One fused message: parameters laid out one after the other in a flat buffer.

    Attributes:
        params: indices (into the registration-ordered parameter list) in buffer order.
        offsets: element offset of each parameter in the buffer.
        numel: elements in the buffer.
        kind: the parameters' common kind.
        group: for a unit that travels by its own scheme (a layer sent by its sufficient factors), the index of
            its group in ``plan_buckets(..., separate=...)``; -1 for a fused bucket.
    """

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    kind: str
    group: int = -1


def plan_buckets(
    params: Sequence[ParamInfo], bucket_bytes: int, *, separate: Sequence[Sequence[int]] = ()
) -> list[Bucket]:
    """Assigns parameters to buckets of at most ``bucket_bytes``, last-registered first.

    Walking the parameters in reverse registration order, each one joins the open bucket of its kind unless
    that would make it exceed ``bucket_bytes``; then the open bucket is closed and a new one starts. A
    parameter larger than ``bucket_bytes`` gets a bucket of its own. Buckets are numbered in the order they
    were opened (the order of their first gradient), as DDP does, and every rank computes the same plan from
    the same model, which is what lets ranks send buckets in one agreed order.

    A group in ``separate`` (a layer that travels by its own scheme, such as SFB) is one unit of its own, placed
    where its first parameter is met; it never joins a fused bucket, and it closes the open ones (a bucket that
    straddled it would start after it in plan order and so hold it back). The units of a hybrid step start in
    one agreed order, as fused buckets do.

    Args:
        params: the parameters in registration order (``model.parameters()`` order).
        bucket_bytes: the fusion threshold in bytes (> 0).
        separate: groups of parameter indices that each form a unit of their own (``Bucket.group`` = its index).

    Raises:
        ValueError: ``bucket_bytes`` is not a positive int, or a parameter is in two groups or in none of
            ``params``.

    Example:
        Four float32 parameters of 4 elements (16 bytes each), 32-byte buckets: the last two go first.

        >>> ps = [ParamInfo(4, 4, "f32")] * 4
        >>> [b.params for b in plan_buckets(ps, 32)]
        [(3, 2), (1, 0)]
        >>> [(b.params, b.group) for b in plan_buckets(ps, 32, separate=[(1, 2)])]
        [((3,), -1), ((2, 1), 0), ((0,), -1)]
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    group_of: dict[int, int] = {}
    for g, members in enumerate(separate):
        for index in members:
            if index in group_of or not 0 <= index < len(params):
                raise ValueError(f"parameter {index} is in two separate groups or out of range")
            group_of[index] = g
    opened: list[tuple[str, list[int], int]] = []  # (kind, members, group) in opening order
    current: dict[str, tuple[int, int]] = {}  # kind -> (its open bucket's index in `opened`, bytes so far)
    placed: dict[int, int] = {}  # group -> its unit's index in `opened`
    for index in reversed(range(len(params))):
        info = params[index]
        group = group_of.get(index)
        if group is not None:
            if group not in placed:
                placed[group] = len(opened)
                opened.append((info.kind, [], group))
                current.clear()  # a fused bucket never straddles it: it would hold the unit back (plan order)
            opened[placed[group]][1].append(index)
            continue
        slot = current.get(info.kind)
        if slot is None or slot[1] + info.nbytes > bucket_bytes:
            opened.append((info.kind, [index], -1))  # the previous open bucket of this kind (if any) is closed
            current[info.kind] = (len(opened) - 1, info.nbytes)
        else:
            opened[slot[0]][1].append(index)
            current[info.kind] = (slot[0], slot[1] + info.nbytes)
    buckets = []
    for kind, members, group in opened:
        offsets, total = [], 0
        for index in members:
            offsets.append(total)
            total += params[index].numel
        buckets.append(Bucket(params=tuple(members), offsets=tuple(offsets), numel=total, kind=kind, group=group))
    return buckets


class LaunchOrder:
    """Decides when each bucket may start: once all its parameters are ready *and* every earlier bucket started.

    Collectives are matched across ranks by call order, and hooks fire in whatever order autograd runs the
    graph, which may differ between ranks (data-dependent control flow, threads). So a bucket that is ready
    early waits for its predecessors: the buckets always start in plan order, on every rank. Parameters that
    got no gradient never become ready; :meth:`rest` starts what is left, in order, at the end of the step.

    Not thread-safe: the caller holds a lock when hooks may fire from several threads.

    Example:
        >>> order = LaunchOrder([(0, 1), (2,)])   # bucket 0 holds params 0 and 1, bucket 1 holds param 2
        >>> order.ready(2)                        # bucket 1 is complete but bucket 0 is not: wait
        []
        >>> order.ready(0), order.ready(1)        # bucket 0 completes, and bucket 1 may follow at once
        ([], [0, 1])
        >>> order.rest()
        []
    """

    def __init__(self, buckets: Sequence[Sequence[int]]) -> None:
        self._members = [tuple(b) for b in buckets]
        self._bucket_of: dict[int, int] = {}
        for k, members in enumerate(self._members):
            for param in members:
                if param in self._bucket_of:
                    raise ValueError(f"parameter {param} is in buckets {self._bucket_of[param]} and {k}")
                self._bucket_of[param] = k
        self._missing = [len(m) for m in self._members]
        self._seen: set[int] = set()
        self._next = 0

    @property
    def launched(self) -> int:
        """How many buckets have started this step (they are buckets ``0 .. launched - 1``)."""
        return self._next

    @property
    def complete(self) -> bool:
        """True once every bucket has started."""
        return self._next == len(self._members)

    def is_ready(self, param: int) -> bool:
        """True if ``param`` was reported ready this step."""
        return param in self._seen

    def ready(self, param: int) -> list[int]:
        """Records that ``param``'s gradient is final; returns the buckets to start now, in order.

        Raises:
            KeyError: ``param`` is in no bucket.
            ValueError: ``param`` was already reported this step, or its bucket already started.
        """
        bucket = self._bucket_of[param]
        if param in self._seen or bucket < self._next:
            raise ValueError(f"parameter {param} reported ready twice in one step")
        self._seen.add(param)
        self._missing[bucket] -= 1
        start = self._next
        while self._next < len(self._members) and self._missing[self._next] == 0:
            self._next += 1
        return list(range(start, self._next))

    def rest(self) -> list[int]:
        """Starts every bucket not started yet (with whatever gradients exist); returns them in order."""
        start, self._next = self._next, len(self._members)
        return list(range(start, self._next))

    def reset(self) -> None:
        """Begins a new step: no parameter is ready, no bucket started."""
        self._missing = [len(m) for m in self._members]
        self._seen.clear()
        self._next = 0
