// stitch_torch.cpp: torch's whole CUDA allocator interface
// (c10::cuda::CUDACachingAllocator::CUDAAllocator, torch 2.11) over the C ABI of
// libstitch_alloc.so (include/stitch_alloc.h).
//
// Built by stitch_alloc.enable() with torch.utils.cpp_extension.load (JIT, cached), then
// installed as torch's CUDA allocator (torch::cuda::CUDAPluggableAllocator::
// changeCurrentAllocator, which keeps the shared_ptr alive and checks that the allocator in
// place was not used yet). The library's functions are looked up with dlsym in the file
// the Python package found (the same file its ctypes handle uses, so one allocator state).
//
// What this layer keeps itself (the library knows nothing of torch):
// * the live allocations (size asked, device, stream, graph pool, allocation context);
// * CUDA graph private pools: blocks of a pool come from stitch_malloc_graph (allowed on a
//   capturing stream, no event on any stream), stay in the pool when freed (reused only by
//   later allocations to the same pool, best fit by size) and go back to the library only
//   when the pool's use count drops to 0 (releasePool), each freed on its own stream;
// * memory history (trace entries alloc / free_requested / free_completed / oom, with the
//   context recorder's stacks) and the snapshot, in which each allocation (live, or cached
//   in a graph pool) is one segment of one block;
// * OOM observers and trace trackers.
// Statistics come from the library (stitch_device_stats), corrected for blocks cached in
// graph pools (reserved, not allocated in torch's sense).

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <c10/util/flat_hash_map.h>

#include "stitch_alloc.h"

namespace {

using c10::DeviceIndex;
using c10::MempoolId_t;
namespace CCA = c10::cuda::CUDACachingAllocator;
namespace CDA = c10::CachingDeviceAllocator;

const MempoolId_t kNoPool{0, 0};

// --- the library's functions, looked up by name ------------------------------------------

struct Lib {
  void* (*malloc)(size_t, int, void*) = nullptr;
  void (*free)(void*, size_t, int, void*) = nullptr;
  void (*init)(int) = nullptr;
  void (*reset)() = nullptr;
  void (*record_stream)(void*, void*) = nullptr;
  ptrdiff_t (*device_stats)(int, struct stitch_device_stats*, size_t) = nullptr;
  int (*reset_peak_stats)(int) = nullptr;
  int (*reset_accumulated_stats)(int) = nullptr;
  int (*set_memory_fraction)(int, double) = nullptr;
  double (*get_memory_fraction)(int) = nullptr;
  void* (*malloc_graph)(size_t, int, void*) = nullptr;
  int (*free_graph)(void*, int) = nullptr;
  int (*segment_log)(int, int) = nullptr;
  ptrdiff_t (*segment_events)(int, struct stitch_segment_event*, size_t) = nullptr;
  ptrdiff_t (*share)(void*, uint8_t*, size_t, uint64_t*) = nullptr;
  int (*ipc_open)(int, const uint8_t*, size_t, void**) = nullptr;
  int (*ipc_close)(void*) = nullptr;
  const char* (*last_error)() = nullptr;
  void (*clear_error)() = nullptr;

  // Every symbol of `path`, or an error naming the missing ones.
  void open(const std::string& path) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(h != nullptr, "stitch-alloc: cannot load ", path, ": ", dlerror());
    std::vector<std::string> missing;
    auto get = [&](auto& f, const char* name) {
      void* s = dlsym(h, name);
      if (s == nullptr) {
        missing.emplace_back(name);
      }
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(s);
    };
    get(malloc, "stitch_malloc");
    get(free, "stitch_free");
    get(init, "stitch_init");
    get(reset, "stitch_reset");
    get(record_stream, "stitch_record_stream");
    get(device_stats, "stitch_device_stats");
    get(reset_peak_stats, "stitch_reset_peak_stats");
    get(reset_accumulated_stats, "stitch_reset_accumulated_stats");
    get(set_memory_fraction, "stitch_set_memory_fraction");
    get(get_memory_fraction, "stitch_get_memory_fraction");
    get(malloc_graph, "stitch_malloc_graph");
    get(free_graph, "stitch_free_graph");
    get(segment_log, "stitch_segment_log");
    get(segment_events, "stitch_segment_events");
    get(share, "stitch_share");
    get(ipc_open, "stitch_ipc_open");
    get(ipc_close, "stitch_ipc_close");
    get(last_error, "stitch_last_error");
    get(clear_error, "stitch_clear_error");
    if (!missing.empty()) {
      std::string m;
      for (auto& s : missing) {
        m += (m.empty() ? "" : ", ") + s;
      }
      TORCH_CHECK(false, "stitch-alloc: ", path, " lacks ", m,
                  " (an older library: rebuild it with cargo build --release --features capi)");
    }
  }

  std::string error() const {
    const char* e = last_error();
    return e == nullptr ? std::string() : std::string(e);
  }
};

Lib lib;

void deleter(void* ptr);

// A diagnostic clock (`_set_alloc_clock`, `_alloc_clock`; scripts/torch-inproc-speed.py
// --alloc-clock): nanoseconds spent inside this allocator's `allocate` and DataPtr deleter,
// counted apart for stitch-alloc's blocks and for the blocks of torch's own allocator handed
// out while delegating, so that the two allocators' cost inside a real step can be compared.
// Off by default; when off it costs one relaxed load per call.
enum ClockSlot { kStitchAlloc = 0, kStitchFree = 1, kNativeAlloc = 2, kNativeFree = 3 };
std::atomic<bool> clock_on{false};
std::array<std::atomic<uint64_t>, 4> clock_ns{};
std::array<std::atomic<uint64_t>, 4> clock_calls{};
// Torch's own deleter of the blocks it hands out (`local_raw_delete`), seen at the first
// delegated allocation while the clock runs.
std::atomic<c10::DeleterFnPtr> native_deleter{nullptr};

inline uint64_t clock_now() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

inline void clock_add(ClockSlot slot, uint64_t t0) {
  clock_ns[slot].fetch_add(clock_now() - t0, std::memory_order_relaxed);
  clock_calls[slot].fetch_add(1, std::memory_order_relaxed);
}

