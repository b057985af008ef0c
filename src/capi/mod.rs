//! The C ABI: `libstitch_alloc.so`, the library PyTorch loads through
//! `torch.cuda.memory.CUDAPluggableAllocator`, usable from any C program.
//!
//! `include/stitch_alloc.h` is the C view of this module; keep the two in step. This file
//! holds the `extern "C"` exports only; behind them:
//!
//! * `conf`: `STITCH_ALLOC_CONF`, read once, at the first call of any function here: a
//!   comma-separated `key:value` list in the style of `PYTORCH_CUDA_ALLOC_CONF` (see
//!   [`CONF_KEYS`] and the header): the C ABI's own keys and every field of
//!   [`Config`](crate::Config) but its capacity. An unknown key or a bad value is rejected
//!   loudly: it is printed to stderr once, no allocator is created, every allocation
//!   returns NULL and [`stitch_last_error`] says why.
//! * `runtime`: one [`Allocator`](crate::Allocator) per device, created on the device's first
//!   use, kept in a process-wide table for the life of the process (it is never dropped: the
//!   process's exit returns the memory). No driver is touched before the first allocation
//!   (no `cuInit` at configuration read). A panic caught inside a device's allocator
//!   disables that device: every later call on it fails, naming the panic.
//! * `calls`: the bodies of the exports, on a given runtime.
//! * `apiclock`: the time `stitch_malloc` and `stitch_free` take (driver calls measured in
//!   each, the rest sampled on one call in 64),
//!   reported in [`stitch_stats_json`] as `malloc_free_calls` / `malloc_free_time_us`.
//! * `capture`: `stitch_malloc` on a capturing stream returns NULL (graph memory comes from
//!   `stitch_malloc_graph`); a block freed on one is held until the capture has ended.
//! * `fork`: in a child forked after the runtime was created, every call fails at once.
//! * `stats`: the document of [`stitch_stats_json`], one typed struct per object.
//! * `guard`: nothing crosses the boundary as a panic: every export runs under
//!   `catch_unwind`. A failure (a NULL from [`stitch_malloc`], an invalid pointer given to
//!   [`stitch_free`], a device out of range, ...) is logged through `tracing` and kept as the
//!   calling thread's last error. Pointers given in are never dereferenced: they are looked
//!   up in the allocator's tables, so freeing an unknown pointer, a pointer inside an
//!   allocation or the same pointer twice is an error report, never undefined behaviour.
//!
//! * `ipc`: CUDA IPC, [`stitch_share`] on the sender and [`stitch_ipc_open`] /
//!   [`stitch_ipc_close`] on the receiver, over [`crate::ipc`].
//!
//! Four functions here have a safety precondition, on buffers the caller passes:
//! [`stitch_device_stats`] and [`stitch_segment_events`] write into the caller's structs,
//! [`stitch_share`] writes the message into the caller's buffer and [`stitch_ipc_open`]
//! reads one from it; none reads or writes through any other pointer it is given.
//! `#[no_mangle]` and those copies are the reasons this module is not under
//! `forbid(unsafe_code)` (its submodules are, but `fork`, whose
//! `pthread_atfork` and `write(2)` are `unsafe` calls).

mod apiclock;
mod calls;
mod capture;
mod conf;
mod fork;
mod guard;
mod ipc;
mod runtime;
mod segments;
mod stats;

use self::guard::{guard, to_cstring};
use self::runtime::{runtime, Runtime};
use crate::Stream;
use std::cell::RefCell;
use std::ffi::{c_char, c_double, c_int, c_void, CStr, CString};

/// The environment variable read for the configuration.
pub const CONF_ENV: &str = "STITCH_ALLOC_CONF";

