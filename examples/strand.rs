//! Diagnose stranding: replay a trace and, at the moment peak reserved is reached, list the
//! handles that hold live bytes and free bytes, with the live blocks inside them.
//! `cargo run --release --example strand -- TRACE [MAX_HANDLE_MIB]`
use std::collections::HashMap;
use stitch_alloc::driver::SimDriver;
use stitch_alloc::trace::{read_path, Event, ReadOptions};
use stitch_alloc::{Allocator, Config, DevicePtr, Layout, Stream};

fn report(snap: &Layout) {
    let rows = snap.stranded_handles();
    let tot: u64 = rows.iter().map(|r| r.free).sum();
    println!("stranded {} MiB in {} handles; top:", tot >> 20, rows.len());
    for r in rows.iter().take(20) {
        let mib: Vec<(u64, u64)> = r
            .live_blocks
            .iter()
            .map(|&(s, i)| (s >> 20, i >> 20))
            .collect();
        println!(
            "  {:>5} MiB free of a {:>5} MiB handle; live blocks (size MiB, MiB inside): {mib:?}",
            r.free >> 20,
            r.size >> 20
        );
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("TRACE");
    let max: u64 = args.next().map_or(128, |v| v.parse().unwrap());
    let t = read_path(&path, ReadOptions::default()).expect("trace");
    let cfg = Config::default().with_handle_sizes(0, max << 20);
    let a = Allocator::new(SimDriver::new(), cfg).unwrap();
    let mut ptrs: HashMap<u64, DevicePtr> = HashMap::new();
    let mut best: Option<(u64, Layout)> = None;
    for e in &t.events {
        match *e {
            Event::Alloc { id, bytes, stream } => {
                ptrs.insert(id, a.alloc(bytes, Stream::sim(stream)).unwrap());
                let r = a.stats().reserved.current;
                if best.as_ref().is_none_or(|b| r > b.0) {
                    best = Some((r, a.snapshot()));
                }
            }
            Event::Free { id, stream } => {
                let p = ptrs.remove(&id).unwrap();
                a.free(p, Stream::sim(stream.unwrap_or(0))).unwrap();
            }
            Event::ProbeLargest => {}
        }
    }
    let s = a.stats();
    println!(
        "ratio {:.4}",
        s.reserved.peak as f64 / s.requested.peak as f64
    );
    report(&best.unwrap().1);
}