// The deleter of a delegated block while the clock runs: torch's own, timed.
void timed_native_deleter(void* ptr) {
  uint64_t t0 = clock_now();
  native_deleter.load(std::memory_order_relaxed)(ptr);
  clock_add(kNativeFree, t0);
}

// A graph-pool block leaving its released pool.
struct Released {
  void* ptr;
  DeviceIndex device;
  size_t size;
  cudaStream_t stream;
  std::shared_ptr<CCA::CUDAAllocator> allocator;  // the pool's own allocator, if any
};

struct MempoolHash {
  size_t operator()(const MempoolId_t& p) const {
    return std::hash<uint64_t>()(p.first) ^ (std::hash<uint64_t>()(p.second) << 1);
  }
};

// One live allocation.
struct Alloc {
  size_t size = 0;  // asked for
  DeviceIndex device = 0;
  cudaStream_t stream = nullptr;
  MempoolId_t pool = kNoPool;
  std::shared_ptr<c10::GatheredContext> context;
  // Creation order of its segment (SegmentInfo::registration_counter: NCCL's
  // register_mem_pool registers a pool's segments in this order, the same on every rank).
  int32_t registration = 0;
};

// A block owned by a graph pool.
struct PoolBlock {
  size_t size = 0;  // the size it was created with (stitch_malloc_graph)
  cudaStream_t stream = nullptr;
  bool live = false;
  int32_t registration = 0;  // creation order (see Alloc::registration)
};

// A CUDA graph's private memory pool.
struct Pool {
  DeviceIndex device = 0;
  int use_count = 0;
  // A torch.cuda.MemPool of another allocator (say a CUDAPluggableAllocator over
  // stitch_malloc_one_handle, for NCCL's register_mem_pool): its blocks come from and go
  // back to that allocator's raw_alloc_with_stream / raw_delete; null: the library's graph
  // memory (stitch_malloc_graph).
  std::shared_ptr<CCA::CUDAAllocator> allocator;
  std::unordered_map<void*, PoolBlock> blocks;
  std::multimap<size_t, void*> free_blocks;  // size -> block, the cached ones
  size_t cached_bytes = 0;                    // sum of the free blocks' sizes
};

// A capture allocating to a pool (beginAllocateToPool .. endAllocateToPool).
struct Capture {
  DeviceIndex device;
  MempoolId_t pool;
  std::function<bool(cudaStream_t)> filter;
};

// What getCheckpointState saves: the pool's blocks and which were live.
struct PoolState : CCA::AllocatorState {
  DeviceIndex device = 0;
  MempoolId_t pool = kNoPool;
  std::vector<std::pair<void*, PoolBlock>> blocks;
};

class StitchAllocator final : public CCA::CUDAAllocator {
 public:
  // --- c10::Allocator ------------------------------------------------------------------

  c10::DataPtr allocate(size_t n) override {
    if (clock_on.load(std::memory_order_relaxed)) {
      return clocked_allocate(n);
    }
    if (delegate_.load(std::memory_order_relaxed)) {
      return native_->allocate(n);
    }
    return alloc_current(n);
  }

