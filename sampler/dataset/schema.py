"""The Parquet schema: the contract between the recorder and everything that reads its data.

One definition per table: column name, Arrow type, and the sentence that docs/schema.md shows
(scripts/gen_schema_doc.py writes that file from here; a test keeps them in step).
Bump SCHEMA_VERSION when a column changes meaning or type; adding columns is compatible.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

# The values of the `source` columns: defined in sampler/dataset/sources.py (no pyarrow: the CLI needs them at start-up)
from sampler.dataset.sources import (  # noqa: F401  (re-exported)
    CUDA,
    CUDA_DRIVER,
    CUDA_DRIVER_HOST,
    CUDA_HOST,
    DEVICE_SOURCES,
    FAULT,
    GPU_SOURCES,
    HOST_SOURCES,
    MALLOC,
    MMAP,
    TORCH,
)

SCHEMA_VERSION = 6
# History: 2 - stacks come from DWARF unwinding merged with Python frames: `frames.kind` has
#   `python` rows (file, line; offset null), `stacks.truncated` means "the walk did not reach the
#   thread's entry", new columns stacks.unwind_stop/python_frames and recorder stack counters.
# 3 - tiers: `outstanding.source` `fault` (always-on tier: sampled page faults); malloc weights
#   of a duty-cycled target include 1/duty; new columns processes.tier/alloc_coverage/
#   probe_hits_per_s/probe_cpu_estimate, recorder.sampled_faults, recordings.cpu_budget/
#   probe_cost_ns/fault_period; targets events `tier` and `governor`.
# 4 - the daemon: new table `findings` (periodic analysis); targets events `pre_oom` and
#   `select` (which daemon target rule chose the process, and its tier).
#   GPU memory: `outstanding.source` `cuda`, `cuda-host`, `cuda-driver`, `cuda-driver-host`
#   (every CUDA call, exact) and `torch` (sampled tensors); tables `gpu_events` and `gpu`;
#   processes.gpu_*; recordings.gpu_status; recorder.cuda_calls.
#   Later, compatible: per-process sampling means (processes.sample_mean_bytes; targets event
#   `sampling`) and the syscall event budget (processes/recorder.vm_events_suppressed); the
#   inject tier (processes.tier `inject`, targets event `inject`) with `outstanding.source`
#   `python` (CPython's small objects) and processes.python_outstanding_bytes/_stderr_bytes.
# 5 - unknown is not zero: processes' malloc-derived columns (heap/arena live, malloc and python
#   outstanding) are null while the process's tier does not measure allocations (`rss`,
#   `syscalls`), not 0 or their last value; outstanding.exiting marks what a process still held
#   after its own teardown (rows written at its exit), which readers keep apart from its running state;
#   frames.function of an address no symbol covers may be `export+0xOFF` (the nearest exported
#   function of a stripped library), where it was null.
# 6 - fleet layout: files are under <table>/host=<host>/date=<day>/ (was <table>/date=<day>/, which
#   readers still accept); `host` is a partition column like `date`, no longer in the files (Hive
#   convention: Spark refuses a file column that repeats a partition column, and pyarrow a type
#   that differs), with the host name as its key has it (characters other than [A-Za-z0-9._-]
#   replaced by `_`); recording ids end in a random suffix (unique across hosts that share a
#   name); targets.exe_build_id, exe_package, exe_version on `attach` and `exec` rows.
#   Native stacks walked in BPF: recorder.stacks_in_bpf/stacks_handed_over/unwind_worker_cpu_s/
#   unwind_rows, processes.recorder_cpu_s, stacks.unwind_stop `unreadable`; stack ids no longer
#   hash a native frame's inlined calls again (ids of stacks through inlined code differ from
#   version 5's; diff matches stacks by names, not ids).
#   Later, compatible: recorder.children_forked/_recorded/_skipped (families registered at fork),
#   recorder.name_worker_cpu_s, processes.malloc_in_use_bytes (the allocator's own count, the
#   recording's self-check). frames.function is null again where no symbol covers the address
#   (the `export+0xOFF` of version 5 was read as the function that ran); analysis reads an older
#   recording's `+0xOFF` names as null (analysis/dataset.py::read_frames).

TS = pa.timestamp("us", tz="UTC")
STR = pa.dictionary(pa.int32(), pa.string())     # low-cardinality strings: cheap, pandas categorical


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    doc: str


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]

    @property
    def schema(self) -> pa.Schema:
        """The files' schema."""
        return pa.schema([pa.field(c.name, c.type) for c in self.columns],
                         metadata={b"allocsampler.schema_version": str(SCHEMA_VERSION).encode(),
                                   b"allocsampler.table": self.name.encode()})

    @property
    def read_schema(self) -> pa.Schema:
        """What a reader of the table sees: the files' columns and `host` (a partition column
        since schema 6, a file column before)."""
        return self.schema.append(pa.field(HOST.name, HOST.type))


