"""Datasets that need no download: scikit-learn's bundled digits, Fashion-MNIST, and the fortunes text corpus.

Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist/``)
or any directory of the four IDX files (gzipped or not). Nothing is ever fetched from the network. The IDX
reader checks the magic number, the dimensions and the length, so a truncated or foreign file gives a clear
error rather than garbage.

``fortunes`` is a character-level language-modelling set: the English quotations, poems, jokes and definitions of
Debian's ``fortunes`` and ``fortunes-min`` packages (``/usr/share/games/fortunes/``, about 2.5 million
characters), cut into windows whose targets are the next characters. Text deep enough to need a transformer, yet
small enough to train on a laptop's CPU in minutes, and pipelines need deep models.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.errors import ConfigError

__all__ = [
    "CONTEXT",
    "DATASETS",
    "DATASET_KINDS",
    "FASHION_MNIST_DIR",
    "FORTUNES_DIR",
    "FORTUNE_FILES",
    "Dataset",
    "check_available",
    "load_dataset",
    "read_idx",
    "text_windows",
]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FORTUNES_DIR = "/usr/share/games/fortunes"
DATASETS = ("digits", "fashion-mnist", "fortunes")
#: What each dataset holds: ``"image"`` (x float32 of shape (n, 1, side, side), one label each) or ``"text"``
#: (x int64 token ids of shape (n, T), y the next token at every position).
DATASET_KINDS = {"digits": "image", "fashion-mnist": "image", "fortunes": "text"}
#: Characters per text window: the transformer's context. 64 keeps attention cheap on a CPU while spanning most
#: of a line, enough for the model to learn words and some syntax.
CONTEXT = 64
#: The cookie files of Debian's ``fortunes`` (1:1.99.1) and ``fortunes-min`` packages, read in this order. A fixed
#: list rather than the directory's contents: other packages (``fortunes-bofh-excuses``, ``fortunes-off``, other
#: languages) install into the same directory, and the corpus must not depend on what else a machine has.
#: ``ascii-art`` is left out: pictures, not text.
FORTUNE_FILES = (
    "art",
    "computers",
    "cookie",
    "debian",
    "definitions",
    "disclaimer",
    "drugs",
    "education",
    "ethnic",
    "food",
    "fortunes",
    "goedel",
    "humorists",
    "kids",
    "knghtbrd",
    "law",
    "linux",
    "linuxcookie",
    "literature",
    "love",
    "magic",
    "medicine",
    "men-women",
    "miscellaneous",
    "news",
    "paradoxum",
    "people",
    "perl",
    "pets",
    "platitudes",
    "politics",
    "pratchett",
    "riddles",
    "science",
    "songs-poems",
    "sports",
    "startrek",
    "tao",
    "translate-me",
    "wisdom",
    "work",
    "zippy",
)
#: Every tenth cookie (index 9, 19, ...) goes to the test set: whole quotations, so no test window shares text
#: with a training window, spread over every file so that train and test cover the same topics.
_TEST_EVERY = 10
_OVERSTRIKE = re.compile(r".\x08")  # old terminal bold/underline: "_\bA" prints an underlined A
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 and C1 controls but tab and newline
_COOKIE_END = re.compile(r"^%\n", re.MULTILINE)
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
    """A train and a test split, of images or of text windows (``kind``).

    Images: ``x`` float32 in [0, 1] with shape (n, 1, side, side), ``y`` int64 labels of shape (n,), ``classes``
    labels. Text: ``x`` int64 token ids of shape (n, T), ``y`` int64 of shape (n, T) with ``y[:, t]`` the token
    after ``x[:, t]``, ``classes`` the vocabulary's size and ``vocabulary`` its characters (token i is
    ``vocabulary[i]``). Either way a model maps ``x`` to scores over ``classes`` on its last axis, so one loss and
    one accuracy (:mod:`paratrain.train.tasks`) serve both.
    """

    name: str
    x_train: npt.NDArray[Any]
    y_train: npt.NDArray[np.int64]
    x_test: npt.NDArray[Any]
    y_test: npt.NDArray[np.int64]
    classes: int
    kind: str = "image"
    vocabulary: str = ""

    @property
    def side(self) -> int:
        """Width (= height) of an image, or a text window's length (the context a model must accept)."""
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


def _digits_table() -> npt.NDArray[np.float64]:
    """scikit-learn's 1,797 digits as one row each: 64 pixels (0-16) and the label.

    Read straight from the CSV the package ships: importing ``sklearn.datasets`` (scipy and all) costs every
    worker 1.5 s at start-up, 50 times the read. :func:`sklearn.datasets.load_digits` where the file is not found.
    """
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt", encoding="ascii") as fh:
                table: npt.NDArray[np.float64] = np.loadtxt(fh, delimiter=",", ndmin=2)
            if table.shape == (1797, 65):
                return table
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target]).astype(np.float64)


