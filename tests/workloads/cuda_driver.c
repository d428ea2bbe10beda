/* A CUDA program for the GPU probe tests, linked against the stub runtime and driver
 * (cudastub_runtime.c, cudastub_driver.c). Each scenario runs in a function of its own name, so
 * that tests can check the stack the recorder attributes memory to. Protocol (stderr/stdin):
 * prints "ready", waits for a line, runs, prints the expected outstanding bytes per source as
 * JSON, waits for a line, exits. */
#include <stdio.h>
#include <stdlib.h>

typedef int cudaError_t;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t n, void *s);
cudaError_t cudaMallocAsync_ptsz(void **p, size_t n, void *s);
cudaError_t cudaMallocFromPoolAsync(void **p, size_t n, void *pool, void *s);
cudaError_t cudaFreeAsync(void *p, void *s);
cudaError_t cudaFreeAsync_ptsz(void *p, void *s);
cudaError_t cudaMallocManaged(void **p, size_t n, unsigned int flags);
cudaError_t cudaMallocPitch(void **p, size_t *pitch, size_t w, size_t h);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaHostRegister(void *p, size_t n, unsigned int flags);
cudaError_t cudaHostUnregister(void *p);
int cuMemAlloc_v2(CUdeviceptr *d, size_t n);
int cuMemFree_v2(CUdeviceptr d);
int cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const void *prop, unsigned long long flags);
int cuMemRelease(CUmemGenericAllocationHandle h);
int cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr, unsigned long long flags);
int cuMemAddressFree(CUdeviceptr p, size_t n);
int cuMemMap(CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h, unsigned long long flags);
int cuMemUnmap(CUdeviceptr p, size_t n);

#define MiB (1UL << 20)
#define HUGE_SIZE (1ULL << 41)
#define NOINLINE __attribute__((noinline))

static int errors;
#define CHECK(call) do { if ((call) != 0) { fprintf(stderr, "failed: %s\n", #call); errors++; } } while (0)
#define FAILS(call) do { if ((call) == 0) { fprintf(stderr, "did not fail: %s\n", #call); errors++; } } while (0)

NOINLINE void leak_device(int n)          /* cudaMalloc never freed: 3 MiB each */
{
    for (int i = 0; i < n; i++) {
        void *p;
        CHECK(cudaMalloc(&p, 3 * MiB));
    }
}

NOINLINE void churn_device(int n)         /* allocated and freed: nothing outstanding */
{
    for (int i = 0; i < n; i++) {
        void *p;
        CHECK(cudaMalloc(&p, 5 * MiB));
        CHECK(cudaFree(p));
    }
    CHECK(cudaFree(NULL));                /* initialises a context: not traced */
}

NOINLINE void fail_device(void)           /* failures are recorded and never counted */
{
    void *p;
    size_t pitch;
    FAILS(cudaMalloc(&p, HUGE_SIZE));
    FAILS(cudaMallocAsync(&p, HUGE_SIZE, 0));
    FAILS(cudaMallocPitch(&p, &pitch, 1 << 20, 1 << 22));
    FAILS(cudaMallocHost(&p, HUGE_SIZE));
    FAILS(cudaFree((void *)8));           /* not a device pointer */
}

NOINLINE void async_paths(void)           /* stream-ordered and pool allocations */
{
    void *a, *b, *c, *d;
    CHECK(cudaMallocAsync(&a, 7 * MiB, 0));
    CHECK(cudaFreeAsync(a, 0));
    CHECK(cudaMallocAsync_ptsz(&b, 2 * MiB, 0));       /* kept */
    CHECK(cudaMallocFromPoolAsync(&c, 4 * MiB, 0, 0)); /* kept */
    CHECK(cudaMallocAsync_ptsz(&d, 6 * MiB, 0));
    CHECK(cudaFreeAsync_ptsz(d, 0));
}

NOINLINE void managed_and_pitch(void)
{
    void *m, *p;
    size_t pitch = 0;
    CHECK(cudaMallocManaged(&m, 1 * MiB, 1));          /* kept: 1 MiB */
    CHECK(cudaMallocPitch(&p, &pitch, 1000, 2048));    /* kept: 1024 x 2048 = 2 MiB */
}

NOINLINE void pinned_host(void)
{
    void *a, *b;
    CHECK(cudaMallocHost(&a, 1 * MiB));                /* kept */
    CHECK(cudaHostAlloc(&b, 2 * MiB, 0));
    CHECK(cudaFreeHost(b));
    void *buf = malloc(3 * MiB);
    CHECK(cudaHostRegister(buf, 3 * MiB, 0));          /* kept: 3 MiB pinned */
    void *buf2 = malloc(MiB);
    CHECK(cudaHostRegister(buf2, MiB, 0));
    CHECK(cudaHostUnregister(buf2));
}

NOINLINE void vmm_paths(void)             /* PyTorch's expandable segments use these */
{
    CUdeviceptr va;
    CUmemGenericAllocationHandle h1, h2, h3, bad;
    CHECK(cuMemAddressReserve(&va, 64 * MiB, 0, 0, 0));  /* address space: never counted */
    CHECK(cuMemCreate(&h1, 2 * MiB, 0, 0));
    CHECK(cuMemCreate(&h2, 2 * MiB, 0, 0));
    CHECK(cuMemCreate(&h3, 2 * MiB, 0, 0));
    FAILS(cuMemCreate(&bad, HUGE_SIZE, 0, 0));
    CHECK(cuMemMap(va, 2 * MiB, 0, h1, 0));
    CHECK(cuMemMap(va + 2 * MiB, 2 * MiB, 0, h2, 0));
    CHECK(cuMemRelease(h1));              /* still mapped: still there */
    CHECK(cuMemUnmap(va + 2 * MiB, 2 * MiB));
    CHECK(cuMemRelease(h2));              /* unmapped and released: gone */
    (void)h3;                             /* created, never mapped or released: there */
    CUdeviceptr va2;
    CHECK(cuMemAddressReserve(&va2, 32 * MiB, 0, 0, 0));
    CHECK(cuMemAddressFree(va2, 32 * MiB));
}

NOINLINE void driver_direct(void)         /* the driver API without the runtime */
{
    CUdeviceptr d, e;
    CHECK(cuMemAlloc_v2(&d, 8 * MiB));    /* kept */
    CHECK(cuMemAlloc_v2(&e, 1 * MiB));
    CHECK(cuMemFree_v2(e));
}

int main(void)
{
    char line[64];
    fprintf(stderr, "ready\n");
    if (!fgets(line, sizeof(line), stdin))
        return 1;
    leak_device(4);
    churn_device(3);
    fail_device();
    async_paths();
    managed_and_pitch();
    pinned_host();
    vmm_paths();
    driver_direct();
    /* expected outstanding bytes, by source */
    fprintf(stderr, "{\"errors\": %d, \"cuda\": %lu, \"cuda-host\": %lu, \"cuda-driver\": %lu, \"cuda-driver-host\": %lu}\n",
           errors, 12 * MiB + 6 * MiB + 3 * MiB, 1 * MiB + 3 * MiB, 12 * MiB + 6 * MiB + 3 * MiB + 4 * MiB + 8 * MiB,
           1 * MiB + 3 * MiB);
    if (!fgets(line, sizeof(line), stdin))
        return 1;
    return errors != 0;
}
