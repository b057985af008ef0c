//! The growth policy: when a request fits no free block, which free handles to move, in
//! which order, what to create, what to release. A policy only reads the engine's state and
//! returns a [`Plan`]; `span` applies it with the driver. Alternative policies implement
//! [`GrowthPolicy`] and can be measured side by side (`Engine::with_policy`).
#![forbid(unsafe_code)]

use super::arena::{round_up, Arena, Pool, State, NIL};
use super::fences::OwnerId;
use super::handles::Handles;
use super::placement::shared_start;
use super::va::VaSpace;
use crate::config::Resolved;
use crate::stats::Stats;

/// A whole handle that holds no live byte: a candidate for stitching or release.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) handle: u32,
    pub(crate) size: u64,
    /// The free block containing it, or `NIL` when unmapped.
    pub(crate) block: u32,
    /// Where it is mapped (0 when unmapped).
    pub(crate) addr: u64,
    /// The block's owner: clean, or the requesting stream's owner (dirty: moved by
    /// aliasing, leaving a ghost).
    pub(crate) owner: OwnerId,
    /// Taking it would leave a piece of a handle shared with a live block stranded: it is
    /// the first whole handle of its free block and the block starts before it, or the
    /// last and the block ends after it. Only set under `Config::spare_pieces` (else
    /// false), where [`choose`] takes such handles after the others of their size.
    pub(crate) borders_piece: bool,
}

/// Result of an attempt to get more memory for a pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Grow {
    Done,
    /// Not enough free handles plus headroom under the capacity.
    Short,
    /// The driver refused to create memory below our capacity.
    DriverOom,
}

/// How many bytes of new handles a build creates.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Create {
    /// Exactly this many.
    Exact(u64),
    /// This many, or up to `min_handle` if the headroom when the build starts allows it.
    AtLeast(u64),
}

/// One new mapped run (or the growth of a run in place).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BuildPlan {
    /// Free handles to move into it, any order (`span` orders them).
    pub(crate) chosen: Vec<Candidate>,
    pub(crate) create: Create,
    /// The largest handle to create (see [`handle_size`]).
    pub(crate) handle_size: u64,
    /// How many clean handles the step before released for this build to create anew
    /// (a stitch by re-creation, `Config::recreate`); 0 otherwise.
    pub(crate) recreated: u64,
    pub(crate) pool: Pool,
    /// Map right after this block, which ends its run and is not carved by this plan, and
    /// link the new memory into its run (a free tail and the new memory become one block).
    pub(crate) extend: Option<u32>,
    /// Report `Short` instead when the creation exceeds the headroom when the build starts.
    pub(crate) short_without_room: bool,
    /// With `extend` naming a dirty free tail: the new memory joins it (its owner's until the
    /// next fence) instead of staying a separate clean block, so the tail grows in place (the
    /// loop region grows its end so at any GPU lag).
    pub(crate) join_tail: bool,
}

/// One step of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Make the free mapped handle a page of the pool where it sits (no driver call): done.
    Retag(Candidate, Pool),
    /// Unmap and release these free handles, then go on.
    Release(Vec<Candidate>),
    /// Build a run: its result ends the plan, unless the driver refused to create memory
    /// and a step follows.
    Build(BuildPlan),
    /// Not enough memory: the plan fails.
    Short,
}

/// Steps applied in order; the last one always ends the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) steps: Vec<Step>,
}

/// What a policy may read.
pub(crate) struct PlanContext<'a> {
    pub(crate) cfg: &'a Resolved,
    pub(crate) stats: &'a Stats,
    pub(crate) arena: &'a Arena,
    pub(crate) handles: &'a Handles,
    pub(crate) va: &'a VaSpace,
    /// The requesting stream's owner, if it ever freed memory.
    pub(crate) stream_owner: Option<OwnerId>,
    /// The loop region's `[lo, hi)` while it is on (`region`): its free handles are not
    /// candidates, and a large request grows its end.
    pub(crate) region: Option<(u64, u64)>,
    /// Whether a stitch for this request would repeat an earlier stitch's state (same
    /// request, same live bytes, same peak: a loop's step; `repeats`).
    pub(crate) repeating: bool,
}