/// The keys `STITCH_ALLOC_CONF` accepts: the C ABI's own (backend, capacity, log, devices,
/// out-of-memory policy), then the fields of [`Config`](crate::Config) but `capacity`
/// (checked against both structs by a test).
pub const CONF_KEYS: [&str; 27] = [
    "backend",
    "capacity_fraction",
    "capacity_bytes",
    "log",
    "devices",
    "peers",
    "on_oom",
    "small_threshold",
    "small_page",
    "medium_threshold",
    "medium_page",
    "min_handle",
    "max_handle",
    "handle_divisor",
    "split_min",
    "recreate",
    "contiguous",
    "prealloc",
    "loop_region",
    "chain_fit",
    "spare_pieces",
    "stitching",
    "reserve_slack",
    "reserve_slack_min",
    "va_chunk",
    "va_limit",
    "paranoid",
];

const VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("the version has no interior NUL"),
    };

thread_local! {
    /// The last document `stitch_stats_json` returned on this thread (replaced by the next).
    static STATS_BUF: RefCell<CString> = RefCell::new(CString::default());
}

fn ptr_to_u64(p: *const c_void) -> u64 {
    p.addr() as u64
}

/// The stream torch passed (a `cudaStream_t`).
fn torch_stream(p: *const c_void) -> Stream {
    // SAFETY: torch passes 0 or a live stream of the device's current (primary) context,
    // which the caching-allocator contract keeps alive while memory allocated or freed on it
    // is in use; the CPU backends take any value.
    unsafe { Stream::from_raw(ptr_to_u64(p)) }
}

fn u64_to_ptr(a: u64) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(a as usize)
}

// ---------------------------------------------------------------------------------------

/// Run `f` on the process's runtime under [`guard`]; in a forked child, fail with
/// [`fork::FORKED`] instead, before touching the runtime or any lock.
fn on_runtime<T>(func: &'static str, fallback: T, f: impl FnOnce(&'static Runtime) -> T) -> T
where
    T: Copy,
{
    guard(func, fallback, || {
        if fork::in_child() {
            fork::say_once();
            guard::set_last_error(&format!("{func}: {}", fork::FORKED));
            return fallback;
        }
        f(runtime())
    })
}

// ---------------------------------------------------------------------------------------
// The exports.
/// Allocate `size` bytes on `device` for use on `stream` (a `cudaStream_t`, NULL for the
/// default stream). The `CUDAPluggableAllocator` allocation function.
///
/// Returns NULL on failure (too large, out of memory, device out of range, invalid
/// configuration, a stream capturing a CUDA graph, a forked child, a device disabled by an
/// internal error); [`stitch_last_error`] says why. A zero-size request returns NULL
/// without touching the last error. With `on_oom:abort` in the configuration, running out
/// of memory prints the diagnosis and aborts the process instead.
///
/// Torch 2.11 does not check this pointer: after a NULL, `torch.empty` succeeds with an
/// unallocated storage and the tensor's first use raises `RuntimeError` ("... its data is
/// not allocated yet"), not `torch.cuda.OutOfMemoryError`.
#[no_mangle]
pub extern "C" fn stitch_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    on_runtime("stitch_malloc", std::ptr::null_mut(), |rt| {
        u64_to_ptr(calls::malloc(rt, size, device, torch_stream(stream)))
    })
}

/// One mapping the driver made or removed for a device (see [`stitch_segment_events`]).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct StitchSegmentEvent {
    /// 1: a mapping was made (`cuMemMap`); 2: one was removed (`cuMemUnmap`).
    pub action: u64,
    /// The mapping's device address.
    pub addr: u64,
    /// Its size in bytes.
    pub size: u64,
}

/// Start (`enable` != 0) or stop recording `device`'s maps and unmaps for
/// [`stitch_segment_events`] (torch's memory history: `segment_map` / `segment_unmap`).
/// Touches no driver: before the device's first allocation the setting is kept for it.
/// Stopping drops what was not read. 0, or -1 for a device out of range.
#[no_mangle]
pub extern "C" fn stitch_segment_log(device: c_int, enable: c_int) -> c_int {
    on_runtime("stitch_segment_log", -1, |rt| {
        calls::segment_log(rt, device, enable != 0)
    })
}

