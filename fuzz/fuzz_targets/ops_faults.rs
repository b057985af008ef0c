//! Allocation sequences with driver failures injected at random (seed and rate from the
//! input): every failure must leave the allocator consistent and leak-free, and the number
//! of faults that fired must agree with the rate. The body is
//! `stitch_alloc::testing::ops_with_faults`, which tests/fuzz_regressions.rs also runs over
//! the committed corpus.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = stitch_alloc::testing::ops_with_faults(data) {
        panic!("invariant violated: {e}");
    }
});
