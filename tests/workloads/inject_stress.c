/* A workload that checks its own allocations while a recorder injects, redirects and restores its
 * allocator calls (tests/inprocess/test_inject.py): 8 threads mix malloc, calloc, realloc, posix_memalign,
 * aligned_alloc, memalign, valloc and free over blocks they fill with a pattern and verify before
 * freeing; signal handlers (on an alternate stack) allocate and verify too; a thread forks children
 * that allocate and verify; midway a library is dlopen'ed and used. Each thread's work is fixed by
 * its own random stream, so the checksum of what was verified is the same in every run.
 *
 * The work is repeated from the same seeds until stdin gives a second line or closes, so a recorder
 * always finds it running; every repeat must give the first one's sum.
 *
 *   inject_stress ITERATIONS [LIB.so]  -> prints "ready", waits for a line, works until the next
 *                                         line or EOF, then "ok CHECKSUM SIGNALS FORKS" (exit 0)
 *                                         or "corrupt ..." (exit 1)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#define THREADS 8
#define SLOTS 64

static long iterations;
static const char *lib_path;
static volatile int corrupt;
static volatile long signals, forks;
static volatile int finished; /* workers done: the signaller stops before any thread can be joined */
static volatile int stopping; /* stdin said stop: workers end after their current round */
static __thread volatile int in_alloc; /* glibc's malloc is not async-signal-safe: handlers skip it */

static uint64_t next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ULL;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void fill(unsigned char *p, size_t n, uint64_t tag)
{
    for (size_t i = 0; i < n; i += 61)
        p[i] = (unsigned char)(tag + i);
    if (n)
        p[n - 1] = (unsigned char)(tag >> 8);
}

/* The sum of the pattern's bytes, or -1 when a byte is wrong. */
static long check(const unsigned char *p, size_t n, uint64_t tag)
{
    long sum = 0;
    for (size_t i = 0; i < n; i += 61) {
        if (i == n - 1)
            break;
        if (p[i] != (unsigned char)(tag + i))
            return -1;
        sum += p[i];
    }
    if (n) {
        if (p[n - 1] != (unsigned char)(tag >> 8))
            return -1;
        sum += p[n - 1];
    }
    return sum;
}

struct blk {
    unsigned char *p;
    size_t n;
    uint64_t tag;
};

static void *alloc_some(uint64_t *rng, size_t n)
{
    void *p = NULL;
    switch (next(rng) % 7) {
    case 0: return malloc(n);
    case 1: return calloc(1, n);
    case 2: return posix_memalign(&p, 64, n) == 0 ? p : NULL;
    case 3: return aligned_alloc(128, (n + 127) & ~(size_t)127);
    case 4: return memalign(256, n);
    case 5: return n < 4096 ? valloc(n) : malloc(n);
    default: return realloc(NULL, n);
    }
}

static void on_signal(int sig)
{
    (void)sig;
    if (in_alloc)
        return;
    uint64_t rng = (uint64_t)(uintptr_t)&rng;
    size_t n = 16 + next(&rng) % 5000;
    unsigned char *p = malloc(n);
    if (!p)
        return;
    fill(p, n, n);
    if (check(p, n, n) < 0)
        corrupt = 1;
    p = realloc(p, n * 2);
    if (p && check(p, n, n) < 0)
        corrupt = 1;
    free(p);
    __atomic_fetch_add(&signals, 1, __ATOMIC_RELAXED);
}

static int child_work(uint64_t seed)
{
    struct blk b[16] = {0};
    for (int i = 0; i < 2000; i++) {
        struct blk *x = &b[next(&seed) % 16];
        if (x->p) {
            if (check(x->p, x->n, x->tag) < 0)
                return 1;
            free(x->p);
        }
        x->n = 1 + next(&seed) % 20000;
        x->tag = next(&seed);
        x->p = malloc(x->n);
        if (!x->p)
            return 1;
        fill(x->p, x->n, x->tag);
    }
    for (int i = 0; i < 16; i++)
        if (b[i].p && check(b[i].p, b[i].n, b[i].tag) < 0)
            return 1;
    return 0;
}

