"""How paratrain's own processes start: ``torch._dynamo`` imported only if something compiles.

A torch optimizer's first use imports ``torch._dynamo`` (its ``step`` calls ``torch._dynamo.graph_break()``, its
``add_param_group`` and ``zero_grad`` go through ``torch._disable_dynamo``): about 1.5 s of CPU here, as much as
importing torch, paid by every rank of every job before its first step, though nothing in paratrain's workers is
compiled. :func:`defer_dynamo` puts a stand-in for the module in its place: in eager mode both calls mean "run the
function as it is", which the stand-in does; any other use of ``torch._dynamo`` (``torch.compile``, ``export``,
a config) imports the real module at that moment and hands over to it. Only for paratrain's entry points (workers,
the CLI, benchmark workers), whose own code never compiles: a user's script keeps torch as it is.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["defer_dynamo"]

_NAME = "torch._dynamo"


class _Deferred(types.ModuleType):
    """Stands for ``torch._dynamo`` until something other than its eager no-ops is asked of it."""

    @staticmethod
    def graph_break(msg: str = "") -> None:
        """Eager mode: nothing to break (only a tracing dynamo gives it a meaning)."""

    @staticmethod
    def disable(fn: Callable[..., Any] | None = None, recursive: bool = True, wrapping: bool = True) -> Any:
        """Eager mode: ``fn`` runs as it is (dynamo's ``disable`` only keeps its tracer out of ``fn``)."""
        if fn is None:
            return lambda f: f
        return fn

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__path__":  # what tools ask of any module (inspect walks them all)
            raise AttributeError(name)
        return getattr(_load(), name)  # __path__ too: a submodule's import hands over to the real package


def _load() -> types.ModuleType:
    """The real ``torch._dynamo``, imported now in the stand-in's place."""
    if isinstance(sys.modules.get(_NAME), _Deferred):
        del sys.modules[_NAME]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(torch.__dict__.get("_dynamo"), _Deferred):
        del torch.__dict__["_dynamo"]
    return importlib.import_module(_NAME)


def defer_dynamo() -> None:
    """Puts the stand-in in place of ``torch._dynamo`` unless the module is loaded already. Torch need not be
    imported yet (nor installed): its package finds lazy submodules such as ``_dynamo`` in ``sys.modules``."""
    if _NAME not in sys.modules:
        sys.modules[_NAME] = _Deferred(_NAME, __doc__)
