//! The loop region: a fixed-shape loop that stitches at the same point of every step gets
//! one large-pool run that only grows, and its large requests are placed there alone, so the
//! step's layout stops moving and the stitches end.
//!
//! At the default budget a loop can need its free memory in two arrangements per step (the
//! batch-2 training loop of design/zoo.md: a 125 MiB logits tensor at the peak, a 93.75 MiB
//! gradient in the backward pass), so each step remaps it twice. From the first stitch that
//! repeats an earlier one's state (`Repeats::repeats_state`), the run that ends highest
//! becomes the region `[lo, hi)`:
//!
//! * a large request takes a free block inside the region only (best fit there);
//! * a large request that fits none extends the region's end by the part missing, with whole
//!   free handles from outside the region first (moved or re-created) and new memory only for
//!   the rest;
//! * the region's own free handles are never moved, released or turned into pages;
//! * a request of at most [`SMALL_IN_REGION`] (and half a small page) goes to small pages,
//!   as under PyTorch's 1 MiB small threshold, unless it may be a growing chain's next copy.
//!
//! The region behaves like an expandable segment that free memory drains into, and an
//! expandable segment settles on a fixed-shape loop. It grows only within [`GROWTH`] above
//! the peak of live bytes: a plan for a large request that does not extend the region, or
//! would take reserved memory past that, ends the mode and is made again without it (shapes
//! changed, or the loop needs more than the region can give). An end of the second kind
//! whose need [`MAX_GROWTH`] holds raises the budget to the smallest doubling of [`GROWTH`]
//! that holds it ([`Fit`]). Entering again then waits for
//! [`BACKOFF`] times as many repeated stitches as the last time, so a workload whose shapes
//! recur in blocks (bert-encode: about ten batches of one shape, then the next) does not
//! enter and leave at every block. Measured (simulator, design/zoo.md "Fifteenth session"):
//! the batch-2 loop settles at 10 of 11 GPU lags from 0 to 5,000 events for 0-0.4% more
//! memory; bert-encode and t5-beam, the other traces with repeated stitches, keep their peaks.
#![forbid(unsafe_code)]

use super::arena::{Pool, State, NIL};
use super::fences::OwnerId;
use super::policy::{Create, Plan, Step};
use super::Engine;

/// How far above the peak of live bytes reserved memory may grow while the region is on,
/// as a fraction of that peak, until the mode has ended once ([`LoopRegion::growth`]).
/// Measured on the batch-2 loop (lags 0, 100, 1000): 0.5% and 1% leave it stitching
/// (1.0112-1.0157, 37-105 ms of late driver time), 2% settles it at every lag (1.0166-1.0194).
pub(crate) const GROWTH: f64 = 0.02;

/// The most [`LoopRegion::growth`] reaches: [`GROWTH`] doubles when the mode ends for want of
/// budget ([`Fit::OverBudget`]) until it holds what the plan needed, up to this. A loop whose
/// shapes drift in a cycle (the mixture of experts of `scripts/torch-inproc-speed.py --workloads
/// moe`: expert batches that change every step and repeat every twelve) needs about 5% above its
/// peak to settle: at 2% it leaves the region and stitches again in every step (through torch, run
/// 145: 5.8 slow allocations and 10.8 ms of driver time a step, 0.79 of PyTorch's speed). Measured
/// (simulator, its snapshot of run 146, design/zoo.md "Thirty-first session"): a fixed 4% leaves it
/// stitching; doubling up to 8% settles it by the middle of the trace at 1.052-1.054 (from
/// 1.017-1.020) for half the driver time, at lags 0, 3 and 1000; the zoo, the shipped traces and
/// `gen llm` / `gen serve` are unchanged to four decimals. Doubling at every end (caec488) also
/// raised the budget of a sampling loop whose request of 19% of its peak no budget holds
/// (unet-denoise, through torch 1.014 -> 1.054-1.063); only a need this maximum holds raises it
/// now, and an end because shapes changed never does ("Thirty-second session").
pub(crate) const MAX_GROWTH: f64 = 0.08;

/// After the mode ends for the k-th time, entering again waits for `BACKOFF^k` repeated
/// stitches. Measured: without it bert-encode enters and leaves at every block of one shape
/// (modeled driver time 152 -> 248 ms at lag 1000); with 2 or 4 it is unchanged.
pub(crate) const BACKOFF: u64 = 2;

