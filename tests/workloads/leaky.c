/* Test workload: leaks and churns through the malloc family at known volumes.
 * Built with -O1 -fno-builtin -fno-omit-frame-pointer so that every call stays and every site
 * is its own stack. Each function returns the bytes it leaves allocated (the ground truth). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sys/mman.h>

static void *volatile sink;

#define NOINLINE __attribute__((noinline))

NOINLINE size_t leak_malloc(size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++) { char *p = malloc(size); p[0] = 1; sink = p; }
    return n * size;
}

NOINLINE size_t leak_calloc(size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++) sink = calloc(1, size);
    return n * size;
}

/* grow each block: the malloc'd half is freed by realloc; the realloc'd block leaks */
NOINLINE static void *start_block(size_t size) { return malloc(size); }
NOINLINE size_t leak_realloc(size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++) sink = realloc(start_block(size / 2), size);
    return n * size;
}

NOINLINE size_t leak_posix_memalign(size_t n, size_t align, size_t size)
{
    for (size_t i = 0; i < n; i++) {
        void *p;
        if (posix_memalign(&p, align, size) == 0) sink = p;
    }
    return n * size;
}

NOINLINE size_t churn(size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++) { char *p = malloc(size); p[0] = 1; sink = p; free(p); }
    return 0;
}

NOINLINE size_t leak_mmap(size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++) {
        char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        p[0] = 1;
        sink = p;
    }
    return n * size;
}

/* mmap n regions and unmap the upper half of each: half stays */
NOINLINE size_t leak_mmap_half(size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++) {
        char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        munmap(p + size / 2, size / 2);
        sink = p;
    }
    return n * (size / 2);
}

/* realloc(NULL, size) behaves as malloc and leaks */
NOINLINE size_t leak_realloc_null(size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++) sink = realloc(NULL, size);
    return n * size;
}

/* realloc(p, 0) frees p (glibc): nothing stays */
NOINLINE size_t realloc_zero(size_t n, size_t size)
{
    for (size_t i = 0; i < n; i++) { void *p = malloc(size); sink = p; sink = realloc(p, 0); }
    return 0;
}

/* failing calls: nothing stays and nothing may be counted */
NOINLINE size_t failing(size_t n)
{
    for (size_t i = 0; i < n; i++) {
        void *p;
        sink = malloc((size_t)1 << 62);                         /* ENOMEM */
        sink = calloc((size_t)1 << 40, (size_t)1 << 40);        /* overflow */
        if (posix_memalign(&p, 3, 1 << 30) == 0) sink = p;       /* EINVAL: bad alignment */
        sink = realloc(NULL, (size_t)1 << 62);                   /* ENOMEM */
        void *q = malloc(64);
        if (!realloc(q, (size_t)1 << 62)) free(q);               /* failed realloc keeps q */
    }
    return 0;
}

/* a failed realloc leaves its (certainly sampled: size >> T) block allocated */
NOINLINE size_t realloc_fail_keeps(size_t size)
{
    void *q = malloc(size);
    void *r = realloc(q, (size_t)1 << 62);
    sink = r ? r : q;
    return size;
}

/* 16 distinct allocation sites for sampling statistics; sizes cycle through a mix */
#define SITE(k) NOINLINE size_t site_##k(size_t n, size_t seed) {                        \
    size_t total = 0, x = seed * 2654435761u + k;                                        \
    for (size_t i = 0; i < n; i++) {                                                     \
        x = x * 6364136223846793005ull + 1442695040888963407ull;                         \
        size_t size = (size_t)16 << ((x >> 33) % 15);   /* 16 B .. 256 KiB */            \
        char *p = malloc(size); p[0] = 1; sink = p; total += size;                       \
    }                                                                                    \
    return total; }
SITE(0) SITE(1) SITE(2) SITE(3) SITE(4) SITE(5) SITE(6) SITE(7)
SITE(8) SITE(9) SITE(10) SITE(11) SITE(12) SITE(13) SITE(14) SITE(15)

typedef size_t (*site_fn)(size_t, size_t);
static site_fn sites[16] = {site_0, site_1, site_2, site_3, site_4, site_5, site_6, site_7,
                            site_8, site_9, site_10, site_11, site_12, site_13, site_14, site_15};
size_t run_site(int k, size_t n, size_t seed) { return sites[k & 15](n, seed); }

/* A service loop for `seconds`: every 10 ms it leaks `leak_rate / 100` bytes (in `size` blocks)
 * at one site and pushes as many bytes through a bounded cache of `cache_bytes` at another
 * (oldest entries freed first): the leak grows to the end, the cache grows then stays flat. */
#include <time.h>
NOINLINE static void *leak_step(size_t size) { char *p = malloc(size); p[0] = 1; return p; }
NOINLINE static void *cache_step(size_t size) { char *p = malloc(size); p[0] = 1; return p; }

size_t service(size_t seconds, size_t leak_rate, size_t cache_bytes, size_t size)
{
    size_t slots = cache_bytes / size, head = 0, total = 0;
    void **cache = calloc(slots, sizeof(void *));
    struct timespec tick = {0, 10 * 1000 * 1000};
    for (size_t k = 0; k < seconds * 100; k++) {
        for (size_t b = 0; b < leak_rate / 100; b += size) { sink = leak_step(size); total += size; }
        for (size_t b = 0; b < leak_rate / 100; b += size) {
            free(cache[head]);
            cache[head] = cache_step(size);
            head = (head + 1) % slots;
        }
        nanosleep(&tick, NULL);
    }
    return total;
}
