"""The core imports without torch; ``pt.torch`` imports ``paratrain.torch`` (and torch) on first use."""

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


def test_pt_torch_loads_on_first_use() -> None:
    """``pt.torch.DistributedOptimizer`` without ``import paratrain.torch`` (it raised AttributeError): the
    subpackage, and torch, load on first use; ``import paratrain`` alone still does not import torch."""
    code = (
        "import sys, paratrain as pt\n"
        "assert 'torch' not in sys.modules and 'paratrain.torch' not in sys.modules\n"
        "assert 'paratrain.ps' not in sys.modules, 'import paratrain loaded the parameter server'\n"
        "assert pt.ps.KVStore.__module__ == 'paratrain.ps.client'\n"
        "assert 'torch' in dir(pt)\n"
        "opt = pt.torch.DistributedOptimizer\n"
        "assert opt.__module__ == 'paratrain.torch.optimizer' and 'torch' in sys.modules\n"
        "assert pt.gossip.__name__ == 'paratrain.gossip' and pt.config.__name__ == 'paratrain.config'\n"
        "try:\n"
        "    pt.no_such_thing\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_thing' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('pt.no_such_thing did not raise AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
