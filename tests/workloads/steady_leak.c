/* Test workload: a steady leak beside churn, with its own ground truth. leak_site leaks one
 * 64 KiB block every 1/32 s (2 MiB/s); churn_site allocates and frees 4 KiB blocks in between.
 * After each leak it prints "<CLOCK_REALTIME ns> <bytes leaked so far>" (line-buffered), so a
 * test reads how much leak_site held at any moment of a recording. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BLOCK 65536

static void *volatile sink;

__attribute__((noinline)) void leak_site(size_t n) { char *p = malloc(n); memset(p, 1, n); sink = p; }
__attribute__((noinline)) void churn_site(size_t n) { char *p = malloc(n); memset(p, 2, n); sink = p; free(p); }

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct timespec gap = {0, 1000000000 / 32}, now;
    for (unsigned long long total = 0;;) {
        leak_site(BLOCK);
        total += BLOCK;
        clock_gettime(CLOCK_REALTIME, &now);
        printf("%lld %llu\n", (long long)now.tv_sec * 1000000000LL + now.tv_nsec, total);
        for (int i = 0; i < 50; i++) churn_site(4096);
        nanosleep(&gap, NULL);
    }
}
