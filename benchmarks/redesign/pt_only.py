import sys, tempfile
from paratrain.bench.train import TrainBenchOptions, _run_paratrain, _breakdown
opts = TrainBenchOptions(model=sys.argv[2], steps=200, warmup=20)
with tempfile.TemporaryDirectory() as out:
    _run_paratrain(opts, out)
    b = _breakdown(out, "paratrain", opts.workers)
print(sys.argv[1], sys.argv[2], round(b["step"], 3), round(b["compute"], 3), round(b["apply"], 3), round(b.get("allreduce_reduce", 0), 3))
