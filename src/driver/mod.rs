//! The `Driver` trait: the CUDA virtual-memory-management operations the allocator needs,
//! and its implementations.
//!
//! The trait is shaped after the CUDA driver API so that a real GPU backend fits it one to
//! one, and so that the CPU backends enforce the same rules the GPU does:
//!
//! * a physical handle is always mapped whole, at offset 0 (`cuMemMap`);
//! * an unmap covers exactly one earlier mapping (`cuMemUnmap`);
//! * a fresh mapping is inaccessible until access is set on it (`cuMemSetAccess`);
//! * a handle can only be released when no mapping of it remains (this crate's rule; CUDA
//!   defers the release, which hides leaks);
//! * no VMM call waits for in-flight GPU work: unmapping memory that queued work still uses is
//!   a use-after-free. The allocator fences with events (`record_event`, `query_event`,
//!   `wait_event`) before it unmaps.
//!
//! Implementations: [`SimDriver`] (accounting only, any scale, deterministic),
//! [`HostDriver`] (real OS virtual memory with `mmap` and `memfd`, so remapped bytes survive)
//! and [`CudaDriver`] (a real GPU through the CUDA driver API, loaded at run time).
//! [`AnyDriver`](crate::AnyDriver) picks one at run time.
//!
//! Wrappers ([`FaultyDriver`]: fault injection; [`Metering`] as [`Timed`] or [`Metered`]:
//! call counts, wall time and the cost model's price; `Arc<D>`; `AnyDriver`) implement
//! [`Forward`] only: its blanket implementation forwards every call and runs their hooks.

mod forward;
mod ledger;
mod streams;

pub mod cuda;
#[doc(hidden)]
pub mod faulty;
pub mod host;
pub mod meter;
pub mod sim;

pub use cuda::{CudaDriver, CudaStream};
#[doc(hidden)]
pub use faulty::FaultyDriver;
pub use forward::{Call, Done, Forward};
pub use host::HostDriver;
pub use ledger::LeakReport;
pub use meter::{Meter, Metered, Metering, OpTiming, RequestTiming, Timed, Timings};
pub use sim::SimDriver;
pub use streams::WorkId;

use serde::Serialize;
use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};

/// A device virtual address.
pub type DevAddr = u64;

/// An opaque physical-memory handle returned by [`Driver::create`]
/// (a `CUmemGenericAllocationHandle` on CUDA).
///
/// Only backends make one (from what they handed out); [`PhysHandle::raw`] reads the value.
/// Every backend refuses a handle it does not hold with `INVALID_HANDLE` instead of passing
/// it on, so a stale or foreign handle is an error, never a crash inside libcuda.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PhysHandle(u64);

