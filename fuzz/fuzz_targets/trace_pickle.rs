//! The PyTorch memory-snapshot reader on arbitrary bytes: an error naming the event, or a
//! valid trace; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stitch_alloc::trace::pytorch::parse_snapshot;

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = parse_snapshot(data, None) {
        t.validate().expect("a parsed snapshot validates");
    }
});
