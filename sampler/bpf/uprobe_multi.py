"""uprobe_multi links through the raw bpf() syscall (bcc 0.26 predates them).

One link attaches one BPF program to many offsets of one file for one process, each offset
with a cookie (our fn_id). A *session* link (kernel >= 6.13) runs the same program at entry
and return, and skips the return when the entry program returns non-zero: unsampled calls then
cost one trap instead of two.
"""

from __future__ import annotations

import ctypes
import os
import platform

from sampler.bpf.syscall import LINK_CREATE, UprobeMultiLinkAttr, bpf

BPF_TRACE_UPROBE_MULTI = 48
BPF_TRACE_UPROBE_SESSION = 57
BPF_F_UPROBE_MULTI_RETURN = 1


def session_supported() -> bool:
    """Uprobe session links exist from Linux 6.13 on."""
    parts = platform.release().split(".")
    try:
        major, minor = int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return False
    return (major, minor) >= (6, 13)


def attach(prog_fd: int, path: str, offsets: list[int], cookies: list[int], pid: int, *,
           session: bool, ref_ctr_offsets: list[int] | None = None, retprobe: bool = False) -> int:
    """Create the link; returns its fd (closing it detaches). `ref_ctr_offsets`: USDT semaphores
    the kernel counts up while attached; `retprobe`: run at the functions' returns (not with
    `session`). Raises OSError."""
    n = len(offsets)
    path_buf = ctypes.create_string_buffer(os.fsencode(path))
    offs = (ctypes.c_uint64 * n)(*offsets)
    cks = (ctypes.c_uint64 * n)(*cookies)
    refs = (ctypes.c_uint64 * n)(*ref_ctr_offsets) if ref_ctr_offsets else None
    attr = UprobeMultiLinkAttr(
        prog_fd=prog_fd,
        attach_type=BPF_TRACE_UPROBE_SESSION if session else BPF_TRACE_UPROBE_MULTI,
        path=ctypes.addressof(path_buf),
        offsets=ctypes.addressof(offs),
        cookies=ctypes.addressof(cks),
        ref_ctr_offsets=ctypes.addressof(refs) if refs is not None else 0,
        cnt=n,
        multi_flags=BPF_F_UPROBE_MULTI_RETURN if retprobe else 0,
        pid=pid,
    )
    try:
        return bpf(LINK_CREATE, attr)
    except OSError as e:
        raise OSError(e.errno, f"uprobe_multi link on {path}: {e.strerror}") from None
