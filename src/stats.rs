//! Statistics: cheap counters always kept, and a detailed report computed on demand.
#![forbid(unsafe_code)]

use crate::driver::CallCounts;
use serde::Serialize;
use std::fmt;

/// A byte count in human units: the crate's one formatter (errors, summaries, the `stitch`
/// command). Below 1 KiB in bytes; then KiB or MiB with one decimal, GiB or TiB with three,
/// choosing the largest unit the value reaches.
///
/// ```
/// use stitch_alloc::stats::Bytes;
/// assert_eq!(Bytes(512).to_string(), "512 B");
/// assert_eq!(Bytes(1536).to_string(), "1.5 KiB");
/// assert_eq!(Bytes(300 << 20).to_string(), "300.0 MiB");
/// assert_eq!(Bytes(3 << 29).to_string(), "1.500 GiB");
/// assert_eq!(Bytes(2 << 40).to_string(), "2.000 TiB");
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u32, usize); 4] = [
            ("TiB", 40, 3),
            ("GiB", 30, 3),
            ("MiB", 20, 1),
            ("KiB", 10, 1),
        ];
        let b = self.0;
        let text = match UNITS.iter().find(|(_, shift, _)| b >= 1u64 << shift) {
            Some(&(unit, shift, decimals)) => {
                format!("{:.*} {unit}", decimals, b as f64 / (1u64 << shift) as f64)
            }
            None => format!("{b} B"),
        };
        // Honour width and alignment, for tables.
        f.pad(&text)
    }
}

/// A current value and its high-water mark.
///
/// ```
/// use stitch_alloc::stats::Gauge;
/// let mut g = Gauge::default();
/// g.add(10);
/// g.sub(4);
/// assert_eq!((g.current, g.peak), (6, 10));
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Gauge {
    /// The value now.
    pub current: u64,
    /// The highest value seen since creation or the last `reset_peaks`.
    pub peak: u64,
}

impl Gauge {
    /// Increase the value.
    #[inline]
    pub fn add(&mut self, v: u64) {
        self.current += v;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }
    /// Decrease the value.
    #[inline]
    pub fn sub(&mut self, v: u64) {
        self.current -= v;
    }
}

