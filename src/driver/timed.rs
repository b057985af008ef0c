//! [`Timed`]: a wrapper around any [`Driver`] that measures the wall time of every call, by
//! kind, beside the time the H200 cost model predicts for the same calls.
//!
//! The model is the table of medians in `shared/anchors.md` (section 1, measured on an H200
//! with driver 580 / CUDA 13.0), interpolated over handle size. It prices what the allocator
//! decides (how many handles of which sizes it creates, maps, grants access to, unmaps and
//! releases); comparing it with the measured time of a real run says whether that table
//! still describes the machine.
#![forbid(unsafe_code)]

use super::{DevAddr, Driver, DriverOp, DriverResult, EventId, MemInfo, PhysHandle, Stream};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const KINDS: usize = DriverOp::ALL.len();

/// Modeled H200 cost of one call, in microseconds, for a handle (or mapping) of `size` bytes;
/// `None` for calls the anchors table does not price (events, `cuMemAddressFree`,
/// `cuMemGetInfo`, copies).
///
/// Medians from anchors.md section 1 (the middle of each measured range), interpolated
/// linearly in log2(size) between the 2 MiB, 64 MiB and 1 GiB columns and clamped outside
/// them. A `set_access` spanning several mappings costs one call per mapping; [`Timed`]
/// prices it that way.
///
/// ```
/// use stitch_alloc::driver::{timed::h200_model_us, DriverOp};
/// assert_eq!(h200_model_us(DriverOp::Map, 2 << 20), Some(1.0));
/// let c2 = h200_model_us(DriverOp::Create, 2 << 20).unwrap();
/// let c64 = h200_model_us(DriverOp::Create, 64 << 20).unwrap();
/// assert!(c2 < c64);
/// assert_eq!(h200_model_us(DriverOp::QueryEvent, 0), None);
/// ```
pub fn h200_model_us(op: DriverOp, size: u64) -> Option<f64> {
    // (2 MiB, 64 MiB, 1 GiB) medians in microseconds.
    let cols: [f64; 3] = match op {
        DriverOp::Create => [11.0, 13.5, 61.0],
        DriverOp::Release => [12.0, 40.0, 480.0],
        DriverOp::Map => [1.0, 1.0, 1.0],
        DriverOp::SetAccess => [26.5, 43.5, 74.0],
        DriverOp::Unmap => [18.0, 25.5, 33.5],
        DriverOp::Reserve => [1.5, 1.5, 1.5],
        _ => return None,
    };
    let x = (size.max(1) as f64).log2();
    let (x0, x1, x2) = (21.0, 26.0, 30.0);
    Some(if x <= x0 {
        cols[0]
    } else if x <= x1 {
        cols[0] + (cols[1] - cols[0]) * (x - x0) / (x1 - x0)
    } else if x <= x2 {
        cols[1] + (cols[2] - cols[1]) * (x - x1) / (x2 - x1)
    } else {
        cols[2]
    })
}

/// Measured and modeled time of one kind of call.
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize)]
pub struct OpTiming {
    /// The kind of call.
    pub op: DriverOp,
    /// Calls made (failed ones included).
    pub calls: u64,
    /// Wall time spent inside them, in nanoseconds.
    pub measured_ns: u64,
    /// What the H200 model predicts for them, in nanoseconds (0 when it prices none).
    pub modeled_ns: u64,
    /// Whether the model prices this kind at all.
    pub modeled: bool,
}

/// Timings of every kind of call, from [`Timed::timings`].
#[derive(Clone, Debug, PartialEq)]
pub struct Timings(pub [OpTiming; KINDS]);

