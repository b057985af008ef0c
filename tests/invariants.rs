//! Every invariant of `stitch_alloc::testing::Harness`, over random operation sequences,
//! on SimDriver at scale and on HostDriver with real data.

mod common;

use proptest::prelude::*;
use stitch_alloc::driver::{HostDriver, SimDriver};
use stitch_alloc::testing::Harness;
use stitch_alloc::{Capacity, Config};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(256), ..ProptestConfig::default() })]

    /// A whole simulated H200, mixed sizes up to 70 GiB, one stream.
    #[test]
    fn sim_h200_scale(ops in prop::collection::vec(common::op(140 * GIB, false), 1..150)) {
        let h = Harness::new(SimDriver::new(), Config::default()).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// A tight 512 MiB device: frequent OOMs (each checked against the zero-fragmentation
    /// bound) and stitching.
    #[test]
    fn sim_tight_capacity(ops in prop::collection::vec(common::op(512 * MIB, false), 1..250)) {
        let h = Harness::new(SimDriver::with_capacity(512 * MIB), Config::default()).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// Contiguous growth (`Config::contiguous`), streams and a tight device: OOMs checked
    /// against the zero-fragmentation bound, the stream rule, aliasing.
    #[test]
    fn sim_contiguous(ops in prop::collection::vec(common::op(256 * MIB, true), 1..200)) {
        let cfg = Config::default().with_contiguous(true).with_reserve_slack(0.0, 0);
        let h = Harness::new(SimDriver::with_capacity(256 * MIB), cfg).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// Contiguous growth: large allocations only, one stream, hold their sum rounded up to
    /// the granularity once, as one growing segment would (no tail left stranded beside a
    /// new span), plus at most the pieces skipped by requests that start at a handle
    /// boundary rather than inside their neighbour's last handle (each under a granule and
    /// at most 1/50 of its request: placement.rs `ALIGN_RATIO`); every invariant still
    /// holds after each one.
    #[test]
    fn contiguous_growth_strands_no_tail(sizes in prop::collection::vec(MIB + 1..48 * MIB, 1..40)) {
        let cfg = Config::default().with_contiguous(true);
        let mut h = Harness::new(SimDriver::with_capacity(4 * GIB), cfg).unwrap();
        let g = h.alloc.granularity();
        let (mut sum, mut skipped) = (0, 0);
        for size in sizes {
            h.apply(stitch_alloc::testing::Op::Alloc { size, stream: 0 }).map_err(TestCaseError::fail)?;
            let rsize = size.div_ceil(512) * 512;
            sum += rsize;
            skipped += (rsize / 50).min(g - 512);
            let reserved = h.alloc.stats().reserved.current;
            prop_assert!(reserved >= sum.div_ceil(g) * g);
            prop_assert!(reserved <= (sum + skipped).div_ceil(g) * g, "{} > {} + {}", reserved, sum, skipped);
        }
        h.finish().map_err(TestCaseError::fail)?;
    }

    /// Streams, in-flight work, cross-stream frees and record_stream on a tight device;
    /// reuse first (no growth slack), so stitching runs on every miss.
    #[test]
    fn sim_streams(ops in prop::collection::vec(common::op(256 * MIB, true), 1..250)) {
        let cfg = Config::default().with_reserve_slack(0.0, 0);
        let h = Harness::new(SimDriver::with_capacity(256 * MIB), cfg).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// Small handles (max 4 MiB each): many handles per stitch.
    #[test]
    fn sim_small_handles(ops in prop::collection::vec(common::op(256 * MIB, true), 1..200)) {
        let cfg = Config::default().with_handle_sizes(0, 4 * MIB).with_reserve_slack(0.0, 0);
        let h = Harness::new(SimDriver::with_capacity(256 * MIB), cfg).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// Coarser handles (the default before 2026-12-02, README's setting for fewer driver
    /// calls: at most 20 MiB, request / 32, down to 4 MiB): handles of sizes that are not
    /// powers of two at span ends, fewer handles per stitch. The default's own finer
    /// handles run in every other `sim_*` case.
    #[test]
    fn sim_coarse_handles(ops in prop::collection::vec(common::op(256 * MIB, true), 1..200)) {
        let mut cfg = Config::default().with_handle_sizes(0, 20 * MIB).with_reserve_slack(0.0, 0);
        cfg.split_min = 4 * MIB;
        cfg.handle_divisor = 32;
        let h = Harness::new(SimDriver::with_capacity(256 * MIB), cfg).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// The medium pool on (requests of 1-8 MiB packed into 32 MiB pages).
    #[test]
    fn sim_medium_pool(ops in prop::collection::vec(common::op(256 * MIB, true), 1..200)) {
        let cfg = Config::default().with_medium(8 * MIB, 32 * MIB).with_reserve_slack(0.0, 0);
        let h = Harness::new(SimDriver::with_capacity(256 * MIB), cfg).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// Stitching off: the plain caching baseline must keep every invariant too.
    #[test]
    fn sim_no_stitch(ops in prop::collection::vec(common::op(256 * MIB, true), 1..200)) {
        let cfg = Config::default().with_stitching(false);
        let h = Harness::new(SimDriver::with_capacity(256 * MIB), cfg).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }

    /// Real memory: bytes written into live allocations survive every later operation,
    /// stitching included.
    #[test]
    fn host_data_integrity(ops in prop::collection::vec(common::op(128 * MIB, true), 1..150)) {
        let dev = HostDriver::with_capacity(128 * MIB).unwrap();
        let cfg = Config::default()
            .with_capacity(Capacity::Bytes(128 * MIB))
            .with_reserve_slack(0.0, 0);
        let h = Harness::new(dev, cfg).unwrap();
        h.run(&ops).map_err(TestCaseError::fail)?;
    }
}

/// Decoded byte strings (the fuzz targets' input form) run through the same harness.
#[test]
fn decoded_bytes_drive_the_harness() {
    let mut seed = 0x1234_5678_u64;
    for _ in 0..64 {
        let bytes: Vec<u8> = (0..600)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let ops = stitch_alloc::testing::Op::decode(&bytes, 256 * MIB);
        assert!(!ops.is_empty());
        let h = Harness::new(SimDriver::with_capacity(256 * MIB), Config::default()).unwrap();
        h.run(&ops).unwrap();
    }
}

/// The oracle's count of handles holding live data, on a layout worked out by hand: with
/// handles of at most 4 MiB, a 6 MiB allocation is served by handles totalling 6 MiB; a
/// 1 MiB one goes into a small page (another handle).
#[test]
fn oracle_counts_handles_from_the_device_ledger() {
    use stitch_alloc::testing::Op;
    let cfg = Config::default().with_handle_sizes(0, 4 * MIB);
    let mut h = Harness::new(SimDriver::with_capacity(64 * MIB), cfg).unwrap();
    assert_eq!(h.handles_holding_live_data(), Some(0));
    h.apply(Op::Alloc {
        size: 6 * MIB,
        stream: 0,
    })
    .unwrap();
    assert_eq!(h.handles_holding_live_data(), Some(6 * MIB));
    h.apply(Op::Alloc {
        size: MIB,
        stream: 0,
    })
    .unwrap();
    let with_small = h.handles_holding_live_data().unwrap();
    assert!(
        with_small > 6 * MIB,
        "the small page's handle holds a live byte"
    );
    assert_eq!(with_small, h.alloc.detailed_stats().live_handle_bytes);
    // Freeing the large allocation leaves its handles mapped but holding nothing.
    let large = 0; // the first live allocation
    h.apply(Op::Free { pick: large }).unwrap();
    assert_eq!(h.handles_holding_live_data(), Some(with_small - 6 * MIB));
    h.finish().unwrap();
}