  // This allocator's block for `n` bytes on the current device and its current stream.
  c10::DataPtr alloc_current(size_t n) {
    DeviceIndex device = c10::cuda::current_device();
    return alloc_on(n, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  // `allocate` while the diagnostic clock runs. A delegated block whose context is its
  // pointer (torch's caching allocator's) gets the timed deleter, which calls torch's; torch's
  // recordStream ignores such a block, so the clock is for single-stream loops only.
  c10::DataPtr clocked_allocate(size_t n) {
    uint64_t t0 = clock_now();
    if (delegate_.load(std::memory_order_relaxed)) {
      c10::DataPtr d = native_->allocate(n);
      clock_add(kNativeAlloc, t0);
      void* p = d.get();
      if (p == nullptr || d.get_context() != p) {
        return d;
      }
      c10::DeleterFnPtr del = d.get_deleter();
      c10::DeleterFnPtr seen = native_deleter.load(std::memory_order_relaxed);
      // The first delegated block names torch's deleter (a failed exchange loads the winner's).
      if (seen == nullptr && native_deleter.compare_exchange_strong(seen, del)) {
        seen = del;
      }
      if (del != seen) {
        return d;
      }
      c10::Device dev = d.device();
      d.release_context();
      return c10::DataPtr(p, p, &timed_native_deleter, dev);
    }
    c10::DataPtr d = alloc_current(n);
    clock_add(kStitchAlloc, t0);
    return d;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &deleter; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // --- c10::DeviceAllocator ------------------------------------------------------------

  bool initialized() override { return initialized_.load(); }

  void emptyCache(MempoolId_t mempool_id) override {
    if (delegated_.load()) {
      native_->emptyCache(mempool_id);
    }
    std::vector<Released> todo;
    {
      std::lock_guard<std::mutex> g(mu_);
      collect_releasable(todo);
    }
    free_pool_blocks(todo);
    if (mempool_id == kNoPool) {
      lib.reset();
    }
    for (int d = 0; d < device_count_.load(); d++) {
      drain_segments(static_cast<DeviceIndex>(d));
    }
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    void* p = ptr.get();
    if (p == nullptr) {
      return;
    }
    if (ptr.get_deleter() != &deleter && delegated_.load()) {
      native_->recordStream(ptr, stream);  // handed out while delegating
      return;
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = allocs_.find(p);
      // A graph pool block is not freed to the library while the pool lives: nothing to
      // fence.
      if (it == allocs_.end() || it->second.pool != kNoPool) {
        return;
      }
    }
    lib.record_stream(p, stream.stream());
  }

  CDA::DeviceStats getDeviceStats(DeviceIndex device) override {
    struct stitch_device_stats s{};
    lib.clear_error();
    ptrdiff_t r = lib.device_stats(device, &s, sizeof s);
    TORCH_CHECK(r >= 0, "stitch-alloc: getDeviceStats(", int(device), "): ", lib.error());
    size_t cached = 0, cached_count = 0;
    int64_t pool_allocs = 0, pool_frees = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& kv : pools_) {
        if (kv.second.device == device) {
          cached += kv.second.cached_bytes;
          cached_count += kv.second.free_blocks.size();
        }
      }
      pool_allocs = pool_reuses_[device_slot(device)];
      pool_frees = pool_frees_[device_slot(device)];
    }
    auto i64 = [](uint64_t v) { return static_cast<int64_t>(v); };
    auto sub = [](uint64_t a, uint64_t b) { return static_cast<int64_t>(a > b ? a - b : 0); };
    CDA::DeviceStats d;
    auto set = [](c10::CachingAllocator::StatArray& a, int64_t cur, int64_t peak, int64_t allocd,
                  int64_t freed) {
      auto& s = a[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      s.current = cur;
      s.peak = std::max(peak, cur);
      s.allocated = allocd;
      s.freed = freed;
    };
    // Bytes: allocated/freed totals are not kept by the library; torch's "allocated" of a
    // byte stat is left 0 here, "freed" too.
    set(d.allocated_bytes, sub(s.allocated_current, cached), i64(s.allocated_peak), 0, 0);
    set(d.requested_bytes, sub(s.requested_current, cached), i64(s.requested_peak), 0, 0);
    set(d.reserved_bytes, i64(s.reserved_current), i64(s.reserved_peak), 0, 0);
    int64_t active = sub(s.active_current, cached);
    set(d.active_bytes, active, std::max(i64(s.allocated_peak), active), 0, 0);
    set(d.inactive_split_bytes, i64(s.inactive_split_bytes_current),
        i64(s.inactive_split_bytes_current), 0, 0);
    int64_t live = sub(s.allocations_current, cached_count);
    set(d.allocation, live, i64(s.allocations_peak), i64(s.allocations_allocated) + pool_allocs,
        i64(s.allocations_freed) + pool_frees);
    set(d.active, live, i64(s.allocations_peak), i64(s.allocations_allocated) + pool_allocs,
        i64(s.allocations_freed) + pool_frees);
    set(d.segment, i64(s.segments_current), i64(s.segments_current), i64(s.segments_allocated),
        i64(s.segments_freed));
    d.num_alloc_retries = i64(s.num_alloc_retries);
    d.num_ooms = i64(s.num_ooms);
    d.num_device_alloc = i64(s.num_device_alloc);
    d.num_device_free = i64(s.num_device_free);
    return d;
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    lib.clear_error();
    TORCH_CHECK(lib.reset_accumulated_stats(device) == 0, "stitch-alloc: ", lib.error());
    std::lock_guard<std::mutex> g(mu_);
    pool_reuses_[device_slot(device)] = 0;
    pool_frees_[device_slot(device)] = 0;
  }

  void resetPeakStats(DeviceIndex device) override {
    lib.clear_error();
    TORCH_CHECK(lib.reset_peak_stats(device) == 0, "stitch-alloc: ", lib.error());
  }

  // --- CUDAAllocator -------------------------------------------------------------------

  void* raw_alloc(size_t nbytes) override {
    DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (delegate_.load(std::memory_order_relaxed)) {
      return native_->raw_alloc_with_stream(nbytes, stream);
    }
    DeviceIndex device = c10::cuda::current_device();
    c10::DataPtr p = alloc_on(nbytes, device, stream);
    return p.release_context();
  }

  void raw_delete(void* ptr) override {
    if (free_ptr(ptr)) {
      return;
    }
    if (delegated_.load()) {
      native_->raw_delete(ptr);  // handed out while delegating (torch checks it is its own)
      return;
    }
    TORCH_CHECK(false, "stitch-alloc: raw_delete of ", ptr, ", which is not a live allocation");
  }

  void init(int device_count) override {
    lib.init(device_count);
    device_count_.store(std::clamp(device_count, 0, static_cast<int>(kMaxDevices)));
    initialized_.store(true);
  }

  double getMemoryFraction(DeviceIndex device) override {
    double f = lib.get_memory_fraction(device);
    TORCH_CHECK(f >= 0, "stitch-alloc: getMemoryFraction: ", lib.error());
    return f;
  }

  void setMemoryFraction(double fraction, DeviceIndex device) override {
    lib.clear_error();
    TORCH_CHECK(lib.set_memory_fraction(device, fraction) == 0, "stitch-alloc: ", lib.error());
  }

  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex) override {
    return {};
  }

  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }

