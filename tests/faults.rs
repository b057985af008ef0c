//! Driver fault injection: whatever call fails, the request gets an error, earlier
//! allocations and their bytes stay intact, nothing leaks, and later requests succeed.
//! Every test also asserts how many faults fired: the scheduled ones exactly, the random
//! ones against their rate, per case and over all cases (`FaultTally`).

mod common;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use std::sync::{Arc, Mutex};
use stitch_alloc::driver::faulty::INJECTABLE;
use stitch_alloc::driver::{CallCounts, DriverOp, FaultyDriver, HostDriver, SimDriver};
use stitch_alloc::testing::{calls_between, FaultTally, Harness, Op};
use stitch_alloc::{AllocError, Allocator, Capacity, Config, Stream};

const MIB: u64 = 1 << 20;

/// What the random-fault tests add up over their cases.
#[derive(Default)]
struct Totals {
    tally: FaultTally,
    /// Operations that failed because of a fault.
    faulted: u64,
    cases: u64,
}

/// Runs one random-fault case: `ops` on a fresh harness over `dev`, faults of `kinds` at
/// probability `prob` (already set on `dev`) while the operations run. Checks every
/// invariant, then that the faults fired agree with the rate, and adds the case to `totals`.
fn fault_case<D>(
    dev: FaultyDriver<D>,
    cfg: Config,
    ops: &[Op],
    kinds: &[DriverOp],
    prob: f64,
    totals: &Mutex<Totals>,
) -> Result<(), TestCaseError>
where
    D: stitch_alloc::testing::TestDevice,
    D: Calls,
{
    dev.set_enabled(false);
    let mut h = Harness::new(dev, cfg).map_err(|e| TestCaseError::fail(e.to_string()))?;
    h.dev.set_enabled(true);
    let before = h.dev.inner().call_counts();
    h.apply_all(ops).map_err(TestCaseError::fail)?;
    let fired = h.dev.injected();
    // A failed call never reaches the wrapped device: draws = its calls + the faults.
    let draws = calls_between(&before, &h.dev.inner().call_counts(), kinds) + fired;
    let counts = h.finish().map_err(TestCaseError::fail)?;
    prop_assert_eq!(counts.faults_fired, fired);
    prop_assert!(counts.faulted <= fired, "{:?}", counts);
    let mut tally = FaultTally::default();
    tally.add(draws, fired, prob);
    tally.check().map_err(TestCaseError::fail)?;
    let mut t = totals.lock().unwrap();
    t.tally.merge(&tally);
    t.faulted += counts.faulted;
    t.cases += 1;
    Ok(())
}

/// The wrapped device's call counts (both CPU backends count every call by kind).
trait Calls {
    fn call_counts(&self) -> CallCounts;
}
impl Calls for SimDriver {
    fn call_counts(&self) -> CallCounts {
        self.calls()
    }
}
impl Calls for HostDriver {
    fn call_counts(&self) -> CallCounts {
        self.calls()
    }
}

/// Runs `cases` random cases through `case`, then checks the totals: the faults fired over
/// all cases agree with the rates, and where dozens were expected, faults fired and made
/// operations fail (a run in which injection silently stopped would pass every per-case
/// check with few draws, not this one).
fn run_fault_cases<S: Strategy>(
    cases: u32,
    strategy: S,
    case: impl Fn(S::Value, &Mutex<Totals>) -> Result<(), TestCaseError>,
) {
    let totals = Mutex::new(Totals::default());
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        ..ProptestConfig::default()
    });
    if let Err(e) = runner.run(&strategy, |v| case(v, &totals)) {
        panic!("{e}");
    }
    let t = totals.into_inner().unwrap();
    eprintln!(
        "{} cases: {} faults fired in {} draws ({:.1} expected), {} operations failed by them",
        t.cases, t.tally.fired, t.tally.draws, t.tally.expected, t.faulted
    );
    t.tally.check().unwrap();
    if t.tally.expected >= 20.0 {
        assert!(t.tally.fired > 0, "no fault fired: {:?}", t.tally);
        assert!(
            t.faulted > 0,
            "faults fired but no operation failed: {:?}",
            t.tally
        );
    }
}

