"""``paratrain profile`` end to end: a quick real run writes a profile the simulator can read; --update merges; bad
options exit 2 before anything is measured. Never asserts how fast this machine is, only that it was measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.cli.main import main
from paratrain.sim.machine import Cluster, LayerCost, LinkCost, MachineProfile, ModelProfile

pytestmark = pytest.mark.timeout(120)


def test_quick_profile_of_ipc_and_mlp(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from paratrain.train.models import build_model

    out = tmp_path / "machine.json"
    argv = ["profile", "--quick", "--paths", "ipc", "--sizes", "0,64KiB,1MiB", "--model", "mlp"]
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", *argv, "--batch-size", "8", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "alpha (us)" in proc.stdout and "model mlp@8x1" in proc.stdout
    machine = MachineProfile.load(out)
    assert set(machine.paths) == {"ipc"}
    # measured, not how fast: under load a noisy 0-byte median can push the fit's slope to its clamp at 0
    # (fit_hockney's documented rule), so only the fitted time of a message is asserted positive
    assert machine.paths["ipc"].time(1 << 20) > 0
    assert machine.gamma > 0 and machine.copy > 0
    profile = machine.model("mlp", 8)
    # the layers are the modules with parameters of their own, in order, with their parameters' names and bytes
    model = build_model("mlp", side=8, classes=10)  # digits: 8x8 images, 10 classes
    owners = [name for name, m in model.named_modules() if list(m.parameters(recurse=False))]
    assert [layer.name for layer in profile.layers] == owners == ["1", "3", "5"]
    params = dict(model.named_parameters())
    for layer in profile.layers:
        assert layer.params == (f"{layer.name}.weight", f"{layer.name}.bias")
        assert layer.param_bytes == tuple(params[p].numel() * 4 for p in layer.params)
        assert layer.forward_s > 0 and layer.backward_s > 0
    assert [layer.output_bytes for layer in profile.layers] == [8 * 512 * 4, 8 * 512 * 4, 8 * 10 * 4]  # float32
    assert [(layer.out_features, layer.in_features) for layer in profile.layers] == [(512, 64), (512, 512), (10, 512)]
    assert profile.optimizer_s > 0 and profile.overhead_s >= 0 and profile.concurrency == 1


def test_update_keeps_what_was_not_measured_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "machine.json"
    model = ModelProfile("cnn", 32, (LayerCost("0", 1e-3, 2e-3, ("0.weight",), (64,), 128),), concurrency=4)
    old = MachineProfile(
        "cluster", {"tcp": LinkCost(1e-4, 1e-9)}, gamma=1.0, copy=1.0, cluster=Cluster(hosts=4), notes="by hand"
    ).with_model(model)
    old.save(out)
    assert main(["profile", "--paths", "", "--update", "--out", str(out)]) == 0  # measures gamma and copy only
    assert "(updated)" in capsys.readouterr().out
    new = MachineProfile.load(out)
    assert new.name == "cluster" and new.cluster == Cluster(hosts=4)
    assert new.paths == old.paths and new.models == old.models
    assert 0 < new.gamma < 1.0 and 0 < new.copy < 1.0
    assert new.notes.startswith("by hand\nparatrain profile")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--paths", "ipc,infiniband"], "unknown path infiniband"),
        (["--emulate", "fast"], "neither a bandwidth"),
        (["--sizes", "1KiB"], "at least two distinct sizes"),
        (["--model", "resnet"], "unknown model 'resnet'"),
    ],
)
def test_bad_options_exit_2(args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "machine.json"
    assert main(["profile", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratrain profile: error:") and message in err
    assert not out.exists()


def test_paths_under_load_are_a_ring_of_n_processes() -> None:
    from paratrain.bench.profile import measure_paths

    links = measure_paths(["ipc"], concurrency=2, sizes=[0, 64 << 10], quick=True, timeout=90)
    assert set(links) == {"ipc", "ipc@2", "injected@2"}
    assert all(link.alpha > 0 for link in links.values())
