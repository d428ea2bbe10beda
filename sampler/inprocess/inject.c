/*
 * allocsampler injected sampler: the preload shim's in-process sampling (sampling.h), placed into a
 * running process from outside (sampler/inprocess/inject.py) instead of by LD_PRELOAD at start-up.
 *
 * The recorder maps this file's code from a memfd (private, read+exec: uprobes can sit in it) and an
 * anonymous read+write region INJ_DATA_OFFSET after it, writes `inj` (the functions to forward to,
 * the sampling mean and cap, the vDSO clock), then points the GOT slots of the process's objects
 * that bind to the allocator at the as_* functions below. Only sampled calls reach a probe site:
 * otel_memory:alloc(ptr, size, weighted_bytes) / otel_memory:free(ptr), the shim's and the
 * OpenTelemetry eBPF profiler's contract, and allocsampler:pyalloc(ptr, size, weighted_bytes) for
 * CPython's small objects (pymalloc), which never reach malloc.
 *
 * Freestanding (-ffreestanding -fPIC -nostdlib, inject.ld): no relocations (all data RIP-relative;
 * every pointer the code calls is written by the recorder into `inj`), no libc, no TLS (a thread's
 * countdown is a slot chosen by its stack pointer), no locks (sampling.h: atomics only), no system
 * call on any allocator path (the rate cap's clock is the vDSO's; only inj_store_run, which a
 * stopped thread runs for the recorder, calls mprotect). Nothing here allocates. A signal handler that allocates
 * while this runs shares the slot: a countdown update may be lost, never memory. A forked child
 * inherits the code, the data (copy-on-write) and the redirected slots, and keeps working; each
 * draw mixes the time stamp counter in, so parent and child stop drawing the same gaps.
 *
 * The code stays mapped after the recorder restores the slots: a thread may be between loading a
 * slot and returning from here, and copies of the slots taken as function pointers keep calling in.
 * Everything here keeps forwarding correctly for as long as the process lives.
 */
#include <stddef.h>
#include <stdint.h>
#include <sys/sdt.h>

#include "inject_abi.h"
#include "sampling.h"

#define API __attribute__((visibility("default"), used))
#define COLD __attribute__((noinline, cold))

struct inj_data inj __attribute__((visibility("hidden"), section(".inj_data"), aligned(4096)));
struct smp_bucket inj_table[SMP_TABLE_BYTES / sizeof(struct smp_bucket) + 1]
    __attribute__((visibility("hidden"), section(".inj_data"), aligned(4096)));

struct inj_store inj_store __attribute__((visibility("hidden"), section(".inj_data"), aligned(64)));

static inline struct smp_bucket *table(void)
{
    return inj_table;
}

static inline struct smp_thread *slot(void)
{
    uintptr_t sp;
    __asm__("mov %%rsp, %0" : "=r"(sp));
    return &inj.slots[((sp >> INJ_SLOT_SHIFT) * 0x9e3779b97f4a7c15ULL) >> (64 - INJ_SLOTS_LOG2)];
}

typedef void *malloc_fn(size_t);
typedef void free_fn(void *);
typedef void *calloc_fn(size_t, size_t);
typedef void *realloc_fn(void *, size_t);
typedef int posix_memalign_fn(void **, size_t, size_t);
typedef void *memalign_fn(size_t, size_t);
typedef void *aligned_alloc_fn(size_t, size_t);
typedef void *valloc_fn(size_t);
typedef void *pvalloc_fn(size_t);

#define REAL(name, NAME) ((name##_fn *)SMP_LOAD(&inj.real[INJ_##NAME]))

/* ------------------------------------------------------------------------------------------ */
/* Sampling decisions (slow path)                                                              */

struct inj_timespec {
    long sec;
    long nsec;
};

