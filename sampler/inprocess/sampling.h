/*
 * The in-process sampling core shared by the preload shim (preload.c) and the injected sampler
 * (inject.c): which allocations are sampled, what each sample weighs, the sample-rate cap, and the
 * set of sampled live addresses. Freestanding: no libc, no TLS, no locks, atomics only; the
 * includer owns the state (where a thread's countdown lives, the process-wide counters), the
 * clock and the probes. Its constants and structs are mirrored in sampler/inprocess/abi.py
 * (checked by tests/bpf/test_abi.py).
 *
 * Sampling: requested bytes are sampled as a Poisson process with mean T. Each thread keeps a
 * countdown of bytes to the next sample point (0 = not drawn yet); an allocation of S bytes is
 * sampled when the countdown is <= S, after which a fresh exponential gap is drawn. By
 * memorylessness this samples an allocation with probability p = 1 - exp(-S/T) independently of
 * the others, and a sample stands for S / p bytes (Horvitz-Thompson). The weight must agree with
 * sampler/control/weights.py: unbiased_weight(), the project's one definition.
 *
 * Sample-rate cap: a process that allocates tens of GB/s would emit tens of thousands of samples
 * per second, more than a recorder can take. Samples are counted in process-wide windows of
 * max(64, cap/4) samples' worth of time at the cap (at least 250 ms), all on the sampled path. A
 * window that fills before its time raises the mean by the power of two that brings the measured
 * rate to <= cap/2; a window that ends with a rate <= cap/4 lowers it by the power of two that
 * keeps the rate <= cap/2, never below the configured T. Each thread remembers the mean its
 * current gap was drawn with (smp_thread.mean): the sample that ends the gap is weighted with
 * that mean, and the next gap is drawn with the process-wide mean of the moment. Given everything
 * before an allocation, the distance to the next sample point is Exp(mean) (memorylessness), so
 * the allocation is sampled with p = 1 - exp(-S/mean) and E[weight x sampled] = S whatever the
 * mean did before: the estimate stays unbiased (a martingale argument; the variance terms
 * w^2 (1 - p) stay unbiased too). The unsampled fast path is the includer's: one compare and
 * subtract of the thread's countdown.
 *
 * Set of sampled live addresses: open addressing over 64-byte buckets (one cache line: an
 * overflow count and 7 keys; 0 is an empty slot), SMP_NBUCKETS buckets (2 MiB), then one byte
 * per bucket counting the keys whose home bucket it is (at most SMP_MAX_PROBE x SMP_SLOTS = 56):
 * a free of an unsampled pointer reads that 32 KiB array, which stays in cache, instead of a
 * random line of the 2 MiB table. A key lives in its home bucket or up to SMP_MAX_PROBE - 1
 * buckets after it; each bucket it passed counts it in `overflow`, so a lookup continues past a
 * bucket only while that count is nonzero. Deletion empties the slot and decrements the counts it
 * added: no tombstones, nothing degrades over time. Insert is a CAS into an empty slot; counts are
 * incremented before the key is placed, so a lookup after the insert (the application passes the
 * pointer on) sees them. A full neighbourhood drops the sample (counted), never corrupts.
 */
#ifndef ALLOCSAMPLER_SAMPLING_H
#define ALLOCSAMPLER_SAMPLING_H

#include <stddef.h>
#include <stdint.h>

#define SMP_LIKELY(x) __builtin_expect(!!(x), 1)
#define SMP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define SMP_LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define SMP_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

#define SMP_DEFAULT_MEAN 524288ULL
#define SMP_MAX_MEAN (1ULL << 40)
#define SMP_DEFAULT_MAX_PER_S 2000ULL
#define SMP_MAX_MAX_PER_S 1000000000ULL

/* One thread's sampling state (the shim: initial-exec TLS; the injected sampler: a slot). */
struct smp_thread {
    uint64_t remaining; /* bytes to the next sample point; 0: not drawn yet */
    uint64_t mean;      /* mean the current gap was drawn with */
    uint64_t rng;       /* splitmix64 state */
    uint64_t seeded;    /* the includer's seeding mark (the shim: the pid that seeded rng) */
};

/* The process's sampling state and counters. */
struct smp_process {
    uint64_t base_mean;     /* the configured mean T (0: not configured yet) */
    uint64_t cur_mean;      /* the mean new gaps are drawn with (0: not configured yet) */
    uint64_t max_per_s;     /* the sample-rate cap (0: none) */
    uint64_t win_start;     /* coarse monotonic ns at which the cap's window began (0: none yet) */
    uint64_t win_count;     /* samples in the window */
    uint64_t mean_changes;  /* how many times the cap changed the mean */
    uint64_t sampled;       /* samples reported */
    uint64_t freed;         /* frees (and reallocs) of sampled blocks reported */
    uint64_t dropped;       /* samples not reported: the set of sampled addresses had no room */
    uint64_t weight_bits;   /* a double: the sum of reported weights */
    uint64_t var_bits;      /* a double: the sum of w (w - size) over reported samples */
    uint64_t seed_counter;  /* tells apart threads seeded at the same moment */
};

