"""The recorder's own heap (glibc): large buffers go back to the system when freed."""

from __future__ import annotations

import contextlib
import ctypes

_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 2 << 20


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def fixed_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> None:
    """Every block over `threshold` in its own mapping, unmapped when freed. glibc otherwise raises
    its threshold to the size of each such block freed (up to 32 MiB): the sections read whole
    afterwards (a few MiB to 20 MiB each) come from the heap, which never shrinks below its
    topmost live block, so each transient buffer stays resident (docs/performance.md: the torch
    recorder's peak). 2 MiB: 256 KiB cost ~25% more CPU per sample at 1 s snapshots (fresh pages
    for each array). Not glibc: nothing to do."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().mallopt(_M_MMAP_THRESHOLD, threshold)


def trim() -> None:
    """Give the free memory at the heap's top and in its free pages back to the system."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().malloc_trim(0)
