//! The statistics document of `stitch_stats_json`: one typed struct per object. Its key
//! names are read by `python/stitch_alloc` (`stats`, `memory_stats`, `memory_summary`) and
//! described in `include/stitch_alloc.h`: change them together.
#![forbid(unsafe_code)]

use super::runtime::Alloc;
use crate::driver::{DriverOp, RequestTiming};
use crate::{Backend, DetailedStats, Stats};
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The whole document of one device.
#[derive(Serialize)]
pub(super) struct StatsDoc<'a> {
    /// The library's version.
    pub version: &'static str,
    /// The device asked about.
    pub device: i32,
    /// The backend serving it; before the first allocation resolves it, the configured one
    /// (`auto` or `cuda`: resolving it would initialise the CUDA driver).
    pub backend: Backend,
    /// Whether the device's allocator exists (its first allocation happened).
    pub initialized: bool,
    /// The device count torch passed to `stitch_init` (-1 before).
    pub init_device_count: i32,
    /// `STITCH_ALLOC_CONF` as read.
    pub conf: &'a str,
    /// The allocator's capacity (0 before it exists).
    pub capacity: u64,
    /// The device's granularity (0 before the allocator exists).
    pub granularity: u64,
    /// Driver calls made by the allocator.
    pub driver_calls: u64,
    /// Of those, virtual memory management calls.
    pub vmm_calls: u64,
    /// Measured wall time inside the driver, microseconds: the sum of the next field.
    pub driver_time_us: f64,
    /// The same by call kind, for the kinds called at least once.
    pub driver_time_us_by_call: BTreeMap<&'static str, f64>,
    /// Driver time of each `stitch_malloc` that called the driver: how many, p50, p99 and
    /// max, microseconds (percentiles within 19%, the maximum exact).
    pub driver_time_us_per_alloc: RequestTiming,
    /// PyTorch's names for what this allocator counts.
    pub torch: TorchStats,
    /// The allocator's counters.
    pub stats: Stats,
    /// [`DetailedStats`] without its `stats` (given above).
    pub fragmentation: Map<String, Value>,
    /// Bytes of blocks freed on a stream while it was capturing a CUDA graph, kept
    /// allocated (out of the pool) until that capture has ended (counted in
    /// `torch.allocated_bytes.all.current` too).
    pub graph_held_bytes: u64,
    /// Segment events (`stitch_segment_events`) dropped because too many were unread.
    pub segment_events_dropped: u64,
    /// `stitch_malloc` and `stitch_free` calls of the process (every device).
    pub malloc_free_calls: u64,
    /// Their time from entry to return, microseconds (lock, engine and driver calls
    /// included; the driver part measured in every call, the rest from one call in 64):
    /// what the allocator's own calls cost.
    pub malloc_free_time_us: f64,
}

impl<'a> StatsDoc<'a> {
    /// The document of `device`, whose allocator is `a` if it exists yet.
    pub fn new(
        device: i32,
        backend: Backend,
        init_device_count: i32,
        conf: &'a str,
        a: Option<&Alloc>,
        graph_held_bytes: u64,
    ) -> Result<Self, String> {
        let detailed = a.map(|a| a.detailed_stats()).unwrap_or_default();
        let stats = detailed.stats;
        let mut by_call = BTreeMap::new();
        let mut driver_time_us = 0.0;
        if let Some(a) = a {
            for t in a.driver().timings().0 {
                if t.calls > 0 {
                    let us = t.measured_ns as f64 / 1e3;
                    driver_time_us += us;
                    by_call.insert(t.op.name(), us);
                }
            }
        }
        let Value::Object(mut fragmentation) =
            serde_json::to_value(&detailed).map_err(|e| e.to_string())?
        else {
            return Err("the detailed statistics are not an object".into());
        };
        fragmentation.remove("stats");
        Ok(StatsDoc {
            version: env!("CARGO_PKG_VERSION"),
            device,
            backend,
            initialized: a.is_some(),
            init_device_count,
            conf,
            capacity: detailed.capacity,
            granularity: detailed.granularity,
            driver_calls: stats.calls.total(),
            vmm_calls: stats.calls.vmm_total(),
            driver_time_us,
            driver_time_us_by_call: by_call,
            driver_time_us_per_alloc: a
                .map(|a| a.driver().meter().request_times())
                .unwrap_or_default(),
            torch: TorchStats::new(&stats, &detailed),
            stats,
            fragmentation,
            graph_held_bytes,
            segment_events_dropped: 0,
            malloc_free_calls: 0,
            malloc_free_time_us: 0.0,
        })
    }

