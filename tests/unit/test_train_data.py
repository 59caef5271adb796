"""Datasets without downloads: the IDX reader on files made here, digits, and clear errors."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.train.data import load_dataset, read_idx
from paratrain.train.record import Recorder, merge_run


def _write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)


def _fake_fashion(directory: Path, *, gz: bool) -> None:
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    _write_idx(directory / f"train-images-idx3-ubyte{suffix}", rng.integers(0, 256, (12, 28, 28)), gz=gz)
    _write_idx(directory / f"train-labels-idx1-ubyte{suffix}", rng.integers(0, 10, 12), gz=gz)
    _write_idx(directory / f"t10k-images-idx3-ubyte{suffix}", rng.integers(0, 256, (5, 28, 28)), gz=gz)
    _write_idx(directory / f"t10k-labels-idx1-ubyte{suffix}", rng.integers(0, 10, 5), gz=gz)


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_from_idx_files(tmp_path: Path, gz: bool) -> None:
    _fake_fashion(tmp_path, gz=gz)
    data = load_dataset("fashion-mnist", data_dir=str(tmp_path))
    assert data.x_train.shape == (12, 1, 28, 28) and data.x_test.shape == (5, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.x_train.min() >= 0.0 and data.x_train.max() <= 1.0
    assert data.y_train.dtype == np.int64 and data.classes == 10


def test_idx_reader_refuses_bad_files(tmp_path: Path) -> None:
    good = tmp_path / "ok"
    _write_idx(good, np.arange(6).reshape(2, 3))
    assert read_idx(good).tolist() == [[0, 1, 2], [3, 4, 5]]
    (tmp_path / "short").write_bytes(good.read_bytes()[:-1])
    with pytest.raises(ConfigError, match="announces"):
        read_idx(tmp_path / "short")
    (tmp_path / "png").write_bytes(b"\x89PNG....")
    with pytest.raises(ConfigError, match="not an IDX file"):
        read_idx(tmp_path / "png")
    (tmp_path / "kind").write_bytes(b"\x00\x00\x42\x01\x00\x00\x00\x01x")
    with pytest.raises(ConfigError, match="element type"):
        read_idx(tmp_path / "kind")


def test_missing_fashion_mnist_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="choose one of"):
        load_dataset("imagenet")


def test_digits_split_is_fixed() -> None:
    pytest.importorskip("sklearn")
    a, b = load_dataset("digits"), load_dataset("digits")
    assert a.x_train.shape == (1437, 1, 8, 8) and a.x_test.shape == (360, 1, 8, 8)
    np.testing.assert_array_equal(a.y_test, b.y_test)


def test_recorder_and_merge(tmp_path: Path) -> None:
    for rank in range(2):
        rec = Recorder(tmp_path, rank=rank)
        with rec.span("forward", "compute"):
            pass
        rec.add_span("allreduce", "communication", 1.0, 1.5, bytes=10)
        rec.log(kind="step", step=1, loss=0.5)
        rec.close()
    records = merge_run(tmp_path)
    assert sorted(r["rank"] for r in records) == [0, 1]
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    spans = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 4 and {e["pid"] for e in spans} == {0, 1}
    assert any(e["ph"] == "M" and e["args"]["name"] == "rank 1" for e in timeline["traceEvents"])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_bundled_stand_in_for_torchvisions_mnist(tmp_path: Path) -> None:
    """``datasets.MNIST`` and ``transforms`` as an MNIST script uses them: 28 x 28 bytes back from the IDX files,
    ToTensor to [0, 1] with a channel, Normalize, the labels, train and test splits."""
    from paratrain.examples.bundled_vision import datasets, transforms

    _fake_fashion(tmp_path, gz=False)
    pipeline = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.25,))])
    train = datasets.MNIST(str(tmp_path), train=True, download=True, transform=pipeline)
    test = datasets.MNIST(str(tmp_path), train=False)
    assert (len(train), len(test)) == (12, 5)
    image, label = train[3]
    raw = read_idx(tmp_path / "train-images-idx3-ubyte")[3]
    assert image.shape == (1, 28, 28) and isinstance(label, int)
    assert np.allclose(image.numpy()[0], (raw / 255.0 - 0.5) / 0.25, atol=1e-6)
    assert label == int(read_idx(tmp_path / "train-labels-idx1-ubyte")[3])
    assert np.array_equal(test[4][0], read_idx(tmp_path / "t10k-images-idx3-ubyte")[4])
