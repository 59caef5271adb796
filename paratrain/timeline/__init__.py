"""Horovod-style timelines of a process's communication, for any script: ``PARATRAIN_TIMELINE=file.json``.

See :mod:`paratrain.timeline.writer`. Torch-free and below the collectives, which record into it.
"""

from __future__ import annotations

from paratrain.timeline.writer import Timeline, rank_path, timeline_for

__all__ = ["Timeline", "rank_path", "timeline_for"]
