"""README's layout section names every module of the package, each in its folder, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

import paratrain

ROOT = Path(paratrain.__file__).parent
README = ROOT.parent / "README.md"


def _listed() -> set[str]:
    """``folder/module.py`` (or ``module.py`` at the top) for every module the layout block names."""
    text = README.read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed: set[str] = set()
    folder = ""
    for line in block.splitlines():
        head = re.match(r"^  (\w+)/\s", line)
        if head:
            folder = head.group(1) + "/"
        elif re.match(r"^  \S", line):
            folder = ""  # a line of top-level modules
        elif not line.startswith("   "):
            continue  # paratrain/ itself, benchmarks/
        for name in re.findall(r"\b(\w+\.py)\b", line):
            listed.add(folder + name)
    return listed


def _present() -> set[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if "__pycache__" in rel.parts or (len(rel.parts) > 1 and rel.name == "__init__.py"):
            continue
        found.add("/".join(rel.parts))
    return found


def test_the_layout_names_every_module_where_it_is() -> None:
    listed, present = _listed(), _present()
    assert not present - listed, f"modules the layout omits: {sorted(present - listed)}"
    assert not listed - present, f"the layout names modules that are not there: {sorted(listed - present)}"
