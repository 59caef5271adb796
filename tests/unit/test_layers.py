"""Imports go one way: a module imports only from its own layer or below, and no package imports form a circle.

Layers, bottom up (README "Layout"): the pure base (errors, config, the plan IR, strategy names) -> transports
and the process launcher -> the shared-memory segment -> algorithms (collectives, ps, gossip) -> the runtime
(Context, groups) -> recovery, the public API (``import paratrain``) and the test harness -> front ends (torch, train,
bench, cli, examples).
Every import counts, also those inside functions and under TYPE_CHECKING: an import hidden in a function is
still a tie, and a circle that only works because of the hiding breaks when someone moves the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import paratrain

ROOT = Path(paratrain.__file__).parent

#: Layer of each top-level part of the package (a module or a subpackage).
LAYERS = {
    "errors": 0,
    "config": 0,
    "_arrays": 0,
    "_current": 0,
    "_process": 0,
    "_exit": 0,  # how paratrain's own processes run and exit (gc.freeze), used by every entry point
    "_startup": 0,  # torch._dynamo deferred in paratrain's own processes
    "device": 0,  # device tensors (CUDA) staged through host memory: what every entry point of a tensor uses
    "plan": 0,
    "strategy": 0,
    "timeline": 0,  # the Chrome-trace writer that the collectives and the Horovod API record into
    "fusion": 0,  # pure: which gradients share a bucket, when a bucket starts (the torch front end and sim use it)
    "transport": 1,
    "launch": 1,
    "shm": 2,
    "collectives": 3,
    "ps": 3,
    "gossip": 3,
    "pipeline": 3,
    "sfb": 3,  # pure: what each scheme costs per layer and the per-layer choice; the torch front end executes it
    "soap": 3,  # pure: FlexFlow's per-operator splits (layouts, moves, the worker grid); the torch front end runs them
    "compression": 3,  # pure numpy: what a compressed gradient is; the torch front end moves it
    "runtime": 4,
    "sim": 4,  # the simulator: replays the algorithms' own plans (collectives, ps, sfb); measuring lives in bench
    "sched": 4,  # model parallelism: pure plans (colourings, the chromatic plan, STRADS's blocks) and their engines
    "recovery": 5,  # reliable collectives over the runtime (it re-forms contexts); the torch front end uses it
    "__init__": 5,  # the public API (paratrain.init, allreduce...): what user scripts and our workers import
    "testing": 5,
    "torch": 6,
    "horovod": 6,  # Horovod's API over the runtime and torch (a front end beside paratrain.torch)
    "train": 7,
    "apps": 7,  # model-parallel applications over sched's engines (problems, each rank's job), beside train
    "bench": 8,
    "cli": 9,
    "examples": 9,
}


def _part(module: str) -> str:
    """``paratrain.collectives.ring`` -> ``collectives``; ``paratrain`` -> ``__init__``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def _module_names() -> set[str]:
    names = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        names.add(".".join(rel.parts).removesuffix(".__init__"))
    return names


def _imports() -> dict[str, set[str]]:
    """Module name -> the paratrain modules it imports anywhere in its source.

    ``from paratrain.cli import plan`` imports the module ``paratrain.cli.plan``, not only the package: a name
    imported from a package counts as that module where one of that name exists."""
    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "paratrain")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                if target.split(".")[0] == "paratrain":
                    found.add(target)
                    found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules)
        graph[name] = found
    return graph


def test_every_part_has_a_layer() -> None:
    parts = {_part(m) for m in _imports()}
    assert parts <= set(LAYERS), f"give these a layer in LAYERS and in README's layout: {parts - set(LAYERS)}"


#: ``pt.torch``, ``pt.train``...: ``paratrain/__init__.py`` loads these on first attribute access (``__getattr__``)
#: and names them under TYPE_CHECKING only so that the attributes have types; the base does not use them.
LAZY = {f"paratrain.{name}" for name in paratrain._LAZY}


def test_no_upward_import() -> None:
    upward = [
        f"{module} ({_part(module)}) imports {target} ({_part(target)})"
        for module, targets in _imports().items()
        for target in targets
        if LAYERS[_part(target)] > LAYERS[_part(module)] and not (module == "paratrain" and target in LAZY)
    ]
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycle_between_modules() -> None:
    graph = _imports()
    modules = set(graph)

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    edges = {m: {r for t in ts if (r := resolve(t)) is not None and r != m} for m, ts in graph.items()}
    # a package's __init__ re-exporting its modules is not a circle with them
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t) :], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
