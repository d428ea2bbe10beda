"""Symbolizer and /proc maps on real processes running programs compiled here."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from sampler.binary.elf import ElfImage
from sampler.proc.maps import find_mapping, open_path, read_maps
from sampler.stacks import name_worker, symbolize
from sampler.stacks.name_worker import NameWorker
from sampler.stacks.symbolize import Frame, Symbolizer, demangle, module_key

PROG_SRC = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifndef VARIANT
#define VARIANT "plain"
#endif
const char *prog_variant = VARIANT; /* distinct builds get distinct build-ids */

static __attribute__((noinline)) int main_static(int x) { return x * 3 + 1; }

static void load(const char *path) {
    void *h = dlopen(path, RTLD_NOW);
    if (!h) {
        printf("error %s\n", dlerror());
    } else {
        void *(*addr)(int) = (void *(*)(int))dlsym(h, "widget_addr");
        printf("exported %p\nstatic %p\ncpp %p\n", addr(0), addr(1), addr(2));
    }
    fflush(stdout);
}

/* Prints its return address, then loads the libraries named on stdin. */
static __attribute__((noinline, noreturn)) void serve(void) {
    printf("ra %p\nmain_static %p\n", __builtin_return_address(0), (void *)main_static);
    fflush(stdout);
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        load(line);
    }
    for (;;)
        pause();
}

/* The call is its last instruction: the return address lies past its end. */
__attribute__((noinline, noreturn)) void tail_caller(void) { serve(); }

int main(void) { tail_caller(); }
"""

WIDGET_SRC = r"""
#include <vector>
#ifndef VARIANT
#define VARIANT "plain"
#endif
extern "C" const char *widget_variant;
const char *widget_variant = VARIANT;

namespace shapes {
__attribute__((noinline)) long grow(std::vector<int> &parts, int n) {
    for (int i = 0; i < n; i++)
        parts.push_back(i);
    return (long)parts.size();
}
}  // namespace shapes

static __attribute__((noinline)) int widget_static_helper(int x) {
    asm volatile("");
    return x * 7 + 1;
}

extern "C" __attribute__((noinline)) int widget_exported(int x) { return widget_static_helper(x) + 2; }

extern "C" void *widget_addr(int which) {
    switch (which) {
    case 0: return (void *)&widget_exported;
    case 1: return (void *)&widget_static_helper;
    default: return (void *)&shapes::grow;
    }
}
"""

CFLAGS = ["-O2", "-fno-omit-frame-pointer", "-Wl,--build-id=sha1"]


@dataclass(frozen=True)
class Build:
    prog: Path
    lib: Path


def compile_pair(out: Path, variant: str, strip: bool = False, extra: tuple[str, ...] = ()) -> Build:
    out.mkdir(parents=True, exist_ok=True)
    (out / "prog.c").write_text(PROG_SRC)
    (out / "widget.cpp").write_text(WIDGET_SRC)
    define = f'-DVARIANT="{variant}"'
    prog, lib = out / "prog", out / "libwidget.so"
    subprocess.run(["gcc", *CFLAGS, *extra, define, "-o", str(prog), str(out / "prog.c")], check=True)
    subprocess.run(
        ["g++", *CFLAGS, *extra, define, "-shared", "-fPIC", "-o", str(lib), str(out / "widget.cpp")], check=True
    )
    if strip:
        subprocess.run(["strip", str(prog), str(lib)], check=True)
    return Build(prog, lib)


