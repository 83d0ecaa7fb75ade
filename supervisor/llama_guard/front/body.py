"""Request bodies in the front door's memory: the budget, the held body, and giving the memory back.

A client holds of the budget only the bytes it has sent (never what its ``Content-Length`` declares):
a connection that declares 32 MiB and sends one byte holds one byte. A body is held from its first
byte until its answer begins (it is kept for a replay until then); :meth:`HeldBody.release` drops it
and gives its bytes back, once.

The budget bounds real memory, not only a count: each body is read as chunks, joined once into one
``bytes`` (the chunks are freed at once, so a body costs twice its size only while it is joined, one
body at a time: the loop does not yield between the join and the free), and that ``bytes`` is freed
when the body is released. glibc's malloc would keep much of it: it raises its mmap threshold to the
size of each large block freed (up to 32 MiB), after which large bodies come from the heap, and a
heap hole is returned to the kernel only at its top. :func:`pin_mmap_threshold` fixes the threshold
(``mallopt(M_MMAP_THRESHOLD)``: a joined body is its own mapping, unmapped when freed), and
:meth:`Budget.give` calls ``malloc_trim(0)`` once :data:`TRIM_AFTER_BYTES` have been released since the
last trim (the read chunks live on the heap). Both are no-ops where the C library is not glibc.
Source: glibc's ``malloc/malloc.c`` (``M_MMAP_THRESHOLD``, the dynamic threshold, ``malloc_trim``) and
mallopt(3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
from collections.abc import Callable

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
MMAP_THRESHOLD_BYTES = 256 * 1024  # blocks from this size up are their own mapping, unmapped when freed
TRIM_AFTER_BYTES = 8 * 1024 * 1024  # released body bytes between two malloc_trim(0) calls


def _glibc() -> ctypes.CDLL | None:
    """The C library when it has glibc's malloc_trim and mallopt, else None (musl, another libc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _glibc()


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (it then no longer grows with each
    large block freed); returns whether it was set. Process-wide: called once, when the front door opens."""
    return _LIBC is not None and _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1


def trim() -> None:
    """Return the heap's free pages to the kernel (``malloc_trim(0)``)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class Budget:
    """Request-body bytes in memory, bounded by ``limit()`` bytes (read at each take)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self.used = 0
        self._released = 0  # bytes given back since the last trim

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes; False (nothing held) when that would pass the limit."""
        if self.used + n > self._limit():
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        """Give back ``n`` bytes whose memory has just been freed (trims the heap now and then)."""
        self.used -= n
        self._released += n
        if self._released >= TRIM_AFTER_BYTES:
            self._released = 0
            trim()


class HeldBody:
    """One request body and the bytes it holds of ``budget``; :meth:`release` frees both, once."""

    def __init__(self, budget: Budget) -> None:
        self._budget = budget
        self.taken = 0  # bytes held of the budget
        self._chunks: list[bytes] = []
        self._data: bytes | None = None
        self._sha256 = hashlib.sha256()  # hashed as it arrives: the fingerprint never waits on a whole body

    def add(self, chunk: bytes) -> bool:
        """Keep ``chunk`` (read from the client); False when the budget has no room for it."""
        if not self._budget.take(len(chunk)):
            return False
        self.taken += len(chunk)
        self._chunks.append(chunk)
        self._sha256.update(chunk)
        return True

    @property
    def sha256(self) -> str:
        """The hex SHA-256 of the bytes added so far (the whole body, once complete)."""
        return self._sha256.hexdigest()

    def complete(self) -> None:
        """The body has fully arrived: join the chunks into one block (the chunks are freed)."""
        self._data = b"".join(self._chunks)
        self._chunks.clear()

    @property
    def data(self) -> bytes:
        """The whole body (after :meth:`complete`). Raises RuntimeError once released."""
        if self._data is None:
            raise RuntimeError("the request body was released")
        return self._data

    def release(self) -> None:
        """Drop the body and give its bytes back to the budget (a second call does nothing)."""
        if self._data is None and not self._chunks and not self.taken:
            return
        self._data = None
        self._chunks.clear()
        taken, self.taken = self.taken, 0
        self._budget.give(taken)
