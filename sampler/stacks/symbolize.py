"""Addresses of a process -> frames (function, module, ASLR-free offset)."""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

from sampler.binary.dwarf_lines import LineTables
from sampler.binary.elf import ElfImage
from sampler.binary.reader import MALFORMED, ElfFormatError
from sampler.proc.maps import Mapping, find_mapping, open_path, read_maps

if TYPE_CHECKING:
    from sampler.stacks.name_worker import NameWorker

NAME_TIMEOUT_S = 5.0        # naming what one snapshot needs (with a name worker)


@dataclass(frozen=True)
class Frame:
    function: str | None
    module: str  # basename of the mapped file, a pseudo path ('[vdso]'), '[anon]' or '[unknown]'
    path: str  # the file's path as the process sees it ('' when none)
    offset: int  # vaddr within the module's ELF; the absolute address when there is no module
    build_id: str | None
    file: str | None = None
    line: int | None = None
    kind: str = "native"
    inline: bool = False      # an inlined call: its code is part of the next (outer) frame
    inlined: tuple[Frame, ...] = ()   # the inlined calls at this address, innermost first (DWARF)


def module_key(frame: Frame) -> tuple:
    """Identifies a code location independently of where ASLR loaded the module."""
    if frame.kind == "python":
        return (frame.path, frame.function, frame.line)
    return (frame.build_id or frame.path, frame.offset)


@dataclass(frozen=True, slots=True)
class Place:
    """Where a native address is, without names: what a stack's identity needs (`key`, as
    module_key gives for its Frame), found per sample; `Symbolizer.describe` names it later."""

    module: str
    path: str
    offset: int                 # vaddr in the module's ELF, the file offset, or the absolute address
    build_id: str | None
    image: ElfImage | None = None   # None: nothing more to read (no file, no ELF headers)

    @property
    def key(self) -> tuple:
        return (self.build_id or self.path, self.offset)


@dataclass
class _ProcessView:
    maps: list[Mapping]
    read_at: float
    generation: int
    owner: int = 0              # the process that read these maps (its forks share the view)
    images: dict[tuple[str, int, str], ElfImage | None] = field(default_factory=dict)