impl PlanContext<'_> {
    /// Bytes that may still be created under the capacity.
    pub(crate) fn headroom(&self) -> u64 {
        self.cfg
            .capacity
            .saturating_sub(self.stats.reserved.current)
    }

    /// Whole free handles: inside clean free blocks, or unmapped; with `dirty`, also those
    /// inside free blocks of that owner (movable by aliasing only, see `ghosts`).
    pub(crate) fn stitch_candidates(&self, dirty: Option<OwnerId>) -> Vec<Candidate> {
        let mut v = stitch_candidates(self.arena, self.handles, dirty, self.cfg.spare_pieces);
        if let Some((lo, hi)) = self.region {
            v.retain(|c| c.block == NIL || c.addr + c.size <= lo || c.addr >= hi);
        }
        v
    }
}

/// A growth policy (see the module docs).
pub(crate) trait GrowthPolicy: Send + Sync {
    /// Whether creating memory for a request of `size` bytes is within the growth budget
    /// (a large request then avoids over-fitting free blocks).
    fn may_create(&self, cfg: &Resolved, stats: &Stats, size: u64) -> bool;

    /// How to make room for `rsize` bytes (a multiple of `UNIT`) in `pool`.
    fn plan(&self, ctx: &PlanContext<'_>, pool: Pool, rsize: u64) -> Plan;
}

/// Whole free handles of the arena (see [`PlanContext::stitch_candidates`]).
pub(crate) fn stitch_candidates(
    arena: &Arena,
    handles: &Handles,
    dirty: Option<OwnerId>,
    spare_pieces: bool,
) -> Vec<Candidate> {
    let mut list = Vec::new();
    arena.collect_free(OwnerId::CLEAN, &mut list);
    if let Some(k) = dirty {
        arena.collect_free(k, &mut list);
    }
    let mut out = Vec::new();
    for i in list {
        let b = &arena.blocks[i as usize];
        let end = b.addr + b.size;
        let State::Free { owner, .. } = b.state else {
            unreachable!("listed block is not free")
        };
        let first = out.len();
        for (&ha, &id) in handles.mapped.range(b.addr..end) {
            let size = handles.size(id);
            if ha + size <= end {
                out.push(Candidate {
                    handle: id,
                    size,
                    block: i,
                    addr: ha,
                    owner,
                    borders_piece: false,
                });
            }
        }
        // The block's whole handles, in address order: a piece lies before the first
        // when the block starts inside a handle, after the last when it ends inside one.
        if spare_pieces && out.len() > first {
            let last = out.len() - 1;
            out[first].borders_piece |= out[first].addr > b.addr;
            out[last].borders_piece |= out[last].addr + out[last].size < end;
        }
    }
    for &id in &handles.unmapped {
        out.push(Candidate {
            handle: id,
            size: handles.size(id),
            block: NIL,
            addr: 0,
            owner: OwnerId::CLEAN,
            borders_piece: false,
        });
    }
    out
}

/// Pick free handles to cover `need` bytes: clean ones before dirty ones (which leave a
/// ghost behind); among each, unmapped ones first (no unmap needed), then the one that
/// covers the remainder most tightly, else the largest, repeatedly; among handles of one
/// size, those that border no piece of a live handle (`Candidate::borders_piece`) first.
/// Takes all if they fall short.
pub(crate) fn choose(cands: Vec<Candidate>, need: u64) -> Vec<Candidate> {
    let (clean, dirty): (Vec<Candidate>, Vec<Candidate>) =
        cands.into_iter().partition(|c| c.owner.is_clean());
    let mut chosen = choose_among(clean, need);
    let taken: u64 = chosen.iter().map(|c| c.size).sum();
    if taken < need {
        chosen.extend(choose_among(dirty, need - taken));
    }
    chosen
}

fn choose_among(mut cands: Vec<Candidate>, need: u64) -> Vec<Candidate> {
    // Within a size, handles that border a piece come first, so that the tightest fit
    // (the last that fits) is one that borders none when there is one.
    cands.sort_by_key(|c| (c.block != NIL, std::cmp::Reverse(c.size), !c.borders_piece));
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
        let pick = cands
            .iter()
            .rposition(|c| c.size >= left)
            .unwrap_or_else(|| {
                // None covers the rest: the largest, one that borders no piece if any does.
                let top = cands[0].size;
                cands
                    .iter()
                    .position(|c| c.size == top && !c.borders_piece)
                    .unwrap_or(0)
            });
        let c = cands.remove(pick);
        left = left.saturating_sub(c.size);
        chosen.push(c);
    }
    chosen
}

