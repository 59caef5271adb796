"""Every example in the package's docstrings runs: a ``>>>`` line in any module is a test (README's tables and
the plan modules' exact tables are what a reader checks first, and an example that no longer runs misleads)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import paratrain

ROOT = Path(paratrain.__file__).parent


def _modules_with_examples() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            rel = path.relative_to(ROOT.parent).with_suffix("")
            found.append(".".join(rel.parts).removesuffix(".__init__"))
    return found


MODULES = _modules_with_examples()


def test_examples_are_found() -> None:
    assert "paratrain.plan.ir" in MODULES and len(MODULES) > 50


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has '>>>' outside its docstrings' examples"
