//! The C ABI with arbitrary sizes, devices, streams and pointers (live, interior, freed,
//! random): it must never panic across the boundary or abort, never hand out overlapping
//! memory, and report every bad call through `stitch_last_error`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::ffi::{c_void, CStr};
use std::sync::Once;
use stitch_alloc::capi::*;

static INIT: Once = Once::new();

fn last_error() -> String {
    // SAFETY: stitch_last_error returns a NUL-terminated string owned by the library,
    // valid until the next call on this thread.
    unsafe { CStr::from_ptr(stitch_last_error()) }.to_string_lossy().into_owned()
}

fuzz_target!(|data: &[u8]| {
    INIT.call_once(|| {
        std::env::set_var("STITCH_ALLOC_CONF", "backend:sim,capacity_bytes:1GiB,log:off,devices:2");
        stitch_init(2);
    });
    let mut live: Vec<(usize, usize, i32)> = Vec::new(); // (ptr, size, device)
    let mut freed: Vec<(usize, i32)> = Vec::new();
    let mut it = data.chunks_exact(6);
    for c in &mut it {
        let arg = u32::from_le_bytes([c[2], c[3], c[4], c[5]]) as usize;
        let dev = (c[1] % 4) as i32 - 1; // -1 ..= 2: two valid devices, two invalid
        let stream = (c[1] >> 4) as usize as *mut c_void;
        match c[0] % 8 {
            0..=2 => {
                let size = match c[0] >> 5 {
                    0 => 0,
                    1 => usize::MAX - arg,
                    2 => arg << 12,
                    _ => arg & 0xff_ffff,
                };
                stitch_clear_error();
                let p = stitch_malloc(size, dev, stream) as usize;
                if size == 0 && (0..=1).contains(&dev) {
                    // NULL, and the last error is left alone (it may hold an OOM diagnosis).
                    assert_eq!(p, 0, "a zero-size malloc returned memory");
                    assert!(last_error().is_empty(), "zero-size malloc set the last error");
                } else if p == 0 {
                    assert!(!last_error().is_empty(), "NULL without a reason");
                } else {
                    assert!((0..=1).contains(&dev) && size > 0);
                    for &(q, qs, qd) in &live {
                        if qd == dev {
                            assert!(q + qs <= p || p + size <= q, "overlap");
                        }
                    }
                    live.push((p, size, dev));
                }
            }
            3 | 4 if !live.is_empty() => {
                let (p, size, d) = live.swap_remove(arg % live.len());
                stitch_clear_error();
                stitch_free(p as *mut c_void, size, d, stream);
                assert!(last_error().is_empty(), "valid free reported {}", last_error());
                freed.push((p, d));
            }
            5 => {
                // A bad free: a freed pointer, an interior pointer, or random bits.
                let p = match (c[0] >> 3) % 3 {
                    0 if !freed.is_empty() => freed[arg % freed.len()].0,
                    1 if !live.is_empty() => live[arg % live.len()].0 + 512,
                    _ => arg << 8,
                };
                if live.iter().any(|&(q, _, _)| q == p) {
                    continue;
                }
                stitch_clear_error();
                stitch_free(p as *mut c_void, 0, dev, stream);
                if p != 0 || dev >= 0 {
                    assert!(!last_error().is_empty(), "bad free of {p:#x} not reported");
                }
            }
            6 => {
                if !live.is_empty() {
                    let (p, _, _) = live[arg % live.len()];
                    stitch_record_stream(p as *mut c_void, stream);
                } else {
                    stitch_record_stream((arg << 8) as *mut c_void, stream);
                }
            }
            _ => {
                let _ = stitch_empty_cache(dev);
                stitch_clear_error();
                let s = stitch_stats_json(dev);
                // Valid devices give their statistics; others NULL with a reason.
                assert_eq!(s.is_null(), !(0..=1).contains(&dev));
                if s.is_null() {
                    assert!(!last_error().is_empty());
                }
            }
        }
    }
    for (p, size, d) in live {
        stitch_clear_error();
        stitch_free(p as *mut c_void, size, d, std::ptr::null_mut());
        assert!(last_error().is_empty(), "{}", last_error());
    }
});
