//! A shadow model and invariant checker shared by every randomised test: unit tests,
//! proptest, fuzz targets and the GPU suite all drive the allocator through [`Harness`].
//!
//! Operations are plain data ([`Op`]); [`Op::decode`] turns arbitrary bytes into a sequence,
//! which is the shape of a fuzz target. After every operation the harness checks:
//!
//! 1. `Allocator::validate()` (every structure's own invariants);
//! 2. no two live allocations overlap;
//! 3. every live byte is mapped with access set;
//! 4. bytes written into each live allocation read back unchanged (backends with data);
//! 5. the allocator's statistics equal the shadow model's;
//! 6. **zero external fragmentation**: an allocation of `N` bytes fails with `OutOfMemory`
//!    only if `capacity - (bytes of handles holding a live byte) < N` rounded up to the
//!    granularity. The bytes of handles holding a live byte are computed independently of
//!    the allocator: from the device's own ledger of handles and where each is mapped
//!    ([`TestDevice::device_handles`]) and the shadow model's live ranges (a handle holds a
//!    live byte iff one of its mappings overlaps a live range). The OOM report's own figure
//!    must equal it. A device without a ledger (CUDA) can only be checked against the
//!    allocator's own figure; such OOMs are counted apart ([`RunCounts::ooms_unverified`]);
//! 7. the stream rule: memory still used by in-flight work on stream `S` is never handed to
//!    another stream (and the device refuses to unmap it: that would surface as an error);
//! 8. at the end, after freeing everything and dropping the allocator, the device holds
//!    nothing (no handle, mapping, reservation or event).
//!
//! Fault-injection runs also report how many faults fired ([`RunCounts::faults_fired`]);
//! [`FaultTally`] checks that count against the injection rate, so a run in which injection
//! silently stopped firing fails.
//!
//! The same harness runs on a real GPU through [`CudaTestDevice`]: real streams, real
//! asynchronous work that reads the memory it was launched on (an early unmap makes it
//! fault), and the `CudaDriver`'s own count of what it handed out as the leak report.
#![forbid(unsafe_code)]

use crate::driver::{
    CallCounts, CudaDriver, CudaStream, DevAddr, Driver, DriverOp, DriverResult, EventId, Forward,
    HostDriver, LeakReport, SimDriver, WorkId,
};
use crate::{AllocError, Allocator, Config, DevicePtr, Stream};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A device whose streams the test controls: the CPU backends (simulated streams and work)
/// and [`CudaTestDevice`] (real streams and GPU work).
pub trait TestDevice: Driver + 'static {
    /// The stream that operations name by number `n` (`0..STREAMS`). The CPU backends use
    /// `Stream::sim(n)`; a GPU needs real stream handles.
    fn test_stream(&self, n: u8) -> Stream {
        Stream::sim(n as u64)
    }
    /// Queue work touching `[addr, addr+len)` on `stream` (it must not change the bytes).
    fn launch(&self, stream: Stream, addr: u64, len: u64) -> WorkId;
    /// Complete all work on `stream`.
    fn complete(&self, stream: Stream);
    /// Complete all work everywhere.
    fn complete_all(&self);
    /// Whether work `w` has completed.
    fn work_done(&self, w: WorkId) -> bool;
    /// Whether the range is mapped with access set.
    fn is_accessible(&self, addr: u64, len: u64) -> bool;
    /// What the device still holds.
    fn leak_report(&self) -> LeakReport;
    /// Driver failures injected so far (fault-injection wrappers; 0 otherwise). A driver
    /// error is a legitimate outcome of an operation during which this count rose.
    fn injected_faults(&self) -> u64 {
        0
    }
    /// Turn fault injection on or off (no-op without a wrapper).
    fn set_faults(&self, on: bool) {
        let _ = on;
    }
    /// Every physical handle the device holds and where it is mapped, from the device's own
    /// ledger (not the allocator's): the input of the zero-fragmentation oracle. `None` when
    /// the device keeps no such ledger (CUDA cannot enumerate its handles).
    fn device_handles(&self) -> Option<Vec<DeviceHandle>> {
        None
    }
}

/// One physical handle as the device's ledger knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHandle {
    /// Bytes (a handle is always mapped whole).
    pub size: u64,
    /// Start of each mapping of the handle (several when aliased, none when unmapped).
    pub mapped_at: Vec<DevAddr>,
}

fn device_handles(v: Vec<(u64, Vec<DevAddr>)>) -> Vec<DeviceHandle> {
    v.into_iter()
        .map(|(size, mapped_at)| DeviceHandle { size, mapped_at })
        .collect()
}