def int64(v: int | None) -> int | None:
    """An unsigned 64-bit value (an address, a length, a handle) as an int64 column holds it: the
    same bits, two's complement."""
    if v is None:
        return None
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def int32(v: int | None) -> int | None:
    """The low 32 bits of a value (prot, flags, advice) as an int32 column holds them."""
    if v is None:
        return None
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _common(ts_doc: str) -> tuple[Column, ...]:
    return (
        Column("ts", TS, ts_doc),
        Column("recording_id", STR, "Recording that wrote the row (see `recordings`)."),
    )


# Partition columns: in the paths (<table>/host=<host>/date=<day>/), not in the files.
HOST = Column("host", STR, "Host name as its partition directory has it (sampler.dataset.layout.host_key: "
                           "characters other than `[A-Za-z0-9._-]` replaced by `_`). A file column in "
                           "schema <= 5, whose datasets have no host= directories.")
DATE = Column("date", STR, "UTC day of the rows (`YYYY-MM-DD`; `recordings`: the day the recording started).")
PARTITION_COLUMNS = (HOST, DATE)


OUTSTANDING = Table(
    "outstanding",
    "One row per interval, process, source and stack that has sampled live memory or activity in "
    "the interval. Estimates are Horvitz-Thompson sums of sample weights; `*_stderr_*` is one "
    "standard error of the estimate above it.",
    (
        *_common("End of the interval (snapshot time)."),
        Column("interval_s", pa.float64(), "Length of the interval in seconds."),
        Column("pid", pa.int32(), "Process id (host pid namespace)."),
        Column("comm", STR, "Process name at snapshot time."),
        Column("source", STR, "`malloc` (malloc family and C++ operators of the probed allocator, or "
                              "the in-process sampler's `otel_memory` USDT samples in the inject and "
                              "preload tiers), `python` (inject tier with --python-objects: CPython "
                              "objects of up to 512 bytes, sampled in its object allocator since they "
                              "never reach malloc; pymalloc's "
                              "arenas are then not counted again as `mmap`), "
                              "`mmap` (anonymous private mmap/mremap) or `fault` (always-on tier: "
                              "memory brought in by sampled page faults and not yet unmapped or "
                              "madvised away; each sample stands for `fault_period` pages). GPU: "
                              "`cuda` (CUDA runtime device and managed memory), `cuda-driver` (driver "
                              "device memory, including VMM physical memory of cuMemCreate), `cuda-host` "
                              "and `cuda-driver-host` (pinned host memory), all exact (every call traced, "
                              "stderr 0), and `torch` (sampled tensors of PyTorch's caching allocator). "
                              "Sources overlap (a large malloc is also an mmap, and faults in; a "
                              "cudaMalloc is also a cuMemAlloc): never add them."),
        Column("stack_id", pa.int64(), "Stack of the allocation site: join with `stacks` / `frames`."),
        Column("outstanding_bytes", pa.float64(), "Estimated bytes allocated and not yet freed."),
        Column("outstanding_stderr_bytes", pa.float64(), "Standard error of `outstanding_bytes`."),
        Column("outstanding_objects", pa.float64(), "Estimated live allocations."),
        Column("outstanding_stderr_objects", pa.float64(), "Standard error of `outstanding_objects`."),
        Column("live_samples", pa.int32(), "Sampled allocations still live (the evidence behind the estimate)."),
        Column("allocated_bytes", pa.float64(), "Estimated bytes allocated during the interval."),
        Column("allocated_stderr_bytes", pa.float64(), "Standard error of `allocated_bytes`."),
        Column("allocated_objects", pa.float64(), "Estimated allocations during the interval."),
        Column("freed_bytes", pa.float64(), "Estimated bytes freed during the interval "
                                             "(of allocations sampled at any time)."),
        Column("freed_objects", pa.float64(), "Estimated frees during the interval."),
        Column("alloc_samples", pa.int32(), "Sampled allocations during the interval."),
        Column("free_samples", pa.int32(), "Frees of sampled allocations during the interval."),
        Column("oldest_age_s", pa.float64(), "Age of the oldest sampled live allocation, seconds (null if none)."),
        Column("exiting", pa.bool_(), "Written when the process exited: what it still held after its own "
                                      "teardown (interpreter finalization, atexit, exit_mmap), not its running "
                                      "state. `top`, `analyze`, `report` and `diff` use the last snapshot before "
                                      "the exit (docs/findings.md); null in older data means false."),
        Column("pinned_bytes", pa.float64(), "Estimated free bytes of pinned glibc heap pages charged to this "
                                             "stack's live chunks: pages that are resident and hold free bytes "
                                             "beside bytes in use, so that `malloc_trim` cannot return them; each "
                                             "page's free bytes shared among the bytes in use on it (docs/"
                                             "findings.md). Null at the snapshots that read no heap layout (walks are "
                                             "spaced by their cost), or outside malloc and python."),
        Column("pinned_stderr_bytes", pa.float64(), "Standard error of `pinned_bytes`."),
    ),
)