/// The default policy: create within the growth budget, else stitch (design/ARCHITECTURE.md
/// 4.4); without stitching, a plain caching allocator that releases free handles at the
/// capacity.
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct StitchPolicy;

impl GrowthPolicy for StitchPolicy {
    /// Within the capacity and `L + max(reserve_slack * L, reserve_slack_min,
    /// repeat_allowance)` where `L = max(peak live, live + size)` (`repeats`).
    fn may_create(&self, cfg: &Resolved, stats: &Stats, size: u64) -> bool {
        let need = round_up(size, cfg.granularity);
        let after = stats.reserved.current + need;
        let live = stats
            .requested_lifetime_peak
            .max(stats.requested.current + size);
        let slack = ((live as f64 * cfg.reserve_slack) as u64)
            .max(cfg.reserve_slack_min)
            .max(stats.repeat_allowance);
        after <= cfg.capacity && after <= live + slack
    }

    fn plan(&self, ctx: &PlanContext<'_>, pool: Pool, rsize: u64) -> Plan {
        let steps = match pool {
            Pool::Small | Pool::Medium => self.paged(ctx, pool, rsize),
            Pool::Large if ctx.cfg.stitching => self.stitch(ctx, rsize),
            Pool::Large => self.plain(ctx, rsize),
        };
        Plan { steps }
    }
}

impl StitchPolicy {
    /// Large pool with stitching: within the budget, create (growing a run in place when
    /// possible); if over budget or the driver refuses, remap free handles into one new span
    /// (or after a block that ends its run), creating only the shortfall.
    fn stitch(&self, ctx: &PlanContext<'_>, rsize: u64) -> Vec<Step> {
        let cfg = ctx.cfg;
        let need = round_up(rsize, cfg.granularity);
        let hsize = handle_size(cfg, need);
        let cands = ctx.stitch_candidates(ctx.stream_owner);
        let free_total: u64 = cands.iter().map(|c| c.size).sum();
        let headroom = ctx.headroom();
        let extension = extension_target(ctx, rsize);
        let block_end = |b: u32| {
            let x = &ctx.arena.blocks[b as usize];
            x.addr + x.size
        };
        let span = |chosen, create, extend| BuildPlan {
            chosen,
            create: Create::Exact(create),
            handle_size: hsize,
            recreated: 0,
            pool: Pool::Large,
            extend,
            short_without_room: false,
            join_tail: false,
        };
        let build = |chosen, create, extend| Step::Build(span(chosen, create, extend));
        // A build that extends the stream's own dirty tail joins it (see `extension_target`).
        let joined = |step: Step, join: bool| match step {
            Step::Build(p) => Step::Build(BuildPlan {
                join_tail: join,
                ..p
            }),
            other => other,
        };
        // A stitch by re-creation: release the clean handles, then build the rest anew.
        let recreated = |(release, keep, create, released, after): Recreate| {
            [
                Step::Release(release),
                Step::Build(BuildPlan {
                    recreated: released,
                    handle_size: recreate_handle_size(cfg, need),
                    ..span(keep, create, after)
                }),
            ]
        };
        let mut steps = Vec::new();
        if ctx.region.is_some() {
            if let Some(region) = region_steps(ctx, rsize, cands.clone(), hsize) {
                return region;
            }
        }
        if self.may_create(cfg, ctx.stats, rsize) {
            // New memory, one or a few calls, no remapping; grown in place after a free
            // block that ends its run when possible. If the driver refuses (another process
            // holds memory), the next steps reuse free handles.
            let in_place = extension.and_then(|(b, ext, join)| {
                let create = ext.max(cfg.min_handle.min(headroom));
                (create <= headroom && ctx.va.is_free(block_end(b), create))
                    .then(|| joined(build(Vec::new(), create, Some(b)), join))
            });
            steps.push(in_place.unwrap_or_else(|| {
                let create = need.max(cfg.min_handle.min(headroom));
                build(Vec::new(), create, append_target(ctx, create, &[]))
            }));
        }
        // Best: grow a free block that ends its run, in place, by the missing part only.
        if let Some((b, ext, join)) = extension {
            let others: Vec<Candidate> = cands.iter().copied().filter(|c| c.block != b).collect();
            let other_total: u64 = others.iter().map(|c| c.size).sum();
            if other_total + headroom >= ext {
                let chosen = if other_total == 0 {
                    Vec::new()
                } else {
                    choose(others, ext)
                };
                let taken: u64 = chosen.iter().map(|c| c.size).sum();
                let create = shortfall(ext, taken, cfg.min_handle.min(headroom));
                if ctx.va.is_free(block_end(b), taken + create) {
                    // With contiguous growth (which grows tails of any size, the
                    // checkerboard's last stitch among them) re-created rather than remapped,
                    // as below; without it, as before (measured: re-creating there too moved
                    // the zoo at lag 0 from 1.0378 to 1.0394).
                    let recreate = cfg.contiguous.then(|| {
                        recreate_steps(ctx, &chosen, ext, create, |kept, create| {
                            (ctx.va.is_free(block_end(b), kept + create)).then_some(b)
                        })
                    });
                    if let Some(Some(r)) = recreate {
                        steps.extend(recreated(r).map(|st| joined(st, join)));
                        return steps;
                    }
                    steps.push(joined(build(chosen, create, Some(b)), join));
                    return steps;
                }
            }
        }
        if free_total + headroom < need {
            steps.push(Step::Short);
            return steps;
        }
        let chosen = if free_total == 0 {
            Vec::new()
        } else {
            choose(cands, need)
        };
        let taken: u64 = chosen.iter().map(|c| c.size).sum();
        let create = shortfall(need, taken, cfg.min_handle.min(headroom));
        if let Some(r) = recreate_steps(ctx, &chosen, need, create, |kept, create| {
            append_target(ctx, kept + create, &chosen)
        }) {
            steps.extend(recreated(r));
            return steps;
        }
        let after = append_target(ctx, taken + create, &chosen);
        steps.push(build(chosen, create, after));
        steps
    }