  // The largest allocation that would succeed without waiting (cuDNN's benchmark mode sizes
  // its workspaces by it). torch's own allocator answers with the larger of the device's free
  // memory and its largest cached block; here a request may be stitched from every free
  // handle, so: free mapped bytes not stranded beside live ones, plus what may still be
  // created (under the capacity and the device's free memory), or the largest free span if
  // larger.
  void cacheInfo(DeviceIndex device, size_t* largestBlock) override {
    struct stitch_device_stats s{};
    if (lib.device_stats(device, &s, sizeof s) < 0) {
      *largestBlock = 0;
      return;
    }
    size_t free_b = 0, total_b = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
        (void)cudaGetLastError();
        free_b = 0;
      }
    }
    uint64_t headroom = s.capacity > s.reserved_current ? s.capacity - s.reserved_current : 0;
    headroom = std::min<uint64_t>(headroom, free_b);
    uint64_t stitchable = s.free_bytes > s.inactive_split_bytes_current
                              ? s.free_bytes - s.inactive_split_bytes_current
                              : 0;
    *largestBlock = static_cast<size_t>(std::max<uint64_t>(s.largest_free_span, stitchable + headroom));
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = allocs_.find(ptr);
    if (it != allocs_.end()) {
      if (size != nullptr) {
        *size = it->second.size;
      }
      return ptr;
    }
    // A pointer inside an allocation (rare): its allocation's base.
    auto a = reinterpret_cast<uintptr_t>(ptr);
    for (auto& kv : allocs_) {
      auto b = reinterpret_cast<uintptr_t>(kv.first);
      if (a >= b && a < b + kv.second.size) {
        if (size != nullptr) {
          *size = kv.second.size;
        }
        return kv.first;
      }
    }
    TORCH_CHECK(false, "stitch-alloc: getBaseAllocation: ", ptr, " is not a live allocation");
    return nullptr;  // not reached
  }

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    recordStream(ptr, c10::cuda::CUDAStream(stream));
  }

  CCA::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    CCA::SnapshotInfo info;
    std::lock_guard<std::mutex> g(mu_);
    for (auto& kv : allocs_) {
      const Alloc& a = kv.second;
      if (mempool_id != kNoPool && a.pool != mempool_id) {
        continue;
      }
      CDA::SegmentInfo seg;
      seg.device = a.device;
      seg.address = reinterpret_cast<size_t>(kv.first);
      seg.total_size = a.size;
      seg.requested_size = a.size;
      seg.allocated_size = a.size;
      seg.active_size = a.size;
      seg.stream = a.stream;
      seg.is_large = true;
      seg.owner_private_pool_id = a.pool;
      seg.registration_counter = a.registration;
      seg.context_when_allocated = a.context;
      CDA::BlockInfo b;
      b.size = a.size;
      b.requested_size = a.size;
      b.allocated = true;
      b.active = true;
      b.context_when_allocated = a.context;
      seg.blocks.push_back(b);
      info.segments.push_back(std::move(seg));
    }
    for (auto& kv : pools_) {
      if (mempool_id != kNoPool && kv.first != mempool_id) {
        continue;
      }
      for (auto& fb : kv.second.free_blocks) {
        CDA::SegmentInfo seg;
        seg.device = kv.second.device;
        seg.address = reinterpret_cast<size_t>(fb.second);
        seg.total_size = fb.first;
        seg.is_large = true;
        seg.owner_private_pool_id = kv.first;
        auto pb = kv.second.blocks.find(fb.second);
        seg.registration_counter = pb == kv.second.blocks.end() ? 0 : pb->second.registration;
        CDA::BlockInfo b;
        b.size = fb.first;
        seg.blocks.push_back(b);
        info.segments.push_back(std::move(seg));
      }
    }
    std::sort(info.segments.begin(), info.segments.end(),
              [](const CDA::SegmentInfo& x, const CDA::SegmentInfo& y) {
                return x.address < y.address;
              });
    if (include_traces) {
      int n = c10::cuda::device_count();
      info.device_traces.resize(std::max<int>(n, 1));
      for (auto& e : trace_) {
        size_t d = static_cast<size_t>(std::max<int>(e.device_, 0));
        if (d >= info.device_traces.size()) {
          info.device_traces.resize(d + 1);
        }
        info.device_traces[d].push_back(e);
      }
    }
    // torch's settings do not apply (its fields have no defaults: all set here).
    auto& c = info.config_metadata;
    c.garbage_collection_threshold = 0.0;
    c.max_split_size = std::numeric_limits<size_t>::max();
    c.pinned_num_register_threads = 0;
    c.expandable_segments = false;
    c.release_lock_on_malloc = false;
    c.pinned_use_host_register = false;
    c.graph_capture_record_stream_reuse = false;
    c.last_allocator_settings = "stitch-alloc";
    return info;
  }

  void beginAllocateToPool(DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& c : captures_) {
      TORCH_CHECK(!(c.pool == mempool_id && c.device == device),
                  "stitch-alloc: beginAllocateToPool: already allocating to this pool");
    }
    Pool& p = pools_[mempool_id];
    p.device = device;
    p.use_count++;
    captures_.push_back(Capture{device, mempool_id, std::move(filter)});
    captures_n_.store(static_cast<int>(captures_.size()), std::memory_order_release);
  }

  void endAllocateToPool(DeviceIndex device, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = captures_.begin(); it != captures_.end(); ++it) {
      if (it->pool == mempool_id && it->device == device) {
        captures_.erase(it);
        captures_n_.store(static_cast<int>(captures_.size()), std::memory_order_release);
        return;
      }
    }
    TORCH_CHECK(false, "stitch-alloc: endAllocateToPool: not allocating to this pool");
  }

  void releasePool(DeviceIndex device, MempoolId_t mempool_id) override {
    std::vector<Released> todo;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = pools_.find(mempool_id);
      if (it == pools_.end()) {
        return;
      }
      if (--it->second.use_count > 0) {
        return;
      }
      it->second.use_count = 0;
      collect_releasable(todo);
    }
    free_pool_blocks(todo);
  }

  int getPoolUseCount(DeviceIndex, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = pools_.find(mempool_id);
    return it == pools_.end() ? 0 : it->second.use_count;
  }

  void createOrIncrefPool(DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    if (allocator.get() == this) {
      allocator = nullptr;
    }
    std::lock_guard<std::mutex> g(mu_);
    Pool& p = pools_[mempool_id];
    TORCH_CHECK(p.blocks.empty() || p.allocator == allocator,
                "stitch-alloc: memory pool ", mempool_id.first, ".", mempool_id.second,
                " already holds blocks of another allocator");
    p.allocator = std::move(allocator);
    p.device = device;
    p.use_count++;
  }

  // torch.cuda.MemPool's destructor calls setUseOnOOM(..., false): that must not throw (a
  // throw there terminates the process). Only turning the feature on is refused.
  void setUseOnOOM(DeviceIndex, MempoolId_t, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom,
                "stitch-alloc does not support setUseOnOOM (a memory pool used when the "
                "device is out of memory)");
  }

  // Pool blocks are never split (each is the exact size it was asked for): nothing to do.
  void setNoSplit(DeviceIndex, MempoolId_t) override {}

  bool checkPoolLiveAllocations(DeviceIndex, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = pools_.find(mempool_id);
    if (it == pools_.end()) {
      return expected.empty();
    }
    size_t live = 0;
    for (auto& kv : it->second.blocks) {
      if (kv.second.live) {
        if (expected.count(kv.first) == 0) {
          return false;
        }
        live++;
      }
    }
    return live == expected.size();
  }

  // CUDA IPC (torch.multiprocessing). The sender's handles are exported as POSIX file
  // descriptors by the library (stitch_share); the message starts with torch's handle
  // version byte and a type byte of our own, so torch's own allocator refuses it instead of
  // misreading it. The receiver maps it with stitch_ipc_open (cached per message there).
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    lib.clear_error();
    ptrdiff_t need = lib.share(ptr, nullptr, 0, nullptr);
    TORCH_CHECK(need > 0, "stitch-alloc: cannot share ", ptr,
                " with another process (CUDA IPC): ", lib.error());
    std::string h(static_cast<size_t>(need), '\0');
    uint64_t offset = 0;
    ptrdiff_t n = lib.share(ptr, reinterpret_cast<uint8_t*>(&h[0]), h.size(), &offset);
    TORCH_CHECK(n == need, "stitch-alloc: sharing ", ptr, " (CUDA IPC): ", lib.error());
    return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(h)};
  }

  // A message of stitch_share (from a process running stitch-alloc) is opened by the
  // library; any other handle came from torch's own allocator in the sender (cudaMalloc or
  // expandable segments) and is opened by torch's own allocator here, as it would be without
  // stitch-alloc. The returned pointer's deleter synchronises the device before the last
  // user unmaps (torch's deleter decrements the sender's reference count only after it).
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    if (handle.size() < 2 || handle[0] != 2 || handle[1] != 'S') {
      TORCH_CHECK(native_ != nullptr,
                  "stitch-alloc: a CUDA IPC handle from torch's own allocator, and torch's "
                  "allocator was not kept to open it");
      init_native();
      return native_->getIpcDevPtr(std::move(handle));
    }
    DeviceIndex device = c10::cuda::current_device();
    void* base = nullptr;
    lib.clear_error();
    int r = lib.ipc_open(device, reinterpret_cast<const uint8_t*>(handle.data()), handle.size(),
                         &base);
    TORCH_CHECK(r == 0 && base != nullptr,
                "stitch-alloc: cannot open a CUDA IPC handle on device ", int(device), ": ",
                lib.error());
    return std::shared_ptr<void>(base, [device](void* p) {
      c10::cuda::CUDAGuard guard(device);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        TORCH_WARN("stitch-alloc: synchronising before closing an IPC mapping: ",
                   cudaGetErrorString(e));
      }
      if (lib.ipc_close(p) != 0) {
        TORCH_WARN("stitch-alloc: closing an IPC mapping: ", lib.error());
      }
    });
  }

  // Torch's own allocator, kept when this one was installed: it opens IPC handles that
  // processes under torch's allocator send.
  void keep_native(CCA::CUDAAllocator* native) { native_ = native; }

  // Torch's own allocator, initialised on first use (torch never initialises it when this
  // one is installed first).
  void init_native() {
    std::lock_guard<std::mutex> g(native_mu_);
    if (!native_->initialized()) {
      native_->init(static_cast<int>(c10::cuda::device_count()));
    }
  }

  // Delegation, a diagnostic for comparing the two allocators' speed in one process
  // (scripts/torch-inproc-speed.py): while on, new allocations come from torch's
  // own caching allocator; their DataPtrs carry its deleter, and raw_delete, recordStream
  // and emptyCache hand it what is not this allocator's. Not for CUDA graphs, memory pools
  // or IPC while on; statistics and snapshots describe this allocator only.
  void set_delegate(bool on) {
    TORCH_CHECK(native_ != nullptr, "stitch-alloc: torch's own allocator was not kept");
    if (on) {
      init_native();
      delegated_.store(true);
    }
    delegate_.store(on);
  }

  bool isHistoryEnabled() override {
    std::lock_guard<std::mutex> g(mu_);
    return record_history_;
  }

  void recordHistory(bool enabled, CDA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CDA::RecordContext when,
                     bool clearHistory, const std::vector<std::string>& skip_actions) override {
    std::lock_guard<std::mutex> g(mu_);
    record_history_ = enabled;
    history_on_.store(enabled);
    // The library records its maps and unmaps while the history is on (segment_map /
    // segment_unmap entries); it touches no driver to do so.
    int n = device_count_.load();
    if (n == 0) {
      n = static_cast<int>(c10::cuda::device_count());
    }
    for (int d = 0; d < n && d < static_cast<int>(kMaxDevices); d++) {
      (void)lib.segment_log(d, enabled ? 1 : 0);
    }
    context_recorder_ = enabled ? context_recorder : nullptr;
    record_when_ = enabled ? when : CDA::RecordContext::NEVER;
    contexts_on_.store(record_when_ != CDA::RecordContext::NEVER, std::memory_order_release);
    tracing_on_.store(record_history_ || !trace_trackers_.empty(), std::memory_order_release);
    trace_max_ = std::max<size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (auto& s : skip_actions) {
      skip_.insert(static_cast<int>(CDA::parseTraceEntryAction(s)));
    }
    if (clearHistory) {
      trace_.clear();
    }
    while (trace_.size() > trace_max_) {
      trace_.pop_front();
    }
  }

  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> g(mu_);
    trace_trackers_.push_back(std::move(tracker));
    tracing_on_.store(true, std::memory_order_release);
  }

  // Every mapping is made accessible to the configured peers (peers:all by default, every
  // device that can access it) when it is created: nothing to enable here.
  void enablePeerAccess(DeviceIndex, DeviceIndex) override {}

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    // Between devices always the peer copy: it works whether or not the mappings were made
    // accessible to the other device (peers:none), staging through the host if need be.
    if (dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(DeviceIndex device,
                                                          MempoolId_t id) override {
    std::lock_guard<std::mutex> g(mu_);
    auto st = std::make_shared<PoolState>();
    st->device = device;
    st->pool = id;
    auto it = pools_.find(id);
    if (it != pools_.end()) {
      for (auto& kv : it->second.blocks) {
        st->blocks.emplace_back(kv.first, kv.second);
      }
    }
    return st;
  }

  // Make the pool's blocks live or cached as they were at the checkpoint. Pool blocks never
  // move, split or merge, so a block of the checkpoint is still there; blocks made after it
  // become cached.
  CCA::CheckpointDelta setCheckpointPoolState(DeviceIndex device,
                                              std::shared_ptr<CCA::AllocatorState> pps) override {
    auto st = std::dynamic_pointer_cast<PoolState>(pps);
    TORCH_CHECK(st != nullptr, "stitch-alloc: setCheckpointPoolState: not a stitch-alloc state");
    CCA::CheckpointDelta delta;
    std::lock_guard<std::mutex> g(mu_);
    auto it = pools_.find(st->pool);
    TORCH_CHECK(it != pools_.end(), "stitch-alloc: setCheckpointPoolState: the pool is gone");
    Pool& pool = it->second;
    std::unordered_map<void*, const PoolBlock*> want;
    for (auto& kv : st->blocks) {
      want[kv.first] = &kv.second;
    }
    for (auto& kv : pool.blocks) {
      auto w = want.find(kv.first);
      bool live_then = w != want.end() && w->second->live;
      if (kv.second.live && !live_then) {
        // Live now, not then: freed into the pool (the caller drops its storages' deleters).
        allocs_.erase(kv.first);
        cache_block(pool, kv.first, kv.second);
        delta.ptrs_freed.push_back(kv.first);
      } else if (!kv.second.live && live_then) {
        uncache_block(pool, kv.first, kv.second.size);
        kv.second.live = true;
        kv.second.stream = w->second->stream;
        Alloc a;
        a.size = kv.second.size;
        a.device = device;
        a.stream = kv.second.stream;
        a.pool = st->pool;
        allocs_[kv.first] = a;
        delta.dataptrs_allocd.emplace_back(kv.first, kv.first, &deleter,
                                           c10::Device(c10::DeviceType::CUDA, device));
      }
    }
    return delta;
  }

  std::string name() override { return "stitch-alloc"; }

  // --- the work ------------------------------------------------------------------------

  // Free a live allocation; false if `ptr` is not one (nothing is freed). Never throws: it
  // runs in DataPtr deleters.
  bool free_ptr(void* ptr) noexcept {
    if (ptr == nullptr) {
      return true;
    }
    Alloc a;
    bool found = false;
    std::shared_ptr<CCA::CUDAAllocator> own;  // set when the block goes back to a pool's own
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = allocs_.find(ptr);
      if (it != allocs_.end()) {
        a = std::move(it->second);
        allocs_.erase(it);
        found = true;
        record(CDA::TraceEntry::FREE_REQUESTED, a.device, ptr, a.size, a.stream, a.pool,
               nullptr);
        if (a.pool != kNoPool) {
          auto p = pools_.find(a.pool);
          if (p != pools_.end()) {
            auto b = p->second.blocks.find(ptr);
            if (b != p->second.blocks.end()) {
              pool_frees_[device_slot(a.device)]++;
              if (p->second.use_count > 0) {
                cache_block(p->second, ptr, b->second);
                record(CDA::TraceEntry::FREE_COMPLETED, a.device, ptr, a.size, a.stream, a.pool,
                       nullptr);
                return true;
              }
              // The pool was released while this block was live: it leaves the pool now
              // and is freed below on its stream (the graphs that used it are gone).
              own = p->second.allocator;
              p->second.blocks.erase(b);
              erase_pool_if_empty(p);
            }
          }
        }
      }
    }
    if (!found) {
      return false;
    }
    if (own != nullptr) {
      give_back(*own, ptr);
    } else {
      lib.free(ptr, a.size, a.device, a.stream);
    }
    if (tracing_on_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> g(mu_);
      record(CDA::TraceEntry::FREE_COMPLETED, a.device, ptr, a.size, a.stream, a.pool, nullptr);
    }
    if (own == nullptr) {
      drain_segments(a.device);
    }
    return true;
  }

 private:
  static size_t device_slot(DeviceIndex d) { return static_cast<size_t>(d) % kMaxDevices; }

  // Free a block of a pool with its own allocator through that allocator; its failure is
  // a warning (this runs in frees).
  static void give_back(CCA::CUDAAllocator& own, void* ptr) {
    try {
      own.raw_delete(ptr);
    } catch (const std::exception& e) {
      TORCH_WARN("stitch-alloc: a memory pool's allocator failed to free ", ptr, ": ",
                 e.what());
    }
  }

  c10::DataPtr alloc_on(size_t n, DeviceIndex device, cudaStream_t stream) {
    c10::Device dev(c10::DeviceType::CUDA, device);
    if (n == 0) {
      return c10::DataPtr(nullptr, dev);
    }
    // Stacks are gathered before the lock: the recorder may take the GIL.
    // The fast path (no history, no capture) takes mu_ once, to note the allocation: the
    // flags below mirror record_when_ and captures_ so that their locked reads are skipped
    // when they are off.
    std::shared_ptr<c10::GatheredContext> ctx;
    CDA::CreateContextFn recorder = nullptr;
    if (contexts_on_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> g(mu_);
      if (record_when_ != CDA::RecordContext::NEVER) {
        recorder = context_recorder_;
      }
    }
    if (recorder != nullptr) {
      ctx = recorder();
    }
    void* p = nullptr;
    MempoolId_t pool_id = kNoPool;
    int32_t registration = -1;  // a pool block's creation order (kept when it is reused)
    if (captures_n_.load(std::memory_order_acquire) > 0) {
      std::unique_lock<std::mutex> g(mu_);
      for (auto& c : captures_) {
        if (c.device == device && c.filter(stream)) {
          pool_id = c.pool;
          break;
        }
      }
      if (pool_id != kNoPool) {
        Pool& pool = pools_[pool_id];
        pool.device = device;
        auto fit = pool.free_blocks.lower_bound(n);
        if (fit != pool.free_blocks.end()) {
          p = fit->second;
          PoolBlock& b = pool.blocks[p];
          uncache_block(pool, p, b.size);
          b.live = true;
          b.stream = stream;
          registration = b.registration;
          pool_reuses_[device_slot(device)]++;
        } else {
          std::shared_ptr<CCA::CUDAAllocator> own = pool.allocator;
          g.unlock();
          lib.clear_error();
          if (own != nullptr) {
            // The pool's own allocator; its errors (a c10::Error) reach the caller as such.
            p = own->raw_alloc_with_stream(n, stream);
            TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "CUDA out of memory: the "
                             "allocator of memory pool ", pool_id.first, ".", pool_id.second,
                             " returned NULL for ", n, " bytes");
          } else {
            p = lib.malloc_graph(n, device, stream);
          }
          g.lock();
          if (p != nullptr) {
            registration = next_registration_++;
            Pool& pool2 = pools_[pool_id];
            pool2.blocks[p] = PoolBlock{n, stream, true, registration};
          }
        }
      }
    }
    if (p == nullptr && pool_id == kNoPool) {
      lib.clear_error();
      p = lib.malloc(n, device, stream);
    }
    if (p == nullptr) {
      out_of_memory(n, device, stream, pool_id);
    }
    drain_segments(device);
    std::lock_guard<std::mutex> g(mu_);
    Alloc a;
    a.size = n;
    a.device = device;
    a.stream = stream;
    a.pool = pool_id;
    a.registration = registration >= 0 ? registration : next_registration_++;
    if (record_when_ != CDA::RecordContext::NEVER) {
      a.context = ctx;
    }
    bool trace_ctx = record_when_ == CDA::RecordContext::ALLOC ||
                     record_when_ == CDA::RecordContext::ALL;
    record(CDA::TraceEntry::ALLOC, device, p, n, stream, pool_id, trace_ctx ? ctx : nullptr);
    allocs_[p] = std::move(a);
    return c10::DataPtr(p, p, &deleter, dev);
  }

  [[noreturn]] void out_of_memory(size_t n, DeviceIndex device, cudaStream_t stream,
                                  MempoolId_t pool_id) {
    std::string why = lib.error();
    size_t free_b = 0, total_b = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    }
    struct stitch_device_stats s{};
    (void)lib.device_stats(device, &s, sizeof s);
    std::vector<CCA::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> g(mu_);
      record(CDA::TraceEntry::OOM, device, reinterpret_cast<void*>(free_b), n, stream, pool_id,
             nullptr);
      observers = oom_observers_;
    }
    for (auto& o : observers) {
      o(device, static_cast<size_t>(s.allocated_current), total_b, free_b);
    }
    // Plain string building: a std::ostringstream here crashed the process (SIGSEGV while
    // formatting) in torch 2.11's JIT build on the H200 (design/gpu-results.md, run 20).
    std::string m = "CUDA out of memory (stitch-alloc). Tried to allocate ";
    m += std::to_string(n);
    m += " bytes on device ";
    m += std::to_string(int(device));
    if (pool_id != kNoPool) {
      m += " for a CUDA graph pool";
    }
    m += ". ";
    m += why.empty() ? std::string("(no diagnosis from the library)") : why;
    m += ". Device memory: ";
    m += std::to_string(free_b);
    m += " bytes free of ";
    m += std::to_string(total_b);
    m += ".";
    TORCH_CHECK_WITH(OutOfMemoryError, false, m);
    std::abort();  // not reached: the check throws
  }

  // While the history is on: the library's maps and unmaps of `device` since the last call,
  // as segment_map / segment_unmap trace entries. Takes mu_ itself (never call it holding
  // mu_); never throws (it runs in frees).
  void drain_segments(DeviceIndex device) noexcept {
    if (!history_on_.load()) {
      return;
    }
    struct stitch_segment_event buf[128];
    for (;;) {
      ptrdiff_t n = lib.segment_events(device, buf, 128);
      if (n <= 0) {
        return;
      }
      try {
        std::lock_guard<std::mutex> g(mu_);
        for (ptrdiff_t i = 0; i < n; i++) {
          record(buf[i].action == 1 ? CDA::TraceEntry::SEGMENT_MAP : CDA::TraceEntry::SEGMENT_UNMAP,
                 device, reinterpret_cast<void*>(buf[i].addr), static_cast<size_t>(buf[i].size),
                 nullptr, kNoPool, nullptr);
        }
      } catch (...) {
        return;  // out of memory for the trace: the entries are lost, the free goes on
      }
      if (n < 128) {
        return;
      }
    }
  }

  // Caller holds mu_. A trace entry: to the trackers always, to the history when on.
  void record(CDA::TraceEntry::Action action, DeviceIndex device, void* addr, size_t size,
              cudaStream_t stream, MempoolId_t pool,
              std::shared_ptr<c10::GatheredContext> ctx) {
    if (!record_history_ && trace_trackers_.empty()) {
      return;
    }
    if (action == CDA::TraceEntry::FREE_REQUESTED || action == CDA::TraceEntry::FREE_COMPLETED) {
      // RecordContext::ALL also records stacks at frees; a free must not take the GIL under
      // the lock, so frees carry no stack here.
      ctx = nullptr;
    }
    CDA::TraceEntry e(action, device, reinterpret_cast<size_t>(addr), size,
                      reinterpret_cast<void*>(stream), pool, c10::getApproximateTime(),
                      std::move(ctx));
    for (auto& t : trace_trackers_) {
      try {
        t(e);
      } catch (const std::exception& ex) {
        TORCH_WARN_ONCE("stitch-alloc: an allocator trace tracker raised: ", ex.what());
      }
    }
    if (record_history_ && skip_.count(static_cast<int>(action)) == 0) {
      trace_.push_back(std::move(e));
      while (trace_.size() > trace_max_) {
        trace_.pop_front();
      }
    }
  }

  // Caller holds mu_.
  void cache_block(Pool& pool, void* p, PoolBlock& b) {
    b.live = false;
    pool.free_blocks.emplace(b.size, p);
    pool.cached_bytes += b.size;
  }

  // Caller holds mu_.
  void uncache_block(Pool& pool, void* p, size_t size) {
    auto range = pool.free_blocks.equal_range(size);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second == p) {
        pool.free_blocks.erase(it);
        pool.cached_bytes -= size;
        return;
      }
    }
  }

  // Caller holds mu_.
  void erase_pool_if_empty(
      std::unordered_map<MempoolId_t, Pool, MempoolHash>::iterator it) {
    if (it->second.use_count == 0 && it->second.blocks.empty()) {
      pools_.erase(it);
    }
  }

  // Caller holds mu_. The cached blocks of every released pool (use count 0), taken out of
  // their pools.
  void collect_releasable(std::vector<Released>& out) {
    for (auto it = pools_.begin(); it != pools_.end();) {
      Pool& p = it->second;
      if (p.use_count > 0) {
        ++it;
        continue;
      }
      for (auto& fb : p.free_blocks) {
        auto b = p.blocks.find(fb.second);
        if (b != p.blocks.end()) {
          out.push_back(
              Released{fb.second, p.device, b->second.size, b->second.stream, p.allocator});
          p.blocks.erase(b);
        }
      }
      p.free_blocks.clear();
      p.cached_bytes = 0;
      if (p.blocks.empty()) {
        it = pools_.erase(it);
      } else {
        ++it;  // live blocks leave when they are freed (free_ptr)
      }
    }
  }

  // Give released pool blocks back to the library, each freed on the stream it was
  // allocated on (stream-ordered, as torch's own allocator does when a graph's pool is
  // released: work queued later on that stream may reuse it at once, other streams once
  // that stream's work so far has completed). No device-wide synchronisation: it would
  // invalidate a CUDA graph another thread is capturing (seen in the soak, run 20).
  void free_pool_blocks(const std::vector<Released>& blocks) {
    for (auto& b : blocks) {
      if (b.allocator != nullptr) {
        give_back(*b.allocator, b.ptr);
        continue;
      }
      lib.clear_error();
      lib.free(b.ptr, b.size, b.device, b.stream);
      std::string e = lib.error();
      if (!e.empty()) {
        TORCH_WARN("stitch-alloc: releasing a graph pool block: ", e);
      }
    }
  }

  static constexpr size_t kMaxDevices = 64;

  std::mutex mu_;
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  // Every live allocation by its pointer: one insert and one erase per tensor. Open
  // addressing (c10's ska::flat_hash_map, as torch's own allocator keeps its blocks) makes
  // no heap allocation per entry and touches fewer cache lines than std::unordered_map:
  // about 50 ns less per insert + erase with 300 live entries and the caches flushed
  // between calls (design/zoo.md, "Thirty-third session").
  ska::flat_hash_map<void*, Alloc> allocs_;
  int32_t next_registration_ = 0;  // Alloc::registration of the next new segment
  std::unordered_map<MempoolId_t, Pool, MempoolHash> pools_;
  std::vector<Capture> captures_;
  int64_t pool_reuses_[kMaxDevices] = {};
  int64_t pool_frees_[kMaxDevices] = {};
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
  std::vector<CCA::AllocatorTraceTracker> trace_trackers_;
  bool record_history_ = false;
  std::atomic<bool> history_on_{false};  // record_history_, readable without mu_
  // Written under mu_, read without it on the fast path of allocations and frees:
  std::atomic<bool> contexts_on_{false};  // record_when_ != NEVER
  std::atomic<bool> tracing_on_{false};   // record_history_ || !trace_trackers_.empty()
  std::atomic<int> captures_n_{0};        // captures_.size()
  std::atomic<int> device_count_{0};     // from init()
  CDA::CreateContextFn context_recorder_ = nullptr;
  CDA::RecordContext record_when_ = CDA::RecordContext::NEVER;
  size_t trace_max_ = 1;
  std::unordered_set<int> skip_;
  std::deque<CDA::TraceEntry> trace_;
  CCA::CUDAAllocator* native_ = nullptr;  // torch's own (never destroyed: a static of torch)
  std::mutex native_mu_;                  // its lazy init
  std::atomic<bool> delegate_{false};     // set_delegate: new allocations from native_
  std::atomic<bool> delegated_{false};    // set_delegate(true) was ever called
};

