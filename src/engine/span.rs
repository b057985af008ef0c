//! Applying a growth plan with the driver: create handles, unmap the chosen free ones from
//! wherever they sit (or leave dirty ones behind as ghosts), map them side by side in fresh
//! address space, grant access once. Any driver failure rolls back: every handle stays owned
//! (mapped where it was, or unmapped) and the engine consistent.
#![forbid(unsafe_code)]

use super::arena::{Pool, State, NIL};
use super::fences::OwnerId;
use super::policy::{BuildPlan, Candidate, Create, Grow, Plan, Step};
use super::Engine;
use crate::driver::{Driver, DriverOp, DriverResult, EventId, Stream};
use crate::error::{AllocError, Result};

/// A build's handles once the chosen ones are off their blocks.
struct Gathered {
    /// Unmapped handles (they go back to `unmapped` if the build fails): the chosen unmapped
    /// or unmapped now, then the fresh ones.
    unmapped: Vec<u32>,
    /// Dirty candidates carved out of their blocks, still mapped there: (standalone block,
    /// candidate).
    aliased: Vec<(u32, Candidate)>,
    /// Handles in mapping order: moved unmapped ones, then aliases, then fresh ones.
    order: Vec<u32>,
}

impl Engine {
    /// Bytes that may still be created under the capacity.
    pub(super) fn headroom(&self) -> u64 {
        self.cfg
            .capacity
            .saturating_sub(self.stats.reserved.current)
    }

    /// Apply `plan` (see [`Step`]).
    pub(super) fn apply<D: Driver + ?Sized>(&mut self, d: &D, plan: Plan) -> Result<Grow> {
        let mut last = Grow::Short;
        for step in plan.steps {
            match step {
                Step::Short => return Ok(Grow::Short),
                Step::Retag(c, pool) => {
                    self.retag(c, pool);
                    return Ok(Grow::Done);
                }
                Step::Release(cands) => {
                    self.release_candidates(d, cands)?;
                }
                Step::Build(b) => {
                    last = self.apply_build(d, b)?;
                    if last != Grow::DriverOom {
                        return Ok(last);
                    }
                }
            }
        }
        Ok(last)
    }

    fn apply_build<D: Driver + ?Sized>(&mut self, d: &D, b: BuildPlan) -> Result<Grow> {
        let create = match b.create {
            Create::Exact(n) => n,
            Create::AtLeast(need) => need.max(self.cfg.min_handle.min(self.headroom())),
        };
        if b.short_without_room && create > self.headroom() {
            return Ok(Grow::Short);
        }
        let stitches = self.stats.stitches;
        let extend = b.extend.map(|t| (t, b.join_tail));
        let r = self.build(d, b.chosen, create, b.handle_size, b.pool, extend)?;
        if r == Grow::Done && b.recreated > 0 {
            if self.stats.stitches == stitches {
                self.stats.stitches += 1;
            }
            self.stats.recreated_handles += b.recreated;
        }
        Ok(r)
    }

    /// The free block that holds mapped candidate `c` now. The plan named the block when it
    /// was made; an earlier step of the same plan (a release carving other handles out of
    /// that block) may have split it since, leaving `c` in one of the pieces.
    fn block_of(&self, c: &Candidate) -> u32 {
        let b = &self.arena.blocks[c.block as usize];
        let holds = |b: &super::arena::Block| {
            matches!(b.state, State::Free { .. })
                && b.addr <= c.addr
                && c.addr + c.size <= b.addr + b.size
        };
        if holds(b) {
            return c.block;
        }
        let piece = self
            .arena
            .blocks
            .iter()
            .position(holds)
            .expect("a planned candidate is still free");
        piece as u32
    }

    /// Turn a free mapped handle into a page of `pool` where it sits.
    fn retag(&mut self, c: Candidate, pool: Pool) {
        let m = self.arena.carve(self.block_of(&c), c.addr, c.size);
        self.arena.blocks[m as usize].pool = pool;
        self.arena.list(m);
        tracing::debug!(size = c.size, ?pool, "free handle reused as a page");
    }

