"""The fortunes text dataset, on a corpus written here: next-token windows, a fixed split, a stable vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.train.data import (
    CONTEXT,
    DATASET_KINDS,
    DATASETS,
    FORTUNE_FILES,
    FORTUNES_DIR,
    check_available,
    load_dataset,
    text_windows,
)


def _corpus(directory: Path, *, cookies_per_file: int = 12) -> None:
    """Every fortune file, each with cookies long enough to fill several windows, in the files' ``%`` format."""
    for f, name in enumerate(FORTUNE_FILES):
        cookies = [
            f"Quote {f}.{c}: the quick brown fox jumps over the lazy dog, {name} edition."
            for c in range(cookies_per_file)
        ]
        (directory / name).write_text("\n%\n".join(cookies) + "\n%\n", encoding="utf-8")


def _decode(vocabulary: str, tokens: np.ndarray) -> str:
    return "".join(vocabulary[t] for t in tokens.ravel())


def test_windows_are_shifted_by_one() -> None:
    x, y = text_windows(np.arange(11, dtype=np.int64), 5)
    assert x.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert y.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert x.dtype == y.dtype == np.int64
    x, y = text_windows(np.arange(5, dtype=np.int64), 5)  # one token short of a window
    assert x.shape == y.shape == (0, 5)


def test_fortunes_windows_split_and_vocabulary(tmp_path: Path) -> None:
    _corpus(tmp_path)
    data = load_dataset("fortunes", data_dir=str(tmp_path))
    assert data.kind == DATASET_KINDS["fortunes"] == "text" and data.side == CONTEXT
    assert data.x_train.shape[1:] == data.y_train.shape[1:] == (CONTEXT,)
    assert data.x_train.dtype == data.y_train.dtype == np.int64
    # the vocabulary is the corpus's characters, sorted; every id is in range
    text = "".join((tmp_path / name).read_text() for name in FORTUNE_FILES)
    assert data.vocabulary == "".join(sorted(set(text))) and data.classes == len(data.vocabulary)
    assert data.x_train.min() >= 0 and data.x_train.max() < data.classes
    # y is x moved by one, across window boundaries too: the stream continues where the last window stopped
    np.testing.assert_array_equal(data.y_train[:, :-1], data.x_train[:, 1:])
    np.testing.assert_array_equal(data.y_train[:-1, -1], data.x_train[1:, 0])
    # the test set is every tenth cookie, whole: file 0's cookie 9 first, and no test cookie in training
    test_text = _decode(data.vocabulary, data.x_test)
    assert test_text.startswith("Quote 0.9: the quick brown fox")
    train_text = _decode(data.vocabulary, data.x_train)
    assert "Quote 0.9:" not in train_text and "Quote 0.8:" in train_text and "Quote 0.10:" in train_text
    assert "\n%\n" in train_text  # cookies keep their end marker
    # the same arrays on every load (every rank builds its own)
    again = load_dataset("fortunes", data_dir=str(tmp_path))
    np.testing.assert_array_equal(again.x_train, data.x_train)
    np.testing.assert_array_equal(again.y_test, data.y_test)
    assert again.vocabulary == data.vocabulary


def test_overstrike_and_control_characters_are_dropped(tmp_path: Path) -> None:
    _corpus(tmp_path)
    (tmp_path / "art").write_text("_\bb_\bo_\bl_\bd text\r\nwith a bell\x07 and a tab\there\n%\n" * 200)
    data = load_dataset("fortunes", data_dir=str(tmp_path))
    assert "\b" not in data.vocabulary and "\x07" not in data.vocabulary and "\r" not in data.vocabulary
    assert "bold text\nwith a bell and a tab\there" in _decode(data.vocabulary, data.x_train)


def test_missing_corpus_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="apt-get install fortunes"):
        load_dataset("fortunes", data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="apt-get install fortunes"):
        check_available("fortunes", data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        check_available("fashion-mnist", data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="choose one of"):
        check_available("wikitext")
    check_available("digits")
    assert set(DATASET_KINDS) == set(DATASETS)


@pytest.mark.skipif(not Path(FORTUNES_DIR, "literature").is_file(), reason="Debian's fortunes is not installed")
def test_installed_corpus_loads() -> None:
    """The real corpus (``apt-get install fortunes``): English prose, a small vocabulary, a tenth held out."""
    data = load_dataset("fortunes")
    assert data.x_train.shape[0] > 30_000 and 0.08 < len(data.x_test) / len(data.x_train) < 0.14
    assert 90 <= data.classes <= 130
    assert "Mark Twain" in _decode(data.vocabulary, data.x_train)
