/*
 * stitch_alloc.h: the C ABI of libstitch_alloc.so (C99).
 *
 * stitch-alloc is a GPU memory allocator on CUDA virtual memory management: free physical
 * handles are remapped ("stitched") into contiguous spans, so an allocation succeeds
 * whenever enough free memory exists anywhere on the device.
 *
 * Build:  cargo build --release --features capi  ->  target/release/libstitch_alloc.so
 * Link:   cc -I include app.c -L target/release -lstitch_alloc -Wl,-rpath,target/release
 *
 * PyTorch (torch 2.11): the Python package in python/ (stitch_alloc.enable()) builds a C++
 * extension (python/stitch_alloc/csrc/stitch_torch.cpp) that implements torch's whole
 * CUDAAllocator interface over the functions below (statistics through stitch_device_stats,
 * graph pools through stitch_malloc_graph / stitch_free_graph). Its fallback loads
 * stitch_malloc / stitch_free through torch.cuda.memory.CUDAPluggableAllocator and the
 * optional hooks through the setters of allocator.allocator(): set_init_fn(stitch_init),
 * set_reset_fn(stitch_reset), set_memory_fraction_fn(stitch_memory_fraction),
 * set_record_stream_fn(stitch_record_stream).
 *
 * Configuration: the environment variable STITCH_ALLOC_CONF, read once at the first call
 * of any function below. A comma-separated key:value list, like PYTORCH_CUDA_ALLOC_CONF:
 *
 *   backend:auto|cuda|host|sim  auto (default): CUDA when a device is usable, else an
 *                               initialisation error (CPU backends only when named; the
 *                               stats document's "backend" says which one serves).
 *                               host: real, writable process memory (mmap/memfd),
 *                               for tests and CPU-only use. sim: accounting only; its
 *                               pointers must never be dereferenced.
 *   capacity_fraction:F         limit each device to F of its memory, F in (0, 1]
 *                               (whatever the limit, the capacity never exceeds the
 *                               device memory free at its first allocation: memory other
 *                               processes or this one's CUDA context hold is not counted)
 *   capacity_bytes:N            limit each device to N bytes (host/sim: the device's size;
 *                               default 16 GiB host, 139.8 GiB sim). Excludes
 *                               capacity_fraction.
 *   small_threshold:N           requests up to N bytes share small pages (default 256KiB)
 *   small_page:N                size of one small page (default: the granularity)
 *   min_handle:N, max_handle:N  smallest / largest physical handle (default: the
 *                               granularity, 2MiB on CUDA / 20MiB)
 *   stitching:true|false        remap free handles into new spans (default true)
 *   reserve_slack:F             growth slack before free handles are reused, F in
 *                               [0, 1000] (default 0)
 *   reserve_slack_min:SIZE      floor under that slack (default 0)
 *   handle_divisor:N            new memory in handles of about request / N (default 128)
 *   split_min:SIZE              the smallest such handle (default 2MiB)
 *   recreate:true|false         stitch clean handles by release and re-create (default true)
 *   contiguous:true|false       grow large spans at the end of a run, free tails coalescing (default true)
 *   loop_region:true|false      settle a loop that stitches every step in one run that
 *                               only grows (default true)
 *   chain_fit:true|false        place a growing chain's next copy (a KV cache grown by
 *                               concatenation) by next fit (default true)
 *   spare_pieces:true|false     a stitch takes last the free handles whose removal would
 *                               strand a piece of a live handle (default false)
 *   prealloc:SIZE               create and map a pool of SIZE at the first allocation
 *   medium_threshold:N, medium_page:N
 *                               pack requests up to N into shared pages (default off)
 *   va_chunk:N, va_limit:N      size of each address reservation (default 4x the
 *                               capacity) / of all together (default 32TiB)
 *   paranoid:true|false         check every invariant after each call (slow; default false)
 *   log:off|error|warn|info|debug|trace
 *                               stderr logging level (default warn)
 *   devices:N                   host/sim: device ordinals served (default 8); cuda: at most
 *                               N of the visible devices
 *   on_oom:null|abort           out of memory: return NULL (default) or print the diagnosis
 *                               and abort the process
 *   peers:all|none|0+1          cuda: devices given access to every mapping (default all
 *                               that can access it)
 *
 * The keys after capacity_bytes are the fields of the Rust Config (same names, meanings,
 * defaults and checks). Sizes: 4096, 512KiB, 128MiB (or 128M), 1.5GiB, 2TiB: KiB/MiB/GiB/TiB
 * (or K/M/G/T) are powers of 1024; kB/MB/GB/TB are powers of 1000 (1MB = 1000000 bytes);
 * at most 1 PiB. An unknown key or a bad value is rejected loudly: it is printed to
 * stderr once, no allocator is created, every stitch_malloc returns NULL and
 * stitch_last_error() says why.
 *
 * Errors: no function here crashes on bad input or lets a Rust panic escape. A failure is
 * logged (at log:warn and above) and kept as the calling thread's last error
 * (stitch_last_error). Pointers passed in are never dereferenced, only looked up.
 *
 * Threads: every function may be called from any thread. One allocator per device, created
 * at the device's first allocation and kept until the process exits. No function touches
 * the CUDA driver (cuInit) before the first allocation, and every one leaves the calling
 * thread's current CUDA context as it found it.
 *
 * Fork: in a child forked after the library's first call, every function fails at once
 * with an error naming the fork ("used in a forked child"): the parent's CUDA memory is not
 * usable there, and a lock a parent thread held cannot hang the child.
 *
 * Internal errors: a Rust panic caught inside a device's allocator disables that device
 * (its state may be half-updated): every later call on it fails, naming the first panic.
 *
 * CUDA graphs: private pools are kept by the caller (the torch extension in python/) over
 * stitch_malloc_graph / stitch_free_graph, which are allowed on a capturing stream.
 * stitch_malloc on a stream that is capturing returns NULL ("CUDA graph capture is not
 * supported by stitch_malloc"); stitch_free on one keeps the block allocated until the
 * capture has ended (no event can be recorded on a capturing stream), counted as
 * "graph_held_bytes" in the statistics; the next call on the device, or
 * stitch_retire_stream of that stream, then frees it on its stream.
 *
 * Note for PyTorch users of the fallback (the extension raises torch.cuda.OutOfMemoryError
 * with the stitch_last_error diagnosis): torch 2.11's CUDAPluggableAllocator::allocate does not check the
 * pointer its allocator returns, so running out of memory does not raise
 * torch.cuda.OutOfMemoryError. torch.empty() succeeds with an unallocated (null) storage;
 * some ops then raise RuntimeError ("The tensor has a non-zero number of elements, but its
 * data is not allocated yet"), but a kernel such as fill_ writes through the null pointer
 * and the CUDA context dies (illegal address; measured on the H200, design/gpu-results.md
 * run 19); a raw allocation (caching_allocator_alloc, library workspaces) just gets NULL.
 * The Python package's C++ extension path avoids all of this. The reason is in the log and in stitch_last_error() of the
 * allocating thread. on_oom:abort stops the process with the diagnosis instead.
 */
