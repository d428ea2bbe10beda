#!/usr/bin/env python3
"""Performance record: what each allocsampler tier costs a process, on four workloads, next to bcc's memleak.

Run as root from the project's virtual environment (it only writes files when asked to):

    sudo .venv/bin/python scripts/bench_overhead.py [--rounds 5] [--markdown [docs/performance.md]]
        [--svg [docs/performance-overhead.svg]] [--workloads c,python,torch,mt] [--variants ...]

Workloads. Each one starts, does its set-up, prints `ready` and blocks reading one byte from stdin;
the harness installs the tool (or nothing), waits until it is really in place (below), writes the
go byte, and the workload times its own loop with CLOCK_MONOTONIC and prints it. Process start-up,
BPF compilation, attaching and the tools' shutdown are never in the measured time.

  c       C malloc/free loop (gcc -O2, -fno-builtin-malloc/free, a volatile sink), sizes cycling
          over 16..4096 bytes: the worst case, every call hits a probe and does nothing else
          (default 500,000 pairs);
  python  json dumps/loads of dicts, bytes objects > 512 B (which bypass pymalloc and reach libc),
          dict and list growth: an allocation-heavy interpreter loop (python -I; iterations
          calibrated at start to ~3 s unprobed);
  torch   a torch CPU training loop in the venv's python: a small conv net + MLP (2 conv, 2 pool,
          2 linear, LayerNorm) on a batch of 4 3x32x32 images, cross-entropy, backward, SGD with
          momentum, the loss kept with .item() each step; torch.set_num_threads(1); iterations
          calibrated to ~3 s unprobed. Besides the tensors (posix_memalign), autograd and the
          framework's per-op bookkeeping make thousands of malloc-family calls per step;
  mt      C allocator stress, 4 threads (gcc -O2 -pthread): random sizes 8..8192 bytes, 1 in 64
          of 16..256 KiB; malloc, calloc (1/16) and realloc of a pooled block (1/16); half the
          blocks are kept in a 64-slot per-thread pool, half are handed to the next thread
          through a lock-free single-producer/single-consumer ring and freed there (cross-thread
          frees); default 1,000,000 allocations in all.

Inject placements. After the rounds (when the inject variant runs), the placement helper maps a
sampler into the busy mt workload PLACEMENTS times (--placements; no redirection): the stop time of
the target's thread, median, p99 and max. Each run of a recorder variant also records the time from
starting the recorder to its probes (and, for inject, the redirection) being in place.

Variants (tiers):

  unprobed         nothing
  memleak          memleak-bpfcc -p PID -T 5 (bcc's tool with its defaults; -T only trims output)
  inject           allocsampler record --pid PID --out DIR --attach-mode inject: the sampler placed
                   into the running process, its allocator calls redirected (no restart; only
                   sampled calls reach a probe); n/a without --attach-mode
  inject-python    the same with --python-objects: CPython's object allocator redirected too (its
                   small objects sampled as source python)
  attach           allocsampler record --pid PID --out DIR --attach-mode uprobe --cpu-budget 0:
                   uprobes on the malloc family, governor off (without --cpu-budget in `record
                   --help`, the flag is left out: there is no governor to turn off then)
  attach-governed  allocsampler record --pid PID --out DIR --attach-mode uprobe: the default CPU
                   budget of the governor (it may duty-cycle the allocation probes); n/a without
                   --cpu-budget
  preload          the workload starts with the preload shim (env from
                   sampler.inprocess.preload.preload_env(--sample-mean): LD_PRELOAD + ALLOCSAMPLER_SAMPLE_MEAN)
                   and is recorded with allocsampler record --pid PID --out DIR, which attaches to
                   the shim's USDT probes otel_memory:alloc/free only
  preload-idle     the shim preloaded, no recorder: the shim's own cost
  rss              allocsampler record --rss --pid PID --out DIR: the always-on tier (sampled page
                   faults, mmap/brk tracepoints, no uprobes); n/a without --rss
  attach-perf      (only when named) attach with --probe-mode perf: classic uprobes + uretprobes
  inject-user      (only when named) inject with --unwind user: stacks copied and unwound in the
                   recorder instead of walked in BPF (the recorder's bill before the BPF walk)

Every allocsampler command also gets -q (no summary). A variant whose prerequisite is missing
(the tool, a CLI flag, the sampler.inprocess.preload module or its shim's USDT notes) is reported as
"n/a" with the reason; a variant that fails while running is dropped for that workload and
reported as "failed" with the reason (--fail-fast aborts instead).

Rounds. One warm-up round (discarded), then --rounds measured rounds (default 5); in each round
every workload runs every variant once, in an order rotated by one position per round (round r
starts with variant r mod k), so no variant always follows the same one. --quick: tiny loops
(c 20,000 pairs, python 300 and torch 60 iterations, mt 40,000 allocations), 1 round, no
warm-up, and unless --workloads/--variants are given only the c workload with one variant of
each kind that the harness starts and waits for differently: unprobed, memleak (an external tool,
its log and munmap), attach (a recorder, symbol probe sites), preload (the shim, USDT sites),
preload-idle (the shim alone), rss (the targets file). attach-governed and attach-perf are attach
with other flags, and the other workloads differ only in their command line; their start-ups
would double the ~20 s. A smoke test of the machinery: the ratios mean nothing (loops of
milliseconds), as the report's first line says.
A full default run starts a recorder ~100 times at ~15 s each (bcc compiles and loads the BPF
programs) and runs the probed loops (memleak: up to ~10x slower): expect about 40 minutes.

Readiness (the go byte is withheld until the probes are really in place). A uprobe shows in the
target's memory: the kernel writes an int3 (or, for an optimized uprobe, a 5-byte call) into the
process's private copy of the text page. So for each probe site (file, offset) the harness reads 5
bytes at the site through /proc/PID/mem and the same bytes of the mapped file
(/proc/PID/map_files), and calls the site patched when they differ.

  * attach tiers: DIR/targets/host=*/date=*/*.parquet exists (written after attaching), it has an attach
    row for the pid, and every site listed as attached in its `probes` (`malloc+0 (emulated,
    session)`: symbol + offset, resolved in the files of its `allocators` column, else the
    target's libc) is patched;
  * preload: the same row, its `probes` must contain `otel_memory:` entries
    (`otel_memory:alloc@0x1a2b (usdt, session)`, the hex being the site's file offset), and
    every site of those probes is patched in the shim's mapping (sites from the shim's
    .note.stapsdt notes; without notes, the entries' offsets in any mapped file that could hold
    them); the shim must be mapped in the target (checked for both preload variants);
  * rss: DIR/targets/host=*/date=*/*.parquet exists;
  * memleak: it printed "Attaching to pid" and the entry of munmap, the last function that it
    attaches, is patched in the target's libc.
  Then the harness waits until the tool has gone quiet (less than --settle-cpu of a CPU over
  0.25 s, at most --settle-timeout s): a recorder's start-up work after attaching (Python
  runtime detection, first files) must not compete with the loop for this machine's 2 CPUs.
  A tool that fails to attach with EINVAL (another uprobe user on the host holds the same
  function with another ref_ctr_offset, iovisor/bcc#5236) is retried (--attach-retries).
  --from-launch S: what users pay from launch instead. The loop starts S seconds after the tool
  was started, without waiting for it to attach or settle: its start-up (BPF load, attaching,
  placement) competes with the loop, and a tool that attaches late records less of it. The
  report gives, per run, whether the tool had attached when the loop ended.

Reported per workload and variant: the median loop time; the ratio of medians to unprobed and,
as its spread, the median and interquartile range of the per-round ratios (each round's variant
over the same round's unprobed); the overhead (ratio - 1) in %; for the attach tiers their
overhead divided by memleak's; probe hits/s and samples/s (sums of `probe_hits` and `samples` in
DIR/recorder over the loop time; the workloads end with _exit, so a Python or torch teardown adds
no hits), lost events (sum of `lost_events` over all rounds), the added ns per probe hit; the
tool's CPU seconds while the loop ran and its peak RSS (VmHWM), both read from /proc. Below the
table: per-round loop times, and for the recorder tiers the tier timeline (DIR/processes `tier`
and targets `tier` events: the governor may move a process to the always-on tier), the mean
`alloc_coverage` and sampled page faults/s.
Targets (a verdict per target): preload <= 1.02x unprobed; rss <= 1.005x; attach: its overhead
at most half of memleak's, (ratio_attach - 1) <= 0.5 * (ratio_memleak - 1). Only ratios taken in
one run mean anything: timings on these shared machines drift.

Outputs: the results go to stdout (markdown); --markdown writes them between the markers
<!-- bench_overhead:begin --> and <!-- bench_overhead:end --> of a file (the prose around them
stays), --svg writes a self-contained SVG chart of the overheads (log axis), referenced from the
markdown block (path relative to the markdown file); --json dumps every run, and --report-from
JSON re-renders the report (stdout, --markdown, --svg) from such a dump without measuring.
Exit status: 0; 1 when a variant failed (the report is still written); 2 on a set-up error;
130 when interrupted (the runs so far go to stdout and --json only).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import glob
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

REPO = Path(__file__).resolve().parent.parent

C_SOURCE = r"""
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static const size_t sizes[] = {16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096};
#define NSIZES (sizeof sizes / sizeof sizes[0])
volatile uintptr_t sink;

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    char go = 0;
    struct timespec a, b;
    printf("ready\n");
    fflush(stdout);
    if (read(0, &go, 1) != 1 || go != 'g')
        return 2;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        char *p = malloc(sizes[i % NSIZES]);
        if (!p)
            return 3;
        p[0] = (char)i;
        sink = (uintptr_t)p + (unsigned char)p[0];
        free(p);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("elapsed_s %.9f ops %ld\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9, n);
    return 0;
}
"""

MT_SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NTHREADS 4
#define QCAP 1024             /* slots per ring (a power of two) */
#define POOL 64               /* blocks each thread keeps alive for a while */

/* One single-producer single-consumer ring per thread: thread i allocates into ring i, thread
   (i+1) % NTHREADS pops and frees (a cross-thread free goes back to the allocating thread's
   arena). */
struct ring {
    _Alignas(64) _Atomic size_t head;       /* consumer */
    _Alignas(64) _Atomic size_t tail;       /* producer */
    _Alignas(64) void *slot[QCAP];
};

static struct ring rings[NTHREADS];
static pthread_barrier_t start_barrier, end_barrier;
static long per_thread;
volatile uintptr_t sink;

static int push(struct ring *q, void *p) {
    size_t t = atomic_load_explicit(&q->tail, memory_order_relaxed);
    size_t h = atomic_load_explicit(&q->head, memory_order_acquire);
    if (t - h == QCAP)
        return 0;
    q->slot[t & (QCAP - 1)] = p;
    atomic_store_explicit(&q->tail, t + 1, memory_order_release);
    return 1;
}

static void *pop(struct ring *q) {
    size_t h = atomic_load_explicit(&q->head, memory_order_relaxed);
    size_t t = atomic_load_explicit(&q->tail, memory_order_acquire);
    if (h == t)
        return NULL;
    void *p = q->slot[h & (QCAP - 1)];
    atomic_store_explicit(&q->head, h + 1, memory_order_release);
    return p;
}

static inline uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static size_t pick_size(uint64_t *rng) {
    uint64_t r = xorshift(rng);
    if ((r & 63) == 0)                                  /* 1 in 64: 16 KiB .. 256 KiB */
        return 16384 + (r >> 8) % (256 * 1024 - 16384);
    return 8 + (r >> 8) % (8192 - 8 + 1);               /* else 8 .. 8192 bytes */
}

static void *worker(void *arg) {
    long id = (long)arg;
    struct ring *out = &rings[id], *in = &rings[(id + NTHREADS - 1) % NTHREADS];
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(id + 1);
    void *pool[POOL] = {0};
    uintptr_t acc = 0;
    pthread_barrier_wait(&start_barrier);
    for (long i = 0; i < per_thread; i++) {
        uint64_t r = xorshift(&rng);
        size_t n = pick_size(&rng);
        char *p;
        if ((r & 15) == 0) {
            p = calloc(1, n);
        } else if ((r & 15) == 1) {                     /* resize a pooled block */
            unsigned k = (r >> 4) % POOL;
            p = realloc(pool[k], n);
            pool[k] = NULL;
        } else {
            p = malloc(n);
        }
        if (!p)
            abort();
        memset(p, (int)i, n < 512 ? n : 512);
        p[n - 1] = (char)i;
        acc += (unsigned char)p[0];
        if (r & 16) {                                   /* half: freed by the next thread */
            if (!push(out, p))
                free(p);
        } else {                                        /* half: kept a while, freed here */
            unsigned k = (r >> 12) % POOL;
            free(pool[k]);
            pool[k] = p;
        }
        for (int j = 0; j < 2; j++) {                   /* free what the previous thread sent */
            void *q = pop(in);
            if (!q)
                break;
            free(q);
        }
    }
    pthread_barrier_wait(&end_barrier);                 /* nobody pushes any more: drain */
    for (void *q; (q = pop(in));)
        free(q);
    for (int k = 0; k < POOL; k++)
        free(pool[k]);
    sink += acc;
    return NULL;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    pthread_t th[NTHREADS];
    struct timespec a, b;
    char go = 0;
    per_thread = n / NTHREADS;
    pthread_barrier_init(&start_barrier, NULL, NTHREADS + 1);
    pthread_barrier_init(&end_barrier, NULL, NTHREADS);
    for (long i = 0; i < NTHREADS; i++)
        if (pthread_create(&th[i], NULL, worker, (void *)i))
            return 4;
    printf("ready\n");
    fflush(stdout);
    if (read(0, &go, 1) != 1 || go != 'g')
        _exit(2);
    clock_gettime(CLOCK_MONOTONIC, &a);
    pthread_barrier_wait(&start_barrier);
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("elapsed_s %.9f ops %ld\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9,
           per_thread * NTHREADS);
    return 0;
}
"""