impl<T: TestDevice> TestDevice for crate::driver::FaultyDriver<T> {
    fn launch(&self, stream: Stream, addr: u64, len: u64) -> WorkId {
        self.inner().launch(stream, addr, len)
    }
    fn complete(&self, stream: Stream) {
        self.inner().complete(stream)
    }
    fn complete_all(&self) {
        self.inner().complete_all()
    }
    fn work_done(&self, w: WorkId) -> bool {
        self.inner().work_done(w)
    }
    fn is_accessible(&self, addr: u64, len: u64) -> bool {
        self.inner().is_accessible(addr, len)
    }
    fn leak_report(&self) -> LeakReport {
        self.inner().leak_report()
    }
    fn injected_faults(&self) -> u64 {
        self.injected()
    }
    fn set_faults(&self, on: bool) {
        self.set_enabled(on)
    }
    fn device_handles(&self) -> Option<Vec<DeviceHandle>> {
        self.inner().device_handles()
    }
}

macro_rules! test_device {
    ($t:ty) => {
        impl TestDevice for $t {
            fn launch(&self, stream: Stream, addr: u64, len: u64) -> WorkId {
                <$t>::launch(self, stream, addr, len)
            }
            fn complete(&self, stream: Stream) {
                <$t>::complete(self, stream, None)
            }
            fn complete_all(&self) {
                <$t>::complete_all(self)
            }
            fn work_done(&self, w: WorkId) -> bool {
                <$t>::work_done(self, w)
            }
            fn is_accessible(&self, addr: u64, len: u64) -> bool {
                <$t>::is_accessible(self, addr, len)
            }
            fn leak_report(&self) -> LeakReport {
                <$t>::leak_report(self)
            }
            fn device_handles(&self) -> Option<Vec<DeviceHandle>> {
                Some(device_handles(<$t>::handle_mappings(self)))
            }
        }
    };
}
test_device!(SimDriver);
test_device!(HostDriver);

/// Bytes of scratch memory per test stream that [`CudaTestDevice::launch`] copies into.
const CUDA_SCRATCH: u64 = 256 << 20;
/// Memsets of the whole scratch buffer queued before each launch's read of its range, so
/// the read happens a few milliseconds after the launch (the window in which an early unmap
/// would make it fault).
const CUDA_PAD_MEMSETS: u32 = 16;

/// A CUDA device for the [`Harness`]: stream 0 is the legacy default stream, streams 1 and
/// 2 are created with `CU_STREAM_NON_BLOCKING` (destroyed on drop).
///
/// * [`TestDevice::launch`] queues real work on the stream: memsets of a private scratch
///   buffer (a few milliseconds of GPU time), then `cuMemcpyDtoDAsync` of the whole range
///   into the scratch buffer. It reads the memory without changing it, so the harness's data
///   checks hold, and a range unmapped before the copy runs makes it fault with
///   `CUDA_ERROR_ILLEGAL_ADDRESS` (reported by the next synchronisation, and by
///   compute-sanitizer). An event recorded after it stands for the work.
/// * `complete` is `cuStreamSynchronize`, `complete_all` is `cuCtxSynchronize`, `work_done`
///   is `cuEventQuery`; all panic on a CUDA error (an illegal address, say).
/// * [`TestDevice::is_accessible`] asks `cuMemGetAccess` (see [`CudaDriver::is_accessible`]).
/// * The harness's reads and writes use a private non-blocking stream, so they never wait
///   for the test streams' work (which would hide stream hazards); [`Driver::write`] of the
///   plain `CudaDriver` synchronises the whole device.
/// * The leak report is the `CudaDriver`'s count of handles, mappings, reservations and
///   events handed out and not given back (the launch events included until completed).
///
/// ```
/// use stitch_alloc::testing::{CudaTestDevice, Harness, Op};
/// use stitch_alloc::{Capacity, Config};
/// let Ok(dev) = CudaTestDevice::new(0) else { return }; // no GPU here
/// let cfg = Config::default().with_capacity(Capacity::Bytes(1 << 30));
/// let h = Harness::new(dev, cfg).unwrap();
/// h.run(&[
///     Op::Alloc { size: 64 << 20, stream: 1 },
///     Op::Launch { pick: 0 },
///     Op::FreeOn { pick: 0, stream: 2 },
///     Op::Alloc { size: 1 << 30, stream: 2 },
/// ])
/// .unwrap();
/// ```
pub struct CudaTestDevice {
    gpu: CudaDriver,
    /// Test streams 1 and 2.
    streams: [CudaStream; 2],
    /// The harness's reads and writes.
    copy: CudaStream,
    /// One scratch buffer per test stream.
    scratch: [DevAddr; STREAMS as usize],
    /// Launched work: id -> (stream, its event until it is known complete).
    work: Mutex<FxHashMap<u64, (Stream, Option<EventId>)>>,
    next_work: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for CudaTestDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTestDevice")
            .field("gpu", &self.gpu)
            .field("streams", &self.streams)
            .finish()
    }
}

