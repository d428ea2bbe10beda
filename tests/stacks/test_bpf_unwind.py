"""Native stacks walked in BPF from compact CFI rows, against the user-space DWARF unwinder.

The BPF programs are compiled with UW_VERIFY: every sampled record carries both the pcs the
walk in BPF found and a copy of the stack from the sample's own registers, which the user-space
unwinder (sampler/stacks/unwind.py) walks. They must agree frame for frame: every walk that
ended in BPF equals the user-space walk, and every walk handed over is a prefix of it. The
workloads are real: a C extension built like most wheels (-O2, no frame pointers) called from
Python, torch CPU tensor allocations, and both again with every CPU kept busy.
"""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from conftest import WORKLOADS

from sampler.binary.elf import ElfImage
from sampler.bpf.abi import UW_MAPS, UW_PENDING, EvType, UwKind, UwStop
from sampler.bpf.events import decode
from sampler.bpf.loader import BpfProbes, ProbeConfig
from sampler.control.weights import weight_table
from sampler.probes.allocators import find_allocators
from sampler.proc.maps import read_maps
from sampler.stacks import cfi, unwind_rows
from sampler.stacks.kernel_tables import KernelTables
from sampler.stacks.symbolize import Symbolizer
from sampler.stacks.table_worker import BuildFailed, TableWorker
from sampler.stacks.unwind import Regs, Unwinder

pytestmark = pytest.mark.bpf
PY_LEAK = WORKLOADS / "py_leak.py"


@pytest.fixture(scope="module")
def probes(bpf_ready, tmp_path_factory):
    cache = tmp_path_factory.mktemp("bpf")
    cache.chmod(0o700)
    p = BpfProbes(ProbeConfig(sample_mean=64 << 10, verify_unwind=True, cache_dir=cache, unwind_procs=16,
                                  weight_table=tuple(weight_table())))
    p.raw = []                      # the ALLOC records of the test running now
    p.rows_cache = tmp_path_factory.mktemp("rows")      # files' rows built once for the module
    p.rows_cache.chmod(0o700)
    p.open_events(lambda b: p.raw.append(bytes(b)) if b[0] == EvType.ALLOC else None)
    yield p
    p.close()


@pytest.fixture
def busy():
    """Every CPU kept busy meanwhile (the recorder and the workload compete for them)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


def record(probes: BpfProbes, tmp_path: Path, argv: list[str], env: dict, want: int,
           wait_tables: bool = True) -> tuple[list[bytes], KernelTables, subprocess.Popen]:
    raw = probes.raw
    raw.clear()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    probes.add_target(proc.pid)
    libs, _ = find_allocators(proc.pid, ())
    for lib in libs:
        probes.attach(proc.pid, lib)
    cache = probes.rows_cache
    if not wait_tables:             # first sight of every file
        cache = tmp_path / "rows"
        cache.mkdir(mode=0o700)
    tables = KernelTables(probes, TableWorker(cache))
    assert tables.track(proc.pid)
    deadline = time.monotonic() + 120
    while wait_tables and tables.worker.pending and time.monotonic() < deadline:
        tables.poll()
        time.sleep(0.05)
    tables.poll()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    seen = 0
    deadline = time.monotonic() + 60
    while len(raw) < want and time.monotonic() < deadline and proc.poll() is None:
        probes.poll(100)
        for b in raw[seen:]:            # what the recorder does: code it does not know -> maps again
            if decode(b).stop == UwStop.NO_MAP:
                tables.unknown_code(proc.pid)
        seen = len(raw)
        tables.poll()
    assert proc.stdout.readline().strip() == "done"
    probes.drain()
    probes.detach(proc.pid)
    return list(raw), tables, proc


def compare(raw: list[bytes]) -> collections.Counter:
    """Each record's BPF walk against the user-space walk of its stack copy."""
    sym, unw = Symbolizer(), Unwinder()
    out: collections.Counter = collections.Counter()
    for b in raw:
        ev = decode(b)
        assert ev.pcs, "a target with tables has every stack walked in BPF"
        res = unw.unwind(partial(sym.locate, ev.pid), Regs(ev.ip, ev.sp, ev.bp), ev.stack, 127)
        if ev.stop < UwStop.NO_TABLE:
            assert ev.pcs == res.pcs, (UwStop(ev.stop).name, res.stop, [hex(x) for x in ev.pcs],
                                       [hex(x) for x in res.pcs])
            out["in_bpf"] += 1
            out["complete"] += ev.stop == UwStop.ENTRY
        else:
            assert res.pcs[:len(ev.pcs)] == ev.pcs
            out["handed_over"] += 1
        out["frames"] += len(res.pcs)
    return out