    /// Large pool without stitching: create new memory; at the capacity, release free
    /// handles first (what a plain caching allocator does on a miss).
    fn plain(&self, ctx: &PlanContext<'_>, rsize: u64) -> Vec<Step> {
        let need = round_up(rsize, ctx.cfg.granularity);
        let headroom = ctx.headroom();
        let mut steps = Vec::new();
        if headroom < need {
            let cands = ctx.stitch_candidates(None);
            let free_total: u64 = cands.iter().map(|c| c.size).sum();
            if free_total + headroom < need {
                return vec![Step::Short];
            }
            steps.push(Step::Release(choose(cands, need - headroom)));
        }
        steps.push(Step::Build(BuildPlan {
            chosen: Vec::new(),
            create: Create::AtLeast(need),
            handle_size: ctx.cfg.max_handle,
            recreated: 0,
            pool: Pool::Large,
            extend: None,
            short_without_room: false,
            join_tail: false,
        }));
        steps
    }

    /// A new page for a paged pool (small or medium) that fits `rsize`: a free handle of at
    /// most a page reused where it sits (no driver call), an unmapped one mapped, a new page
    /// created; at the capacity, a larger free handle reused in place, else free handles
    /// stitched into a span of the pool.
    fn paged(&self, ctx: &PlanContext<'_>, pool: Pool, rsize: u64) -> Vec<Step> {
        let page = match pool {
            Pool::Small => ctx.cfg.small_page,
            _ => ctx.cfg.medium_page,
        };
        let g = ctx.cfg.granularity;
        let cands = ctx.stitch_candidates(None);
        let smallest = |mapped: bool, max: u64| {
            cands
                .iter()
                .filter(|c| c.size >= rsize && (c.block != NIL) == mapped && c.size <= max)
                .min_by_key(|c| c.size)
                .copied()
        };
        let build = |chosen, create, short_without_room| {
            Step::Build(BuildPlan {
                chosen,
                create: Create::Exact(create),
                handle_size: ctx.cfg.max_handle,
                recreated: 0,
                pool,
                extend: None,
                short_without_room,
                join_tail: false,
            })
        };
        if let Some(c) = smallest(true, page) {
            return vec![Step::Retag(c, pool)];
        }
        if let Some(c) = smallest(false, page) {
            return vec![build(vec![c], 0, false)];
        }
        let mut steps = Vec::new();
        let headroom = ctx.headroom() / g * g;
        let want = page.max(round_up(rsize, g));
        if !self.may_create(ctx.cfg, ctx.stats, want) {
            // Past the growth budget, reserved memory must not grow while free memory
            // exists: give the smallest clean free handle back and create the page in its
            // place (measured on the zoo: pages created beside gigabytes of free large
            // handles set the peak of several workloads).
            let clean = cands
                .iter()
                .filter(|c| {
                    c.owner.is_clean()
                        && ctx.handles.record(c.handle).ghosts == 0
                        && c.size + headroom >= want
                })
                .min_by_key(|c| c.size);
            if let Some(&c) = clean {
                return vec![Step::Release(vec![c]), build(Vec::new(), want, false)];
            }
            // Else a handle this stream freed (its queued work may still use it) becomes a
            // page of this stream where it sits: the stream's later work is ordered after.
            if let Some(k) = ctx.stream_owner {
                let own = ctx
                    .stitch_candidates(Some(k))
                    .into_iter()
                    .filter(|c| c.owner == k && c.block != NIL && c.size >= rsize)
                    .min_by_key(|c| c.size);
                if let Some(c) = own {
                    return vec![Step::Retag(c, pool)];
                }
            }
        }
        if headroom >= round_up(rsize, g) {
            steps.push(build(Vec::new(), want.min(headroom), false));
        }
        // At the capacity: a larger free handle becomes a (larger) page where it sits.
        if let Some(c) = smallest(true, u64::MAX) {
            steps.push(Step::Retag(c, pool));
            return steps;
        }
        // Else stitch free handles (unmapped first) into one span for this pool, if they
        // and the headroom left then cover it.
        let need = round_up(rsize, g);
        let chosen = choose(cands, need);
        let taken: u64 = chosen.iter().map(|c| c.size).sum();
        steps.push(build(chosen, need.saturating_sub(taken), true));
        steps
    }
}