/* One round of a thread's work from its own seed; returns the sum of what it verified. */
static long round_of(int id)
{
    uint64_t rng = 1000 + (uint64_t)id;
    struct blk b[SLOTS] = {0};
    long sum = 0;
    void *lib = NULL;
    void *(*lib_alloc)(size_t) = NULL;
    void (*lib_free)(void *) = NULL;
    for (long it = 0; it < iterations && !corrupt; it++) {
        struct blk *x = &b[next(&rng) % SLOTS];
        size_t n = 1 + next(&rng) % (next(&rng) % 8 == 0 ? 300000 : 3000);
        uint64_t tag = next(&rng);
        in_alloc = 1;
        if (x->p) {
            long c = check(x->p, x->n, x->tag);
            if (c < 0) {
                corrupt = 1;
                break;
            }
            sum += c;
            if (next(&rng) % 3 == 0) { /* grow or shrink in place of a free and a new block */
                unsigned char *q = realloc(x->p, n);
                if (!q) {
                    corrupt = 1;
                    break;
                }
                size_t keep = x->n < n ? x->n : n;
                for (size_t i = 0; i < keep; i += 61)
                    if (i != x->n - 1 && q[i] != (unsigned char)(x->tag + i))
                        corrupt = 1;
                fill(q, n, tag);
                *x = (struct blk){q, n, tag};
                in_alloc = 0;
                continue;
            }
            free(x->p);
        }
        x->p = alloc_some(&rng, n);
        in_alloc = 0;
        if (!x->p) {
            corrupt = 1;
            break;
        }
        x->n = n;
        x->tag = tag;
        fill(x->p, n, tag);
        if (id == 0 && it == iterations / 2 && lib_path) { /* a library appears midway */
            in_alloc = 1;       /* dlopen allocates under its own locks */
            lib = dlopen(lib_path, RTLD_NOW);
            in_alloc = 0;
            if (lib) {
                lib_alloc = (void *(*)(size_t))dlsym(lib, "lib_alloc");
                lib_free = (void (*)(void *))dlsym(lib, "lib_free");
            }
        }
        if (lib_alloc && lib_free) {
            in_alloc = 1;
            unsigned char *p = lib_alloc(4000);
            fill(p, 4000, 7);
            if (check(p, 4000, 7) < 0)
                corrupt = 1;
            lib_free(p);
            in_alloc = 0;
        }
        if (id == 1 && it % (iterations / 8 + 1) == 0) { /* forks: the child inherits everything */
            in_alloc = 1;       /* fork holds every malloc lock while it copies */
            pid_t pid = fork();
            if (pid == 0) {
                in_alloc = 0;
                _exit(child_work(tag));
            }
            in_alloc = 0;
            int status = 0;
            if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
                corrupt = 1;
            __atomic_fetch_add(&forks, 1, __ATOMIC_RELAXED);
        }
    }
    for (int i = 0; i < SLOTS; i++) {
        if (b[i].p) {
            long c = check(b[i].p, b[i].n, b[i].tag);
            if (c < 0)
                corrupt = 1;
            sum += c;
            in_alloc = 1;       /* a handler's malloc would wait on the lock free holds */
            free(b[i].p);
            in_alloc = 0;
        }
    }
    return sum;
}

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    in_alloc = 1;
    stack_t ss = {.ss_sp = malloc(1 << 16), .ss_size = 1 << 16};
    sigaltstack(&ss, NULL);
    in_alloc = 0;
    long sum = round_of(id);
    while (!corrupt && !__atomic_load_n(&stopping, __ATOMIC_RELAXED))
        if (round_of(id) != sum)
            corrupt = 1;
    __atomic_fetch_add(&finished, 1, __ATOMIC_RELAXED);
    return (void *)(intptr_t)sum;
}

static void *signaller(void *arg)
{
    pthread_t *t = arg;
    uint64_t rng = 7;
    while (!__atomic_load_n(&finished, __ATOMIC_RELAXED)) {
        pthread_kill(t[next(&rng) % THREADS], SIGUSR1);
        usleep(200);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    iterations = atol(argv[1]);
    lib_path = argc > 2 ? argv[2] : NULL;
    struct sigaction sa = {.sa_handler = on_signal, .sa_flags = SA_ONSTACK | SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        return 2;
    pthread_t t[THREADS], sig;
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
    pthread_create(&sig, NULL, signaller, t);
    if (!fgets(line, sizeof line, stdin))
        line[0] = 0;        /* EOF says stop as well */
    __atomic_store_n(&stopping, 1, __ATOMIC_RELAXED);
    pthread_join(sig, NULL);
    long total = 0;
    for (int i = 0; i < THREADS; i++) {
        void *r;
        pthread_join(t[i], &r);
        total += (long)(intptr_t)r;
    }
    int bad = corrupt;
    printf("%s %ld %ld %ld\n", bad ? "corrupt" : "ok", total, signals, forks);
    return bad ? 1 : 0;
}
