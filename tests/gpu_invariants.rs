//! Every invariant of `stitch_alloc::testing::Harness`, over random operation sequences (the
//! strategies of tests/invariants.rs), on a real GPU through `CudaTestDevice`: real streams,
//! real asynchronous work reading the memory it was launched on, data written and read back
//! through the device, and the driver's own count of handles, mappings, reservations and
//! events as the leak check.
//!
//! Every test is `#[ignore]`d: a plain `cargo test` reports it as ignored, and the GPU
//! bundle (`scripts/gpu-check.sh run`) runs it with `--include-ignored` and
//! `STITCH_REQUIRE_GPU=1`, under which a missing GPU fails the test (elsewhere it prints
//! `SKIPPED (no CUDA device): <name>` and returns; see `common::gpu_or_skip`). Cases:
//! `PROPTEST_CASES`, else 32 per test. Run with `--test-threads=1 --include-ignored`.
//!
//! The CUDA driver keeps no ledger of where each handle is mapped, so the harness checks
//! OOMs here against the allocator's own count of live handle bytes (`ooms_unverified`);
//! the independent check runs on the CPU backends (tests/invariants.rs).

mod common;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;
use stitch_alloc::testing::{CudaTestDevice, Harness};
use stitch_alloc::{Capacity, Config, CudaDriver};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Holds the primary context retained for the whole process, so that each case's
/// `CudaTestDevice` does not pay for creating it again (100-200 ms).
static KEEP: OnceLock<Option<CudaDriver>> = OnceLock::new();

/// Runs `cases` random sequences of up to `max_ops` operations (sizes up to `max_size`,
/// stream operations on or off) through a fresh harness on the GPU each.
fn run(test: &str, cfg: Config, max_size: u64, streams: bool, max_ops: usize) {
    if !common::gpu_or_skip(test) {
        return;
    }
    KEEP.get_or_init(|| CudaDriver::new(0).ok());
    let cases = common::cases(32);
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        // Shrinking on a GPU is slow; a failure is reported after a bounded search.
        max_shrink_iters: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let totals: [AtomicU64; 8] = Default::default();
    let t = Instant::now();
    let strategy = prop::collection::vec(common::op(max_size, streams), 1..max_ops);
    let result = runner.run(&strategy, |ops| {
        let dev = CudaTestDevice::new(0).expect("CUDA is available but the device did not open");
        let h = Harness::new(dev, cfg.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let c = h.run(&ops).map_err(TestCaseError::fail)?;
        for (a, v) in totals.iter().zip([
            1,
            ops.len() as u64,
            c.allocs,
            c.frees,
            c.ooms,
            c.ooms_unverified,
            c.in_flight_frees,
            c.allocs_under_hazard,
        ]) {
            a.fetch_add(v, Ordering::Relaxed);
        }
        Ok(())
    });
    let [n, ops, allocs, frees, ooms, unverified, in_flight, under_hazard] =
        totals.map(|a| a.into_inner());
    eprintln!(
        "{test}: {n} passing case(s) of {cases}, {ops} ops: {allocs} allocs, {frees} frees, \
         {ooms} OOMs (each checked against the zero-fragmentation bound, {unverified} of them \
         with the allocator's own live handle count); {in_flight} frees \
         of memory GPU work was still reading, {under_hazard} allocs while such memory \
         existed; in {:.1?}",
        t.elapsed()
    );
    if let Err(e) = result {
        panic!("{test}: {e}");
    }
}

/// A 4 GiB allocator, mixed sizes up to 4 GiB, three streams with in-flight work,
/// cross-stream frees and record_stream.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_invariants_streams() {
    run(
        "gpu_invariants_streams",
        Config::default().with_capacity(Capacity::Bytes(4 * GIB)),
        4 * GIB,
        true,
        200,
    );
}

/// A tight 512 MiB allocator with handles of at most 4 MiB: frequent OOMs and stitches of
/// many handles, with streams.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_invariants_tight_small_handles() {
    run(
        "gpu_invariants_tight_small_handles",
        Config::default()
            .with_capacity(Capacity::Bytes(512 * MIB))
            .with_handle_sizes(0, 4 * MIB),
        512 * MIB,
        true,
        200,
    );
}

/// Stitching off (the plain caching baseline on VMM), one stream.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_invariants_no_stitch() {
    run(
        "gpu_invariants_no_stitch",
        Config::default()
            .with_capacity(Capacity::Bytes(1024 * MIB))
            .with_stitching(false),
        1024 * MIB,
        false,
        100,
    );
}
