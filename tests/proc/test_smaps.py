"""smaps classification and process samples, checked against real multi-threaded C workloads."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from sampler.proc.memory import sample_process
from sampler.proc.smaps import (
    HEAP_MAX_SIZE,
    Region,
    classify,
    memory_breakdown,
    read_smaps,
    thread_stack_pointers,
)

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")

# argv: THREADS MIB_PER_THREAD. Each thread gets its own arena with malloc(16), fills MIB in 1 KiB
# chunks and blocks; main first maps a heap look-alike without heap_info ("decoy") and prints
# its address once every thread is done.
WORKLOAD_C = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define HEAP_MAX (64UL << 20)
static size_t per_thread;
static pthread_barrier_t ready;

static void *worker(void *arg) {
    (void)arg;
    memset(malloc(16), 1, 16);
    for (size_t done = 0; done < per_thread; done += 1024)
        memset(malloc(1024), 1, 1024);
    pthread_barrier_wait(&ready);
    for (;;) pause();
}

static char *decoy(void) {
    char *p = mmap(NULL, 2 * HEAP_MAX, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    char *base = (char *)(((uintptr_t)p + HEAP_MAX - 1) & ~(HEAP_MAX - 1));
    if (base > p) munmap(p, base - p);
    munmap(base + HEAP_MAX, p + 2 * HEAP_MAX - (base + HEAP_MAX));
    mprotect(base, 1 << 20, PROT_READ | PROT_WRITE);
    memset(base, 0xab, 1 << 20);
    return base;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    int n = atoi(argv[1]);
    per_thread = strtoul(argv[2], NULL, 10) << 20;
    char *d = decoy();
    pthread_t t;
    pthread_barrier_init(&ready, NULL, n + 1);
    for (int i = 0; i < n; i++) pthread_create(&t, NULL, worker, NULL);
    pthread_barrier_wait(&ready);
    printf("ready %p\n", (void *)d);
    fflush(stdout);
    for (;;) pause();
}
"""


@dataclass
class Workload:
    pid: int
    decoy: int  # base of the heap look-alike


@pytest.fixture(scope="module")
def workload_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("workload") / "arenas.c"
    src.write_text(WORKLOAD_C)
    binary = src.with_suffix("")
    subprocess.run(["gcc", "-O1", "-pthread", "-o", str(binary), str(src)], check=True)
    return binary


@contextmanager
def running(binary: Path, threads: int, mib: int, **env: str) -> Iterator[Workload]:
    proc = subprocess.Popen(
        [str(binary), str(threads), str(mib)], stdout=subprocess.PIPE, env={**os.environ, **env}
    )
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == b"ready", f"workload failed, exit code {proc.poll()}"
        # Threads leaving the barrier show as 'running' (no sp) until they block in pause().
        deadline = time.monotonic() + 5
        while len(thread_stack_pointers(proc.pid)) < threads + 1:
            assert time.monotonic() < deadline, "workload threads never blocked"
            time.sleep(0.01)
        yield Workload(proc.pid, int(line[1], 16))
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def classified(pid: int) -> list[Region]:
    return classify(pid, read_smaps(pid), thread_stack_pointers(pid))


def rollup_rss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Rss:"))


def region_at(regions: list[Region], addr: int) -> Region:
    return next(r for r in regions if r.start <= addr < r.end)