static uint64_t coarse_ns(void)
{
    struct inj_timespec ts = {0, 0};
    int (*clock_gettime)(int, struct inj_timespec *) = (int (*)(int, struct inj_timespec *))inj.clock;
    if (clock_gettime(6 /* CLOCK_MONOTONIC_COARSE */, &ts) != 0)
        return 0;
    return (uint64_t)ts.sec * SMP_NS_PER_S + (uint64_t)ts.nsec;
}

static inline uint64_t rdtsc(void)
{
    uint32_t lo, hi;
    __asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
    return (uint64_t)hi << 32 | lo;
}

static COLD uint64_t decide(struct smp_thread *t, size_t size)
{
    if (SMP_UNLIKELY(!t->seeded)) {
        uint64_t ctr = __atomic_fetch_add(&inj.proc.seed_counter, 1, __ATOMIC_RELAXED);
        t->rng = smp_mix64((uintptr_t)t) ^ smp_mix64(ctr + 0x9e3779b97f4a7c15ULL);
        t->seeded = 1;
    }
    t->rng ^= smp_mix64(rdtsc());   /* a forked child stops drawing its parent's gaps */
    return smp_decide(t, &inj.proc, size, inj.clock ? coarse_ns : 0);
}

static COLD void report_alloc(void *p, size_t size, uint64_t mean)
{
    uintptr_t a = (uintptr_t)p;
    if (a == 0)
        return; /* failed allocations are not reported */
    uint64_t weighted = smp_sampled(&inj.proc, table(), a, size, mean);
    if (weighted) {
        uint64_t ptr = a, sz = size;
        STAP_PROBE3(otel_memory, alloc, ptr, sz, weighted);
    }
}

/* Returns whether `a` was sampled (its free is reported). */
static COLD int forget_sampled(uintptr_t a)
{
    if (!smp_forget(&inj.proc, table(), a))
        return 0;
    uint64_t ptr = a;
    STAP_PROBE1(otel_memory, free, ptr);
    return 1;
}

/* A block reported freed is still allocated (its realloc failed): back into the set, and the
 * recorder undoes the free. */
static COLD void unforget(uintptr_t a)
{
    if (smp_unforget(&inj.proc, table(), a)) {
        uint64_t ptr = a;
        STAP_PROBE1(allocsampler, unfree, ptr);
    }
}

static COLD void *sampled_ptr(struct smp_thread *t, void *p, size_t bytes)
{
    uint64_t mean = decide(t, bytes);
    if (mean)
        report_alloc(p, bytes, mean);
    return p;
}

/* ------------------------------------------------------------------------------------------ */
/* The malloc family. Each function is a fast path (the slot's countdown, a tail call) and a    */
/* cold slow path that forwards, decides and reports; `bytes` is what the countdown consumes.  */

#define UNPAREN(...) __VA_ARGS__
/* do_NAME is the function; as_NAME its exported name (calls inside stay direct: no GOT here). */
#define WRAP(name, NAME, params, args, bytes)                                                      \
    static COLD void *name##_slow(struct smp_thread *t, size_t bytes_, UNPAREN params)             \
    {                                                                                              \
        return sampled_ptr(t, REAL(name, NAME) args, bytes_);                                      \
    }                                                                                              \
    static inline void *do_##name params                                                           \
    {                                                                                              \
        struct smp_thread *t = slot();                                                             \
        size_t b = (bytes);                                                                        \
        if (SMP_LIKELY(b < t->remaining)) {                                                        \
            t->remaining -= b;                                                                     \
            return REAL(name, NAME) args;                                                          \
        }                                                                                          \
        return name##_slow(t, b, UNPAREN args);                                                    \
    }                                                                                              \
    API void *as_##name params                                                                     \
    {                                                                                              \
        return do_##name args;                                                                     \
    }