PY_SOURCE = r'''
import json
import os
import sys
import time


def main():
    iters = int(sys.argv[1])
    base = [{"id": j, "name": "item-%d" % j, "tags": ["t%d" % (j % 7), "u%d" % (j % 11)],
             "score": j * 0.5, "payload": "x" * (j % 90)} for j in range(24)]
    cache = {}
    sink = 0
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    if sys.stdin.buffer.read(1) != b"g":
        sys.exit(2)
    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    for i in range(iters):
        doc = {"seq": i, "items": base, "meta": {"k%d" % k: k * i for k in range(20)}}
        s = json.dumps(doc)                        # a few KiB of str: libc
        back = json.loads(s)
        sink += len(back["items"])
        blobs = [bytes(600 + (i * 131 + k * 977) % 3500) for k in range(6)]   # > 512 B: libc
        cache[i % 512] = blobs[i % 6]              # churn: entries replaced and dropped
        if len(cache) > 256:
            cache.pop((i - 256) % 512, None)
        lst = []
        for k in range(150):                       # list growth past 512 B: realloc in libc
            lst.append(k)
        d = {}
        for k in range(48):                        # dict resizes: big key tables in libc
            d[k] = k
        sink += len(lst) + len(d) + len(s)
    t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    print("elapsed_s %.9f ops %d sink %d" % ((t1 - t0) / 1e9, iters, sink), flush=True)
    os._exit(0)     # no interpreter teardown: the recorder's probe hits are the loop's


main()
'''

TORCH_SOURCE = r'''
import os
import sys
import time

import torch


def main():
    iters, batch = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 256), torch.nn.ReLU(),
        torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 10),
    ).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    losses = []

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x + (i % 7)), y)
        loss.backward()
        opt.step()
        return loss

    for i in range(5):                             # first calls: kernels picked, buffers sized
        step(i)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    if sys.stdin.buffer.read(1) != b"g":
        sys.exit(2)
    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    for i in range(iters):
        losses.append(step(i).item())
    t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    print("elapsed_s %.9f ops %d sink %.3f" % ((t1 - t0) / 1e9, iters, sum(losses)), flush=True)
    os._exit(0)     # no teardown (torch frees a lot at exit): the recorder's probe hits are the loop's


main()
'''

WORKLOADS = ("c", "python", "torch", "mt")
VARIANTS = ("unprobed", "memleak", "inject", "inject-python", "attach", "attach-governed", "preload", "preload-idle",
            "rss")
QUICK_WORKLOADS = ("c",)
QUICK_VARIANTS = ("unprobed", "memleak", "inject", "attach", "preload", "preload-idle", "rss")   # one of each kind
QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"
EXTRA_VARIANTS = ("attach-perf", "inject-user")  # only when named in --variants
ALIASES = {"allocsampler": "attach", "allocsampler-perf": "attach-perf"}   # the script's old names
ATTACH_TIERS = ("attach", "attach-governed", "attach-perf")
INJECT_VARIANTS = frozenset({"inject", "inject-python", "inject-user"})
RECORDER_VARIANTS = frozenset({*ATTACH_TIERS, *INJECT_VARIANTS, "preload", "rss"})
PRELOAD_VARIANTS = frozenset({"preload", "preload-idle"})
WORKLOAD_TITLES = {"c": "c: malloc/free loop", "python": "python: allocation-heavy loop",
                   "torch": "torch: CPU training loop", "mt": "mt: 4-thread allocator stress"}
TARGETS = {"preload": 1.02, "rss": 1.005}          # ratio of medians to unprobed, at most
# the inject tier's, per workload (issue 16): allocation data kept for the whole run besides
INJECT_TARGETS = {"python": 1.03, "torch": 1.08, "c": 1.5, "mt": 1.15}
PLACEMENTS = 200                                   # timed placements into the busy mt workload
ATTACH_VS_MEMLEAK = 0.5                            # attach overhead / memleak overhead, at most
BEGIN, END = "<!-- bench_overhead:begin -->", "<!-- bench_overhead:end -->"


class BenchError(RuntimeError):
    pass


class AttachConflict(BenchError):
    """The kernel refused a uprobe with EINVAL: most likely another tool holds a uprobe on the same
    libc function registered with another ref_ctr_offset (bcc's Python binding passes garbage
    there, iovisor/bcc#5236; `dmesg` then shows "ref_ctr_offset mismatch")."""


# --- probe sites in the target's memory --------------------------------------------------------
@dataclass
class Mapping:
    start: int
    end: int
    perms: str
    offset: int      # file offset of start
    path: str