/// Move up to `max` of `device`'s oldest recorded segment events into `out`, oldest first;
/// returns how many, or -1 on error (a device out of range, `out` NULL with `max` > 0).
/// At most 1,048,576 unread events are kept; older ones are dropped.
///
/// # Safety
/// `out` must point to `max` writable `StitchSegmentEvent`s (it may be NULL when `max` is 0).
#[no_mangle]
pub unsafe extern "C" fn stitch_segment_events(
    device: c_int,
    out: *mut StitchSegmentEvent,
    max: usize,
) -> isize {
    on_runtime("stitch_segment_events", -1, |rt| {
        if out.is_null() && max > 0 {
            guard::set_last_error("stitch_segment_events: out is NULL");
            return -1;
        }
        let Ok(ev) = calls::segment_events(rt, device, max) else {
            return -1;
        };
        for (i, e) in ev.iter().enumerate() {
            let v = StitchSegmentEvent {
                action: if e.map { 1 } else { 2 },
                addr: e.addr,
                size: e.size,
            };
            // SAFETY: the caller guarantees `out` holds `max` events, and `ev.len() <= max`.
            unsafe { out.add(i).write(v) };
        }
        ev.len() as isize
    })
}

/// As [`stitch_malloc`], with the memory inside **one** physical handle created for it (any
/// size up to the capacity): for buffers that NCCL user-buffer registration
/// (`ncclCommRegister`, `ProcessGroupNCCL.register_mem_pool`) or RDMA pinning will see, which
/// need one physical allocation behind the whole range. Same signature as `stitch_malloc`, so
/// a `CUDAPluggableAllocator` built on it can back a `torch.cuda.MemPool` (see the README).
/// Freed with [`stitch_free`].
#[no_mangle]
pub extern "C" fn stitch_malloc_one_handle(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    on_runtime("stitch_malloc_one_handle", std::ptr::null_mut(), |rt| {
        u64_to_ptr(calls::malloc_one_handle(
            rt,
            size,
            device,
            torch_stream(stream),
        ))
    })
}

/// Free `ptr`, returned by [`stitch_malloc`] on `device`, whose last use was queued on
/// `stream`. `size` is the size asked for (0 = unknown). The `CUDAPluggableAllocator` free
/// function (torch 2.11 passes all four arguments).
///
/// NULL, a pointer this library never returned, a pointer inside an allocation, a pointer
/// freed already, or one of another device: nothing is freed, the error is logged and kept
/// for [`stitch_last_error`]. On a stream capturing a CUDA graph no event can be recorded:
/// the block stays allocated until the capture has ended, and the next call on the device
/// (or `stitch_retire_stream` of that stream) frees it then on its stream.
#[no_mangle]
pub extern "C" fn stitch_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    on_runtime("stitch_free", (), |rt| {
        calls::free(rt, ptr_to_u64(ptr), size, device, torch_stream(stream))
    })
}

/// Make the live allocation at `ptr` (as returned by [`stitch_malloc`], on any device)
/// shareable with another process: CUDA IPC, what `torch.multiprocessing` needs. Its
/// physical handles are exported as POSIX file descriptors (each once, kept open until the
/// handle is released) and described in a message for [`stitch_ipc_open`]. Keep the
/// allocation alive until every receiver has closed it.
///
/// Writes the message to `out` when it fits in `cap` bytes and returns its length; when it
/// does not fit, writes nothing and returns the length needed (call again with a larger
/// buffer). `*offset` (when not NULL) gets where the allocation starts in the range the
/// receiver maps. -1 on error (not a live allocation's start, a backend or device that
/// cannot export handles): see [`stitch_last_error`].
///
/// # Safety
/// `out` must point to `cap` writable bytes (it may be NULL when `cap` is 0); `offset` must
/// be NULL or point to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn stitch_share(
    ptr: *mut c_void,
    out: *mut u8,
    cap: usize,
    offset: *mut u64,
) -> isize {
    on_runtime("stitch_share", -1, |rt| {
        if out.is_null() && cap > 0 {
            guard::set_last_error("stitch_share: out is NULL");
            return -1;
        }
        match ipc::share(rt, ptr_to_u64(ptr)) {
            Ok((msg, off)) => {
                if msg.len() <= cap {
                    // SAFETY: the caller guarantees `out` holds `cap` bytes, and
                    // `msg.len() <= cap`; the buffers cannot overlap (`msg` is ours).
                    unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), out, msg.len()) };
                    if !offset.is_null() {
                        // SAFETY: the caller guarantees a non-NULL `offset` is writable.
                        unsafe { offset.write(off) };
                    }
                }
                msg.len() as isize
            }
            Err(m) => {
                guard::report(
                    tracing::Level::WARN,
                    &format!("stitch_share(ptr={ptr:p}): {m}"),
                );
                -1
            }
        }
    })
}