impl CudaTestDevice {
    /// Open device `ordinal`, create the streams and the scratch buffers.
    pub fn new(ordinal: i32) -> DriverResult<Self> {
        let gpu = CudaDriver::new(ordinal)?;
        let streams = [gpu.create_stream(true)?, gpu.create_stream(true)?];
        let copy = gpu.create_stream(true)?;
        let mut scratch = [0; STREAMS as usize];
        for i in 0..scratch.len() {
            match gpu.mem_alloc(CUDA_SCRATCH) {
                Ok(p) => scratch[i] = p,
                Err(e) => {
                    for &p in &scratch[..i] {
                        let _ = gpu.mem_free(p);
                    }
                    return Err(e);
                }
            }
        }
        Ok(CudaTestDevice {
            gpu,
            streams,
            copy,
            scratch,
            work: Mutex::new(FxHashMap::default()),
            next_work: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The underlying driver.
    pub fn gpu(&self) -> &CudaDriver {
        &self.gpu
    }

    fn index(&self, s: Stream) -> usize {
        (0..STREAMS)
            .position(|n| self.test_stream(n) == s)
            .unwrap_or_else(|| panic!("stream {:#x} is not a test stream", s.raw()))
    }

    /// Destroy the events of completed work (all work when `stream` is `None`).
    fn retire(&self, stream: Option<Stream>) {
        let mut work = self.work.lock();
        for (s, ev) in work.values_mut() {
            if stream.is_none_or(|x| x == *s) {
                if let Some(e) = ev.take() {
                    self.gpu
                        .destroy_event(e)
                        .expect("destroying a launch event failed");
                }
            }
        }
    }
}

impl Drop for CudaTestDevice {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.synchronize() {
            tracing::warn!(%e, "CudaTestDevice: synchronize at drop failed");
        }
        for (_, ev) in self.work.get_mut().values_mut() {
            if let Some(e) = ev.take() {
                let _ = self.gpu.destroy_event(e);
            }
        }
        for &p in &self.scratch {
            if let Err(e) = self.gpu.mem_free(p) {
                tracing::warn!(%e, "CudaTestDevice: freeing scratch failed");
            }
        }
    }
}

/// Forwards to the GPU, except that host copies go through the private copy stream.
impl Forward for CudaTestDevice {
    type Inner = CudaDriver;
    fn inner(&self) -> &CudaDriver {
        &self.gpu
    }
    fn forward_write(&self, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        self.gpu.write_on(self.copy.stream(), addr, data)
    }
    fn forward_read(&self, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        self.gpu.read_on(self.copy.stream(), addr, buf)
    }
}

impl TestDevice for CudaTestDevice {
    fn test_stream(&self, n: u8) -> Stream {
        match n % STREAMS {
            0 => Stream::DEFAULT,
            k => self.streams[k as usize - 1].stream(),
        }
    }

    fn launch(&self, stream: Stream, addr: u64, len: u64) -> WorkId {
        let scratch = self.scratch[self.index(stream)];
        fn fail<T>(stream: Stream, e: crate::driver::DriverError) -> T {
            panic!("launch on stream {:#x} failed: {e}", stream.raw())
        }
        for i in 0..CUDA_PAD_MEMSETS {
            self.gpu
                .memset_d32_async(scratch, 0xA5A5_0000 | i, CUDA_SCRATCH / 4, stream)
                .unwrap_or_else(|e| fail(stream, e));
        }
        let mut off = 0;
        while off < len {
            let n = (len - off).min(CUDA_SCRATCH);
            self.gpu
                .copy_dtod_async(scratch, addr + off, n, stream)
                .unwrap_or_else(|e| fail(stream, e));
            off += n;
        }
        let ev = self
            .gpu
            .record_event(stream)
            .unwrap_or_else(|e| fail(stream, e));
        let id = self
            .next_work
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.work.lock().insert(id, (stream, Some(ev)));
        WorkId(id)
    }

    fn complete(&self, stream: Stream) {
        self.gpu
            .stream_synchronize(stream)
            .unwrap_or_else(|e| panic!("work on stream {:#x} failed: {e}", stream.raw()));
        self.retire(Some(stream));
    }

    fn complete_all(&self) {
        self.gpu
            .synchronize()
            .unwrap_or_else(|e| panic!("device work failed: {e}"));
        self.retire(None);
    }

    fn work_done(&self, w: WorkId) -> bool {
        let mut work = self.work.lock();
        let Some((_, ev)) = work.get_mut(&w.0) else {
            return true;
        };
        let Some(e) = *ev else { return true };
        match self.gpu.query_event(e) {
            Ok(true) => {
                *ev = None;
                self.gpu
                    .destroy_event(e)
                    .expect("destroying a launch event failed");
                true
            }
            Ok(false) => false,
            Err(e) => panic!("launched work failed: {e}"),
        }
    }

    fn is_accessible(&self, addr: u64, len: u64) -> bool {
        self.gpu.is_accessible(addr, len)
    }

    fn leak_report(&self) -> LeakReport {
        self.gpu.leak_report()
    }
}

/// One step of a randomised test.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes on stream `stream % STREAMS`.
    Alloc {
        /// Bytes.
        size: u64,
        /// Stream number.
        stream: u8,
    },
    /// Free live allocation `pick % live` on the stream it was allocated on.
    Free {
        /// Which allocation.
        pick: u32,
    },
    /// Free live allocation `pick % live` on stream `stream % STREAMS` (maybe another one).
    FreeOn {
        /// Which allocation.
        pick: u32,
        /// Stream number.
        stream: u8,
    },
    /// Launch simulated work using allocation `pick % live` on its stream.
    Launch {
        /// Which allocation.
        pick: u32,
    },
    /// Mark allocation `pick % live` as used on stream `stream % STREAMS` too, and launch
    /// work there.
    UseOn {
        /// Which allocation.
        pick: u32,
        /// Stream number.
        stream: u8,
    },
    /// Complete the work on stream `stream % STREAMS`.
    Complete {
        /// Stream number.
        stream: u8,
    },
    /// Complete all work.
    CompleteAll,
    /// Release free handles.
    EmptyCache,
}

/// Number of distinct streams the operations use.
pub const STREAMS: u8 = 3;

impl Op {
    /// Decode arbitrary bytes into operations (for fuzzing): each op takes a tag byte and
    /// a few argument bytes; sizes are spread log-uniformly up to `max_size`.
    pub fn decode(mut bytes: &[u8], max_size: u64) -> Vec<Op> {
        let mut ops = Vec::new();
        let take = |n: usize, bytes: &mut &[u8]| -> Option<u64> {
            if bytes.len() < n {
                return None;
            }
            let mut v = 0u64;
            for &b in &bytes[..n] {
                v = v << 8 | b as u64;
            }
            *bytes = &bytes[n..];
            Some(v)
        };
        let max_bits = 64 - max_size.max(1).leading_zeros() as u64;
        while let Some(tag) = take(1, &mut bytes) {
            let tag = tag as u8;
            let op = match tag % 16 {
                0..=5 => {
                    let Some(v) = take(4, &mut bytes) else { break };
                    let bits = (v >> 24) % (max_bits + 1);
                    let size = if bits == 0 {
                        v & 1
                    } else {
                        (1 << (bits - 1)) + (v & ((1 << (bits - 1)) - 1))
                    };
                    Op::Alloc {
                        size: size.min(max_size.saturating_add(1)),
                        stream: (tag >> 4) % STREAMS,
                    }
                }
                6..=9 => Op::Free {
                    pick: take(1, &mut bytes).unwrap_or(0) as u32,
                },
                10 => Op::FreeOn {
                    pick: take(1, &mut bytes).unwrap_or(0) as u32,
                    stream: tag >> 4,
                },
                11 => Op::Launch {
                    pick: take(1, &mut bytes).unwrap_or(0) as u32,
                },
                12 => Op::UseOn {
                    pick: take(1, &mut bytes).unwrap_or(0) as u32,
                    stream: tag >> 4,
                },
                13 => Op::Complete { stream: tag >> 4 },
                14 => Op::CompleteAll,
                _ => Op::EmptyCache,
            };
            ops.push(op);
        }
        ops
    }
}

struct Live {
    ptr: u64,
    size: u64,
    stream: Stream,
    seed: u64,
    /// Simulated work that uses it: (stream, work).
    work: Vec<(Stream, WorkId)>,
}

/// Memory freed while in-flight work on `stream` still used it.
struct Hazard {
    addr: u64,
    len: u64,
    stream: Stream,
    work: WorkId,
}

/// Counts of what a run did, to check that tests exercise what they claim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunCounts {
    /// Successful allocations.
    pub allocs: u64,
    /// Successful frees.
    pub frees: u64,
    /// `OutOfMemory` results (each checked against the zero-fragmentation bound).
    pub ooms: u64,
    /// Of those, OOMs on a device without a ledger ([`TestDevice::device_handles`] is
    /// `None`): checked against the allocator's own count of live handle bytes only.
    pub ooms_unverified: u64,
    /// Other refused requests (zero size, too large).
    pub refused: u64,
    /// Operations that failed because of an injected driver fault.
    pub faulted: u64,
    /// Driver faults injected during the run (by the device's fault-injection wrapper; 0
    /// without one). Some are absorbed (retried, or the request served another way), so
    /// `faulted <= faults_fired`.
    pub faults_fired: u64,
    /// Frees of memory that launched work was still using (work not yet complete).
    pub in_flight_frees: u64,
    /// Successful allocations made while such freed-but-still-used memory existed (each
    /// checked against the stream rule).
    pub allocs_under_hazard: u64,
}

