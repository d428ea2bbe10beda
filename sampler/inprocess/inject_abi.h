/*
 * The ABI between the injected sampler (inject.c) and the recorder that places it
 * (sampler/inprocess/inject.py). sampler/inprocess/abi.py mirrors it and sampling.h in Python;
 * tests/bpf/test_abi.py checks them constant by constant and field by field. The recorder writes
 * everything here through /proc/PID/mem before it redirects a single call; the sampler only reads
 * the configuration and updates the counters, slots and set.
 */
#ifndef ALLOCSAMPLER_INJECT_ABI_H
#define ALLOCSAMPLER_INJECT_ABI_H

#include "sampling.h"

#define INJ_MAGIC 0x31504d53434f4c41ULL /* "ALOCSMP1": a placed, configured sampler */
#define INJ_VERSION 1
/* The data lies this far after the start of the code mapping (inject.ld), so that the code reaches
 * it RIP-relative without relocations; the code file must be smaller. */
#define INJ_DATA_OFFSET 0x20000
/* Per-thread sampling state without TLS: a slot chosen by the stack pointer's 64 KiB block.
 * Threads' stacks lie megabytes apart; two threads that share a slot only perturb each other's
 * countdown (a lost update), never memory. */
#define INJ_SLOTS_LOG2 14
#define INJ_SLOT_SHIFT 16

/* The functions the sampler stands in for, indexes into `real`. */
enum inj_fn {
    INJ_MALLOC = 0, INJ_FREE, INJ_CALLOC, INJ_REALLOC, INJ_POSIX_MEMALIGN, INJ_ALIGNED_ALLOC,
    INJ_MEMALIGN, INJ_VALLOC, INJ_PVALLOC, INJ_NFN,
};
/* CPython's allocator domains it stands in for (PyMemAllocatorEx: ctx, malloc, calloc, realloc,
 * free), indexes into `py`. */
enum inj_py_domain { INJ_PY_MEM = 0, INJ_PY_OBJ, INJ_PY_NDOMAINS };
/* Requests above this go from pymalloc to the raw allocator (malloc): sampled there, not twice. */
#define INJ_PY_SMALL 512

struct inj_py_allocator {
    uint64_t ctx;
    uint64_t malloc;
    uint64_t calloc;
    uint64_t realloc;
    uint64_t free;
};

struct inj_data {
    uint64_t magic;             /* INJ_MAGIC once configured (the recorder writes it last) */
    uint32_t version;
    uint32_t pad;
    uint64_t owner;             /* pid of the recorder that configured it last (informative) */
    uint64_t clock;             /* the vDSO's clock_gettime in this process (0: no rate cap) */
    uint64_t real[INJ_NFN];     /* the allocator's functions this sampler forwards to */
    struct inj_py_allocator py[INJ_PY_NDOMAINS];  /* CPython's allocators it forwards to */
    uint64_t reserved[8];
    struct smp_process proc;
    struct smp_thread slots[1 << INJ_SLOTS_LOG2];
};

/* The set of sampled addresses (SMP_TABLE_BYTES) is the object `inj_table`, after `inj` in the
 * data segment; the recorder takes both places from the ELF's symbols. */

/* Writes into the process's own words (GOT slots, .dynsym values, CPython's allocator domains),
 * made by a thread of the process that the placement helper stopped and pointed at inj_store_run
 * (place.c `store`): each is one aligned 8-byte compare-and-exchange by the CPU, so a thread
 * loading the word sees the old or the new value, never a mix (a copy through /proc/PID/mem is a
 * string move and tears), and nothing is written where the word no longer holds what the recorder
 * planned on. Pages that are not writable are made so around the writes and get their protection
 * back. The helper fills `inj_store` (and runs on `stack`); the thread ends on an int3. */
#define INJ_STORE_OPS 256
#define INJ_STORE_PAGES 64
#define INJ_STORE_STACK 4096
#define INJ_STORE_AFTER_OK 1ULL        /* flags: only when the op before it was written */

struct inj_store_op {
    uint64_t addr;
    uint64_t expected;
    uint64_t value;
    uint64_t flags;
    uint64_t seen;              /* what the word held (== expected: written) */
    uint64_t done;              /* 1: written, 0: not (seen differs, or skipped) */
};

struct inj_store_page {
    uint64_t addr;              /* page-aligned */
    uint64_t len;
    uint64_t prot;              /* its protection, given back after the writes */
    uint64_t write_prot;        /* the same with PROT_WRITE (exec kept: other threads may run there) */
    int64_t err;                /* mprotect's result (0, or -errno: then none of its ops ran) */
};

struct inj_store {
    uint64_t nops;
    uint64_t npages;
    uint64_t state;             /* INJ_STORE_DONE once the routine has ended */
    uint64_t pad;
    struct inj_store_page pages[INJ_STORE_PAGES];
    struct inj_store_op ops[INJ_STORE_OPS];
    uint8_t stack[INJ_STORE_STACK];
};
#define INJ_STORE_DONE 0x454e4f44ULL   /* "DONE" */

#endif
