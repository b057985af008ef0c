//! Allocation sequences with driver failures injected at random (seed and rate from the
//! input): every failure must leave the allocator consistent and leak-free.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stitch_alloc::driver::faulty::INJECTABLE;
use stitch_alloc::driver::{FaultyDriver, SimDriver};
use stitch_alloc::testing::{Harness, Op};
use stitch_alloc::Config;

const MIB: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let seed = u64::from_le_bytes(data[..8].try_into().unwrap());
    let prob = data[8] as f64 / 512.0;
    let ops = Op::decode(&data[9..], 256 * MIB);
    let dev = FaultyDriver::new(SimDriver::with_capacity(256 * MIB));
    dev.fail_randomly(&INJECTABLE, prob, seed);
    dev.set_enabled(false);
    let cfg = Config::default()
        .with_reserve_slack(0.0, 0)
        .with_handle_sizes(0, 16 * MIB);
    let h = Harness::new(dev, cfg).expect("allocator starts");
    h.dev.set_enabled(true);
    if let Err(e) = h.run(&ops) {
        panic!("invariant violated: {e}");
    }
});