class Symbolizer:
    """Turns (pid, addresses) into Frames, caching maps, ELF images and results (one thread)."""

    def __init__(self, memo_size: int = 200_000, maps_refresh_interval: float = 0.1, namer: NameWorker | None = None):
        """`namer`: symbol tables and DWARF are read there (sampler/stacks/name_worker.py), not here."""
        self._namer = namer
        self._procs: dict[int, _ProcessView] = {}
        self._generations: dict[int, int] = {}
        self._memo: OrderedDict[tuple[int, int, int, bool], Place] = OrderedDict()
        self._names: OrderedDict[tuple[ElfImage, int], Frame] = OrderedDict()   # describe's, per file
        self._memo_size = memo_size
        self._refresh_interval = maps_refresh_interval

    def frames(self, pid: int, addrs: Sequence[int], first_is_ip: bool) -> list[Frame]:
        """One frame per address; addrs[0] is the instruction pointer when first_is_ip.

        The others are return addresses, which point after the call: their function is the one
        containing addr - 1, and the frame's offset is that of addr - 1 (the call site), so that
        a call in tail position is not attributed to the next function.
        """
        places = self.places(pid, addrs, first_is_ip)
        self.prepare(places)
        return [self.describe(p) for p in places]

    def places(self, pid: int, addrs: Sequence[int], first_is_ip: bool) -> list[Place]:
        """`frames` without names: the per-sample part (maps and ELF headers, no symbol tables,
        no DWARF), memoised per process and address."""
        view = self._view(pid)
        out = []
        for i, addr in enumerate(addrs):
            is_ip = first_is_ip and i == 0
            where = addr if is_ip else addr - 1
            if view is None:  # the process is gone
                out.append(_unknown(where))
                continue
            key = (view.owner, view.generation, addr, is_ip)
            place = self._memo.get(key)
            if place is None:
                view, place = self._place(pid, view, where)
                if place.module != "[unknown]":    # a miss may be a dlopen not yet seen: retry later
                    self._memo[(view.owner, view.generation, addr, is_ip)] = place
                    if len(self._memo) > self._memo_size:
                        self._memo.popitem(last=False)
            else:
                self._memo.move_to_end(key)
            out.append(place)
        return out

    def expect_names(self) -> None:
        """Stacks to name at the next snapshot: the name worker is started now (its start-up,
        ~0.3 s, then does not hold the snapshot and the ring buffer's reader up)."""
        if self._namer is not None:
            self._namer.warm()

    def prepare(self, places: Sequence[Place], budget_s: float = NAME_TIMEOUT_S) -> None:
        """Name the places `describe` will be asked for, in one request per file to the name
        worker (when there is one), within `budget_s`: what is not named by then is described by
        file and offset."""
        if self._namer is None:
            return
        todo: dict[ElfImage, tuple[str, dict[int, None]]] = {}
        for p in places:
            if p.image is not None and (p.image, p.offset) not in self._names and self._namer.can_name(p.image):
                todo.setdefault(p.image, (p.path, {}))[1][p.offset] = None
        deadline = time.monotonic() + budget_s
        # a file that already ran out of time goes last, and the smaller (quicker to read) first:
        # a few huge files, a target's planted ones say, never starve a small library of the budget
        def cost(img: ElfImage) -> tuple[int, int]:
            debug = img.debug_elf.buf if img.debug_elf is not None else b""
            return self._namer.strikes(img), len(img.elf.buf) + len(debug)

        for img, (seen_as, offsets) in sorted(todo.items(), key=lambda kv: cost(kv[0])):
            found = self._namer.name(img, seen_as, list(offsets), deadline)
            if found is None:
                continue
            for vaddr, named in zip(offsets, found, strict=True):
                self._remember((img, vaddr), _frame(named, "", "", vaddr, img.build_id))

    def describe(self, place: Place) -> Frame:
        """The named frame of a place: function, file and line, inlined calls (memoised per file
        and offset, whatever process mapped it). With a name worker, only what `prepare` named
        has names."""
        img = place.image
        if img is None:
            return Frame(None, place.module, place.path, place.offset, place.build_id)
        key = (img, place.offset)
        frame = self._names.get(key)
        if frame is None:
            if self._namer is not None:         # not named in time, or the file failed there
                return Frame(None, place.module, place.path, place.offset, img.build_id)
            frame = _frame(name_at(img, place.offset), place.module, place.path, place.offset, img.build_id)
            self._remember(key, frame)
        else:
            self._names.move_to_end(key)
        if frame.module == place.module and frame.path == place.path:
            return frame
        return replace(frame, module=place.module, path=place.path,
                       inlined=tuple(replace(f, module=place.module, path=place.path) for f in frame.inlined))

    def _remember(self, key: tuple[ElfImage, int], frame: Frame) -> None:
        self._names[key] = frame
        if len(self._names) > self._memo_size:
            self._names.popitem(last=False)

    def locate(self, pid: int, addr: int) -> tuple[ElfImage, int] | None:
        """(image, bias) of the executable file mapping holding `addr` (vaddr = addr - bias), for
        the unwinder; None when the address is in no such mapping (or the process is gone)."""
        view = self._view(pid)
        if view is None:
            return None
        m = find_mapping(view.maps, addr)
        if m is None or not m.executable:
            view, m = self._reread(pid, view, addr)
        if m is None or not m.file_backed or not m.executable:
            return None
        img = self._image(pid, view, m)
        if img is None:
            return None
        vaddr = img.file_offset_to_vaddr(addr - m.start + m.offset)
        return None if vaddr is None else (img, addr - vaddr)

    def prune(self, live_pids: set[int], shed: int = 0) -> None:
        """Bound what is kept for a long recording: views of processes not in `live_pids` go;
        `shed` 1 (memory is short) also drops the memo, 2 the DWARF line tables and demangled
        names too (costly to rebuild)."""
        for pid in [p for p in self._procs if p not in live_pids]:
            del self._procs[pid]
        if shed >= 1:
            self._memo.clear()
            self._names.clear()
            # generations only keep old memo entries apart: with the memo empty they may go
            for pid in [p for p in self._generations if p not in live_pids]:
                del self._generations[pid]
        LineTables.prune(shed)
        if shed >= 2:
            demangle.cache_clear()
        if self._namer is not None:
            self._namer.idle()

    def worker_cpu_seconds(self) -> float:
        """CPU time of the name worker's children so far (0 without one)."""
        return self._namer.cpu_seconds() if self._namer is not None else 0.0

    def close(self) -> None:
        if self._namer is not None:
            self._namer.close()

    def images(self) -> set[ElfImage]:
        """The ELF images of the processes known now (what the unwinder's tables may keep)."""
        return {img for v in self._procs.values() for img in v.images.values() if img is not None}

    def mapped_code(self, pid: int) -> None:
        """`pid` mapped executable code (its mmap event): the next miss re-reads its maps at once,
        whatever the rate limit, so that the samples that follow from the new code resolve."""
        view = self._procs.get(pid)
        if view is not None:
            view.read_at = float("-inf")

    def fork(self, parent: int, child: int) -> None:
        """`child` was forked from `parent`: it resolves with the parent's view (the same maps,
        images and memo), even once it is gone, until a miss has its own maps read."""
        view = self._view(parent)
        if view is not None:
            self._procs[child] = view

    def forget(self, pid: int) -> None:
        """Drop what is known of `pid` (it exited or exec'd)."""
        self._procs.pop(pid, None)
        # Memo entries of the old generation are never hit again and age out of the LRU.
        self._generations[pid] = self._generations.get(pid, 0) + 1

    def _view(self, pid: int) -> _ProcessView | None:
        view = self._procs.get(pid)
        if view is None:
            try:
                maps = read_maps(pid)
            except (ProcessLookupError, PermissionError):
                return None
            view = _ProcessView(maps, time.monotonic(), self._generations.get(pid, 0), pid)
            self._procs[pid] = view
        return view

    def _place(self, pid: int, view: _ProcessView, addr: int) -> tuple[_ProcessView, Place]:
        m = find_mapping(view.maps, addr)
        if m is None or not m.executable:
            view, m = self._reread(pid, view, addr)
        if m is None:
            return view, _unknown(addr)
        if not m.file_backed:
            return view, Place(m.path or "[anon]", m.path, addr, None)
        module = os.path.basename(m.path)
        file_off = addr - m.start + m.offset
        img = self._image(pid, view, m)
        vaddr = img.file_offset_to_vaddr(file_off) if img else None
        if img is None or vaddr is None:
            # Without the ELF headers the file offset is the best ASLR-free location.
            return view, Place(module, m.path, file_off, img.build_id if img else None)
        return view, Place(module, m.path, vaddr, img.build_id, img)

    def _reread(self, pid: int, view: _ProcessView, addr: int) -> tuple[_ProcessView, Mapping | None]:
        """The view and mapping of code at `addr` after a miss: in no mapping, or in one that is not
        executable (read while ld.so was mapping a library: its whole span read-only first, the
        code segment over it a moment later), the maps are read again (rate-limited)."""
        view = self._refresh(pid, view)
        return view, find_mapping(view.maps, addr)

    def _refresh(self, pid: int, view: _ProcessView) -> _ProcessView:
        """Re-read the maps after a miss (a dlopen since the last read).

        Stale stacks hold garbage addresses, so reads are rate-limited to one per interval.
        """
        now = time.monotonic()
        if now - view.read_at < self._refresh_interval:
            return view
        try:
            maps = read_maps(pid)
        except (ProcessLookupError, PermissionError):
            view.read_at = now
            return view
        if maps == view.maps:
            view.read_at = now
            return view
        # The address space changed: results memoised for the old maps may be wrong.
        gen = self._generations[pid] = self._generations.get(pid, 0) + 1
        new = _ProcessView(maps, now, gen, pid)
        self._procs[pid] = new
        return new

    def _image(self, pid: int, view: _ProcessView, m: Mapping) -> ElfImage | None:
        key = (m.dev, m.inode, m.path)
        if key not in view.images:
            view.images[key] = None
            # through the process that read the maps (a fork's parent outlives a short child)
            for owner in dict.fromkeys((view.owner or pid, pid)):
                try:
                    view.images[key] = ElfImage.open(open_path(owner, m), m.path, f"/proc/{owner}/root")
                    break
                except (OSError, ElfFormatError):
                    continue
        return view.images[key]


