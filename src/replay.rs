//! Replaying a [`Trace`] through an [`Allocator`], and the driver cost model that turns the
//! calls it made into a predicted GPU time.
//!
//! ```
//! use stitch_alloc::{Allocator, Config};
//! use stitch_alloc::driver::SimDriver;
//! use stitch_alloc::replay::{replay, ReplayOptions};
//! use stitch_alloc::trace::Trace;
//!
//! let t = Trace::parse_str("a 1 104857600\na 2 104857600\nf 1\na 3 209715200\nf 2\nf 3\n").unwrap();
//! let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
//! let r = replay(&t, &a, &ReplayOptions::default());
//! assert_eq!((r.events, r.allocs, r.failed_allocs), (6, 3, 0));
//! assert_eq!(r.peak_live_bytes, 300 << 20);
//! assert!(r.ratio >= 1.0);
//! assert!(r.modeled_driver_us > 0.0);
//! ```
//!
//! # The cost model
//! [`CostModel`] holds per-call costs in microseconds, by handle size, taken from the H200
//! medians measured for this project (`shared/anchors.md` section 1: one H200, driver 580,
//! CUDA 13.0). Each size-dependent cost is given at 2 MiB, 64 MiB and 1 GiB (the middle of
//! each measured range) and interpolated linearly in log(size) between them (held flat
//! outside). Two ways to apply it:
//!
//! * **Exact sizes** — wrap the driver in [`Metered`]: every call is priced with the size of
//!   the handle(s) it touches. `cuMemSetAccess` over a range costs the per-handle price for
//!   each mapping the range covers (the anchors found one SetAccess spanning N mappings costs
//!   the same as N calls), plus a small quadratic term fitted to the anchors' measurement
//!   that N adjacent handles cost more per handle as N grows (48 µs at N = 1 to 65 µs at
//!   N = 512 for map + SetAccess + unmap).
//! * **Counts only** — [`CostModel::cost_of_counts`] prices the counts in [`CallCounts`] at
//!   the 2–64 MiB midpoints; SetAccess is charged per *map* call (one per handle mapped), since
//!   the engine grants access once per span of handles it has just mapped. Used when no
//!   [`Metered`] driver is given.
//!
//! Events and `cuMemGetInfo` were not measured in the anchors; their costs here (2 µs per
//! record, 1 µs per query or destroy, 5 µs per wait not counting the GPU work waited for)
//! are stated assumptions, as is `cuMemAddressFree` (priced like a reserve).
#![forbid(unsafe_code)]

use crate::allocator::{Allocator, DevicePtr};
use crate::driver::{
    CallCounts, DevAddr, Driver, DriverOp, DriverResult, EventId, MemInfo, PhysHandle, Stream,
    WorkId,
};
use crate::trace::{Event, Trace};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

const MIB: f64 = (1u64 << 20) as f64;

/// A cost that depends on the handle size: microseconds at 2 MiB, 64 MiB and 1 GiB.
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SizedCost {
    /// Cost for a 2 MiB handle (and anything smaller).
    pub at_2mib: f64,
    /// Cost for a 64 MiB handle.
    pub at_64mib: f64,
    /// Cost for a 1 GiB handle (and anything larger).
    pub at_1gib: f64,
}

impl SizedCost {
    /// The same cost at every size.
    pub const fn flat(us: f64) -> Self {
        SizedCost {
            at_2mib: us,
            at_64mib: us,
            at_1gib: us,
        }
    }

