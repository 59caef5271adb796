"""How paratrain's own processes run: started with ``torch._dynamo`` deferred (:mod:`paratrain._startup`), ended
with their objects frozen out of the garbage collector before the interpreter exits.

The interpreter's last collections walk every object still alive. With torch loaded (and ``torch._dynamo``, which
an optimizer's first use imports) that walk is 0.6 s of a worker's 0.8 s exit here, paid by every rank of every
job before the launcher sees it end. :func:`gc.freeze` moves those objects where the collector never looks; the
process's memory goes back to the system when it exits anyway. Only for paratrain's entry points (workers, the
CLI, benchmark workers), which close their files themselves: a user's script may count on the last collection to
flush a file left open in a reference cycle, so :func:`paratrain.init` does not do this for it.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import NoReturn

from paratrain._startup import defer_dynamo

__all__ = ["exit_with"]


def exit_with(main: Callable[[], int | None]) -> NoReturn:
    """Runs ``main`` (``torch._dynamo`` deferred: :func:`~paratrain._startup.defer_dynamo`) and exits with its code
    (0 for None), skipping the collector's walk on the way out."""
    defer_dynamo()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    gc.freeze()
    sys.exit(code)