impl PhysHandle {
    /// A handle of value `raw` (backends only).
    pub(crate) const fn new(raw: u64) -> Self {
        PhysHandle(raw)
    }
    /// A handle from its raw value, for code outside the crate that received one as an
    /// integer.
    ///
    /// # Safety
    /// `raw` must be the value of a handle a backend of this process handed out
    /// ([`PhysHandle::raw`]). The backends check handles against what they hold, so a wrong
    /// value is refused with an error; the function is `unsafe` so that making handles out of
    /// thin air stays visible.
    pub const unsafe fn from_raw(raw: u64) -> Self {
        PhysHandle(raw)
    }
    /// The raw value (a `CUmemGenericAllocationHandle` on CUDA).
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// An opaque event returned by [`Driver::record_event`] (a `CUevent` on CUDA).
///
/// Only backends make one; [`EventId::raw`] reads the value. Every backend refuses an event
/// it did not hand out, or that was already destroyed, with `INVALID_HANDLE` instead of
/// passing it on.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct EventId(u64);

impl EventId {
    /// An event of value `raw` (backends only).
    pub(crate) const fn new(raw: u64) -> Self {
        EventId(raw)
    }
    /// An event from its raw value, for code outside the crate that received one as an
    /// integer.
    ///
    /// # Safety
    /// `raw` must be the value of an event a backend of this process handed out
    /// ([`EventId::raw`]) and has not destroyed. The backends check events against the ones
    /// they handed out, so a wrong value is refused with an error.
    pub const unsafe fn from_raw(raw: u64) -> Self {
        EventId(raw)
    }
    /// The raw value (a `CUevent` on CUDA).
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// A stream: a real CUDA stream (`CUstream`/`cudaStream_t`), the default stream, or a
/// simulated stream of the CPU backends.
///
/// * [`Stream::DEFAULT`] (raw value 0) is the legacy default stream, valid everywhere.
/// * [`Stream::sim`]`(n)` is simulated stream `n`: its raw value is `n` with bit 63 set, a
///   tag no real `CUstream` (a user-space pointer, below 2^47) has. The CPU backends take it
///   like any stream; [`CudaDriver`] refuses it with `INVALID_HANDLE` instead of passing it
///   to libcuda. `sim(0)` is [`Stream::DEFAULT`].
/// * A real stream comes from [`CudaStream::stream`] (a stream this crate created) or from
///   the `unsafe` [`Stream::from_raw`] (a stream someone else created, such as PyTorch's
///   `cudaStream_t` received by the C ABI).
///
/// ```
/// use stitch_alloc::Stream;
/// assert_eq!(Stream::DEFAULT.raw(), 0);
/// assert_eq!(Stream::sim(0), Stream::DEFAULT);
/// assert_eq!(Stream::sim(3).raw(), 3 | 1 << 63);
/// assert!(Stream::sim(3).is_sim() && !Stream::DEFAULT.is_sim());
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Stream(u64);

impl Stream {
    /// The default (legacy) stream.
    pub const DEFAULT: Stream = Stream(0);

    /// The tag bit of simulated streams.
    const SIM_TAG: u64 = 1 << 63;

    /// Simulated stream `n` (bit 63 of `n` is ignored); `sim(0)` is [`Stream::DEFAULT`].
    pub const fn sim(n: u64) -> Stream {
        if n & !Self::SIM_TAG == 0 {
            Stream::DEFAULT
        } else {
            Stream(n | Self::SIM_TAG)
        }
    }

    /// A stream from its raw `CUstream` / `cudaStream_t` value.
    ///
    /// # Safety
    /// When the stream is given to a [`CudaDriver`] (directly or through an allocator),
    /// `raw` must be 0 or a live stream of that device's primary context, and stay live
    /// while the driver may use it (events recorded on it are waited for later): libcuda
    /// does not validate stream handles. A value with bit 63 set is taken as a simulated
    /// stream (refused by `CudaDriver`). Any value is harmless with the CPU backends.
    pub const unsafe fn from_raw(raw: u64) -> Stream {
        Stream(raw)
    }

    /// The raw value (a `CUstream` for a real stream; tagged with bit 63 for a simulated one).
    pub const fn raw(self) -> u64 {
        self.0
    }

    /// Whether this is a simulated stream ([`Stream::sim`] of a non-zero `n`).
    pub const fn is_sim(self) -> bool {
        self.0 & Self::SIM_TAG != 0
    }
}

/// Device memory as the driver reports it (like `cudaMemGetInfo`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemInfo {
    /// Bytes the device could still hand out.
    pub free: u64,
    /// Total bytes of device memory.
    pub total: u64,
}

/// A thread's CUDA stream capture mode (`CUstreamCaptureMode`): which calls a capture in
/// progress forbids on this thread.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CaptureMode {
    /// Unsafe calls are forbidden while any thread's global-mode capture runs (CUDA's
    /// default).
    Global,
    /// Forbidden while this thread captures.
    ThreadLocal,
    /// Nothing is forbidden (the caller keeps the calls safe).
    Relaxed,
}

