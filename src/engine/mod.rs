//! The allocation engine: the allocator's whole state and its entry points. Single-threaded;
//! [`crate::Allocator`] wraps it in a lock.
//!
//! # Data model and where each part lives
//! * [`arena`]: **blocks**, pieces of mapped memory: live (handed out), free (in the free
//!   lists of [`bins`]), or pending (freed, waiting for events of several streams). Blocks of
//!   one contiguously mapped run are linked in address order; two neighbours that are both
//!   free with the same owner are always merged. The live map.
//! * [`fences`]: a free block's **owner**: [`fences::OwnerId::CLEAN`] (usable by any stream and by
//!   stitching) or a stream whose frees are not yet fenced (usable by that stream only);
//!   pending multi-stream frees; events whose destroy must be retried; extra streams of
//!   live blocks.
//! * [`handles`]: physical memory created by the driver, each either mapped whole at one
//!   address, owned and unmapped, or (after a failed rollback) quarantined.
//! * [`ghosts`]: old mappings of handles stitched while the device may still use them,
//!   unmapped once an event recorded at the stitch completes.
//! * [`va`]: the reserved virtual address space and its free ranges.
//! * [`placement`]: where a large allocation goes inside a larger free block.
//! * [`policy`]: what to do when nothing fits (create, stitch, release): a side-effect-free
//!   plan; [`span`] applies it with the driver and rolls back on failure.
//! * [`maintenance`] (`empty_cache`, teardown) and [`report`] (statistics, layout, OOM
//!   diagnosis).
//!
//! Small requests live in the small pool: runs of exactly one handle (a "small page").
#![forbid(unsafe_code)]

mod arena;
mod bins;
mod chains;
mod fences;
mod ghosts;
mod handles;
mod maintenance;
mod placement;
mod policy;
mod region;
mod repeats;
mod report;
mod share;
mod single;
mod span;
mod va;

pub use arena::Pool;
pub(crate) use arena::UNIT;
pub use report::{BlockView, HandleView, Layout, StrandedHandle};

use crate::config::Resolved;
use crate::driver::{Driver, DriverOp, DriverResult, Stream};
use crate::error::{AllocError, Result};
use crate::stats::Stats;
use arena::{round_up, Arena, State};
use fences::{Fences, OwnerId, PendingFree};
use ghosts::Ghosts;
use handles::Handles;
use policy::{Grow, GrowthPolicy, PlanContext, StitchPolicy};
use va::VaSpace;

/// A large request avoids (while within the growth budget) a free block this many times its
/// size: it would pin memory that larger requests could use whole.
const OVERFIT: u64 = 4;

/// Waits for in-flight frees one slow path may ask its caller for before it waits for all
/// of them itself (under the caller's lock). Each wait completes at least one fence, so a
/// request that enough in-flight frees could satisfy needs only as many waits as fences.
pub(crate) const MAX_WAIT_ROUNDS: u32 = 64;

/// What one allocation try ([`Engine::alloc_step`]) came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Allocated at this address.
    Done(u64),
    /// Nothing fits until this in-flight event completes: wait for it (without the lock
    /// that fast paths take), hand it back with [`Engine::waited`], try again.
    Wait(crate::driver::EventId),
}

/// The engine state (see the module docs). Each part checks its own invariants; `validate`
/// checks them all and the facts that tie the parts together.
pub(crate) struct Engine {
    pub(crate) cfg: Resolved,
    /// Blocks, free lists (one set per owner of `fences`), live map.
    arena: Arena,
    /// Owners of free blocks, pending frees, events to destroy, extra streams.
    fences: Fences,
    /// Owned handles; the mapped ones are covered exactly by `arena`'s blocks.
    handles: Handles,
    /// Old mappings of stitched handles waiting for the device.
    ghosts: Ghosts,
    /// Reserved address space: mapped handles + quarantined + ghosts + free = reserved.
    va: VaSpace,
    /// What to do when nothing fits.
    policy: Box<dyn GrowthPolicy>,
    /// The last stitch and its streak of repeats, for `Stats::repeat_allowance`.
    repeats: repeats::Repeats,
    /// The loop region, while a fixed-shape loop is being settled (`region`).
    region: region::LoopRegion,
    /// What tells a growing chain's next copy, and where the last one ended (`chains`).
    chains: chains::Chains,
    /// Counters; `requested`, `allocated`, `live_allocations`, `pending_free`, `reserved`,
    /// `mapped` and `handles` always equal what the structures hold.
    pub(crate) stats: Stats,
    /// Set by `teardown`; every entry point then fails with `ShutDown`.
    pub(crate) shut_down: bool,
    /// The most `reserved` may be: the capacity, or what was reserved when the capacity was
    /// lowered below it ([`Engine::set_capacity`]; nothing is created until reserved is
    /// under the capacity again).
    reserved_ceiling: u64,
    /// Whether `set_capacity` was called (then an allocation is also checked against the
    /// live bytes).
    capacity_changed: bool,
}