    /// The cost for a handle of `bytes`, interpolated linearly in log(size).
    ///
    /// ```
    /// use stitch_alloc::replay::SizedCost;
    /// let c = SizedCost { at_2mib: 10.0, at_64mib: 20.0, at_1gib: 60.0 };
    /// assert_eq!(c.at(1 << 20), 10.0);
    /// assert_eq!(c.at(64 << 20), 20.0);
    /// assert_eq!(c.at(4 << 30), 60.0);
    /// assert!((c.at(256 << 20) - 40.0).abs() < 1e-9);
    /// ```
    pub fn at(&self, bytes: u64) -> f64 {
        let mib = bytes as f64 / MIB;
        if mib <= 2.0 {
            self.at_2mib
        } else if mib <= 64.0 {
            let t = (mib / 2.0).log2() / 5.0;
            self.at_2mib + t * (self.at_64mib - self.at_2mib)
        } else if mib < 1024.0 {
            let t = (mib / 64.0).log2() / 4.0;
            self.at_64mib + t * (self.at_1gib - self.at_64mib)
        } else {
            self.at_1gib
        }
    }

    /// The cost used when only call counts are known: the mean of the 2 MiB and 64 MiB points.
    pub fn midpoint(&self) -> f64 {
        (self.at_2mib + self.at_64mib) / 2.0
    }
}

/// Per-call driver costs in microseconds (see the module docs for sources). Every field can
/// be overridden; [`CostModel::h200`] (the default) is the measured H200 table. It reads from
/// JSON with missing fields taken from the default (`stitch replay --cost-model FILE`):
///
/// ```
/// use stitch_alloc::replay::CostModel;
/// let c: CostModel = serde_json::from_str(r#"{"set_access_quadratic": 0.0, "map": {"at_2mib": 2, "at_64mib": 2, "at_1gib": 2}}"#).unwrap();
/// assert_eq!(c.set_access_quadratic, 0.0);
/// assert_eq!(c.map.at(1 << 30), 2.0);
/// assert_eq!(c.create, CostModel::h200().create);
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CostModel {
    /// `cuMemAddressReserve` (0.3–3 µs at any size).
    pub reserve: f64,
    /// `cuMemAddressFree` (not measured; assumed like reserve).
    pub free_reservation: f64,
    /// `cuMemCreate` per handle (7–15 / 10–17 / 52–70 µs).
    pub create: SizedCost,
    /// `cuMemRelease` per handle (9–15 / 26–54 / 320–640 µs).
    pub release: SizedCost,
    /// `cuMemMap` per handle (0.8–1.1 µs).
    pub map: SizedCost,
    /// `cuMemUnmap` per mapping (17–19 / 25–26 / 33–34 µs).
    pub unmap: SizedCost,
    /// `cuMemSetAccess`, per handle the range covers (25–28 / 42–45 / 70–78 µs).
    pub set_access: SizedCost,
    /// Extra SetAccess cost of `q * N^2` µs for a range covering N handles (fitted: 0.033).
    pub set_access_quadratic: f64,
    /// `cuEventCreate` + `cuEventRecord` (assumed).
    pub record_event: f64,
    /// `cuEventQuery` (assumed).
    pub query_event: f64,
    /// `cuEventSynchronize`, call overhead only (assumed).
    pub wait_event: f64,
    /// `cuEventDestroy` (assumed).
    pub destroy_event: f64,
    /// `cuMemGetInfo` (assumed).
    pub mem_info: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self::h200()
    }
}

impl CostModel {
    /// The H200 medians of `shared/anchors.md` section 1 (middle of each measured range).
    pub const fn h200() -> Self {
        CostModel {
            reserve: 1.65,
            free_reservation: 1.65,
            create: SizedCost {
                at_2mib: 11.0,
                at_64mib: 13.5,
                at_1gib: 61.0,
            },
            release: SizedCost {
                at_2mib: 12.0,
                at_64mib: 40.0,
                at_1gib: 480.0,
            },
            map: SizedCost::flat(1.0),
            unmap: SizedCost {
                at_2mib: 18.0,
                at_64mib: 25.5,
                at_1gib: 33.5,
            },
            set_access: SizedCost {
                at_2mib: 26.5,
                at_64mib: 43.5,
                at_1gib: 74.0,
            },
            set_access_quadratic: 0.033,
            record_event: 2.0,
            query_event: 1.0,
            wait_event: 5.0,
            destroy_event: 1.0,
            mem_info: 1.0,
        }
    }