impl Timings {
    /// The timing of `op`.
    pub fn get(&self, op: DriverOp) -> OpTiming {
        self.0[op as usize]
    }
    /// Every kind, in [`DriverOp::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = OpTiming> + '_ {
        self.0.iter().copied()
    }
    /// Measured nanoseconds over all calls.
    pub fn measured_ns(&self) -> u64 {
        self.0.iter().map(|t| t.measured_ns).sum()
    }
    /// Measured nanoseconds over the kinds the model prices (to compare with
    /// [`Timings::modeled_ns`]).
    pub fn measured_modeled_kinds_ns(&self) -> u64 {
        self.0
            .iter()
            .filter(|t| t.modeled)
            .map(|t| t.measured_ns)
            .sum()
    }
    /// Modeled nanoseconds over all priced calls.
    pub fn modeled_ns(&self) -> u64 {
        self.0.iter().map(|t| t.modeled_ns).sum()
    }
}

impl fmt::Display for Timings {
    /// A table: one row per kind with calls, measured and modeled milliseconds, their ratio
    /// and the measured mean per call; then the totals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<17} {:>8} {:>12} {:>12} {:>9} {:>12}",
            "call", "count", "measured_ms", "modeled_ms", "meas/mod", "us_per_call"
        )?;
        let ms = |ns: u64| ns as f64 / 1e6;
        for t in self.iter().filter(|t| t.calls > 0) {
            let name = t.op.name();
            let modeled = if t.modeled {
                format!("{:.3}", ms(t.modeled_ns))
            } else {
                "-".into()
            };
            let ratio = if t.modeled && t.modeled_ns > 0 {
                format!("{:.2}", t.measured_ns as f64 / t.modeled_ns as f64)
            } else {
                "-".into()
            };
            writeln!(
                f,
                "{:<17} {:>8} {:>12.3} {:>12} {:>9} {:>12.2}",
                name,
                t.calls,
                ms(t.measured_ns),
                modeled,
                ratio,
                t.measured_ns as f64 / 1e3 / t.calls as f64
            )?;
        }
        let (m, p) = (self.measured_modeled_kinds_ns(), self.modeled_ns());
        writeln!(
            f,
            "priced calls: measured {:.3} ms, modeled {:.3} ms, measured/modeled {:.2}; all calls measured {:.3} ms",
            ms(m),
            ms(p),
            if p > 0 { m as f64 / p as f64 } else { 0.0 },
            ms(self.measured_ns())
        )
    }
}

/// A [`Driver`] that forwards every call to `D` and accumulates, per [`DriverOp`], the call
/// count, the wall time inside the call, and the H200 model's price for it
/// ([`h200_model_us`]).
///
/// Works over any backend: on `CudaDriver` it measures the real driver; on the CPU backends
/// it measures their bookkeeping and still prices the calls as an H200 would.
///
/// ```
/// use stitch_alloc::driver::{DriverOp, SimDriver, Timed};
/// use stitch_alloc::{Allocator, Config, Stream};
/// let a = Allocator::new(Timed::new(SimDriver::with_capacity(1 << 30)), Config::default())
///     .unwrap();
/// let p = a.alloc(64 << 20, Stream::DEFAULT).unwrap();
/// a.free(p, Stream::DEFAULT).unwrap();
/// let t = a.driver().timings();
/// assert_eq!(t.get(DriverOp::Create).calls, a.stats().calls.get(DriverOp::Create));
/// assert!(t.modeled_ns() > 0);
/// println!("{t}");
/// ```
pub struct Timed<D> {
    inner: D,
    calls: [AtomicU64; KINDS],
    ns: [AtomicU64; KINDS],
    modeled_ns: [AtomicU64; KINDS],
    /// Live handles and their sizes (to price `release`).
    handles: Mutex<FxHashMap<u64, u64>>,
    /// Live mappings: address -> size (to price `unmap` and `set_access`).
    mappings: Mutex<BTreeMap<u64, u64>>,
}

impl<D: fmt::Debug> fmt::Debug for Timed<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Timed").field("inner", &self.inner).finish()
    }
}

