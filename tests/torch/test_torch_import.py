"""The core imports without torch; ``paratrain.torch`` is reachable as ``pt.torch`` once imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def test_core_does_not_import_torch_and_pt_torch_works_after_import() -> None:
    code = (
        "import sys, paratrain as pt\n"
        "assert 'torch' not in sys.modules, 'the communication core imported torch'\n"
        "import paratrain.torch\n"
        "assert pt.torch.DistributedOptimizer is paratrain.torch.optimizer.DistributedOptimizer\n"
        "assert callable(pt.torch.broadcast_parameters) and callable(pt.torch.shard)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