/// The largest handle to create for a large request of `bytes`: about
/// `bytes / handle_divisor`, rounded down to a power of two times the granularity, within
/// `[split_min, max_handle]` (`max_handle` when the divisor is 1). Finer handles let later,
/// smaller requests be cut at handle boundaries (less stranded memory) at the price of more
/// driver calls per byte created (design/zoo.md).
pub(crate) fn handle_size(cfg: &Resolved, bytes: u64) -> u64 {
    sized_within(cfg, bytes, cfg.max_handle)
}

/// The largest handle a stitch by re-creation creates for `bytes`: as [`handle_size`] but
/// up to [`largest_handle`] (such a span is one allocation's, so larger handles pin nothing
/// else, and one huge stitch keeps its handle count).
pub(crate) fn recreate_handle_size(cfg: &Resolved, bytes: u64) -> u64 {
    sized_within(cfg, bytes, largest_handle(cfg))
}

/// The largest handle the engine ever creates for the pools: `max_handle` for growth, up to
/// [`RECREATE_HANDLE_MAX`] for a stitch by re-creation.
pub(crate) fn largest_handle(cfg: &Resolved) -> u64 {
    cfg.max_handle.max(RECREATE_HANDLE_MAX)
}

/// About `bytes / handle_divisor`, a power of two times the granularity, within
/// `[split_min, cap]` (`cap` when the divisor is 1).
fn sized_within(cfg: &Resolved, bytes: u64, cap: u64) -> u64 {
    if cfg.handle_divisor <= 1 {
        return cap;
    }
    let g = cfg.granularity;
    let units = (bytes / cfg.handle_divisor / g).max(1);
    let pow2 = 1u64 << (63 - units.leading_zeros());
    pow2.saturating_mul(g).clamp(cfg.split_min, cap)
}

/// See [`recreate_handle_size`].
pub(crate) const RECREATE_HANDLE_MAX: u64 = 128 << 20;

/// What [`recreate_steps`] plans: the handles to release, those to keep, the bytes to create,
/// how many are released, and where to link the span.
type Recreate = (Vec<Candidate>, Vec<Candidate>, u64, u64, Option<u32>);

