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
 *       before a sampled block is freed, or handed to realloc (before the real realloc runs, since
 *       another thread may receive the address as soon as it does).
 *
 * Environment (read once, at start-up):
 *   ALLOCSAMPLER_SAMPLE_MEAN  mean bytes between samples T, decimal; default 524288; 0, an invalid
 *                             value or one above 2^40 means the default.
 *   ALLOCSAMPLER_MAX_SAMPLES_PER_S
 *                             cap on the process's samples per second, decimal; default 2000;
 *                             0 turns the cap off; an invalid value or one above 10^9 means the
 *                             default. Above the cap the mean is raised (see "Sample-rate cap").
 *
 * Exported besides the interposed functions (for tests and debugging):
 *   double allocsampler_preload_weight(unsigned long size)   weight of a sample of `size` bytes
 *   void allocsampler_preload_stats(unsigned long *sampled, double *weighted_bytes)
 *                             process totals of reported samples and of their weights
 *   void allocsampler_preload_sampling(unsigned long *mean, unsigned long *configured_mean,
 *                                      unsigned long *mean_changes, unsigned long *max_per_s,
 *                                      double *weight_var)
 *                             the mean new gaps are drawn with now, ALLOCSAMPLER_SAMPLE_MEAN, how
 *                             many times the cap changed the mean, the cap (0: none), and the
 *                             Horvitz-Thompson variance estimate of weighted_bytes: the sum over
 *                             reported samples of w^2 (1 - p) = w (w - size). Any pointer may be
 *                             NULL.
 *   unsigned long allocsampler_preload_freed     frees (and reallocs) of sampled blocks reported
 *   unsigned long allocsampler_preload_dropped   samples not reported because the set of sampled
 *                             live addresses had no room (or could not be mapped); such blocks are
 *                             simply not sampled, their frees are not reported either.
 *
 * Sampling: requested bytes are sampled as a Poisson process with mean T. Each thread keeps a
 * countdown of bytes to the next sample point (initial-exec TLS; 0 = not drawn yet); an allocation
 * of S bytes is sampled when the countdown is <= S, after which a fresh exponential gap is drawn.
 * By memorylessness this samples an allocation with probability p = 1 - exp(-S/T) independently of
 * the others, and a sample stands for S / p bytes (Horvitz-Thompson). The weight must agree with
 * sampler/control/weights.py: unbiased_weight(), the project's one definition.
 *
 * Sample-rate cap: a process that allocates tens of GB/s would emit tens of thousands of samples
 * per second, more than a recorder can take. Samples are counted in process-wide windows of
 * max(64, cap/4) samples' worth of time at the cap (at least 250 ms), timed with the vDSO's
 * CLOCK_MONOTONIC_COARSE, all on the sampled path. A window that fills before its time raises the
 * mean by the power of two that brings the measured rate to <= cap/2; a window that ends with a
 * rate <= cap/4 lowers it by the power of two that keeps the rate <= cap/2, never below the
 * configured T. Each thread remembers the mean its current gap was drawn with (t_mean): the sample
 * that ends the gap is weighted with that mean, and the next gap is drawn with the process-wide
 * mean of the moment. Given everything before an allocation, the distance to the next sample point
 * is Exp(t_mean) (memorylessness), so the allocation is sampled with p = 1 - exp(-S/t_mean) and
 * E[weight x sampled] = S whatever the mean did before: the estimate stays unbiased (a martingale
 * argument; the variance terms w^2 (1 - p) stay unbiased too). The unsampled fast path is
 * unchanged: one TLS compare-and-subtract; a raised mean reaches a thread at its next sample, and
 * comes down at the first sample after the rate fell (a process that stops allocating keeps it).
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

#define API __attribute__((visibility("default")))
#define COLD __attribute__((noinline, cold))
#define NOINLINE __attribute__((noinline))
#define TLS __thread __attribute__((tls_model("initial-exec")))
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)
#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

#define DEFAULT_MEAN 524288ULL
#define MAX_MEAN (1ULL << 40)
#define DEFAULT_MAX_PER_S 2000ULL
#define MAX_MAX_PER_S 1000000000ULL

