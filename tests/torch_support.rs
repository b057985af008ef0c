//! What the PyTorch extension needs from the engine (issue #12): statistics resets, a
//! capacity changed at run time, and graph-pool allocation that touches no event.

use std::sync::Arc;
use stitch_alloc::driver::{DriverOp, SimDriver};
use stitch_alloc::{AllocError, Allocator, Config, Stream};

const MIB: u64 = 1 << 20;
const S1: Stream = Stream::sim(1);
const S2: Stream = Stream::sim(2);

fn sim(cap: u64) -> Allocator<Arc<SimDriver>> {
    let d = Arc::new(SimDriver::with_capacity(cap));
    Allocator::new(d, Config::default().with_paranoid(true)).unwrap()
}

fn events(a: &Allocator<Arc<SimDriver>>) -> u64 {
    let c = a.stats().calls;
    c.get(DriverOp::RecordEvent) + c.get(DriverOp::QueryEvent) + c.get(DriverOp::WaitEvent)
}

#[test]
fn reset_peaks_starts_from_current_and_keeps_the_growth_budget() {
    let a = sim(1 << 30);
    let p = a.alloc(64 * MIB, S1).unwrap();
    let q = a.alloc(32 * MIB, S1).unwrap();
    a.free(p, S1).unwrap();
    let before = a.stats();
    assert_eq!(before.requested.peak, 96 * MIB);
    a.reset_peak_stats();
    let s = a.stats();
    assert_eq!(s.requested.peak, 32 * MIB);
    assert_eq!(s.allocated.peak, s.allocated.current);
    assert_eq!(s.reserved.peak, s.reserved.current);
    assert_eq!(s.live_allocations.peak, 1);
    assert_eq!(
        s.requested_lifetime_peak,
        96 * MIB,
        "the policy's budget is kept"
    );
    assert_eq!(s.allocs, before.allocs, "accumulated counters untouched");
    // Peaks grow again from there.
    let r = a.alloc(8 * MIB, S1).unwrap();
    assert_eq!(a.stats().requested.peak, 40 * MIB);
    a.reset_accumulated_stats();
    let s = a.stats();
    assert_eq!((s.allocs, s.frees, s.calls.total(), s.ooms), (0, 0, 0, 0));
    assert_eq!(s.live_allocations.current, 2, "gauges untouched");
    assert_eq!(s.requested.peak, 40 * MIB);
    a.free(q, S1).unwrap();
    a.free(r, S1).unwrap();
    assert_eq!(a.stats().frees, 2);
    a.validate().unwrap();
}

#[test]
fn lowering_the_capacity_fails_later_allocations_and_keeps_live_ones() {
    let a = sim(1 << 30);
    let live: Vec<_> = (0..4).map(|_| a.alloc(64 * MIB, S1).unwrap()).collect();
    let spare = a.alloc(128 * MIB, S1).unwrap();
    a.free(spare, S1).unwrap();
    assert!(a.stats().reserved.current >= 384 * MIB);
    // Below what is reserved (not below what is live).
    assert_eq!(a.set_capacity(300 * MIB + 5).unwrap(), 300 * MIB);
    assert_eq!(a.capacity(), 300 * MIB);
    a.validate().unwrap();
    for &p in &live {
        assert_eq!(
            a.usable_size(p),
            Some(64 * MIB),
            "live allocations untouched"
        );
    }
    // 256 MiB live: 44 MiB more fits under 300 MiB, 64 MiB does not.
    match a.alloc(64 * MIB, S2) {
        Err(AllocError::OutOfMemory(r)) => assert_eq!(r.capacity, 300 * MIB),
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert!(matches!(
        a.alloc(301 * MIB, S2),
        Err(AllocError::TooLarge { .. })
    ));
    let small = a.alloc(40 * MIB, S2).unwrap();
    a.validate().unwrap();
    assert!(a.stats().reserved.current <= 384 * MIB);
    // Raising it again lets the 64 MiB in.
    a.set_capacity(1 << 30).unwrap();
    let big = a.alloc(64 * MIB, S2).unwrap();
    for p in live.into_iter().chain([small, big]) {
        a.free(p, S2).unwrap();
    }
    assert!(a.set_capacity(1).is_err(), "below one granule");
    a.validate().unwrap();
}

#[test]
fn graph_pool_allocation_records_and_queries_no_event() {
    let a = sim(1 << 30);
    // Dirty memory on S1 (freed, unfenced) and a pending multi-stream free: the ordinary
    // slow path would record and query events for both.
    let p = a.alloc(64 * MIB, S1).unwrap();
    let q = a.alloc(64 * MIB, S1).unwrap();
    a.record_stream(q, S2).unwrap();
    a.free(p, S1).unwrap();
    a.free(q, S1).unwrap(); // records events on S1 and S2 now
    let before = events(&a);
    // Sizes the dirty block would fit, a new span, and a small page.
    let g1 = a.alloc_clean(32 * MIB, S1).unwrap();
    let g2 = a.alloc_clean(200 * MIB, S1).unwrap();
    let g3 = a.alloc_clean(4096, S1).unwrap();
    assert_eq!(
        events(&a),
        before,
        "no event recorded, queried or waited for"
    );
    assert_ne!(g1, p, "the dirty block freed on S1 is not taken");
    for g in [g1, g2, g3] {
        a.free_clean(g).unwrap();
    }
    assert_eq!(events(&a), before, "a clean free records nothing");
    // Clean memory is reused at once by any stream, with no event.
    let reserved = a.stats().reserved.current;
    let r = a.alloc_clean(200 * MIB, S2).unwrap();
    assert_eq!(
        a.stats().reserved.current,
        reserved,
        "the freed memory is reused, nothing is created"
    );
    assert_eq!(events(&a), before);
    assert!(a.free_clean(r).is_ok());
    assert!(a.free_clean(r).is_err(), "double free");
    a.validate().unwrap();
}

#[test]
fn graph_pool_allocation_out_of_memory_is_a_report() {
    let a = sim(256 * MIB);
    let p = a.alloc(200 * MIB, S1).unwrap();
    a.free(p, S1).unwrap(); // dirty on S1: not usable by alloc_clean
    match a.alloc_clean(200 * MIB, S1) {
        Err(AllocError::OutOfMemory(r)) => assert_eq!(r.requested, 200 * MIB),
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert_eq!(a.stats().ooms, 1);
    // The ordinary path still serves it (same stream).
    let q = a.alloc(200 * MIB, S1).unwrap();
    a.free(q, S1).unwrap();
    a.validate().unwrap();
}