impl Engine {
    pub(crate) fn new<D: Driver + ?Sized>(d: &D, cfg: Resolved) -> Result<Self> {
        let mut e = Engine {
            cfg,
            arena: Arena::new(),
            fences: Fences::new(),
            handles: Handles::default(),
            ghosts: Ghosts::default(),
            va: VaSpace::default(),
            policy: Box::new(StitchPolicy),
            repeats: repeats::Repeats::default(),
            region: region::LoopRegion::default(),
            chains: chains::Chains::default(),
            stats: Stats::default(),
            shut_down: false,
            reserved_ceiling: 0,
            capacity_changed: false,
        };
        let chunk = e.cfg.va_chunk;
        e.reserve_va(d, chunk)?;
        if e.cfg.prealloc > 0 {
            e.preallocate(d)?;
        }
        Ok(e)
    }

    /// An engine over a simulated device of `capacity` bytes with `cfg`, and the device
    /// (the engine's unit tests).
    #[cfg(test)]
    pub(crate) fn on_sim(capacity: u64, cfg: &crate::Config) -> (crate::driver::SimDriver, Self) {
        let d = crate::driver::SimDriver::with_capacity(capacity);
        let r = cfg.resolve(d.granularity(), d.mem_info().unwrap()).unwrap();
        let e = Engine::new(&d, r).unwrap();
        (d, e)
    }

    /// The engine's unit tests' dirty-tail scene, on a 1 GiB simulated device with no growth
    /// slack and no loop region: two 16 MiB blocks and a 28 MiB one (`x`) with live 2 MiB
    /// spacers between them, all three freed on stream `sim(1)` while its work may still use
    /// them (dirty, that stream's; `x` first), then 27 MiB in `x`'s place, which leaves a
    /// dirty 1 MiB tail ending its run (`x`'s free count). Returns the device, the engine,
    /// the stream and the 27 MiB allocation's address (`x`'s).
    #[cfg(test)]
    pub(crate) fn dirty_tail_scene() -> (crate::driver::SimDriver, Self, Stream, u64) {
        const M: u64 = 1 << 20;
        let cfg = crate::Config {
            reserve_slack: 0.0,
            reserve_slack_min: 0,
            loop_region: false,
            ..crate::Config::default()
        };
        let (d, mut e) = Engine::on_sim(1 << 30, &cfg);
        let a = Stream::sim(1);
        let z1 = e.alloc(&d, 16 * M, a).unwrap();
        let _s1 = e.alloc(&d, 2 * M, a).unwrap();
        let z2 = e.alloc(&d, 16 * M, a).unwrap();
        let _s2 = e.alloc(&d, 2 * M, a).unwrap();
        let x = e.alloc(&d, 28 * M, a).unwrap();
        assert_eq!(e.stats.reserved.current, 64 * M);
        for (p, n) in [(x, 28 * M), (z1, 16 * M), (z2, 16 * M)] {
            d.launch(a, p, n);
            e.free(&d, p, a).unwrap();
        }
        let y = e.alloc(&d, 27 * M, a).unwrap();
        assert_eq!(y, x, "27 MiB in x's place");
        (d, e, a, y)
    }

