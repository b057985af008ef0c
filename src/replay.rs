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
//! Modeled driver time comes from the crate's one cost model, [`crate::cost`] (the H200
//! table of `../shared/anchors.md` section 1; [`CostModel`] and [`SizedCost`] are re-exported
//! here). Two ways to apply it:
//!
//! * **Exact sizes** — wrap the driver in [`Metered`] (re-exported from
//!   [`crate::driver::meter`]): every call is priced with the size of the handle(s) it
//!   touches, SetAccess per mapping the range covers ([`CostModel::price_set_access`]).
//! * **Counts only** — [`CostModel::cost_of_counts`] prices the counts in [`CallCounts`] at
//!   the 2–64 MiB midpoints; SetAccess is charged per *map* call. Used when no [`Metered`]
//!   driver is given.
#![forbid(unsafe_code)]

use crate::allocator::{Allocator, DevicePtr};
use crate::driver::{CallCounts, Driver, Stream, WorkId};
use crate::trace::{Event, Trace};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

pub use crate::cost::{CostModel, SizedCost};
pub use crate::driver::{Meter, Metered};

pub mod models;

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
    /// Keep the allocator's whole layout when reserved last reached its peak
    /// ([`ReplayReport::peak_layout`], for diagnosis; slow on traces that grow often).
    pub peak_layout: bool,
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
    /// The allocator's detailed statistics when reserved last reached its peak (where the
    /// excess over live bytes sits: rounding, stranded, free handles, pending); left out
    /// with `skip_stranded`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_detail: Option<crate::stats::DetailedStats>,
    /// The whole layout at the same moment, with [`ReplayOptions::peak_layout`].
    #[serde(skip)]
    pub peak_layout: Option<crate::Layout>,
    /// Requested bytes still live at the end.
    pub final_live_bytes: u64,
    /// Driver calls by kind (totals since the allocator was created).
    pub driver_calls: CallCounts,
    /// Modeled driver time in microseconds.
    pub modeled_driver_us: f64,
    /// Modeled driver time of each allocation that called the driver (count, median, 99th
    /// percentile and the slowest, exact), as the C ABI reports the measured time of each
    /// (`driver_time_us_per_alloc`); `None` without a meter ([`ReplayOptions::meter`]).
    pub modeled_us_per_alloc: Option<crate::driver::RequestTiming>,
    /// The [`SLOWEST_KEPT`] allocations with the most modeled driver time, slowest first,
    /// each with the calls it made: which request sets the slowest figure, and whether its
    /// time went to new memory (`create`) or to free handles moved from elsewhere (`map`
    /// beyond `create`; a moved handle its old place may still be using is unmapped there
    /// later, by another request). Empty without a meter ([`ReplayOptions::meter`]).
    pub slowest_allocs: Vec<SlowAlloc>,
    /// Every allocation that called the driver, in trace order, with the mappings it made
    /// and removed: the trajectory to compare, allocation by allocation, with the
    /// `segment_map` / `segment_unmap` entries a history recorded under the C ABI holds
    /// (`stitch replay --calls-log`, `scripts/trajectory.py`). Empty without a meter
    /// ([`ReplayOptions::meter`]); not in the JSON report.
    #[serde(skip)]
    pub driver_allocs: Vec<DriverAlloc>,
    /// Modeled driver time spent in each tenth of the replayed events, in microseconds (ten
    /// entries, summing to the replay's share of `modeled_driver_us`): how much of it is
    /// warm-up, growing to the first peak, and how much recurs in the steady state. Empty
    /// without a meter ([`ReplayOptions::meter`]).
    pub modeled_driver_us_by_tenth: Vec<f64>,
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
    /// Stitches made in the same state as an earlier one at the same lifetime peak
    /// ([`crate::Stats::repeated_stitches`]).
    pub repeated_stitches: u64,
    /// Large allocations placed by next fit as a growing chain's next copy
    /// ([`crate::Stats::chain_fits`]).
    pub chain_fits: u64,
    /// Handles moved by stitching.
    pub stitched_handles: u64,
    /// Clean handles released by stitching to create the span's memory anew.
    pub recreated_handles: u64,
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
    /// PyTorch's own peak reserved bytes over the same recording, for a PyTorch snapshot
    /// that records its segments ([`crate::trace::pytorch::RecordedReserved`]; filled in by
    /// the caller). Left out of the JSON when unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pytorch_peak_reserved_bytes: Option<u64>,
    /// `pytorch_peak_reserved_bytes / peak_live_bytes` (PyTorch's ratio beside `ratio`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pytorch_ratio: Option<f64>,
    /// `pytorch_peak_reserved_bytes - peak_reserved_bytes`: the reserved memory stitch-alloc
    /// would save (negative: what it would cost).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saved_bytes: Option<i64>,
}

