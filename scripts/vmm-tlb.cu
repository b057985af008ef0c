// Does the size of the physical handles behind a buffer change how fast kernels read it?
// stitch-alloc builds spans from handles of 2-8 MiB (design/zoo.md: finer handles strand
// less memory); PyTorch's allocator serves large tensors from cudaMalloc'd segments. If
// the GPU's address translation covers fewer bytes per entry for small handles, kernels
// over the same bytes run slower. This times two kernels over one 8 GiB buffer laid out
// six ways: cudaMalloc; one VMM handle; VMM handles of 64, 8 and 2 MiB mapped side by side
// in creation order; 2 MiB handles mapped in reverse creation order; and cudaMalloc again
// (the first layout repeated last, against drift over the run). Kernels: a random
// gather (4-byte reads at hashed offsets over the whole buffer: the worst case for address
// translation) and a streaming read (coalesced, every byte once). Median of 7 timed runs
// (CUDA events) after one warm-up, in milliseconds. Build and run on the GPU machine:
//   nvcc -O2 -std=c++17 scripts/vmm-tlb.cu -lcuda -o vmm-tlb && ./vmm-tlb
#include <cuda.h>
#include <cuda_runtime.h>

#include "vmm-common.h"

static const size_t S = 8ull << 30;

__global__ void gather(const unsigned* buf, size_t words, unsigned* out, int iters) {
    size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    unsigned long long x = t * 0x9E3779B97F4A7C15ull + 1;
    unsigned acc = 0;
    for (int k = 0; k < iters; k++) {
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        acc += buf[x % words];
    }
    out[t] = acc;
}

__global__ void stream(const uint4* buf, size_t n, unsigned* out) {
    size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (size_t i = t; i < n; i += stride) {
        uint4 v = buf[i];
        acc += v.x ^ v.y ^ v.z ^ v.w;
    }
    out[t] = acc;
}

// Median milliseconds of 7 runs of `launch` after one warm-up.
template <class F>
static double timed(F launch) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    launch();
    cudaDeviceSynchronize();
    std::vector<double> ms;
    for (int r = 0; r < 7; r++) {
        cudaEventRecord(a);
        launch();
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float m = 0;
        cudaEventElapsedTime(&m, a, b);
        ms.push_back(m);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return median(ms);
}

static void run(const char* label, CUdeviceptr p, unsigned* out) {
    const int threads = 256, blocks = 132 * 16;
    size_t words = S / 4;
    cudaMemset((void*)p, 1, S);
    double g = timed([&] { gather<<<blocks, threads>>>((const unsigned*)p, words, out, 256); });
    double s = timed([&] { stream<<<blocks, threads>>>((const uint4*)p, S / 16, out); });
    double reads = (double)blocks * threads * 256;
    std::printf("%-34s gather %8.2f ms (%6.2f G reads/s)   stream %7.2f ms (%6.0f GB/s)\n", label, g,
                reads / g / 1e6, s, S / s / 1e6);
}

// Map `S` bytes of handles of `h` bytes at a fresh reservation (in reverse creation order
// when `reverse`), run the kernels, give everything back.
static void vmm(const char* label, size_t h, bool reverse, unsigned* out) {
    size_t n = S / h;
    std::vector<CUmemGenericAllocationHandle> hs(n);
    for (auto& x : hs) x = create(h);
    CUdeviceptr base;
    CK(cuMemAddressReserve(&base, S, 0, 0, 0));
    for (size_t i = 0; i < n; i++) CK(cuMemMap(base + i * h, h, 0, hs[reverse ? n - 1 - i : i], 0));
    access(base, S);
    run(label, base, out);
    CK(cuMemUnmap(base, S));
    CK(cuMemAddressFree(base, S));
    for (auto x : hs) CK(cuMemRelease(x));
}

// A cudaMalloc'd 8 GiB buffer timed under `name`, then freed; false if it cannot be had.
static bool timed_cuda_malloc(const char* name, unsigned* out) {
    void* p = nullptr;
    if (cudaMalloc(&p, S) != cudaSuccess) {
        std::printf("cudaMalloc of %zu bytes failed\n", S);
        return false;
    }
    run(name, (CUdeviceptr)p, out);
    cudaFree(p);
    return true;
}

int main() {
    init_device();
    cudaSetDevice(0);
    unsigned* out = nullptr;
    if (cudaMalloc(&out, 132 * 16 * 256 * sizeof(unsigned)) != cudaSuccess) {
        std::printf("cudaMalloc of the output buffer failed\n");
        return 1;
    }
    if (!timed_cuda_malloc("cudaMalloc", out)) return 1;
    vmm("VMM, one 8 GiB handle", S, false, out);
    vmm("VMM, 64 MiB handles", 64ull << 20, false, out);
    vmm("VMM, 8 MiB handles", 8ull << 20, false, out);
    vmm("VMM, 2 MiB handles", 2ull << 20, false, out);
    vmm("VMM, 2 MiB handles, reverse order", 2ull << 20, true, out);
    if (!timed_cuda_malloc("cudaMalloc, again", out)) return 1;
    cudaFree(out);
    return 0;
}