/// Counters maintained on every operation (cheap to read: one lock, one copy).
///
/// Names follow PyTorch's `memory_stats()` where one exists: `requested` is what callers
/// asked for, `allocated` what their blocks occupy (512-byte rounding), `reserved` the
/// physical memory held in handles, `mapped` the part of it mapped into address space.
///
/// ```
/// use stitch_alloc::{Allocator, Config, Stream};
/// use stitch_alloc::driver::SimDriver;
/// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
/// let p = a.alloc(1000, Stream::DEFAULT).unwrap();
/// let s = a.stats();
/// assert_eq!((s.allocs, s.requested.current, s.allocated.current), (1, 1000, 1024));
/// a.free(p, Stream::DEFAULT).unwrap();
/// assert_eq!((a.stats().requested.current, a.stats().requested.peak), (0, 1000));
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Bytes requested by live allocations.
    pub requested: Gauge,
    /// Bytes occupied by live allocations (rounded sizes).
    pub allocated: Gauge,
    /// Physical bytes held in handles.
    pub reserved: Gauge,
    /// Physical bytes mapped.
    pub mapped: Gauge,
    /// Live allocations.
    pub live_allocations: Gauge,
    /// Bytes freed with a cross-stream use and waiting for their events.
    pub pending_free: u64,
    /// Successful allocations.
    pub allocs: u64,
    /// Successful frees.
    pub frees: u64,
    /// Allocations served from already mapped memory with no driver call.
    pub fast_allocs: u64,
    /// Allocations that took the slow path (new memory, stitching, waiting).
    pub slow_allocs: u64,
    /// Stitches: slow paths that remapped existing free handles into a new span.
    pub stitches: u64,
    /// Slow paths that grew a free block in place (mapping handles right after it) instead
    /// of building a new span.
    pub extensions: u64,
    /// Handles moved by stitching.
    pub stitched_handles: u64,
    /// Clean handles that stitching released so as to create the span's memory anew,
    /// instead of moving them (`Config::recreate`); such a slow path counts as a stitch.
    pub recreated_handles: u64,
    /// Of those, handles moved while device work queued before their free could still be
    /// using them: mapped at the new address at once (an alias; work on the freeing stream
    /// stays ordered), the old mapping removed once that work has completed. No CPU wait.
    pub aliased_handles: u64,
    /// Bytes created and mapped when the allocator started (`Config::prealloc`).
    pub preallocated: u64,
    /// Handles created.
    pub handles_created: u64,
    /// Handles released.
    pub handles_released: u64,
    /// Handles exported to other processes ([`crate::Allocator::share`]), each once.
    pub handles_exported: u64,
    /// Current number of handles.
    pub handles: u64,
    /// Allocations that failed with `OutOfMemory`.
    pub ooms: u64,
    /// Times the allocator blocked on an event before reusing freed memory.
    pub event_waits: u64,
    /// CUDA events the allocator holds now: recorded to fence frees and stitched memory,
    /// not yet destroyed (a gauge of the present, kept by [`Stats::reset_accumulated`]).
    /// Zero once every free and old mapping is done with, after
    /// [`crate::Allocator::empty_cache`] on an idle device; `validate` checks it against
    /// the events the allocator's structures refer to.
    pub events_held: u64,
    /// Driver calls made by the allocator, by kind.
    pub calls: CallCounts,
    /// The highest `requested.current` since the allocator was created: unlike
    /// `requested.peak`, never reset ([`Stats::reset_peaks`]), so the growth budget does not
    /// change when a program resets its peak statistics.
    pub requested_lifetime_peak: u64,
    /// Bytes the growth budget allows above the peak of live bytes because stitches of one
    /// request size repeated with no new peak in between (a fixed-shape loop stitching every
    /// step), at most 1% of the peak; 0 until then. Like `requested_lifetime_peak`, never
    /// reset.
    pub repeat_allowance: u64,
    /// Stitches made in the same state as an earlier stitch at the same lifetime peak: a
    /// request of the same size with the same live bytes, the mark of a loop with the same
    /// shapes every step that stitches at the same point of each step, paying the driver
    /// again each time. A [`crate::Config::prealloc`] pool a little above the peak of live
    /// bytes can end them: 1.05 x did on a training loop (design/zoo.md, "Fourteenth
    /// session"), a step that fragments more needs more (1.5 x for a checkerboard). After
    /// eight the allocator says so once, as a `tracing` warning naming 1.05 x the peak.
    pub repeated_stitches: u64,
    /// Large allocations placed by next fit as a growing chain's next copy
    /// ([`crate::Config::chain_fit`]).
    pub chain_fits: u64,
    /// Times the loop region was entered ([`crate::Config::loop_region`]): a loop stitched
    /// again in a state it stitched in before, and its large requests were given one run
    /// that only grows.
    pub loop_region_entries: u64,
    /// Times the loop region was left: a large request it could not serve within its budget
    /// above the peak of live bytes (2%, up to 8%; shapes changed, or the loop needs more), a
    /// graph-pool allocation, or `empty_cache`.
    pub loop_region_exits: u64,
}

/// The [`crate::Config::prealloc`] the allocator names for a loop that stitches at the same
/// point of each step ([`Stats::repeated_stitches`]) with a peak of `peak_live` bytes: 1.05 x
/// the peak, rounded up to a MiB (enough for the fixed-shape training loop of design/zoo.md,
/// "Fourteenth session"; a step that fragments more needs more).
///
/// ```
/// assert_eq!(stitch_alloc::stats::prealloc_for_peak(16 << 20), 17 << 20);
/// ```
pub fn prealloc_for_peak(peak_live: u64) -> u64 {
    (peak_live + peak_live / 20).div_ceil(1 << 20) << 20
}