/// Random failures of every kind of call, on a tight device with streams.
#[test]
fn random_faults_sim() {
    let strategy = (
        prop::collection::vec(common::op(256 * MIB, true), 1..200),
        any::<u64>(),
        0.01f64..0.3,
    );
    run_fault_cases(common::cases(128), strategy, |(ops, seed, prob), totals| {
        let dev = FaultyDriver::new(SimDriver::with_capacity(256 * MIB));
        dev.fail_randomly(&INJECTABLE, prob, seed);
        let cfg = Config::default()
            .with_reserve_slack(0.0, 0)
            .with_handle_sizes(0, 16 * MIB);
        fault_case(dev, cfg, &ops, &INJECTABLE, prob, totals)
    });
}

/// The same on real memory: bytes of live allocations survive every failure.
#[test]
fn random_faults_host() {
    let strategy = (
        prop::collection::vec(common::op(64 * MIB, true), 1..120),
        any::<u64>(),
    );
    run_fault_cases(common::cases(128), strategy, |(ops, seed), totals| {
        let dev = FaultyDriver::new(HostDriver::with_capacity(64 * MIB).unwrap());
        let kinds = &INJECTABLE[..9]; // all but destroy_event
        dev.fail_randomly(kinds, 0.1, seed);
        let cfg = Config::default()
            .with_capacity(Capacity::Bytes(64 * MIB))
            .with_reserve_slack(0.0, 0)
            .with_handle_sizes(0, 8 * MIB);
        fault_case(dev, cfg, &ops, kinds, 0.1, totals)
    });
}

/// Every call of a stitch, failed in turn: the k-th map (half the handles mapped), the k-th
/// unmap, the set_access, the create of the shortfall.
#[test]
fn each_step_of_a_stitch_can_fail() {
    let mut schedules = 0;
    let mut fired = 0;
    // The stitch below unmaps 8 handles (4 holes of 16 + 14 MiB), creates 1 for the
    // shortfall, maps 9 and sets access once.
    for (op, calls) in [
        (DriverOp::Unmap, 8),
        (DriverOp::Map, 9),
        (DriverOp::SetAccess, 1),
        (DriverOp::Create, 1),
    ] {
        for k in 1..=calls {
            let dev = FaultyDriver::new(SimDriver::with_capacity(256 * MIB));
            let cfg = Config::default()
                .with_reserve_slack(0.0, 0)
                .with_handle_sizes(0, 16 * MIB);
            let mut h = Harness::new(dev, cfg).unwrap();
            for _ in 0..8 {
                h.apply(Op::Alloc {
                    size: 30 * MIB,
                    stream: 0,
                })
                .unwrap();
            }
            for i in 0..4 {
                h.apply(Op::Free { pick: i }).unwrap();
            }
            h.dev.fail_nth(op, k);
            // Needs a stitch of several handles (and some new memory).
            h.apply(Op::Alloc {
                size: 130 * MIB,
                stream: 0,
            })
            .unwrap();
            fired += h.dev.injected();
            h.dev.set_enabled(false);
            // The allocator serves the same request once the driver recovers.
            h.apply(Op::Alloc {
                size: 130 * MIB,
                stream: 0,
            })
            .unwrap();
            let counts = h.finish().unwrap();
            assert!(counts.allocs >= 9, "{op:?} #{k}: {counts:?}");
            schedules += 1;
        }
    }
    assert_eq!(schedules, 19);
    assert_eq!(fired, 19, "every schedule must hit its call");
}

#[test]
fn driver_failure_is_a_typed_error_and_nothing_leaks() {
    let dev = Arc::new(FaultyDriver::new(SimDriver::with_capacity(GIB)));
    let a = Allocator::new(dev.clone(), Config::default().with_paranoid(true)).unwrap();
    dev.fail_nth(DriverOp::SetAccess, 1);
    let e = a.alloc(100 * MIB, Stream::DEFAULT).unwrap_err();
    assert!(
        matches!(
            e,
            AllocError::Driver {
                op: DriverOp::SetAccess,
                ..
            }
        ),
        "{e}"
    );
    let p = a.alloc(100 * MIB, Stream::DEFAULT).unwrap();
    a.free(p, Stream::DEFAULT).unwrap();
    drop(a);
    assert!(
        dev.inner().leak_report().is_clean(),
        "{:?}",
        dev.inner().leak_report()
    );
}