/// A stitch by re-creation (`Config::recreate`): with two or more clean handles to move,
/// release them and create the span's memory anew (a release costs less than an unmap plus
/// a SetAccess, and the span gets handles sized to this request); dirty handles and those
/// with ghosts still move. Returns the handles to release, those to keep, the bytes to
/// create, how many are released and where to link the span (`after(kept, create)`), or
/// `None` when nothing is re-created.
fn recreate_steps(
    ctx: &PlanContext<'_>,
    chosen: &[Candidate],
    need: u64,
    create: u64,
    after: impl FnOnce(u64, u64) -> Option<u32>,
) -> Option<Recreate> {
    if !ctx.cfg.recreate {
        return None;
    }
    let (release, keep): (Vec<Candidate>, Vec<Candidate>) = chosen
        .iter()
        .partition(|c| c.owner.is_clean() && ctx.handles.record(c.handle).ghosts == 0);
    if release.len() < 2 {
        return None;
    }
    let kept: u64 = keep.iter().map(|c| c.size).sum();
    let released = release.len() as u64;
    let create = need.saturating_sub(kept).max(create);
    let target = after(kept, create);
    Some((release, keep, create, released, target))
}

/// The loop region's growth for a large request of `rsize` bytes that no free block inside
/// it fits (`region`): extend its end by the part its free (or the requesting stream's dirty)
/// tail lacks, from `cands` (free handles outside the region: released and re-created, or
/// moved) and new memory for the rest. `None` when the region has no such end or no free
/// address space after it. Whether the growth stays within the region's budget is the
/// engine's check (`Engine::region_plan_fits`).
fn region_steps(
    ctx: &PlanContext<'_>,
    rsize: u64,
    cands: Vec<Candidate>,
    hsize: u64,
) -> Option<Vec<Step>> {
    let (_, hi) = ctx.region?;
    let cfg = ctx.cfg;
    let blocks = &ctx.arena.blocks;
    let t = blocks.iter().position(|b| {
        b.next == NIL && b.pool == Pool::Large && b.state != State::Vacant && b.addr + b.size == hi
    })? as u32;
    let tb = &blocks[t as usize];
    let usable = match tb.state {
        State::Free { owner, .. } if owner.is_clean() || Some(owner) == ctx.stream_owner => {
            usable_from(ctx, t, rsize)
        }
        _ => 0,
    };
    let ext = round_up(rsize.saturating_sub(usable), cfg.granularity);
    // The new memory joins the tail only when the tail is the requesting stream's (dirty)
    // block: joined to another stream's, it would be that stream's until its fence, and the
    // request it was made for could not use it.
    let join = matches!(tb.state, State::Free { owner, .. }
        if !owner.is_clean() && Some(owner) == ctx.stream_owner);
    let headroom = ctx.headroom();
    let chosen = if cands.is_empty() {
        Vec::new()
    } else {
        choose(cands, ext)
    };
    let taken: u64 = chosen.iter().map(|c| c.size).sum();
    let create = shortfall(ext, taken, cfg.min_handle.min(headroom));
    if create > headroom || !ctx.va.is_free(hi, taken + create) {
        return None;
    }
    let build = |chosen, create, handle_size, recreated| BuildPlan {
        chosen,
        create: Create::Exact(create),
        handle_size,
        recreated,
        pool: Pool::Large,
        extend: Some(t),
        short_without_room: false,
        join_tail: join,
    };
    if let Some((release, keep, create, released, _)) =
        recreate_steps(ctx, &chosen, ext, create, |_, _| Some(t))
    {
        return Some(vec![
            Step::Release(release),
            Step::Build(build(
                keep,
                create,
                recreate_handle_size(cfg, ext),
                released,
            )),
        ]);
    }
    Some(vec![Step::Build(build(chosen, create, hsize, 0))])
}

/// Bytes to create when `taken` of `need` bytes come from free handles: none if covered,
/// else the rest but at least `floor`.
fn shortfall(need: u64, taken: u64, floor: u64) -> u64 {
    let short = need.saturating_sub(taken);
    if short > 0 {
        short.max(floor)
    } else {
        0
    }
}