def _digits() -> Dataset:
    table = _digits_table()
    x = (table[:, :64].reshape(-1, 8, 8).astype(np.float32) / 16.0)[:, None]
    y = table[:, 64].astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))  # a fixed split: the same on every rank and run
    cut = int(len(y) * 0.8)
    train, test = order[:cut], order[cut:]
    return Dataset("digits", x[train], y[train], x[test], y[test], classes=10)


def text_windows(tokens: npt.NDArray[np.int64], length: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Cuts a token stream into non-overlapping windows: ``x`` of ``length`` tokens and ``y`` = ``x`` moved by one.

    Every token but the first is a target exactly once; the tail that does not fill a window is dropped.

    Example:
        >>> x, y = text_windows(np.arange(10), 4)
        >>> x.tolist(), y.tolist()
        ([[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3, 4], [5, 6, 7, 8]])
    """
    n = (len(tokens) - 1) // length
    x = np.ascontiguousarray(tokens[: n * length].reshape(n, length), dtype=np.int64)
    y = np.ascontiguousarray(tokens[1 : n * length + 1].reshape(n, length), dtype=np.int64)
    return x, y


def _fortune_paths(data_dir: str | None) -> list[Path]:
    directory = Path(data_dir or FORTUNES_DIR)
    missing = [name for name in FORTUNE_FILES if not (directory / name).is_file()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(
            f"the fortunes corpus is not in {directory} (missing {shown}). Install it with 'apt-get install "
            f"fortunes' (files go to {FORTUNES_DIR}/), or pass --data-dir DIR holding the files "
            f"{', '.join(FORTUNE_FILES[:3])}, ... (see paratrain.train.data.FORTUNE_FILES). Nothing is downloaded."
        )
    return [directory / name for name in FORTUNE_FILES]


def _fortunes(data_dir: str | None) -> Dataset:
    cookies: list[str] = []
    for path in _fortune_paths(data_dir):
        text = path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")
        text = _CONTROL.sub("", _OVERSTRIKE.sub("", text))
        cookies.extend(c.strip("\n") for c in _COOKIE_END.split(text + "\n") if c.strip())
    # "%" on a line of its own ends a cookie in the files, and ends one here too: the model learns where a
    # quotation stops.
    test = "".join(c + "\n%\n" for i, c in enumerate(cookies) if i % _TEST_EVERY == _TEST_EVERY - 1)
    train = "".join(c + "\n%\n" for i, c in enumerate(cookies) if i % _TEST_EVERY != _TEST_EVERY - 1)
    vocabulary = "".join(sorted(set(train) | set(test)))  # sorted: the same ids on every rank and every run
    codes = np.frombuffer(vocabulary.encode("utf-32-le"), dtype=np.uint32)

    def encode(text: str) -> npt.NDArray[np.int64]:
        return np.searchsorted(codes, np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)).astype(np.int64)

    x_train, y_train = text_windows(encode(train), CONTEXT)
    x_test, y_test = text_windows(encode(test), CONTEXT)
    if len(x_train) == 0 or len(x_test) == 0:
        raise ConfigError(f"the fortunes corpus in {data_dir or FORTUNES_DIR} is too short for {CONTEXT}-token windows")
    return Dataset("fortunes", x_train, y_train, x_test, y_test, len(vocabulary), "text", vocabulary)


def check_available(name: str, *, data_dir: str | None = None) -> None:
    """Refuses, before any worker starts, a dataset whose files are missing (cheap: reads no data).

    Raises:
        ConfigError: unknown name, or the files missing (the message says which package installs them).
    """
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if name == "fashion-mnist":
        directory = Path(data_dir or FASHION_MNIST_DIR)
        if any(_find(directory, stem) is None for stem in _FILES.values()):
            raise ConfigError(
                f"Fashion-MNIST not found in {directory}. Install it with 'apt-get install dataset-fashion-mnist' "
                "or pass --data-dir DIR with the four IDX files. Nothing is downloaded."
            )
    if name == "fortunes":
        _fortune_paths(data_dir)


def load_dataset(name: str, *, data_dir: str | None = None) -> Dataset:
    """Loads one of :data:`DATASETS`.

    ``"digits"``: bundled with scikit-learn, 1437 train / 360 test 8x8 images. ``"fashion-mnist"``: 60,000 /
    10,000 28x28 images. ``"fortunes"``: character windows of :data:`CONTEXT` tokens from Debian's ``fortunes``.

    Raises:
        ConfigError: unknown name, or files missing (the message says how to install them).
    """
    if name == "digits":
        return _digits()
    if name == "fashion-mnist":
        return _fashion_mnist(data_dir)
    if name == "fortunes":
        return _fortunes(data_dir)
    raise ConfigError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
