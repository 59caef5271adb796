"""The wire format: a versioned msgpack header frame followed by raw data frames. Never pickle.

A message is ``[header, buf_0, ..., buf_k]``. The header frame is ``MAGIC`` (4 bytes), a version byte, then a
msgpack array ``[src, tag, meta, descriptors]`` where ``meta`` is a map of small scalars chosen by the
algorithm and each descriptor is ``[dtype_name, shape]`` of one buffer. Data frames are the raw bytes of
C-contiguous arrays, so a sender hands its arrays' memory to the socket without copying, and a receiver wraps
the received frames in numpy arrays without copying. On authenticated links no frame is longer than the link's
limit (at most :data:`MAX_FRAME_BYTES`): a larger array travels as consecutive frames of that length (the last
shorter; its descriptor says the length: ``[dtype, shape, frame bytes]``), which the receiver joins (one copy, for
those arrays only), so that every socket can refuse longer frames before reading them (a stranger that declares a
1 GiB frame in its handshake is cut off at its header, not buffered). Links without a secret let anyone in anyway,
and keep one frame per array (``max_frame=None``).

Between processes of one host a message's arrays may instead lie in a shared-memory lane
(:mod:`paratrain.transport.lane`): then the header is the only frame and a fifth element, ``[lane name, record
offset]``, says where they are.

Everything a peer sends is untrusted. :func:`decode` checks magic, version, types, dtype names, shapes and that
each frame's length equals what its descriptor implies, and raises :class:`~paratrain.errors.MessageError`
otherwise; it never executes anything from the peer (msgpack with ext types refused).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from paratrain._arrays import DTYPE_NAMES, dtype_from_name
from paratrain.device import host_view
from paratrain.errors import MessageError

__all__ = [
    "MAGIC",
    "MAX_DIMS",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "VERSION",
    "Message",
    "decode",
    "encode",
    "encode_header",
    "encode_prepared",
    "frames_of",
    "prepare",
]

MAGIC = b"PTRN"
VERSION = 2  # 2: arrays over MAX_FRAME_BYTES cut into frames
MAX_HEADER_BYTES = 1 << 16
MAX_FRAMES = 4096
#: The longest data frame; the sockets refuse longer ones (with room for a mechanism's framing, ``ZmqTransport``).
MAX_FRAME_BYTES = 16 << 20
MAX_DIMS = 32
_MAX_META_ITEMS = 256
_PREFIX = len(MAGIC) + 1


@dataclass(frozen=True, slots=True)
class Message:
    """A received (or locally built) message.

    Attributes:
        src: rank of the sender.
        tag: integer tag chosen by the sender; receivers match on ``(src, tag)``.
        meta: small msgpack-able header fields (str keys; int, float, str, bool, None, bytes, lists, maps).
        arrays: the data buffers as numpy arrays (read-only views of received frames).
        dtypes: wire dtype names, parallel to ``arrays``; differs from ``arrays[i].dtype`` only for
            ``"bfloat16"`` (carried as uint16).
    """

    src: int
    tag: int
    meta: Mapping[str, Any] = field(default_factory=dict)
    arrays: tuple[npt.NDArray[Any], ...] = ()
    dtypes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of data carried (headers excluded)."""
        return sum(a.nbytes for a in self.arrays)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise MessageError(f"msgpack extension type {code} is not allowed in a paratrain header")


def encode_header(
    src: int, tag: int, meta: Mapping[str, Any], descriptors: Sequence[list[Any]], lane: list[Any] | None = None
) -> bytes:
    """The header frame for a message (see the module docstring); ``lane``: where its arrays lie instead of
    frames (``[lane name, record offset]``, see :mod:`paratrain.transport.lane`)."""
    fields = [src, tag, dict(meta), list(descriptors)]
    if lane is not None:
        fields.append(lane)
    body = msgpack.packb(fields, use_bin_type=True)
    if len(body) + _PREFIX > MAX_HEADER_BYTES:
        raise ValueError(
            f"message header is {len(body)} bytes, over the {MAX_HEADER_BYTES}-byte limit; "
            "put bulk data in arrays, not in meta"
        )
    return MAGIC + bytes([VERSION]) + body


def encode(
    src: int, tag: int, arrays: Sequence[Any] = (), meta: Mapping[str, Any] | None = None
) -> tuple[list[bytes | memoryview], list[npt.NDArray[Any]]]:
    """Frames for a message, and the arrays whose memory the frames borrow.

    The data frames are memoryviews of the (made contiguous) arrays, not copies: the caller must keep the
    returned arrays alive and unmodified until the transport has sent them.

    Raises:
        TypeError: an array of an unsupported type or dtype.
        ValueError: too many arrays or an oversized header.
    """
    views, descriptors = prepare(arrays)
    return encode_prepared(src, tag, meta, views, descriptors), views


