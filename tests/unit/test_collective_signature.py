"""Call signatures: the verdict every rank computes from the same list, and the shared-memory encoding."""

from __future__ import annotations

import pytest

from paratrain.collectives.signature import (
    DESCRIPTOR_BYTES,
    INVALID,
    MAX_DIMS,
    Signature,
    mismatch,
    mismatch_error,
)
from paratrain.errors import MessageError

BASE = Signature("allreduce", "sum", "float32", (17, 1311), "auto", "shm")

# (rank 1's signature, given rank 0's BASE; the message, None where they may go on)
VERDICTS: list[tuple[str, Signature, str | None]] = [
    ("equal", BASE, None),
    (
        "same bytes, other shape",
        BASE._replace(shape=(17, 23, 57)),
        "rank 0 has shape (17, 1311) float32 but rank 1 has (17, 23, 57) float32",
    ),
    ("dtype", BASE._replace(dtype="int32"), "rank 0 has shape (17, 1311) float32 but rank 1 has (17, 1311) int32"),
    ("op", BASE._replace(op="max"), "rank 0 has op 'sum' but rank 1 has op 'max'"),
    ("root", BASE._replace(root=1), "rank 0 has root None but rank 1 has root 1"),
    (
        "algorithm",
        BASE._replace(requested="ring", resolved="ring"),
        "rank 0 has algorithm 'shm' (auto) but rank 1 has algorithm 'ring'",
    ),
    ("only the requested name differs", BASE._replace(requested="shm"), None),
    (
        "auto resolving differently for another size is not reported twice",
        BASE._replace(shape=(4,), resolved="direct"),
        "rank 0 has shape (17, 1311) float32 but rank 1 has (4,) float32",
    ),
    ("kind", BASE._replace(kind="broadcast"), "rank 0 called allreduce but rank 1 called broadcast"),
    ("rejected arguments", INVALID, "rank 1 rejected its own arguments (see the error it raised)"),
]


@pytest.mark.parametrize(("what", "theirs", "message"), VERDICTS, ids=[v[0] for v in VERDICTS])
def test_mismatch_names_the_difference(what: str, theirs: Signature, message: str | None) -> None:
    assert mismatch([BASE, theirs]) == message
    # the same verdict from the encoded descriptors, as the shared-memory path computes it
    assert mismatch([Signature.decode(BASE.encode()), Signature.decode(theirs.encode())]) == message
    assert (BASE.encode() == theirs.encode()) == (theirs == BASE)


def test_allgather_may_differ_in_its_first_dimension_only() -> None:
    a = Signature("allgather", None, "float64", (2, 3), "ring", "ring")
    assert mismatch([a, a._replace(shape=(5, 3)), a._replace(shape=(0, 3))]) is None
    assert mismatch([a, a._replace(shape=(2, 4))]) == (
        "rank 0 has shape (2, 3) float64 but rank 1 has (2, 4) float64 (allgather needs equal trailing dimensions)"
    )


def test_the_first_difference_in_rank_order_is_reported() -> None:
    sigs = [BASE, BASE, BASE._replace(op="min"), BASE._replace(shape=(1,))]
    assert mismatch(sigs) == "rank 0 has op 'sum' but rank 2 has op 'min'"
    error = mismatch_error(sigs)
    assert error is not None and str(error).startswith("allreduce called with different arguments: rank 0 has op")
    assert mismatch_error([INVALID, BASE]) is not None
    assert mismatch_error([BASE, BASE]) is None


@pytest.mark.parametrize(
    "sig",
    [
        BASE,
        Signature("broadcast", None, "bfloat16", (), "auto", "tree", 0),
        Signature("barrier", None, "", (), "shm", "shm"),
        Signature("reduce_scatter", "mean", "complex128", (3,) * MAX_DIMS, "ring", "ring"),
        Signature("allreduce", "max", "uint8", (0, 1 << 40), "name-of-exactly-24-bytes", "x" * 24, 12345),
        INVALID,
    ],
)
def test_encoding_round_trips(sig: Signature) -> None:
    data = sig.encode()
    assert len(data) <= DESCRIPTOR_BYTES
    assert Signature.decode(data + bytes(DESCRIPTOR_BYTES - len(data))) == sig
    assert Signature.from_wire(sig.to_wire(), 0) == sig


def test_long_algorithm_names_keep_a_prefix_and_a_hash() -> None:
    a = BASE._replace(resolved="hierarchical-with-a-very-long-suffix-1")
    b = BASE._replace(resolved="hierarchical-with-a-very-long-suffix-2")
    assert a.encode() != b.encode()
    decoded = Signature.decode(a.encode()).resolved
    assert decoded.startswith("hierarchical-wi~") and len(decoded) == 24
    assert mismatch([Signature.decode(a.encode()), Signature.decode(b.encode())]) is not None


def test_what_cannot_be_encoded_or_read() -> None:
    with pytest.raises(ValueError, match="unknown 'scan'"):
        BASE._replace(kind="scan").encode()
    with pytest.raises(ValueError, match="dimensions"):
        BASE._replace(shape=(1,) * (MAX_DIMS + 1)).encode()
    with pytest.raises(MessageError, match="rank 3 sent a malformed call signature"):
        Signature.from_wire(["allreduce", "sum", "float32", [2.5], "auto", "ring", None], 3)
    assert Signature.decode(bytes(DESCRIPTOR_BYTES)).kind == "?"  # a slot nobody wrote
