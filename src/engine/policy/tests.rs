use super::*;
use crate::driver::{Driver, DriverOp, SimDriver, Stream};
use crate::engine::Engine;
use crate::Config;

const M: u64 = 1 << 20;

fn cand(handle: u32, size: u64, mapped: bool, owner: OwnerId) -> Candidate {
    Candidate {
        handle,
        size,
        block: if mapped { 100 + handle } else { NIL },
        addr: if mapped { u64::from(handle) << 30 } else { 0 },
        owner,
        borders_piece: false,
    }
}

fn ids(v: &[Candidate]) -> Vec<u32> {
    v.iter().map(|c| c.handle).collect()
}

#[test]
fn choose_takes_unmapped_first_then_the_tightest_then_the_largest() {
    let c = OwnerId::CLEAN;
    let cands = vec![
        cand(0, 8 * M, true, c),
        cand(1, 2 * M, false, c),
        cand(2, 4 * M, true, c),
        cand(3, 16 * M, true, c),
    ];
    // 2 MiB unmapped first; 4 MiB left: the 4 MiB handle fits it exactly.
    assert_eq!(ids(&choose(cands.clone(), 6 * M)), vec![1, 2]);
    // 5 MiB left after the unmapped one: 8 MiB is the tightest that covers it.
    assert_eq!(ids(&choose(cands.clone(), 7 * M)), vec![1, 0]);
    // 40 MiB left: none covers it, take the largest, then the tightest for the rest.
    assert_eq!(ids(&choose(cands.clone(), 22 * M)), vec![1, 3, 2]);
    // More than all: everything.
    assert_eq!(choose(cands, 100 * M).len(), 4);
}

#[test]
fn choose_uses_dirty_handles_only_for_what_clean_ones_miss() {
    let d = OwnerId(1);
    let cands = vec![
        cand(0, 4 * M, true, d),
        cand(1, 4 * M, true, OwnerId::CLEAN),
        cand(2, 2 * M, false, d),
    ];
    assert_eq!(ids(&choose(cands.clone(), 4 * M)), vec![1]);
    // Clean covers 4 of 6 MiB; of the dirty ones the unmapped comes first.
    assert_eq!(ids(&choose(cands, 6 * M)), vec![1, 2]);
}

#[test]
fn shortfall_is_zero_when_covered_and_at_least_the_floor() {
    assert_eq!(shortfall(8 * M, 8 * M, 2 * M), 0);
    assert_eq!(shortfall(8 * M, 10 * M, 2 * M), 0);
    assert_eq!(shortfall(8 * M, 7 * M, 2 * M), 2 * M);
    assert_eq!(shortfall(8 * M, 4 * M, 2 * M), 4 * M);
}

/// The tests' device: a simulated 64 MiB GPU.
fn device() -> SimDriver {
    SimDriver::with_capacity(64 * M)
}

/// `cfg` resolved for [`device`].
fn resolved(cfg: &Config) -> Resolved {
    let d = device();
    cfg.resolve(d.granularity(), d.mem_info().unwrap()).unwrap()
}

fn engine(cfg: Config) -> (SimDriver, Engine) {
    Engine::on_sim(64 * M, &cfg)
}

fn plan(e: &Engine, pool: Pool, rsize: u64) -> Plan {
    e.plan_for(pool, rsize, e.fences.owner_index(Stream::DEFAULT))
}

fn layout_json(e: &Engine) -> String {
    serde_json::to_string(&e.layout()).unwrap()
}