def finish(proc: subprocess.Popen, tables: KernelTables) -> None:
    proc.stdin.write("bye\n")
    proc.stdin.flush()
    proc.wait(30)
    tables.close()


@pytest.mark.parametrize("load", ["idle", "busy"])
def test_c_extension_stacks_walked_in_bpf_equal_the_dwarf_unwinder(probes, leakext, tmp_path, load, request):
    if load == "busy":
        request.getfixturevalue("busy")
    env = {"PYTHONPATH": str(leakext), "PATH": "/usr/bin:/bin"}
    raw, tables, proc = record(probes, tmp_path, [sys.executable, str(PY_LEAK), "ext", "4096", "20000"], env, 600)
    try:
        n = compare(raw)
    finally:
        finish(proc, tables)
    assert len(raw) >= 300
    assert n["in_bpf"] == len(raw), n
    assert n["complete"] >= 0.99 * n["in_bpf"], n


@pytest.mark.parametrize("load", ["idle", "busy"])
def test_torch_stacks_walked_in_bpf_equal_the_dwarf_unwinder(probes, tmp_path, load, request):
    if load == "busy":
        request.getfixturevalue("busy")
    env = {"PATH": "/usr/bin:/bin"}
    raw, tables, proc = record(probes, tmp_path, [sys.executable, str(PY_LEAK), "torch", str(64 << 10), "1500"],
                               env, 500)
    try:
        n = compare(raw)
        stats = tables.stats()
    finally:
        finish(proc, tables)
    assert len(raw) >= 300
    assert stats["files_ready"] >= 20 and stats["rows_used"] > 2_000_000, stats     # libtorch_cpu and co.
    assert n["in_bpf"] == len(raw), n
    assert n["complete"] >= 0.99 * len(raw), n
    assert n["frames"] / len(raw) >= 20         # deep C++ stacks, not a stub walk


def test_walks_hand_over_while_rows_are_built_and_lose_nothing(probes, leakext, tmp_path):
    env = {"PYTHONPATH": str(leakext), "PATH": "/usr/bin:/bin"}
    raw, tables, proc = record(probes, tmp_path, [sys.executable, str(PY_LEAK), "ext", "4096", "4000"], env, 100,
                               wait_tables=False)
    try:
        first = decode(raw[0])
        n = compare(raw)
    finally:
        finish(proc, tables)
    assert first.stop in (UwStop.NO_TABLE, UwStop.NO_MAP) or n["handed_over"] > 0, n


def test_rows_give_the_rule_of_the_cfi_at_every_pc():
    """unwind_rows against CfiTable.rule at pcs drawn in every row of libc and libpython."""
    rng = np.random.default_rng(7)
    for path in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"):
        img = ElfImage.open(path)
        fr = unwind_rows.build(img)
        rows, table = fr.rows, cfi.CfiTable(img)
        assert fr.fits and len(rows) > 10_000
        assert bool(np.all(rows["pc"][1:] > rows["pc"][:-1]))
        for i in rng.choice(len(rows) - 1, 3000, replace=False):
            lo, hi = int(rows["pc"][i]), int(rows["pc"][i + 1])
            for v in {lo, hi - 1, int(rng.integers(lo, hi))}:
                kind, off, _, bp_kind, bp_off = table.rule(v)
                k, bk = int(rows["kind"][i]) & 15, int(rows["kind"][i]) >> 4
                got_off = int(rows["cfa_off"][i])
                if k == UwKind.PLT:       # CFA_RSP, 8 more from the threshold in bp_off8 on
                    k, bk = int(UwKind.CFA_RSP), 0
                    got_off += 8 * int((v & 15) >= rows["bp_off8"][i])
                assert k == kind or (k == UwKind.UNSUPPORTED and kind <= cfi.CFA_DEREF_RBP), (path, hex(v))
                if k <= UwKind.CFA_DEREF_RBP:
                    assert got_off == off, (path, hex(v))
                    assert bk == bp_kind or bk == cfi.BP_UNKNOWN, (path, hex(v))
                    if bk in (cfi.BP_CFA, cfi.BP_RBP):
                        assert int(rows["bp_off8"][i]) * 8 == bp_off, (path, hex(v))