impl Stats {
    /// Start every high-water mark again from the current value (torch's
    /// `reset_peak_memory_stats`). `requested_lifetime_peak` is kept.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(8 << 20, Stream::DEFAULT).unwrap();
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// a.reset_peak_stats();
    /// let s = a.stats();
    /// assert_eq!((s.requested.peak, s.requested_lifetime_peak), (0, 8 << 20));
    /// ```
    pub fn reset_peaks(&mut self) {
        for g in [
            &mut self.requested,
            &mut self.allocated,
            &mut self.reserved,
            &mut self.mapped,
            &mut self.live_allocations,
        ] {
            g.peak = g.current;
        }
    }

    /// Zero every accumulated counter (allocations, frees, paths taken, stitches, handles
    /// created and released, out-of-memory errors, event waits, driver calls): torch's
    /// `reset_accumulated_memory_stats`. Gauges, `pending_free`, `handles`, `events_held`
    /// and `preallocated` describe the present and are kept.
    pub fn reset_accumulated(&mut self) {
        self.allocs = 0;
        self.frees = 0;
        self.fast_allocs = 0;
        self.slow_allocs = 0;
        self.stitches = 0;
        self.repeated_stitches = 0;
        self.chain_fits = 0;
        self.loop_region_entries = 0;
        self.loop_region_exits = 0;
        self.extensions = 0;
        self.stitched_handles = 0;
        self.recreated_handles = 0;
        self.aliased_handles = 0;
        self.handles_created = 0;
        self.handles_released = 0;
        self.handles_exported = 0;
        self.ooms = 0;
        self.event_waits = 0;
        self.calls = CallCounts::default();
    }
}

/// A fragmentation and layout report, computed on demand by walking every structure
/// (slower: use for monitoring and diagnosis, not per operation).
///
/// ```
/// use stitch_alloc::{Allocator, Config, Stream};
/// use stitch_alloc::driver::SimDriver;
/// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
/// let p = a.alloc(1000, Stream::DEFAULT).unwrap();
/// let d = a.detailed_stats();
/// assert_eq!(d.rounding_waste, 24); // 1000 bytes rounded to 1024
/// assert_eq!(d.small_pages, 1);
/// assert_eq!(d.granularity, 2 << 20);
/// # a.free(p, Stream::DEFAULT).unwrap();
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DetailedStats {
    /// The cheap counters at the same moment.
    pub stats: Stats,
    /// The allocator's capacity.
    pub capacity: u64,
    /// Granularity of the device.
    pub granularity: u64,
    /// Free blocks (spans of mapped, unused memory), all pools and streams.
    pub free_spans: u64,
    /// Bytes in free blocks.
    pub free_bytes: u64,
    /// The largest free block in the large pool.
    pub largest_free_span: u64,
    /// Handles holding no live byte (reusable whole by stitching).
    pub free_handles: u64,
    /// Bytes in those handles.
    pub free_handle_bytes: u64,
    /// Total size of the handles that hold at least one live byte.
    pub live_handle_bytes: u64,
    /// Free bytes inside handles that hold live bytes ("stranded": usable in place only).
    pub stranded_bytes: u64,
    /// `allocated - requested`: rounding waste of live allocations.
    pub rounding_waste: u64,
    /// Handles used as small pages.
    pub small_pages: u64,
    /// Free bytes inside small pages that hold live bytes.
    pub small_stranded_bytes: u64,
    /// Runs used as medium pages.
    pub medium_pages: u64,
    /// Free bytes inside medium pages that hold live bytes.
    pub medium_stranded_bytes: u64,
    /// Handles owned but not mapped.
    pub unmapped_handles: u64,
    /// Virtual address space reserved.
    pub va_reserved: u64,
    /// Estimated heap bytes of the allocator's own metadata.
    pub metadata_bytes: u64,
    /// `live_handle_bytes / requested` (1.0 = no waste at all); 0 with nothing live.
    pub live_handle_ratio: f64,
}

/// One row of a summary table: a label, then the values right-aligned.
fn row(f: &mut fmt::Formatter<'_>, label: &str, cells: &[String]) -> fmt::Result {
    write!(f, "| {label:<28}")?;
    for c in cells {
        write!(f, " | {c:>13}")?;
    }
    writeln!(f, " |")
}

fn rule(f: &mut fmt::Formatter<'_>, c: char) -> fmt::Result {
    writeln!(f, "|{}|", c.to_string().repeat(62))
}