STACKS = Table(
    "stacks",
    "One row per distinct stack, written once when the stack is first seen. `stack_id` is a hash "
    "of the frames' (build-id or path, offset) (Python frames: file, function, line; a native "
    "frame's inlined calls are not hashed again), so it is the same across processes and runs of "
    "the same binaries.",
    (
        *_common("When the stack was first seen."),
        Column("stack_id", pa.int64(), "Stack identifier."),
        Column("n_frames", pa.int32(), "Number of frames (see `frames`)."),
        Column("truncated", pa.bool_(), "The native walk did not reach the thread's entry (`_start`, "
                                         "`clone`): outer frames may be missing (see `unwind_stop`)."),
        Column("site", pa.string(), "Innermost symbolized frame: the allocation site, as `function (module)`."),
        Column("summary", pa.string(), "The frames innermost first, `function (module)` (Python: "
                                       "`function (file:line)`) joined by ` < `."),
        Column("unwind_stop", STR, "Why the native walk ended: `entry` (thread entry reached), `stack_end` "
                                   "(beyond the copied stack: raise `--stack-bytes`), `no_cfi` (code without "
                                   "unwind info or frame pointer), `bad_frame`, `unreadable` (stack memory "
                                   "BPF could not read), `max_frames`, `no_stack`."),
        Column("python_frames", pa.int16(), "Number of Python frames in the stack."),
    ),
)

FRAMES = Table(
    "frames",
    "The frames of each stack, one row per frame; depth 0 is the innermost (the caller of the "
    "allocation function). Python frames replace the interpreter's eval frames that ran them; other "
    "interpreter frames between them are hidden unless recorded with `--interpreter-frames`.",
    (
        *_common("When the stack was first seen."),
        Column("stack_id", pa.int64(), "Stack identifier."),
        Column("depth", pa.int16(), "0 = innermost."),
        Column("function", pa.string(), "Function name (demangled), null when unknown. From the "
                                        "symbol covering the address (the binary's, or its separate "
                                        "debug file's: by build-id, `.gnu_debuglink` or debuginfod "
                                        "with `DEBUGINFOD_URLS`), else DWARF's; null where none covers "
                                        "it (a static function of a stripped file: `module` and "
                                        "`offset` say where it is). Recordings of schema 5 and 6 "
                                        "wrote `export+0xOFF` there, a guess; readers take it as null."),
        Column("module", STR, "Binary file name, `[unknown]` when the address is in no mapping."),
        Column("path", STR, "Binary path as the process sees it."),
        Column("offset", pa.int64(), "Address in the module's ELF address space (call site for "
                                     "return addresses), or the absolute address when unknown; null "
                                     "for Python frames."),
        Column("build_id", STR, "GNU build-id of the module, hex."),
        Column("file", pa.string(), "Source file, when known."),
        Column("line", pa.int32(), "Source line, when known."),
        Column("kind", STR, "`native` or `python` (for Python frames `module` is the file's base "
                            "name and `path` the file)."),
        Column("inlined", pa.bool_(), "A call inlined by the compiler into the next (outer) frame, known "
                                      "from DWARF (same module and offset as that frame)."),
    ),
)

