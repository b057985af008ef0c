//! Replay speed on SimDriver: events per second for the shipped small traces and the
//! full-size generated LLM-inference and training traces.
//!
//! `cargo bench --bench replay`. The allocator is built outside the timed region and dropped
//! outside it too; the timed region is exactly `replay()` (with per-event peak sampling, as
//! the `stitch replay` command does, but no metering wrapper).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::path::Path;
use std::time::Duration;
use stitch_alloc::driver::SimDriver;
use stitch_alloc::replay::{replay, ReplayOptions};
use stitch_alloc::trace::gen::{self, Kind, Scale};
use stitch_alloc::trace::{self, ReadOptions, Trace};
use stitch_alloc::{Allocator, Capacity, Config};

fn shipped(name: &str) -> Trace {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    trace::read_path(p, ReadOptions::default()).expect("shipped trace")
}

fn bench_trace(c: &mut Criterion, name: &str, t: &Trace, capacity: u64) {
    bench_with(c, name, t, capacity, ReplayOptions::default());
}

fn bench_with(c: &mut Criterion, name: &str, t: &Trace, capacity: u64, opts: ReplayOptions) {
    let mut g = c.benchmark_group("replay");
    g.throughput(Throughput::Elements(t.op_count() as u64));
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(3));
    g.bench_function(name, |b| {
        b.iter_batched(
            || {
                Allocator::new(
                    SimDriver::with_capacity(capacity),
                    Config::default().with_capacity(Capacity::Fraction(1.0)),
                )
                .expect("allocator")
            },
            |a| {
                let r = replay(t, &a, &opts);
                assert_eq!(r.failed_allocs, 0);
                a
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    for (name, cap) in [
        ("llm-small.trace.gz", 4u64 << 30),
        ("train-small.trace", 4 << 30),
        ("adversarial-small.trace.gz", 4 << 30),
        ("torch-small.pickle.gz", 4 << 30),
        // Every allocation here is a slow path (new memory or a stitch), plus one probe.
        ("checkerboard-small.trace", 2 << 30),
    ] {
        bench_trace(c, name, &shipped(name), cap);
    }
    let h200 = stitch_alloc::driver::sim::H200_CAPACITY;
    let llm = gen::generate(Kind::Llm, 1, Scale::Full);
    bench_trace(c, "llm-full (generated)", &llm, h200);
    // The same without the stranded-bytes walk at each new peak of reserved bytes.
    bench_with(
        c,
        "llm-full, no stranded sampling",
        &llm,
        h200,
        ReplayOptions {
            skip_stranded: true,
            ..Default::default()
        },
    );
    bench_trace(
        c,
        "train-full (generated)",
        &gen::generate(Kind::Train, 1, Scale::Full),
        h200,
    );
    bench_trace(
        c,
        "checkerboard-full (generated)",
        &gen::generate(Kind::Checkerboard, 1, Scale::Full),
        h200,
    );
}

criterion_group!(replay_benches, benches);
criterion_main!(replay_benches);
