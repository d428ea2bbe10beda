/* Pages that long-lived blocks keep resident (resident-vs-live attribution: docs/findings.md).
 *
 * usage: pinning interleaved|first|plateau|churn [MIB [STRIDE]]     (defaults: 84 MiB, stride 4)
 *
 * Prints "waiting" and blocks until a line arrives on stdin, so that a recorder can attach first.
 * Then MIB of 1 KiB blocks (1040-byte chunks) come from two sites: every STRIDE-th from
 * long_lived(), the others from short_lived(),
 *   interleaved: in one sequence, so that the long-lived blocks end up spread over the whole run;
 *   first:       (the control) all long-lived blocks first, then all short-lived ones,
 *   plateau:     (a control) every block long-lived: a held plateau, nothing freed,
 *   churn:       (a control) the plateau, then, after "ready", CHURN_S seconds of short-lived
 *                blocks of 16..8192 bytes freed at random in a working set of 4096, in bursts
 *                of 4096 every 20 ms (prints
 *                "churned COUNT" when done),
 * and every short-lived block is freed. Then it prints its ground truth, computed from the
 * addresses it got: "live BYTES" (long-lived chunk bytes), "pinned BYTES" (freed chunk bytes
 * on the pages that also hold a long-lived chunk's byte) and "ready", and waits for lines on
 * stdin: "trim" calls malloc_trim(0) and prints "trimmed BYTES" (its resident set before minus
 * after). It exits at end of input. */
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 1024
#define CHUNK ((BLOCK + 8 + 15) & ~(size_t)15)     /* glibc's request2size on x86-64 */
#define HDR 16                                     /* a chunk starts 16 bytes before its block */
#define CHURN_S 8

__attribute__((noinline)) void *long_lived(size_t n) { char *p = malloc(n); memset(p, 1, n); return p; }
__attribute__((noinline)) void *short_lived(size_t n) { char *p = malloc(n); memset(p, 2, n); return p; }

static long resident(void)
{
    long size, rss;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f || fscanf(f, "%ld %ld", &size, &rss) != 2)
        return -1;
    fclose(f);
    return rss * sysconf(_SC_PAGESIZE);
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "interleaved") && strcmp(mode, "first") && strcmp(mode, "plateau") && strcmp(mode, "churn")) {
        fprintf(stderr, "usage: %s interleaved|first|plateau|churn [MIB [STRIDE]]\n", argv[0]);
        return 2;
    }
    int interleaved = !strcmp(mode, "interleaved"), churn = !strcmp(mode, "churn");
    size_t n = (argc > 2 ? strtoul(argv[2], NULL, 10) : 84) << 20;
    size_t stride = !strcmp(mode, "plateau") || churn ? 1 : argc > 3 ? strtoul(argv[3], NULL, 10) : 4;
    n /= CHUNK;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    char **blocks = calloc(n, sizeof *blocks);
    char *is_long = calloc(n, 1);
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("waiting\n");
    if (!fgets(line, sizeof line, stdin))
        return 1;
    size_t longs = n / stride;
    for (size_t i = 0; i < n; i++) {
        is_long[i] = interleaved ? i % stride == stride - 1 : i < longs;
        blocks[i] = is_long[i] ? long_lived(BLOCK) : short_lived(BLOCK);
    }
    /* ground truth, from the chunks' addresses: the span they cover, page by page */
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (size_t i = 0; i < n; i++) {
        uintptr_t c = (uintptr_t)blocks[i] - HDR;
        lo = c < lo ? c : lo;
        hi = c + CHUNK > hi ? c + CHUNK : hi;
    }
    lo &= ~(page - 1);
    size_t pages = (hi - lo + page - 1) / page;
    size_t *freed = calloc(pages, sizeof *freed);
    char *held = calloc(pages, 1);
    size_t live = 0;
    for (size_t i = 0; i < n; i++) {
        uintptr_t c = (uintptr_t)blocks[i] - HDR;
        for (uintptr_t a = c; a < c + CHUNK;) {
            uintptr_t next = (a & ~(page - 1)) + page;
            size_t k = (a - lo) / page, len = (next < c + CHUNK ? next : c + CHUNK) - a;
            if (is_long[i])
                held[k] = 1;
            else
                freed[k] += len;
            a += len;
        }
        if (is_long[i])
            live += CHUNK;
    }
    for (size_t i = 0; i < n; i++)
        if (!is_long[i])
            free(blocks[i]);
    size_t pinned = 0;
    for (size_t k = 0; k < pages; k++)
        if (held[k])
            pinned += freed[k];
    printf("live %zu\npinned %zu\nready\n", live, pinned);
    if (churn) {
        static char *ws[4096];
        unsigned seed = 1;
        size_t count = 0;
        time_t end = time(NULL) + CHURN_S;
        while (time(NULL) < end) {
            for (int k = 0; k < 4096; k++, count++) {
                size_t i = rand_r(&seed) % 4096;
                free(ws[i]);
                ws[i] = short_lived(16 + rand_r(&seed) % 8177);
            }
            usleep(20000);          /* ~200,000 a second: a busy service's rate, not a benchmark's */
        }
        printf("churned %zu\n", count);
    }
    while (fgets(line, sizeof line, stdin))
        if (!strncmp(line, "trim", 4)) {
            long before = resident();
            malloc_trim(0);
            printf("trimmed %ld\n", before - resident());
        }
    return 0;
}
