//! Soak: millions of random operations on SimDriver under a fixed memory cap.
//!
//! `cargo run --release --example soak -- [OPS] [SEED]` (default 10,000,000 ops).
//! Checks on every OutOfMemory that the zero-external-fragmentation bound holds, runs the full
//! `validate()` every 250,000 operations, and reports throughput, OOMs, stitches, and the
//! allocator's metadata bytes per live allocation. Exits non-zero on any violation.

use std::sync::Arc;
use std::time::Instant;
use stitch_alloc::driver::SimDriver;
use stitch_alloc::{AllocError, Allocator, Capacity, Config, DevicePtr, Stream};

const MIB: u64 = 1 << 20;

fn main() {
    let mut args = std::env::args().skip(1);
    let ops: u64 = args.next().map_or(10_000_000, |a| a.parse().expect("OPS"));
    let mut seed: u64 = args.next().map_or(42, |a| a.parse().expect("SEED"));
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let cap = 16u64 << 30;
    let dev = Arc::new(SimDriver::with_capacity(cap));
    let a = Allocator::new(
        dev.clone(),
        Config::default().with_capacity(Capacity::Bytes(cap)),
    )
    .expect("allocator");
    let g = a.granularity();
    let streams = [Stream::sim(0), Stream::sim(1)];
    let mut live: Vec<(DevicePtr, Stream)> = Vec::new();
    let (mut ooms, mut max_live, mut max_meta_per_live) = (0u64, 0usize, 0f64);
    let t = Instant::now();
    for i in 0..ops {
        let r = rnd();
        // Keep the live set bounded and churning: alloc more often while it is small.
        let want_alloc = live.is_empty() || (r % 100) < if live.len() < 1000 { 60 } else { 45 };
        if want_alloc {
            let size = match r >> 8 & 63 {
                0..=39 => 1 + (r >> 16) % (256 << 10),
                40..=59 => 1 + (r >> 16) % (16 * MIB),
                60..=62 => 1 + (r >> 16) % (256 * MIB),
                _ => 1 + (r >> 16) % (1 << 30),
            };
            let s = streams[(r >> 40) as usize % 2];
            match a.alloc(size, s) {
                Ok(p) => live.push((p, s)),
                Err(AllocError::OutOfMemory(rep)) => {
                    ooms += 1;
                    let d = a.detailed_stats();
                    if cap - d.live_handle_bytes >= size.div_ceil(g) * g {
                        eprintln!("VIOLATION at op {i}: external fragmentation: {rep}");
                        std::process::exit(1);
                    }
                }
                Err(e) => {
                    eprintln!("VIOLATION at op {i}: unexpected error {e}");
                    std::process::exit(1);
                }
            }
        } else {
            let k = (r >> 20) as usize % live.len();
            let (p, s) = live.swap_remove(k);
            if let Err(e) = a.free(p, s) {
                eprintln!("VIOLATION at op {i}: free failed: {e}");
                std::process::exit(1);
            }
        }
        max_live = max_live.max(live.len());
        if i % 250_000 == 0 {
            if let Err(e) = a.validate() {
                eprintln!("VIOLATION at op {i}: {e}");
                std::process::exit(1);
            }
            if live.len() >= 100 {
                let m = a.detailed_stats().metadata_bytes as f64 / live.len() as f64;
                max_meta_per_live = max_meta_per_live.max(m);
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let d = a.detailed_stats();
    println!(
        "soak: {ops} ops in {secs:.1} s ({:.2} M ops/s), peak live allocations {max_live}, OOMs {ooms} (each checked), \
         stitches {}, handles moved {}, peak reserved {:.2} GiB of {:.0} GiB, metadata now {} bytes for {} live \
         ({:.0} B each; worst sampled {max_meta_per_live:.0} B each)",
        ops as f64 / secs / 1e6,
        d.stats.stitches,
        d.stats.stitched_handles,
        d.stats.reserved.peak as f64 / (1u64 << 30) as f64,
        cap as f64 / (1u64 << 30) as f64,
        d.metadata_bytes,
        live.len(),
        d.metadata_bytes as f64 / live.len().max(1) as f64,
    );
    for (p, s) in live {
        a.free(p, s).expect("final free");
    }
    a.validate().expect("valid at the end");
    drop(a);
    assert!(
        dev.leak_report().is_clean(),
        "leak: {:?}",
        dev.leak_report()
    );
    println!("soak: clean shutdown, no leak");
}
