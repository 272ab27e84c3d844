"""Page-table calls the mmap module does not expose: ``madvise`` with the populate advices
(Linux >= 5.14) and ``mincore``, through ctypes so the GIL is released while the kernel
works (``mmap.madvise`` holds it); and the kernel's memory counters (``meminfo``)."""

from __future__ import annotations

import ctypes
import mmap

MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
PAGE_SIZE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int


def madvise(addr: int, length: int, advice: int) -> int:
    """``madvise(addr, length, advice)``; 0, or the errno of the failure."""
    return 0 if _libc.madvise(addr, length, advice) == 0 else ctypes.get_errno()


def resident(addr: int) -> bool:
    """The page at ``addr`` (page-aligned, in a file mapping) is in memory: allocated by
    whichever process touched it first, mapped here or not."""
    vec = (ctypes.c_ubyte * 1)()
    return _libc.mincore(addr, PAGE_SIZE, vec) == 0 and bool(vec[0] & 1)


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """A meminfo file as {field: value}: ``/proc/meminfo`` or a NUMA node's
    ``/sys/devices/system/node/nodeN/meminfo`` (whose lines start ``Node N``); kB fields in
    bytes, counts as they are."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key.split()[-1]] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out
