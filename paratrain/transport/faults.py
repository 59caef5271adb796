"""A transport wrapper that injects latency, per-node bandwidth limits, message drops and crashes.

It wraps any transport, so experiments and fault tests exercise the production code paths unchanged (no
subclass copies production code to break it). The network model is per node, as in a cluster where every
host has one link to a switch:

* **egress**: a node's outgoing messages share its link. A message of ``n`` bytes occupies it for
  ``n / bandwidth`` seconds after the previous one leaves, then arrives ``latency`` seconds later;
* **ingress**: a node's incoming messages also share its link. A message becomes visible to the receiver no
  sooner than ``n / bandwidth`` after the previous one did. A single flow is not slowed twice (its arrivals
  are already spaced by the sender's link), but many senders into one node — workers into a parameter
  server — share that node's bandwidth, which is the hot spot that decentralized training avoids.

* **links** (``links=FILE``): pairs of ranks joined by a link of their own (a cable, or a path through a
  slower network), with its own bandwidth and latency, one queue per direction; their messages use that link
  instead of the nodes' (how uneven clusters are built on one machine). The file is JSON::

      {"links": [{"between": [0, 1], "bandwidth": "100Mbit", "latency": "2ms"}, ...]}

  (``bandwidth`` omitted: unlimited; numbers are bytes per second and seconds). Pairs not listed use the nodes'
  links.

Drops lose a data message silently (the receiver's timeout then fires). A crash aborts the inner transport
after a given number of sends, so peers see a real lost connection. Randomness is seeded: the same seed and the
same sequence of sends drop the same messages.

Spec strings (``PARATRAIN_FAULTS`` or ``paratrain ... --faults``) are comma-separated ``key=value``:
``latency=2ms,bandwidth=100Mbit,drop=0.01,seed=7,crash_after=100,links=links.json``.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from paratrain._arrays import as_numpy_view, is_torch_tensor, wire_array
from paratrain.config import parse_duration
from paratrain.device import on_device, to_host
from paratrain.errors import ConfigError, TransportClosedError
from paratrain.transport.base import ANY_SOURCE, ANY_TAG, Handle, Transport, TransportWrapper
from paratrain.transport.wire import Message

__all__ = ["FaultSpec", "FaultyTransport", "Link", "parse_bandwidth", "read_links"]

_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)(bit|bps|b|B|B/s|Bps)?\s*$")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_bandwidth(text: str) -> float:
    """Parses ``"100Mbit"``, ``"1Gbit"``, ``"50MB"`` (bytes) into bytes per second.

    Example:
        >>> parse_bandwidth("100Mbit")
        12500000.0
    """
    match = _BANDWIDTH.match(text)
    if match is None:
        raise ConfigError(f"{text!r} is not a bandwidth; write e.g. 100Mbit, 1Gbit or 50MB (bytes per second)")
    value = float(match.group(1)) * _SCALE[match.group(2).lower()]
    unit = match.group(3) or "B"
    if unit in ("bit", "bps", "b"):
        value /= 8.0
    if value <= 0:
        raise ConfigError(f"bandwidth {text!r} must be positive")
    return value


@dataclass(frozen=True, slots=True)
class Link:
    """A link of its own between ranks ``a`` and ``b``: ``bandwidth`` bytes per second each way (None:
    unlimited) and ``latency`` seconds one way."""

    a: int
    b: int
    bandwidth: float | None
    latency: float

    def __post_init__(self) -> None:
        if self.a == self.b or min(self.a, self.b) < 0:
            raise ConfigError(f"a link joins two different ranks, got {self.a} and {self.b}")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ConfigError(f"link {self.a}-{self.b}: bandwidth must be positive, got {self.bandwidth}")
        if self.latency < 0:
            raise ConfigError(f"link {self.a}-{self.b}: latency must be >= 0, got {self.latency}")


def read_links(path: str) -> tuple[Link, ...]:
    """The links of a JSON file (see the module docstring), checked.

    Raises:
        ConfigError: the file is missing, not JSON, or an entry is malformed (which one, and why).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"links file {path!r}: {exc}") from None
    entries = doc.get("links") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f'links file {path!r}: expected {{"links": [{{"between": [A, B], ...}}, ...]}}')
    links: list[Link] = []
    seen: set[frozenset[int]] = set()
    for i, entry in enumerate(entries):
        between = entry.get("between") if isinstance(entry, dict) else None
        if not (isinstance(between, list) and len(between) == 2 and all(type(r) is int for r in between)):
            raise ConfigError(f"links file {path!r}, entry {i}: 'between' must be two ranks, got {between!r}")
        bandwidth, latency = entry.get("bandwidth"), entry.get("latency", 0.0)
        try:
            bw = None if bandwidth is None else _number(bandwidth, parse_bandwidth)
            lat = _number(latency, parse_duration)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"links file {path!r}, entry {i}: {exc}") from None
        link = Link(between[0], between[1], bw, lat)
        if frozenset(between) in seen:
            raise ConfigError(f"links file {path!r}, entry {i}: the link {between[0]}-{between[1]} is listed twice")
        seen.add(frozenset(between))
        links.append(link)
    return tuple(links)


