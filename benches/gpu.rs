//! GPU benchmarks, all in one run so their ratios compare like with like:
//!
//! * `pair/*`: an alloc+free pair of one size, three ways: the allocator's hot path
//!   (`Allocator<CudaDriver>`, memory already mapped), `cuMemAllocAsync`+`cuMemFreeAsync` on
//!   the default pool kept warm (release threshold at its maximum, as PyTorch's
//!   `cudaMallocAsync` backend sets it), and `cuMemAlloc`+`cuMemFree`;
//! * `stitch/*`: the allocation that stitches N free handles (N x 2 MiB for N = 8, 64, 512,
//!   and 8 x 64 MiB), each iteration on a freshly fragmented allocator;
//! * a replay of the random-churn trace (`stitch gen churn --seed 1`) through the allocator wrapped in
//!   [`Timed`](stitch_alloc::driver::Timed), printing the measured time of every kind of
//!   driver call beside the H200 model of anchors.md, and the same trace through
//!   `cuMemAllocAsync` and `cuMemAlloc` for the wall time.
//!
//! Without a usable CUDA device it prints `SKIPPED (no CUDA device): ...` and exits 0.
//! Run: `cargo bench --bench gpu -- --warm-up-time 1 --measurement-time 3`.

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stitch_alloc::driver::{CudaDriver, Driver, Timed};
use stitch_alloc::trace::{gen, Event};
use stitch_alloc::{Allocator, Capacity, Config, DevicePtr, Stream};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S: Stream = Stream::DEFAULT;

type Gpu = Arc<CudaDriver>;

/// Mean nanoseconds per iteration over everything a benchmark measured (warm-up included),
/// by name, for the summary printed at the end.
#[derive(Default)]
struct Means(Mutex<HashMap<String, (Duration, u64)>>);

impl Means {
    fn add(&self, name: &str, d: Duration, iters: u64) {
        let mut m = self.0.lock().unwrap();
        let e = m.entry(name.to_string()).or_default();
        e.0 += d;
        e.1 += iters;
    }
    fn ns(&self, name: &str) -> Option<f64> {
        let m = self.0.lock().unwrap();
        m.get(name)
            .filter(|e| e.1 > 0)
            .map(|e| e.0.as_nanos() as f64 / e.1 as f64)
    }
}

fn pairs(c: &mut Criterion, gpu: &Gpu, means: &Means) {
    let mut g = c.benchmark_group("pair");
    g.throughput(Throughput::Elements(1));
    let stream = gpu.create_stream(true).unwrap();
    gpu.set_default_pool_release_threshold(u64::MAX).unwrap();
    for &size in &[4 * KIB, 64 * MIB] {
        // The allocator's hot path.
        let a = Allocator::new(
            gpu.clone(),
            Config::default().with_capacity(Capacity::Bytes(8 * GIB)),
        )
        .unwrap();
        let p = a.alloc(size, S).unwrap();
        a.free(p, S).unwrap();
        let calls = a.stats().calls;
        let name = format!("hot/{size}");
        g.bench_with_input(
            BenchmarkId::new("stitch_alloc_hot", size),
            &size,
            |b, &size| {
                b.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        let p = a.alloc(size, S).unwrap();
                        a.free(std::hint::black_box(p), S).unwrap();
                    }
                    let d = t.elapsed();
                    means.add(&name, d, iters);
                    d
                })
            },
        );
        assert_eq!(a.stats().calls, calls, "the hot path made a driver call");
        drop(a);

        // cuMemAllocAsync + cuMemFreeAsync on a warm default pool, one stream. The stream is
        // synchronised between batches of 1000 pairs, outside the timed part.
        let s = stream.stream();
        let p = gpu.mem_alloc_async(size, s).unwrap();
        gpu.mem_free_async(p, s).unwrap();
        gpu.stream_synchronize(s).unwrap();
        let name = format!("async/{size}");
        g.bench_with_input(
            BenchmarkId::new("cuMemAllocAsync", size),
            &size,
            |b, &size| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    let mut left = iters;
                    while left > 0 {
                        let n = left.min(1000);
                        let t = Instant::now();
                        for _ in 0..n {
                            let p = gpu.mem_alloc_async(size, s).unwrap();
                            gpu.mem_free_async(std::hint::black_box(p), s).unwrap();
                        }
                        total += t.elapsed();
                        gpu.stream_synchronize(s).unwrap();
                        left -= n;
                    }
                    means.add(&name, total, iters);
                    total
                })
            },
        );

        // cuMemAlloc + cuMemFree.
        let name = format!("malloc/{size}");
        g.bench_with_input(BenchmarkId::new("cuMemAlloc", size), &size, |b, &size| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    let p = gpu.mem_alloc(size).unwrap();
                    gpu.mem_free(std::hint::black_box(p)).unwrap();
                }
                let d = t.elapsed();
                means.add(&name, d, iters);
                d
            })
        });
    }
    g.finish();
    gpu.synchronize().unwrap();
    gpu.trim_default_pool(0).unwrap();
}

