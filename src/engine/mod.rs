//! The allocation engine: blocks, free lists, handles, virtual address space, stream fences,
//! and the slow paths (stitching, growing, releasing) that call the driver.
//!
//! The engine is single-threaded; [`crate::Allocator`] wraps it in a lock.
//!
//! # Data model
//! * A **handle** is physical memory created by the driver. It is either mapped whole at one
//!   address (recorded in `mapped`), or owned and unmapped (`unmapped`), or — only after a
//!   failed rollback — mapped without access (`quarantine`). A handle stitched away from
//!   memory that device work queued on the freeing stream may still use also keeps its old
//!   mapping for a while (a **ghost**, in `ghosts`): unmapped once an event recorded at the
//!   stitch completes, so the CPU never waits for the device to stitch.
//! * A **block** is a piece of mapped memory: live (handed out), free (in a free list), or
//!   pending (freed, waiting for events of several streams). Blocks of one contiguously
//!   mapped run are linked in address order (`prev`/`next`); two neighbours that are both
//!   free with the same owner are always merged.
//! * A free block has an **owner**: 0 = clean (usable by any stream and by stitching), `k > 0`
//!   = freed on stream `owners[k].stream` and not yet fenced (usable by that stream only).
//! * Small requests live in the small pool: runs of exactly one handle (a "small page").
#![forbid(unsafe_code)]

mod bins;
mod va;

use crate::config::Resolved;
use crate::driver::{Driver, DriverOp, DriverResult, EventId, PhysHandle, Stream};
use crate::error::{AllocError, OomReport, Result};
use crate::stats::{DetailedStats, Stats};
use bins::Bins;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::BTreeMap;
use va::VaSpace;

/// "No block".
pub(crate) const NIL: u32 = u32::MAX;
/// Allocation unit and alignment: 512 bytes.
pub(crate) const UNIT: u64 = 512;
/// A large request avoids (while within the growth budget) a free block this many times its
/// size: it would pin memory that larger requests could use whole.
const OVERFIT: u64 = 4;

/// Which pool a block belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    /// Requests up to the small threshold, packed into small pages.
    Small = 0,
    /// Requests up to the medium threshold, packed into medium pages, so that they never pin
    /// a large handle.
    Medium = 1,
    /// Everything else.
    Large = 2,
}

/// Number of pools.
const POOLS: usize = 3;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// In `bins[owner][pool]`. `seq` is the owner's free counter when it was freed
    /// (the highest of the merged pieces).
    Free { owner: u16, seq: u64 },
    /// Handed out; in `live` under its address.
    Live { requested: u64, stream: Stream },
    /// Freed with uses on several streams; in `pending` until all their events complete.
    Pending,
    /// Unused arena slot; in `vacant`.
    Vacant,
}

/// One block. Invariants (checked by `Engine::validate`):
/// `size > 0`, `addr` and `size` multiples of `UNIT`; `prev`/`next` link blocks of one
/// contiguously mapped run: `blocks[prev].addr + blocks[prev].size == addr`.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) prev: u32,
    pub(crate) next: u32,
    /// Free-list links, meaningful while `state` is `Free`.
    pub(crate) fprev: u32,
    pub(crate) fnext: u32,
    pub(crate) pool: Pool,
    pub(crate) state: State,
}

#[derive(Debug)]
struct Owner {
    /// The stream whose frees this owner holds (unused for owner 0, the clean pool).
    stream: Stream,
    /// Frees counted on this stream so far.
    free_seq: u64,
    /// An event recorded on the stream, covering frees with `seq <= covered`.
    fence: Option<(EventId, u64)>,
}

#[derive(Debug)]
struct HandleRec {
    handle: PhysHandle,
    size: u64,
    /// Where it is mapped, if anywhere.
    at: Option<u64>,
    /// Old mappings of it still in `ghosts`; it may be released only at 0.
    ghosts: u32,
}

/// An old mapping of a handle that stitching moved while work queued on the freeing stream
/// could still use it. Its address range stays taken (not free in `va`, not in `mapped`)
/// until it is unmapped, after `event` completes (`None`: no work can touch it; unmap at
/// the next chance).
#[derive(Debug)]
struct Ghost {
    addr: u64,
    size: u64,
    hid: u32,
    event: Option<EventId>,
    /// The stream the event was recorded on (events of one stream complete in order).
    stream: Stream,
}

#[derive(Debug)]
struct PendingFree {
    block: u32,
    events: Vec<EventId>,
}

/// A whole handle that holds no live byte.
#[derive(Copy, Clone, Debug)]
struct Cand {
    hid: u32,
    size: u64,
    /// The free block containing it, or `NIL` when unmapped.
    block: u32,
    addr: u64,
    /// The block's owner: 0 (clean) or the requesting stream's owner (dirty: moved by
    /// aliasing, see `Ghost`).
    owner: u16,
}

/// Result of an attempt to get more memory for a pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Grow {
    Done,
    /// Not enough free handles plus headroom under the capacity.
    Short,
    /// The driver refused to create memory below our capacity.
    DriverOom,
}

/// A view of one block for dumps and pictures.
#[derive(Clone, Debug, Serialize)]
pub struct BlockView {
    /// Start address.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Pool.
    pub pool: Pool,
    /// `"live"`, `"free"` (clean), `"dirty"` (freed, not yet fenced), or `"pending"`.
    pub state: &'static str,
    /// The stream that allocated it (live) or freed it (dirty).
    pub stream: Option<u64>,
    /// Requested bytes (live blocks).
    pub requested: Option<u64>,
}

/// A view of one handle.
#[derive(Clone, Debug, Serialize)]
pub struct HandleView {
    /// Size in bytes.
    pub size: u64,
    /// Where it is mapped (none if owned but unmapped).
    pub addr: Option<u64>,
    /// Whether a live or pending block overlaps it.
    pub holds_live: bool,
}

/// A mapped handle that holds both live and free bytes: its free part is usable in place
/// only, never by stitching ("stranded").
#[derive(Clone, Debug, Serialize)]
pub struct StrandedHandle {
    /// Where the handle is mapped.
    pub addr: u64,
    /// Its size.
    pub size: u64,
    /// Free bytes inside it.
    pub free: u64,
    /// The live blocks overlapping it: (block size, bytes of it inside this handle).
    pub live_blocks: Vec<(u64, u64)>,
}

/// The allocator's whole layout, for JSON dumps and address-space pictures.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    /// Statistics at the same moment.
    pub detailed: DetailedStats,
    /// Virtual address reservations as (base, size).
    pub reservations: Vec<(u64, u64)>,
    /// Every handle.
    pub handles: Vec<HandleView>,
    /// Runs of contiguously mapped blocks, each in address order.
    pub runs: Vec<Vec<BlockView>>,
}

impl Snapshot {
    /// Every stranded handle, most free bytes first: where fragmentation inside handles sits.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(100 << 20, Stream::DEFAULT).unwrap();
    /// let q = a.alloc(20 << 20, Stream::DEFAULT).unwrap();
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// let _ = a.alloc(10 << 20, Stream::DEFAULT).unwrap(); // reuses part of p's handle
    /// let s = a.snapshot().stranded_handles();
    /// assert!(s.iter().all(|h| h.free > 0 && !h.live_blocks.is_empty()));
    /// # let _ = q;
    /// ```
    pub fn stranded_handles(&self) -> Vec<StrandedHandle> {
        let mut out = Vec::new();
        for h in &self.handles {
            let Some(ha) = h.addr else { continue };
            let (mut free, mut live) = (0, Vec::new());
            for b in self.runs.iter().flatten() {
                let (s0, e0) = (b.addr.max(ha), (b.addr + b.size).min(ha + h.size));
                if s0 < e0 {
                    if b.state == "live" {
                        live.push((b.size, e0 - s0));
                    } else {
                        free += e0 - s0;
                    }
                }
            }
            if free > 0 && !live.is_empty() {
                out.push(StrandedHandle {
                    addr: ha,
                    size: h.size,
                    free,
                    live_blocks: live,
                });
            }
        }
        out.sort_by_key(|h| std::cmp::Reverse(h.free));
        out
    }
}

/// The engine state (see the module docs).
pub(crate) struct Engine {
    pub(crate) cfg: Resolved,
    blocks: Vec<Block>,
    vacant: Vec<u32>,
    /// address -> block, for every live block.
    live: FxHashMap<u64, u32>,
    /// `owners[0]` is the clean pool; others are streams, in order of first free.
    owners: Vec<Owner>,
    /// `bins[owner][pool]` holds exactly the free blocks with that owner and pool.
    bins: Vec<[Bins; POOLS]>,
    pending: Vec<PendingFree>,
    /// Completed events whose destroy failed; retried on later slow paths and at teardown.
    zombies: Vec<EventId>,
    /// Extra streams that used a live block (`record_stream`).
    extra: FxHashMap<u32, Vec<Stream>>,
    handles: Vec<Option<HandleRec>>,
    free_hids: Vec<u32>,
    /// address -> handle id, for every mapped, accessible handle; all of them are covered
    /// exactly by blocks.
    mapped: BTreeMap<u64, u32>,
    /// Owned handles that are not mapped.
    unmapped: Vec<u32>,
    /// Handles left mapped without access after a failed rollback.
    quarantine: Vec<u32>,
    /// Old mappings of stitched handles waiting for the device (see `Ghost`).
    ghosts: Vec<Ghost>,
    va: VaSpace,
    pub(crate) stats: Stats,
    pub(crate) shut_down: bool,
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// The owner index of a free block's state.
fn state_owner(s: State) -> usize {
    match s {
        State::Free { owner, .. } => owner as usize,
        _ => unreachable!("owner of a block that is not free"),
    }
}

impl Engine {
    pub(crate) fn new<D: Driver + ?Sized>(d: &D, cfg: Resolved) -> Result<Self> {
        let mut e = Engine {
            cfg,
            blocks: Vec::new(),
            vacant: Vec::new(),
            live: FxHashMap::default(),
            owners: vec![Owner {
                stream: Stream::sim(u64::MAX),
                free_seq: 0,
                fence: None,
            }],
            bins: vec![Default::default()],
            pending: Vec::new(),
            zombies: Vec::new(),
            extra: FxHashMap::default(),
            handles: Vec::new(),
            free_hids: Vec::new(),
            mapped: BTreeMap::new(),
            unmapped: Vec::new(),
            quarantine: Vec::new(),
            ghosts: Vec::new(),
            va: VaSpace::default(),
            stats: Stats::default(),
            shut_down: false,
        };
        let chunk = e.cfg.va_chunk;
        e.reserve_va(d, chunk)?;
        Ok(e)
    }

