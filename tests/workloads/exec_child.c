/* A program a recorded Python parent starts with subprocess (vfork and exec; tests/record/
 * test_families.py): prints "ready", then on a line MIB keeps MIB MiB in 64 KiB blocks made in
 * exec_child_leak and prints "kept BYTES"; exits when stdin closes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *volatile keep[1 << 16];

__attribute__((noinline)) static size_t exec_child_leak(int mib)
{
    size_t n = 0;
    for (int i = 0; i < mib * 16 && i < (1 << 16); i++) {
        char *p = malloc(64 << 10);
        memset(p, 1, 64 << 10);
        keep[i] = p;
        n += 64 << 10;
    }
    return n;
}

int main(void)
{
    char line[64];
    printf("ready\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        printf("kept %zu\n", exec_child_leak(atoi(line)));
        fflush(stdout);
    }
    return 0;
}
