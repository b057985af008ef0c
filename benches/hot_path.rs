//! Hot path: alloc+free pairs served from already mapped memory (no driver call).

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use std::sync::Arc;
use stitch_alloc::driver::SimDriver;
use stitch_alloc::{Allocator, Config, DevicePtr, Stream};

const MIB: u64 = 1 << 20;

fn warm(a: &Allocator<SimDriver>, size: u64) {
    let p = a.alloc(size, Stream::DEFAULT).unwrap();
    a.free(p, Stream::DEFAULT).unwrap();
}

fn cached_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_pair");
    g.throughput(Throughput::Elements(1));
    for &size in &[512u64, 64 << 10, 4 * MIB, 100 * MIB] {
        let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
        warm(&a, size);
        let calls = a.stats().calls;
        g.bench_with_input(BenchmarkId::new("cached", size), &size, |b, &size| {
            b.iter(|| {
                let p = a.alloc(size, Stream::DEFAULT).unwrap();
                a.free(p, Stream::DEFAULT).unwrap();
            })
        });
        assert_eq!(a.stats().calls, calls, "hot path made a driver call");
    }
    g.finish();
}

/// Mixed sizes with 64 allocations live: a pair is one free of the oldest and one alloc.
fn mixed(c: &mut Criterion) {
    let mut g = c.benchmark_group("mixed");
    g.throughput(Throughput::Elements(1));
    let sizes: Vec<u64> = (0..1024u64)
        .map(|i| {
            let x = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % 1000;
            match x % 4 {
                0 => 256 + x * 37,
                1 => 4096 + x * 1931,
                2 => MIB + x * 8191,
                _ => 8 * MIB + x * 65_537,
            }
        })
        .collect();
    let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
    let mut live: std::collections::VecDeque<DevicePtr> = std::collections::VecDeque::new();
    // Warm up: the working set's memory gets created once.
    for &s in sizes.iter().cycle().take(20_000) {
        live.push_back(a.alloc(s, Stream::DEFAULT).unwrap());
        if live.len() > 64 {
            a.free(live.pop_front().unwrap(), Stream::DEFAULT).unwrap();
        }
    }
    let calls = a.stats().calls;
    let mut i = 0usize;
    g.bench_function("sizes_256B_to_16MiB_64_live", |b| {
        b.iter(|| {
            a.free(live.pop_front().unwrap(), Stream::DEFAULT).unwrap();
            live.push_back(a.alloc(sizes[i & 1023], Stream::DEFAULT).unwrap());
            i += 1;
        })
    });
    let extra = a.stats().calls.vmm_total() - calls.vmm_total();
    eprintln!("mixed: {extra} VMM driver calls during the measurement");
    g.finish();
}

/// 1, 2 and 4 threads hammering one allocator (10,000 pairs each): throughput in pairs.
fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads");
    for &n in &[1usize, 2, 4] {
        let a = Arc::new(Allocator::new(SimDriver::new(), Config::default()).unwrap());
        for t in 0..n {
            warm(&a, 4096 + t as u64 * 512);
        }
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("pairs", n), &n, |b, &n| {
            b.iter_batched(
                || (),
                |_| {
                    std::thread::scope(|s| {
                        for t in 0..n {
                            let a = &a;
                            s.spawn(move || {
                                for _ in 0..10_000 {
                                    let p =
                                        a.alloc(4096 + t as u64 * 512, Stream::DEFAULT).unwrap();
                                    a.free(p, Stream::DEFAULT).unwrap();
                                }
                            });
                        }
                    })
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

/// A recorded training loop's allocations and frees, replayed again and again on one
/// allocator (`tests/data/zoo/*.pickle.gz`, the default stream, no GPU lag): the mix of sizes,
/// lifetimes and slow paths that torch's calls make, per allocation + free. Two rounds warm
/// the allocator first; design/zoo.md ("The hot path", tenth session) has the profile.
fn zoo_loop(c: &mut Criterion) {
    use stitch_alloc::trace::{read_path, Event, ReadOptions};
    let mut g = c.benchmark_group("zoo_loop");
    g.sample_size(10);
    for name in ["llm-train-s", "hf-generate"] {
        let path = format!(
            "{}/tests/data/zoo/{name}.pickle.gz",
            env!("CARGO_MANIFEST_DIR")
        );
        let t = read_path(&path, ReadOptions::default()).expect("a shipped zoo snapshot");
        // Each allocation gets a slot; a free names its allocation's slot.
        let mut slot = std::collections::HashMap::new();
        let mut ops: Vec<(usize, Option<u64>)> = Vec::new();
        for e in &t.events {
            match *e {
                Event::Alloc { id, bytes, .. } => {
                    slot.insert(id, ops.len());
                    ops.push((ops.len(), Some(bytes)));
                }
                Event::Free { id, .. } => {
                    if let Some(s) = slot.remove(&id) {
                        ops.push((s, None));
                    }
                }
                _ => {}
            }
        }
        let mut left: Vec<usize> = slot.into_values().collect();
        left.sort_unstable();
        let pairs = ops.iter().filter(|o| o.1.is_some()).count() as u64;
        let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
        let mut ptrs: Vec<Option<DevicePtr>> = vec![None; ops.len()];
        let mut round = || {
            for &(s, bytes) in &ops {
                match bytes {
                    Some(n) => ptrs[s] = Some(a.alloc(n, Stream::DEFAULT).unwrap()),
                    None => a.free(ptrs[s].take().unwrap(), Stream::DEFAULT).unwrap(),
                }
            }
            for &s in &left {
                a.free(ptrs[s].take().unwrap(), Stream::DEFAULT).unwrap();
            }
        };
        round();
        round();
        g.throughput(Throughput::Elements(pairs));
        g.bench_function(BenchmarkId::new("pairs", name), |b| b.iter(&mut round));
    }
    g.finish();
}

criterion_group!(benches, cached_pair, mixed, threads, zoo_loop);
criterion_main!(benches);