    /// Price call counts alone (no sizes): size-dependent calls at the 2–64 MiB midpoint,
    /// SetAccess once per mapped handle (per map call). Returns (total, per kind).
    pub fn cost_of_counts(&self, c: &CallCounts) -> (f64, BTreeMap<&'static str, f64>) {
        let mut by = BTreeMap::new();
        let n = |op| c.get(op) as f64;
        let items = [
            (DriverOp::Reserve, n(DriverOp::Reserve) * self.reserve),
            (
                DriverOp::FreeReservation,
                n(DriverOp::FreeReservation) * self.free_reservation,
            ),
            (
                DriverOp::Create,
                n(DriverOp::Create) * self.create.midpoint(),
            ),
            (
                DriverOp::Release,
                n(DriverOp::Release) * self.release.midpoint(),
            ),
            (DriverOp::Map, n(DriverOp::Map) * self.map.midpoint()),
            (DriverOp::Unmap, n(DriverOp::Unmap) * self.unmap.midpoint()),
            (
                DriverOp::SetAccess,
                n(DriverOp::Map) * self.set_access.midpoint(),
            ),
            (
                DriverOp::RecordEvent,
                n(DriverOp::RecordEvent) * self.record_event,
            ),
            (
                DriverOp::QueryEvent,
                n(DriverOp::QueryEvent) * self.query_event,
            ),
            (
                DriverOp::WaitEvent,
                n(DriverOp::WaitEvent) * self.wait_event,
            ),
            (
                DriverOp::DestroyEvent,
                n(DriverOp::DestroyEvent) * self.destroy_event,
            ),
            (DriverOp::MemInfo, n(DriverOp::MemInfo) * self.mem_info),
        ];
        let mut total = 0.0;
        for (op, us) in items {
            total += us;
            by.insert(op.name(), us);
        }
        (total, by)
    }
}

#[derive(Debug, Default)]
struct MeterState {
    handles: FxHashMap<PhysHandle, u64>,
    /// addr -> size of every live mapping
    mappings: BTreeMap<DevAddr, u64>,
    by_op: [f64; DriverOp::ALL.len()],
    total: f64,
}

/// Modeled driver time accumulated by a [`Metered`] driver, priced with exact sizes.
#[derive(Debug)]
pub struct Meter {
    cost: CostModel,
    state: Mutex<MeterState>,
}

impl Meter {
    /// A meter pricing with `cost`.
    pub fn new(cost: CostModel) -> Arc<Self> {
        Arc::new(Meter {
            cost,
            state: Mutex::new(MeterState::default()),
        })
    }
    /// The cost model in use.
    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }
    /// Modeled microseconds so far.
    pub fn total_us(&self) -> f64 {
        self.state.lock().total
    }
    /// Modeled microseconds so far, by call kind (kinds never called are left out).
    pub fn by_call(&self) -> BTreeMap<&'static str, f64> {
        let s = self.state.lock();
        DriverOp::ALL
            .iter()
            .zip(s.by_op.iter())
            .filter(|(_, &us)| us > 0.0)
            .map(|(op, &us)| (op.name(), us))
            .collect()
    }
    fn charge(&self, op: DriverOp, f: impl FnOnce(&CostModel, &mut MeterState) -> f64) {
        let mut s = self.state.lock();
        let us = f(&self.cost, &mut s);
        s.by_op[op as usize] += us;
        s.total += us;
    }
}

/// A driver wrapper that prices every call with the handle sizes it touches (see the module
/// docs), recording into a shared [`Meter`]. Calls are passed through unchanged; failed calls
/// are priced too (the GPU would have spent the time).
#[derive(Debug)]
pub struct Metered<D> {
    inner: D,
    meter: Arc<Meter>,
}

impl<D: Driver> Metered<D> {
    /// Wrap `inner`, recording into `meter`.
    pub fn new(inner: D, meter: Arc<Meter>) -> Self {
        Metered { inner, meter }
    }
    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }
    /// The meter.
    pub fn meter(&self) -> &Arc<Meter> {
        &self.meter
    }
}