class Running:
    """A running prog: its return address and main_static, and libraries it dlopens on request."""

    def __init__(self, prog: Path):
        self.proc = subprocess.Popen([str(prog)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        head = self._read(2)
        self.ra, self.main_static = head["ra"], head["main_static"]

    def load(self, lib: Path) -> dict[str, int]:
        self.proc.stdin.write(f"{lib}\n")
        self.proc.stdin.flush()
        return self._read(3)

    def _read(self, n: int) -> dict[str, int]:
        out = {}
        for _ in range(n):
            key, value = self.proc.stdout.readline().split()
            assert key != "error", value
            out[key] = int(value, 16)
        return out

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Build:
    return compile_pair(tmp_path_factory.mktemp("widget"), "plain")


@pytest.fixture
def spawn():
    running: list[Running] = []

    def start(prog: Path) -> Running:
        running.append(Running(prog))
        return running[-1]

    yield start
    for r in running:
        r.stop()


def build_id_of(path: Path) -> str:
    out = subprocess.run(["readelf", "-n", str(path)], check=True, capture_output=True, text=True).stdout
    return re.search(r"Build ID: ([0-9a-f]+)", out).group(1)


def mangled(lib: Path, needle: str, dynamic: bool = True) -> str:
    args = ["nm", "--defined-only", *(["-D"] if dynamic else []), str(lib)]
    out = subprocess.run(args, check=True, capture_output=True, text=True)
    return next(line.split()[-1] for line in out.stdout.splitlines() if needle in line)


def cxxfilt(name: str) -> str:
    return subprocess.run(["c++filt", name], check=True, capture_output=True, text=True).stdout.strip()


def at_ips(sym: Symbolizer, pid: int, addrs: list[int]) -> list[Frame]:
    """Each address symbolized as an instruction pointer."""
    return [sym.frames(pid, [a], first_is_ip=True)[0] for a in addrs]


def test_frames_name_functions_modules_and_build_ids(built, spawn):
    p = spawn(built.prog)
    lib = p.load(built.lib)
    img, prog_img = ElfImage.open(str(built.lib)), ElfImage.open(str(built.prog))
    sym = Symbolizer()

    ip, ret = sym.frames(p.pid, [lib["exported"] + 3, p.ra], first_is_ip=True)
    assert ip == Frame(
        function="widget_exported",
        module="libwidget.so",
        path=str(built.lib),
        offset=img.symbol("widget_exported").value + 3,
        build_id=build_id_of(built.lib),
        file=None,
        line=None,
        kind="native",
    )
    tail = prog_img.symbol("tail_caller")
    ret_offset = tail.value + tail.size - 1  # the call's last byte
    assert ret == Frame("tail_caller", "prog", str(built.prog), ret_offset, build_id_of(built.prog))

    # Return addresses one past a function start look up the start itself.
    addrs = [lib["static"] + 1, lib["cpp"] + 1, p.main_static + 1]
    frames = sym.frames(p.pid, addrs, first_is_ip=False)
    cpp_name = cxxfilt(mangled(built.lib, "grow"))
    assert cpp_name.startswith("shapes::grow(std::vector<int")
    assert [(f.function, f.module) for f in frames] == [
        ("widget_static_helper(int)", "libwidget.so"),  # static C++: mangled too
        (cpp_name, "libwidget.so"),
        ("main_static", "prog"),
    ]
    assert frames[0].offset == img.symbol(mangled(built.lib, "widget_static_helper", dynamic=False)).value
    # Memoised: the same frames again.
    assert sym.frames(p.pid, addrs, first_is_ip=False) == frames


def test_return_address_is_looked_up_at_the_call(built, spawn):
    p = spawn(built.prog)
    sym = Symbolizer()
    # tail_caller ends with its call, so its return address is past its last byte: taken as an
    # instruction pointer it is not in tail_caller, taken as a return address it is.
    (as_ip,) = sym.frames(p.pid, [p.ra], first_is_ip=True)
    (as_ret,) = sym.frames(p.pid, [p.ra], first_is_ip=False)
    assert as_ip.function != "tail_caller"
    assert as_ret.function == "tail_caller"
    assert as_ret.offset == as_ip.offset - 1


def test_stripped_binaries_keep_exported_names(tmp_path, spawn):
    b = compile_pair(tmp_path, "stripped", strip=True)
    p = spawn(b.prog)
    lib = p.load(b.lib)
    addrs = [lib["exported"], lib["static"], lib["cpp"], p.main_static, p.ra - 1]
    frames = at_ips(Symbolizer(), p.pid, addrs)
    assert [f.function for f in frames] == [
        "widget_exported",  # .dynsym
        None,  # static: gone with .symtab
        cxxfilt(mangled(b.lib, "grow")),
        None,
        None,  # executables export nothing
    ]
    assert [f.module for f in frames] == ["libwidget.so"] * 3 + ["prog"] * 2
    assert frames[0].build_id == build_id_of(b.lib)
    assert frames[3].build_id == build_id_of(b.prog)


def test_deleted_library_symbolizes_through_map_files(tmp_path, spawn, built):
    b = compile_pair(tmp_path / "dir with space", "deleted")
    p = spawn(built.prog)
    lib = p.load(b.lib)
    b.lib.unlink()

    m = find_mapping(read_maps(p.pid), lib["exported"])
    assert (m.path, m.deleted, m.executable) == (str(b.lib), True, True)
    assert open_path(p.pid, m) == f"/proc/{p.pid}/map_files/{m.start:x}-{m.end:x}"
    frames = at_ips(Symbolizer(), p.pid, [lib["exported"], lib["static"]])
    assert [(f.function, f.module, f.path) for f in frames] == [
        ("widget_exported", "libwidget.so", str(b.lib)),
        ("widget_static_helper(int)", "libwidget.so", str(b.lib)),
    ]


def test_maps_are_reread_after_dlopen(built, spawn):
    p = spawn(built.prog)
    sym = Symbolizer(maps_refresh_interval=0)
    assert sym.frames(p.pid, [p.main_static], first_is_ip=True)[0].function == "main_static"
    lib = p.load(built.lib)  # mapped after the first read of the maps
    assert sym.frames(p.pid, [lib["exported"]], first_is_ip=True)[0].function == "widget_exported"


def test_code_in_a_mapping_not_yet_executable_rereads_the_maps(built, spawn, monkeypatch):
    """Maps read while ld.so was loading a library hold its span read-only (mapped whole first,
    its code over it a moment later): after the code's mmap event, an address there is a stale
    view, read again, not code without CFI or symbols."""
    p = spawn(built.prog)
    addr = p.load(built.lib)["exported"]
    reads: list[int] = []

    def mid_dlopen(pid: int):
        reads.append(pid)
        maps = read_maps(pid)
        return maps if len(reads) > 1 else [replace(m, perms="r--p") if m.start <= addr < m.end else m
                                            for m in maps]

    monkeypatch.setattr(symbolize, "read_maps", mid_dlopen)
    sym = Symbolizer(maps_refresh_interval=3600)
    assert sym.frames(p.pid, [p.main_static], first_is_ip=True)[0].function == "main_static"
    sym.mapped_code(p.pid)                                  # the recorder saw the code's mmap
    assert sym.locate(p.pid, addr) is not None and len(reads) == 2
    assert sym.frames(p.pid, [addr], first_is_ip=True)[0].function == "widget_exported"
    assert sym.locate(p.pid, addr) is not None and len(reads) == 2     # once: the view is current


def test_module_key_is_the_same_across_processes(built, spawn):
    sym = Symbolizer()
    keys, addrs = set(), set()
    for _ in range(2):
        p = spawn(built.prog)
        addr = p.load(built.lib)["cpp"] + 7
        keys.add(module_key(sym.frames(p.pid, [addr], first_is_ip=True)[0]))
        addrs.add(addr)
    grow = ElfImage.open(str(built.lib)).symbol(mangled(built.lib, "grow"))
    assert keys == {(build_id_of(built.lib), grow.value + 7)}
    if Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0":
        assert len(addrs) == 2


def test_gone_process(built, spawn):
    p = spawn(built.prog)
    sym = Symbolizer()
    assert sym.frames(p.pid, [p.main_static], first_is_ip=True)[0].function == "main_static"
    p.stop()
    with pytest.raises(ProcessLookupError):
        read_maps(p.pid)
    sym.forget(p.pid)
    for s in (sym, Symbolizer()):
        frames = s.frames(p.pid, [p.main_static, p.ra], first_is_ip=True)
        assert frames == [
            Frame(None, "[unknown]", "", p.main_static, None),
            Frame(None, "[unknown]", "", p.ra - 1, None),
        ]


def test_own_process_libc_and_pseudo_mappings():
    pid = os.getpid()
    # From libc itself: a non-PIE python's own PLT stub is malloc's canonical address.
    malloc = ctypes.cast(ctypes.CDLL("libc.so.6").malloc, ctypes.c_void_p).value
    maps = read_maps(pid)
    assert [m.start for m in maps] == sorted(m.start for m in maps)
    assert find_mapping(maps, maps[0].start - 1) is None
    assert find_mapping(maps, maps[-1].end) is None

    vdso = next(m for m in maps if m.path == "[vdso]")
    anon = next((m for m in maps if m.path == ""), None)
    addrs = [malloc, vdso.start + 1, 8] + ([anon.start + 1] if anon else [])
    frames = Symbolizer().frames(pid, addrs, first_is_ip=False)
    assert frames[0].module == "libc.so.6"  # malloc - 1: whatever precedes malloc
    assert frames[1] == Frame(None, "[vdso]", "[vdso]", vdso.start, None)
    assert frames[2] == Frame(None, "[unknown]", "", 7, None)
    if anon:
        assert frames[3] == Frame(None, "[anon]", "", anon.start, None)
    (ip,) = Symbolizer().frames(pid, [malloc + 4], first_is_ip=True)
    assert (ip.function, ip.module, ip.path) == ("malloc", "libc.so.6", find_mapping(maps, malloc).path)


def test_demangle():
    assert demangle("_ZN6shapes4growERSt6vectorIiSaIiEEi") == cxxfilt("_ZN6shapes4growERSt6vectorIiSaIiEEi")
    assert demangle("_ZN3foo3barEv.cold") == "foo::bar() [clone .cold]"
    assert demangle("malloc") == "malloc"
    assert demangle("_Znot_a_mangled_name") == "_Znot_a_mangled_name"


# -- the name worker (sampler/stacks/name_worker.py): the same names, from a child ------------------

@pytest.fixture(scope="module")
def debug_built(tmp_path_factory):
    """prog and libwidget.so with DWARF (file, line, inlined calls to name)."""
    return compile_pair(tmp_path_factory.mktemp("named"), "named", extra=("-g",))


def test_the_worker_names_as_the_recorder_would_even_after_the_process_and_file_are_gone(debug_built, spawn):
    p = spawn(debug_built.prog)
    lib = p.load(debug_built.lib)
    addrs = [lib["exported"] + 1, lib["static"] + 1, lib["cpp"] + 1, p.main_static + 1, p.ra]
    here = Symbolizer().frames(p.pid, addrs, first_is_ip=False)
    assert all(f.function and f.file and f.line for f in here[:4]), here
    namer = NameWorker()
    sym = Symbolizer(namer=namer)
    try:
        places = sym.places(p.pid, addrs, first_is_ip=False)
        p.stop()                    # what the worker reads is the recorder's descriptor of each file
        debug_built.lib.rename(debug_built.lib.with_suffix(".gone"))
        sym.prepare(places)
        assert [sym.describe(x) for x in places] == here
        assert namer.cpu_seconds() > 0 and not namer.failures
    finally:
        sym.close()
        debug_built.lib.with_suffix(".gone").rename(debug_built.lib)


def test_a_file_not_named_in_time_fails_alone_and_keeps_its_offsets(debug_built, spawn, monkeypatch):
    """The child is killed when an answer misses the snapshot's deadline; a file late twice is not
    asked for again (its frames keep module and offset), and the next file is named by a fresh child."""
    p = spawn(debug_built.prog)
    lib = p.load(debug_built.lib)
    namer = NameWorker()
    sym = Symbolizer(namer=namer)
    try:
        slow, fine = sym.places(p.pid, [lib["exported"] + 1, p.main_static + 1], first_is_ip=False)
        # cut after 1 ms by the snapshot's budget: not the file's fault
        assert namer.name(slow.image, slow.path, [slow.offset], time.monotonic() + 0.001) is None
        assert slow.image not in namer.failed and not namer.failures
        monkeypatch.setattr(name_worker, "STRIKE_AFTER_S", 0.0)     # now every late answer is the file's
        for _ in range(2):          # twice: a first late answer may be a cold start
            assert namer.name(slow.image, slow.path, [slow.offset], time.monotonic() + 0.001) is None
        sym.prepare([slow, fine])
        frame = sym.describe(slow)
        assert (frame.function, frame.module, frame.offset) == (None, "libwidget.so", slow.offset)
        assert sym.describe(fine).function == "main_static"
        assert namer.failures == 1 and slow.image in namer.failed and fine.image not in namer.failed
    finally:
        sym.close()


def test_names_from_the_worker_are_bounded_before_they_reach_a_frame_row():
    """Names a file's DWARF chose can be of any length and lines any number: what the child
    answers is cut to what a frame row holds, on both sides."""
    from sampler.stacks.symbolize import Named
    n = name_worker.bounded(Named("f" * 100_000, 7, 1 << 40, (("g" * 5000, "h.c", -3),) * 500))
    assert len(n.function) == name_worker.MAX_NAME and n.file is None and n.line is None
    assert len(n.inlined) == name_worker.MAX_INLINED
    assert n.inlined[0] == ("g" * name_worker.MAX_NAME, "h.c", None)
