"""DWARF CFI unwinding (sampler.stacks.cfi, sampler.stacks.unwind) of stacks that real processes capture of
themselves, as BPF would: registers plus a copy of the top of the stack.

Ground truth: the call chains the workloads make (unwind_self.c, a Python script through torch's
autograd engine), readelf's decoding of the same CFI, and the walk on the full copy for truncated
copies.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import WORKLOADS, compile_c

from sampler.binary import elf
from sampler.binary.elf import ElfImage
from sampler.proc.maps import find_mapping, open_path, read_maps
from sampler.stacks import cfi
from sampler.stacks.name_worker import NameWorker
from sampler.stacks.table_worker import TableWorker
from sampler.stacks.unwind import Regs, Unwinder, UnwindResult

STOPS = {"entry", "no_cfi", "stack_end", "max_frames", "bad_frame"}
LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
# Our functions in unwind_self.c / unwind_lib.c, innermost first, as each thread calls them.
OWN_MAIN = ["unwind_capture", "capture", "in_handler", "on_signal", "realigned", "framed", "level2", "lib_call",
            "level1", "main", "_start"]
OWN_THREAD = OWN_MAIN[:-2] + ["thread_main"]
# libc frames expected in between (names that need libc's .symtab are checked only when it has one).
LIBC_MAIN = ["__restore_rt", "raise", "__libc_start_call_main", "__libc_start_main"]
LIBC_THREAD = ["__restore_rt", "raise", "start_thread"]
THREAD_ENTRY = {"clone3", "__clone3", "clone", "__clone", "start_thread"}


# Helpers


class MapsLocate:
    """A Locate over /proc/PID/maps: (image, bias) for addresses in file-backed executable maps."""

    def __init__(self, pid: int):
        self.pid = pid
        self.maps = read_maps(pid)
        self._found: dict[int, tuple[ElfImage, int] | None] = {}

    def __call__(self, addr: int) -> tuple[ElfImage, int] | None:
        m = find_mapping(self.maps, addr)
        if m is None:
            return None
        r = self._found.get(m.start, False)
        if r is False:
            r = None
            if m.executable and m.file_backed:
                img = ElfImage.open(open_path(self.pid, m))
                vaddr = img.file_offset_to_vaddr(addr - m.start + m.offset)
                r = (img, addr - vaddr) if vaddr is not None else None
            self._found[m.start] = r
        return r

    def file(self, addr: int) -> str:
        m = find_mapping(self.maps, addr)
        return Path(m.path).name if m else "?"


def read_capture(path: Path) -> tuple[Regs, bytes]:
    raw = path.read_bytes()
    rip, rsp, rbp, n = struct.unpack_from("<4Q", raw)
    assert len(raw) == 32 + n
    return Regs(rip, rsp, rbp), raw[32:]


def frames(locate: MapsLocate, res: UnwindResult) -> list[tuple[str, str]]:
    """(image file name, function) per pc; return addresses are looked up at ra - 1."""
    out = []
    for i, pc in enumerate(res.pcs):
        loc = locate(pc)
        if loc is None:
            out.append(("?", "?"))
            continue
        img, bias = loc
        v = pc - bias
        sym = (i and img.lookup(v - 1)) or img.lookup(v)  # __restore_rt's FDE starts 1 byte early
        out.append((locate.file(pc), sym[0] if sym else "?"))
    return out


def is_subsequence(needle: list[str], hay: list[str]) -> bool:
    it = iter(hay)
    return all(any(x == y for y in it) for x in needle)


@dataclass
class SelfRun:
    """unwind_self running (blocked on stdin) with its two captures."""

    proc: subprocess.Popen
    exe: Path
    locate: MapsLocate
    captures: dict[str, tuple[Regs, bytes]]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


# lib flags, exe flags, frames expected from frame pointers (per thread).
VARIANTS = {
    "cfi": ([], [], 0),
    # lib_call without any CFI but with a frame pointer: the frame-pointer fallback.
    "fp_lib": (["-fno-omit-frame-pointer", "-fno-asynchronous-unwind-tables", "-g0"], [], 1),
    # The executable's CFI in .debug_frame only (no .eh_frame for its functions).
    "debug_frame": ([], ["-fno-asynchronous-unwind-tables"], 0),
    # The same, moved to a separate debug file found by build-id.
    "debug_file": ([], ["-fno-asynchronous-unwind-tables"], 0),
}


def start_self(tmp: Path, variant: str) -> SelfRun:
    lib_flags, exe_flags, _ = VARIANTS[variant]
    opt = ["-O2", "-fomit-frame-pointer"]
    compile_c(WORKLOADS / "unwind_lib.c", tmp / "libunwind_lib.so", "-shared", "-fPIC", *opt, *lib_flags)
    exe = compile_c(WORKLOADS / "unwind_self.c", tmp / "unwind_self", *opt, *exe_flags, "-pthread",
                    "-Wl,--no-as-needed", f"-L{tmp}", "-lunwind_lib", f"-Wl,-rpath,{tmp}")
    if variant == "debug_file":
        # Not ElfImage.open: the unstripped image would be reused for the stripped file.
        notes = subprocess.run(["readelf", "-n", str(exe)], capture_output=True, text=True, check=True).stdout
        bid = re.search(r"Build ID: ([0-9a-f]+)", notes).group(1)
        debug = tmp / "debug" / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
        debug.parent.mkdir(parents=True)
        subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(debug)], check=True)
        stripped = tmp / "unwind_self_stripped"
        subprocess.run(["objcopy", "--strip-debug", str(exe), str(stripped)], check=True)
        exe = stripped
    proc = subprocess.Popen([str(exe), str(tmp / "cap")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    caps = {w: read_capture(tmp / f"cap.{w}") for w in ("main", "thread")}
    return SelfRun(proc, exe, MapsLocate(proc.pid), caps)


@pytest.fixture(scope="module")
def cfi_run(tmp_path_factory):
    run = start_self(tmp_path_factory.mktemp("unwind_cfi"), "cfi")
    yield run
    run.close()


# 1. Real stacks of a C workload


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unwinds_own_chain_to_thread_entry(variant, tmp_path, monkeypatch):
    monkeypatch.setattr(elf, "DEBUG_ROOTS", (str(tmp_path / "debug"),) + elf.DEBUG_ROOTS)
    run = start_self(tmp_path, variant)
    try:
        libc = ElfImage.open(LIBC)
        exe_img = ElfImage.open(str(run.exe))
        if variant == "debug_file":
            assert exe_img.debug_path and exe_img.section(".debug_frame") is not None
        u = Unwinder()
        for which, own, in_libc in (("main", OWN_MAIN, LIBC_MAIN), ("thread", OWN_THREAD, LIBC_THREAD)):
            regs, stack = run.captures[which]
            res = u.unwind(run.locate, regs, stack)
            named = frames(run.locate, res)
            names = [f for _, f in named]
            assert res.pcs[0] == regs.ip and res.stop == "entry", (which, res.stop, named)
            assert res.fp_frames == VARIANTS[variant][2], (which, named)
            # Every frame of our binaries, in order, and none missing or spurious.
            ours = [f for lib, f in named if lib in (run.exe.name, "libunwind_lib.so")]
            assert ours == own, (which, named)
            expected_libc = [f for f in in_libc if libc.symbol(f) is not None]
            assert is_subsequence(expected_libc, names), (which, named)
            assert is_subsequence(["realigned", "raise", "on_signal"][::-1], names)
            # The walk needed each rule form the workload is built to produce.
            kinds, precise = [], True
            for pc in res.pcs:
                img, bias = run.locate(pc)
                kinds.append(u.cfi.table(img).rule(pc - bias - (not precise))[0])
                precise = kinds[-1] == cfi.SIGNAL
            needed = {cfi.CFA_RSP, cfi.CFA_RBP, cfi.CFA_DEREF_RBP, cfi.SIGNAL, cfi.ENTRY}
            assert needed <= set(kinds) and (cfi.NO_CFI in kinds) == bool(res.fp_frames), kinds
            if which == "main":
                assert names[-1] == "_start"
            else:
                assert named[-1][0] == Path(LIBC).name
                if libc.has_symtab:
                    assert names[-1] in THREAD_ENTRY
        if variant.startswith("debug"):
            assert ".debug_frame" in u.cfi.table(exe_img).sources
    finally:
        run.close()


def test_plt_entry_frames(cfi_run):
    """A pc in a PLT stub (CFA = rsp + 8, or + 16 after the lazy stub's push): the stack a probe
    on lib_call@plt would see, cut from the real capture at the return address into level1."""
    regs, stack = cfi_run.captures["main"]
    u = Unwinder()
    full = u.unwind(cfi_run.locate, regs, stack)
    names = [f for _, f in frames(cfi_run.locate, full)]
    k = names.index("level1")
    word = struct.pack("<Q", full.pcs[k])
    (o,) = [o for o in range(0, len(stack) - 7, 8) if stack[o : o + 8] == word]
    exe, bias = cfi_run.locate(full.pcs[k])
    (stub,) = [a for a, name in exe.plt_targets().items() if name == "lib_call"]

    at_stub = u.unwind(cfi_run.locate, Regs(stub + bias, regs.sp + o, regs.bp), stack[o:])
    assert at_stub.pcs == (stub + bias, *full.pcs[k:]) and at_stub.stop == "entry"

    plt = exe.section(".plt")
    assert plt is not None and plt[0] <= stub < plt[0] + len(plt[1])
    assert exe.read_vaddr(stub + 6, 1) == b"\x68"  # lazy stub: jmp *GOT; push $index; jmp .plt[0]
    pushed = u.unwind(cfi_run.locate, Regs(stub + 11 + bias, regs.sp + o - 8, regs.bp), bytes(8) + stack[o:])
    assert pushed.pcs == (stub + 11 + bias, *full.pcs[k:]) and pushed.stop == "entry"


def test_truncated_copies_and_max_frames(cfi_run):
    """A shorter copy gives a prefix of the full walk, ending with stack_end when it differs."""
    u = Unwinder()
    for which in ("main", "thread"):
        regs, stack = cfi_run.captures[which]
        full = u.unwind(cfi_run.locate, regs, stack)
        needed = None
        for cut in range(0, len(stack) + 1, 8):
            res = u.unwind(cfi_run.locate, regs, stack[:cut])
            assert res.pcs == full.pcs[: len(res.pcs)]
            if res == full:
                needed = needed if needed is not None else cut
            else:
                assert res.stop == "stack_end" and needed is None, (cut, res)
        assert needed is not None and needed < len(stack)
        for m in range(1, len(full.pcs)):
            cut = u.unwind(cfi_run.locate, regs, stack, max_frames=m)
            assert (cut.pcs, cut.stop, cut.fp_frames) == (full.pcs[:m], "max_frames", 0)
            assert 0 <= cut.used <= full.used
        assert u.unwind(cfi_run.locate, regs, stack, max_frames=len(full.pcs)) == full


# 2. Rules of real libraries, and garbage


def readelf_rows(path: str) -> list[tuple[str, int, int, list[dict[str, str]]]]:
    """(CIE augmentation, start, end, rows) per FDE from readelf's decoded frame table."""
    # readelf exits 1 over unrelated warnings (libc's .gnu_debuglink): the table is still complete.
    out = subprocess.run(["readelf", "--debug-dump=frames-interp", path], capture_output=True, text=True).stdout
    cies: dict[int, str] = {}
    fdes: list[tuple[str, int, int, list[dict[str, str]]]] = []
    cols: list[str] = []
    for line in out.splitlines():
        if m := re.match(r'^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ CIE "([^"]*)"', line):
            cies[int(m.group(1), 16)] = m.group(2)
            cols = []  # the CIE's own rows are not an FDE's
            fdes.append(("", 0, 0, []))
        elif m := re.match(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ FDE cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+)", line):
            fdes.append((cies[int(m.group(1), 16)], int(m.group(2), 16), int(m.group(3), 16), []))
            cols = []
        elif line.strip().startswith("LOC") and fdes[-1][2]:
            cols = line.split()
        elif fdes and cols and re.match(r"^[0-9a-f]{16} ", line):
            line = re.sub(r"(r\d+) \(\w+\)", r"\1", line)  # 'r9 (r9)': saved in another register
            fdes[-1][3].append(dict(zip(cols, line.split(), strict=True)))
    return [f for f in fdes if f[2] > f[1]]


def agrees(rule: cfi.Rule, aug: str, row: dict[str, str]) -> bool:
    """Whether our rule matches readelf's row. readelf prints 'u' both for undefined registers
    and for registers without a rule yet; 'exp' for any expression."""
    kind, off, ra_off, bp_kind, bp_off = rule
    if "S" in aug:
        return kind == cfi.SIGNAL
    ra, c, bp = row.get("ra"), row["CFA"], row.get("rbp", "s")
    if ra == "u":
        return kind == cfi.ENTRY
    if ra is None or not ra.startswith("c") or not re.fullmatch(r"(rsp|rbp)\+\d+|exp", c):
        return kind == cfi.UNSUPPORTED
    if c == "exp":
        cfa_ok = kind in (cfi.CFA_DEREF_RBP, cfi.CFA_RSP, cfi.UNSUPPORTED)
    else:
        cfa_ok = (kind, off) == ({"rsp": cfi.CFA_RSP, "rbp": cfi.CFA_RBP}[c[:3]], int(c[4:]))
    if kind == cfi.UNSUPPORTED:
        return cfa_ok
    bp_ok = {
        "s": bp_kind == cfi.BP_SAME,
        "u": bp_kind in (cfi.BP_SAME, cfi.BP_UNKNOWN),
        "exp": bp_kind in (cfi.BP_RBP, cfi.BP_UNKNOWN),
    }.get(bp, bp_kind == cfi.BP_CFA and bp == f"c{bp_off:+d}")
    return cfa_ok and ra_off == int(ra[1:]) and bp_ok


@pytest.mark.parametrize("path", [LIBC, "/usr/bin/python3.11", "unwind_self"])
def test_rules_agree_with_readelf(path, cfi_run):
    path = str(cfi_run.exe) if path == "unwind_self" else path
    table = cfi.CfiTable(ElfImage.open(path))
    checked = skipped = 0
    for aug, lo, hi, rows in readelf_rows(path):
        # Registers kept in other registers (DW_CFA_register, hand-written clone/setcontext):
        # readelf then prints 'u' for rip where the CIE's rule still holds. Not compared.
        if any(re.fullmatch(r"\(?r\d+\)?", v) for r in rows for v in r.values()):
            skipped += 1
            continue
        locs = [int(r["LOC"], 16) for r in rows] + [hi]
        for i, row in enumerate(rows):
            for v in {locs[i], locs[i + 1] - 1} & set(range(lo, hi)):
                assert agrees(table.rule(v), aug, row), (path, hex(v), aug, row, table.rule(v))
                checked += 1
    assert checked > 50 and skipped <= 5


def test_plt_rule_in_libc():
    img = ElfImage.open(LIBC)
    table = cfi.CfiTable(img)
    addr, code = img.section(".plt")
    # .plt[0] pushes once (CFA rsp + 16, + 24 after its push); stubs: rsp + 8, + 16 after their push.
    assert [table.rule(addr + i)[:2] for i in (0, 5, 6, 15)] == [(cfi.CFA_RSP, 16)] * 2 + [(cfi.CFA_RSP, 24)] * 2
    for v in range(addr + 16, addr + len(code)):
        assert table.rule(v) == (cfi.CFA_RSP, 16 if (v & 15) >= 11 else 8, -8, cfi.BP_SAME, 0)


def test_scanned_index_equals_header_index():
    for path in (LIBC, "/usr/bin/python3.11"):
        img = ElfImage.open(path)
        # the header's table with the FDEs left in the file (the recorder), or read whole (the worker)
        hdr, whole = cfi.CfiTable(img), cfi.CfiTable(img, in_memory=True)
        scanned = cfi.CfiTable(img, use_hdr=False)
        assert hdr.sources == whole.sources == [".eh_frame_hdr"] and scanned.sources == [".eh_frame"]
        assert hdr.key == whole.key is not None
        assert np.array_equal(hdr.fde_starts(), scanned.fde_starts()) and len(hdr.fde_starts()) > 1000
        for s in hdr.fde_starts()[::7].tolist():
            assert hdr.rule(s + 1) == scanned.rule(s + 1) == whole.rule(s + 1)
        assert list(hdr.every_fde()) == list(whole.every_fde())


def test_rows_read_after_the_digest_are_saved_only_for_files_root_alone_can_change(tmp_path):
    """FDEs left in the file are read after the cache key's digest: a file another user can write
    could change in between, so what they decode to is not saved under that key."""
    for mode, saved in ((0o644, True), (0o664, False), (0o666, False)):
        copy = tmp_path / f"libc-{mode:o}.so"
        shutil.copyfile(LIBC, copy)
        with open(copy, "ab") as f:             # files with the same bytes share one image
            f.write(bytes(mode))
        copy.chmod(mode)
        img = ElfImage.open(str(copy))
        lazy, whole = cfi.CfiTable(img), cfi.CfiTable(img, in_memory=True)
        assert lazy.key == whole.key is not None
        assert (lazy.persist, whole.persist) == (saved, True), mode
        lazy.rule(int(lazy.fde_starts()[5]) + 1)
        assert lazy.dirty == saved


# A Python process with the libraries of the brief (and torch when importable). It captures its
# own stack twice: from Python code through ctypes, and inside torch's autograd engine.
PY_SCRIPT = r"""
import ctypes, json, sqlite3, ssl, sys
import numpy
lib = ctypes.CDLL(sys.argv[1])
out = sys.argv[2].encode()

def deep(n):
    if n == 0:
        lib.unwind_capture(out + b".py")
        return 0
    return deep(n - 1) + 1

deep(3)
torch = None
if sys.argv[3] == "1":
    import torch

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            lib.unwind_capture(out + b".torch")
            return g * 2

    Twice.apply(torch.ones(3, requires_grad=True)).sum().backward()
print("ready", flush=True)
sys.stdin.read()
"""


@dataclass
class PyRun:
    proc: subprocess.Popen
    locate: MapsLocate
    captures: dict[str, tuple[Regs, bytes]]
    libraries: list[str]


@pytest.fixture(scope="module")
def py_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unwind_py")
    lib = compile_c(WORKLOADS / "unwind_capture.c", tmp / "libunwind_capture.so", "-shared", "-fPIC", "-O2",
                    "-fomit-frame-pointer")
    has_torch = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0
    proc = subprocess.Popen([sys.executable, "-c", PY_SCRIPT, str(lib), str(tmp / "cap"), str(int(has_torch))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    caps = {w: read_capture(tmp / f"cap.{w}") for w in ("py", "torch") if (tmp / f"cap.{w}").exists()}
    assert ("torch" in caps) == has_torch
    libs = sorted({m.path for m in read_maps(proc.pid) if m.executable and m.file_backed})
    yield PyRun(proc, MapsLocate(proc.pid), caps, libs)
    proc.stdin.close()
    proc.wait(10)


def test_python_and_torch_stacks(py_run):
    """Native stacks of a Python process (and torch's autograd engine) down to _start."""
    locate = py_run.locate
    report = []
    for which, (regs, stack) in py_run.captures.items():
        full = Unwinder().unwind(locate, regs, stack)
        named = frames(locate, full)
        assert full.stop == "entry" and named[-1][1] == "_start" and full.fp_frames == 0, named
        assert named[0][1] == "unwind_capture"
        assert "_PyEval_EvalFrameDefault" in {f for _, f in named}
        if which == "torch":
            libs = {lib for lib, _ in named}
            assert {"libtorch_cpu.so", "libtorch_python.so"} <= libs, named
            assert any("Engine" in f and "execute" in f for _, f in named), named
        # A fresh Unwinder (indexes built, FDEs decoded anew) and a warm one give the same walk;
        # their speed is measured by scripts/bench_stacks.py, not here.
        u = Unwinder()
        assert u.unwind(locate, regs, stack) == full
        assert u.unwind(locate, regs, stack) == full
        needed = next(c for c in range(0, len(stack) + 1, 8) if u.unwind(locate, regs, stack[:c]) == full)
        assert 0 < needed <= len(stack)
        report.append(f"{which}: {len(full.pcs)} frames, bytes needed {needed} of {len(stack)}")
    print("\n" + "\n".join(report))


def test_rules_of_every_loaded_library(py_run):
    """Every FDE of small libraries, 2000 random ones of big ones: start, middle and last byte."""
    rng = np.random.default_rng(0)
    report = []
    for path in py_run.libraries:
        t0 = time.perf_counter()
        table = cfi.CfiTable(ElfImage.open(path))
        starts = table.fde_starts()
        sample = starts if len(starts) <= 4000 else rng.choice(starts, 2000, replace=False)
        kinds: Counter[int] = Counter()
        for s in sample.tolist():
            span = table.fde_range(s)
            if span is None:  # only an empty FDE covers nothing
                continue
            lo, hi = span
            assert lo == s
            for v in {lo, (lo + hi) // 2, hi - 1}:
                kinds[table.rule(v)[0]] += 1
        elapsed = time.perf_counter() - t0
        total = sum(kinds.values())
        report.append(f"{Path(path).name}: {len(starts)} FDEs, index {table.index_seconds * 1e3:.1f} ms, "
                      f"{len(sample)} sampled in {elapsed:.2f} s (with ElfImage.open), "
                      f"unsupported {kinds[cfi.UNSUPPORTED] / max(total, 1):.2%}")
        assert total == 0 or kinds[cfi.NO_CFI] == 0, report[-1]  # every indexed FDE decodes
        assert kinds[cfi.UNSUPPORTED] <= 0.02 * total, report[-1]
    print("\n" + "\n".join(report))


def test_garbage_never_raises(py_run):
    locate = py_run.locate
    maps = [m for m in read_maps(py_run.proc.pid) if m.executable and m.file_backed]
    code = np.array([(m.start, m.end) for m in maps], np.int64)
    rng = np.random.default_rng(2)
    u = Unwinder()
    stops: Counter[str] = Counter()

    def code_addr() -> int:
        lo, hi = code[rng.integers(len(code))]
        return int(rng.integers(lo, hi))

    for i in range(3000):
        n = int(rng.integers(0, 4096)) & ~7
        words = rng.integers(0, 1 << 63, n // 8, dtype=np.int64)
        # Plant code addresses and stack-like pointers, so that walks get past the first frame.
        sp = int(rng.integers(1 << 40, 1 << 47)) & ~7
        for j in rng.integers(0, max(n // 8, 1), n // 32):
            words[j] = code_addr() if rng.random() < 0.7 else sp + int(rng.integers(0, n + 64)) & ~7
        ip = code_addr() if i % 10 else int(rng.integers(0, 1 << 63))
        bp = sp + int(rng.integers(-64, n + 64)) if i % 3 else int(rng.integers(0, 1 << 63))
        max_frames = int(rng.integers(1, 128))
        res = u.unwind(locate, Regs(ip, sp, bp), words.tobytes(), max_frames)
        assert res.stop in STOPS and 1 <= len(res.pcs) <= max_frames and res.pcs[0] == ip
        stops[res.stop] += 1
    # Real stacks with garbage mixed in.
    for regs, stack in py_run.captures.values():
        for _ in range(300):
            buf = bytearray(stack)
            for j in rng.integers(0, len(buf) // 8, 16):
                buf[8 * j : 8 * j + 8] = rng.bytes(8)
            res = u.unwind(locate, regs, bytes(buf))
            assert res.stop in STOPS
            stops[res.stop] += 1
    assert len(stops) >= 3, stops  # the walks do get somewhere, and end in varied ways


# 3. The disk cache


def test_disk_cache_avoids_decoding_again(cfi_run, py_run, tmp_path, monkeypatch):
    samples = [(cfi_run.locate, *c) for c in cfi_run.captures.values()]
    samples += [(py_run.locate, *c) for c in py_run.captures.values()]
    cache = tmp_path / "cache"
    first = Unwinder(cache)
    results = [first.unwind(loc, regs, stack) for loc, regs, stack in samples]
    assert first.decodes > 0
    first.save()
    exe = ElfImage.open(str(cfi_run.exe))
    # named by build-id and a digest of the CFI bytes; no temporary files left
    written = {p.stem.split("-")[0] for p in cache.iterdir()}
    assert {exe.build_id, ElfImage.open(LIBC).build_id} <= written
    assert all(p.suffix == ".npy" for p in cache.iterdir())

    second = Unwinder(cache)
    assert [second.unwind(loc, regs, stack) for loc, regs, stack in samples] == results
    assert second.decodes == 0
    second.save()  # nothing new: nothing rewritten

    # A damaged file is ignored (and rewritten), not trusted.
    next(cache.glob(f"{exe.build_id}-*.npy")).write_bytes(b"not a cache")
    third = Unwinder(cache)
    assert [third.unwind(loc, regs, stack) for loc, regs, stack in samples] == results
    assert third.decodes > 0

    # Bounded memory: tiny bounds give the same walks.
    monkeypatch.setattr(cfi, "MEMO_MAX", 3)
    monkeypatch.setattr(cfi, "DECODED_MAX", 2)
    small = Unwinder()
    assert [small.unwind(loc, regs, stack) for loc, regs, stack in samples] == results


def test_the_table_worker_gets_our_settings_and_no_credentials(monkeypatch):
    """The table worker parses target-controlled files: it gets our settings and one BLAS thread,
    never the upload credentials a daemon's environment holds (sampler/environ.py)."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-workers")
    monkeypatch.setenv("ALLOCSAMPLER_RUN_DIR", "/run/allocsampler-test")
    w = TableWorker(None)
    try:
        w.submit(1, "/bin/true", "/bin/true", "/")
        [child] = [c for c in psutil.Process().children() if "sampler.stacks.table_worker" in c.cmdline()]
        env = child.environ()
    finally:
        w.close()
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["ALLOCSAMPLER_RUN_DIR"] == "/run/allocsampler-test" and env["OPENBLAS_NUM_THREADS"] == "1"


def test_only_the_name_worker_gets_the_proxy_it_downloads_through(monkeypatch):
    """The name worker asks debuginfod, behind the host's proxy and CA certificates; the table
    worker downloads nothing and gets neither; credentials reach neither."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-workers")
    monkeypatch.setenv("https_proxy", "http://proxy.internal:3128")
    monkeypatch.setenv("SSL_CERT_FILE", "/etc/ssl/certs/internal.pem")
    envs = {}
    for worker, module in ((NameWorker(), "name_worker"), (TableWorker(None), "table_worker")):
        try:
            if module == "name_worker":
                worker.warm()
            else:
                worker.submit(1, "/bin/true", "/bin/true", "/")
            [child] = [c for c in psutil.Process().children() if f"sampler.stacks.{module}" in c.cmdline()]
            envs[module] = child.environ()
        finally:
            worker.close()
    assert envs["name_worker"]["https_proxy"] == "http://proxy.internal:3128"
    assert envs["name_worker"]["SSL_CERT_FILE"] == "/etc/ssl/certs/internal.pem"
    assert "https_proxy" not in envs["table_worker"] and "SSL_CERT_FILE" not in envs["table_worker"]
    assert not any("AWS_SECRET_ACCESS_KEY" in env for env in envs.values())