PROCESSES = Table(
    "processes",
    "One row per interval and target process: its memory footprint from /proc and what the "
    "sampled allocations explain of it. Byte counts. rss, vms and threads are read at every row; "
    "pss, uss, swap and the smaps breakdown (heap_*, arena_*, anon_rss, file_rss, stack_rss) again "
    "when rss moved by more than max(1 MiB, 1%) since they were last read, and at least every 30 s "
    "(reading smaps walks every page table of the process).",
    (
        *_common("Time of the measurement."),
        Column("pid", pa.int32(), "Process id."),
        Column("comm", STR, "Process name."),
        Column("rss", pa.int64(), "Resident set size."),
        Column("pss", pa.int64(), "Proportional set size."),
        Column("uss", pa.int64(), "Unique set size."),
        Column("swap", pa.int64(), "Swapped-out anonymous memory."),
        Column("vms", pa.int64(), "Virtual size."),
        Column("threads", pa.int32(), "Thread count."),
        Column("memory_limit", pa.int64(), "Memory limit that applies: the smallest of the cgroup "
                                           "limits and host RAM."),
        Column("heap_rss", pa.int64(), "Resident bytes of the brk heap (`[heap]`, glibc main arena)."),
        Column("heap_size", pa.int64(), "Size of the brk heap."),
        Column("heap_swap", pa.int64(), "Swapped bytes of the brk heap."),
        Column("arena_rss", pa.int64(), "Resident bytes of glibc secondary-arena heaps (64 MiB-aligned)."),
        Column("arena_size", pa.int64(), "Committed (read/write) bytes of those heaps."),
        Column("arena_swap", pa.int64(), "Swapped bytes of those heaps."),
        Column("arena_heaps", pa.int32(), "Number of secondary-arena heaps."),
        Column("arenas", pa.int32(), "Number of secondary arenas (main arena not counted)."),
        Column("anon_rss", pa.int64(), "Resident bytes of other anonymous memory (mmap, obmalloc, ...)."),
        Column("file_rss", pa.int64(), "Resident bytes of file-backed mappings."),
        Column("stack_rss", pa.int64(), "Resident bytes of thread stacks."),
        Column("heap_live_bytes", pa.float64(), "Estimated live malloc chunk bytes located in `[heap]` "
                                                "(sampled blocks, glibc chunk sizes). Null while the "
                                                "process's tier does not measure allocations (`rss`, "
                                                "`syscalls`)."),
        Column("arena_live_bytes", pa.float64(), "Estimated live malloc chunk bytes located in arena heaps. "
                                                 "Null while the process's tier does not measure allocations."),
        Column("heap_arena_live_stderr_bytes", pa.float64(), "Standard error of heap + arena live bytes."),
        Column("malloc_in_use_bytes", pa.float64(), "What glibc malloc itself counts in use in `[heap]` and its "
                                                    "arenas (their bytes less the free chunks its bins, fast bins "
                                                    "and top hold), read from its free lists at this snapshot: "
                                                    "null where they were not walked (paced by their cost) or "
                                                    "another allocator serves malloc. Its growth against that of "
                                                    "heap_live_bytes + arena_live_bytes (what was sampled) says "
                                                    "whether the recording sees the allocations "
                                                    "(`recording_incomplete`)."),
        Column("malloc_outstanding_bytes", pa.float64(), "Estimated outstanding bytes, source malloc. Null "
                                                         "while the process's tier does not measure allocations."),
        Column("malloc_outstanding_stderr_bytes", pa.float64(), "Its standard error."),
        Column("mmap_outstanding_bytes", pa.float64(), "Estimated outstanding bytes, source mmap."),
        Column("mmap_outstanding_stderr_bytes", pa.float64(), "Its standard error."),
        Column("python_outstanding_bytes", pa.float64(), "Estimated outstanding bytes, source python (inject "
                                                         "tier with --python-objects; 0 in other allocation tiers, "
                                                         "null in `rss` and `syscalls`)."),
        Column("python_outstanding_stderr_bytes", pa.float64(), "Its standard error."),
        Column("lost_events", pa.int64(), "Events lost so far because the ring buffer was full (cumulative)."),
        Column("dropped_samples", pa.int64(), "Sampled allocations not tracked because the live table "
                                              "was full (cumulative): estimates are low by about this "
                                              "many samples."),
        Column("stack_collisions", pa.int64(), "Distinct stacks that hashed to one id (cumulative; expected 0)."),
        Column("vm_events_suppressed", pa.int64(), "Unsampled syscall events (mmap, munmap, brk, madvise, "
                                                   "mprotect) not sent because the process was over its "
                                                   "budget per second (cumulative; the forks of a recorded "
                                                   "family spend its root's budget, counted on the root). "
                                                   "Unmaps of sampled "
                                                   "mappings are always sent; other unseen unmaps are "
                                                   "reconciled with /proc/PID/maps at the snapshot."),
        Column("sample_mean_bytes", pa.int64(), "The process's sampling mean now: the recording's mean "
                                                "times a power of two, raised when its samples come faster "
                                                "than the cap and lowered by a pre-OOM capture. Weights "
                                                "carry the mean they were drawn with, so estimates stay "
                                                "unbiased across changes."),
        Column("tier", STR, "How the process is recorded now: `inject` (a sampler placed into the "
                            "running process: its allocator calls sampled there), `attach` (uprobes "
                            "on its allocator), `preload` (its own otel_memory USDT samples), `rss` "
                            "(always-on: sampled page faults) or `syscalls` (mmap/brk only)."),
        Column("alloc_coverage", pa.float64(), "Attach tier: fraction of the interval with allocation "
                                               "probes attached (below 1 when the governor duty-cycles "
                                               "them; malloc weights are divided by the duty, so "
                                               "estimates stay unbiased). Null for other tiers."),
        Column("probe_hits_per_s", pa.float64(), "Allocator probe hits per second in the interval "
                                                 "(attach tier; the cost the target pays)."),
        Column("probe_cpu_estimate", pa.float64(), "Estimated CPU the probes cost the process, as a "
                                                   "fraction of one CPU (hits x the calibrated cost per hit, which "
                                                   "grows with the other targets probed on the same "
                                                   "library: each hit runs their links too)."),
        Column("recorder_cpu_s", pa.float64(), "The recorder's own time spent on this process in the interval, "
                                               "seconds: decoding, unwinding and accounting its events, and "
                                               "measuring it at the snapshot (timed per event). Work that all "
                                               "processes share (reading the ring buffer, writing files, building "
                                               "unwind tables in the table worker) is only in `recorder.cpu_s`."),
        Column("gpu_used_bytes", pa.int64(), "GPU memory the driver (NVML) says the process uses, summed over "
                                             "devices; null without NVML or for a process without CUDA."),
        Column("gpu_reserved_bytes", pa.float64(), "Outstanding device memory from the traced CUDA calls: the "
                                                   "larger of sources `cuda` and `cuda-driver` (with PyTorch, its "
                                                   "caching allocator's reserved memory); null without CUDA."),
        Column("gpu_pinned_bytes", pa.float64(), "Outstanding pinned host memory (the larger of `cuda-host` and "
                                                 "`cuda-driver-host`); null without CUDA."),
        Column("gpu_allocated_bytes", pa.float64(), "Estimated bytes of live tensors of PyTorch's caching "
                                                    "allocator (source `torch`); null without its USDT probes."),
        Column("gpu_allocated_stderr_bytes", pa.float64(), "Standard error of `gpu_allocated_bytes`."),
    ),
)