#[test]
fn over_budget_a_large_request_grows_a_free_block_in_place_with_another_free_handle() {
    // Runs placed apart (contiguous growth would have linked the four spans into one run).
    let mut cfg = Config::default()
        .with_reserve_slack(0.0, 0)
        .with_contiguous(false);
    cfg.handle_divisor = 1; // one handle per allocation
    let (d, mut e) = engine(cfg);
    let s = Stream::DEFAULT;
    let p: Vec<u64> = (0..4).map(|_| e.alloc(&d, 8 * M, s).unwrap()).collect();
    e.free(&d, p[0], s).unwrap();
    e.free(&d, p[2], s).unwrap();
    e.poll(&d, true).unwrap(); // make the frees clean
    let before = layout_json(&e);
    let got = plan(&e, Pool::Large, 16 * M);
    assert_eq!(layout_json(&e), before, "planning changes nothing");
    let [Step::Build(b)] = &got.steps[..] else {
        panic!("one build expected: {got:?}")
    };
    assert_eq!(b.create, Create::Exact(0));
    assert_eq!((b.chosen.len(), b.chosen[0].size), (1, 8 * M));
    let grown = b.extend.expect("grown in place");
    assert_ne!(b.chosen[0].block, grown, "the other free handle is moved");
    // Applying it is what the engine does for that request.
    e.alloc(&d, 16 * M, s).unwrap();
    assert_eq!((e.stats.stitches, e.stats.extensions), (1, 1));
    e.validate().unwrap();
    e.teardown(&d);
}

#[test]
fn within_budget_a_large_request_creates_first_and_stitches_if_the_driver_refuses() {
    let mut cfg = Config::default()
        .with_reserve_slack(0.01, 64 * M)
        .with_contiguous(false);
    cfg.handle_divisor = 1;
    let (d, mut e) = engine(cfg);
    let s = Stream::DEFAULT;
    let p = e.alloc(&d, 8 * M, s).unwrap();
    e.free(&d, p, s).unwrap();
    e.poll(&d, true).unwrap();
    let got = plan(&e, Pool::Large, 24 * M);
    let [Step::Build(first), Step::Build(second)] = &got.steps[..] else {
        panic!("a create, then a fallback: {got:?}")
    };
    // The free 8 MiB block is under half the request: no growth in place.
    assert_eq!((first.extend, second.extend), (None, None));
    assert!(first.chosen.is_empty());
    assert_eq!(first.create, Create::Exact(24 * M));
    assert_eq!((second.chosen.len(), second.chosen[0].size), (1, 8 * M));
    assert_eq!(second.create, Create::Exact(16 * M));
    e.teardown(&d);
}

#[test]
fn handles_are_sized_to_the_request() {
    // The default before 2026-12-02 (kept as a setting: README's configuration section).
    let cfg = Config {
        max_handle: 20 * M,
        handle_divisor: 32,
        split_min: 4 * M,
        ..Config::default()
    };
    let r = resolved(&cfg);
    // About request / 32, a power of two times 2 MiB, within [4 MiB, max_handle (20 MiB)].
    assert_eq!(super::handle_size(&r, 8 * M), 4 * M);
    assert_eq!(super::handle_size(&r, 256 * M), 8 * M);
    assert_eq!(super::handle_size(&r, 300 * M), 8 * M);
    assert_eq!(super::handle_size(&r, 512 * M), 16 * M);
    assert_eq!(super::handle_size(&r, 1 << 30), 20 * M);
    assert_eq!(super::handle_size(&r, 64 << 30), 20 * M);
    // A stitch by re-creation builds one allocation's span: handles up to 128 MiB.
    assert_eq!(super::recreate_handle_size(&r, 300 * M), 8 * M);
    assert_eq!(super::recreate_handle_size(&r, 1 << 30), 32 * M);
    assert_eq!(super::recreate_handle_size(&r, 64 << 30), 128 * M);
    let mut one = cfg.clone();
    one.handle_divisor = 1;
    let r1 = resolved(&one);
    assert_eq!(super::handle_size(&r1, 8 * M), 20 * M);
    assert_eq!(super::recreate_handle_size(&r1, 8 * M), 128 * M);
}