/// While the region is on, large requests up to this size go to small pages
/// ([`Engine::region_small`]). The small threshold (256 KiB by default) puts them in the large
/// pool, where a fixed-shape loop's mid-sized tensors are placed in the region and fragment it:
/// the batch-2 loop then left the region at every step's 93.75 MiB gradient (reserved past
/// [`GROWTH`]) and stitched to the end of its trace at GPU lag 0; in small pages, where a loop's
/// repeated sizes reuse their slots, it settles at lags 0, 100 and 1000 as under a 1 MiB
/// threshold (design/zoo.md, "Twenty-fifth session").
pub(crate) const SMALL_IN_REGION: u64 = 1 << 20;

/// The region's state (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct LoopRegion {
    /// `Some((lo, hi))` while the mode is on: a large-pool run starts at `lo` and ends at
    /// `hi` (`Engine::validate` checks it).
    pub(crate) range: Option<(u64, u64)>,
    /// Repeated stitches seen (the engine's own count: `Stats::repeated_stitches` can be
    /// reset by the user).
    repeats: u64,
    /// `repeats` when the mode last ended.
    left_at: u64,
    /// How many times the mode ended.
    exits: u32,
    /// How many times the growth budget has doubled ([`LoopRegion::growth`]): raised at
    /// ends for want of budget ([`Fit::OverBudget`]) whose need [`MAX_GROWTH`] holds.
    raises: u32,
}

/// How a plan made while the loop region is on stands against it
/// ([`Engine::region_plan_fits`]).
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) enum Fit {
    /// It extends the region's end within the growth budget: the mode goes on.
    Fits,
    /// It does not extend the region (shapes changed): the mode ends, the budget stays.
    Elsewhere,
    /// It extends the region but would take reserved memory past the budget (the loop needs
    /// more room than the region may give): the mode ends. The payload is the room the plan
    /// needs above the peak of live bytes, as a fraction of that peak; the budget doubles
    /// until it holds that need, when [`MAX_GROWTH`] does ([`LoopRegion::leave`]).
    OverBudget(f64),
}

impl LoopRegion {
    /// Note a repeated stitch; whether the mode should be entered now (it is off and enough
    /// repeats have been seen since it last ended).
    pub(crate) fn on_repeat(&mut self) -> bool {
        self.repeats += 1;
        let wait = BACKOFF.saturating_pow(self.exits.min(32));
        self.range.is_none() && self.repeats >= self.left_at.saturating_add(wait)
    }

    /// How far above the peak of live bytes the region may take reserved memory now:
    /// [`GROWTH`], doubled until it held the need of each end for want of budget, at most
    /// [`MAX_GROWTH`]. A loop that fits in the first budget keeps it; one that runs out of it
    /// (its shapes need more room than 2% to stop moving) is given what it showed it needs.
    /// Ends because the shapes changed, or for a need above [`MAX_GROWTH`], leave it as it
    /// is: unet-denoise (a small sampling loop whose 68 MiB request needs 19% above its
    /// 365 MiB peak) was given 8% it could not settle with when every end doubled it, and held
    /// 1.054-1.069 of its peak where 2% gave 1.011-1.014.
    pub(crate) fn growth(&self) -> f64 {
        Self::growth_after(self.raises)
    }

    fn growth_after(raises: u32) -> f64 {
        (GROWTH * 2f64.powi(raises.min(16) as i32)).min(MAX_GROWTH)
    }

    /// End the mode (a no-op when it is off); `why` says whether the budget is raised: for
    /// [`Fit::OverBudget`] whose need [`MAX_GROWTH`] holds, to the smallest doubling of
    /// [`GROWTH`] that holds it.
    pub(crate) fn leave(&mut self, why: Fit) {
        if self.range.take().is_some() {
            self.left_at = self.repeats;
            self.exits = self.exits.saturating_add(1);
            if let Fit::OverBudget(need) = why {
                if need <= MAX_GROWTH {
                    while Self::growth_after(self.raises) < need {
                        self.raises += 1;
                    }
                }
            }
        }
    }

    /// Whether `[addr, addr + size)` lies inside the region.
    pub(crate) fn holds(&self, addr: u64, size: u64) -> bool {
        self.range
            .is_some_and(|(lo, hi)| addr >= lo && addr.saturating_add(size) <= hi)
    }
}

impl Engine {
    /// Whether a large request of `size` bytes goes to small pages while the region is on (and,
    /// outside it, may take room small pages already hold: `Engine::mid_sized_in_small_page`):
    /// at most [`SMALL_IN_REGION`] and half a small page, and not a growing chain's possible
    /// next copy (a live large request at most `chains::CHAIN_STEP` smaller). A chain's copies
    /// never repeat a size, so small pages, where a block cannot span two pages, would strand
    /// them: a loop of 256 K/V chains beside transients went from 1.15 to 1.45 x peak live.
    pub(super) fn region_small(&self, size: u64) -> bool {
        size <= SMALL_IN_REGION.min(self.cfg.small_page / 2) && !self.chains.has_below(size)
    }

