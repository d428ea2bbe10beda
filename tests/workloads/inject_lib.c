/* A library the injection stress workload dlopens midway: its own GOT slots for malloc and free
 * appear after the recorder redirected the others. */
#include <stdlib.h>

void *lib_alloc(size_t n)
{
    return malloc(n);
}

void lib_free(void *p)
{
    free(p);
}
