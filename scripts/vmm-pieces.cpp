// Measures what mapping one physical handle in pieces costs and allows (CUDA driver API):
// whether cuMemMap takes a non-zero offset into a handle, whether one piece can be unmapped
// while the others stay mapped and then be mapped elsewhere with the same bytes, and what
// cuMemSetAccess costs over N pieces of one handle against N handles and one whole mapping.
// A lead for design/zoo.md (handle size vs stranding): build and run on the GPU machine
// (scripts/vmm-common.h beside it),
//   g++ -O2 -std=c++17 scripts/vmm-pieces.cpp -I/usr/local/cuda/include -lcuda -o vmm-pieces
//   ./vmm-pieces
// Result on the H200 (driver 580.159.04, CUDA 13.0; design/gpu-results.md run 49): mapping a
// 16 MiB handle in 2 MiB pieces at offsets is refused with CUDA_ERROR_NOT_SUPPORTED (801),
// so a handle is mapped whole or not at all and the later sections did not run.
#include <cstring>

#include "vmm-common.h"

static size_t G;

int main() {
    init_device();
    CUmemAllocationProp p = pinned_prop();
    CK(cuMemGetAllocationGranularity(&G, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    int drv = 0;
    CK(cuDriverGetVersion(&drv));
    std::printf("driver %d granularity %zu\n", drv, G);
    const int reps = 15;
    for (size_t n : {8, 32}) {
        const size_t H = n * G;
        CUdeviceptr va, va2;
        CK(cuMemAddressReserve(&va, 4 * H, 0, 0, 0));
        va2 = va + 2 * H;
        CUmemGenericAllocationHandle h = create(H);
        std::vector<double> whole_map, whole_acc, whole_unmap, pc_map, pc_acc, pc_unmap1,
            pc_unmap_rest, pc_acc_each, nh_acc;
        for (int r = 0; r < reps; r++) {
            // A: the handle mapped whole, one SetAccess.
            double t0 = now_us();
            CK(cuMemMap(va, H, 0, h, 0));
            double t1 = now_us();
            access(va, H);
            double t2 = now_us();
            CK(cuMemUnmap(va, H));
            double t3 = now_us();
            whole_map.push_back(t1 - t0);
            whole_acc.push_back(t2 - t1);
            whole_unmap.push_back(t3 - t2);
            // B: the same handle mapped in n pieces of G at offsets, one SetAccess over all.
            t0 = now_us();
            for (size_t i = 0; i < n; i++) CK(cuMemMap(va + i * G, G, i * G, h, 0));
            t1 = now_us();
            access(va, H);
            t2 = now_us();
            pc_map.push_back(t1 - t0);
            pc_acc.push_back(t2 - t1);
            // One piece out while the others stay mapped.
            t0 = now_us();
            CK(cuMemUnmap(va + (n / 2) * G, G));
            t1 = now_us();
            pc_unmap1.push_back(t1 - t0);
            t0 = now_us();
            for (size_t i = 0; i < n; i++)
                if (i != n / 2) CK(cuMemUnmap(va + i * G, G));
            t1 = now_us();
            pc_unmap_rest.push_back((t1 - t0) / (double)(n - 1));
            // C: n pieces, one SetAccess per piece.
            for (size_t i = 0; i < n; i++) CK(cuMemMap(va + i * G, G, i * G, h, 0));
            t0 = now_us();
            for (size_t i = 0; i < n; i++) access(va + i * G, G);
            t1 = now_us();
            pc_acc_each.push_back(t1 - t0);
            for (size_t i = 0; i < n; i++) CK(cuMemUnmap(va + i * G, G));
        }
        // D: n handles of G side by side, one SetAccess over all.
        std::vector<CUmemGenericAllocationHandle> hs;
        for (size_t i = 0; i < n; i++) hs.push_back(create(G));
        for (int r = 0; r < reps; r++) {
            for (size_t i = 0; i < n; i++) CK(cuMemMap(va + i * G, G, 0, hs[i], 0));
            double t0 = now_us();
            access(va, H);
            double t1 = now_us();
            nh_acc.push_back(t1 - t0);
            for (size_t i = 0; i < n; i++) CK(cuMemUnmap(va + i * G, G));
        }
        for (auto x : hs) CK(cuMemRelease(x));
        std::printf(
            "handle %zu MiB (%zu pieces), medians of %d, us: whole map %.1f SetAccess %.1f unmap %.1f | "
            "pieces map %.1f (all) SetAccess one call %.1f, one call per piece %.1f (all) | "
            "unmap one piece %.1f, the rest %.1f each | %zu handles of 2 MiB: one SetAccess %.1f\n",
            H >> 20, n, reps, median(whole_map), median(whole_acc), median(whole_unmap),
            median(pc_map), median(pc_acc), median(pc_acc_each), median(pc_unmap1),
            median(pc_unmap_rest), n, median(nh_acc));
        // Correctness: bytes written through the whole mapping are seen through a piece mapped
        // elsewhere at its offset, while the other pieces stay mapped and written.
        for (size_t i = 0; i < n; i++) CK(cuMemMap(va + i * G, G, i * G, h, 0));
        access(va, H);
        for (size_t i = 0; i < n; i++) CK(cuMemsetD8(va + i * G, (unsigned char)(i + 1), G));
        CK(cuCtxSynchronize());
        size_t k = n / 2;
        CK(cuMemUnmap(va + k * G, G));
        CK(cuMemMap(va2, G, k * G, h, 0));
        access(va2, G);
        std::vector<unsigned char> buf(G);
        CK(cuMemcpyDtoH(buf.data(), va2, G));
        bool moved_ok = std::all_of(buf.begin(), buf.end(), [&](unsigned char c) { return c == k + 1; });
        CK(cuMemcpyDtoH(buf.data(), va + (k + 1) * G, G));
        bool rest_ok = std::all_of(buf.begin(), buf.end(), [&](unsigned char c) { return c == k + 2; });
        CK(cuMemsetD8(va2, 0xAB, G));
        CK(cuCtxSynchronize());
        CK(cuMemcpyDtoH(buf.data(), va + (k - 1) * G, G));
        bool neighbour_ok = std::all_of(buf.begin(), buf.end(), [&](unsigned char c) { return c == k; });
        std::printf("  piece %zu moved to another address: its bytes %s, the next piece %s, the one before after a write to the moved piece %s\n",
                    k, moved_ok ? "intact" : "WRONG", rest_ok ? "intact" : "WRONG",
                    neighbour_ok ? "intact" : "WRONG");
        CK(cuMemUnmap(va2, G));
        for (size_t i = 0; i < n; i++)
            if (i != k) CK(cuMemUnmap(va + i * G, G));
        CK(cuMemRelease(h));
        CK(cuMemAddressFree(va, 4 * H));
    }
    // A 2 MiB piece of a handle mapped whole: can it be unmapped alone? (expected: no)
    {
        const size_t H = 8 * G;
        CUdeviceptr va;
        CK(cuMemAddressReserve(&va, H, 0, 0, 0));
        CUmemGenericAllocationHandle h = create(H);
        CK(cuMemMap(va, H, 0, h, 0));
        CUresult r = cuMemUnmap(va + G, G);
        std::printf("partial unmap of a whole mapping: %d (%s)\n", (int)r,
                    r == CUDA_SUCCESS ? "allowed" : "refused");
        if (r == CUDA_SUCCESS) {
            cuMemUnmap(va, G);
            cuMemUnmap(va + 2 * G, H - 2 * G);
        } else {
            CK(cuMemUnmap(va, H));
        }
        CK(cuMemRelease(h));
        CK(cuMemAddressFree(va, H));
    }
    // Creating one 64 MiB handle against 32 of 2 MiB.
    {
        std::vector<double> one, many, rel1, reln;
        for (int r = 0; r < reps; r++) {
            double t0 = now_us();
            CUmemGenericAllocationHandle h = create(32 * G);
            double t1 = now_us();
            CK(cuMemRelease(h));
            double t2 = now_us();
            std::vector<CUmemGenericAllocationHandle> hs;
            for (int i = 0; i < 32; i++) hs.push_back(create(G));
            double t3 = now_us();
            for (auto x : hs) CK(cuMemRelease(x));
            double t4 = now_us();
            one.push_back(t1 - t0);
            rel1.push_back(t2 - t1);
            many.push_back(t3 - t2);
            reln.push_back(t4 - t3);
        }
        std::printf("create 64 MiB once %.1f us, release %.1f | create 32 x 2 MiB %.1f us, release %.1f\n",
                    median(one), median(rel1), median(many), median(reln));
    }
    CK(cuDevicePrimaryCtxRelease(dev));
    std::printf("done\n");
    return 0;
}