def mappings(pid: int) -> list[Mapping]:
    """The file-backed mappings of a process."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append(Mapping(start, end, parts[1], int(parts[2], 16), parts[5].rstrip("\n")))
    return out


def _same_file(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def libc_path(maps: list[Mapping]) -> str | None:
    for m in maps:
        if "x" in m.perms and re.search(r"/libc(\.so\.6|-[\d.]+\.so)$", m.path):
            return m.path
    return None


def site_patched(pid: int, maps: list[Mapping], path: str, off: int) -> bool | None:
    """Whether the probe site at file offset `off` of `path` differs in the target's memory from
    the mapped file (an int3, or the 5-byte call of an optimized uprobe); None when no executable
    mapping of that file covers the offset."""
    for m in maps:
        if "x" not in m.perms or not (m.offset <= off < m.offset + m.end - m.start) or not _same_file(m.path, path):
            continue
        addr = m.start + off - m.offset
        n = min(5, m.end - addr)
        try:     # the file really mapped (it may have been replaced on disk since)
            src = open(f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}", "rb")  # noqa: SIM115
        except OSError:
            src = open(m.path, "rb")  # noqa: SIM115
        with src:
            src.seek(off)
            disk = src.read(n)
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(addr)
            mem = f.read(n)
        return disk != mem
    return None


class ElfSymbols:
    """Function symbols of an ELF file (dynamic, then static) as file offsets."""

    def __init__(self, path: str):
        from elftools.elf.elffile import ELFFile

        self.offsets: dict[str, int] = {}
        with open(path, "rb") as f:
            elf = ELFFile(f)
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            for name in (".dynsym", ".symtab"):
                sec = elf.get_section_by_name(name)
                if sec is None:
                    continue
                for sym in sec.iter_symbols():
                    if sym["st_info"]["type"] not in ("STT_FUNC", "STT_GNU_IFUNC") or not sym["st_value"]:
                        continue
                    off = _vaddr_to_offset(loads, sym["st_value"])
                    if off is not None:
                        self.offsets.setdefault(sym.name.split("@")[0], off)


def _vaddr_to_offset(loads, vaddr: int) -> int | None:
    for seg in loads:
        if seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]:
            return vaddr - seg["p_vaddr"] + seg["p_offset"]
    return None


def usdt_sites(path: str | Path) -> dict[str, list[int]]:
    """USDT probes of an ELF file from its .note.stapsdt notes: "provider:name" -> file offsets of
    the probe sites."""
    from elftools.elf.elffile import ELFFile

    out: dict[str, list[int]] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        sec = elf.get_section_by_name(".note.stapsdt")
        if sec is None or elf.elfclass != 64:
            return out
        base_sec = elf.get_section_by_name(".stapsdt.base")
        loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        data = sec.data()
        end = "<" if elf.little_endian else ">"
        pos = 0
        while pos + 12 <= len(data):
            namesz, descsz, ntype = struct.unpack_from(end + "III", data, pos)
            pos += 12
            name = data[pos:pos + namesz].rstrip(b"\0")
            pos += (namesz + 3) & ~3
            desc = data[pos:pos + descsz]
            pos += (descsz + 3) & ~3
            if name != b"stapsdt" or ntype != 3 or len(desc) < 26:
                continue
            pc, base, _sem = struct.unpack_from(end + "QQQ", desc, 0)
            provider, probe = desc[24:].split(b"\0")[:2]
            if base_sec is not None and base:      # prelink adjustment, as in systemtap/bcc
                pc += base_sec["sh_addr"] - base
            off = _vaddr_to_offset(loads, pc)
            if off is not None:
                out.setdefault(f"{provider.decode()}:{probe.decode()}", []).append(off)
    return out


PROBE_SYM = re.compile(r"^([\w.]+)\+(\d+)\b")                                       # malloc+0 (...)
PROBE_USDT = re.compile(r"^([\w.]+:[\w.]+)@(?:(/\S+?)[+:@])?0x([0-9a-fA-F]+)\b")     # prov:name@0x1a2b


# --- processes --------------------------------------------------------------------------------
def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGINT, wait: float = 20.0) -> int | None:
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        return proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _short(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "…"


@dataclass
class Run:
    workload: str
    variant: str
    round: int
    loop_s: float
    ops: int
    probe_hits: int | None = None
    samples: int | None = None
    lost_events: int | None = None
    dropped_samples: int | None = None
    recorder_cpu_s: float | None = None      # sum of DIR/recorder cpu_s
    recorder_rss: int | None = None          # max of DIR/recorder rss
    tool_cpu_s: float | None = None          # tool's CPU seconds from release to the loop's end (/proc)
    tool_hwm: int | None = None              # tool's VmHWM
    probe_sites: int | None = None           # probe sites seen patched at release
    probes: list[str] = field(default_factory=list)    # the targets attach row's probes
    attach_retries: int = 0
    settle_s: float | None = None            # waited after readiness for the tool to go quiet
    sampled_faults: int | None = None        # DIR/recorder sampled_faults (always-on tier)
    tiers: list[str] = field(default_factory=list)     # DIR/processes tier, in order of appearance
    alloc_coverage: float | None = None      # mean DIR/processes alloc_coverage (governor duty)
    ready_s: float | None = None             # from starting the tool to its probes (and redirection) in place
    attached_in_loop: bool | None = None     # --from-launch: attached before the loop ended
    stop_us: float | None = None             # inject: how long the placement stopped the target's thread


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args = args
        self.tmp = tmp
        self.c_exe = tmp / "malloc_loop"
        self.mt_exe = tmp / "mt_stress"
        self.py_script = tmp / "py_workload.py"
        self.torch_script = tmp / "torch_workload.py"
        self._symbols: dict[str, ElfSymbols] = {}
        self.seq = 0
        self.na: dict[str, str] = {}               # variant or workload -> why it cannot run
        self.notes: list[str] = []                 # how variants were run, for the record
        self.commands: dict[str, str] = {}         # variant -> command template
        self.recorder_args: dict[str, list[str]] = {}
        self.shim: Path | None = None
        self.preload_env: dict[str, str] | None = None
        self.usdt: dict[str, list[int]] = {}
        self.warned: set[str] = set()

    # set-up -----------------------------------------------------------------------------------
    def build(self) -> None:
        src = self.tmp / "malloc_loop.c"
        src.write_text(C_SOURCE)
        nobuiltin = ["-fno-builtin-malloc", "-fno-builtin-free", "-fno-builtin-calloc", "-fno-builtin-realloc"]
        if "c" in self.args.workloads:
            subprocess.run(["gcc", "-O2", *nobuiltin, "-o", str(self.c_exe), str(src)], check=True)
        if "mt" in self.args.workloads or ("inject" in self.args.variants and self.args.placements):
            src = self.tmp / "mt_stress.c"
            src.write_text(MT_SOURCE)
            subprocess.run(["gcc", "-O2", "-pthread", *nobuiltin, "-o", str(self.mt_exe), str(src)], check=True)
        self.py_script.write_text(PY_SOURCE)
        self.torch_script.write_text(TORCH_SOURCE)
        if "torch" in self.args.workloads:
            r = subprocess.run([self.args.torch_python, "-I", "-c", "import torch; print(torch.__version__)"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                self.na["torch"] = f"`import torch` failed in {self.args.torch_python}: " + _short(r.stderr[-300:])
            else:
                self.torch_version = r.stdout.strip()

    def prepare_variants(self) -> None:
        """Decide what each variant runs, or why it cannot run here."""
        a = self.args
        need_rec = [v for v in a.variants if v in RECORDER_VARIANTS]
        helptext, why = "", ""
        if need_rec:
            try:
                r = subprocess.run([*a.allocsampler_cmd, "record", "--help"], capture_output=True, text=True,
                                   timeout=120, cwd=REPO)
                helptext = r.stdout if r.returncode == 0 else ""
                why = "" if helptext else f"`allocsampler record --help` exited {r.returncode}: {_short(r.stderr)}"
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"`allocsampler record --help` failed: {e}"
        has_budget = re.search(r"--cpu-budget\b", helptext) is not None
        has_rss = re.search(r"--rss\b", helptext) is not None
        has_modes = re.search(r"--attach-mode\b", helptext) is not None
        uprobe = ["--attach-mode", "uprobe"] if has_modes else []
        rec = " ".join(Path(c).name if i == 0 else c for i, c in enumerate(a.allocsampler_cmd))
        common = ["-q"] + (["-i", str(a.interval)] if a.interval else []) \
            + (["--sample-bytes", str(a.sample_mean)] if a.sample_mean_given else [])
        pretty = " ".join(common)
        for v in a.variants:
            if v == "unprobed":
                self.commands[v] = "nothing attached"
            elif v == "memleak":
                if not (os.path.isfile(a.memleak) and os.access(a.memleak, os.X_OK)):
                    self.na[v] = f"{a.memleak} not found (bcc's tools: apt install bpfcc-tools)"
                self.commands[v] = f"{Path(a.memleak).name} -p PID -T 5"
            elif v in RECORDER_VARIANTS and why:
                self.na[v] = why
            elif v in INJECT_VARIANTS:
                if not has_modes:
                    self.na[v] = "`allocsampler record` has no --attach-mode (no injected sampler yet)"
                extra = {"inject-python": ["--python-objects"], "inject-user": ["--unwind", "user"]}.get(v, [])
                self.recorder_args[v] = ["--attach-mode", "inject", *extra]
                self.commands[v] = f"{rec} record --pid PID --out DIR {' '.join(self.recorder_args[v])} {pretty}"
            elif v in ("attach", "attach-perf"):
                extra = uprobe + (["--cpu-budget", "0"] if has_budget else [])
                if v == "attach-perf":
                    extra += ["--probe-mode", "perf"]
                self.recorder_args[v] = extra
                self.commands[v] = f"{rec} record --pid PID --out DIR {' '.join(extra)} {pretty}".replace("  ", " ")
                if not has_budget and not any(n.startswith("attach: no --cpu-budget") for n in self.notes):
                    self.notes.append("attach: no --cpu-budget in `allocsampler record --help` (no governor "
                                      "yet), so it ran without the flag")
            elif v == "attach-governed":
                if not has_budget:
                    self.na[v] = "`allocsampler record` has no --cpu-budget (the governor is not there yet)"
                self.recorder_args[v] = list(uprobe)
                self.commands[v] = (f"{rec} record --pid PID --out DIR {' '.join(uprobe)} {pretty} "
                                    "(default --cpu-budget)").replace("  ", " ")
            elif v == "rss":
                if not has_rss:
                    self.na[v] = "`allocsampler record` has no --rss (the always-on tier is not there yet)"
                self.recorder_args[v] = ["--rss"]
                self.commands[v] = f"{rec} record --rss --pid PID --out DIR {pretty}"
            if v in PRELOAD_VARIANTS and v not in self.na:
                reason = self._prepare_preload(need_usdt=(v == "preload"))
                if reason:
                    self.na[v] = reason
                if v == "preload":
                    self.recorder_args[v] = []
                    self.commands[v] = (f"LD_PRELOAD=<shim> ALLOCSAMPLER_SAMPLE_MEAN={a.sample_mean} workload; "
                                        f"{rec} record --pid PID --out DIR {pretty}")
                else:
                    self.commands[v] = f"LD_PRELOAD=<shim> ALLOCSAMPLER_SAMPLE_MEAN={a.sample_mean} workload"
        for v, reason in self.na.items():
            if v in a.variants:
                print(f"# {v}: n/a: {reason}", file=sys.stderr)

    def _prepare_preload(self, need_usdt: bool) -> str | None:
        if self.preload_env is None:
            if str(REPO) not in sys.path:
                sys.path.insert(0, str(REPO))
            try:
                from sampler.inprocess import preload as pl
            except Exception as e:  # noqa: BLE001 - any failure makes the variant n/a
                return f"sampler.inprocess.preload is not importable ({type(e).__name__}: {_short(e)})"
            for fn in ("preload_env", "shim_path"):
                if not callable(getattr(pl, fn, None)):
                    return f"sampler.inprocess.preload has no {fn}()"
            try:
                shim = Path(pl.shim_path())
                env = dict(pl.preload_env(self.args.sample_mean))
            except Exception as e:  # noqa: BLE001
                return f"sampler.inprocess.preload failed: {type(e).__name__}: {_short(e)}"
            if not shim.is_file():
                return f"sampler.inprocess.preload.shim_path() = {shim}: no such file"
            if shim.name not in env.get("LD_PRELOAD", ""):
                return f"preload_env() does not put {shim.name} in LD_PRELOAD"
            self.shim, self.preload_env = shim.resolve(), env
            try:
                self.usdt = {k: v for k, v in usdt_sites(self.shim).items() if k.startswith("otel_memory:")}
            except Exception as e:  # noqa: BLE001
                return f"cannot read the USDT notes of {self.shim}: {e}"
            self.notes.append(f"preload shim: {self.shim} (USDT probes: {', '.join(sorted(self.usdt)) or 'none'}), "
                              f"ALLOCSAMPLER_SAMPLE_MEAN={env.get('ALLOCSAMPLER_SAMPLE_MEAN', '?')}")
        if need_usdt and "otel_memory:alloc" not in self.usdt:
            return f"the shim {self.shim} has no otel_memory:alloc USDT note"
        return None

    # workloads --------------------------------------------------------------------------------
    def workload_argv(self, workload: str, n: int) -> list[str]:
        if workload == "c":
            return [str(self.c_exe), str(n)]
        if workload == "mt":
            return [str(self.mt_exe), str(n)]
        if workload == "torch":
            return [self.args.torch_python, "-I", str(self.torch_script), str(n), str(self.args.torch_batch)]
        return [sys.executable, "-I", str(self.py_script), str(n)]

    def start_workload(self, argv: list[str], env: dict | None) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        line = proc.stdout.readline()
        if line.strip() != b"ready":
            _stop(proc, signal.SIGKILL)
            raise BenchError(f"workload {argv} did not start: {line!r}")
        return proc

    def symbols(self, path: str) -> ElfSymbols:
        key = os.path.realpath(path)
        if key not in self._symbols:
            self._symbols[key] = ElfSymbols(key)
        return self._symbols[key]

    # one run ----------------------------------------------------------------------------------
    def run_once(self, workload: str, variant: str, n: int, rnd: int) -> Run:
        self.seq += 1
        rundir = self.tmp / f"run{self.seq:03d}-{workload}-{variant}"
        rundir.mkdir()
        log = rundir / "tool.log"
        work = tool = None
        logf = None
        try:
            preload = variant in PRELOAD_VARIANTS
            work = self.start_workload(self.workload_argv(workload, n), self.preload_env if preload else None)
            if preload and not any(_same_file(m.path, str(self.shim)) for m in mappings(work.pid)):
                raise BenchError(f"{variant}: the shim {self.shim} is not mapped in the {workload} workload")
            sites = ready = None
            retries = 0
            launched = time.monotonic()
            while (variant in RECORDER_VARIANTS or variant == "memleak") and self.args.from_launch:
                logf = open(log, "wb")   # noqa: SIM115 - closed in finally
                tool = self.start_tool(variant, work.pid, rundir, logf)
                time.sleep(self.args.from_launch)
                break
            while (variant in RECORDER_VARIANTS or variant == "memleak") and not self.args.from_launch:
                logf = open(log, "wb")   # noqa: SIM115 - closed in finally
                launched = time.monotonic()
                tool = self.start_tool(variant, work.pid, rundir, logf)
                try:
                    sites = self.wait_ready(variant, work.pid, tool, rundir, log)
                    ready = time.monotonic() - launched
                    break
                except AttachConflict as e:
                    # Another uprobe user on this libc (other sessions, tests) registered the same
                    # function with a different ref_ctr_offset: the kernel refuses ours (EINVAL).
                    retries += 1
                    if retries > self.args.attach_retries:
                        raise BenchError(f"{variant}: gave up after {retries} attach conflicts:\n{e}") from None
                    print(f"  {variant}: attach conflict (EINVAL), retry {retries} in "
                          f"{self.args.retry_wait:g} s", file=sys.stderr)
                    _stop(tool, signal.SIGINT, 20)
                    logf.close()
                    shutil.rmtree(rundir / "out", ignore_errors=True)
                    time.sleep(self.args.retry_wait)
            settle = self.settle(tool) if tool and not self.args.from_launch else None
            cpu0 = _cpu_s(tool.pid) if tool else None
            work.stdin.write(b"g")
            work.stdin.close()
            cpu1 = hwm = None
            while True:      # poll the tool's CPU while the loop runs: its value at the loop's end
                if tool is not None:
                    cpu1 = _cpu_s(tool.pid) if tool.poll() is None else cpu1
                    hwm = _vm_hwm(tool.pid) or hwm
                try:
                    work.wait(0.1 if tool is not None else None)
                    break
                except subprocess.TimeoutExpired:
                    continue
            attached = None
            if tool is not None and self.args.from_launch and variant != "memleak":
                # attached by the loop's end: its `targets` row is written
                attached = bool(glob.glob(str(rundir / "out" / "targets" / "host=*" / "date=*" / "*.parquet")))
            out = work.stdout.read().decode()
            if work.returncode != 0:
                raise BenchError(f"workload {workload} exited {work.returncode}: {out!r}")
            m = re.search(r"elapsed_s ([\d.]+) ops (\d+)", out)
            if not m:
                raise BenchError(f"workload {workload}: no timing in {out!r}")
            r = Run(workload, variant, rnd, float(m.group(1)), int(m.group(2)), tool_hwm=hwm,
                    probe_sites=sites, attach_retries=retries, settle_s=settle, ready_s=ready,
                    attached_in_loop=attached)
            if cpu0 is not None and cpu1 is not None:
                r.tool_cpu_s = cpu1 - cpu0
            if tool is not None:
                self.stop_tool(variant, tool, log)
                if variant in RECORDER_VARIANTS:
                    self.read_recorder(r, rundir / "out")
            return r
        finally:
            _stop(work, signal.SIGKILL, 5)
            _stop(tool, signal.SIGINT, 20)
            if logf is not None:
                logf.close()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    def settle(self, tool: subprocess.Popen) -> float:
        """After attaching, a tool still works a while (a recorder: Python runtime detection, the
        first symbolization, writing its first files). Wait until it uses less than --settle-cpu of a
        CPU over 0.25 s (at most --settle-timeout s), so that its start-up is not in the loop's time.
        Returns the seconds waited."""
        t0 = time.monotonic()
        window = 0.25
        c0 = _cpu_s(tool.pid)
        while c0 is not None and time.monotonic() - t0 < self.args.settle_timeout and tool.poll() is None:
            time.sleep(window)
            c1 = _cpu_s(tool.pid)
            if c1 is None or (c1 - c0) / window < self.args.settle_cpu:
                break
            c0 = c1
        return time.monotonic() - t0

    def start_tool(self, variant: str, pid: int, rundir: Path, logf) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if variant in RECORDER_VARIANTS:
            a = self.args
            argv = [*a.allocsampler_cmd, "record", *self.recorder_args[variant], "--pid", str(pid),
                    "--out", str(rundir / "out"), "-q"]
            if a.interval:
                argv += ["-i", str(a.interval)]
            if a.sample_mean_given:
                argv += ["--sample-bytes", str(a.sample_mean)]
        else:
            argv = [self.args.memleak, "-p", str(pid), "-T", "5"]
        # cwd: `python -m sampler.cli` (no .venv in this checkout) must import this checkout
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, cwd=REPO)

    def wait_ready(self, variant: str, pid: int, tool: subprocess.Popen, rundir: Path, log: Path) -> int:
        """Wait until the tool's probes are in place; returns the number of probe sites checked."""
        deadline = time.monotonic() + self.args.attach_timeout
        why = "nothing yet"
        while time.monotonic() < deadline:
            if tool.poll() is not None:
                last = next((ln for ln in reversed(_tail(log).splitlines()) if ln.strip()), "no output")
                msg = f"{variant} exited {tool.returncode} before it attached ({last.strip()}):\n{_tail(log)}"
                raise (AttachConflict if "Invalid argument" in _tail(log, 100000) else BenchError)(msg)
            maps = mappings(pid)
            if variant == "memleak":
                if "Attaching to pid" in _tail(log, 100000):
                    libc = libc_path(maps)
                    off = self.symbols(libc).offsets.get("munmap") if libc else None
                    if off is None:
                        raise BenchError(f"pid {pid}: no libc with munmap mapped")
                    if site_patched(pid, maps, libc, off):
                        return 1
                    why = "munmap not patched yet"
                else:
                    why = "no 'Attaching to pid' line yet"
            else:
                files = glob.glob(str(rundir / "out" / "targets" / "host=*" / "date=*" / "*.parquet"))
                if not files:
                    why = "no targets file yet"
                elif variant == "rss":
                    return 0
                else:
                    ok, why, n = self._recorder_sites_patched(variant, pid, files, maps)
                    if ok:
                        return n
            time.sleep(0.05)
        raise BenchError(f"{variant} not attached after {self.args.attach_timeout} s ({why}):\n{_tail(log)}")

    def _recorder_sites_patched(self, variant: str, pid: int, files: list[str],
                                maps: list[Mapping]) -> tuple[bool, str, int]:
        import pandas as pd

        rows = pd.concat([pd.read_parquet(f) for f in files])
        attach = rows[(rows["event"] == "attach") & (rows["pid"] == pid)]
        if attach.empty:
            return False, "no attach row yet", 0
        probes = [p for ps in attach["probes"] if ps is not None for p in ps]
        attached = [p for p in probes if "not attached" not in p]
        if not attached:
            return False, "the attach row lists no attached probe: " + ", ".join(probes), 0
        allocs = [a.split(":", 1)[1] if ":" in a else a for al in attach["allocators"] if al is not None for a in al]
        otel = [p for p in attached if p.startswith("otel_memory:")]
        if variant in INJECT_VARIANTS and not otel:
            raise BenchError(f"{variant}: the recorder attached no otel_memory: USDT probe of the injected sampler "
                             "(probes: " + ", ".join(probes) + ")")
        if variant == "preload":
            if not otel:    # the recorder did not see the shim: measuring it would be measuring attach
                raise BenchError("preload: the recorder attached no otel_memory: USDT probe (probes: "
                                 + ", ".join(probes) + ")")
            if len(otel) < len(attached) and "preload-extra" not in self.warned:
                self.warned.add("preload-extra")
                self.notes.append("preload: the recorder also attached " + ", ".join(sorted(
                    {p.split(" ")[0] for p in attached if not p.startswith("otel_memory:")})))
        libc = libc_path(maps)
        checks: list[tuple[str, list[str], int]] = []     # (probe, candidate files, file offset)
        for p in attached:
            if m := PROBE_USDT.match(p):
                name, path, off = m.group(1), m.group(2), int(m.group(3), 16)
                notes = self.usdt.get(name) if self.shim is not None and variant == "preload" else None
                if variant in INJECT_VARIANTS:   # the sites are in the sampler's memfd, at these offsets
                    checks.append((p, [mp.path for mp in maps if "/memfd:allocsampler" in mp.path], off))
                elif notes and path is None:
                    checks += [(p, [str(self.shim)], o) for o in notes]
                    if off not in notes and f"usdt-off:{name}" not in self.warned:
                        self.warned.add(f"usdt-off:{name}")
                        self.notes.append(f"{variant}: {p} does not name a site of {name} in the shim's notes "
                                          f"({', '.join(hex(o) for o in notes)}); the notes' sites were checked")
                else:
                    cands = [path] if path else (allocs or [mp.path for mp in maps if "allocsampler" in mp.path]
                                                 or sorted({mp.path for mp in maps if "x" in mp.perms}))
                    checks.append((p, cands, off))
            elif m := PROBE_SYM.match(p):
                name, off = m.group(1), int(m.group(2))
                for f in [*allocs, *([libc] if libc else [])]:
                    base = self.symbols(f).offsets.get(name)
                    if base is not None:
                        checks.append((p, [f], base + off))
                        break
        if not checks:
            return False, "no probe site could be located: " + ", ".join(attached), 0
        missing = [p for p, cands, off in checks
                   if not any(site_patched(pid, maps, f, off) for f in cands)]
        if missing:
            return False, "not patched yet: " + ", ".join(dict.fromkeys(missing)), 0
        return True, "", len(checks)

    def stop_tool(self, variant: str, tool: subprocess.Popen, log: Path) -> None:
        if variant in RECORDER_VARIANTS:
            try:     # it ends by itself when its only target exits
                rc = tool.wait(self.args.stop_timeout)
            except subprocess.TimeoutExpired:
                rc = _stop(tool, signal.SIGINT, self.args.stop_timeout)
        else:
            rc = _stop(tool, signal.SIGINT, self.args.stop_timeout)
        if rc not in (0, None) and not (variant == "memleak" and rc in (-signal.SIGINT, 130)):
            last = next((ln for ln in reversed(_tail(log).splitlines()) if ln.strip()), "no output")
            raise BenchError(f"{variant} exited {rc} ({last.strip()}):\n{_tail(log)}")

    @staticmethod
    def read_recorder(r: Run, out: Path) -> None:
        import pandas as pd

        rec = pd.read_parquet(out / "recorder")
        if rec.empty:
            raise BenchError(f"{out}/recorder is empty")

        def total(col: str) -> int | None:
            return int(rec[col].fillna(0).sum()) if col in rec else None

        r.probe_hits, r.samples = total("probe_hits"), total("samples")
        r.lost_events, r.dropped_samples = total("lost_events"), total("dropped_samples")
        r.recorder_cpu_s = float(rec["cpu_s"].sum()) if "cpu_s" in rec else None
        r.recorder_rss = int(rec["rss"].max()) if "rss" in rec else None
        r.sampled_faults = total("sampled_faults")
        timeline = []                            # (ts, tier): processes rows and targets `tier` events
        with contextlib.suppress(Exception):
            t = pd.read_parquet(out / "targets")
            a = t[t["event"] == "attach"]
            r.probes = sorted({p for ps in a["probes"] if ps is not None for p in ps})
            for ts, detail in t[t["event"] == "tier"][["ts", "detail"]].itertuples(index=False):
                timeline.append((ts, str(detail).split(":", 1)[0]))
                if m := re.search(r"one thread stopped (\d+) us", str(detail)):
                    r.stop_us = float(m.group(1))
        with contextlib.suppress(Exception):     # columns of the tiers (schema 3)
            p = pd.read_parquet(out / "processes")
            if "tier" in p:
                timeline += [(ts, str(x)) for ts, x in p[["ts", "tier"]].dropna().itertuples(index=False)]
            if "alloc_coverage" in p and p["alloc_coverage"].notna().any():
                r.alloc_coverage = float(p["alloc_coverage"].mean())
        for _, tier in sorted(timeline, key=lambda x: x[0]):
            if not r.tiers or r.tiers[-1] != tier:
                r.tiers.append(tier)

    def time_placements(self, n: int, ops: int) -> list[float]:
        """Stop times (us) of `n` placements of the sampler into the running mt workload (4 busy
        threads), by the placement helper alone: no configuration, no redirection."""
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from sampler.inprocess import inject
        from sampler.proc.process import read_stat

        code, helper = inject.built()
        layout = inject.CodeLayout.of(code)
        work = self.start_workload(self.workload_argv("mt", max(ops, 10**6) * 100), None)   # outlives the placements
        stops = []
        try:
            work.stdin.write(b"g")
            work.stdin.close()
            time.sleep(0.2)
            for _ in range(n):
                if work.poll() is not None:
                    raise BenchError(f"the mt workload ended after {len(stops)} placements")
                try:
                    stops.append(inject.place(work.pid, helper, layout, read_stat(work.pid).start)[1] / 1000)
                except inject.Refused as e:
                    raise BenchError(f"placement refused: {e}") from None
                time.sleep(0.01)
        finally:
            _stop(work, signal.SIGKILL, 5)
        print(f"# {n} placements into mt: median {statistics.median(stops):.0f} us, max {max(stops):.0f} us",
              file=sys.stderr)
        return stops

    # calibration ------------------------------------------------------------------------------
    def calibrate(self, workload: str, seconds: float, n: int) -> int:
        """Loop size for about `seconds` unprobed: grow n until a run takes > 0.4 s, then scale."""
        for _ in range(5):
            t = self.run_once(workload, "unprobed", n, -1).loop_s
            if t > 0.4:
                break
            n *= 4
        return max(1, int(n * seconds / max(t, 1e-6)))


