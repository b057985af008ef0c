//! Blocks: the arena that holds them, their links, the free lists they sit in, the live map,
//! and the pure operations on them (split, merge, coalesce, carve a handle out, hand out).
//! Nothing here calls the driver or knows about handles.
#![forbid(unsafe_code)]

use super::bins::Bins;
use super::fences::OwnerId;
use crate::driver::Stream;
use rustc_hash::FxHashMap;
use serde::Serialize;

/// "No block".
pub(crate) const NIL: u32 = u32::MAX;
/// Allocation unit and alignment: 512 bytes.
pub(crate) const UNIT: u64 = 512;

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
pub(crate) const POOLS: usize = 3;

/// `v` rounded up to a multiple of `to`.
pub(crate) fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// In `bins[owner][pool]`. `seq` is the owner's free counter when it was freed
    /// (the highest of the merged pieces); 0 for clean blocks.
    Free { owner: OwnerId, seq: u64 },
    /// Handed out; in `live` under its address. `requested > 0` and the block's size is
    /// `requested` rounded up to `UNIT`.
    Live { requested: u64, stream: Stream },
    /// Freed with uses on several streams; in the fences' pending list until all their
    /// events complete.
    Pending,
    /// Unused arena slot; in `vacant`.
    Vacant,
}

impl State {
    /// The owner of a free block's state.
    pub(crate) fn owner(self) -> OwnerId {
        match self {
            State::Free { owner, .. } => owner,
            _ => unreachable!("owner of a block that is not free"),
        }
    }
}

/// One block of mapped memory.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    /// Start address, a multiple of `UNIT`.
    pub(crate) addr: u64,
    /// Size in bytes, a nonzero multiple of `UNIT`.
    pub(crate) size: u64,
    /// The block just below in the same contiguously mapped run, or `NIL`:
    /// `blocks[prev].addr + blocks[prev].size == addr`, `blocks[prev].next == self`, same pool.
    pub(crate) prev: u32,
    /// The block just above in the same run, or `NIL` (mirror of `prev`).
    pub(crate) next: u32,
    /// Free-list links (owned by [`Bins`]), meaningful while `state` is `Free`.
    pub(crate) fprev: u32,
    pub(crate) fnext: u32,
    /// The pool; every block of one run has the same pool.
    pub(crate) pool: Pool,
    pub(crate) state: State,
}

/// Sums over the blocks, for the engine's cross-checks against its statistics.
#[derive(Debug, Default)]
pub(crate) struct ArenaTotals {
    pub(crate) requested: u64,
    pub(crate) allocated: u64,
    pub(crate) live_count: u64,
    pub(crate) pending_bytes: u64,
    /// Bytes of every non-vacant block.
    pub(crate) block_bytes: u64,
}

/// Every block, the free lists and the live map.
#[derive(Debug)]
pub(crate) struct Arena {
    /// Block slots by id. Non-vacant blocks never overlap; two linked neighbours that are
    /// both free with the same owner are always merged (see `coalesce_insert`).
    pub(crate) blocks: Vec<Block>,
    /// Exactly the ids of the slots in state `Vacant`, reused first.
    vacant: Vec<u32>,
    /// address -> block, for exactly the live blocks.
    pub(crate) live: FxHashMap<u64, u32>,
    /// `bins[owner][pool]` holds exactly the free blocks with that owner and pool, each in
    /// the list of its size class. One entry per owner of the fences.
    pub(crate) bins: Vec<[Bins; POOLS]>,
}

impl Arena {
    /// An empty arena with the clean owner's free lists.
    pub(crate) fn new() -> Self {
        Arena {
            blocks: Vec::new(),
            vacant: Vec::new(),
            live: FxHashMap::default(),
            bins: vec![Default::default()],
        }
    }

    /// Free lists for one more owner.
    pub(crate) fn add_owner(&mut self) {
        self.bins.push(Default::default());
    }

    /// Capacity of the vacant list (for the metadata estimate).
    pub(crate) fn vacant_capacity(&self) -> usize {
        self.vacant.capacity()
    }

    pub(crate) fn new_block(&mut self, b: Block) -> u32 {
        if let Some(i) = self.vacant.pop() {
            self.blocks[i as usize] = b;
            i
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as u32
        }
    }

    pub(crate) fn vacate(&mut self, i: u32) {
        self.blocks[i as usize].state = State::Vacant;
        self.vacant.push(i);
    }

    /// Put free block `i` (in no list) in the list of its owner and pool.
    pub(crate) fn list(&mut self, i: u32) {
        let b = &self.blocks[i as usize];
        let (o, p) = (b.state.owner().index(), b.pool as usize);
        self.bins[o][p].insert(&mut self.blocks, i);
    }

    /// Take free block `i` off the list of its owner and pool.
    #[cfg(test)]
    pub(crate) fn unlist(&mut self, i: u32) {
        let b = &self.blocks[i as usize];
        let (o, p) = (b.state.owner().index(), b.pool as usize);
        self.bins[o][p].remove(&mut self.blocks, i);
    }

