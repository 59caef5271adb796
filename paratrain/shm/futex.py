"""Linux futex wait/wake on shared-memory words through ctypes, with a portable sleep fallback.

Why a futex: a rank that waits for a peer in shared memory should spin for a few tens of microseconds (waking a
sleeping process on another core costs ~40 µs, more than a whole small allreduce), but must then sleep without
burning the core that the peer may need. A futex sleeps on the value of a 32-bit word in shared memory and is
woken by the peer that changes it, with no message and no file descriptor. ``FUTEX_WAIT`` only sleeps if the word
still holds the expected value (checked atomically in the kernel), so a wake that comes first is never lost.

The operations are *non-private* (no ``FUTEX_PRIVATE_FLAG``): the word lives in memory shared by processes.
Where futexes are unavailable (not Linux, or an unknown architecture) :data:`AVAILABLE` is False and
:func:`wait` sleeps briefly instead; :func:`wake` then does nothing, so waiters rely on their own timeout slices.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import platform
import sys
import time
from typing import Any

__all__ = ["AVAILABLE", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> tuple[Any, int]:
    if not sys.platform.startswith("linux"):
        return None, -1
    number = _SYS_FUTEX.get(platform.machine().lower(), -1)
    if number < 0:
        return None, -1
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None, -1
    fn.restype = ctypes.c_long
    return fn, number


_syscall, _NR_FUTEX = _load()

#: True when real futexes are used; False means :func:`wait` falls back to short sleeps.
AVAILABLE: bool = _syscall is not None


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleeps while the 32-bit word at ``address`` equals ``expected``, at most ``timeout`` seconds.

    Returns on a wake, on a value change, on a signal, or on timeout; the caller re-reads the word and decides
    (spurious returns are allowed, as with every futex). Blocks; thread-safe.

    Args:
        address: the address of a 4-byte aligned word in shared memory.
        expected: the value (as an unsigned 32-bit integer) that the caller last saw there.
        timeout: the longest sleep in seconds (> 0).
    """
    if _syscall is None:
        time.sleep(min(timeout, 0.0005))
        return
    ts = _Timespec(int(timeout), int((timeout - int(timeout)) * 1e9))
    rc = _syscall(
        ctypes.c_long(_NR_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_uint32(expected & 0xFFFFFFFF),
        ctypes.byref(ts),
        None,
        ctypes.c_int(0),
    )
    if rc != 0:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(err, f"futex wait failed: {errno.errorcode.get(err, err)}")


def wake(address: int, count: int = _INT_MAX) -> None:
    """Wakes up to ``count`` processes sleeping in :func:`wait` on the word at ``address``. Never blocks."""
    if _syscall is None:
        return
    _syscall(
        ctypes.c_long(_NR_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(count),
        None,
        None,
        ctypes.c_int(0),
    )
