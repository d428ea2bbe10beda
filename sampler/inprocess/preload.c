/*
 * allocsampler preload shim: samples malloc-family allocations inside the process and emits USDT
 * probes only for the sampled calls, so that an attached recorder pays for probes on about one call
 * per ALLOCSAMPLER_SAMPLE_MEAN allocated bytes instead of on every call.
 *
 * Use:   LD_PRELOAD=build/liballocsampler_preload.so ALLOCSAMPLER_SAMPLE_MEAN=524288 prog ...
 * Build: python -m sampler.inprocess.preload   (sampler/inprocess/preload.py has the compiler flags)
 *
 * Probes (SystemTap SDT v3 notes, no semaphores; the OpenTelemetry eBPF profiler memory contract):
 *   otel_memory:alloc(u64 ptr, u64 size, u64 weighted_bytes)
 *       after the allocator returned a sampled block; size is the requested size, weighted_bytes
 *       the bytes the sample stands for (size / p, rounded).
 *   otel_memory:free(u64 ptr)
 *       before a sampled block is freed or handed to realloc.
 *   allocsampler:unfree(u64 ptr)
 *       after a realloc of a sampled block failed: the free reported before it is undone (the
 *       block is still allocated). Our extension of the contract.
 *
 * Environment (read once, at start-up):
 *   ALLOCSAMPLER_SAMPLE_MEAN  mean bytes between samples T, decimal; default 524288; 0, an invalid
 *                             value or one above 2^40 means the default.
 *   ALLOCSAMPLER_MAX_SAMPLES_PER_S
 *                             cap on the process's samples per second, decimal; default 2000;
 *                             0 turns the cap off; an invalid value or one above 10^9 means the
 *                             default. Above the cap the mean is raised (sampling.h: "Sample-rate cap").
 *
 * Exported besides the interposed functions (for tests and debugging):
 *   double allocsampler_preload_weight(unsigned long size)   weight of a sample of `size` bytes
 *   void allocsampler_preload_stats(unsigned long *sampled, double *weighted_bytes)
 *                             process totals of reported samples and of their weights
 *   void allocsampler_preload_counts(unsigned long *freed, unsigned long *dropped)
 *                             frees (and reallocs) of sampled blocks reported, and samples not
 *                             reported because the set of sampled live addresses had no room (or
 *                             could not be mapped): such blocks are simply not sampled, their frees
 *                             are not reported either.
 *   void allocsampler_preload_sampling(unsigned long *mean, unsigned long *configured_mean,
 *                                      unsigned long *mean_changes, unsigned long *max_per_s,
 *                                      double *weight_var)
 *                             the mean new gaps are drawn with now, ALLOCSAMPLER_SAMPLE_MEAN, how
 *                             many times the cap changed the mean, the cap (0: none), and the
 *                             Horvitz-Thompson variance estimate of weighted_bytes: the sum over
 *                             reported samples of w^2 (1 - p) = w (w - size). Any pointer may be
 *                             NULL.
 *
 * Sampling, the weights, the cap and the set of sampled addresses are sampling.h's, shared with the
 * injected sampler (inject.c). Here each thread's state is in initial-exec TLS, and the clock is the
 * vDSO's CLOCK_MONOTONIC_COARSE.
 *
 * Safety rules, since production services preload this: no allocation in the hooks, no locks, no
 * stdio; atomics only; nothing that a fork can leave locked (the child reseeds its random state
 * when it sees a new pid); every call is forwarded to the NEXT definition (dlsym(RTLD_NEXT)) so
 * that jemalloc/tcmalloc linked by the application stay in charge. Calls that arrive while dlsym
 * itself runs (it may allocate) are served from a static bootstrap buffer whose frees are ignored.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sdt.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "sampling.h"

#define API __attribute__((visibility("default")))
#define COLD __attribute__((noinline, cold))
#define TLS __thread __attribute__((tls_model("initial-exec")))

/* ------------------------------------------------------------------------------------------ */
/* State                                                                                       */

