// The extension's live-allocation map, measured on the CPU: one insert and one erase per
// tensor (what `allocate` and the DataPtr deleter do in python/stitch_alloc/csrc/
// stitch_torch.cpp), std::unordered_map against c10's ska::flat_hash_map, with 300 live
// entries, keys spaced as the allocator's addresses are, and optionally 8 MiB of other
// memory touched per 246 calls (a bert-encode step's allocations) so that the maps' lines
// are evicted between calls as in a real step. Prints ns per insert + erase, two clock
// reads included. Needs only torch's headers (scripts/check-torch-ext.sh unpacks them):
//
//   g++ -O2 -std=c++17 -isystem <torch>/include -o /tmp/ext-map-bench scripts/ext-map-bench.cpp
//   /tmp/ext-map-bench
#include <c10/util/flat_hash_map.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <unordered_map>
#include <vector>

// The extension's record of a live allocation, with the same members' sizes.
struct Alloc {
  size_t size = 0;
  int8_t device = 0;
  void* stream = nullptr;
  std::pair<uint64_t, uint64_t> pool{0, 0};
  std::shared_ptr<int> context;
  int32_t registration = 0;
};

template <class Map>
double ns_per_pair(size_t pollute_bytes) {
  Map m;
  std::vector<char> other(pollute_bytes + 64, 1);
  volatile long sink = 0;
  std::vector<void*> live;
  uint64_t s = 1;
  size_t next = 0x7f0000000000ull;
  for (int i = 0; i < 300; i++) {
    void* p = reinterpret_cast<void*>(next += 512 * (1 + (i % 7)));
    m[p] = Alloc{};
    live.push_back(p);
  }
  double total = 0;
  long n = 0;
  for (int step = 0; step < 2000; step++) {
    for (int k = 0; k < 246; k++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      size_t victim = (s >> 33) % live.size();
      void* p = reinterpret_cast<void*>(next += 512 * (1 + (s >> 60)));
      auto t0 = std::chrono::steady_clock::now();
      Alloc a;
      a.size = 4096;
      a.registration = k;
      m[p] = std::move(a);
      auto it = m.find(live[victim]);
      Alloc gone = std::move(it->second);
      m.erase(it);
      auto t1 = std::chrono::steady_clock::now();
      total += std::chrono::duration<double, std::nano>(t1 - t0).count();
      n++;
      sink += gone.size;
      live[victim] = p;
      for (size_t j = 0; j < pollute_bytes / 246; j += 64) {
        sink += other[(k * (pollute_bytes / 246) + j) % pollute_bytes]++;
      }
    }
  }
  return total / n;
}

int main() {
  for (int round = 0; round < 3; round++) {
    std::printf(
        "8 MiB touched per step: std::unordered_map %.1f ns, ska::flat_hash_map %.1f ns; "
        "nothing touched: %.1f / %.1f ns\n",
        ns_per_pair<std::unordered_map<void*, Alloc>>(8 << 20),
        ns_per_pair<ska::flat_hash_map<void*, Alloc>>(8 << 20),
        ns_per_pair<std::unordered_map<void*, Alloc>>(0),
        ns_per_pair<ska::flat_hash_map<void*, Alloc>>(0));
  }
}
