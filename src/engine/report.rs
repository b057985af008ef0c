//! Reports: detailed statistics, the layout (for dumps and pictures), the out-of-memory
//! diagnosis, the reason a pointer is not live, and the metadata estimate. Read only.
#![forbid(unsafe_code)]

use super::arena::{Block, Pool, State, NIL, POOLS};
use super::bins::Bins;
use super::fences::{Owner, PendingFree};
use super::Engine;
use crate::error::{AllocError, OomReport};
use crate::stats::DetailedStats;
use serde::Serialize;

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
pub struct Layout {
    /// Statistics at the same moment.
    pub detailed: DetailedStats,
    /// Virtual address reservations as (base, size).
    pub reservations: Vec<(u64, u64)>,
    /// Every handle.
    pub handles: Vec<HandleView>,
    /// Runs of contiguously mapped blocks, each in address order.
    pub runs: Vec<Vec<BlockView>>,
}

impl Layout {
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

impl Engine {
    /// Why `ptr` is not a live allocation.
    pub(super) fn diagnose(&self, ptr: u64) -> AllocError {
        if self.handles.containing(ptr).is_none() {
            return AllocError::InvalidPointer {
                ptr,
                reason: "not inside memory of this allocator",
            };
        }
        // Is ptr inside a free or pending block?
        let blocks = &self.arena.blocks;
        let mut free = Vec::new();
        for b in self.arena.bins.iter().flatten() {
            b.collect(blocks, &mut free);
        }
        let in_free = free.iter().any(|&i| {
            let b = &blocks[i as usize];
            b.addr <= ptr && ptr < b.addr + b.size
        }) || self.fences.pending.iter().any(|p| {
            let b = &blocks[p.block as usize];
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

    /// Ids of handles overlapped by a live or pending block.
    fn live_handles(&self) -> Vec<bool> {
        let mut holds = vec![false; self.handles.slots()];
        let busy = self
            .arena
            .live
            .values()
            .copied()
            .chain(self.fences.pending.iter().map(|p| p.block));
        for i in busy {
            let b = &self.arena.blocks[i as usize];
            let start = self
                .handles
                .mapped
                .range(..=b.addr)
                .next_back()
                .map_or(b.addr, |(&a, _)| a);
            for (_, &id) in self.handles.mapped.range(start..b.addr + b.size) {
                holds[id as usize] = true;
            }
        }
        holds
    }

    /// Heap bytes held by the engine's own structures (capacities, not lengths; B-tree and
    /// hash-map nodes estimated from their entry counts).
    pub(crate) fn metadata_bytes(&self) -> u64 {
        use std::mem::size_of;
        let vec = |cap: usize, each: usize| (cap * each) as u64;
        vec(self.arena.blocks.capacity(), size_of::<Block>())
            + vec(self.arena.vacant_capacity(), 4)
            // hashbrown: one control byte plus the entry per bucket, ~1/0.875 buckets per entry
            + vec(self.arena.live.capacity(), 8 + 4 + 1) * 8 / 7
            + vec(self.arena.bins.capacity(), size_of::<[Bins; POOLS]>())
            + vec(self.fences.owners.capacity(), size_of::<Owner>())
            + self.handles.metadata_bytes()
            + vec(self.fences.pending.capacity(), size_of::<PendingFree>())
            + self.va.metadata_bytes()
            + self.repeats.metadata_bytes()
    }

    pub(crate) fn detailed(&self) -> DetailedStats {
        let holds = self.live_handles();
        let mut live_handle_bytes = 0;
        let mut free_handles = 0;
        let mut free_handle_bytes = 0;
        for (id, h) in self.handles.iter() {
            if holds[id as usize] {
                live_handle_bytes += h.size;
            } else {
                free_handles += 1;
                free_handle_bytes += h.size;
            }
        }
        let mut free_spans = 0;
        let mut free_bytes = 0;
        for bins in &self.arena.bins {
            for b in bins {
                free_spans += b.count as u64;
                free_bytes += b.bytes;
            }
        }
        let largest = self
            .arena
            .bins
            .iter()
            .map(|b| b[Pool::Large as usize].largest(&self.arena.blocks))
            .max()
            .unwrap_or(0);
        let mut pages = [0u64; POOLS];
        let mut page_stranded = [0u64; POOLS];
        // Pages: runs of the paged pools. Count them and their free bytes if they hold live ones.
        for b in &self.arena.blocks {
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
                    i = (x.next != NIL).then(|| &self.arena.blocks[x.next as usize]);
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
            unmapped_handles: (self.handles.unmapped.len() + self.handles.quarantined.len()) as u64,
            va_reserved: self.va.reserved(),
            metadata_bytes: self.metadata_bytes(),
            live_handle_ratio: if s.requested.current > 0 {
                live_handle_bytes as f64 / s.requested.current as f64
            } else {
                0.0
            },
        }
    }

    pub(super) fn oom_report(&self, requested: u64, rsize: u64, driver_oom: bool) -> OomReport {
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

    /// The whole layout: every handle and every run of blocks.
    pub(super) fn layout_now(&self) -> Layout {
        let holds = self.live_handles();
        let handles = self
            .handles
            .iter()
            .map(|(id, h)| HandleView {
                size: h.size,
                addr: h.at,
                holds_live: holds[id as usize],
            })
            .collect();
        let mut heads: Vec<&Block> = self
            .arena
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
                        State::Free { owner, .. } if owner.is_clean() => ("free", None, None),
                        State::Free { owner, .. } => {
                            ("dirty", Some(self.fences.owner(owner).stream.raw()), None)
                        }
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
                    b = &self.arena.blocks[b.next as usize];
                }
                run
            })
            .collect();
        Layout {
            detailed: self.detailed(),
            reservations: self.va.reservations.iter().map(|(&b, &s)| (b, s)).collect(),
            handles,
            runs,
        }
    }
}
