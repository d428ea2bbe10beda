/* A program that allocates through a pointer to malloc it looked up itself before any recorder came
 * (dlsym at start: a word no relocation names, which nothing can prove is malloc's), and through
 * malloc itself (tests/analysis/test_coverage.py). Prints "ready" on stderr; on a line "hidden MIB" or
 * "plain MIB" keeps MIB MiB in 64 KiB blocks that way and prints the bytes; exits at end of input. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *(*hidden)(size_t);
static void *volatile kept[1 << 16];
static int nkept;

__attribute__((noinline)) static size_t keep(void *(*alloc)(size_t), int mib)
{
    size_t n = 0;
    for (int i = 0; i < mib * 16 && nkept < (1 << 16); i++) {
        char *p = alloc(64 << 10);
        memset(p, 1, 64 << 10);
        kept[nkept++] = p;
        n += 64 << 10;
    }
    return n;
}

int main(void)
{
    hidden = (void *(*)(size_t))dlsym(RTLD_DEFAULT, "malloc");
    char line[64], how[16];
    int mib;
    fprintf(stderr, "ready\n");
    while (fgets(line, sizeof line, stdin)) {
        if (sscanf(line, "%15s %d", how, &mib) != 2)
            break;
        fprintf(stderr, "%zu\n", keep(strcmp(how, "hidden") ? malloc : hidden, mib));
    }
    return 0;
}
