"""The simulator's replay: exact times on hand-computed cases, and the step plans built from the runtime's own plans."""

from __future__ import annotations

import itertools
import math

import pytest

from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.errors import ConfigError
from paratrain.pipeline.schedules import gpipe, lower, one_f_one_b
from paratrain.plan.cost import simulate
from paratrain.plan.ir import Action, Plan, PlanError
from paratrain.ps.plans import push_actions
from paratrain.ps.sharding import plan_chunks
from paratrain.sim.machine import LayerCost, LinkCost, ModelProfile
from paratrain.sim.replay import Cores, Network, replay
from paratrain.sim.step import TAG_STRIDE, StepJob, gossip_steps, repeat_steps, step_plan

ALPHA, BETA = 1e-3, 1e-8


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_allreduce_is_the_textbook_cost(n: int) -> None:
    """2(N-1)(alpha + n/(N) beta): a ring receives from one peer, so its ingress never binds, and the replay also
    equals the one-link model of paratrain.plan.cost on the same plan."""
    count = 1200 * n  # divisible: every chunk the same size
    plan = allreduce_plan("ring", n, count, 4, agreement=False)
    out = replay(plan, Network.uniform(LinkCost(ALPHA, BETA)))
    want = 2 * (n - 1) * (ALPHA + count * 4 / n * BETA)
    assert out.time == pytest.approx(want, rel=1e-12)
    assert out.time == pytest.approx(simulate(plan, alpha=ALPHA, beta=BETA).time, rel=1e-12)
    assert out.bytes_out == [2 * (n - 1) * count * 4 // n] * n


def test_parameter_server_incast_shares_the_servers_link() -> None:
    """Four workers send n bytes to one server at once: their egress links run in parallel, the server's ingress
    serialises them, so the k-th is visible at alpha + k n beta (the one-link model says alpha + n beta for all)."""
    nbytes = 1_000_000
    workers = tuple((Action("send", peer=4, nbytes=nbytes),) for _ in range(4))
    server = tuple(Action("recv", peer=w, nbytes=nbytes) for w in range(4))
    out = replay(Plan("incast", (*workers, server)), Network.uniform(LinkCost(ALPHA, BETA)))
    seen = sorted(out.done[4])
    assert seen == pytest.approx([ALPHA + k * nbytes * BETA for k in (1, 2, 3, 4)], rel=1e-12)
    assert simulate(Plan("incast", (*workers, server)), alpha=ALPHA, beta=BETA).time == pytest.approx(
        ALPHA + nbytes * BETA
    )


def test_an_emulated_receivers_queue_drains_at_the_links_rate_not_the_senders_cpu() -> None:
    """The fault injector's ingress: a sender pays its CPU per byte (beta), the receiver's queue holds each message
    ``n * ingress_beta``; two senders at once are visible at max(arrival, previous + n ingress_beta)."""
    workers = tuple((Action("send", peer=2, nbytes=1000),) for _ in range(2))
    server = tuple(Action("recv", peer=w, nbytes=1000) for w in range(2))
    out = replay(Plan("incast", (*workers, server)), Network.uniform(LinkCost(0.0, 1e-3, ingress_beta=2e-3)))
    assert sorted(out.done[2]) == pytest.approx([2.0, 4.0])
    out = replay(Plan("incast", (*workers, server)), Network.uniform(LinkCost(0.0, 1e-3, ingress_beta=0.0)))
    assert sorted(out.done[2]) == pytest.approx([1.0, 1.0])


def test_parameter_server_steps_overlap_one_workers_pulls_with_anothers_next_push() -> None:
    """Two workers, one server, one chunk of one unit of link time, backward 0.5 s, no latency (by hand): step 1
    ends at 3.5 s on worker 0 (push 0.5-1.5, visible 1.5; worker 1's visible 2.5; replies 2.5-3.5, 3.5-4.5) and
    4.5 s on worker 1; in step 2 worker 0 pushes at 4.0-5.0 while the server still sends to worker 1, so steps
    then take 3.5 s, not the 4.5 s of one step replayed alone."""
    model = ModelProfile("one", 8, (LayerCost("fc", 0.0, 0.5, ("fc.weight",), (4000,)),))
    plan = step_plan(StepJob(model, workers=2, strategy="bsp", servers=1))
    assert plan.bytes_sent() == [4000, 4000, 8000]
    network = Network.uniform(LinkCost(0.0, 1 / 4000))
    assert replay(plan, network).finish[:2] == pytest.approx([3.5, 4.5])
    three = replay(repeat_steps(plan, 3), network)
    ends = [
        [max(three.done[r][j * len(plan.ranks[r]) : (j + 1) * len(plan.ranks[r])]) for j in range(3)] for r in (0, 1)
    ]
    assert ends == [pytest.approx([3.5, 7.0, 10.5]), pytest.approx([4.5, 8.0, 11.5])]


def test_asp_answers_a_pull_without_waiting_for_the_other_workers_push() -> None:
    """As above, with worker 1 five times slower (backward 2.5 s). ASP: worker 0's push is visible at 1.5 s and its
    pull is answered from the open round at once, 1.5-2.5 s. BSP: the chunk's round closes when worker 1's push is
    visible (2.5-3.5 s), so worker 0's reply leaves at 3.5 s and arrives at 4.5 s."""
    model = ModelProfile("one", 8, (LayerCost("fc", 0.0, 0.5, ("fc.weight",), (4000,)),))
    network = Network.uniform(LinkCost(0.0, 1 / 4000))
    finish = {}
    for strategy in ("asp", "bsp"):
        plan = step_plan(StepJob(model, workers=2, strategy=strategy, servers=1))
        finish[strategy] = replay(plan, network, slowdown=[1.0, 5.0, 1.0]).finish[0]
    assert finish == {"asp": pytest.approx(2.5), "bsp": pytest.approx(4.5)}


@pytest.mark.parametrize(("backward", "period"), [(0.5, 1.0), (1.5, 1.5)])
def test_gossip_hides_the_exchange_behind_the_next_step(backward: float, period: float) -> None:
    """Two workers, each step's model (one unit of link time) sent as the step ends and received during the next
    step's backward: a step takes max(backward, the link's time), by hand; no mixing or optimizer cost here."""
    model = ModelProfile("one", 8, (LayerCost("fc", 0.0, backward, ("fc.weight",), (4000,)),))
    plan, first = gossip_steps(StepJob(model, workers=2, strategy="gossip"), 4)
    out = replay(plan, Network.uniform(LinkCost(0.0, 1 / 4000)), validate=False)
    size = (len(plan.ranks[0]) - first[0]) // 4
    ends = [max(out.done[0][first[0] + j * size : first[0] + (j + 1) * size]) for j in range(4)]
    assert [b - a for a, b in itertools.pairwise(ends)] == pytest.approx([period] * 3)
    with pytest.raises(ConfigError, match="gossip_steps"):
        step_plan(StepJob(model, workers=2, strategy="gossip"))


def test_fp16_compression_halves_the_wire_and_costs_two_casts() -> None:
    model = ModelProfile("one", 8, (LayerCost("fc", 0.0, 0.5, ("fc.weight",), (4000,)),))
    plain = step_plan(StepJob(model, workers=2, choose=lambda b, n: "ring"))
    cast = step_plan(StepJob(model, workers=2, choose=lambda b, n: "ring", compression="fp16"))
    assert [2 * b for b in cast.bytes_sent()] == plain.bytes_sent()
    copies = [(a.label, a.nbytes, a.lane) for a in cast.ranks[0] if a.label.startswith("cast")]
    assert copies == [("cast bucket 0", 2 * 1001 * 4, 1), ("cast back bucket 0", 1001 * 4, 0)]
    with pytest.raises(ConfigError, match="fp16"):
        StepJob(model, workers=2, strategy="bsp", compression="fp16")


def test_hosts_share_a_nic_between_hosts_and_not_inside() -> None:
    """Two hosts of two ranks: the two ranks of host 0 sending to host 1 share its NIC; inside a host they
    do not."""
    intra, inter = LinkCost(0.0, 1e-9), LinkCost(ALPHA, BETA)
    net = Network.hosts(lambda r: r // 2, intra, inter)
    nbytes = 100_000
    ranks = (
        (Action("send", peer=2, nbytes=nbytes),),
        (Action("send", peer=3, nbytes=nbytes),),
        (Action("recv", peer=0, nbytes=nbytes),),
        (Action("recv", peer=1, nbytes=nbytes),),
    )
    out = replay(Plan("nic", ranks), net)
    assert sorted([out.done[2][0], out.done[3][0]]) == pytest.approx(
        [nbytes * BETA + ALPHA, 2 * nbytes * BETA + ALPHA], rel=1e-12
    )
    local = (
        (Action("send", peer=1, nbytes=nbytes),),
        (Action("recv", peer=0, nbytes=nbytes),),
        (Action("send", peer=3, nbytes=nbytes),),
        (Action("recv", peer=2, nbytes=nbytes),),
    )
    out = replay(Plan("local", local), net)
    assert out.done[1][0] == out.done[3][0] == pytest.approx(nbytes * 1e-9)


def test_lanes_overlap_communication_with_compute() -> None:
    """Lane 1 sends while lane 0 computes; lane 0's last action waits for the message it depends on."""
    r0 = (
        Action("compute", seconds=1.0, label="B2"),
        Action("send", peer=1, nbytes=10**6, deps=(0,), lane=1),
        Action("compute", seconds=3.0, label="B1"),
        Action("compute", seconds=0.5, label="step", deps=(1, 2)),
    )
    r1 = (Action("recv", peer=0, nbytes=10**6),)
    out = replay(Plan("overlap", (r0, r1)), Network.uniform(LinkCost(0.0, 1e-6)), trace=True)
    assert out.done[0] == pytest.approx([1.0, 2.0, 4.0, 4.5])
    assert out.busy[0] == pytest.approx(4.5) and out.waiting[0] == pytest.approx(0.0)
    names = {e["name"] for e in out.chrome_trace()["traceEvents"]}
    assert {"B2", "B1", "step", "->1 1000000B", "process_name", "thread_name"} <= names


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 8), (3, 3)])
def test_pipeline_bubble(k: int, m: int) -> None:
    """GPipe and 1F1B with uniform stages and free links: makespan (M + K - 1)(F + B), the bubble formula."""
    for sched in (gpipe(k, m), one_f_one_b(k, m)):
        out = replay(lower(sched, forward_s=1.0, backward_s=2.0), Network.uniform(LinkCost(0.0, 0.0)))
        assert out.time == pytest.approx((m + k - 1) * 3.0)