#[test]
fn default_handles_are_request_over_128_from_one_granule_to_8_mib() {
    let cfg = Config::default();
    assert_eq!(
        (cfg.max_handle, cfg.handle_divisor, cfg.split_min),
        (8 * M, 128, 2 * M)
    );
    let r = resolved(&cfg);
    assert_eq!(super::handle_size(&r, 8 * M), 2 * M);
    assert_eq!(super::handle_size(&r, 256 * M), 2 * M);
    assert_eq!(super::handle_size(&r, 512 * M), 4 * M);
    assert_eq!(super::handle_size(&r, 1 << 30), 8 * M);
    assert_eq!(super::handle_size(&r, 64 << 30), 8 * M);
    // What the driver sees: a fresh 512 MiB request is 128 handles of 4 MiB (64 of 8 MiB
    // with divisor 64, the default before 2026-12-07; design/zoo.md "Twenty-ninth session").
    let (d, mut e) = Engine::on_sim(1 << 30, &cfg);
    let before = d.calls().get(DriverOp::Create);
    let p = e.alloc(&d, 512 * M, Stream::DEFAULT).unwrap();
    assert_eq!(d.calls().get(DriverOp::Create) - before, 128);
    e.free(&d, p, Stream::DEFAULT).unwrap();
    e.teardown(&d);
}

#[test]
fn past_the_budget_a_page_replaces_a_clean_free_handle_instead_of_growing() {
    // One 8 MiB handle (a free handle of one page is retagged instead: no driver call).
    let (d, mut e) = engine(Config {
        split_min: 8 * M,
        ..Config::default()
    });
    let s = Stream::DEFAULT;
    let p = e.alloc(&d, 8 * M, s).unwrap();
    e.free(&d, p, s).unwrap();
    e.poll(&d, true).unwrap();
    let reserved = e.stats.reserved.current;
    let got = plan(&e, Pool::Small, 4096);
    let [Step::Release(r), Step::Build(b)] = &got.steps[..] else {
        panic!("release a free handle, then build a page: {got:?}")
    };
    assert_eq!(r.len(), 1);
    assert_eq!(b.pool, Pool::Small);
    e.alloc(&d, 4096, s).unwrap();
    assert!(
        e.stats.reserved.current <= reserved,
        "reserved did not grow"
    );
    e.validate().unwrap();
    e.teardown(&d);
}

/// A policy that never grows: every miss is out of memory.
struct Never;

impl GrowthPolicy for Never {
    fn may_create(&self, _: &Resolved, _: &Stats, _: u64) -> bool {
        false
    }
    fn plan(&self, _: &PlanContext<'_>, _: Pool, _: u64) -> Plan {
        Plan {
            steps: vec![Step::Short],
        }
    }
}

#[test]
fn the_engine_applies_whichever_policy_it_is_given() {
    let (d, mut e) = engine(Config::default());
    e.set_policy(Box::new(Never));
    let err = e.alloc(&d, 8 * M, Stream::DEFAULT).unwrap_err();
    assert!(matches!(err, crate::AllocError::OutOfMemory(_)), "{err}");
    assert_eq!(e.stats.handles_created, 0);
    e.set_policy(Box::new(StitchPolicy));
    e.alloc(&d, 8 * M, Stream::DEFAULT).unwrap();
    e.teardown(&d);
}

#[test]
fn a_small_request_reuses_a_free_page_sized_handle_where_it_sits() {
    let (d, mut e) = engine(Config::default().with_small_threshold(1 << 16));
    let s = Stream::DEFAULT;
    let p = e.alloc(&d, 2 * M, s).unwrap();
    e.free(&d, p, s).unwrap();
    e.poll(&d, true).unwrap();
    let got = plan(&e, Pool::Small, 4096);
    assert!(
        matches!(&got.steps[..], [Step::Retag(c, Pool::Small)] if c.size == 2 * M),
        "{got:?}"
    );
    e.teardown(&d);
}

#[test]
fn without_stitching_at_the_capacity_free_handles_are_released_first() {
    let (d, mut e) = engine(Config::default().with_stitching(false));
    let s = Stream::DEFAULT;
    let cap = e.cfg.capacity;
    let p = e.alloc(&d, cap / 2, s).unwrap();
    let _q = e.alloc(&d, cap / 2, s).unwrap();
    e.free(&d, p, s).unwrap();
    e.poll(&d, true).unwrap();
    let got = plan(&e, Pool::Large, cap / 4 + 4 * M);
    let [Step::Release(r), Step::Build(b)] = &got.steps[..] else {
        panic!("release then create: {got:?}")
    };
    assert!(!r.is_empty());
    assert_eq!(b.create, Create::AtLeast(cap / 4 + 4 * M));
    assert_eq!(plan(&e, Pool::Large, cap).steps, vec![Step::Short]);
    e.teardown(&d);
}