/// `n` live blocks of `handle` bytes with `n` free ones between them, one handle each, on
/// an allocator whose capacity they fill.
fn fragmented(gpu: &Gpu, n: u64, handle: u64) -> (Allocator<Gpu>, Vec<DevicePtr>) {
    let a = Allocator::new(
        gpu.clone(),
        Config::default()
            .with_capacity(Capacity::Bytes(2 * n * handle))
            .with_handle_sizes(handle, handle),
    )
    .unwrap();
    let ps: Vec<_> = (0..2 * n).map(|_| a.alloc(handle, S).unwrap()).collect();
    let mut keep = Vec::new();
    for (i, p) in ps.into_iter().enumerate() {
        if i % 2 == 0 {
            a.free(p, S).unwrap();
        } else {
            keep.push(p);
        }
    }
    (a, keep)
}

/// Per configuration: every timed stitch (microseconds) and the handles it moved.
type StitchLog = Mutex<Vec<(String, Vec<f64>, u64)>>;

fn stitch(c: &mut Criterion, gpu: &Gpu, log: &StitchLog) {
    let mut g = c.benchmark_group("stitch");
    // Each iteration builds a fragmented allocator (thousands of driver calls for N = 512),
    // so take exactly 10 samples of one iteration each.
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_millis(1));
    for &(n, handle) in &[
        (8u64, 2 * MIB),
        (64, 2 * MIB),
        (512, 2 * MIB),
        (8, 64 * MIB),
    ] {
        let label = format!("{n}x{}MiB", handle / MIB);
        let times = Mutex::new(Vec::new());
        let moved = Mutex::new(0u64);
        g.bench_function(BenchmarkId::new("handles", &label), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let (a, keep) = fragmented(gpu, n, handle);
                    gpu.synchronize().unwrap();
                    let before = a.stats();
                    let t = Instant::now();
                    let big = a.alloc(n * handle, S).unwrap();
                    let d = t.elapsed();
                    let st = a.stats();
                    if st.stitches + st.extensions == before.stitches + before.extensions {
                        eprintln!("warning: stitch/{n}: the allocation stitched nothing: {st:?}");
                    }
                    *moved.lock().unwrap() = st.stitched_handles - before.stitched_handles;
                    times.lock().unwrap().push(d.as_secs_f64() * 1e6);
                    total += d;
                    a.free(big, S).unwrap();
                    for p in keep {
                        a.free(p, S).unwrap();
                    }
                    drop(a);
                }
                total
            })
        });
        let moved = *moved.lock().unwrap();
        log.lock()
            .unwrap()
            .push((label, times.into_inner().unwrap(), moved));
    }
    g.finish();
}

/// Replays `trace`'s allocations and frees (ids dense from 0, as the generators hand them
/// out) with `alloc`/`free` callbacks; returns the wall time and the peak of live requested
/// bytes.
fn replay(
    trace: &[Event],
    mut alloc: impl FnMut(u64) -> u64,
    mut free: impl FnMut(u64),
) -> (Duration, u64) {
    let n = trace
        .iter()
        .map(|e| match e {
            Event::Alloc { id, .. } => *id as usize + 1,
            _ => 0,
        })
        .max()
        .unwrap_or(0);
    let mut ptr = vec![(0u64, 0u64); n];
    let (mut live, mut peak) = (0u64, 0u64);
    let t = Instant::now();
    for e in trace {
        match *e {
            Event::Alloc { id, bytes, .. } => {
                ptr[id as usize] = (alloc(bytes), bytes);
                live += bytes;
                peak = peak.max(live);
            }
            Event::Free { id, .. } => {
                let (p, bytes) = ptr[id as usize];
                free(p);
                live -= bytes;
            }
            _ => {}
        }
    }
    (t.elapsed(), peak)
}