/* ------------------------------------------------------------------------------------------ */
/* Exported counters                                                                           */

API unsigned long allocsampler_preload_dropped;
API unsigned long allocsampler_preload_freed;
static unsigned long g_sampled;
static uint64_t g_weight_bits; /* a double, summed with a CAS loop */
static uint64_t g_var_bits;    /* a double: sum of w (w - size) over reported samples */

/* ------------------------------------------------------------------------------------------ */
/* Per-thread state (initial-exec TLS: one %fs-relative access, never allocates)               */

static TLS uint64_t t_remaining; /* bytes to the next sample point; 0: not drawn yet */
static TLS uint64_t t_mean;      /* mean the current gap was drawn with (sampled path only) */
static TLS uint64_t t_rng;       /* splitmix64 state */
static TLS pid_t t_rng_pid;      /* process that seeded t_rng; a fork makes the child reseed */
static TLS int t_resolving;      /* this thread is inside dlsym */

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

/* ------------------------------------------------------------------------------------------ */
/* The next definitions. Each pointer starts at a stub that resolves all of them with dlsym;    */
/* a stub reached again while this thread is inside dlsym serves the bootstrap buffer.          */

typedef void *malloc_fn(size_t);
typedef void free_fn(void *);
typedef void *calloc_fn(size_t, size_t);
typedef void *realloc_fn(void *, size_t);
typedef int posix_memalign_fn(void **, size_t, size_t);
typedef void *memalign_fn(size_t, size_t);

static void *stub_malloc(size_t);
static void stub_free(void *);
static void *stub_calloc(size_t, size_t);
static void *stub_realloc(void *, size_t);
static int stub_posix_memalign(void **, size_t, size_t);
static void *stub_aligned_alloc(size_t, size_t);
static void *stub_memalign(size_t, size_t);
static void *stub_valloc(size_t);
static void *stub_pvalloc(size_t);

static malloc_fn *real_malloc = stub_malloc;
static free_fn *real_free = stub_free;
static calloc_fn *real_calloc = stub_calloc;
static realloc_fn *real_realloc = stub_realloc;
static posix_memalign_fn *real_posix_memalign = stub_posix_memalign;
static memalign_fn *real_aligned_alloc = stub_aligned_alloc;
static memalign_fn *real_memalign = stub_memalign;
static malloc_fn *real_valloc = stub_valloc;
static malloc_fn *real_pvalloc = stub_pvalloc;

#define REAL(name) (__atomic_load_n(&real_##name, __ATOMIC_RELAXED))

/* Used when the next object does not define a function (never with glibc). */
static void *missing_alloc1(size_t n)
{
    (void)n;
    errno = ENOMEM;
    return NULL;
}
static void *missing_alloc2(size_t a, size_t b)
{
    (void)a;
    (void)b;
    errno = ENOMEM;
    return NULL;
}
static void missing_free(void *p)
{
    (void)p; /* leaked: nothing to hand it to */
}
static void *missing_realloc(void *p, size_t n)
{
    (void)p;
    (void)n;
    errno = ENOMEM;
    return NULL;
}
static int missing_posix_memalign(void **pp, size_t a, size_t n)
{
    (void)pp;
    (void)a;
    (void)n;
    return ENOMEM;
}

