//! Mid-sized traffic on the simulator: three kinds of workload whose requests are a quarter
//! of a page to a page or so, the sizes where the small pool and the large pool meet
//! (`Config::small_threshold`). Prints, per kind, seed and small threshold, the driver's peak
//! physical bytes over the workload's own peak live bytes (counted here, not read from the
//! allocator). design/zoo.md ("Twenty-third session", "Twenty-fourth session") quotes it.
//!
//! ```text
//! cargo run --release --example mid_sized [-- SEEDS THRESHOLDS [DIR]]   # e.g. 6 256KiB,1MiB
//! ```
//!
//! With `DIR`, each kind's event sequence for every seed (at the first threshold: the
//! sequence does not depend on the allocator) is also written there as a text trace, for
//! `stitch replay --compare` (the models of PyTorch's two allocators) and
//! `scripts/sim-ab.py`.
use std::collections::HashMap;
use std::sync::Arc;
use stitch_alloc::driver::SimDriver;
use stitch_alloc::trace::gen::Rng;
use stitch_alloc::trace::{Event, Trace};
use stitch_alloc::{Allocator, Config, DevicePtr, Stream};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const S0: Stream = Stream::sim(0);

/// Peak live (the workload's sum) and peak held (the driver's physical bytes), and the
/// events as a trace.
#[derive(Default)]
struct Peaks {
    live: u64,
    peak_live: u64,
    peak_held: u64,
    events: Vec<Event>,
    ids: HashMap<DevicePtr, u64>,
}

impl Peaks {
    fn alloc(&mut self, a: &Allocator<Arc<SimDriver>>, d: &SimDriver, size: u64) -> DevicePtr {
        let p = a.alloc(size, S0).expect("alloc");
        self.live += size;
        self.peak_live = self.peak_live.max(self.live);
        self.peak_held = self.peak_held.max(d.used_bytes());
        let id = self.events.len() as u64;
        self.events.push(Event::Alloc {
            id,
            bytes: size,
            stream: 0,
        });
        self.ids.insert(p, id);
        p
    }
    fn free(&mut self, a: &Allocator<Arc<SimDriver>>, p: DevicePtr, size: u64) {
        a.free(p, S0).expect("free");
        self.live -= size;
        let id = self.ids.remove(&p).expect("a live pointer");
        self.events.push(Event::Free { id, stream: None });
    }
}

/// Random requests of 256 KiB-1 MiB with random lifetimes; `large` of them 4-32 MiB.
fn churn(a: &Allocator<Arc<SimDriver>>, d: &SimDriver, seed: u64, large: f64) -> Peaks {
    let mut rng = Rng::new(seed);
    let mut pk = Peaks::default();
    let mut held: Vec<(DevicePtr, u64)> = Vec::new();
    for _ in 0..40_000 {
        if held.len() < 200 || (held.len() < 600 && rng.chance(0.5)) {
            let size = if rng.chance(large) {
                rng.range(4 * MIB, 32 * MIB)
            } else {
                rng.range(256 * KIB, MIB)
            };
            held.push((pk.alloc(a, d, size), size));
        } else {
            let (p, size) = held.swap_remove(rng.below(held.len() as u64) as usize);
            pk.free(a, p, size);
        }
    }
    for (p, size) in held {
        pk.free(a, p, size);
    }
    pk
}

/// 256 K/V tensors growing 16 KiB a step by concatenation, each copy beside a transient twice
/// its size; a tensor that reaches its final length (256 KiB-1.25 MiB) is retired and a new
/// one of 64 KiB admitted.
fn kv_chains(a: &Allocator<Arc<SimDriver>>, d: &SimDriver, seed: u64) -> Peaks {
    let mut rng = Rng::new(seed);
    let mut pk = Peaks::default();
    let mut kv: Vec<(DevicePtr, u64, u64)> = Vec::new();
    for _ in 0..600 {
        while kv.len() < 256 {
            let p = pk.alloc(a, d, 64 * KIB);
            kv.push((p, 64 * KIB, 256 * KIB + rng.below(MIB)));
        }
        let mut i = 0;
        while i < kv.len() {
            let (old, size, end) = kv[i];
            let next = size + 16 * KIB;
            let transient = pk.alloc(a, d, 2 * next);
            let new = pk.alloc(a, d, next);
            pk.free(a, transient, 2 * next);
            pk.free(a, old, size);
            if next >= end {
                pk.free(a, new, next);
                kv.swap_remove(i);
            } else {
                kv[i] = (new, next, end);
                i += 1;
            }
        }
    }
    for (p, size, _) in kv {
        pk.free(a, p, size);
    }
    pk
}

fn parse_size(s: &str) -> u64 {
    stitch_alloc::parse_size(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seeds: u64 = args.get(1).map_or(6, |s| s.parse().expect("seeds"));
    let thresholds: Vec<u64> = args
        .get(2)
        .map_or("256KiB,1MiB", String::as_str)
        .split(',')
        .map(parse_size)
        .collect();
    let dir = args.get(3);
    type Kind = fn(&Allocator<Arc<SimDriver>>, &SimDriver, u64) -> Peaks;
    // (what it is, its traces' file name, the workload)
    let kinds: [(&str, &str, Kind); 3] = [
        ("churn, 10% large", "churn-large", |a, d, s| {
            churn(a, d, s, 0.1)
        }),
        ("churn, mid-sized only", "churn", |a, d, s| {
            churn(a, d, s, 0.0)
        }),
        ("K/V chains + transients", "kv-chains", kv_chains),
    ];
    for (name, file, kind) in kinds {
        for &t in &thresholds {
            let mut ratios = Vec::new();
            for seed in 1..=seeds {
                let d = Arc::new(SimDriver::with_capacity(64 << 30));
                let a = Allocator::new(d.clone(), Config::default().with_small_threshold(t))
                    .expect("allocator");
                let pk = kind(&a, &d, seed);
                if let (Some(dir), true) = (dir, t == thresholds[0]) {
                    let path = format!("{dir}/mid-sized-{file}-{seed}.trace.gz");
                    let trace = Trace {
                        events: pk.events.clone(),
                    };
                    trace.write_path(&path).expect("write the trace");
                    println!("wrote {path}");
                }
                ratios.push(pk.peak_held as f64 / pk.peak_live as f64);
            }
            let (lo, hi) = ratios
                .iter()
                .fold((f64::MAX, 0f64), |(l, h), &r| (l.min(r), h.max(r)));
            let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
            println!(
                "{name:<26} threshold {:>5} KiB: {lo:.4}-{hi:.4} (mean {mean:.4})",
                t / KIB
            );
        }
    }
}
