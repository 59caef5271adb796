"""paratrain._startup: training with torch._dynamo deferred equals training without, imports nothing of dynamo,
and anything that compiles hands over to the real module."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_TRAIN = """
def train():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for opt in (sgd, adam, sgd, adam):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    sgd.load_state_dict(sgd.state_dict())
    return [p.detach().double().flatten().tolist() for p in model.parameters()]
"""


def test_deferred_dynamo_trains_the_same_model_and_compiling_hands_over_to_the_real_module() -> None:
    script = _TRAIN + textwrap.dedent(
        """
        import inspect, json, sys
        from paratrain._startup import defer_dynamo
        defer_dynamo()
        import torch
        params = train()
        inspect.getmodule(train)  # walks every module's __file__: must not load dynamo
        deferred = type(sys.modules["torch._dynamo"]).__name__
        doubled = torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2)).tolist()
        real = type(sys.modules["torch._dynamo"]).__name__, type(torch._dynamo).__name__
        print(json.dumps({"params": params, "deferred": deferred, "doubled": doubled, "real": real}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    namespace: dict[str, object] = {}
    exec(_TRAIN, namespace)  # the same training in this process, whose dynamo is the real one
    assert got["params"] == namespace["train"]()  # type: ignore[operator]
    assert got["deferred"] == "_Deferred"  # two optimizers trained, saved and loaded: dynamo never imported
    assert got["doubled"] == [2.0, 2.0]
    assert got["real"] == ["module", "module"]