# --- report -----------------------------------------------------------------------------------
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _quartiles(xs: list[float]) -> tuple[float, float] | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _fmt(v, spec: str, none: str = "–") -> str:
    return none if v is None else format(v, spec)


def _pct(v: float | None) -> str:
    if v is None:
        return "–"
    p = v * 100
    return f"{p:+,.0f}%" if abs(p) >= 100 else f"{p:+.1f}%" if abs(p) >= 10 else f"{p:+.2f}%"


def summarize(runs: list[Run], workloads: list[str], variants: list[str], na: dict[str, str],
              failed: dict[tuple[str, str], str]) -> list[dict]:
    rows = []
    order = VARIANTS + EXTRA_VARIANTS
    variants = sorted(variants, key=lambda v: order.index(v) if v in order else len(order))   # display order
    for w in workloads:
        by = {(r.variant, r.round): r for r in runs if r.workload == w}
        med = {v: _median([r.loop_s for r in runs if r.workload == w and r.variant == v]) for v in variants}
        base = med.get("unprobed")
        ratio = {v: (med[v] / base) if base and med[v] else None for v in variants}
        ml = ratio.get("memleak")
        for v in variants:
            row = {"workload": w, "variant": v}
            rs = sorted((r for r in runs if r.workload == w and r.variant == v), key=lambda r: r.round)
            reason = na.get(w) or na.get(v)
            if reason or (w, v) in failed:
                row["na"] = f"n/a: {reason}" if reason else f"failed: {failed[(w, v)]}"
                row["na_of"] = w if w in na else v if reason else f"{w} / {v}"
                if not rs:
                    rows.append(row)
                    continue
            if not rs:
                continue
            per_round = [r.loop_s / by[("unprobed", r.round)].loop_s for r in rs
                         if ("unprobed", r.round) in by and by[("unprobed", r.round)].loop_s > 0]
            iqr = _quartiles(per_round)
            vs_round = []
            if v in ATTACH_TIERS:
                for r in rs:
                    u, m = by.get(("unprobed", r.round)), by.get(("memleak", r.round))
                    if u and m and m.loop_s != u.loop_s:
                        vs_round.append((r.loop_s - u.loop_s) / (m.loop_s - u.loop_s))
            hits_run = _median([r.probe_hits for r in rs])
            ovh = ratio[v] - 1 if ratio[v] is not None else None
            vs_ml = (ovh / (ml - 1)) if (v in ATTACH_TIERS and ml and ml != 1 and ovh is not None) else None
            lost = [r.lost_events for r in rs if r.lost_events is not None]
            row.update({
                "n": len(rs), "ops": rs[0].ops, "median_s": med[v], "ratio": ratio[v],
                "iqr": iqr, "per_round": per_round, "overhead": ovh if v != "unprobed" else None,
                "vs_memleak": vs_ml, "vs_memleak_iqr": _quartiles(vs_round),
                "hits_per_s": _median([r.probe_hits / r.loop_s if r.probe_hits is not None else None for r in rs]),
                "samples_per_s": _median([r.samples / r.loop_s if r.samples is not None else None for r in rs]),
                "lost": sum(lost) if lost else None,
                "ns_per_hit": ((med[v] - base) / hits_run * 1e9) if hits_run and base else None,
                "tool_cpu": _median([r.tool_cpu_s for r in rs]),
                "tool_hwm": _median([r.tool_hwm for r in rs]),
                "rec_cpu": _median([r.recorder_cpu_s for r in rs]),
                "sites": _median([r.probe_sites for r in rs]),
                "times": [r.loop_s for r in rs], "rounds": [r.round for r in rs],
                "tiers": list(dict.fromkeys(" -> ".join(r.tiers) for r in rs if r.tiers)),
                "coverage": _median([r.alloc_coverage for r in rs]),
                "settle": _median([r.settle_s for r in rs]),
                "faults_per_s": _median([r.sampled_faults / r.loop_s if r.sampled_faults is not None else None
                                         for r in rs]),
                "ready": _median([r.ready_s for r in rs]),
                "ready_iqr": _quartiles([r.ready_s for r in rs if r.ready_s is not None]),
                "stops_us": [r.stop_us for r in rs if r.stop_us is not None],
                "attached_in_loop": [r.attached_in_loop for r in rs if r.attached_in_loop is not None],
            })
            rows.append(row)
    return rows