/// A plan that releases some handles of a free block and stitches another handle of the
/// same block: the release carves that block up, so the build finds its candidate in
/// whichever piece holds it now (it named a block id that no longer covers it and panicked
/// until 2026-12-01; found by `random_faults_host` with 2,000 cases).
#[test]
fn a_build_after_a_release_of_the_same_block_finds_its_candidate() {
    let mut cfg = Config::default().with_reserve_slack(0.0, 0);
    cfg.max_handle = 2 * M;
    let (d, mut e) = engine(cfg);
    let s = Stream::DEFAULT;
    let p = e.alloc(&d, 8 * M, s).unwrap();
    e.free(&d, p, s).unwrap();
    e.poll(&d, true).unwrap();
    let mut cands = stitch_candidates(&e.arena, &e.handles, None, false);
    cands.sort_by_key(|c| c.addr);
    assert_eq!(cands.len(), 4, "one free block of four handles: {cands:?}");
    assert!(cands.iter().all(|c| c.block == cands[0].block));
    let keep = cands.remove(2);
    let plan = Plan {
        steps: vec![
            Step::Release(cands),
            Step::Build(BuildPlan {
                chosen: vec![keep],
                create: Create::Exact(4 * M),
                handle_size: 2 * M,
                recreated: 3,
                pool: Pool::Large,
                extend: None,
                short_without_room: false,
                join_tail: false,
            }),
        ],
    };
    assert_eq!(e.apply(&d, plan).unwrap(), Grow::Done);
    e.validate().unwrap();
    assert_eq!(e.stats.handles, 3, "one kept, two created, three released");
    e.teardown(&d);
}

/// Large-pool runs of the layout, as (blocks, bytes).
fn large_runs(e: &Engine) -> Vec<(usize, u64)> {
    e.layout()
        .runs
        .iter()
        .filter(|r| r[0].pool == Pool::Large)
        .map(|r| (r.len(), r.iter().map(|b| b.size).sum()))
        .collect()
}

#[test]
fn contiguous_growth_links_each_new_span_after_the_highest_run() {
    let mut cfg = Config::default().with_contiguous(true);
    cfg.handle_divisor = 1;
    let (d, mut e) = engine(cfg.clone());
    let s = Stream::DEFAULT;
    let p: Vec<u64> = (0..3).map(|_| e.alloc(&d, 8 * M, s).unwrap()).collect();
    assert_eq!(large_runs(&e), vec![(3, 24 * M)], "one run of three blocks");
    assert_eq!((p[1], p[2]), (p[0] + 8 * M, p[0] + 16 * M));
    // Freed, the pieces merge across both joins into one block.
    for &q in &p {
        e.free(&d, q, s).unwrap();
    }
    assert_eq!(large_runs(&e), vec![(1, 24 * M)]);
    e.validate().unwrap();
    e.teardown(&d);
    // Off: three runs apart, which never merge.
    let (d, mut e) = engine(cfg.with_contiguous(false));
    for _ in 0..3 {
        e.alloc(&d, 8 * M, s).unwrap();
    }
    assert_eq!(large_runs(&e).len(), 3);
    e.teardown(&d);
}