const GIB: u64 = 1 << 30;

#[test]
fn failed_construction_leaks_nothing() {
    for op in [DriverOp::MemInfo, DriverOp::Reserve] {
        let dev = Arc::new(FaultyDriver::new(SimDriver::with_capacity(GIB)));
        dev.fail_nth(op, 1);
        let e = Allocator::new(dev.clone(), Config::default()).unwrap_err();
        assert!(
            matches!(e, AllocError::Driver { op: failed, code, .. } if failed == op && code == stitch_alloc::driver::code::INJECTED),
            "{op:?}: {e}"
        );
        assert_eq!(dev.injected(), 1);
        assert!(dev.inner().leak_report().is_clean());
    }
}

/// A case `random_faults_host` found (2026-12-01, 2,000 cases): with faults injected, a slow
/// path waited for a stream's fence, and on the next try an owner's block was no longer free.
#[test]
fn random_faults_host_regression_1() {
    use Op::*;
    let ops = [
        Alloc { size: 1, stream: 0 },
        Alloc { size: 1, stream: 0 },
        Alloc { size: 1, stream: 0 },
        Alloc { size: 1, stream: 0 },
        EmptyCache,
        Alloc {
            size: 4194305,
            stream: 0,
        },
        Alloc { size: 1, stream: 2 },
        Launch { pick: 516896414 },
        Free { pick: 49100774 },
        Free { pick: 0 },
        Alloc {
            size: 8388609,
            stream: 0,
        },
        Alloc { size: 1, stream: 0 },
        Complete { stream: 0 },
        Free { pick: 1128768392 },
        Alloc {
            size: 58720256,
            stream: 0,
        },
    ];
    let totals = Mutex::new(Totals::default());
    let dev = FaultyDriver::new(HostDriver::with_capacity(64 * MIB).unwrap());
    let kinds = &INJECTABLE[..9];
    dev.fail_randomly(kinds, 0.1, 2701901258531916570);
    let cfg = Config::default()
        .with_capacity(Capacity::Bytes(64 * MIB))
        .with_reserve_slack(0.0, 0)
        .with_handle_sizes(0, 8 * MIB);
    fault_case(dev, cfg, &ops, kinds, 0.1, &totals).unwrap();
}

#[test]
fn a_failed_contiguous_growth_leaves_the_run_as_it_was() {
    let shape = |h: &Harness<FaultyDriver<SimDriver>>| {
        let l = h.alloc.snapshot();
        // Blocks and runs; a fresh handle of a failed build stays owned, unmapped.
        serde_json::to_string(&l.runs).unwrap()
    };
    for op in [DriverOp::Create, DriverOp::Map, DriverOp::SetAccess] {
        let dev = FaultyDriver::new(SimDriver::with_capacity(256 * MIB));
        let mut h = Harness::new(dev, Config::default().with_contiguous(true)).unwrap();
        // 7 MiB in an 8 MiB span: a 1 MiB free tail that the next request grows.
        h.apply(Op::Alloc {
            size: 7 * MIB,
            stream: 0,
        })
        .unwrap();
        let before = shape(&h);
        h.dev.fail_nth(op, 1);
        h.apply(Op::Alloc {
            size: 9 * MIB,
            stream: 0,
        })
        .unwrap();
        assert_eq!(h.dev.injected(), 1, "{op:?} was called");
        if h.live_count() == 1 {
            // The allocation failed: everything is as it was.
            assert_eq!(shape(&h), before, "{op:?}: rolled back");
            h.dev.set_enabled(false);
            h.apply(Op::Alloc {
                size: 9 * MIB,
                stream: 0,
            })
            .unwrap();
        }
        // Served: at once by a later step of the plan, or once the driver recovers.
        assert_eq!(h.live_count(), 2, "{op:?}");
        assert!(h.alloc.stats().reserved.current <= 18 * MIB, "{op:?}");
        h.finish().unwrap();
    }
}
