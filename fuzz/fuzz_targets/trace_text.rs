//! The trace reader (text, gzip or PyTorch pickle, detected from the bytes) on arbitrary
//! input: an error value or a valid trace, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stitch_alloc::trace::{read_bytes, ReadOptions};

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = read_bytes(data, ReadOptions::default()) {
        // A trace that parsed is consistent, and survives a write/read round trip.
        t.validate().expect("a parsed trace validates");
        let again = stitch_alloc::trace::Trace::parse_str(&t.to_text()).expect("round trip");
        assert_eq!(again.events, t.events);
    }
});
