"""Datasets that need no download: scikit-learn's bundled digits, and Fashion-MNIST from IDX files on disk.

Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist/``)
or any directory of the four IDX files (gzipped or not). Nothing is ever fetched from the network. The IDX
reader checks the magic number, the dimensions and the length, so a truncated or foreign file gives a clear
error rather than garbage.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.errors import ConfigError

__all__ = ["DATASETS", "FASHION_MNIST_DIR", "Dataset", "load_dataset", "read_idx"]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
DATASETS = ("digits", "fashion-mnist")
_IDX_TYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True, slots=True)
class Dataset:
    """Images as float32 in [0, 1] with shape (n, 1, side, side), labels as int64, split into train and test."""

    name: str
    x_train: npt.NDArray[np.float32]
    y_train: npt.NDArray[np.int64]
    x_test: npt.NDArray[np.float32]
    y_test: npt.NDArray[np.int64]
    classes: int

    @property
    def side(self) -> int:
        """Width (= height) of an image."""
        return int(self.x_train.shape[-1])


def read_idx(path: str | os.PathLike[str]) -> npt.NDArray[Any]:
    """Reads one IDX file (optionally gzipped) into an array of its declared type and shape.

    Raises:
        ConfigError: not an IDX file, an unknown element type, or a length that does not match the header.
    """
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ConfigError(f"{p} is not an IDX file (bad magic number)")
    kind, ndim = raw[2], raw[3]
    if kind not in _IDX_TYPES:
        raise ConfigError(f"{p}: unknown IDX element type 0x{kind:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ConfigError(f"{p}: truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_TYPES[kind]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ConfigError(f"{p}: IDX header announces {shape} ({expected} bytes) but {len(raw) - header} follow")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        candidate = directory / name
        if candidate.exists():
            return candidate
    return None


def _fashion_mnist(data_dir: str | None) -> Dataset:
    directory = Path(data_dir or FASHION_MNIST_DIR)
    paths = {key: _find(directory, stem) for key, stem in _FILES.items()}
    missing = [_FILES[k] for k, v in paths.items() if v is None]
    if missing:
        raise ConfigError(
            f"Fashion-MNIST not found in {directory} (missing {', '.join(missing)}). Install it with "
            "'apt-get install dataset-fashion-mnist' (files go to /usr/share/datasets/fashion-mnist/), or pass "
            "--data-dir DIR with the four IDX files (gzipped or not). Nothing is downloaded."
        )
    arrays = {key: read_idx(path) for key, path in paths.items() if path is not None}
    for split in ("train", "test"):
        if arrays[f"{split}_images"].shape[0] != arrays[f"{split}_labels"].shape[0]:
            raise ConfigError(f"Fashion-MNIST {split}: image and label counts differ")
    return Dataset(
        name="fashion-mnist",
        x_train=(arrays["train_images"][:, None].astype(np.float32) / 255.0),
        y_train=arrays["train_labels"].astype(np.int64),
        x_test=(arrays["test_images"][:, None].astype(np.float32) / 255.0),
        y_test=arrays["test_labels"].astype(np.int64),
        classes=10,
    )


def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None]
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))  # a fixed split: the same on every rank and run
    cut = int(len(y) * 0.8)
    train, test = order[:cut], order[cut:]
    return Dataset("digits", x[train], y[train], x[test], y[test], classes=10)


def load_dataset(name: str, *, data_dir: str | None = None) -> Dataset:
    """Loads ``"digits"`` (bundled with scikit-learn, 1437 train / 360 test 8x8 images) or ``"fashion-mnist"``.

    Raises:
        ConfigError: unknown name, or Fashion-MNIST files missing (the message says how to install them).
    """
    if name == "digits":
        return _digits()
    if name == "fashion-mnist":
        return _fashion_mnist(data_dir)
    raise ConfigError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