    /// The document as JSON text, every object's keys in sorted order (as serde_json's map
    /// writes them).
    pub fn to_json(&self) -> Result<String, String> {
        serde_json::to_value(self)
            .map(|v| v.to_string())
            .map_err(|e| e.to_string())
    }
}

/// PyTorch's `memory_stats()` names for what this allocator counts.
#[derive(Serialize)]
pub(super) struct TorchStats {
    #[serde(rename = "allocated_bytes.all.current")]
    allocated_current: u64,
    #[serde(rename = "allocated_bytes.all.peak")]
    allocated_peak: u64,
    #[serde(rename = "requested_bytes.all.current")]
    requested_current: u64,
    #[serde(rename = "requested_bytes.all.peak")]
    requested_peak: u64,
    #[serde(rename = "reserved_bytes.all.current")]
    reserved_current: u64,
    #[serde(rename = "reserved_bytes.all.peak")]
    reserved_peak: u64,
    /// Torch's "active" also holds blocks freed but still waiting for other streams.
    #[serde(rename = "active_bytes.all.current")]
    active_current: u64,
    #[serde(rename = "allocation.all.current")]
    allocations_current: u64,
    #[serde(rename = "allocation.all.peak")]
    allocations_peak: u64,
    #[serde(rename = "allocation.all.allocated")]
    allocations_allocated: u64,
    #[serde(rename = "allocation.all.freed")]
    allocations_freed: u64,
    #[serde(rename = "segment.all.current")]
    segments_current: u64,
    #[serde(rename = "segment.all.allocated")]
    segments_allocated: u64,
    #[serde(rename = "segment.all.freed")]
    segments_freed: u64,
    /// Free bytes that cannot be given back because they share a handle with live bytes.
    #[serde(rename = "inactive_split_bytes.all.current")]
    inactive_split_current: u64,
    num_ooms: u64,
    /// Torch: a failed cudaMalloc followed by a cache flush and a retry. Here: a slow path
    /// that blocked on outstanding frees before trying again.
    num_alloc_retries: u64,
    num_device_alloc: u64,
    num_device_free: u64,
}

impl TorchStats {
    fn new(s: &Stats, d: &DetailedStats) -> Self {
        let t = DeviceStats::new(s, d, 0);
        TorchStats {
            allocated_current: t.allocated_current,
            allocated_peak: t.allocated_peak,
            requested_current: t.requested_current,
            requested_peak: t.requested_peak,
            reserved_current: t.reserved_current,
            reserved_peak: t.reserved_peak,
            active_current: t.active_current,
            allocations_current: t.allocations_current,
            allocations_peak: t.allocations_peak,
            allocations_allocated: t.allocations_allocated,
            allocations_freed: t.allocations_freed,
            segments_current: t.segments_current,
            segments_allocated: t.segments_allocated,
            segments_freed: t.segments_freed,
            inactive_split_current: t.inactive_split_bytes_current,
            num_ooms: t.num_ooms,
            num_alloc_retries: t.num_alloc_retries,
            num_device_alloc: t.num_device_alloc,
            num_device_free: t.num_device_free,
        }
    }
}