VM_EVENTS = Table(
    "vm_events",
    "Memory-mapping syscalls of the targets, one row per call (glibc heap and arena growth, "
    "trims, mmap allocations). Capped per interval; `processes` has no cap.",
    (
        *_common("Time of the syscall's return (munmap: of its entry)."),
        Column("pid", pa.int32(), "Process id."),
        Column("tid", pa.int32(), "Thread id."),
        Column("op", STR, "`mmap`, `munmap`, `mremap`, `brk`, `madvise` or `mprotect`."),
        Column("event", STR, "What the call does to the allocator's memory: `heap_reserve` (glibc "
                             "arena heap reservation, PROT_NONE), `heap_reserve_trim` (its unaligned "
                             "head/tail), `heap_grow` (mprotect RW in an arena heap), `heap_trim` "
                             "(madvise in an arena heap), `heap_shrink`, `heap_release`, `brk_grow`, "
                             "`brk_shrink`, `brk_trim` (madvise in [heap]), `brk_query`, `anon_map`, "
                             "`anon_reserve`, `file_map`, `shared_map`, `unmap`, `remap`, `protect`, "
                             "`release` (other madvise DONTNEED/FREE), `advise`, `failed`."),
        Column("addr", pa.int64(), "Address argument (brk: requested break)."),
        Column("length", pa.int64(), "Length argument (mremap: old length)."),
        Column("prot", pa.int32(), "mmap/mprotect protection bits, else null."),
        Column("flags", pa.int32(), "mmap flags, else null."),
        Column("advice", pa.int32(), "madvise advice (4 = MADV_DONTNEED, 8 = MADV_FREE), else null."),
        Column("new_length", pa.int64(), "mremap new length, else null."),
        Column("result", pa.int64(), "Return value (address, 0, or -errno; brk: the new break; munmap: "
                                     "0, it is reported at entry so that it orders before a reuse)."),
        Column("sampled_weight", pa.float64(), "Weight in bytes when this mmap/mremap was a sampled "
                                               "allocation of source `mmap`, else null."),
        Column("stack_id", pa.int64(), "Stack of a sampled call, else null."),
    ),
)

TARGETS = Table(
    "targets",
    "Lifecycle of the recorded processes: attach, exec, exit, and what could not be probed.",
    (
        *_common("When it happened."),
        Column("pid", pa.int32(), "Process id."),
        Column("event", STR, "`attach`, `exec`, `exit`, `detach`, `warning`, `failed` (recording the "
                             "process failed on something it supplied: detail says what; it is no "
                             "longer recorded), `tier` (the process "
                             "changed tier; detail says why), `governor` (duty-cycle changes), "
                             "`sampling` (its sampling mean changed: detail gives the mean and why), "
                             "`inject` (the injected sampler redirected objects loaded later, or CPython's "
                             "allocator, or says why not), "
                             "`select` (daemon: the target rule that selected the process and its "
                             "tier) or `pre_oom` (daemon: the process neared its cgroup memory limit; "
                             "detail raised for a window, snapshot taken)."),
        Column("comm", STR, "Process name."),
        Column("exe", pa.string(), "Executable path."),
        Column("exe_build_id", pa.string(), "`attach`, `exec`: GNU build-id (hex) of the executable the process "
                                            "runs, null when it has none or could not be read."),
        Column("exe_package", STR, "`attach`, `exec`: the distribution package that installed the executable "
                                   "(Debian: dpkg's database), null when none did (a virtualenv's copy, a "
                                   "build of your own, a container's file) or the distribution is not known."),
        Column("exe_version", STR, "`attach`, `exec`: that package's installed version, null without a package."),
        Column("cmdline", pa.string(), "Command line, space-joined."),
        Column("ppid", pa.int32(), "Parent pid."),
        Column("allocators", pa.list_(pa.string()), "Probed allocator libraries as `family:path`."),
        Column("probes", pa.list_(pa.string()),
               "Probe sites as `function+offset (emulated|stepped, session|perf|not attached)`."),
        Column("detail", pa.string(), "Human-readable detail (warnings, skipped functions, exit status)."),
    ),
)

