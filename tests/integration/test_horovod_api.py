"""``paratrain.horovod`` exercised the way Horovod's own PyTorch tests exercise Horovod: expected values computed
from rank and size, every dtype, several dimensions, async handles with synchronize, variable-size allgather,
gradients through the collectives, broadcast of parameters and optimizer state, and the error cases; on 2 and 3
real processes under ``paratrain launch``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

JOB = r"""
import itertools
import torch
import paratrain.horovod as hvd

checks = []


def check(name, ok):
    assert ok, f"rank {hvd.rank()}: {name}"
    checks.append(name)


try:
    hvd.rank()
except ValueError as exc:
    assert "not been initialized" in str(exc)
hvd.init()
hvd.init()  # idempotent
r, n = hvd.rank(), hvd.size()
check("basics", hvd.is_initialized() and 0 <= r < n and hvd.local_size() == n and hvd.local_rank() == r)
check("cross", (hvd.cross_rank(), hvd.cross_size()) == (0, 1))  # one host: each local rank is alone

INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
for dtype, dim in itertools.product(INTS + FLOATS, [1, 2, 3]):
    base = torch.arange(3**dim).reshape([3] * dim) % 5
    mine = (base + r).to(dtype)
    total = (base * n + sum(range(n))).to(dtype)
    summed = hvd.allreduce(mine, op=hvd.Sum)
    check(f"sum {dtype} {dim}d", summed.dtype == dtype and torch.equal(summed, total))
    check(f"sum deprecated average=False {dtype}", torch.equal(hvd.allreduce(mine, average=False), total))
    avg = hvd.allreduce(mine)  # Average, the default
    if dtype.is_floating_point:
        check(f"average {dtype} {dim}d", torch.allclose(avg.double(), total.double() / n, atol=0.05))
    else:
        check(f"average {dtype} {dim}d", torch.equal(avg, torch.div(total, n, rounding_mode="trunc")))
    check(f"min {dtype}", torch.equal(hvd.allreduce(mine, op=hvd.Min), base.to(dtype)))
    check(f"max {dtype}", torch.equal(hvd.allreduce(mine, op=hvd.Max), (base + n - 1).to(dtype)))
    prod = torch.ones_like(base)
    for q in range(n):
        prod = prod * (base + q)
    check(f"product {dtype}", torch.equal(hvd.allreduce(mine, op=hvd.Product), prod.to(dtype)))
    inplace = mine.clone()
    out = hvd.allreduce_(inplace, op=hvd.Sum)
    check(f"in place {dtype}", out is inplace and torch.equal(inplace, total))