def test_a_file_the_worker_cannot_read_fails_alone(tmp_path):
    bad = tmp_path / "libbad.so"
    bad.write_bytes(b"\x7fELF" + os.urandom(4000))
    good = "/lib/x86_64-linux-gnu/libc.so.6"
    w = TableWorker(None)
    try:
        w.submit("bad", str(bad), str(bad), "")
        w.submit("good", good, good, "")
        deadline = time.monotonic() + 60
        results: dict = {}
        while len(results) < 2 and time.monotonic() < deadline:
            results.update(w.done())
            time.sleep(0.05)
    finally:
        w.close()
    assert isinstance(results["bad"], BuildFailed) and not results["bad"].worker_died
    assert results["good"].fits and len(results["good"].rows) > 10_000


LIB_C = """
#include <stdlib.h>
static volatile long sink;
__attribute__((noinline)) static long step(long x) {
    char b[64]; b[x & 63] = (char)x; sink += b[(x * 7) & 63]; return x * 3 + 1;
}
__attribute__((noinline)) long walk(long n) { long t = 0; for (long i = 0; i < n; i++) t += step(i); return t; }
__attribute__((noinline)) void *grab(long n) { void *p = malloc((size_t)n); sink += walk(n & 15); return p; }
"""
HOLD_LIB = "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('ready', flush=True); sys.stdin.readline()"


def _loaded_rows(probes: BpfProbes, pid: int, path: str) -> np.ndarray:
    """The rows BPF walks `pid`'s mapping of `path` with, read back from uw_procs/uw_maps/uw_rows."""
    start = next(m.start for m in read_maps(pid) if m.path == path and m.executable)
    proc = probes.bpf["uw_procs"][ctypes.c_uint32(pid)]
    for i in range(proc.n):
        m = probes.bpf["uw_maps"][ctypes.c_int(proc.slot * UW_MAPS + i)]
        if m.start == start:
            assert m.row_lo != UW_PENDING, "the mapping's rows are loaded"
            rows = [bytes(probes.bpf["uw_rows"][ctypes.c_int(m.row_lo + k)]) for k in range(m.row_n)]
            return np.frombuffer(b"".join(rows), unwind_rows.ROW)
    raise AssertionError(f"no uw_maps entry of {path} in {pid}")


def test_a_reused_inode_number_never_lends_another_files_rows(probes, tmp_path):
    """Rows are tied to a file's identity (device, inode, size, mtime, ctime), not to the
    (device, inode) that /proc/PID/maps shows: a library deleted after a process used it, and
    another written under the same inode number (ext4 reuses it at once), gets its own rows,
    although the first one's are still loaded."""
    src = tmp_path / "lib.c"
    src.write_text(LIB_C)
    evil, good = tmp_path / "evil.so", tmp_path / "good.so"
    subprocess.run(["gcc", "-O0", "-fno-omit-frame-pointer", "-shared", "-fPIC", "-o", str(evil), str(src)], check=True)
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", str(good), str(src)], check=True)
    want = {p: unwind_rows.build(ElfImage.open(str(p))).rows for p in (evil, good)}
    assert want[evil].tobytes() != want[good].tobytes()
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    tables = KernelTables(probes, TableWorker(None))
    procs: list[subprocess.Popen] = []
    try:
        lib = mnt / "libshared.so"

        def hold() -> int:
            p = subprocess.Popen([sys.executable, "-c", HOLD_LIB, str(lib)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "ready"
            assert tables.track(p.pid)
            deadline = time.monotonic() + 60
            while tables.busy and time.monotonic() < deadline:
                tables.poll()
                time.sleep(0.02)
            tables.poll()
            return p.pid

        shutil.copy(evil, lib)
        inode = lib.stat().st_ino
        first = hold()
        assert np.array_equal(_loaded_rows(probes, first, str(lib)), want[evil])
        loaded = tables.stats()["tables"]
        procs[0].communicate("bye\n", timeout=10)
        tables.untrack(first)
        tables.worker.close()           # its cached image holds the file open
        lib.unlink()
        shutil.copy(good, lib)
        assert lib.stat().st_ino == inode, "the premise: ext4 gave the new file the old inode number"
        second = hold()
        assert np.array_equal(_loaded_rows(probes, second, str(lib)), want[good])
        assert tables.stats()["tables"] == loaded + 1       # the first file's rows are still loaded (idle)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        tables.close()
        subprocess.run(["umount", str(mnt)], check=False)