    /// The smallest free large-pool block inside the loop region that fits `rsize`, clean
    /// or `own`'s: the best fit overall when it lies there (the usual case once the loop
    /// has settled), else a search of the free blocks.
    pub(super) fn find_in_region(&self, rsize: u64, own: Option<OwnerId>) -> Option<u32> {
        let blocks = &self.arena.blocks;
        let inside = |i: u32| {
            let b = &blocks[i as usize];
            self.region.holds(b.addr, b.size)
        };
        if let Some(i) = self.arena.find(rsize, Pool::Large, own) {
            if inside(i) {
                return Some(i);
            }
        }
        let mut all = Vec::new();
        self.arena.bins[OwnerId::CLEAN.index()][Pool::Large as usize].collect(blocks, &mut all);
        if let Some(o) = own {
            self.arena.bins[o.index()][Pool::Large as usize].collect(blocks, &mut all);
        }
        all.into_iter()
            .filter(|&i| blocks[i as usize].size >= rsize && inside(i))
            .min_by_key(|&i| blocks[i as usize].size)
    }

    /// Whether a plan made while the loop region is on keeps to it: it extends the region's
    /// end and leaves reserved memory within [`LoopRegion::growth`] above the peak of live bytes
    /// (counting this request).
    pub(super) fn region_plan_fits(&self, plan: &Plan, rsize: u64) -> Fit {
        let Some((_, hi)) = self.region.range else {
            return Fit::Elsewhere;
        };
        let released: u64 = plan
            .steps
            .iter()
            .map(|st| match st {
                Step::Release(v) => v.iter().map(|c| c.size).sum(),
                _ => 0,
            })
            .sum();
        let s = &self.stats;
        let peak = s.requested_lifetime_peak.max(s.requested.current + rsize);
        let cap = peak + (peak as f64 * self.region.growth()) as u64;
        let mut fit = Fit::Elsewhere;
        for st in &plan.steps {
            let Step::Build(b) = st else { continue };
            let create = match b.create {
                Create::Exact(n) | Create::AtLeast(n) => n,
            };
            let extends = b.extend.is_some_and(|t| {
                let x = &self.arena.blocks[t as usize];
                x.addr + x.size == hi
            });
            if extends {
                let after = (s.reserved.current + create).saturating_sub(released);
                if after <= cap {
                    return Fit::Fits;
                }
                let need = after.saturating_sub(peak) as f64 / peak.max(1) as f64;
                fit = match fit {
                    Fit::OverBudget(n) => Fit::OverBudget(n.min(need)),
                    _ => Fit::OverBudget(need),
                };
            }
        }
        fit
    }

    /// Where the large-pool run that starts at `lo` ends, if there is such a run.
    pub(super) fn run_end(&self, lo: u64) -> Option<u64> {
        let blocks = &self.arena.blocks;
        let mut i = blocks.iter().position(|b| {
            b.addr == lo && b.prev == NIL && b.pool == Pool::Large && b.state != State::Vacant
        })?;
        while blocks[i].next != NIL {
            i = blocks[i].next as usize;
        }
        Some(blocks[i].addr + blocks[i].size)
    }

