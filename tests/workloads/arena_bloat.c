/* glibc arena bloat reproducer (the `arena_bloat` finding: docs/findings.md).
 *
 * usage: arena_bloat top-pin|page-pin [THREADS [MIB]]   (defaults: 8 threads, 32 MiB)
 *
 * Prints "waiting" and blocks until a line arrives on stdin, so that a recorder can attach
 * before the first allocation. Then THREADS long-lived threads each malloc(16) (a thread's first
 * malloc gives it its own arena) and, one after the other, allocate MIB as 1 KiB chunks, touch
 * them and free them again except for
 *   top-pin:  the last chunk, which pins the heap top: no automatic trim, malloc_trim frees it all;
 *   page-pin: every 4th chunk (1040-byte chunks: every 4 KiB page keeps a live chunk), which
 *             malloc_trim cannot release.
 * Prints "ready" once every thread is done, then "freed BYTES" (the chunk bytes it freed and left
 * resident: its ground truth), and sleeps until killed, all threads alive. */
#include <malloc.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHUNK 1024

static size_t per_thread;
static int page_pin;
static sem_t turn, done;
static void *volatile sink;
static size_t freed;           /* updated by one thread at a time (the turn semaphore) */

static void *worker(void *arg)
{
    (void)arg;
    sink = malloc(16);
    size_t n = per_thread / CHUNK;
    char **chunks = calloc(n, sizeof *chunks);
    sem_wait(&turn);
    for (size_t i = 0; i < n; i++) {
        chunks[i] = malloc(CHUNK);
        memset(chunks[i], 1, CHUNK);
    }
    for (size_t i = 0; i < n; i++)
        if (page_pin ? i % 4 != 3 : i != n - 1) {
            freed += malloc_usable_size(chunks[i]) + sizeof(size_t);     /* the chunk, header included */
            free(chunks[i]);
        }
    sem_post(&done);
    for (;;)
        pause();
}

int main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "top-pin") && strcmp(argv[1], "page-pin"))) {
        fprintf(stderr, "usage: %s top-pin|page-pin [THREADS [MIB]]\n", argv[0]);
        return 2;
    }
    page_pin = !strcmp(argv[1], "page-pin");
    int threads = argc > 2 ? atoi(argv[2]) : 8;
    per_thread = (argc > 3 ? strtoul(argv[3], NULL, 10) : 32) << 20;
    sem_init(&turn, 0, 0);
    sem_init(&done, 0, 0);
    char line[16];
    printf("waiting\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 1;
    pthread_t t;
    for (int i = 0; i < threads; i++)
        pthread_create(&t, NULL, worker, NULL);
    for (int i = 0; i < threads; i++) {    /* one thread at a time: deterministic layout */
        sem_post(&turn);
        sem_wait(&done);
    }
    printf("ready\nfreed %zu\n", freed);
    fflush(stdout);
    for (;;)
        pause();
}