/// `struct stitch_device_stats` of `include/stitch_alloc.h`, field for field: the typed
/// statistics of `stitch_device_stats` (torch's `DeviceStats` meanings). Versioned by its
/// size: fields are only ever appended, and the call fills as much as the caller's struct
/// holds.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// 1 once the device's allocator exists (its first allocation happened), else 0 (and
    /// every other field 0).
    pub initialized: u64,
    /// The allocator's capacity (changed by `stitch_set_memory_fraction`).
    pub capacity: u64,
    /// Bytes of live blocks (rounded sizes): torch's `allocated_bytes`.
    pub allocated_current: u64,
    /// Its high-water mark since creation or `stitch_reset_peak_stats`.
    pub allocated_peak: u64,
    /// Bytes asked for by live allocations: torch's `requested_bytes`.
    pub requested_current: u64,
    /// Its high-water mark.
    pub requested_peak: u64,
    /// Physical bytes held in handles: torch's `reserved_bytes`.
    pub reserved_current: u64,
    /// Its high-water mark.
    pub reserved_peak: u64,
    /// Live bytes plus bytes freed and waiting for other streams: torch's `active_bytes`.
    pub active_current: u64,
    /// Live allocations: torch's `allocation`.
    pub allocations_current: u64,
    /// Its high-water mark.
    pub allocations_peak: u64,
    /// Allocations made (accumulated; `stitch_reset_accumulated_stats`).
    pub allocations_allocated: u64,
    /// Allocations freed (accumulated).
    pub allocations_freed: u64,
    /// Physical handles held: torch's `segment`.
    pub segments_current: u64,
    /// Handles created (accumulated).
    pub segments_allocated: u64,
    /// Handles released (accumulated).
    pub segments_freed: u64,
    /// Free bytes in handles that also hold live bytes (not releasable): torch's
    /// `inactive_split_bytes`.
    pub inactive_split_bytes_current: u64,
    /// Bytes freed with uses on several streams, waiting for their events.
    pub pending_free_bytes: u64,
    /// The largest free mapped span.
    pub largest_free_span: u64,
    /// Free mapped bytes.
    pub free_bytes: u64,
    /// Out-of-memory failures (accumulated).
    pub num_ooms: u64,
    /// Slow paths that blocked on outstanding frees before trying again (accumulated).
    pub num_alloc_retries: u64,
    /// Handle mappings made (`cuMemMap`; accumulated).
    pub num_device_alloc: u64,
    /// Mappings removed (`cuMemUnmap`; accumulated).
    pub num_device_free: u64,
    /// Bytes of blocks freed during a CUDA graph capture outside a graph pool, held.
    pub graph_held_bytes: u64,
}

impl DeviceStats {
    /// The figures of an allocator whose counters are `s` and report `d`.
    pub fn new(s: &Stats, d: &DetailedStats, graph_held_bytes: u64) -> Self {
        DeviceStats {
            initialized: 1,
            capacity: d.capacity,
            allocated_current: s.allocated.current,
            allocated_peak: s.allocated.peak,
            requested_current: s.requested.current,
            requested_peak: s.requested.peak,
            reserved_current: s.reserved.current,
            reserved_peak: s.reserved.peak,
            active_current: s.allocated.current + s.pending_free,
            allocations_current: s.live_allocations.current,
            allocations_peak: s.live_allocations.peak,
            allocations_allocated: s.allocs,
            allocations_freed: s.frees,
            segments_current: s.handles,
            segments_allocated: s.handles_created,
            segments_freed: s.handles_released,
            inactive_split_bytes_current: d.stranded_bytes,
            pending_free_bytes: s.pending_free,
            largest_free_span: d.largest_free_span,
            free_bytes: d.free_bytes,
            num_ooms: s.ooms,
            num_alloc_retries: s.event_waits,
            num_device_alloc: s.calls.get(DriverOp::Map),
            num_device_free: s.calls.get(DriverOp::Unmap),
            graph_held_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_stats_is_all_u64_and_matches_the_header() {
        // The header declares 25 uint64_t fields in this order; a field added here must be
        // appended there too (the size is the version).
        assert_eq!(std::mem::size_of::<DeviceStats>(), 25 * 8);
        let h = include_str!("../../include/stitch_alloc.h");
        let start = h.find("struct stitch_device_stats {").unwrap();
        let body = &h[start..start + h[start..].find("};").unwrap()];
        let fields: Vec<&str> = body
            .lines()
            .filter_map(|l| l.trim().strip_prefix("uint64_t "))
            .filter_map(|l| l.split(';').next())
            .collect();
        let want = [
            "initialized",
            "capacity",
            "allocated_current",
            "allocated_peak",
            "requested_current",
            "requested_peak",
            "reserved_current",
            "reserved_peak",
            "active_current",
            "allocations_current",
            "allocations_peak",
            "allocations_allocated",
            "allocations_freed",
            "segments_current",
            "segments_allocated",
            "segments_freed",
            "inactive_split_bytes_current",
            "pending_free_bytes",
            "largest_free_span",
            "free_bytes",
            "num_ooms",
            "num_alloc_retries",
            "num_device_alloc",
            "num_device_free",
            "graph_held_bytes",
        ];
        assert_eq!(fields, want);
    }
}
