"""Tests of the wire format: round trips, rejections in encode, and a decoder that treats peers as hostile."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from paratrain._arrays import DTYPE_NAMES
from paratrain.errors import MessageError
from paratrain.transport.wire import MAGIC, VERSION, Message, decode, encode, encode_header

PREFIX = MAGIC + bytes([VERSION])

NUMPY_DTYPES = sorted(DTYPE_NAMES - {"bfloat16"})
SHAPES = [(), (0,), (3, 0, 2), (1,), (5, 7)]


def roundtrip(src: int, tag: int, arrays: Any = (), meta: dict[str, Any] | None = None) -> Message:
    """Encodes, copies every frame to bytes as a socket would, and decodes."""
    frames, _views = encode(src, tag, arrays, meta)
    return decode([bytes(f) for f in frames])


def random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random values of any wire dtype, built from raw bytes so that every bit pattern is possible."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    count = int(np.prod(shape))
    raw = rng.integers(0, 256, size=count * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def header(body: Any) -> bytes:
    """A header frame with a valid prefix and an arbitrary (possibly invalid) msgpack body."""
    return PREFIX + msgpack.packb(body, use_bin_type=True)


# --------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_roundtrip_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    a = random_array(rng, dtype, shape)
    msg = roundtrip(3, 11, [a])
    (out,) = msg.arrays
    assert msg.dtypes == (dtype,)
    assert out.dtype == a.dtype
    assert out.shape == a.shape
    # Compare bit patterns: random float bytes include NaNs, which never compare equal by value.
    assert out.tobytes() == a.tobytes()


def test_roundtrip_zero_dimensional_arrays() -> None:
    rng = np.random.default_rng(1)
    for dtype in NUMPY_DTYPES:
        a = random_array(rng, dtype, ())
        (out,) = roundtrip(0, 0, [a]).arrays
        assert (out.dtype, out.shape, out.tobytes()) == (a.dtype, (), a.tobytes()), dtype


@pytest.mark.parametrize(
    "make_view",
    [
        lambda a: a.T,
        lambda a: a[::2, 1::3],
        lambda a: a[:, ::-1],
    ],
    ids=["transposed", "strided", "reversed"],
)
def test_roundtrip_non_contiguous_view(make_view: Any) -> None:
    base = np.random.default_rng(2).standard_normal((6, 9))
    view = make_view(base)
    assert not view.flags.c_contiguous
    (out,) = roundtrip(0, 0, [view]).arrays
    np.testing.assert_array_equal(out, view)


def test_roundtrip_several_arrays_in_one_message() -> None:
    rng = np.random.default_rng(3)
    arrays: list[np.ndarray] = [
        rng.standard_normal((4, 4)).astype(np.float32),
        rng.integers(-5, 5, size=10),
        np.array([True, False, True]),
        np.zeros((0, 3), dtype=np.float64),
        np.array([7], dtype=np.uint8),
    ]
    msg = roundtrip(1, 2, arrays)
    assert len(msg.arrays) == len(arrays)
    assert msg.dtypes == tuple(a.dtype.name for a in arrays)
    for out, a in zip(msg.arrays, arrays, strict=True):
        assert out.dtype == a.dtype
        np.testing.assert_array_equal(out, a)
    assert msg.nbytes == sum(a.nbytes for a in arrays)


def test_roundtrip_zero_arrays() -> None:
    frames, views = encode(4, 5)
    assert len(frames) == 1
    assert views == []
    msg = decode([bytes(f) for f in frames])
    assert msg.arrays == ()
    assert msg.dtypes == ()
    assert msg.nbytes == 0


def test_roundtrip_meta_with_nested_values() -> None:
    meta = {
        "step": 12,
        "lr": 0.125,
        "name": "grad",
        "final": True,
        "missing": None,
        "blob": b"\x00\xff",
        "nested": {"a": [1, 2.5, "x", False, None, b"y"], "b": {"c": [[]]}},
        "list": [{"k": 1}, [2, 3]],
    }
    assert dict(roundtrip(0, 0, meta=meta).meta) == meta


@pytest.mark.parametrize(("src", "tag"), [(0, 0), (7, 42), (123, -1), (2**31 - 1, -(2**40))])
def test_roundtrip_preserves_src_and_tag(src: int, tag: int) -> None:
    msg = roundtrip(src, tag, [np.arange(3)])
    assert (msg.src, msg.tag) == (src, tag)


def test_encode_frames_borrow_array_memory() -> None:
    # Zero copy: a data frame is a view of the returned array, not a snapshot of it.
    a = np.arange(4, dtype=np.int32)
    frames, views = encode(0, 0, [a])
    views[0][0] = 99
    assert np.frombuffer(frames[1], dtype=np.int32)[0] == 99


def test_encode_accepts_bytes_as_uint8() -> None:
    msg = roundtrip(0, 0, [b"abc"])
    assert msg.dtypes == ("uint8",)
    assert msg.arrays[0].tobytes() == b"abc"


# --------------------------------------------------------------------------------------------- torch


def test_torch_tensors_roundtrip() -> None:
    torch = pytest.importorskip("torch")
    tensors = [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([-(2**40), 0, 5], dtype=torch.int64),
        torch.tensor([True, False]),
    ]
    msg = roundtrip(0, 1, tensors)
    assert msg.dtypes == ("float32", "int64", "bool")
    for out, t in zip(msg.arrays, tensors, strict=True):
        np.testing.assert_array_equal(out, t.numpy())


def test_torch_bfloat16_encodes_as_its_bit_pattern() -> None:
    torch = pytest.importorskip("torch")
    t = torch.tensor([[1.0, -2.5, 3.0e30], [0.0, float("inf"), 1e-3]], dtype=torch.bfloat16)
    frames, _ = encode(0, 0, [t])
    # Read the header by hand: this checks the sender independently of the decoder.
    _src, _tag, _meta, descriptors = msgpack.unpackb(bytes(frames[0])[len(PREFIX) :])
    assert descriptors == [["bfloat16", [2, 3]]]
    assert bytes(frames[1]) == t.view(torch.int16).numpy().view(np.uint16).tobytes()


def test_torch_bfloat16_roundtrip() -> None:
    torch = pytest.importorskip("torch")
    t = torch.tensor([[1.0, -2.5, 3.0e30], [0.0, float("inf"), 1e-3]], dtype=torch.bfloat16)
    msg = roundtrip(0, 0, [t])
    assert msg.dtypes == ("bfloat16",)
    out = msg.arrays[0]
    assert out.dtype == np.uint16
    np.testing.assert_array_equal(out, t.view(torch.int16).numpy().view(np.uint16))
    # The bits reinterpret to the same bfloat16 values on the receiving side.
    back = torch.from_numpy(out.view(np.int16).copy()).view(torch.bfloat16)
    assert torch.equal(back, t)


@pytest.mark.parametrize("size", [3, 1 << 16], ids=["socket", "lane"])
@pytest.mark.parametrize("dst", [0, 1], ids=["to itself", "to a peer"])
def test_zmq_keeps_the_bfloat16_name(size: int, dst: int) -> None:
    """Regression: the ZeroMQ transport encoded the prepared views again, which are uint16 for a bfloat16 tensor,
    so a bfloat16 message not sent through a lane arrived as uint16 (a parameter server then rejected a push
    compressed to bf16 as "carries uint16")."""
    torch = pytest.importorskip("torch")
    from paratrain.transport.registry import local_job

    job = local_job("zmq", 2, timeout=30.0)
    try:
        t = torch.linspace(-3, 3, size).to(torch.bfloat16)
        job.transports[0].isend(dst, 5, [t, np.arange(2)]).wait(30)
        msg = job.transports[dst].recv(0, 5, timeout=30)
        assert msg.dtypes == ("bfloat16", "int64")
        assert torch.equal(torch.from_numpy(msg.arrays[0].view(np.int16).copy()).view(torch.bfloat16), t)
    finally:
        for transport in job.transports:
            transport.close()


def test_decode_bfloat16_without_torch() -> None:
    bits = np.array([0x3F80, 0xC020], dtype=np.uint16)  # 1.0 and -2.5 in bfloat16
    msg = decode([encode_header(0, 0, {}, [["bfloat16", [2]]]), bits.tobytes()])
    assert msg.dtypes == ("bfloat16",)
    np.testing.assert_array_equal(msg.arrays[0], bits)


def test_torch_zero_dimensional_tensor_keeps_its_shape() -> None:
    torch = pytest.importorskip("torch")
    (out,) = roundtrip(0, 0, [torch.tensor(2.5)]).arrays
    assert out.shape == ()
    assert out[()] == 2.5


def test_torch_tensor_requiring_grad_is_sent_detached() -> None:
    torch = pytest.importorskip("torch")
    t = torch.linspace(0, 1, 5, requires_grad=True)
    (out,) = roundtrip(0, 0, [t]).arrays
    np.testing.assert_array_equal(out, t.detach().numpy())


def test_torch_non_contiguous_tensor() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()
    assert not t.is_contiguous()
    (out,) = roundtrip(0, 0, [t]).arrays
    np.testing.assert_array_equal(out, t.numpy())


# --------------------------------------------------------------------------------------------- encode rejections


@pytest.mark.parametrize(
    "bad",
    [
        np.array([object(), 1], dtype=object),
        [1.0, 2.0],  # a python list: must be converted explicitly, never guessed at
        np.arange(3, dtype=">i4"),  # big-endian: receivers assume little-endian bytes
        np.array(["a", "b"]),
        np.zeros(2, dtype=[("x", "<f4")]),
    ],
    ids=["object", "list", "big-endian", "unicode", "structured"],
)
def test_encode_rejects_unsupported_arrays(bad: Any) -> None:
    with pytest.raises(TypeError):
        encode(0, 0, [bad])


def test_encode_rejects_oversized_meta() -> None:
    with pytest.raises(ValueError, match="header"):
        encode(0, 0, meta={"blob": "x" * 100_000})


# --------------------------------------------------------------------------------------------- decode rejections


def valid_header(descriptors: list[Any] | None = None) -> bytes:
    return encode_header(0, 0, {}, descriptors or [])


DECODE_REJECTS: list[tuple[str, list[Any]]] = [
    ("empty", []),
    ("short-header", [MAGIC]),
    ("bad-magic", [b"XXXX" + bytes([VERSION]) + msgpack.packb([0, 0, {}, []])]),
    ("wrong-version", [MAGIC + bytes([VERSION + 1]) + msgpack.packb([0, 0, {}, []])]),
    ("body-not-msgpack", [PREFIX + b"\xc1"]),  # 0xc1 is the one byte msgpack never uses
    ("body-trailing-bytes", [header([0, 0, {}, []]) + b"\x00"]),
    ("body-empty", [PREFIX]),
    ("body-not-list", [header({"src": 0})]),
    ("body-3-list", [header([0, 0, {}])]),
    ("body-5-list", [header([0, 0, {}, [], 0])]),
    ("src-str", [header(["0", 0, {}, []])]),
    ("src-bool", [header([True, 0, {}, []])]),  # bool is an int subclass in python: still refused
    ("src-negative", [header([-1, 0, {}, []])]),
    ("tag-float", [header([0, 1.0, {}, []])]),
    ("tag-huge", [header([0, 2**63, {}, []])]),
    ("meta-list", [header([0, 0, [], []])]),
    ("meta-bytes-key", [header([0, 0, {b"k": 1}, []])]),
    ("meta-int-key", [header([0, 0, {1: 1}, []])]),
    ("meta-nested-bytes-key", [header([0, 0, {"a": [{b"k": 1}]}, []])]),
    ("meta-too-deep", [header([0, 0, {"a": [[[[[[[[[1]]]]]]]]]}, []])]),
    ("meta-timestamp", [header([0, 0, {"t": msgpack.Timestamp(1, 0)}, []])]),
    ("descriptors-not-list", [header([0, 0, {}, {}])]),
    ("more-descriptors-than-frames", [valid_header([["uint8", [1]]])]),
    ("more-frames-than-descriptors", [valid_header(), b""]),
    ("descriptor-not-pair", [valid_header([["uint8"]]), b""]),
    ("dtype-object", [valid_header([["object", [1]]]), b"\x00" * 8]),
    ("dtype-not-str", [valid_header([[1, [1]]]), b"\x00"]),
    ("shape-not-list", [valid_header([["uint8", 1]]), b"\x00"]),
    ("shape-negative", [valid_header([["uint8", [-1]]]), b""]),
    ("shape-float", [valid_header([["uint8", [1.0]]]), b"\x00"]),
    ("shape-too-many-dims", [valid_header([["uint8", [1] * 33]]), b"\x00"]),
    ("frame-too-short", [valid_header([["float32", [2]]]), b"\x00" * 7]),
    ("frame-too-long", [valid_header([["float32", [2]]]), b"\x00" * 9]),
    ("frame-not-buffer", [valid_header([["uint8", [1]]]), "x"]),
    ("header-not-buffer", [None]),
    ("ext-type", [header([0, 0, {"x": msgpack.ExtType(5, b"x")}, []])]),
    ("ext-type-as-src", [header([msgpack.ExtType(5, b"x"), 0, {}, []])]),
]


@pytest.mark.parametrize("frames", [f for _, f in DECODE_REJECTS], ids=[n for n, _ in DECODE_REJECTS])
def test_decode_rejects_malformed(frames: list[Any]) -> None:
    with pytest.raises(MessageError):
        decode(frames)


def test_decode_accepts_what_the_rejection_cases_perturb() -> None:
    # Guards the table above: its cases must fail for the reason they name, not because the base is invalid.
    msg = decode([valid_header([["float32", [2]]]), b"\x00" * 8])
    assert msg.arrays[0].shape == (2,)
    assert decode([header([0, -5, {"k": [1, {"j": None}]}, []])]).tag == -5


def test_decode_rejects_zero_size_shape_with_overflowing_dims() -> None:
    # The frame length check passes (0 bytes expected), then numpy refuses to allocate the shape.
    with pytest.raises(MessageError):
        decode([valid_header([["float32", [0, 2**47, 2**47]]]), b""])


def test_decode_rejects_non_contiguous_frame_buffer() -> None:
    strided = memoryview(bytearray(8))[::2]
    with pytest.raises(MessageError):
        decode([valid_header([["uint8", [4]]]), strided])


# --------------------------------------------------------------------------------------------- fuzzing


def _message_pool(rng: np.random.Generator) -> list[list[bytes]]:
    """~20 valid messages with varied dtypes, shapes, array counts and meta, as lists of bytes frames."""
    specs: list[tuple[int, int, list[Any], dict[str, Any] | None]] = [
        (0, 0, [], None),
        (1, -3, [], {"k": "v", "n": [1, 2, {"x": None}]}),
        (2, 7, [np.arange(5, dtype=np.int64)], None),
        (3, 1, [np.zeros((0,), dtype=np.float32)], {"empty": True}),
        (4, 2, [np.array([3.5])], None),
        (5, 9, [random_array(rng, "float16", (3, 4))], {"lr": 0.1}),
        (6, 100, [random_array(rng, "complex128", (2,)), random_array(rng, "bool", (7,))], None),
        (7, 0, [random_array(rng, "uint8", (64,))], {"blob": b"\x01\x02"}),
        (8, 5, [random_array(rng, n, (2, 3)) for n in ("int8", "int16", "int32", "uint32")], None),
        (9, 6, [np.zeros((3, 0, 2), dtype=np.uint64), np.ones((1,), dtype=np.float64)], None),
        (10, -(2**40), [random_array(rng, "complex64", (1, 1, 2))], {"deep": {"a": {"b": [1, [2, [3]]]}}}),
        (11, 3, [random_array(rng, "uint16", (4,))] * 3, {"s": "é" * 5}),
        (12, 4, [random_array(rng, "float32", (16,))], {str(i): i for i in range(20)}),
        (13, 8, [np.array([], dtype=np.int8).reshape(0, 0)], None),
        (14, 12, [random_array(rng, "int64", (1,)) for _ in range(4)], None),
        (15, 13, [random_array(rng, "float64", (2, 2, 2))], {"none": None, "f": False}),
        (16, 14, [random_array(rng, n, (3,)) for n in NUMPY_DTYPES], {"dtypes": NUMPY_DTYPES}),
        (17, -1, [random_array(rng, "float32", (100,))], {"ids": list(range(40)), "neg": -7}),
    ]
    pool = [[bytes(f) for f in encode(src, tag, arrays, meta)[0]] for src, tag, arrays, meta in specs]
    # Small headers with extreme but legal values, so byte flips land on interesting msgpack types.
    pool.append([header([2**31 - 1, 2**62 - 1, {"": ""}, []])])
    pool.append([header([0, 0, {"x": 1.5e300}, [["bool", [3]]]]), b"\x00\x01\x02"])
    return pool


def _bfloat16_pool(rng: np.random.Generator) -> list[list[bytes]]:
    """Messages a torch sender produces for bfloat16 tensors, built by hand so that numpy suffices."""
    bits = random_array(rng, "uint16", (3, 2))
    return [
        [encode_header(16, 1, {}, [["bfloat16", [3, 2]]]), bits.tobytes()],
        [encode_header(17, 2, {"m": 1}, [["bfloat16", [0]], ["uint8", [2]]]), b"", b"ab"],
    ]


def _mutate(frames: list[bytes], rng: np.random.Generator, noise: bytes) -> list[bytes]:
    """Applies 1 to 3 random mutations of the kinds a broken or hostile peer could produce."""
    out = list(frames)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(0, 6))
        if not out:
            out.append(noise[: int(rng.integers(0, 16))])
            continue
        # Bias towards the header frame: data frames accept any bytes, the header is where parsing happens.
        i = 0 if rng.random() < 0.5 else int(rng.integers(0, len(out)))
        frame = out[i]
        if kind == 0 and frame:  # flip a byte
            pos = int(rng.integers(0, len(frame)))
            out[i] = frame[:pos] + bytes([frame[pos] ^ int(rng.integers(1, 256))]) + frame[pos + 1 :]
        elif kind == 1:  # truncate
            out[i] = frame[: int(rng.integers(0, len(frame) + 1))]
        elif kind == 2:  # extend with random bytes
            start = int(rng.integers(0, len(noise) - 32))
            out[i] = frame + noise[start : start + int(rng.integers(1, 32))]
        elif kind == 3:  # drop a frame
            del out[i]
        elif kind == 4:  # duplicate a frame
            out.insert(i, frame)
        else:  # swap two frames
            j = int(rng.integers(0, len(out)))
            out[i], out[j] = out[j], out[i]
    return out


def _random_frames(rng: np.random.Generator, noise: bytes) -> list[bytes]:
    """0 to 4 frames of 0 to 64 random bytes; the first often carries a valid prefix to reach msgpack."""
    frames = []
    for _ in range(int(rng.integers(0, 5))):
        start = int(rng.integers(0, len(noise) - 64))
        frames.append(noise[start : start + int(rng.integers(0, 65))])
    if frames and rng.random() < 0.5:
        frames[0] = PREFIX + frames[0]
    return frames


def _fuzz(rng: np.random.Generator, pool: list[list[bytes]], n_random: int, n_mutated: int) -> tuple[int, int]:
    """Decodes random and mutated inputs; fails on any outcome but a consistent Message or MessageError.

    Returns the numbers of inputs decoded and rejected.
    """
    noise = rng.bytes(1 << 16)  # sliced at random offsets: far cheaper than fresh random bytes per input
    offenders: list[str] = []
    n_offending = decoded = rejected = 0
    for i in range(n_random + n_mutated):
        if i < n_random:
            frames = _random_frames(rng, noise)
        else:
            frames = _mutate(pool[int(rng.integers(0, len(pool)))], rng, noise)
        try:
            msg = decode(frames)
        except MessageError:
            rejected += 1
            continue
        except Exception as exc:
            n_offending += 1
            if len(offenders) < 5:
                offenders.append(f"{type(exc).__name__}: {exc!r} for frames {frames!r}")
            continue
        decoded += 1
        # A decoded message must describe exactly the frames it was built from.
        if len(msg.arrays) != len(frames) - 1 or any(
            a.nbytes != len(f) for a, f in zip(msg.arrays, frames[1:], strict=False)
        ):
            n_offending += 1
            if len(offenders) < 5:
                offenders.append(f"inconsistent message {msg!r} for frames {frames!r}")
    assert n_offending == 0, f"{n_offending} bad outcomes, first ones:\n" + "\n".join(offenders)
    return decoded, rejected


def test_decoder_survives_fuzzing() -> None:
    """100k hostile inputs: each decodes to a consistent Message or raises MessageError, nothing else."""
    rng = np.random.default_rng(20240611)
    decoded, rejected = _fuzz(rng, _message_pool(rng) + _bfloat16_pool(rng), n_random=50_000, n_mutated=50_000)
    # Sanity of the fuzzer itself: both the success and the failure paths must be well exercised.
    assert decoded > 1_000
    assert rejected > 10_000


def test_decoder_survives_fuzzing_of_bfloat16_messages() -> None:
    # bfloat16 once failed to decode at all (dtype_from_name evaluated np.dtype("bfloat16")); mutate only those.
    rng = np.random.default_rng(7)
    decoded, _ = _fuzz(rng, _bfloat16_pool(rng), n_random=0, n_mutated=5_000)
    assert decoded > 100


def test_an_array_over_the_frame_limit_travels_in_frames_of_the_limit_and_comes_back_whole() -> None:
    from paratrain.transport.wire import MAX_FRAME_BYTES, frames_of

    big = np.arange(2 * MAX_FRAME_BYTES // 4 + 5, dtype=np.float32)  # two full frames and 20 bytes
    small = np.arange(3, dtype=np.int64)
    frames, _ = encode(1, 7, [big, small])
    assert [memoryview(f).nbytes for f in frames[1:]] == [MAX_FRAME_BYTES, MAX_FRAME_BYTES, 20, 24]
    assert frames_of(big.nbytes) == 3
    msg = decode([bytes(f) for f in frames])
    assert np.array_equal(msg.arrays[0], big) and np.array_equal(msg.arrays[1], small)
    # a frame of the wrong length in the middle, or one missing, is refused like any malformed message
    with pytest.raises(MessageError, match="hold"):
        decode([frames[0], frames[1], bytes(frames[2])[:-4], frames[3], frames[4]])
    with pytest.raises(MessageError, match=r"hold .* needs"):
        decode([frames[0], frames[1], frames[3], frames[4]])


def test_without_a_frame_limit_every_array_is_one_frame() -> None:
    """Links that refuse no frame (no secret) keep one zero-copy frame per array, however large."""
    from paratrain.transport.wire import MAX_FRAME_BYTES, encode_prepared, prepare

    big = np.ones(MAX_FRAME_BYTES // 4 + 1, dtype=np.float32)
    views, descriptors = prepare([big])
    frames = encode_prepared(0, 1, None, views, descriptors, max_frame=None)
    assert len(frames) == 2
    assert np.array_equal(decode(frames, max_frame=None).arrays[0], big)
    # a cut array says its frame length, which may not exceed the receiver's limit
    cut = encode_prepared(0, 1, None, views, descriptors, max_frame=1 << 20)
    assert len(cut) == 1 + 17 and np.array_equal(decode(cut, max_frame=1 << 20).arrays[0], big)
    with pytest.raises(MessageError, match="cuts its array into frames of"):
        decode(cut, max_frame=1 << 19)
