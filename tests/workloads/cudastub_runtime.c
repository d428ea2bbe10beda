/* A stand-in for the CUDA runtime (libcudart.so.12) for tests without a GPU: the real names and
 * signatures of the memory API, each calling the driver stub (libcuda.so.1) as the real runtime
 * calls the driver, and mapping its errors (2: cudaErrorMemoryAllocation, 1: cudaErrorInvalidValue).
 * Built by the tests: gcc -shared -fPIC -Wl,-soname,libcudart.so.12 ... libcuda.so.1 */
#include <stddef.h>

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaMemPool_t;
typedef unsigned long long CUdeviceptr;

int cuMemAlloc_v2(CUdeviceptr *d, size_t n);
int cuMemFree_v2(CUdeviceptr d);
int cuMemAllocAsync(CUdeviceptr *d, size_t n, void *s);
int cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, void *s);
int cuMemAllocFromPoolAsync(CUdeviceptr *d, size_t n, void *pool, void *s);
int cuMemFreeAsync(CUdeviceptr d, void *s);
int cuMemFreeAsync_ptsz(CUdeviceptr d, void *s);
int cuMemAllocManaged(CUdeviceptr *d, size_t n, unsigned int flags);
int cuMemAllocPitch_v2(CUdeviceptr *d, size_t *pitch, size_t w, size_t h, unsigned int elt);
int cuMemAllocHost_v2(void **pp, size_t n);
int cuMemHostAlloc(void **pp, size_t n, unsigned int flags);
int cuMemFreeHost(void *p);
int cuMemHostRegister_v2(void *p, size_t n, unsigned int flags);
int cuMemHostUnregister(void *p);

#define GARBAGE ((void *)0xdead0000ULL)

static cudaError_t out(void **p, int r, CUdeviceptr d)
{
    if (r) {
        *p = GARBAGE;           /* an out-parameter is only meaningful on success */
        return r == 2 ? 2 : 1;
    }
    *p = (void *)d;
    return 0;
}

cudaError_t cudaMalloc(void **p, size_t n) { CUdeviceptr d = 0; int r = cuMemAlloc_v2(&d, n); return out(p, r, d); }
cudaError_t cudaFree(void *p) { if (!p) return 0; return cuMemFree_v2((CUdeviceptr)p) ? 1 : 0; }
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s)
{ CUdeviceptr d = 0; int r = cuMemAllocAsync(&d, n, s); return out(p, r, d); }
cudaError_t cudaMallocAsync_ptsz(void **p, size_t n, cudaStream_t s)
{ CUdeviceptr d = 0; int r = cuMemAllocAsync_ptsz(&d, n, s); return out(p, r, d); }
cudaError_t cudaMallocFromPoolAsync(void **p, size_t n, cudaMemPool_t pool, cudaStream_t s)
{ CUdeviceptr d = 0; int r = cuMemAllocFromPoolAsync(&d, n, pool, s); return out(p, r, d); }
cudaError_t cudaFreeAsync(void *p, cudaStream_t s) { return cuMemFreeAsync((CUdeviceptr)p, s) ? 1 : 0; }
cudaError_t cudaFreeAsync_ptsz(void *p, cudaStream_t s) { return cuMemFreeAsync_ptsz((CUdeviceptr)p, s) ? 1 : 0; }
cudaError_t cudaMallocManaged(void **p, size_t n, unsigned int flags)
{ CUdeviceptr d = 0; int r = cuMemAllocManaged(&d, n, flags); return out(p, r, d); }
cudaError_t cudaMallocPitch(void **p, size_t *pitch, size_t w, size_t h)
{ CUdeviceptr d = 0; int r = cuMemAllocPitch_v2(&d, pitch, w, h, 4); return out(p, r, d); }
cudaError_t cudaMallocHost(void **p, size_t n)
{ void *q = 0; int r = cuMemAllocHost_v2(&q, n); return out(p, r, (CUdeviceptr)q); }
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int flags)
{ void *q = 0; int r = cuMemHostAlloc(&q, n, flags); return out(p, r, (CUdeviceptr)q); }
cudaError_t cudaFreeHost(void *p) { return cuMemFreeHost(p) ? 1 : 0; }
cudaError_t cudaHostRegister(void *p, size_t n, unsigned int flags) { return cuMemHostRegister_v2(p, n, flags) ? 1 : 0; }
cudaError_t cudaHostUnregister(void *p) { return cuMemHostUnregister(p) ? 1 : 0; }
