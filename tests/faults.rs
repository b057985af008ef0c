//! Driver fault injection: whatever call fails, the request gets an error, earlier
//! allocations and their bytes stay intact, nothing leaks, and later requests succeed.

mod common;

use proptest::prelude::*;
use std::sync::Arc;
use stitch_alloc::driver::faulty::INJECTABLE;
use stitch_alloc::driver::{DriverOp, FaultyDriver, HostDriver, SimDriver};
use stitch_alloc::testing::{Harness, Op};
use stitch_alloc::{AllocError, Allocator, Capacity, Config, Stream};

const MIB: u64 = 1 << 20;

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(128), ..ProptestConfig::default() })]

    /// Random failures of every kind of call, on a tight device with streams.
    #[test]
    fn random_faults_sim(
        ops in prop::collection::vec(common::op(256 * MIB, true), 1..200),
        seed in any::<u64>(),
        prob in 0.01f64..0.3,
    ) {
        let dev = FaultyDriver::new(SimDriver::with_capacity(256 * MIB));
        dev.fail_randomly(&INJECTABLE, prob, seed);
        dev.set_enabled(false);
        let cfg = Config::default().with_reserve_slack(0.0, 0).with_handle_sizes(0, 16 * MIB);
        let h = Harness::new(dev, cfg).map_err(|e| TestCaseError::fail(e.to_string()))?;
        h.dev.set_enabled(true);
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// The same on real memory: bytes of live allocations survive every failure.
    #[test]
    fn random_faults_host(
        ops in prop::collection::vec(common::op(64 * MIB, true), 1..120),
        seed in any::<u64>(),
    ) {
        let dev = FaultyDriver::new(HostDriver::with_capacity(64 * MIB).unwrap());
        dev.fail_randomly(&INJECTABLE[..9], 0.1, seed); // all but destroy_event
        dev.set_enabled(false);
        let cfg = Config::default()
            .with_capacity(Capacity::Bytes(64 * MIB))
            .with_reserve_slack(0.0, 0)
            .with_handle_sizes(0, 8 * MIB);
        let h = Harness::new(dev, cfg).map_err(|e| TestCaseError::fail(e.to_string()))?;
        h.dev.set_enabled(true);
        h.run(&ops).map_err(TestCaseError::fail)?;
    }
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
        assert!(matches!(e, AllocError::Driver { .. }), "{e}");
        assert!(dev.inner().leak_report().is_clean());
    }
}
