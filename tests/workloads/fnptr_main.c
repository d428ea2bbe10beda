/* The driver of fnptr_lib.c, a PIE executable linked against it (a non-PIE one that takes malloc's
 * address makes its own PLT stub the canonical malloc, and the library's words would hold that stub,
 * which goes through a GOT slot). Prints "ready" on stderr, on a line leaks through the library's
 * function pointers and churns as much, prints the bytes leaked, and waits for another line. */
#include <stdio.h>
#include <stdlib.h>

size_t fnptr_leak(size_t size, size_t count);
size_t fnptr_churn(size_t size, size_t count);

int main(void)
{
    char line[64];
    fprintf(stderr, "ready\n");
    if (!fgets(line, sizeof line, stdin))
        return 1;
    size_t n = fnptr_leak(65536, 512);
    fnptr_churn(65536, 512);
    fprintf(stderr, "%zu\n", n);
    if (!fgets(line, sizeof line, stdin))
        return 0;
    return 0;
}