x = torch.full((4,), float(r + 1))
scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
check("pre/postscale", torch.equal(scaled, torch.full((4,), float(n * (n + 1) // 2))))
i = torch.full((3,), 7, dtype=torch.int32)
truncated = hvd.allreduce(i, op=hvd.Sum, postscale_factor=0.3)
check("int postscale truncates", torch.equal(truncated, torch.full((3,), int(7 * n * 0.3), dtype=torch.int32)))
half = hvd.allreduce(torch.full((5,), 0.5 + r), compression=hvd.Compression.fp16)
check("fp16 compression", half.dtype == torch.float32 and torch.allclose(half, torch.full((5,), 0.5 + (n - 1) / 2)))

handles = [hvd.allreduce_async(torch.full((2,), float(k * (r + 1))), op=hvd.Sum, name=f"h{k}") for k in range(5)]
check("poll is a bool", all(isinstance(hvd.poll(h), bool) for h in handles))
results = [hvd.synchronize(h) for h in handles]
check("async", all(torch.equal(x, torch.full((2,), float(k * n * (n + 1) // 2))) for k, x in enumerate(results)))
try:
    hvd.poll(handles[0])
    check("a synchronized handle is cleared", False)
except ValueError:
    check("a synchronized handle is cleared", True)
t = torch.zeros(3)
h = hvd.allreduce_async_(t + r, op=hvd.Sum)
check("async in place", torch.equal(hvd.synchronize(h), torch.full((3,), float(n * (n - 1) // 2))))
g = hvd.grouped_allreduce([torch.ones(2) * r, torch.ones(3, 3) * (r + 1)], op=hvd.Sum)
check("grouped", torch.equal(g[0], torch.ones(2) * (n * (n - 1) // 2)))
check("grouped", torch.equal(g[1], torch.ones(3, 3) * (n * (n + 1) // 2)))

for dtype in INTS + FLOATS:
    mine = torch.full((r + 1, 3), r).to(dtype)
    want = torch.cat([torch.full((q + 1, 3), q) for q in range(n)]).to(dtype)
    check(f"allgather variable {dtype}", torch.equal(hvd.allgather(mine), want))
    check(f"allgather async {dtype}", torch.equal(hvd.synchronize(hvd.allgather_async(mine)), want))
    for root in range(n):
        b = hvd.broadcast(torch.full((2, 2), r).to(dtype), root_rank=root)
        check(f"broadcast {dtype} from {root}", torch.equal(b, torch.full((2, 2), root).to(dtype)))
        own = torch.full((3,), r).to(dtype)
        same = hvd.broadcast_(own, root) is own
        check(f"broadcast_ {dtype}", same and torch.equal(own, torch.full((3,), root).to(dtype)))

w = torch.full((4,), float(r + 1), requires_grad=True)
hvd.allreduce(w, op=hvd.Sum).backward(torch.ones(4))
check("allreduce gradient", torch.equal(w.grad, torch.full((4,), float(n))))
w.grad = None
hvd.allreduce(w).backward(torch.ones(4))
check("average gradient", torch.allclose(w.grad, torch.ones(4)))
a = torch.full((r + 1, 2), 1.0, requires_grad=True)
gathered = hvd.allgather(a)
gathered.backward(torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)]))
check("allgather gradient", torch.equal(a.grad, torch.full((r + 1, 2), float(r * n))))
for root in range(n):
    v = torch.ones(3, requires_grad=True)
    hvd.broadcast(v, root).backward(torch.ones(3))
    check("broadcast gradient", torch.equal(v.grad, torch.full((3,), float(n) if r == root else 0.0)))

torch.manual_seed(r)  # a different model on every rank
model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
hvd.broadcast_parameters(model.state_dict(), root_rank=1)
flat = torch.cat([t.flatten().double() for t in model.state_dict().values()])
everyone = hvd.allgather(flat.reshape(1, -1))
check("broadcast_parameters", all(torch.equal(row, everyone[1]) for row in everyone))
torch.manual_seed(r)
other = torch.nn.Linear(3, 3)
hvd.broadcast_parameters(other.named_parameters(), root_rank=0)
rows = hvd.allgather(other.weight.detach().reshape(1, -1))
check("broadcast named_parameters", all(torch.equal(row, rows[0]) for row in rows))

sgd = lambda p: torch.optim.SGD(p, lr=0.1 * (r + 1), momentum=0.5 + 0.1 * r)
adam = lambda p: torch.optim.Adam(p, lr=0.01 * (r + 1), betas=(0.8 + 0.01 * r, 0.99))
for make in (sgd, adam):
    opt = make(model.parameters())
    model(torch.randn(6, 5) * (r + 1)).sum().backward()
    opt.step()  # rank-dependent state
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    lr = hvd.allgather(torch.tensor([opt.param_groups[0]["lr"]]))
    state = torch.cat([v.flatten().double() for s in opt.state.values() for _, v in sorted(s.items())])
    states = hvd.allgather(state.reshape(1, -1))
    equal = all(torch.equal(row, states[0]) for row in states)
    check(f"optimizer state {type(opt).__name__}", torch.all(lr == lr[0]) and equal)
    if isinstance(opt, torch.optim.Adam):
        betas = hvd.allgather(torch.tensor([opt.param_groups[0]["betas"][0]]))
        check("tuple options", torch.all(betas == betas[0]) and isinstance(opt.param_groups[0]["betas"], tuple))

resumed = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
if r == 0:  # Horovod's resume idiom: a checkpoint (here, a step) on the root only, then broadcast
    model(torch.randn(6, 5)).sum().backward()
    resumed.step()
hvd.broadcast_optimizer_state(resumed, root_rank=0)
state = torch.cat([v.flatten().double() for s in resumed.state.values() for _, v in sorted(s.items())])
states = hvd.allgather(state.reshape(1, -1))
filled = len(resumed.state) == len(list(model.parameters()))
check("the root's state to ranks without", filled and all(torch.equal(x, states[0]) for x in states))

try:
    hvd.allreduce(torch.ones(2 if r == 0 else 3))
    check("shape mismatch raises", False)
except hvd.HorovodInternalError as exc:
    check("shape mismatch raises", isinstance(exc, RuntimeError) and "shape" in str(exc).lower())
try:
    hvd.allreduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64))
    check("dtype mismatch raises", False)
except hvd.HorovodInternalError as exc:
    check("dtype mismatch raises", "dtype" in str(exc).lower() or "float" in str(exc).lower())
check("usable after an error", torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n))))
try:
    mixed = torch.optim.SGD(model.parameters(), lr=0.1) if r == 0 else torch.optim.Adam(model.parameters())
    hvd.broadcast_optimizer_state(mixed, root_rank=0)
    check("optimizer mismatch raises", False)
except hvd.HorovodInternalError as exc:
    check("optimizer mismatch raises", "differs" in str(exc))
for bad in (dict(op=hvd.Sum, average=True), dict(op=99)):
    try:
        hvd.allreduce(torch.ones(1), **bad)
        check("bad arguments raise", False)
    except ValueError:
        check("bad arguments raise", True)
orthogonal = hvd.allreduce(torch.eye(n, dtype=torch.float64)[r], op=hvd.Adasum)
check("adasum of orthogonal gradients is their sum", torch.equal(orthogonal, torch.ones(n, dtype=torch.float64)))
same = torch.tensor([0.5, -1.0, 2.0])
check("adasum of equal gradients is the gradient", torch.allclose(hvd.allreduce(same, op=hvd.Adasum), same))
vecs = [torch.tensor([1.0, 2.0, 0.5]) * (q + 1) + torch.tensor([0.0, q, -q]) for q in range(n)]


def pair(a, b):
    dot = float(a @ b)
    return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b


want = pair(vecs[0], vecs[1]) if n == 2 else pair(pair(vecs[0], vecs[1]), vecs[2])
check("adasum by its formula", torch.allclose(hvd.allreduce(vecs[r], op=hvd.Adasum), want, atol=1e-6))
try:
    hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    check("adasum refuses integers", False)
except ValueError:
    check("adasum refuses integers", True)
rows = torch.arange(2 * n + 1, dtype=torch.float64).reshape(-1, 1).repeat(1, 2) * (r + 1)
part = hvd.reducescatter(rows, op=hvd.Sum)
full = torch.arange(2 * n + 1, dtype=torch.float64).reshape(-1, 1).repeat(1, 2) * (n * (n + 1) // 2)
lo = sum(3 if q == 0 else 2 for q in range(r))  # the first len % n ranks get one row more
check("reducescatter", torch.equal(part, full[lo : lo + (3 if r == 0 else 2)]))
check("reducescatter average", torch.allclose(hvd.reducescatter(rows), full[lo : lo + (3 if r == 0 else 2)] / n))
send = torch.arange(n * 2).reshape(-1, 1) + 100 * r  # 2 rows for every rank
got = hvd.alltoall(send)
expected = torch.cat([torch.arange(2 * r, 2 * r + 2).reshape(-1, 1) + 100 * q for q in range(n)])
check("alltoall", torch.equal(got, expected))
splits = torch.tensor([q + 1 for q in range(n)])  # q + 1 rows to rank q
mine = torch.arange(int(splits.sum())) + 1000 * r
got, received = hvd.alltoall(mine, splits=splits)
starts = [sum(range(1, q + 1)) for q in range(n)]
want = torch.cat([torch.arange(starts[r], starts[r] + r + 1) + 1000 * q for q in range(n)])
check("alltoall splits", torch.equal(got, want) and received.tolist() == [r + 1] * n)
state = {"epoch": 3 + r, "names": ["a", "b"], "lr": 0.5}
sent = hvd.broadcast_object(state, root_rank=n - 1)
check("broadcast_object", sent == {"epoch": 2 + n, "names": ["a", "b"], "lr": 0.5})
check("allgather_object", hvd.allgather_object({"rank": r}) == [{"rank": q} for q in range(n)])
try:
    hvd.broadcast_object(object() if r == 0 else None, root_rank=0)
    check("an object JSON cannot carry is refused everywhere", False)
except (TypeError, hvd.HorovodInternalError) as exc:
    check("an object JSON cannot carry is refused everywhere", isinstance(exc, TypeError) == (r == 0))
hvd.barrier()
print(f"rank {r}: {len(checks)} checks passed", flush=True)
hvd.shutdown()
"""


OPTIMIZER_JOB = r'''
import torch
from sklearn.datasets import load_digits
import paratrain.horovod as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
torch.set_default_dtype(torch.float64)
digits = load_digits()
x, y = torch.tensor(digits.data / 16.0), torch.tensor(digits.target)
PER, STEPS = 8, 6  # rows per rank and micro-batch; every rank gets equal rows: the mean of means is the mean


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))


def batch(step, micro, rank):
    start = (step * 2 + micro) * PER * n + rank * PER
    return x[start : start + PER], y[start : start + PER]


def reference(passes, scale):
    """One process, the same total batch: every rank's rows of each micro-batch at once."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            rows = [batch(step, micro, q) for q in range(n)]
            xb, yb = torch.cat([a for a, _ in rows]), torch.cat([b for _, b in rows])
            (scale * torch.nn.functional.cross_entropy(m(xb), yb)).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def distributed(passes=1, clip=False, **kw):
    m = model()
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), named_parameters=m.named_parameters(),
        backward_passes_per_step=passes, **kw
    )
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            xb, yb = batch(step, micro, r)
            torch.nn.functional.cross_entropy(m(xb), yb).backward()
        if clip:  # Horovod's pattern: synchronize, change the reduced gradients, step without synchronizing
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def agree(name, got, want, tol):
    everyone = hvd.allgather(got.reshape(1, -1))
    assert all(torch.equal(row, everyone[0]) for row in everyone), f"{name}: ranks differ"
    err = float((got - want).abs().max())
    assert err <= tol, f"{name}: {err} from the one-process run"
    print(f"rank {r}: {name} max difference {err:.2e}", flush=True)


agree("average", distributed(), reference(1, 1.0), 1e-12)
agree("predivide 4", distributed(gradient_predivide_factor=4.0), reference(1, 1.0), 1e-12)
agree("sum", distributed(op=hvd.Sum), reference(1, float(n)), 1e-12)
agree("backward passes 2", distributed(passes=2), reference(2, 1.0), 1e-12)
agree("synchronize, skip_synchronize", distributed(clip=True), reference(1, 1.0), 1e-12)
agree("fp16 compression", distributed(compression=hvd.Compression.fp16), reference(1, 1.0), 1e-2)


def branched():
    """A model whose output head differs by rank (head r % 2): a head another rank used has no gradient here."""
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(64, 16), torch.nn.Linear(16, 10), torch.nn.Linear(16, 10)])


def branched_loss(m, rank, step):
    xb, yb = batch(step, 0, rank)
    return torch.nn.functional.cross_entropy(m[1 + rank % 2](torch.tanh(m[0](xb))), yb)


def branched_run(distributed):
    """Horovod's rule: a gradient a rank did not produce counts as zeros, so each head gets the mean over all
    ranks; one process: the mean of every rank's loss."""
    m = branched()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=m.named_parameters()) if distributed else sgd
    for step in range(STEPS):
        opt.zero_grad()
        loss = branched_loss(m, r, step) if distributed else sum(branched_loss(m, q, step) for q in range(n)) / n
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in m.parameters()])


agree("heads by rank, missing gradients as zeros", branched_run(True), branched_run(False), 1e-12)


def adasum_reference():
    """Each rank's SGD step from the same parameters on its own rows (its momentum its own), the changes
    combined pairwise by Adasum in a binary tree."""
    from paratrain.horovod.ops import adasum_tree

    models = [model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for step in range(STEPS):
        start = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for q, (m, o) in enumerate(zip(models, opts)):
            with torch.no_grad():
                for p, s in zip(m.parameters(), start):
                    p.copy_(s)
            o.zero_grad()
            xb, yb = batch(step, 0, q)
            torch.nn.functional.cross_entropy(m(xb), yb).backward()
            o.step()
            deltas.append([p.detach() - s for p, s in zip(m.parameters(), start)])
        for m in models:
            with torch.no_grad():
                for i, p in enumerate(m.parameters()):
                    p.copy_(start[i] + adasum_tree([d[i] for d in deltas]))
    return torch.cat([p.detach().flatten() for p in models[0].parameters()])


agree("adasum", distributed(op=hvd.Adasum), adasum_reference(), 1e-12)


def near(name, got, want, tol):
    """This rank's values against the one-process ones (they differ between ranks)."""
    err = float((got - want).abs().max())
    assert err <= tol, f"{name}: {err} from the one-process run"
    print(f"rank {r}: {name} max difference {err:.2e}", flush=True)
torch.manual_seed(3)
full = torch.randn(4 * n, 3, 5) * 2 + 1  # every rank builds the whole batch and takes its quarter-rows
mine = full[4 * r : 4 * r + 4].clone().requires_grad_(True)
whole = full.clone().requires_grad_(True)
sync, plain = hvd.SyncBatchNorm(3, momentum=0.3), torch.nn.BatchNorm1d(3, momentum=0.3)
with torch.no_grad():
    for bn in (sync, plain):
        bn.weight.copy_(torch.tensor([1.0, 2.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.0, 0.5, 1.0]))
weights = torch.arange(4 * n * 15, dtype=torch.float64).reshape(4 * n, 3, 5).sin()  # a loss that mixes rows
(sync(mine) * weights[4 * r : 4 * r + 4]).sum().backward()
(plain(whole) * weights).sum().backward()
near("sync batch norm input gradient", mine.grad.flatten(), whole.grad[4 * r : 4 * r + 4].flatten(), 1e-12)
weight_grad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
agree("sync batch norm weight gradient", weight_grad, plain.weight.grad, 1e-12)
agree("sync batch norm running statistics", torch.cat([sync.running_mean, sync.running_var]),
      torch.cat([plain.running_mean, plain.running_var]), 1e-12)
sync.eval(), plain.eval()
evaluated = plain(whole)[4 * r : 4 * r + 4].detach().flatten()
near("sync batch norm in evaluation", sync(mine).detach().flatten(), evaluated, 1e-12)
try:
    hvd.DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), named_parameters=[("a", torch.zeros(1))])
    raise SystemExit("unnamed parameters were accepted")
except ValueError as exc:
    assert "not named" in str(exc)
print(f"rank {r}: optimizer checks passed", flush=True)
hvd.shutdown()
'''


def _launch(script: Path, text: str, ranks: int) -> subprocess.CompletedProcess[str]:
    """Writes ``text`` to ``script`` and runs it on ``ranks`` processes under ``paratrain launch``; must succeed."""
    script.write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", str(ranks), str(script)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_horovod_api_on_real_processes(tmp_path: Path, ranks: int) -> None:
    out = _launch(tmp_path / "hvd_job.py", JOB, ranks)
    passed = [line for line in out.stdout.splitlines() if "checks passed" in line]
    assert len(passed) == ranks, out.stdout
    counts = {line.split(":")[-1].strip() for line in passed}
    assert len(counts) == 1 and int(counts.pop().split()[0]) >= 250, passed


@pytest.mark.parametrize("ranks", [2, 3])
def test_distributed_optimizer_equals_one_process_with_the_same_total_batch(tmp_path: Path, ranks: int) -> None:
    """Horovod's DistributedOptimizer on digits (float64, SGD with momentum): averaged, predivided, summed,
    accumulated over 2 backward passes, synchronized by hand, and fp16-compressed reductions give the one-process
    model of the same total batch (to 1e-12; fp16 to 1e-2), the same on every rank, also when the ranks use
    different output heads (a gradient a rank did not produce is reduced as zeros, as Horovod does, instead of
    leaving the others waiting); Adasum equals its
    one-process replay; SyncBatchNorm over the ranks' rows equals BatchNorm over the whole batch (outputs,
    gradients, running statistics)."""
    out = _launch(tmp_path / "hvd_optimizer.py", OPTIMIZER_JOB, ranks)
    assert out.stdout.count("optimizer checks passed") == ranks, out.stdout