    /// Create and map `cfg.prealloc` bytes as one clean free span of the large pool. On any
    /// failure everything is given back and the error returned.
    fn preallocate<D: Driver + ?Sized>(&mut self, d: &D) -> Result<()> {
        let bytes = self.cfg.prealloc;
        let plan = policy::Plan {
            steps: vec![policy::Step::Build(policy::BuildPlan {
                chosen: Vec::new(),
                create: policy::Create::Exact(bytes),
                handle_size: policy::handle_size(&self.cfg, bytes),
                recreated: 0,
                pool: arena::Pool::Large,
                extend: None,
                short_without_room: true,
                join_tail: false,
            })],
        };
        let failure = match self.apply(d, plan) {
            Ok(Grow::Done) => {
                self.stats.preallocated = bytes;
                return Ok(());
            }
            Ok(_) => AllocError::Driver {
                op: DriverOp::Create,
                code: crate::driver::code::OUT_OF_MEMORY,
                message: format!("prealloc of {bytes} bytes: the device is out of memory"),
            },
            Err(e) => e,
        };
        self.teardown(d);
        Err(failure)
    }

    /// Use another growth policy from now on (to compare policies side by side).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn set_policy(&mut self, policy: Box<dyn GrowthPolicy>) {
        self.policy = policy;
    }

    /// Call the driver, counting the call.
    #[inline]
    fn driver_call<T>(
        &mut self,
        op: DriverOp,
        f: impl FnOnce() -> DriverResult<T>,
    ) -> DriverResult<T> {
        self.stats.calls.add(op);
        f()
    }

    /// Allocate `size` bytes for use on `stream`, waiting for in-flight frees inside the
    /// call when that is what it takes (engine tests and single-threaded users; the
    /// [`crate::Allocator`] waits outside its lock instead, through [`Engine::alloc_step`]).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn alloc<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        size: u64,
        stream: Stream,
    ) -> Result<u64> {
        let mut rounds = 0;
        loop {
            match self.alloc_step(d, size, stream, rounds)? {
                Step::Done(p) => return Ok(p),
                Step::Wait(e) => {
                    let r = d.wait_event(e);
                    self.waited(d, e, r);
                    rounds += 1;
                }
            }
        }
    }

    /// The checks every allocation makes before looking for memory, and its rounded size
    /// and pool.
    fn admit(&mut self, size: u64) -> Result<(u64, Pool)> {
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
        if self.capacity_changed && self.stats.allocated.current + rsize > self.cfg.capacity {
            // After `set_capacity` lowered the capacity below what is held, a free block
            // could fit; otherwise none can, and the slow path reports as it always has.
            return Err(self.over_capacity(size, rsize));
        }
        let pool = if size <= self.cfg.small_threshold {
            Pool::Small
        } else if size <= self.cfg.medium_threshold {
            Pool::Medium
        } else {
            Pool::Large
        };
        Ok((rsize, pool))
    }

    /// One try at allocating `size` bytes for use on `stream`: the address, or an event to
    /// wait for (lent by [`Engine::wait_target`]; give it back with [`Engine::waited`])
    /// before trying again with `rounds` one higher. After [`MAX_WAIT_ROUNDS`] such waits
    /// the slow path waits for everything in flight itself, so a caller's loop ends.
    pub(crate) fn alloc_step<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        size: u64,
        stream: Stream,
        rounds: u32,
    ) -> Result<Step> {
        let (rsize, mut pool) = self.admit(size)?;
        if self.region.range.is_some() && pool == Pool::Large && self.region_small(size) {
            pool = Pool::Small;
        }
        let own = if self.fences.has_streams() {
            self.fences.owner_index(stream)
        } else {
            None
        };
        if self.chain_request(pool, size) {
            let g = self.cfg.granularity;
            if let Some(i) = self
                .chains
                .next_fit(&self.arena, &self.handles, g, rsize, own)
            {
                self.stats.fast_allocs += 1;
                self.stats.chain_fits += 1;
                let p = self.take(i, rsize, size, stream);
                self.chains.placed_at(p + rsize);
                return Ok(Step::Done(p));
            }
        }
        let found = match self.region.range {
            Some(_) if pool == Pool::Large => self.find_in_region(rsize, own),
            _ => self.arena.find(rsize, pool, own),
        };
        if let Some(i) = found {
            // A large request would pin a free block four or more times its size: take room a
            // small page already holds if it may, else create a fitting block while within
            // the growth budget.
            let overfit =
                pool == Pool::Large && self.arena.blocks[i as usize].size / OVERFIT >= rsize;
            if let Some(j) = overfit
                .then(|| self.mid_sized_in_small_page(size, rsize, own))
                .flatten()
            {
                self.stats.fast_allocs += 1;
                return Ok(Step::Done(self.take(j, rsize, size, stream)));
            }
            if !overfit || self.region.range.is_some() || !self.overfit_may_create(size) {
                self.stats.fast_allocs += 1;
                return Ok(Step::Done(self.take(i, rsize, size, stream)));
            }
            return self.alloc_slow(d, (size, rsize, pool, stream), (true, rounds));
        }
        self.alloc_slow(d, (size, rsize, pool, stream), (false, rounds))
    }

    /// A free small-page block for a mid-sized large request whose best fit in the large pool
    /// is four or more times its size ([`OVERFIT`], the caller's test): room that small pages
    /// already hold, where the request strands nothing new, instead of a piece of a free run
    /// that would pin its handles. Only for requests that may use small pages
    /// ([`Engine::region_small`]: at most 1 MiB and half a small page, no growing chain's next
    /// copy), outside the loop region, and never by growing the small pool. Measured
    /// (design/zoo.md, "Twenty-sixth session"): bert-encode 1.0208 -> 1.0145 at lag 0, a 1 MiB
    /// tensor no longer alone in a run of two free handles; the zoo's geometric mean lower at
    /// every lag (llm-train-l, lora and resnet50-amp 0.001-0.002 higher at lag 0 only), the
    /// shipped traces level or lower, serving loops within 0.003 either way; sending such
    /// requests to small pages when that grows them took back what 256 KiB gained on
    /// mid-sized churn.
    fn mid_sized_in_small_page(&self, size: u64, rsize: u64, own: Option<OwnerId>) -> Option<u32> {
        if self.region.range.is_some() || !self.region_small(size) {
            return None;
        }
        self.arena.find(rsize, Pool::Small, own)
    }

    /// Whether a request of `size` bytes in `pool` is placed as a growing chain's next copy
    /// (`Config::chain_fit`, `chains`): not inside the loop region, which places a fixed-shape
    /// loop's requests itself.
    #[inline]
    fn chain_request(&mut self, pool: Pool, size: u64) -> bool {
        self.cfg.chain_fit
            && pool == Pool::Large
            && self.region.range.is_none()
            && self.chains.next_copy(size)
    }

    /// The over-fit rule's budget: the growth policy's, without the repeat allowance. The
    /// allowance is earned by repeated stitches to end them by growth; spent here, it grew
    /// reserved past the peak of live bytes beside gigabytes of free blocks (design/zoo.md,
    /// "Sixteenth session": llm-train-l 1.0054 -> 1.0046 at lag 0, 1.0062 -> 1.0049 at lag
    /// 1000 without it, nothing else in the zoo higher).
    fn overfit_may_create(&self, size: u64) -> bool {
        let base = Stats {
            repeat_allowance: 0,
            ..self.stats
        };
        self.policy.may_create(&self.cfg, &base, size)
    }

    /// Hand out `rsize` bytes of free block `i`, placed where it strands the fewest free
    /// handle bytes.
    #[inline]
    fn take(&mut self, i: u32, rsize: u64, requested: u64, stream: Stream) -> u64 {
        let handles = &self.handles;
        // With contiguous growth the allocation takes the block's start, so what is left
        // stays one block with the free memory after it; a piece left in front would be a
        // hole only smaller requests fill (design/zoo.md: zoo geomean 1.0304 -> 1.0235).
        // It starts at a handle boundary, though, when the block's start shares a handle
        // with a live neighbour (`placement::contiguous_offset`).
        let place = !self.cfg.contiguous;
        let aligned = if place || self.arena.blocks[i as usize].pool != Pool::Large {
            0
        } else {
            placement::contiguous_offset(&self.arena, handles, self.cfg.granularity, i, rsize)
        };
        let large = self.arena.blocks[i as usize].pool == Pool::Large;
        let addr = self.arena.take(i, rsize, requested, stream, |a, size| {
            if !place {
                return aligned;
            }
            placement::best_offset(a, size, rsize, handles.spans_from(a, a + size))
        });
        if large {
            self.chains.add(requested, addr);
        }
        let s = &mut self.stats;
        s.requested.add(requested);
        s.requested_lifetime_peak = s.requested_lifetime_peak.max(s.requested.current);
        s.allocated.add(rsize);
        s.live_allocations.add(1);
        s.allocs += 1;
        addr
    }

    /// `Arena::find_exhaustive` for `stream` (inside the loop region for a large request
    /// while it is on).
    fn find_exhaustive(&self, rsize: u64, pool: Pool, stream: Stream) -> Option<u32> {
        let own = self.fences.owner_index(stream);
        match self.region.range {
            Some(_) if pool == Pool::Large => self.find_in_region(rsize, own),
            _ => self.arena.find_exhaustive(rsize, pool, own),
        }
    }

    /// Make room for `rsize` bytes in `pool`: plan with the policy, apply the plan.
    fn grow<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        pool: Pool,
        rsize: u64,
        stream: Stream,
    ) -> Result<Grow> {
        let mut plan = self.plan(pool, rsize, stream);
        let fit = if self.region.range.is_some() && pool == Pool::Large {
            self.region_plan_fits(&plan, rsize)
        } else {
            region::Fit::Fits
        };
        if fit != region::Fit::Fits {
            // Shapes changed, or the loop needs more than the region may grow: back to the
            // usual policy, with every free byte visible again.
            self.leave_region(fit);
            tracing::debug!(rsize, "loop region: left");
            plan = self.plan(pool, rsize, stream);
        }
        let stitches = self.stats.stitches;
        let live = self.stats.requested.current;
        let r = self.apply(d, plan)?;
        if self.region.range.is_some() {
            self.refresh_region();
        }
        if self.stats.stitches > stitches {
            let s = &mut self.stats;
            let peak = s.requested_lifetime_peak;
            s.repeat_allowance = self.repeats.on_stitch(rsize, peak, s.repeat_allowance);
            if self.repeats.repeats_state(rsize, live, peak) {
                s.repeated_stitches += 1;
                if self.cfg.loop_region && self.region.on_repeat() {
                    self.enter_region();
                }
                let s = &mut self.stats;
                if s.repeated_stitches >= repeats::REPEAT_WARN && !self.repeats.warned {
                    self.repeats.warned = true;
                    let suggest_mib = crate::stats::prealloc_for_peak(peak) >> 20;
                    tracing::warn!(
                        repeated = s.repeated_stitches,
                        request = rsize,
                        "a loop stitches again at the same point of its steps (same request, \
                         same live bytes), paying driver calls each time; a pool pre-allocated a \
                         little above the peak of live bytes can end it (prealloc:{suggest_mib}MiB \
                         is 1.05 x the peak; a step that fragments more needs more)"
                    );
                }
            }
        }
        Ok(r)
    }

    /// The growth policy's plan for `rsize` bytes in `pool` on `stream`.
    fn plan(&self, pool: Pool, rsize: u64, stream: Stream) -> policy::Plan {
        self.plan_for(pool, rsize, self.fences.owner_index(stream))
    }

    /// The growth policy's plan for `rsize` bytes in `pool`, for a request whose stream's
    /// dirty blocks are `stream_owner`'s (`None`: clean memory only), the loop region as it
    /// stands.
    fn plan_for(&self, pool: Pool, rsize: u64, stream_owner: Option<OwnerId>) -> policy::Plan {
        let ctx = PlanContext {
            cfg: &self.cfg,
            stats: &self.stats,
            arena: &self.arena,
            handles: &self.handles,
            va: &self.va,
            stream_owner,
            region: self.region.range,
            repeating: self.repeats.seen(
                rsize,
                self.stats.requested.current,
                self.stats.requested_lifetime_peak,
            ),
        };
        self.policy.plan(&ctx, pool, rsize)
    }

    /// The slow path: poll, plan and grow, or ask the caller to wait. `(overfit, rounds)`:
    /// whether the fast path found only a block far too large, and how many waits this
    /// request has made so far.
    fn alloc_slow<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        (size, rsize, pool, stream): (u64, u64, Pool, Stream),
        (overfit, rounds): (bool, u32),
    ) -> Result<Step> {
        if rounds == 0 {
            self.stats.slow_allocs += 1;
        }
        let _span =
            tracing::debug_span!("alloc_slow", size, ?pool, stream = stream.raw()).entered();
        // Frees fenced since the last slow path may have become clean and merged.
        self.poll_for_alloc(d)?;
        let fits = if overfit {
            None
        } else {
            self.find_exhaustive(rsize, pool, stream)
        };
        let mut grown = match fits {
            Some(_) => Grow::Done,
            None => self.grow(d, pool, rsize, stream)?,
        };
        if grown != Grow::Done && rounds < MAX_WAIT_ROUNDS {
            // Wait for the one in-flight free that helps most, then try again; the caller
            // waits, outside its lock if it holds one.
            if let Some(e) = self.wait_target() {
                return Ok(Step::Wait(e));
            }
        } else if grown != Grow::Done {
            // A caller that went round this often: block until every outstanding free is
            // usable, then try once more.
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
            .or_else(|| {
                // The region was left by the plan just applied (its run is gone): any block.
                self.arena
                    .find_exhaustive(rsize, pool, self.fences.owner_index(stream))
            })
            .expect("growing made room");
        Ok(Step::Done(self.take(i, rsize, size, stream)))
    }

    /// Allocate `size` bytes from clean free memory or new memory only, for a stream that
    /// may be capturing a CUDA graph: no event is recorded, queried or waited for on any
    /// stream (no poll of the fences; blocks freed on `stream` and not yet fenced are not
    /// used; a stitch moves clean or unmapped handles only, so it records no ghost event).
    /// The block is live on `stream`; give it back with [`Engine::free_clean`].
    pub(crate) fn alloc_clean<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        size: u64,
        stream: Stream,
    ) -> Result<u64> {
        let (rsize, pool) = self.admit(size)?;
        if let Some(i) = self.arena.find_exhaustive(rsize, pool, None) {
            self.stats.fast_allocs += 1;
            return Ok(self.take(i, rsize, size, stream));
        }
        self.stats.slow_allocs += 1;
        // A graph pool's allocations are not the loop's: the usual policy, every free byte
        // visible.
        self.leave_region(region::Fit::Elsewhere);
        let plan = self.plan_for(pool, rsize, None);
        let grown = self.apply(d, plan)?;
        let found = self.arena.find_exhaustive(rsize, pool, None);
        match (grown, found) {
            (Grow::Done, Some(i)) => Ok(self.take(i, rsize, size, stream)),
            (grown, _) => {
                self.stats.ooms += 1;
                let report = self.oom_report(size, rsize, grown == Grow::DriverOom);
                tracing::warn!(%report, "allocation for a graph pool failed: out of memory");
                Err(AllocError::OutOfMemory(Box::new(report)))
            }
        }
    }

    /// The out-of-memory error of a request that would take the live bytes past the
    /// capacity.
    #[cold]
    fn over_capacity(&mut self, size: u64, rsize: u64) -> AllocError {
        self.stats.ooms += 1;
        let report = self.oom_report(size, rsize, false);
        tracing::warn!(%report, "allocation failed: over the (lowered) capacity");
        AllocError::OutOfMemory(Box::new(report))
    }

    /// Free the allocation at `ptr` as clean: the caller guarantees that no work queued on
    /// the device still uses it (a CUDA graph pool released after a device synchronisation),
    /// so it is reusable by every stream at once and no event is recorded.
    pub(crate) fn free_clean(&mut self, ptr: u64) -> Result<()> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        let Some(&i) = self.arena.live.get(&ptr) else {
            return Err(self.diagnose(ptr));
        };
        let State::Live { requested, .. } = self.arena.blocks[i as usize].state else {
            unreachable!("live map points at a block that is not live")
        };
        let size = self.arena.blocks[i as usize].size;
        self.arena.blocks[i as usize].state = State::Free {
            owner: fences::OwnerId::CLEAN,
            seq: 0,
        };
        self.arena.coalesce_insert(i);
        self.forget_live(ptr, i, requested, size);
        Ok(())
    }

    /// The bookkeeping every free ends with: live block `i` at `ptr` (`requested` bytes asked
    /// for, `size` held) leaves the live map, its extra streams and the live statistics.
    fn forget_live(&mut self, ptr: u64, i: u32, requested: u64, size: u64) {
        self.arena.live.remove(&ptr);
        if self.arena.blocks[i as usize].pool == Pool::Large {
            self.chains.remove(requested, ptr);
        }
        self.fences.extra_streams.remove(&i);
        let s = &mut self.stats;
        s.requested.sub(requested);
        s.allocated.sub(size);
        s.live_allocations.sub(1);
        s.frees += 1;
    }

    /// Change the capacity to `bytes` (rounded down to the granularity) at run time. A lower
    /// one touches nothing already allocated: the engine creates no memory while it holds
    /// more than the capacity, frees its free handles when a request needs room, and an
    /// allocation beyond the new limit fails. Returns the capacity set.
    pub(crate) fn set_capacity(&mut self, bytes: u64) -> Result<u64> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        let g = self.cfg.granularity;
        let cap = bytes / g * g;
        if cap == 0 {
            return Err(AllocError::Config(format!(
                "capacity {bytes} is below one {g}-byte granule"
            )));
        }
        if cap > crate::config::MAX_BYTES {
            return Err(AllocError::Config(format!(
                "capacity {cap} exceeds {} bytes (1 PiB)",
                crate::config::MAX_BYTES
            )));
        }
        self.reserved_ceiling = self.stats.reserved.current.max(cap);
        self.cfg.capacity = cap;
        self.capacity_changed = true;
        Ok(cap)
    }

    /// Free the allocation at `ptr`, whose last use is on `stream`.
    pub(crate) fn free<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        ptr: u64,
        stream: Stream,
    ) -> Result<u64> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        let Some(&i) = self.arena.live.get(&ptr) else {
            return Err(self.diagnose(ptr));
        };
        let State::Live {
            requested,
            stream: s0,
        } = self.arena.blocks[i as usize].state
        else {
            unreachable!("live map points at a block that is not live")
        };
        let extra = self.fences.extra_streams.get(&i);
        let single = stream == s0 && extra.is_none_or(|v| v.iter().all(|&s| s == s0));
        let size = self.arena.blocks[i as usize].size;
        if single {
            let owner = self.owner_for(s0);
            let o = self.fences.owner_mut(owner);
            o.free_seq += 1;
            let seq = o.free_seq;
            self.arena.blocks[i as usize].state = State::Free { owner, seq };
            self.arena.coalesce_insert(i);
        } else {
            // Uses on several streams: fence each now; reusable once all have completed. A
            // stream whose event cannot be recorded now is fenced on a later slow path: the
            // free itself never fails, since the caller has let go of the pointer.
            let mut streams = vec![s0, stream];
            streams.extend(extra.into_iter().flatten().copied());
            streams.sort();
            streams.dedup();
            let mut events = Vec::with_capacity(streams.len());
            let mut unfenced = Vec::new();
            for s in streams {
                if fences::capturing(d, s) {
                    unfenced.push(s); // fenced on a slow path once its capture ends
                    continue;
                }
                match self.record_event(d, s) {
                    Ok(e) => events.push(e),
                    Err(err) => {
                        tracing::warn!(%err, stream = s.raw(), "cannot fence a stream at a free; retried later");
                        unfenced.push(s);
                    }
                }
            }
            self.arena.blocks[i as usize].state = State::Pending;
            self.fences.pending.push(PendingFree {
                block: i,
                events,
                unfenced,
                lost: false,
            });
            self.stats.pending_free += size;
        }
        self.forget_live(ptr, i, requested, size);
        Ok(size)
    }

    /// Wait until every free made on `stream` is usable by everyone; afterwards the allocator
    /// never touches `stream` again (unless it is used again), so it may be destroyed. If
    /// the stream cannot be fenced, its frees are quarantined (usable by nobody until
    /// teardown), it is still never touched again, and the error is returned.
    pub(crate) fn retire_stream<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        stream: Stream,
    ) -> Result<()> {
        self.retire_fences(d, stream)
    }

    /// Note that the live allocation at `ptr` is also used on `stream`.
    pub(crate) fn record_stream(&mut self, ptr: u64, stream: Stream) -> Result<()> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        let Some(&i) = self.arena.live.get(&ptr) else {
            return Err(self.diagnose(ptr));
        };
        let v = self.fences.extra_streams.entry(i).or_default();
        if !v.contains(&stream) {
            v.push(stream);
        }
        Ok(())
    }

    /// Slots of the stream-owner table, the clean owner not counted.
    #[cfg(feature = "testing")]
    pub(crate) fn stream_owner_slots(&self) -> usize {
        self.fences.owners.len() - 1
    }

    /// Size in bytes usable at `ptr` (the rounded block size), if it is live.
    pub(crate) fn usable_size(&self, ptr: u64) -> Option<u64> {
        self.arena
            .live
            .get(&ptr)
            .map(|&i| self.arena.blocks[i as usize].size)
    }

    /// The whole layout, for dumps and pictures.
    pub(crate) fn layout(&self) -> Layout {
        self.layout_now()
    }

    /// Check every invariant of every structure. Slow: for tests, fuzzing and `paranoid`.
    pub(crate) fn validate(&self) -> std::result::Result<(), String> {
        let blocks = self.arena.validate()?;
        self.fences
            .validate(&self.arena.blocks, self.arena.bins.len())?;
        let handles = self.handles.validate(&self.va)?;
        let ghost_bytes = self.ghosts.validate(&self.handles, &self.va)?;
        self.validate_events()?;
        self.va.validate()?;
        self.chains.validate(&self.arena)?;
        // Every block lies in contiguously mapped handles, which the blocks cover exactly.
        for (i, b) in self.arena.blocks.iter().enumerate() {
            if b.state == State::Vacant {
                continue;
            }
            let Some((ha, id)) = self.handles.containing(b.addr) else {
                return Err(format!("block {i} at {:#x} is not mapped", b.addr));
            };
            let mut end = ha + self.handles.size(id);
            while end < b.addr + b.size {
                match self.handles.mapped.get(&end) {
                    Some(&h) => end += self.handles.size(h),
                    None => return Err(format!("block {i} spans an unmapped hole at {end:#x}")),
                }
            }
        }
        if let Some((lo, hi)) = self.region.range {
            let end = self.run_end(lo);
            if end != Some(hi) {
                return Err(format!(
                    "loop region [{lo:#x}, {hi:#x}) is not a large-pool run (run end {end:?})"
                ));
            }
        }
        if blocks.block_bytes != handles.mapped {
            return Err(format!(
                "blocks cover {} bytes but {} are mapped",
                blocks.block_bytes, handles.mapped
            ));
        }
        if handles.mapped + handles.quarantined + ghost_bytes + self.va.free_bytes()
            != self.va.reserved()
        {
            return Err("address space: mapped + ghosts + free != reserved".into());
        }
        let s = &self.stats;
        let checks = [
            ("requested", s.requested.current, blocks.requested),
            ("allocated", s.allocated.current, blocks.allocated),
            (
                "live_allocations",
                s.live_allocations.current,
                blocks.live_count,
            ),
            ("pending_free", s.pending_free, blocks.pending_bytes),
            ("reserved", s.reserved.current, handles.reserved),
            ("mapped", s.mapped.current, handles.mapped),
            ("handles", s.handles, handles.count),
        ];
        for (name, have, want) in checks {
            if have != want {
                return Err(format!("stats.{name} is {have}, the structures say {want}"));
            }
        }
        if handles.reserved > self.cfg.capacity.max(self.reserved_ceiling) {
            return Err(format!(
                "reserved {} exceeds capacity {} (and {} reserved when it was lowered)",
                handles.reserved, self.cfg.capacity, self.reserved_ceiling
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    const M: u64 = 1 << 20;

    /// A 1 MiB request whose only large-pool fit is a free 8 MiB block takes room a small
    /// page already has: before, it took a piece of the block (no growth slack), so that the
    /// next 8 MiB request had to grow, or got a new 2 MiB handle of its own (within the
    /// slack); either way reserved rose above what the program needs.
    #[test]
    fn a_mid_sized_request_takes_small_page_room_rather_than_pin_a_free_run() {
        let s = Stream::DEFAULT;
        for slack in [0.0, 0.05] {
            let cfg = Config {
                reserve_slack: slack,
                ..Config::default()
            };
            let (d, mut e) = Engine::on_sim(1 << 30, &cfg);
            let tiny = e.alloc(&d, 100 << 10, s).unwrap();
            let p = e.alloc(&d, 8 * M, s).unwrap();
            e.free(&d, p, s).unwrap();
            let reserved = e.stats.reserved.current;
            let q = e.alloc(&d, M, s).unwrap();
            assert!(
                !(p..p + 8 * M).contains(&q),
                "slack {slack}: not in the free run"
            );
            assert_eq!(
                e.stats.reserved.current, reserved,
                "slack {slack}: no growth"
            );
            let r = e.alloc(&d, 8 * M, s).unwrap();
            assert_eq!(r, p, "slack {slack}: the free run is whole");
            assert_eq!(e.stats.reserved.current, reserved, "slack {slack}");
            e.validate().unwrap();
            for x in [tiny, q, r] {
                e.free(&d, x, s).unwrap();
            }
            e.teardown(&d);
            assert!(d.leak_report().is_clean());
        }
    }
}