/// The kinds of driver call, used for error reports and call counting.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DriverOp {
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    FreeReservation,
    /// `cuMemCreate`.
    Create,
    /// `cuMemRelease`.
    Release,
    /// `cuMemMap`.
    Map,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuEventCreate` + `cuEventRecord`.
    RecordEvent,
    /// `cuEventQuery`.
    QueryEvent,
    /// `cuEventSynchronize`.
    WaitEvent,
    /// `cuEventDestroy`.
    DestroyEvent,
    /// `cuMemGetInfo`.
    MemInfo,
    /// Host/device copies used by tests (`cuMemcpyHtoD`/`DtoH`).
    Copy,
    /// Sharing between processes: `cuMemExportToShareableHandle` (a handle as a POSIX file
    /// descriptor) and `cuMemImportFromShareableHandle` (see [`crate::ipc`]). Not priced by
    /// the cost model: replays never share.
    Share,
}

impl DriverOp {
    /// Every kind, in a fixed order (the order of [`CallCounts`]).
    pub const ALL: [DriverOp; 14] = [
        DriverOp::Reserve,
        DriverOp::FreeReservation,
        DriverOp::Create,
        DriverOp::Release,
        DriverOp::Map,
        DriverOp::Unmap,
        DriverOp::SetAccess,
        DriverOp::RecordEvent,
        DriverOp::QueryEvent,
        DriverOp::WaitEvent,
        DriverOp::DestroyEvent,
        DriverOp::MemInfo,
        DriverOp::Copy,
        DriverOp::Share,
    ];

    /// The snake_case name used in JSON reports (`"set_access"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DriverOp::Reserve => "reserve",
            DriverOp::FreeReservation => "free_reservation",
            DriverOp::Create => "create",
            DriverOp::Release => "release",
            DriverOp::Map => "map",
            DriverOp::Unmap => "unmap",
            DriverOp::SetAccess => "set_access",
            DriverOp::RecordEvent => "record_event",
            DriverOp::QueryEvent => "query_event",
            DriverOp::WaitEvent => "wait_event",
            DriverOp::DestroyEvent => "destroy_event",
            DriverOp::MemInfo => "mem_info",
            DriverOp::Copy => "copy",
            DriverOp::Share => "share",
        }
    }
}

impl fmt::Display for DriverOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Number of calls made, by kind.
///
/// ```
/// use stitch_alloc::driver::{CallCounts, DriverOp};
/// let mut c = CallCounts::default();
/// c.add(DriverOp::Map);
/// assert_eq!(c.get(DriverOp::Map), 1);
/// assert_eq!(c.total(), 1);
/// // `{:?}` names each kind.
/// assert!(format!("{c:?}").contains("map: 1"));
/// ```
#[derive(Copy, Clone, Default, PartialEq, Eq)]
pub struct CallCounts([u64; DriverOp::ALL.len()]);

impl std::fmt::Debug for CallCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut m = f.debug_struct("CallCounts");
        for (op, n) in self.iter() {
            m.field(op.name(), &n);
        }
        m.finish()
    }
}

impl CallCounts {
    /// Count one call of `op`.
    #[inline]
    pub fn add(&mut self, op: DriverOp) {
        self.0[op as usize] += 1;
    }
    /// Calls of `op` so far.
    pub fn get(&self, op: DriverOp) -> u64 {
        self.0[op as usize]
    }
    /// All calls so far.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    /// VMM calls only (reserve, free_reservation, create, release, map, unmap, set_access).
    pub fn vmm_total(&self) -> u64 {
        self.0[..7].iter().sum()
    }
    /// `(name, count)` pairs for every kind.
    pub fn iter(&self) -> impl Iterator<Item = (DriverOp, u64)> + '_ {
        DriverOp::ALL.iter().map(move |&op| (op, self.get(op)))
    }
}

impl Serialize for CallCounts {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(DriverOp::ALL.len()))?;
        for (op, n) in self.iter() {
            m.serialize_entry(op.name(), &n)?;
        }
        m.end()
    }
}

/// A failed driver call: which call, the driver's numeric code, and a message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{op} failed (code {code}): {message}")]
pub struct DriverError {
    /// The call that failed.
    pub op: DriverOp,
    /// The driver's code (a `CUresult` on CUDA, an `errno` on the host backend,
    /// one of the `code::` constants for rule violations found by the CPU backends).
    pub code: i64,
    /// What went wrong, in words.
    pub message: String,
}

impl DriverError {
    /// Build an error.
    pub fn new(op: DriverOp, code: i64, message: impl Into<String>) -> Self {
        DriverError {
            op,
            code,
            message: message.into(),
        }
    }
}

