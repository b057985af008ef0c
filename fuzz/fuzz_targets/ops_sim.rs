//! Allocation sequences on SimDriver (a tight 256 MiB device so OOM and stitching are
//! frequent), every invariant checked after every step by the shared harness.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stitch_alloc::driver::SimDriver;
use stitch_alloc::testing::{Harness, Op};
use stitch_alloc::Config;

const MIB: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    // The first byte picks a policy, so every configuration gets fuzzed.
    let (cfg, rest) = match data.split_first() {
        Some((b, rest)) => {
            let mut cfg = Config::default()
                .with_stitching(b & 1 == 0)
                .with_reserve_slack(if b & 2 == 0 { 0.0 } else { 0.01 }, 0)
                .with_handle_sizes(
                    0,
                    [4 * MIB, 16 * MIB, 64 * MIB, 128 * MIB][(b >> 2 & 3) as usize],
                )
                .with_medium(if b & 16 == 0 { 0 } else { 8 * MIB }, 32 * MIB);
            if b & 32 != 0 {
                // Coarser handles, request / 32 down to 4 MiB (the default before
                // 2026-12-02, README's setting for fewer driver calls).
                cfg.split_min = 4 * MIB;
                cfg.handle_divisor = 32;
            }
            (cfg, rest)
        }
        None => return,
    };
    let ops = Op::decode(rest, 256 * MIB);
    let h = Harness::new(SimDriver::with_capacity(256 * MIB), cfg).expect("allocator starts");
    if let Err(e) = h.run(&ops) {
        panic!("invariant violated: {e}");
    }
});
