"""CUDA tensors sent as they are: through a transport (plain, with the fault injector, over sockets) and pushed to a
parameter server, staged to host memory on the way. Skipped without a CUDA device (benchmarks/gpu/run.sh)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from paratrain import Context  # noqa: E402
from paratrain.ps import KVStore  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402
from paratrain.transport.registry import local_job  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(("kind", "faults"), [("inproc", None), ("inproc", "latency=1ms"), ("zmq", None)])
def test_a_transport_sends_cuda_tensors_as_host_arrays(kind: str, faults: str | None) -> None:
    job = local_job(kind, 2, timeout=30.0, faults=faults)
    try:
        sent = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)]
        job.transports[0].isend(1, 7, [t.cuda().t() if t.ndim == 2 else t.cuda() for t in sent]).wait(30)
        msg = job.transports[1].recv(0, 7, timeout=30)
        np.testing.assert_array_equal(msg.arrays[0], sent[0].t().numpy())
        assert list(msg.dtypes) == ["float32", "bfloat16"]
        assert torch.equal(torch.from_numpy(msg.arrays[1].view(np.int16)).view(torch.bfloat16), sent[1])
    finally:
        for t in job.transports:
            t.close()


def test_cuda_tensors_pushed_to_a_parameter_server_equal_cpu_pushes() -> None:
    def worker(ctx: Context) -> tuple[Any, Any, Any, Any]:
        kv = KVStore(context=ctx)
        kv.init("w", torch.zeros(6, 4, dtype=torch.float64).cuda())
        kv.init("v", torch.zeros(10).cuda())
        kv.push("w", torch.full((6, 4), 1.5, dtype=torch.float64).cuda()).wait(30)
        kv.push_rows("w", torch.tensor([1, 4]).cuda(), torch.ones(2, 4, dtype=torch.float64).cuda()).wait(30)
        kv.push_sparse("v", torch.tensor([2, 7]).cuda(), torch.tensor([1.0, 3.0]).cuda()).wait(30)
        kv.clock()
        rows = kv.pull_rows("w", torch.tensor([4, 0]).cuda())
        on_device = torch.zeros(6, 4, dtype=torch.float64).cuda()
        assert kv.pull("w", out=on_device) is on_device and on_device.device.type == "cuda"
        out = kv.pull("w"), kv.pull("v"), rows, on_device.cpu().numpy()
        kv.close()
        return out

    expected_w = np.full((6, 4), 3.0)
    expected_w[[1, 4]] += 2.0
    expected_v = np.zeros(10, dtype=np.float32)
    expected_v[[2, 7]] = [2.0, 6.0]
    for w, v, rows, pulled_to_device in run_ranks(2, worker, servers=1, timeout=60):
        np.testing.assert_array_equal(w, expected_w)
        np.testing.assert_array_equal(pulled_to_device, expected_w)
        np.testing.assert_array_equal(v, expected_v)
        np.testing.assert_array_equal(rows, expected_w[[4, 0]])