    /// Turn the loop region on: the large-pool run that ends highest (where the stitch just
    /// made mapped its span, or the run grown last) becomes the region.
    pub(super) fn enter_region(&mut self) {
        let top = self
            .arena
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.next == NIL && b.pool == Pool::Large && b.state != State::Vacant)
            .max_by_key(|(_, b)| b.addr + b.size)
            .map(|(i, _)| i as u32);
        let Some(mut i) = top else {
            return;
        };
        let hi = self.arena.blocks[i as usize].addr + self.arena.blocks[i as usize].size;
        while self.arena.blocks[i as usize].prev != NIL {
            i = self.arena.blocks[i as usize].prev;
        }
        let lo = self.arena.blocks[i as usize].addr;
        self.region.range = Some((lo, hi));
        self.stats.loop_region_entries += 1;
        tracing::debug!(lo, hi, "loop region: entered");
    }

    /// End the loop region's mode, if on; `why` as in [`LoopRegion::leave`].
    pub(crate) fn leave_region(&mut self, why: Fit) {
        if self.region.range.is_some() {
            self.region.leave(why);
            self.stats.loop_region_exits += 1;
        }
    }

    /// After a plan was applied while the region is on: its end moves with the run that
    /// starts at its start; the mode ends if that run is gone.
    pub(super) fn refresh_region(&mut self) {
        let Some((lo, _)) = self.region.range else {
            return;
        };
        match self.run_end(lo) {
            Some(hi) => self.region.range = Some((lo, hi)),
            None => self.leave_region(Fit::Elsewhere),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_growth_budget_doubles_until_it_holds_each_need_up_to_its_maximum() {
        let mut r = LoopRegion::default();
        let mut seen = vec![r.growth()];
        for need in [0.03, 0.05, 0.07, 0.075] {
            r.range = Some((0, 10));
            r.leave(Fit::OverBudget(need));
            seen.push(r.growth());
        }
        assert_eq!(seen, [0.02, 0.04, 0.08, 0.08, 0.08]);
        assert_eq!(MAX_GROWTH, GROWTH * 4.0);
        r.leave(Fit::OverBudget(0.03));
        assert_eq!(r.growth(), MAX_GROWTH, "leaving while off counts no exit");
        let mut r = LoopRegion {
            range: Some((0, 10)),
            ..LoopRegion::default()
        };
        r.leave(Fit::OverBudget(0.05));
        assert_eq!(
            r.growth(),
            MAX_GROWTH,
            "raised at once to the doubling that holds it"
        );
    }

    #[test]
    fn an_exit_because_shapes_changed_or_for_a_need_no_budget_holds_keeps_the_budget() {
        let mut r = LoopRegion::default();
        for _ in 0..5 {
            r.range = Some((0, 10));
            r.leave(Fit::Elsewhere);
        }
        assert_eq!(r.growth(), GROWTH);
        assert_eq!(r.exits, 5, "every exit still counts for the back-off");
        r.range = Some((0, 10));
        r.leave(Fit::OverBudget(0.19));
        assert_eq!(r.growth(), GROWTH, "a need above the maximum");
        assert_eq!(r.exits, 6);
    }

    #[test]
    fn entering_again_waits_longer_after_each_exit() {
        let mut r = LoopRegion::default();
        assert!(r.on_repeat(), "the first repeat enters");
        r.range = Some((0, 10));
        assert!(!r.on_repeat(), "not while on");
        r.leave(Fit::Elsewhere);
        assert!(r.range.is_none());
        // After one exit: 2 more repeats.
        assert!(!r.on_repeat());
        assert!(r.on_repeat());
        r.range = Some((0, 10));
        r.leave(Fit::Elsewhere);
        // After two exits: 4 more.
        let entered: Vec<bool> = (0..4).map(|_| r.on_repeat()).collect();
        assert_eq!(entered, [false, false, false, true]);
        r.leave(Fit::Elsewhere); // off already: no new exit counted
        assert_eq!(r.exits, 2);
    }

    /// The region's end is another stream's dirty free tail when a request of this stream
    /// fits no free block inside: the memory created to extend the region must stay usable
    /// by the requesting stream, not join the other stream's tail (it did, and the engine
    /// then found no block for the request it had just grown for: a panic).
    #[test]
    fn extending_past_another_streams_dirty_tail_serves_the_requesting_stream() {
        use crate::driver::Stream;
        use crate::Config;
        const M: u64 = 1 << 20;
        let (d, mut e) = Engine::on_sim(1 << 30, &Config::default());
        let (a, b) = (Stream::sim(1), Stream::sim(2));
        // One run of 256 MiB: 192 MiB live on A, then 64 MiB freed on B while B's work
        // still uses it (a dirty tail of B's).
        let p = e.alloc(&d, 256 * M, a).unwrap();
        e.free(&d, p, a).unwrap();
        let _x = e.alloc(&d, 192 * M, a).unwrap();
        let y = e.alloc(&d, 64 * M, b).unwrap();
        assert_eq!(e.stats.reserved.current, 256 * M, "one run");
        d.launch(b, y, 64 * M);
        e.free(&d, y, b).unwrap();
        e.enter_region();
        assert!(e.region.range.is_some());
        e.validate().unwrap();
        // A asks for 4 MiB: nothing inside the region is A's to use; within 2% above the
        // 256 MiB peak the region grows by 4 MiB, and A gets it.
        let q = e.alloc(&d, 4 * M, a).unwrap();
        assert!(e.region.holds(q, 4 * M), "placed in the region");
        assert_eq!(e.stats.reserved.current, 260 * M);
        e.validate().unwrap();
        d.complete_all();
        e.teardown(&d);
        assert!(d.leak_report().is_clean());
    }

    #[test]
    fn holds_is_the_half_open_range() {
        let mut r = LoopRegion::default();
        assert!(!r.holds(0, 1));
        r.range = Some((100, 200));
        assert!(r.holds(100, 100));
        assert!(!r.holds(99, 2));
        assert!(!r.holds(150, 51));
    }
}