/// Map, on `device`, the memory that a message of [`stitch_share`] from another process (or
/// this one) describes: each handle is fetched from the sender with `pidfd_getfd` (the
/// sender must be alive; the receiver needs ptrace rights over it: same user), imported,
/// and mapped side by side with read-write access. Writes the base of the mapping to `*out`
/// (the shared allocation is at base + the sender's offset) and returns 0; -1 on error
/// (malformed message, sender gone, no right to its descriptors, driver failure), with
/// nothing left behind. The same message on the same device gives the same base again and
/// counts one more user. The memory is the sender's: this process's statistics do not count
/// it.
///
/// # Safety
/// `message` must point to `len` readable bytes; `out` must point to a writable pointer.
#[no_mangle]
pub unsafe extern "C" fn stitch_ipc_open(
    device: c_int,
    message: *const u8,
    len: usize,
    out: *mut *mut c_void,
) -> c_int {
    on_runtime("stitch_ipc_open", -1, |rt| {
        if message.is_null() || out.is_null() {
            guard::set_last_error("stitch_ipc_open: message or out is NULL");
            return -1;
        }
        // SAFETY: the caller guarantees `message` holds `len` readable bytes.
        let msg = unsafe { std::slice::from_raw_parts(message, len) };
        match ipc::open(rt, device, msg) {
            Ok(base) => {
                // SAFETY: the caller guarantees `out` is writable.
                unsafe { out.write(u64_to_ptr(base)) };
                0
            }
            Err(m) => {
                guard::report(
                    tracing::Level::WARN,
                    &format!("stitch_ipc_open(device={device}): {m}"),
                );
                -1
            }
        }
    })
}

/// One user of a mapping from [`stitch_ipc_open`] is done with it; when the last one is,
/// it is unmapped and its imported handles released. Synchronise the work that used it
/// first (unmapping memory that queued work still reads is a use-after-free). 0, or -1 for
/// a pointer that is not an open mapping's base (reported).
#[no_mangle]
pub extern "C" fn stitch_ipc_close(ptr: *mut c_void) -> c_int {
    on_runtime("stitch_ipc_close", -1, |rt| {
        calls::status(
            ipc::close(rt, ptr_to_u64(ptr)),
            |_| tracing::Level::WARN,
            || format!("stitch_ipc_close(ptr={ptr:p})"),
        )
    })
}

/// Torch's init hook: called once CUDA is initialised, with the number of devices. Reads the
/// configuration (reporting an invalid one at once). Allocators are still created lazily,
/// and no driver is touched before the first allocation.
#[no_mangle]
pub extern "C" fn stitch_init(device_count: c_int) {
    on_runtime("stitch_init", (), |rt| calls::init(rt, device_count))
}

/// Torch's reset hook (`torch.cuda.empty_cache()`): release the physical memory of free
/// handles on every device back to the driver.
#[no_mangle]
pub extern "C" fn stitch_reset() {
    on_runtime("stitch_reset", (), calls::reset)
}

/// Release the physical memory of free handles on `device`. Returns 0, or -1 on error
/// ([`stitch_last_error`]). A device not used yet has nothing to release (0).
#[no_mangle]
pub extern "C" fn stitch_empty_cache(device: c_int) -> c_int {
    on_runtime("stitch_empty_cache", -1, |rt| {
        calls::empty_cache(rt, device)
    })
}

