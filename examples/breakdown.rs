//! Where the excess of peak reserved over peak live sits at the peak: replay a trace (with a
//! simulated GPU lag) and classify every free byte of the large pool that lies in a handle
//! holding live bytes, by where its free block sits in its run.
//! `cargo run --release --example breakdown -- TRACE [GPU_LAG] [runs] [live-peak] [growth]
//! [no-chain-fit] [small=SIZE]` (`small=`: `Config::small_threshold`, e.g. `small=256KiB`);
//! with `runs`, each large run at the peak too: the VA gap before it and its blocks in order,
//! `l` live, `p` pending, `f` free, `d` dirty (freed by a stream, not yet fenced), in MiB.
//! The layout is the one when reserved last reached its peak; with `live-peak`, the one right
//! after the event at which live bytes peak (reserved can reach its peak later, at lower live
//! bytes, when little is stranded). With `growth`, every event at which reserved grew: the
//! request, its stream, live bytes, the peak of live bytes so far and reserved after it.
//! With `at=N`, only the first N events are replayed (the layout is the one at their last
//! peak of reserved bytes).
use stitch_alloc::driver::SimDriver;
use stitch_alloc::replay::{replay, ReplayOptions};
use stitch_alloc::trace::{read_path, Event, ReadOptions};
use stitch_alloc::{parse_size, Allocator, Config, Pool};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("TRACE");
    let lag: usize = args.next().map_or(1000, |v| v.parse().unwrap());
    let words: Vec<String> = args.collect();
    let has = |w: &str| words.iter().any(|x| x == w);
    let list_runs = has("runs");
    let t = read_path(&path, ReadOptions::default()).expect("trace");
    let m = |x: u64| x as f64 / (1u64 << 20) as f64;
    let mut cfg = Config::default().with_chain_fit(!has("no-chain-fit"));
    if let Some(v) = words.iter().find_map(|w| w.strip_prefix("small=")) {
        cfg = cfg.with_small_threshold(parse_size(v).expect("small=SIZE"));
    }
    // A first pass for the timeline: where live bytes peak, and where reserved grows.
    let at = words
        .iter()
        .find_map(|w| w.strip_prefix("at="))
        .map(|v| v.parse::<usize>().expect("at=EVENT"));
    let stop_after = if at.is_some() {
        at
    } else if has("live-peak") || has("growth") {
        let a = Allocator::new(SimDriver::new(), cfg.clone()).unwrap();
        let opts = ReplayOptions {
            gpu_lag: lag,
            timeline: true,
            skip_stranded: true,
            ..Default::default()
        };
        let tl = replay(&t, &a, &opts).timeline.expect("a timeline");
        if has("growth") {
            let (mut before, mut peak) = (0u64, 0u64);
            for (i, (&live, &reserved)) in tl.live.iter().zip(&tl.reserved).enumerate() {
                peak = peak.max(live);
                if reserved > before {
                    let req = match t.events.get(i) {
                        Some(Event::Alloc { bytes, stream, .. }) => {
                            format!("alloc {:.2} MiB on stream {stream}", m(*bytes))
                        }
                        Some(e) => format!("{e:?}"),
                        None => String::from("-"),
                    };
                    println!(
                        "  event {i}: {req}; live {:.0} MiB (peak so far {:.0}), reserved {:.0} MiB (+{:.0})",
                        m(live),
                        m(peak),
                        m(reserved),
                        m(reserved - before)
                    );
                    before = reserved;
                }
            }
        }
        let peak = tl.live.iter().copied().max().unwrap_or(0);
        has("live-peak")
            .then(|| tl.live.iter().position(|&x| x == peak))
            .flatten()
            .map(|i| i + 1)
    } else {
        None
    };
    let a = Allocator::new(SimDriver::new(), cfg).unwrap();
    let opts = ReplayOptions {
        gpu_lag: lag,
        peak_layout: true,
        stop_after,
        ..Default::default()
    };
    let r = replay(&t, &a, &opts);
    let l = r.peak_layout.expect("a peak");
    let g = l.detailed.granularity;
    let live_handle = |lo: u64, hi: u64| -> u64 {
        // Bytes of [lo, hi) inside handles that hold live bytes.
        l.handles
            .iter()
            .filter(|h| h.holds_live)
            .filter_map(|h| h.addr.map(|a| (a, a + h.size)))
            .map(|(a, e)| e.min(hi).saturating_sub(a.max(lo)))
            .sum()
    };
    // [tail < granule, tail >= granule, head, hole], bytes and counts.
    let mut cat = [(0u64, 0u64); 4];
    let mut runs_with_tail = 0;
    for run in &l.runs {
        if run.first().is_none_or(|b| b.pool != Pool::Large) {
            continue;
        }
        let n = run.len();
        for (k, b) in run.iter().enumerate() {
            if b.state == "live" || b.state == "pending" {
                continue;
            }
            let s = live_handle(b.addr, b.addr + b.size);
            if s == 0 {
                continue;
            }
            let c = if k + 1 == n {
                runs_with_tail += 1;
                usize::from(s >= g)
            } else if k == 0 {
                2
            } else {
                3
            };
            cat[c].0 += s;
            cat[c].1 += 1;
        }
    }
    let d = &l.detailed;
    println!(
        "{path}: ratio {:.4}, excess {:.0} MiB; large runs {}; stranded tails <granule {:.0} MiB ({}), >=granule {:.0} MiB ({}), heads {:.0} MiB ({}), holes {:.0} MiB ({}); small pages {:.0} MiB; rounding {:.1} MiB; free handles {:.0} MiB",
        r.ratio,
        m(r.peak_reserved_bytes - r.peak_live_bytes),
        l.runs.iter().filter(|r| r[0].pool == Pool::Large).count(),
        m(cat[0].0), cat[0].1, m(cat[1].0), cat[1].1, m(cat[2].0), cat[2].1, m(cat[3].0), cat[3].1,
        m(d.small_stranded_bytes), m(d.rounding_waste), m(d.free_handle_bytes),
    );
    let _ = runs_with_tail;
    // Runs of the large pool whose end touches another large run's start (one run would do).
    // (start, end, last block free, first block free) of each large run, in address order.
    let free = |b: &stitch_alloc::BlockView| b.state != "live" && b.state != "pending";
    let mut spans: Vec<(u64, u64, bool, bool)> = l
        .runs
        .iter()
        .filter(|r| r[0].pool == Pool::Large)
        .map(|r| {
            let z = r.last().unwrap();
            (r[0].addr, z.addr + z.size, free(z), free(&r[0]))
        })
        .collect();
    spans.sort();
    let joins: Vec<_> = spans.windows(2).filter(|w| w[0].1 == w[1].0).collect();
    let touching = joins.len();
    let both_free = joins.iter().filter(|w| w[0].2 || w[1].3).count();
    let gaps: Vec<u64> = spans
        .windows(2)
        .map(|w| w[1].0.saturating_sub(w[0].1))
        .filter(|&g| g > 0 && g < (1 << 30))
        .collect();
    println!("  runs touching the next: {touching} (a free side at the join: {both_free}); small VA gaps (<1 GiB) between runs: {} totalling {:.0} MiB", gaps.len(), m(gaps.iter().sum()));
    if list_runs {
        let mut large: Vec<&Vec<stitch_alloc::BlockView>> =
            l.runs.iter().filter(|r| r[0].pool == Pool::Large).collect();
        large.sort_by_key(|r| r[0].addr);
        let mut prev_end = None;
        for run in large {
            let z = run.last().unwrap();
            let gap = prev_end.map_or(String::from("-"), |e: u64| {
                format!("{:.0}", m(run[0].addr.saturating_sub(e)))
            });
            let blocks: Vec<String> = run
                .iter()
                .map(|b| format!("{}{:.2}", &b.state[..1], m(b.size)))
                .collect();
            println!(
                "  run at {:#x}, gap before {gap} MiB: {}",
                run[0].addr,
                blocks.join(" ")
            );
            prev_end = Some(z.addr + z.size);
        }
    }
}
