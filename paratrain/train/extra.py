"""Whether this Python has what ``paratrain train`` needs: the ``train`` extra, found without importing it.

Checked once by the command, before any worker starts: without it every rank would die with its own
``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import sys

__all__ = ["TRAIN_EXTRA", "missing_train_extra", "require_train_extra"]

# what the 'train' extra of pyproject.toml installs: import name -> distribution name
TRAIN_EXTRA = {"torch": "torch", "sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}


def missing_train_extra() -> list[str]:
    """The distributions of the ``train`` extra that cannot be imported here (found, not imported: cheap)."""
    import importlib.util

    missing = []
    for module, distribution in TRAIN_EXTRA.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: in sys.modules without a spec, i.e. importable
            found = module in sys.modules
        if not found:
            missing.append(distribution)
    return missing


def require_train_extra(command: str) -> bool:
    """Says once, before any worker starts, which part of the ``train`` extra is missing; False if any is."""
    missing = missing_train_extra()
    if missing:
        print(
            f"paratrain {command} needs the 'train' extra: pip install 'paratrain[train]' "
            f"(missing: {', '.join(missing)})",
            file=sys.stderr,
        )
    return not missing