/// Where contiguous growth (`Config::contiguous`) maps a new large span of `total` bytes:
/// right after the block that ends a large-pool run, with `total` bytes of free address
/// space after it, and is not one the plan carves (`chosen`'s blocks). The largest clean
/// free tail first (it coalesces with the new memory at once), else the run that ends
/// highest (the memory grows at one end, as an expandable segment does, so free blocks on
/// either side of each join merge later). `None` when off or nothing qualifies: the span
/// gets fresh address space of its own.
pub(crate) fn append_target(
    ctx: &PlanContext<'_>,
    total: u64,
    chosen: &[Candidate],
) -> Option<u32> {
    if !ctx.cfg.contiguous || total == 0 {
        return None;
    }
    let g = ctx.cfg.granularity;
    let mut tail: Option<(u64, u32)> = None;
    let mut top: Option<(u64, u32)> = None;
    for (i, b) in ctx.arena.blocks.iter().enumerate() {
        let i = i as u32;
        if b.next != NIL || b.pool != Pool::Large || b.state == State::Vacant {
            continue;
        }
        let end = b.addr + b.size;
        if end % g != 0 || chosen.iter().any(|c| c.block == i) || !ctx.va.is_free(end, total) {
            continue;
        }
        if matches!(b.state, State::Free { owner, .. } if owner.is_clean())
            && tail.is_none_or(|(s, _)| b.size > s)
        {
            tail = Some((b.size, i));
        }
        if top.is_none_or(|(e, _)| end > e) {
            top = Some((end, i));
        }
    }
    tail.or(top).map(|(_, i)| i)
}

/// The bytes of free block `i` from where a large request of `rsize` bytes would start in it
/// under contiguous growth to its end: past a first handle it shares with a live block when
/// the placement skips that piece (`placement::contiguous_offset`), else all of it.
fn usable_from(ctx: &PlanContext<'_>, i: u32, rsize: u64) -> u64 {
    let b = &ctx.arena.blocks[i as usize];
    match shared_start(ctx.arena, ctx.handles, i) {
        Some(nb) if super::placement::align(nb.saturating_sub(b.addr), rsize) => {
            (b.addr + b.size).saturating_sub(nb)
        }
        _ => b.size,
    }
}

/// The largest free block of the large pool that ends its run with enough free address
/// space after it to grow to `rsize` bytes: clean, or the requesting stream's own (dirty)
/// unless the stitch repeats a loop's step; returns it, the bytes to add, and whether the
/// new memory must join it (a dirty tail: [`BuildPlan::join_tail`]).
pub(crate) fn extension_target(ctx: &PlanContext<'_>, rsize: u64) -> Option<(u32, u64, bool)> {
    let g = ctx.cfg.granularity;
    let blocks = &ctx.arena.blocks;
    let mut list = Vec::new();
    ctx.arena.bins[OwnerId::CLEAN.index()][Pool::Large as usize].collect(blocks, &mut list);
    let clean = list.len();
    // The requesting stream may use its own dirty blocks at once (its later work is ordered
    // after the work that freed them), so a stitch can grow such a tail instead of building
    // a new run beside it, which left the tail's partial granule and moved more handles
    // (design/zoo.md, "Seventeenth session"). Not for a loop's repeated stitch: the run it
    // builds becomes the loop region, which must not start as a grown run of older blocks
    // (it then left the batch-2 loop stitching at GPU lag 100).
    if let Some(k) = ctx.stream_owner.filter(|k| !k.is_clean() && !ctx.repeating) {
        ctx.arena.bins[k.index()][Pool::Large as usize].collect(blocks, &mut list);
    }
    let mut best: Option<(u32, u64, bool)> = None;
    for (n, i) in list.into_iter().enumerate() {
        let b = &blocks[i as usize];
        // Runs placed apart: only worth it when the block is a large part of the request;
        // a small leftover would make the new allocation share a handle with its
        // neighbour, stranding it when either is freed (any tail: zoo geomean 0.003 lower,
        // the checkerboard's largest tensor 99.8% -> 99.5% of free memory). With
        // contiguous growth a tail of any size grows (design/zoo.md: the tails left
        // beside new spans were the largest part of the excess).
        let small = b.size < rsize / 2 && !ctx.cfg.contiguous;
        if b.next != NIL || b.size >= rsize || small {
            continue;
        }
        let end = b.addr + b.size;
        let usable = if ctx.cfg.contiguous {
            usable_from(ctx, i, rsize)
        } else {
            b.size
        };
        let ext = round_up(rsize - usable, g);
        if end % g != 0 || !ctx.va.is_free(end, ext) {
            continue;
        }
        if best.is_none_or(|(j, _, _)| blocks[j as usize].size < b.size) {
            best = Some((i, ext, n >= clean));
        }
    }
    best
}

#[cfg(test)]
mod tests;