// The installed allocator. Never destroyed (like the library's own state): tensors freed
// during the interpreter's exit still reach it.
StitchAllocator* instance = nullptr;

void deleter(void* ptr) {
  bool clocked = clock_on.load(std::memory_order_relaxed);
  uint64_t t0 = clocked ? clock_now() : 0;
  if (instance != nullptr && !instance->free_ptr(ptr)) {
    TORCH_WARN("stitch-alloc: free of ", ptr, ", which is not a live allocation (ignored)");
  }
  if (clocked) {
    clock_add(kStitchFree, t0);
  }
}

// Load the library at `path` and make this allocator torch's. Refused (by torch) when the
// allocator in place has been used already.
void install(const std::string& path) {
  TORCH_CHECK(instance == nullptr, "stitch-alloc: the extension is installed already");
  lib.open(path);
  auto* keep = new std::shared_ptr<StitchAllocator>(std::make_shared<StitchAllocator>());
  (*keep)->keep_native(CCA::get());
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(*keep);
  } catch (...) {
    delete keep;
    throw;
  }
  instance = keep->get();  // `keep` is never freed
}

bool installed() {
  return instance != nullptr && CCA::get() == instance;
}

void set_delegate(bool on) {
  TORCH_CHECK(installed(), "stitch-alloc: the extension is not installed");
  instance->set_delegate(on);
}