impl<D: Driver> Driver for Metered<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        self.meter.charge(DriverOp::MemInfo, |c, _| c.mem_info);
        self.inner.mem_info()
    }
    fn reserve(&self, size: u64) -> DriverResult<DevAddr> {
        self.meter.charge(DriverOp::Reserve, |c, _| c.reserve);
        self.inner.reserve(size)
    }
    fn free_reservation(&self, base: DevAddr, size: u64) -> DriverResult<()> {
        self.meter
            .charge(DriverOp::FreeReservation, |c, _| c.free_reservation);
        self.inner.free_reservation(base, size)
    }
    fn create(&self, size: u64) -> DriverResult<PhysHandle> {
        self.meter
            .charge(DriverOp::Create, |c, _| c.create.at(size));
        let h = self.inner.create(size)?;
        self.meter.state.lock().handles.insert(h, size);
        Ok(h)
    }
    fn release(&self, handle: PhysHandle) -> DriverResult<()> {
        let r = self.inner.release(handle);
        self.meter.charge(DriverOp::Release, |c, s| {
            let size = if r.is_ok() {
                s.handles.remove(&handle)
            } else {
                s.handles.get(&handle).copied()
            };
            c.release.at(size.unwrap_or(2 << 20))
        });
        r
    }
    fn map(&self, addr: DevAddr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        self.meter.charge(DriverOp::Map, |c, _| c.map.at(size));
        self.inner.map(addr, size, handle)?;
        self.meter.state.lock().mappings.insert(addr, size);
        Ok(())
    }
    fn unmap(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        self.meter.charge(DriverOp::Unmap, |c, _| c.unmap.at(size));
        self.inner.unmap(addr, size)?;
        self.meter.state.lock().mappings.remove(&addr);
        Ok(())
    }
    fn set_access(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        self.meter.charge(DriverOp::SetAccess, |c, s| {
            let mut n = 0u64;
            let mut us = 0.0;
            for (_, &len) in s.mappings.range(addr..addr.saturating_add(size)) {
                n += 1;
                us += c.set_access.at(len);
            }
            if n == 0 {
                // Not tracked (should not happen): price one handle of the range's size.
                return c.set_access.at(size);
            }
            us + c.set_access_quadratic * (n * n) as f64
        });
        self.inner.set_access(addr, size)
    }
    fn record_event(&self, stream: Stream) -> DriverResult<EventId> {
        self.meter
            .charge(DriverOp::RecordEvent, |c, _| c.record_event);
        self.inner.record_event(stream)
    }
    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        self.meter
            .charge(DriverOp::QueryEvent, |c, _| c.query_event);
        self.inner.query_event(event)
    }
    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        self.meter.charge(DriverOp::WaitEvent, |c, _| c.wait_event);
        self.inner.wait_event(event)
    }
    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        self.meter
            .charge(DriverOp::DestroyEvent, |c, _| c.destroy_event);
        self.inner.destroy_event(event)
    }
    fn write(&self, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        self.inner.write(addr, data)
    }
    fn read(&self, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        self.inner.read(addr, buf)
    }
    fn has_data(&self) -> bool {
        self.inner.has_data()
    }
    fn simulated_work(&self) -> Option<&dyn crate::driver::SimulatedWork> {
        self.inner.simulated_work()
    }
}