def encode_prepared(
    src: int,
    tag: int,
    meta: Mapping[str, Any] | None,
    views: Sequence[npt.NDArray[Any]],
    descriptors: list[list[Any]],
    *,
    max_frame: int | None = MAX_FRAME_BYTES,
) -> list[bytes | memoryview]:
    """The frames of :func:`encode` from what :func:`prepare` returned (the descriptors keep each array's wire
    dtype name: a bfloat16 tensor's view is uint16, and preparing the views again would send it as uint16).
    ``max_frame``: the longest data frame on this link (None: one frame per array, for links that refuse no
    frame). A cut array's descriptor says its frame length (``[dtype, shape, frame bytes]``)."""
    frames: list[bytes | memoryview] = []
    described: list[list[Any]] = []
    for view, desc in zip(views, descriptors, strict=True):
        data = memoryview(view.reshape(-1).view(np.uint8).data) if view.size else memoryview(b"")
        if max_frame is None or data.nbytes <= max_frame:
            frames.append(data if view.size else b"")
            described.append(desc)
        else:
            frames.extend(data[i : i + max_frame] for i in range(0, data.nbytes, max_frame))
            described.append([*desc[:2], max_frame])
    return [encode_header(src, tag, meta or {}, described), *frames]


def frames_of(nbytes: int, max_frame: int | None = MAX_FRAME_BYTES) -> int:
    """The frames an array of ``nbytes`` travels in (one for an empty array, or without ``max_frame``).

    Example:
        >>> frames_of(0), frames_of(MAX_FRAME_BYTES), frames_of(MAX_FRAME_BYTES + 1), frames_of(1 << 40, None)
        (1, 1, 2, 1)
    """
    return 1 if max_frame is None else max(1, -(-nbytes // max_frame))


def prepare(arrays: Sequence[Any]) -> tuple[list[npt.NDArray[Any]], list[list[Any]]]:
    """C-contiguous numpy views of ``arrays`` and their descriptors (``[dtype name, shape]``).

    Raises:
        TypeError: an array of an unsupported type or dtype.
        ValueError: too many arrays.
    """
    if len(arrays) > MAX_FRAMES:
        raise ValueError(f"a message carries at most {MAX_FRAMES} arrays, got {len(arrays)}; fuse them")
    views: list[npt.NDArray[Any]] = []
    descriptors: list[list[Any]] = []
    for a in arrays:
        view, name = host_view(a)  # (a device tensor: staged to host memory)
        views.append(view)
        descriptors.append([name, list(view.shape)])
    return views, descriptors


#: Resolves a lane header: ``(src, lane field, [(storage dtype, shape, nbytes)])`` to the arrays.
LaneResolver = Callable[[int, Any, list[tuple[np.dtype[Any], list[int], int]]], list[npt.NDArray[Any]]]


def _check_meta(meta: Any, depth: int = 0) -> None:
    if depth > 8:
        raise MessageError("message meta is nested too deeply")
    if isinstance(meta, dict):
        if len(meta) > _MAX_META_ITEMS:
            raise MessageError("message meta has too many entries")
        for key, value in meta.items():
            if not isinstance(key, str):
                raise MessageError(f"message meta key {key!r} is not a string")
            _check_meta(value, depth + 1)
    elif isinstance(meta, list):
        if len(meta) > 1 << 16:
            raise MessageError("message meta list is too long")
        for item in meta:
            _check_meta(item, depth + 1)
    elif meta is not None and not isinstance(meta, (bool, int, float, str, bytes)):
        raise MessageError(f"message meta holds a value of type {type(meta).__name__}")


def _buffer(frame: Any, index: int) -> memoryview:
    try:
        buf = memoryview(frame)
    except TypeError:
        raise MessageError(f"frame {index} does not expose a buffer") from None
    if not buf.c_contiguous:
        raise MessageError(f"frame {index} is not a contiguous buffer")
    return buf.cast("B")


def _array(
    frames: Sequence[Any], first: int, storage: np.dtype[Any], desc: list[Any], *, expected: int, max_frame: int
) -> npt.NDArray[Any]:
    """The array of descriptor ``desc`` (``[name, shape]``) from its frames (numbered from ``first``): a view of a
    lone frame, or its frames joined (each but the last exactly ``max_frame``)."""
    name, shape = desc[:2]
    bufs = [_buffer(f, first + k) for k, f in enumerate(frames)]
    sizes = [b.nbytes for b in bufs]
    whole = [max_frame] * (len(bufs) - 1) + [expected - max_frame * (len(bufs) - 1)]
    if sizes != whole:
        where = f"frame {first}" if len(bufs) == 1 else f"frames {first}-{first + len(bufs) - 1}"
        raise MessageError(f"{where} hold {sizes} bytes but its descriptor {shape} {name} needs {whole}")
    if expected == 0:
        return np.empty(shape, dtype=storage)
    if len(bufs) == 1:
        return np.frombuffer(bufs[0], dtype=storage).reshape(shape)
    joined = np.empty(expected, dtype=np.uint8)
    for k, buf in enumerate(bufs):
        joined[k * max_frame : k * max_frame + buf.nbytes] = np.frombuffer(buf, dtype=np.uint8)
    return joined.view(storage).reshape(shape)


def decode(
    frames: Sequence[bytes | memoryview | Any],
    lanes: LaneResolver | None = None,
    *,
    max_frame: int | None = MAX_FRAME_BYTES,
) -> Message:
    """Validates and decodes received frames into a :class:`Message` without copying the data.

    Frames may be ``bytes``, ``memoryview`` or any object exposing the buffer protocol (e.g. ``zmq.Frame``).
    A header with a lane field (its arrays lie in a shared-memory lane, not in frames) is accepted only with
    ``lanes``, which maps the lane and wraps the arrays (and raises ``MessageError`` for bad offsets).
    ``max_frame``: the longest frame a descriptor may announce (the receiving socket's limit; None:
    :data:`MAX_FRAME_BYTES`).

    Raises:
        MessageError: for anything malformed; the message must then be dropped.
    """
    if not frames:
        raise MessageError("empty message (no header frame)")
    try:
        head = memoryview(frames[0])
    except TypeError:
        raise MessageError("header frame does not expose a buffer") from None
    if head.nbytes < _PREFIX:
        raise MessageError(f"header frame of {head.nbytes} bytes is too short")
    if head.nbytes > MAX_HEADER_BYTES:
        raise MessageError(f"header frame of {head.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    head = head.cast("B")
    if head[: len(MAGIC)].tobytes() != MAGIC:
        raise MessageError("bad magic: not a paratrain message (another program on this port?)")
    version = head[len(MAGIC)]
    if version != VERSION:
        raise MessageError(
            f"wire version {version} is not {VERSION}: peers run different paratrain versions; install the same one"
        )
    try:
        body = msgpack.unpackb(
            head[_PREFIX:],
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            use_list=True,
        )
    except MessageError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for garbage; all mean "malformed"
        raise MessageError(f"undecodable header: {type(exc).__name__}: {exc}") from None
    if not (isinstance(body, list) and len(body) in (4, 5)):
        raise MessageError("header is not [src, tag, meta, descriptors]")
    src, tag, meta, descriptors = body[:4]
    lane = body[4] if len(body) == 5 else None
    if lane is not None and lanes is None:
        raise MessageError("a shared-memory lane message reached a transport without lanes")
    if type(src) is not int or type(tag) is not int:
        raise MessageError("header src and tag must be integers")
    if not (-(1 << 62) < tag < (1 << 62)) or not 0 <= src < (1 << 31):
        raise MessageError(f"header src {src} or tag {tag} out of range")
    if not isinstance(meta, dict):
        raise MessageError("header meta is not a map")
    _check_meta(meta)
    if not isinstance(descriptors, list):
        raise MessageError("header descriptors is not a list")
    if len(descriptors) > MAX_FRAMES:
        raise MessageError(f"header announces {len(descriptors)} arrays, over {MAX_FRAMES}")
    if lane is not None and len(frames) != 1:
        raise MessageError(f"a lane message carries no data frames, but {len(frames) - 1} frames arrived")
    arrays: list[npt.NDArray[Any]] = []
    names: list[str] = []
    specs: list[tuple[np.dtype[Any], list[int], int]] = []
    next_frame = 1
    for i, desc in enumerate(descriptors):
        if not (isinstance(desc, list) and len(desc) in (2, 3)):
            raise MessageError(f"descriptor {i} is not [dtype, shape] or [dtype, shape, frame bytes]")
        name, shape = desc[:2]
        frame = desc[2] if len(desc) == 3 else None
        if frame is not None and not (type(frame) is int and 1 <= frame <= (max_frame or MAX_FRAME_BYTES)):
            raise MessageError(f"descriptor {i} cuts its array into frames of {frame!r} bytes")
        if not isinstance(name, str) or name not in DTYPE_NAMES:
            raise MessageError(f"descriptor {i} has an unsupported dtype {name!r}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise MessageError(f"descriptor {i} shape is not a list of at most {MAX_DIMS} dimensions")
        if not all(type(d) is int and 0 <= d < (1 << 48) for d in shape):
            raise MessageError(f"descriptor {i} shape {shape!r} holds a negative, huge or non-integer size")
        storage = dtype_from_name(name)
        if math.prod(d for d in shape if d) * storage.itemsize >= 1 << 62:
            raise MessageError(f"descriptor {i} shape {shape!r} describes an impossibly large array")
        expected = math.prod(shape) * storage.itemsize
        names.append(name)
        if lane is not None:
            specs.append((storage, shape, expected))
            continue
        count = frames_of(expected, frame)
        if next_frame + count > len(frames):
            raise MessageError(f"descriptor {i} needs {count} frame(s) but the message ends before them")
        mine = frames[next_frame : next_frame + count]
        arrays.append(_array(mine, next_frame, storage, desc, expected=expected, max_frame=frame or expected))
        next_frame += count
    if lane is None and next_frame != len(frames):
        raise MessageError(f"header announces {next_frame - 1} data frames but {len(frames) - 1} arrived")
    if lane is not None:
        assert lanes is not None
        arrays = lanes(src, lane, specs)
    return Message(src=src, tag=tag, meta=meta, arrays=tuple(arrays), dtypes=tuple(names))