RECORDER = Table(
    "recorder",
    "Health of the recorder, one row per interval.",
    (
        *_common("End of the interval."),
        Column("interval_s", pa.float64(), "Length of the interval in seconds."),
        Column("targets", pa.int32(), "Processes being recorded."),
        Column("events", pa.int64(), "Ring-buffer records read in the interval."),
        Column("probe_hits", pa.int64(), "Allocator probe hits in the interval (all targets)."),
        Column("vm_hits", pa.int64(), "Memory-mapping syscalls of targets in the interval."),
        Column("samples", pa.int64(), "Sampling decisions that chose an allocation."),
        Column("lost_events", pa.int64(), "Records lost (ring buffer full) in the interval."),
        Column("dropped_samples", pa.int64(), "Samples not tracked (live table full) in the interval."),
        Column("live_entries", pa.int64(), "Sampled live blocks tracked at the end of the interval."),
        Column("cpu_s", pa.float64(), "Recorder CPU time (user + system) in the interval."),
        Column("rss", pa.int64(), "Recorder resident memory."),
        Column("pending_full", pa.int64(), "Tracked calls dropped because the per-thread pending table was "
                                           "full (their samples are lost)."),
        Column("stack_errors", pa.int64(), "Samples whose user stack could not be captured."),
        Column("python_thread_misses", pa.int64(), "Samples of a Python thread not yet known to BPF (they "
                                                   "have native frames only; the thread list is re-read)."),
        Column("stacks_unwound", pa.int64(), "Sampled stacks unwound in the interval."),
        Column("stacks_complete", pa.int64(), "Of those, the ones whose walk reached the thread's entry."),
        Column("stacks_in_bpf", pa.int64(), "Sampled stacks whose native walk ended in BPF (compact unwind "
                                            "rows: the record carries pcs, not a stack copy)."),
        Column("stacks_handed_over", pa.int64(), "Sampled stacks that BPF handed over to user space with a copy "
                                                 "of the stack from the frame where it stopped (a file whose rows "
                                                 "were being built, code in no known mapping, a signal frame)."),
        Column("unwind_worker_cpu_s", pa.float64(), "CPU time of the table worker in the interval (building "
                                                    "files' unwind rows, once per file and host; not in `cpu_s`)."),
        Column("name_worker_cpu_s", pa.float64(), "CPU time of the name worker in the interval (reading symbol "
                                                  "tables and DWARF to name new stacks' frames; not in `cpu_s`)."),
        Column("unwind_rows", pa.int64(), "Unwind rows loaded into BPF at the end of the interval (8 bytes each)."),
        Column("vm_events_dropped", pa.int64(), "`vm_events` rows not written in the interval because "
                                                "of the per-interval cap (the syscalls were still applied)."),
        Column("vm_events_suppressed", pa.int64(), "Unsampled syscall events that BPF did not send in the "
                                                   "interval (processes over their budget per second)."),
        Column("sampled_faults", pa.int64(), "Page-fault samples of targets in the interval (always-on tier)."),
        Column("cuda_calls", pa.int64(), "CUDA runtime and driver calls traced in the interval."),
        Column("children_forked", pa.int64(), "Processes forked by targets whose family is recorded "
                                              "(--children; a daemon rule's children = true) in the "
                                              "interval: each is registered in BPF at its fork."),
        Column("children_recorded", pa.int64(), "Of them, recorded (also those that exited before the "
                                                "recorder looked at them: their samples are kept)."),
        Column("children_skipped", pa.int64(), "Of them, not recorded: exited before they could get probes "
                                               "of their own (a parent without the injected sampler), or past "
                                               "the caps of forks registered at once (1,024 per family, "
                                               "3,072 in all: bpf/abi.h FAMILY_MAX, FAMILIES_MAX)."),
    ),
)