void set_alloc_clock(bool on) {
  TORCH_CHECK(installed(), "stitch-alloc: the extension is not installed");
  clock_on.store(on);
}

// {slot: (calls, ns)} since the extension was loaded.
pybind11::dict alloc_clock() {
  const char* names[4] = {"stitch_alloc", "stitch_free", "native_alloc", "native_free"};
  pybind11::dict d;
  for (int i = 0; i < 4; i++) {
    d[names[i]] = pybind11::make_tuple(clock_calls[i].load(), clock_ns[i].load());
  }
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "stitch-alloc as torch's CUDA allocator (the whole CUDAAllocator interface)";
  m.def("install", &install, "Load libstitch_alloc.so from the path and install it");
  m.def("installed", &installed, "Whether this extension's allocator is torch's");
  m.def("name", []() { return std::string("stitch-alloc"); });
  m.def("_set_delegate", &set_delegate,
        "Diagnostics: new allocations from torch's own allocator while on (the in-process "
        "speed comparison of scripts/torch-inproc-speed.py; not with graphs, pools or IPC)");
  m.def("_set_alloc_clock", &set_alloc_clock,
        "Diagnostics: time each allocate and free of this allocator and of torch's own blocks "
        "handed out while delegating (single-stream loops only)");
  m.def("_alloc_clock", &alloc_clock,
        "Diagnostics: {stitch_alloc, stitch_free, native_alloc, native_free: (calls, ns)}");
}
