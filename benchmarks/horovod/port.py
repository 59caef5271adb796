"""Ports Horovod's PyTorch MNIST example to paratrain by changing import lines only, and says which.

Usage: python benchmarks/horovod/port.py UPSTREAM.py PORTED.py

UPSTREAM.py is ``examples/pytorch/pytorch_mnist.py`` from github.com/horovod/horovod (not shipped here: it is
Horovod's code). Three import lines change and nothing else: Horovod's two imports become paratrain's Horovod
API, and torchvision's datasets and transforms become the bundled stand-in (Fashion-MNIST from Debian, the shape
of MNIST; nothing is downloaded). The script fails if any of the three lines is missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

SWAPS = {
    "from torchvision import datasets, transforms": (
        "from paratrain.examples.bundled_vision import datasets, transforms"
    ),
    "import horovod": "import paratrain.horovod as horovod",
    "import horovod.torch as hvd": "import paratrain.horovod as hvd",
}


def main() -> int:
    upstream, ported = Path(sys.argv[1]), Path(sys.argv[2])
    lines = upstream.read_text().splitlines(keepends=True)
    changed = []
    for i, line in enumerate(lines):
        new = SWAPS.get(line.rstrip("\n"))
        if new is not None:
            lines[i] = new + "\n"
            changed.append(f"line {i + 1}: {line.strip()!r} -> {new!r}")
    if len(changed) != len(SWAPS):
        print(f"expected {len(SWAPS)} import lines to swap, found {len(changed)}: {changed}", file=sys.stderr)
        return 1
    ported.write_text("".join(lines))
    print("\n".join(changed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