WRAP(malloc, MALLOC, (size_t n), (n), n)
WRAP(aligned_alloc, ALIGNED_ALLOC, (size_t al, size_t n), (al, n), n)
WRAP(memalign, MEMALIGN, (size_t al, size_t n), (al, n), n)
WRAP(valloc, VALLOC, (size_t n), (n), n)
/* The request is rounded up to whole pages, as glibc does; one that wraps is never sampled. */
WRAP(pvalloc, PVALLOC, (size_t n), (n), (n + 4095) & ~(size_t)4095)

static COLD void *calloc_slow(struct smp_thread *t, size_t s, size_t n, size_t m)
{
    return sampled_ptr(t, REAL(calloc, CALLOC)(n, m), s);
}

API void *as_calloc(size_t n, size_t m)
{
    size_t s;
    if (SMP_UNLIKELY(__builtin_mul_overflow(n, m, &s)))
        return REAL(calloc, CALLOC)(n, m); /* fails with ENOMEM there; never sampled */
    struct smp_thread *t = slot();
    if (SMP_LIKELY(s < t->remaining)) {
        t->remaining -= s;
        return REAL(calloc, CALLOC)(n, m);
    }
    return calloc_slow(t, s, n, m);
}

/* realloc(NULL, n) is a malloc. A sampled block handed to realloc is reported freed before the real
 * realloc, while the address is still the caller's: afterwards another thread may already have it
 * back from malloc, sampled, and forgetting it then would take that sample's entry. A realloc that
 * fails (out of memory; size 0 frees) leaves the block allocated: it goes back into the set and
 * allocsampler:unfree tells the recorder to undo the free. */
static COLD void *realloc_slow(struct smp_thread *t, void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    if (a == 0)
        return do_malloc(n);
    int was = smp_maybe_sampled(table(), a) && forget_sampled(a);
    void *q;
    if (SMP_LIKELY(n < t->remaining)) {
        t->remaining -= n;
        q = REAL(realloc, REALLOC)(p, n);
    } else {
        q = sampled_ptr(t, REAL(realloc, REALLOC)(p, n), n);
    }
    if (SMP_UNLIKELY(was && q == 0 && n != 0))
        unforget(a);
    return q;
}

API void *as_realloc(void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    struct smp_thread *t = slot();
    if (SMP_LIKELY(n < t->remaining && a != 0 && SMP_LOAD(&smp_homes(table())[smp_home(a)]) == 0)) {
        t->remaining -= n;
        return REAL(realloc, REALLOC)(p, n);
    }
    return realloc_slow(t, p, n);
}

static COLD int posix_memalign_slow(struct smp_thread *t, void **pp, size_t al, size_t n)
{
    int r = REAL(posix_memalign, POSIX_MEMALIGN)(pp, al, n);
    sampled_ptr(t, r == 0 ? *pp : 0, n);
    return r;
}

API int as_posix_memalign(void **pp, size_t al, size_t n)
{
    struct smp_thread *t = slot();
    if (SMP_LIKELY(n < t->remaining)) {
        t->remaining -= n;
        return REAL(posix_memalign, POSIX_MEMALIGN)(pp, al, n);
    }
    return posix_memalign_slow(t, pp, al, n);
}

static COLD void free_sampled(void *p)
{
    forget_sampled((uintptr_t)p);
    REAL(free, FREE)(p);
}

API void as_free(void *p)
{
    uintptr_t a = (uintptr_t)p;
    if (a != 0 && smp_maybe_sampled(table(), a)) {
        free_sampled(p);
        return;
    }
    REAL(free, FREE)(p);
}

/* ------------------------------------------------------------------------------------------ */
/* CPython's allocator domains (PyMemAllocatorEx). Small requests are pymalloc's and never reach  */
/* malloc: they are sampled here and reported as allocsampler:pyalloc; larger ones go to the raw */
/* allocator (malloc, sampled there), so they only pass through. A free is a free whatever the   */
/* domain: otel_memory:free.                                                                     */

/* These functions lie in their own section (.inj_py, inject.ld) and never tail-call: pymalloc's
 * arena mmaps happen under one of their frames, which tells the recorder that such a mapping
 * holds objects already sampled here (not counted again as mmap). */
