//! Statistics: cheap counters always kept, and a detailed report computed on demand.
#![forbid(unsafe_code)]

use crate::driver::CallCounts;
use serde::Serialize;

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
    /// Of those, handles moved while device work queued before their free could still be
    /// using them: mapped at the new address at once (an alias; work on the freeing stream
    /// stays ordered), the old mapping removed once that work has completed. No CPU wait.
    pub aliased_handles: u64,
    /// Handles created.
    pub handles_created: u64,
    /// Handles released.
    pub handles_released: u64,
    /// Current number of handles.
    pub handles: u64,
    /// Allocations that failed with `OutOfMemory`.
    pub ooms: u64,
    /// Times the allocator blocked on an event before reusing freed memory.
    pub event_waits: u64,
    /// Driver calls made by the allocator, by kind.
    pub calls: CallCounts,
}

/// A fragmentation and layout report, computed on demand by walking every structure
/// (slower: use for monitoring and diagnosis, not per operation).
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