#ifndef STITCH_ALLOC_H
#define STITCH_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Allocate `size` bytes on `device` for use on `stream` (a cudaStream_t; NULL is the
 * default stream). Memory is aligned to 512 bytes and stays at its address until freed.
 * Returns NULL on failure: a request larger than the capacity ("request too large"), out
 * of memory, a device out of range, an invalid configuration, a stream capturing a CUDA
 * graph, a forked child, a disabled device. Size 0 returns NULL without touching the
 * last error (so an out-of-memory diagnosis survives the empty tensors after it).
 * Torch's allocation function.
 */
void* stitch_malloc(size_t size, int device, void* stream);

/*
 * Free `ptr` from stitch_malloc on `device`; `stream` is the stream of its last use (the
 * memory is reusable at once on that stream, on others once the work queued on it so far
 * has completed). `size` is the size asked for, or 0 if unknown. Torch's free function
 * (torch 2.11 passes all four arguments).
 * NULL, an unknown pointer, a pointer inside an allocation, a second free, or a pointer of
 * another device free nothing and are reported through stitch_last_error.
 */
void stitch_free(void* ptr, size_t size, int device, void* stream);

/* Torch's init hook: reads the configuration (reporting an invalid one at once). */
void stitch_init(int device_count);

/*
 * Torch's reset hook (torch.cuda.empty_cache()): release the physical memory of every free
 * handle, on every device, back to the driver.
 */