def verdicts(rows: list[dict], workloads: list[str], variants: list[str]) -> list[str]:
    """One line per target: met / NOT met / not measured, with the per-workload figures."""
    get = {(r["workload"], r["variant"]): r for r in rows}
    out = []

    def missing(w: str, *vs: str) -> str | None:
        for v in vs:
            r = get.get((w, v))
            if r is None or r.get("ratio") is None:
                return f"{w}: not measured ({v}: {_short(r['na'], 90) if r and 'na' in r else 'not run'})"
        return None

    def line(label: str, items: list[tuple[str, bool, str]], skipped: list[str]) -> str:
        if not items:
            return f"- **{label}: not measured**" + (f" ({'; '.join(skipped)})" if skipped else "")
        ok = all(i[1] for i in items)
        head = ("met" if ok else "NOT met") + (f" on the {len(items)} measured workloads" if skipped and ok else "")
        detail = "; ".join([*(f"{w} {txt}: {'met' if good else 'NOT met'}" for w, good, txt in items), *skipped])
        return f"- **{label}: {head}** ({detail})"

    for v, limit in TARGETS.items():
        if v not in variants:
            continue
        items, skipped = [], []
        for w in workloads:
            if why := missing(w, v, "unprobed"):
                skipped.append(why)
                continue
            r = get[(w, v)]
            q = r["iqr"]
            txt = f"{r['ratio']:.3f}x"
            if q and len(r["per_round"]) > 1:
                txt += f" (per-round IQR {q[0]:.3f}-{q[1]:.3f}" + (", straddles the target)" if q[0] <= limit <= q[1]
                                                                   else ")")
            items.append((w, r["ratio"] <= limit, txt))
        out.append(line(f"{v} <= {limit}x unprobed", items, skipped))
    if "inject" in variants:
        items, skipped = [], []
        for w in workloads:
            limit = INJECT_TARGETS.get(w)
            if limit is None:
                continue
            if why := missing(w, "inject", "unprobed"):
                skipped.append(why)
                continue
            r = get[(w, "inject")]
            q = r["iqr"]
            kept = r.get("tiers") == ["inject"]          # every run stayed in the tier: data for the whole run
            txt = f"{r['ratio']:.3f}x <= {limit}x" + (
                f" (per-round IQR {q[0]:.3f}-{q[1]:.3f})" if q and len(r["per_round"]) > 1 else "") + (
                "" if kept else f", tiers {' | '.join(r.get('tiers') or ['?'])}")
            items.append((w, r["ratio"] <= limit and kept, txt))
        out.append(line("inject: at most the issue's ratio per workload, allocation data for the whole run",
                        items, skipped))
    for v in ATTACH_TIERS:
        if v not in variants:
            continue
        items, skipped = [], []
        for w in workloads:
            if why := missing(w, v, "memleak", "unprobed"):
                skipped.append(why)
                continue
            r, m = get[(w, v)], get[(w, "memleak")]
            vs, q = r["vs_memleak"], r.get("vs_memleak_iqr")
            txt = f"{_pct(r['ratio'] - 1)} vs memleak's {_pct(m['ratio'] - 1)}"
            if vs is not None:
                txt = f"{vs:.3f}x memleak's overhead ({txt}" + (
                    f"; per-round IQR {q[0]:.3f}-{q[1]:.3f})" if q and len(r["per_round"]) > 1 else ")")
            items.append((w, (r["ratio"] - 1) <= ATTACH_VS_MEMLEAK * (m["ratio"] - 1), txt))
        out.append(line(f"{v}: overhead <= {ATTACH_VS_MEMLEAK}x memleak's", items, skipped))
    return out