/// Drives an allocator with [`Op`]s and checks every invariant after each one.
pub struct Harness<T: TestDevice> {
    /// The allocator under test.
    pub alloc: Allocator<Arc<T>>,
    /// Its device.
    pub dev: Arc<T>,
    live: Vec<Live>,
    /// addr -> size of each live allocation.
    ranges: BTreeMap<u64, u64>,
    hazards: Vec<Hazard>,
    next_seed: u64,
    /// What the run did.
    pub counts: RunCounts,
    check_data: bool,
    faults_before: u64,
    /// The device's fault count when the harness was made.
    faults_at_start: u64,
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The bytes checked in an allocation: up to 64 at the start, middle and end.
fn probe_points(size: u64) -> [(u64, usize); 3] {
    let n = size.min(64);
    [
        (0, n as usize),
        (size / 2, (size - size / 2).min(64) as usize),
        (size - n, n as usize),
    ]
}

fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| mix(seed ^ (off + i)) as u8)
        .collect()
}

impl<T: TestDevice> Harness<T> {
    /// A harness over a new allocator on `dev` with `config` (paranoid checks are turned on).
    pub fn new(dev: T, config: Config) -> Result<Self, AllocError> {
        let dev = Arc::new(dev);
        let check_data = dev.has_data();
        let alloc = Allocator::new(dev.clone(), config.with_paranoid(true))?;
        Ok(Harness {
            alloc,
            dev: dev.clone(),
            live: Vec::new(),
            ranges: BTreeMap::new(),
            hazards: Vec::new(),
            next_seed: 1,
            counts: RunCounts::default(),
            check_data,
            faults_before: 0,
            faults_at_start: dev.injected_faults(),
        })
    }