/// How to replay.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// The cost model for call counts (used when `meter` is `None`).
    pub cost: CostModel,
    /// The meter of a [`Metered`] driver under the allocator: modeled time then uses exact
    /// handle sizes.
    pub meter: Option<Arc<Meter>>,
    /// Record live and reserved bytes after every event (for plots).
    pub timeline: bool,
    /// Stop after this many events (probes count as events here).
    pub stop_after: Option<usize>,
    /// Do not measure `stranded_bytes_at_peak` (it walks the allocator's structures at each
    /// new peak of reserved bytes, which costs 30-50% of the replay time on traces that
    /// grow in many steps); the report then gives 0.
    pub skip_stranded: bool,
    /// Device streams for the trace's stream ids (ids not listed are used as they are, which
    /// suits the CPU backends; on CUDA every non-zero id must map to a real stream).
    pub streams: std::collections::HashMap<u64, Stream>,
    /// Model a GPU that runs this many events behind the CPU (0 = off; CPU backends only):
    /// each allocation and each free queues simulated work touching the block on its
    /// stream, and that work completes `gpu_lag` events later. Freed memory then stays in
    /// use by the device for a while, as under a real framework whose CPU thread runs ahead.
    pub gpu_lag: usize,
}

/// Live and reserved bytes over the event index, with stitches and failures marked.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timeline {
    /// Requested bytes live after each event.
    pub live: Vec<u64>,
    /// Physical bytes reserved after each event.
    pub reserved: Vec<u64>,
    /// Indices of events during which the allocator stitched.
    pub stitches: Vec<usize>,
    /// Indices of allocations that failed.
    pub ooms: Vec<usize>,
    /// Indices of probes.
    pub probes: Vec<usize>,
}

/// What a [`Event::ProbeLargest`] found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProbeReport {
    /// Index of the probe event.
    pub event: usize,
    /// The largest single allocation that succeeded (0 if none).
    pub largest_bytes: u64,
    /// Free physical memory at the probe: capacity minus live requested bytes.
    pub free_bytes: u64,
    /// `largest_bytes / free_bytes`.
    pub fraction_of_free: f64,
    /// Memory a request could use at all: capacity minus the handles holding live bytes
    /// (what remains once the unavoidable sub-granule tails of live tensors are excluded).
    pub reclaimable_bytes: u64,
    /// `largest_bytes / reclaimable_bytes`.
    pub fraction_of_reclaimable: f64,
    /// Modeled driver time of the first successful probe allocation (the stitch that builds
    /// the large span), in microseconds.
    pub first_success_us: f64,
    /// Modeled driver time of the whole probe (all attempts), in microseconds.
    pub probe_us: f64,
    /// Allocation attempts made.
    pub attempts: u32,
}

