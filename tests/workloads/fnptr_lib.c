/* A library that allocates through function pointers in its data, as libxml2's xmlMalloc and
 * jansson's do_malloc do: each word is filled with malloc's (free's) address by an R_X86_64_64
 * relocation when the library is loaded, before any recorder looks, and its calls never go
 * through a GOT slot. Driven by tests/workloads/driver.py (tests/inprocess/test_inject.py). */
#include <stdlib.h>
#include <string.h>

void *(*lib_malloc)(size_t) = malloc;
void (*lib_free)(void *) = free;

static void *volatile kept[1 << 16];
static int nkept;

__attribute__((noinline)) size_t fnptr_leak(size_t size, size_t count)
{
    size_t n = 0;
    for (size_t i = 0; i < count && nkept < (1 << 16); i++) {
        char *p = lib_malloc(size);
        memset(p, 1, size);
        kept[nkept++] = p;
        n += size;
    }
    return n;
}

__attribute__((noinline)) size_t fnptr_churn(size_t size, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        char *p = lib_malloc(size);
        p[0] = 1;
        lib_free(p);
    }
    return count * size;
}