    /// Whether a fault was injected during the current operation.
    fn faulted(&self) -> bool {
        self.dev.injected_faults() > self.faults_before
    }

    /// Live allocations now.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// The oracle's figure: total size of the device's handles that hold at least one live
    /// byte of the shadow model (a handle holds one iff one of its mappings overlaps a live
    /// range), from the device's ledger; `None` on a device without one.
    pub fn handles_holding_live_data(&self) -> Option<u64> {
        let handles = self.dev.device_handles()?;
        Some(self.bytes_of_handles_holding_live_data(&handles))
    }

    fn bytes_of_handles_holding_live_data(&self, handles: &[DeviceHandle]) -> u64 {
        let live = |addr: u64, len: u64| {
            // Live ranges never overlap, so only the last one starting before the end can
            // reach into the mapping.
            self.ranges
                .range(..addr + len)
                .next_back()
                .is_some_and(|(&a, &s)| a + s > addr)
        };
        handles
            .iter()
            .filter(|h| h.mapped_at.iter().any(|&at| live(at, h.size)))
            .map(|h| h.size)
            .sum()
    }

    fn stream(&self, n: u8) -> Stream {
        self.dev.test_stream(n % STREAMS)
    }

    fn write_pattern(&self, l: &Live) -> Result<(), String> {
        for (off, len) in probe_points(l.size) {
            self.dev
                .write(l.ptr + off, &pattern(l.seed, off, len))
                .map_err(|e| format!("write into live {:#x}: {e}", l.ptr))?;
        }
        Ok(())
    }

    fn check_pattern(&self, l: &Live) -> Result<(), String> {
        for (off, len) in probe_points(l.size) {
            let mut buf = vec![0; len];
            self.dev
                .read(l.ptr + off, &mut buf)
                .map_err(|e| format!("read of live {:#x}: {e}", l.ptr))?;
            if buf != pattern(l.seed, off, len) {
                return Err(format!(
                    "data of live allocation {:#x}+{} changed at offset {off}",
                    l.ptr, l.size
                ));
            }
        }
        Ok(())
    }