impl ReplayReport {
    /// Fill in PyTorch's own peak reserved bytes over the replayed recording (and the ratio
    /// and saving derived from it).
    ///
    /// ```
    /// let mut r = stitch_alloc::replay::ReplayReport {
    ///     peak_live_bytes: 100,
    ///     peak_reserved_bytes: 110,
    ///     ..Default::default()
    /// };
    /// r.set_pytorch_reserved(150);
    /// assert_eq!((r.pytorch_ratio, r.saved_bytes), (Some(1.5), Some(40)));
    /// ```
    pub fn set_pytorch_reserved(&mut self, peak_bytes: u64) {
        self.pytorch_peak_reserved_bytes = Some(peak_bytes);
        self.pytorch_ratio =
            (self.peak_live_bytes > 0).then(|| peak_bytes as f64 / self.peak_live_bytes as f64);
        let diff = i128::from(peak_bytes) - i128::from(self.peak_reserved_bytes);
        self.saved_bytes = Some(i64::try_from(diff).unwrap_or(i64::MAX));
    }
}

/// Count, median, 99th percentile and maximum of per-allocation driver times (exact: the
/// value at that rank of the sorted list).
fn request_timing(mut us: Vec<f64>) -> crate::driver::RequestTiming {
    us.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let rank = ((q * us.len() as f64).ceil() as usize).clamp(1, us.len().max(1));
        us.get(rank - 1).copied().unwrap_or(0.0)
    };
    crate::driver::RequestTiming {
        count: us.len() as u64,
        p50_us: at(0.5),
        p99_us: at(0.99),
        max_us: us.last().copied().unwrap_or(0.0),
    }
}

/// One allocation that called the driver ([`ReplayReport::driver_allocs`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DriverAlloc {
    /// Its index among the trace's allocations (0 for the first allocation event).
    pub alloc: usize,
    /// Requested bytes.
    pub bytes: u64,
    /// Mappings it made (`map` calls).
    pub maps: u64,
    /// Mappings it removed (`unmap` calls).
    pub unmaps: u64,
}

/// How many of the slowest allocations a replay keeps ([`ReplayReport::slowest_allocs`]).
pub const SLOWEST_KEPT: usize = 5;

/// One of a replay's slowest allocations ([`ReplayReport::slowest_allocs`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SlowAlloc {
    /// Its index among the trace's events.
    pub event: usize,
    /// Requested bytes.
    pub bytes: u64,
    /// Its modeled driver time, microseconds.
    pub modeled_us: f64,
    /// The driver calls it made, by kind (kinds it did not call left out).
    pub calls: BTreeMap<&'static str, u64>,
}

/// Keep `slow` at the [`SLOWEST_KEPT`] slowest, slowest first, with `cand` considered.
fn keep_slowest(slow: &mut Vec<SlowAlloc>, cand: SlowAlloc) {
    if slow.len() == SLOWEST_KEPT && slow.last().is_some_and(|l| l.modeled_us >= cand.modeled_us) {
        return;
    }
    let at = slow.partition_point(|x| x.modeled_us >= cand.modeled_us);
    slow.insert(at, cand);
    slow.truncate(SLOWEST_KEPT);
}