    #[inline]
    fn drv<T>(&mut self, op: DriverOp, f: impl FnOnce() -> DriverResult<T>) -> DriverResult<T> {
        self.stats.calls.add(op);
        f()
    }

    fn reserve_va<D: Driver + ?Sized>(&mut self, d: &D, size: u64) -> Result<()> {
        let total = self.va.reserved();
        if total.saturating_add(size) > self.cfg.va_limit {
            return Err(AllocError::Driver {
                op: DriverOp::Reserve,
                code: crate::driver::code::OUT_OF_MEMORY,
                message: format!(
                    "virtual address limit: {total} bytes reserved, {size} more would pass va_limit {}",
                    self.cfg.va_limit
                ),
            });
        }
        let base = self.drv(DriverOp::Reserve, || d.reserve(size))?;
        tracing::debug!(base, size, "reserved virtual address space");
        self.va.add_reservation(base, size);
        Ok(())
    }

    /// Address space for a new run: the middle of the largest free range, so the run can
    /// later grow in place; a new reservation when no range is twice the length; plain best
    /// fit when the address-space limit is reached.
    fn va_alloc<D: Driver + ?Sized>(&mut self, d: &D, len: u64) -> Result<u64> {
        let g = self.cfg.granularity;
        if let Some(a) = self.va.alloc_spread(len, g) {
            return Ok(a);
        }
        let chunk = self.cfg.va_chunk.max(len.saturating_mul(4));
        match self.reserve_va(d, chunk) {
            Ok(()) => Ok(self
                .va
                .alloc_spread(len, g)
                .expect("fresh reservation fits")),
            Err(e) => self.va.alloc(len).ok_or(e),
        }
    }

    // ----- arena -----

    fn new_block(&mut self, b: Block) -> u32 {
        if let Some(i) = self.vacant.pop() {
            self.blocks[i as usize] = b;
            i
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as u32
        }
    }

    fn vacate(&mut self, i: u32) {
        self.blocks[i as usize].state = State::Vacant;
        self.vacant.push(i);
    }

    fn add_handle(&mut self, handle: PhysHandle, size: u64) -> u32 {
        let rec = Some(HandleRec {
            handle,
            size,
            at: None,
            ghosts: 0,
        });
        self.stats.reserved.add(size);
        self.stats.handles += 1;
        self.stats.handles_created += 1;
        if let Some(h) = self.free_hids.pop() {
            self.handles[h as usize] = rec;
            h
        } else {
            self.handles.push(rec);
            (self.handles.len() - 1) as u32
        }
    }

    fn hsize(&self, hid: u32) -> u64 {
        self.handles[hid as usize]
            .as_ref()
            .expect("live handle")
            .size
    }

    fn hrec(&self, hid: u32) -> &HandleRec {
        self.handles[hid as usize].as_ref().expect("live handle")
    }

    /// Release an unmapped handle to the driver. On failure it stays owned and unmapped.
    fn release_handle<D: Driver + ?Sized>(&mut self, d: &D, hid: u32) -> DriverResult<()> {
        let h = self.hrec(hid).handle;
        match self.drv(DriverOp::Release, || d.release(h)) {
            Ok(()) => {
                let size = self.hsize(hid);
                tracing::debug!(size, "released a handle");
                self.handles[hid as usize] = None;
                self.free_hids.push(hid);
                self.stats.reserved.sub(size);
                self.stats.handles -= 1;
                self.stats.handles_released += 1;
                Ok(())
            }
            Err(e) => {
                self.unmapped.push(hid);
                Err(e)
            }
        }
    }

    // ----- hot path -----

    fn owner_index(&self, stream: Stream) -> Option<usize> {
        self.owners[1..]
            .iter()
            .position(|o| o.stream == stream)
            .map(|i| i + 1)
    }

    fn owner_for(&mut self, stream: Stream) -> usize {
        if let Some(o) = self.owner_index(stream) {
            return o;
        }
        self.owners.push(Owner {
            stream,
            free_seq: 0,
            fence: None,
        });
        self.bins.push(Default::default());
        self.owners.len() - 1
    }

    #[inline]
    fn find(&self, rsize: u64, pool: Pool, stream: Stream) -> Option<u32> {
        let p = pool as usize;
        let clean = self.bins[0][p].find(&self.blocks, rsize);
        let own = if self.owners.len() > 1 {
            self.owner_index(stream)
                .and_then(|o| self.bins[o][p].find(&self.blocks, rsize))
        } else {
            None
        };
        match (clean, own) {
            (Some(a), Some(b)) => Some(
                if self.blocks[b as usize].size <= self.blocks[a as usize].size {
                    b
                } else {
                    a
                },
            ),
            (a, b) => a.or(b),
        }
    }

    /// Like `find`, but scans whole classes: used on the slow path so no fit is ever missed.
    fn find_exhaustive(&self, rsize: u64, pool: Pool, stream: Stream) -> Option<u32> {
        if let Some(i) = self.find(rsize, pool, stream) {
            return Some(i);
        }
        let p = pool as usize;
        let mut all = Vec::new();
        self.bins[0][p].collect(&self.blocks, &mut all);
        if let Some(o) = self.owner_index(stream) {
            self.bins[o][p].collect(&self.blocks, &mut all);
        }
        all.into_iter()
            .filter(|&i| self.blocks[i as usize].size >= rsize)
            .min_by_key(|&i| self.blocks[i as usize].size)
    }

    /// Hand out `rsize` bytes of free block `i` (at its start, or where `placement` says).
    #[inline]
    fn take(&mut self, mut i: u32, rsize: u64, requested: u64, stream: Stream) -> u64 {
        let State::Free { owner, .. } = self.blocks[i as usize].state else {
            unreachable!("take of a block that is not free")
        };
        let pool = self.blocks[i as usize].pool;
        self.bins[owner as usize][pool as usize].remove(&mut self.blocks, i);
        let (mut addr, mut size) = {
            let b = &self.blocks[i as usize];
            (b.addr, b.size)
        };
        let off = if pool == Pool::Large && size > rsize {
            self.placement(addr, size, rsize)
        } else {
            0
        };
        if off > 0 {
            // The piece in front stays free as block `i`; the allocation starts a new block.
            let j = self.split(i, off);
            self.bins[owner as usize][pool as usize].insert(&mut self.blocks, i);
            i = j;
            addr += off;
            size -= off;
        }
        if size > rsize {
            let r = self.split(i, rsize);
            self.bins[owner as usize][pool as usize].insert(&mut self.blocks, r);
        }
        self.blocks[i as usize].state = State::Live { requested, stream };
        self.live.insert(addr, i);
        let s = &mut self.stats;
        s.requested.add(requested);
        s.allocated.add(rsize);
        s.live_allocations.add(1);
        s.allocs += 1;
        addr
    }

    /// Split block `i` (in no list) at byte `at`: `i` keeps the front, a new block with the
    /// same pool and state takes the rest and is linked after it. Returns the new block.
    #[inline]
    fn split(&mut self, i: u32, at: u64) -> u32 {
        let (addr, size, next, pool, state) = {
            let b = &self.blocks[i as usize];
            (b.addr, b.size, b.next, b.pool, b.state)
        };
        debug_assert!(at > 0 && at < size);
        let j = self.new_block(Block {
            addr: addr + at,
            size: size - at,
            prev: i,
            next,
            fprev: NIL,
            fnext: NIL,
            pool,
            state,
        });
        if next != NIL {
            self.blocks[next as usize].prev = j;
        }
        let b = &mut self.blocks[i as usize];
        b.next = j;
        b.size = at;
        j
    }

    /// Where to put `rsize` bytes inside the free block `[a, a+size)` (an offset): the place
    /// that leaves the fewest bytes of wholly free handles stranded (pinned by the new
    /// allocation but not used by it). Candidates: either end of the block, and every handle
    /// boundary inside it as the allocation's start or end. Ties keep the block's start.
    fn placement(&self, a: u64, size: u64, rsize: u64) -> u64 {
        const MAX: usize = 32;
        let e = a + size;
        let first = self.mapped.range(..=a).next_back().map_or(a, |(&h, _)| h);
        let mut hs = [(0u64, 0u64); MAX];
        let mut n = 0;
        for (&ha, &hid) in self.mapped.range(first..e) {
            if n == MAX {
                return 0; // many small handles: stranding is small anyway
            }
            hs[n] = (ha, ha + self.hsize(hid));
            n += 1;
        }
        if n <= 1 {
            return 0;
        }
        let hs = &hs[..n];
        let cost = |p: u64| -> u64 {
            let q = p + rsize;
            hs.iter()
                .filter(|h| h.0 >= a && h.1 <= e && h.0 < q && p < h.1)
                .map(|h| (h.1 - h.0) - (h.1.min(q) - h.0.max(p)))
                .sum()
        };
        let mut best = (cost(a), a);
        let mut consider = |p: u64| {
            if p >= a && p + rsize <= e && p % UNIT == 0 {
                let c = cost(p);
                if c < best.0 {
                    best = (c, p);
                }
            }
        };
        consider(e - rsize);
        for h in hs {
            for x in [h.0, h.1] {
                consider(x);
                if x >= rsize {
                    consider(x - rsize);
                }
            }
        }
        best.1 - a
    }