RECORDINGS = Table(
    "recordings",
    "One row per recording (rewritten when it ends).",
    (
        Column("recording_id", STR, "Unique id: start time, pid of the recorder and a random suffix."),
        Column("started", TS, "Start of the recording."),
        Column("ended", TS, "End of the recording, null while it runs or if it was killed."),
        Column("schema_version", pa.int32(), "Version of this schema."),
        Column("sampler_version", pa.string(), "allocsampler version."),
        Column("sample_mean_bytes", pa.int64(), "Mean bytes between samples (T); a process's own mean "
                                                "may be a power-of-two multiple of it "
                                                "(processes.sample_mean_bytes)."),
        Column("interval_s", pa.float64(), "Snapshot interval (adaptive, the default: the longest, reached "
                                           "after 80 s; the first are 1 s, so that short recordings have "
                                           "enough snapshots)."),
        Column("probe_mode", STR, "`session` (uprobe_multi sessions: return probe only for sampled "
                                  "calls) or `perf` (classic uprobes/uretprobes)."),
        Column("kernel", pa.string(), "Kernel release."),
        Column("argv", pa.string(), "Command line of the recorder."),
        Column("cpu_budget", pa.float64(), "Governor budget: fraction of one CPU per process the attach "
                                           "tier's probes may cost (0: governor off)."),
        Column("probe_cost_ns", pa.float64(), "Cost of one probe hit, calibrated at start-up (null "
                                              "without the governor)."),
        Column("fault_period", pa.int32(), "Always-on tier: one page fault sampled in this many (null "
                                           "when no process was in that tier)."),
        Column("gpu_status", pa.string(), "GPU metrics: `nvml: N devices, driver V`, or one line saying why "
                                          "NVML is not sampled (e.g. no NVIDIA driver); CUDA calls are traced "
                                          "either way."),
    ),
)

GPU_EVENTS = Table(
    "gpu_events",
    "Every CUDA runtime and driver memory call of the targets, one row per call (capped per interval), "
    "with its result: allocations and frees, pinned host memory, the VMM API (cuMemCreate/Release, "
    "cuMemMap/Unmap, cuMemAddressReserve/Free). Failed calls are rows that count nothing.",
    (
        *_common("Time of the call's return."),
        Column("pid", pa.int32(), "Process id."),
        Column("tid", pa.int32(), "Thread id."),
        Column("source", STR, "Outstanding source the call belongs to: `cuda`, `cuda-host`, `cuda-driver`, "
                              "`cuda-driver-host`."),
        Column("function", STR, "Function called, e.g. `cudaMalloc`, `cuMemCreate`."),
        Column("op", STR, "`alloc`, `free`, `register`, `unregister` (pinned host memory), `create`, `release` "
                          "(VMM physical memory), `map`, `unmap`, `reserve`, `unreserve` (address space: never "
                          "counted as memory)."),
        Column("memory", STR, "`device`, `managed`, `host` (pinned), `vmm` (physical memory handle) or "
                              "`address` (reserved address range)."),
        Column("ptr", pa.int64(), "Pointer or VMM handle: the out-parameter of a successful allocation (0 when "
                                  "it failed), else the first argument."),
        Column("size", pa.int64(), "Bytes (pitched allocations: pitch x height)."),
        Column("handle", pa.int64(), "cuMemMap: the physical memory handle mapped at `ptr`, else null."),
        Column("result", pa.int32(), "Return value: 0 is success (cudaSuccess, CUDA_SUCCESS)."),
        Column("error", STR, "Name of a non-zero result, e.g. `cudaErrorMemoryAllocation`; null on success."),
        Column("counted", pa.bool_(), "The call changed outstanding memory (a successful allocation, or the free "
                                      "of a known block)."),
        Column("duration_us", pa.float64(), "Time spent in the call, microseconds."),
        Column("stack_id", pa.int64(), "Stack of calls that allocate, reserve, map or register (also failed "
                                       "ones), else null."),
    ),
)

GPU = Table(
    "gpu",
    "GPU devices as the NVIDIA driver reports them (NVML), one row per interval and device. Per-process "
    "usage is `processes.gpu_used_bytes`.",
    (
        *_common("Time of the measurement."),
        Column("device", pa.int32(), "NVML device index."),
        Column("uuid", STR, "Device UUID."),
        Column("name", STR, "Device name."),
        Column("total_bytes", pa.int64(), "Memory of the device."),
        Column("used_bytes", pa.int64(), "Memory in use (all processes, and the driver's reserve without "
                                         "nvmlMemory_v2)."),
        Column("reserved_bytes", pa.int64(), "Memory the driver reserves for itself (null without nvmlMemory_v2)."),
        Column("processes", pa.int32(), "Processes with memory on the device."),
    ),
)