#[test]
fn a_free_tail_of_any_size_grows_with_the_new_memory() {
    let (d, mut e) = engine(Config::default().with_contiguous(true));
    let s = Stream::DEFAULT;
    // 7 MiB in an 8 MiB span leaves a 1 MiB free tail, a ninth of the next request.
    let a = e.alloc(&d, 7 * M, s).unwrap();
    let before = layout_json(&e);
    let got = plan(&e, Pool::Large, 9 * M);
    assert_eq!(layout_json(&e), before, "planning changes nothing");
    let Some(Step::Build(b)) = got.steps.first() else {
        panic!("a build expected: {got:?}")
    };
    assert_eq!(b.create, Create::Exact(8 * M), "the 8 MiB the tail misses");
    assert!(b.extend.is_some(), "grown after the tail: {got:?}");
    let q = e.alloc(&d, 9 * M, s).unwrap();
    assert_eq!(q, a + 7 * M, "the new allocation starts in the tail");
    assert_eq!(
        e.stats.reserved.current,
        16 * M,
        "16 MiB live in 16 MiB, no tail stranded"
    );
    assert_eq!(e.stats.extensions, 1);
    e.validate().unwrap();
    e.teardown(&d);
    // Off: the tail is under half the request and stays; a new 8 MiB span is created.
    let (d, mut e) = engine(Config::default().with_contiguous(false));
    e.alloc(&d, 7 * M, s).unwrap();
    e.alloc(&d, 9 * M, s).unwrap();
    assert_eq!(e.stats.reserved.current, 18 * M);
    e.teardown(&d);
}

/// Contiguous growth, one handle per request: four 8 MiB spans, the second and fourth freed
/// (clean), then a 3 MiB allocation `t` in a 4 MiB span whose top 1 MiB is a free tail.
fn two_free_handles_and_a_free_tail(recreate: bool) -> (SimDriver, Engine, u64) {
    let mut cfg = Config::default().with_contiguous(true);
    cfg.handle_divisor = 1;
    cfg.recreate = recreate;
    let (d, mut e) = engine(cfg);
    let s = Stream::DEFAULT;
    let p: Vec<u64> = (0..4).map(|_| e.alloc(&d, 8 * M, s).unwrap()).collect();
    let t = e.alloc(&d, 3 * M, s).unwrap(); // a 4 MiB span: 1 MiB free tail at the top
    e.free(&d, p[1], s).unwrap();
    e.free(&d, p[3], s).unwrap();
    e.poll(&d, true).unwrap();
    (d, e, t)
}

#[test]
fn a_stitched_span_is_linked_after_the_largest_clean_free_tail() {
    let (d, mut e, t) = two_free_handles_and_a_free_tail(false);
    let s = Stream::DEFAULT;
    // 12 MiB: the two free 8 MiB handles are moved; with no room in the free blocks,
    // the span goes after the run's free tail (the highest run end).
    let got = plan(&e, Pool::Large, 12 * M);
    let Some(Step::Build(b)) = got.steps.last() else {
        panic!("a build expected: {got:?}")
    };
    let tail = b.extend.expect("linked after a run end");
    assert_eq!(e.arena.blocks[tail as usize].addr, t + 3 * M);
    let q = e.alloc(&d, 12 * M, s).unwrap();
    assert_eq!(q, t + 3 * M, "the allocation starts in the free tail");
    e.validate().unwrap();
    e.teardown(&d);
}

#[test]
fn a_tail_grown_from_two_free_handles_recreates_them() {
    // The checkerboard's last stitch grows a free tail: its free handles are released and
    // created anew (as a stitch into a new span is), not unmapped and remapped one by one
    // (modeled driver time of the checkerboard with contiguous growth: 2.9 s -> 1.06 s).
    let (d, mut e, t) = two_free_handles_and_a_free_tail(true);
    let s = Stream::DEFAULT;
    let got = plan(&e, Pool::Large, 17 * M);
    let [Step::Release(r), Step::Build(b)] = got.steps.as_slice() else {
        panic!("release then build expected: {got:?}")
    };
    assert_eq!(r.len(), 2, "both free 8 MiB handles released");
    assert!(b.chosen.is_empty());
    assert_eq!((b.create, b.recreated), (Create::Exact(16 * M), 2));
    let tail = b.extend.expect("grown after the free tail");
    assert_eq!(e.arena.blocks[tail as usize].addr, t + 3 * M);
    let q = e.alloc(&d, 17 * M, s).unwrap();
    assert_eq!(q, t + 3 * M, "the allocation starts in the tail");
    assert_eq!(e.stats.recreated_handles, 2);
    e.validate().unwrap();
    e.teardown(&d);
}