    /// Merge free block `i` (not in any list) with same-owner free neighbours, then list it.
    /// A dirty block also absorbs clean neighbours: memory any stream may use can always be
    /// restricted to one stream until its next fence, and the freeing stream then finds one
    /// contiguous free range instead of pieces split by ownership.
    fn coalesce_insert(&mut self, mut i: u32) {
        let State::Free { owner, mut seq } = self.blocks[i as usize].state else {
            unreachable!("coalesce of a block that is not free")
        };
        let pool = self.blocks[i as usize].pool as usize;
        // Absorbing a clean neighbour can bring a same-owner block next: go on merging.
        loop {
            let prev = self.blocks[i as usize].prev;
            let Some(ps) = self.unlist_joinable(prev, owner, pool) else {
                break;
            };
            seq = seq.max(ps);
            self.absorb_next(prev, i);
            i = prev;
        }
        loop {
            let next = self.blocks[i as usize].next;
            let Some(ns) = self.unlist_joinable(next, owner, pool) else {
                break;
            };
            seq = seq.max(ns);
            self.absorb_next(i, next);
        }
        self.blocks[i as usize].state = State::Free { owner, seq };
        self.bins[owner as usize][pool].insert(&mut self.blocks, i);
    }

    /// If block `j` is free and may merge into a free block of `owner` (same owner, or clean
    /// into dirty), take it off its list and return its `seq`.
    fn unlist_joinable(&mut self, j: u32, owner: u16, pool: usize) -> Option<u64> {
        if j == NIL {
            return None;
        }
        let State::Free { owner: o, seq } = self.blocks[j as usize].state else {
            return None;
        };
        if o != owner && !(owner != 0 && o == 0) {
            return None;
        }
        self.bins[o as usize][pool].remove(&mut self.blocks, j);
        Some(seq)
    }

    /// Merge block `next` (unlisted, right after `i` in its run) into `i`.
    fn absorb_next(&mut self, i: u32, next: u32) {
        let (size, nn) = {
            let n = &self.blocks[next as usize];
            (n.size, n.next)
        };
        let b = &mut self.blocks[i as usize];
        b.size += size;
        b.next = nn;
        if nn != NIL {
            self.blocks[nn as usize].prev = i;
        }
        self.vacate(next);
    }