/// Torch's memory-fraction hook (`torch.cuda.set_per_process_memory_fraction`): limit
/// `device` to `fraction` of its memory (and to any capacity in the configuration). Takes
/// effect only before the device's first allocation; later, the call is refused loudly
/// (logged as an error and kept as the last error; the Python package raises) and changes
/// nothing.
#[no_mangle]
pub extern "C" fn stitch_memory_fraction(fraction: c_double, device: c_int) {
    on_runtime("stitch_memory_fraction", (), |rt| {
        calls::memory_fraction(rt, fraction, device)
    })
}

/// Torch's record-stream hook (`Tensor.record_stream`): the live allocation at `ptr` is also
/// used on `stream`, so its free waits for that stream's queued work too.
#[no_mangle]
pub extern "C" fn stitch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    on_runtime("stitch_record_stream", (), |rt| {
        calls::record_stream(rt, ptr_to_u64(ptr), torch_stream(stream))
    })
}

/// Call before destroying a stream that memory was freed on (a `cudaStreamDestroy` of a
/// stream of your own, a `torch.cuda.ExternalStream`): fences and waits for the frees made
/// on it, so that nothing is recorded on it later. Returns 0, or -1 on error
/// ([`stitch_last_error`]; its freed memory then stays unusable by others until the process
/// ends, never unmapped under queued work).
#[no_mangle]
pub extern "C" fn stitch_retire_stream(device: c_int, stream: *mut c_void) -> c_int {
    on_runtime("stitch_retire_stream", -1, |rt| {
        calls::retire_stream(rt, device, torch_stream(stream))
    })
}

/// The statistics of `device` as a JSON object (NUL-terminated UTF-8), or NULL on error
/// ([`stitch_last_error`]). The string belongs to the library: it stays valid until the
/// next `stitch_stats_json` call on the same thread. Do not free it.
#[no_mangle]
pub extern "C" fn stitch_stats_json(device: c_int) -> *const c_char {
    on_runtime("stitch_stats_json", std::ptr::null(), |rt| {
        let Some(s) = calls::stats_json(rt, device) else {
            return std::ptr::null();
        };
        let c = to_cstring(&s);
        STATS_BUF
            .try_with(|b| {
                *b.borrow_mut() = c;
                b.borrow().as_ptr()
            })
            .unwrap_or(std::ptr::null())
    })
}

/// Fill `out` (`out_size` writable bytes) with the typed statistics of `device`
/// (`struct stitch_device_stats`, torch's `DeviceStats` meanings): as many bytes as both
/// this library's struct and `out_size` hold. Returns the library's struct size (fields
/// past `min(out_size, return value)` were not written), or -1 on error
/// ([`stitch_last_error`]) with `out` untouched. Before the device's first allocation every
/// field is 0 (`initialized` too), and no driver is touched.
///
/// # Safety
/// `out` must be NULL (an error) or point to `out_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stitch_device_stats(
    device: c_int,
    out: *mut c_void,
    out_size: usize,
) -> isize {
    on_runtime("stitch_device_stats", -1, |rt| {
        if out.is_null() {
            guard::report(
                tracing::Level::WARN,
                "stitch_device_stats: out is a null pointer",
            );
            return -1;
        }
        let Some(st) = calls::device_stats(rt, device) else {
            return -1;
        };
        let n = std::mem::size_of::<stats::DeviceStats>();
        // SAFETY: `st` is a plain `repr(C)` struct of integers, `n` bytes long; the caller
        // guarantees `out` points to `out_size` writable bytes, and at most that many are
        // written; the two cannot overlap (`st` is a local).
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&raw const st).cast::<u8>(),
                out.cast::<u8>(),
                n.min(out_size),
            )
        };
        n as isize
    })
}

