//! Policy lab: an LLM-inference-like workload on SimDriver, reporting ratio and modeled
//! driver time for a few handle-size settings. (Quick experiment; `stitch replay` is the tool.)
//!
//! Modeled driver time is the crate's one cost model (`stitch_alloc::cost`, the H200 table),
//! applied by a `Timed` driver to every call with the exact size of the handles it touches.
use stitch_alloc::driver::{DriverOp, SimDriver, Timed};
use stitch_alloc::{Allocator, Config, DevicePtr, Stream};

const MIB: u64 = 1 << 20;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (l, h) = ((lo as f64).ln(), (hi as f64).ln());
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (l + (h - l) * u).exp() as u64
    }
}

fn run(cfg: Config, seed: u64) {
    let a = Allocator::new(Timed::new(SimDriver::new()), cfg).unwrap();
    let s = Stream::DEFAULT;
    let mut r = Rng(seed);
    let mut events = 0u64;
    let mut peak_live = 0u64;
    // weights
    let mut weights = Vec::new();
    let mut w = 0;
    while w < 16 << 30 {
        let sz = r.range(20 * MIB, 400 * MIB);
        weights.push(a.alloc(sz, s).unwrap());
        w += sz;
        events += 1;
    }
    let per_token = MIB / 2;
    let mut seqs: Vec<(DevicePtr, u64, u64)> = Vec::new(); // kv ptr, tokens, target
    let mut temps: Vec<(DevicePtr, u64)> = Vec::new(); // ptr, expiry step
    let mut smalls: Vec<(DevicePtr, u64)> = Vec::new();
    let mut fails = 0;
    for step in 0..4000u64 {
        // admit sequences
        while seqs.len() < 48 && r.next() % 3 == 0 {
            let prompt = r.range(16, 2048);
            let target = prompt + r.range(16, 1024);
            match a.alloc(prompt * per_token, s) {
                Ok(p) => seqs.push((p, prompt, target)),
                Err(_) => fails += 1,
            }
            events += 1;
        }
        // grow KV every 16 tokens
        let mut i = 0;
        while i < seqs.len() {
            let (p, t, target) = seqs[i];
            let nt = t + 16;
            if nt >= target {
                a.free(p, s).unwrap();
                events += 1;
                seqs.swap_remove(i);
                continue;
            }
            if step % 2 == (i as u64) % 2 {
                match a.alloc(nt * per_token, s) {
                    Ok(q) => {
                        a.free(p, s).unwrap();
                        seqs[i] = (q, nt, target);
                    }
                    Err(_) => fails += 1,
                }
                events += 2;
            }
            i += 1;
        }
        // temporaries
        for _ in 0..r.range(2, 8) {
            let sz = r.log_uniform(MIB, 512 * MIB);
            match a.alloc(sz, s) {
                Ok(p) => temps.push((p, step + r.range(0, 3))),
                Err(_) => fails += 1,
            }
            events += 1;
        }
        for _ in 0..r.range(5, 30) {
            let sz = r.range(256, MIB);
            if let Ok(p) = a.alloc(sz, s) {
                smalls.push((p, step + r.range(0, 5)));
            }
            events += 1;
        }
        peak_live = peak_live.max(a.stats().requested.current);
        if std::env::var("LAB_SNAP").is_ok() && step == 700 {
            let rows = a.snapshot().stranded_handles();
            let tot: u64 = rows.iter().map(|r| r.free).sum();
            eprintln!("stranded total {} MiB in {} handles", tot >> 20, rows.len());
            for r in rows.iter().take(25) {
                eprintln!(
                    "  free {:>5} MiB of handle {:>5} MiB; live blocks {:?}",
                    r.free >> 20,
                    r.size >> 20,
                    r.live_blocks
                );
            }
        }
        if std::env::var("LAB_DEBUG").is_ok() && step % 500 == 0 {
            let d = a.detailed_stats();
            eprintln!("step {step}: live {:.2} reserved {:.2} live_handles {:.2} stranded {:.2} free_handles {:.2} small_pages {} small_stranded {:.3} free_spans {}",
                d.stats.requested.current as f64 / 1073741824.0, d.stats.reserved.current as f64 / 1073741824.0,
                d.live_handle_bytes as f64 / 1073741824.0, d.stranded_bytes as f64 / 1073741824.0,
                d.free_handle_bytes as f64 / 1073741824.0, d.small_pages, d.small_stranded_bytes as f64 / 1073741824.0, d.free_spans);
        }
        for list in [&mut temps, &mut smalls] {
            list.retain(|&(p, e)| {
                if e <= step {
                    a.free(p, s).unwrap();
                    events += 1;
                    false
                } else {
                    true
                }
            });
        }
    }
    let st = a.stats();
    let c = st.calls;
    let us = a.driver().meter().total_us();
    println!(
        "events {events} fails {fails} peak_live {:.2} GiB peak_reserved {:.2} GiB ratio {:.4} stitches {} ext {} moved {} created {} maps {} modeled {:.3} s",
        peak_live as f64 / (1u64 << 30) as f64,
        st.reserved.peak as f64 / (1u64 << 30) as f64,
        st.reserved.peak as f64 / st.requested.peak as f64,
        st.stitches,
        st.extensions,
        st.stitched_handles,
        st.handles_created,
        c.get(DriverOp::Map),
        us / 1e6
    );
}

fn main() {
    let only: Option<u64> = std::env::var("LAB_MAX").ok().map(|v| v.parse().unwrap());
    let slacks: Vec<f64> = std::env::var("LAB_SLACK")
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or_else(|_| vec![0.0, 0.01]);
    for (min, max) in [
        (0, 2 * MIB),
        (0, 32 * MIB),
        (0, 64 * MIB),
        (0, 128 * MIB),
        (0, 256 * MIB),
        (0, 1 << 30),
        (0, 4 << 30),
    ] {
        if only.is_some_and(|o| o != max) {
            continue;
        }
        for &slack in &slacks {
            print!("max {:>5} MiB slack {slack:<5}: ", max >> 20);
            run(
                Config::default()
                    .with_handle_sizes(min, max)
                    .with_reserve_slack(slack, 0),
                1,
            );
        }
    }
    if only.is_some() {
        return;
    }
    print!("no-stitch: ");
    run(Config::default().with_stitching(false), 1);
}