MALLOC_ARENAS = Table(
    "malloc_arenas",
    "One row per interval, process and glibc arena (the main arena of `[heap]` and each secondary "
    "arena): its resident memory, the sampled live bytes in it and, read from the arena's bins "
    "through /proc/PID/mem, its free chunks. The free-list columns are null at the snapshots that did "
    "not walk the arenas (walks are spaced by their cost: sampler/control/pacing.py), and when the "
    "metadata could not be read consistently (the process runs on while it is read) or the walk ran "
    "over its budget. A CPython process also has one `pymalloc` row for its small-object arenas at "
    "each snapshot that scanned them (sampler/proc/pymalloc.py).",
    (
        *_common("Time of the measurement."),
        Column("pid", pa.int32(), "Process id."),
        Column("allocator", pa.string(), "`glibc`: one row per glibc arena; `pymalloc`: one row for all of "
                                         "CPython's small-object arenas (1 MiB each, counted in `heaps`), found "
                                         "by their pool headers. Null in older data: glibc."),
        Column("arena", pa.int64(), "Address of the arena's `malloc_state` (0: main arena not located; "
                                    "pymalloc: 0)."),
        Column("main", pa.bool_(), "The main arena (`[heap]`, grown with brk)."),
        Column("heaps", pa.int32(), "Heaps of the arena (64 MiB-aligned; 1 for the main arena)."),
        Column("size", pa.int64(), "Committed (read/write) bytes of its heaps."),
        Column("rss", pa.int64(), "Resident bytes of its heaps (pagemap present bits)."),
        Column("swap", pa.int64(), "Swapped bytes of its heaps."),
        Column("live_bytes", pa.float64(), "Estimated live malloc chunk bytes located in its heaps "
                                           "(sampled blocks, glibc chunk sizes)."),
        Column("live_stderr_bytes", pa.float64(), "Standard error of `live_bytes`."),
        Column("live_samples", pa.int32(), "Sampled live blocks located in its heaps."),
        Column("free_bytes", pa.int64(), "Bytes of free chunks in its bins plus the top chunk (exact, as "
                                         "mallinfo2's fordblks; tcache and fastbin chunks count as in use)."),
        Column("free_chunks", pa.int64(), "Free chunks in its bins."),
        Column("top_bytes", pa.int64(), "Size of its top chunk."),
        Column("free_resident_bytes", pa.int64(), "Resident bytes inside free chunks and the top chunk."),
        Column("trimmable_bytes", pa.int64(), "Resident bytes that `malloc_trim(0)` would return to the "
                                              "system: whole pages inside free chunks of the unsorted and "
                                              "large bins, and (main arena) the top chunk."),
        Column("pinned_bytes", pa.int64(), "Free bytes on pinned pages: resident pages of its heaps that hold "
                                           "free bytes (free chunks, the top chunk) beside bytes in use (live "
                                           "chunks, chunks cached in tcache or fastbins, glibc's metadata), which "
                                           "`malloc_trim` cannot return (exact)."),
        Column("pinned_pages", pa.int64(), "Pinned pages (see `pinned_bytes`)."),
        Column("in_use_bytes", pa.int64(), "Bytes in use (exact): glibc, the heaps less their free chunks and "
                                           "top (tcache and fastbin chunks count as in use); pymalloc, the blocks "
                                           "in use of every pool. Null when the walk failed."),
    ),
)

FINDINGS = Table(
    "findings",
    "Daemon only: what its periodic analysis (`allocsampler analyze` over the recent data, run in a "
    "child process) found, one row per finding and analysis run. docs/findings.md explains the "
    "kinds and fields; `details` holds the kind-specific fields as JSON.",
    (
        *_common("When the analysis ran."),
        Column("pid", pa.int32(), "Process id."),
        Column("comm", STR, "Process name."),
        Column("kind", STR, "`persistent_growth`, `arena_bloat`, `unexplained_growth`, ..."),
        Column("severity", pa.float64(), "Ranking, 0..100 (higher is worse)."),
        Column("confidence", pa.float64(), "0..1: how sure the statistics are that the pattern is real."),
        Column("summary", pa.string(), "One sentence for humans (also logged)."),
        Column("source", STR, "Allocation source of a stack finding (`malloc`, `python`, `mmap`, `fault`, ...), "
                              "else null."),
        Column("stack_id", pa.int64(), "Stack of a stack finding (join with `stacks`/`frames`), else null."),
        Column("new", pa.bool_(), "First time this daemon run reported this finding (kind, process, "
                                  "source and stack); it was logged."),
        Column("window_s", pa.float64(), "Length of the data window analysed, seconds."),
        Column("details", pa.string(), "The finding as JSON (the fields of `analyze --json`)."),
    ),
)

TABLES: dict[str, Table] = {t.name: t for t in (
    OUTSTANDING, STACKS, FRAMES, PROCESSES, VM_EVENTS, TARGETS, RECORDER, RECORDINGS, MALLOC_ARENAS,
    FINDINGS, GPU_EVENTS, GPU)}