impl<D: Driver> Timed<D> {
    /// Wrap `inner`; all counters start at zero.
    pub fn new(inner: D) -> Self {
        Timed {
            inner,
            calls: std::array::from_fn(|_| AtomicU64::new(0)),
            ns: std::array::from_fn(|_| AtomicU64::new(0)),
            modeled_ns: std::array::from_fn(|_| AtomicU64::new(0)),
            handles: Mutex::new(FxHashMap::default()),
            mappings: Mutex::new(BTreeMap::new()),
        }
    }

    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The counts and times so far.
    pub fn timings(&self) -> Timings {
        Timings(std::array::from_fn(|i| OpTiming {
            op: DriverOp::ALL[i],
            calls: self.calls[i].load(Ordering::Relaxed),
            measured_ns: self.ns[i].load(Ordering::Relaxed),
            modeled_ns: self.modeled_ns[i].load(Ordering::Relaxed),
            modeled: h200_model_us(DriverOp::ALL[i], 1 << 21).is_some(),
        }))
    }

    /// Zero the counts and times (the handle and mapping tables are kept).
    pub fn reset(&self) {
        for a in self.calls.iter().chain(&self.ns).chain(&self.modeled_ns) {
            a.store(0, Ordering::Relaxed);
        }
    }

    fn timed<T>(&self, op: DriverOp, f: impl FnOnce(&D) -> T) -> T {
        let t = Instant::now();
        let r = f(&self.inner);
        let ns = t.elapsed().as_nanos() as u64;
        self.calls[op as usize].fetch_add(1, Ordering::Relaxed);
        self.ns[op as usize].fetch_add(ns, Ordering::Relaxed);
        r
    }

    fn price(&self, op: DriverOp, size: u64) {
        if let Some(us) = h200_model_us(op, size) {
            self.modeled_ns[op as usize].fetch_add((us * 1e3) as u64, Ordering::Relaxed);
        }
    }
}

