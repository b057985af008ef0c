// Does cuMemSetAccess cost more per handle as the range covers more mappings? The cost
// model (design/replay-results.md) prices one SetAccess over N mappings at N x 26.5 us plus
// 0.033 N^2 us, a quadratic fitted to the anchors' map+SetAccess+unmap figures for N up to
// 512; a pre-allocated pool of 41 GiB in 8 MiB handles is one SetAccess over 5,248 mappings,
// priced at 0.9 s by that term alone (design/zoo.md, "Pre-allocation in replays"). This
// maps N adjacent 2 MiB handles (N = 64, 512, 2048, 8192) and times SetAccess over them as
// one call, as calls of 64 handles, and as one call per handle, and the unmap of each
// handle, printing microseconds per handle; then, with all N mapped and accessible (a live
// pool), the median of 32 single-handle remaps (unmap, map, SetAccess of one handle), the
// case a stitch into a large pool pays. Build and run on the GPU machine
// (scripts/vmm-common.h beside it):
//   g++ -O2 -std=c++17 scripts/vmm-setaccess.cpp -I/usr/local/cuda/include -lcuda -o vmm-setaccess
//   ./vmm-setaccess
#include "vmm-common.h"

static const size_t G = 2u << 20;

// Map every handle at its place in the reservation (no access yet).
static void map_all(CUdeviceptr base, const std::vector<CUmemGenericAllocationHandle>& hs) {
    for (size_t i = 0; i < hs.size(); i++) CK(cuMemMap(base + i * G, G, 0, hs[i], 0));
}

// Unmap every handle, one call each; returns the microseconds taken in all.
static double unmap_all(CUdeviceptr base, size_t n) {
    double t0 = now_us();
    for (size_t i = 0; i < n; i++) CK(cuMemUnmap(base + i * G, G));
    return now_us() - t0;
}

// SetAccess over [base, base + n G) in calls of `chunk` handles; microseconds taken in all.
static double access_in_chunks(CUdeviceptr base, size_t n, size_t chunk) {
    double t0 = now_us();
    for (size_t i = 0; i < n; i += chunk) access(base + i * G, std::min(chunk, n - i) * G);
    return now_us() - t0;
}

int main() {
    init_device();
    std::printf("%6s %14s %16s %16s %14s %14s  (us per handle)\n", "N", "one call", "calls of 64",
                "call per handle", "unmap", "remap in pool");
    for (size_t n : {64, 512, 2048, 8192}) {
        CUdeviceptr base;
        CK(cuMemAddressReserve(&base, n * G, G, 0, 0));
        std::vector<CUmemGenericAllocationHandle> hs(n);
        for (auto& h : hs) h = create(G);
        double per[3], unmap = 0;
        const size_t chunks[3] = {n, 64, 1};
        for (int k = 0; k < 3; k++) {
            map_all(base, hs);
            per[k] = access_in_chunks(base, n, chunks[k]) / n;
            unmap += unmap_all(base, n) / n / 3;
        }
        // A live pool: every handle mapped and accessible; remap single handles inside it.
        map_all(base, hs);
        access_in_chunks(base, n, 64);
        std::vector<double> remap;
        for (size_t k = 0; k < 32; k++) {
            size_t i = (k * 7919) % n;
            double t0 = now_us();
            CK(cuMemUnmap(base + i * G, G));
            CK(cuMemMap(base + i * G, G, 0, hs[i], 0));
            access(base + i * G, G);
            remap.push_back(now_us() - t0);
        }
        unmap_all(base, n);
        std::printf("%6zu %14.1f %16.1f %16.1f %14.1f %14.1f\n", n, per[0], per[1], per[2], unmap,
                    median(remap));
        for (auto h : hs) CK(cuMemRelease(h));
        CK(cuMemAddressFree(base, n * G));
    }
    return 0;
}
