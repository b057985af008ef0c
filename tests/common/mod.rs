//! Proptest strategies over the shared `Op` language (see `stitch_alloc::testing`).
#![allow(dead_code)]

use proptest::prelude::*;
use stitch_alloc::testing::Op;

/// A size drawn from a mix of small, medium and large requests, scaled to `max`.
pub fn size(max: u64) -> impl Strategy<Value = u64> {
    let mid = (64u64 << 20).min(max / 4).max(2 << 20);
    prop_oneof![
        4 => 1u64..=(1 << 20),
        4 => (1u64 << 20)..=mid,
        2 => mid..=max / 2,
        1 => Just(0u64),
        1 => (max - max / 8)..=(max + 1),
    ]
}

/// One operation; `streams` turns stream ops on.
pub fn op(max: u64, streams: bool) -> impl Strategy<Value = Op> {
    let alloc = (size(max), 0u8..3).prop_map(|(size, stream)| Op::Alloc { size, stream });
    let free = any::<u32>().prop_map(|pick| Op::Free { pick });
    if !streams {
        return prop_oneof![5 => alloc, 4 => free, 1 => Just(Op::EmptyCache)].boxed();
    }
    prop_oneof![
        5 => alloc,
        4 => free,
        1 => (any::<u32>(), 0u8..3).prop_map(|(pick, stream)| Op::FreeOn { pick, stream }),
        2 => any::<u32>().prop_map(|pick| Op::Launch { pick }),
        1 => (any::<u32>(), 0u8..3).prop_map(|(pick, stream)| Op::UseOn { pick, stream }),
        2 => (0u8..3).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::CompleteAll),
        1 => Just(Op::EmptyCache),
    ]
    .boxed()
}

/// Proptest cases: `PROPTEST_CASES` if set, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The guard at the top of every GPU test. With a usable CUDA device it returns `true`.
/// Without one it fails the test when `STITCH_REQUIRE_GPU=1` (set where the GPU bundle runs
/// the tests: `scripts/gpu-check.sh run`, `scripts/gpu-session.sh suite`), so a GPU run
/// cannot pass without a GPU; elsewhere it prints `SKIPPED (no CUDA device): <test>` to
/// stderr and returns `false`. The GPU tests are also `#[ignore]`d, so a plain
/// `cargo test` reports them as ignored, never as passed; they run with `--include-ignored`.
pub fn gpu_or_skip(test: &str) -> bool {
    if stitch_alloc::CudaDriver::available() {
        return true;
    }
    let why = stitch_alloc::CudaDriver::unavailable_reason().unwrap_or_default();
    if std::env::var("STITCH_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{test}: no CUDA device ({why}), and STITCH_REQUIRE_GPU=1 demands one");
    }
    // Written to the stderr handle directly: libtest does not capture that, so the skip is
    // visible in every run, not only in failing ones.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED (no CUDA device): {test} ({why})"
    );
    false
}
