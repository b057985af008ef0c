// The per-call cost of PyTorch's allocator and of stitch-alloc's C ABI in one process, so
// that the process's own pace (design/gpu-results.md run 60: two CPU speeds between
// processes) is the same for both. Built and driven by scripts/torch-alloc-pair.py
// (torch.utils.cpp_extension.load).
//
// A "step" allocates 1,200 sizes in order (60% 512 B-64 KiB, 30% 1-9 MiB, 10% 32-96 MiB,
// from a fixed xorshift sequence), freeing the one before every third, then frees the rest
// in reverse: about the allocation count and size mix of a small training step. The
// result is nanoseconds per malloc + free pair over the timed steps, after warm-up steps
// that leave every size cached (no driver call in the timed ones, for either allocator).
//
// torch_pair_ns: c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete,
//   i.e. the allocator torch has installed (its default caching allocator unless the
//   process enabled another one first).
// stitch_pair_ns: stitch_malloc / stitch_free of the given libstitch_alloc.so, called
//   directly (dlopen), on the same stream: the C ABI alone, without torch's
//   CUDAPluggableAllocator wrapper around it.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

std::vector<size_t> step_sizes(size_t n) {
    std::vector<size_t> sz(n);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const uint64_t k = x % 10, r = x >> 20;
        sz[i] = k < 6 ? 512 + r % 65536 : k < 9 ? (1u << 20) + r % (8u << 20)
                                                : (32u << 20) + r % (64u << 20);
    }
    return sz;
}

// Nanoseconds per pair over `steps` steps of `sz`.
template <class Alloc, class Free>
double run_steps(int steps, const std::vector<size_t>& sz, Alloc alloc, Free free_) {
    std::vector<void*> p(sz.size(), nullptr);
    long pairs = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; s++) {
        for (size_t i = 0; i < sz.size(); i++) {
            p[i] = alloc(sz[i]);
            if (p[i] == nullptr) throw std::runtime_error("allocation failed");
            if (i % 3 == 2) {
                free_(p[i - 1], sz[i - 1]);
                p[i - 1] = nullptr;
                pairs++;
            }
        }
        for (size_t i = sz.size(); i-- > 0;) {
            if (p[i] != nullptr) {
                free_(p[i], sz[i]);
                p[i] = nullptr;
                pairs++;
            }
        }
    }
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(pairs);
}

double torch_pair_ns(int steps, int warmup, int64_t n) {
    const auto sz = step_sizes(static_cast<size_t>(n));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    auto alloc = [&](size_t s) {
        return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(s, stream.stream());
    };
    auto free_ = [](void* p, size_t) { c10::cuda::CUDACachingAllocator::raw_delete(p); };
    run_steps(warmup, sz, alloc, free_);
    return run_steps(steps, sz, alloc, free_);
}

double stitch_pair_ns(const std::string& lib, int steps, int warmup, int64_t n) {
    void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) throw std::runtime_error(std::string("dlopen: ") + dlerror());
    using MallocFn = void* (*)(size_t, int, void*);
    using FreeFn = void (*)(void*, size_t, int, void*);
    auto m = reinterpret_cast<MallocFn>(dlsym(h, "stitch_malloc"));
    auto f = reinterpret_cast<FreeFn>(dlsym(h, "stitch_free"));
    if (m == nullptr || f == nullptr) throw std::runtime_error("stitch_malloc / stitch_free missing");
    const auto sz = step_sizes(static_cast<size_t>(n));
    const int device = c10::cuda::current_device();
    void* stream = c10::cuda::getCurrentCUDAStream().stream();
    auto alloc = [&](size_t s) { return m(s, device, stream); };
    auto free_ = [&](void* p, size_t s) { f(p, s, device, stream); };
    run_steps(warmup, sz, alloc, free_);
    return run_steps(steps, sz, alloc, free_);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("torch_pair_ns", &torch_pair_ns, "ns per pair through torch's installed allocator");
    m.def("stitch_pair_ns", &stitch_pair_ns, "ns per pair through stitch_malloc / stitch_free");
}