/// The result of a replay. Serialises to the JSON printed by `stitch replay --json`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReplayReport {
    /// The backend's name.
    pub backend: String,
    /// Whether stitching was on (filled in by the caller, who built the allocator).
    pub stitching: Option<bool>,
    /// The allocator's capacity.
    pub capacity: u64,
    /// Allocation and free events replayed (probes not counted).
    pub events: u64,
    /// Allocation events.
    pub allocs: u64,
    /// Free events.
    pub frees: u64,
    /// Allocations that failed (out of memory or any other error).
    pub failed_allocs: u64,
    /// Frees skipped because their allocation had failed.
    pub skipped_frees: u64,
    /// Frees the allocator refused (should be 0).
    pub failed_frees: u64,
    /// The first error seen, if any, in words.
    pub first_error: Option<String>,
    /// The most requested bytes live at once (probe allocations excluded).
    pub peak_live_bytes: u64,
    /// The most physical bytes reserved at once (probe allocations excluded).
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_live_bytes` (0 when nothing was live).
    pub ratio: f64,
    /// Free bytes stranded in handles holding live bytes, when reserved last reached its peak.
    pub stranded_bytes_at_peak: u64,
    /// Requested bytes still live at the end.
    pub final_live_bytes: u64,
    /// Driver calls by kind (totals since the allocator was created).
    pub driver_calls: CallCounts,
    /// Modeled driver time in microseconds.
    pub modeled_driver_us: f64,
    /// Modeled driver time by call kind.
    pub modeled_driver_by_call: BTreeMap<&'static str, f64>,
    /// `"exact-sizes"` (a [`Metered`] driver) or `"counts"` (call counts at 2–64 MiB prices).
    pub cost_basis: &'static str,
    /// Wall time of the replay loop, in milliseconds.
    pub wall_ms: f64,
    /// Events replayed per second of wall time.
    pub events_per_sec: f64,
    /// Stitches (slow paths that remapped free handles).
    pub stitches: u64,
    /// Handles moved by stitching.
    pub stitched_handles: u64,
    /// Slow paths that grew a free block in place instead of building a new span.
    pub extensions: u64,
    /// Handles created.
    pub handles_created: u64,
    /// Handles released.
    pub handles_released: u64,
    /// Allocations served with no driver call.
    pub fast_allocs: u64,
    /// Allocations that took the slow path.
    pub slow_allocs: u64,
    /// Simulated GPU lag in events ([`ReplayOptions::gpu_lag`]; 0 = none).
    pub gpu_lag: usize,
    /// Times the allocator blocked the CPU until the device caught up with a free.
    pub event_waits: u64,
    /// The largest allocation that succeeded at the last probe, if the trace has one.
    pub largest_alloc_after: Option<u64>,
    /// Every probe's findings.
    pub probes: Vec<ProbeReport>,
    /// Per-event series, when asked for.
    #[serde(skip)]
    pub timeline: Option<Timeline>,
}

fn modeled<D: Driver>(a: &Allocator<D>, opts: &ReplayOptions) -> f64 {
    match &opts.meter {
        Some(m) => m.total_us(),
        None => opts.cost.cost_of_counts(&a.stats().calls).0,
    }
}

/// Find the largest single allocation that succeeds now, leaving what is live unchanged.
///
/// First a request of capacity is made (it fails unless nothing is live, but makes the
/// allocator fence every outstanding free), then the candidate "every free handle plus the
/// headroom under the capacity" is tried, then a binary search in whole granules, then the
/// exact byte count above the best granule multiple. Every success is freed at once.
fn probe<D: Driver>(a: &Allocator<D>, opts: &ReplayOptions, event: usize) -> ProbeReport {
    let t0 = modeled(a, opts);
    let cap = a.capacity();
    let g = a.granularity();
    let mut attempts = 0u32;
    let mut first_success_us = None;
    let mut try_size = |size: u64, attempts: &mut u32| -> bool {
        if size == 0 {
            return true;
        }
        *attempts += 1;
        let before = modeled(a, opts);
        match a.alloc(size, Stream::DEFAULT) {
            Ok(p) => {
                if first_success_us.is_none() {
                    first_success_us = Some(modeled(a, opts) - before);
                }
                let _ = a.free(p, Stream::DEFAULT);
                true
            }
            Err(_) => false,
        }
    };
    // Fences every outstanding free (fails unless nothing is live).
    let mut best = if try_size(cap, &mut attempts) { cap } else { 0 };
    let d = a.detailed_stats();
    let live = d.stats.requested.current;
    let free_bytes = cap.saturating_sub(live);
    let reclaimable = cap.saturating_sub(d.live_handle_bytes);
    if best < cap {
        let guess = d.free_handle_bytes + cap.saturating_sub(d.stats.reserved.current);
        // Binary search over whole granules in [lo, hi): lo succeeds (or is 0), hi fails.
        let (mut lo, mut hi) = (0u64, cap / g);
        let gg = guess / g;
        if gg > 0 && gg < hi {
            if try_size(gg * g, &mut attempts) {
                lo = gg;
            } else {
                hi = gg;
            }
        }
        if lo + 1 < hi && try_size((lo + 1) * g, &mut attempts) {
            lo += 1;
            while lo + 1 < hi {
                let mid = lo + (hi - lo) / 2;
                if try_size(mid * g, &mut attempts) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
        }
        best = lo * g;
        // Bytes above the best granule multiple (a request can use a handle's tail), in 512 B.
        if best > 0 {
            let (mut blo, mut bhi) = (0u64, g / 512);
            while blo + 1 < bhi {
                let mid = blo + (bhi - blo) / 2;
                if try_size(best + mid * 512, &mut attempts) {
                    blo = mid;
                } else {
                    bhi = mid;
                }
            }
            best += blo * 512;
        } else if try_size(g, &mut attempts) {
            best = g;
        }
    }
    let probe_us = modeled(a, opts) - t0;
    let frac = |x: u64| if x == 0 { 0.0 } else { best as f64 / x as f64 };
    ProbeReport {
        event,
        largest_bytes: best,
        free_bytes,
        fraction_of_free: frac(free_bytes),
        reclaimable_bytes: reclaimable,
        fraction_of_reclaimable: frac(reclaimable),
        first_success_us: first_success_us.unwrap_or(0.0),
        probe_us,
        attempts,
    }
}

/// Replay `trace` through `alloc`.
///
/// Allocations that fail are counted (`failed_allocs`) and their frees skipped; replay
/// goes on. A free with no stream is made on the allocating stream. Peaks are sampled after
/// every allocation; the stranded bytes are measured (with the slower `detailed_stats`) only when
/// reserved bytes reach a new peak. Probe events ([`Event::ProbeLargest`]) run a search for
/// the largest allocation that succeeds, which is excluded from the peaks.
///
/// The allocator is left as the trace leaves it (allocations the trace never frees stay live).
pub fn replay<D: Driver>(
    trace: &Trace,
    alloc: &Allocator<D>,
    opts: &ReplayOptions,
) -> ReplayReport {
    let mut r = ReplayReport {
        backend: alloc.driver().name().to_string(),
        capacity: alloc.capacity(),
        ..Default::default()
    };
    let mut tl = opts.timeline.then(|| {
        let n = trace.events.len();
        Timeline {
            live: Vec::with_capacity(n),
            reserved: Vec::with_capacity(n),
            ..Default::default()
        }
    });
    // id -> (pointer, stream, bytes); None for a failed allocation.
    let mut ptrs: FxHashMap<u64, Option<(DevicePtr, u64, u64)>> = FxHashMap::default();
    // Simulated device work still in flight: (event index, stream, work), oldest first.
    let work = if opts.gpu_lag > 0 {
        alloc.driver().simulated_work()
    } else {
        None
    };
    let mut in_flight: std::collections::VecDeque<(usize, Stream, WorkId)> = Default::default();
    ptrs.reserve(1024);
    let mut peak_live = 0u64;
    let mut peak_reserved = 0u64;
    let mut stranded = 0u64;
    let mut last_stitches = alloc.stats().stitches;
    let mut probe_time = 0.0f64;
    let limit = opts.stop_after.unwrap_or(usize::MAX);
    let dev_stream = |s: u64| opts.streams.get(&s).copied().unwrap_or(Stream(s));
    let t0 = Instant::now();
    for (i, ev) in trace.events.iter().enumerate() {
        if i >= limit {
            break;
        }
        if let Some(q) = work {
            while let Some(&(j, s, w)) = in_flight.front() {
                if j + opts.gpu_lag > i {
                    break;
                }
                q.complete(s, Some(w));
                in_flight.pop_front();
            }
        }
        match *ev {
            Event::Alloc { id, bytes, stream } => {
                r.allocs += 1;
                match alloc.alloc(bytes, dev_stream(stream)) {
                    Ok(p) => {
                        if let Some(q) = work {
                            let s = dev_stream(stream);
                            in_flight.push_back((i, s, q.launch(s, p.addr(), bytes)));
                        }
                        ptrs.insert(id, Some((p, stream, bytes)));
                    }
                    Err(e) => {
                        r.failed_allocs += 1;
                        if r.first_error.is_none() {
                            r.first_error = Some(format!("event {i}: {e}"));
                        }
                        if let Some(t) = tl.as_mut() {
                            t.ooms.push(i);
                        }
                        ptrs.insert(id, None);
                    }
                }
            }
            Event::Free { id, stream } => {
                r.frees += 1;
                match ptrs.remove(&id) {
                    Some(Some((p, s0, bytes))) => {
                        let s = dev_stream(stream.unwrap_or(s0));
                        if let Some(q) = work {
                            // The tensor's last kernel, queued just before the free.
                            in_flight.push_back((i, s, q.launch(s, p.addr(), bytes)));
                        }
                        if let Err(e) = alloc.free(p, s) {
                            r.failed_frees += 1;
                            if r.first_error.is_none() {
                                r.first_error = Some(format!("event {i}: {e}"));
                            }
                        }
                    }
                    Some(None) => r.skipped_frees += 1,
                    None => {
                        r.failed_frees += 1;
                        if r.first_error.is_none() {
                            r.first_error = Some(format!("event {i}: free of unknown id {id}"));
                        }
                    }
                }
            }
            Event::ProbeLargest => {
                let p0 = Instant::now();
                let p = probe(alloc, opts, i);
                probe_time += p0.elapsed().as_secs_f64();
                r.largest_alloc_after = Some(p.largest_bytes);
                r.probes.push(p);
                if let Some(t) = tl.as_mut() {
                    t.probes.push(i);
                    let s = alloc.stats();
                    t.live.push(s.requested.current);
                    t.reserved.push(s.reserved.current);
                }
                last_stitches = alloc.stats().stitches;
                continue;
            }
        }
        let is_alloc = matches!(ev, Event::Alloc { .. });
        if !is_alloc && tl.is_none() {
            // A free raises no peak and never stitches: nothing to sample.
            continue;
        }
        let s = alloc.stats();
        let live = s.requested.current;
        let reserved = s.reserved.current;
        // Only allocations raise live or reserved bytes: sampling after them alone keeps
        // memory a probe left reserved out of the peak until an allocation needs it.
        if is_alloc {
            if live > peak_live {
                peak_live = live;
            }
            if reserved > peak_reserved {
                peak_reserved = reserved;
                if !opts.skip_stranded {
                    stranded = alloc.detailed_stats().stranded_bytes;
                }
            }
        }
        if let Some(t) = tl.as_mut() {
            t.live.push(live);
            t.reserved.push(reserved);
            if s.stitches > last_stitches {
                t.stitches.push(i);
            }
        }
        last_stitches = s.stitches;
    }
    let wall = t0.elapsed().as_secs_f64();
    if let Some(q) = work {
        for (_, s, w) in in_flight {
            q.complete(s, Some(w));
        }
    }
    let s = alloc.stats();
    r.events = r.allocs + r.frees;
    r.peak_live_bytes = peak_live;
    r.peak_reserved_bytes = peak_reserved;
    r.ratio = if peak_live > 0 {
        peak_reserved as f64 / peak_live as f64
    } else {
        0.0
    };
    r.stranded_bytes_at_peak = stranded;
    r.final_live_bytes = s.requested.current;
    r.driver_calls = s.calls;
    match &opts.meter {
        Some(m) => {
            r.modeled_driver_us = m.total_us();
            r.modeled_driver_by_call = m.by_call();
            r.cost_basis = "exact-sizes";
        }
        None => {
            let (t, by) = opts.cost.cost_of_counts(&s.calls);
            r.modeled_driver_us = t;
            r.modeled_driver_by_call = by;
            r.cost_basis = "counts";
        }
    }
    r.wall_ms = wall * 1e3;
    let replay_secs = (wall - probe_time).max(1e-9);
    r.events_per_sec = r.events as f64 / replay_secs;
    r.stitches = s.stitches;
    r.stitched_handles = s.stitched_handles;
    r.extensions = s.extensions;
    r.handles_created = s.handles_created;
    r.handles_released = s.handles_released;
    r.fast_allocs = s.fast_allocs;
    r.slow_allocs = s.slow_allocs;
    r.gpu_lag = if work.is_some() { opts.gpu_lag } else { 0 };
    r.event_waits = s.event_waits;
    r.timeline = tl;
    r
}