void stitch_reset(void);

/*
 * Torch's memory-fraction hook (torch.cuda.set_per_process_memory_fraction): limit `device`
 * to `fraction` (0 < fraction <= 1) of its memory, at any time (stitch_set_memory_fraction,
 * which also returns whether it worked).
 */
void stitch_memory_fraction(double fraction, int device);

/*
 * Torch's record-stream hook (Tensor.record_stream): the live allocation at `ptr` is also
 * used on `stream`; its free then waits for that stream's queued work too.
 */
void stitch_record_stream(void* ptr, void* stream);

/*
 * Call before destroying a stream that memory of `device` was freed on (your own
 * cudaStreamDestroy, a torch.cuda.ExternalStream): fences and waits for the frees made on
 * it, so the library never records an event on it afterwards. Returns 0, or -1 on error
 * (see stitch_last_error; its freed memory then stays unusable by other streams until the
 * process ends, and is never unmapped under queued work).
 */
int stitch_retire_stream(int device, void* stream);

/*
 * Release the physical memory of the free handles of one device. Returns 0, or -1 on error
 * (device out of range, invalid configuration, driver failure; see stitch_last_error).
 */
int stitch_empty_cache(int device);

/*
 * The statistics of `device` as one JSON object (UTF-8, NUL-terminated), or NULL on error.
 * The string is owned by the library and stays valid until the next stitch_stats_json
 * call on the same thread: copy it if you keep it; never free it.
 *
 * Fields: "version", "device", "backend" (before the first allocation with backend auto
 * or cuda: the configured one, unresolved), "initialized" (false until the device's first
 * allocation; the counters are then 0), "init_device_count" (the count stitch_init was
 * given, -1 before), "conf" (STITCH_ALLOC_CONF as read), "capacity",
 * "granularity", "driver_calls", "vmm_calls", "graph_held_bytes" (blocks freed during a
 * graph capture, held),
 * "malloc_free_calls" and "malloc_free_time_us" (the process's stitch_malloc and
 * stitch_free calls, every device, and their time from entry to return in microseconds,
 * the driver calls inside them measured on every call, the rest on one call in 64),
 * "driver_time_us" (measured wall time inside driver calls, microseconds) and
 * "driver_time_us_by_call" (the same by call kind: "create", "map", "set_access", ...),
 * "driver_time_us_per_alloc" ({count, p50_us, p99_us, max_us}: the driver time of each
 *   stitch_malloc that called the driver; percentiles within 19%, the maximum exact),
 * "torch": PyTorch memory_stats() names: "allocated_bytes.all.current"/".peak",
 *   "requested_bytes.all.*", "reserved_bytes.all.*", "active_bytes.all.current",
 *   "allocation.all.{current,peak,allocated,freed}", "segment.all.{current,allocated,freed}",
 *   "inactive_split_bytes.all.current" (free bytes stranded beside live ones), "num_ooms",
 *   "num_alloc_retries", "num_device_alloc" (maps), "num_device_free" (unmaps);
 * "stats": the allocator's counters (requested/allocated/reserved/mapped/live_allocations
 *   as {current, peak}, allocs, frees, stitches, handles, ooms, calls by kind, ...);
 * "fragmentation": free_spans, free_bytes, largest_free_span, free_handles,
 *   stranded_bytes, live_handle_bytes, rounding_waste, va_reserved, ...
 */
const char* stitch_stats_json(int device);

/*
 * Typed statistics of one device (torch's DeviceStats meanings), filled by
 * stitch_device_stats. Versioned by size: fields are only ever appended. Every field is
 * 0 before the device's first allocation (initialized too). "Accumulated" counters are
 * zeroed by stitch_reset_accumulated_stats, peaks restart from the current value at
 * stitch_reset_peak_stats.
 */