def _p99(xs: list[float]) -> float:
    """The 99th percentile, nearest rank (the max below 100 values)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, math.ceil(0.99 * len(ys)) - 1)]


def inject_lines(rows: list[dict], placements: list[float]) -> list[str]:
    """The inject tier's placement stops and the time from `record` to sampling in place."""
    out = []
    stops = list(placements)
    if stops:
        out.append(f"- placement stop of the target's thread, {len(stops)} placements into the running mt "
                   f"workload (4 busy threads): median {statistics.median(stops):.0f} us, p99 "
                   f"{_p99(stops):.0f} us, max {max(stops):.0f} us")
    in_runs = [x for r in rows if r["variant"] in INJECT_VARIANTS for x in r.get("stops_us") or ()]
    if in_runs:
        out.append(f"- the same in the measured inject runs ({len(in_runs)}, one per run): median "
                   f"{statistics.median(in_runs):.0f} us, max {max(in_runs):.0f} us")
    for r in rows:
        if r["variant"] in RECORDER_VARIANTS and r.get("ready") is not None:
            q = r.get("ready_iqr")
            out.append(f"- {r['workload']} / {r['variant']}: `record` started -> probes"
                       + (" and redirection" if r["variant"] in INJECT_VARIANTS else "") + f" in place: median "
                       f"{r['ready']:.2f} s" + (f" [IQR {q[0]:.2f}-{q[1]:.2f}]" if q else ""))
    return out


