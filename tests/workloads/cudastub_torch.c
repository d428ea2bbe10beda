/* A stand-in for PyTorch's libc10_cuda.so for tests without a GPU: a tiny "caching allocator"
 * that reserves segments with cudaMalloc (the runtime stub) and hands out tensors from them,
 * announcing each with PyTorch's USDT probes pytorch:malloc(ptr, device, size, stream) and
 * pytorch:free(ptr), guarded by semaphores as in c10/util/static_tracepoint.h.
 * Built by the tests: gcc -shared -fPIC ... libcudart.so.12 */
#define _SDT_HAS_SEMAPHORES 1
#include <stddef.h>
#include <sys/sdt.h>

unsigned short pytorch_malloc_semaphore __attribute__((section(".probes")));
unsigned short pytorch_free_semaphore __attribute__((section(".probes")));

int cudaMalloc(void **p, size_t n);

static char *seg;
static size_t seg_left;

/* Reserve a segment of `bytes` (cudaMalloc), tensors come from the newest one. */
__attribute__((noinline)) int c10_reserve_segment(size_t bytes)
{
    void *p = 0;
    if (cudaMalloc(&p, bytes))
        return -1;
    seg = p;
    seg_left = bytes;
    return 0;
}

__attribute__((noinline)) size_t c10_tensor_alloc(size_t bytes)
{
    if (bytes > seg_left)
        return 0;
    char *p = seg;
    seg += bytes;
    seg_left -= bytes;
    if (pytorch_malloc_semaphore)
        STAP_PROBE4(pytorch, malloc, p, 0, bytes, 7);
    return (size_t)p;
}

__attribute__((noinline)) void c10_tensor_free(size_t p)
{
    if (pytorch_free_semaphore)
        STAP_PROBE1(pytorch, free, (void *)p);
}