    /// Apply one operation and check every invariant. `Err` describes a violation.
    pub fn apply(&mut self, op: Op) -> Result<(), String> {
        self.faults_before = self.dev.injected_faults();
        match op {
            Op::Alloc { size, stream } => {
                let s = self.stream(stream);
                self.do_alloc(size, s)?
            }
            Op::Free { pick } => {
                if !self.live.is_empty() {
                    let i = pick as usize % self.live.len();
                    let s = self.live[i].stream;
                    self.do_free(i, s)?;
                }
            }
            Op::FreeOn { pick, stream } => {
                if !self.live.is_empty() {
                    let i = pick as usize % self.live.len();
                    let s = self.stream(stream);
                    self.do_free(i, s)?;
                }
            }
            Op::Launch { pick } => {
                if !self.live.is_empty() {
                    let i = pick as usize % self.live.len();
                    let l = &self.live[i];
                    let w = self.dev.launch(l.stream, l.ptr, l.size);
                    let s = l.stream;
                    self.live[i].work.push((s, w));
                }
            }
            Op::UseOn { pick, stream } => {
                if !self.live.is_empty() {
                    let i = pick as usize % self.live.len();
                    let s = self.stream(stream);
                    let (ptr, size) = (self.live[i].ptr, self.live[i].size);
                    self.alloc
                        .record_stream(DevicePtr(ptr), s)
                        .map_err(|e| format!("record_stream on a live allocation failed: {e}"))?;
                    let w = self.dev.launch(s, ptr, size);
                    self.live[i].work.push((s, w));
                }
            }
            Op::Complete { stream } => self.dev.complete(self.stream(stream)),
            Op::CompleteAll => self.dev.complete_all(),
            Op::EmptyCache => {
                if let Err(e) = self.alloc.empty_cache() {
                    if !self.faulted() {
                        return Err(format!("empty_cache failed: {e}"));
                    }
                    self.counts.faulted += 1;
                }
            }
        }
        self.hazards.retain(|h| !self.dev.work_done(h.work));
        self.check()
    }

    fn do_alloc(&mut self, size: u64, stream: Stream) -> Result<(), String> {
        let g = self.alloc.granularity();
        let cap = self.alloc.capacity();
        match self.alloc.alloc(size, stream) {
            Ok(p) => {
                let p = p.0;
                if size == 0 || size > cap {
                    return Err(format!("alloc of {size} bytes should have been refused"));
                }
                if let Some((&a, &s)) = self.ranges.range(..p + size).next_back() {
                    if a + s > p {
                        return Err(format!("{p:#x}+{size} overlaps live {a:#x}+{s}"));
                    }
                }
                if !self.dev.is_accessible(p, size) {
                    return Err(format!("new allocation {p:#x}+{size} is not accessible"));
                }
                if let Some(h) = self.hazards.iter().find(|h| {
                    h.stream != stream
                        && h.addr < p + size
                        && p < h.addr + h.len
                        && !self.dev.work_done(h.work)
                }) {
                    return Err(format!(
                        "stream rule: {p:#x}+{size} handed to stream {} while work on stream {} still uses {:#x}",
                        stream.raw(), h.stream.raw(), h.addr
                    ));
                }
                let l = Live {
                    ptr: p,
                    size,
                    stream,
                    seed: self.next_seed,
                    work: Vec::new(),
                };
                self.next_seed += 1;
                if self.check_data {
                    self.write_pattern(&l)?;
                }
                self.ranges.insert(p, size);
                self.live.push(l);
                self.counts.allocs += 1;
                if !self.hazards.is_empty() {
                    self.counts.allocs_under_hazard += 1;
                }
            }
            Err(AllocError::OutOfMemory(_)) | Err(AllocError::Driver { .. }) if self.faulted() => {
                self.counts.faulted += 1;
            }
            Err(AllocError::OutOfMemory(r)) => {
                let need = size.div_ceil(g) * g;
                let (held, whose) = match self.dev.device_handles() {
                    Some(handles) => {
                        let held = self.bytes_of_handles_holding_live_data(&handles);
                        if r.live_handle_bytes != held {
                            return Err(format!(
                                "OOM report says {} bytes of handles hold live data, the device's \
                                 ledger and the live ranges say {held} (report: {r})",
                                r.live_handle_bytes
                            ));
                        }
                        (held, "the device's handles holding live data")
                    }
                    None => {
                        self.counts.ooms_unverified += 1;
                        (
                            r.live_handle_bytes,
                            "live handles (the allocator's own count)",
                        )
                    }
                };
                if held > cap {
                    return Err(format!(
                        "{held} bytes of handles hold live data, over the capacity {cap}"
                    ));
                }
                if cap - held >= need {
                    return Err(format!(
                        "external fragmentation: {size} bytes refused although capacity {cap} \
                         minus {whose} {held} leaves {} (report: {r})",
                        cap - held
                    ));
                }
                if r.requested != size || r.capacity != cap {
                    return Err(format!("OOM report has wrong figures: {r:?}"));
                }
                self.counts.ooms += 1;
            }
            Err(AllocError::ZeroSize) if size == 0 => self.counts.refused += 1,
            Err(AllocError::TooLarge { .. }) if size > cap => self.counts.refused += 1,
            Err(e) => {
                return Err(format!(
                    "alloc({size}, stream {}) failed: {e}",
                    stream.raw()
                ))
            }
        }
        Ok(())
    }

