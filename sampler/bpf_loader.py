"""Compiling the BPF programs with bcc and attaching them to targets.

One BPF object holds all programs (bpf/*.c) so that they share the sampled-live table, the
countdown and the ring buffer. Syscall and sched tracepoints are attached once, host-wide,
and filter on the `targets` map; allocator uprobes are attached per target process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import bpf as bpf_sources

from . import uprobe_multi, weights
from .allocators import AllocatorLib, Fn
from .errors import EnvironmentProblem

SOURCES = ("alloc.bpf.c", "vm.bpf.c", "proc.bpf.c")
C_LOST_EVENTS, C_LIVE_FULL, C_PENDING_FULL, C_SAMPLED, C_STACK_ERR = range(5)
C_HITS, C_VM_HITS, C_N = 16, 48, 64

_PERF_ENTRY = {fn: f"{fn.name.lower()}_enter" for fn in Fn}


@dataclass(frozen=True)
class ProbeConfig:
    sample_mean: int = 512 * 1024
    max_frames: int = 127
    live_max: int = 262144
    ringbuf_bytes: int = 8 << 20
    mode: str = "auto"            # auto | session | perf


@dataclass
class _Attachment:
    link_fds: list[int] = field(default_factory=list)
    perf: list[tuple[str, bytes, int, bool]] = field(default_factory=list)   # kind, path, addr, ret


class BpfProbes:
    def __init__(self, cfg: ProbeConfig):
        from bcc import BPF  # imported late: slow, and absent on machines that only analyze

        self.cfg = cfg
        self.session = cfg.mode == "session" or (cfg.mode == "auto" and uprobe_multi.session_supported())
        # One translation unit: bcc rewrites map operations only in the main file, not in
        # included headers, so common.h is pasted in rather than #included.
        text = "\n".join(bpf_sources.source(s) for s in ("common.h", *SOURCES))
        pages = max(1, cfg.ringbuf_bytes // os.sysconf("SC_PAGE_SIZE"))
        pages = 1 << (pages.bit_length() - 1)          # ring buffers are a power of two
        cflags = [
            f"-DSAMPLE_MEAN={cfg.sample_mean}ULL",
            f"-DMAX_FRAMES={cfg.max_frames}",
            f"-DLIVE_MAX={cfg.live_max}",
            f"-DRINGBUF_PAGES={pages}",
            "-Wno-unused-function",
        ]
        if _exit_has_group_dead():
            cflags.append("-DEXIT_HAS_GROUP_DEAD")
        devnull = os.open(os.devnull, os.O_WRONLY)
        saved = os.dup(2)
        try:
            os.dup2(devnull, 2)     # clang's warnings about foreign kernel headers are noise
            self.bpf = BPF(text=text, cflags=cflags)
        except Exception as e:
            raise EnvironmentProblem(
                f"could not compile or load the BPF programs ({e}); check kernel headers under "
                f"/lib/modules/{os.uname().release}/build (run scripts/setup.sh)") from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)
        tab = self.bpf["weight_tab"]
        for i, v in enumerate(weights.weight_table()):
            tab[ctypes.c_int(i)] = ctypes.c_uint64(v)
        self._targets = self.bpf["targets"]
        self._live = self.bpf["live"]
        self._attached: dict[int, _Attachment] = {}
        try:
            if self.session:
                self._alloc_fd = self.bpf.load_func(
                    b"alloc_session", BPF.KPROBE, attach_type=uprobe_multi.BPF_TRACE_UPROBE_SESSION).fd
                self._free_fd = self.bpf.load_func(
                    b"free_multi", BPF.KPROBE, attach_type=uprobe_multi.BPF_TRACE_UPROBE_MULTI).fd
            # perf-mode programs: the mode itself, and the fallback of session mode
            for name in {*_PERF_ENTRY.values(), *(n.replace("_enter", "_d_enter") for n in _PERF_ENTRY.values()
                                                  if not n.startswith(("free", "delete"))),
                         "alloc_return"}:
                self.bpf.load_func(name.encode(), BPF.KPROBE)
        except Exception as e:
            raise EnvironmentProblem(f"the kernel rejected a BPF program ({e}): this kernel may lack "
                                     "uprobe_multi/session support; try --probe-mode perf") from None

    # targets -------------------------------------------------------------------------------
    def add_target(self, pid: int) -> None:
        self._targets[ctypes.c_uint32(pid)] = ctypes.c_uint32(1)

    def attach(self, pid: int, lib: AllocatorLib) -> dict[str, str]:
        """Attach the allocator probes of one library for one process; returns the mode used
        per function ('session' or 'perf'). Raises OSError.

        A session link can be refused for a function that another tool already probes with a
        return probe (EINVAL; seen with memleak-bpfcc running): such functions fall back to
        perf uprobes, which coexist with anything."""
        att = self._attached.setdefault(pid, _Attachment())
        modes: dict[str, str] = {}
        fallback = lib.points
        if self.session:
            fallback = []
            for prog_fd, points, session in ((self._alloc_fd, lib.allocs, True),
                                             (self._free_fd, lib.frees, False)):
                for group in (points, *([p] for p in points)) if points else ():
                    try:
                        att.link_fds.append(uprobe_multi.attach(
                            prog_fd, lib.attach_path, [p.file_offset for p in group],
                            [p.cookie for p in group], pid, session=session))
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        if len(group) == 1:
                            fallback.append(group[0])
                        continue
                    modes.update((p.name, "session") for p in group)
                    if group is points:
                        break       # all in one link: no per-function retries
        path = lib.attach_path.encode()
        for p in fallback:
            addr = p.vaddr + p.site.offset
            prog = _PERF_ENTRY[p.fn].replace("_enter", "_d_enter") if p.delegates else _PERF_ENTRY[p.fn]
            self.bpf.attach_uprobe(name=path, addr=addr, fn_name=prog.encode(), pid=pid)
            att.perf.append(("p", path, addr, False))
            if not p.fn.frees:
                self.bpf.attach_uretprobe(name=path, addr=p.vaddr, fn_name=b"alloc_return", pid=pid)
                att.perf.append(("r", path, p.vaddr, True))
            modes[p.name] = "perf"
        return modes

    def detach(self, pid: int) -> None:
        att = self._attached.pop(pid, None)
        if att:
            for fd in att.link_fds:
                os.close(fd)
            for _kind, path, addr, ret in att.perf:
                try:
                    if ret:
                        self.bpf.detach_uretprobe(name=path, addr=addr, pid=pid)
                    else:
                        self.bpf.detach_uprobe(name=path, addr=addr, pid=pid)
                except Exception:  # noqa: BLE001 - already gone with the process
                    pass
        with contextlib.suppress(KeyError):
            del self._targets[ctypes.c_uint32(pid)]

    def forget_live(self, pid: int, addrs) -> None:
        """Drop sampled-live entries of a process that exited or exec'd."""
        key = self._live.Key()
        key.pid = pid
        for a in addrs:
            key.addr = a
            with contextlib.suppress(KeyError):
                del self._live[key]

    # events and counters -------------------------------------------------------------------
    def open_events(self, handle: Callable[[bytes], None]) -> None:
        def _cb(_ctx, data, size):
            handle(ctypes.string_at(data, size))
        self._cb = _cb
        self.bpf["events"].open_ring_buffer(_cb)

    def poll(self, timeout_ms: int) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)

    def drain(self) -> None:
        self.bpf.ring_buffer_consume()

    def counters(self) -> list[int]:
        tab = self.bpf["counters"]
        return [sum(tab[ctypes.c_int(i)]) for i in range(C_N)]

    def drops(self) -> dict[int, tuple[int, int]]:
        """pid -> (lost events, samples not tracked because the live table was full)."""
        return {k.value: (v.lost_events, v.live_full) for k, v in self.bpf["drops"].items()}

    def close(self) -> None:
        for pid in list(self._attached):
            self.detach(pid)
        self.bpf.cleanup()


def _exit_has_group_dead() -> bool:
    for base in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        try:
            return "group_dead" in Path(base, "events/sched/sched_process_exit/format").read_text()
        except OSError:
            continue
    return False
