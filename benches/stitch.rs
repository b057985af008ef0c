//! Stitching: the slow path that remaps N free handles into one span (SimDriver: measures the
//! allocator's own work; the driver's time on a GPU is modeled from the call counts).

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use stitch_alloc::driver::SimDriver;
use stitch_alloc::{Allocator, Config, DevicePtr, Stream};

const MIB: u64 = 1 << 20;

/// `n` live 64 MiB blocks with `n` free 64 MiB holes between them.
fn fragmented(n: u64) -> (Allocator<SimDriver>, Vec<DevicePtr>) {
    let a = Allocator::new(
        SimDriver::with_capacity(2 * n * 64 * MIB),
        Config::default().with_handle_sizes(0, 64 * MIB),
    )
    .unwrap();
    let ps: Vec<_> = (0..2 * n)
        .map(|_| a.alloc(64 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    let mut keep = Vec::new();
    for (i, p) in ps.into_iter().enumerate() {
        if i % 2 == 0 {
            a.free(p, Stream::DEFAULT).unwrap();
        } else {
            keep.push(p);
        }
    }
    (a, keep)
}

fn stitch(c: &mut Criterion) {
    let mut g = c.benchmark_group("stitch");
    for &n in &[2u64, 8, 64, 512] {
        g.bench_with_input(BenchmarkId::new("handles", n), &n, |b, &n| {
            b.iter_batched(
                || fragmented(n),
                |(a, keep)| {
                    let big = a.alloc(n * 64 * MIB, Stream::DEFAULT).unwrap();
                    assert_eq!(a.stats().stitched_handles, n);
                    (a, keep, big)
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, stitch);
criterion_main!(benches);