def test_a_deadlock_is_an_error_naming_the_rank() -> None:
    ranks = ((Action("recv", peer=1, nbytes=4), Action("send", peer=1, nbytes=4, deps=(0,))),) * 2
    with pytest.raises(PlanError, match="deadlock: rank 0"):
        replay(
            Plan("stuck", (ranks[0], (Action("recv", peer=0, nbytes=4), Action("send", peer=0, nbytes=4, deps=(0,))))),
            Network.uniform(LinkCost(0, 0)),
        )


def _model() -> ModelProfile:
    layers = (
        LayerCost("fc1", 0.01, 0.02, ("fc1.weight", "fc1.bias"), (4 * 3000 * 700, 4 * 3000)),
        LayerCost("fc2", 0.01, 0.02, ("fc2.weight", "fc2.bias"), (4 * 10 * 3000, 40)),
    )
    return ModelProfile("two-layer", 32, layers, optimizer_s=0.005)


def test_the_step_replays_the_runtimes_allreduce_plans() -> None:
    """No second copy of a schedule: lane 1 of every worker is, bucket by bucket, exactly the runtime's
    allreduce plan for that bucket (tags offset per call, dependencies renumbered)."""
    job = StepJob(
        _model(), workers=3, bucket_bytes=1 << 20, choose=lambda nbytes, n: "tree" if nbytes < 1e6 else "ring"
    )
    plan = step_plan(job)
    buckets = job.buckets()
    assert len(buckets) == 2
    for r in range(3):
        lane1 = [a for a in plan.ranks[r] if a.lane == 1]
        want = []
        for k, b in enumerate(buckets):
            count = b.numel + len(b.params)
            algorithm = "tree" if count * 4 < 1e6 else "ring"
            want += [
                (a.kind, a.peer, a.nbytes, a.tag + k * TAG_STRIDE)
                for a in allreduce_plan(algorithm, 3, count, 4, aliased=True).ranks[r]
            ]
        assert [(a.kind, a.peer, a.nbytes, a.tag) for a in lane1] == want
    out = replay(plan, Network.uniform(LinkCost(ALPHA, BETA)))
    assert out.time > _model().compute_s