impl<D: Driver> Driver for Timed<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        self.timed(DriverOp::MemInfo, |d| d.mem_info())
    }
    fn reserve(&self, size: u64) -> DriverResult<DevAddr> {
        let r = self.timed(DriverOp::Reserve, |d| d.reserve(size));
        self.price(DriverOp::Reserve, size);
        r
    }
    fn free_reservation(&self, base: DevAddr, size: u64) -> DriverResult<()> {
        self.timed(DriverOp::FreeReservation, |d| {
            d.free_reservation(base, size)
        })
    }
    fn create(&self, size: u64) -> DriverResult<PhysHandle> {
        let r = self.timed(DriverOp::Create, |d| d.create(size));
        self.price(DriverOp::Create, size);
        if let Ok(h) = r {
            self.handles.lock().insert(h.0, size);
        }
        r
    }
    fn release(&self, handle: PhysHandle) -> DriverResult<()> {
        let r = self.timed(DriverOp::Release, |d| d.release(handle));
        let size = if r.is_ok() {
            self.handles.lock().remove(&handle.0)
        } else {
            self.handles.lock().get(&handle.0).copied()
        };
        self.price(DriverOp::Release, size.unwrap_or(0));
        r
    }
    fn map(&self, addr: DevAddr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let r = self.timed(DriverOp::Map, |d| d.map(addr, size, handle));
        self.price(DriverOp::Map, size);
        if r.is_ok() {
            self.mappings.lock().insert(addr, size);
        }
        r
    }
    fn unmap(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let r = self.timed(DriverOp::Unmap, |d| d.unmap(addr, size));
        self.price(DriverOp::Unmap, size);
        if r.is_ok() {
            self.mappings.lock().remove(&addr);
        }
        r
    }
    fn set_access(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let r = self.timed(DriverOp::SetAccess, |d| d.set_access(addr, size));
        // One call per mapping the range covers (anchors: cost follows handles, not calls).
        let sizes: Vec<u64> = {
            let m = self.mappings.lock();
            let start = m
                .range(..=addr)
                .next_back()
                .filter(|(&a, &s)| a + s > addr)
                .map_or(addr, |(&a, _)| a);
            m.range(start..addr + size).map(|(_, &s)| s).collect()
        };
        if sizes.is_empty() {
            self.price(DriverOp::SetAccess, size);
        }
        for s in sizes {
            self.price(DriverOp::SetAccess, s);
        }
        r
    }
    fn record_event(&self, stream: Stream) -> DriverResult<EventId> {
        self.timed(DriverOp::RecordEvent, |d| d.record_event(stream))
    }
    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        self.timed(DriverOp::QueryEvent, |d| d.query_event(event))
    }
    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        self.timed(DriverOp::WaitEvent, |d| d.wait_event(event))
    }
    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        self.timed(DriverOp::DestroyEvent, |d| d.destroy_event(event))
    }
    fn write(&self, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        self.timed(DriverOp::Copy, |d| d.write(addr, data))
    }
    fn read(&self, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        self.timed(DriverOp::Copy, |d| d.read(addr, buf))
    }
    fn has_data(&self) -> bool {
        self.inner.has_data()
    }
    fn simulated_work(&self) -> Option<&dyn crate::driver::SimulatedWork> {
        self.inner.simulated_work()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::SimDriver;
    use crate::{Allocator, Config};

    const MIB: u64 = 1 << 20;

    #[test]
    fn model_interpolates_and_clamps() {
        let m = |op, s| h200_model_us(op, s).unwrap();
        assert_eq!(m(DriverOp::Create, 4096), 11.0);
        assert_eq!(m(DriverOp::Create, 2 * MIB), 11.0);
        assert_eq!(m(DriverOp::Create, 64 * MIB), 13.5);
        assert_eq!(m(DriverOp::Create, 1 << 30), 61.0);
        assert_eq!(m(DriverOp::Create, 8 << 30), 61.0);
        let mid = m(DriverOp::Release, 256 * MIB);
        assert!(mid > 40.0 && mid < 480.0, "{mid}");
        for op in [
            DriverOp::FreeReservation,
            DriverOp::RecordEvent,
            DriverOp::QueryEvent,
            DriverOp::WaitEvent,
            DriverOp::DestroyEvent,
            DriverOp::MemInfo,
            DriverOp::Copy,
        ] {
            assert_eq!(h200_model_us(op, MIB), None);
        }
    }

    #[test]
    fn counts_match_the_allocator_and_set_access_is_priced_per_mapping() {
        let a = Allocator::new(
            Timed::new(SimDriver::with_capacity(1 << 30)),
            Config::default().with_handle_sizes(0, 2 * MIB),
        )
        .unwrap();
        let p = a.alloc(16 * MIB, Stream::DEFAULT).unwrap();
        a.free(p, Stream::DEFAULT).unwrap();
        a.empty_cache().unwrap();
        let t = a.driver().timings();
        let calls = a.stats().calls;
        for op in DriverOp::ALL {
            if op != DriverOp::MemInfo {
                assert_eq!(t.get(op).calls, calls.get(op), "{op}");
            }
        }
        // 8 handles of 2 MiB: 8 creates, maps, unmaps and releases, and access for 8
        // mappings however many set_access calls covered them.
        assert_eq!(t.get(DriverOp::Create).calls, 8);
        assert_eq!(t.get(DriverOp::Create).modeled_ns, 8 * 11_000);
        assert_eq!(t.get(DriverOp::Release).modeled_ns, 8 * 12_000);
        assert_eq!(t.get(DriverOp::Unmap).modeled_ns, 8 * 18_000);
        assert_eq!(t.get(DriverOp::SetAccess).modeled_ns, 8 * 26_500);
        assert!(t.measured_ns() > 0);
        let table = t.to_string();
        assert!(table.contains("set_access") && table.contains("measured/modeled"));
        a.driver().reset();
        assert_eq!(a.driver().timings().measured_ns(), 0);
        assert!(a.driver().inner().leak_report().reservations > 0);
    }
}
