/* dlopen a library and allocate from it at once, many times over: the samples taken right after
 * each dlopen have addresses in a mapping that is only microseconds old.
 *
 *     dlopen_alloc LIB COUNT SIZE PER_LIB      (LIB: a path with "%d" for the copy to load)
 *
 * Prints "ready", waits for a line on stdin, then for each of COUNT copies of the library (distinct
 * files: each dlopen maps new code) calls its dl_alloc(SIZE, PER_LIB), prints "done" and waits. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef DL_LIB
/* The library: no frame pointers, as wheels are built; keeps what it allocates. */
static void *kept[1 << 12];
static int nkept;

__attribute__((noinline)) static void *dl_alloc_one(size_t n)
{
    char *p = malloc(n);
    if (p)
        p[0] = 1;
    return p;
}

int dl_alloc(size_t n, int count)
{
    for (int i = 0; i < count && nkept < (int)(sizeof(kept) / sizeof(kept[0])); i++)
        kept[nkept++] = dl_alloc_one(n);
    __asm__ volatile("" ::: "memory");
    return nkept;
}
#else
int main(int argc, char **argv)
{
    if (argc != 5)
        return 2;
    int count = atoi(argv[2]), per = atoi(argv[4]);
    size_t size = strtoull(argv[3], 0, 10);
    char line[64], path[4096];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof(line), stdin))
        return 1;
    for (int i = 0; i < count; i++) {
        snprintf(path, sizeof(path), argv[1], i);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        int (*fn)(size_t, int) = h ? (int (*)(size_t, int))dlsym(h, "dl_alloc") : 0;
        if (!fn) {
            fprintf(stderr, "%s: %s\n", path, dlerror());
            return 1;
        }
        fn(size, per);
    }
    printf("done\n");
    fflush(stdout);
    return fgets(line, sizeof(line), stdin) ? 0 : 1;
}
#endif