def test_the_step_replays_the_parameter_servers_plans() -> None:
    job = StepJob(_model(), workers=2, strategy="bsp", servers=2, bucket_bytes=1 << 20, chunk_bytes=1 << 20)
    plan = step_plan(job)
    for r in range(2):
        pushes = [(a.kind, a.peer, a.nbytes) for a in plan.ranks[r] if a.lane == 1]
        want = []
        for k, b in enumerate(job.buckets()):
            chunks = plan_chunks(f"paratrain.torch/bucket{k}", (b.numel,), 4, 2, chunk_bytes=1 << 20)
            want += [(a.kind, a.peer, a.nbytes) for a in push_actions(chunks, 4, [2, 3])]
        assert pushes == want
    out = replay(plan, Network.uniform(LinkCost(ALPHA, BETA)), gamma=1e-10)
    # every byte of the model goes to the servers and back once per worker
    assert sum(out.bytes_out[:2]) == 2 * _model().param_bytes
    assert sum(out.bytes_out[2:]) == 2 * _model().param_bytes
    assert not math.isnan(out.time)


def test_sfb_layers_travel_as_the_runtimes_allgather_of_their_factors() -> None:
    """An SFB layer is a unit of its own (plan_buckets' separate=), sent by the allgather plan of every worker's
    K (M + N) rows, and rebuilt at the step; the rest keeps its allreduce."""
    from paratrain.collectives.lower import allgather_plan

    layers = (
        LayerCost(
            "fc1", 0.01, 0.02, ("fc1.weight", "fc1.bias"), (4 * 300 * 70, 4 * 300), out_features=300, in_features=70
        ),
        LayerCost(
            "out", 0.001, 0.002, ("out.weight", "out.bias"), (4 * 10 * 300, 40), out_features=10, in_features=300
        ),
    )
    model = ModelProfile("mlp", 16, layers, optimizer_s=0.001)
    job = StepJob(model, workers=3, sfb_layers=("fc1",), batch_size=16, choose=lambda nbytes, n: "ring")
    plan = step_plan(job)
    units = job.buckets()
    k = next(i for i, b in enumerate(units) if b.group == 0)
    rows = 16 * (300 + 70)
    want = allgather_plan(3, tuple((r * rows, (r + 1) * rows) for r in range(3)), 4).ranks[1]
    got = [a for a in plan.ranks[1] if a.lane == 1 and a.tag // TAG_STRIDE == k]
    assert [(a.kind, a.peer, a.nbytes) for a in got] == [(a.kind, a.peer, a.nbytes) for a in want]
    assert [a.label for a in plan.ranks[1] if a.label.startswith("SFB")] == ["SFB rebuild fc1"]
    out = replay(plan, Network.uniform(LinkCost(ALPHA, BETA)))
    assert out.bytes_out[1] == sum(a.nbytes for a in plan.ranks[1] if a.kind == "send")


@pytest.mark.parametrize(("n", "algorithm"), [(4, "ring"), (8, "ring"), (5, "ring")])
def test_a_symmetric_step_replayed_from_rank_0_alone_is_the_full_replay(n: int, algorithm: str) -> None:
    """Rank 0's actions, with each send's image delivered to itself, give every rank's timeline exactly."""
    from paratrain.sim.step import symmetric_step

    layers = (
        LayerCost("fc1", 0.01, 0.02, ("w", "b"), (4 * (480 * n - 6), 4), out_features=0),
        LayerCost("fc2", 0.003, 0.004, ("w2", "b2"), (4 * 24 * n, 4)),
    )
    job = StepJob(
        ModelProfile("m", 8, layers, optimizer_s=0.001),
        workers=n,
        bucket_bytes=1 << 30,
        choose=lambda nbytes, w: algorithm,
    )
    net = Network.uniform(LinkCost(ALPHA, BETA))
    full = replay(step_plan(job), net, gamma=1e-10, copy=3e-10)
    rank0 = symmetric_step(job)
    assert rank0 is not None and rank0.world_size == 1
    one = replay(rank0, net, gamma=1e-10, copy=3e-10, symmetric=n)
    assert one.finish[0] == pytest.approx(full.finish[0], rel=1e-12)
    assert one.done[0] == pytest.approx(full.done[0], rel=1e-12)
    assert set(full.finish) == {full.finish[0]}


def test_no_symmetric_shortcut_for_plans_that_are_not() -> None:
    from paratrain.sim.step import symmetric_step

    assert symmetric_step(StepJob(_model(), workers=3, choose=lambda nbytes, n: "tree")) is None
    assert symmetric_step(StepJob(_model(), workers=3, choose=lambda nbytes, n: "direct")) is None
    assert symmetric_step(StepJob(_model(), workers=3, strategy="bsp")) is None


def test_the_padded_symmetric_step_bounds_an_uneven_ring_closely() -> None:
    """Buckets that do not split into N equal chunks: rank 0's replay with every chunk padded to the largest is
    an upper bound of the exact replay, off by at most the padding's bytes."""
    from paratrain.sim.step import symmetric_step

    job = StepJob(_model(), workers=5, bucket_bytes=1 << 30, choose=lambda nbytes, n: "ring")
    net = Network.uniform(LinkCost(ALPHA, BETA))
    exact = replay(step_plan(job), net, gamma=1e-10).time
    assert symmetric_step(job) is None
    padded = symmetric_step(job, pad=True)
    assert padded is not None
    bound = replay(padded, net, gamma=1e-10, symmetric=5).time
    assert exact <= bound <= exact * (1 + 1e-4)


@pytest.mark.parametrize(("schedule", "microbatches"), [("gpipe", 4), ("1f1b", 4), ("gpipe", 8)])
def test_a_pipeline_step_is_its_schedules_bubble(schedule: str, microbatches: int) -> None:
    """Four equal layers, one per module, 1 s forward and 2 s backward at the profiled batch of 64: four stages
    of one layer each, micro-batches of 64/M examples (f = 1/M, b = 2/M); with free links and no optimizer a
    flushing schedule takes (M + K - 1)(f + b), by hand."""
    from paratrain.sim.pipe import pipeline_step

    layers = tuple(LayerCost(f"{i}", 1.0, 2.0, (f"{i}.weight",), (400,), 256, module=i) for i in range(4))
    model = ModelProfile("four", 64, layers, modules=4)
    step = pipeline_step(model, stages=4, microbatches=microbatches, batch_size=64, schedule_name=schedule)
    assert step.balance == (1, 1, 1, 1) and step.microbatch == 64 // microbatches
    out = replay(step.plan, Network.uniform(LinkCost(0.0, 0.0)))
    f, b = 1.0 / microbatches, 2.0 / microbatches
    assert out.time == pytest.approx((microbatches + 4 - 1) * (f + b))
    with pytest.raises(ConfigError, match="profile --model four"):
        pipeline_step(ModelProfile("four", 64, layers), stages=4, microbatches=4, batch_size=64)


def test_shared_cores_run_computes_at_their_share_by_hand() -> None:
    """Processor sharing, profiled 2-way shared on 1 core (alone: half the time): all computing at once take the
    profiled times; when one finishes the others speed up; hosts share only their own cores."""
    free = Network.uniform(LinkCost(0.0, 0.0))

    def computes(*seconds: float) -> Plan:
        return Plan("c", tuple((Action("compute", seconds=s),) for s in seconds))

    four = replay(computes(1.0, 1.0, 1.0, 1.0), free, cores=Cores(capacity=2.0, alone=0.5))
    assert four.finish == pytest.approx([1.0] * 4) and four.busy == pytest.approx([1.0] * 4)
    # 3 on 2 cores: each at 2/3 until rank 2's 0.125 s of work is done at 0.1875, then the others at full speed
    three = replay(computes(1.0, 1.0, 0.25), free, cores=Cores(capacity=2.0, alone=0.5), trace=True)
    assert three.finish == pytest.approx([0.5625, 0.5625, 0.1875])
    assert sorted(e["dur"] for e in three.spans if e["cat"] == "compute") == pytest.approx([187_500, 562_500, 562_500])
    two_hosts = Cores(capacity=1.0, alone=0.5, host_of=lambda r: r // 2)
    assert replay(computes(1.0, 1.0, 1.0), free, cores=two_hosts).finish == pytest.approx([1.0, 1.0, 0.5])
    with pytest.raises(PlanError, match="symmetric"):
        replay(Plan("c", ((Action("compute", seconds=1.0),),)), free, cores=two_hosts, symmetric=4)


def test_pipeline_stages_that_compute_alone_run_at_their_speed_alone() -> None:
    """GPipe, 2 stages, one micro-batch, profiled 2-way shared on one core: the stages never compute at the same
    time, so each runs alone at twice its profiled speed: (F + B) x 2 stages x 0.5, not the profiled 6 s."""
    plan = lower(gpipe(2, 1), forward_s=1.0, backward_s=2.0)
    free = Network.uniform(LinkCost(0.0, 0.0))
    assert replay(plan, free).time == pytest.approx(6.0)
    assert replay(plan, free, cores=Cores(capacity=1.0, alone=0.5)).time == pytest.approx(3.0)


def test_model_profile_says_how_its_processes_shared_the_cores() -> None:
    """4 processes at once took 40 ms a step, one alone 20 ms: they ran as 2 cores' worth, each profiled second is
    half a second alone; one process, or no step alone, says nothing."""
    layer = LayerCost("fc", 0.01, 0.02)
    shared = ModelProfile("m", 64, (layer,), optimizer_s=0.01, concurrency=4, alone_s=0.02)
    assert shared.cores() == pytest.approx((2.0, 0.5))
    assert ModelProfile("m", 64, (layer,), concurrency=4).cores() is None
    assert ModelProfile("m", 64, (layer,), alone_s=0.01).cores() is None
    assert ModelProfile("m", 64, (layer,), concurrency=2, alone_s=0.05).cores() == pytest.approx((2.0, 1.0))


def test_a_parameterless_first_stage_sends_the_input_and_gets_no_gradient() -> None:
    """A Flatten in front (module 0, no parameters) as its own stage: it sends each micro-batch's input
    (``input_bytes`` scaled) on and, as the runtime, receives no gradient and runs no backward."""
    from paratrain.sim.pipe import pipeline_step

    layers = tuple(LayerCost(f"{i}", 1.0, 2.0, (f"{i}.weight",), (400,), 256, module=i + 1) for i in range(4))
    model = ModelProfile("flat", 64, layers, modules=5, input_bytes=6400)
    step = pipeline_step(model, stages=5, microbatches=2, batch_size=64)
    assert step.balance == (1, 1, 1, 1, 1)
    assert [(m.dst, m.nbytes) for m in step.plan.sends(0)] == [(1, 3200), (1, 3200)]
    assert {(m.dst, m.nbytes) for m in step.plan.sends(1) if m.dst == 0} == {(0, 0)}
    assert not [a for a in step.plan.ranks[0] if a.kind == "compute" and a.label.startswith("B")]
