"""The disk copy of a reliable checkpoint: written atomically, read back bit for bit without pickle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paratrain.recovery import Checkpoint, RecoveryError
from paratrain.recovery.reliable import load_checkpoint_file, save_checkpoint


def test_a_checkpoint_reads_back_bit_for_bit_and_replaces_the_previous_one(tmp_path: Path) -> None:
    assert load_checkpoint_file(tmp_path) is None
    arrays = {
        "model.w": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
        "optim.0.momentum_buffer": np.arange(5, dtype=np.float64),
        "steps": np.array(7, dtype=np.int64),
    }
    save_checkpoint(Checkpoint(1, 6, {"x": np.zeros(2)}, {"step": 5}), tmp_path)
    save_checkpoint(Checkpoint(2, 11, arrays, {"step": 10, "epoch_loss": 2.5, "note": "é"}), tmp_path)
    got = load_checkpoint_file(tmp_path)
    assert got is not None and (got.version, got.seq, dict(got.meta)) == (
        2,
        11,
        {"step": 10, "epoch_loss": 2.5, "note": "é"},
    )
    assert list(got.arrays) == list(arrays)
    for name, value in arrays.items():
        assert got.arrays[name].dtype == value.dtype and got.arrays[name].tobytes() == value.tobytes()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.npz"]  # no temporary file left behind


def test_a_file_that_is_not_a_checkpoint_is_refused_with_its_name(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.npz").write_bytes(b"not a zip")
    with pytest.raises(RecoveryError, match=r"checkpoint\.npz is not a paratrain checkpoint"):
        load_checkpoint_file(tmp_path)
    np.savez(tmp_path / "checkpoint.npz", a0=np.zeros(1))  # an npz without our header
    with pytest.raises(RecoveryError, match="not a paratrain checkpoint"):
        load_checkpoint_file(tmp_path)