    fn do_free(&mut self, i: usize, stream: Stream) -> Result<(), String> {
        if self.check_data {
            self.check_pattern(&self.live[i])?;
        }
        if let Err(e) = self.alloc.free(DevicePtr(self.live[i].ptr), stream) {
            if self.faulted() {
                // The free did not happen: the allocation must still be live and intact.
                self.counts.faulted += 1;
                return Ok(());
            }
            return Err(format!("free of live {:#x}: {e}", self.live[i].ptr));
        }
        let l = self.live.swap_remove(i);
        match self.alloc.free(DevicePtr(l.ptr), stream) {
            Err(AllocError::DoubleFree { ptr }) if ptr == l.ptr => {}
            other => {
                return Err(format!(
                    "second free of {:#x}: expected DoubleFree, got {other:?}",
                    l.ptr
                ))
            }
        }
        self.ranges.remove(&l.ptr);
        let before = self.hazards.len();
        for (s, w) in l.work {
            if !self.dev.work_done(w) {
                self.hazards.push(Hazard {
                    addr: l.ptr,
                    len: l.size,
                    stream: s,
                    work: w,
                });
            }
        }
        if self.hazards.len() > before {
            self.counts.in_flight_frees += 1;
        }
        self.counts.frees += 1;
        Ok(())
    }

    /// Check the invariants that hold between operations.
    pub fn check(&self) -> Result<(), String> {
        self.alloc.validate()?;
        let s = self.alloc.stats();
        let requested: u64 = self.live.iter().map(|l| l.size).sum();
        if s.requested.current != requested || s.live_allocations.current != self.live.len() as u64
        {
            return Err(format!(
                "stats say {} bytes in {} allocations, the model {} in {}",
                s.requested.current,
                s.live_allocations.current,
                requested,
                self.live.len()
            ));
        }
        if s.reserved.current > self.alloc.capacity() {
            return Err("reserved exceeds capacity".into());
        }
        for l in &self.live {
            if !self.dev.is_accessible(l.ptr, l.size) {
                return Err(format!("live {:#x}+{} is not accessible", l.ptr, l.size));
            }
            if self.check_data {
                self.check_pattern(l)?;
            }
        }
        Ok(())
    }

    /// Free everything, drop the allocator and check the device holds nothing.
    pub fn finish(mut self) -> Result<RunCounts, String> {
        self.counts.faults_fired = self.dev.injected_faults() - self.faults_at_start;
        self.dev.set_faults(false);
        self.faults_before = self.dev.injected_faults();
        while !self.live.is_empty() {
            let s = self.live[0].stream;
            self.do_free(0, s)?;
            self.check()?;
        }
        let s = self.alloc.stats();
        if s.requested.current != 0 || s.allocated.current != 0 {
            return Err(format!("stats not zero after freeing everything: {s:?}"));
        }
        self.dev.complete_all();
        self.alloc
            .empty_cache()
            .map_err(|e| format!("final empty_cache: {e}"))?;
        let s = self.alloc.stats();
        if s.reserved.current != 0 {
            return Err(format!(
                "empty_cache left {} bytes reserved with nothing live",
                s.reserved.current
            ));
        }
        if s.events_held != 0 {
            return Err(format!(
                "empty_cache on an idle device left {} events held",
                s.events_held
            ));
        }
        let report = self.alloc.shutdown();
        if report.leaked_allocations != 0 {
            return Err(format!("shutdown reports leaks: {report:?}"));
        }
        let leaks = self.dev.leak_report();
        if !leaks.is_clean() {
            return Err(format!("device still holds resources: {leaks:?}"));
        }
        Ok(std::mem::take(&mut self.counts))
    }

    /// Apply a whole sequence (without finishing).
    pub fn apply_all(&mut self, ops: &[Op]) -> Result<(), String> {
        for (n, &op) in ops.iter().enumerate() {
            self.apply(op)
                .map_err(|e| format!("after op {n} {op:?}: {e}"))?;
        }
        Ok(())
    }

    /// Run a whole sequence, then `finish`.
    pub fn run(mut self, ops: &[Op]) -> Result<RunCounts, String> {
        self.apply_all(ops)?;
        self.finish()
    }
}

impl<T: TestDevice> Drop for Harness<T> {
    fn drop(&mut self) {
        // Whatever happened, tear down with a working driver so the device can report leaks
        // truthfully (a failing run keeps its own error message).
        self.dev.set_faults(false);
    }
}

