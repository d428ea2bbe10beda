/* glibc heap look-alikes forged by a process that wants its recorder to walk them (security.md,
 * "Inputs": glibc heap headers). Nothing here is malloc's: every heap is MAP_NORESERVE memory with,
 * in its first page only, a heap_info {ar_ptr = base + 48, prev 0, size, mprotect_size, pagesize}
 * and a malloc_state whose 127 bins are empty (fd == bk == head) and whose top chunk ends where
 * heap_info.size says: exactly what sampler/proc/smaps.py and arenas.py check.
 *
 * usage: forged_heaps separate N [pinned]
 *                                  N heaps of 64 MiB - 4 KiB, each its own VMA with a 4 KiB PROT_NONE
 *                                  tail (a partly committed glibc heap), each its own arena; `pinned`:
 *                                  a free chunk in its first page and its top in its last, so that
 *                                  both pages are pinned (a PinMap of the whole heap)
 *        forged_heaps merged N     one rw VMA of N x 64 MiB, a forged arena every 64 MiB
 *        forged_heaps huge GIB     one rw VMA of GIB GiB with one forged header, at its start
 *
 * Prints "ready BASE" (the first heap) and sleeps until killed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define HEAP_MAX (64UL << 20)
#define STATE 48           /* sizeof(heap_info) since glibc 2.35: the arena's malloc_state follows */
#define TOP 0x900          /* the top chunk, past the 2200-byte malloc_state */

static int pinned;

static void forge(char *base, uint64_t size)
{
    uint64_t *info = (uint64_t *)base;
    uint64_t ms = (uint64_t)(uintptr_t)base + STATE;
    info[0] = ms;                                   /* ar_ptr */
    info[1] = 0;                                    /* prev */
    info[2] = info[3] = size;                       /* size, mprotect_size */
    info[4] = 4096;
    uint64_t *state = (uint64_t *)(base + STATE);
    state[96 / 8] = (uint64_t)(uintptr_t)base + TOP;   /* top */
    for (int i = 0; i < 127; i++) {                 /* bins: empty lists point at their own head */
        uint64_t head = ms + 112 + 16 * i - 16;
        state[(112 + 16 * i) / 8] = state[(120 + 16 * i) / 8] = head;
    }
    ((uint64_t *)(base + TOP))[1] = (size - TOP) | 1;  /* the top's size: it ends at heap_info.size */
    if (pinned) {   /* a 256-byte free chunk on the unsorted list, the top in the last page's second half */
        uint64_t *chunk = (uint64_t *)(base + TOP), unsorted = ms + 112 - 16;
        chunk[1] = 0x100 | 1;
        chunk[2] = chunk[3] = unsorted;
        state[112 / 8] = state[120 / 8] = (uint64_t)(uintptr_t)chunk;
        uint64_t top = (uint64_t)(uintptr_t)base + size - 0x800;
        state[96 / 8] = top;
        ((uint64_t *)(uintptr_t)top)[1] = 0x800 | 1;
    }
}

/* `n` bytes of PROT_NONE reservation aligned to 64 MiB, its unaligned head and tail unmapped as glibc does */
static char *reserve(size_t n)
{
    char *p = mmap(NULL, n + HEAP_MAX, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    char *base = (char *)(((uintptr_t)p + HEAP_MAX - 1) & ~(HEAP_MAX - 1));
    if (base > p)
        munmap(p, base - p);
    munmap(base + n, p + HEAP_MAX - base);
    return base;
}

static void writable(char *at, size_t n)
{
    if (mprotect(at, n, PROT_READ | PROT_WRITE)) {
        perror("mprotect");
        exit(1);
    }
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: %s separate N [pinned] | merged N | huge GIB\n", argv[0]);
        return 2;
    }
    pinned = argc == 4 && !strcmp(argv[3], "pinned");
    size_t n = strtoul(argv[2], NULL, 10);
    char *base;
    if (!strcmp(argv[1], "separate")) {
        base = reserve(n * HEAP_MAX);
        for (size_t i = 0; i < n; i++) {
            writable(base + i * HEAP_MAX, HEAP_MAX - 4096);
            forge(base + i * HEAP_MAX, HEAP_MAX - 4096);
        }
    } else if (!strcmp(argv[1], "merged")) {
        base = reserve(n * HEAP_MAX);
        writable(base, n * HEAP_MAX);
        for (size_t i = 0; i < n; i++)
            forge(base + i * HEAP_MAX, HEAP_MAX);
    } else if (!strcmp(argv[1], "huge")) {
        base = reserve(n << 30);
        writable(base, n << 30);
        forge(base, HEAP_MAX);
    } else {
        return 2;
    }
    printf("ready %p\n", (void *)base);
    fflush(stdout);
    for (;;)
        pause();
}
