// What scripts/vmm-pieces.cpp and scripts/vmm-busy.cpp share: checked driver calls, a
// microsecond clock, a median, and the device's first context with pinned-handle and
// read-write access helpers (CUDA driver API, device 0).
#pragma once
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

// A driver call that must succeed: on failure print the call, its code and line, and exit.
#define CK(x)                                                                            \
    do {                                                                                 \
        CUresult r_ = (x);                                                               \
        if (r_ != CUDA_SUCCESS) {                                                        \
            const char* s_ = nullptr;                                                    \
            cuGetErrorString(r_, &s_);                                                   \
            std::printf("FAIL %s: %d %s (line %d)\n", #x, (int)r_, s_ ? s_ : "?", __LINE__); \
            std::exit(1);                                                                \
        }                                                                                \
    } while (0)

static CUdevice dev;

static double now_us() {
    using namespace std::chrono;
    return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// cuInit, device 0 and its primary context made current.
static void init_device() {
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
}

static CUmemAllocationProp pinned_prop() {
    CUmemAllocationProp p = {};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = (int)dev;
    return p;
}

static CUmemGenericAllocationHandle create(size_t size) {
    CUmemAllocationProp p = pinned_prop();
    CUmemGenericAllocationHandle h;
    CK(cuMemCreate(&h, size, &p, 0));
    return h;
}

static void access(CUdeviceptr va, size_t size) {
    CUmemAccessDesc a = {};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = (int)dev;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(va, size, &a, 1));
}