union smp_dbits {
    double d;
    uint64_t u;
};

/* ------------------------------------------------------------------------------------------ */
/* Numerics without libm (only on the sampled path)                                            */

static const double SMP_LN2 = 0.69314718055994530942;
static const double SMP_LN2_HI = 6.93147180369123816490e-01; /* LN2_HI + LN2_LO = ln 2 */
static const double SMP_LN2_LO = 1.90821492927058770002e-10;

/* ln x for finite x > 0 (normal numbers): x = m 2^e with m in [sqrt(1/2), sqrt(2)), and
 * ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172: the odd series converges ~34x per term. */
static double smp_ln(double x)
{
    union smp_dbits v = {.d = x};
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
    return e * SMP_LN2 + 2.0 * sum;
}

/* 1 - exp(-x) for x >= 0, to a few ulp: a series below 0.5 (no cancellation), else via exp(-x). */
static double smp_one_minus_exp_neg(double x)
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
    int k = (int)(x / SMP_LN2 + 0.5);
    double r = (x - k * SMP_LN2_HI) - k * SMP_LN2_LO;
    double term = 1.0, sum = 1.0;
    for (int i = 1; i <= 20; i++) {
        term *= -r / i;
        sum += term;
    }
    union smp_dbits scale = {.u = (uint64_t)(1023 - k) << 52};
    return 1.0 - sum * scale.d;
}

/* Bytes one sampled allocation of `size` stands for: size / (1 - exp(-size/mean)).
 * Must agree with sampler/control/weights.py: unbiased_weight(size, mean). */
static double smp_weight(uint64_t size, uint64_t mean)
{
    if (size == 0)
        return 0.0;
    return (double)size / smp_one_minus_exp_neg((double)size / (double)mean);
}

/* ------------------------------------------------------------------------------------------ */
/* Random gaps                                                                                 */

static inline uint64_t smp_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* An exponential gap with mean `mean`, rounded up to whole bytes (exact for integer sizes: the
 * gap G exceeds S iff ceil(G) exceeds S), at least 1 so that the countdown is never the 0
 * sentinel. Records the mean in t: the sample that ends this gap is weighted with it. */