class Named(NamedTuple):
    """What naming an address finds: its function, source line and inlined calls (innermost first)."""
    function: str | None
    file: str | None
    line: int | None
    inlined: tuple[tuple[str | None, str | None, int | None], ...]


def name_at(img: ElfImage, vaddr: int) -> Named:
    """The names of the code at `vaddr` in `img`, from its symbol tables and DWARF (the name
    worker's job; in-process where there is none). A file that is malformed, truncated since or
    over its read budget names nothing."""
    try:
        tables = LineTables.for_image(img)
        src = tables.lookup(vaddr) if tables is not None else []
        name = function_name(img, vaddr, src[-1].function if src else None)
    except (OSError, *MALFORMED):
        return Named(None, None, None, ())
    if not src:
        return Named(name, None, None, ())
    inlined = tuple((demangle(x.function) if x.function else None, x.file, x.line) for x in src[:-1])
    return Named(name, src[-1].file, src[-1].line, inlined)


def _frame(named: Named, module: str, path: str, vaddr: int, build_id: str | None) -> Frame:
    inlined = tuple(Frame(fn, module, path, vaddr, build_id, file, line, inline=True)
                    for fn, file, line in named.inlined)
    return Frame(named.function, module, path, vaddr, build_id, named.file, named.line, inlined=inlined)