/// A stitch for a request that fits no free block grows the requesting stream's own dirty
/// free tail in place (the stream may use it at once) rather than building a new run beside
/// it: the request starts in the tail's partial granule and one handle fewer is moved.
#[test]
fn a_stitch_grows_the_requesting_streams_dirty_tail() {
    // A dirty 1 MiB tail after y, and 32 MiB of the same stream's dirty blocks elsewhere.
    let (d, mut e, a, y) = Engine::dirty_tail_scene();
    let moved = e.stats.stitched_handles;
    // 26.5 MiB fits no free block and the budget allows no growth: 26 MiB of the 16 MiB
    // blocks' handles are mapped after the tail, and the request starts in it.
    let w = e.alloc(&d, 53 * M / 2, a).unwrap();
    assert_eq!(w, y + 27 * M, "placed in the tail");
    assert_eq!(e.stats.reserved.current, 64 * M, "nothing created");
    assert_eq!(
        e.stats.stitched_handles - moved,
        13,
        "13 handles of 2 MiB moved, not 14"
    );
    e.validate().unwrap();
    d.complete_all();
    e.teardown(&d);
    assert!(d.leak_report().is_clean());
}

/// Free bytes that no request larger than a granule can use where they are and no stitch
/// can move: free blocks holding no whole handle, inside handles that hold live bytes
/// (computed from the public layout, not from the policy's own flags).
fn isolated_piece_bytes(a: &crate::Allocator<SimDriver>) -> u64 {
    let l = a.snapshot();
    let mut n = 0;
    for b in l.runs.iter().flatten().filter(|b| b.state != "live") {
        let end = b.addr + b.size;
        let whole = l
            .handles
            .iter()
            .any(|h| h.addr.is_some_and(|ha| b.addr <= ha && ha + h.size <= end));
        if !whole {
            n += b.size;
        }
    }
    n
}

/// `Config::spare_pieces`: two free blocks of 2 MiB handles, one (8 MiB freed between a 3
/// MiB and a 1 MiB live block) whose first and last whole handles border 1 MiB pieces of
/// live handles, one (8 MiB freed between blocks that end and start on handle boundaries)
/// whose handles border none; an 11 MiB request stitches six of the seven free handles
/// (and grows the 1 MiB free tail after the last live block, in both settings). Sparing
/// pieces leaves a handle that borders one in place with both pieces still attached to
/// usable free blocks: no isolated piece afterwards. The default order cuts off 2 MiB.
#[test]
fn a_stitch_spares_pieces_of_live_handles_when_asked() {
    let run = |spare: bool| {
        let cfg = Config::default()
            .with_loop_region(false)
            .with_chain_fit(false)
            .with_spare_pieces(spare);
        let a = crate::Allocator::new(SimDriver::with_capacity(1 << 30), cfg).unwrap();
        let s = Stream::DEFAULT;
        let _x = a.alloc(3 * M, s).unwrap();
        let y1 = a.alloc(8 * M, s).unwrap();
        let _z = a.alloc(M, s).unwrap();
        let y2 = a.alloc(8 * M, s).unwrap();
        let _q = a.alloc(M, s).unwrap();
        a.free(y1, s).unwrap();
        a.free(y2, s).unwrap();
        let before = isolated_piece_bytes(&a);
        let _w = a.alloc(11 * M, s).unwrap();
        a.validate().unwrap();
        (before, isolated_piece_bytes(&a), a.stats().stitches)
    };
    let (off_before, off_after, off_stitches) = run(false);
    let (on_before, on_after, on_stitches) = run(true);
    assert_eq!(
        (off_before, on_before),
        (M, M),
        "the 1 MiB tail after the last block"
    );
    assert_eq!((off_stitches, on_stitches), (1, 1));
    assert!(
        on_after < off_after && on_after <= on_before,
        "isolated piece bytes: default {off_after}, sparing {on_after}"
    );
}
