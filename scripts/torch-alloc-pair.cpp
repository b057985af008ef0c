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
// iface_pair_ns (with grab_native, after stitch_alloc.enable installed the extension):
//   CUDAAllocator::allocate and the DataPtr's release, i.e. what torch.empty and del reach,
//   through torch's own allocator or the installed stitch-alloc extension.
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

// Nanoseconds per pair over `steps` steps of `sz`. `alloc(i, size)` allocates slot `i`
// (false: it failed), `free_(i, size)` frees it; the caller keeps the slots.
template <class Alloc, class Free>
double run_steps(int steps, const std::vector<size_t>& sz, Alloc alloc, Free free_) {
    std::vector<bool> held(sz.size(), false);
    long pairs = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; s++) {
        for (size_t i = 0; i < sz.size(); i++) {
            if (!alloc(i, sz[i])) throw std::runtime_error("allocation failed");
            held[i] = true;
            if (i % 3 == 2) {
                free_(i - 1, sz[i - 1]);
                held[i - 1] = false;
                pairs++;
            }
        }
        for (size_t i = sz.size(); i-- > 0;) {
            if (held[i]) {
                free_(i, sz[i]);
                held[i] = false;
                pairs++;
            }
        }
    }
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(pairs);
}

// Slots of raw pointers for `run_steps`.
template <class Malloc, class Free>
double run_raw(int steps, int warmup, const std::vector<size_t>& sz, Malloc m, Free f) {
    std::vector<void*> p(sz.size(), nullptr);
    auto alloc = [&](size_t i, size_t s) { return (p[i] = m(s)) != nullptr; };
    auto free_ = [&](size_t i, size_t s) {
        f(p[i], s);
        p[i] = nullptr;
    };
    run_steps(warmup, sz, alloc, free_);
    return run_steps(steps, sz, alloc, free_);
}

double torch_pair_ns(int steps, int warmup, int64_t n) {
    const auto sz = step_sizes(static_cast<size_t>(n));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    auto alloc = [&](size_t s) {
        return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(s, stream.stream());
    };
    auto free_ = [](void* p, size_t) { c10::cuda::CUDACachingAllocator::raw_delete(p); };
    return run_raw(steps, warmup, sz, alloc, free_);
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
    return run_raw(steps, warmup, sz, alloc, free_);
}

// torch's own caching allocator, kept by `grab_native` before another one is installed.
c10::cuda::CUDACachingAllocator::CUDAAllocator* native = nullptr;

void grab_native() { native = c10::cuda::CUDACachingAllocator::get(); }

// Whether the installed allocator is another than the one `grab_native` kept.
bool another_installed() {
    return native != nullptr && c10::cuda::CUDACachingAllocator::get() != native;
}

// ns per pair through the `CUDAAllocator::allocate` interface, what `torch.empty` calls, the
// allocation released by dropping its DataPtr (its deleter, as `del` does): torch's own
// allocator (`use_native`, kept by `grab_native`, initialised here if torch never did
// because another was installed first) or the installed one.
double iface_pair_ns(bool use_native, int steps, int warmup, int64_t n) {
    auto* a = use_native ? native : c10::cuda::CUDACachingAllocator::get();
    if (a == nullptr) throw std::runtime_error("grab_native was not called");
    if (use_native && !a->initialized()) a->init(static_cast<int>(c10::cuda::device_count()));
    const auto sz = step_sizes(static_cast<size_t>(n));
    std::vector<c10::DataPtr> p(sz.size());
    auto alloc = [&](size_t i, size_t s) {
        p[i] = a->allocate(s);
        return p[i].get() != nullptr;
    };
    auto free_ = [&](size_t i, size_t) { p[i].clear(); };
    run_steps(warmup, sz, alloc, free_);
    return run_steps(steps, sz, alloc, free_);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("torch_pair_ns", &torch_pair_ns, "ns per pair through torch's installed allocator");
    m.def("stitch_pair_ns", &stitch_pair_ns, "ns per pair through stitch_malloc / stitch_free");
    m.def("grab_native", &grab_native, "keep torch's own allocator before another is installed");
    m.def("another_installed", &another_installed, "whether another allocator is installed");
    m.def("iface_pair_ns", &iface_pair_ns, "ns per pair through CUDAAllocator::allocate");
}