struct stitch_device_stats {
    uint64_t initialized;              /* 1 once the device's allocator exists */
    uint64_t capacity;                 /* bytes; changed by stitch_set_memory_fraction */
    uint64_t allocated_current;        /* bytes of live blocks (rounded): allocated_bytes */
    uint64_t allocated_peak;
    uint64_t requested_current;        /* bytes asked for by live blocks: requested_bytes */
    uint64_t requested_peak;
    uint64_t reserved_current;         /* physical bytes held in handles: reserved_bytes */
    uint64_t reserved_peak;
    uint64_t active_current;           /* live + freed, waiting for other streams */
    uint64_t allocations_current;      /* live allocations: allocation */
    uint64_t allocations_peak;
    uint64_t allocations_allocated;    /* accumulated */
    uint64_t allocations_freed;        /* accumulated */
    uint64_t segments_current;         /* physical handles: segment */
    uint64_t segments_allocated;       /* handles created, accumulated */
    uint64_t segments_freed;           /* handles released, accumulated */
    uint64_t inactive_split_bytes_current; /* free bytes sharing a handle with live ones */
    uint64_t pending_free_bytes;       /* freed with uses on several streams, not yet usable */
    uint64_t largest_free_span;        /* the largest free mapped span */
    uint64_t free_bytes;               /* free mapped bytes */
    uint64_t num_ooms;                 /* accumulated */
    uint64_t num_alloc_retries;        /* slow paths that waited for frees, accumulated */
    uint64_t num_device_alloc;         /* cuMemMap calls, accumulated */
    uint64_t num_device_free;          /* cuMemUnmap calls, accumulated */
    uint64_t graph_held_bytes;         /* freed during a capture outside a graph pool, held */
};

/*
 * Fill `out` (`out_size` writable bytes, normally sizeof(struct stitch_device_stats)) with
 * the statistics of `device`: min(out_size, the library's struct size) bytes. Returns the
 * library's struct size (an older library fills fewer fields: those past the return value
 * are untouched), or -1 on error (stitch_last_error; `out` untouched). Computes the
 * fragmentation figures (inactive_split_bytes_current, largest_free_span, free_bytes) by
 * walking the allocator's structures. Touches no driver before the first allocation.
 */
ptrdiff_t stitch_device_stats(int device, struct stitch_device_stats* out, size_t out_size);

/* Restart every peak of `device` from its current value. 0, or -1 on error. The growth
 * policy keeps its own lifetime peak: this changes no allocation decision. */
int stitch_reset_peak_stats(int device);

/* Zero `device`'s accumulated counters (see the struct). 0, or -1 on error. */
int stitch_reset_accumulated_stats(int device);

/*
 * Limit `device` to `fraction` (0 < fraction <= 1) of its total memory (and to any
 * capacity of the configuration), at any time. Before the device's first allocation it
 * sets the capacity the allocator is created with; after it, it changes the capacity at
 * once: nothing live is touched, and a later allocation that would take the live bytes past
 * the new limit (or needs memory that cannot be created under it) fails as out of memory.
 * Returns 0, or -1 on error (a fraction outside (0, 1], a bad device).
 */
int stitch_set_memory_fraction(int device, double fraction);

/* The fraction last set on `device` (1.0 if none), or -1.0 on error. */
double stitch_get_memory_fraction(int device);

/*
 * The segment log (for torch's memory history: segment_map / segment_unmap entries). One
 * mapping the driver made (action 1, cuMemMap) or removed (action 2, cuMemUnmap).
 */
struct stitch_segment_event {
    uint64_t action;
    uint64_t addr;
    uint64_t size;
};

/*
 * Start (enable != 0) or stop recording `device`'s maps and unmaps. Touches no driver:
 * before the device's first allocation the setting is kept for it. Stopping drops unread
 * events. 0, or -1 for a device out of range.
 */
int stitch_segment_log(int device, int enable);

/*
 * Move up to `max` of `device`'s oldest recorded events into `out` (oldest first); returns
 * how many, or -1 on error. At most 1,048,576 unread events are kept (older ones are dropped,
 * counted as "segment_events_dropped" in stitch_stats_json).
 */