/// Start every high-water mark of `device`'s statistics again from its current value
/// (torch's `reset_peak_memory_stats`). 0, or -1 on error. The growth policy keeps its own
/// lifetime peak, so this changes no allocation decision.
#[no_mangle]
pub extern "C" fn stitch_reset_peak_stats(device: c_int) -> c_int {
    on_runtime("stitch_reset_peak_stats", -1, |rt| {
        calls::reset_stats(rt, device, false)
    })
}

/// Zero `device`'s accumulated counters (allocations, frees, handles created and released,
/// out-of-memory errors, retries, driver calls): torch's `reset_accumulated_memory_stats`.
/// 0, or -1 on error.
#[no_mangle]
pub extern "C" fn stitch_reset_accumulated_stats(device: c_int) -> c_int {
    on_runtime("stitch_reset_accumulated_stats", -1, |rt| {
        calls::reset_stats(rt, device, true)
    })
}

/// Limit `device` to `fraction` (0 < fraction <= 1) of its memory, at any time: before the
/// first allocation it sets the capacity the allocator is created with, after it changes the
/// capacity at once. Nothing live is touched; a later allocation that would take the live
/// bytes past the new limit (or needs memory that cannot be created under it) fails as out
/// of memory. 0, or -1 on error.
#[no_mangle]
pub extern "C" fn stitch_set_memory_fraction(device: c_int, fraction: c_double) -> c_int {
    on_runtime("stitch_set_memory_fraction", -1, |rt| {
        calls::set_memory_fraction(rt, device, fraction)
    })
}

/// The memory fraction last set on `device` (1.0 if none), or -1.0 on error.
#[no_mangle]
pub extern "C" fn stitch_get_memory_fraction(device: c_int) -> c_double {
    on_runtime("stitch_get_memory_fraction", -1.0, |rt| {
        calls::get_memory_fraction(rt, device)
    })
}

/// Allocate `size` bytes for a CUDA graph's private memory pool on `stream`, which may be
/// capturing: only clean free memory (no work of any stream may still use it) or new
/// memory is used, no event is recorded, queried or waited for on any stream, and the
/// driver's calls run with the thread in relaxed capture mode. NULL on failure (out of
/// memory, too large, ...; [`stitch_last_error`]) or for size 0. Give the memory back with
/// [`stitch_free_graph`] only.
#[no_mangle]
pub extern "C" fn stitch_malloc_graph(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    on_runtime("stitch_malloc_graph", std::ptr::null_mut(), |rt| {
        u64_to_ptr(calls::malloc_graph(rt, size, device, torch_stream(stream)))
    })
}

/// Free `ptr` (from [`stitch_malloc_graph`] or [`stitch_malloc`]) as clean: reusable by every
/// stream at once, no event recorded. The caller guarantees that no queued work uses it any
/// more (for a graph pool: the graphs that used it are destroyed and the device was
/// synchronised since). 0, or -1 on error (an unknown pointer frees nothing).
#[no_mangle]
pub extern "C" fn stitch_free_graph(ptr: *mut c_void, device: c_int) -> c_int {
    on_runtime("stitch_free_graph", -1, |rt| {
        calls::free_graph(rt, ptr_to_u64(ptr), device)
    })
}

/// The calling thread's last error message, or `""` if none since the thread started or
/// since [`stitch_clear_error`]. Owned by the library; valid until the next `stitch_*` call
/// on the same thread. Never NULL.
#[no_mangle]
pub extern "C" fn stitch_last_error() -> *const c_char {
    static EMPTY: &CStr = c"";
    guard("stitch_last_error", EMPTY.as_ptr(), guard::last_error_ptr)
}

/// Forget the calling thread's last error.
#[no_mangle]
pub extern "C" fn stitch_clear_error() {
    guard("stitch_clear_error", (), || {
        guard::clear_error();
    })
}

/// The library's version (`"0.1.0"`), a static string.
#[no_mangle]
pub extern "C" fn stitch_version() -> *const c_char {
    VERSION.as_ptr()
}

// ---------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_the_crate_version() {
        assert_eq!(VERSION.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
        assert_eq!(stitch_version(), VERSION.as_ptr());
    }
}