def _number(value: Any, parse: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{value!r} is neither a number nor a string like 100Mbit or 2ms")
    return float(value) if not isinstance(value, str) else float(parse(value))


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """What to inject.

    Attributes:
        latency: one-way delay of every message, in seconds.
        bandwidth: bytes per second of each node's link (in and out), or None for unlimited.
        drop: probability that a data message is lost.
        seed: seed of the drop decisions.
        crash_after: abort this rank's transport after this many sends (None: never).
        links: pairs of ranks with a link of their own (``links=FILE``).
    """

    latency: float = 0.0
    bandwidth: float | None = None
    drop: float = 0.0
    seed: int = 0
    crash_after: int | None = None
    links: tuple[Link, ...] = ()

    def __post_init__(self) -> None:
        if self.latency < 0:
            raise ConfigError(f"latency must be >= 0, got {self.latency}")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ConfigError(f"bandwidth must be positive, got {self.bandwidth}")
        if not 0.0 <= self.drop < 1.0:
            raise ConfigError(f"drop probability must be in [0, 1), got {self.drop}")
        if self.crash_after is not None and self.crash_after < 0:
            raise ConfigError(f"crash_after must be >= 0, got {self.crash_after}")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parses ``"latency=2ms,bandwidth=100Mbit,drop=0.01,seed=7,crash_after=100,links=FILE"``."""
        fields: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep:
                raise ConfigError(f"fault spec item {item!r} is not key=value")
            try:
                if key == "latency":
                    fields[key] = parse_duration(value)
                elif key == "bandwidth":
                    fields[key] = parse_bandwidth(value)
                elif key == "drop":
                    fields[key] = float(value)
                elif key in ("seed", "crash_after"):
                    fields[key] = int(value)
                elif key == "links":
                    fields[key] = read_links(value.strip())
                else:
                    raise ConfigError(
                        f"unknown fault {key!r}; known: latency, bandwidth, drop, seed, crash_after, links"
                    )
            except ValueError as exc:
                raise ConfigError(f"fault spec item {item!r}: {exc}") from None
        return cls(**fields)


class FaultyTransport(TransportWrapper):
    """Wraps ``inner`` and injects the faults of ``spec``. Thread-safe.

    Example:
        >>> from paratrain.transport.inproc import InprocFabric
        >>> fabric = InprocFabric(2)
        >>> slow = FaultyTransport(fabric.transport(0), FaultSpec(latency=0.001))
        >>> slow.send(1, tag=1)
        >>> fabric.transport(1).recv(0, 1).src
        0
        >>> slow.close()
    """

    name = "faulty"

    def __init__(self, inner: Transport, spec: FaultSpec) -> None:
        super().__init__(inner)
        self.round = inner.round
        self.rejoined = inner.rejoined  # (wrapped once connected)
        self.spec = spec
        self._rng = random.Random(spec.seed * 1_000_003 + inner.rank)
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._egress_free = 0.0
        self._ingress_free = 0.0
        # this rank's own links: peer -> (bandwidth, latency), and when each one's outgoing direction is free
        self._links = {
            (link.b if link.a == inner.rank else link.a): (link.bandwidth, link.latency)
            for link in spec.links
            if inner.rank in (link.a, link.b)
        }
        self._link_free: dict[int, float] = {}
        self._sends = 0
        self._closed = False
        self._wrapped: dict[int, Handle[Message]] = {}
        self.dropped = 0
        self._thread = threading.Thread(target=self._pump, name=f"paratrain-faults-{inner.rank}", daemon=True)
        self._thread.start()

    def _schedule(self, when: float, kind: str, payload: Any) -> None:
        with self._lock:
            heapq.heappush(self._heap, (when, next(self._seq), kind, payload))
            self._lock.notify()

    def _pump(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closed and not self._heap:
                        return
                    if self._heap:
                        delay = self._heap[0][0] - time.monotonic()
                        if delay <= 0:
                            _, _, kind, payload = heapq.heappop(self._heap)
                            break
                        self._lock.wait(delay)
                    else:
                        self._lock.wait()
            try:
                if kind == "send":
                    dst, tag, arrays, meta = payload
                    self.inner.isend(dst, tag, arrays, meta)
                else:
                    handle, msg = payload
                    handle.set_result(msg)
            except Exception:  # a lost peer or a closed inner transport: the message is gone, as on a network
                continue

    def _transfer_time(self, nbytes: int) -> float:
        return 0.0 if self.spec.bandwidth is None else nbytes / self.spec.bandwidth

    def isend(
        self, dst: int, tag: int, arrays: Sequence[Any] = (), meta: Mapping[str, Any] | None = None
    ) -> Handle[None]:
        """Copies the message and schedules it on this node's link; may drop it or crash this rank."""
        self._check_peer(dst)
        if self._closed:
            raise TransportClosedError(f"rank {self.rank}: transport closed; cannot send")
        copies = [_copy(a) for a in arrays]
        nbytes = sum(as_numpy_view(c)[0].nbytes for c in copies)
        with self._lock:
            self._sends += 1
            crash = self.spec.crash_after is not None and self._sends > self.spec.crash_after
            drop = self.spec.drop > 0 and self._rng.random() < self.spec.drop
            now = time.monotonic()
            own = self._links.get(dst)
            if own is None:
                start = max(now, self._egress_free)
                self._egress_free = start + self._transfer_time(nbytes)
                when = self._egress_free + self.spec.latency
            else:  # a link of its own: its queue, its rate, its latency
                bandwidth, latency = own
                free = max(now, self._link_free.get(dst, 0.0)) + (0.0 if bandwidth is None else nbytes / bandwidth)
                self._link_free[dst] = free
                when = free + latency
        if crash:
            self.abort(TransportClosedError(f"rank {self.rank}: injected crash after {self.spec.crash_after} sends"))
            raise TransportClosedError(f"rank {self.rank}: injected crash after {self.spec.crash_after} sends")
        if drop:
            self.dropped += 1
            return Handle.completed(None)
        if dst == self.rank or when <= now:
            self.inner.isend(dst, tag, copies, meta)
        else:
            self._schedule(when, "send", (dst, tag, copies, dict(meta or {})))
        return Handle.completed(None)

    def irecv(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle[Message]:
        """Posts a receive whose message is released when this node's ingress link has carried it."""
        inner_handle = self.inner.irecv(src, tag)
        if self.spec.bandwidth is None:
            return inner_handle
        outer: Handle[Message] = Handle()
        self._wrapped[id(outer)] = inner_handle

        def arrived(h: Handle[Message]) -> None:
            self._wrapped.pop(id(outer), None)
            error = h.exception()
            if error is not None:
                outer.set_error(error)
                return
            msg = h.wait(0)
            if msg.src in self._links:  # its own link spaced it already, at the sender
                outer.set_result(msg)
                return
            with self._lock:
                now = time.monotonic()
                self._ingress_free = max(now, self._ingress_free + self._transfer_time(msg.nbytes))
                release = self._ingress_free
            if release <= now:
                outer.set_result(msg)
            else:
                self._schedule(release, "recv", (outer, msg))

        inner_handle.add_done_callback(arrived)
        return outer

    def cancel_recv(self, handle: Handle[Message]) -> bool:
        """Withdraws a posted receive."""
        inner_handle = self._wrapped.pop(id(handle), handle)
        return self.inner.cancel_recv(inner_handle)

    def incarnations(self) -> dict[int, int]:
        """Peers the inner transport took back after they were lost."""
        return self.inner.incarnations()

    def close(self) -> None:
        """Delivers what is still on the link, then closes the inner transport."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=max(5.0, self.timeout))
        self.inner.close()

    def abort(self, reason: BaseException | None = None) -> None:
        """Crashes: queued messages are lost, receives waiting on the link fail, the inner transport is aborted."""
        with self._lock:
            self._closed = True
            held = [payload[0] for _, _, kind, payload in self._heap if kind == "recv"]
            self._heap.clear()
            self._lock.notify()
        for handle in held:
            handle.set_error(TransportClosedError(f"rank {self.rank}: transport aborted ({reason or 'no reason'})"))
        self.inner.abort(reason)


def _copy(a: Any) -> Any:
    """A private copy, since the message leaves after ``send`` returned and the caller may reuse ``a``."""
    if on_device(a):
        return to_host(a)  # a copy already, in host memory
    if is_torch_tensor(a):
        return a.detach().clone()
    view, name = as_numpy_view(a)
    return wire_array(np.array(view, copy=True), name)  # (a bfloat16 WireArray keeps its name)