#define PYFN __attribute__((section(".inj_py_text")))
#define NO_TAIL(x) ({ __typeof__(x) r_ = (x); __asm__ volatile("" : "+r"(r_)); r_; })

typedef void *py_malloc_fn(void *, size_t);
typedef void *py_calloc_fn(void *, size_t, size_t);
typedef void *py_realloc_fn(void *, void *, size_t);
typedef void py_free_fn(void *, void *);

static COLD PYFN void *py_sampled(struct smp_thread *t, void *p, size_t bytes)
{
    uint64_t mean = decide(t, bytes);
    uintptr_t a = (uintptr_t)p;
    if (mean && a) {
        uint64_t weighted = smp_sampled(&inj.proc, table(), a, bytes, mean);
        if (weighted) {
            uint64_t ptr = a, sz = bytes;
            STAP_PROBE3(allocsampler, pyalloc, ptr, sz, weighted);
        }
    }
    return p;
}

/* Sizes 1..INJ_PY_SMALL are pymalloc's; 0 and larger ones pass through to malloc (sampled there). */
#define PY_SAMPLE(bytes, call)                                                                     \
    do {                                                                                           \
        struct smp_thread *t_ = slot();                                                            \
        size_t b_ = (bytes);                                                                       \
        if (SMP_LIKELY(b_ < t_->remaining) || b_ - 1 >= INJ_PY_SMALL) {                            \
            if (b_ - 1 < INJ_PY_SMALL)                                                             \
                t_->remaining -= b_;                                                               \
            return NO_TAIL(call);                                                                  \
        }                                                                                          \
        return py_sampled(t_, call, b_);                                                           \
    } while (0)

/* A sampled object handed to realloc: as realloc_slow (reported freed first, undone on failure). */
static COLD PYFN void *py_realloc_sampled(struct inj_py_allocator *a, void *p, size_t n)
{
    int was = forget_sampled((uintptr_t)p);
    struct smp_thread *t = slot();
    void *q = ((py_realloc_fn *)SMP_LOAD(&a->realloc))((void *)a->ctx, p, n);
    if (n - 1 < INJ_PY_SMALL) {
        if (SMP_LIKELY(n < t->remaining))
            t->remaining -= n;
        else
            py_sampled(t, q, n);
    }
    if (SMP_UNLIKELY(was && q == 0))
        unforget((uintptr_t)p);
    return q;
}

#define PY_DOMAIN(dom, D)                                                                          \
    API PYFN void *as_py_##dom##_malloc(void *ctx, size_t n)                                            \
    {                                                                                              \
        (void)ctx;                                                                                 \
        struct inj_py_allocator *a = &inj.py[D];                                                   \
        PY_SAMPLE(n, ((py_malloc_fn *)SMP_LOAD(&a->malloc))((void *)a->ctx, n));                   \
    }                                                                                              \
    API PYFN void *as_py_##dom##_calloc(void *ctx, size_t n, size_t m)                                  \
    {                                                                                              \
        (void)ctx;                                                                                 \
        struct inj_py_allocator *a = &inj.py[D];                                                   \
        size_t s;                                                                                  \
        if (SMP_UNLIKELY(__builtin_mul_overflow(n, m, &s)))                                        \
            return NO_TAIL(((py_calloc_fn *)SMP_LOAD(&a->calloc))((void *)a->ctx, n, m));          \
        PY_SAMPLE(s, ((py_calloc_fn *)SMP_LOAD(&a->calloc))((void *)a->ctx, n, m));                \
    }                                                                                              \
    API PYFN void *as_py_##dom##_realloc(void *ctx, void *p, size_t n)                                  \
    {                                                                                              \
        (void)ctx;                                                                                 \
        uintptr_t addr = (uintptr_t)p;                                                             \
        if (SMP_UNLIKELY(addr != 0 && smp_maybe_sampled(table(), addr)))                           \
            return py_realloc_sampled(&inj.py[D], p, n);                                           \
        struct inj_py_allocator *a = &inj.py[D];                                                   \
        PY_SAMPLE(n, ((py_realloc_fn *)SMP_LOAD(&a->realloc))((void *)a->ctx, p, n));              \
    }                                                                                              \
    API PYFN void as_py_##dom##_free(void *ctx, void *p)                                                \
    {                                                                                              \
        (void)ctx;                                                                                 \
        struct inj_py_allocator *a = &inj.py[D];                                                   \
        uintptr_t addr = (uintptr_t)p;                                                             \
        if (addr != 0 && smp_maybe_sampled(table(), addr))                                         \
            forget_sampled(addr);                                                                  \
        ((py_free_fn *)SMP_LOAD(&a->free))((void *)a->ctx, p);                                     \
    }