    /// Allocate `size` bytes for use on `stream`.
    pub(crate) fn alloc<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        size: u64,
        stream: Stream,
    ) -> Result<u64> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        if size == 0 {
            return Err(AllocError::ZeroSize);
        }
        if size > self.cfg.capacity {
            return Err(AllocError::TooLarge {
                requested: size,
                limit: self.cfg.capacity,
            });
        }
        let rsize = round_up(size, UNIT);
        let pool = if size <= self.cfg.small_threshold {
            Pool::Small
        } else if size <= self.cfg.medium_threshold {
            Pool::Medium
        } else {
            Pool::Large
        };
        if let Some(i) = self.find(rsize, pool, stream) {
            // A large request would pin a free block four or more times its size: create a
            // fitting one instead while within the growth budget.
            let overfit = pool == Pool::Large && self.blocks[i as usize].size / OVERFIT >= rsize;
            if !overfit || !self.may_create(size) {
                self.stats.fast_allocs += 1;
                return Ok(self.take(i, rsize, size, stream));
            }
            return self.alloc_slow(d, size, rsize, pool, stream, true);
        }
        self.alloc_slow(d, size, rsize, pool, stream, false)
    }

    /// Whether creating memory for a request of `size` bytes stays within the capacity and
    /// the growth budget: `L + max(reserve_slack * L, reserve_slack_min)` where
    /// `L = max(peak live, live + size)`.
    fn may_create(&self, size: u64) -> bool {
        let need = round_up(size, self.cfg.granularity);
        let s = &self.stats;
        let after = s.reserved.current + need;
        let live = s.requested.peak.max(s.requested.current + size);
        let slack = (live as f64 * self.cfg.reserve_slack) as u64;
        after <= self.cfg.capacity && after <= live + slack.max(self.cfg.reserve_slack_min)
    }

    fn alloc_slow<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        size: u64,
        rsize: u64,
        pool: Pool,
        stream: Stream,
        overfit: bool,
    ) -> Result<u64> {
        self.stats.slow_allocs += 1;
        let _span =
            tracing::debug_span!("alloc_slow", size, ?pool, stream = stream.raw()).entered();
        // Frees fenced since the last slow path may have become clean and merged.
        self.poll(d, false)?;
        let fits = if overfit {
            None
        } else {
            self.find_exhaustive(rsize, pool, stream)
        };
        let mut grown = match fits {
            Some(_) => Grow::Done,
            None => self.grow(d, pool, rsize, stream)?,
        };
        if grown != Grow::Done {
            // Block until every outstanding free is usable, then try once more.
            self.poll(d, true)?;
            grown = match self.find_exhaustive(rsize, pool, stream) {
                Some(_) => Grow::Done,
                None => self.grow(d, pool, rsize, stream)?,
            };
        }
        if grown != Grow::Done {
            self.stats.ooms += 1;
            let report = self.oom_report(size, rsize, grown == Grow::DriverOom);
            tracing::warn!(%report, "allocation failed: out of memory");
            return Err(AllocError::OutOfMemory(Box::new(report)));
        }
        let i = self
            .find_exhaustive(rsize, pool, stream)
            .expect("growing made room");
        Ok(self.take(i, rsize, size, stream))
    }

    // ----- free -----

    /// Why `ptr` is not a live allocation.
    fn diagnose(&self, ptr: u64) -> AllocError {
        let Some((&ha, &hid)) = self.mapped.range(..=ptr).next_back() else {
            return AllocError::InvalidPointer {
                ptr,
                reason: "not inside memory of this allocator",
            };
        };
        if ptr >= ha + self.hsize(hid) {
            return AllocError::InvalidPointer {
                ptr,
                reason: "not inside memory of this allocator",
            };
        }
        // Find the block containing ptr by walking the run from the handle's start.
        let mut cands = Vec::new();
        for b in self.bins.iter().flatten() {
            b.collect(&self.blocks, &mut cands);
        }
        let in_free = cands.iter().any(|&i| {
            let b = &self.blocks[i as usize];
            b.addr <= ptr && ptr < b.addr + b.size
        }) || self.pending.iter().any(|p| {
            let b = &self.blocks[p.block as usize];
            b.addr <= ptr && ptr < b.addr + b.size
        });
        if in_free {
            AllocError::DoubleFree { ptr }
        } else {
            AllocError::InvalidPointer {
                ptr,
                reason: "points inside a live allocation, not at its start",
            }
        }
    }

    /// Free the allocation at `ptr`, whose last use is on `stream`.
    pub(crate) fn free<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        ptr: u64,
        stream: Stream,
    ) -> Result<()> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        let Some(&i) = self.live.get(&ptr) else {
            return Err(self.diagnose(ptr));
        };
        let State::Live {
            requested,
            stream: s0,
        } = self.blocks[i as usize].state
        else {
            unreachable!("live map points at a block that is not live")
        };
        let extra = self.extra.get(&i);
        let single = stream == s0 && extra.is_none_or(|v| v.iter().all(|&s| s == s0));
        let size = self.blocks[i as usize].size;
        if single {
            let o = self.owner_for(s0);
            self.owners[o].free_seq += 1;
            let seq = self.owners[o].free_seq;
            self.blocks[i as usize].state = State::Free {
                owner: o as u16,
                seq,
            };
            self.coalesce_insert(i);
        } else {
            // Uses on several streams: fence each now; reusable once all have completed.
            let mut streams = vec![s0, stream];
            streams.extend(extra.into_iter().flatten().copied());
            streams.sort();
            streams.dedup();
            let mut events = Vec::with_capacity(streams.len());
            for s in streams {
                match self.drv(DriverOp::RecordEvent, || d.record_event(s)) {
                    Ok(e) => events.push(e),
                    Err(err) => {
                        for e in events {
                            self.destroy_event(d, e);
                        }
                        return Err(err.into());
                    }
                }
            }
            self.blocks[i as usize].state = State::Pending;
            self.pending.push(PendingFree { block: i, events });
            self.stats.pending_free += size;
        }
        self.live.remove(&ptr);
        self.extra.remove(&i);
        let s = &mut self.stats;
        s.requested.sub(requested);
        s.allocated.sub(size);
        s.live_allocations.sub(1);
        s.frees += 1;
        Ok(())
    }

    /// Wait until every free made on `stream` is usable by everyone; afterwards the allocator
    /// never touches `stream` again (unless it is used again), so it may be destroyed.
    pub(crate) fn retire_stream<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        stream: Stream,
    ) -> Result<()> {
        if let Some(k) = self.owner_index(stream) {
            self.poll_owner(d, k, true)?;
            if let Some((e, _)) = self.owners[k].fence.take() {
                self.destroy_event(d, e);
            }
        }
        let uses = |p: &PendingFree| !p.events.is_empty();
        if self.pending.iter().any(uses) {
            self.poll_pending(d, true)?;
        }
        Ok(())
    }

    /// Note that the live allocation at `ptr` is also used on `stream`.
    pub(crate) fn record_stream(&mut self, ptr: u64, stream: Stream) -> Result<()> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        let Some(&i) = self.live.get(&ptr) else {
            return Err(self.diagnose(ptr));
        };
        let v = self.extra.entry(i).or_default();
        if !v.contains(&stream) {
            v.push(stream);
        }
        Ok(())
    }

    /// Size in bytes usable at `ptr` (the rounded block size), if it is live.
    pub(crate) fn usable_size(&self, ptr: u64) -> Option<u64> {
        self.live.get(&ptr).map(|&i| self.blocks[i as usize].size)
    }

    // ----- fences -----

    /// Destroy an event; if the driver refuses, keep it to retry later (never leak it).
    fn destroy_event<D: Driver + ?Sized>(&mut self, d: &D, e: EventId) {
        if let Err(err) = self.drv(DriverOp::DestroyEvent, || d.destroy_event(e)) {
            tracing::warn!(%err, "could not destroy an event; will retry");
            self.zombies.push(e);
        }
    }

    /// Retry destroying events whose destroy failed before.
    fn retry_zombies<D: Driver + ?Sized>(&mut self, d: &D) {
        for e in std::mem::take(&mut self.zombies) {
            self.destroy_event(d, e);
        }
    }

    /// Move owner `k`'s free blocks with `seq <= covered` to the clean pool.
    fn migrate(&mut self, k: usize, covered: u64) {
        let mut list = Vec::new();
        for p in 0..POOLS {
            self.bins[k][p].collect(&self.blocks, &mut list);
        }
        for i in list {
            if let State::Free { owner, seq } = self.blocks[i as usize].state {
                if owner as usize == k && seq <= covered {
                    let pool = self.blocks[i as usize].pool as usize;
                    self.bins[k][pool].remove(&mut self.blocks, i);
                    self.blocks[i as usize].state = State::Free { owner: 0, seq: 0 };
                    self.coalesce_insert(i);
                }
            }
        }
    }

    /// Fence streams with unfenced frees, and make clean whatever has completed. With
    /// `wait`, block until every free so far is clean.
    fn poll<D: Driver + ?Sized>(&mut self, d: &D, wait: bool) -> Result<()> {
        if !self.zombies.is_empty() {
            self.retry_zombies(d);
        }
        if !self.quarantine.is_empty() {
            self.retry_quarantine(d);
        }
        for k in 1..self.owners.len() {
            self.poll_owner(d, k, wait)?;
        }
        if !self.ghosts.is_empty() {
            self.poll_ghosts(d, wait)?;
        }
        self.poll_pending(d, wait)
    }

    /// Fence stream owner `k`'s frees and make clean what has completed (see `poll`).
    fn poll_owner<D: Driver + ?Sized>(&mut self, d: &D, k: usize, wait: bool) -> Result<()> {
        {
            loop {
                let dirty = self.bins[k].iter().any(|b| b.count > 0);
                if self.owners[k].fence.is_none() {
                    if !dirty {
                        break;
                    }
                    let s = self.owners[k].stream;
                    let e = self.drv(DriverOp::RecordEvent, || d.record_event(s))?;
                    self.owners[k].fence = Some((e, self.owners[k].free_seq));
                }
                let (e, covered) = self.owners[k].fence.expect("fence set above");
                let done = self.event_done(d, e, wait)?;
                if !done {
                    break;
                }
                self.owners[k].fence = None;
                self.destroy_event(d, e);
                self.migrate(k, covered);
                // Frees after the fence are still dirty: go round and fence them too.
            }
        }
        Ok(())
    }

    /// Whether event `e` has completed; with `wait`, block until it has.
    fn event_done<D: Driver + ?Sized>(&mut self, d: &D, e: EventId, wait: bool) -> Result<bool> {
        if wait {
            self.drv(DriverOp::WaitEvent, || d.wait_event(e))?;
            self.stats.event_waits += 1;
            Ok(true)
        } else {
            Ok(self.drv(DriverOp::QueryEvent, || d.query_event(e))?)
        }
    }

    /// Make clean the multi-stream frees whose events have all completed (all, with `wait`).
    fn poll_pending<D: Driver + ?Sized>(&mut self, d: &D, wait: bool) -> Result<()> {
        let mut j = 0;
        while j < self.pending.len() {
            let mut all = true;
            for idx in 0..self.pending[j].events.len() {
                let e = self.pending[j].events[idx];
                let done = self.event_done(d, e, wait)?;
                if !done {
                    all = false;
                    break;
                }
            }
            if all {
                let p = self.pending.swap_remove(j);
                for e in p.events {
                    self.destroy_event(d, e);
                }
                let size = self.blocks[p.block as usize].size;
                self.stats.pending_free -= size;
                self.blocks[p.block as usize].state = State::Free { owner: 0, seq: 0 };
                self.coalesce_insert(p.block);
            } else {
                j += 1;
            }
        }
        Ok(())
    }

    // ----- growing -----

    /// Whole handles that hold no live byte and are clean: inside clean free blocks, or
    /// unmapped; with `dirty_for`, also those inside free blocks that stream freed and the
    /// device may still be using (movable by aliasing only, see `Ghost`).
    fn free_handles(&self, dirty_for: Option<Stream>) -> Vec<Cand> {
        let mut list = Vec::new();
        for p in 0..POOLS {
            self.bins[0][p].collect(&self.blocks, &mut list);
        }
        if let Some(k) = dirty_for.and_then(|s| self.owner_index(s)) {
            for p in 0..POOLS {
                self.bins[k][p].collect(&self.blocks, &mut list);
            }
        }
        let mut out = Vec::new();
        for i in list {
            let b = &self.blocks[i as usize];
            let end = b.addr + b.size;
            let State::Free { owner, .. } = b.state else {
                unreachable!("listed block is not free")
            };
            for (&ha, &hid) in self.mapped.range(b.addr..end) {
                let size = self.hsize(hid);
                if ha + size <= end {
                    out.push(Cand {
                        hid,
                        size,
                        block: i,
                        addr: ha,
                        owner,
                    });
                }
            }
        }
        for &hid in &self.unmapped {
            out.push(Cand {
                hid,
                size: self.hsize(hid),
                block: NIL,
                addr: 0,
                owner: 0,
            });
        }
        out
    }

    fn grow<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        pool: Pool,
        rsize: u64,
        stream: Stream,
    ) -> Result<Grow> {
        match pool {
            Pool::Small | Pool::Medium => self.grow_paged(d, pool, rsize),
            Pool::Large if self.cfg.stitching => self.stitch(d, rsize, stream),
            Pool::Large => self.grow_plain(d, rsize),
        }
    }

    fn headroom(&self) -> u64 {
        self.cfg.capacity - self.stats.reserved.current
    }

    /// Pick free handles to cover `need` bytes: clean ones before dirty ones (which leave a
    /// ghost behind); among each, unmapped ones first (no unmap needed), then the one that
    /// covers the remainder most tightly, else the largest, repeatedly.
    fn choose(cands: Vec<Cand>, need: u64) -> Vec<Cand> {
        let (clean, dirty): (Vec<Cand>, Vec<Cand>) = cands.into_iter().partition(|c| c.owner == 0);
        let mut chosen = Self::choose_among(clean, need);
        let taken: u64 = chosen.iter().map(|c| c.size).sum();
        if taken < need {
            chosen.extend(Self::choose_among(dirty, need - taken));
        }
        chosen
    }

    fn choose_among(mut cands: Vec<Cand>, need: u64) -> Vec<Cand> {
        cands.sort_by_key(|c| (c.block != NIL, std::cmp::Reverse(c.size)));
        let mut chosen = Vec::new();
        let mut left = need;
        // Unmapped handles cost no unmap: take them all first if they help.
        while left > 0 && cands.first().is_some_and(|c| c.block == NIL) {
            let c = cands.remove(0);
            left = left.saturating_sub(c.size);
            chosen.push(c);
        }
        while left > 0 && !cands.is_empty() {
            // cands is sorted by size, descending: the tightest fit is the last that fits.
            let pick = cands.iter().rposition(|c| c.size >= left).unwrap_or(0);
            let c = cands.remove(pick);
            left = left.saturating_sub(c.size);
            chosen.push(c);
        }
        chosen
    }

    /// Large-pool growth with stitching: remap free handles into one new span, creating
    /// only the shortfall.
    fn stitch<D: Driver + ?Sized>(&mut self, d: &D, rsize: u64, stream: Stream) -> Result<Grow> {
        let g = self.cfg.granularity;
        let need = round_up(rsize, g);
        let cands = self.free_handles(Some(stream));
        let free_total: u64 = cands.iter().map(|c| c.size).sum();
        let headroom = self.headroom();
        if self.may_create(rsize) {
            // Within the growth budget: new memory, one or a few calls, no remapping; grown
            // in place after a free block that ends its run when possible. If the driver
            // refuses (another process holds memory), fall through to reusing free handles.
            let mut r = None;
            if let Some((b, ext)) = self.extension_target(rsize) {
                let create = ext.max(self.cfg.min_handle.min(headroom));
                let x = &self.blocks[b as usize];
                if create <= headroom && self.va.is_free(x.addr + x.size, create) {
                    r = Some(self.build(d, Vec::new(), create, Pool::Large, Some(b))?);
                }
            }
            if r.is_none() {
                let create = need.max(self.cfg.min_handle.min(headroom));
                r = Some(self.build(d, Vec::new(), create, Pool::Large, None)?);
            }
            if r != Some(Grow::DriverOom) {
                return Ok(r.expect("set above"));
            }
        }
        // Best: grow a free block that ends its run, in place, by the missing part only.
        if let Some((b, ext)) = self.extension_target(rsize) {
            let others: Vec<Cand> = cands.iter().copied().filter(|c| c.block != b).collect();
            let other_total: u64 = others.iter().map(|c| c.size).sum();
            if other_total + headroom >= ext {
                let chosen = if other_total == 0 {
                    Vec::new()
                } else {
                    Self::choose(others, ext)
                };
                let taken: u64 = chosen.iter().map(|c| c.size).sum();
                let short = ext.saturating_sub(taken);
                let create = if short > 0 {
                    short.max(self.cfg.min_handle.min(headroom))
                } else {
                    0
                };
                let x = &self.blocks[b as usize];
                if self.va.is_free(x.addr + x.size, taken + create) {
                    return self.build(d, chosen, create, Pool::Large, Some(b));
                }
            }
        }
        if free_total + headroom < need {
            return Ok(Grow::Short);
        }
        let chosen = if free_total == 0 {
            Vec::new()
        } else {
            Self::choose(cands, need)
        };
        let taken: u64 = chosen.iter().map(|c| c.size).sum();
        let short = need.saturating_sub(taken);
        let create = if short > 0 {
            short.max(self.cfg.min_handle.min(headroom))
        } else {
            0
        };
        self.build(d, chosen, create, Pool::Large, None)
    }

    /// The largest clean free block of the large pool that ends its run with enough free
    /// address space after it to grow to `rsize` bytes; returns it and the bytes to add.
    fn extension_target(&self, rsize: u64) -> Option<(u32, u64)> {
        let g = self.cfg.granularity;
        let mut list = Vec::new();
        self.bins[0][Pool::Large as usize].collect(&self.blocks, &mut list);
        let mut best: Option<(u32, u64)> = None;
        for i in list {
            let b = &self.blocks[i as usize];
            // Only worth it when the block is a large part of the request; a small leftover
            // would make the new allocation share a handle with its neighbour.
            if b.next != NIL || b.size >= rsize || b.size < rsize / 2 {
                continue;
            }
            let ext = round_up(rsize - b.size, g);
            let end = b.addr + b.size;
            if end % g != 0 || !self.va.is_free(end, ext) {
                continue;
            }
            if best.is_none_or(|(j, _)| self.blocks[j as usize].size < b.size) {
                best = Some((i, ext));
            }
        }
        best
    }

    /// Large-pool growth without stitching: create new memory; if the capacity is reached,
    /// release free handles first (what a plain caching allocator does on a miss).
    fn grow_plain<D: Driver + ?Sized>(&mut self, d: &D, rsize: u64) -> Result<Grow> {
        let g = self.cfg.granularity;
        let need = round_up(rsize, g);
        if self.headroom() < need {
            let cands = self.free_handles(None);
            let free_total: u64 = cands.iter().map(|c| c.size).sum();
            if free_total + self.headroom() < need {
                return Ok(Grow::Short);
            }
            let chosen = Self::choose(cands, need - self.headroom());
            self.release_cands(d, chosen)?;
        }
        let create = need.max(self.cfg.min_handle.min(self.headroom()));
        self.build_span(d, Vec::new(), create, Pool::Large)
    }

    /// A new page for a paged pool (small or medium) that fits `rsize`: a free handle of at
    /// most a page reused where it sits (no driver call), an unmapped one mapped, a new page
    /// created; at the capacity, a larger free handle reused in place, else free handles
    /// stitched into a span of the pool.
    fn grow_paged<D: Driver + ?Sized>(&mut self, d: &D, pool: Pool, rsize: u64) -> Result<Grow> {
        let page = match pool {
            Pool::Small => self.cfg.small_page,
            _ => self.cfg.medium_page,
        };
        let g = self.cfg.granularity;
        let cands = self.free_handles(None);
        let fits = |c: &&Cand| c.size >= rsize;
        if let Some(c) = cands
            .iter()
            .filter(fits)
            .filter(|c| c.block != NIL && c.size <= page)
            .min_by_key(|c| c.size)
            .copied()
        {
            self.retag(c, pool);
            return Ok(Grow::Done);
        }
        if let Some(c) = cands
            .iter()
            .filter(fits)
            .filter(|c| c.block == NIL && c.size <= page)
            .min_by_key(|c| c.size)
            .copied()
        {
            return self.build_span(d, vec![c], 0, pool);
        }
        let headroom = self.headroom() / g * g;
        let want = page.max(round_up(rsize, g));
        if headroom >= round_up(rsize, g) {
            let r = self.build_span(d, Vec::new(), want.min(headroom), pool)?;
            if r == Grow::Done {
                return Ok(r);
            }
        }
        // At the capacity: a larger free handle becomes a (larger) page where it sits.
        if let Some(c) = cands
            .iter()
            .filter(fits)
            .filter(|c| c.block != NIL)
            .min_by_key(|c| c.size)
            .copied()
        {
            self.retag(c, pool);
            return Ok(Grow::Done);
        }
        // Else stitch free handles (unmapped first) into one span for this pool.
        let need = round_up(rsize, g);
        let total: u64 = cands.iter().map(|c| c.size).sum();
        if total + self.headroom() < need {
            return Ok(Grow::Short);
        }
        let chosen = Self::choose(cands, need);
        let taken: u64 = chosen.iter().map(|c| c.size).sum();
        let create = need.saturating_sub(taken);
        self.build_span(d, chosen, create, pool)
    }

    /// Turn a free mapped handle into a page of `pool` where it sits.
    fn retag(&mut self, c: Cand, pool: Pool) {
        let m = self.carve(c.block, c.addr, c.size);
        self.blocks[m as usize].pool = pool;
        self.bins[0][pool as usize].insert(&mut self.blocks, m);
        tracing::debug!(size = c.size, ?pool, "free handle reused as a page");
    }

    /// Cut the handle at `[haddr, haddr+hsize)` out of free block `b`, which contains it.
    /// Returns a new standalone free block (same owner) covering exactly the handle, in no
    /// list; the pieces of `b` around it stay listed (`b` keeps the piece below, if any).
    fn carve(&mut self, b: u32, haddr: u64, hsize: u64) -> u32 {
        let (addr, size, prev, next, pool, state) = {
            let x = &self.blocks[b as usize];
            (x.addr, x.size, x.prev, x.next, x.pool, x.state)
        };
        let State::Free { owner, .. } = state else {
            unreachable!("carve of a block that is not free")
        };
        let o = owner as usize;
        debug_assert!(addr <= haddr && haddr + hsize <= addr + size);
        self.bins[o][pool as usize].remove(&mut self.blocks, b);
        let below = haddr - addr;
        let above = addr + size - (haddr + hsize);
        let clean = state;
        let m = if below > 0 {
            let x = &mut self.blocks[b as usize];
            x.size = below;
            x.next = NIL;
            self.bins[o][pool as usize].insert(&mut self.blocks, b);
            self.new_block(Block {
                addr: haddr,
                size: hsize,
                prev: NIL,
                next: NIL,
                fprev: NIL,
                fnext: NIL,
                pool,
                state: clean,
            })
        } else {
            if prev != NIL {
                self.blocks[prev as usize].next = NIL;
            }
            let x = &mut self.blocks[b as usize];
            x.size = hsize;
            x.prev = NIL;
            x.next = NIL;
            b
        };
        if above > 0 {
            let r = self.new_block(Block {
                addr: haddr + hsize,
                size: above,
                prev: NIL,
                next,
                fprev: NIL,
                fnext: NIL,
                pool,
                state: clean,
            });
            if next != NIL {
                self.blocks[next as usize].prev = r;
            }
            self.bins[o][pool as usize].insert(&mut self.blocks, r);
        } else if next != NIL {
            self.blocks[next as usize].prev = NIL;
        }
        m
    }

    /// Carve a mapped candidate out of its block and unmap it. On an unmap failure the
    /// handle stays mapped as a standalone clean free block.
    fn detach<D: Driver + ?Sized>(&mut self, d: &D, c: Cand) -> DriverResult<()> {
        let m = self.carve(c.block, c.addr, c.size);
        match self.drv(DriverOp::Unmap, || d.unmap(c.addr, c.size)) {
            Ok(()) => {
                self.vacate(m);
                self.mapped.remove(&c.addr);
                self.handles[c.hid as usize].as_mut().expect("handle").at = None;
                self.va.free(c.addr, c.size);
                self.stats.mapped.sub(c.size);
                Ok(())
            }
            Err(e) => {
                let pool = self.blocks[m as usize].pool as usize;
                self.bins[0][pool].insert(&mut self.blocks, m);
                Err(e)
            }
        }
    }

    /// Sort mapped candidates so that carving one never moves another to a new block:
    /// within a block, from the highest address down.
    fn carve_order(chosen: &mut [Cand]) {
        chosen.sort_by_key(|c| (c.block != NIL, c.block, std::cmp::Reverse(c.addr)));
    }

    /// Unmap (if mapped) and release the given free handles. Old mappings of them (ghosts)
    /// are waited for and unmapped first: a mapped handle cannot be released.
    fn release_cands<D: Driver + ?Sized>(&mut self, d: &D, mut chosen: Vec<Cand>) -> Result<u64> {
        if chosen.iter().any(|c| self.hrec(c.hid).ghosts > 0) {
            self.poll_ghosts(d, true)?;
            chosen.retain(|c| self.hrec(c.hid).ghosts == 0);
        }
        Self::carve_order(&mut chosen);
        let mut released = 0;
        for c in chosen {
            if c.block == NIL {
                self.unmapped.retain(|&h| h != c.hid);
            } else {
                self.detach(d, c)?;
            }
            self.release_handle(d, c.hid)?;
            released += c.size;
        }
        Ok(released)
    }

    /// Build one new mapped run in `pool` from the `chosen` free handles (unmapping them
    /// first) plus `create` new bytes. Any driver failure leaves every handle owned (mapped
    /// where it was, or in `unmapped`) and the engine consistent.
    fn build_span<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        chosen: Vec<Cand>,
        create: u64,
        pool: Pool,
    ) -> Result<Grow> {
        self.build(d, chosen, create, pool, None)
    }

    /// Like `build_span`, or, with `extend = Some(b)`, map the handles right after clean free
    /// block `b` (which ends its run and has free address space after it) and grow `b`.
    fn build<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        mut chosen: Vec<Cand>,
        create: u64,
        pool: Pool,
        extend: Option<u32>,
    ) -> Result<Grow> {
        let _span =
            tracing::debug_span!("build_span", moved = chosen.len(), create, ?pool).entered();
        // 1. Create the shortfall, in handles of at most max_handle bytes.
        let mut fresh = Vec::new();
        let mut left = create;
        while left > 0 {
            let sz = left.min(self.cfg.max_handle);
            match self.drv(DriverOp::Create, || d.create(sz)) {
                Ok(h) => {
                    tracing::debug!(size = sz, "created a handle");
                    fresh.push(self.add_handle(h, sz));
                    left -= sz;
                }
                Err(e) => {
                    for hid in fresh {
                        let _ = self.release_handle(d, hid);
                    }
                    if e.code == crate::driver::code::OUT_OF_MEMORY {
                        tracing::warn!(%e, "driver out of memory below the allocator's capacity");
                        return Ok(Grow::DriverOom);
                    }
                    return Err(e.into());
                }
            }
        }
        // 2. Unmap the chosen clean handles from wherever they sit. Dirty ones (freed on the
        //    requesting stream, maybe still in use by work queued there) stay mapped where
        //    they are until an event recorded now completes: they are mapped at the new
        //    address too, and later work on that stream is ordered after the old work.
        let dirty = chosen.iter().find(|c| c.owner != 0).map(|c| c.owner);
        let ghost_event = match dirty {
            Some(k) => {
                let s = self.owners[k as usize].stream;
                match self.drv(DriverOp::RecordEvent, || d.record_event(s)) {
                    Ok(e) => Some(e),
                    Err(e) => {
                        self.unmapped.extend(fresh);
                        return Err(e.into());
                    }
                }
            }
            None => None,
        };
        Self::carve_order(&mut chosen);
        let moved = chosen.iter().filter(|c| c.block != NIL).count() as u64;
        // Unmapped handles (they go back to `unmapped` if the build fails), and the dirty
        // ones carved out of their blocks, still mapped there: (standalone block, candidate).
        let mut hids = Vec::with_capacity(chosen.len() + fresh.len());
        let mut aliased: Vec<(u32, Cand)> = Vec::new();
        for c in chosen {
            if c.block == NIL {
                self.unmapped.retain(|&h| h != c.hid);
            } else if c.owner != 0 {
                let m = self.carve(c.block, c.addr, c.size);
                aliased.push((m, c));
                continue;
            } else if let Err(e) = self.detach(d, c) {
                self.unalias(d, aliased, ghost_event);
                self.unmapped.extend(hids);
                self.unmapped.extend(fresh);
                return Err(e.into());
            }
            hids.push(c.hid);
        }
        let aliased_hids: Vec<u32> = aliased.iter().map(|(_, c)| c.hid).collect();
        // Mapping order in the new span: moved handles (unmapped ones, then aliases), then
        // the fresh ones.
        let order: Vec<u32> = hids
            .iter()
            .chain(&aliased_hids)
            .chain(&fresh)
            .copied()
            .collect();
        hids.extend(fresh);
        // 3. Map them side by side in fresh address space (or right after the block being
        //    extended), then grant access once.
        let total: u64 = order.iter().map(|&h| self.hsize(h)).sum();
        let placed = match extend {
            Some(b) => {
                let x = &self.blocks[b as usize];
                let end = x.addr + x.size;
                if self.va.take_exact(end, total) {
                    Ok(end)
                } else {
                    self.va_alloc(d, total)
                }
            }
            None => self.va_alloc(d, total),
        };
        let extend = extend.filter(|&b| {
            placed.as_ref().is_ok_and(|&p| {
                let x = &self.blocks[b as usize];
                p == x.addr + x.size
            })
        });
        let base = match placed {
            Ok(b) => b,
            Err(e) => {
                self.unalias(d, aliased, ghost_event);
                self.unmapped.extend(hids);
                return Err(e);
            }
        };
        let mut off = 0;
        let mut done = Vec::with_capacity(order.len());
        let mut failed = None;
        for &hid in &order {
            let (h, size) = (self.hrec(hid).handle, self.hsize(hid));
            if let Err(e) = self.drv(DriverOp::Map, || d.map(base + off, size, h)) {
                failed = Some(e);
                break;
            }
            done.push((base + off, hid));
            off += size;
        }
        if failed.is_none() {
            if let Err(e) = self.drv(DriverOp::SetAccess, || d.set_access(base, total)) {
                failed = Some(e);
            }
        }
        if let Some(e) = failed {
            self.rollback_span(d, base, total, &done, &aliased_hids);
            self.unmapped
                .extend(hids.iter().filter(|h| !self.quarantine.contains(h)));
            self.unalias(d, aliased, ghost_event);
            return Err(e.into());
        }
        // The dirty handles' old mappings become ghosts.
        let mut aliased_bytes = 0;
        for (m, c) in &aliased {
            self.vacate(*m);
            self.mapped.remove(&c.addr);
            self.stats.mapped.sub(c.size);
            self.handles[c.hid as usize]
                .as_mut()
                .expect("handle")
                .ghosts += 1;
            self.ghosts.push(Ghost {
                addr: c.addr,
                size: c.size,
                hid: c.hid,
                event: ghost_event,
                stream: self.owners[c.owner as usize].stream,
            });
            aliased_bytes += c.size;
        }
        self.stats.aliased_handles += aliased.len() as u64;
        for (addr, hid) in done {
            self.mapped.insert(addr, hid);
            self.handles[hid as usize].as_mut().expect("handle").at = Some(addr);
        }
        self.stats.mapped.add(total);
        if moved > 0 {
            self.stats.stitches += 1;
            self.stats.stitched_handles += moved;
            tracing::debug!(moved, total, "stitched free handles into a new span");
        }
        // Memory the device may still use is usable by the freeing stream only, until a fence.
        let state = match dirty {
            Some(k) if aliased_bytes > 0 => State::Free {
                owner: k,
                seq: self.owners[k as usize].free_seq,
            },
            _ => State::Free { owner: 0, seq: 0 },
        };
        match extend {
            Some(b) => {
                // `b` is still a clean free block ending its run (carving only ever removes
                // handles that lie wholly inside other blocks, or splits off pieces below).
                self.bins[0][pool as usize].remove(&mut self.blocks, b);
                self.blocks[b as usize].size += total;
                self.blocks[b as usize].state = state;
                self.coalesce_insert(b);
                self.stats.extensions += 1;
            }
            None => {
                let i = self.new_block(Block {
                    addr: base,
                    size: total,
                    prev: NIL,
                    next: NIL,
                    fprev: NIL,
                    fnext: NIL,
                    pool,
                    state,
                });
                self.bins[state_owner(state)][pool as usize].insert(&mut self.blocks, i);
            }
        }
        Ok(Grow::Done)
    }

    /// Undo the maps of a span that failed to build; give back its address space. A handle
    /// whose unmap fails too is quarantined (mapped, no access) and retried later.
    ///
    /// `aliased` handles are still mapped at their old address too: a failed unmap of their
    /// new mapping leaves a ghost with no work behind it, retried at the next slow path.
    fn rollback_span<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        base: u64,
        total: u64,
        done: &[(u64, u32)],
        aliased: &[u32],
    ) {
        let mut cursor = base;
        for &(addr, hid) in done {
            let size = self.hsize(hid);
            if self.drv(DriverOp::Unmap, || d.unmap(addr, size)).is_err() {
                if aliased.contains(&hid) {
                    tracing::error!(
                        addr,
                        size,
                        "rollback unmap of an alias failed; retried later"
                    );
                    self.handles[hid as usize].as_mut().expect("handle").ghosts += 1;
                    self.ghosts.push(Ghost {
                        addr,
                        size,
                        hid,
                        event: None,
                        stream: Stream::DEFAULT,
                    });
                    if addr > cursor {
                        self.va.free(cursor, addr - cursor);
                    }
                    cursor = addr + size;
                    continue;
                }
                tracing::error!(addr, size, "rollback unmap failed; handle quarantined");
                self.handles[hid as usize].as_mut().expect("handle").at = Some(addr);
                self.quarantine.push(hid);
                if addr > cursor {
                    self.va.free(cursor, addr - cursor);
                }
                cursor = addr + size;
            }
        }
        if base + total > cursor {
            self.va.free(cursor, base + total - cursor);
        }
    }

    /// Undo the carving of dirty candidates after a failed build: each is still mapped where
    /// it was, and goes back to its owner's free list as a standalone block.
    fn unalias<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        aliased: Vec<(u32, Cand)>,
        event: Option<EventId>,
    ) {
        for (m, _) in aliased {
            let o = state_owner(self.blocks[m as usize].state);
            let pool = self.blocks[m as usize].pool as usize;
            self.bins[o][pool].insert(&mut self.blocks, m);
        }
        if let Some(e) = event {
            self.destroy_event(d, e);
        }
    }

    /// Unmap the ghosts whose work has completed (all of them, waiting, with `wait`).
    /// Events of one stream complete in the order they were recorded (the ghosts' order),
    /// so after the first one not done, that stream's later ones are not asked about.
    fn poll_ghosts<D: Driver + ?Sized>(&mut self, d: &D, wait: bool) -> Result<()> {
        let mut events: Vec<(Option<EventId>, Stream)> = Vec::new();
        for g in &self.ghosts {
            if !events.iter().any(|&(e, _)| e == g.event) {
                events.push((g.event, g.stream));
            }
        }
        let mut behind: Vec<Stream> = Vec::new();
        for (ev, stream) in events {
            if let Some(e) = ev {
                if behind.contains(&stream) {
                    continue;
                }
                if !self.event_done(d, e, wait)? {
                    behind.push(stream);
                    continue;
                }
            }
            let mut left = false;
            let mut j = 0;
            while j < self.ghosts.len() {
                if self.ghosts[j].event != ev {
                    j += 1;
                    continue;
                }
                let (addr, size, hid) = {
                    let g = &self.ghosts[j];
                    (g.addr, g.size, g.hid)
                };
                if self.drv(DriverOp::Unmap, || d.unmap(addr, size)).is_err() {
                    tracing::warn!(addr, size, "unmapping an old mapping failed; retried later");
                    left = true;
                    j += 1;
                    continue;
                }
                self.ghosts.remove(j); // keeps the record order poll_ghosts relies on
                self.handles[hid as usize].as_mut().expect("handle").ghosts -= 1;
                self.va.free(addr, size);
            }
            if let (Some(e), false) = (ev, left) {
                self.destroy_event(d, e);
            }
        }
        Ok(())
    }

    // ----- maintenance -----

    /// Release every free handle (and retry quarantined ones). Returns bytes released.
    pub(crate) fn empty_cache<D: Driver + ?Sized>(&mut self, d: &D) -> Result<u64> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        self.poll(d, false)?;
        self.retry_quarantine(d);
        let cands = self.free_handles(None);
        let released = self.release_cands(d, cands)?;
        tracing::debug!(released, "empty_cache");
        Ok(released)
    }

    /// Retry unmapping quarantined handles; those that succeed become ordinary unmapped
    /// handles, usable by the next stitch (or released by `empty_cache`).
    fn retry_quarantine<D: Driver + ?Sized>(&mut self, d: &D) {
        for hid in std::mem::take(&mut self.quarantine) {
            let (addr, size) = (
                self.hrec(hid).at.expect("quarantined is mapped"),
                self.hsize(hid),
            );
            if self.drv(DriverOp::Unmap, || d.unmap(addr, size)).is_err() {
                self.quarantine.push(hid);
                continue;
            }
            self.handles[hid as usize].as_mut().expect("handle").at = None;
            self.va.free(addr, size);
            self.unmapped.push(hid);
        }
    }

    /// Give everything back to the driver. Returns (leaked allocations, their bytes).
    pub(crate) fn teardown<D: Driver + ?Sized>(&mut self, d: &D) -> (u64, u64) {
        let leaked = (self.live.len() as u64, self.stats.requested.current);
        if let Err(e) = self.poll(d, true) {
            tracing::error!(%e, "waiting for outstanding frees failed during teardown");
        }
        for k in 1..self.owners.len() {
            if let Some((e, _)) = self.owners[k].fence.take() {
                self.destroy_event(d, e);
            }
        }
        for p in std::mem::take(&mut self.pending) {
            for e in p.events {
                self.destroy_event(d, e);
            }
        }
        self.retry_zombies(d);
        self.retry_quarantine(d);
        if !self.ghosts.is_empty() {
            // Unmaps that failed in the poll above: one more try, then give up on them.
            if let Err(e) = self.poll_ghosts(d, true) {
                tracing::error!(%e, "unmapping old mappings failed during teardown");
            }
            let mut evs: Vec<EventId> = self.ghosts.iter().filter_map(|g| g.event).collect();
            evs.sort_by_key(|e| e.raw());
            evs.dedup();
            for e in evs {
                self.destroy_event(d, e);
            }
        }
        for (addr, hid) in std::mem::take(&mut self.mapped) {
            let size = self.hsize(hid);
            match self.drv(DriverOp::Unmap, || d.unmap(addr, size)) {
                Ok(()) => {
                    self.handles[hid as usize].as_mut().expect("handle").at = None;
                    self.stats.mapped.sub(size);
                    self.unmapped.push(hid);
                }
                Err(e) => tracing::error!(%e, addr, "unmap failed during teardown"),
            }
        }
        for hid in std::mem::take(&mut self.unmapped) {
            if let Err(e) = self.release_handle(d, hid) {
                tracing::error!(%e, "release failed during teardown");
            }
        }
        for (base, size) in self.va.take_reservations() {
            if let Err(e) = self.drv(DriverOp::FreeReservation, || d.free_reservation(base, size)) {
                tracing::error!(%e, base, "freeing a reservation failed during teardown");
            }
        }
        self.blocks.clear();
        self.vacant.clear();
        self.live.clear();
        self.extra.clear();
        for b in &mut self.bins {
            *b = Default::default();
        }
        // Leaked allocations are gone with their memory.
        let s = &mut self.stats;
        s.requested.current = 0;
        s.allocated.current = 0;
        s.live_allocations.current = 0;
        s.pending_free = 0;
        self.shut_down = true;
        leaked
    }

    // ----- reports -----

    /// Ids of handles overlapped by a live or pending block.
    fn live_handles(&self) -> Vec<bool> {
        let mut holds = vec![false; self.handles.len()];
        let busy = self
            .live
            .values()
            .copied()
            .chain(self.pending.iter().map(|p| p.block));
        for i in busy {
            let b = &self.blocks[i as usize];
            let start = self
                .mapped
                .range(..=b.addr)
                .next_back()
                .map_or(b.addr, |(&a, _)| a);
            for (_, &hid) in self.mapped.range(start..b.addr + b.size) {
                holds[hid as usize] = true;
            }
        }
        holds
    }

    /// Heap bytes held by the engine's own structures (capacities, not lengths; B-tree and
    /// hash-map nodes estimated from their entry counts).
    pub(crate) fn metadata_bytes(&self) -> u64 {
        use std::mem::size_of;
        let vec = |cap: usize, each: usize| (cap * each) as u64;
        vec(self.blocks.capacity(), size_of::<Block>())
            + vec(self.vacant.capacity(), 4)
            // hashbrown: one control byte plus the entry per bucket, ~1/0.875 buckets per entry
            + vec(self.live.capacity(), 8 + 4 + 1) * 8 / 7
            + vec(self.bins.capacity(), size_of::<[Bins; POOLS]>())
            + vec(self.owners.capacity(), size_of::<Owner>())
            + vec(self.handles.capacity(), size_of::<Option<HandleRec>>())
            + vec(self.free_hids.capacity(), 4)
            // B-tree: about 1.5x the raw entry size
            + vec(self.mapped.len(), 12) * 3 / 2
            + vec(self.unmapped.capacity() + self.quarantine.capacity(), 4)
            + vec(self.pending.capacity(), size_of::<PendingFree>())
            + self.va.metadata_bytes()
    }

    pub(crate) fn detailed(&self) -> DetailedStats {
        let holds = self.live_handles();
        let mut live_handle_bytes = 0;
        let mut free_handles = 0;
        let mut free_handle_bytes = 0;
        for (hid, h) in self.handles.iter().enumerate() {
            if let Some(h) = h {
                if holds[hid] {
                    live_handle_bytes += h.size;
                } else {
                    free_handles += 1;
                    free_handle_bytes += h.size;
                }
            }
        }
        let mut free_spans = 0;
        let mut free_bytes = 0;
        for bins in &self.bins {
            for b in bins {
                free_spans += b.count as u64;
                free_bytes += b.bytes;
            }
        }
        let largest = self
            .bins
            .iter()
            .map(|b| b[Pool::Large as usize].largest(&self.blocks))
            .max()
            .unwrap_or(0);
        let mut pages = [0u64; POOLS];
        let mut page_stranded = [0u64; POOLS];
        // Pages: runs of the paged pools. Count them and their free bytes if they hold live ones.
        for b in &self.blocks {
            if b.pool != Pool::Large && b.prev == NIL && b.state != State::Vacant {
                pages[b.pool as usize] += 1;
                let mut i = Some(b);
                let mut free = 0;
                let mut any_live = false;
                while let Some(x) = i {
                    match x.state {
                        State::Free { .. } => free += x.size,
                        _ => any_live = true,
                    }
                    i = (x.next != NIL).then(|| &self.blocks[x.next as usize]);
                }
                if any_live {
                    page_stranded[b.pool as usize] += free;
                }
            }
        }
        let s = self.stats;
        let stranded = live_handle_bytes
            .saturating_sub(s.allocated.current)
            .saturating_sub(s.pending_free);
        DetailedStats {
            stats: s,
            capacity: self.cfg.capacity,
            granularity: self.cfg.granularity,
            free_spans,
            free_bytes,
            largest_free_span: largest,
            free_handles,
            free_handle_bytes,
            live_handle_bytes,
            stranded_bytes: stranded,
            rounding_waste: s.allocated.current - s.requested.current,
            small_pages: pages[Pool::Small as usize],
            small_stranded_bytes: page_stranded[Pool::Small as usize],
            medium_pages: pages[Pool::Medium as usize],
            medium_stranded_bytes: page_stranded[Pool::Medium as usize],
            unmapped_handles: (self.unmapped.len() + self.quarantine.len()) as u64,
            va_reserved: self.va.reserved(),
            metadata_bytes: self.metadata_bytes(),
            live_handle_ratio: if s.requested.current > 0 {
                live_handle_bytes as f64 / s.requested.current as f64
            } else {
                0.0
            },
        }
    }

    fn oom_report(&self, requested: u64, rsize: u64, driver_oom: bool) -> OomReport {
        let d = self.detailed();
        OomReport {
            requested,
            rounded: rsize,
            capacity: self.cfg.capacity,
            reserved: self.stats.reserved.current,
            live: self.stats.requested.current,
            live_handle_bytes: d.live_handle_bytes,
            stranded: d.stranded_bytes,
            largest_free_span: d.largest_free_span,
            driver_out_of_memory: driver_oom,
        }
    }

    pub(crate) fn snapshot(&self) -> Snapshot {
        let holds = self.live_handles();
        let handles = self
            .handles
            .iter()
            .enumerate()
            .filter_map(|(hid, h)| {
                h.as_ref().map(|h| HandleView {
                    size: h.size,
                    addr: h.at,
                    holds_live: holds[hid],
                })
            })
            .collect();
        let mut heads: Vec<&Block> = self
            .blocks
            .iter()
            .filter(|b| b.state != State::Vacant && b.prev == NIL)
            .collect();
        heads.sort_by_key(|b| b.addr);
        let runs = heads
            .into_iter()
            .map(|mut b| {
                let mut run = Vec::new();
                loop {
                    let (state, stream, requested) = match b.state {
                        State::Live { requested, stream } => {
                            ("live", Some(stream.raw()), Some(requested))
                        }
                        State::Free { owner: 0, .. } => ("free", None, None),
                        State::Free { owner, .. } => (
                            "dirty",
                            Some(self.owners[owner as usize].stream.raw()),
                            None,
                        ),
                        State::Pending => ("pending", None, None),
                        State::Vacant => unreachable!(),
                    };
                    run.push(BlockView {
                        addr: b.addr,
                        size: b.size,
                        pool: b.pool,
                        state,
                        stream,
                        requested,
                    });
                    if b.next == NIL {
                        break;
                    }
                    b = &self.blocks[b.next as usize];
                }
                run
            })
            .collect();
        Snapshot {
            detailed: self.detailed(),
            reservations: self.va.reservations.iter().map(|(&b, &s)| (b, s)).collect(),
            handles,
            runs,
        }
    }

    /// Check every invariant of every structure. Slow: for tests, fuzzing and `paranoid`.
    pub(crate) fn validate(&self) -> std::result::Result<(), String> {
        let mut requested = 0;
        let mut allocated = 0;
        let mut live_count = 0;
        let mut pending_bytes = 0;
        let mut block_bytes = 0;
        let mut spans = Vec::new();
        let mut vacant = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            let i = i as u32;
            if b.state == State::Vacant {
                vacant += 1;
                continue;
            }
            if b.size == 0 || b.size % UNIT != 0 || b.addr % UNIT != 0 {
                return Err(format!(
                    "block {i} has bad size/address {:#x}+{}",
                    b.addr, b.size
                ));
            }
            if b.prev != NIL {
                let p = &self.blocks[b.prev as usize];
                if p.state == State::Vacant
                    || p.next != i
                    || p.addr + p.size != b.addr
                    || p.pool != b.pool
                {
                    return Err(format!("block {i}: bad prev link"));
                }
            }
            if b.next != NIL {
                let n = &self.blocks[b.next as usize];
                if n.state == State::Vacant || n.prev != i || b.addr + b.size != n.addr {
                    return Err(format!("block {i}: bad next link"));
                }
            }
            match b.state {
                State::Free { owner, .. } => {
                    if owner as usize >= self.owners.len() {
                        return Err(format!("block {i}: unknown owner {owner}"));
                    }
                    for nb in [b.prev, b.next] {
                        if nb != NIL {
                            if let State::Free { owner: o2, .. } = self.blocks[nb as usize].state {
                                if o2 == owner {
                                    return Err(format!(
                                        "block {i}: free neighbours with one owner not merged"
                                    ));
                                }
                            }
                        }
                    }
                }
                State::Live { requested: r, .. } => {
                    if self.live.get(&b.addr) != Some(&i) {
                        return Err(format!("live block {i} missing from the live map"));
                    }
                    if r == 0 || round_up(r, UNIT) != b.size {
                        return Err(format!(
                            "live block {i}: {} bytes for a {r}-byte request",
                            b.size
                        ));
                    }
                    requested += r;
                    allocated += b.size;
                    live_count += 1;
                }
                State::Pending => {
                    if !self.pending.iter().any(|p| p.block == i) {
                        return Err(format!("pending block {i} is not in the pending list"));
                    }
                    pending_bytes += b.size;
                }
                State::Vacant => unreachable!(),
            }
            // The block lies in contiguously mapped handles (and in one handle if small).
            let Some((&ha, &hid)) = self.mapped.range(..=b.addr).next_back() else {
                return Err(format!("block {i} at {:#x} is not mapped", b.addr));
            };
            let mut end = ha + self.hsize(hid);
            if end <= b.addr {
                return Err(format!("block {i} at {:#x} is not mapped", b.addr));
            }
            while end < b.addr + b.size {
                match self.mapped.get(&end) {
                    Some(&h) => end += self.hsize(h),
                    None => return Err(format!("block {i} spans an unmapped hole at {end:#x}")),
                }
            }
            block_bytes += b.size;
            spans.push((b.addr, b.size));
        }
        if vacant != self.vacant.len() {
            return Err("vacant list disagrees with the arena".into());
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!("blocks overlap at {:#x}", w[1].0));
            }
        }
        if live_count != self.live.len() {
            return Err("live map holds a block that is not live".into());
        }
        for (k, bins) in self.bins.iter().enumerate() {
            for (p, b) in bins.iter().enumerate() {
                b.validate(&self.blocks)?;
                let mut list = Vec::new();
                b.collect(&self.blocks, &mut list);
                for i in list {
                    let x = &self.blocks[i as usize];
                    let ok = matches!(x.state, State::Free { owner, .. } if owner as usize == k)
                        && x.pool as usize == p;
                    if !ok {
                        return Err(format!("block {i} is listed in bins[{k}][{p}] wrongly"));
                    }
                }
            }
        }
        let listed: usize = self
            .bins
            .iter()
            .flat_map(|b| b.iter())
            .map(|b| b.count)
            .sum();
        let free_blocks = self
            .blocks
            .iter()
            .filter(|b| matches!(b.state, State::Free { .. }))
            .count();
        if listed != free_blocks {
            return Err(format!("{free_blocks} free blocks but {listed} listed"));
        }
        // Handles and address space.
        let mut reserved = 0;
        let mut count = 0;
        for h in self.handles.iter().flatten() {
            reserved += h.size;
            count += 1;
        }
        let mut mapped = 0;
        let mut last_end = 0;
        for (&a, &hid) in &self.mapped {
            let h = self.handles[hid as usize]
                .as_ref()
                .ok_or_else(|| format!("mapped handle {hid} was released"))?;
            if h.at != Some(a) {
                return Err(format!("handle {hid} mapped at {a:#x} records {:?}", h.at));
            }
            if a < last_end {
                return Err(format!("mappings overlap at {a:#x}"));
            }
            if !self.va.is_reserved(a, h.size) || self.va.overlaps_free(a, h.size) {
                return Err(format!(
                    "mapping {a:#x} is outside reserved, used address space"
                ));
            }
            last_end = a + h.size;
            mapped += h.size;
        }
        for &hid in &self.unmapped {
            if self.hrec(hid).at.is_some() {
                return Err(format!("unmapped handle {hid} records an address"));
            }
        }
        let quarantined: u64 = self.quarantine.iter().map(|&h| self.hsize(h)).sum();
        let mut ghost_bytes = 0;
        let mut ghost_counts = vec![0u32; self.handles.len()];
        for g in &self.ghosts {
            let h = self.handles[g.hid as usize]
                .as_ref()
                .ok_or_else(|| format!("ghost at {:#x} of a released handle", g.addr))?;
            if h.size != g.size || h.at == Some(g.addr) {
                return Err(format!("ghost at {:#x} disagrees with its handle", g.addr));
            }
            if !self.va.is_reserved(g.addr, g.size) || self.va.overlaps_free(g.addr, g.size) {
                return Err(format!(
                    "ghost {:#x} is outside reserved, used address space",
                    g.addr
                ));
            }
            let next_map = self.mapped.range(g.addr..).next().map(|(&a, _)| a);
            let prev_map = self.mapped.range(..g.addr).next_back();
            if next_map.is_some_and(|a| a < g.addr + g.size)
                || prev_map.is_some_and(|(&a, &h)| a + self.hsize(h) > g.addr)
            {
                return Err(format!("ghost {:#x} overlaps a mapping", g.addr));
            }
            ghost_counts[g.hid as usize] += 1;
            ghost_bytes += g.size;
        }
        for (hid, h) in self.handles.iter().enumerate() {
            if let Some(h) = h {
                if h.ghosts != ghost_counts[hid] {
                    return Err(format!(
                        "handle {hid} counts {} ghosts, has {}",
                        h.ghosts, ghost_counts[hid]
                    ));
                }
            }
        }
        if block_bytes != mapped {
            return Err(format!(
                "blocks cover {block_bytes} bytes but {mapped} are mapped"
            ));
        }
        if count != self.mapped.len() + self.unmapped.len() + self.quarantine.len() {
            return Err("a handle is neither mapped, unmapped nor quarantined".into());
        }
        self.va.validate()?;
        if mapped + quarantined + ghost_bytes + self.va.free_bytes() != self.va.reserved() {
            return Err("address space: mapped + ghosts + free != reserved".into());
        }
        let s = &self.stats;
        let checks = [
            ("requested", s.requested.current, requested),
            ("allocated", s.allocated.current, allocated),
            (
                "live_allocations",
                s.live_allocations.current,
                live_count as u64,
            ),
            ("pending_free", s.pending_free, pending_bytes),
            ("reserved", s.reserved.current, reserved),
            ("mapped", s.mapped.current, mapped),
            ("handles", s.handles, count as u64),
        ];
        for (name, have, want) in checks {
            if have != want {
                return Err(format!("stats.{name} is {have}, the structures say {want}"));
            }
        }
        if reserved > self.cfg.capacity {
            return Err(format!(
                "reserved {reserved} exceeds capacity {}",
                self.cfg.capacity
            ));
        }
        Ok(())
    }
}