    /// Carve a clean mapped candidate out of its block and unmap it. On an unmap failure
    /// the handle stays mapped as a standalone clean free block.
    fn detach<D: Driver + ?Sized>(&mut self, d: &D, c: Candidate) -> DriverResult<()> {
        let m = self.arena.carve(self.block_of(&c), c.addr, c.size);
        match self.driver_call(DriverOp::Unmap, || d.unmap(c.addr, c.size)) {
            Ok(()) => {
                self.arena.vacate(m);
                self.handles.mapped.remove(&c.addr);
                self.handles.record_mut(c.handle).at = None;
                self.va.free(c.addr, c.size);
                self.stats.mapped.sub(c.size);
                Ok(())
            }
            Err(e) => {
                self.arena.list(m);
                Err(e)
            }
        }
    }

    /// Unmap (if mapped) and release the given free handles. Old mappings of them (ghosts)
    /// are waited for and unmapped first: a mapped handle cannot be released.
    pub(super) fn release_candidates<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        mut chosen: Vec<Candidate>,
    ) -> Result<u64> {
        if chosen
            .iter()
            .any(|c| self.handles.record(c.handle).ghosts > 0)
        {
            self.poll_ghosts(d, true, usize::MAX)?;
            chosen.retain(|c| self.handles.record(c.handle).ghosts == 0);
        }
        carve_order(&mut chosen);
        let mut released = 0;
        for c in chosen {
            if c.block == NIL {
                self.handles.unmapped.retain(|&h| h != c.handle);
            } else {
                self.detach(d, c)?;
            }
            self.release_handle(d, c.handle)?;
            released += c.size;
        }
        Ok(released)
    }

    /// Build one new mapped run in `pool` from the `chosen` free handles plus `create` new
    /// bytes (in handles of at most `handle_size`); or, with `extend = Some(b)`, map them
    /// right after block `b` (which ends its run and has free address space after it) and
    /// link them into its run, merging with `b` if it is a free tail (with `join` true, also
    /// a dirty one: the new memory becomes its owner's until the next fence).
    fn build<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        mut chosen: Vec<Candidate>,
        create: u64,
        handle_size: u64,
        pool: Pool,
        extend: Option<(u32, bool)>,
    ) -> Result<Grow> {
        let (extend, join) = match extend {
            Some((b, join)) => (Some(b), join),
            None => (None, false),
        };
        let _span =
            tracing::debug_span!("build_span", moved = chosen.len(), create, ?pool).entered();
        // 1. Create the shortfall.
        let Some(fresh) = self.create_handles(d, create, handle_size)? else {
            return Ok(Grow::DriverOom);
        };
        // 2. Dirty candidates (freed on the requesting stream, maybe still in use by work
        //    queued there) stay mapped where they are until an event recorded now completes:
        //    they are mapped at the new address too, and later work on that stream is
        //    ordered after the old work.
        let dirty = chosen.iter().find(|c| !c.owner.is_clean()).map(|c| c.owner);
        let ghost_event = match dirty {
            Some(k) => {
                let s = self.fences.owner(k).stream;
                match self.record_event(d, s) {
                    Ok(e) => Some(e),
                    Err(e) => {
                        self.handles.unmapped.extend(fresh);
                        return Err(e.into());
                    }
                }
            }
            None => None,
        };
        carve_order(&mut chosen);
        let moved = chosen.iter().filter(|c| c.block != NIL).count() as u64;
        let g = self.gather(d, chosen, fresh, ghost_event)?;
        let aliased_ids: Vec<u32> = g.aliased.iter().map(|(_, c)| c.handle).collect();
        // 3. Map them side by side in fresh address space (or right after the block being
        //    extended), then grant access once.
        let total: u64 = g.order.iter().map(|&h| self.handles.size(h)).sum();
        // The plan named a block that ends its run; it still must (a plan is applied on the
        // state it was made from, but a block the plan reused is never followed).
        let extend = extend.filter(|&b| {
            let x = &self.arena.blocks[b as usize];
            x.state != State::Vacant && x.next == NIL && x.pool == pool
        });
        let placed = match extend {
            Some(b) => {
                let x = &self.arena.blocks[b as usize];
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
                let x = &self.arena.blocks[b as usize];
                p == x.addr + x.size
            })
        });
        let base = match placed {
            Ok(b) => b,
            Err(e) => {
                self.unalias(d, g.aliased, ghost_event);
                self.handles.unmapped.extend(g.unmapped);
                return Err(e);
            }
        };
        let done = match self.map_side_by_side(d, base, total, &g.order) {
            Ok(done) => done,
            Err((e, done)) => {
                self.rollback_span(d, base, total, &done, &aliased_ids);
                let back: Vec<u32> = g
                    .unmapped
                    .iter()
                    .copied()
                    .filter(|h| !self.handles.quarantined.contains(h))
                    .collect();
                self.handles.unmapped.extend(back);
                self.unalias(d, g.aliased, ghost_event);
                return Err(e.into());
            }
        };
        // 4. Commit: the dirty handles' old mappings become ghosts, the new run its block.
        let mut aliased_bytes = 0;
        for (m, c) in &g.aliased {
            self.arena.vacate(*m);
            self.handles.mapped.remove(&c.addr);
            self.stats.mapped.sub(c.size);
            let stream = self.fences.owner(c.owner).stream;
            self.add_ghost(c.addr, c.handle, ghost_event, stream);
            aliased_bytes += c.size;
        }
        self.stats.aliased_handles += g.aliased.len() as u64;
        for (addr, id) in done {
            self.handles.mapped.insert(addr, id);
            self.handles.record_mut(id).at = Some(addr);
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
                seq: self.fences.owner(k).free_seq,
            },
            _ => State::Free {
                owner: OwnerId::CLEAN,
                seq: 0,
            },
        };
        // Joining a dirty tail: the new memory is usable by the tail's stream at once (its
        // later work is ordered after the old) and by others after the tail's fence, like the
        // tail itself, so the two merge into one block.
        // The merged block keeps the later of the two free counts: moved handles freed on
        // the tail's stream after the tail (`state` dirty, counted now) must not turn clean
        // with a fence that covers only the tail's older free.
        let state = match extend.map(|b| self.arena.blocks[b as usize].state) {
            Some(tail @ State::Free { owner, .. }) if join && !owner.is_clean() => match state {
                State::Free { owner: k, .. } if k == owner => state,
                _ => tail,
            },
            _ => state,
        };
        match extend {
            Some(b) => {
                // `b` still ends its run (carving only ever removes handles that lie wholly
                // inside other blocks, or splits off pieces below): the new memory is linked
                // after it, merging with it if it is a free tail.
                if matches!(self.arena.blocks[b as usize].state, State::Free { .. }) {
                    self.stats.extensions += 1;
                }
                self.arena.append_run(b, total, state);
            }
            None => {
                self.arena.new_run(base, total, pool, state);
            }
        }
        Ok(Grow::Done)
    }

    /// Create `bytes` of new handles of at most `handle_size` bytes each (a multiple of the
    /// granularity; the last one takes the remainder). `None` when the driver is out of
    /// memory below our capacity (what was created is released).
    fn create_handles<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        bytes: u64,
        handle_size: u64,
    ) -> Result<Option<Vec<u32>>> {
        let mut fresh = Vec::new();
        let mut left = bytes;
        let largest = super::policy::largest_handle(&self.cfg);
        let handle_size = handle_size.clamp(self.cfg.granularity, largest);
        while left > 0 {
            let sz = left.min(handle_size);
            match self.driver_call(DriverOp::Create, || d.create(sz)) {
                Ok(h) => {
                    tracing::debug!(size = sz, "created a handle");
                    fresh.push(self.add_handle(h, sz));
                    left -= sz;
                }
                Err(e) => {
                    for id in fresh {
                        let _ = self.release_handle(d, id);
                    }
                    if e.code == crate::driver::code::OUT_OF_MEMORY {
                        tracing::warn!(%e, "driver out of memory below the allocator's capacity");
                        return Ok(None);
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(Some(fresh))
    }

    /// Take the chosen candidates (in carve order) off their blocks: unmapped ones out of
    /// `unmapped`, clean mapped ones unmapped, dirty ones carved but left mapped. On an unmap
    /// failure everything goes back (the fresh handles to `unmapped`).
    fn gather<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        chosen: Vec<Candidate>,
        fresh: Vec<u32>,
        ghost_event: Option<EventId>,
    ) -> Result<Gathered> {
        let mut unmapped = Vec::with_capacity(chosen.len() + fresh.len());
        let mut aliased: Vec<(u32, Candidate)> = Vec::new();
        for c in chosen {
            if c.block == NIL {
                self.handles.unmapped.retain(|&h| h != c.handle);
            } else if !c.owner.is_clean() {
                let m = self.arena.carve(self.block_of(&c), c.addr, c.size);
                aliased.push((m, c));
                continue;
            } else if let Err(e) = self.detach(d, c) {
                self.unalias(d, aliased, ghost_event);
                self.handles.unmapped.extend(unmapped);
                self.handles.unmapped.extend(fresh);
                return Err(e.into());
            }
            unmapped.push(c.handle);
        }
        let order: Vec<u32> = unmapped
            .iter()
            .chain(aliased.iter().map(|(_, c)| &c.handle))
            .chain(&fresh)
            .copied()
            .collect();
        unmapped.extend(fresh);
        Ok(Gathered {
            unmapped,
            aliased,
            order,
        })
    }

    /// Map `order` side by side from `base`, then grant access to all `total` bytes. Returns
    /// the mappings made as (address, handle); on failure, the error and those made so far.
    #[allow(clippy::type_complexity)]
    fn map_side_by_side<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        base: u64,
        total: u64,
        order: &[u32],
    ) -> std::result::Result<Vec<(u64, u32)>, (crate::driver::DriverError, Vec<(u64, u32)>)> {
        let mut off = 0;
        let mut done = Vec::with_capacity(order.len());
        for &id in order {
            let (h, size) = {
                let r = self.handles.record(id);
                (r.handle, r.size)
            };
            if let Err(e) = self.driver_call(DriverOp::Map, || d.map(base + off, size, h)) {
                return Err((e, done));
            }
            done.push((base + off, id));
            off += size;
        }
        if let Err(e) = self.driver_call(DriverOp::SetAccess, || d.set_access(base, total)) {
            return Err((e, done));
        }
        Ok(done)
    }

    /// Undo the maps of a span that failed to build; give back its address space. A handle
    /// whose unmap fails too is quarantined (mapped, no access) and retried later.
    ///
    /// `aliased` handles are still mapped at their old address too: a failed unmap of their
    /// new mapping leaves a ghost with no work behind it, retried at the next slow path.
    pub(super) fn rollback_span<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        base: u64,
        total: u64,
        done: &[(u64, u32)],
        aliased: &[u32],
    ) {
        let mut cursor = base;
        for &(addr, id) in done {
            let size = self.handles.size(id);
            if self
                .driver_call(DriverOp::Unmap, || d.unmap(addr, size))
                .is_err()
            {
                if aliased.contains(&id) {
                    tracing::error!(
                        addr,
                        size,
                        "rollback unmap of an alias failed; retried later"
                    );
                    self.add_ghost(addr, id, None, Stream::DEFAULT);
                } else {
                    tracing::error!(addr, size, "rollback unmap failed; handle quarantined");
                    self.handles.record_mut(id).at = Some(addr);
                    self.handles.quarantined.push(id);
                }
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
        aliased: Vec<(u32, Candidate)>,
        event: Option<EventId>,
    ) {
        for (m, _) in aliased {
            self.arena.list(m);
        }
        if let Some(e) = event {
            self.destroy_event(d, e);
        }
    }

    /// Reserve `size` more bytes of virtual address space, within `va_limit`.
    pub(super) fn reserve_va<D: Driver + ?Sized>(&mut self, d: &D, size: u64) -> Result<()> {
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
        let base = self.driver_call(DriverOp::Reserve, || d.reserve(size))?;
        tracing::debug!(base, size, "reserved virtual address space");
        self.va.add_reservation(base, size);
        Ok(())
    }

    /// Address space for a new run: the middle of the largest free range, so the run can
    /// later grow in place; a new reservation when no range is twice the length; plain best
    /// fit when the address-space limit is reached.
    pub(super) fn va_alloc<D: Driver + ?Sized>(&mut self, d: &D, len: u64) -> Result<u64> {
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
}

/// Order chosen candidates so that carving one never moves another to a new block: unmapped
/// ones first, then by block, within a block from the highest address down.
pub(crate) fn carve_order(chosen: &mut [Candidate]) {
    chosen.sort_by_key(|c| (c.block != NIL, c.block, std::cmp::Reverse(c.addr)));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory moved from the requesting stream's own dirty blocks and joined to that
    /// stream's dirty free tail (what the loop region does when its end is such a tail)
    /// keeps the latest free count of its pieces: handles freed after the tail must not turn
    /// clean with a fence that covers only the tail's older free (they took the tail's
    /// count before).
    #[test]
    fn a_joined_dirty_tail_keeps_the_latest_free_count() {
        use crate::engine::arena::State;
        use crate::engine::policy::Step;
        const M: u64 = 1 << 20;
        // A dirty 1 MiB tail after y (x's free count), and 32 MiB of the same stream's dirty
        // blocks freed after it.
        let (d, mut e, a, y) = Engine::dirty_tail_scene();
        let tail = e
            .arena
            .blocks
            .iter()
            .position(|b| b.addr == y + 27 * M)
            .unwrap() as u32;
        // Grow the tail by 26 MiB of the 16 MiB blocks' handles, joined to it.
        let owner = e.fences.owner_index(a).unwrap();
        let plan = e.plan_for(Pool::Large, 53 * M / 2, Some(owner));
        let Some(Step::Build(b)) = plan.steps.last() else {
            panic!("a build: {plan:?}")
        };
        let chosen: Vec<_> = b.chosen.iter().copied().take(13).collect();
        assert!(chosen.iter().all(|c| c.owner == owner && c.size == 2 * M));
        let r = e.build(&d, chosen, 0, 2 * M, Pool::Large, Some((tail, true)));
        assert_eq!(r.unwrap(), Grow::Done);
        let latest = e.fences.owner(owner).free_seq;
        let grown = &e.arena.blocks[tail as usize];
        assert_eq!((grown.addr, grown.size), (y + 27 * M, 27 * M), "one block");
        assert_eq!(grown.state, State::Free { owner, seq: latest });
        e.validate().unwrap();
        d.complete_all();
        e.teardown(&d);
        assert!(d.leak_report().is_clean());
    }

    fn cand(block: u32, addr: u64) -> Candidate {
        Candidate {
            handle: 0,
            size: 1,
            block,
            addr,
            owner: OwnerId::CLEAN,
            borders_piece: false,
        }
    }

    #[test]
    fn carve_order_is_unmapped_first_then_per_block_from_the_top() {
        let mut v = vec![
            cand(2, 10),
            cand(1, 5),
            cand(NIL, 0),
            cand(2, 30),
            cand(1, 7),
        ];
        carve_order(&mut v);
        let got: Vec<(u32, u64)> = v.iter().map(|c| (c.block, c.addr)).collect();
        assert_eq!(got, vec![(NIL, 0), (1, 7), (1, 5), (2, 30), (2, 10)]);
    }
}