static uint64_t smp_draw_gap(struct smp_thread *t, uint64_t mean)
{
    t->mean = mean;
    t->rng += 0x9e3779b97f4a7c15ULL; /* splitmix64 */
    double u = (double)((smp_mix64(t->rng) >> 11) + 1) * 0x1.0p-53; /* (0, 1] */
    double g = -(double)mean * smp_ln(u);
    if (!(g < 0x1.0p62))
        return 1ULL << 62;
    uint64_t r = (uint64_t)g;
    if ((double)r < g)
        r++;
    return r ? r : 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Sample-rate cap (sampled path only)                                                         */

#define SMP_NS_PER_S 1000000000ULL
#define SMP_WINDOW_MIN_SAMPLES 64ULL   /* a window holds at least this many samples at the cap */
#define SMP_RATE_MIN_NS 4000000ULL     /* coarse clock resolution (a jiffy at HZ=250): rate floor */
#define SMP_MAX_STEP_LOG2 20           /* one change multiplies or divides the mean by <= 2^20 */

/* Counts one sample against the cap at time `now` (coarse monotonic ns); the thread that ends a
 * window may change the mean. */
static void smp_rate_tick(struct smp_process *p, uint64_t cap, uint64_t now)
{
    uint64_t budget = cap / 4 > SMP_WINDOW_MIN_SAMPLES ? cap / 4 : SMP_WINDOW_MIN_SAMPLES;
    uint64_t window_ns = budget * SMP_NS_PER_S / cap; /* >= 250 ms */
    uint64_t start = __atomic_load_n(&p->win_start, __ATOMIC_ACQUIRE);
    uint64_t n = __atomic_add_fetch(&p->win_count, 1, __ATOMIC_RELAXED);
    uint64_t elapsed = now > start ? now - start : 0;
    int over = elapsed < window_ns; /* still inside the window */
    if (over && n != budget + 1)
        return; /* within budget (exactly one sample sees the budget overrun) */
    if (!__atomic_compare_exchange_n(&p->win_start, &start, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        return; /* another thread ended this window */
    SMP_STORE(&p->win_count, 0);
    uint64_t span = elapsed > SMP_RATE_MIN_NS ? elapsed : SMP_RATE_MIN_NS;
    double rate = (double)n * (double)SMP_NS_PER_S / (double)span; /* samples/s in the window */
    double half = 0.5 * (double)cap;
    uint64_t cur = SMP_LOAD(&p->cur_mean), base = SMP_LOAD(&p->base_mean), next = cur;
    if (over) { /* too fast: the smallest 2^k, k >= 1, that brings the rate to <= cap/2 */
        int k = 1;
        while (k < SMP_MAX_STEP_LOG2 && rate > half * (double)(1ULL << k))
            k++;
        next = cur >= (SMP_MAX_MEAN >> k) ? SMP_MAX_MEAN : cur << k;
    } else if (cur > base && rate <= 0.25 * (double)cap) {
        /* well below: the largest 2^k, k >= 1, that keeps the rate <= cap/2 */
        int k = 1;
        while (k < SMP_MAX_STEP_LOG2 && rate * (double)(2ULL << k) <= half)
            k++;
        next = cur >> k;
        if (next < base)
            next = base;
    }
    if (next != cur) {
        SMP_STORE(&p->cur_mean, next);
        __atomic_fetch_add(&p->mean_changes, 1, __ATOMIC_RELAXED);
    }
}

/* Called when size >= t->remaining (the includer's inline fast path handles the rest), with
 * t->rng seeded. Returns 0 when not sampled, else the mean of the gap this allocation ended,
 * which its weight must use. `now` gives the coarse monotonic ns (called only under a cap). */
static uint64_t smp_decide(struct smp_thread *t, struct smp_process *p, size_t size, uint64_t (*now)(void))
{
    if (size == 0)
        return 0; /* zero-size requests are never sampled */
    uint64_t rem = t->remaining;
    if (rem == 0) { /* this thread's first decision: draw its first gap */
        rem = smp_draw_gap(t, SMP_LOAD(&p->cur_mean));
        if (size < rem) {
            t->remaining = rem - size;
            return 0;
        }
    }
    uint64_t mean = t->mean;
    uint64_t cap = SMP_LOAD(&p->max_per_s);
    if (cap && now)
        smp_rate_tick(p, cap, now()); /* before the draw: the next gap gets the new mean */
    t->remaining = smp_draw_gap(t, SMP_LOAD(&p->cur_mean)); /* the next point: memoryless */
    return mean;
}

/* ------------------------------------------------------------------------------------------ */
/* Set of sampled live addresses (see the top of the file)                                     */

#define SMP_SLOTS 7
#define SMP_NBUCKETS_LOG2 15
#define SMP_NBUCKETS (1u << SMP_NBUCKETS_LOG2)
#define SMP_BUCKET_MASK (SMP_NBUCKETS - 1)
#define SMP_MAX_PROBE 8

struct smp_bucket {
    uintptr_t overflow;
    uintptr_t key[SMP_SLOTS];
} __attribute__((aligned(64)));

/* Bytes of a set: the buckets, then one home count per bucket. */
#define SMP_TABLE_BYTES ((size_t)SMP_NBUCKETS * (sizeof(struct smp_bucket) + 1))

static inline size_t smp_home(uintptr_t a)
{
    return (size_t)(((uint64_t)(a >> 4) * 0x9e3779b97f4a7c15ULL) >> (64 - SMP_NBUCKETS_LOG2));
}

static inline uint8_t *smp_homes(struct smp_bucket *t)
{
    return (uint8_t *)(t + SMP_NBUCKETS);
}

static inline int smp_bucket_has(const struct smp_bucket *b, uintptr_t a)
{
    int hit = 0;
#pragma GCC unroll 8
    for (int i = 0; i < SMP_SLOTS; i++)
        hit |= SMP_LOAD(&b->key[i]) == a;
    return hit;
}

static __attribute__((noinline)) int smp_table_has_far(const struct smp_bucket *t, size_t h, uintptr_t a)
{
    for (int d = 1; d < SMP_MAX_PROBE; d++) {
        const struct smp_bucket *b = &t[(h + d) & SMP_BUCKET_MASK];
        if (smp_bucket_has(b, a))
            return 1;
        if (SMP_LOAD(&b->overflow) == 0)
            return 0;
    }
    return 0;
}

/* a != 0 */
static inline int smp_table_has(const struct smp_bucket *t, uintptr_t a)
{
    size_t h = smp_home(a);
    const struct smp_bucket *b = &t[h];
    if (smp_bucket_has(b, a))
        return 1;
    if (SMP_LIKELY(SMP_LOAD(&b->overflow) == 0))
        return 0;
    return smp_table_has_far(t, h, a);
}

/* The fast test of a free: is `a` (nonzero) possibly sampled? One byte of the home counts, then
 * the bucket only when some key lives there. */
static inline int smp_maybe_sampled(struct smp_bucket *t, uintptr_t a)
{
    return SMP_LOAD(&smp_homes(t)[smp_home(a)]) != 0 && smp_table_has(t, a);
}

static int smp_table_insert(struct smp_bucket *t, uintptr_t a)
{
    if (smp_table_has(t, a))
        return 1; /* left over from a free we never saw: keep a single entry */
    size_t h = smp_home(a);
    __atomic_fetch_add(&smp_homes(t)[h], 1, __ATOMIC_SEQ_CST);
    for (int d = 0; d < SMP_MAX_PROBE; d++) {
        struct smp_bucket *b = &t[(h + d) & SMP_BUCKET_MASK];
        for (int i = 0; i < SMP_SLOTS; i++) {
            uintptr_t cur = SMP_LOAD(&b->key[i]);
            if (cur == 0 && __atomic_compare_exchange_n(&b->key[i], &cur, a, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
                return 1;
        }
        __atomic_fetch_add(&b->overflow, 1, __ATOMIC_SEQ_CST);
    }
    for (int d = 0; d < SMP_MAX_PROBE; d++)
        __atomic_fetch_sub(&t[(h + d) & SMP_BUCKET_MASK].overflow, 1, __ATOMIC_RELAXED);
    __atomic_fetch_sub(&smp_homes(t)[h], 1, __ATOMIC_RELAXED);
    return 0;
}

static int smp_table_remove(struct smp_bucket *t, uintptr_t a)
{
    size_t h = smp_home(a);
    for (int d = 0; d < SMP_MAX_PROBE; d++) {
        struct smp_bucket *b = &t[(h + d) & SMP_BUCKET_MASK];
        for (int i = 0; i < SMP_SLOTS; i++) {
            uintptr_t cur = a;
            if (SMP_LOAD(&b->key[i]) == a &&
                __atomic_compare_exchange_n(&b->key[i], &cur, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
                for (int e = 0; e < d; e++)
                    __atomic_fetch_sub(&t[(h + e) & SMP_BUCKET_MASK].overflow, 1, __ATOMIC_RELAXED);
                __atomic_fetch_sub(&smp_homes(t)[h], 1, __ATOMIC_RELAXED);
                return 1;
            }
        }
        if (SMP_LOAD(&b->overflow) == 0)
            return 0;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Reporting (sampled path only)                                                               */

static void smp_add_double(uint64_t *bits, double x)
{
    uint64_t old = SMP_LOAD(bits);
    for (;;) {
        union smp_dbits v = {.u = old};
        v.d += x;
        if (__atomic_compare_exchange_n(bits, &old, v.u, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return;
    }
}

/* Records a sampled allocation of `size` at `a` (nonzero) drawn with `mean`: into the set and the
 * counters. Returns the weighted bytes for the probe, 0 when the set had no room (dropped). */
static uint64_t smp_sampled(struct smp_process *p, struct smp_bucket *t, uintptr_t a, size_t size,
                            uint64_t mean)
{
    if (t == NULL || !smp_table_insert(t, a)) {
        __atomic_fetch_add(&p->dropped, 1, __ATOMIC_RELAXED);
        return 0;
    }
    double w = smp_weight(size, mean);
    __atomic_fetch_add(&p->sampled, 1, __ATOMIC_RELAXED);
    smp_add_double(&p->weight_bits, w);
    smp_add_double(&p->var_bits, w * (w - (double)size)); /* w^2 (1 - p), p = size / w */
    uint64_t weighted = w >= 0x1.0p64 ? UINT64_MAX : (uint64_t)(w + 0.5);
    return weighted ? weighted : 1;
}

/* Removes a sampled address from the set; returns whether it was there (its free is reported). */
static int smp_forget(struct smp_process *p, struct smp_bucket *t, uintptr_t a)
{
    if (!smp_table_remove(t, a))
        return 0;
    __atomic_fetch_add(&p->freed, 1, __ATOMIC_RELAXED);
    return 1;
}

/* Puts back an address smp_forget removed: the block is still allocated (its realloc failed).
 * Returns whether it fit (if not, the block is simply no longer sampled). */
static int smp_unforget(struct smp_process *p, struct smp_bucket *t, uintptr_t a)
{
    if (!smp_table_insert(t, a))
        return 0;
    __atomic_fetch_sub(&p->freed, 1, __ATOMIC_RELAXED);
    return 1;
}

#endif