PY_DOMAIN(mem, INJ_PY_MEM)
PY_DOMAIN(obj, INJ_PY_OBJ)

/* ------------------------------------------------------------------------------------------ */
/* Writes for the recorder (inject_abi.h: struct inj_store), run by a thread the placement       */
/* helper stopped and pointed here, on inj_store.stack; it ends on an int3 the helper waits for.  */

__asm__(".text\n"
        ".globl inj_syscall3\n.hidden inj_syscall3\n.type inj_syscall3,@function\n"
        "inj_syscall3:\n"
        "  mov %rdi, %rax\n  mov %rsi, %rdi\n  mov %rdx, %rsi\n  mov %rcx, %rdx\n"
        "  syscall\n  ret\n"
        ".size inj_syscall3, .-inj_syscall3\n");
long inj_syscall3(long nr, long a, long b, long c);

#define INJ_SYS_MPROTECT 10

static int page_ok(uint64_t addr)
{
    for (uint64_t i = 0; i < inj_store.npages && i < INJ_STORE_PAGES; i++) {
        struct inj_store_page *pg = &inj_store.pages[i];
        if (addr >= pg->addr && addr + 8 <= pg->addr + pg->len)
            return pg->err == 0;
    }
    return 1; /* already writable: the helper listed only the pages that were not */
}

API __attribute__((noreturn)) void inj_store_run(void)
{
    uint64_t npages = inj_store.npages < INJ_STORE_PAGES ? inj_store.npages : INJ_STORE_PAGES;
    uint64_t nops = inj_store.nops < INJ_STORE_OPS ? inj_store.nops : INJ_STORE_OPS;
    for (uint64_t i = 0; i < npages; i++) {
        struct inj_store_page *pg = &inj_store.pages[i];
        pg->err = inj_syscall3(INJ_SYS_MPROTECT, (long)pg->addr, (long)pg->len, (long)pg->write_prot);
    }
    int last = 1;
    for (uint64_t i = 0; i < nops; i++) {
        struct inj_store_op *op = &inj_store.ops[i];
        op->done = 0;
        if (((op->flags & INJ_STORE_AFTER_OK) && !last) || (op->addr & 7) || !page_ok(op->addr)) {
            last = 0;
            continue;
        }
        uint64_t seen = op->expected;
        last = __atomic_compare_exchange_n((uint64_t *)op->addr, &seen, op->value, 0, __ATOMIC_SEQ_CST,
                                           __ATOMIC_SEQ_CST);
        op->seen = seen;
        op->done = (uint64_t)last;
    }
    for (uint64_t i = 0; i < npages; i++) {
        struct inj_store_page *pg = &inj_store.pages[i];
        if (pg->err == 0)
            inj_syscall3(INJ_SYS_MPROTECT, (long)pg->addr, (long)pg->len, (long)pg->prot);
    }
    __atomic_store_n(&inj_store.state, INJ_STORE_DONE, __ATOMIC_SEQ_CST);
    for (;;)
        __asm__ volatile("int3");
}