ptrdiff_t stitch_segment_events(int device, struct stitch_segment_event* out, size_t max);

/*
 * As stitch_malloc, with the memory inside ONE physical handle created for it (any size up
 * to the capacity; max_handle does not apply), mapped alone: for buffers that NCCL
 * user-buffer registration (ncclCommRegister, ProcessGroupNCCL.register_mem_pool) or RDMA
 * pinning (ibv_reg_mr) will see, which need one physical allocation behind the whole range
 * (a span of several handles, stitched or not, is refused there). Clean free handles are
 * released first when the capacity leaves no room. Same signature as stitch_malloc, so a
 * CUDAPluggableAllocator on it can back a torch.cuda.MemPool. Freed with stitch_free.
 */
void* stitch_malloc_one_handle(size_t size, int device, void* stream);

/*
 * CUDA IPC (torch.multiprocessing). Make the live allocation at `ptr` (from stitch_malloc,
 * any device) shareable with another process: its physical handles are exported as POSIX
 * file descriptors (each once, kept open until the handle is released) and described in a
 * message for stitch_ipc_open. Keep the allocation alive until every receiver has closed it.
 * Writes the message to `out` when it fits in `cap` bytes and returns its length; when it
 * does not fit, writes nothing and returns the length needed. `*offset` (when not NULL)
 * gets where the allocation starts in the range the receiver maps. -1 on error (not a live
 * allocation's start; a backend or device that cannot export handles): stitch_last_error.
 */
ptrdiff_t stitch_share(void* ptr, uint8_t* out, size_t cap, uint64_t* offset);

/*
 * Map on `device` the memory a stitch_share message describes: each handle is fetched from
 * the sender with pidfd_getfd (the sender must be alive; the receiver needs ptrace rights
 * over it: same user), imported and mapped side by side with read-write access. Writes the
 * mapping's base to `*out` (the shared allocation is at base + the sender's offset); 0, or
 * -1 on error with nothing left behind. The same message on the same device gives the same
 * base and counts one more user. The memory is the sender's: not in this process's stats.
 */
int stitch_ipc_open(int device, const uint8_t* message, size_t len, void** out);

/*
 * One user of a stitch_ipc_open mapping is done; the last one unmaps it and releases its
 * imported handles. Synchronise the work that used it first. 0, or -1 for a pointer that is
 * not an open mapping's base.
 */
int stitch_ipc_close(void* ptr);

/*
 * CUDA graph private pools. Allocate `size` bytes on `device` for use on `stream`, which may
 * be capturing a graph (unlike stitch_malloc, which refuses a capturing stream): only clean
 * free memory (no stream's queued work may still use it) or newly created memory is used;
 * no event is recorded, queried or waited for on any stream; the driver calls run with the
 * calling thread in relaxed capture mode (cuThreadExchangeStreamCaptureMode), restored
 * after. NULL on failure (stitch_last_error) and for size 0. The caller (a graph pool)
 * keeps the block until the graphs using it are gone, then returns it with
 * stitch_free_graph.
 */
void* stitch_malloc_graph(size_t size, int device, void* stream);

/*
 * Free `ptr` (from stitch_malloc_graph or stitch_malloc) of `device` as clean: reusable by
 * every stream at once, no event recorded. The caller guarantees that no queued work uses
 * it any more (for a graph pool: its graphs are destroyed and the device synchronised
 * since). 0, or -1 on error (an unknown pointer frees nothing).
 */
int stitch_free_graph(void* ptr, int device);

/*
 * The calling thread's last error message, or "" if there was none (since the thread
 * started or since stitch_clear_error). Never NULL. Owned by the library; valid until the
 * next stitch_* call on the same thread.
 */
const char* stitch_last_error(void);

/* Forget the calling thread's last error. */
void stitch_clear_error(void);

/* The library's version, e.g. "0.1.0" (a static string). */
const char* stitch_version(void);

#ifdef __cplusplus
}
#endif

#endif /* STITCH_ALLOC_H */
