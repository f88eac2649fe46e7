"""Giving freed heap memory back to the operating system.

glibc serves allocations below its mmap threshold from its heaps, and raises that threshold (up to
32 MiB on 64-bit) each time a larger mapped block is freed. A reader that decodes whole shard
arrays (megabytes each) and drops them again then leaves freed pages in its heaps that the
process's RSS keeps: stage two's peak RSS grew 1.33x from a 1x to a 5x cache of SmolLM2's width
(benchmarks/cache_scale.py). `trim()` after dropping decoded shards hands those pages back.
Elsewhere (macOS, musl) there is no malloc_trim and it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)  # glibc only


_MALLOC_TRIM = _malloc_trim()


def trim() -> bool:
    """Return the heaps' free pages to the OS; False where the C library cannot."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