def markdown(rows: list[dict], verdict_lines: list[str], meta: dict, svg_ref: str | None, notes: list[str],
             placements: list[float] | None = None) -> str:
    mib = 1 << 20
    out = [f"![overhead]({svg_ref})", ""] if svg_ref else []
    out += [
        "| workload | variant | median loop s | ratio vs unprobed | per-round ratios: median [IQR] | overhead "
        "| our overhead / memleak's | probe hits/s | samples/s | lost events | added ns per hit "
        "| tool CPU s in loop | tool peak RSS MiB |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    notes = list(notes)
    for r in rows:
        if "na" in r and (note := f"{r['na_of']}: {r['na']}") not in notes:    # the whole reason, once
            notes.append(note)
        if "n" not in r:
            out.append(f"| {r['workload']} | {r['variant']} | {_short(r['na'], 70)} |" + " – |" * 10)
            continue
        q = r["iqr"]
        out.append("| " + " | ".join([
            r["workload"], r["variant"] + (f" ({_short(r['na'], 40)})" if "na" in r else ""),
            _fmt(r["median_s"], ".3f"),
            _fmt(r["ratio"], ".3f"),
            f"{statistics.median(r['per_round']):.3f} [{q[0]:.3f}-{q[1]:.3f}]" if q and r["variant"] != "unprobed"
            else "–",
            _pct(r["overhead"]), _fmt(r["vs_memleak"], ".3f"),
            _fmt(r["hits_per_s"], ",.0f"), _fmt(r["samples_per_s"], ",.1f"), _fmt(r["lost"], ",d"),
            _fmt(r["ns_per_hit"] if r["variant"] != "unprobed" else None, ",.0f"),
            _fmt(r["tool_cpu"], ".2f"), _fmt(r["tool_hwm"] and r["tool_hwm"] / mib, ".0f"),
        ]) + " |")
    out += ["", "Targets:", "", *verdict_lines, ""]
    if lines := inject_lines(rows, placements or []):
        out += ["Attaching (the target's stop, and the time until the first allocation can be sampled):", "",
                *lines, ""]
    if notes:
        out += ["Notes:", "", *[f"- {n}" for n in notes], ""]
    out += ["Loop times per round (s; round number in brackets), warm-up round excluded:", ""]
    for r in rows:
        if "n" in r:
            extra = []
            if r.get("tiers"):
                extra.append("tier: " + " | ".join(r["tiers"]))
            if r.get("coverage") is not None:
                extra.append(f"alloc_coverage {r['coverage']:.2f} (mean over the recorder's intervals)")
            if r.get("settle") is not None:
                extra.append(f"tool settled {r['settle']:.1f} s after attaching (median)")
            if r.get("attached_in_loop"):
                a = r["attached_in_loop"]
                extra.append(f"attached before the loop ended in {sum(a)} of {len(a)} rounds (from launch)")
            if r.get("faults_per_s"):
                extra.append(f"{r['faults_per_s']:,.1f} sampled faults/s")
            out.append(f"- {r['workload']} / {r['variant']} ({r['ops']:,} ops): "
                       + ", ".join(f"{t:.3f} [{k}]" for t, k in zip(r["times"], r["rounds"], strict=True))
                       + (f" ({'; '.join(extra)})" if extra else ""))
    out += ["", "Machine and run:", ""]
    for k, v in meta.items():
        out.append(f"- {k}: {v}")
    return "\n".join(out) + "\n"


def write_markdown(path: Path, text: str) -> None:
    """Replace the block between the markers if the file has them, else append a block to the file
    (or create it)."""
    block = f"{BEGIN}\n{text}{END}\n"
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        path.write_text(head + block + ("\n" + tail if tail else ""))
    elif old:
        path.write_text(old.rstrip("\n") + "\n\n" + block)
    else:
        path.write_text("# allocsampler overhead (scripts/bench_overhead.py)\n\n" + block)


# --- SVG ----------------------------------------------------------------------------------------
COLORS = {"memleak": "#7f7f7f", "inject": "#9467bd", "inject-python": "#c5b0d5", "attach": "#d62728",
          "attach-governed": "#ff7f0e",
          "attach-perf": "#8c564b", "preload": "#1f77b4", "preload-idle": "#17becf", "rss": "#2ca02c",
          "inject-user": "#e377c2"}


def svg_chart(rows: list[dict], workloads: list[str], caption: str) -> str:
    """Grouped horizontal bars: overhead in % (ratio of medians - 1) per workload and variant, log
    axis from 0.1% (smaller and negative overheads are drawn as a stub at 0.1% and labelled with
    their value); whiskers: the interquartile range of the per-round ratios."""
    lo = 0.1
    vals = [(r["ratio"] - 1) * 100 for r in rows if r.get("ratio") is not None and r["variant"] != "unprobed"]
    vals += [(r["iqr"][1] - 1) * 100 for r in rows if r.get("iqr") and r["variant"] != "unprobed"]
    hi = 10 ** max(1, math.ceil(math.log10(max([v for v in vals if v > 0], default=10))))
    width, left, plot_w = 960, 150, 600
    bar_h, row_h, head_h, gap, top = 13, 19, 24, 10, 62

    def x(pct: float) -> float:
        pct = min(max(pct, lo), hi)
        return left + (math.log10(pct) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * plot_w

    groups = [(w, [r for r in rows if r["workload"] == w and r["variant"] != "unprobed"]) for w in workloads]
    groups = [(w, rs) for w, rs in groups if rs]
    height = top + sum(head_h + len(rs) * row_h + gap for _, rs in groups) + 46
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="11">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         '<text x="10" y="18" font-size="14" font-weight="bold">Overhead of each allocsampler tier vs '
         'unprobed (ratio of medians - 1)</text>',
         f'<text x="10" y="34" fill="#444">log axis, overheads below {lo:g}% drawn at {lo:g}%; whiskers: '
         'interquartile range of the per-round ratios; dashed: targets</text>']
    y_end = height - 46
    decade = lo
    while decade <= hi * 1.0001:
        xx = x(decade)
        s.append(f'<line x1="{xx:.1f}" y1="{top - 8}" x2="{xx:.1f}" y2="{y_end}" stroke="#ddd"/>')
        s.append(f'<text x="{xx:.1f}" y="{top - 12}" text-anchor="middle" fill="#444">{decade:,g}%</text>')
        s.append(f'<text x="{xx:.1f}" y="{y_end + 14}" text-anchor="middle" fill="#444">{decade:,g}%</text>')
        decade *= 10
    for v, limit in TARGETS.items():
        pct = (limit - 1) * 100
        xx = x(pct)
        s.append(f'<line x1="{xx:.1f}" y1="{top - 4}" x2="{xx:.1f}" y2="{y_end}" stroke="{COLORS[v]}" '
                 'stroke-dasharray="4,3" stroke-width="1"/>')
        anchor, dx = ("end", -3) if limit < max(TARGETS.values()) else ("start", 3)   # labels apart
        s.append(f'<text x="{xx + dx:.1f}" y="{y_end + 28}" text-anchor="{anchor}" fill="{COLORS[v]}" '
                 f'font-size="10">{escape(v)} target {pct:g}%</text>')
    y = top
    for w, rs in groups:
        s.append(f'<text x="10" y="{y + 15}" font-weight="bold">{escape(WORKLOAD_TITLES.get(w, w))}</text>')
        y += head_h
        for r in rs:
            v = r["variant"]
            color = COLORS.get(v, "#333")
            s.append(f'<text x="{left - 8}" y="{y + bar_h - 2}" text-anchor="end">{escape(v)}</text>')
            if r.get("ratio") is None:
                s.append(f'<text x="{left + 4}" y="{y + bar_h - 2}" fill="#888" font-style="italic">'
                         f'{escape(_short(r.get("na", "n/a"), 110))}</text>')
                y += row_h
                continue
            pct = (r["ratio"] - 1) * 100
            xe = x(pct)
            faint = ' fill-opacity="0.35"' if pct <= lo else ""
            s.append(f'<rect x="{left}" y="{y}" width="{max(xe - left, 2):.1f}" height="{bar_h}" fill="{color}"'
                     f'{faint}><title>{escape(w)} / {escape(v)}: {escape(_pct(r["ratio"] - 1))}</title></rect>')
            label_x = xe
            if r.get("iqr") and len(r.get("per_round", [])) > 1:
                q0, q1 = ((q - 1) * 100 for q in r["iqr"])
                a, b, cy = x(q0), x(q1), y + bar_h / 2
                s.append(f'<path d="M{a:.1f},{cy - 4}v8M{a:.1f},{cy}H{b:.1f}M{b:.1f},{cy - 4}v8" stroke="#222" '
                         'fill="none"/>')
                label_x = max(label_x, b)
            text = _pct(r["ratio"] - 1) + (f"  ({r['ratio']:.3g}x)" if r["ratio"] >= 2 else "")
            if "na" in r:
                text += "  " + _short(r["na"], 60)
            s.append(f'<text x="{label_x + 5:.1f}" y="{y + bar_h - 2}">{escape(text)}</text>')
            y += row_h
        y += gap
    s.append(f'<text x="10" y="{height - 6}" fill="#666" font-size="10">{escape(_short(caption, 170))}</text>')
    s.append("</svg>")
    return "\n".join(s) + "\n"


def machine_meta(args, bench: Bench, argv: list[str], started: dt.datetime, load0, sizes: dict) -> dict:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        glibc = libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError):
        glibc = "?"
    bcc = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "python3-bpfcc"], capture_output=True,
                         text=True).stdout or "?"
    meta = {
        "date": f"{started:%Y-%m-%d %H:%M} UTC",
        "kernel": platform.release(),
        "CPUs": f"{os.cpu_count()} x {cpu}",
        "glibc": glibc, "python (workloads)": platform.python_version(), "bcc": bcc,
    }
    if getattr(bench, "torch_version", None):
        meta["torch"] = bench.torch_version + f" (batch {args.torch_batch}, 1 thread)"
    meta.update({
        "loop sizes": ", ".join(f"{w} {n:,}" for w, n in sizes.items()),
        "load average before / after": f"{load0[0]:.2f} / {os.getloadavg()[0]:.2f}",
        "command": " ".join(argv),
        "rounds": f"{args.rounds} (+{args.warmup} warm-up, discarded); variant order rotated by one per round, "
                  f"base order: {', '.join(v for v in args.variants if v not in bench.na)}",
    })
    for v in args.variants:
        if v in bench.commands:
            meta[f"`{v}`"] = bench.commands[v]
    return meta


