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
//!    granularity;
//! 7. the stream rule: memory still used by in-flight work on stream `S` is never handed to
//!    another stream (and the device refuses to unmap it: that would surface as an error);
//! 8. at the end, after freeing everything and dropping the allocator, the device holds
//!    nothing (no handle, mapping, reservation or event).
#![forbid(unsafe_code)]

use crate::driver::{Driver, HostDriver, LeakReport, SimDriver, WorkId};
use crate::{AllocError, Allocator, Config, DevicePtr, Stream};
use std::collections::BTreeMap;
use std::sync::Arc;

/// A device whose streams the test controls (the CPU backends).
pub trait TestDevice: Driver + 'static {
    /// Queue simulated work touching `[addr, addr+len)` on `stream`.
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
        }
    };
}
test_device!(SimDriver);
test_device!(HostDriver);

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
    /// Other refused requests (zero size, too large).
    pub refused: u64,
    /// Operations that failed because of an injected driver fault.
    pub faulted: u64,
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
            dev,
            live: Vec::new(),
            ranges: BTreeMap::new(),
            hazards: Vec::new(),
            next_seed: 1,
            counts: RunCounts::default(),
            check_data,
            faults_before: 0,
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

    fn stream(n: u8) -> Stream {
        Stream((n % STREAMS) as u64)
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
            Op::Alloc { size, stream } => self.do_alloc(size, Self::stream(stream))?,
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
                    self.do_free(i, Self::stream(stream))?;
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
                    let s = Self::stream(stream);
                    let (ptr, size) = (self.live[i].ptr, self.live[i].size);
                    self.alloc
                        .record_stream(DevicePtr(ptr), s)
                        .map_err(|e| format!("record_stream on a live allocation failed: {e}"))?;
                    let w = self.dev.launch(s, ptr, size);
                    self.live[i].work.push((s, w));
                }
            }
            Op::Complete { stream } => self.dev.complete(Self::stream(stream)),
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
                        stream.0, h.stream.0, h.addr
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
            }
            Err(AllocError::OutOfMemory(_)) | Err(AllocError::Driver { .. }) if self.faulted() => {
                self.counts.faulted += 1;
            }
            Err(AllocError::OutOfMemory(r)) => {
                let d = self.alloc.detailed_stats();
                let need = size.div_ceil(g) * g;
                if cap - d.live_handle_bytes >= need {
                    return Err(format!(
                        "external fragmentation: {size} bytes refused although capacity {cap} minus \
                         live handles {} leaves {} (report: {r})",
                        d.live_handle_bytes,
                        cap - d.live_handle_bytes
                    ));
                }
                if r.requested != size || r.capacity != cap {
                    return Err(format!("OOM report has wrong figures: {r:?}"));
                }
                self.counts.ooms += 1;
            }
            Err(AllocError::ZeroSize) if size == 0 => self.counts.refused += 1,
            Err(AllocError::TooLarge { .. }) if size > cap => self.counts.refused += 1,
            Err(e) => return Err(format!("alloc({size}, stream {}) failed: {e}", stream.0)),
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
        if self.alloc.free(DevicePtr(l.ptr), stream).is_ok() {
            return Err(format!("double free of {:#x} was accepted", l.ptr));
        }
        self.ranges.remove(&l.ptr);
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
        if self.alloc.stats().reserved.current != 0 {
            return Err(format!(
                "empty_cache left {} bytes reserved with nothing live",
                self.alloc.stats().reserved.current
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

    /// Run a whole sequence, then `finish`.
    pub fn run(mut self, ops: &[Op]) -> Result<RunCounts, String> {
        for (n, &op) in ops.iter().enumerate() {
            self.apply(op)
                .map_err(|e| format!("after op {n} {op:?}: {e}"))?;
        }
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
