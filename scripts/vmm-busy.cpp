// Do the VMM calls wait for the GPU? The C ABI's slowest allocations through torch (tens of
// ms, design/gpu-results.md runs 45 and 48) are far above the cost model's 1-10 ms, which
// was measured on an idle GPU (anchors.md). This times cuMemCreate, cuMemMap,
// cuMemSetAccess, cuMemUnmap and cuMemRelease of 2 MiB and 20 MiB handles on an idle GPU
// and while a stream of the same context is busy (a queue of large memsets, about 100 ms
// of work), and reports the medians and the slowest call of each. Build and run on the GPU
// machine (scripts/vmm-common.h beside it):
//   g++ -O2 -std=c++17 scripts/vmm-busy.cpp -I/usr/local/cuda/include -lcuda -o vmm-busy
//   ./vmm-busy
#include "vmm-common.h"

struct Times {
    std::vector<double> create, map, access, unmap, release;
};

static void summary(const char* what, std::vector<double> v) {
    std::sort(v.begin(), v.end());
    std::printf("  %-8s median %8.1f us  p90 %8.1f us  max %9.1f us\n", what, v[v.size() / 2],
                v[v.size() * 9 / 10], v.back());
}

// One create-map-access-unmap-release cycle of a handle of `size` at `va`.
static void cycle(CUdeviceptr va, size_t size, Times& t) {
    double t0 = now_us();
    CUmemGenericAllocationHandle h = create(size);
    double t1 = now_us();
    CK(cuMemMap(va, size, 0, h, 0));
    double t2 = now_us();
    access(va, size);
    double t3 = now_us();
    CK(cuMemUnmap(va, size));
    double t4 = now_us();
    CK(cuMemRelease(h));
    double t5 = now_us();
    t.create.push_back(t1 - t0);
    t.map.push_back(t2 - t1);
    t.access.push_back(t3 - t2);
    t.unmap.push_back(t4 - t3);
    t.release.push_back(t5 - t4);
}

int main() {
    init_device();
    CUstream busy;
    CK(cuStreamCreate(&busy, CU_STREAM_NON_BLOCKING));
    // The busy stream's work: memsets over a 4 GiB buffer of ordinary device memory.
    const size_t big = size_t(4) << 30;
    CUdeviceptr buf;
    CK(cuMemAlloc(&buf, big));
    CUevent e0, e1;
    CK(cuEventCreate(&e0, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&e1, CU_EVENT_DEFAULT));
    CK(cuEventRecord(e0, busy));
    for (int i = 0; i < 20; i++) CK(cuMemsetD8Async(buf, (unsigned char)i, big, busy));
    CK(cuEventRecord(e1, busy));
    CK(cuEventSynchronize(e1));
    float ms = 0;
    CK(cuEventElapsedTime(&ms, e0, e1));
    const int memsets = std::max(1, (int)(100.0 / (ms / 20.0)));  // about 100 ms of work
    std::printf("one 4 GiB memset: %.2f ms; %d of them make the busy queue\n", ms / 20.0, memsets);
    const int reps = 40;
    for (size_t size : {size_t(2) << 20, size_t(20) << 20}) {
        CUdeviceptr va;
        CK(cuMemAddressReserve(&va, size, 0, 0, 0));
        Times idle, loaded;
        for (int r = 0; r < reps; r++) cycle(va, size, idle);
        int done_early = 0;
        for (int r = 0; r < reps; r++) {
            for (int i = 0; i < memsets; i++) CK(cuMemsetD8Async(buf, (unsigned char)r, big, busy));
            CK(cuEventRecord(e1, busy));
            cycle(va, size, loaded);
            // Was the queue still running when the cycle ended? (Else the cycle waited for it.)
            if (cuEventQuery(e1) == CUDA_SUCCESS) done_early++;
            CK(cuEventSynchronize(e1));
        }
        std::printf("handle %zu MiB, %d cycles each; idle GPU:\n", size >> 20, reps);
        summary("create", idle.create);
        summary("map", idle.map);
        summary("access", idle.access);
        summary("unmap", idle.unmap);
        summary("release", idle.release);
        std::printf("  while another stream runs ~100 ms of work (queue already finished when the "
                    "cycle ended: %d of %d):\n", done_early, reps);
        summary("create", loaded.create);
        summary("map", loaded.map);
        summary("access", loaded.access);
        summary("unmap", loaded.unmap);
        summary("release", loaded.release);
        CK(cuMemAddressFree(va, size));
    }
    CK(cuMemFree(buf));
    CK(cuEventDestroy(e0));
    CK(cuEventDestroy(e1));
    CK(cuStreamDestroy(busy));
    CK(cuDevicePrimaryCtxRelease(dev));
    std::printf("done\n");
    return 0;
}