def test_each_thread_gets_an_arena(workload_bin: Path) -> None:
    with running(workload_bin, threads=4, mib=8) as w:
        b = memory_breakdown(w.pid)
        regions = classified(w.pid)
        smaps_rss = sum(r.rss for r in read_smaps(w.pid))
        total = rollup_rss(w.pid)
        ps_rss = psutil.Process(w.pid).memory_info().rss

    assert b.arena_heaps >= 4 and b.arenas >= 4
    assert b.arena_rss >= 28 * MiB and b.arena_size >= b.arena_rss
    assert b.heap_rss < 4 * MiB  # the main thread barely mallocs
    # Splitting and classifying neither loses nor invents memory.
    assert b.rss == smaps_rss == sum(r.rss for r in regions)
    assert abs(b.rss - total) <= 4 * PAGE
    # statm's counters are per-CPU batched, so psutil's RSS is close, not exact.
    assert abs(b.rss - ps_rss) <= max(MiB, ps_rss // 100)
    named = b.heap_rss + b.arena_rss + b.anon_rss + b.file_rss + b.stack_rss
    assert 0 <= b.rss - named < MiB  # the rest is [vdso] and friends
    assert b.regions == sorted(b.regions) == [(r.start, r.end, r.kind) for r in regions]

    arenas = [r for r in regions if r.kind == "arena"]
    assert all(r.start % HEAP_MAX_SIZE == 0 and r.size <= HEAP_MAX_SIZE for r in arenas)
    # glibc >= 2.35: the arena's malloc_state sits right after the 48-byte heap_info.
    assert all(r.arena_first and r.arena_ptr == r.start + 48 for r in arenas)
    reserves = [r for r in regions if r.kind == "arena_reserve"]
    assert reserves and all(r.rss == 0 and r.start % HEAP_MAX_SIZE for r in reserves)

    # 64 MiB-aligned with a PROT_NONE tail, but no heap_info: plain anonymous memory.
    decoy = region_at(regions, w.decoy)
    assert (decoy.start, decoy.kind, decoy.rss) == (w.decoy, "anon", MiB)
    assert region_at(regions, w.decoy + MiB).kind == "anon"


def test_thread_stacks(workload_bin: Path) -> None:
    with running(workload_bin, threads=4, mib=1) as w:
        sps = thread_stack_pointers(w.pid)
        regions = classify(w.pid, read_smaps(w.pid), sps)      # the same reading of the threads
    assert len(sps) == 5
    stacks = {region_at(regions, sp) for sp in sps}
    assert len(stacks) == 5 and all(r.kind == "stack" for r in stacks)
    assert next(r for r in regions if r.path == "[stack]") in stacks


def test_arena_max_one_uses_main_heap(workload_bin: Path) -> None:
    with running(workload_bin, threads=4, mib=8, MALLOC_ARENA_MAX="1") as w:
        b = memory_breakdown(w.pid)
    assert b.arena_heaps == 0 and b.arenas == 0 and b.arena_rss == 0
    assert b.heap_rss >= 28 * MiB and b.heap_size >= b.heap_rss


def test_merged_heaps_are_split(workload_bin: Path) -> None:
    # 150 MiB in one arena needs three heaps; glibc places a new heap right above the previous
    # one when it can, and a full heap merges with its neighbour into one VMA.
    with running(workload_bin, threads=1, mib=150) as w:
        raw = read_smaps(w.pid)
        regions = classified(w.pid)
        b = memory_breakdown(w.pid)
    merged = [r for r in raw if r.start % HEAP_MAX_SIZE == 0 and r.size > HEAP_MAX_SIZE]
    assert merged, "no merged heap VMA: " + repr([(hex(r.start), r.size) for r in raw if r.size >= MiB])
    arenas = [r for r in regions if r.kind == "arena"]
    assert len(arenas) == b.arena_heaps == 3 and b.arenas == 1
    assert all(r.start % HEAP_MAX_SIZE == 0 and r.end - r.start == r.size <= HEAP_MAX_SIZE for r in arenas)
    first = next(r for r in arenas if r.arena_first)
    assert all(r.arena_ptr == first.start + 48 for r in arenas)
    for vma in merged:
        pieces = [r for r in regions if vma.start <= r.start < vma.end]
        assert len(pieces) == -(-vma.size // HEAP_MAX_SIZE)
        assert (pieces[0].start, pieces[-1].end) == (vma.start, vma.end)
        for field in ("size", "rss", "pss", "swap", "anonymous"):
            assert sum(getattr(r, field) for r in pieces) == getattr(vma, field)
    # Every page of a full heap was written; pagemap attributes them to the right piece.
    assert all(r.rss == HEAP_MAX_SIZE for r in arenas if r.size == HEAP_MAX_SIZE)
    assert b.arena_rss >= 150 * MiB


def test_sample_process(workload_bin: Path) -> None:
    with running(workload_bin, threads=2, mib=4) as w:
        s = sample_process(w.pid)
    assert (s.pid, s.comm, s.threads) == (w.pid, workload_bin.name, 3)
    assert 0 < s.uss <= s.rss <= s.vms and 0 < s.pss <= s.rss
    assert abs(s.rss - s.breakdown.rss) <= max(MiB, s.rss // 100)
    assert s.breakdown.arenas == 2 and s.breakdown.arena_rss >= 8 * MiB
    assert 0 < s.memory_limit <= psutil.virtual_memory().total


def test_sample_self() -> None:
    s = sample_process(os.getpid())
    assert s.pid == os.getpid() and s.threads >= 1
    assert s.rss > 0 and s.breakdown.heap_rss > 0 and s.breakdown.file_rss > 0
    assert s.breakdown.stack_rss > 0


def test_gone_process() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    for probe in (sample_process, memory_breakdown, read_smaps, thread_stack_pointers):
        with pytest.raises(ProcessLookupError):
            probe(proc.pid)