def function_name(img: ElfImage, vaddr: int, dwarf_name: str | None = None) -> str | None:
    """The name of the function at `vaddr` (demangled): the symbol covering it, else DWARF's
    subprogram; None when neither does (a static function of a stripped file: no guess from the
    exports around it, which a reader would take for the function that ran)."""
    sym = img.lookup(vaddr)
    if sym is not None:
        return demangle(sym[0])
    return demangle(dwarf_name) if dwarf_name else None


def _unknown(addr: int) -> Place:
    return Place("[unknown]", "", addr, None)


MAX_MANGLED = 1024
MAX_DEMANGLED = 4096


@functools.lru_cache(maxsize=1)
def _cxa_demangle() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    try:
        cxx = ctypes.CDLL("libstdc++.so.6")
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    fn = cxx["__cxa_demangle"]
    fn.restype = ctypes.c_void_p  # malloc'ed: must reach free() as a pointer, not a bytes copy
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    free = libc["free"]
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return fn, free


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """The C++ name behind an Itanium-mangled `name`; `name` itself when it is not one. Names
    come from the target's files: one over MAX_MANGLED is not demangled (the demangler's work and
    output grow fast with nesting), and the result is cut at MAX_DEMANGLED."""
    funcs = _cxa_demangle() if name.startswith("_Z") and len(name) <= MAX_MANGLED else None
    if funcs is None:
        return name[:MAX_DEMANGLED]
    fn, free = funcs
    status = ctypes.c_int()
    buf = fn(name.encode(), None, None, ctypes.byref(status))
    if not buf:
        return name
    try:
        return ctypes.string_at(buf).decode("utf-8", "replace")[:MAX_DEMANGLED] if status.value == 0 else name
    finally:
        free(buf)
