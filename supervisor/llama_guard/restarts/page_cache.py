"""The model file in the page cache before a planned restart, so the new server reads it from RAM.

llama-server maps the GGUF file (mmap) and copies its tensors to the GPU as it loads: a file whose
pages are cached loads at memory speed, one that is not at disk speed (a 14 GiB file on a 1 GB/s
disk: 14 s more). The old server's mapping keeps most pages warm, but the kernel may have evicted
some (other processes' memory, a large prompt cache): :func:`warm` counts what is resident
(``mincore(2)`` over a read-only mapping), and when the rest fits in ``MemAvailable``
(``/proc/meminfo``) asks the kernel to read it ahead (``posix_fadvise(POSIX_FADV_WILLNEED)``, which
starts the reads and returns). When it does not fit, nothing is read (a read-ahead would only evict
other pages, the model's own first ones included): the caller reports ``model_page_cache_short``.

Blocking (file I/O): run it off the event loop.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from llama_guard.vocab.units import MIB

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Warmth:
    """The page cache and the model file: ``size_bytes`` of the file, ``cached_bytes`` resident
    before the read-ahead (None when ``mincore`` is not available), ``available_bytes`` the host's
    MemAvailable (None when unknown); ``fits``: the uncached rest fits in the available RAM (True
    when either is unknown); ``read_ahead``: WILLNEED was asked for."""

    size_bytes: int
    cached_bytes: int | None
    available_bytes: int | None
    fits: bool
    read_ahead: bool

    def fields(self, model: Path) -> dict[str, object]:
        """The ``model_page_cache_short`` event's fields (MiB)."""
        return {"model": str(model), "model_mib": self.size_bytes / MIB,
                "cached_mib": None if self.cached_bytes is None else self.cached_bytes / MIB,
                "available_mib": None if self.available_bytes is None else self.available_bytes / MIB}


def mem_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (the kernel's estimate of what can be given to
    new use without swapping, reclaimable page cache included); None when absent or unreadable."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024  # kB
    return None


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library's mmap, mincore and munmap, typed (the process's own symbols: no library search)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


MAP_FAILED = ctypes.c_void_p(-1).value
LOW_BIT = bytes(b & 1 for b in range(256))  # a translate table: each mincore byte → its bit 0


def cached_bytes(fd: int, size: int) -> int | None:
    """How many bytes of the open file ``fd`` (``size`` bytes) are in the page cache: ``mincore(2)``
    over a read-only shared mapping (it maps nothing in and reads no page; one byte per 4 KiB page
    of the file, 3.6 MB for a 14 GiB file). None when it cannot tell (the mapping failed)."""
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    libc = _libc()
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == MAP_FAILED:
        return None
    try:
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(addr, size, vec) != 0:
            return None
        resident = bytes(vec).translate(LOW_BIT).count(1)  # bit 0: resident; the others are reserved
    finally:
        libc.munmap(addr, size)
    return min(size, resident * page)


def warm(path: Path, meminfo: Path = MEMINFO) -> Warmth:
    """Count the cached part of ``path``; when the rest fits in MemAvailable (of ``meminfo``), ask
    for it to be read ahead (WILLNEED: the kernel starts the reads). Raises OSError when the file
    cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        cached = cached_bytes(fd, size)
        available = mem_available_bytes(meminfo)
        missing = size - (cached or 0)
        fits = available is None or missing <= available
        if fits and missing > 0:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return Warmth(size, cached, available, fits, read_ahead=fits and missing > 0)
    finally:
        os.close(fd)