/// Codes used by the CPU backends, chosen to match the `CUresult` the GPU would give.
pub mod code {
    /// `CUDA_ERROR_INVALID_VALUE`: bad argument or rule violation.
    pub const INVALID_VALUE: i64 = 1;
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: i64 = 2;
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: i64 = 801;
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`: the operation would touch memory in-flight work uses.
    pub const ILLEGAL_ADDRESS: i64 = 700;
    /// `CUDA_ERROR_INVALID_HANDLE`.
    pub const INVALID_HANDLE: i64 = 400;
    /// An operating-system limit was hit (file descriptors, `vm.max_map_count`).
    pub const OS_LIMIT: i64 = 10_000;
    /// An injected failure (fault-injection wrappers).
    pub const INJECTED: i64 = 10_001;
}

/// Result of a driver call.
pub type DriverResult<T> = Result<T, DriverError>;

/// The VMM operations the allocator needs, shaped after the CUDA driver API.
///
/// All sizes are multiples of [`Driver::granularity`]; addresses of reservations and
/// mappings are aligned to it. Implementations must be `Send + Sync`: the allocator calls
/// them under its own lock, but users may share one driver between allocators.
pub trait Driver: Send + Sync {
    /// A short name for reports (`"sim"`, `"host"`, `"cuda"`).
    fn name(&self) -> &'static str;
    /// The mapping granularity in bytes (2 MiB on current GPUs).
    fn granularity(&self) -> u64;
    /// Total and free device memory.
    fn mem_info(&self) -> DriverResult<MemInfo>;

    /// Reserve `size` bytes of virtual address space (`cuMemAddressReserve`).
    fn reserve(&self, size: u64) -> DriverResult<DevAddr>;
    /// Free a whole earlier reservation (`cuMemAddressFree`). It must hold no mapping.
    fn free_reservation(&self, base: DevAddr, size: u64) -> DriverResult<()>;

    /// Create a physical handle of `size` bytes (`cuMemCreate`).
    fn create(&self, size: u64) -> DriverResult<PhysHandle>;
    /// Release a handle (`cuMemRelease`). It must not be mapped anywhere.
    fn release(&self, handle: PhysHandle) -> DriverResult<()>;

    /// Map the whole of `handle` (`size` must be its size) at `addr`, which must lie in a
    /// reservation and overlap no mapping (`cuMemMap`). The new mapping is inaccessible
    /// until [`Driver::set_access`].
    fn map(&self, addr: DevAddr, size: u64, handle: PhysHandle) -> DriverResult<()>;
    /// Remove exactly one earlier mapping (`cuMemUnmap`). Fails if in-flight work still
    /// uses the range (the CPU backends detect this; on a GPU it would be a use-after-free).
    fn unmap(&self, addr: DevAddr, size: u64) -> DriverResult<()>;
    /// Grant read-write access on a fully mapped range, which may span several mappings
    /// (`cuMemSetAccess`).
    fn set_access(&self, addr: DevAddr, size: u64) -> DriverResult<()>;

    /// Record an event on `stream` that completes once all work queued on it so far has.
    fn record_event(&self, stream: Stream) -> DriverResult<EventId>;
    /// Whether `event` has completed (never blocks).
    fn query_event(&self, event: EventId) -> DriverResult<bool>;
    /// Block until `event` completes.
    fn wait_event(&self, event: EventId) -> DriverResult<()>;
    /// Destroy an event.
    fn destroy_event(&self, event: EventId) -> DriverResult<()>;

    /// Copy bytes from the host into mapped, accessible device memory.
    /// Backends without data (the simulator) return a `NOT_SUPPORTED` error.
    fn write(&self, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        let _ = (addr, data);
        Err(DriverError::new(
            DriverOp::Copy,
            code::NOT_SUPPORTED,
            "this backend holds no data",
        ))
    }
    /// Copy bytes from mapped, accessible device memory to the host.
    fn read(&self, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        let _ = (addr, buf);
        Err(DriverError::new(
            DriverOp::Copy,
            code::NOT_SUPPORTED,
            "this backend holds no data",
        ))
    }
    /// Whether `stream` is capturing a CUDA graph (`cuStreamIsCapturing`). Work queued on a
    /// capturing stream is recorded into the graph and runs again on every replay, so memory
    /// it touches must not be reused; the C ABI refuses allocations on such a stream. The
    /// CPU backends cannot capture (`Ok(false)`, the default); the legacy default stream 0
    /// never captures, and [`CudaDriver`] answers for it without a driver call.
    fn stream_capturing(&self, stream: Stream) -> DriverResult<bool> {
        let _ = stream;
        Ok(false)
    }
    /// Set the calling thread's stream capture mode (`cuThreadExchangeStreamCaptureMode`) and
    /// return the one it replaces. Under [`CaptureMode::Relaxed`] the virtual memory calls
    /// that a capture in global mode forbids may run while a stream captures; put the old
    /// mode back afterwards. The CPU backends capture nothing: the default changes nothing
    /// and returns `mode`.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> DriverResult<CaptureMode> {
        Ok(mode)
    }
    /// The most physical handles this backend can hold at once, where it has such a limit
    /// below what the device's memory needs (the host backend: one open file per handle,
    /// so three quarters of the process's soft `RLIMIT_NOFILE`). `None` (the default, and
    /// the GPU's): no limit that the allocator must size its handles for. The allocator
    /// reads it once, when it is created (see `Allocator::new`).
    fn handle_limit(&self) -> Option<u64> {
        None
    }
    /// Export `handle` as a POSIX file descriptor that another process can import
    /// (`cuMemExportToShareableHandle`); the descriptor is the caller's to keep or close, and
    /// the handle stays this driver's. Backends that cannot share (the simulator; a GPU whose
    /// handles were created without the POSIX-descriptor type) return `NOT_SUPPORTED`, the
    /// default.
    fn export(&self, handle: PhysHandle) -> DriverResult<OwnedFd> {
        let _ = handle;
        Err(DriverError::new(
            DriverOp::Share,
            code::NOT_SUPPORTED,
            "this backend cannot export handles to other processes",
        ))
    }
    /// Import a handle of `size` bytes that another process exported as `fd`
    /// (`cuMemImportFromShareableHandle`). The new handle is this driver's, mapped and
    /// released like a created one; its memory stays counted by the exporter (an import
    /// takes nothing from this driver's capacity). `fd` is only read.
    fn import(&self, fd: BorrowedFd<'_>, size: u64) -> DriverResult<PhysHandle> {
        let _ = (fd, size);
        Err(DriverError::new(
            DriverOp::Share,
            code::NOT_SUPPORTED,
            "this backend cannot import handles from other processes",
        ))
    }
    /// Whether [`Driver::write`] and [`Driver::read`] work.
    fn has_data(&self) -> bool {
        false
    }
    /// How many devices each [`Driver::set_access`] grants access to: the owner plus its
    /// peers (one `CUmemAccessDesc` each). The cost model prices SetAccess per device
    /// ([`crate::cost::CostModel::set_access_per_peer`]).
    fn access_devices(&self) -> u32 {
        1
    }
    /// The simulated GPU work queue of a CPU backend (`None` on a real device, whose work
    /// runs by itself). Replays use it to model a GPU that lags behind the CPU.
    fn simulated_work(&self) -> Option<&dyn SimulatedWork> {
        None
    }
}

/// Simulated kernels on the CPU backends: work launched on a stream stays in flight (and
/// keeps its memory from being unmapped) until completed, in launch order.
///
/// ```
/// use stitch_alloc::driver::{Driver, SimDriver};
/// use stitch_alloc::Stream;
/// let sim = SimDriver::new();
/// let q = sim.simulated_work().expect("the simulator queues work");
/// let w = q.launch(Stream::sim(1), 0, 4096);
/// assert!(!q.work_done(w));
/// q.complete(Stream::sim(1), Some(w));
/// assert!(q.work_done(w));
/// ```
pub trait SimulatedWork {
    /// Queue a kernel on `stream` touching `[addr, addr+len)`.
    fn launch(&self, stream: Stream, addr: DevAddr, len: u64) -> WorkId;
    /// Complete the work on `stream` up to and including `upto` (all of it when `None`).
    fn complete(&self, stream: Stream, upto: Option<WorkId>);
    /// Whether work `w` has completed.
    fn work_done(&self, w: WorkId) -> bool;
}