/// How many injected faults fired against how many should have: each call of a kind that
/// random injection covers is one draw that fails with probability `prob`, so the faults
/// fired in `draws` draws follow a binomial law. [`FaultTally::check`] fails when the count
/// lies outside eight standard deviations (plus one) of its mean: injection that stopped
/// firing, or fired at the wrong rate, is noticed; a correct run fails with negligible
/// probability. Tallies of several runs add up ([`FaultTally::merge`]), which is what makes
/// "no fault fired at all" detectable over a whole test.
///
/// ```
/// use stitch_alloc::testing::FaultTally;
/// let mut t = FaultTally::default();
/// t.add(10_000, 1_012, 0.1);
/// assert!(t.check().is_ok());
/// let mut silent = FaultTally::default();
/// silent.add(10_000, 0, 0.1);
/// assert!(silent.check().is_err(), "no fault fired in 10 000 draws at 10%");
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultTally {
    /// Calls that could have failed.
    pub draws: u64,
    /// Calls that did.
    pub fired: u64,
    /// Expected faults: the sum of `draws * prob` over the runs.
    pub expected: f64,
    /// Variance of the count: the sum of `draws * prob * (1 - prob)`.
    variance: f64,
}

impl FaultTally {
    /// Add one run of `draws` draws at probability `prob` in which `fired` faults fired.
    pub fn add(&mut self, draws: u64, fired: u64, prob: f64) {
        self.draws += draws;
        self.fired += fired;
        self.expected += draws as f64 * prob;
        self.variance += draws as f64 * prob * (1.0 - prob);
    }

    /// Add another tally.
    pub fn merge(&mut self, other: &FaultTally) {
        self.draws += other.draws;
        self.fired += other.fired;
        self.expected += other.expected;
        self.variance += other.variance;
    }

    /// Whether the faults fired agree with the rate (see the type's docs).
    pub fn check(&self) -> Result<(), String> {
        let slack = 8.0 * self.variance.sqrt() + if self.expected > 0.0 { 1.0 } else { 0.0 };
        if self.fired > self.draws || (self.fired as f64 - self.expected).abs() > slack {
            return Err(format!(
                "{} fault(s) fired in {} draws, {:.1} expected (at most {:.1} off)",
                self.fired, self.draws, self.expected, slack
            ));
        }
        Ok(())
    }
}

/// Calls of the given kinds between two snapshots of a device's call counts. Over a
/// [`crate::driver::FaultyDriver`], the wrapped device's count plus the faults fired is the
/// number of draws (a failed call never reaches the wrapped device).
pub fn calls_between(before: &CallCounts, after: &CallCounts, kinds: &[DriverOp]) -> u64 {
    kinds.iter().map(|&k| after.get(k) - before.get(k)).sum()
}

/// The body of the `ops_faults` fuzz target: bytes 0-7 seed the fault injection, byte 8
/// sets its rate (`/512`), the rest decode into [`Op`]s run on a tight 256 MiB simulated
/// device whose every injectable call fails at that rate. Checks every invariant of the
/// [`Harness`] and that the faults fired fit the rate ([`FaultTally`]). Returns what the run
/// did and its tally, or `Ok(None)` for inputs too short to use.
pub fn ops_with_faults(data: &[u8]) -> Result<Option<(RunCounts, FaultTally)>, String> {
    use crate::driver::faulty::INJECTABLE;
    use crate::driver::FaultyDriver;
    const MIB: u64 = 1 << 20;
    if data.len() < 9 {
        return Ok(None);
    }
    let seed = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
    let prob = data[8] as f64 / 512.0;
    let ops = Op::decode(&data[9..], 256 * MIB);
    let dev = FaultyDriver::new(SimDriver::with_capacity(256 * MIB));
    dev.fail_randomly(&INJECTABLE, prob, seed);
    dev.set_enabled(false);
    let cfg = Config::default()
        .with_reserve_slack(0.0, 0)
        .with_handle_sizes(0, 16 * MIB);
    let mut h = Harness::new(dev, cfg).map_err(|e| format!("allocator did not start: {e}"))?;
    h.dev.set_enabled(true);
    let before = FaultyDriver::inner(&h.dev).calls();
    h.apply_all(&ops)?;
    // A failed call never reaches the wrapped device: the draws are its calls of the
    // injectable kinds plus the faults.
    let fired = h.dev.injected();
    let draws = calls_between(&before, &FaultyDriver::inner(&h.dev).calls(), &INJECTABLE) + fired;
    let counts = h.finish()?;
    if counts.faults_fired != fired || counts.faulted > fired {
        return Err(format!(
            "{fired} fault(s) fired but the run counted {counts:?}"
        ));
    }
    let mut tally = FaultTally::default();
    tally.add(draws, fired, prob);
    tally.check().map_err(|e| format!("fault injection: {e}"))?;
    Ok(Some((counts, tally)))
}