#define BIND(name, fallback)                                                                   \
    do {                                                                                       \
        void *f_ = dlsym(RTLD_NEXT, #name);                                                    \
        __typeof__(real_##name) g_ = f_ ? (__typeof__(real_##name))f_ : (fallback);            \
        __atomic_store_n(&real_##name, g_, __ATOMIC_RELEASE);                                  \
    } while (0)

/* Resolves every next definition; a no-op (returning 0) when this thread is already inside. */
static COLD int resolve(void)
{
    if (t_resolving)
        return 0;
    t_resolving = 1;
    int saved = errno;
    BIND(malloc, missing_alloc1);
    BIND(free, missing_free);
    BIND(calloc, missing_alloc2);
    BIND(realloc, missing_realloc);
    BIND(posix_memalign, missing_posix_memalign);
    BIND(aligned_alloc, missing_alloc2);
    BIND(memalign, missing_alloc2);
    BIND(valloc, missing_alloc1);
    BIND(pvalloc, missing_alloc1);
    errno = saved;
    t_resolving = 0;
    return 1;
}

static size_t page_size(void)
{
    static size_t pg;
    size_t v = LOAD(&pg);
    if (unlikely(v == 0)) {
        long r = sysconf(_SC_PAGESIZE);
        v = r > 0 ? (size_t)r : 4096;
        STORE(&pg, v);
    }
    return v;
}

static inline int bad_align(size_t al)
{
    return al == 0 || (al & (al - 1));
}

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

static uint64_t g_base_mean;                  /* ALLOCSAMPLER_SAMPLE_MEAN; 0: not read yet */
static uint64_t g_cur_mean;                   /* mean new gaps are drawn with; 0: not read yet */
static uint64_t g_max_per_s = DEFAULT_MAX_PER_S; /* ALLOCSAMPLER_MAX_SAMPLES_PER_S; 0: no cap */

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
        return DEFAULT_MEAN;
    /* getenv does not allocate */
    uint64_t m = parse_u64(getenv("ALLOCSAMPLER_SAMPLE_MEAN"), MAX_MEAN, 0);
    if (m == 0)
        m = DEFAULT_MEAN;
    STORE(&g_max_per_s, parse_u64(getenv("ALLOCSAMPLER_MAX_SAMPLES_PER_S"), MAX_MAX_PER_S,
                                  DEFAULT_MAX_PER_S));
    STORE(&g_base_mean, m);
    uint64_t unset = 0; /* a mean the cap has already raised stays */
    __atomic_compare_exchange_n(&g_cur_mean, &unset, m, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return LOAD(&g_cur_mean);
}

/* The mean a gap drawn now gets (the configured one unless the cap raised it). */
static inline uint64_t sample_mean(void)
{
    uint64_t m = LOAD(&g_cur_mean);
    return likely(m) ? m : read_config();
}

static inline uint64_t base_mean(void)
{
    uint64_t m = LOAD(&g_base_mean);
    return m ? m : DEFAULT_MEAN;
}

/* ------------------------------------------------------------------------------------------ */
/* Numerics without libm (only on the sampled path)                                            */

static const double LN2 = 0.69314718055994530942;
static const double LN2_HI = 6.93147180369123816490e-01; /* LN2_HI + LN2_LO = ln 2 */
static const double LN2_LO = 1.90821492927058770002e-10;

union dbits {
    double d;
    uint64_t u;
};

/* ln x for finite x > 0 (normal numbers): x = m 2^e with m in [sqrt(1/2), sqrt(2)), and
 * ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172: the odd series converges ~34x per term. */
static double ln_pos(double x)
{
    union dbits v = {.d = x};
    int e = (int)((v.u >> 52) & 0x7ff) - 1023;
    v.u = (v.u & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;
    double m = v.d;
    if (m > 1.4142135623730951) {
        m *= 0.5;
        e += 1;
    }
    double s = (m - 1.0) / (m + 1.0), s2 = s * s, term = s, sum = 0.0;
    for (int k = 1; k <= 27; k += 2) {
        sum += term / k;
        term *= s2;
    }
    return e * LN2 + 2.0 * sum;
}

/* 1 - exp(-x) for x >= 0, to a few ulp: a series below 0.5 (no cancellation), else via exp(-x). */
static double one_minus_exp_neg(double x)
{
    if (x < 0.5) {
        double term = x, sum = x;
        for (int k = 2; k <= 22; k++) {
            term *= -x / k;
            sum += term;
        }
        return sum;
    }
    if (x > 40.0)
        return 1.0; /* exp(-40) < 2^-57: rounds away */
    /* exp(-x) = 2^-k exp(-r), x = k ln2 + r, |r| <= ln2/2 */
    int k = (int)(x / LN2 + 0.5);
    double r = (x - k * LN2_HI) - k * LN2_LO;
    double term = 1.0, sum = 1.0;
    for (int i = 1; i <= 20; i++) {
        term *= -r / i;
        sum += term;
    }
    union dbits scale = {.u = (uint64_t)(1023 - k) << 52};
    return 1.0 - sum * scale.d;
}

/* Bytes one sampled allocation of `size` stands for: size / (1 - exp(-size/T)).
 * Must agree with sampler/control/weights.py: unbiased_weight(size, T). */
static double weight_for(uint64_t size, uint64_t mean)
{
    if (size == 0)
        return 0.0;
    return (double)size / one_minus_exp_neg((double)size / (double)mean);
}

/* ------------------------------------------------------------------------------------------ */
/* Random gaps                                                                                 */

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t g_seed_counter;

static void seed_thread(pid_t pid)
{
    struct timespec ts = {0, 0};
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO; no allocation */
    uint64_t tid = (uint64_t)syscall(SYS_gettid);
    uint64_t ctr = __atomic_fetch_add(&g_seed_counter, 1, __ATOMIC_RELAXED);
    t_rng = mix64(tid + 0x9e3779b97f4a7c15ULL) ^ mix64((uint64_t)(uintptr_t)&t_rng + ctr) ^
            mix64((uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec) ^ ((uint64_t)pid << 32);
    t_rng_pid = pid;
}

static uint64_t next_random(void) /* splitmix64 */
{
    pid_t pid = getpid();
    if (unlikely(pid != t_rng_pid))
        seed_thread(pid); /* first use in this thread, or first since a fork */
    t_rng += 0x9e3779b97f4a7c15ULL;
    return mix64(t_rng);
}

/* An exponential gap with mean T, rounded up to whole bytes (exact for integer sizes: the gap
 * G exceeds S iff ceil(G) exceeds S), at least 1 so that the countdown is never the 0 sentinel. */
static uint64_t draw_gap(void)
{
    uint64_t mean = sample_mean();
    t_mean = mean; /* the sample that ends this gap is weighted with it */
    double u = (double)((next_random() >> 11) + 1) * 0x1.0p-53; /* (0, 1] */
    double g = -(double)mean * ln_pos(u);
    if (!(g < 0x1.0p62))
        return 1ULL << 62;
    uint64_t r = (uint64_t)g;
    if ((double)r < g)
        r++;
    return r ? r : 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Sample-rate cap (sampled path only; see the top of the file)                                */

#define NS_PER_S 1000000000ULL
#define WINDOW_MIN_SAMPLES 64ULL   /* a window holds at least this many samples at the cap */
#define RATE_MIN_NS 4000000ULL     /* coarse clock resolution (a jiffy at HZ=250): rate floor */
#define MAX_STEP_LOG2 20           /* one change multiplies or divides the mean by <= 2^20 */

static uint64_t g_win_start; /* coarse monotonic ns at which the window began (0: none yet) */
static uint64_t g_win_count; /* samples in the window */
static unsigned long g_mean_changes;

static inline uint64_t coarse_ns(void)
{
    struct timespec ts = {0, 0};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); /* vDSO, ~10 ns; never a system call */
    return (uint64_t)ts.tv_sec * NS_PER_S + (uint64_t)ts.tv_nsec;
}

/* Counts one sample against the cap; the thread that ends a window may change the mean. */
static COLD void rate_tick(uint64_t cap)
{
    uint64_t budget = cap / 4 > WINDOW_MIN_SAMPLES ? cap / 4 : WINDOW_MIN_SAMPLES;
    uint64_t window_ns = budget * NS_PER_S / cap; /* >= 250 ms */
    uint64_t start = __atomic_load_n(&g_win_start, __ATOMIC_ACQUIRE);
    uint64_t n = __atomic_add_fetch(&g_win_count, 1, __ATOMIC_RELAXED);
    uint64_t now = coarse_ns();
    uint64_t elapsed = now > start ? now - start : 0;
    int over = elapsed < window_ns; /* still inside the window */
    if (over && n != budget + 1)
        return; /* within budget (exactly one sample sees the budget overrun) */
    if (!__atomic_compare_exchange_n(&g_win_start, &start, now, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_RELAXED))
        return; /* another thread ended this window */
    STORE(&g_win_count, 0);
    uint64_t span = elapsed > RATE_MIN_NS ? elapsed : RATE_MIN_NS;
    double rate = (double)n * (double)NS_PER_S / (double)span; /* samples/s in the window */
    double half = 0.5 * (double)cap;
    uint64_t cur = sample_mean(), base = base_mean(), next = cur;
    if (over) { /* too fast: the smallest 2^k, k >= 1, that brings the rate to <= cap/2 */
        int k = 1;
        while (k < MAX_STEP_LOG2 && rate > half * (double)(1ULL << k))
            k++;
        next = cur >= (MAX_MEAN >> k) ? MAX_MEAN : cur << k;
    } else if (cur > base && rate <= 0.25 * (double)cap) {
        /* well below: the largest 2^k, k >= 1, that keeps the rate <= cap/2 */
        int k = 1;
        while (k < MAX_STEP_LOG2 && rate * (double)(2ULL << k) <= half)
            k++;
        next = cur >> k;
        if (next < base)
            next = base;
    }
    if (next != cur) {
        STORE(&g_cur_mean, next);
        __atomic_fetch_add(&g_mean_changes, 1, __ATOMIC_RELAXED);
    }
}

/* Called when size >= t_remaining (the inline fast paths handle the rest). Returns 0 when not
 * sampled, else the mean of the gap this allocation ended, which its weight must use. */
static uint64_t decide(size_t size)
{
    if (size == 0)
        return 0; /* zero-size requests are never sampled */
    uint64_t rem = t_remaining;
    if (rem == 0) { /* this thread's first decision: draw its first gap */
        rem = draw_gap();
        if (size < rem) {
            t_remaining = rem - size;
            return 0;
        }
    }
    uint64_t mean = t_mean;
    if (unlikely(mean == 0))
        mean = sample_mean(); /* cannot happen: every drawn gap set it */
    uint64_t cap = LOAD(&g_max_per_s);
    if (cap)
        rate_tick(cap);       /* before the draw: the next gap gets the new mean */
    t_remaining = draw_gap(); /* the next point after this allocation: memoryless */
    return mean;
}

/* ------------------------------------------------------------------------------------------ */
/* Set of sampled live addresses                                                               */
/*                                                                                             */
/* Open addressing over 64-byte buckets (one cache line: an overflow count and 7 keys; 0 is an   */
/* empty slot), 2^15 buckets = 2 MiB (2^18 words), mapped with MAP_NORESERVE on the first       */
/* sample, so that a process that never samples pays nothing. A key lives in its home bucket or  */
/* up to MAX_PROBE - 1 buckets after it; each bucket it passed counts it in `overflow`, so a     */
/* lookup continues past a bucket only while that count is nonzero. Deletion just empties the    */
/* slot and decrements the counts it added: no tombstones, so nothing degrades over time, and a  */
/* lookup of an unsampled pointer reads one cache line. Insert is a CAS into an empty slot.      */
/* Counts are incremented before the key is placed, so a lookup that happens after the insert    */
/* (the application passes the pointer on) sees them.                                           */
/* In front of it, one byte per bucket counts the keys whose home bucket it is (at most          */
/* MAX_PROBE x SLOTS = 56): a free of an unsampled pointer reads that 32 KiB array, which stays   */
/* in cache, instead of a random line of the 2 MiB table (measured: ~12 ns per free saved on a  */
/* malloc/free loop).                                                                            */

#define SLOTS 7
#define NBUCKETS_LOG2 15
#define NBUCKETS (1u << NBUCKETS_LOG2)
#define BUCKET_MASK (NBUCKETS - 1)
#define MAX_PROBE 8

struct bucket {
    uintptr_t overflow;
    uintptr_t key[SLOTS];
} __attribute__((aligned(64)));

static struct bucket *g_table;

static inline size_t home_bucket(uintptr_t a)
{
    return (size_t)(((uint64_t)(a >> 4) * 0x9e3779b97f4a7c15ULL) >> (64 - NBUCKETS_LOG2));
}

static inline uint8_t *homes_of(struct bucket *t)
{
    return (uint8_t *)(t + NBUCKETS);
}

static inline int bucket_has(const struct bucket *b, uintptr_t a)
{
    int hit = 0;
#pragma GCC unroll 8
    for (int i = 0; i < SLOTS; i++)
        hit |= LOAD(&b->key[i]) == a;
    return hit;
}

static NOINLINE int table_has_far(const struct bucket *t, size_t h, uintptr_t a)
{
    for (int d = 1; d < MAX_PROBE; d++) {
        const struct bucket *b = &t[(h + d) & BUCKET_MASK];
        if (bucket_has(b, a))
            return 1;
        if (LOAD(&b->overflow) == 0)
            return 0;
    }
    return 0;
}

/* a != 0 */
static inline int table_has(const struct bucket *t, uintptr_t a)
{
    size_t h = home_bucket(a);
    const struct bucket *b = &t[h];
    if (bucket_has(b, a))
        return 1;
    if (likely(LOAD(&b->overflow) == 0))
        return 0;
    return table_has_far(t, h, a);
}

static int table_insert(struct bucket *t, uintptr_t a)
{
    if (table_has(t, a))
        return 1; /* left over from a free we never saw: keep a single entry */
    size_t h = home_bucket(a);
    __atomic_fetch_add(&homes_of(t)[h], 1, __ATOMIC_SEQ_CST);
    for (int d = 0; d < MAX_PROBE; d++) {
        struct bucket *b = &t[(h + d) & BUCKET_MASK];
        for (int i = 0; i < SLOTS; i++) {
            uintptr_t cur = LOAD(&b->key[i]);
            if (cur == 0 && __atomic_compare_exchange_n(&b->key[i], &cur, a, 0, __ATOMIC_SEQ_CST,
                                                        __ATOMIC_RELAXED))
                return 1;
        }
        __atomic_fetch_add(&b->overflow, 1, __ATOMIC_SEQ_CST);
    }
    for (int d = 0; d < MAX_PROBE; d++)
        __atomic_fetch_sub(&t[(h + d) & BUCKET_MASK].overflow, 1, __ATOMIC_RELAXED);
    __atomic_fetch_sub(&homes_of(t)[h], 1, __ATOMIC_RELAXED);
    return 0;
}

static int table_remove(struct bucket *t, uintptr_t a)
{
    size_t h = home_bucket(a);
    for (int d = 0; d < MAX_PROBE; d++) {
        struct bucket *b = &t[(h + d) & BUCKET_MASK];
        for (int i = 0; i < SLOTS; i++) {
            uintptr_t cur = a;
            if (LOAD(&b->key[i]) == a && __atomic_compare_exchange_n(&b->key[i], &cur, 0, 0,
                                                                     __ATOMIC_SEQ_CST,
                                                                     __ATOMIC_RELAXED)) {
                for (int e = 0; e < d; e++)
                    __atomic_fetch_sub(&t[(h + e) & BUCKET_MASK].overflow, 1, __ATOMIC_RELAXED);
                __atomic_fetch_sub(&homes_of(t)[h], 1, __ATOMIC_RELAXED);
                return 1;
            }
        }
        if (LOAD(&b->overflow) == 0)
            return 0;
    }
    return 0;
}

static struct bucket *table_get(void)
{
    struct bucket *t = __atomic_load_n(&g_table, __ATOMIC_ACQUIRE);
    if (t)
        return t;
    size_t len = (size_t)NBUCKETS * (sizeof(struct bucket) + 1);     /* + the home counts */
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    struct bucket *expected = NULL;
    if (!__atomic_compare_exchange_n(&g_table, &expected, (struct bucket *)m, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE)) {
        munmap(m, len); /* another thread was first */
        return expected;
    }
    return (struct bucket *)m;
}

/* ------------------------------------------------------------------------------------------ */
/* Reporting (sampled path only)                                                               */

static void add_double(uint64_t *bits, double x)
{
    uint64_t old = LOAD(bits);
    for (;;) {
        union dbits v = {.u = old};
        v.d += x;
        if (__atomic_compare_exchange_n(bits, &old, v.u, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return;
    }
}

/* `mean`: the mean of the gap the allocation ended (decide's result). */
static COLD void report_alloc(void *p, size_t size, uint64_t mean)
{
    uintptr_t a = (uintptr_t)p;
    if (a == 0 || in_boot(a))
        return; /* failed allocations are not reported */
    int saved = errno;
    struct bucket *t = table_get();
    if (t == NULL || !table_insert(t, a)) {
        __atomic_fetch_add(&allocsampler_preload_dropped, 1, __ATOMIC_RELAXED);
        errno = saved;
        return;
    }
    double w = weight_for(size, mean);
    __atomic_fetch_add(&g_sampled, 1, __ATOMIC_RELAXED);
    add_double(&g_weight_bits, w);
    add_double(&g_var_bits, w * (w - (double)size)); /* w^2 (1 - p), p = size / w */
    uint64_t ptr = a, sz = size;
    uint64_t weighted = w >= 0x1.0p64 ? UINT64_MAX : (uint64_t)(w + 0.5);
    STAP_PROBE3(otel_memory, alloc, ptr, sz, weighted);
    errno = saved;
}

/* Removes a sampled address from the set and reports its free (before the real free/realloc). */
static COLD void forget_sampled(struct bucket *t, uintptr_t a)
{
    if (table_remove(t, a)) {
        __atomic_fetch_add(&allocsampler_preload_freed, 1, __ATOMIC_RELAXED);
        uint64_t ptr = a;
        STAP_PROBE1(otel_memory, free, ptr);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* The interposed functions. Fast paths: one TLS compare-and-subtract, then a tail call.       */

static COLD void *malloc_slow(size_t n)
{
    void *p = REAL(malloc)(n);
    uint64_t mean = decide(n);
    if (mean)
        report_alloc(p, n, mean);
    return p;
}

static inline void *do_malloc(size_t n)
{
    if (likely(n < t_remaining)) {
        t_remaining -= n;
        return REAL(malloc)(n);
    }
    return malloc_slow(n);
}

API void *malloc(size_t n)
{
    return do_malloc(n);
}

static COLD void free_sampled(struct bucket *t, void *p)
{
    forget_sampled(t, (uintptr_t)p);
    REAL(free)(p);
}

API void free(void *p)
{
    uintptr_t a = (uintptr_t)p;
    if (unlikely(in_boot(a)))
        return; /* bootstrap memory is never reused */
    struct bucket *t = LOAD(&g_table);
    if (t != NULL && a != 0 && LOAD(&homes_of(t)[home_bucket(a)]) != 0 && table_has(t, a)) {
        free_sampled(t, p);
        return;
    }
    REAL(free)(p);
}

static COLD void *calloc_slow(size_t n, size_t m, size_t s)
{
    void *p = REAL(calloc)(n, m);
    uint64_t mean = decide(s);
    if (mean)
        report_alloc(p, s, mean);
    return p;
}

API void *calloc(size_t n, size_t m)
{
    size_t s;
    if (unlikely(__builtin_mul_overflow(n, m, &s)))
        return REAL(calloc)(n, m); /* fails with ENOMEM there; never sampled */
    if (likely(s < t_remaining)) {
        t_remaining -= s;
        return REAL(calloc)(n, m);
    }
    return calloc_slow(n, m, s);
}

static COLD void *realloc_slow(void *p, size_t n)
{
    void *q = REAL(realloc)(p, n);
    uint64_t mean = decide(n);
    if (mean)
        report_alloc(q, n, mean);
    return q;
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
    if (unlikely(in_boot(a)))
        return realloc_boot(p, n);
    struct bucket *t = LOAD(&g_table);
    if (t != NULL && LOAD(&homes_of(t)[home_bucket(a)]) != 0 && table_has(t, a))
        forget_sampled(t, a); /* before the real realloc: the address may be reused at once */
    if (likely(n < t_remaining)) {
        t_remaining -= n;
        return REAL(realloc)(p, n);
    }
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
    if (unlikely(__builtin_mul_overflow(n, m, &s))) {
        errno = ENOMEM;
        return NULL;
    }
    return do_realloc(p, s);
}

static COLD int posix_memalign_slow(void **pp, size_t al, size_t n)
{
    int r = REAL(posix_memalign)(pp, al, n);
    uint64_t mean = decide(n);
    if (mean && r == 0)
        report_alloc(*pp, n, mean);
    return r;
}

API int posix_memalign(void **pp, size_t al, size_t n)
{
    if (likely(n < t_remaining)) {
        t_remaining -= n;
        return REAL(posix_memalign)(pp, al, n);
    }
    return posix_memalign_slow(pp, al, n);
}

static COLD void *aligned_alloc_slow(size_t al, size_t n)
{
    void *p = REAL(aligned_alloc)(al, n);
    uint64_t mean = decide(n);
    if (mean)
        report_alloc(p, n, mean);
    return p;
}

API void *aligned_alloc(size_t al, size_t n)
{
    if (likely(n < t_remaining)) {
        t_remaining -= n;
        return REAL(aligned_alloc)(al, n);
    }
    return aligned_alloc_slow(al, n);
}

static COLD void *memalign_slow(size_t al, size_t n)
{
    void *p = REAL(memalign)(al, n);
    uint64_t mean = decide(n);
    if (mean)
        report_alloc(p, n, mean);
    return p;
}

API void *memalign(size_t al, size_t n)
{
    if (likely(n < t_remaining)) {
        t_remaining -= n;
        return REAL(memalign)(al, n);
    }
    return memalign_slow(al, n);
}

static COLD void *valloc_slow(size_t n)
{
    void *p = REAL(valloc)(n);
    uint64_t mean = decide(n);
    if (mean)
        report_alloc(p, n, mean);
    return p;
}

API void *valloc(size_t n)
{
    if (likely(n < t_remaining)) {
        t_remaining -= n;
        return REAL(valloc)(n);
    }
    return valloc_slow(n);
}

static COLD void *pvalloc_slow(size_t n, size_t s)
{
    void *p = REAL(pvalloc)(n);
    uint64_t mean = decide(s);
    if (mean)
        report_alloc(p, s, mean);
    return p;
}

API void *pvalloc(size_t n)
{
    /* The request is rounded up to whole pages, as glibc does; one that wraps is never sampled. */
    size_t pg = page_size();
    size_t s = (n + pg - 1) & ~(pg - 1);
    if (likely(s < t_remaining)) {
        t_remaining -= s;
        return REAL(pvalloc)(n);
    }
    return pvalloc_slow(n, s);
}

/* ------------------------------------------------------------------------------------------ */
/* Debugging and test entry points                                                             */

/* At the current mean (the configured one unless the cap raised it). */
API double allocsampler_preload_weight(unsigned long size)
{
    return weight_for(size, sample_mean());
}

API void allocsampler_preload_stats(unsigned long *sampled, double *weighted_bytes)
{
    if (sampled)
        *sampled = LOAD(&g_sampled);
    if (weighted_bytes) {
        union dbits v = {.u = LOAD(&g_weight_bits)};
        *weighted_bytes = v.d;
    }
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
        *mean_changes = LOAD(&g_mean_changes);
    if (max_per_s)
        *max_per_s = LOAD(&g_max_per_s);
    if (weight_var) {
        union dbits v = {.u = LOAD(&g_var_bits)};
        *weight_var = v.d;
    }
}

__attribute__((constructor)) static void allocsampler_preload_init(void)
{
    if (REAL(malloc) == stub_malloc)
        resolve();
    read_config();
    /* Gaps drawn before the configuration could be read used the default mean (their t_mean says
     * so, and their samples would be weighted right): draw this thread's again with the configured
     * one (the process is memoryless, so restarting the countdown is unbiased). */
    t_remaining = 0;
}