# --- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Methodology: see the module docstring (scripts/bench_overhead.py).",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, help="measured rounds (default: 5; 1 with --quick)")
    p.add_argument("--placements", type=int, help=f"timed inject placements (default: {PLACEMENTS}; 20 with "
                                                  "--quick; 0: none)")
    p.add_argument("--warmup", type=int, help="discarded warm-up rounds (default: 1; 0 with --quick)")
    p.add_argument("--workloads",
                   help=f"comma-separated, from {','.join(WORKLOADS)} (default: all; --quick: "
                   f"{','.join(QUICK_WORKLOADS)})")
    p.add_argument("--variants",
                   help=f"comma-separated, from {','.join(VARIANTS + EXTRA_VARIANTS)} (default: all but "
                   f"{','.join(EXTRA_VARIANTS)}; --quick: {','.join(QUICK_VARIANTS)}); unprobed is added when "
                   "missing (the ratios need it)")
    p.add_argument("--quick", action="store_true",
                   help="tiny loops, 1 round, no warm-up, one variant of each kind on the c workload: a smoke test")
    p.add_argument("--c-pairs", type=int, help="malloc/free pairs of the C loop (default: 500,000; --quick: 20,000)")
    p.add_argument("--mt-ops", type=int,
                   help="allocations of the mt stress, all 4 threads together (default: 1,000,000; --quick: 40,000)")
    p.add_argument("--py-seconds", type=float, default=3.0,
                   help="calibrate the Python loop to about this many unprobed seconds (default: %(default)s)")
    p.add_argument("--py-iters", type=int, help="Python loop iterations (instead of calibrating)")
    p.add_argument("--torch-seconds", type=float, default=3.0,
                   help="calibrate the torch loop to about this many unprobed seconds (default: %(default)s)")
    p.add_argument("--torch-iters", type=int, help="torch forward passes (instead of calibrating)")
    p.add_argument("--torch-batch", type=int, default=4, help="torch batch size (default: %(default)s)")
    p.add_argument("--torch-python", help="python with torch for the torch workload (default: the repo's .venv one)")
    p.add_argument("--sample-mean", type=int, default=512 << 10,
                   help="mean bytes between samples for the preload shim (ALLOCSAMPLER_SAMPLE_MEAN; default: "
                   "%(default)s, the recorder's default); when given, also passed to every recorder as "
                   "--sample-bytes")
    p.add_argument("--interval", type=float, help="allocsampler -i (default: the tool's default)")
    p.add_argument("--allocsampler", help="allocsampler executable (default: the repo's .venv one)")
    p.add_argument("--memleak", default=shutil.which("memleak-bpfcc") or "/usr/sbin/memleak-bpfcc")
    p.add_argument("--attach-timeout", type=float, default=60.0)
    p.add_argument("--settle-cpu", type=float, default=0.1,
                   help="after attaching, wait until the tool uses less than this fraction of a CPU over 0.25 s "
                   "(default: %(default)s)")
    p.add_argument("--settle-timeout", type=float, default=15.0,
                   help="... but at most this many seconds (default: %(default)s; 0: do not wait)")
    p.add_argument("--stop-timeout", type=float, default=30.0)
    p.add_argument("--from-launch", type=float, default=0.0, metavar="S",
                   help="start the loop S seconds after the tool, without waiting for it to attach or settle "
                   "(default: wait)")
    p.add_argument("--attach-retries", type=int, default=10,
                   help="retries when a tool's uprobe is refused with EINVAL (default: %(default)s)")
    p.add_argument("--retry-wait", type=float, default=3.0)
    p.add_argument("--fail-fast", action="store_true",
                   help="stop at the first failing run (default: drop that variant for that workload, report it)")
    p.add_argument("--markdown", type=Path, nargs="?", const=REPO / "docs" / "performance.md",
                   help=f"also write the results to this file (default when given without a path: "
                   f"docs/performance.md), replacing the block between the markers {BEGIN} and {END}")
    p.add_argument("--svg", type=Path, nargs="?", const=REPO / "docs" / "performance-overhead.svg",
                   help="also write an SVG chart of the overheads here (default when given without a path: "
                   "docs/performance-overhead.svg); the markdown block references it")
    p.add_argument("--json", type=Path, help="also dump every run and the summary as JSON here")
    p.add_argument("--report-from", type=Path, metavar="JSON",
                   help="measure nothing: report (stdout, --markdown, --svg) from a --json dump of an earlier run")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (datasets, logs)")
    a = p.parse_args(argv)
    a.sample_mean_given = any(x == "--sample-mean" or x.startswith("--sample-mean=") for x in (argv or sys.argv[1:]))
    a.variants = a.variants or ",".join(QUICK_VARIANTS if a.quick else VARIANTS)
    a.workloads = a.workloads or ",".join(QUICK_WORKLOADS if a.quick else WORKLOADS)
    a.variants = list(dict.fromkeys(ALIASES.get(v.strip(), v.strip()) for v in a.variants.split(",") if v.strip()))
    a.workloads = list(dict.fromkeys(w.strip() for w in a.workloads.split(",") if w.strip()))
    if bad := [v for v in a.variants if v not in VARIANTS + EXTRA_VARIANTS]:
        p.error(f"unknown variants {bad}; choose from {VARIANTS + EXTRA_VARIANTS}")
    if bad := [w for w in a.workloads if w not in WORKLOADS]:
        p.error(f"unknown workloads {bad}; choose from {WORKLOADS}")
    if "unprobed" not in a.variants:
        a.variants.insert(0, "unprobed")
    if a.quick:
        a.rounds = a.rounds or 1
        a.c_pairs = a.c_pairs or 20_000
        a.mt_ops = a.mt_ops or 40_000
        a.py_iters = a.py_iters or 300
        a.torch_iters = a.torch_iters or 60
        a.warmup = 0 if a.warmup is None else a.warmup
        a.placements = 20 if a.placements is None else a.placements
    a.rounds = 5 if a.rounds is None else a.rounds
    a.placements = PLACEMENTS if a.placements is None else a.placements
    a.c_pairs = a.c_pairs or 500_000
    a.mt_ops = a.mt_ops or 1_000_000
    a.warmup = 1 if a.warmup is None else a.warmup
    if a.rounds < 1 or a.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    exe = a.allocsampler or REPO / ".venv" / "bin" / "allocsampler"
    a.allocsampler_cmd = [str(exe)] if Path(exe).exists() else [sys.executable, "-m", "sampler.cli"]
    venv_py = REPO / ".venv" / "bin" / "python"
    a.torch_python = a.torch_python or (str(venv_py) if venv_py.exists() else sys.executable)
    return a


def measure(args: argparse.Namespace, argv: list[str]) -> tuple[dict, int]:
    """Run the benchmark; returns its record (what --json dumps, what --report-from reads) and the
    exit status (0; 1 if a run failed; 130 if interrupted: the record then has the runs so far)."""
    started = dt.datetime.now(dt.timezone.utc)
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench_overhead."))
    runs: list[Run] = []
    failed: dict[tuple[str, str], str] = {}
    sizes: dict[str, int] = {}
    placements: list[float] = []
    bench = Bench(args, tmp)
    status = 0
    try:
        bench.build()
        bench.prepare_variants()
        workloads = [w for w in args.workloads if w not in bench.na]
        for w in args.workloads:
            if w in bench.na:
                print(f"# {w}: n/a: {bench.na[w]}", file=sys.stderr)
        fixed = {"c": args.c_pairs, "mt": args.mt_ops, "python": args.py_iters, "torch": args.torch_iters}
        for w in workloads:
            if fixed[w]:
                sizes[w] = fixed[w]
            elif w == "python":
                sizes[w] = bench.calibrate("python", args.py_seconds, 2000)
            else:
                sizes[w] = bench.calibrate("torch", args.torch_seconds, 50)
            print(f"# {w}: {sizes[w]:,} ops per run", file=sys.stderr)
        runnable = [v for v in args.variants if v not in bench.na]
        for rnd in range(args.warmup + args.rounds):
            measured = rnd >= args.warmup
            k = rnd % len(runnable)
            order = runnable[k:] + runnable[:k]
            tag = f"round {rnd - args.warmup + 1}" if measured else "warm-up"
            for w in workloads:
                for v in order:
                    if (w, v) in failed or (w, "unprobed") in failed:
                        continue
                    t0 = time.monotonic()
                    try:
                        r = bench.run_once(w, v, sizes[w], rnd - args.warmup + 1 if measured else 0)
                    except BenchError as e:
                        if args.fail_fast:
                            raise
                        failed[(w, v)] = _short(str(e).strip().splitlines()[0], 300)   # the rest: stderr
                        print(f"{tag:>9} {w:>6} {v:<16} FAILED: {e}", file=sys.stderr)
                        continue
                    more = f" hits={r.probe_hits:,} samples={r.samples:,}" if r.probe_hits is not None else ""
                    settle = f", settled {r.settle_s:.1f} s" if r.settle_s is not None else ""
                    print(f"{tag:>9} {w:>6} {v:<16} {r.loop_s:8.3f} s{more}  (run took "
                          f"{time.monotonic() - t0:.0f} s{settle})", file=sys.stderr)
                    if measured:
                        runs.append(r)
        if "inject" in runnable and args.placements and "mt" not in bench.na:
            placements = bench.time_placements(args.placements, sizes.get("mt") or args.mt_ops)
        status = 1 if failed else 0
    except KeyboardInterrupt:
        print("interrupted: reporting the runs so far (no --markdown/--svg written)", file=sys.stderr)
        status = 130
    except (BenchError, subprocess.CalledProcessError) as e:
        print(f"bench_overhead: error: {e}", file=sys.stderr)
        status = 2
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    for (w, v), why in failed.items():
        if v == "unprobed":
            bench.na.setdefault(w, f"unprobed failed: {why}")
    record = {
        "meta": machine_meta(args, bench, argv, started, load0, sizes), "notes": bench.notes, "na": bench.na,
        "failed": [[w, v, why] for (w, v), why in failed.items()], "workloads": args.workloads,
        "variants": args.variants, "rounds": args.rounds, "quick": args.quick, "runs": [asdict(r) for r in runs],
        "placements_us": placements,
    }
    return record, status


def report(record: dict, args: argparse.Namespace, write_files: bool) -> None:
    runs = [Run(**r) for r in record["runs"]]
    failed = {(w, v): why for w, v, why in record["failed"]}
    workloads, variants, meta = record["workloads"], record["variants"], record["meta"]
    rows = summarize(runs, workloads, variants, record["na"], failed)
    verdict_lines = verdicts(rows, workloads, variants)
    svg_ref = None
    if args.svg and write_files:
        base = args.markdown.resolve().parent if args.markdown else Path.cwd()
        svg_ref = os.path.relpath(args.svg.resolve(), base)
    text = markdown(rows, verdict_lines, meta, svg_ref, record["notes"], record.get("placements_us"))
    if record.get("quick"):         # also in --markdown files and --report-from re-renders
        text = f"{QUICK_NOTE}\n\n{text}"
    if args.json and not args.report_from:
        args.json.write_text(json.dumps({**record, "summary": rows, "verdicts": verdict_lines}, indent=1,
                                        default=str) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if not write_files:
        print(text)
        return
    if args.svg:
        caption = f"{meta['date']}, {meta['CPUs']}, kernel {meta['kernel']}, {record['rounds']} rounds; " \
                  "scripts/bench_overhead.py"
        args.svg.write_text(svg_chart(rows, workloads, caption))
        print(f"wrote {args.svg}", file=sys.stderr)
    if args.markdown:
        write_markdown(args.markdown, text)
        print(f"wrote {args.markdown} (between {BEGIN} and {END})", file=sys.stderr)
    print(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_from:
        record = json.loads(args.report_from.read_text())
        status = 0
    else:
        if os.geteuid() != 0:
            print("bench_overhead: run as root (BPF)", file=sys.stderr)
            return 2
        # Tools stop on SIGINT; a shell's background job starts with it ignored, and children
        # inherit that (memleak then outlives its stop and is killed): restore the default.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        record, status = measure(args, sys.argv if argv is None else ["bench_overhead.py", *argv])
        if status == 2:
            return 2
    report(record, args, write_files=status != 130)
    return status


if __name__ == "__main__":
    sys.exit(main())
