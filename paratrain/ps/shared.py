"""Pulls read in place: a server's chunk values in shared memory that the workers of its host copy straight out.

Why: with the transport's shared-memory lanes a pushed gradient already reaches the server with one copy (the
worker's, into the lane) and is added where it lies. A pull answered with data would still cost the server one
copy per worker per chunk, on the one thread that also applies every push: with W workers the server copies
W times the model every clock, serially, while the workers wait. PHub's lesson is to keep aggregation next to
the data and let the readers fetch it: here each value larger than :data:`SHARED_MIN_BYTES` lives in a file of
its own that same-host workers map, a pull is answered with the file's name and the value's *sequence number*
instead of the data, and the worker copies the value out itself, in parallel with the other workers.

Consistency without locks (a sequence lock with one writer): the first 64 bytes of the file hold the sequence word.
The server adds 1 to it before every change to the value, and every change already goes through one place
(``ParameterServer._quiesce``, which for values sent zero-copy waits for the sends). A worker checks that the word
equals the number in the answer, copies, and checks again: equal both times means no change began before the copy
ended, so it copied exactly the value the server answered with, as an answer carrying the data would have. Otherwise
it asks again for the data itself (rare: only when another worker's next push hit the chunk during the copy), and
gets the value as it is then: like any pull answered a little later, it holds at least every push its consistency
model requires, maybe more (a key with a server optimizer changes only when a round completes, which under BSP needs
this worker's next clock, so there a copy is never disturbed). x86-64 keeps the server's word store before its data
stores and the worker's loads in order, which is all the protocol needs; the transport offers the memory only where
lanes run (x86-64, one host).

Lifetime: the server unlinks every file when it stops (and the launcher sweeps ``paratrain-<run>*`` after a
crash); workers map a file at its first pull, keep the mapping, and check every name against the serving rank's
prefix and every size against the chunk, since both come from a peer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.transport.lane import segment_dir

__all__ = ["SHARED_MIN_BYTES", "SharedValue", "ValueReader", "value_prefix"]

#: Values at least this large are shared (below it a reply's copy costs less than the worker's extra mapping).
SHARED_MIN_BYTES = 1 << 16
_HEAD = 64


def value_prefix(memory_prefix: str, server: int) -> str:
    """The names of server rank ``server``'s value files, given the transport's ``memory_prefix``."""
    return f"{memory_prefix}psv-{server}-"


class SharedValue:
    """The server's side: one chunk's value in a file of its own, behind its sequence word."""

    def __init__(self, prefix: str, value: npt.NDArray[Any]) -> None:
        self.name = f"{prefix}{os.getpid()}-{secrets.token_hex(6)}"
        self._path = os.path.join(segment_dir(), self.name)
        size = _HEAD + value.nbytes
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self._seq = np.frombuffer(self._mm, dtype=np.uint64, count=1)
        self.value: npt.NDArray[Any] = np.frombuffer(
            self._mm, dtype=value.dtype, count=value.size, offset=_HEAD
        ).reshape(value.shape)
        np.copyto(self.value, value)

    @property
    def seq(self) -> int:
        """The sequence number a reader must see before and after its copy."""
        return int(self._seq[0])

    def changing(self) -> None:
        """Called before every change to :attr:`value`: copies in progress will see it and be read again."""
        self._seq[0] += 1

    def unlink(self) -> None:
        """Removes the name (mappings, the server's and the workers', stay valid)."""
        with contextlib.suppress(OSError):
            os.unlink(self._path)


class ValueReader:
    """A worker's side: the value files it mapped, by name, and the copy under the sequence check."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, npt.NDArray[np.uint64]]] = {}

    def _map(self, name: str, prefix: str, nbytes: int) -> tuple[mmap.mmap, npt.NDArray[np.uint64]]:
        if not name.startswith(prefix) or "/" in name or "\0" in name:
            raise ValueError(f"value file {name!r} is not one of this server's ({prefix}*)")
        mapped = self._maps.get(name)
        if mapped is None:
            fd = os.open(os.path.join(segment_dir(), name), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            mapped = self._maps[name] = (mm, np.frombuffer(mm, dtype=np.uint64, count=1))
        if len(mapped[0]) < _HEAD + nbytes:
            raise ValueError(f"value file {name!r} holds {len(mapped[0]) - _HEAD} bytes, the chunk needs {nbytes}")
        return mapped

    def read(self, name: Any, prefix: str, seq: Any, out: npt.NDArray[Any]) -> bool:
        """Copies the value in file ``name`` into ``out`` (its dtype and shape are the chunk's); False when it
        changed meanwhile (or had already changed), so that the caller asks for the data instead.

        Raises:
            ValueError: the name or the file does not fit this server and chunk.
            OSError: the file cannot be opened or mapped.
        """
        if not isinstance(name, str) or type(seq) is not int:
            raise ValueError(f"malformed reference to a value: {name!r} at {seq!r}")
        mm, word = self._map(name, prefix, out.nbytes)
        if int(word[0]) != seq:
            return False
        src = np.frombuffer(mm, dtype=out.dtype, count=out.size, offset=_HEAD).reshape(out.shape)
        np.copyto(out, src)
        return int(word[0]) == seq

    def close(self) -> None:
        """Forgets the mappings (they close when no array uses them)."""
        self._maps.clear()