fn measured_vs_modeled(gpu: &Gpu) {
    // The random-churn trace (`trace::gen::churn`: KV tensors grown by realloc, 1-512 MiB
    // temporaries freed out of order, small tensors).
    let churn = gen::generate(gen::Kind::Churn, 1, gen::Scale::Full);
    let summary = churn.summary();
    let trace = &churn.events;
    println!(
        "== replay: `stitch gen churn --seed 1`, {} events ({} allocations)",
        trace.len(),
        summary.allocs
    );

    let a = Allocator::new(
        Timed::new(gpu.clone()),
        Config::default().with_capacity(Capacity::Bytes(64 * GIB)),
    )
    .unwrap();
    let (wall, peak_live) = replay(
        trace,
        |size| a.alloc(size, S).unwrap().0,
        |p| a.free(DevicePtr(p), S).unwrap(),
    );
    let st = a.stats();
    let timings = a.driver().timings();
    println!(
        "stitch-alloc: wall {:.1} ms, peak reserved {:.2} GiB / peak live {:.2} GiB = {:.3}; \
         {} slow of {} allocs, {} stitches ({} handles moved), {} extensions, {} handles \
         created; driver time {:.1} ms = {:.0}% of wall",
        wall.as_secs_f64() * 1e3,
        st.reserved.peak as f64 / GIB as f64,
        peak_live as f64 / GIB as f64,
        st.reserved.peak as f64 / peak_live as f64,
        st.slow_allocs,
        st.allocs,
        st.stitches,
        st.stitched_handles,
        st.extensions,
        st.handles_created,
        timings.measured_ns() as f64 / 1e6,
        100.0 * timings.measured_ns() as f64 / wall.as_nanos() as f64
    );
    println!("== measured vs modeled (H200 medians of anchors.md section 1) driver time:");
    print!("{timings}");
    // The same trace again on the same allocator: its cache is warm now.
    a.driver().reset();
    let (wall_warm, _) = replay(
        trace,
        |size| a.alloc(size, S).unwrap().0,
        |p| a.free(DevicePtr(p), S).unwrap(),
    );
    let warm_driver_ms = a.driver().timings().measured_ns() as f64 / 1e6;
    let warm_slow = a.stats().slow_allocs - st.slow_allocs;
    drop(a);

    // cudaMallocAsync: a pool that starts empty, then the same trace again on the warm pool.
    let s = gpu.create_stream(true).unwrap();
    gpu.set_default_pool_release_threshold(u64::MAX).unwrap();
    let mut async_walls = Vec::new();
    for _ in 0..2 {
        let t = Instant::now();
        replay(
            trace,
            |size| gpu.mem_alloc_async(size, s.stream()).unwrap(),
            |p| gpu.mem_free_async(p, s.stream()).unwrap(),
        );
        gpu.stream_synchronize(s.stream()).unwrap();
        async_walls.push(t.elapsed());
    }
    gpu.trim_default_pool(0).unwrap();
    let (wall_malloc, _) = replay(
        trace,
        |size| gpu.mem_alloc(size).unwrap(),
        |p| gpu.mem_free(p).unwrap(),
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "replay wall time, cold / warm: stitch-alloc {:.1} / {:.1} ms (warm: {warm_slow} slow \
         allocs, driver {warm_driver_ms:.1} ms); cuMemAllocAsync {:.1} / {:.1} ms; \
         cuMemAlloc {:.1} ms",
        ms(wall),
        ms(wall_warm),
        ms(async_walls[0]),
        ms(async_walls[1]),
        ms(wall_malloc)
    );
}

fn summary(means: &Means, stitches: &StitchLog) {
    println!("== gpu bench summary (mean ns per alloc+free pair, same run)");
    println!(
        "{:>10} {:>12} {:>16} {:>12} {:>11} {:>12}",
        "size", "hot_path", "cuMemAllocAsync", "cuMemAlloc", "async/hot", "malloc/hot"
    );
    for size in [4 * KIB, 64 * MIB] {
        let get = |k: &str| means.ns(&format!("{k}/{size}")).unwrap_or(f64::NAN);
        let (h, a, m) = (get("hot"), get("async"), get("malloc"));
        println!(
            "{:>10} {:>12.1} {:>16.1} {:>12.1} {:>10.1}x {:>11.1}x",
            if size < MIB {
                format!("{} KiB", size / KIB)
            } else {
                format!("{} MiB", size / MIB)
            },
            h,
            a,
            m,
            a / h,
            m / h
        );
    }
    println!("== stitch: time of the allocation that stitches N free handles");
    println!(
        "{:>10} {:>7} {:>11} {:>11} {:>11} {:>15}",
        "handles", "moved", "median_us", "min_us", "max_us", "us_per_handle"
    );
    for (label, times, moved) in stitches.lock().unwrap().iter() {
        let mut t = times.clone();
        t.sort_by(f64::total_cmp);
        if t.is_empty() {
            continue;
        }
        let med = t[t.len() / 2];
        println!(
            "{:>10} {:>7} {:>11.1} {:>11.1} {:>11.1} {:>15.1}",
            label,
            moved,
            med,
            t[0],
            t[t.len() - 1],
            med / (*moved).max(1) as f64
        );
    }
}

fn main() {
    if !CudaDriver::available() {
        use std::io::Write;
        let why = CudaDriver::unavailable_reason().unwrap_or_default();
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (no CUDA device): bench gpu ({why})"
        );
        return;
    }
    let gpu: Gpu =
        Arc::new(CudaDriver::new(0).expect("CUDA is available but device 0 did not open"));
    println!(
        "== {} (driver {}), granularity {} bytes",
        gpu.device_name(),
        gpu.driver_version(),
        gpu.granularity()
    );
    let mut c = Criterion::default().configure_from_args();
    let means = Means::default();
    let stitches = StitchLog::default();
    pairs(&mut c, &gpu, &means);
    stitch(&mut c, &gpu, &stitches);
    c.final_summary();
    summary(&means, &stitches);
    // The replay takes a few seconds: only in benchmark mode, not under `cargo test`.
    if std::env::args().any(|a| a == "--bench") {
        measured_vs_modeled(&gpu);
    }
}