/// The calls made between two readings of a meter's counts, by kind.
fn calls_between(before: &CallCounts, after: &CallCounts) -> BTreeMap<&'static str, u64> {
    after
        .iter()
        .map(|(op, n)| (op.name(), n - before.get(op)))
        .filter(|&(_, n)| n > 0)
        .collect()
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
    // Modeled driver time of each allocation that called the driver (with a meter).
    let mut per_alloc_us: Vec<f64> = Vec::new();
    let mut driver_allocs: Vec<DriverAlloc> = Vec::new();
    let mut slowest: Vec<SlowAlloc> = Vec::new();
    ptrs.reserve(1024);
    let mut peak_live = 0u64;
    let mut peak_reserved = 0u64;
    let mut stranded = 0u64;
    let mut peak_detail = None;
    let mut last_stitches = alloc.stats().stitches;
    let mut probe_time = 0.0f64;
    let limit = opts.stop_after.unwrap_or(usize::MAX);
    // The meter's total at the start of each tenth of the events replayed.
    let replayed = trace.events.len().min(limit);
    let mut tenth_marks: Vec<f64> = Vec::new();
    let dev_stream = |s: u64| opts.streams.get(&s).copied().unwrap_or(Stream::sim(s));
    let t0 = Instant::now();
    for (i, ev) in trace.events.iter().enumerate() {
        if i >= limit {
            break;
        }
        if let Some(m) = &opts.meter {
            while tenth_marks.len() < 10 && i >= tenth_marks.len() * replayed / 10 {
                tenth_marks.push(m.total_us());
            }
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
                let before = opts.meter.as_ref().map(|m| (m, m.totals()));
                let got = alloc.alloc(bytes, dev_stream(stream));
                if let Some((m, (t0, c0))) = before {
                    let (t1, c1) = m.totals();
                    let dt = t1 - t0;
                    if dt > 0.0 {
                        per_alloc_us.push(dt);
                        let calls = calls_between(&c0, &c1);
                        driver_allocs.push(DriverAlloc {
                            alloc: r.allocs as usize - 1,
                            bytes,
                            maps: calls.get("map").copied().unwrap_or(0),
                            unmaps: calls.get("unmap").copied().unwrap_or(0),
                        });
                        let cand = SlowAlloc {
                            event: i,
                            bytes,
                            modeled_us: dt,
                            calls,
                        };
                        keep_slowest(&mut slowest, cand);
                    }
                }
                match got {
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
                    let d = alloc.detailed_stats();
                    stranded = d.stranded_bytes;
                    peak_detail = Some(d);
                }
                if opts.peak_layout {
                    r.peak_layout = Some(alloc.snapshot());
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
    r.peak_detail = peak_detail;
    r.final_live_bytes = s.requested.current;
    r.driver_calls = s.calls;
    r.modeled_us_per_alloc = opts.meter.as_ref().map(|_| request_timing(per_alloc_us));
    r.slowest_allocs = slowest;
    r.driver_allocs = driver_allocs;
    if let Some(m) = &opts.meter {
        // Ten starts (an empty trace has none: its tenths cost nothing), then the end.
        let end = m.total_us();
        tenth_marks.resize(10, end);
        tenth_marks.push(end);
        r.modeled_driver_us_by_tenth = tenth_marks.windows(2).map(|w| w[1] - w[0]).collect();
    }
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
    r.repeated_stitches = s.repeated_stitches;
    r.chain_fits = s.chain_fits;
    r.stitched_handles = s.stitched_handles;
    r.recreated_handles = s.recreated_handles;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn slow(event: usize, us: f64) -> SlowAlloc {
        SlowAlloc {
            event,
            bytes: 1,
            modeled_us: us,
            calls: BTreeMap::new(),
        }
    }

    /// Of more than [`SLOWEST_KEPT`] candidates in any order, the slowest are kept, slowest
    /// first; on a tie the earlier event stays ahead and a later equal one past the limit
    /// is not taken.
    #[test]
    fn keep_slowest_keeps_the_slowest_in_order() {
        let times = [3.0, 9.0, 1.0, 7.0, 7.0, 2.0, 8.0, 5.0, 7.0];
        let mut kept = Vec::new();
        for (i, &t) in times.iter().enumerate() {
            keep_slowest(&mut kept, slow(i, t));
        }
        let got: Vec<(usize, f64)> = kept.iter().map(|s| (s.event, s.modeled_us)).collect();
        assert_eq!(got, vec![(1, 9.0), (6, 8.0), (3, 7.0), (4, 7.0), (8, 7.0)]);
        keep_slowest(&mut kept, slow(9, 7.0));
        assert_eq!(
            kept.last().unwrap().event,
            8,
            "a tie past the limit is not taken"
        );
    }
}
