"""glibc heap headers forged by a recorded process (docs/security.md, "Inputs"): tests/workloads/
forged_heaps.c, run as nobody, writes heap_info, empty bins and a top chunk into one page per 64 MiB
of MAP_NORESERVE memory. What the recorder reads for them is bounded by what a real allocator can
have (smaps.MAX_HEAP_PIECES heaps, arenas.PAGEMAP_BUDGET and PIN_BUDGET), and what is left out is
said. Before those bounds, 4,096 such heaps cost one snapshot 2.8-5.3 s of CPU and 1.1 GiB, and one
256 GiB mapping with a single header 3.3 s of classify."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import WORKLOADS, compile_c, drop_to_nobody

from analysis.dataset import read_table
from sampler.proc.arenas import PIN_BUDGET, arena_rows
from sampler.proc.smaps import HEAP_MAX_SIZE, MAX_HEAP_PIECES, memory_breakdown

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def forger() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="allocsampler-forged-", dir="/tmp"))
    os.chmod(d, 0o755)                      # nobody runs it
    yield compile_c(WORKLOADS / "forged_heaps.c", d / "forged_heaps")
    shutil.rmtree(d, ignore_errors=True)


@contextmanager
def forged(binary: Path, *args: str) -> Iterator[tuple[int, int]]:
    """(pid, first heap) of the forger run as nobody with `args`."""
    p = subprocess.Popen([str(binary), *args], preexec_fn=drop_to_nobody, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        line = p.stdout.readline().split()
        assert line[:1] == ["ready"], f"forger failed, exit code {p.poll()}"
        yield p.pid, int(line[1], 16)
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def snapshot_cost(pid: int, cpu_s: float, mib: float) -> tuple[object, list[dict], list, list[str]]:
    """What one snapshot reads of the process's heaps (snapshot.py: the breakdown, then the arena
    rows with their walk), within `cpu_s` CPU seconds and, in a second run, `mib` MiB of traced
    memory at its peak; then the breakdown, rows, pin maps and notes of a third run."""
    cpu = time.thread_time()
    b = memory_breakdown(pid)
    arena_rows(pid, b.regions, [], pins=[], walk=True)
    cpu = time.thread_time() - cpu
    tracemalloc.start()
    try:
        arena_rows(pid, memory_breakdown(pid).regions, [], pins=[], walk=True)
        peak = tracemalloc.get_traced_memory()[1] / MiB
    finally:
        tracemalloc.stop()
    print(f"\n{pid}: {cpu:.3f} s CPU, traced peak {peak:.1f} MiB")
    assert cpu < cpu_s and peak < mib, (cpu, peak)
    b = memory_breakdown(pid)
    pins: list = []
    notes: list[str] = []
    rows = arena_rows(pid, b.regions, [], pins=pins, walk=True, notes=notes)
    print(f"{b.arena_heaps} heaps, {b.heaps_unread} unread, {len(rows)} rows, {len(pins)} pin maps, notes {notes}")
    return b, rows, pins, notes


@pytest.mark.serial         # it times a snapshot's CPU: 1.06 s of its 1 s beside the suite's other worker
@pytest.mark.parametrize("shape", ["separate", "merged"])
def test_4096_forged_heaps_cost_a_snapshot_a_bounded_analysis(forger, shape):
    """4,096 heaps, one VMA each or all in one VMA (256 GiB, 18 MB of RSS): 512 are read as
    heaps at most, the rest said unread; within 1 s of CPU and 32 MiB (0.25 s, 11 MiB; before: 2.8 s
    and 5.3 s, 1,096 MiB)."""
    with forged(forger, shape, "4096") as (pid, base):
        b, rows, pins, notes = snapshot_cost(pid, 1.0, 32)
    if shape == "separate":
        assert (b.arena_heaps, b.arenas, b.heaps_unread) == (MAX_HEAP_PIECES, MAX_HEAP_PIECES, 4096 - MAX_HEAP_PIECES)
        forged_rows = [r for r in rows if not r["main"]]
        assert len(forged_rows) == MAX_HEAP_PIECES and not notes
        assert all(r["rss"] == 4096 and r["free_bytes"] is not None for r in forged_rows)    # read, within bounds
    else:   # one mapping longer than the heaps left: never split into 64 MiB pieces
        assert (b.arena_heaps, b.heaps_unread) == (0, 4096)
        assert next(k for s, e, k in b.regions if s == base) == "anon" and all(r["main"] for r in rows)


def test_a_256_gib_mapping_with_one_forged_header_is_read_once(forger):
    """One 256 GiB VMA (1.4 MB of RSS) whose first 64 MiB has a header: not split, 0.01 s (before:
    classify read the page map of all 4,096 pieces, 3.3 s, linear in the VMA's size)."""
    with forged(forger, "huge", "256") as (pid, base):
        b, _, _, _ = snapshot_cost(pid, 0.5, 8)
    assert (b.arena_heaps, b.heaps_unread) == (0, 256 * GiB // HEAP_MAX_SIZE)
    assert [(e - s, k) for s, e, k in b.regions if s == base] == [(256 * GiB, "anon")]


def test_what_the_page_map_and_pin_budgets_leave_out_is_said(forger):
    """512 merged heaps (32 GiB) are read, but their page maps and the brk heap's are over the
    64 MiB a snapshot reads: the last arena has no row, and says so. 512 separate heaps each pinned
    at both ends (a PinMap of 128 KiB each) stop at PIN_BUDGET; their rows still count every page
    (before: 138 MiB traced for the merged ones)."""
    with forged(forger, "merged", "512") as (pid, _):
        b, rows, pins, notes = snapshot_cost(pid, 1.0, 32)
    assert (b.arena_heaps, b.heaps_unread) == (512, 0)
    assert len(rows) == 512 and sum(len(p.ratio) == 1 for p in pins) >= 511     # trimmed to their page 0
    assert len(notes) == 1 and notes[0].startswith("1 of 513 glibc arenas (1 heaps) have no malloc_arenas row")
    with forged(forger, "separate", "512", "pinned") as (pid, _):
        b, rows, pins, notes = snapshot_cost(pid, 1.0, 40)
    assert b.arena_heaps == 512 and len(rows) == 513
    assert sum(r["pinned_pages"] for r in rows if not r["main"]) == 2 * 512
    assert sum(p.ratio.nbytes for p in pins) <= PIN_BUDGET and len(pins) < 512 // 3
    assert notes == [f"pinned pages of some heaps not charged to their stacks: over {PIN_BUDGET >> 20} MiB of pin maps"]


def vm_hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


@pytest.mark.bpf
@pytest.mark.serial         # it times the recorder's snapshots
def test_a_recording_of_4096_forged_heaps_keeps_its_snapshots_and_its_memory(forger, record, memory_ceiling):
    """`allocsampler record` of the forger for 20 s, under the unit's memory ceiling (576M): a
    snapshot every second, never a gap over 15 s, the recorder's peak RSS under 300 MiB (112 MiB),
    and one warning saying what was left unread (before: killed by the ceiling; 1,202 MiB without)."""
    with forged(forger, "separate", "4096") as (pid, _):
        rec = record("--pid", str(pid), "-i", "1")
        (memory_ceiling / "cgroup.procs").write_text(str(rec.proc.pid))
        rec.wait_attached()
        time.sleep(20)
        assert rec.proc.poll() is None, rec.proc.communicate()
        peak = vm_hwm_mib(rec.proc.pid)
        code, _, err = rec.stop()
        assert code == 0, err[-3000:]
    oom = dict(line.split() for line in (memory_ceiling / "memory.oom_control").read_text().splitlines())
    recorder = read_table(rec.out, "recorder").sort_values("ts")
    gaps = recorder["ts"].diff().dropna().dt.total_seconds()
    processes = read_table(rec.out, "processes")
    processes = processes[processes["pid"] == pid]
    walked = read_table(rec.out, "malloc_arenas")
    walked = walked[(walked["pid"] == pid) & walked["free_bytes"].notna()]
    print(f"\nrecorder peak RSS {peak:.0f} MiB, {len(recorder)} snapshots, largest gap {gaps.max():.2f} s, "
          f"per-snapshot recorder time {processes['recorder_cpu_s'].median():.3f} s median, "
          f"{processes['recorder_cpu_s'].max():.3f} s max; {walked['ts'].nunique()} walks")
    assert int(oom.get("oom_kill", 0)) == 0 and peak < 300, peak
    assert len(recorder) >= 15 and gaps.max() < 15, gaps.max()
    assert processes["recorder_cpu_s"].median() < 0.5          # wall seconds measuring it (0.16-0.27 s)
    assert (processes["arena_heaps"] == MAX_HEAP_PIECES).all() and walked["ts"].nunique() >= 1
    targets = read_table(rec.out, "targets")
    said = targets[(targets["pid"] == pid) & (targets["event"] == "warning")]["detail"]
    assert len(said) == 1 and said.iloc[0].startswith(f"{4096 - MAX_HEAP_PIECES:,} pieces of 64 MiB"), list(said)
