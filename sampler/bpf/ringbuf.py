"""Reading a BPF ring buffer map, with its data area mapped once.

libbpf maps the data area twice in a row, so that a record crossing the end reads as one piece;
every page of it then counts twice in the reader's RSS (16 MiB for our 8 MiB ring, once the
producer has gone round). Here the data is mapped once and the rare record that crosses the end
is joined from its two pieces. The layout is the kernel's (kernel/bpf/ringbuf.c): page 0 holds
the consumer position (ours to write), page 1 the producer position, then the data; each record
has an 8-byte header (length with BUSY and DISCARD bits, page offset) and takes its length
rounded up to 8 bytes.

Positions are read and written as single aligned 64-bit accesses (x86-64 orders loads and stores
as the kernel's acquire/release pairs need).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import time
from collections.abc import Callable

_BUSY = 1 << 31
_DISCARD = 1 << 30
_HDR = 8

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, length: int, prot: int, offset: int) -> int:
    addr = _libc.mmap(None, length, prot, mmap.MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mapping the ring buffer: {os.strerror(err)}")
    return addr


class RingReader:
    """The records of one ring buffer map (`size`: its data bytes, a power of two of pages)."""

    def __init__(self, fd: int, size: int):
        page = mmap.PAGESIZE
        if size <= 0 or size % page or size & (size - 1):
            raise ValueError(f"ring buffer size {size}: not a power of two of pages")
        self._page, self._size, self._mask = page, size, size - 1
        self._cons_addr = _map(fd, page, mmap.PROT_READ | mmap.PROT_WRITE, 0)
        try:
            self._area_addr = _map(fd, page + size, mmap.PROT_READ, page)
        except OSError:
            _libc.munmap(self._cons_addr, page)
            raise
        self._cons = ctypes.c_uint64.from_address(self._cons_addr)
        self._prod = ctypes.c_uint64.from_address(self._area_addr)
        data = (ctypes.c_char * size).from_address(self._area_addr + page)
        self._data = memoryview(data).cast("B")
        self._words = self._data.cast("I")                  # record headers: one aligned load each
        self._poller = select.epoll()
        self._poller.register(fd, select.EPOLLIN)

    def read(self, handle: Callable[[bytes], None], deadline: float = float("inf")) -> bool:
        """Hand every committed record to `handle`, in order; True when cut short at `deadline`
        (looked at every 32 records; the rest waits for the next read). A record is consumed
        before `handle` sees it: one that raises is not handed over again."""
        cons = self._cons.value
        data, words, mask = self._data, self._words, self._mask
        read = 0
        try:
            while True:
                prod = self._prod.value
                if cons >= prod:
                    return False
                while cons < prod:
                    off = cons & mask
                    hdr = words[off >> 2]
                    if hdr & _BUSY:                 # reserved, not yet committed: later
                        return False
                    n = hdr & ~(_BUSY | _DISCARD)
                    cons += (n + _HDR + 7) & ~7
                    if hdr & _DISCARD:
                        continue
                    start = off + _HDR
                    end = start + n
                    rec = data[start:end].tobytes() if end <= self._size else \
                        data[start:].tobytes() + data[:end - self._size].tobytes()
                    self._cons.value = cons         # its space is free for the programs now
                    handle(rec)
                    read += 1
                    if not read & 31 and time.monotonic() > deadline:
                        return True
        finally:
            self._cons.value = cons

    def wait(self, timeout_ms: int) -> None:
        """Until the programs wake the reader (or `timeout_ms` passes)."""
        self._poller.poll(max(timeout_ms, 0) / 1000)

    def close(self) -> None:
        if self._poller.closed:
            return
        self._poller.close()
        self._words.release()
        self._data.release()
        del self._cons, self._prod
        _libc.munmap(self._area_addr, self._page + self._size)
        _libc.munmap(self._cons_addr, self._page)
