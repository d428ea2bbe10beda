/* A stand-in for the CUDA driver (libcuda.so.1) for tests on machines without a GPU: the real
 * names and signatures of the memory API; "device" memory is host memory (malloc), VMM handles
 * are counters, reserved address ranges are PROT_NONE mappings. Every function returns 0
 * (CUDA_SUCCESS) except for sizes of STUB_FAIL_SIZE or more, which fail with
 * CUDA_ERROR_OUT_OF_MEMORY after writing a garbage pointer into the out-parameter (a probe must
 * not read it). Built by the tests: gcc -shared -fPIC -Wl,-soname,libcuda.so.1 */
#include <stddef.h>
#include <stdlib.h>
#include <sys/mman.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;
typedef void *CUmemoryPool;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define STUB_FAIL_SIZE (1ULL << 40)
#define GARBAGE 0xdead0000ULL

static CUresult dev_alloc(CUdeviceptr *d, size_t n)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (n >= STUB_FAIL_SIZE) {
        *d = GARBAGE;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void *p = malloc(n ? n : 1);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *d = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

static CUresult dev_free(CUdeviceptr d)
{
    if (d < 4096)              /* not a pointer this stub handed out */
        return CUDA_ERROR_INVALID_VALUE;
    free((void *)d);
    return CUDA_SUCCESS;
}

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t n) { return dev_alloc(d, n); }
CUresult cuMemFree_v2(CUdeviceptr d) { return dev_free(d); }
CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, CUstream s) { (void)s; return dev_alloc(d, n); }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, CUstream s) { (void)s; return dev_alloc(d, n); }
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s)
{ (void)p; (void)s; return dev_alloc(d, n); }
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s)
{ (void)p; (void)s; return dev_alloc(d, n); }
CUresult cuMemFreeAsync(CUdeviceptr d, CUstream s) { (void)s; return dev_free(d); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr d, CUstream s) { (void)s; return dev_free(d); }
CUresult cuMemAllocManaged(CUdeviceptr *d, size_t n, unsigned int flags) { (void)flags; return dev_alloc(d, n); }

CUresult cuMemAllocPitch_v2(CUdeviceptr *d, size_t *pitch, size_t width, size_t height, unsigned int elt)
{
    (void)elt;
    size_t p = (width + 511) & ~(size_t)511;
    if (height && p > STUB_FAIL_SIZE / height) {
        *d = GARBAGE;
        *pitch = 12345;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = dev_alloc(d, p * height);
    if (r == CUDA_SUCCESS)
        *pitch = p;
    return r;
}

CUresult cuMemAllocHost_v2(void **pp, size_t n) { return dev_alloc((CUdeviceptr *)pp, n); }
CUresult cuMemHostAlloc(void **pp, size_t n, unsigned int flags) { (void)flags; return dev_alloc((CUdeviceptr *)pp, n); }
CUresult cuMemFreeHost(void *p) { return dev_free((CUdeviceptr)p); }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags)
{ (void)flags; return p && n && n < STUB_FAIL_SIZE ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
CUresult cuMemHostUnregister(void *p) { return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

/* VMM: physical memory handles, address reservations and mappings */
static CUmemGenericAllocationHandle next_handle = 0x1000;

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const void *prop, unsigned long long flags)
{
    (void)prop; (void)flags;
    if (n == 0 || n >= STUB_FAIL_SIZE) {
        *h = GARBAGE;
        return n ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_VALUE;
    }
    *h = next_handle++;
    return CUDA_SUCCESS;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr, unsigned long long flags)
{
    (void)align; (void)addr; (void)flags;
    void *m = mmap(0, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = (CUdeviceptr)m;
    return CUDA_SUCCESS;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t n) { return munmap((void *)p, n) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS; }
CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h, unsigned long long flags)
{ (void)n; (void)off; (void)flags; return p && h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
CUresult cuMemUnmap(CUdeviceptr p, size_t n) { (void)n; return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
