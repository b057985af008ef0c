//! Allocation sequences on real memory (HostDriver): bytes written into live allocations must
//! survive every later operation, stitching included.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stitch_alloc::driver::HostDriver;
use stitch_alloc::testing::{Harness, Op};
use stitch_alloc::{Capacity, Config};

const MIB: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let ops = Op::decode(data, 64 * MIB);
    let dev = HostDriver::with_capacity(64 * MIB).expect("host device");
    let cfg = Config::default()
        .with_capacity(Capacity::Bytes(64 * MIB))
        .with_reserve_slack(0.0, 0)
        .with_handle_sizes(0, 8 * MIB);
    let h = Harness::new(dev, cfg).expect("allocator starts");
    if let Err(e) = h.run(&ops) {
        panic!("invariant violated: {e}");
    }
});
