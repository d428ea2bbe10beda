/* Workload of tests/record/test_tiers.py. Modes (argv[1]):
 *   faults STEPS   per 100 ms step: leak_pages touches 1 MiB it keeps, churn_pages touches 4 MiB
 *                  it unmaps, madv_pages touches 4 MiB it gives back with MADV_DONTNEED;
 *   rate SECONDS PAIRS_PER_S
 *                  malloc/free pairs at a steady rate (the governor's load), and leak_blocks keeps
 *                  one 4 KiB block in every 64 pairs;
 *   sizes N        N allocations of sizes cycling 16..65536 from leak_sized, all kept, 64 per 3 ms.
 * Prints "ready" on stderr, waits for a line on stdin, runs, prints the ground truth in bytes on
 * stderr, then waits for another line before exiting (the recorder takes a last snapshot). At end
 * of input it does not wait. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MiB (1L << 20)
volatile char *sink;

__attribute__((noinline)) char *leak_pages(void)
{
    char *p = mmap(0, MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    for (long i = 0; i < MiB; i += 4096)
        ((volatile char *)p)[i] = 1;
    return p;
}

__attribute__((noinline)) void churn_pages(void)
{
    char *p = mmap(0, 4 * MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    for (long i = 0; i < 4 * MiB; i += 4096)
        ((volatile char *)p)[i] = 1;
    munmap(p, 4 * MiB);
}

__attribute__((noinline)) void madv_pages(char *p)
{
    for (long i = 0; i < 4 * MiB; i += 4096)
        ((volatile char *)p)[i] = 1;
    madvise(p, 4 * MiB, MADV_DONTNEED);
}

__attribute__((noinline)) void *leak_blocks(void)
{
    void *p = malloc(4096);
    sink = p;
    return p;
}

__attribute__((noinline)) void *leak_sized(size_t n)
{
    void *p = malloc(n);
    sink = p;
    return p;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void wait_line(void)         /* a line, or end of input (run by `record -- CMD`) */
{
    char buf[64];
    if (!fgets(buf, sizeof buf, stdin))
        return;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    fprintf(stderr, "ready\n");
    wait_line();
    long truth = 0;
    if (!strcmp(argv[1], "faults")) {
        int steps = atoi(argv[2]);
        char *scratch = mmap(0, 4 * MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        for (int s = 0; s < steps; s++) {
            sink = leak_pages();
            truth += MiB;
            churn_pages();
            madv_pages(scratch);
            usleep(100000);
        }
    } else if (!strcmp(argv[1], "rate")) {
        double secs = atof(argv[2]), rate = atof(argv[3]);
        double t0 = now();
        long done = 0;
        while (now() - t0 < secs) {
            long due = (long)((now() - t0) * rate);
            for (; done < due; done++) {
                void *p = malloc(64 + (done & 511));
                sink = p;
                free(p);
                if (done % 64 == 0) {
                    leak_blocks();
                    truth += 4096;
                }
            }
            usleep(1000);
        }
    } else if (!strcmp(argv[1], "sizes")) {
        long n = atol(argv[2]);
        for (long i = 0; i < n; i++) {
            size_t sz = 16 << (i % 13);
            leak_sized(sz);
            truth += sz;
            if (i % 64 == 63)
                usleep(3000);       /* a steady pace: a burst of samples would overflow the ring */
        }
    }
    fprintf(stderr, "%ld\n", truth);
    wait_line();
    return 0;
}
