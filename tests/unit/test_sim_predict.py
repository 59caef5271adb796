"""Predictions from a machine profile: the runtime's policies, the hybrid's layers, the formula, the planner."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from paratrain.cli.main import main
from paratrain.sim.machine import LayerCost, LinkCost, MachineProfile, ModelProfile
from paratrain.sim.predict import alpha_beta_step, predict
from paratrain.sim.search import Candidate, candidates, reason, search
from paratrain.transport.faults import Link


def _widemlp() -> ModelProfile:
    layers = (
        LayerCost("fc1", 0.010, 0.020, ("fc1.weight", "fc1.bias"), (2048 * 784 * 4, 2048 * 4), 0, 2048, 784),
        LayerCost("fc2", 0.020, 0.040, ("fc2.weight", "fc2.bias"), (2048 * 2048 * 4, 2048 * 4), 0, 2048, 2048),
        LayerCost("out", 0.001, 0.002, ("out.weight", "out.bias"), (10 * 2048 * 4, 40), 0, 10, 2048),
    )
    return ModelProfile("widemlp", 64, layers, optimizer_s=0.01, concurrency=4)


def _profile() -> MachineProfile:
    paths = {"ipc": LinkCost(300e-6, 0.3e-9), "shm": LinkCost(10e-6, 0.1e-9), "tcp": LinkCost(350e-6, 3e-9)}
    return MachineProfile("test", paths, gamma=1e-10, copy=5e-11).with_model(_widemlp())


def test_the_runtimes_choices() -> None:
    profile = _profile()
    local = predict(profile, "widemlp", workers=4)
    assert set(local.algorithms) == {"shm"}  # one host, no emulated network: shared memory
    slow = predict(profile, "widemlp", workers=4, bandwidth=12.5e6)
    assert "shm" not in slow.algorithms and slow.step_s > 10 * local.step_s
    hybrid = predict(profile, "widemlp", workers=4, strategy="poseidon:allreduce", bandwidth=12.5e6)
    assert hybrid.job.sfb_layers == ("fc1", "fc2")  # Poseidon's cost model: SFB for the wide layers
    assert hybrid.step_s < slow.step_s / 3
    with pytest.raises(Exception, match="paratrain profile --model lenet"):
        predict(profile, "lenet", workers=4)


def test_the_formula_is_the_textbook_sum() -> None:
    profile, model = _profile(), _widemlp()
    beta = 0.3e-9 + 1 / 12.5e6
    want = model.compute_s + 2 * 3 * (300e-6 + model.param_bytes * beta / 4)
    assert alpha_beta_step(profile, model, workers=4, bandwidth=12.5e6) == pytest.approx(want)
    ps = alpha_beta_step(profile, model, workers=4, strategy="bsp", bandwidth=12.5e6)
    assert ps == pytest.approx(model.compute_s + 2 * (300e-6 + 4 * model.param_bytes * beta))


def test_paths_measured_under_the_jobs_load_are_used_where_the_profile_has_them() -> None:
    base, model = _profile(), _widemlp()
    loaded = MachineProfile(
        "loaded",
        {**base.paths, "ipc@4": LinkCost(900e-6, 2e-9), "injected@4": LinkCost(1e-3, 3e-9)},
        gamma=base.gamma,
        copy=base.copy,
    ).with_model(model)
    # emulated: the injector's own cost at 4 processes, then the link; the receiver's queue at the link's rate
    want = model.compute_s + 2 * 3 * (1e-3 + model.param_bytes * (3e-9 + 1 / 12.5e6) / 4)
    assert alpha_beta_step(loaded, model, workers=4, bandwidth=12.5e6) == pytest.approx(want)
    assert (
        predict(loaded, model, workers=4, bandwidth=12.5e6).step_s
        > predict(base, model, workers=4, bandwidth=12.5e6).step_s
    )
    # one host, no emulated network: shared memory, which has no loaded variant here
    assert predict(loaded, "widemlp", workers=4).step_s == pytest.approx(predict(base, "widemlp", workers=4).step_s)
    # nothing measured at 2 processes: the nearest load measured (4); one process: the idle ping-pong
    assert loaded.link("injected", 2, fallback="ipc") == LinkCost(1e-3, 3e-9)
    assert loaded.link("injected", 1, fallback="ipc") == base.paths["ipc"]


def test_a_synchronous_step_waits_for_the_expected_slowest_worker() -> None:
    base = _profile()
    model = _widemlp()
    late = ModelProfile(model.model, 64, model.layers, optimizer_s=0.01, concurrency=4, straggle_s=0.125)
    for strategy in ("allreduce", "bsp"):
        on_time = predict(base, model, workers=4, strategy=strategy, bandwidth=12.5e6).step_s
        assert predict(base, late, workers=4, strategy=strategy, bandwidth=12.5e6).step_s == pytest.approx(
            on_time + 0.125, rel=1e-3
        )
    assert predict(base, late, workers=1).step_s == pytest.approx(predict(base, model, workers=1).step_s)


def test_the_search_ranks_everything_and_says_why() -> None:
    profile, model = _profile(), _widemlp()
    space = candidates(model)
    # allreduce with and without fp16, bsp, ssp:2 and asp with 1, 2, 4 servers, sfb, poseidon; 5 sizes; overlap
    assert len(space) == (2 + 3 + 3 + 3 + 1 + 1) * 5 * 2 + 2  # and gossip on two graphs (no buckets)
    assert {c.update for c in space} == {
        "exact",
        "fp16-rounded gradients",
        "stale reads (at most 2 steps)",
        "asynchronous (stale reads)",
        "decentralised (neighbours' average)",
    }
    ranked = search(profile, model, workers=4, batch_size=64, bandwidth=12.5e6, space=space)
    assert [s.step_s for s in ranked] == sorted(s.step_s for s in ranked)
    assert ranked[0].candidate.strategy == "poseidon:allreduce"
    default = next(s for s in ranked if s.candidate == Candidate())
    text = reason(ranked[0], default)
    assert "faster than the default allreduce" in text and "fc1, fc2" in text


def test_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    machine = tmp_path / "machine.json"
    _profile().save(machine)
    trace = tmp_path / "pick.json"
    code = main(
        [
            "plan",
            "--machine",
            str(machine),
            "--model",
            "widemlp",
            "--workers",
            "4",
            "--bandwidth",
            "100Mbit",
            "--trace",
            str(trace),
            "--top",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "pick: poseidon:allreduce" in out and "run it: paratrain train --model widemlp --workers 4" in out
    assert "traceEvents" in json.loads(trace.read_text())
    assert main(["plan", "--machine", str(machine), "--model", "lenet", "--workers", "4"]) == 2
    assert "paratrain profile --model lenet" in capsys.readouterr().err
    assert main(["plan", "--machine", str(tmp_path / "none.json"), "--model", "widemlp", "--workers", "4"]) == 2


def test_a_persistent_straggler_holds_back_bsp_but_not_asp(capsys: pytest.CaptureFixture[str]) -> None:
    profile, model = _profile(), _widemlp()
    slow = [1.0, 3.0, 1.0, 1.0]
    even = {s: predict(profile, model, workers=4, strategy=s, bandwidth=1.25e9).step_s for s in ("bsp", "asp")}
    late = {
        s: predict(profile, model, workers=4, strategy=s, bandwidth=1.25e9, slowdown=slow).step_s
        for s in ("bsp", "asp")
    }
    # BSP: every step waits for the straggler's 3x compute; ASP: the others go on, and as the server's link is
    # the bottleneck here, they take the share of it the straggler leaves (the job's rate hardly moves)
    assert late["bsp"] >= 3 * model.compute_s > even["bsp"]
    assert late["asp"] < 1.1 * even["asp"] and late["asp"] < late["bsp"]
    ranked = search(profile, model, workers=4, batch_size=64, bandwidth=1.25e9, slowdown=slow)
    assert ranked[0].candidate.strategy == "asp" and "compare accuracy" in reason(ranked[0], ranked[-1])
    exact = search(
        profile,
        model,
        workers=4,
        batch_size=64,
        bandwidth=1.25e9,
        slowdown=slow,
        space=[c for c in candidates(model) if c.update == "exact"],
    )
    assert all(s.candidate.strategy != "asp" and not s.candidate.compression for s in exact)


@pytest.mark.parametrize("spec", ["random:0.1:3", "4:2", "1:0.5", "x"])
def test_plan_refuses_stragglers_it_does_not_model(
    spec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    machine = tmp_path / "machine.json"
    _profile().save(machine)
    argv = ["plan", "--machine", str(machine), "--model", "widemlp", "--workers", "4", "--straggler", spec]
    assert main(argv) == 2
    assert "the planner takes RANK:FACTOR" in capsys.readouterr().err


def test_ssp_sits_between_asp_and_bsp_and_ssp0_is_bsp() -> None:
    profile, model = _profile(), _widemlp()
    net = {"workers": 4, "bandwidth": 1.25e9}
    assert (
        predict(profile, model, strategy="ssp:0", **net).step_s == predict(profile, model, strategy="bsp", **net).step_s
    )
    # identical workers never meet the bound: SSP(2) runs as ASP
    assert predict(profile, model, strategy="ssp:2", **net).step_s == pytest.approx(
        predict(profile, model, strategy="asp", **net).step_s
    )
    # a persistent straggler: ASP's fast workers run free, SSP(1)'s at most one step ahead, BSP's in lockstep
    slow = {**net, "slowdown": [1.0, 4.0, 1.0, 1.0]}
    asp, ssp, bsp = (predict(profile, model, strategy=s, **slow).step_s for s in ("asp", "ssp:1", "bsp"))
    assert asp < ssp < bsp


def test_plan_searches_what_the_search_knows_by_default() -> None:
    from paratrain.cli.plan import DEFAULT_STRATEGIES
    from paratrain.sim.search import SEARCHED

    assert ",".join(SEARCHED) == DEFAULT_STRATEGIES


def test_pipelines_are_searched_when_the_profile_knows_the_modules() -> None:
    profile, model = _profile(), _widemlp()
    assert not any(c.strategy.startswith("pipeline") for c in candidates(model, workers=4, batch_size=64))
    cut = ModelProfile(
        model.model,
        64,
        tuple(dataclasses.replace(layer, module=2 * i + 1) for i, layer in enumerate(model.layers)),
        optimizer_s=0.01,
        concurrency=4,
        modules=6,
    )
    pipes = [c for c in candidates(cut, workers=4, batch_size=64) if c.strategy.startswith("pipeline")]
    assert [(c.strategy, c.microbatches, c.batch_size) for c in pipes] == [
        ("pipeline:gpipe", 4, 256),
        ("pipeline:gpipe", 8, 256),
        ("pipeline:1f1b", 4, 256),
        ("pipeline:1f1b", 8, 256),
    ]
    ranked = search(profile, cut, workers=4, batch_size=64, bandwidth=12.5e6, space=pipes)
    flags = ranked[0].train_flags()
    assert flags[:2] == ["--strategy", ranked[0].candidate.strategy] and "--balance" in flags
    balance = [int(n) for n in flags[flags.index("--balance") + 1].split(",")]
    assert len(balance) == 4 and sum(balance) == 6 and min(balance) >= 1


def test_links_of_their_own_route_the_step_and_let_the_trees_in() -> None:
    """4 workers whose link 0-1 runs at 1/10 of the others' (--faults links=FILE): the predicted step slows down,
    and the runtime's policy the prediction follows chooses the trees packed around the slow link."""
    profile = _profile()
    fast, slow = 125e6, 12.5e6
    links = tuple(Link(a, b, slow if (a, b) == (0, 1) else fast, 0.0) for a in range(4) for b in range(a + 1, 4))
    even = tuple(Link(a, b, fast, 0.0) for a in range(4) for b in range(a + 1, 4))
    uneven_step = predict(profile, "widemlp", workers=4, links=links)
    assert "blink" in uneven_step.algorithms  # (small buckets go "direct")
    assert uneven_step.step_s > predict(profile, "widemlp", workers=4, links=even).step_s
    ring = predict(profile, "widemlp", workers=4, links=links, algorithm="ring")
    assert ring.step_s > 2 * uneven_step.step_s


def test_plan_command_takes_the_links(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    machine, links, out_json = tmp_path / "machine.json", tmp_path / "links.json", tmp_path / "plan.json"
    _profile().save(machine)
    pairs = [[a, b] for a in range(4) for b in range(a + 1, 4)]
    links.write_text(json.dumps({"links": [{"between": p, "bandwidth": "100Mbit" if p == [0, 1] else "1Gbit"}
                                           for p in pairs]}))  # fmt: skip
    argv = ["plan", "--machine", str(machine), "--model", "widemlp", "--workers", "4", "--links", str(links)]
    assert main([*argv, "--json", str(out_json), "--top", "2"]) == 0
    assert json.loads(out_json.read_text())["links"] == str(links)
    capsys.readouterr()
    links.write_text(json.dumps({"links": [{"between": [0, 0]}]}))
    assert main(argv) == 2
    assert "two different ranks" in capsys.readouterr().err