/// A table in the style of `torch.cuda.memory_summary()`: each gauge's current value and
/// peak, then the counters.
///
/// ```
/// use stitch_alloc::{Allocator, Config, Stream};
/// use stitch_alloc::driver::SimDriver;
/// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
/// let p = a.alloc(100 << 20, Stream::DEFAULT).unwrap();
/// let text = a.stats().to_string();
/// assert!(text.contains("Requested memory") && text.contains("100.0 MiB"), "{text}");
/// # a.free(p, Stream::DEFAULT).unwrap();
/// ```
impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        rule(f, '=')?;
        writeln!(f, "| {:<60} |", "stitch-alloc memory summary")?;
        rule(f, '-')?;
        row(f, "Metric", &["Current".into(), "Peak".into()])?;
        rule(f, '-')?;
        let bytes = |g: Gauge| [Bytes(g.current).to_string(), Bytes(g.peak).to_string()];
        row(f, "Requested memory", &bytes(self.requested))?;
        row(f, "Allocated memory", &bytes(self.allocated))?;
        row(f, "Reserved memory (handles)", &bytes(self.reserved))?;
        row(f, "Mapped memory", &bytes(self.mapped))?;
        let g = self.live_allocations;
        row(
            f,
            "Live allocations",
            &[g.current.to_string(), g.peak.to_string()],
        )?;
        row(
            f,
            "Frees waiting for events",
            &[Bytes(self.pending_free).to_string(), String::new()],
        )?;
        rule(f, '-')?;
        row(f, "Metric", &["Count".into(), String::new()])?;
        rule(f, '-')?;
        for (label, n) in [
            ("Allocations", self.allocs),
            ("Frees", self.frees),
            ("  with no driver call", self.fast_allocs),
            ("  on the slow path", self.slow_allocs),
            ("Stitches", self.stitches),
            ("  handles moved", self.stitched_handles),
            ("  handles re-created", self.recreated_handles),
            ("In-place extensions", self.extensions),
            ("Handles now", self.handles),
            ("  created", self.handles_created),
            ("  released", self.handles_released),
            ("Out-of-memory failures", self.ooms),
            ("Waits on events", self.event_waits),
            ("Events held now", self.events_held),
            ("Driver calls", self.calls.total()),
        ] {
            row(f, label, &[n.to_string(), String::new()])?;
        }
        rule(f, '=')
    }
}

/// [`Stats`]' table, then the fragmentation figures.
///
/// ```
/// use stitch_alloc::{Allocator, Config, Stream};
/// use stitch_alloc::driver::SimDriver;
/// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
/// let p = a.alloc(100 << 20, Stream::DEFAULT).unwrap();
/// let text = a.detailed_stats().to_string();
/// assert!(text.contains("Largest free span") && text.contains("1.000 GiB"), "{text}");
/// # a.free(p, Stream::DEFAULT).unwrap();
/// ```
impl fmt::Display for DetailedStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.stats)?;
        row(f, "Fragmentation", &["Value".into(), String::new()])?;
        rule(f, '-')?;
        let b = |v: u64| [Bytes(v).to_string(), String::new()];
        row(f, "Capacity", &b(self.capacity))?;
        row(f, "Granularity", &b(self.granularity))?;
        row(f, "Free bytes (mapped)", &b(self.free_bytes))?;
        row(
            f,
            "Free spans",
            &[self.free_spans.to_string(), String::new()],
        )?;
        row(f, "Largest free span", &b(self.largest_free_span))?;
        row(f, "Free handles' bytes", &b(self.free_handle_bytes))?;
        row(f, "Live handles' bytes", &b(self.live_handle_bytes))?;
        row(f, "Stranded in live handles", &b(self.stranded_bytes))?;
        row(f, "Rounding waste", &b(self.rounding_waste))?;
        row(
            f,
            "Live handles / requested",
            &[format!("{:.4}", self.live_handle_ratio), String::new()],
        )?;
        row(f, "Address space reserved", &b(self.va_reserved))?;
        row(f, "Metadata (estimated)", &b(self.metadata_bytes))?;
        rule(f, '=')
    }
}