static struct smp_process g = {.max_per_s = SMP_DEFAULT_MAX_PER_S};
static struct smp_bucket *g_table; /* mapped on the first sample: a process that never samples pays nothing */
static TLS struct smp_thread t;    /* one %fs-relative access; never allocates */
static TLS int t_resolving;        /* this thread is inside dlsym */

/* ------------------------------------------------------------------------------------------ */
/* Bootstrap buffer: serves the allocations dlsym makes while the real functions are resolved.  */
/* Never reused (so it is always zero, which calloc relies on); frees inside it are ignored.    */

#define BOOT_SIZE (64 * 1024)
static char g_boot[BOOT_SIZE] __attribute__((aligned(64)));
static size_t g_boot_used;

static inline int in_boot(uintptr_t a)
{
    return a - (uintptr_t)g_boot < BOOT_SIZE;
}

static void *boot_alloc(size_t n, size_t align)
{
    if (align < 16)
        align = 16;
    if (n > BOOT_SIZE || align > BOOT_SIZE / 2 || (align & (align - 1))) {
        errno = ENOMEM;
        return NULL;
    }
    size_t used = __atomic_load_n(&g_boot_used, __ATOMIC_RELAXED);
    for (;;) {
        uintptr_t base = (uintptr_t)g_boot;
        uintptr_t p = (base + used + sizeof(size_t) + align - 1) & ~(uintptr_t)(align - 1);
        size_t end = p + ((n + 15) & ~(size_t)15) - base;
        if (end > BOOT_SIZE) {
            errno = ENOMEM;
            return NULL;
        }
        if (__atomic_compare_exchange_n(&g_boot_used, &used, end, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
            ((size_t *)p)[-1] = n; /* the requested size, for realloc */
            return (void *)p;
        }
    }
}

static inline size_t boot_size(const void *p)
{
    return ((const size_t *)p)[-1];
}

static size_t page_size(void)
{
    static size_t pg;
    size_t v = SMP_LOAD(&pg);
    if (SMP_UNLIKELY(v == 0)) {
        long r = sysconf(_SC_PAGESIZE);
        v = r > 0 ? (size_t)r : 4096;
        SMP_STORE(&pg, v);
    }
    return v;
}

static inline int bad_align(size_t al)
{
    return al == 0 || (al & (al - 1));
}

/* ------------------------------------------------------------------------------------------ */
/* The next definitions. Each pointer starts at a stub that resolves all of them with dlsym;    */
/* a stub reached again while this thread is inside dlsym serves the bootstrap buffer.          */
/* One X-macro lists the interposed allocation functions: name, return type, parameters, and the */
/* fallback when the next object does not define it (never with glibc; called with the         */
/* function's arguments, which the x86-64 calling convention lets it ignore).                   */

#define ALLOCATORS(X)                                                                              \
    X(malloc, void *, (size_t n), missing_null)                                                    \
    X(calloc, void *, (size_t n, size_t m), missing_null)                                          \
    X(realloc, void *, (void *p, size_t n), missing_null)                                          \
    X(posix_memalign, int, (void **pp, size_t al, size_t n), missing_enomem)                       \
    X(aligned_alloc, void *, (size_t al, size_t n), missing_null)                                  \
    X(memalign, void *, (size_t al, size_t n), missing_null)                                       \
    X(valloc, void *, (size_t n), missing_null)                                                    \
    X(pvalloc, void *, (size_t n), missing_null)

#define DECLARE(name, ret, params, missing)                                                        \
    typedef ret name##_fn params;                                                                  \
    static ret stub_##name params;                                                                 \
    static name##_fn *real_##name = stub_##name;
ALLOCATORS(DECLARE)
typedef void free_fn(void *);
static void stub_free(void *);
static free_fn *real_free = stub_free;

#define REAL(name) (__atomic_load_n(&real_##name, __ATOMIC_RELAXED))

static int missing_enomem(void)
{
    return ENOMEM;
}
static void *missing_null(void)
{
    errno = ENOMEM;
    return NULL;
}
static void missing_free(void *p)
{
    (void)p; /* leaked: nothing to hand it to */
}

/* Resolves every next definition; a no-op (returning 0) when this thread is already inside. */
static COLD int resolve(void)
{
    if (t_resolving)
        return 0;
    t_resolving = 1;
    int saved = errno;
#define BIND(name, ret, params, missing)                                                           \
    {                                                                                              \
        void *f_ = dlsym(RTLD_NEXT, #name);                                                        \
        name##_fn *g_ = f_ ? (name##_fn *)f_ : (name##_fn *)(void *)missing;                      \
        __atomic_store_n(&real_##name, g_, __ATOMIC_RELEASE);                                      \
    }
    ALLOCATORS(BIND)
    void *f = dlsym(RTLD_NEXT, "free");
    __atomic_store_n(&real_free, f ? (free_fn *)f : missing_free, __ATOMIC_RELEASE);
    errno = saved;
    t_resolving = 0;
    return 1;
}

/* The stubs: the real function once resolved, the bootstrap buffer while dlsym runs. */
static void *stub_malloc(size_t n)
{
    return resolve() ? REAL(malloc)(n) : boot_alloc(n, 16);
}
static void stub_free(void *p)
{
    if (resolve())
        REAL(free)(p);
}
static void *stub_calloc(size_t n, size_t m)
{
    size_t s;
    if (resolve())
        return REAL(calloc)(n, m);
    if (__builtin_mul_overflow(n, m, &s)) {
        errno = ENOMEM;
        return NULL;
    }
    return boot_alloc(s, 16); /* the buffer is never reused: already zero */
}
static void *stub_realloc(void *p, size_t n)
{
    if (resolve())
        return REAL(realloc)(p, n);
    if (p == NULL)
        return boot_alloc(n, 16);
    errno = ENOMEM; /* cannot happen: nothing but the bootstrap buffer exists yet */
    return NULL;
}
static int stub_posix_memalign(void **pp, size_t al, size_t n)
{
    if (resolve())
        return REAL(posix_memalign)(pp, al, n);
    if (bad_align(al) || al % sizeof(void *))
        return EINVAL;
    void *p = boot_alloc(n, al);
    if (!p)
        return ENOMEM;
    *pp = p;
    return 0;
}
static void *stub_aligned_alloc(size_t al, size_t n)
{
    if (resolve())
        return REAL(aligned_alloc)(al, n);
    if (bad_align(al)) {
        errno = EINVAL;
        return NULL;
    }
    return boot_alloc(n, al);
}
static void *stub_memalign(size_t al, size_t n)
{
    if (resolve())
        return REAL(memalign)(al, n);
    if (bad_align(al)) {
        errno = EINVAL;
        return NULL;
    }
    return boot_alloc(n, al);
}
static void *stub_valloc(size_t n)
{
    return resolve() ? REAL(valloc)(n) : boot_alloc(n, page_size());
}
static void *stub_pvalloc(size_t n)
{
    return resolve() ? REAL(pvalloc)(n) : boot_alloc(n, page_size());
}

/* ------------------------------------------------------------------------------------------ */
/* Configuration                                                                               */

/* A decimal number in 0..max, or `fallback` for anything else (empty, not a number, too big). */
static uint64_t parse_u64(const char *s, uint64_t max, uint64_t fallback)
{
    uint64_t v = 0;
    if (!s || !*s)
        return fallback;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return fallback;
        v = v * 10 + (uint64_t)(*s - '0');
        if (v > max)
            return fallback;
    }
    return v;
}

static COLD uint64_t read_config(void)
{
    /* Before libc is initialised environ is still NULL: use the default, read again later. */
    if (environ == NULL)
        return SMP_DEFAULT_MEAN;
    /* getenv does not allocate */
    uint64_t m = parse_u64(getenv("ALLOCSAMPLER_SAMPLE_MEAN"), SMP_MAX_MEAN, 0);
    if (m == 0)
        m = SMP_DEFAULT_MEAN;
    SMP_STORE(&g.max_per_s, parse_u64(getenv("ALLOCSAMPLER_MAX_SAMPLES_PER_S"), SMP_MAX_MAX_PER_S,
                                      SMP_DEFAULT_MAX_PER_S));
    SMP_STORE(&g.base_mean, m);
    uint64_t unset = 0; /* a mean the cap has already raised stays */
    __atomic_compare_exchange_n(&g.cur_mean, &unset, m, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return SMP_LOAD(&g.cur_mean);
}

/* The mean a gap drawn now gets (the configured one unless the cap raised it). */
static inline uint64_t sample_mean(void)
{
    uint64_t m = SMP_LOAD(&g.cur_mean);
    return SMP_LIKELY(m) ? m : read_config();
}

static inline uint64_t base_mean(void)
{
    uint64_t m = SMP_LOAD(&g.base_mean);
    return m ? m : SMP_DEFAULT_MEAN;
}

static uint64_t coarse_ns(void)
{
    struct timespec ts = {0, 0};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); /* vDSO, ~10 ns; never a system call */
    return (uint64_t)ts.tv_sec * SMP_NS_PER_S + (uint64_t)ts.tv_nsec;
}

/* This thread's state, seeded on its first use and again in a forked child (a new pid). */
static COLD void seed_thread(pid_t pid)
{
    struct timespec ts = {0, 0};
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO; no allocation */
    uint64_t tid = (uint64_t)syscall(SYS_gettid);
    uint64_t ctr = __atomic_fetch_add(&g.seed_counter, 1, __ATOMIC_RELAXED);
    t.rng = smp_mix64(tid + 0x9e3779b97f4a7c15ULL) ^ smp_mix64((uint64_t)(uintptr_t)&t + ctr) ^
            smp_mix64((uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec) ^ ((uint64_t)pid << 32);
    t.seeded = (uint64_t)pid;
}

/* Called when size >= t.remaining. Returns 0 when not sampled, else the mean of the gap this
 * allocation ended, which its weight must use. */
static uint64_t decide(size_t size)
{
    pid_t pid = getpid();
    if (SMP_UNLIKELY((uint64_t)pid != t.seeded))
        seed_thread(pid); /* first use in this thread, or first since a fork */
    if (SMP_UNLIKELY(SMP_LOAD(&g.cur_mean) == 0))
        read_config();
    return smp_decide(&t, &g, size, coarse_ns);
}

static struct smp_bucket *table_get(void)
{
    struct smp_bucket *tab = __atomic_load_n(&g_table, __ATOMIC_ACQUIRE);
    if (tab)
        return tab;
    void *m = mmap(NULL, SMP_TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    struct smp_bucket *expected = NULL;
    if (!__atomic_compare_exchange_n(&g_table, &expected, (struct smp_bucket *)m, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE)) {
        munmap(m, SMP_TABLE_BYTES); /* another thread was first */
        return expected;
    }
    return (struct smp_bucket *)m;
}

/* `mean`: the mean of the gap the allocation ended (decide's result). */
static COLD void report_alloc(void *p, size_t size, uint64_t mean)
{
    uintptr_t a = (uintptr_t)p;
    if (a == 0 || in_boot(a))
        return; /* failed allocations are not reported */
    int saved = errno;
    uint64_t weighted = smp_sampled(&g, table_get(), a, size, mean);
    if (weighted) {
        uint64_t ptr = a, sz = size;
        STAP_PROBE3(otel_memory, alloc, ptr, sz, weighted);
    }
    errno = saved;
}

/* Removes a sampled address from the set and reports its free (before the real free/realloc);
 * returns whether it was there. */
static COLD int forget_sampled(struct smp_bucket *tab, uintptr_t a)
{
    if (!smp_forget(&g, tab, a))
        return 0;
    uint64_t ptr = a;
    STAP_PROBE1(otel_memory, free, ptr);
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* The interposed functions. Fast paths: one TLS compare-and-subtract, then a tail call.       */
/* `bytes` is the request the countdown consumes (calloc: n*m, pvalloc: whole pages).          */

#define FAST(name, bytes, args)                                                                    \
    do {                                                                                           \
        if (SMP_LIKELY((bytes) < t.remaining)) {                                                   \
            t.remaining -= (bytes);                                                                \
            return REAL(name) args;                                                                \
        }                                                                                          \
    } while (0)

static COLD void *sampled_ptr(void *p, size_t bytes)
{
    uint64_t mean = decide(bytes);
    if (mean)
        report_alloc(p, bytes, mean);
    return p;
}

static COLD void *malloc_slow(size_t n)
{
    return sampled_ptr(REAL(malloc)(n), n);
}

static inline void *do_malloc(size_t n)
{
    FAST(malloc, n, (n));
    return malloc_slow(n);
}

API void *malloc(size_t n)
{
    return do_malloc(n);
}

static COLD void free_sampled(struct smp_bucket *tab, void *p)
{
    forget_sampled(tab, (uintptr_t)p);
    REAL(free)(p);
}

API void free(void *p)
{
    uintptr_t a = (uintptr_t)p;
    if (SMP_UNLIKELY(in_boot(a)))
        return; /* bootstrap memory is never reused */
    struct smp_bucket *tab = SMP_LOAD(&g_table);
    if (tab != NULL && a != 0 && smp_maybe_sampled(tab, a)) {
        free_sampled(tab, p);
        return;
    }
    REAL(free)(p);
}

static COLD void *calloc_slow(size_t n, size_t m, size_t s)
{
    return sampled_ptr(REAL(calloc)(n, m), s);
}

API void *calloc(size_t n, size_t m)
{
    size_t s;
    if (SMP_UNLIKELY(__builtin_mul_overflow(n, m, &s)))
        return REAL(calloc)(n, m); /* fails with ENOMEM there; never sampled */
    FAST(calloc, s, (n, m));
    return calloc_slow(n, m, s);
}

/* A sampled block handed to realloc is reported freed before the real realloc, while the address
 * is still the caller's (inject.c's realloc_slow says why); a realloc that fails gives it back:
 * allocsampler:unfree(ptr) undoes that free. */
static COLD void *realloc_sampled(struct smp_bucket *tab, void *p, size_t n)
{
    int was = forget_sampled(tab, (uintptr_t)p);
    void *q;
    if (SMP_LIKELY(n < t.remaining)) {
        t.remaining -= n;
        q = REAL(realloc)(p, n);
    } else {
        q = sampled_ptr(REAL(realloc)(p, n), n);
    }
    if (SMP_UNLIKELY(was && q == NULL && n != 0) && smp_unforget(&g, tab, (uintptr_t)p)) {
        uint64_t ptr = (uintptr_t)p;
        STAP_PROBE1(allocsampler, unfree, ptr);
    }
    return q;
}

static COLD void *realloc_slow(void *p, size_t n)
{
    return sampled_ptr(REAL(realloc)(p, n), n);
}

static COLD void *realloc_boot(void *p, size_t n)
{
    void *q = do_malloc(n);
    if (q) {
        size_t old = boot_size(p);
        __builtin_memcpy(q, p, old < n ? old : n);
    }
    return q;
}

static inline void *do_realloc(void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    if (a == 0)
        return do_malloc(n);
    if (SMP_UNLIKELY(in_boot(a)))
        return realloc_boot(p, n);
    struct smp_bucket *tab = SMP_LOAD(&g_table);
    if (tab != NULL && smp_maybe_sampled(tab, a))
        return realloc_sampled(tab, p, n);
    FAST(realloc, n, (p, n));
    return realloc_slow(p, n);
}

API void *realloc(void *p, size_t n)
{
    return do_realloc(p, n);
}

/* glibc's reallocarray is an overflow check and a jump to realloc@plt; doing the same here (rather
 * than forwarding to the next reallocarray, which would come back into realloc above) counts the
 * bytes once and keeps the next allocator's realloc in charge. */
API void *reallocarray(void *p, size_t n, size_t m)
{
    size_t s;
    if (SMP_UNLIKELY(__builtin_mul_overflow(n, m, &s))) {
        errno = ENOMEM;
        return NULL;
    }
    return do_realloc(p, s);
}

static COLD int posix_memalign_slow(void **pp, size_t al, size_t n)
{
    int r = REAL(posix_memalign)(pp, al, n);
    sampled_ptr(r == 0 ? *pp : NULL, n);
    return r;
}

API int posix_memalign(void **pp, size_t al, size_t n)
{
    FAST(posix_memalign, n, (pp, al, n));
    return posix_memalign_slow(pp, al, n);
}

/* aligned_alloc, memalign, valloc: the request is their size argument. */
#define ALIGNED(name, params, args, n)                                                             \
    static COLD void *name##_slow params                                                           \
    {                                                                                              \
        return sampled_ptr(REAL(name) args, n);                                                    \
    }                                                                                              \
    API void *name params                                                                          \
    {                                                                                              \
        FAST(name, n, args);                                                                       \
        return name##_slow args;                                                                   \
    }
ALIGNED(aligned_alloc, (size_t al, size_t n), (al, n), n)
ALIGNED(memalign, (size_t al, size_t n), (al, n), n)
ALIGNED(valloc, (size_t n), (n), n)

static COLD void *pvalloc_slow(size_t n, size_t s)
{
    return sampled_ptr(REAL(pvalloc)(n), s);
}

API void *pvalloc(size_t n)
{
    /* The request is rounded up to whole pages, as glibc does; one that wraps is never sampled. */
    size_t pg = page_size();
    size_t s = (n + pg - 1) & ~(pg - 1);
    FAST(pvalloc, s, (n));
    return pvalloc_slow(n, s);
}

/* ------------------------------------------------------------------------------------------ */
/* Debugging and test entry points                                                             */

/* At the current mean (the configured one unless the cap raised it). */
API double allocsampler_preload_weight(unsigned long size)
{
    return smp_weight(size, sample_mean());
}

API void allocsampler_preload_stats(unsigned long *sampled, double *weighted_bytes)
{
    if (sampled)
        *sampled = SMP_LOAD(&g.sampled);
    if (weighted_bytes) {
        union smp_dbits v = {.u = SMP_LOAD(&g.weight_bits)};
        *weighted_bytes = v.d;
    }
}

API void allocsampler_preload_counts(unsigned long *freed, unsigned long *dropped)
{
    if (freed)
        *freed = SMP_LOAD(&g.freed);
    if (dropped)
        *dropped = SMP_LOAD(&g.dropped);
}

API void allocsampler_preload_sampling(unsigned long *mean, unsigned long *configured_mean,
                                       unsigned long *mean_changes, unsigned long *max_per_s,
                                       double *weight_var)
{
    uint64_t m = sample_mean();
    if (mean)
        *mean = m;
    if (configured_mean)
        *configured_mean = base_mean();
    if (mean_changes)
        *mean_changes = SMP_LOAD(&g.mean_changes);
    if (max_per_s)
        *max_per_s = SMP_LOAD(&g.max_per_s);
    if (weight_var) {
        union smp_dbits v = {.u = SMP_LOAD(&g.var_bits)};
        *weight_var = v.d;
    }
}

__attribute__((constructor)) static void allocsampler_preload_init(void)
{
    if (REAL(malloc) == stub_malloc)
        resolve();
    read_config();
    /* Gaps drawn before the configuration could be read used the default mean (their mean says
     * so, and their samples would be weighted right): draw this thread's again with the configured
     * one (the process is memoryless, so restarting the countdown is unbiased). */
    t.remaining = 0;
}