    /// Every free block of owner `k`, all pools.
    pub(crate) fn collect_free(&self, k: OwnerId, out: &mut Vec<u32>) {
        for p in 0..POOLS {
            self.bins[k.index()][p].collect(&self.blocks, out);
        }
    }

    /// A free block of at least `rsize` bytes in `pool`, clean or of owner `own`: the
    /// smaller of the two owners' good fits (the own one on a tie).
    #[inline]
    pub(crate) fn find(&self, rsize: u64, pool: Pool, own: Option<OwnerId>) -> Option<u32> {
        let p = pool as usize;
        let clean = self.bins[OwnerId::CLEAN.index()][p].find(&self.blocks, rsize);
        let own = own.and_then(|o| self.bins[o.index()][p].find(&self.blocks, rsize));
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
    pub(crate) fn find_exhaustive(
        &self,
        rsize: u64,
        pool: Pool,
        own: Option<OwnerId>,
    ) -> Option<u32> {
        if let Some(i) = self.find(rsize, pool, own) {
            return Some(i);
        }
        let p = pool as usize;
        let mut all = Vec::new();
        self.bins[OwnerId::CLEAN.index()][p].collect(&self.blocks, &mut all);
        if let Some(o) = own {
            self.bins[o.index()][p].collect(&self.blocks, &mut all);
        }
        all.into_iter()
            .filter(|&i| self.blocks[i as usize].size >= rsize)
            .min_by_key(|&i| self.blocks[i as usize].size)
    }

    /// Hand out `rsize` bytes of free block `i`: at its start, or, for a large block with
    /// room to spare, at the offset `place(addr, size)` returns. The pieces around stay free.
    /// Returns the address.
    #[inline]
    pub(crate) fn take(
        &mut self,
        mut i: u32,
        rsize: u64,
        requested: u64,
        stream: Stream,
        place: impl FnOnce(u64, u64) -> u64,
    ) -> u64 {
        let State::Free { owner, .. } = self.blocks[i as usize].state else {
            unreachable!("take of a block that is not free")
        };
        let (o, pool) = (owner.index(), self.blocks[i as usize].pool);
        self.bins[o][pool as usize].remove(&mut self.blocks, i);
        let (mut addr, mut size) = {
            let b = &self.blocks[i as usize];
            (b.addr, b.size)
        };
        let off = if pool == Pool::Large && size > rsize {
            place(addr, size)
        } else {
            0
        };
        if off > 0 {
            // The piece in front stays free as block `i`; the allocation starts a new block.
            let j = self.split(i, off);
            self.bins[o][pool as usize].insert(&mut self.blocks, i);
            i = j;
            addr += off;
            size -= off;
        }
        if size > rsize {
            let r = self.split(i, rsize);
            self.bins[o][pool as usize].insert(&mut self.blocks, r);
        }
        self.blocks[i as usize].state = State::Live { requested, stream };
        self.live.insert(addr, i);
        addr
    }

    /// Split block `i` (in no list) at byte `at`: `i` keeps the front, a new block with the
    /// same pool and state takes the rest and is linked after it. Returns the new block.
    #[inline]
    pub(crate) fn split(&mut self, i: u32, at: u64) -> u32 {
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

    /// Merge free block `i` (not in any list) with same-owner free neighbours, then list it.
    /// A dirty block also absorbs clean neighbours: memory any stream may use can always be
    /// restricted to one stream until its next fence, and the freeing stream then finds one
    /// contiguous free range instead of pieces split by ownership.
    pub(crate) fn coalesce_insert(&mut self, mut i: u32) -> u32 {
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
        self.bins[owner.index()][pool].insert(&mut self.blocks, i);
        i
    }

    /// If block `j` is free and may merge into a free block of `owner` (same owner, or clean
    /// into dirty), take it off its list and return its `seq`.
    fn unlist_joinable(&mut self, j: u32, owner: OwnerId, pool: usize) -> Option<u64> {
        if j == NIL {
            return None;
        }
        let State::Free { owner: o, seq } = self.blocks[j as usize].state else {
            return None;
        };
        let clean_into_dirty = o.is_clean() && !owner.is_clean();
        if o != owner && !clean_into_dirty {
            return None;
        }
        self.bins[o.index()][pool].remove(&mut self.blocks, j);
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

    /// Move owner `k`'s free blocks with `seq <= covered` to the clean owner (merging them).
    pub(crate) fn make_clean(&mut self, k: OwnerId, covered: u64) {
        let mut list = Vec::new();
        self.collect_free(k, &mut list);
        for i in list {
            if let State::Free { owner, seq } = self.blocks[i as usize].state {
                if owner == k && seq <= covered {
                    let pool = self.blocks[i as usize].pool as usize;
                    self.bins[k.index()][pool].remove(&mut self.blocks, i);
                    self.blocks[i as usize].state = State::Free {
                        owner: OwnerId::CLEAN,
                        seq: 0,
                    };
                    self.coalesce_insert(i);
                }
            }
        }
    }

    /// Cut `[start, start+len)` out of free block `b`, which contains it. Returns a new
    /// standalone free block (same owner) covering exactly that range, in no list; the
    /// pieces of `b` around it stay listed (`b` keeps the piece below, if any), each the end
    /// of its run.
    pub(crate) fn carve(&mut self, b: u32, start: u64, len: u64) -> u32 {
        let (addr, size, prev, next, pool, state) = {
            let x = &self.blocks[b as usize];
            (x.addr, x.size, x.prev, x.next, x.pool, x.state)
        };
        let o = state.owner().index();
        debug_assert!(addr <= start && start + len <= addr + size);
        self.bins[o][pool as usize].remove(&mut self.blocks, b);
        let below = start - addr;
        let above = addr + size - (start + len);
        let m = if below > 0 {
            let x = &mut self.blocks[b as usize];
            x.size = below;
            x.next = NIL;
            self.bins[o][pool as usize].insert(&mut self.blocks, b);
            self.new_block(Block {
                addr: start,
                size: len,
                prev: NIL,
                next: NIL,
                fprev: NIL,
                fnext: NIL,
                pool,
                state,
            })
        } else {
            if prev != NIL {
                self.blocks[prev as usize].next = NIL;
            }
            let x = &mut self.blocks[b as usize];
            x.size = len;
            x.prev = NIL;
            x.next = NIL;
            b
        };
        if above > 0 {
            let r = self.new_block(Block {
                addr: start + len,
                size: above,
                prev: NIL,
                next,
                fprev: NIL,
                fnext: NIL,
                pool,
                state,
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

    /// A new run of one free block `[base, base+size)` in `pool`, listed. Returns it.
    pub(crate) fn new_run(&mut self, base: u64, size: u64, pool: Pool, state: State) -> u32 {
        let i = self.new_block(Block {
            addr: base,
            size,
            prev: NIL,
            next: NIL,
            fprev: NIL,
            fnext: NIL,
            pool,
            state,
        });
        self.list(i);
        i
    }

    /// Map `bytes` of new memory right after block `b`, which ends its run, as a free block
    /// of `state` linked after it: it merges with `b` when `b` is free and may join it (same
    /// owner, or clean `b` into a dirty state), so a free tail and the new memory become one
    /// block. Returns the free block that holds the new memory.
    pub(crate) fn append_run(&mut self, b: u32, bytes: u64, state: State) -> u32 {
        let (addr, size, pool) = {
            let x = &self.blocks[b as usize];
            debug_assert_eq!(x.next, NIL);
            debug_assert!(x.state != State::Vacant);
            (x.addr, x.size, x.pool)
        };
        let j = self.new_block(Block {
            addr: addr + size,
            size: bytes,
            prev: b,
            next: NIL,
            fprev: NIL,
            fnext: NIL,
            pool,
            state,
        });
        self.blocks[b as usize].next = j;
        self.coalesce_insert(j)
    }

    /// Bytes of the dirty free blocks plus the pending blocks among `pending` (teardown's
    /// report of memory it unmaps unfenced: after its final wait, what is left is unfenceable).
    pub(crate) fn unfenced_bytes(&self, pending: impl Iterator<Item = u32>) -> u64 {
        let dirty: u64 = self
            .blocks
            .iter()
            .filter(|b| matches!(b.state, State::Free { owner, .. } if !owner.is_clean()))
            .map(|b| b.size)
            .sum();
        dirty + pending.map(|i| self.blocks[i as usize].size).sum::<u64>()
    }

    /// Forget every block and every stream owner's free lists (teardown).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.vacant.clear();
        self.live.clear();
        self.bins.truncate(1);
        self.bins[0] = Default::default();
    }

    /// Check the arena's own invariants (see the fields); returns sums for cross-checks.
    pub(crate) fn validate(&self) -> Result<ArenaTotals, String> {
        let mut t = ArenaTotals::default();
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
                    if owner.index() >= self.bins.len() {
                        return Err(format!("block {i}: unknown owner {}", owner.0));
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
                    t.requested += r;
                    t.allocated += b.size;
                    t.live_count += 1;
                }
                State::Pending => t.pending_bytes += b.size,
                State::Vacant => unreachable!(),
            }
            t.block_bytes += b.size;
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
        if t.live_count != self.live.len() as u64 {
            return Err("live map holds a block that is not live".into());
        }
        for (k, bins) in self.bins.iter().enumerate() {
            for (p, b) in bins.iter().enumerate() {
                b.validate(&self.blocks)?;
                let mut list = Vec::new();
                b.collect(&self.blocks, &mut list);
                for i in list {
                    let x = &self.blocks[i as usize];
                    let ok = matches!(x.state, State::Free { owner, .. } if owner.index() == k)
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
        Ok(t)
    }
}

#[cfg(test)]
mod tests;
