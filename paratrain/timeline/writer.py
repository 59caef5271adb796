"""A Chrome-trace timeline of communication, written as it happens (Horovod's ``HOROVOD_TIMELINE``).

Set ``PARATRAIN_TIMELINE=/path/timeline.json`` for any script run under paratrain (``paratrain launch``,
torchrun, SLURM or one process): rank 0 writes ``timeline.json``, rank r ``timeline.rank{r}.json``
(:func:`rank_path`). Open a file in Perfetto (ui.perfetto.dev) or ``chrome://tracing``.

As in Horovod's timeline, each *tensor* is a row (a trace "process" named after the tensor), so one tensor's
life reads left to right:

* ``NEGOTIATE_<OP>``: from the call until every rank has asked for the tensor (the Horovod API's
  :mod:`~paratrain.horovod.controller` matches requests by name; time here is a rank waiting for the others);
* ``<OP>``: from then until the result is ready, holding ``QUEUE`` (waiting for the tensors fused or issued
  before it), ``MEMCPY_IN_FUSION_BUFFER``, ``COMMUNICATE`` (the collective itself) and
  ``MEMCPY_OUT_FUSION_BUFFER``.

Collectives called without the Horovod API (``ctx.allreduce``, the DDP wrapper, paratrain's
``DistributedOptimizer``) are recorded by :class:`~paratrain.collectives.api.Collectives` on one row per kind
(``allreduce``, ``allgather``...): ``QUEUE`` from an async call until the background thread starts it, then the
operation, with its bytes. Timestamps are wall-clock microseconds, so the files of ranks on one host line up
when loaded together.

Events are complete ("X") events appended as they end, so the file is valid JSON only after :meth:`close`
(at interpreter exit at the latest); a file cut short by a crash still loads, since the trace viewers accept an
unterminated array.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Timeline", "rank_path", "timeline_for"]


def rank_path(path: str | Path, rank: int) -> Path:
    """Rank ``rank``'s file for the timeline ``path``: ``path`` itself on rank 0, ``stem.rank{r}.suffix`` else.

    Example:
        >>> rank_path("/tmp/t.json", 0).name, rank_path("/tmp/t.json", 2).name
        ('t.json', 't.rank2.json')
    """
    p = Path(path)
    return p if rank == 0 else p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


class Timeline:
    """One process's timeline file; thread-safe (the Horovod thread and the collectives' thread both write).

    Example:
        >>> import json, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "t.json")
        >>> tl = Timeline(path, rank=0)
        >>> tl.span("grad.w", "ALLREDUCE", 1.0, 1.5, bytes=64)
        >>> tl.close()
        >>> [e["name"] for e in json.load(open(path)) if e["ph"] == "X"]
        ['ALLREDUCE']
    """

    def __init__(self, path: str | Path, *, rank: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._lock = threading.Lock()
        self._rows: dict[str, int] = {}
        self._file: TextIO | None = self.path.open("w", encoding="utf-8")
        self._file.write("[\n")
        self._event({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"rank {rank}"}})
        self._event({"name": "timeline_start", "ph": "i", "s": "g", "pid": 0, "ts": time.time() * 1e6})

    def _event(self, event: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def _row(self, tensor: str) -> int:
        """The trace process of ``tensor`` (declared with its name on first use; 0 is the rank's own row)."""
        row = self._rows.get(tensor)
        if row is None:
            row = self._rows[tensor] = len(self._rows) + 1
            self._event({"name": "process_name", "ph": "M", "pid": row, "args": {"name": tensor}})
            self._event({"name": "process_sort_index", "ph": "M", "pid": row, "args": {"sort_index": row}})
        return row

    def span(self, tensor: str, name: str, start: float, end: float, **args: Any) -> None:
        """Records ``name`` on ``tensor``'s row from ``start`` to ``end`` (``time.time()`` seconds)."""
        with self._lock:
            event: dict[str, Any] = {
                "name": name,
                "ph": "X",
                "pid": self._row(tensor),
                "tid": 0,
                "ts": round(start * 1e6, 3),
                "dur": round(max(0.0, end - start) * 1e6, 3),
            }
            if args:
                event["args"] = args
            self._event(event)

    def mark(self, tensor: str, name: str, when: float, **args: Any) -> None:
        """An instant event on ``tensor``'s row (e.g. the moment a rank asked for it)."""
        with self._lock:
            event: dict[str, Any] = {"name": name, "ph": "i", "s": "p", "pid": self._row(tensor), "tid": 0}
            event["ts"] = round(when * 1e6, 3)
            if args:
                event["args"] = args
            self._event(event)

    def flush(self) -> None:
        """Writes what is buffered to the file."""
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Ends the JSON array and closes the file. Idempotent."""
        with self._lock:
            if self._file is None:
                return
            self._file.write(
                json.dumps({"name": "timeline_end", "ph": "i", "s": "g", "pid": 0, "ts": time.time() * 1e6})
            )
            self._file.write("\n]\n")
            self._file.close()
            self._file = None


_open: dict[Path, Timeline] = {}
_open_lock = threading.Lock()


def timeline_for(path: str | Path | None, rank: int) -> Timeline | None:
    """The process's timeline for ``path`` (``PARATRAIN_TIMELINE``) as rank ``rank``: opened once per process
    and file and closed at exit, shared by every group's collectives and the Horovod API; None without a path."""
    if not path:
        return None
    target = rank_path(path, rank).resolve()
    with _open_lock:
        tl = _open.get(target)
        if tl is None or tl._file is None:
            tl = _open[target] = Timeline(target, rank=rank)
            atexit.register(tl.close)
        return tl
