"""``paratrain.ps.protocol.OPS`` names exactly the requests the worker's client sends (``KVStore``, its
``Router``, its ``Resizer`` and a replacement's ``take_place``; it had fallen behind: ``fence`` and ``flush`` were
missing)."""

from __future__ import annotations

import re
from pathlib import Path

import paratrain.ps.client
import paratrain.ps.rejoin
import paratrain.ps.resizer
import paratrain.ps.routing
from paratrain.ps.protocol import OPS


def test_ops_names_every_request_a_worker_sends() -> None:
    source = "".join(
        Path(str(module.__file__)).read_text(encoding="utf-8")
        for module in (paratrain.ps.client, paratrain.ps.rejoin, paratrain.ps.resizer, paratrain.ps.routing)
    )
    assert set(re.findall(r'"op": "([a-z_]+)"', source)) == set(OPS)
    assert len(OPS) == len(set(OPS))
